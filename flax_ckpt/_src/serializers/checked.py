"""The library's checksums around a serializer that is not built in: every byte it stores is checked.

Scope: ``Checked``, a Serializer wrapping a user's (base.Serializer). Its ``write`` hands the user a
Storage that computes a crc32c of every BLOCK bytes of every object written and stores them beside it
as ``<object>.crc32c`` (a sealed document: size, block, checksums), and that enforces the naming rules
(object names start with the tag; no ``.crc32c`` names; chunk records name their object in
``"file"``); the objects and their sizes become ``Written.files``, whose sizes the manifest keeps.
Its reads hand the user a Storage that fetches whole blocks and checks them before the user sees a
byte: damage, a missing object or checksum file is a CorruptCheckpointError naming the object and the
leaf. It also times the writes (fsync, checksums) for SaveStats. Nothing here knows the user's format.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Literal, Sequence

import crc32c
import numpy as np

from flax_ckpt._src.checks import check_relpath, seal, unseal
from flax_ckpt._src.errors import CorruptCheckpointError, InvalidManifestError
from flax_ckpt._src.serializers import check_name
from flax_ckpt._src.serializers.base import ArrayItem, Box, Serializer, StoredArray, Written
from flax_ckpt._src.storage.base import Buffer, Storage

BLOCK = 1 << 20  # bytes per checksum: a partial read fetches and checks whole blocks
SUFFIX = ".crc32c"  # the checksum file of object <name> is <name>.crc32c
MAX_SUMS_BYTES = 64 << 20  # the largest checksum file read (an object of about 4 TiB)
_FORMAT, _VERSION = "flax_ckpt.crc32c", 1
_SEPARATORS = ("/", ".", "-", "_")


class Checked:
    """A serializer that is not built in, with the library's checksums on every byte it stores."""

    def __init__(self, inner: Serializer):
        self.name = check_name(inner)
        missing = [
            m
            for m in ("write", "read")
            if not callable(getattr(inner, m, None))
            or getattr(type(inner), m, None) is getattr(Serializer, m)
        ]  # fc.Serializer's stub
        if missing:
            raise TypeError(
                f"{type(inner).__name__} is not a Serializer: it has no {' or '.join(missing)} method "
                "(see fc.Serializer)"
            )
        self.inner = inner

    def write(self, storage: Storage, items: Sequence[ArrayItem], *, tag: str) -> Written:
        rec = _Recorder(storage, _Log(self.name, tag))
        written = self.inner.write(rec, items, tag=tag)
        if not isinstance(written, Written):
            raise TypeError(
                f"serializer {self.name!r}: write returned {type(written).__name__}, not fc.Written"
            )
        log = rec.log
        for item in items:
            for j, chunk in enumerate(written.chunks.get(item.leaf, ())):
                name = chunk.get("file") if isinstance(chunk, dict) else None
                if name not in log.sizes:
                    raise ValueError(
                        f'serializer {self.name!r}: chunk {j} of leaf {item.name!r} has "file" '
                        f"{name!r}, not an object it wrote; every chunk record names the object holding "
                        'its bytes in "file" (flax-ckpt verify names it when it is damaged)'
                    )
        return Written(written.chunks, dict(log.sizes), fsync_s=log.fsync_s, serialize_s=log.crc_s)

    def read(self, storage: Storage, leaf: StoredArray, box: Box, out: np.ndarray, where: str) -> None:
        self.inner.read(_Verifier(storage, where, {}), leaf, box, out, where)

    def read_many(
        self, storage: Storage, requests: Sequence[tuple[StoredArray, Box, np.ndarray]], where: str
    ) -> None:
        sums: dict[str, tuple[int, int, list[int]]] = {}  # checksum files read once for the whole batch
        for leaf, box, out in requests:
            at = f"{where} leaf {leaf.name!r}"
            self.inner.read(_Verifier(storage, at, sums), leaf, box, out, at)

    def view(self, storage: Storage, leaf: StoredArray, box: Box, where: str) -> None:
        return None  # every byte goes through the checks

    def validate(self, leaf: StoredArray, files: dict[str, int], where: str) -> None:
        for j, chunk in enumerate(leaf.chunks):
            name = check_relpath(chunk.get("file"), f"chunks[{j}].file", where)
            if name not in files or name + SUFFIX not in files:
                raise InvalidManifestError(
                    f"{where}: chunk {j}: object {name!r} or its checksums {name + SUFFIX!r} "
                    "are not among the manifest's files"
                )
        validate = getattr(self.inner, "validate", None)  # optional (base.Serializer's default accepts)
        if validate is not None:
            validate(leaf, files, where)


