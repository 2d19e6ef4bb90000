"""Read and write Orbax checkpoints without importing orbax (numpy, JSON and tensorstore only).

Scope: Orbax's on-disk layout, both ways, for one checkpoint folder or one step of an Orbax
CheckpointManager directory. Scheduling and retention belong to manager.py, which calls ``list_steps``,
``step_item_path``, ``read_step_metrics`` and ``save_step``; flax_ckpt's own layout is format.py's.

Versions: the layout was read in orbax-checkpoint 0.12.8's source and every feature below is tested
against 0.12.8 (tests/test_orbax_compat.py). Older releases whose items have a ``_METADATA`` file with
``tree_metadata`` / ``key_metadata`` entries use the same layout, but are not tested.

Read (``restore``, ``metadata``, ``is_orbax``):
- items of PyTreeCheckpointHandler and StandardCheckpointHandler (v0 API) and PyTreeHandler (v1 API,
  item ``state``); arrays in OCDBT (the item's merged root database, which refers to the per-process
  ones) or one folder per parameter, zarr v2 or zarr3, zstd or uncompressed; value types ``jax.Array``,
  ``np.ndarray``, ``scalar`` (given back as Python numbers), ``string`` and the empty ``None``/``Dict``/
  ``List``/``Tuple``/``NamedTuple``; PRNG key arrays (``random_key_impl`` in ``array_metadatas``);
- a StandardCheckpointer/PyTreeCheckpointer folder, a CheckpointManager step folder (``<step>`` or
  ``<prefix>_<step>``; items from ``_CHECKPOINT_METADATA``'s ``item_handlers``), or an item folder inside
  one; composite steps with JSON items (JsonCheckpointHandler, v1 JsonHandler; ``json_items``) and
  ``metrics``. One pytree item restores as itself; several as ``{item name: tree}``;
- with a target, each leaf is checked like flax_ckpt's own restore (StructureMismatchError,
  LeafMismatchError: no silent casts) and only the boxes the target's shardings need are read; without
  one, nested dicts/lists of numpy arrays, Python scalars and strings (PRNG keys as key arrays).
Write (``save`` for ``fc.save(..., format="orbax")``, ``save_step`` for a manager, ``snapshot`` for
their blocking half): one pytree item, OCDBT (default) or not, zarr3 (default) or zarr v2, zstd, with
``_METADATA``, ``_sharding``, ``_strings.json``, ``array_metadatas/process_0``, ``_CHECKPOINT_METADATA``
and ``commit_success.txt``; atomic (``<name>.orbax-checkpoint-tmp-<ns>`` renamed) on local file systems,
``commit_success.txt`` last on object stores. orbax's StandardCheckpointer, PyTreeCheckpointer and
CheckpointManager restore it, sharded arrays included. Storage: local paths and every URL flax_ckpt
opens (memory://, s3://, gs://); there a folder without ``commit_success.txt`` is not committed.

Refused with UnsupportedOrbaxCheckpointError, naming the path and the feature: items of any other
handler (ArrayCheckpointHandler, ProtoCheckpointHandler, random-key handlers, user handlers), legacy
msgpack checkpoints (a ``checkpoint`` file and no ``_METADATA``), value types of custom TypeHandlers,
unknown PRNG implementations, and saving from more than one process. UnsupportedLeafError: keys holding
'/' or colliding once joined with '.' (Orbax's parameter names), dtypes tensorstore lacks. Not covered:
Orbax's emergency / multi-tier checkpoint layouts and ``_ROOT_METADATA`` (ignored).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.engine.checkpoint import (CheckpointInfo, LeafInfo, _flat_shardings, _jsonable, describe_target, host_array,
                         split_path)
from flax_ckpt._src.commit import is_temporary, rename_into_place
from flax_ckpt._src.errors import (CheckpointError, CheckpointExistsError, CheckpointNotCommittedError,
                     CheckpointNotFoundError, CorruptCheckpointError, InvalidManifestError,
                     LeafMismatchError, StructureMismatchError, UnsupportedLeafError, format_list)
from flax_ckpt._src.format import MANIFEST, check_relpath
from flax_ckpt._src.serializers import Shard, box_of
from flax_ckpt._src.errors import UnsupportedOrbaxCheckpointError
from flax_ckpt._src.storage import KvStorage, LocalStorage, Storage

TESTED_ORBAX_VERSION = "0.12.8"
TREE_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
SHARDING = "_sharding"
STRINGS = "_strings.json"
OCDBT_MANIFEST = "manifest.ocdbt"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
JSON_FILES = ("metadata", "data.json")
PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
STANDARD_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
_PYTREE_CLASSES = frozenset({"PyTreeCheckpointHandler", "StandardCheckpointHandler", "PyTreeHandler"})
_JSON_CLASSES = frozenset({"JsonCheckpointHandler", "JsonHandler"})
_ARRAY_TYPES = frozenset({"jax.Array", "np.ndarray", "scalar"})
_EMPTY_TYPES = {"None": None, "Dict": {}, "List": [], "Tuple": (), "NamedTuple": None}
_STEP_NAME = re.compile(r"(?:(.+)_)?(\d+)")
_MAX_JSON = 256 << 20
_OCDBT_FILE_SIZE = 1 << 31
_CONTEXT = {"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}, "file_io_concurrency": {"limit": 128}}


# --------------------------------------------------------------------------------------- locating

def _folder(path: Any) -> Storage:
    """The folder a path, URL or Storage names."""
    if isinstance(path, (LocalStorage, KvStorage)):
        return path
    parent, name = split_path(path)
    return parent.sub(name)


def _name_of(storage: Storage) -> str:
    return storage.url.rstrip("/").rsplit("/", 1)[-1]


def _read_json(storage: Storage, name: str) -> Any:
    """The parsed JSON file ``name`` in ``storage``; None when it does not exist."""
    try:
        raw = storage.read(name, _MAX_JSON)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if len(raw) > _MAX_JSON:
        raise InvalidManifestError(f"{storage.url}/{name}: larger than {_MAX_JSON} bytes; not Orbax metadata")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise InvalidManifestError(f"{storage.url}/{name}: not valid JSON ({e}); the Orbax checkpoint is "
                                   "damaged") from None


def is_orbax(path: Any) -> bool:
    """True when ``path`` holds an Orbax layout (no flax_ckpt manifest; ``_METADATA`` or
    ``_CHECKPOINT_METADATA``). Reads one folder listing, no file."""
    try:
        entries = set(_folder(path).list())
    except Exception:
        return False
    return MANIFEST not in entries and bool(entries & {TREE_METADATA, CHECKPOINT_METADATA})


def _handler_kind(handler: Any) -> str:
    cls = handler.rsplit(".", 1)[-1] if isinstance(handler, str) and handler.startswith("orbax.") else None
    return "pytree" if cls in _PYTREE_CLASSES else "json" if cls in _JSON_CLASSES else "unknown"


@dataclass(frozen=True)
class _Located:
    """A committed Orbax folder: its pytree items (key None: the folder is the item), JSON items,
    step metadata and step number."""

    storage: Storage
    items: dict[str | None, Storage]
    json_items: dict[str, Storage]
    meta: dict[str, Any]
    step: int | None


def _refuse_msgpack(storage: Storage) -> None:
    if "checkpoint" in storage.list():
        raise UnsupportedOrbaxCheckpointError(
            f"{storage.url} is a legacy msgpack Orbax checkpoint (a 'checkpoint' file, no {TREE_METADATA}); "
            "flax_ckpt reads only the tensorstore layout. Restore it with orbax-checkpoint and re-save it.")


def _items_from_handlers(storage: Storage, handlers: dict[str, Any]) -> tuple[dict, dict]:
    items, json_items, refused = {}, {}, []
    for name, handler in handlers.items():
        kind = _handler_kind(handler)
        if kind == "pytree":
            items[name] = storage.sub(name)
        elif kind == "json":
            json_items[name] = storage.sub(name)
        else:
            refused.append(f"{name!r} ({handler})")
    if not items and refused:
        raise UnsupportedOrbaxCheckpointError(
            f"{storage.url}: no item flax_ckpt can read; item handlers {', '.join(refused)} are not "
            "supported (only PyTreeCheckpointHandler, StandardCheckpointHandler, PyTreeHandler and JSON "
            "items are). Restore it with orbax-checkpoint.")
    return items, json_items


def _items_by_listing(storage: Storage, entries: set[str]) -> tuple[dict, dict]:
    items, json_items = {}, {}
    for name in sorted(entries):
        inner = set(storage.sub(name).list())
        if TREE_METADATA in inner:
            items[name] = storage.sub(name)
        elif inner & {name, *JSON_FILES}:
            json_items[name] = storage.sub(name)
    return items, json_items


def _step_number(storage: Storage) -> int | None:
    m = _STEP_NAME.fullmatch(_name_of(storage))
    return int(m.group(2)) if m else None


def _as_item_of_step(path: Any, storage: Storage, meta: dict[str, Any]) -> _Located:
    """A pytree item folder; inside a CheckpointManager step, with that step's metadata and metrics."""
    parent, name = split_path(path)
    step_meta = {} if meta else _read_json(parent, CHECKPOINT_METADATA)
    handlers = step_meta.get("item_handlers") if isinstance(step_meta, dict) else None
    if not isinstance(handlers, dict) or _handler_kind(handlers.get(name)) != "pytree":
        return _Located(storage, {None: storage}, {}, meta, None)
    json_items = {n: parent.sub(n) for n, h in handlers.items() if _handler_kind(h) == "json"}
    return _Located(storage, {None: storage}, json_items, step_meta, _step_number(parent))


