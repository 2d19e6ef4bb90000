"""The serializer protocol: shards of arrays -> stored chunks, and back.

A serializer is given host shards (numpy arrays with their box in the global array) and a Storage; it
writes them and returns, per array, the chunk records the manifest keeps. On restore it fills a box of
one array from those records, verifying checksums. Two implementations live beside this file:
``raw`` (numpy only: packed raw bytes with crc32c per block; the default, chosen by
benchmarks/bench_serializers.py) and ``zarr3`` (one tensorstore zarr3 array per leaf, crc32c codec).
Choosing a serializer is explicit: pass a name or an instance; there is no global registry to extend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.storage import Storage

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop) in global coordinates


@dataclass(frozen=True)
class Shard:
    """One host copy of a part of an array: ``data`` is C-contiguous with the extents of ``box``."""

    box: Box
    data: np.ndarray


@dataclass(frozen=True)
class ArrayItem:
    """Everything a serializer needs to write one array: the manifest leaf number, a name for
    messages, dtype, global shape, and the shards this process writes."""

    leaf: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Written:
    """What a write produced: chunk records per leaf number, and the sizes of the files it created."""

    chunks: dict[int, list[dict[str, Any]]]
    files: dict[str, int]


class Serializer(Protocol):
    """Turns shards of arrays into stored chunks and back. ``leaf`` is the engine's typed record of one
    array; its ``chunks`` are this serializer's own records (what ``write`` returned for it)."""

    name: str

    def write(self, storage: Storage, items: Sequence[ArrayItem], *, tag: str) -> Written:
        """Writes every shard of ``items`` durably; ``tag`` makes file names unique per process."""

    def read(self, storage: Storage, leaf: LeafRecord, box: Box, out: np.ndarray, where: str) -> None:
        """Fills ``out`` (shape = extents of ``box``, leaf's dtype) with the leaf's data in ``box``,
        verifying checksums (CorruptCheckpointError naming ``where`` and the file)."""

    def read_many(self, storage: Storage, requests: Sequence[tuple[LeafRecord, Box, np.ndarray]], where: str) -> None:
        """``read`` for many (leaf, box, out) at once (``where``: the manifest, for messages); a
        serializer may batch them (raw: one ranged read per run of adjacent chunks)."""

    def view(self, storage: Storage, leaf: LeafRecord, box: Box, where: str) -> np.ndarray | None:
        """The box as a read-only, verified array over bytes that are never written again, or None (read
        instead). Restore hands it to jax.device_put unchanged (on a CPU device: no copy). Only the
        memory tiers' copies have such bytes (tiers/load.py); a file on disk may change under a map."""

    def validate(self, leaf: LeafRecord, files: dict[str, int], where: str) -> None:
        """Checks this serializer's chunk records of a manifest leaf (InvalidManifestError otherwise)."""


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A jax shard index (slices, possibly open-ended) as a box in an array of ``shape``."""
    return tuple(tuple(sl.indices(d)[:2]) for sl, d in zip(index, shape))


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(s < e for s, e in out) or not out else None


def local(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices relative to ``origin``'s start (an Ellipsis for 0-d, so indexing gives a view)."""
    if not box:
        return (Ellipsis,)
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(box, origin))


def for_each_overlap(leaf: LeafRecord, box: Box):
    """Yields (chunk record, chunk box, overlap box) for every chunk of ``leaf`` that intersects ``box``."""
    for chunk in leaf.chunks:
        cbox = tuple(tuple(b) for b in chunk["index"])
        ov = intersect(cbox, box)
        if ov is not None:
            yield chunk, cbox, ov


def get_serializer(spec: "str | Serializer | None") -> Serializer:
    from flax_ckpt._src.serializers.raw import RawSerializer
    from flax_ckpt._src.serializers.zarr3 import Zarr3Serializer

    if spec is None or spec == "raw":
        return RawSerializer()
    if spec == "zarr3" or spec == "tensorstore":
        return Zarr3Serializer()
    if isinstance(spec, str):
        raise ValueError(f"unknown serializer {spec!r}; use 'raw', 'zarr3' or a Serializer instance")
    return spec


__all__ = ["ArrayItem", "Box", "Serializer", "Shard", "Written", "box_of", "get_serializer"]
