"""Save and restore of one checkpoint: snapshot -> serializer -> commit, and manifest -> target.

Scope: a single checkpoint folder. ``snapshot`` runs on the caller's thread (device-to-host copies);
``write_snapshot`` and ``commit`` may run in the background (writer.py). Scheduling, retention and tiers
belong to the manager; multi-process agreement to distributed.py; the byte layout to the serializers.
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src import distributed as distributed
from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.errors import (CheckpointError, CheckpointNotCommittedError, CheckpointNotFoundError,
                     CorruptCheckpointError, InvalidManifestError, LeafMismatchError, StructureMismatchError,
                     format_list)
from flax_ckpt._src.format import MANIFEST, MAX_MANIFEST_BYTES, boxes_disjoint, decode, dtype_from_name, dtype_name, encode
from flax_ckpt._src.serializers import ArrayItem, Box, Serializer, Shard, Written, box_of, get_serializer
from flax_ckpt._src.storage import LocalStorage, Storage, split_location

_IO_THREADS = 8
_REMOTE_THREADS = 32  # object stores: reads in flight at once
_BIG_LEAF = 1 << 20  # restore reads leaves of at least this many bytes on a pool
_ALIGN = 64  # restored host buffers start on this boundary (see _aligned_empty)
_BUDGET_SLACK = 64 << 20  # see Reader._reserve
ARRAY_KINDS = ("jax", "numpy", "prng_key")  # leaf kinds with a dtype, a shape and chunks


# ----------------------------------------------------------------------------------------------- save

@dataclass
class LeafPlan:
    """One leaf as the manifest will describe it, plus this process's host shards (arrays only)."""

    path: tree_mod.KeyPath
    record: dict[str, Any]
    shards: tuple[Shard, ...] = ()


@dataclass
class Snapshot:
    """A host copy of a tree: nothing in it changes when the caller's arrays are mutated or donated."""

    leaves: list[LeafPlan]
    nbytes: int  # bytes this process writes
    seconds: float = 0.0
    owned: bool = False  # every shard buffer was allocated by the snapshot (copy=True): reusable

    def spare_buffers(self) -> dict[tuple[Any, Box], np.ndarray]:
        """This snapshot's buffers by (key path, box), for ``snapshot(reuse=...)``; none unless owned.
        Read-only views (of CPU jax arrays) are never handed out."""
        if not self.owned:
            return {}
        return {(p.path, s.box): s.data for p in self.leaves for s in p.shards if s.data.flags.writeable}

    def items(self) -> list[ArrayItem]:
        return [ArrayItem(i, tree_mod.keystr(p.path), dtype_from_name(p.record["dtype"]),
                          tuple(p.record["shape"]), p.shards)
                for i, p in enumerate(self.leaves) if "dtype" in p.record]


def describe_sharding(s: Any) -> dict[str, Any] | None:
    if s is None:
        return None
    if isinstance(s, jax.sharding.NamedSharding):
        spec = [None if p is None else (p if isinstance(p, str) else list(p)) for p in s.spec]
        return {"type": "NamedSharding", "axis_names": list(s.mesh.axis_names),
                "mesh_shape": [int(n) for n in s.mesh.devices.shape], "spec": spec}
    return {"type": type(s).__name__, "num_devices": len(s.device_set)}


def host_array(x: Any, copy: bool) -> np.ndarray:
    """``x`` as a C-ordered numpy array: a fresh copy, or (copy=False) a view where one exists."""
    a = np.asarray(x)
    return np.array(a, order="C", copy=True) if copy else np.asarray(a, order="C")


def _host_into(spare: dict, key: tuple[Any, Box], x: Any, copy: bool) -> np.ndarray:
    """``host_array(x, copy)``, copying into the spare buffer of the same key, shape and dtype if there is one
    (already-faulted memory: several times cheaper to fill than a fresh allocation)."""
    buf = spare.get(key)
    if buf is None:
        return host_array(x, copy)
    a = np.asarray(x)
    if buf.shape != a.shape or buf.dtype != a.dtype:
        return host_array(a, copy)
    np.copyto(buf, a)
    return buf


