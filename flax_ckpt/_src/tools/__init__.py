"""Library functions behind the ``flax-ckpt`` command: list, verify, diff, convert and prune checkpoints.

Scope: read-mostly tools over committed checkpoints, native or Orbax (and, for listing, a tiered
manager's memory-tier copies), each a typed function returning plain values (dataclasses) that the CLI
prints as text or JSON. Argument parsing and printing belong in cli.py; byte layouts to the serializers,
orbax_compat and tier_store; retention policy to ``manager.steps_to_delete`` (prune calls it, never a
copy of it). Progress bars (tqdm, on stderr) are off unless ``progress=True``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import jax
import numpy as np
from tqdm import tqdm

from flax_ckpt._src.engine import checkpoint as ckpt
from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src.orbax import compat as orbax_compat
from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                     CorruptCheckpointError, InvalidManifestError, StorageError, format_list)
from flax_ckpt._src.format import MANIFEST, dtype_from_name
from flax_ckpt._src.manager import steps_to_delete
from flax_ckpt._src.storage import LocalStorage, Storage, open_storage

Format = Literal["native", "orbax", "safetensors"]


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                leave=False, dynamic_ncols=True)


def _key(rec: dict[str, Any]) -> str:
    return tree_mod.keystr(tree_mod.path_from_json(rec["path"]))


def _chunk_file(chunk: dict[str, Any]) -> str:
    """The stored object a chunk lives in, relative to the checkpoint folder (raw file or zarr3 cell)."""
    return chunk["file"] if "file" in chunk else f"{chunk['array']}/{chunk['key']}"


# --------------------------------------------------------------------------------------------- verify

@dataclass(frozen=True)
class Problem:
    """One piece of damage: ``leaf`` (key path) and ``file`` (relative to the checkpoint) where known."""

    leaf: str | None
    file: str | None
    message: str


def verify(path: Any, *, progress: bool = False) -> list[Problem]:
    """Re-reads every stored byte of ``path`` and checks every checksum; returns what is damaged.

    Reads chunk by chunk, so one damaged leaf or file never hides another. An empty list means sound.
    A damaged manifest is one problem (nothing it names can be trusted). Raises CheckpointNotFoundError
    or CheckpointNotCommittedError when there is no committed checkpoint to verify.
    """
    if _is_orbax(path):
        return _verify_orbax(path)
    try:
        storage, body = ckpt.open_checkpoint(path)
    except (InvalidManifestError, CorruptCheckpointError) as e:
        return [Problem(None, MANIFEST, str(e))]
    problems = list(_check_files(storage, body))
    serializer = ckpt.get_serializer(body["serializer"])
    arrays = [r for r in body["leaves"] if "chunks" in r]
    total = sum(math.prod(r["shape"]) * dtype_from_name(r["dtype"]).itemsize for r in arrays)
    with _bar(total, "verify", progress) as bar:
        for rec in arrays:
            problems.extend(_verify_leaf(storage, serializer, rec, bar))
    return problems


def _check_files(storage: Storage, body: dict[str, Any]) -> Iterator[Problem]:
    for fname, size in sorted(body["files"].items()):
        try:
            storage.check_size(fname, size)
        except (CorruptCheckpointError, StorageError, OSError) as e:
            yield Problem(None, fname, str(e))


def _verify_leaf(storage: Storage, serializer: Any, rec: dict[str, Any], bar: tqdm) -> list[Problem]:
    """Reads every chunk of one leaf; one Problem per damaged file of the leaf (the first failure's
    message, with the count of damaged chunks when there are several)."""
    key, dtype = _key(rec), dtype_from_name(rec["dtype"])
    failures: dict[str, list[str]] = {}
    for chunk in rec["chunks"]:
        box = tuple(tuple(b) for b in chunk["index"])
        extents = tuple(e - s for s, e in box)
        if math.prod(extents) == 0 and extents:
            continue
        out = np.empty(extents, dtype)
        try:
            serializer.read(storage, dict(rec, chunks=[chunk]), box, out, f"{storage.url} leaf {key!r}")
        except (CorruptCheckpointError, StorageError, OSError) as e:
            failures.setdefault(_chunk_file(chunk), []).append(str(e))
        bar.update(out.nbytes)
    return [Problem(key, f, msgs[0] + (f" (and {len(msgs) - 1} more damaged chunks of this leaf in {f})"
                                       if len(msgs) > 1 else "")) for f, msgs in failures.items()]


_READ_ERRORS = (CheckpointError, OSError, ValueError)


def _verify_orbax(path: Any) -> list[Problem]:
    """Orbax stores no flax_ckpt checksums (tensorstore checks OCDBT nodes and what codecs it wrote):
    verification reads every leaf back. A failed full read is retried leaf by leaf (arrays), so each
    damaged array is named."""
    try:
        info = ckpt.metadata(path)
    except _READ_ERRORS as e:
        return [Problem(None, None, str(e))]
    try:
        ckpt.restore(path)
        return []
    except _READ_ERRORS as e:
        first = Problem(None, None, str(e))
    problems = []
    for p, li in tree_mod.flatten(info.tree)[0]:
        if li.kind not in ("jax", "numpy"):
            continue
        target = tree_mod.nest([(p, jax.ShapeDtypeStruct(li.shape, li.dtype))])
        try:
            ckpt.restore(path, target, partial=True)
        except _READ_ERRORS as e:
            problems.append(Problem(tree_mod.keystr(p), None, str(e)))
    return problems or [first]


# ----------------------------------------------------------------------------------------- leaf reads

def _is_orbax(path: Any) -> bool:
    """Orbax's layout (no manifest.json, Orbax's files); checkpoint.metadata and restore detect it alike."""
    parent, name = ckpt.split_path(path)
    if parent.sub(name).exists(MANIFEST):
        return False
    return bool(orbax_compat.is_orbax(path))


class _Leaves:
    """The leaves of one checkpoint by key path, read one at a time (native) or all at once (Orbax)."""

    def __init__(self, path: Any):
        self.path = path
        self._records: dict[str, dict[str, Any]] = {}
        self._values: dict[str, tuple[tree_mod.KeyPath, Any]] | None = None
        if _is_orbax(path):
            self.info = ckpt.metadata(path)
            return
        storage, body = ckpt.open_checkpoint(path)
        self.info = ckpt.info_from_body(storage.url, body)
        self._reader = ckpt.Reader(storage, body, f"{storage.url}/{MANIFEST}")
        self._records = {_key(r): r for r in body["leaves"]}

    def keys(self) -> list[str]:
        return list(self.info.leaves)

    def nbytes(self, key: str) -> int:
        return self.info.leaves[key].nbytes

    def _orbax_values(self) -> dict[str, tuple[tree_mod.KeyPath, Any]]:
        if self._values is None:
            flat, _ = tree_mod.flatten(ckpt.restore(self.path))
            self._values = {tree_mod.keystr(p): (p, v) for p, v in flat}
        return self._values

    def key_path(self, key: str) -> tree_mod.KeyPath:
        if key in self._records:
            return tree_mod.path_from_json(self._records[key]["path"])
        return self._orbax_values()[key][0]

    def value(self, key: str) -> Any:
        """The leaf as a restore without a target gives it (numpy arrays, PRNG key arrays, scalars)."""
        if key in self._records:
            return self._reader.value(self._records[key], None, None)
        return self._orbax_values()[key][1]

    def data(self, key: str) -> Any:
        """Like ``value``, but a PRNG key as its raw key data (a numpy array) so it can be compared."""
        if key in self._records and self._records[key]["kind"] == "prng_key":
            return self._reader.host(self._records[key])
        v = self.value(key)
        if tree_mod.is_prng_key(v):
            return np.asarray(jax.random.key_data(v))
        return v


# ----------------------------------------------------------------------------------------------- diff

@dataclass(frozen=True)
class LeafDiff:
    """A leaf present in both checkpoints whose type or values differ. ``max_abs_diff`` is None when
    the values cannot be compared numerically (different shapes or kinds, strings)."""

    key: str
    a: str
    b: str
    max_abs_diff: float | None


@dataclass(frozen=True)
class DiffResult:
    only_in_a: list[str]
    only_in_b: list[str]
    differing: list[LeafDiff]
    same: int

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differing)


def _describe(info: ckpt.LeafInfo) -> str:
    if info.dtype is None:
        return info.kind
    prefix = "key<>" if info.kind == "prng_key" else ""
    return f"{prefix}{info.dtype.name}{list(info.shape or ())}".replace(" ", "")


def diff(a: Any, b: Any, *, progress: bool = False) -> DiffResult:
    """Compares two checkpoints leaf by leaf (native or Orbax, in any combination).

    NaNs in the same places count as equal; a NaN against a number is an infinite difference. Arrays
    of the same shape but different dtypes are compared as float64 and reported as differing."""
    la, lb = _Leaves(a), _Leaves(b)
    ka, kb = la.keys(), lb.keys()
    common = [k for k in ka if k in set(kb)]
    differing, same = [], 0
    with _bar(sum(la.nbytes(k) + lb.nbytes(k) for k in common), "diff", progress) as bar:
        for k in common:
            d = _diff_leaf(k, la, lb)
            bar.update(la.nbytes(k) + lb.nbytes(k))
            if d is None:
                same += 1
            else:
                differing.append(d)
    return DiffResult([k for k in ka if k not in set(kb)], [k for k in kb if k not in set(ka)], differing, same)


def _diff_leaf(key: str, la: _Leaves, lb: _Leaves) -> LeafDiff | None:
    ia, ib = la.info.leaves[key], lb.info.leaves[key]
    da, db = _describe(ia), _describe(ib)
    va, vb = la.data(key), lb.data(key)
    if ia.dtype is None or ib.dtype is None:
        if ia.kind == ib.kind and _same_value(va, vb):
            return None
        return LeafDiff(key, _value_repr(va, da), _value_repr(vb, db), _scalar_diff(va, vb))
    if _array_kind(ia.kind) != _array_kind(ib.kind) or ia.shape != ib.shape:
        return LeafDiff(key, da, db, None)
    x, y = np.asarray(va), np.asarray(vb)
    if da == db and x.tobytes() == y.tobytes():
        return None
    m = max_abs_diff(x, y)
    return None if (da == db and m == 0.0) else LeafDiff(key, da, db, m)


def _array_kind(kind: str) -> str:
    """jax and numpy arrays compare alike (a restore without a target turns one into the other)."""
    return "array" if kind in ("jax", "numpy") else kind


def max_abs_diff(x: np.ndarray, y: np.ndarray) -> float:
    """max |x - y| in float64 (complex: modulus); NaN vs NaN is 0, NaN vs a number is inf."""
    if x.size == 0:
        return 0.0
    wide = np.complex128 if np.iscomplexobj(x) or np.iscomplexobj(y) else np.float64
    fx, fy = x.astype(wide), y.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(fx - fy)
        nx, ny = np.isnan(fx), np.isnan(fy)
        d = np.where(nx & ny, 0.0, np.where(nx | ny, np.inf, d))
        d = np.where(np.isnan(d), 0.0, d)  # inf - inf of the same sign
    return float(d.max())


def _same_value(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, (float, complex)):
        return np.asarray(x).tobytes() == np.asarray(y).tobytes()
    return x == y


def _scalar_diff(x: Any, y: Any) -> float | None:
    num = (int, float, complex)
    if isinstance(x, num) and isinstance(y, num) and not isinstance(x, bool) and not isinstance(y, bool):
        return max_abs_diff(np.asarray(x), np.asarray(y))
    return None


def _value_repr(v: Any, desc: str) -> str:
    if isinstance(v, (bool, int, float, complex, str)):
        return f"{type(v).__name__} {v!r}"
    return desc


# -------------------------------------------------------------------------------------------- convert

@dataclass(frozen=True)
class ConvertResult:
    dst: str
    to: Format
    leaves: int
    nbytes: int
    skipped: list[str] = field(default_factory=list)  # not exported to safetensors: non-arrays, PRNG keys


def detect_format(path: Any) -> Literal["native", "orbax"]:
    return "orbax" if _is_orbax(path) else "native"


def convert(src: Any, dst: Any, *, to: Format | None = None, serializer: str | None = None,
            subtree: str | None = None, progress: bool = False) -> ConvertResult:
    """Converts the checkpoint ``src`` into ``dst`` (which must not exist).

    ``to``: "native", "orbax" (default: the other layout than ``src``'s) or "safetensors" (the array
    leaves under ``subtree`` as one .safetensors file; ``subtree`` defaults to "params" when the tree has
    it, else the whole tree). Attribute containers (TrainState fields) become dicts, as in a restore
    without a target; step, metrics and user metadata are carried over where the layout has room."""
    to = to or ("native" if detect_format(src) == "orbax" else "orbax")
    if to not in ("native", "orbax", "safetensors"):
        raise ValueError(f"unknown target format {to!r}; use 'native', 'orbax' or 'safetensors'")
    leaves = _Leaves(src)
    if to == "safetensors":
        return _export_safetensors(leaves, dst, subtree, progress)
    tree, nbytes = _read_tree(leaves, leaves.keys(), progress)
    info = leaves.info
    if to == "orbax":
        ckpt.save(dst, tree, metadata=info.metadata, format="orbax")
    else:
        ckpt.save(dst, tree, metadata=info.metadata, step=info.step, metrics=info.metrics, serializer=serializer)
    return ConvertResult(os.fspath(dst), to, len(leaves.keys()), nbytes)


def _read_tree(leaves: _Leaves, keys: list[str], progress: bool) -> tuple[Any, int]:
    total = sum(leaves.nbytes(k) for k in keys)
    items = []
    with _bar(total, "read", progress) as bar:
        for k in keys:
            items.append((leaves.key_path(k), _as_saved(leaves.info.leaves[k].kind, leaves.value(k))))
            bar.update(leaves.nbytes(k))
    return tree_mod.nest(items), total


def _as_saved(kind: str, value: Any) -> Any:
    """A leaf saved as a jax.Array goes back as one (on the host CPU device), so the converted
    checkpoint records the same kind of leaf; its sharding is not kept (no mesh to rebuild it on)."""
    if kind == "jax" and isinstance(value, np.ndarray):
        return jax.device_put(value, jax.devices("cpu")[0])
    return value


def _select(keys: list[str], subtree: str | None) -> tuple[list[str], str]:
    """The keys under ``subtree`` and the prefix to strip from them."""
    if subtree is None:
        subtree = "params" if any(k.startswith("params/") for k in keys) else ""
    prefix = subtree.strip("/") + "/" if subtree.strip("/") else ""
    chosen = [k for k in keys if k.startswith(prefix)]
    if not chosen:
        raise CheckpointError(f"no leaves under {subtree!r}; the checkpoint's top-level keys are "
                              f"{format_list(sorted({k.split('/')[0] for k in keys}))}")
    return chosen, prefix


def _export_safetensors(leaves: _Leaves, dst: Any, subtree: str | None, progress: bool) -> ConvertResult:
    from safetensors.numpy import save_file

    dst = os.fspath(dst)
    if os.path.lexists(dst):
        raise CheckpointExistsError(f"{dst} exists; exports are never overwritten (choose another name)")
    keys, prefix = _select(leaves.keys(), subtree)
    arrays = [k for k in keys if leaves.info.leaves[k].kind in ("jax", "numpy")]
    skipped = [k for k in keys if k not in set(arrays)]
    names = {k: ".".join(k[len(prefix):].split("/")) or "<root>" for k in arrays}
    _check_exportable(leaves, arrays, names)
    tensors, nbytes = {}, 0
    with _bar(sum(leaves.nbytes(k) for k in arrays), "export", progress) as bar:
        for k in arrays:
            tensors[names[k]] = np.ascontiguousarray(leaves.value(k))
            nbytes += leaves.nbytes(k)
            bar.update(leaves.nbytes(k))
    meta = {"format": "flax_ckpt export", "source": str(leaves.info.path), "subtree": prefix.rstrip("/"),
            "step": json.dumps(leaves.info.step), "metrics": json.dumps(leaves.info.metrics)}
    tmp = f"{dst}{commit_mod.TMP_MARK}{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.link(tmp, dst)  # atomic, and refuses to replace a file that appeared meanwhile
    except FileExistsError:
        raise CheckpointExistsError(f"{dst} appeared while exporting; not overwritten") from None
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return ConvertResult(dst, "safetensors", len(arrays), nbytes, skipped)


_SAFETENSORS_DTYPES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                       "float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                       "float8_e5m2", "float8_e5m2fnuz", "complex64"}


def _check_exportable(leaves: _Leaves, arrays: list[str], names: dict[str, str]) -> None:
    """Collects every leaf safetensors cannot hold (dtype, or a tensor name taken twice) into one error."""
    bad = [f"{k} ({leaves.info.leaves[k].dtype})" for k in arrays
           if getattr(leaves.info.leaves[k].dtype, "name", None) not in _SAFETENSORS_DTYPES]
    seen: dict[str, str] = {}
    for k in arrays:
        if names[k] in seen:
            bad.append(f"{k} and {seen[names[k]]} both map to tensor name {names[k]!r}")
        seen.setdefault(names[k], k)
    if bad:
        raise CheckpointError(f"cannot export to safetensors (nothing was written): {format_list(bad)}. "
                              "Cast those leaves, or export another --subtree.")


# --------------------------------------------------------------------------------------------- ls

@dataclass(frozen=True)
class StepEntry:
    """One entry of a checkpoint directory. ``state``: "committed" (a valid manifest, or an Orbax
    step), "in-flight" (a ``.tmp-`` folder: a save in flight or one that crashed), "deleting" (an
    interrupted deletion), "invalid" (a manifest that fails validation) or "uncommitted" (no manifest)."""

    name: str
    step: int | None
    state: str
    tier: str
    format: str | None
    nbytes: int | None
    metrics: dict[str, Any] | None = None
    created: float | None = None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        return self.state == "committed"


def _in_flight(name: str) -> bool:
    return commit_mod.TMP_MARK in name or orbax_compat.TMP_SUFFIX in name


def _step_of(name: str) -> int | None:
    head = name.split(commit_mod.TMP_MARK)[0].split(commit_mod.DELETING_MARK)[0].split(orbax_compat.TMP_SUFFIX)[0]
    return int(head) if head.isdigit() else None


def _disk_size(storage: Storage, body: dict[str, Any] | None) -> int | None:
    if isinstance(storage, LocalStorage):
        total = 0
        for dirpath, _, files in os.walk(storage.root):
            total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
        return total
    return None if body is None else sum(body["files"].values())


def list_steps(directory: Any, *, tier: str = "persistent") -> list[StepEntry]:
    """Every step folder of a manager's ``directory`` (committed or not), ordered by step."""
    root = open_storage(directory)
    if isinstance(root, LocalStorage) and not root.isdir():
        raise CheckpointNotFoundError(f"{root.url} is not a folder of checkpoints")
    entries = [_entry(root, n, tier) for n in root.list() if _step_of(n) is not None]
    return sorted(entries, key=lambda e: (e.step, e.name))


