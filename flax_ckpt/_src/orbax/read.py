"""Reading Orbax checkpoints without orbax: an Orbax step or item as a restore ``Source``.

Scope: an item's ``_METADATA`` (tree metadata: key paths and value types), its side files
(``_sharding``, ``_strings.json``, ``array_metadatas/process_*`` for PRNG implementations) and its
arrays through tensorstore (zarr v2 or zarr3, in OCDBT or one folder per parameter), turned into the
engine's LeafRecords. The engine checks the target and places the leaves (engine/restore.py), exactly
as for its own checkpoints. Value types read: ``jax.Array``, ``np.ndarray``, ``scalar`` (Python
numbers stored as 0-d arrays, given back as numbers), ``string`` and the empty ``None``/``Dict``/
``List``/``Tuple``/``NamedTuple``; anything else is an UnsupportedOrbaxCheckpointError naming it.
The key paths of ``_METADATA`` pass the native manifest's checks (checks.check_tree: one tree, at most
MAX_PATH_DEPTH keys, indices below MAX_INDEX, lists without vast gaps, in linear time): damaged or
crafted metadata is an InvalidManifestError, which a manager treats as damage (it falls back a step).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import numpy as np

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.checks import MAX_INDEX, MAX_PATH_DEPTH, check_relpath, check_tree, shape_problem
from flax_ckpt._src.engine.leaves import CheckpointInfo, checkpoint_info, key_data_shape
from flax_ckpt._src.engine.reader import Damage, read_back
from flax_ckpt._src.errors import (
    CorruptCheckpointError,
    InvalidManifestError,
    StructureMismatchError,
    UnsupportedOrbaxCheckpointError,
    format_list,
)
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.orbax.folders import FolderArray, Unsupported, check_chunk
from flax_ckpt._src.orbax.locate import (
    OCDBT_MANIFEST,
    SHARDING,
    STRINGS,
    TESTED_ORBAX_VERSION,
    TREE_METADATA,
    Located,
    checksummed,
    is_grain,
    item_roots,
    json_checksummed,
    json_text,
    json_value,
    read_json,
    step_metrics,
    stored_size,
    walk,
)
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.serializers import Box
from flax_ckpt._src.storage import Storage, TensorstoreStorage

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import tensorstore as ts
else:
    ts = lazy("tensorstore", globals(), "ts")  # imported on first use (lazy.py)

_ARRAY_TYPES = {"jax.Array": "jax", "np.ndarray": "numpy", "scalar": "numpy"}
_EMPTY_TYPES = {"None": "none", "Dict": "dict", "List": "list", "Tuple": "tuple", "NamedTuple": "none"}
_CONTEXT = {"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}, "file_io_concurrency": {"limit": 128}}
OCDBT_FILE_SIZE = 1 << 31
# The most bytes one stored byte may decode to: a zstd block (at most 128 KiB) takes at least 4 bytes
# (its 3-byte header and 1 byte of an RLE block); Orbax compresses with zstd alone. Unknown compressors
# get the same bound, uncompressed arrays the native layout's (see OrbaxSource.budget).
MAX_EXPANSION = (128 << 10) // 4
_BUDGET_SLACK = 64 << 20


def context_for(storage: Storage) -> ts.Context:
    """A tensorstore context for an Orbax folder: the storage's (object store settings) plus an OCDBT cache."""
    # Orbax folders are read and written through tensorstore: every storage flax_ckpt makes is one.
    tss = cast(TensorstoreStorage, storage)
    parent = tss.context if tss.context is not None else ts.Context()
    return ts.Context(ts.Context.Spec(_CONTEXT), parent)


def array_kvstore(item: Storage, param: str, use_ocdbt: bool, write: bool = False) -> dict[str, Any]:
    """The kvstore of one parameter's array: inside the item's OCDBT database, or its own folder."""
    tss = cast(TensorstoreStorage, item)  # as in context_for
    if not use_ocdbt:
        return tss.kvstore_spec(param)
    spec: dict[str, Any] = {
        "driver": "ocdbt",
        "base": tss.kvstore_spec(),
        "path": param,
        "cache_pool": "cache_pool#ocdbt",
    }
    if write:
        spec.update(
            target_data_file_size=OCDBT_FILE_SIZE,
            assume_config=True,
            config={
                "max_inline_value_bytes": 1024,
                "max_decoded_node_bytes": 100_000_000,
                "manifest_kind": "single",
            },
        )
    return spec