def _array_plan(path, x: Any, kind: str, copy: bool, spare: dict | None = None) -> LeafPlan:
    rec: dict[str, Any] = {"path": tree_mod.path_to_json(path), "kind": kind}
    spare = spare if copy and spare else {}
    if kind == "prng_key":
        rec["key_impl"] = str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
        rec["key_shape"] = list(x.shape[x.ndim - len(_known_key_shape(rec["key_impl"])):])
    shape = tuple(int(d) for d in x.shape)
    rec.update(dtype=dtype_name(x.dtype), shape=list(shape))
    if isinstance(x, jax.Array):
        rec["sharding"] = describe_sharding(x.sharding)
        on_cpu = all(d.platform == "cpu" for d in x.sharding.device_set)
        boxes = [(s, box_of(s.index, shape)) for s in x.addressable_shards if s.replica_id == 0]
        # A CPU array's host view is already a snapshot: jax arrays are immutable, the view keeps the
        # buffer alive through x.delete(), and XLA never donates a buffer that has host views (it
        # allocates the output instead). So CPU arrays are not copied; other devices' are.
        shards = tuple(Shard(b, host_array(s.data, False) if on_cpu else _host_into(spare, (path, b), s.data, True))
                       for s, b in boxes)
    else:
        rec["sharding"] = None
        box = tuple((0, d) for d in shape)
        shards = (Shard(box, _host_into(spare, (path, box), x, copy)),)
    return LeafPlan(path, rec, shards)


def _value_record(path, x: Any, kind: str) -> dict[str, Any]:
    rec: dict[str, Any] = {"path": tree_mod.path_to_json(path), "kind": kind}
    if kind == "empty":
        rec["empty"] = tree_mod.empty_kind(x)
    elif kind == "string":
        rec["value"] = x
    else:  # Python scalar: ints and bools exactly in JSON, floats as their bytes (NaN payloads, -0.0)
        py = type(x).__name__ if type(x) in (bool, int, float, complex) else (
            "bool" if isinstance(x, bool) else "int" if isinstance(x, int) else
            "float" if isinstance(x, float) else "complex")
        rec["py_type"] = py
        rec["value"] = {"bool": bool, "int": int}[py](x) if py in ("bool", "int") else \
            np.asarray(x, np.float64 if py == "float" else np.complex128).tobytes().hex()
    return rec


def snapshot(tree: Any, *, copy: bool = True, reuse: Snapshot | None = None) -> Snapshot:
    """Copies every array this process writes to host memory (``copy=False`` reuses host buffers
    where possible: for synchronous saves, where nothing can change them meanwhile).

    ``reuse``: an earlier snapshot (copy=True) that nothing reads any more, e.g. the previous save's
    once it is durable; its buffers are overwritten where key path, box, shape and dtype match, which
    saves the page faults of fresh memory (most of a snapshot's time on a CPU host)."""
    t0 = time.perf_counter()
    spare = reuse.spare_buffers() if (copy and reuse is not None) else {}
    flat, _ = tree_mod.flatten(tree)
    kinds = tree_mod.classify_all(flat)
    for (_, x), kind in zip(flat, kinds):  # start every device-to-host transfer before waiting on any
        if kind == "jax" and not all(d.platform == "cpu" for d in x.sharding.device_set):
            x.copy_to_host_async()

    def plan(i: int) -> LeafPlan:
        (path, x), kind = flat[i], kinds[i]
        if kind in ("jax", "numpy", "prng_key"):
            return _array_plan(path, x, kind, copy, spare)
        return LeafPlan(path, _value_record(path, x, kind))

    big = [i for i, (_, x) in enumerate(flat) if getattr(x, "nbytes", 0) > (1 << 20)]
    leaves: list[Any] = [None] * len(flat)
    if len(big) > 1:
        with ThreadPoolExecutor(min(4, len(big))) as pool:
            for i, p in zip(big, pool.map(plan, big)):
                leaves[i] = p
    for i in range(len(flat)):
        if leaves[i] is None:
            leaves[i] = plan(i)
    nbytes = sum(s.data.nbytes for p in leaves for s in p.shards)
    return Snapshot(leaves, nbytes, time.perf_counter() - t0, owned=copy)