def _entry(root: Storage, name: str, tier: str) -> StepEntry:
    step, folder = _step_of(name), root.sub(name)
    if commit_mod.is_temporary(name) or _in_flight(name):
        state = "in-flight" if _in_flight(name) else "deleting"
        return StepEntry(name, step, state, tier, None, _disk_size(folder, None))
    url = folder.url
    try:
        body = ckpt.read_manifest(folder)
    except (InvalidManifestError, CorruptCheckpointError) as e:
        return StepEntry(name, step, "invalid", tier, None, _disk_size(folder, None), problem=str(e))
    except CheckpointError as e:
        if _is_orbax(url):
            return _orbax_entry(url, name, step, tier, folder)
        return StepEntry(name, step, "uncommitted", tier, None, _disk_size(folder, None), problem=str(e))
    return StepEntry(name, step, "committed", tier, "flax_ckpt", _disk_size(folder, body), body["metrics"],
                     body["created"])


def memory_tier_root(directory: Any, local_dir: str) -> str:
    """Where a tiered CheckpointManager of ``directory`` keeps its memory tiers under ``Tiers.local_dir``
    (the scheme of tiers.TierSet: ``<local_dir>/<sha256 of the directory's URL, 16 hex>/``)."""
    url = open_storage(directory).url
    return os.path.join(os.path.abspath(local_dir), hashlib.sha256(url.encode()).hexdigest()[:16])