def _locate(path: Any) -> _Located:
    storage = _folder(path)
    entries = set(storage.list())
    if not entries:
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url} (the folder is missing or empty)")
    if TMP_SUFFIX in _name_of(storage) or is_temporary(_name_of(storage)):
        raise CheckpointNotCommittedError(f"{storage.url} is the folder of an Orbax save in flight or one "
                                          "that crashed; it is never read")
    meta = _read_json(storage, CHECKPOINT_METADATA)
    meta = meta if isinstance(meta, dict) else {}
    if not isinstance(storage, LocalStorage) and COMMIT_SUCCESS not in entries:
        raise CheckpointNotCommittedError(f"{storage.url} has no {COMMIT_SUCCESS}: on an object store an "
                                          "Orbax checkpoint without it is uncommitted and never read")
    handlers = meta.get("item_handlers")
    if TREE_METADATA in entries:
        if isinstance(handlers, str) and _handler_kind(handlers) != "pytree":
            raise UnsupportedOrbaxCheckpointError(
                f"{storage.url}: written by {handlers}, which flax_ckpt does not read (only PyTree and "
                "Standard checkpoint handlers). Restore it with orbax-checkpoint.")
        return _as_item_of_step(path, storage, meta)
    if isinstance(handlers, dict):
        items, json_items = _items_from_handlers(storage, handlers)
    else:
        _refuse_msgpack(storage)
        items, json_items = _items_by_listing(storage, entries)
    for item in items.values():
        if TREE_METADATA not in item.list():
            _refuse_msgpack(item)
            raise CorruptCheckpointError(f"{item.url}: the pytree item has no {TREE_METADATA}; the Orbax "
                                         "checkpoint is incomplete")
    if not items:
        raise UnsupportedOrbaxCheckpointError(f"{storage.url}: an Orbax folder without any pytree item "
                                              f"(items: {format_list(sorted(json_items))}); nothing to restore")
    return _Located(storage, items, json_items, meta, _step_number(storage))


# ---------------------------------------------------------------------------------- tree metadata