# ------------------------------------------------------------------------------------------------ write


class _Log:
    """What one write stored: object sizes (checksum files included) and time, shared by sub-folders."""

    def __init__(self, serializer: str, tag: str):
        self.serializer, self.tag = serializer, tag
        self.lock = threading.Lock()
        self.sizes: dict[str, int] = {}
        self.fsync_s = self.crc_s = 0.0

    def check(self, name: str) -> None:
        try:
            check_relpath(name, "object", "")
        except InvalidManifestError:
            raise ValueError(
                f"serializer {self.serializer!r} wrote {name!r}: not a relative path inside the "
                "checkpoint folder"
            ) from None
        if name.endswith(SUFFIX):
            raise ValueError(
                f"serializer {self.serializer!r} wrote {name!r}: names ending in {SUFFIX} are the "
                "library's checksum files"
            )
        if not (name == self.tag or name.startswith(tuple(self.tag + s for s in _SEPARATORS))):
            raise ValueError(
                f"serializer {self.serializer!r} wrote {name!r}: object names start with the tag "
                f"{self.tag!r} and a separator ('/', '.', '-', '_'), so that processes never write "
                "the same name"
            )


def _block_crcs(views: list[memoryview]) -> list[int]:
    """crc32c of every BLOCK bytes of the buffers taken back to back ([0] for none)."""
    crcs, crc, fill = [], 0, 0
    for v in views:
        pos = 0
        while pos < len(v):
            take = min(BLOCK - fill, len(v) - pos)
            crc = crc32c.crc32c(v[pos : pos + take], crc)
            fill, pos = fill + take, pos + take
            if fill == BLOCK:
                crcs.append(crc)
                crc, fill = 0, 0
    if fill or not crcs:
        crcs.append(crc)
    return crcs


class _Wrapped:
    """What both wrappers below pass through unchanged: the look-ups that read no stored bytes."""

    _s: Storage

    def __init__(self, storage: Storage):
        self._s = storage
        self.url, self.supports_rename, self.local_path = (
            storage.url,
            storage.supports_rename,
            storage.local_path,
        )

    def exists(self, name: str) -> bool:
        return self._s.exists(name)

    def check_size(self, name: str, expected: int) -> None:
        self._s.check_size(name, expected)

    def kind(self) -> Literal["missing", "file", "folder"]:
        return self._s.kind()

    def list(self) -> list[str]:
        return self._s.list()

    def stored_bytes(self) -> int | None:
        return self._s.stored_bytes()


