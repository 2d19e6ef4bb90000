"""How the processes of a tiered job agree, and how copies travel between them.

Scope: small all-gathers of JSON (distributed.allgather: inventories, commit votes, payload sizes;
every wait has distributed.timeout_s()), the framing of several byte parts into one
payload (sizes and a crc32c-checked header), and the transfer of bytes between processes
with a JAX collective: a jitted ``ppermute`` over a mesh of one device per process, in pieces of at
most 32 MiB (uint8 arrays), so device memory stays bounded whatever the payload. Nothing here knows
what a copy holds. With one process every operation is local.

Collectives are issued only from the caller's (training) thread: the tiers call ``transfer`` from
``save``, ``wait_until_finished``, ``close`` and ``restore``, never from the background writer, so they
are ordered like the training step's own collectives on every process (two threads issuing
collectives in different orders on different processes can deadlock). The key-value rounds may run on
any thread. Rounds are numbered per job-wide name: the k-th round of each process meets the k-th
round of the others (every process runs the same rounds in the same order, as SPMD code does).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any, Sequence

import crc32c
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_ckpt._src.commit import distributed
from flax_ckpt._src.errors import CorruptCheckpointError, DistributedError
from flax_ckpt._src.storage.base import as_buffer

_MAX_PIECE = 32 << 20
_MIN_PIECE = 4 << 10
_MAGIC = b"FCT1"


class Group:
    """The processes of this job, as seen by the tiers of one manager directory (``name``)."""

    def __init__(self, name: str):
        self.index, self.count = distributed.process_index(), distributed.process_count()
        self.prefix = f"flax_ckpt/tiers/{name}"

    def allgather(self, what: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        """Every process's ``value``, in process order; DistributedError if one does not answer."""
        return distributed.allgather(self.prefix, what, value)

    def transfer(
        self, perm: Sequence[tuple[int, int]], mine: Sequence[memoryview] | None, sizes: Sequence[int]
    ) -> np.ndarray | None:
        """For each (src, dst) in ``perm``, src's buffers (``sizes[src]`` bytes) arrive at dst. Returns
        what this process received, or None. Every process calls it with the same perm and sizes."""
        total = max((sizes[s] for s, _ in perm), default=0)
        src_of = {d: s for s, d in perm}
        got = np.empty(sizes[src_of[self.index]], np.uint8) if self.index in src_of else None
        if total == 0:
            return got
        piece = min(_MAX_PIECE, max(_MIN_PIECE, 1 << (total - 1).bit_length()))
        sharding, fn, device = _permuter(tuple(sorted(perm)), piece)
        stream = _Stream(mine or [])
        for k in range(math.ceil(total / piece)):
            x = jax.make_array_from_single_device_arrays(
                (self.count * piece,), sharding, [jax.device_put(stream.take(piece), device)]
            )
            try:
                y = np.asarray(fn(x).addressable_shards[0].data)
            except jax.errors.JaxRuntimeError as e:
                raise DistributedError(
                    f"tiers: the transfer between processes {list(perm)} failed (a process died?): {e}"
                ) from None
            if got is not None and k * piece < len(got):
                got[k * piece : (k + 1) * piece] = y[: len(got) - k * piece]
        return got


class _Stream:
    """Successive fixed-size windows over a list of buffers, zero-padded at the end."""

    def __init__(self, buffers: Sequence[memoryview]):
        self.buffers, self.i, self.pos = [memoryview(b).cast("B") for b in buffers], 0, 0

    def take(self, n: int) -> np.ndarray:
        out, filled = np.zeros(n, np.uint8), 0
        while filled < n and self.i < len(self.buffers):
            b = self.buffers[self.i]
            m = min(n - filled, len(b) - self.pos)
            out[filled : filled + m] = np.frombuffer(b[self.pos : self.pos + m], np.uint8)
            filled, self.pos = filled + m, self.pos + m
            if self.pos == len(b):
                self.i, self.pos = self.i + 1, 0
        return out


def process_mesh() -> Mesh:
    """One device per process (its lowest id), in process order."""
    devs = [
        min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        for p in range(jax.process_count())
    ]
    return Mesh(np.array(devs), ("p",))


@functools.lru_cache(maxsize=16)
def _permuter(perm: tuple[tuple[int, int], ...], piece: int) -> tuple[NamedSharding, Any, Any]:
    mesh = process_mesh()
    spec = PartitionSpec("p")
    fn = jax.jit(
        jax.shard_map(lambda x: jax.lax.ppermute(x, "p", perm), mesh=mesh, in_specs=spec, out_specs=spec)
    )
    return NamedSharding(mesh, spec), fn, mesh.devices[jax.process_index()]


# ------------------------------------------------------------------------------------------ framing


def frame(parts: Sequence[Sequence[Any]]) -> list[memoryview]:
    """Buffers to send: a header (magic, part sizes, crc32c of the header), then the parts, each part
    given as a list of buffers."""
    views = [[memoryview(b).cast("B") for b in p] for p in parts]
    head = _MAGIC + struct.pack(f"<I{len(views)}Q", len(views), *[sum(len(b) for b in p) for p in views])
    return [memoryview(head + struct.pack("<I", crc32c.crc32c(head)))] + [b for p in views for b in p]


def unframe(buf: np.ndarray | None, where: str) -> list[memoryview]:
    mv = memoryview(as_buffer(buf) if buf is not None else b"").cast("B")
    try:
        (count,) = struct.unpack_from("<I", mv, 4)
        sizes = struct.unpack_from(f"<{count}Q", mv, 8)
        end = 8 + 8 * count
        ok = bytes(mv[:4]) == _MAGIC and struct.unpack_from("<I", mv, end)[0] == crc32c.crc32c(mv[:end])
    except struct.error:
        ok = False
    if not ok or end + 4 + sum(sizes) != len(mv):
        raise CorruptCheckpointError(f"{where}: received {len(mv)} bytes that are not a framed copy")
    parts, pos = [], end + 4
    for n in sizes:
        parts.append(mv[pos : pos + n])
        pos += n
    return parts
