"""Reading memory-tier copies back: verified views of the copy's pages, or chunks decoded into buffers.

Scope: restoring a tree from one copy (through the engine's restore_body, which checks the target leaf
by leaf) and turning a copy into a persistent-storage snapshot (migration at close). A shard whose
bytes lie back to back in one data file (every shard of a base; in a differential copy, one that
changed entirely or not at all) goes to jax.device_put as a read-only view of the mapped file, each
chunk's crc32c checked first: on a CPU device that view becomes the restored array without a copy
(files.py guarantees those pages are never written again). Any other shard is read chunk by
chunk into its place in a fresh buffer (one kernel copy from tmpfs, or from the bytes a peer sent),
delta chunks decompressed and XORed with the base there, each crc32c checked while still in cache.
Large shards are checked and read on files.pool(). The format is store.py's; which copy to
read is tierset.py's decision.
"""

from __future__ import annotations

import math
import zlib
from concurrent.futures import wait
from typing import Any, Callable, Sequence

import crc32c
import numpy as np

from flax_ckpt._src.checks import tiling_problem
from flax_ckpt._src.engine import restore as engine
from flax_ckpt._src.engine.fit import Fit
from flax_ckpt._src.engine.leaves import CheckpointInfo, checkpoint_info
from flax_ckpt._src.engine.reader import Damage, read_back
from flax_ckpt._src.engine.snapshot import HostLeaf, Snapshot
from flax_ckpt._src.errors import CheckpointError, CorruptCheckpointError
from flax_ckpt._src.records import LeafRecord, dtype_from_name, leaf_name
from flax_ckpt._src.serializers import Box, Shard, for_each_overlap, local
from flax_ckpt._src.serializers.base import stored
from flax_ckpt._src.storage.base import as_buffer
from flax_ckpt._src.tiers import files as tier_files
from flax_ckpt._src.tiers.store import Copy

_PARALLEL_MIN = 16 << 20


def _u8(buf: Any) -> np.ndarray:
    return np.frombuffer(buf, np.uint8)


def _unshuffle(x: np.ndarray, itemsize: int) -> np.ndarray:
    return (
        np.ascontiguousarray(x.reshape(itemsize, -1).T).reshape(-1)
        if itemsize > 1 and len(x) % itemsize == 0
        else x
    )


def _fill(copy: Copy, e: list, dst: memoryview, itemsize: int, where: str) -> None:
    """Decodes one chunk into ``dst`` and verifies it."""
    n = len(dst)
    if e[0] == "r":
        copy.data.read_into(e[2], dst)
    elif e[0] == "b":
        copy.base_data.read_into(e[2], dst)
    else:
        z = bytearray(e[3])
        copy.data.read_into(e[2], memoryview(z))
        d = zlib.decompressobj()
        try:
            x = d.decompress(z, n + 1)
        except zlib.error:
            x = b""
        if len(x) != n or not d.eof:
            raise CorruptCheckpointError(f"{where}: a delta chunk does not decompress to {n} bytes")
        copy.base_data.read_into(e[4], dst)
        np.bitwise_xor(_u8(dst), _unshuffle(_u8(x), itemsize), out=_u8(dst))
    _check_chunk(dst, e, where)


def _check_chunk(buf: memoryview, e: list, where: str) -> None:
    if crc32c.crc32c(buf) != e[1]:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch in a chunk stored as {e[0]!r} (crc32c "
            f"expected {e[1]}); the memory copy is damaged"
        )


def read_shard(copy: Copy, s: dict[str, Any], dst: memoryview) -> None:
    """Fills ``dst`` (the shard's nbytes) with shard ``s`` of the copy, every chunk verified."""
    rec, size = copy.body["leaves"][s["leaf"]], copy.body["chunk"]
    where = f"{copy.where}: leaf {leaf_name(rec)!r} box {list(s['box'])}"
    itemsize = dtype_from_name(rec["dtype"]).itemsize
    jobs = [(e, dst[k * size : (k + 1) * size]) for k, e in enumerate(s["chunks"])]
    if len(dst) < _PARALLEL_MIN:
        for e, d in jobs:
            _fill(copy, e, d, itemsize, where)
        return
    futures = [tier_files.pool().submit(_fill, copy, e, d, itemsize, where) for e, d in jobs]
    wait(futures)  # every chunk has stopped writing into dst before anything is raised
    for f in futures:
        f.result()


def _verify(mv: memoryview, entries: list[list], size: int, where: str) -> None:
    for k, e in enumerate(entries):
        _check_chunk(mv[k * size : (k + 1) * size], e, where)


