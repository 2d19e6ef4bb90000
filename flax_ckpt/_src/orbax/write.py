"""Writing Orbax's layout without orbax: one pytree item, or a CheckpointManager step.

Scope: turning the engine's snapshot (engine/snapshot.py) into an Orbax item (zarr3 or zarr v2
arrays in OCDBT or not, zstd, with ``_METADATA``, ``_sharding``, ``_strings.json`` and
``array_metadatas/process_0``; zarr3 chunks carry a ``crc32c`` codec, which tensorstore, hence Orbax,
checks on every read; JSON data files a ``<file>.crc32c`` beside them, checked by flax_ckpt's reads and
ignored by Orbax's), a CheckpointManager step of one unnamed ``default`` item or of the named items
of the run it continues (``StepSnapshot``: an Orbax run saved with ``args.Composite``, pytree and
JSON items), and committing a folder of them with the engine's commit
(commit/; the commit record is ``commit_success.txt``, written last; staging folders are named as
Orbax names them, ``<name>.orbax-checkpoint-tmp-<ns>``). orbax-checkpoint's StandardCheckpointer,
PyTreeCheckpointer and CheckpointManager restore what is written here (tests/test_orbax_compat.py).
Refused: several processes (Orbax merges per-process OCDBT databases; flax_ckpt does not), keys
holding '/' or colliding once joined with '.', dtypes tensorstore lacks, Python ints beyond 64 bits.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import crc32c
import numpy as np

from flax_ckpt._src import checks
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.commit import distributed
from flax_ckpt._src.engine.snapshot import HostLeaf, Snapshot, jsonable, metrics_json
from flax_ckpt._src.errors import (
    CheckpointError,
    StructureMismatchError,
    UnsupportedLeafError,
    UnsupportedOrbaxCheckpointError,
    format_list,
)
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.orbax.locate import (
    CHECKPOINT_METADATA,
    COMMIT_SUCCESS,
    CRC_SUFFIX,
    DEFAULT_ITEM,
    JSON_HANDLER,
    METRICS_ITEM,
    PYTREE_HANDLER,
    SHARDING,
    STANDARD_HANDLER,
    STRINGS,
    TMP_SUFFIX,
    TREE_METADATA,
    handler_kind,
    is_grain,
    process_file,
)
from flax_ckpt._src.orbax.read import OCDBT_FILE_SIZE, array_kvstore, context_for
from flax_ckpt._src.storage import Storage
from flax_ckpt._src.storage.local import fsync_all

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
    import tensorstore as ts
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)
    ts = lazy("tensorstore", globals(), "ts")  # imported on first use (lazy.py)

_EMPTY_VALUE_TYPES = {"none": "None", "dict": "Dict", "list": "List", "tuple": "Tuple"}


def param(lf: HostLeaf) -> str:
    """Orbax's parameter name: the key path joined with '.'."""
    return _param(lf.path)


@functools.lru_cache(maxsize=1 << 16)  # a run saves the same key paths at every step
def _param(path: tuple) -> str:
    return ".".join([str(k) for _, k in path])


def value_type(lf: HostLeaf) -> str:
    kind = lf.record.kind
    if kind in ("jax", "prng_key"):
        return "jax.Array"
    if kind in ("numpy", "scalar"):
        return "np.ndarray" if kind == "numpy" else "scalar"
    if kind == "string":
        return "string"
    namedtuple = isinstance(lf.obj, tuple) and hasattr(lf.obj, "_fields")
    return "None" if namedtuple else _EMPTY_VALUE_TYPES[lf.record.value]


def _array(lf: HostLeaf) -> tuple[tuple[int, ...], np.dtype, list[tuple[tuple, np.ndarray]]] | None:
    """Shape, dtype and (box, data) shards of an array leaf; a Python scalar as the 0-d array Orbax
    stores it as; None for other leaves."""
    if lf.record.kind == "scalar":
        a = np.asarray(lf.record.value)
        return (), a.dtype, [((), a)]
    if not lf.record.is_array:
        return None
    return lf.record.array_shape, lf.record.array_dtype, [(s.box, s.data) for s in lf.shards]


def write_shape(lf: HostLeaf) -> tuple[int, ...] | None:
    """The per-device shard shape of a jax.Array (what Orbax chunks by); None for host values."""
    s = lf.sharding
    if s is None:
        return None
    if isinstance(s, jax.sharding.SingleDeviceSharding):  # the whole array (no hashing of the sharding)
        return tuple(lf.record.array_shape)
    return _shard_shape(s, tuple(lf.record.array_shape))


@functools.lru_cache(maxsize=4096)  # a state's leaves share a few shardings and shapes
def _shard_shape(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(d) for d in sharding.shard_shape(shape))