@dataclass
class _Item:
    """One pytree item: its parsed ``_METADATA`` and lazily read side files."""

    storage: Storage
    doc: dict[str, Any]
    use_ocdbt: bool
    use_zarr3: bool
    context: ts.Context
    _side: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.storage.url}/{TREE_METADATA}"

    def strings(self) -> dict[str, Any]:
        if STRINGS not in self._side:
            self._side[STRINGS] = _read_json(self.storage, STRINGS) or {}
        return self._side[STRINGS]

    def key_impls(self) -> dict[str, str]:
        """{param name: PRNG key implementation} from array_metadatas/process_*."""
        if "impls" not in self._side:
            folder = self.storage.sub("array_metadatas")
            impls = {}
            for name in folder.list():
                doc = _read_json(folder, name) or {}
                for rec in doc.get("array_metadatas", []) if isinstance(doc, dict) else []:
                    meta = rec.get("array_metadata", {}) if isinstance(rec, dict) else {}
                    ext = meta.get("ext_metadata")
                    if isinstance(ext, dict) and isinstance(ext.get("random_key_impl"), str):
                        impls[meta.get("param_name")] = ext["random_key_impl"]
            self._side["impls"] = impls
        return self._side["impls"]

    def shardings(self) -> dict[str, dict[str, Any]]:
        """{param name: Orbax sharding description} from ``_sharding``."""
        if SHARDING not in self._side:
            out = {}
            for k, v in (_read_json(self.storage, SHARDING) or {}).items():
                try:
                    out[base64.urlsafe_b64decode(k.encode()).decode()] = json.loads(v)
                except (ValueError, TypeError):
                    continue
            self._side[SHARDING] = out
        return self._side[SHARDING]


@dataclass(frozen=True)
class _Leaf:
    """One entry of an item's tree metadata, with flax_ckpt's key path (prefixed by the item name
    when a step has several pytree items)."""

    path: tree_mod.KeyPath
    param: str
    value_type: str
    item: _Item

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(str(k) for _, k in self.path)

    @property
    def key(self) -> str:
        return tree_mod.keystr(self.path)


def _context(storage: Storage) -> ts.Context:
    parent = storage.context if isinstance(storage, KvStorage) and storage.context is not None else ts.Context()
    return ts.Context(ts.Context.Spec(_CONTEXT), parent)


def _open_item(storage: Storage, context: ts.Context) -> _Item:
    doc = _read_json(storage, TREE_METADATA)
    where = f"{storage.url}/{TREE_METADATA}"
    if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
        raise InvalidManifestError(f"{where}: no 'tree_metadata' object; not an Orbax pytree item this "
                                   f"flax_ckpt reads (checked against orbax-checkpoint {TESTED_ORBAX_VERSION})")
    use_ocdbt = doc.get("use_ocdbt")
    entries = set(storage.list())
    if use_ocdbt is None:
        use_ocdbt = OCDBT_MANIFEST in entries
    if use_ocdbt and OCDBT_MANIFEST not in entries:
        raise CorruptCheckpointError(f"{storage.url}: {TREE_METADATA} says OCDBT but {OCDBT_MANIFEST} is "
                                     "missing (a multi-process save that was never merged, or a partial copy)")
    return _Item(storage, doc, bool(use_ocdbt), bool(doc.get("use_zarr3", False)), context)


def _entry_path(key_meta: Any, where: str, key: str) -> tuple[tree_mod.KeyPath, str]:
    if not isinstance(key_meta, list) or not key_meta:
        raise InvalidManifestError(f"{where}: entry {key}: 'key_metadata' must be a non-empty list")
    path = []
    for e in key_meta:
        if not isinstance(e, dict) or not isinstance(e.get("key"), (str, int)) or e.get("key_type") not in (1, 2):
            raise InvalidManifestError(f"{where}: entry {key}: bad key entry {e!r}")
        name = str(e["key"])
        if e["key_type"] == 1 and not name.isdigit():
            raise InvalidManifestError(f"{where}: entry {key}: sequence key {name!r} is not an index")
        path.append(("idx", int(name)) if e["key_type"] == 1 else ("key", name))
    return tuple(path), ".".join(str(k) for _, k in path)


def _item_leaves(item: _Item, prefix: tree_mod.KeyPath) -> list[_Leaf]:
    leaves = []
    for key, entry in item.doc["tree_metadata"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("value_metadata"), dict):
            raise InvalidManifestError(f"{item.where}: entry {key}: missing 'value_metadata'")
        path, param = _entry_path(entry.get("key_metadata"), item.where, key)
        vt = entry["value_metadata"].get("value_type")
        if not isinstance(vt, str):
            raise InvalidManifestError(f"{item.where}: entry {key}: 'value_type' must be a string")
        if vt != "placeholder":
            leaves.append(_Leaf(prefix + path, param, vt, item))
    # Orbax keeps an empty-container entry next to entries below it after partial saves: drop those.
    inner = {lf.names[:i] for lf in leaves for i in range(len(lf.names))}
    return [lf for lf in leaves if lf.names not in inner]


def _leaves(located: _Located) -> list[_Leaf]:
    context = _context(located.storage)
    out = []
    for name, storage in located.items.items():
        prefix = () if name is None or len(located.items) == 1 else (("key", name),)
        out.extend(_item_leaves(_open_item(storage, context), prefix))
    return out


# ----------------------------------------------------------------------------------------- arrays

def _kv(storage: Storage, name: str = "") -> dict[str, Any]:
    if isinstance(storage, KvStorage):
        spec = dict(storage.spec)
        spec["path"] = spec["path"] + (name + "/" if name else "")
        return spec
    return storage.kvstore_spec(name)


def _array_kvstore(item_storage: Storage, param: str, use_ocdbt: bool, write: bool = False) -> dict[str, Any]:
    if not use_ocdbt:
        return _kv(item_storage, param)
    spec: dict[str, Any] = {"driver": "ocdbt", "base": _kv(item_storage), "path": param,
                            "cache_pool": "cache_pool#ocdbt"}
    if write:
        spec.update(target_data_file_size=_OCDBT_FILE_SIZE, assume_config=True,
                    config={"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000,
                            "manifest_kind": "single"})
    return spec


def _read_spec(leaf: _Leaf) -> dict[str, Any]:
    item = leaf.item
    if not item.use_ocdbt:  # one folder per parameter: the name must stay inside the item folder
        check_relpath(leaf.param, f"tree_metadata[{leaf.key!r}]", item.where)
    return {"driver": "zarr3" if item.use_zarr3 else "zarr",
            "kvstore": _array_kvstore(item.storage, leaf.param, item.use_ocdbt),
            "recheck_cached_data": False, "recheck_cached_metadata": False, "fill_missing_data_reads": False}


