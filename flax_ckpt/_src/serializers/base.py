"""The serializer protocol and the records it speaks: the whole contract of storing arrays a new way.

Scope: ``Serializer`` (three members to implement: ``name``, ``write``, ``read``; three optional ones
with defaults) and the small typed values it takes and gives: ``Shard`` and ``ArrayItem`` (what
``write`` stores), ``Written`` (what it stored: chunk records and files), ``StoredArray`` (what
``read`` reads from) and ``Box``. All public (``fc.Serializer``, ``fc.ArrayItem``, ...), written from
``fc.Storage`` alone; the implementations live beside this file (raw.py, zarr3.py, checked.py), and a
user's anywhere (examples/npy_serializer.py). Nothing here does I/O.

Checksums are the library's job, not the protocol's: a serializer that is not built in gets a Storage
that records a crc32c of every block of every object it writes (``<object>.crc32c`` beside it) and, on
restore and ``flax-ckpt verify``, a Storage that checks every byte it reads against them
(serializers/checked.py). The built-in raw and zarr3 serializers keep theirs in their own records
(crc32c per block in each chunk record; zarr's crc32c codec).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from flax_ckpt._src.storage.base import Storage

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop) in global coordinates; () for a 0-d array


@dataclass(frozen=True)
class Shard:
    """One host copy of a part of an array: ``data`` is C-contiguous with the extents of ``box``.
    ``crc32c``: None, or ``(block, crcs)``: the crc32c (uint32) of every ``block`` bytes of ``data`` from
    its start, made as the snapshot copied them; a serializer whose checksum blocks are the same may
    store these instead of reading the bytes again (raw does)."""

    box: Box
    data: np.ndarray
    crc32c: "tuple[int, np.ndarray] | None" = None


@dataclass(frozen=True)
class ArrayItem:
    """One array to write: ``leaf`` (its number in the checkpoint, the key of ``Written.chunks``),
    ``name`` (its key path, for messages), dtype, global shape, and the shards this process writes
    (together with other processes' shards they cover the array exactly once)."""

    leaf: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Written:
    """What one ``write`` stored. ``chunks``: per ``ArrayItem.leaf``, the JSON records of its chunks,
    each with ``"index"`` (its box, as lists) and whatever ``read`` needs; the chunks of a leaf tile its
    shards exactly. ``files``: the objects written and their sizes ({} when unknown; the library then
    records them itself). ``fsync_s`` and ``serialize_s``: seconds spent making the bytes durable and
    encoding them (checksums), summed over threads (the built-ins report them; left 0.0, the library
    measures what it can)."""

    chunks: dict[int, list[dict[str, Any]]]
    files: dict[str, int] = field(default_factory=dict)
    fsync_s: float = 0.0
    serialize_s: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes written to storage (the sizes of ``files``)."""
        return sum(self.files.values())


class StoredArray(Protocol):
    """One saved array as ``read`` sees it: its key path, dtype, global shape and the chunk records
    ``write`` returned for it (the engine's leaf record has these, and more)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> np.dtype: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def chunks(self) -> tuple[dict[str, Any], ...]: ...


class Serializer(Protocol):
    """Turns shards of arrays into stored objects and back, through a Storage.

    Implement ``name``, ``write`` and ``read``; subclass ``fc.Serializer`` to inherit the defaults of
    ``read_many``, ``view`` and ``validate``. The manifest records ``name``; a restore finds the
    serializer by it (README, "Writing a serializer"): built-in names, then the entry points of
    installed packages in the group ``serializers.ENTRY_POINTS``, built with no arguments (so whatever
    ``read`` needs goes into the chunk records). ``write`` may run in several processes at once (one
    ``tag`` each) and ``read`` in several threads. Raise CorruptCheckpointError for damage you find;
    every byte read through the Storage is already checked against its checksum."""

    name: str

    def write(self, storage: Storage, items: Sequence[ArrayItem], *, tag: str) -> Written:
        """Writes every shard of ``items`` below ``storage`` (object names unique per ``tag``, which
        differs per process; not ending in ``.crc32c``) and returns their chunk records."""
        raise NotImplementedError(f"{type(self).__name__} does not implement write")

    def read(self, storage: Storage, leaf: StoredArray, box: Box, out: np.ndarray, where: str) -> None:
        """Fills ``out`` (extents of ``box``, the leaf's dtype, C-contiguous) with the leaf's data in
        ``box``, which any chunks of ``leaf`` may overlap (a restore into another sharding reads parts
        of several). ``where`` names the checkpoint and leaf for error messages."""
        raise NotImplementedError(f"{type(self).__name__} does not implement read")

    def read_many(self, storage: Storage, requests: Sequence[tuple[StoredArray, Box, np.ndarray]],
                  where: str) -> None:
        """Optional: ``read`` for many (leaf, box, out) at once (``where``: the manifest); a serializer
        may batch them (raw: one ranged read per run of adjacent chunks). Default: one ``read`` each."""
        for leaf, box, out in requests:
            self.read(storage, leaf, box, out, f"{where} leaf {leaf.name!r}")

    def view(self, storage: Storage, leaf: StoredArray, box: Box, where: str) -> np.ndarray | None:
        """Optional: the box as a read-only, verified array over bytes never written again, or None (the
        default: read instead). Only the memory tiers' copies have such bytes; a file may change."""
        return None

    def validate(self, leaf: StoredArray, files: dict[str, int], where: str) -> None:
        """Optional: checks this serializer's fields of the chunk records of a manifest leaf when the
        checkpoint is opened (InvalidManifestError otherwise); ``files``: the manifest's objects and
        sizes. Default: accept (the manifest's own checksum already covers the records)."""
        return None


__all__ = ["ArrayItem", "Box", "Serializer", "Shard", "StoredArray", "Written"]