def check(snap: Snapshot) -> None:
    """Refuses, before anything is written, a tree Orbax's layout cannot hold (UnsupportedLeafError)."""
    slash = [lf.record.name for lf in snap.leaves if any("/" in str(k) for _, k in lf.path)]
    seen: dict[str, str] = {}
    clash = []
    for lf in snap.leaves:
        other = seen.setdefault(param(lf), lf.record.name)
        if other != lf.record.name:
            clash.append(f"{other!r} and {lf.record.name!r} (both {param(lf)!r})")
    dtypes = []
    for lf in snap.leaves:
        arr = _array(lf)
        if arr is not None and arr[1].hasobject:
            raise UnsupportedLeafError(
                f"{lf.record.name}: {lf.record.value!r} does not fit int64/uint64; Orbax "
                "stores Python scalars as fixed-width arrays"
            )
        if arr is not None and not _ts_dtype_ok(arr[1]):
            dtypes.append(f"{lf.record.name} ({arr[1].name})")
    if slash or clash or dtypes:
        raise UnsupportedLeafError(
            "cannot save in Orbax's layout (nothing was written): "
            + (f"keys holding '/': {format_list(slash)}; " if slash else "")
            + (
                f"key paths that Orbax's '.'-joined parameter names confuse: {'; '.join(clash)}; "
                if clash
                else ""
            )
            + (f"dtypes tensorstore (hence Orbax) cannot store: {', '.join(dtypes)}; " if dtypes else "")
            + "rename those keys or cast those leaves, or save in flax_ckpt's own format."
        )


@functools.lru_cache(maxsize=None)
def _ts_dtype_ok(dtype: np.dtype) -> bool:
    try:
        ts.dtype(dtype.name)
        return True
    except (ValueError, TypeError):
        return False


def single_process() -> None:
    if distributed.process_count() > 1:
        raise UnsupportedOrbaxCheckpointError(
            "saving in Orbax's layout from several processes is not supported (it needs Orbax's "
            "per-process OCDBT merge); save in flax_ckpt's format, which any process count restores"
        )


def _chunk_shape(shape: tuple[int, ...], dtype: np.dtype, ws: tuple[int, ...] | None) -> list[int]:
    """The shard shape, halved along even dimensions while a chunk exceeds OCDBT's target file size
    (so chunks still tile each shard exactly and no two shards write one chunk)."""
    return list(_chunk_tuple(tuple(shape), dtype, ws))


@functools.lru_cache(maxsize=4096)  # a state's leaves share a few shapes
def _chunk_tuple(shape: tuple[int, ...], dtype: np.dtype, ws: tuple[int, ...] | None) -> tuple[int, ...]:
    chunk = [max(1, d) for d in (ws if ws is not None else shape)]
    while math.prod(chunk) * dtype.itemsize > OCDBT_FILE_SIZE:
        even = [i for i, d in enumerate(chunk) if d % 2 == 0]
        if not even:
            break
        i = max(even, key=lambda j: chunk[j])
        chunk[i] //= 2
    return tuple(chunk)


def _zarr_metadata(
    shape: tuple[int, ...], chunk: list[int], use_zarr3: bool, compression: bool
) -> dict[str, Any]:
    if not use_zarr3:
        return {
            "shape": list(shape),
            "chunks": chunk,
            "compressor": {"id": "zstd", "level": 1} if compression else None,
        }
    inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression:
        inner.append({"name": "zstd", "configuration": {"level": 3}})
    inner.append({"name": "crc32c"})  # each chunk's (compressed) bytes checksummed: verified on every read
    codec = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": chunk,
            "codecs": inner,
            "index_location": "end",
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
    }
    return {
        "shape": list(shape),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        "codecs": [codec],
    }


def _write_arrays(
    storage: Storage, arrays: list[HostLeaf], use_ocdbt: bool, use_zarr3: bool, compression: bool
) -> Callable[[], None]:
    """Starts writing the array leaves with tensorstore; returns the call that finishes (waits for every
    write, raising the first failure). The small arrays' OCDBT transaction commits on tensorstore's
    threads until then. In a local folder, with OCDBT, tensorstore does not fsync (each of its fsyncs
    would wait for the one before it: the data file, its folder, the manifest, the item folder): the
    files it wrote are fsynced by the finishing call, all at once, and the commit fsyncs the folders.
    Nothing is visible before the commit's rename, so the order of fsyncs within the folder is free."""
    context = context_for(storage)
    unsynced = use_ocdbt and storage.local_path is not None
    if unsynced:
        context = ts.Context(ts.Context.Spec({"file_io_sync": False}), context)
    small = []
    if use_ocdbt and use_zarr3:  # small arrays as key-value pairs of one OCDBT commit
        small = [(lf, data) for lf in arrays if (data := _one_chunk(lf)) is not None]
    done = {id(lf) for lf, _ in small}
    wait_small = _write_small(storage, small, compression, context)

    def finish() -> None:
        try:
            rest = [lf for lf in arrays if id(lf) not in done]
            _write_with(storage, rest, use_ocdbt, use_zarr3, compression, context)
        finally:
            wait_small()
        if unsynced:
            _sync_written(storage)

    return finish