def _open_arrays(leaves: list[_Leaf]) -> dict[str, Any]:
    """{leaf key: opened TensorStore} for every array leaf; opens concurrently, reads metadata only."""
    futures = {lf.key: ts.open(_read_spec(lf), open=True, read=True, context=lf.item.context)
               for lf in leaves if lf.value_type in _ARRAY_TYPES}
    stores = {}
    for lf in leaves:
        if lf.key in futures:
            try:
                stores[lf.key] = futures[lf.key].result()
            except Exception as e:
                raise CorruptCheckpointError(f"{lf.item.storage.url}: cannot open the array of {lf.key!r} "
                                             f"(parameter {lf.param!r}): {e}") from None
    return stores


@dataclass(frozen=True)
class _Saved:
    """What the checkpoint holds for one leaf (arrays: opened store and, for PRNG keys, the impl)."""

    leaf: _Leaf
    store: Any = None
    impl: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.store.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.store.dtype.numpy_dtype)

    def key_shape(self) -> tuple[int, ...]:
        """For a PRNG key array, the logical key shape (the stored shape without the key data dims)."""
        data = jax.random.key_data(jax.random.key(0, impl=self.impl))
        return self.shape[:len(self.shape) - data.ndim]

    def describe(self) -> str:
        vt = self.leaf.value_type
        if vt in _EMPTY_TYPES:
            return vt
        if vt == "string":
            return "str"
        if self.impl is not None:
            return f"key<{self.impl}>{list(self.key_shape())}".replace(" ", "")
        text = f"{self.dtype.name}{list(self.shape)}".replace(" ", "")
        return f"Python scalar ({text})" if vt == "scalar" else text


def _saved(leaves: list[_Leaf]) -> list[_Saved]:
    unknown = [f"{lf.key!r} ({lf.value_type})" for lf in leaves
               if lf.value_type not in _ARRAY_TYPES and lf.value_type not in _EMPTY_TYPES
               and lf.value_type != "string"]
    if unknown:
        raise UnsupportedOrbaxCheckpointError(
            f"{leaves[0].item.where}: leaves of value types flax_ckpt does not read (custom Orbax "
            f"TypeHandlers): {', '.join(unknown)}. Restore them with orbax-checkpoint, or pass a target "
            "without them and partial=True.")
    stores = _open_arrays(leaves)
    saved = [_Saved(lf, stores.get(lf.key), lf.item.key_impls().get(lf.param) if lf.key in stores else None)
             for lf in leaves]
    bad = [f"{s.leaf.key!r} ({s.impl})" for s in saved if s.impl is not None and not _known_impl(s.impl)]
    if bad:
        raise UnsupportedOrbaxCheckpointError(f"{leaves[0].item.storage.url}: PRNG key implementations this "
                                              f"jax does not know: {', '.join(bad)}")
    return saved


def _known_impl(impl: str) -> bool:
    try:
        jax.random.key(0, impl=impl)
        return True
    except (ValueError, TypeError, KeyError):
        return False


# ---------------------------------------------------------------------------------------- restore

def _target_impl(t: Any) -> str | None:
    return str(jax.random.key_impl(t)) if isinstance(t, jax.Array) else None


def _compatible(t: Any, s: _Saved) -> bool:
    vt = s.leaf.value_type
    if tree_mod.empty_kind(t) is not None:
        return vt in _EMPTY_TYPES
    if tree_mod.is_prng_key(t):
        impl = _target_impl(t)
        return s.impl is not None and (impl is None or impl == s.impl) and s.key_shape() == tuple(t.shape)
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return s.store is not None and s.impl is None and np.dtype(t.dtype) == s.dtype and \
            tuple(t.shape) == s.shape
    kinds = _scalar_kinds(t)
    if kinds is not None:
        return s.store is not None and s.impl is None and s.shape == () and s.dtype.kind in kinds
    if isinstance(t, str):
        return vt == "string"
    return False


def _scalar_kinds(t: Any) -> str | None:
    """For a Python scalar target, the numpy dtype kinds it restores from (bool before int)."""
    for typ, kinds in ((bool, "b"), (int, "iu"), (float, "f"), (complex, "c")):
        if isinstance(t, typ):
            return kinds
    return None


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@dataclass
class _Job:
    """One leaf to produce: what is saved, the target leaf (or None), the placement, and the reads."""

    saved: _Saved
    target: Any
    sharding: Any
    reads: dict[Any, Any] = field(default_factory=dict)  # box (or None: whole array) -> ts future

    @property
    def python(self) -> bool:
        """Restored as a Python number: a Python scalar target, or Orbax's ``scalar`` without target."""
        scalar = self.saved.leaf.value_type == "scalar"
        return _scalar_kinds(self.target) is not None or (self.target is None and scalar)

    @property
    def boxed(self) -> bool:
        return self.sharding is not None and self.saved.impl is None and not self.python

    def start(self) -> None:
        s = self.saved
        if s.store is None:
            return
        if not self.boxed:
            self.reads[None] = s.store.read()
            return
        for index in self.sharding.addressable_devices_indices_map(s.shape).values():
            box = box_of(index, s.shape)
            if box not in self.reads:
                self.reads[box] = s.store[_slices(box)].read()

    def data(self, box: Any) -> np.ndarray:
        try:
            return self.reads[box].result()
        except Exception as e:
            lf = self.saved.leaf
            raise CorruptCheckpointError(f"{lf.item.storage.url}: reading {lf.key!r} (parameter {lf.param!r}) "
                                         f"failed: {e}") from None

    def finish(self) -> Any:
        s, t, vt = self.saved, self.target, self.saved.leaf.value_type
        if vt in _EMPTY_TYPES:
            return t if t is not None else _copy_empty(_EMPTY_TYPES[vt])
        if vt == "string":
            return s.leaf.item.strings().get(s.leaf.param, "")
        if s.impl is not None:
            key = jax.random.wrap_key_data(self.data(None), impl=s.impl)
            return jax.device_put(key, self.sharding) if self.sharding is not None else key
        if self.python:
            value = self.data(None).item()
            return type(t)(value) if t is not None else value
        if self.boxed:
            return self._assemble()
        arr = self.data(None)
        if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
            return jax.device_put(arr)
        return arr[()] if isinstance(t, np.generic) else arr

    def _assemble(self) -> jax.Array:
        shape = self.saved.shape
        arrays = [jax.device_put(self.data(box_of(index, shape)), dev)
                  for dev, index in self.sharding.addressable_devices_indices_map(shape).items()]
        return jax.make_array_from_single_device_arrays(shape, self.sharding, arrays)


