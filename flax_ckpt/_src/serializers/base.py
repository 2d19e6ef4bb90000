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
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from flax_ckpt._src.storage.base import Storage

if TYPE_CHECKING:
    from flax_ckpt._src.records import LeafRecord

Box = tuple[tuple[int, int], ...]  # per dimension [start, stop) in global coordinates; () for a 0-d array


@dataclass(frozen=True, slots=True)
class Shard:
    """One host copy of a part of an array: ``data`` is C-contiguous with the extents of ``box``.
    ``crc32c``: None, or ``(block, crcs)``: the crc32c (uint32) of every ``block`` bytes of ``data`` from
    its start, made as the snapshot copied them; a serializer whose checksum blocks are the same may
    store these instead of reading the bytes again (raw does)."""

    box: Box
    data: np.ndarray
    crc32c: "tuple[int, np.ndarray] | None" = None


@dataclass(frozen=True, slots=True)
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


if TYPE_CHECKING:

    def stored(leaf: LeafRecord) -> StoredArray:
        """``leaf`` itself, an array's record, as a serializer reads it: an array record has the dtype
        and shape that ``LeafRecord`` types as optional (they are None for leaves that are not arrays)."""
        ...

else:

    def stored(leaf):  # at run time the record itself, and no more (it is called per leaf)
        return leaf


class Serializer(Protocol):
    """Turns shards of arrays into stored objects and back, through a Storage.

    Implement ``name``, ``write`` and ``read``; subclass ``fc.Serializer`` to inherit the defaults of
    ``read_many``, ``view`` and ``validate``. The manifest records ``name``; a restore finds the
    serializer by it (README, "Writing a serializer"): built-in names, then the entry points of
    installed packages in the group ``serializers.ENTRY_POINTS``, built with no arguments (so whatever
    ``read`` needs goes into the chunk records). ``write`` may run in several processes at once (one
    ``tag`` each) and ``read`` in several threads. Raise CorruptCheckpointError for damage you find;
    every byte read through the Storage is already checked against its checksum.

    Example:
      One object per shard, read back whole (a restore into another sharding would read parts of
      several chunks: see examples/npy_serializer.py):

      >>> import numpy as np
      >>> class Bytes(fc.Serializer):
      ...     name = "bytes-example"
      ...     def write(self, storage, items, *, tag):
      ...         chunks = {}
      ...         for item in items:
      ...             chunks[item.leaf] = []
      ...             for j, shard in enumerate(item.shards):
      ...                 file = f"{tag}/{item.leaf}.{j}"
      ...                 storage.write(file, [shard.data.tobytes()])
      ...                 chunks[item.leaf].append({"index": [list(b) for b in shard.box], "file": file})
      ...         return fc.Written(chunks)
      ...     def read(self, storage, leaf, box, out, where):
      ...         (chunk,) = leaf.chunks
      ...         storage.read_into(chunk["file"], 0, memoryview(out).cast("B"))
      >>> fc.save("ckpt", {"w": np.arange(4, dtype=np.int32)}, serializer=Bytes())
      >>> fc.metadata("ckpt", serializer=Bytes()).serializer
      'bytes-example'
      >>> fc.restore("ckpt", serializer=Bytes())
      {'w': array([0, 1, 2, 3], dtype=int32)}
    """

    name: str

    def write(self, storage: Storage, items: Sequence[ArrayItem], *, tag: str) -> Written:
        """Writes every shard of ``items`` below ``storage`` (see the class's example).

        Args:
          storage: where to write; object names are relative to it.
          items: the arrays to write, each with the shards this process holds.
          tag: differs per process: object names must be unique per tag (and not end in ``.crc32c``).

        Returns:
          The chunk records per ``ArrayItem.leaf`` (each with ``"index"``, its box as lists, and
          whatever ``read`` needs) and, optionally, the objects written and their sizes.

        Raises:
          StorageError: the storage refused a write (raised by ``storage`` itself).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement write")

    def read(self, storage: Storage, leaf: StoredArray, box: Box, out: np.ndarray, where: str) -> None:
        """Fills ``out`` with the leaf's data in ``box`` (see the class's example).

        Args:
          storage: the storage ``write`` wrote to.
          leaf: the leaf's name, dtype, shape and the chunk records ``write`` returned for it.
          box: the part to read, per dimension [start, stop); any chunks of ``leaf`` may overlap it (a
            restore into another sharding reads parts of several).
          out: the extents of ``box``, the leaf's dtype, C-contiguous.
          where: the checkpoint and leaf, for error messages.

        Raises:
          CorruptCheckpointError: the chunk records or the stored bytes are damaged (a checksum
            mismatch is raised by ``storage`` itself).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement read")

    def read_many(
        self, storage: Storage, requests: Sequence[tuple[StoredArray, Box, np.ndarray]], where: str
    ) -> None:
        """Optional: ``read`` for many (leaf, box, out) at once; a serializer may batch them (raw: one
        ranged read per run of adjacent chunks). Default: one ``read`` each.

        Args:
          storage: the storage ``write`` wrote to.
          requests: (leaf, box, out) triples, as ``read`` takes them.
          where: the manifest, for error messages.

        Raises:
          CorruptCheckpointError: as ``read``.
        """
        for leaf, box, out in requests:
            self.read(storage, leaf, box, out, f"{where} leaf {leaf.name!r}")

    def view(self, storage: Storage, leaf: StoredArray, box: Box, where: str) -> np.ndarray | None:
        """Optional: the box as a read-only, verified array over bytes never written again, or None.

        Only the memory tiers' copies have such bytes; a file may change, so the default reads instead.

        Args:
          storage: the storage ``write`` wrote to.
          leaf: as for ``read``.
          box: as for ``read``.
          where: as for ``read``.

        Returns:
          The array, or None (the default): the caller reads instead.

        Raises:
          CorruptCheckpointError: as ``read``.
        """
        return None

    def validate(self, leaf: StoredArray, files: dict[str, int], where: str) -> None:
        """Optional: checks this serializer's fields of a manifest leaf's chunk records when the
        checkpoint is opened. Default: accept (the manifest's own checksum already covers the records).

        Args:
          leaf: as for ``read``.
          files: the manifest's objects and their sizes.
          where: the manifest and leaf, for error messages.

        Raises:
          InvalidManifestError: a record this serializer could not read.
        """
        return None


__all__ = ["ArrayItem", "Box", "Serializer", "Shard", "StoredArray", "Written"]