def write_snapshot(snap: Snapshot, storage: Storage, serializer: Serializer, tag: str = "p0",
                   process: int | None = None) -> Written:
    """Writes this process's shards. ``process`` (multi-process saves): leaves it holds no shard of are
    skipped, and host values (numpy leaves) are written by process 0 alone."""
    items = snap.items()
    if process is not None:
        items = [it for it in items if it.shards and (
            process == 0 or snap.leaves[it.leaf].record.get("sharding") is not None)]
    return serializer.write(storage, items, tag=tag)


def manifest_bytes(snap: Snapshot, written: list[Written], serializer: Serializer, *, step: int | None,
                   metrics: dict | None, metadata: Any, process_count: int = 1) -> bytes:
    leaves = []
    for i, p in enumerate(snap.leaves):
        rec = dict(p.record)
        if "dtype" in rec:
            rec["chunks"] = [c for w in written for c in w.chunks.get(i, [])]
        leaves.append(rec)
    files = {name: size for w in written for name, size in w.files.items()}
    body = {"step": step, "metrics": _jsonable(metrics, "metrics"), "metadata": _jsonable(metadata, "metadata"),
            "created": time.time(), "process_count": process_count, "serializer": serializer.name,
            "files": files, "leaves": leaves}
    return encode(body, check=True)


def _jsonable(obj: Any, what: str) -> Any:
    if obj is None:
        return None
    try:
        return json.loads(json.dumps(obj, default=_json_default))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must be JSON-serializable (no pickle is used): {e}") from None
    except RecursionError:
        raise CheckpointError(f"{what} is nested too deeply to store as JSON") from None


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.generic, np.ndarray, jax.Array)) and np.ndim(x) == 0:
        return np.asarray(x).item()
    raise TypeError(f"{type(x).__name__} is not JSON-serializable")


def split_path(path: Any) -> tuple[Storage, str]:
    """(parent storage, final name) of a checkpoint path, URL, kvstore spec or Storage."""
    return split_location(path)


def save(path: Any, tree: Any, *, metadata: Any = None, serializer: "str | Serializer | None" = None,
         step: int | None = None, metrics: dict | None = None, format: str = "flax_ckpt") -> None:
    """Synchronous, atomic save of ``tree`` to ``path`` (which must not exist).

    ``format="orbax"`` writes Orbax's layout (restorable by orbax-checkpoint; see orbax_compat)."""
    if format == "orbax":
        from flax_ckpt._src.orbax import compat as orbax_compat
        return orbax_compat.save(path, tree, metadata=metadata)
    if format != "flax_ckpt":
        raise ValueError(f"unknown format {format!r}; use 'flax_ckpt' or 'orbax'")
    parent, name = split_path(path)
    _jsonable(metadata, "metadata")
    snap = snapshot(tree, copy=False)
    persist(snap, parent, name, get_serializer(serializer), step=step, metrics=metrics, metadata=metadata)


@dataclass
class PersistTimes:
    """Seconds spent in each background phase of one save."""

    write: float = 0.0
    commit: float = 0.0
    fsync: float = 0.0  # part of write: summed over writer threads (local file systems)
    serialize: float = 0.0  # part of write: checksums, summed over writer threads
    written: int = 0  # bytes handed to storage (data files; local file systems)

    def add_clock(self, clock: Any) -> None:
        if clock is not None:
            self.fsync, self.serialize, self.written = clock.fsync_s, clock.serialize_s, clock.nbytes


def persist(snap: Snapshot, parent: Storage, name: str, serializer: Serializer, *, step: int | None,
            metrics: dict | None, metadata: Any) -> PersistTimes:
    """Writes a snapshot under ``parent/name`` and commits it atomically; on any failure removes what
    it wrote and re-raises. This is the whole path from a snapshot to durable bytes. With several
    processes (jax.distributed), every process calls it with its own snapshot; see _persist_shared."""
    if distributed.process_count() > 1:
        return _persist_shared(snap, parent, name, serializer, step=step, metrics=metrics, metadata=metadata)
    times = PersistTimes()
    staging = commit_mod.staging_name(parent, name)
    stage = parent.sub(staging)
    clock = getattr(stage, "clock", None)
    try:
        t0 = time.perf_counter()
        written = write_snapshot(snap, stage, serializer)
        t1 = time.perf_counter()
        data = manifest_bytes(snap, [written], serializer, step=step, metrics=metrics, metadata=metadata)
        commit_mod.commit(parent, staging, name, data)
        times.write, times.commit = t1 - t0, time.perf_counter() - t1
        times.add_clock(clock)
    except BaseException:
        commit_mod.abort(parent, staging)
        raise
    return times


