"""Where bytes go: a local folder (plain os calls, fsync) or any tensorstore kvstore (memory, s3, gcs).

Scope: named byte objects under a root, and nothing about checkpoints. Names are '/'-separated paths
relative to the root, already validated by format.check_relpath where they come from a manifest. The
serializers and the commit protocol sit on top of this module; it imports neither.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from typing import Any, Protocol, Sequence
from urllib.parse import urlparse

import tensorstore as ts

from .errors import CorruptCheckpointError, StorageError

Buffer = Any  # anything with the buffer protocol (bytes, memoryview, C-contiguous numpy array)
_WRITE_STEP = 1 << 30


class Storage(Protocol):
    """A root under which named objects are written whole and read by byte range."""

    url: str
    supports_rename: bool  # True: a folder can be renamed atomically (local file systems)

    def sub(self, name: str) -> "Storage": ...
    def write(self, name: str, buffers: Sequence[Buffer]) -> None: ...
    def read(self, name: str, max_bytes: int) -> bytes: ...
    def read_into(self, name: str, offset: int, out: memoryview) -> None: ...
    def check_size(self, name: str, expected: int) -> None: ...
    def exists(self, name: str) -> bool: ...
    def list(self) -> list[str]: ...
    def delete(self, name: str = "") -> None: ...
    def kvstore_spec(self, name: str) -> dict[str, Any]: ...


class IoClock:
    """Seconds spent in writes and fsyncs through a storage and its sub-folders, summed over threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.write_s = self.fsync_s = 0.0
        self.nbytes = 0

    def add(self, write_s: float, fsync_s: float, nbytes: int) -> None:
        with self._lock:
            self.write_s += write_s
            self.fsync_s += fsync_s
            self.nbytes += nbytes


