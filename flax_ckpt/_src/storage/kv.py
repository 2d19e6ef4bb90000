"""Object stores (s3, gcs) and the in-memory store, all through tensorstore's kvstore drivers.

Scope: KvStorage, the Storage protocol (base.py) over any tensorstore kvstore (memory://, s3://, gs://,
or an explicit spec), and kv_storage, which builds one from a spec and ObjectStoreOptions; every
memory:// path shares one in-process memory kvstore. Requests run concurrently up to
ObjectStoreOptions.concurrency; reads of large byte ranges are split into parts fetched in parallel. A
permanent error or one that outlasts every retry becomes a StorageError naming the URL. There is no
rename: the commit protocol writes its commit object last instead. How an object store is reached is
not here but in endpoints.py: the options, the s3/gcs spec and context (credentials, tensorstore's
request retries), the gs:// endpoint, the fail-fast endpoint check, and ``explain`` (what a failure means).
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any, Literal, Sequence

from flax_ckpt._src.errors import CorruptCheckpointError, StorageError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.storage.base import Buffer
from flax_ckpt._src.storage.endpoints import (
    ObjectStoreOptions,
    check_endpoint,
    explain,
    gcs_setup,
    open_gcs,
    s3_setup,
)

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import tensorstore as ts
else:
    ts = lazy("tensorstore", globals(), "ts")  # imported on first use (lazy.py)

_MEMORY_CONTEXT: list[Any] = []  # the in-process memory kvstore of every memory:// path, made on first use
_MEMORY_LOCK = threading.Lock()
_PART = 16 << 20  # a read_into of more bytes than this is split into parallel ranged requests


def _memory_context() -> Any:
    with _MEMORY_LOCK:
        if not _MEMORY_CONTEXT:
            _MEMORY_CONTEXT.append(ts.Context())
        return _MEMORY_CONTEXT[0]


class KvStorage:
    """Any tensorstore kvstore (memory://, s3://, gs://, or an explicit spec). No rename: the commit
    protocol writes the commit record last instead (``write_if_absent``)."""

    supports_rename = False
    local_path: str | None = None  # an object store is no folder of this host

    def __init__(self, spec: dict[str, Any], url: str, context: Any = None, endpoint: str | None = None):
        spec = dict(spec)
        path = spec.get("path", "")
        spec["path"] = path if not path or path.endswith("/") else path + "/"
        self.spec, self.url = spec, url if url.endswith("://") else url.rstrip("/")
        self.context = (
            context if context is not None else (_memory_context() if spec["driver"] == "memory" else None)
        )
        self.endpoint = endpoint  # gcs only: the server's base URL, when not tensorstore's default
        self._kv = None

    @property
    def kv(self):
        if self._kv is None:
            driver = self.spec["driver"]
            endpoint = self.spec.get("endpoint") if driver == "s3" else self.endpoint
            if endpoint and driver in ("s3", "gcs"):
                check_endpoint(str(endpoint), self.url)
            try:
                if driver == "gcs" and self.endpoint:
                    self._kv = open_gcs(self.spec, self.context, self.endpoint)
                else:
                    self._kv = ts.KvStore.open(self.spec, context=self.context).result()
            except Exception as e:
                raise StorageError(
                    f"{self.url}: cannot open kvstore {self.spec}: {explain(e, driver)}"
                ) from e
        return self._kv

    def sub(self, name: str) -> "KvStorage":
        spec = dict(self.spec, path=self.spec["path"] + name)
        return KvStorage(
            spec,
            self.url + name if self.url.endswith("/") else f"{self.url}/{name}",
            self.context,
            self.endpoint,
        )

    def parent(self) -> tuple["KvStorage", str]:
        """(the storage one level up, this one's last path component)."""
        head, _, name = self.spec["path"].rstrip("/").rpartition("/")
        if not name:
            raise ValueError(f"{self.url} is the root of its store; a checkpoint needs a name below it")
        up = self.url.rsplit("/", 1)[0]
        parent = KvStorage(
            dict(self.spec, path=head), up + "/" if up.endswith(":/") else up, self.context, self.endpoint
        )
        return parent, name

    def _err(self, op: str, name: str, e: Exception) -> StorageError:
        """The StorageError for a failed request; one raised on opening the store (an unreachable
        endpoint, a bad spec) already names the URL and the fix, and is re-raised as it is."""
        if isinstance(e, StorageError):
            raise e
        why = explain(e, self.spec["driver"], write=op == "write of")
        endpoint = self.spec.get("endpoint") if self.spec["driver"] == "s3" else self.endpoint
        at = (
            f" (endpoint {endpoint})"
            if endpoint and re.search(r"All \d+ retry attempts failed", str(e))
            else ""
        )
        return StorageError(f"{op} {self.url}/{name} failed{at}: {why}")

    def write(self, name: str, buffers: Sequence[Buffer]) -> float:
        """Writes the object ``name``; durable once it returns, so no fsync time (0.0)."""
        data = _join(buffers)
        try:
            self.kv.write(name, data).result()
        except Exception as e:
            raise self._err("write of", name, e) from e
        return 0.0

    def write_if_absent(self, name: str, data: bytes) -> bool:
        """Writes ``name`` unless it exists; False if another writer's object is there. A retried
        request whose first try landed finds its own bytes, which counts as written."""
        try:
            found = self.kv.read(name, byte_range=slice(0, 0)).result()
            if found.state == "value":
                return self.read(name, len(data)) == data
            stamp = self.kv.write(name, data, if_equal=found.stamp.generation).result()
        except Exception as e:
            raise self._err("write of", name, e) from e
        return bool(stamp.generation) or self.read(name, len(data)) == data

    def read(self, name: str, max_bytes: int) -> bytes:
        try:
            r = self.kv.read(name).result()
        except Exception as e:
            raise self._err("read of", name, e) from e
        if r.state != "value":
            raise FileNotFoundError(f"{self.url}/{name}")
        return bytes(r.value)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.read_ranges(name, [(offset, [out])])

    def read_ranges(self, name: str, parts: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """Fills, for each (offset, buffers), the buffers with the bytes from ``offset`` on: every ranged
        request (large buffers split into parts of _PART bytes) in flight at once."""
        jobs = []
        for offset, buffers in parts:
            for buf in buffers:
                out = memoryview(buf).cast("B")
                jobs += [(offset + a, out[a : min(a + _PART, len(out))]) for a in range(0, len(out), _PART)]
                offset += len(out)
        futures = [self.kv.read(name, byte_range=slice(at, at + len(out))) for at, out in jobs]
        try:
            for (at, out), f in zip(jobs, futures):
                self._fill(name, at, out, f)
        finally:
            for f in futures:
                f.cancel()

    def _fill(self, name: str, offset: int, out: memoryview, future: Any) -> None:
        try:
            r = future.result()
        except Exception as e:
            if "OUT_OF_RANGE" in str(e):
                raise CorruptCheckpointError(
                    f"{self.url}/{name}: truncated (needed bytes {offset}..{offset + len(out)})"
                ) from None
            raise self._err("read of", name, e) from e
        if r.state != "value":
            raise CorruptCheckpointError(f"{self.url}/{name}: missing data object")
        if len(r.value) != len(out):
            raise CorruptCheckpointError(
                f"{self.url}/{name}: truncated (needed {len(out)} bytes at {offset}, got {len(r.value)})"
            )
        out[:] = r.value

    def exists(self, name: str) -> bool:
        try:
            return self.kv.read(name, byte_range=slice(0, 0)).result().state == "value"
        except Exception as e:
            raise self._err("read of", name, e) from e

    def kind(self) -> Literal["missing", "file", "folder"]:
        """An object store has no folders: a prefix with objects below it counts as one."""
        return "folder" if self.list() else "missing"

    def check_size(self, name: str, expected: int) -> None:
        """Raises CorruptCheckpointError unless the object exists with at least ``expected`` bytes
        (object stores report no size without a read; this reads one byte)."""
        if expected == 0:
            if not self.exists(name):
                raise CorruptCheckpointError(f"{self.url}/{name}: missing data object")
            return
        self.read_into(name, expected - 1, memoryview(bytearray(1)))

    def list(self) -> list[str]:
        return sorted({k.split("/")[0] for k in self.list_all()})

    def list_all(self) -> list[str]:
        try:
            return sorted(k.decode() for k in self.kv.list().result())
        except Exception as e:
            raise self._err("list of", "", e) from e

    def delete(self, name: str = "") -> None:
        """Deletes the object ``name`` and everything under ``name/`` (everything, for "")."""
        try:
            if not name:
                self.kv.delete_range(ts.KvStore.KeyRange()).result()
                return
            self.kv.write(name, None).result()
            self.kv.delete_range(ts.KvStore.KeyRange(name + "/", name + "0")).result()
        except Exception as e:
            raise self._err("delete of", name, e) from e

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError(f"{self.url}: an object store cannot rename (supports_rename is False)")

    def sync(self, name: str = "", *, tree: bool = True) -> None:
        """Nothing to do: an object is durable once its write returns."""

    def makedirs(self) -> None:
        """Nothing to do: object stores have no folders."""

    def stored_bytes(self) -> None:
        """Unknown without listing sizes, which object stores report only per request."""
        return None

    def kvstore_spec(self, name: str = "") -> dict[str, Any]:
        return dict(self.spec, path=self.spec["path"] + (name + "/" if name else ""))


def _join(buffers: Sequence[Buffer]) -> bytes:
    if len(buffers) == 1:
        return memoryview(buffers[0]).cast("B").tobytes()
    return b"".join(memoryview(b).cast("B") for b in buffers)


def _url_of(spec: dict[str, Any]) -> str:
    driver, path = str(spec.get("driver")), str(spec.get("path", "")).strip("/")
    scheme = {"s3": "s3", "gcs": "gs"}.get(driver)
    if scheme:
        return f"{scheme}://{spec.get('bucket', '')}/{path}".rstrip("/")
    return f"{driver}://{path}"


def kv_storage(spec: dict[str, Any], url: str | None, options: ObjectStoreOptions) -> KvStorage:
    """A KvStorage for ``spec``, its context holding the options (s3, gcs) or the shared memory store."""
    url = url if url is not None else _url_of(spec)
    driver, endpoint = spec.get("driver"), None
    if driver == "s3":
        spec, context = s3_setup(spec, options)
    elif driver == "gcs":
        spec, context, endpoint = gcs_setup(spec, options)
    elif options != ObjectStoreOptions():
        raise ValueError(f"{url}: ObjectStoreOptions apply to s3:// and gs:// only")
    else:
        context = None
    return KvStorage(spec, url, context, endpoint)