class _Item:
    """One pytree item: its parsed ``_METADATA`` and side files."""

    def __init__(self, storage: Storage, context: ts.Context):
        self.storage, self.context = storage, context
        self.where = f"{storage.url}/{TREE_METADATA}"
        doc = read_json(storage, TREE_METADATA)
        if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
            raise InvalidManifestError(
                f"{self.where}: no 'tree_metadata' object; not an Orbax pytree item this "
                f"flax_ckpt reads (checked against orbax-checkpoint {TESTED_ORBAX_VERSION})"
            )
        use_ocdbt = doc.get("use_ocdbt")
        entries = set(storage.list())
        if use_ocdbt is None:
            use_ocdbt = OCDBT_MANIFEST in entries
        if use_ocdbt and OCDBT_MANIFEST not in entries:
            raise CorruptCheckpointError(
                f"{storage.url}: {TREE_METADATA} says OCDBT but {OCDBT_MANIFEST} is "
                "missing (a multi-process save that was never merged, or a partial copy)"
            )
        self.doc, self.use_ocdbt, self.use_zarr3 = doc, bool(use_ocdbt), bool(doc.get("use_zarr3", False))

    def strings(self) -> dict[str, Any]:
        return read_json(self.storage, STRINGS, checked=True) or {}

    def key_impls(self) -> dict[str, str]:
        """{param name: PRNG key implementation} from array_metadatas/process_*."""
        folder, impls = self.storage.sub("array_metadatas"), {}
        for name in folder.list():
            doc = read_json(folder, name) or {}
            for rec in doc.get("array_metadatas", []) if isinstance(doc, dict) else []:
                meta = rec.get("array_metadata", {}) if isinstance(rec, dict) else {}
                ext = meta.get("ext_metadata")
                if isinstance(ext, dict) and isinstance(ext.get("random_key_impl"), str):
                    impls[meta.get("param_name")] = ext["random_key_impl"]
        return impls

    def shardings(self) -> dict[str, dict[str, Any]]:
        """{param name: Orbax sharding description} from ``_sharding``."""
        out = {}
        for k, v in (read_json(self.storage, SHARDING) or {}).items():
            try:
                out[base64.urlsafe_b64decode(k.encode()).decode()] = json.loads(v)
            except (ValueError, TypeError):
                continue
        return out

    def entries(self, prefix: tree_mod.KeyPath) -> list[tuple[tree_mod.KeyPath, str, str]]:
        """(key path, parameter name, value type) of every entry but placeholders."""
        out = []
        for key, entry in self.doc["tree_metadata"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("value_metadata"), dict):
                raise InvalidManifestError(f"{self.where}: entry {key[:100]}: missing 'value_metadata'")
            path, param = _entry_path(entry.get("key_metadata"), self.where, key)
            vt = entry["value_metadata"].get("value_type")
            if not isinstance(vt, str):
                raise InvalidManifestError(f"{self.where}: entry {key[:100]}: 'value_type' must be a string")
            if vt != "placeholder":
                out.append((prefix + path, param, vt))
        # Orbax keeps an empty-container entry next to entries below it after partial saves: drop those
        # (its node in a trie of the key strings has children; one pass over the keys).
        trie: dict[str, Any] = {}
        ends = []
        for p, _, _ in out:
            node = trie
            for _, k in p:
                node = node.setdefault(str(k), {})
            ends.append(node)
        return [e for e, end in zip(out, ends) if not end]

    def read_spec(self, path: tree_mod.KeyPath, param: str) -> dict[str, Any]:
        if not self.use_ocdbt:  # one folder per parameter: the name must stay inside the item folder
            check_relpath(param, f"tree_metadata[{tree_mod.keystr(path)!r}]", self.where)
        return {
            "driver": "zarr3" if self.use_zarr3 else "zarr",
            "kvstore": array_kvstore(self.storage, param, self.use_ocdbt),
            "recheck_cached_data": False,
            "recheck_cached_metadata": False,
            "fill_missing_data_reads": False,
        }