def list_memory_tiers(directory: Any, local_dir: str) -> list[StepEntry]:
    """The memory-tier copies (tier_store format) this host holds for the manager of ``directory``: one
    entry per process, tier and step; tier "local-memory p<i>" or "peer-memory p<i> (of p<k>)". A copy
    is committed in its tier iff it has a valid index and its commit record."""
    root = memory_tier_root(directory, local_dir)
    entries = []
    for proc in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        subs = sorted(os.listdir(os.path.join(root, proc))) if os.path.isdir(os.path.join(root, proc)) else []
        for sub in subs:
            if sub != "local" and not sub.startswith("peer-p"):
                continue
            label = f"local-memory {proc}" if sub == "local" else f"peer-memory {proc} (of p{sub[len('peer-p'):]})"
            folder = os.path.join(root, proc, sub)
            entries += [_memory_entry(folder, n, label) for n in os.listdir(folder) if _step_of(n) is not None]
    return sorted(entries, key=lambda e: (e.step, e.tier, e.name))


def _memory_entry(folder: str, name: str, tier: str) -> StepEntry:
    from flax_ckpt._src.tiers import store as tier_store

    path, step = os.path.join(folder, name), _step_of(name)
    size = _disk_size(LocalStorage(path), None)
    if commit_mod.is_temporary(name):
        return StepEntry(name, step, "in-flight", tier, None, size)
    try:
        body = tier_store.open_copy(path).body
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        return StepEntry(name, step, "invalid", tier, "memory", size, problem=str(e))
    fmt = "memory (full)" if body.get("base") is None else f"memory (diff of {body['base']})"
    record = os.path.join(path, tier_store.COMMIT)
    if not os.path.exists(record):
        return StepEntry(name, step, "uncommitted", tier, fmt, size)
    return StepEntry(name, step, "committed", tier, fmt, size, created=os.stat(record).st_mtime)