class _Recorder(_Wrapped):
    """The Storage a user's write gets: writes go through, each followed by its checksum file."""

    def __init__(self, storage: Storage, log: _Log, prefix: str = ""):
        super().__init__(storage)
        self.log, self._prefix = log, prefix

    def write(self, name: str, buffers: Sequence[Buffer]) -> float:
        full = self._prefix + name
        self.log.check(full)
        t0 = time.perf_counter()
        views = [memoryview(b).cast("B") for b in buffers]
        size, crcs = sum(len(v) for v in views), _block_crcs(views)
        sums = seal({"size": size, "block": BLOCK, "crc32c": crcs}, name=_FORMAT, version=_VERSION)
        t1 = time.perf_counter()
        fsync = self._s.write(name, views) + self._s.write(name + SUFFIX, [sums])
        with self.log.lock:
            self.log.sizes[full], self.log.sizes[full + SUFFIX] = size, len(sums)
            self.log.fsync_s += fsync
            self.log.crc_s += t1 - t0
        return fsync

    def sub(self, name: str) -> "_Recorder":
        return _Recorder(self._s.sub(name), self.log, f"{self._prefix}{name}/")

    def read(self, name: str, max_bytes: int) -> bytes:
        return self._s.read(name, max_bytes)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._s.read_into(name, offset, out)

    def read_ranges(self, name: str, parts: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self._s.read_ranges(name, parts)

    def makedirs(self) -> None:
        self._s.makedirs()

    def sync(self, name: str = "", *, tree: bool = True) -> None:
        self._s.sync(name, tree=tree)

    def parent(self) -> "tuple[Storage, str]":
        raise ValueError(
            f"serializer {self.log.serializer!r}: a serializer writes inside the checkpoint folder"
        )

    def write_if_absent(self, name: str, data: bytes) -> bool:
        raise ValueError(
            f"serializer {self.log.serializer!r}: a serializer writes with write() (checksummed)"
        )

    def delete(self, name: str = "") -> None:
        raise ValueError(f"serializer {self.log.serializer!r}: a serializer does not delete what it wrote")

    def rename(self, src: str, dst: str) -> None:
        raise ValueError(f"serializer {self.log.serializer!r}: a serializer does not rename what it wrote")


# ------------------------------------------------------------------------------------------------- read


class _Verifier(_Wrapped):
    """The Storage a user's read gets: whole blocks are read and checked before any byte is handed on."""

    def __init__(
        self, storage: Storage, where: str, sums: dict[str, tuple[int, int, list[int]]], prefix: str = ""
    ):
        super().__init__(storage)
        self._where, self._sums, self._prefix = where, sums, prefix

    def _checksums(self, name: str) -> tuple[int, int, list[int]]:
        """(size, block, crc32c per block) of object ``name``, from its checksum file."""
        full = self._prefix + name
        check_relpath(full, "file", self._where)
        found = self._sums.get(full)
        if found is not None:
            return found
        try:
            raw = self._s.read(name + SUFFIX, MAX_SUMS_BYTES)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptCheckpointError(
                f"{self._where}: {full + SUFFIX}, the checksums of {full}, is missing"
            ) from None
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{self._where}: {e}") from None
        body = unseal(
            raw,
            name=_FORMAT,
            version=_VERSION,
            where=f"{self._where}: {full + SUFFIX}",
            what="checksum file",
            error=CorruptCheckpointError,
            max_bytes=MAX_SUMS_BYTES,
        )
        size, block, crcs = body.get("size"), body.get("block"), body.get("crc32c")
        if (
            type(size) is not int
            or type(block) is not int
            or size < 0
            or block <= 0
            or not isinstance(crcs, list)
            or len(crcs) != max(1, math.ceil(size / block))
            or not all(type(c) is int for c in crcs)
        ):
            raise CorruptCheckpointError(f"{self._where}: {full + SUFFIX} is not a valid checksum file")
        self._sums[full] = found = (size, block, crcs)
        return found

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        """Reads the blocks of ``name`` that hold bytes [offset, offset + len(out)), checks them, copies."""
        size, block, crcs = self._checksums(name)
        out = memoryview(out).cast("B")
        end = offset + len(out)
        if offset < 0 or end > size:
            raise CorruptCheckpointError(
                f"{self._where}: bytes {offset}..{end} of {self._prefix + name} asked for, which holds {size}"
            )
        if end == offset:
            return
        b0, b1 = offset // block, math.ceil(end / block)
        s, e = b0 * block, min(b1 * block, size)
        aligned = s == offset and e == end
        buf = out if aligned else memoryview(bytearray(e - s))
        try:
            self._s.read_into(name, s, buf)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptCheckpointError(f"{self._where}: {self._prefix + name} is missing") from None
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{self._where}: {err}") from None
        for k in range(b0, b1):
            part = buf[k * block - s : min((k + 1) * block, size) - s]
            if crc32c.crc32c(part) != crcs[k]:
                raise CorruptCheckpointError(
                    f"{self._where}: checksum mismatch in {self._prefix + name} bytes {k * block}.."
                    f"{k * block + len(part)} (crc32c expected {crcs[k]}, found {crc32c.crc32c(part)}); "
                    "the object is damaged"
                )
        if not aligned:
            out[:] = buf[offset - s : end - s]

    def read(self, name: str, max_bytes: int) -> bytes:
        size = self._checksums(name)[0]
        if size > max_bytes:
            raise CorruptCheckpointError(
                f"{self._where}: {self._prefix + name} holds {size} bytes, more than the {max_bytes} it may"
            )
        out = bytearray(size)
        self.read_into(name, 0, memoryview(out))
        return bytes(out)

    def read_ranges(self, name: str, parts: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        for offset, buffers in parts:
            for b in buffers:
                view = memoryview(b).cast("B")
                self.read_into(name, offset, view)
                offset += len(view)

    def sub(self, name: str) -> "_Verifier":
        return _Verifier(self._s.sub(name), self._where, self._sums, f"{self._prefix}{name}/")

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise ValueError(f"{self._where}: a serializer's read changes nothing in the checkpoint")

    write = write_if_absent = delete = rename = sync = makedirs = parent = _refuse


__all__ = ["BLOCK", "Checked", "SUFFIX"]
