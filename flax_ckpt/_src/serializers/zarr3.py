"""The tensorstore serializer: one zarr3 array per leaf, chunked by shard, crc32c codec on every chunk.

Works over any tensorstore kvstore the Storage can name (file, memory, s3, gcs), so its arrays are
readable by any zarr3 tool. Chunk records are {"array": <folder of the zarr3 array>} plus the box;
tensorstore verifies each chunk's crc32c as it reads. dtypes tensorstore lacks are stored as unsigned
integers of the same width ("stored_dtype" in the record). Its storage is a TensorstoreStorage (the
storage protocol's tensorstore part: ``context``, ``kvstore_spec``), which both built-in storages are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from flax_ckpt._src.checks import check_relpath
from flax_ckpt._src.errors import CorruptCheckpointError, InvalidManifestError, StorageError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.serializers import for_each_overlap, local
from flax_ckpt._src.serializers.base import ArrayItem, Box, StoredArray, Written
from flax_ckpt._src.storage import TensorstoreStorage, explain

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import tensorstore as ts
else:
    ts = lazy("tensorstore", globals(), "ts")  # imported on first use (lazy.py)

CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_UNSUPPORTED = {"uint4", "uint2"}


def _stored(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{8 * dtype.itemsize}") if dtype.name in _UNSUPPORTED else dtype


def _spec(storage: TensorstoreStorage, name: str, dtype: np.dtype, shape, chunk) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": storage.kvstore_spec(name),
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "data_type": _stored(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "codecs": CODECS,
        },
    }


def _context(storage: TensorstoreStorage) -> dict[str, Any]:
    """The storage's tensorstore context (shared memory kvstore, s3 settings), if it has one."""
    return {"context": storage.context} if storage.context is not None else {}


class Zarr3Serializer:
    name = "zarr3"

    def write(self, storage: TensorstoreStorage, items: Sequence[ArrayItem], *, tag: str) -> Written:
        try:
            return self._write(storage, items)
        except (ValueError, RuntimeError, OSError) as e:  # tensorstore reports I/O failures as ValueError
            raise StorageError(f"write of zarr3 arrays under {storage.url} failed: {explain(e)}") from e

    def _write(self, storage: TensorstoreStorage, items: Sequence[ArrayItem]) -> Written:
        futures, chunks, opened = [], {}, []  # opened: the arrays stay alive until their writes finish
        for item in items:
            name = f"z/{item.leaf}"
            chunk = [max(1, e - s) for s, e in item.shards[0].box] if item.shards else [1] * len(item.shape)
            spec = _spec(storage, name, item.dtype, item.shape, chunk)
            arr = ts.open(spec, create=True, open=True, **_context(storage)).result()
            opened.append(arr)
            chunks[item.leaf] = []
            for shard in item.shards:
                data = (
                    shard.data.view(_stored(item.dtype)) if _stored(item.dtype) != item.dtype else shard.data
                )
                if data.size:
                    futures.append(arr[tuple(slice(s, e) for s, e in shard.box)].write(data))
                cell = "/".join(["c"] + [str(s // c) for (s, _), c in zip(shard.box, chunk)])
                chunks[item.leaf].append(
                    {
                        "index": [list(b) for b in shard.box],
                        "array": name,
                        "key": cell,
                        "stored_dtype": _stored(item.dtype).name,
                    }
                )
        for f in futures:
            f.result()
        return Written(chunks, {})

    def view(self, storage: TensorstoreStorage, leaf: StoredArray, box: Box, where: str) -> None:
        return None  # files on disk: read, never mapped

    def read_many(
        self, storage: TensorstoreStorage, requests: Sequence[tuple[StoredArray, Box, np.ndarray]], where: str
    ) -> None:
        for leaf, box, out in requests:
            self.read(storage, leaf, box, out, f"{where} leaf {leaf.name!r}")

    def validate(self, leaf: StoredArray, files: dict[str, int], where: str) -> None:
        for j, ch in enumerate(leaf.chunks):
            check_relpath(ch.get("array"), f"chunks[{j}].array", where)
            check_relpath(ch.get("key"), f"chunks[{j}].key", where)
            if not isinstance(ch.get("stored_dtype"), str):
                raise InvalidManifestError(f"{where}: leaf chunk {j}: missing stored_dtype")
            expected = _stored(leaf.dtype).name  # what write() stores for the dtype
            if ch["stored_dtype"] != expected:
                raise InvalidManifestError(
                    f"{where}: leaf chunk {j}: stored_dtype {ch['stored_dtype']!r} is not "
                    f"{expected!r}, the storage of {leaf.dtype.name}"
                )

    def read(
        self, storage: TensorstoreStorage, leaf: StoredArray, box: Box, out: np.ndarray, where: str
    ) -> None:
        handles: dict[str, Any] = {}
        for chunk, _, ov in for_each_overlap(leaf, box):
            name = chunk["array"]
            if name not in handles:
                try:
                    handles[name] = ts.open(
                        {"driver": "zarr3", "kvstore": storage.kvstore_spec(name)},
                        open=True,
                        dtype=chunk["stored_dtype"],
                        shape=leaf.shape,
                        **_context(storage),
                    ).result()
                except Exception as e:
                    raise _read_error(storage, f"{where}: cannot open zarr3 array {name}", e) from e
            _check_chunk_present(storage, leaf, chunk, where)
            dst = out[local(ov, box)]
            try:
                data = handles[name][tuple(slice(s, e) for s, e in ov)].read().result()
            except Exception as e:
                raise _read_error(storage, f"{where}: reading {name} failed", e) from e
            dst[...] = data.view(out.dtype) if data.dtype != out.dtype else data


def _check_chunk_present(
    storage: TensorstoreStorage, leaf: StoredArray, chunk: dict[str, Any], where: str
) -> None:
    """tensorstore reads a missing chunk as fill value; a chunk we wrote must exist, so check."""
    box = chunk["index"]
    if any(s >= e for s, e in box):
        return
    key = f"{chunk['array']}/{chunk['key']}"
    try:
        storage.read_into(key, 0, memoryview(bytearray(1)))
    except (OSError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(f"{where}: zarr3 chunk {key} is missing ({e})") from None


def _read_error(storage: TensorstoreStorage, what: str, e: Exception) -> Exception:
    """On an object store, a failed request is a StorageError (the data may be fine: retry later, no
    fallback to older steps); anything else, and any checksum failure, is damage."""
    msg = str(e)
    damaged = (
        "DATA_LOSS" in msg
        or "crc32c" in msg.lower()
        or "checksum" in msg.lower()
        or "NOT_FOUND" in msg
        or "Error parsing" in msg
    )
    if not storage.supports_rename and not damaged:
        return StorageError(f"{what}: {explain(e)}")
    return CorruptCheckpointError(f"{what} (damaged data?): {e}")