def view_shard(copy: Copy, s: dict[str, Any]) -> np.ndarray | None:
    """Shard ``s`` as a read-only array over the copy's own pages, every chunk verified, when its
    bytes lie back to back in one data file (a base's shards; in a differential copy, a shard that
    changed entirely or not at all); else None. Given to jax.device_put, such an array becomes a
    CPU device's buffer without a copy (and it is the one host copy for other devices)."""
    rec, size, entries = copy.body["leaves"][s["leaf"]], copy.body["chunk"], s["chunks"]
    kinds = {e[0] for e in entries}
    if not entries or len(kinds) != 1 or kinds == {"x"}:
        return None
    start = entries[0][2]
    if any(e[2] != start + k * size for k, e in enumerate(entries)):
        return None
    data = copy.data if kinds == {"r"} else copy.base_data
    mv = data.view(start, start + s["nbytes"])
    where = f"{copy.where}: leaf {leaf_name(rec)!r} box {list(s['box'])}"
    step = max(1, _PARALLEL_MIN // size)
    if len(mv) < _PARALLEL_MIN:
        _verify(mv, entries, size, where)
    else:
        futures = [
            tier_files.pool().submit(_verify, mv[k * size :], entries[k : k + step], size, where)
            for k in range(0, len(entries), step)
        ]
        for f in futures:
            f.result()
    out = np.frombuffer(mv, dtype_from_name(rec["dtype"])).reshape(tuple(e - a for a, e in s["box"]))
    out.flags.writeable = False  # restored arrays may be these very pages: nothing writes into them
    return out


def _flat_bytes(a: np.ndarray) -> memoryview:
    return memoryview(as_buffer(a.reshape(-1).view(np.uint8))) if a.size else memoryview(bytearray(0))


def shard_array(copy: Copy, s: dict[str, Any]) -> np.ndarray:
    rec = copy.body["leaves"][s["leaf"]]
    out = np.empty(tuple(e - a for a, e in s["box"]), dtype_from_name(rec["dtype"]))
    read_shard(copy, s, _flat_bytes(out))
    return out


class CopySource:
    """One memory-tier copy as a restore Source: a box is filled from the copy's shards that overlap
    it (refusing a box the copy does not hold: a target laid out differently from the save), or
    handed out as a verified view of the copy's pages (view_shard) when one stored shard is exactly
    that box. No size budget comes from a folder (a differential copy stores fewer bytes than it
    restores; its index was bounds-checked against the bytes present when opened)."""

    remote = False
    budget = None
    hint = ""

    def __init__(self, copy: Copy):
        self.copy, self.url, self.where = copy, copy.where, copy.where
        chunks: dict[int, list[dict[str, Any]]] = {}
        for j, s in enumerate(copy.body["shards"]):
            chunks.setdefault(s["leaf"], []).append({"index": s["box"], "shard": j})
        self.leaves = [
            LeafRecord.from_json(r).with_chunks(chunks.get(i, ()))
            if "dtype" in r
            else LeafRecord.from_json(r)
            for i, r in enumerate(copy.body["leaves"])
        ]

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        parts = list(
            for_each_overlap(stored(leaf), box)
        )  # they must cover the box exactly: nothing left unwritten
        problem = tiling_problem([ov for _, _, ov in parts], box)
        if problem is not None and sum(math.prod(e - a for a, e in ov) for _, _, ov in parts) >= math.prod(
            e - a for a, e in box
        ):  # shards that overlap: never a layout a save writes
            raise CorruptCheckpointError(
                f"{self.where} leaf {leaf.name!r}: the memory copy's shards do not tile box "
                f"{list(box)} ({problem}); the copy is damaged or crafted"
            )
        if problem is not None:
            raise CheckpointError(
                f"{self.where} leaf {leaf.name!r}: this process's memory copy does not hold box "
                f"{list(box)} (the target's layout differs from the one saved); restore from "
                "persistent storage"
            )
        for chunk, cbox, ov in parts:
            s = self.copy.body["shards"][chunk["shard"]]
            dst = out[local(ov, box)]
            if ov == cbox and dst.flags.c_contiguous:
                read_shard(self.copy, s, _flat_bytes(dst))
            else:
                dst[...] = shard_array(self.copy, s)[local(ov, cbox)]

    def read_many(self, requests: Sequence[tuple[LeafRecord, Box, np.ndarray]]) -> None:
        for leaf, box, out in requests:
            self.read(leaf, box, out)

    def view(self, leaf: LeafRecord, box: Box) -> np.ndarray | None:
        hits = list(for_each_overlap(stored(leaf), box))
        if len(hits) != 1 or not hits[0][1] == hits[0][2] == box:
            return None
        return view_shard(self.copy, self.copy.body["shards"][hits[0][0]["shard"]])

    def select(self, target: Any) -> tuple["CopySource", Any]:
        return self, target

    def unchecked(self) -> list[str]:
        return []  # every chunk of a copy carries its crc32c

    def verify(self, update: Callable[[int], None]) -> list[Damage]:
        return read_back(self, update)

    def info(self) -> CheckpointInfo:
        """What the copy records (as fc.metadata gives a native step; no user metadata: a tiered save has none)."""
        b = self.copy.body
        return checkpoint_info(
            self.url,
            self.leaves,
            step=b["step"],
            metrics=b.get("metrics"),
            metadata=None,
            created=b.get("created", 0.0),
            process_count=b["process_count"],
            serializer="memory",
            format="native",
        )


def restore_copy(
    copy: Copy, target_of: Callable[[CopySource], Any], *, shardings: Any, fit: Fit
) -> tuple[Any, int]:
    """Restores the copy's tree into ``target_of(source)`` (checked per leaf); returns it and the array bytes."""
    source = CopySource(copy)
    target = target_of(source)
    value = engine.restore(source, target, shardings=shardings, fit=fit)
    return value, engine.restored_nbytes(source, target, fit)


def to_snapshot(copy: Copy) -> Snapshot:
    """The persistent-storage snapshot of a copy (its primary shards): migration from the memory tier."""
    shards: dict[int, list[Shard]] = {}
    for s in copy.body["shards"]:
        if s["primary"]:
            shards.setdefault(s["leaf"], []).append(Shard(tuple(map(tuple, s["box"])), shard_array(copy, s)))
    leaves = [
        HostLeaf(LeafRecord.from_json(r), tuple(shards.get(i, ()))) for i, r in enumerate(copy.body["leaves"])
    ]
    return Snapshot(leaves, sum(sh.data.nbytes for lf in leaves for sh in lf.shards))