def _persist_shared(snap: Snapshot, parent: Storage, name: str, serializer: Serializer, *, step: int | None,
                    metrics: dict | None, metadata: Any) -> PersistTimes:
    """persist() across processes: process 0 names the staging folder, each process writes its own
    shards there (files tagged p<i>) and publishes its chunk records, process 0 merges them into the
    manifest and commits; the others return once the commit is announced (distributed.SaveRound)."""
    times, rnd = PersistTimes(), distributed.SaveRound.begin(parent, name)
    staging = rnd.agree_staging(lambda: commit_mod.staging_name(parent, name))
    stage, digest = parent.sub(staging), distributed.tree_digest([p.record for p in snap.leaves])
    clock = getattr(stage, "clock", None)
    try:
        t0 = time.perf_counter()
        written = write_snapshot(snap, stage, serializer, tag=f"p{rnd.index}", process=rnd.index)
        t1 = time.perf_counter()
        if rnd.index:
            rnd.publish(stage, written, digest)
            rnd.await_commit()
        else:
            parts = rnd.gather(stage, written, digest)
            data = manifest_bytes(snap, parts, serializer, step=step, metrics=metrics, metadata=metadata,
                                  process_count=rnd.count)
            decode(data, f"{stage.url}/{MANIFEST}")  # the merged chunks must tile every array exactly
            commit_mod.commit(parent, staging, name, data)
            rnd.announce()
        times.write, times.commit = t1 - t0, time.perf_counter() - t1
        times.add_clock(clock)
    except BaseException as e:
        rnd.fail(e)
        if rnd.index == 0:
            commit_mod.abort(parent, staging)
        raise
    return times


# -------------------------------------------------------------------------------------------- restore

