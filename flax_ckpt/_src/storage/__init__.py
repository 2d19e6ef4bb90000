"""Where bytes go: a local folder (plain os calls, fsync) or any tensorstore kvstore (memory, s3, gcs).

Scope: named byte objects under a root, and nothing about checkpoints. The protocol is base.py's, the
two implementations are local.py (folders) and kv.py (tensorstore kvstores: memory://, s3://, gs://;
how an object store is reached, and what its failures mean, is endpoints.py's); this module turns a
user's location (path, URL, kvstore spec) into one. ``Storage`` is the part every storage has (public
as ``fc.Storage``: what a serializer writes through); ``TensorstoreStorage`` adds the part only
tensorstore drivers use (``context``, ``kvstore_spec``). The serializers and the commit protocol sit
on top of this package; it imports neither.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from flax_ckpt._src.errors import StorageError
from flax_ckpt._src.storage.base import Buffer, Storage, TensorstoreStorage
from flax_ckpt._src.storage.endpoints import ObjectStoreOptions, explain, options_of
from flax_ckpt._src.storage.kv import KvStorage, kv_storage
from flax_ckpt._src.storage.local import LocalStorage, fsync_dir

__all__ = [
    "Buffer",
    "KvStorage",
    "LocalStorage",
    "ObjectStoreOptions",
    "Storage",
    "TensorstoreStorage",
    "explain",
    "fsync_dir",
    "open_storage",
    "split_location",
]


def open_storage(path: Any, *, options: "ObjectStoreOptions | dict[str, Any] | None" = None) -> Storage:
    """A path, 'file://...', 'memory://...', 's3://bucket/prefix', 'gs://bucket/prefix', a tensorstore
    kvstore spec (dict), or a Storage (returned as is). ``options`` (or the environment) say how to
    reach an object store: endpoint, region, credentials, retries, concurrency."""
    if isinstance(path, Storage):
        return path
    opts = options_of(options)
    if isinstance(path, dict):
        if path.get("driver") == "file":
            return LocalStorage(path.get("path", ""))
        if not isinstance(path.get("driver"), str):
            raise StorageError(f"{path!r}: a kvstore spec needs a 'driver' (s3, gcs, memory, file, ...)")
        return kv_storage(path, None, opts)
    path = os.fspath(path)
    u = urlparse(path)
    if u.scheme in ("", "file"):
        return LocalStorage(u.path if u.scheme else path)
    prefix = u.path.lstrip("/")
    if u.scheme == "memory":
        return kv_storage({"driver": "memory", "path": (u.netloc + "/" + prefix).strip("/")}, path, opts)
    if u.scheme in ("s3", "gs"):
        if not u.netloc:
            raise StorageError(f"{path}: no bucket; write {u.scheme}://<bucket>/<prefix>")
        driver = "s3" if u.scheme == "s3" else "gcs"
        return kv_storage({"driver": driver, "bucket": u.netloc, "path": prefix}, path.rstrip("/"), opts)
    raise StorageError(
        f"{path}: unsupported scheme {u.scheme!r}; use a local path, memory://, s3:// or gs://"
    )


def split_location(
    location: Any, *, options: "ObjectStoreOptions | dict[str, Any] | None" = None
) -> tuple[Storage, str]:
    """(parent storage, final name) of a checkpoint location: a path, URL, kvstore spec or Storage."""
    if isinstance(location, (str, os.PathLike)) and "://" not in os.fspath(location):
        s = os.path.abspath(os.fspath(location))
        return LocalStorage(os.path.dirname(s)), os.path.basename(s)
    if isinstance(location, str) and location.startswith("file://"):
        return split_location(location[len("file://") :])
    if isinstance(location, str):
        head, _, name = location.rstrip("/").rpartition("/")
        if head.endswith(":/") and head != "memory:/":  # s3://bucket alone
            raise StorageError(f"{location}: a checkpoint location needs a name below the bucket")
        return open_storage(head + "/" if head == "memory:/" else head, options=options), name
    return open_storage(location, options=options).parent()