def _copy_empty(v: Any) -> Any:
    return type(v)() if v is not None else None


def _produce(jobs: list[_Job]) -> list[Any]:
    for job in jobs:  # every read in flight before waiting on any
        job.start()
    out = []
    for job in jobs:
        out.append(job.finish())
        job.reads.clear()  # release the host copy as soon as its leaf is placed
    return out


def _placement(target: Any, sharding: Any) -> Any:
    if sharding is not None:
        return sharding
    return getattr(target, "sharding", None) if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)) else None


def restore(path: Any, target: Any = None, *, shardings: Any = None, partial: bool = False) -> Any:
    """Restores an Orbax checkpoint into ``target``'s structure (or plain dicts/lists of numpy arrays,
    Python scalars and strings), checked leaf by leaf like flax_ckpt's own restore."""
    located = _locate(path)
    leaves = _leaves(located)
    if target is None:
        saved = _saved(leaves)
        smap = _flat_shardings(shardings, [lf.key for lf in leaves])
        values = _produce([_Job(s, None, smap.get(s.leaf.key)) for s in saved])
        return tree_mod.nest((s.leaf.path, v) for s, v in zip(saved, values))
    flat, treedef = tree_mod.flatten(target)
    chosen = _match(located, leaves, flat, partial)
    saved = _saved(chosen)
    where = chosen[0].item.where if chosen else located.storage.url
    bad = [f"{tree_mod.keystr(p)!r}: expected {describe_target(t)} (target), found {s.describe()}"
           for (p, t), s in zip(flat, saved) if not _compatible(t, s)]
    if bad:
        raise LeafMismatchError(f"restore of {len(bad)} leaves does not match the target: " + "; ".join(bad)
                                + f" in {where}")
    smap = _flat_shardings(shardings, [tree_mod.keystr(p) for p, _ in flat])
    values = _produce([_Job(s, t, _placement(t, smap.get(tree_mod.keystr(p))))
                       for (p, t), s in zip(flat, saved)])
    return jax.tree_util.tree_unflatten(treedef, values)


def _match(located: _Located, leaves: list[_Leaf], flat: list, partial: bool) -> list[_Leaf]:
    """The saved leaf of every target leaf, matched by key names as Orbax does."""
    by_names = {lf.names: lf for lf in leaves}
    wanted = [tuple(str(k) for _, k in p) for p, _ in flat]
    missing = [tree_mod.keystr(p) for (p, _), n in zip(flat, wanted) if n not in by_names]
    unexpected = [] if partial else [lf.key for lf in leaves if lf.names not in set(wanted)]
    if missing or unexpected:
        items = [n for n in located.items if n is not None]
        raise StructureMismatchError(
            f"restore of {located.storage.url}: the target's structure differs from the Orbax checkpoint's. "
            + (f"In the target but not the checkpoint: {format_list(missing)}. " if missing else "")
            + (f"In the checkpoint but not the target: {format_list(unexpected)} "
               "(pass partial=True to restore only the target's sub-tree). " if unexpected else "")
            + (f"This step holds the pytree items {format_list(items)}: the target is a dict keyed by them. "
               if len(items) > 1 else "")
            + f"Checkpoint: {leaves[0].item.where if leaves else located.storage.url}")
    return [by_names[n] for n in wanted]


# --------------------------------------------------------------------------------------- metadata