def _sync_written(item: Storage) -> None:
    """fsyncs, all at once, every file below ``item`` except the side files (fsynced when written)."""
    root, side = (
        item.local_path,
        {
            TREE_METADATA,
            SHARDING,
            STRINGS,
            STRINGS + CRC_SUFFIX,
            COMMIT_SUCCESS,
            CHECKPOINT_METADATA,
            "array_metadatas/process_0",
        },
    )
    assert root is not None
    files = [
        os.path.join(d, f)
        for d, _, names in os.walk(root)
        for f in names
        if os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") not in side
    ]
    fsync_all(files)


def _write_with(
    storage: Storage,
    arrays: list[HostLeaf],
    use_ocdbt: bool,
    use_zarr3: bool,
    compression: bool,
    context: ts.Context,
) -> None:
    """Writes ``arrays`` through tensorstore, each array opened on its own."""
    opened = []
    for lf in arrays:
        got = _array(lf)
        assert got is not None, f"{lf.record.name} is an array leaf"
        shape, dtype, shards = got
        spec = {
            "driver": "zarr3" if use_zarr3 else "zarr",
            "dtype": dtype.name,
            "kvstore": array_kvstore(storage, param(lf), use_ocdbt, write=True),
            "metadata": _zarr_metadata(
                shape, _chunk_shape(shape, dtype, write_shape(lf)), use_zarr3, compression
            ),
            "store_data_equal_to_fill_value": True,
            "recheck_cached_data": False,
            "recheck_cached_metadata": False,
        }
        opened.append((lf, shape, dtype, shards, ts.open(spec, create=True, open=True, context=context)))
    writes, failure = [], None
    for lf, shape, dtype, shards, fut in opened:
        try:
            store = fut.result()
        except Exception as e:
            failure = failure or UnsupportedLeafError(
                f"{lf.record.name}: tensorstore cannot store {dtype}{list(shape)} in Orbax's layout: {e}"
            )
            continue
        writes += [
            (lf, store[tuple(slice(a, b) for a, b in box)].write(data)) for box, data in shards if data.size
        ]
    for lf, w in writes:  # wait for every write, even after a failure, before anyone deletes the folder
        try:
            w.result()
        except Exception as e:
            failure = failure or CheckpointError(f"{storage.url}: writing {lf.record.name!r} failed: {e}")
    if failure is not None:
        raise failure


# ------------------------------------------------------------------ small arrays, encoded here
# Tensorstore opens each array on its own (spec parsing, its metadata written and read back, a write of
# its own): about 0.1 ms of CPU an array, which is most of a save of many small leaves. An array that is
# one chunk of at most _SMALL bytes is encoded here instead, exactly as tensorstore encodes it for
# _zarr_metadata's codecs (zarr3, one sharding_indexed shard holding one chunk: the bytes, zstd, their
# crc32c, then the shard index, (offset, length) as little-endian uint64, and its crc32c), and all of
# them are written into the item's OCDBT database in one transaction: one commit instead of one each.

_SMALL = 64 << 10  # larger arrays: tensorstore, which compresses them on several threads
_ZARR3_TYPES = {
    "bool": False,
    "int8": 0,
    "int16": 0,
    "int32": 0,
    "int64": 0,
    "uint8": 0,
    "uint16": 0,
    "uint32": 0,
    "uint64": 0,
    "float16": 0.0,
    "bfloat16": 0.0,
    "float32": 0.0,
    "float64": 0.0,
    "complex64": [0.0, 0.0],
    "complex128": [0.0, 0.0],
}  # data_type: fill_value (tensorstore's)


def _one_chunk(lf: HostLeaf) -> np.ndarray | None:
    """The whole array of a leaf stored as one chunk of at most _SMALL bytes, in a dtype encoded here."""
    arr = _array(lf)
    if arr is None:
        return None
    shape, dtype, shards = arr
    shape = tuple(shape)
    if _zarr3_type(dtype) is None or dtype.itemsize * math.prod(shape) > _SMALL or 0 in shape:
        return None
    if _chunk_tuple(shape, dtype, write_shape(lf)) != _whole_chunk(shape):
        return None
    if len(shards) == 1 and shards[0][1].shape == shape:  # one shard of the array's shape: all of it
        return np.asarray(shards[0][1])
    whole = tuple((0, d) for d in shape)
    return next(
        (np.asarray(data) for box, data in shards if tuple(map(tuple, box)) == whole and data.shape == shape),
        None,
    )