def read_manifest(storage: Storage) -> dict[str, Any]:
    """The validated manifest body of the checkpoint folder ``storage``."""
    where = f"{storage.url}/{MANIFEST}"
    try:
        raw = storage.read(MANIFEST, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        if isinstance(storage, LocalStorage) and not os.path.exists(storage.root):
            raise CheckpointNotFoundError(f"no checkpoint at {storage.url} (the path does not exist)") from None
        if isinstance(storage, LocalStorage) and not storage.isdir():
            raise CheckpointNotFoundError(f"{storage.url} is a file, not a checkpoint folder") from None
        if not isinstance(storage, LocalStorage) and not storage.list():
            raise CheckpointNotFoundError(f"no checkpoint at {storage.url}") from None
        raise CheckpointNotCommittedError(
            f"{storage.url} holds no committed checkpoint (no {MANIFEST}: a save in flight or one that "
            "crashed); it is never read") from None
    body = decode(raw, where)
    try:
        ser = get_serializer(body["serializer"])
    except ValueError as e:
        raise InvalidManifestError(f"{where}: field body.serializer: {e}") from None
    for i, leaf in enumerate(body["leaves"]):
        if leaf["kind"] in ARRAY_KINDS:  # not "chunks" in leaf: other kinds' extra fields are never validated
            ser.validate(leaf, body["files"], f"{where}: leaves[{i}] ({tree_mod.keystr(tree_mod.path_from_json(leaf['path']))})")
        if leaf["kind"] == "prng_key" and leaf["key_shape"] != _key_data_shape(leaf["key_impl"], where, i):
            raise InvalidManifestError(f"{where}: field leaves[{i}].key_shape: {leaf['key_shape']} is not the key "
                                       f"data shape of {leaf['key_impl']!r}")
    return body


@functools.lru_cache(maxsize=64)
def _known_key_shape(impl: str) -> list[int] | None:
    try:
        return list(jax.random.key_data(jax.random.key(0, impl=impl)).shape)
    except (ValueError, TypeError, KeyError):
        return None


def _key_data_shape(impl: str, where: str, i: int) -> list[int]:
    shape = _known_key_shape(impl)
    if shape is None:
        raise InvalidManifestError(f"{where}: field leaves[{i}].key_impl: unknown PRNG implementation {impl!r}")
    return shape


def open_checkpoint(path: Any) -> tuple[Storage, dict[str, Any]]:
    parent, name = split_path(path)
    storage = parent.sub(name)
    if commit_mod.is_temporary(name):
        raise CheckpointNotCommittedError(f"{storage.url} is the folder of a save in flight or one that "
                                          "crashed; it is never read")
    return storage, read_manifest(storage)


def _describe(rec: dict[str, Any]) -> str:
    if rec["kind"] in ("jax", "numpy"):
        return f"{rec['dtype']}{list(rec['shape'])}".replace(" ", "")
    if rec["kind"] == "prng_key":
        return f"key<{rec['key_impl']}>{rec['shape'][:len(rec['shape']) - len(rec['key_shape'])]}".replace(" ", "")
    if rec["kind"] == "scalar":
        return f"Python {rec['py_type']}"
    if rec["kind"] == "string":
        return "str"
    return {"none": "None", "dict": "{}", "list": "[]", "tuple": "()"}[rec["empty"]]


def describe_target(t: Any) -> str:
    """A restore target leaf as error messages show it: float32[4,6], key<threefry2x32>[2], Python int."""
    if tree_mod.is_prng_key(t):
        return f"key<{jax.random.key_impl(t) if isinstance(t, jax.Array) else t.dtype}>{list(t.shape)}".replace(" ", "")
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return f"{np.dtype(t.dtype).name}{list(t.shape)}".replace(" ", "")
    if isinstance(t, (bool, int, float, complex)):
        return f"Python {type(t).__name__}"
    if isinstance(t, str):
        return "str"
    kind = tree_mod.empty_kind(t)
    return {"none": "None", "dict": "{}", "list": "[]", "tuple": "()"}.get(kind or "", type(t).__name__)


def _compatible(t: Any, rec: dict[str, Any]) -> bool:
    kind = rec["kind"]
    if tree_mod.empty_kind(t) is not None:
        return kind == "empty" and rec["empty"] == tree_mod.empty_kind(t)
    if tree_mod.is_prng_key(t):
        impl = str(jax.random.key_impl(t)) if isinstance(t, jax.Array) else None
        return kind == "prng_key" and (impl is None or impl == rec["key_impl"]) and \
            list(t.shape) == rec["shape"][:len(rec["shape"]) - len(rec["key_shape"])]
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return kind in ("jax", "numpy") and np.dtype(t.dtype).name == rec["dtype"] and \
            list(t.shape) == rec["shape"]
    if isinstance(t, (bool, int, float, complex)):
        if kind in ("jax", "numpy") and rec["shape"] == [] and _scalar_kind(t) == np.dtype(
                dtype_from_name(rec["dtype"])).kind:
            return True  # e.g. TrainState.create's step=0 against the int32 array a jitted step saved
        return kind == "scalar" and rec["py_type"] == type(t).__name__
    if isinstance(t, str):
        return kind == "string"
    return False


def _scalar_kind(t: Any) -> str:
    """The numpy dtype kind a Python scalar target accepts from a 0-d array."""
    return "b" if isinstance(t, bool) else "i" if isinstance(t, int) else "f" if isinstance(t, float) else "c"


def _scalar(rec: dict[str, Any]) -> Any:
    py = rec["py_type"]
    if py in ("bool", "int"):
        return rec["value"]
    dt = np.float64 if py == "float" else np.complex128
    return {"float": float, "complex": complex}[py](np.frombuffer(bytes.fromhex(rec["value"]), dt)[0])


@dataclass
class Reader:
    """Reads leaves of one checkpoint folder (``host``: a box into numpy; ``value``: a leaf as restore
    returns it), verifying checksums, with allocation bounded by the bytes the folder stores."""

    storage: Storage
    body: dict[str, Any]
    where: str
    serializer: Serializer = field(init=False)
    budget: int | None = field(init=False)  # bytes still allowed to be allocated (None: no bound known)
    mutex: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self):
        self.serializer = get_serializer(self.body["serializer"])
        stored = _stored_bytes(self.storage)
        self.budget = None if stored is None else 2 * stored + _BUDGET_SLACK

    def host(self, rec: dict[str, Any], box=None, *, device: bool = False) -> np.ndarray:
        """A box of a leaf in host memory. ``device``: it only goes on to jax.device_put, so a
        serializer's read-only view of bytes it holds in memory will do (``view``, optional in the
        protocol: the memory tiers' copies), where one exists."""
        shape = tuple(rec["shape"])
        box = box or tuple((0, d) for d in shape)
        where = f"{self.where} leaf {leaf_name(rec)!r}"
        extents, dt = tuple(e - s for s, e in box), dtype_from_name(rec["dtype"])
        if device and hasattr(self.serializer, "view"):
            v = self.serializer.view(self.storage, rec, box, where)
            if v is not None:
                return v
        try:
            self._reserve(math.prod(extents) * dt.itemsize, where)
            out = _aligned_empty(extents, dt)
            self.serializer.read(self.storage, rec, box, out, where)
        except CorruptCheckpointError as e:
            if not self.storage.exists(MANIFEST):
                raise CheckpointNotFoundError(f"{self.storage.url} was deleted while it was being read (by the "
                                              "retention of a running CheckpointManager?)") from e
            raise
        return out

    def _reserve(self, nbytes: int, where: str) -> None:
        """Memory stays bounded by what is stored: a restore allocates at most twice the bytes the
        checkpoint folder holds (plus _BUDGET_SLACK), whatever its manifest claims. The slack lets a
        merely truncated file reach the serializer, whose error names it."""
        with self.mutex:
            if self.budget is not None and nbytes > self.budget:
                raise CorruptCheckpointError(
                    f"{where}: needs {nbytes} bytes, more than the checkpoint folder can hold (it stores "
                    f"{_stored_bytes(self.storage)} bytes); the manifest claims data that is not there "
                    "(damaged or crafted); nothing was allocated")
            if self.budget is not None:
                self.budget -= nbytes

    def sharded(self, rec: dict[str, Any], sharding: jax.sharding.Sharding) -> jax.Array:
        """Reads only the boxes this process's devices hold; when they tile one bounding box (the usual
        case), that box is read once and sliced, so no stored byte is read twice."""
        shape = tuple(rec["shape"])
        boxes = {dev: box_of(index, shape) for dev, index in sharding.addressable_devices_indices_map(shape).items()}
        unique = set(boxes.values())
        bbox = tuple((min(b[d][0] for b in unique), max(b[d][1] for b in unique)) for d in range(len(shape)))
        if len(unique) > 1 and sum(_volume(b) for b in unique) == _volume(bbox) and boxes_disjoint(unique):
            whole = self.host(rec, bbox, device=True)
            cache = {b: whole[tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(b, bbox))] for b in unique}
        else:
            cache = {b: self.host(rec, b, device=True) for b in unique}
        arrays = [jax.device_put(cache[box], dev) for dev, box in boxes.items()]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def value(self, rec: dict[str, Any], target: Any, sharding: Any) -> Any:
        kind = rec["kind"]
        if kind == "empty":
            return target if target is not None or rec["empty"] == "none" else \
                {"none": None, "dict": {}, "list": [], "tuple": ()}[rec["empty"]]
        if kind == "string":
            return rec["value"]
        if kind == "scalar":
            return _scalar(rec)
        if kind == "prng_key":
            data = self.host(rec, device=True)
            key = jax.random.wrap_key_data(data, impl=rec["key_impl"])
            sharding = sharding or getattr(target, "sharding", None)
            return jax.device_put(key, sharding) if sharding is not None else key
        if isinstance(target, (bool, int, float, complex)) and sharding is None:  # a 0-d array as saved
            return jax.device_put(self.host(rec, device=True)) if kind == "jax" else self.host(rec)
        if sharding is None and target is not None:
            sharding = getattr(target, "sharding", None)
        if sharding is None:
            if target is not None and isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
                return jax.device_put(self.host(rec, device=True))
            arr = self.host(rec)
            return arr[()] if isinstance(target, np.generic) else arr
        return self.sharded(rec, sharding)


