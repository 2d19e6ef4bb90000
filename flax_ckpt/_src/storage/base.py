"""The storage protocol: a root under which named byte objects are written whole and read by range.

Scope: the typed interface every storage implements (``LocalStorage`` in local.py, ``KvStorage`` in
kv.py) and the write clock they share. Nothing here knows about checkpoints. Optional behaviour is a
declared capability, never a type probe: ``supports_rename`` says whether ``rename`` and ``sync`` are
available (local file systems: the commit renames a staging folder; object stores: it writes a commit
object last instead), ``local_path`` whether the root is a folder on this host (locks, memory maps).
"""

from __future__ import annotations

import threading
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

Buffer = Any  # anything with the buffer protocol (bytes, memoryview, C-contiguous numpy array)


class IoClock:
    """Seconds spent in writes and fsyncs through a storage and its sub-folders, summed over threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.write_s = self.fsync_s = self.serialize_s = 0.0
        self.nbytes = 0

    def add_serialize(self, seconds: float) -> None:
        """Time a serializer spent encoding (checksums) before handing bytes to this storage."""
        with self._lock:
            self.serialize_s += seconds

    def add(self, write_s: float, fsync_s: float, nbytes: int) -> None:
        with self._lock:
            self.write_s += write_s
            self.fsync_s += fsync_s
            self.nbytes += nbytes


@runtime_checkable
class Storage(Protocol):
    """A root under which named objects are written whole and read by byte range. Names are
    '/'-separated paths relative to the root (validated by checks.check_relpath where they come from
    a manifest)."""

    url: str
    supports_rename: bool  # rename() and sync() work: a folder can be renamed atomically (local file systems)
    local_path: str | None  # the root as a folder of this host's file system, or None (object stores)
    context: Any  # the tensorstore Context of drivers opened over kvstore_spec(), or None for a default one
    clock: IoClock  # time and bytes written through this storage (and, for a folder, what it was made from)

    def sub(self, name: str) -> "Storage": ...
    def parent(self) -> "tuple[Storage, str]": ...
    def write(self, name: str, buffers: Sequence[Buffer]) -> None: ...
    def write_if_absent(self, name: str, data: bytes) -> bool: ...
    def read(self, name: str, max_bytes: int) -> bytes: ...
    def read_into(self, name: str, offset: int, out: memoryview) -> None: ...
    def read_ranges(self, name: str, parts: Sequence[tuple[int, Sequence[memoryview]]]) -> None: ...
    def check_size(self, name: str, expected: int) -> None: ...
    def exists(self, name: str) -> bool: ...
    def kind(self) -> Literal["missing", "file", "folder"]: ...
    def list(self) -> list[str]: ...
    def delete(self, name: str = "") -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def sync(self, name: str = "", *, tree: bool = True) -> None: ...
    def makedirs(self) -> None: ...
    def stored_bytes(self) -> int | None: ...
    def kvstore_spec(self, name: str = "") -> dict[str, Any]: ...