@functools.lru_cache(maxsize=None)
def _key_folder(name: str) -> str:
    """Where the keys of the array of parameter ``name`` start in the item's OCDBT database: under
    ``<name>/``, or at its root for the parameter "" (a top-level "" key: the path tensorstore reads, as
    Orbax writes it)."""
    return f"{name}/" if name else ""


def _chunk_key(rank: int) -> str:
    """The key of an array's one chunk (zarr3's default chunk key encoding)."""
    return "/".join(["c"] + ["0"] * rank)


@functools.lru_cache(maxsize=4096)
def _whole_chunk(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(max(1, d) for d in shape)


@functools.lru_cache(maxsize=None)
def _zarr3_type(dtype: np.dtype) -> str | None:
    return dtype.name if dtype.name in _ZARR3_TYPES and dtype.byteorder in "=<|" else None


@functools.lru_cache(maxsize=4096)
def _zarr_json(shape: tuple[int, ...], dtype: np.dtype, compression: bool) -> bytes:
    """The zarr.json tensorstore writes for _zarr_metadata's array of one chunk."""
    meta = _zarr_metadata(shape, [max(1, d) for d in shape], True, compression)
    del meta["codecs"][0]["configuration"]["index_location"]  # "end", the default, which tensorstore omits
    for codec in meta["codecs"][0]["configuration"]["codecs"]:
        if codec["name"] == "bytes" and dtype.itemsize == 1:
            del codec["configuration"]  # tensorstore's normal form: no byte order for one-byte types
        elif codec["name"] == "zstd":
            codec["configuration"]["checksum"] = False
    meta.update(
        chunk_key_encoding={"name": "default"},
        data_type=dtype.name,
        fill_value=_ZARR3_TYPES[dtype.name],
        node_type="array",
        zarr_format=3,
    )
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def _shards(datas: list[np.ndarray], compressor: Any) -> list[bytes]:
    """One zarr3 shard for each of ``datas``, holding it as its only chunk: its bytes (compressed, on
    zstandard's threads where it can), their crc32c, the shard index ((offset, length) as little-endian
    uint64) and its crc32c."""
    raws = [np.ascontiguousarray(d, dtype=d.dtype.newbyteorder("<")).tobytes() for d in datas]
    if compressor is None:
        bodies = raws
    else:
        try:
            bodies = [b.tobytes() for b in compressor.multi_compress_to_buffer(raws, threads=-1)]
        except (AttributeError, NotImplementedError):  # zstandard's cffi backend has no batch compression
            bodies = [compressor.compress(r) for r in raws]
    return [_framed(body) for body in bodies]


def _framed(body: bytes) -> bytes:
    chunk = body + crc32c.crc32c(body).to_bytes(4, "little")
    index = _index(len(chunk))
    return chunk + index


@functools.lru_cache(maxsize=4096)
def _index(length: int) -> bytes:
    index = (0).to_bytes(8, "little") + length.to_bytes(8, "little")
    return index + crc32c.crc32c(index).to_bytes(4, "little")


def _write_small(
    storage: Storage, arrays: list[tuple[HostLeaf, np.ndarray]], compression: bool, context: ts.Context
) -> Callable[[], None]:
    """Starts writing ``arrays`` (leaves with their _one_chunk) into the item's OCDBT database, in one
    transaction; returns the call that waits for its commit (a CheckpointError if it failed)."""
    if not arrays:
        return lambda: None
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3) if compression else None
    where = f"{storage.url}: writing {len(arrays)} arrays into its OCDBT database failed"
    txn = ts.Transaction(atomic=True)
    try:
        kv = ts.KvStore.open(array_kvstore(storage, "", True, write=True), context=context).result()
        view, writes = kv.with_transaction(txn), []
        for (lf, data), shard in zip(arrays, _shards([data for _, data in arrays], compressor)):
            folder, shape = _key_folder(param(lf)), data.shape
            writes.append(view.write(f"{folder}zarr.json", _zarr_json(shape, data.dtype, compression)))
            writes.append(view.write(f"{folder}{_chunk_key(len(shape))}", shard))
        commit = txn.commit_async()
    except Exception as e:
        txn.abort()
        raise CheckpointError(f"{where}: {e}") from e

    def wait() -> None:
        try:
            commit.result()
            for w in writes:
                w.result()
        except Exception as e:
            raise CheckpointError(f"{where}: {e}") from e

    return wait


def _json_bytes(obj: Any) -> bytes:
    """A JSON file of the step, refused (CheckpointError, before the commit) if restore would not read it."""
    return checks.check_written(json.dumps(obj).encode(), "Orbax metadata (a JSON file of the step)")


