"""Synchronous saves of arrays on accelerators: each piece written as soon as its transfer lands.

Scope: ``streamed``, the snapshot a synchronous save takes (``fc.save``, a manager with
``async_save=False``): what to transfer, in order, nothing waited for; and ``write_streamed``, its
write: the device-to-host transfers started in order, at most ``WINDOW`` bytes in flight (so that
they land in that order, the first soon), and the arrays' pieces in batches of consecutive pieces,
written on a small pool, each batch as soon as its transfers have landed: the transfer of later
shards overlaps the write of earlier ones. The host copy is the one the transfer makes: never a
second one. An
asynchronous save, which must return with a copy that later donation cannot change, takes a full
snapshot instead (engine/snapshot.py). What a file holds is the serializer's business; the streamed
write asks it to write batches of pieces, each as a ``write`` call of its own, and merges their records.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.engine.device import paced
from flax_ckpt._src.engine.snapshot import HostLeaf, Snapshot, learned, snapshot
from flax_ckpt._src.errors import CheckpointError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.serializers import ArrayItem, Box, Serializer, Shard, Written, box_of
from flax_ckpt._src.storage import Storage

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

THREADS = 8  # batches written at once
WINDOW = 0  # bytes of transfers in flight at once (0: every transfer started at once)
_BATCH_MIN, _BATCH_MAX = 4 << 20, 64 << 20  # bytes of one batch (see _batch_bytes)


@dataclass(frozen=True)
class Piece:
    """Rows ``rows`` (along the first axis; None: all) of the host value of ``part`` (one device
    array: a shard's, or the whole array), the ``box`` of leaf ``leaf`` of the snapshot."""

    leaf: int
    part: jax.Array
    box: Box
    rows: slice | None
    nbytes: int

    def host(self) -> np.ndarray:
        """The piece in host memory: a view of the transfer's buffer (waits for it to land)."""
        a = _host_value(self.part)
        return a if self.rows is None else a[self.rows]


def _host_value(part: jax.Array) -> np.ndarray:
    return np.asarray(part)  # the transfer's own buffer (read-only): no copy where it has landed


def _off_host(k: Any) -> bool:
    """Whether a learned jax leaf lies off the host (a CPU array's host view is free: nothing to stream)."""
    return not k.cpu


@dataclass
class Streamed(Snapshot):
    """A snapshot whose arrays on accelerators are in flight to the host: their leaves hold records
    without shards, and ``pieces`` say where their bytes will be. Written by ``write_streamed``, while
    the caller's arrays are alive and unchanged (a synchronous save)."""

    pieces: list[Piece] = field(default_factory=list)
    batch: int = _BATCH_MAX  # bytes of a batch (and at most of a piece, unless one row is more)
    transfers: list[tuple[jax.Array, int]] = field(default_factory=list)  # (array, bytes), in order


def streamed(tree: Any) -> Snapshot:
    """A synchronous save's snapshot of ``tree``: host leaves as ``snapshot(copy=False)`` takes them;
    arrays off the host (accelerators) as pieces, in leaf order, to transfer as ``write_streamed``
    writes them. A plain Snapshot when no array is off the host."""
    flat = tree if isinstance(tree, tree_mod.Flat) else tree_mod.flat(tree)
    _check_alive(flat)
    seen = learned(flat, range(len(flat.leaves)))
    device = [i for i, k in enumerate(seen) if k.kind in ("jax", "prng_key") and _off_host(k)]
    if not device:
        return snapshot(flat, copy=False)
    data = {
        i: jax.random.key_data(flat.leaves[i]) if seen[i].kind == "prng_key" else flat.leaves[i]
        for i in device
    }
    rest = [i for i in range(len(seen)) if i not in data]
    host = snapshot(flat, copy=False, only=rest) if rest else Snapshot([], 0)
    leaves: list[HostLeaf] = [None] * len(seen)  # type: ignore[list-item]
    for i, hl in zip(rest, host.leaves):
        leaves[i] = hl
    parts: list[tuple[int, jax.Array, Box]] = []
    for i in device:
        k, x = seen[i], data[i]
        leaves[i] = HostLeaf(k.array, (), x.sharding, whole=k.whole)
        parts += (
            [(i, x, k.box)]
            if k.whole
            else [
                (i, s.data, box_of(s.index, k.array.array_shape))
                for s in x.addressable_shards
                if s.replica_id == 0
            ]
        )
    size = [math.prod(e - s for s, e in box) * seen[i].array.array_dtype.itemsize for i, _, box in parts]
    limit = _batch_bytes(sum(size))
    pieces = [p for (i, part, box), n in zip(parts, size) for p in _split(i, part, box, n, limit)]
    return Streamed(
        leaves,
        host.nbytes + sum(size),
        pieces=pieces,
        batch=limit,
        transfers=[(part, n) for (_, part, _), n in zip(parts, size)],
    )


def _check_alive(flat: tree_mod.Flat) -> None:
    """A CheckpointError naming every deleted jax array (donated to a step, or ``.delete()``d), before
    anything is written."""
    gone = [name for name, x in zip(flat.names, flat.leaves) if isinstance(x, jax.Array) and x.is_deleted()]
    if gone:
        shown = ", ".join(repr(n) for n in gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
        raise CheckpointError(
            f"cannot save {shown}: the array has been deleted, most likely donated to a jitted step "
            "(donate_argnums) that consumed this state. Save the state before that step runs, or the state "
            "it returned; nothing was written"
        )


def _split(leaf: int, part: jax.Array, box: Box, nbytes: int, limit: int) -> list[Piece]:
    """One shard (``nbytes``) as pieces of at most ``limit`` bytes, cut along its first axis (at least
    one row each)."""
    if not box or nbytes <= limit or box[0][1] - box[0][0] < 2:
        return [Piece(leaf, part, box, None, nbytes)]
    (lo, hi), rest = box[0], box[1:]
    row = nbytes // (hi - lo)
    step = max(1, limit // max(1, row))
    return [
        Piece(
            leaf,
            part,
            ((lo + r, min(lo + r + step, hi)),) + rest,
            slice(r, r + step),
            row * (min(r + step, hi - lo) - r),
        )
        for r in range(0, hi - lo, step)
    ]


def _batch_bytes(total: int) -> int:
    """Bytes of one batch: about four batches per writer thread, so that the writes begin soon after
    the first transfers land and end soon after the last."""
    return min(_BATCH_MAX, max(_BATCH_MIN, total // (4 * THREADS)))


def batches(pieces: Sequence[Piece], limit: int) -> list[list[Piece]]:
    """The pieces in runs of consecutive pieces of at most ``limit`` bytes each (a piece larger than
    that alone), in transfer order."""
    out: list[list[Piece]] = []
    held = 0
    for p in pieces:
        if not out or (held and held + p.nbytes > limit):
            out.append([])
            held = 0
        out[-1].append(p)
        held += p.nbytes
    return out


def _items(snap: Snapshot, batch: list[Piece]) -> list[ArrayItem]:
    """A batch's pieces in host memory, as the serializer takes them (one item per leaf)."""
    by_leaf: dict[int, list[Shard]] = {}
    for p in batch:
        by_leaf.setdefault(p.leaf, []).append(Shard(p.box, p.host()))
    out = []
    for i, shards in by_leaf.items():
        rec = snap.leaves[i].record
        out.append(ArrayItem(i, rec.name, rec.array_dtype, rec.array_shape, tuple(shards)))
    return out


def write_streamed(
    serializer: Serializer, storage: Storage, snap: Streamed, items: Sequence[ArrayItem], *, tag: str
) -> Written:
    """Writes ``items`` (the snapshot's host leaves) and every piece of ``snap`` below ``storage``: on
    up to THREADS threads, one ``serializer.write`` per batch (tags ``<tag>.h`` and ``<tag>.<k>``),
    each batch once its transfers have landed. Returns the records of all, merged. On a failure, every
    write has stopped (or never started) before the first error is raised."""
    feeder = _Feeder(snap.transfers)
    feeder.start()
    try:
        return _write_batches(serializer, storage, snap, items, tag)
    finally:
        feeder.stop()


def _write_batches(
    serializer: Serializer, storage: Storage, snap: Streamed, items: Sequence[ArrayItem], tag: str
) -> Written:
    jobs: list[Callable[[], Written]] = []
    host = [it for it in items if it.shards]
    if host:
        jobs.append(lambda: serializer.write(storage, host, tag=f"{tag}.h"))
    for k, b in enumerate(batches(snap.pieces, snap.batch)):
        jobs.append(lambda b=b, k=k: serializer.write(storage, _items(snap, b), tag=f"{tag}.{k}"))
    with ThreadPoolExecutor(max(1, min(THREADS, len(jobs))), thread_name_prefix="flax_ckpt-stream") as pool:
        futures = [pool.submit(job) for job in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            for f in futures:
                f.cancel()
            wait(futures)
        written = [f.result() for f in futures]  # the first failure, in batch order, is raised
    return merged(written)


def _start(x: jax.Array) -> None:
    x.copy_to_host_async()


class _Feeder:
    """Starts the transfers in order, at most WINDOW bytes in flight (all at once when they fit), on a
    thread of its own that waits for the oldest to land before starting more. A failed transfer is
    left to the write that needs it (which raises it); ``stop`` starts no more and joins."""

    def __init__(self, transfers: list[tuple[jax.Array, int]]):
        self.transfers, self._stopped = transfers, threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not WINDOW or sum(n for _, n in self.transfers) <= WINDOW:
            for x, _ in self.transfers:  # every transfer started before any is waited for
                _start(x)
            return
        self._thread = threading.Thread(target=self._run, name="flax_ckpt-transfer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for y in paced(self.transfers, _start, WINDOW):
                if self._stopped.is_set():
                    return
                _landed(y)
        except Exception:  # noqa: BLE001 - the write that needs the array raises it
            return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


def _landed(x: jax.Array) -> None:
    """Waits for ``x``'s transfer to land (its host value is then cached on it)."""
    try:
        _host_value(x)
    except Exception:  # noqa: BLE001 - the write that needs it raises it
        pass


def merged(written: Sequence[Written]) -> Written:
    """The records of several writes as one: each leaf's chunks in order, every file."""
    chunks: dict[int, list[dict[str, Any]]] = {}
    for w in written:
        for i, recs in w.chunks.items():
            chunks.setdefault(i, []).extend(recs)
    return Written(
        chunks,
        {name: size for w in written for name, size in w.files.items()},
        fsync_s=sum(w.fsync_s for w in written),
        serialize_s=sum(w.serialize_s for w in written),
    )


__all__ = ["Piece", "Streamed", "batches", "merged", "streamed", "write_streamed"]