def _stored_bytes(storage: Storage) -> int | None:
    """The bytes in the regular files of a local checkpoint folder (None for other storages). Refuses
    (CorruptCheckpointError) symlinks that leave the folder and special files (FIFOs, devices, sockets),
    before any data is read: nothing outside a checkpoint is read, and no read blocks."""
    if not isinstance(storage, LocalStorage):
        return None
    root, total = os.path.realpath(storage.root), 0
    for dirpath, dirnames, filenames in os.walk(storage.root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    real = os.path.realpath(path)
                    if real != root and not real.startswith(root + os.sep):
                        raise CorruptCheckpointError(f"{path} resolves to {real}, outside the checkpoint folder "
                                                     f"{root}; refusing to read the checkpoint")
                    st = os.stat(path)
            except FileNotFoundError:
                continue  # deleted meanwhile; reads will say so
            except OSError as e:
                raise CorruptCheckpointError(f"{path}: {e.strerror}; refusing to read the checkpoint") from None
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                raise CorruptCheckpointError(f"{path} is not a regular file (a FIFO, device or socket); "
                                             "refusing to read the checkpoint")
    return total


def _volume(box: tuple[tuple[int, int], ...]) -> int:
    return math.prod(e - s for s, e in box)


def leaf_name(rec: dict[str, Any]) -> str:
    return tree_mod.keystr(tree_mod.path_from_json(rec["path"]))


def _flat_shardings(shardings: Any, keys: list[str]) -> dict[str, Any]:
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        return {k: shardings for k in keys}
    flat, _ = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))
    return {tree_mod.keystr(tuple(tree_mod._entry(k) for k in p)): s for p, s in flat}