def _write_checked(storage: Storage, name: str, data: bytes) -> None:
    """A JSON data file (Orbax gives it no checksum) with its crc32c beside it, ``<name>.crc32c``,
    which flax_ckpt checks on read and verify reports as verified; Orbax reads only ``name``. Refused
    (before the commit) when restore would not read it back (checks.check_written)."""
    storage.write(name, [checks.check_written(data, f"JSON item file {name}")])
    storage.write(name + CRC_SUFFIX, [str(crc32c.crc32c(data)).encode()])


def _tree_metadata(snap: Snapshot, use_ocdbt: bool, use_zarr3: bool) -> bytes:
    """``_METADATA`` as json.dumps writes it, joined from each leaf's entry (the same at every step)."""
    entries = ", ".join([_tree_entry(lf.path, value_type(lf), write_shape(lf)) for lf in snap.leaves])
    rest = _json_bytes(
        {
            "use_ocdbt": use_ocdbt,
            "use_zarr3": use_zarr3,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        }
    )
    return checks.check_written(
        b'{"tree_metadata": {' + entries.encode() + b"}, " + rest[1:], "Orbax _METADATA"
    )


@functools.lru_cache(maxsize=1 << 16)  # a run saves the same key paths at every step
def _tree_entry(path: tuple, vt: str, ws: tuple[int, ...] | None) -> str:
    value: dict[str, Any] = {"value_type": vt, "skip_deserialize": vt in ("None", "Dict", "List", "Tuple")}
    if ws is not None:
        value["write_shape"] = list(ws)
    keys = [{"key": str(k), "key_type": 1 if kind == "idx" else 2} for kind, k in path]
    key = json.dumps(str(tuple(str(k) for _, k in path)))
    return f"{key}: {json.dumps({'key_metadata': keys, 'value_metadata': value})}"


@functools.lru_cache(maxsize=1024)
def _sharding_json(s: jax.sharding.Sharding) -> str | None:
    """json.dumps of _sharding_of(s), or None."""
    d = _sharding_of(s)
    return None if d is None else json.dumps(d)


def _sharding_of(s: jax.sharding.Sharding | None) -> dict[str, Any] | None:
    """Orbax's ``_sharding`` description of a jax sharding (None: Orbax writes none either)."""
    if isinstance(s, jax.sharding.NamedSharding):
        assert isinstance(s.mesh, jax.sharding.Mesh), "an array's sharding has devices"
        ids = np.vectorize(lambda d: {"id": int(d.id)}, otypes=[object])(s.mesh.devices).tolist()
        spec = [p if p is None or isinstance(p, str) else list(p) for p in s.spec]
        return {
            "sharding_type": "NamedSharding",
            "shape": [int(n) for n in s.mesh.devices.shape],
            "axis_names": [str(a) for a in s.mesh.axis_names],
            "axis_types": [str(a) for a in s.mesh.axis_types],
            "partition_spec": spec,
            "device_mesh": {"mesh": ids},
        }
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return {"sharding_type": "SingleDeviceSharding", "device_str": str(next(iter(s.device_set)))}
    return None


def _array_metadatas(arrays: list[HostLeaf], names: list[str]) -> bytes | None:
    """``array_metadatas/process_0`` as json.dumps writes it, joined from each jax array's entry (``names``:
    the arrays' parameter names); None without jax arrays."""
    entries = []
    for lf, name in zip(arrays, names):
        ws = write_shape(lf)
        if ws is not None and value_type(lf) == "jax.Array":
            chunk = _chunk_tuple(tuple(lf.record.array_shape), lf.record.array_dtype, ws)
            entries.append(_array_entry(name, ws, chunk, lf.record.key_impl))
    if not entries:
        return None
    raw = b'{"array_metadatas": [' + ", ".join(entries).encode() + b"]}"
    return checks.check_written(raw, "Orbax array_metadatas")


@functools.lru_cache(maxsize=1 << 16)  # a run saves the same arrays at every step
def _array_entry(name: str, ws: tuple[int, ...], chunk: tuple[int, ...], key_impl: str | None) -> str:
    ext = {"random_key_impl": key_impl} if key_impl else None
    return json.dumps(
        {
            "array_metadata": {
                "param_name": name,
                "write_shape": list(ws),
                "chunk_shape": list(chunk),
                "ext_metadata": ext,
            }
        }
    )


def write_item(
    storage: Storage,
    snap: Snapshot,
    *,
    use_ocdbt: bool = True,
    use_zarr3: bool = True,
    compression: bool = True,
) -> None:
    """Writes one Orbax pytree item (arrays, ``_METADATA`` and side files) into ``storage``. The side
    files are made while tensorstore commits the small arrays, and written (each fsynced) on other
    threads while the other arrays are: their fsyncs overlap."""
    arrays = [lf for lf in snap.leaves if _array(lf) is not None]
    finish = _write_arrays(storage, arrays, use_ocdbt, use_zarr3, compression)
    try:
        files = _side_files(snap, arrays, use_ocdbt, use_zarr3)
    except BaseException:
        finish()  # every write ended before anyone deletes the folder
        raise
    _overlapped([functools.partial(storage.write, name, [data]) for name, data in files], finish)