class _Opened:
    """One array opened through tensorstore, with FolderArray's face: ``shape``, ``dtype``,
    ``metadata``, ``compressed``, ``read(box, out)``."""

    @staticmethod
    def stored_bytes() -> int:
        return 0  # unknown: the budget sums the files the walk found instead

    def __init__(self, store: Any):
        self.store = store
        self.shape, self.dtype = tuple(int(d) for d in store.shape), np.dtype(store.dtype.numpy_dtype)
        problem = shape_problem(list(self.shape), self.dtype.itemsize)
        if problem:
            raise ValueError(problem)
        chunk = store.chunk_layout.read_chunk.shape  # None for a 0-d array
        check_chunk(tuple(chunk or ()), self.shape, self.dtype)  # else tensorstore aborts (std::bad_alloc)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.store.spec().to_json().get("metadata", {})

    @property
    def compressed(self) -> bool:
        return _compressed(self.metadata)

    def read(self, box: Box, out: np.ndarray) -> None:
        whole = all(s == 0 and e == d for (s, e), d in zip(box, self.shape))
        out[...] = (self.store if whole else self.store[tuple(slice(s, e) for s, e in box)]).read().result()


def _entry_path(key_meta: Any, where: str, key: str) -> tuple[tree_mod.KeyPath, str]:
    """An entry's key path and parameter name; InvalidManifestError unless it is a list of at most
    MAX_PATH_DEPTH keys, each a name (key_type 2) or a sequence index (key_type 1) below MAX_INDEX."""
    if not isinstance(key_meta, list) or not key_meta:
        raise InvalidManifestError(f"{where}: entry {key[:100]}: 'key_metadata' must be a non-empty list")
    if len(key_meta) > MAX_PATH_DEPTH:
        raise InvalidManifestError(
            f"{where}: entry {key[:100]}...: {len(key_meta)} keys deep, deeper than "
            f"{MAX_PATH_DEPTH}; the Orbax checkpoint is damaged or crafted"
        )
    path = []
    for e in key_meta:
        if (
            not isinstance(e, dict)
            or not isinstance(e.get("key"), (str, int))
            or isinstance(e["key"], bool)
            or e.get("key_type") not in (1, 2)
        ):
            raise InvalidManifestError(f"{where}: entry {key[:100]}: bad key entry {str(e)[:100]}")
        name = e["key"] if isinstance(e["key"], str) else None
        if e["key_type"] == 1:
            index = (
                e["key"]
                if type(e["key"]) is int
                else int(name)
                if (name is not None and len(name) <= 10 and name.isascii() and name.isdigit())
                else -1
            )
            if not 0 <= index < MAX_INDEX:
                raise InvalidManifestError(
                    f"{where}: entry {key[:100]}: sequence key {str(e['key'])[:40]!r} is "
                    f"not an index below {MAX_INDEX}"
                )
            path.append(("idx", index))
        else:
            k = e["key"]  # a name, or an int (checked above)
            path.append(("key", k if isinstance(k, str) else _int_name(k, where, key)))
    return tuple(path), ".".join(str(k) for _, k in path)


def _int_name(number: int, where: str, key: str) -> str:
    """A name key stored as a JSON number, as its string (Orbax writes names as strings)."""
    if abs(number) >= MAX_INDEX:
        raise InvalidManifestError(f"{where}: entry {key[:100]}: key {str(number)[:40]} is not a name")
    return str(number)