class LocalStorage:
    """A folder on a local (or network) file system. Writes are fsynced before they return."""

    supports_rename = True

    def __init__(self, root: str | os.PathLike, clock: IoClock | None = None):
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.clock = clock if clock is not None else IoClock()

    def _p(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/")) if name else self.root

    def sub(self, name: str) -> "LocalStorage":
        """The folder ``name`` below this one, with a clock of its own."""
        return LocalStorage(self._p(name))

    def write(self, name: str, buffers: Sequence[Buffer]) -> None:
        path = self._p(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        t0, nbytes = time.perf_counter(), 0
        try:
            for buf in buffers:
                mv = memoryview(buf).cast("B")
                nbytes += len(mv)
                while len(mv):
                    n = os.write(fd, mv[:_WRITE_STEP])
                    mv = mv[n:]
            t1 = time.perf_counter()
            os.fsync(fd)
            self.clock.add(t1 - t0, time.perf_counter() - t1, nbytes)
        finally:
            os.close(fd)

    def _inside(self, path: str) -> str:
        real = os.path.realpath(path)
        root = os.path.realpath(self.root)
        if real != root and not real.startswith(root + os.sep):
            raise CorruptCheckpointError(f"{path} resolves to {real}, outside the checkpoint folder {root}; "
                                         "refusing to read it")
        return real

    def read(self, name: str, max_bytes: int) -> bytes:
        path = self._inside(self._p(name))
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        return data

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        path = self._inside(self._p(name))
        fd = os.open(path, os.O_RDONLY)
        try:
            mv, pos = memoryview(out).cast("B"), offset
            while len(mv):
                n = os.preadv(fd, [mv[:_WRITE_STEP]], pos)
                if n == 0:
                    raise CorruptCheckpointError(f"{path}: truncated (needed bytes {offset}..{offset + len(out)}, "
                                                 f"file ends at {pos})")
                mv, pos = mv[n:], pos + n
        finally:
            os.close(fd)

    def size(self, name: str) -> int | None:
        try:
            return os.stat(self._p(name)).st_size
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return os.path.isfile(self._p(name))

    def check_size(self, name: str, expected: int) -> None:
        """Raises CorruptCheckpointError unless the file exists with exactly ``expected`` bytes."""
        found = self.size(name)
        if found != expected:
            raise CorruptCheckpointError(
                f"{self._p(name)}: " + ("missing" if found is None else f"truncated or extended: expected "
                                        f"{expected} bytes, found {found}"))

    def isdir(self) -> bool:
        return os.path.isdir(self.root)

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, name: str = "") -> None:
        path = self._p(name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=False)
        elif os.path.lexists(path):
            os.unlink(path)

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename; refuses (CheckpointExistsError from the caller) when dst exists and is not empty."""
        os.rename(self._p(src), self._p(dst))

    def fsync_tree(self, name: str = "") -> None:
        """fsyncs every folder under name (files are fsynced when written)."""
        for dirpath, _, _ in os.walk(self._p(name)):
            fsync_dir(dirpath)

    def kvstore_spec(self, name: str) -> dict[str, Any]:
        return {"driver": "file", "path": self._p(name) + "/"}


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on folders
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


_MEMORY_CONTEXT = ts.Context()  # one in-process memory kvstore shared by every memory:// path
_open_lock = threading.Lock()
_open_cache: dict[str, Any] = {}


class KvStorage:
    """Any tensorstore kvstore (memory://, s3://, gs://, or an explicit spec). No rename: the commit
    protocol writes the commit record last instead."""

    supports_rename = False

    def __init__(self, spec: dict[str, Any], url: str, context: Any = None):
        spec = dict(spec)
        path = spec.get("path", "")
        spec["path"] = path if not path or path.endswith("/") else path + "/"
        self.spec, self.url = spec, url.rstrip("/")
        self.context = context if context is not None else (
            _MEMORY_CONTEXT if spec["driver"] == "memory" else None)
        self._kv = None

    @property
    def kv(self):
        if self._kv is None:
            try:
                self._kv = ts.KvStore.open(self.spec, context=self.context).result()
            except Exception as e:
                raise StorageError(f"{self.url}: cannot open kvstore {self.spec}: {e}") from e
        return self._kv

    def sub(self, name: str) -> "KvStorage":
        spec = dict(self.spec, path=self.spec["path"] + name)
        return KvStorage(spec, f"{self.url}/{name}", self.context)

    def _err(self, op: str, name: str, e: Exception) -> StorageError:
        return StorageError(f"{op} {self.url}/{name} failed: {e}")

    def write(self, name: str, buffers: Sequence[Buffer]) -> None:
        data = b"".join(memoryview(b).cast("B") for b in buffers) if len(buffers) != 1 else \
            memoryview(buffers[0]).cast("B").tobytes()
        try:
            self.kv.write(name, data).result()
        except Exception as e:
            raise self._err("write of", name, e) from e

    def read(self, name: str, max_bytes: int) -> bytes:
        try:
            r = self.kv.read(name).result()
        except Exception as e:
            raise self._err("read of", name, e) from e
        if r.state != "value":
            raise FileNotFoundError(f"{self.url}/{name}")
        return bytes(r.value)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        out = memoryview(out).cast("B")
        if len(out) == 0:
            return
        try:
            r = self.kv.read(name, byte_range=slice(offset, offset + len(out))).result()
        except Exception as e:
            if "OUT_OF_RANGE" in str(e) or "out of range" in str(e).lower():
                raise CorruptCheckpointError(f"{self.url}/{name}: truncated (needed bytes {offset}.."
                                             f"{offset + len(out)})") from None
            raise self._err("read of", name, e) from e
        if r.state != "value":
            raise CorruptCheckpointError(f"{self.url}/{name}: missing data object")
        if len(r.value) != len(out):
            raise CorruptCheckpointError(f"{self.url}/{name}: truncated (needed {len(out)} bytes at {offset}, "
                                         f"got {len(r.value)})")
        out[:] = r.value

    def exists(self, name: str) -> bool:
        try:
            return self.kv.read(name, byte_range=slice(0, 0)).result().state == "value"
        except Exception as e:
            raise self._err("read of", name, e) from e

    def check_size(self, name: str, expected: int) -> None:
        """Raises CorruptCheckpointError unless the object exists with at least ``expected`` bytes
        (object stores report no size without a read; this reads one byte)."""
        if expected == 0:
            r = self.kv.read(name, byte_range=slice(0, 0)).result()
            if r.state != "value":
                raise CorruptCheckpointError(f"{self.url}/{name}: missing data object")
            return
        self.read_into(name, expected - 1, memoryview(bytearray(1)))

    def list(self) -> list[str]:
        try:
            keys = self.kv.list().result()
        except Exception as e:
            raise self._err("list of", "", e) from e
        return sorted({k.decode().split("/")[0] for k in keys})

    def list_all(self) -> list[str]:
        return sorted(k.decode() for k in self.kv.list().result())

    def delete(self, name: str = "") -> None:
        """Deletes the object ``name`` and everything under ``name/`` (everything, for "")."""
        try:
            if not name:
                self.kv.delete_range(ts.KvStore.KeyRange()).result()
                return
            self.kv.delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()
            self.kv.delete_range(ts.KvStore.KeyRange(name + "/", name + "0")).result()
        except Exception as e:
            raise self._err("delete of", name, e) from e

    def kvstore_spec(self, name: str) -> dict[str, Any]:
        return dict(self.spec, path=self.spec["path"] + name + "/")


def open_storage(path: Any) -> LocalStorage | KvStorage:
    """A path, 'file://...', 'memory://...', 's3://bucket/prefix', 'gs://bucket/prefix', a tensorstore
    kvstore spec (dict), or a Storage (returned as is)."""
    if isinstance(path, (LocalStorage, KvStorage)):
        return path
    if isinstance(path, dict):
        return KvStorage(path, url=f"{path.get('driver')}://{path.get('bucket', '')}/{path.get('path', '')}")
    path = os.fspath(path)
    u = urlparse(path)
    if u.scheme in ("", "file"):
        return LocalStorage(u.path if u.scheme else path)
    prefix = u.path.lstrip("/")
    if u.scheme == "memory":
        return KvStorage({"driver": "memory", "path": (u.netloc + "/" + prefix).strip("/")}, path)
    if u.scheme == "s3":
        spec: dict[str, Any] = {"driver": "s3", "bucket": u.netloc, "path": prefix}
        endpoint = os.environ.get("FLAX_CKPT_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
        return KvStorage(spec, path)
    if u.scheme == "gs":
        return KvStorage({"driver": "gcs", "bucket": u.netloc, "path": prefix}, path)
    raise StorageError(f"{path}: unsupported scheme {u.scheme!r}; use a local path, memory://, s3:// or gs://")