def _overlapped(writes: list[Callable[[], Any]], main: Callable[[], Any]) -> None:
    """Runs ``writes`` (small files, each written and fsynced) on other threads while ``main`` runs on
    this one, so that their fsyncs overlap; returns once all ended, raising the first failure."""
    pending = [_files_pool().submit(w) for w in writes]
    try:
        main()
    finally:
        for f in pending:  # every write ended, even after a failure, before anyone deletes the folder
            f.exception()
    for f in pending:
        f.result()


@functools.lru_cache(maxsize=1 << 16)  # a run saves the same key paths at every step
def _b64(name: str) -> str:
    return base64.urlsafe_b64encode(name.encode()).decode()


def _side_files(
    snap: Snapshot, arrays: list[HostLeaf], use_ocdbt: bool, use_zarr3: bool
) -> list[tuple[str, bytes]]:
    """An item's files besides its arrays: ``_sharding``, ``_strings.json`` (with its crc32c),
    ``array_metadatas/process_0`` and ``_METADATA``, as (name, bytes)."""
    files = []
    names = [param(lf) for lf in arrays]
    shardings = {
        _b64(name): text
        for lf, name in zip(arrays, names)
        if lf.sharding is not None and (text := _sharding_json(lf.sharding)) is not None
    }
    strings = {param(lf): lf.record.value for lf in snap.leaves if lf.record.kind == "string"}
    if shardings:
        files.append((SHARDING, _json_bytes(shardings)))
    if strings:
        data = _json_bytes(strings)
        files += [(STRINGS, data), (STRINGS + CRC_SUFFIX, str(crc32c.crc32c(data)).encode())]
    metadatas = _array_metadatas(arrays, names)
    if metadatas is not None:
        files.append(("array_metadatas/process_0", metadatas))
    files.append((TREE_METADATA, _tree_metadata(snap, use_ocdbt, use_zarr3)))
    return files


_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _files_pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(8, thread_name_prefix="flax_ckpt-orbax-files"))
        return _POOL[0]


def _handler_for(snap: Snapshot) -> str:
    """StandardCheckpointHandler where orbax's would accept the tree (no strings), else PyTree's."""
    return PYTREE_HANDLER if any(lf.record.kind == "string" for lf in snap.leaves) else STANDARD_HANDLER


def _success(storage: Storage) -> bytes:
    return f"Checkpoint commit was successful to {storage.url}".encode()


def _commit_folder(parent: Storage, name: str, write: Callable[[Storage], Any], meta: dict[str, Any]) -> None:
    """Writes ``name`` atomically with the engine's commit: ``write(folder)`` and, beside it,
    ``_CHECKPOINT_METADATA``, then ``commit_success.txt`` as the commit record. Refuses an existing
    checkpoint."""
    staging = commit_mod.staging_name(
        parent, name, record=COMMIT_SUCCESS, mark=TMP_SUFFIX + "-", nonce=str(time.time_ns())
    )
    folder = parent.sub(staging)
    try:
        meta = dict(meta, commit_timestamp_nsecs=time.time_ns())
        _overlapped(
            [functools.partial(folder.write, CHECKPOINT_METADATA, [_json_bytes(meta)])], lambda: write(folder)
        )
        commit_mod.commit(parent, staging, name, COMMIT_SUCCESS, _success(folder))
    except BaseException:
        commit_mod.abort(parent, staging, COMMIT_SUCCESS)
        raise