def restore(path: Any, target: Any = None, *, shardings: Any = None, partial: bool = False) -> Any:
    """Restores ``path`` into ``target``'s structure (or plain containers of numpy arrays)."""
    if _is_orbax(path):
        from flax_ckpt._src.orbax import compat as orbax_compat
        return orbax_compat.restore(path, target, shardings=shardings, partial=partial)
    storage, body = open_checkpoint(path)
    return restore_body(storage, body, target, shardings=shardings, partial=partial)


def restore_body(storage: Storage, body: dict[str, Any], target: Any = None, *, shardings: Any = None,
                 partial: bool = False) -> Any:
    where = f"{storage.url}/{MANIFEST}"
    saved = {leaf_name(rec): rec for rec in body["leaves"]}
    reader = Reader(storage, body, where)
    if target is None:
        shard_map = _flat_shardings(shardings, list(saved))
        keys = list(saved)
        values = _read_all(reader, [(saved[k], None, shard_map.get(k)) for k in keys])
        return tree_mod.nest((tree_mod.path_from_json(saved[k]["path"]), v) for k, v in zip(keys, values))
    flat, treedef = tree_mod.flatten(target)
    keys = [tree_mod.keystr(p) for p, _ in flat]
    missing = [k for k in keys if k not in saved]
    unexpected = [] if partial else [k for k in saved if k not in set(keys)]
    if missing or unexpected:
        raise StructureMismatchError(
            f"restore of {storage.url}: the target's structure differs from the checkpoint's. "
            + (f"In the target but not the checkpoint: {format_list(missing)}. " if missing else "")
            + (f"In the checkpoint but not the target: {format_list(unexpected)} "
               "(pass partial=True to restore only the target's sub-tree). " if unexpected else "")
            + f"Checkpoint: {where}")
    bad = [f"{k!r}: expected {describe_target(t)} (target), found {_describe(saved[k])}"
           for k, (_, t) in zip(keys, flat) if not _compatible(t, saved[k])]
    if bad:
        raise LeafMismatchError(f"restore of {len(bad)} leaves does not match the target: " + "; ".join(bad)
                                + f" in {where}")
    shard_map = _flat_shardings(shardings, keys)
    values = _read_all(reader, [(saved[k], t, shard_map.get(k)) for k, (_, t) in zip(keys, flat)])
    return jax.tree_util.tree_unflatten(treedef, values)


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-ordered array whose data starts on a 64-byte boundary: jax.device_put onto a
    CPU device then uses the buffer as is instead of copying it (XLA copies unaligned host buffers)."""
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


def restored_nbytes(body: dict[str, Any], target: Any, partial: bool) -> int:
    """Array bytes a restore of ``body`` into ``target`` reads."""
    wanted = None
    if target is not None and partial:
        wanted = {tree_mod.keystr(p) for p, _ in tree_mod.flatten(target)[0]}
    return sum(leaf_info(r).nbytes for r in body["leaves"] if wanted is None or leaf_name(r) in wanted)


def _read_all(reader: Reader, jobs: list[tuple[dict, Any, Any]]) -> list[Any]:
    """Reads every leaf: the large ones on a pool, the small ones meanwhile on this thread (a pool task
    per small leaf costs more in thread hand-offs than the read itself). On object stores, where every
    read is a request round trip, all array leaves go to a wide pool."""
    if not reader.storage.supports_rename:
        with ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            return list(pool.map(lambda j: reader.value(*j), jobs))
    big = [i for i, (r, _, _) in enumerate(jobs)
           if r["kind"] in ARRAY_KINDS  # only these are validated to have a shape and a dtype
           and math.prod(r["shape"]) * dtype_from_name(r["dtype"]).itemsize >= _BIG_LEAF]
    if len(big) < 2:
        return [reader.value(*j) for j in jobs]
    values: list[Any] = [None] * len(jobs)
    with ThreadPoolExecutor(min(_IO_THREADS, len(big))) as pool:
        futures = {i: pool.submit(reader.value, *jobs[i]) for i in big}
        for i, j in enumerate(jobs):
            if i not in futures:
                values[i] = reader.value(*j)
        for i, f in futures.items():
            values[i] = f.result()
    return values


# ------------------------------------------------------------------------------------------- metadata

@dataclass(frozen=True)
class LeafInfo:
    """What the manifest says of one leaf; reads no array bytes."""

    kind: str
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    sharding: dict[str, Any] | None
    nbytes: int

    def __repr__(self) -> str:
        return f"LeafInfo({self.kind}, {self.dtype}{list(self.shape) if self.shape is not None else ''})"


@dataclass(frozen=True)
class CheckpointInfo:
    """fc.metadata(path): the tree of LeafInfo, step, metrics, user metadata; reads no array bytes."""

    path: str
    tree: Any
    leaves: dict[str, LeafInfo]
    step: int | None
    metrics: dict[str, Any] | None
    metadata: Any
    created: float
    process_count: int
    serializer: str
    nbytes: int
    format: str = "flax_ckpt"


def leaf_info(rec: dict[str, Any]) -> LeafInfo:
    if rec["kind"] not in ARRAY_KINDS:
        return LeafInfo(rec["kind"], None, None, None, 0)
    dt = dtype_from_name(rec["dtype"])
    shape = tuple(rec["shape"])
    if rec["kind"] == "prng_key":
        shape = shape[:len(shape) - len(rec["key_shape"])]
    return LeafInfo(rec["kind"], shape, dt, rec.get("sharding"), math.prod(rec["shape"]) * dt.itemsize)


def info_from_body(url: str, body: dict[str, Any]) -> CheckpointInfo:
    leaves = {leaf_name(r): leaf_info(r) for r in body["leaves"]}
    nested = tree_mod.nest((tree_mod.path_from_json(r["path"]), leaves[leaf_name(r)]) for r in body["leaves"])
    return CheckpointInfo(url, nested, leaves, body.get("step"), body.get("metrics"), body.get("metadata"),
                          body["created"], body["process_count"], body["serializer"],
                          sum(i.nbytes for i in leaves.values()))


def _is_orbax(path: Any) -> bool:
    parent, name = split_path(path)
    if parent.sub(name).exists(MANIFEST):
        return False
    from flax_ckpt._src.orbax import compat as orbax_compat
    return orbax_compat.is_orbax(path)


def metadata(path: Any) -> CheckpointInfo:
    if _is_orbax(path):
        from flax_ckpt._src.orbax import compat as orbax_compat
        return orbax_compat.metadata(path)
    storage, body = open_checkpoint(path)
    return info_from_body(storage.url, body)


