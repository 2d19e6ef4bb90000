"""The storage protocol: a root under which named byte objects are written whole and read by range.

Scope: the typed interfaces every storage implements (``LocalStorage`` in local.py, ``KvStorage`` in
kv.py), in two parts. ``Storage`` is what every storage has, and all a serializer written from public
names sees (``fc.Storage``). ``TensorstoreStorage`` adds what only tensorstore drivers need, to open
their own kvstore over the same root (the zarr3 serializer, Orbax's reader). Nothing here knows about
checkpoints. Optional behaviour is a declared capability, never a type probe: ``supports_rename`` says
whether ``rename`` and ``sync`` are available (local file systems: the commit renames a staging folder;
object stores: it writes a commit object last instead), ``local_path`` whether the root is a folder on
this host (locks, memory maps). Timings come back as results (``write`` returns its fsync seconds),
never through shared state.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Literal, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer as _Buffer

Buffer = Any  # anything with the buffer protocol (bytes, memoryview, C-contiguous numpy array)


if TYPE_CHECKING:

    def as_buffer(a: np.ndarray) -> _Buffer:
        """``a`` itself, typed as the buffer it is for what takes one (crc32c, memoryview, zlib): numpy's
        type stubs give ``ndarray`` its ``__buffer__`` only from Python 3.12 on."""
        ...

else:

    def as_buffer(a):  # at run time the array itself, and no more (it is called per leaf)
        return a


def span(address: int, nbytes: int) -> memoryview:
    """The ``nbytes`` bytes of memory from ``address`` as one byte view: buffers that lie back to back
    in memory, written with one call. It holds no reference: the caller keeps their owners alive while
    the view is used."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


@runtime_checkable
class Storage(Protocol):
    """A root under which named objects are written whole and read by byte range. Names are
    '/'-separated paths relative to the root (validated by checks.check_relpath where they come from
    a manifest). A serializer uses ``write``, ``read``, ``read_into`` and ``read_ranges``, maybe
    ``exists`` and ``sub``; the rest is the commit's and the tools'."""

    url: str
    supports_rename: bool  # rename() and sync() work: a folder can be renamed atomically (local file systems)
    local_path: str | None  # the root as a folder of this host's file system, or None (object stores)

    def write(self, name: str, buffers: Sequence[Buffer]) -> float:
        """Writes the buffers back to back as object ``name``, durably once it returns (replacing any
        object of that name). Returns the seconds of it spent making the bytes durable (fsync; 0.0
        where a store has no such step)."""
        ...

    def read(self, name: str, max_bytes: int) -> bytes:
        """The whole object ``name`` (FileNotFoundError when missing; CorruptCheckpointError when it
        holds more than ``max_bytes``)."""
        ...

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fills ``out`` with the bytes of ``name`` from ``offset`` on (CorruptCheckpointError when the
        object ends before)."""

    def read_ranges(self, name: str, parts: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """``read_into`` for many (offset, buffers filled back to back) of one object at once."""

    def sub(self, name: str) -> "Storage": ...
    def parent(self) -> "tuple[Storage, str]": ...
    def write_if_absent(self, name: str, data: bytes) -> bool: ...
    def check_size(self, name: str, expected: int) -> None: ...
    def exists(self, name: str) -> bool: ...
    def kind(self) -> Literal["missing", "file", "folder"]: ...
    def list(self) -> list[str]: ...
    def delete(self, name: str = "") -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def sync(self, name: str = "", *, tree: bool = True) -> None: ...
    def makedirs(self) -> None: ...
    def stored_bytes(self) -> int | None: ...


@runtime_checkable
class TensorstoreStorage(Storage, Protocol):
    """A Storage that tensorstore drivers can also open directly, as a kvstore over the same root (both
    built-in storages are). What the zarr3 serializer and Orbax's reader need; a serializer written
    from public names writes through ``Storage`` alone, so the library checksums every byte of it."""

    context: Any  # the tensorstore Context of drivers opened over kvstore_spec(), or None for a default one

    def kvstore_spec(self, name: str = "") -> dict[str, Any]:
        """The tensorstore kvstore spec of the folder ``name`` below the root (the root for "")."""
        ...