class _MetadataCheck:
    """checks.check_tree's ``fail``: an InvalidManifestError naming the item's _METADATA and the leaf."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, why: str):
        raise InvalidManifestError(
            f"{self.where}: key paths that make no tree: {field}: {why}; the Orbax "
            "checkpoint is damaged or crafted"
        )


def _flax_sharding(desc: dict[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(desc, dict):
        return None
    if desc.get("sharding_type") == "NamedSharding":
        return {
            "type": "NamedSharding",
            "axis_names": desc.get("axis_names"),
            "mesh_shape": desc.get("shape"),
            "spec": desc.get("partition_spec"),
        }
    if desc.get("sharding_type") == "SingleDeviceSharding":
        return {"type": "SingleDeviceSharding", "num_devices": 1}
    return {"type": str(desc.get("sharding_type"))}


class OrbaxSource:
    """One located Orbax folder as one restore Source. Its value: the one pytree item of an unnamed
    folder (a StandardCheckpointer folder, a manager's ``default`` item, an item folder); for a step
    saved with named items (``args.Composite``), ``{item name: value}`` over every item, pytree items as
    trees and JSON items as their JSON (leaves of kind "json"), and a target is a dict keyed by item
    names (``select``); a JSON item alone (its folder, or ``item=``) is its JSON. Opening reads the JSON
    metadata and every array's zarr metadata, never array bytes.

    A local item of one folder per array is read by folders.FolderArray (no symlink followed, no FIFO
    read or waited on, file by file); any other item through tensorstore, after its folders were walked
    (locate.walk: tensorstore follows symlinks and blocks on FIFOs). An array whose folder holds a
    symlink below the array's own folder (a chunk file, found only when it is read) is read through
    tensorstore too, after that walk: symlinks inside the checkpoint are followed, those leading out
    refused."""

    remote: bool  # tensorstore's reads are requests: read the leaves concurrently (FolderArrays: in batches)

    def __init__(self, located: Located):
        self.located, self.url = located, located.storage.url
        roots = item_roots(located)
        context = context_for(located.storage)
        items = [(name, _Item(storage, context)) for name, storage in located.items.items()]
        self.items = [item for _, item in items]
        self.where = self.items[0].where if self.items else located.storage.url
        keyed = located.names is not None or len(items) > 1
        entries = [
            (item, path, param, vt)
            for name, item in items
            for path, param, vt in item.entries((("key", name),) if keyed else ())
        ]
        check_tree(
            [p for _, p, _, _ in entries],
            _MetadataCheck(self.where),
            lambda i: repr(tree_mod.keystr(entries[i][1])[:200]),
        )
        unknown = [
            f"{tree_mod.keystr(p)!r} ({vt})"
            for _, p, _, vt in entries
            if vt not in _ARRAY_TYPES and vt not in _EMPTY_TYPES and vt != "string"
        ]
        if unknown:
            raise UnsupportedOrbaxCheckpointError(
                f"{self.where}: leaves of value types flax_ckpt does not read (custom Orbax TypeHandlers): "
                f"{', '.join(unknown)}. Restore them with orbax-checkpoint, or pass a target without them "
                "and partial=True."
            )
        arrays = {
            i: (item, path, param) for i, (item, path, param, vt) in enumerate(entries) if vt in _ARRAY_TYPES
        }
        opened = (
            _open_folders(arrays) if roots is not None and not any(i.use_ocdbt for i in self.items) else None
        )
        self._roots, self._lock = roots, threading.Lock()
        self._files = None if opened is not None or roots is None else walk(roots)  # links out, FIFOs refused
        self.remote = opened is None
        futures = (
            {}
            if opened is not None
            else {
                i: ts.open(item.read_spec(path, param), open=True, read=True, context=item.context)
                for i, (item, path, param) in arrays.items()
            }
        )
        side = {
            id(item): (
                item.key_impls() if any(e[0] is item and e[3] in _ARRAY_TYPES for e in entries) else {},
                item.shardings() if any(e[0] is item and e[3] in _ARRAY_TYPES for e in entries) else {},
                item.strings() if any(e[0] is item and e[3] == "string" for e in entries) else {},
            )
            for item in self.items
        }
        self.arrays: dict[str, FolderArray | _Opened] = {}
        self.params: dict[str, tuple[_Item, str]] = {}
        self.leaves: list[LeafRecord] = []
        bad_impls = []
        for i, (item, path, param, vt) in enumerate(entries):
            impls, shardings, strings = side[id(item)]
            if vt in _EMPTY_TYPES:
                self.leaves.append(LeafRecord(path, "empty", value=_EMPTY_TYPES[vt]))
                continue
            if vt == "string":
                self.leaves.append(LeafRecord(path, "string", value=strings.get(param, "")))
                continue
            try:
                array = opened[i] if opened is not None else _Opened(futures[i].result())
            except Exception as e:
                raise CorruptCheckpointError(
                    f"{item.storage.url}: cannot open the array of "
                    f"{tree_mod.keystr(path)!r} (parameter {param!r}): {e}"
                ) from None
            shape, dtype = array.shape, array.dtype
            impl = impls.get(param)
            if impl is not None:
                key_shape = key_data_shape(impl)
                if key_shape is None:
                    bad_impls.append(f"{tree_mod.keystr(path)!r} ({impl})")
                    continue
                leaf = LeafRecord(
                    path, "prng_key", dtype, shape, impl, key_shape, _flax_sharding(shardings.get(param))
                )
            else:
                leaf = LeafRecord(
                    path,
                    _ARRAY_TYPES[vt],
                    dtype,
                    shape,
                    sharding=_flax_sharding(shardings.get(param)),
                    python=vt == "scalar",
                )
            self.leaves.append(leaf)
            self.arrays[leaf.name], self.params[leaf.name] = array, (item, param)
        if bad_impls:
            raise UnsupportedOrbaxCheckpointError(
                f"{self.items[0].storage.url}: PRNG key implementations this "
                f"jax does not know: {', '.join(bad_impls)}"
            )
        if located.json_root is not None:
            json_leaves = [((), located.json_root)]
        else:
            json_leaves = [((("key", n),), n) for n in located.names or () if n in located.json_items]
        self.leaves += [
            LeafRecord(path, "json", value=json_value(located.json_items[n], n)) for path, n in json_leaves
        ]
        if (names := located.names) is not None:  # {item name: value} in the order of the names
            self.leaves.sort(key=lambda leaf: names.index(leaf.path[0][1]))

    def select(self, target: Any) -> tuple["OrbaxSource", Any]:
        """For a step of named items: only the items ``target`` (a dict keyed by item names) names, each
        JSON item's target replaced by None (a JSON item comes back as stored)."""
        names = self.located.names
        if names is None or target is None:
            return self, target
        unknown = sorted(map(str, set(target) - set(names))) if isinstance(target, Mapping) else None
        if unknown is None or unknown:
            refused = self.located.refused
            trees = [n for n in names if n in self.located.items]
            json_names = [n for n in names if n not in self.located.items]
            example = (trees or json_names)[0]
            raise StructureMismatchError(
                f"restore of {self.url}: this Orbax step was saved with named items (args.Composite): "
                + " and ".join(
                    ([f"the pytree items {format_list(trees)}"] if trees else [])
                    + ([f"the JSON items {format_list(json_names)}"] if json_names else [])
                )
                + ". The target is a dict keyed by item names, e.g. "
                f"{{{example!r}: ...}} (only the items it names are read), or pass item={example!r} to "
                "restore one item by itself. "
                + (
                    f"Not items of this step: {format_list(unknown)}. "
                    if unknown
                    else f"The target is a {type(target).__name__}. "
                )
                + (f"Items flax_ckpt does not read: {', '.join(map(repr, refused))}." if refused else "")
            )
        view = copy.copy(self)
        view.leaves = [
            _as_text(leaf, target, self.located) for leaf in self.leaves if leaf.path[0][1] in target
        ]
        json_items = {n for n in names if n in self.located.json_items}
        return view, {k: None if k in json_items else v for k, v in target.items()}

    @property
    def budget(self) -> int | None:
        """See _budget; None on object stores (no bound known without every object's size)."""
        if self.located.storage.local_path is None:
            return None
        arrays = [self.arrays[leaf.name] for leaf in self.leaves if leaf.name in self.arrays]
        try:
            return _budget(self._files, self.leaves, arrays)
        except Unsupported:  # a symlink among the chunk files: the walk follows it (or refuses it)
            return _budget(self._walked(), self.leaves, arrays)

    def _walked(self) -> list[str]:
        with self._lock:
            if self._files is None:
                assert self._roots is not None, "only a local checkpoint's folders are walked"
                self._files = walk(self._roots)
            return self._files

    def _through_tensorstore(self, leaf: LeafRecord) -> _Opened:
        """The array of ``leaf`` opened by tensorstore, once the folders were walked; it replaces its
        FolderArray."""
        self._walked()
        item, param = self.params[leaf.name]
        with self._lock:
            array = self.arrays[leaf.name]
            if not isinstance(array, _Opened):
                array = _Opened(
                    ts.open(
                        item.read_spec(leaf.path, param), open=True, read=True, context=item.context
                    ).result()
                )
                if (array.shape, array.dtype) != (leaf.shape, leaf.dtype):
                    raise CorruptCheckpointError(
                        f"{item.storage.url}: the array of {leaf.name!r} changed since "
                        f"the checkpoint was opened"
                    )
                self.arrays[leaf.name] = array
            return array

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        try:
            try:
                self.arrays[leaf.name].read(box, out)
            except Unsupported:  # a symlink below the array's folder
                self._through_tensorstore(leaf).read(box, out)
        except Exception as e:
            item, param = self.params[leaf.name]
            raise CorruptCheckpointError(
                f"{item.storage.url}: reading {leaf.name!r} (parameter {param!r}) failed: {e}"
            ) from None

    def read_many(self, requests: Sequence[tuple[LeafRecord, Box, np.ndarray]]) -> None:
        for leaf, box, out in requests:
            self.read(leaf, box, out)

    def view(self, leaf: LeafRecord, box: Box) -> None:
        return None

    def info(self) -> CheckpointInfo:
        """fc.metadata of the Orbax checkpoint: shapes and dtypes from the zarr metadata, shardings from
        ``_sharding``; reads no array bytes."""
        loc = self.located
        first = self.items[0] if self.items else None
        custom = loc.meta.get("custom_metadata")
        if custom in (None, {}) and first is not None:
            custom = first.doc.get("custom_metadata")
        codec = (
            "json"
            if first is None
            else (f"{'zarr3' if first.use_zarr3 else 'zarr'}{'+ocdbt' if first.use_ocdbt else ''}")
        )
        return checkpoint_info(
            loc.storage.url,
            self.leaves,
            step=loc.step,
            metrics=step_metrics(loc),
            metadata=None if custom == {} else custom,
            created=_created(loc),
            process_count=_process_count(loc),
            serializer=f"orbax:{codec}",
            format="orbax",
        )

    def unchecked(self) -> list[str]:
        """The leaves whose stored bytes carry no checksum checked on read (verify reports them as
        unverified): arrays whose codecs have none (zarr v2; Orbax's zarr3 checksums only the shard
        index, its zstd frames carry none; flax_ckpt's zarr3 chunks have a crc32c codec), strings and
        JSON items unless their file has flax_ckpt's ``.crc32c`` beside it (Orbax writes none)."""
        out, strings = [], {}
        for leaf in self.leaves:
            if leaf.kind == "string":
                item = self.items[0] if len(self.items) == 1 else self._item_of(leaf)
                if id(item) not in strings:
                    strings[id(item)] = checksummed(item.storage, STRINGS)
                ok = strings[id(item)]
            elif leaf.kind == "json":
                name = leaf.path[0][1] if leaf.path else self.located.json_root
                assert name is not None, "a JSON leaf without a path is the step's JSON root item"
                ok = json_checksummed(self.located.json_items[name], name)
            else:
                ok = not leaf.is_array or data_checksummed(self.arrays[leaf.name].metadata)
            if not ok:
                out.append(leaf.name)
        return out

    def verify(self, update: Callable[[int], None]) -> list[Damage]:
        """Reads every array leaf back (tensorstore checks what the codecs checksum), one leaf at a time."""
        return read_back(self, update)

    def _item_of(self, leaf: LeafRecord) -> "_Item":
        """The pytree item a leaf of a step of several items belongs to (its first key is the item's name)."""
        return dict(zip(self.located.items, self.items))[leaf.path[0][1]]

    @property
    def hint(self) -> str:
        items = [n for n in self.located.items if n is not None]
        return (
            f"This step holds the pytree items {format_list(items)}: the target is a dict keyed by them. "
            if len(items) > 1 and self.located.names is None
            else ""
        )

    @property
    def step(self) -> int | None:
        return self.located.step

    @property
    def metrics(self) -> dict[str, Any] | None:
        return step_metrics(self.located)


def _as_text(leaf: LeafRecord, target: Mapping[str, Any], located: Located) -> LeafRecord:
    """A grain item's leaf as its file's text where the target's item is bytes or a str (a grain
    ``DataLoaderIterator``'s ``get_state()``, bytes; or a wrapper's str of it), else as parsed JSON."""
    name = leaf.path[0][1]
    handlers = located.meta.get("item_handlers")
    wanted = target.get(name)
    if leaf.kind != "json" or not isinstance(wanted, (bytes, str)) or not isinstance(handlers, dict):
        return leaf
    if not is_grain(handlers.get(name)):
        return leaf
    raw = json_text(located.json_items[name], name)
    return dataclasses.replace(leaf, value=raw if isinstance(wanted, bytes) else raw.decode())


def _budget(
    files: list[str] | None, leaves: Sequence[LeafRecord], arrays: Sequence[FolderArray | _Opened]
) -> int:
    """The bytes a restore of a local Orbax folder may allocate (Reader refuses more with a
    CorruptCheckpointError before allocating): as the native layout's, twice the stored bytes plus
    _BUDGET_SLACK when no array is compressed; else MAX_EXPANSION times them (an array of zeros
    compresses that far, and a folder can claim no more). The stored bytes: of the regular ``files``
    the walk found, or (None) the FolderArrays' chunk files. Both readers stop decoding a chunk at its
    declared size, so a chunk that expands further is an error, never a larger allocation. Arrays
    declaring at most _BUDGET_SLACK in all fit any budget: then no file's size is asked."""
    if sum(leaf.nbytes for leaf in leaves if leaf.is_array) <= _BUDGET_SLACK:
        return _BUDGET_SLACK
    compressed = any(a.compressed for a in arrays)
    stored = stored_size(files) if files is not None else sum(a.stored_bytes() for a in arrays)
    return (MAX_EXPANSION if compressed else 2) * stored + _BUDGET_SLACK


def _compressed(metadata: dict[str, Any]) -> bool:
    """Whether a zarr array's chunks go through a codec other than byte layout and checksums."""
    if metadata.get("zarr_format") == 2 or "compressor" in metadata:
        return metadata.get("compressor") is not None or bool(metadata.get("filters"))

    def chain(codecs: Any) -> bool:
        for c in codecs if isinstance(codecs, list) else [codecs]:
            name = c.get("name") if isinstance(c, dict) else c
            if name == "sharding_indexed":
                if chain((c.get("configuration") or {}).get("codecs")):
                    return True
            elif name not in ("bytes", "crc32c", "transpose"):
                return True
        return False

    return chain(metadata.get("codecs", []))


def data_checksummed(metadata: dict[str, Any]) -> bool:
    """Whether a zarr array's chunk data (not just a shard index) is covered by a checksum: a crc32c
    codec, or zstd frames written with their checksum. zarr v2 compressors carry none."""

    def chain(codecs: Any) -> bool:
        for c in codecs if isinstance(codecs, list) else []:
            conf = c.get("configuration") or {} if isinstance(c, dict) else {}
            name = c.get("name") if isinstance(c, dict) else None
            if name == "crc32c" or (name == "zstd" and conf.get("checksum")):
                return True
            if name == "sharding_indexed" and chain(conf.get("codecs")):
                return True
        return False

    return metadata.get("zarr_format") != 2 and chain(metadata.get("codecs"))


def _open_folders(arrays: dict[int, tuple[_Item, tree_mod.KeyPath, str]]) -> dict[int, FolderArray] | None:
    """{entry: FolderArray} for every array of local one-folder-per-array items, or None when one of them
    is not read that way (folders.Unsupported: tensorstore reads them all, after the walk)."""
    opened = {}
    for i, (item, path, param) in arrays.items():
        check_relpath(
            param, f"tree_metadata[{tree_mod.keystr(path)!r}]", item.where
        )  # a folder inside the item
        try:
            root = item.storage.local_path
            assert root is not None, "folders are opened for a local checkpoint's items"
            opened[i] = FolderArray(root, param, item.use_zarr3)
        except Unsupported:
            return None
        except (CorruptCheckpointError, OSError) as e:
            raise CorruptCheckpointError(
                f"{item.storage.url}: cannot open the array of {tree_mod.keystr(path)!r} "
                f"(parameter {param!r}): {e}"
            ) from None
    return opened


def _process_count(located: Located) -> int:
    counts = [
        sum(1 for n in item.list() if n.startswith("ocdbt.process_")) for item in located.items.values()
    ]
    counts += [len(item.sub("array_metadatas").list()) for item in located.items.values()]
    return max([1, *counts])


def _created(located: Located) -> float:
    for key in ("commit_timestamp_nsecs", "init_timestamp_nsecs"):
        if isinstance(located.meta.get(key), int):
            return located.meta[key] / 1e9
    return 0.0