def _step_meta(
    handlers: str | dict[str, str], custom: Any, metrics: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``_CHECKPOINT_METADATA`` as orbax 0.12.8 writes it (a step's metrics live in its ``metrics``
    item; a StandardCheckpointer folder's in the ``metrics`` field, where Orbax's metadata has them)."""
    return {
        "item_handlers": handlers,
        "metrics": metrics or {},
        "performance_metrics": {},
        "init_timestamp_nsecs": time.time_ns(),
        "commit_timestamp_nsecs": None,
        "custom_metadata": custom if custom is not None else {},
    }


def save_item(
    parent: Storage,
    name: str,
    snap: Snapshot,
    *,
    metadata: Any = None,
    metrics: Any = None,
    use_ocdbt: bool = True,
    use_zarr3: bool = True,
    compression: bool = True,
) -> None:
    """A StandardCheckpointer-style folder ``parent/name`` that ``ocp.StandardCheckpointer().restore(path,
    abstract_tree)`` and ``ocp.PyTreeCheckpointer().restore`` read. ``metadata`` goes to
    ``_CHECKPOINT_METADATA``'s custom_metadata, ``metrics`` to its metrics."""
    single_process()
    snap.complete()  # shards still on their devices come to host first (a no-op once they are)
    custom = jsonable(metadata, "metadata")
    metrics = metrics_json(metrics)
    _commit_folder(
        parent,
        name,
        lambda f: write_item(f, snap, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3, compression=compression),
        _step_meta(_handler_for(snap), custom, metrics),
    )


@dataclass
class StepSnapshot(Snapshot):
    """A snapshot of a step of named items, as the Orbax run it continues has them (``args.Composite``):
    the pytree items' leaves (key paths starting with the item's name) and each JSON item's JSON.
    ``handlers``: {item name: the handler the run's newest step records for it}."""

    handlers: dict[str, str] = field(default_factory=dict)
    json_items: dict[str, Any] = field(default_factory=dict)


def check_items(tree: Any, handlers: dict[str, str], where: str) -> dict[str, Any]:
    """The JSON items' values of ``tree`` (as stored) for a new step of an Orbax run of named items
    ``handlers`` ({item name: handler}). Refuses, before anything is written, a tree that is not a dict
    keyed by exactly those names (StructureMismatchError naming both), a JSON item whose value is not
    JSON and items of handlers flax_ckpt does not write (UnsupportedLeafError /
    UnsupportedOrbaxCheckpointError)."""
    names = sorted(handlers)
    refused = {n: h for n, h in handlers.items() if handler_kind(h) == "unknown"}
    if refused:
        raise UnsupportedOrbaxCheckpointError(
            f"{where} is an Orbax run whose steps hold items of handlers flax_ckpt does not write: "
            + ", ".join(f"{n!r} ({h})" for n, h in sorted(refused.items()))
            + "; nothing was written. Continue this run with orbax-checkpoint, or give the flax_ckpt run a "
            "directory of its own."
        )
    pytree = [n for n in names if handler_kind(handlers[n]) == "pytree"]
    json_names = [n for n in names if handler_kind(handlers[n]) == "json"]
    keys = list(tree) if isinstance(tree, Mapping) else None
    if keys is None or sorted(map(str, keys)) != names or not all(isinstance(k, str) for k in keys):
        kinds = " and ".join(
            ([f"the pytree items {format_list(pytree)}"] if pytree else [])
            + ([f"the JSON items {format_list(json_names)}"] if json_names else [])
        )
        if keys is None:
            found = f"the saved value is a {type(tree).__name__}"
        else:
            missing = sorted(set(names) - set(map(str, keys)))
            extra = sorted(set(map(str, keys)) - set(names))
            detail = "; ".join(
                ([f"missing: {format_list(missing)}"] if missing else [])
                + ([f"not items of the run: {format_list(extra)}"] if extra else [])
            )
            found = (
                f"the saved dict has the keys {', '.join(sorted(map(repr, keys)))}"
                if keys
                else "the saved dict is empty"
            ) + (f" ({detail})" if detail else "")
        example = ", ".join(f"{n!r}: ..." for n in names[:3]) + (", ..." if len(names) > 3 else "")
        raise StructureMismatchError(
            f"{where} is an Orbax run of named items (args.Composite): its steps hold {kinds}, so a new step "
            f"is a dict keyed by exactly those names; {found}. Nothing was written. Save {{{example}}} (pytree "
            "items as trees of arrays, JSON items as JSON), or give a run of other items a directory of its own."
        )
    json_items = {}
    for n in json_names:
        if is_grain(handlers[n]):
            json_items[n] = _grain_item(tree[n], n, where)
            continue
        try:
            json_items[n] = jsonable(tree[n], f"the JSON item {n!r}")
        except CheckpointError as e:
            raise UnsupportedLeafError(
                f"{where}: {e}. The run's steps hold {n!r} as a JSON item (Orbax's JsonSave), so its value must be "
                "JSON: dicts with string keys, lists, strings, numbers, booleans, None; nothing was written. "
                "Convert it (e.g. int(x), x.tolist()), or keep arrays in a pytree item."
            ) from None
    return json_items


def _grain_item(value: Any, name: str, where: str) -> bytes:
    """``grain_text`` of a grain item's value, or an UnsupportedLeafError saying what the item holds."""
    try:
        return grain_text(value, name)
    except CheckpointError as e:
        raise UnsupportedLeafError(
            f"{where}: {e}. The run's steps hold {name!r} as grain's data item (PyGrainCheckpointSave), so its "
            "value is the iterator's get_state(): save {..., " + repr(name) + ": iterator.get_state()}, or "
            "give the iterator itself to CheckpointCallback, which does that; nothing was written."
        ) from None


def grain_text(value: Any, name: str) -> bytes:
    """The file grain's handler writes for a data iterator's state ``value`` (``get_state()``): a
    DataLoaderIterator's bytes (or a str of them) as they are, a DatasetIterator's dict as
    ``json.dumps(value, indent=4)``; CheckpointError for bytes that are not UTF-8 text or a value that is
    not JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            bytes(value).decode()
        except UnicodeDecodeError as e:
            raise CheckpointError(
                f"the grain item {name!r} is {len(bytes(value))} bytes that are not UTF-8 text ({e}); grain's "
                "handler stores a DataLoaderIterator's state as text"
            ) from None
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    return json.dumps(jsonable(value, f"the grain item {name!r}"), indent=4).encode()


def item_snapshot(snap: Snapshot, name: str) -> Snapshot:
    """The leaves of pytree item ``name`` of a StepSnapshot, with key paths relative to the item."""
    leaves = [
        dataclasses.replace(lf, record=dataclasses.replace(lf.record, path=lf.path[1:]))
        for lf in snap.leaves
        if lf.path and lf.path[0][1] == name
    ]
    return Snapshot(leaves, sum(s.data.nbytes for lf in leaves for s in lf.shards))


def check_item_roots(snap: Snapshot) -> None:
    """Refuses pytree items that are a single leaf (Orbax's items are trees of leaves)."""
    bare = [f"{lf.path[0][1]!r} ({lf.record.kind})" for lf in snap.leaves if len(lf.path) == 1]
    if bare:
        raise UnsupportedLeafError(
            f"the pytree items {', '.join(bare)} are a single value or an empty container, not a tree of "
            "leaves, which is what Orbax stores as a pytree item; nothing was written. Wrap the value in a "
            "dict (e.g. {'value': x})."
        )


def _json_file(handler: str) -> str:
    """The file a JSON item's value lives in: the v1 API's JsonHandler reads ``data.json``,
    JsonCheckpointHandler ``metadata``."""
    return "data.json" if handler.rsplit(".", 1)[-1] == "JsonHandler" else "metadata"


def _write_json_item(folder: Storage, filename: str, value: Any) -> None:
    _write_checked(folder, filename, _json_bytes(value))
    folder.write(COMMIT_SUCCESS, [_success(folder)])


def save_step(
    root: Storage,
    step: int,
    snap: Snapshot,
    *,
    metrics: dict[str, Any] | None = None,
    metadata: Any = None,
    use_ocdbt: bool = True,
    use_zarr3: bool = True,
    name: str | None = None,
) -> str:
    """Writes ``<root>/<name>`` (default: ``<step>``) as an Orbax CheckpointManager step: item
    ``default`` (or, for a StepSnapshot, the run's named items, each with the handler the run records
    for it), plus a ``metrics`` JSON item; returns its URL."""
    single_process()
    snap.complete()  # shards still on their devices come to host first (a no-op once they are)
    metrics = metrics_json(metrics)
    custom = jsonable(metadata, "metadata")
    if isinstance(snap, StepSnapshot):
        trees = {n: item_snapshot(snap, n) for n, h in snap.handlers.items() if handler_kind(h) == "pytree"}
        handlers = {
            n: _handler_for(trees[n]) if n in trees and h == STANDARD_HANDLER else h
            for n, h in snap.handlers.items()
        }
        json_items = {n: snap.json_items[n] for n in snap.handlers if n not in trees}
    else:
        trees, handlers, json_items = {DEFAULT_ITEM: snap}, {DEFAULT_ITEM: _handler_for(snap)}, {}
    if metrics is not None:
        handlers[METRICS_ITEM] = JSON_HANDLER
    root.makedirs()

    def write(folder: Storage) -> None:
        for n, tree in trees.items():
            item = folder.sub(n)
            _overlapped(
                [functools.partial(item.write, COMMIT_SUCCESS, [_success(item)])],
                functools.partial(write_item, item, tree, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3),
            )
        for n, value in json_items.items():
            if is_grain(handlers[n]):  # grain's layout: this process's file, its state's text
                _write_checked(folder.sub(n), process_file(), value)
                folder.sub(n).write(COMMIT_SUCCESS, [_success(folder.sub(n))])
                continue
            _write_json_item(folder.sub(n), _json_file(handlers[n]), value)
        if metrics is not None:
            _write_json_item(folder.sub(METRICS_ITEM), METRICS_ITEM, metrics)

    name = str(int(step)) if name is None else name
    _commit_folder(root, name, write, _step_meta(handlers, custom))
    return root.sub(name).url


__all__ = [
    "StepSnapshot",
    "check",
    "check_item_roots",
    "check_items",
    "save_item",
    "save_step",
    "single_process",
    "write_item",
]