def _flax_sharding(desc: dict[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(desc, dict):
        return None
    if desc.get("sharding_type") == "NamedSharding":
        return {"type": "NamedSharding", "axis_names": desc.get("axis_names"),
                "mesh_shape": desc.get("shape"), "spec": desc.get("partition_spec")}
    if desc.get("sharding_type") == "SingleDeviceSharding":
        return {"type": "SingleDeviceSharding", "num_devices": 1}
    return {"type": str(desc.get("sharding_type"))}


def _leaf_info(s: _Saved) -> LeafInfo:
    vt = s.leaf.value_type
    if s.store is None:
        return LeafInfo("string" if vt == "string" else "empty", None, None, None, 0)
    kind = "prng_key" if s.impl else {"jax.Array": "jax", "np.ndarray": "numpy", "scalar": "scalar"}[vt]
    shape = s.key_shape() if s.impl else s.shape
    nbytes = math.prod(s.shape) * s.dtype.itemsize
    return LeafInfo(kind, shape, s.dtype, _flax_sharding(s.leaf.item.shardings().get(s.leaf.param)), nbytes)


def _process_count(located: _Located) -> int:
    counts = [sum(1 for n in item.list() if n.startswith("ocdbt.process_")) for item in located.items.values()]
    counts += [len(item.sub("array_metadatas").list()) for item in located.items.values()]
    return max([1, *counts])


def _created(located: _Located) -> float:
    for key in ("commit_timestamp_nsecs", "init_timestamp_nsecs"):
        if isinstance(located.meta.get(key), int):
            return located.meta[key] / 1e9
    return 0.0


def _metrics(located: _Located) -> dict[str, Any] | None:
    if "metrics" in located.json_items:
        found = _read_json_item(located.json_items["metrics"], "metrics")
        if isinstance(found, dict):
            return found
    m = located.meta.get("metrics")
    return m if isinstance(m, dict) and m else None


def _custom_metadata(located: _Located, leaves: list[_Leaf]) -> Any:
    custom = located.meta.get("custom_metadata")
    if custom in (None, {}) and leaves:
        custom = leaves[0].item.doc.get("custom_metadata")
    return None if custom == {} else custom


def metadata(path: Any) -> CheckpointInfo:
    """fc.metadata of an Orbax checkpoint (format="orbax"): shapes and dtypes from the zarr metadata,
    shardings from ``_sharding``; reads no array bytes."""
    located = _locate(path)
    leaves = _leaves(located)
    saved = _saved(leaves)
    infos = {s.leaf.key: _leaf_info(s) for s in saved}
    first = leaves[0].item if leaves else None
    codec = "zarr3" if first is not None and first.use_zarr3 else "zarr"
    serializer = f"orbax:{codec}{'+ocdbt' if first is not None and first.use_ocdbt else ''}"
    return CheckpointInfo(located.storage.url, tree_mod.nest((s.leaf.path, infos[s.leaf.key]) for s in saved),
                          infos, located.step, _metrics(located), _custom_metadata(located, leaves),
                          _created(located), _process_count(located), serializer,
                          sum(i.nbytes for i in infos.values()), format="orbax")


def _read_json_item(storage: Storage, item: str) -> Any:
    """A JSON item's value: the file named like the item (a manager's ``metrics/metrics``), else
    JsonCheckpointHandler's ``metadata`` or the v1 JsonHandler's ``data.json``."""
    for name in (item, *JSON_FILES):
        found = _read_json(storage, name)
        if found is not None:
            return found
    return None


def json_items(path: Any) -> dict[str, Any]:
    """The JSON items of an Orbax step folder (composite checkpoints), ``{item name: value}``."""
    return {name: _read_json_item(s, name) for name, s in _locate(path).json_items.items()}


# ------------------------------------------------------------------------------------------- save

@dataclass(frozen=True)
class HostLeaf:
    """One leaf as Orbax will describe it, with this process's host shards (arrays only)."""

    path: tree_mod.KeyPath
    value_type: str
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None
    shards: tuple[Shard, ...] = ()
    write_shape: tuple[int, ...] | None = None
    sharding: dict[str, Any] | None = None  # Orbax's _sharding description
    key_impl: str | None = None
    value: str | None = None  # string leaves

    @property
    def param(self) -> str:
        return ".".join(str(k) for _, k in self.path)


@dataclass(frozen=True)
class Snapshot:
    """A host copy of a tree in Orbax's terms; taking it is the blocking half of an async save."""

    leaves: tuple[HostLeaf, ...]
    nbytes: int


def _orbax_sharding(s: jax.sharding.Sharding) -> dict[str, Any] | None:
    if isinstance(s, jax.sharding.NamedSharding):
        ids = np.vectorize(lambda d: {"id": int(d.id)}, otypes=[object])(s.mesh.devices).tolist()
        spec = [p if p is None or isinstance(p, str) else list(p) for p in s.spec]
        return {"sharding_type": "NamedSharding", "shape": [int(n) for n in s.mesh.devices.shape],
                "axis_names": [str(a) for a in s.mesh.axis_names],
                "axis_types": [str(a) for a in s.mesh.axis_types], "partition_spec": spec,
                "device_mesh": {"mesh": ids}}
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return {"sharding_type": "SingleDeviceSharding", "device_str": str(next(iter(s.device_set)))}
    return None  # other shardings: Orbax writes none either; restore needs a target for them


def _array_leaf(path: tree_mod.KeyPath, x: Any, kind: str, copy: bool) -> HostLeaf:
    if kind == "numpy" or kind == "scalar":
        a = host_array(x, copy)
        if a.dtype.hasobject:
            raise UnsupportedLeafError(f"{tree_mod.keystr(path)}: {x!r} does not fit int64/uint64; Orbax "
                                       "stores Python scalars as fixed-width arrays")
        vt = "np.ndarray" if kind == "numpy" else "scalar"
        return HostLeaf(path, vt, a.shape, a.dtype, (Shard(tuple((0, d) for d in a.shape), a),))
    impl = str(jax.random.key_impl(x)) if kind == "prng_key" else None
    data = jax.random.key_data(x) if impl else x
    shape = tuple(int(d) for d in data.shape)
    shards = tuple(Shard(box_of(s.index, shape), host_array(s.data, copy)) for s in data.addressable_shards
                   if s.replica_id == 0)
    return HostLeaf(path, "jax.Array", shape, np.dtype(data.dtype), shards,
                    tuple(int(d) for d in data.sharding.shard_shape(data.shape)),
                    _orbax_sharding(data.sharding), impl)


def _leaf(path: tree_mod.KeyPath, x: Any, kind: str, copy: bool) -> HostLeaf:
    if kind == "empty":
        is_namedtuple = isinstance(x, tuple) and hasattr(x, "_fields")
        vt = "None" if x is None or is_namedtuple else {"dict": "Dict", "list": "List", "tuple": "Tuple"}[
            tree_mod.empty_kind(x)]
        return HostLeaf(path, vt)
    if kind == "string":
        return HostLeaf(path, "string", value=x)
    return _array_leaf(path, x, kind, copy)


def _check_storable(leaves: list[HostLeaf]) -> None:
    slash = [tree_mod.keystr(lf.path) for lf in leaves if any("/" in str(k) for _, k in lf.path)]
    seen: dict[str, str] = {}
    clash = []
    for lf in leaves:
        other = seen.setdefault(lf.param, tree_mod.keystr(lf.path))
        if other != tree_mod.keystr(lf.path):
            clash.append(f"{other!r} and {tree_mod.keystr(lf.path)!r} (both {lf.param!r})")
    dtypes = [f"{tree_mod.keystr(lf.path)} ({lf.dtype.name})" for lf in leaves
              if lf.dtype is not None and not _ts_dtype_ok(lf.dtype)]
    if slash or clash or dtypes:
        raise UnsupportedLeafError(
            "cannot save in Orbax's layout (nothing was written): "
            + (f"keys holding '/': {format_list(slash)}; " if slash else "")
            + (f"key paths that Orbax's '.'-joined parameter names confuse: {'; '.join(clash)}; " if clash else "")
            + (f"dtypes tensorstore (hence Orbax) cannot store: {', '.join(dtypes)}; " if dtypes else "")
            + "rename those keys or cast those leaves, or save in flax_ckpt's own format.")


def _ts_dtype_ok(dtype: np.dtype) -> bool:
    try:
        ts.dtype(dtype.name)
        return True
    except (ValueError, TypeError):
        return False


def snapshot(tree: Any, *, copy: bool = True) -> Snapshot:
    """Copies every array shard this process writes to host memory (``copy=False`` reuses host buffers
    where possible, for synchronous saves)."""
    flat, _ = tree_mod.flatten(tree)
    kinds = tree_mod.classify_all(flat)
    for (_, x), kind in zip(flat, kinds):
        if kind == "jax" and not all(d.platform == "cpu" for d in x.sharding.device_set):
            x.copy_to_host_async()
    leaves = [_leaf(p, x, k, copy or (k == "jax" and not all(d.platform == "cpu" for d in x.sharding.device_set)))
              for (p, x), k in zip(flat, kinds)]
    _check_storable(leaves)
    return Snapshot(tuple(leaves), sum(s.data.nbytes for lf in leaves for s in lf.shards))


def _chunk_shape(lf: HostLeaf) -> list[int]:
    """The shard shape, halved along even dimensions while a chunk exceeds OCDBT's target file size
    (so chunks still tile each shard exactly and no two shards write one chunk)."""
    chunk = [max(1, d) for d in (lf.write_shape if lf.write_shape is not None else lf.shape)]
    while math.prod(chunk) * lf.dtype.itemsize > _OCDBT_FILE_SIZE:
        even = [i for i, d in enumerate(chunk) if d % 2 == 0]
        if not even:
            break
        i = max(even, key=lambda j: chunk[j])
        chunk[i] //= 2
    return chunk


def _zarr_metadata(lf: HostLeaf, use_zarr3: bool, compression: bool) -> dict[str, Any]:
    chunk = _chunk_shape(lf)
    if not use_zarr3:
        return {"shape": list(lf.shape), "chunks": chunk,
                "compressor": {"id": "zstd", "level": 1} if compression else None}
    inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression:
        inner.append({"name": "zstd", "configuration": {"level": 3}})
    codec = {"name": "sharding_indexed", "configuration": {
        "chunk_shape": chunk, "codecs": inner, "index_location": "end",
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}
    return {"shape": list(lf.shape), "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "codecs": [codec]}


def _write_arrays(storage: Storage, arrays: list[HostLeaf], use_ocdbt: bool, use_zarr3: bool,
                  compression: bool) -> None:
    context = _context(storage)
    opened = []
    for lf in arrays:
        spec = {"driver": "zarr3" if use_zarr3 else "zarr", "dtype": lf.dtype.name,
                "kvstore": _array_kvstore(storage, lf.param, use_ocdbt, write=True),
                "metadata": _zarr_metadata(lf, use_zarr3, compression),
                "store_data_equal_to_fill_value": True, "recheck_cached_data": False,
                "recheck_cached_metadata": False}
        opened.append((lf, ts.open(spec, create=True, open=True, context=context)))
    writes, failure = [], None
    for lf, fut in opened:
        try:
            store = fut.result()
        except Exception as e:
            failure = failure or UnsupportedLeafError(
                f"{tree_mod.keystr(lf.path)}: tensorstore cannot store {lf.dtype}{list(lf.shape)} in "
                f"Orbax's layout: {e}")
            continue
        writes += [(lf, store[_slices(s.box)].write(s.data)) for s in lf.shards if s.data.size]
    for lf, w in writes:  # wait for every write, even after a failure, before anyone deletes the folder
        try:
            w.result()
        except Exception as e:
            failure = failure or CheckpointError(
                f"{storage.url}: writing {tree_mod.keystr(lf.path)!r} failed: {e}")
    if failure is not None:
        raise failure


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _tree_metadata(snap: Snapshot, use_ocdbt: bool, use_zarr3: bool) -> dict[str, Any]:
    entries = {}
    for lf in snap.leaves:
        names = tuple(str(k) for _, k in lf.path)
        value: dict[str, Any] = {"value_type": lf.value_type, "skip_deserialize": lf.value_type in _EMPTY_TYPES}
        if lf.write_shape is not None:
            value["write_shape"] = list(lf.write_shape)
        keys = [{"key": str(k), "key_type": 1 if kind == "idx" else 2} for kind, k in lf.path]
        entries[str(names)] = {"key_metadata": keys, "value_metadata": value}
    return {"tree_metadata": entries, "use_ocdbt": use_ocdbt, "use_zarr3": use_zarr3,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def _array_metadatas(arrays: list[HostLeaf]) -> dict[str, Any]:
    return {"array_metadatas": [
        {"array_metadata": {"param_name": lf.param, "write_shape": list(lf.write_shape),
                            "chunk_shape": _chunk_shape(lf),
                            "ext_metadata": {"random_key_impl": lf.key_impl} if lf.key_impl else None}}
        for lf in arrays if lf.value_type == "jax.Array"]}


def write_item(storage: Storage, snap: Snapshot, *, use_ocdbt: bool = True, use_zarr3: bool = True,
               compression: bool = True) -> None:
    """Writes one Orbax pytree item (arrays, ``_METADATA`` and side files) into ``storage``."""
    arrays = [lf for lf in snap.leaves if lf.dtype is not None]
    _write_arrays(storage, arrays, use_ocdbt, use_zarr3, compression)
    shardings = {base64.urlsafe_b64encode(lf.param.encode()).decode(): json.dumps(lf.sharding)
                 for lf in arrays if lf.sharding is not None}
    strings = {lf.param: lf.value for lf in snap.leaves if lf.value_type == "string"}
    if shardings:
        storage.write(SHARDING, [_json_bytes(shardings)])
    if strings:
        storage.write(STRINGS, [_json_bytes(strings)])
    if any(lf.value_type == "jax.Array" for lf in arrays):
        storage.write("array_metadatas/process_0", [_json_bytes(_array_metadatas(arrays))])
    storage.write(TREE_METADATA, [_json_bytes(_tree_metadata(snap, use_ocdbt, use_zarr3))])


def _handler_for(snap: Snapshot) -> str:
    """StandardCheckpointHandler where orbax's would accept the tree (no strings), else PyTree's."""
    return PYTREE_HANDLER if any(lf.value_type == "string" for lf in snap.leaves) else STANDARD_HANDLER


def _commit_success(storage: Storage) -> None:
    storage.write(COMMIT_SUCCESS, [f"Checkpoint commit was successful to {storage.url}".encode()])


def _commit_folder(parent: Storage, name: str, write: Callable[[Storage], Any], meta: dict[str, Any]) -> None:
    """Writes ``name`` atomically: into ``<name>.orbax-checkpoint-tmp-<ns>`` and renamed (local), or in
    place with ``commit_success.txt`` last (object stores). Refuses an existing folder."""
    if parent.sub(name).list():
        raise CheckpointExistsError(f"{parent.url}/{name} already exists; checkpoints are never overwritten "
                                    "(save to a new path or delete it first)")
    staging = f"{name}{TMP_SUFFIX}-{time.time_ns()}" if parent.supports_rename else name
    folder = parent.sub(staging)
    try:
        write(folder)
        meta = dict(meta, commit_timestamp_nsecs=time.time_ns())
        folder.write(CHECKPOINT_METADATA, [_json_bytes(meta)])
        _commit_success(folder)
        if parent.supports_rename:
            rename_into_place(parent, staging, name)
    except BaseException:
        parent.delete(staging)
        raise


def _step_meta(handlers: str | dict[str, str], custom: Any) -> dict[str, Any]:
    """``_CHECKPOINT_METADATA`` as orbax 0.12.8 writes it (metrics live in the ``metrics`` item)."""
    return {"item_handlers": handlers, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": time.time_ns(), "commit_timestamp_nsecs": None,
            "custom_metadata": custom if custom is not None else {}}


def _single_process() -> None:
    if jax.process_count() > 1:
        raise UnsupportedOrbaxCheckpointError(
            "saving in Orbax's layout from several processes is not supported (it needs Orbax's "
            "per-process OCDBT merge); save in flax_ckpt's format, which any process count restores")


def save(path: Any, tree: Any, *, metadata: Any = None, use_ocdbt: bool = True, use_zarr3: bool = True,
         compression: bool = True) -> None:
    """``fc.save(path, tree, format="orbax")``: a StandardCheckpointer-style folder that
    ``ocp.StandardCheckpointer().restore(path, abstract_tree)`` and ``ocp.PyTreeCheckpointer().restore``
    read. ``metadata`` goes to ``_CHECKPOINT_METADATA``'s custom_metadata. ``tree`` may be a Snapshot."""
    _single_process()
    custom = _jsonable(metadata, "metadata")
    snap = tree if isinstance(tree, Snapshot) else snapshot(tree, copy=False)
    parent, name = split_path(path)
    _commit_folder(parent, name, lambda f: write_item(f, snap, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
                                                      compression=compression),
                   _step_meta(_handler_for(snap), custom))


# ------------------------------------------------------------------- an Orbax CheckpointManager dir

def _step_dirs(directory: Any) -> dict[int, str]:
    """{step: folder name} of committed Orbax steps under ``directory``."""
    root = _folder(directory)
    local = isinstance(root, LocalStorage)
    found: dict[int, str] = {}
    for entry in root.list():
        m = _STEP_NAME.fullmatch(entry)
        if m is None or is_temporary_name(entry) or is_temporary(entry):
            continue
        if not _committed_step(root.sub(entry), local):
            continue
        step = int(m.group(2))
        if step not in found or m.group(1) is None:
            found[step] = entry
    return found


def _committed_step(folder: Storage, local: bool) -> bool:
    """An Orbax step folder that is committed: ``commit_success.txt`` (required on object stores), or on
    a local file system (where the rename commits) ``_CHECKPOINT_METADATA`` or an item's ``_METADATA``."""
    inner = set(folder.list())
    if MANIFEST in inner:
        return False  # a flax_ckpt step
    if COMMIT_SUCCESS in inner:
        return True
    return local and (CHECKPOINT_METADATA in inner
                      or any(TREE_METADATA in folder.sub(n).list() for n in sorted(inner)))


def list_steps(directory: Any) -> list[int]:
    """Committed Orbax steps of an Orbax CheckpointManager directory (``<step>`` or ``<prefix>_<step>``
    folders; ``*.orbax-checkpoint-tmp*`` and flax_ckpt steps are ignored)."""
    return sorted(_step_dirs(directory))


def _step_folder(directory: Any, step: int) -> Storage:
    dirs = _step_dirs(directory)
    if step not in dirs:
        raise CheckpointNotFoundError(f"no committed Orbax step {step} in {_folder(directory).url} "
                                      f"(steps: {sorted(dirs) or 'none'})")
    return _folder(directory).sub(dirs[step])


def is_temporary_name(entry: str) -> bool:
    """A folder name of an Orbax save in flight or one that crashed (``*.orbax-checkpoint-tmp*``)."""
    return TMP_SUFFIX in entry


def step_path(directory: Any, step: int) -> str:
    """The folder of committed Orbax ``step`` (``<dir>/<step>`` or ``<dir>/<prefix>_<step>``), e.g. to
    delete it."""
    return _step_folder(directory, step).url


def step_item_path(directory: Any, step: int) -> str:
    """The folder to pass to ``restore`` for ``step``: its pytree item (``default``, ``state``, ...),
    or the step folder itself when it holds several pytree items (restored as ``{item: tree}``)."""
    located = _locate(_step_folder(directory, step).url)
    if len(located.items) == 1:
        return next(iter(located.items.values())).url
    return located.storage.url


def read_step_metrics(directory: Any, step: int) -> dict[str, Any] | None:
    """The metrics saved with ``step`` (the ``metrics`` item, else ``_CHECKPOINT_METADATA``), or None."""
    return _metrics(_locate(_step_folder(directory, step).url))


def save_step(directory: Any, step: int, tree: Any, *, metrics: dict[str, Any] | None = None,
              metadata: Any = None, use_ocdbt: bool = True, use_zarr3: bool = True) -> str:
    """Writes ``<directory>/<step>`` as an Orbax CheckpointManager step (item ``default``, plus a
    ``metrics`` JSON item); returns its path. ``tree`` may be a Snapshot taken earlier."""
    _single_process()
    metrics = _jsonable(metrics, "metrics")
    custom = _jsonable(metadata, "metadata")
    snap = tree if isinstance(tree, Snapshot) else snapshot(tree, copy=False)
    root = _folder(directory)
    if isinstance(root, LocalStorage):
        os.makedirs(root.root, exist_ok=True)
    handlers = {"default": _handler_for(snap)}
    if metrics is not None:
        handlers["metrics"] = JSON_HANDLER

    def write(folder: Storage) -> None:
        write_item(folder.sub("default"), snap, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
        _commit_success(folder.sub("default"))
        if metrics is not None:
            folder.sub("metrics").write("metrics", [_json_bytes(metrics)])
            _commit_success(folder.sub("metrics"))

    _commit_folder(root, str(int(step)), write, _step_meta(handlers, custom))
    return root.sub(str(int(step))).url