def _orbax_entry(url: str, name: str, step: int | None, tier: str, folder: Storage) -> StepEntry:
    try:
        info = ckpt.metadata(url)
    except (CheckpointError, OSError, ValueError) as e:
        return StepEntry(name, step, "invalid", tier, "orbax", _disk_size(folder, None), problem=str(e))
    return StepEntry(name, step, "committed", tier, "orbax", _disk_size(folder, None), info.metrics, info.created)


# ------------------------------------------------------------------------------------------- prune

@dataclass(frozen=True)
class PruneResult:
    kept: list[int]
    deleted: list[int]
    dry_run: bool


def prune(directory: Any, *, keep: int | None, keep_period: int | None = None, best_metric: str | None = None,
          best_mode: Literal["min", "max"] = "min", keep_best: int | None = None,
          dry_run: bool = False) -> PruneResult:
    """Deletes committed steps the manager's retention (``manager.steps_to_delete``) would remove.

    Takes the directory's lock, so it never races a live CheckpointManager (CheckpointLockedError).
    Folders of saves in flight and damaged steps are left alone."""
    if keep is not None and keep < 1:
        raise ValueError(f"--keep must be >= 1, got {keep}")
    if keep_best is not None and best_metric is None:
        raise ValueError("keep_best needs best_metric (the metric name to rank steps by)")
    root = open_storage(directory)
    lock = _lock(root) if not dry_run else None
    try:
        committed = {e.step: e for e in list_steps(directory) if e.committed and e.step is not None
                     and e.name == str(e.step)}
        metrics = {s: (e.metrics or {}).get(best_metric) for s, e in committed.items()} if best_metric else None
        doomed = steps_to_delete(committed, max_to_keep=keep, keep_period=keep_period, metrics=metrics,
                                 best_mode=best_mode, keep_best=keep_best)
        if not dry_run:
            for s in doomed:
                commit_mod.remove(root, str(s))
    finally:
        if lock is not None:
            lock.release()
    return PruneResult(sorted(set(committed) - set(doomed)), doomed, dry_run)


def _lock(root: Storage) -> Any:
    """The manager's directory lock (local folders; object stores have none to take)."""
    from flax_ckpt._src.manager import DirectoryLock

    if not isinstance(root, LocalStorage):
        return None
    if not root.isdir():
        raise CheckpointNotFoundError(f"{root.url} is not a folder of checkpoints")
    return DirectoryLock(root.root)
