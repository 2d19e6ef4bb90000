"""Finding Orbax checkpoints: which folder is an Orbax step or item, its items, and a run's steps.

Scope: Orbax's on-disk layout above the arrays (facts from orbax-checkpoint 0.12.8's source, tested
against it): ``_CHECKPOINT_METADATA`` (item handlers, metrics, timestamps), an item's ``_METADATA``,
``commit_success.txt``, JSON items, step folders ``<step>`` or ``<prefix>_<step>`` and in-flight
``*.orbax-checkpoint-tmp*`` folders. Everything here reads folder listings and small JSON files, never
array bytes; reading arrays is read.py's, writing write.py's.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import crc32c

from flax_ckpt._src import checks
from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.errors import (
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidManifestError,
    TargetMismatchError,
    UnsupportedOrbaxCheckpointError,
    format_list,
)
from flax_ckpt._src.storage import Storage

TESTED_ORBAX_VERSION = "0.12.8"
TREE_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
SHARDING = "_sharding"
STRINGS = "_strings.json"
OCDBT_MANIFEST = "manifest.ocdbt"
TMP_SUFFIX = commit_mod.ORBAX_TMP_MARK
JSON_FILES = ("metadata", "data.json")
# the names Orbax writes into a step or item folder (an ocdbt item also has ocdbt.process_<i>/ folders)
ORBAX_PARTS = frozenset(
    {TREE_METADATA, CHECKPOINT_METADATA, COMMIT_SUCCESS, SHARDING, STRINGS, OCDBT_MANIFEST, "d"}
)
PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
STANDARD_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
_PYTREE_CLASSES = frozenset({"PyTreeCheckpointHandler", "StandardCheckpointHandler", "PyTreeHandler"})
_JSON_CLASSES = frozenset({"JsonCheckpointHandler", "JsonHandler"})
# grain's handler for its data iterators (grain.python.PyGrainCheckpointSave/Restore): one JSON text file
# per process, process_<index>-of-<count>.json, the iterator's get_state() (json.dumps(..., indent=4) for a
# DatasetIterator's dict, the text of a DataLoaderIterator's bytes). Read and written as a JSON item.
_GRAIN_CLASSES = frozenset({"CheckpointHandler", "PyGrainCheckpointHandler"})
DEFAULT_ITEM, METRICS_ITEM = "default", "metrics"  # a manager's unnamed item; its step metrics
_STEP_NAME = re.compile(r"(?:(.+)_)?([0-9]+)")  # ASCII digits only: "²", "٣" or "𝟑" are no steps
CRC_SUFFIX = (
    ".crc32c"  # beside a JSON data file flax_ckpt wrote (a JSON item's, _strings.json): its crc32c, in
)
#                         decimal; Orbax reads only the file itself


def name_of(storage: Storage) -> str:
    return storage.url.rstrip("/").rsplit("/", 1)[-1]


def read_json(storage: Storage, name: str, *, checked: bool = False) -> Any:
    """The parsed JSON file ``name`` in ``storage``; None when it does not exist. ``checked``: a data
    file whose ``<name>.crc32c`` (written by flax_ckpt) is checked when there is one."""
    try:
        raw = storage.read(name, checks.MAX_MANIFEST_BYTES)  # what orbax/write.py writes at most
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if len(raw) > checks.MAX_MANIFEST_BYTES:
        raise InvalidManifestError(
            f"{storage.url}/{name}: larger than {checks.MAX_MANIFEST_BYTES} bytes; not Orbax metadata"
        )
    if checked:
        _check_crc(storage, name, raw)
    try:
        return json.loads(raw)
    except ValueError as e:
        raise InvalidManifestError(
            f"{storage.url}/{name}: not valid JSON ({e}); the Orbax checkpoint is damaged"
        ) from None


def _check_crc(storage: Storage, name: str, raw: bytes) -> None:
    try:
        want = storage.read(name + CRC_SUFFIX, 64).strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return  # written by Orbax: no checksum (verify reports it as unverified)
    got = crc32c.crc32c(raw)
    if want != str(got).encode():
        raise CorruptCheckpointError(
            f"{storage.url}/{name}: its crc32c is {got}, but {name}{CRC_SUFFIX} says "
            f"{want.decode(errors='replace')!r}: the file is damaged"
        )


def checksummed(storage: Storage, name: str) -> bool:
    """Whether the JSON data file ``name`` carries flax_ckpt's checksum (``<name>.crc32c``)."""
    return storage.exists(name + CRC_SUFFIX)


def is_orbax(folder: Storage) -> bool:
    """True when ``folder`` holds an Orbax layout (no flax_ckpt manifest; ``_METADATA`` or
    ``_CHECKPOINT_METADATA``, or a committed JSON item's file). Reads one folder listing, no file."""
    try:
        entries = set(folder.list())
    except Exception:
        return False
    if MANIFEST in entries:
        return False
    return bool(entries & {TREE_METADATA, CHECKPOINT_METADATA}) or (
        COMMIT_SUCCESS in entries and bool(entries & {name_of(folder), *JSON_FILES})
    )


def item_roots(located: "Located") -> list[str] | None:
    """The local folders a located Orbax checkpoint is read from: its own and those of its items that
    lie beside it (the sibling items of an item folder), or None on object stores. An item anywhere
    else (item names in _CHECKPOINT_METADATA leading out, a symlinked sibling) is a
    CorruptCheckpointError."""
    base = located.storage
    if base.local_path is None:
        return None
    roots, parent = [base.local_path], os.path.dirname(base.local_path)
    an_item = None in located.items or located.json_root is not None  # ``base`` is one item of a step
    for s in (*located.items.values(), *located.json_items.values()):
        path = s.local_path
        assert path is not None, "the items of a local checkpoint are local folders"
        if path == base.local_path or path.startswith(base.local_path + os.sep):
            continue  # walked with the checkpoint folder
        if not an_item or os.path.dirname(path) != parent or os.path.islink(path):  # an item's sibling items
            raise CorruptCheckpointError(
                f"{path}: an item of {base.url} that lies outside its folder"
                + (f" and its step's {parent}" if an_item else "")
                + " (item names in _CHECKPOINT_METADATA leading out); refusing to "
                "read the checkpoint"
            )
        roots.append(path)
    return roots


def walk(roots: list[str]) -> list[str]:
    """Walks the local folders an Orbax checkpoint is read from (``item_roots``) before tensorstore
    opens anything in them (it follows symlinks and blocks on FIFOs): CorruptCheckpointError for a
    symlink that leads out of the checkpoint folder (symlinks inside it are followed, as the native
    layout's walk does), and for a FIFO, device or socket. Returns the paths of the regular files found
    (``stored_size`` sums them for the restore budget). Hard links are not refused (a ``cp -al`` backup
    has them); ``verify`` reports them. One scandir per folder, file types from the listing: no stat
    per file."""
    files: list[str] = []
    for root in roots:
        _walk(root, files)
    return files


def _walk(root: str, files: list[str]) -> None:
    real_root = os.path.realpath(root)
    folders = [root]
    while folders:
        try:
            with os.scandir(folders.pop()) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        folders.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        files.append(e.path)
                    elif e.is_symlink():
                        _check_link(e.path, real_root, files)
                    else:
                        raise CorruptCheckpointError(
                            f"{e.path} is not a regular file (a FIFO, device or socket); "
                            "refusing to read the checkpoint"
                        )
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed meanwhile (or an item folder that is not there): reads will say so
        except OSError as e:
            raise CorruptCheckpointError(
                f"{e.filename}: {e.strerror}; refusing to read the checkpoint"
            ) from None


def _check_link(path: str, real_root: str, files: list[str]) -> None:
    """A symlink in the folder: it must resolve inside it, to a folder (walked there) or a regular file."""
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise CorruptCheckpointError(
            f"{path} resolves to {real}, outside the checkpoint folder {real_root}; "
            "refusing to read the checkpoint"
        )
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # dangling: a read of it fails as a missing file
    except OSError as e:  # a loop
        raise CorruptCheckpointError(f"{path}: {e.strerror}; refusing to read the checkpoint") from None
    if stat.S_ISREG(st.st_mode):
        files.append(real)
    elif not stat.S_ISDIR(st.st_mode):
        raise CorruptCheckpointError(
            f"{path} is not a regular file (a FIFO, device or socket); refusing to read the checkpoint"
        )


def stored_size(files: list[str]) -> int:
    """The bytes of the files ``walk`` found (one lstat each; a file removed meanwhile counts 0)."""
    total = 0
    for path in files:
        try:
            total += os.lstat(path).st_size
        except OSError:
            continue
    return total


def handler_kind(handler: Any) -> str:
    """ "pytree", "json" (Orbax's JSON handlers and grain's, whose items are JSON files) or "unknown"."""
    if is_grain(handler):
        return "json"
    cls = handler.rsplit(".", 1)[-1] if isinstance(handler, str) and handler.startswith("orbax.") else None
    return "pytree" if cls in _PYTREE_CLASSES else "json" if cls in _JSON_CLASSES else "unknown"


def is_grain(handler: Any) -> bool:
    """Whether ``handler`` (as ``_CHECKPOINT_METADATA``'s item_handlers records it) is grain's
    ``PyGrainCheckpointHandler``, whose item is one JSON file per process (``process_file``)."""
    return (
        isinstance(handler, str)
        and handler.startswith("grain.")
        and handler.rsplit(".", 1)[-1] in _GRAIN_CLASSES
    )


def process_file() -> str:
    """The file of this process in a grain item: ``process_<index>-of-<count>.json`` (grain's names)."""
    import jax

    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


@dataclass(frozen=True)
class Located:
    """A committed Orbax folder: its pytree items (key None: the folder is the item), JSON items (the
    step's ``metrics`` among them), step metadata and step number. ``names``: for a step saved with
    named items (``args.Composite``: item names other than a manager's single ``default``), the names
    of the items restore gives back, as ``{name: value}``; None otherwise. ``json_root``: the JSON item
    that is the whole value (a JSON item's own folder, or ``item=`` naming one). ``refused``: items of
    handlers flax_ckpt does not read, {name: handler}."""

    storage: Storage
    items: dict[str | None, Storage]
    json_items: dict[str, Storage]
    meta: dict[str, Any]
    step: int | None
    names: tuple[str, ...] | None = None
    json_root: str | None = None
    refused: dict[str, str] = field(default_factory=dict)

    def all_names(self) -> list[str]:
        """The items of this folder one can ask for by name (``item=``)."""
        names = self.names if self.names is not None else [n for n in self.items if n is not None]
        return sorted(names)


def _refuse_msgpack(storage: Storage) -> None:
    if "checkpoint" in storage.list():
        raise UnsupportedOrbaxCheckpointError(
            f"{storage.url} is a legacy msgpack Orbax checkpoint (a 'checkpoint' file, no {TREE_METADATA}); "
            "flax_ckpt reads only the tensorstore layout. Restore it with orbax-checkpoint and re-save it."
        )


def _items_from_handlers(storage: Storage, handlers: dict[str, Any]) -> tuple[dict, dict, dict]:
    items, json_items, refused = {}, {}, {}
    for name, handler in handlers.items():
        kind = handler_kind(handler)
        if kind == "pytree":
            items[name] = storage.sub(name)
        elif kind == "json":
            json_items[name] = storage.sub(name)
        else:
            refused[name] = str(handler)
    if not items and refused:
        raise UnsupportedOrbaxCheckpointError(
            f"{storage.url}: no item flax_ckpt can read; item handlers {_refused_text(refused)} are not "
            "supported (only PyTreeCheckpointHandler, StandardCheckpointHandler, PyTreeHandler and JSON "
            "items are). Restore it with orbax-checkpoint."
        )
    return items, json_items, refused


def _refused_text(refused: dict[str, str]) -> str:
    return ", ".join(f"{n!r} ({h})" for n, h in refused.items())


def _named(names: set[str], handlers: Any) -> bool:
    """A step of named items (args.Composite): item names other than a manager's single ``default``
    or the single ``state`` of the v1 API's ``save_pytree`` (its PyTreeHandler)."""
    names = names - {METRICS_ITEM}
    v1_pytree = (
        names == {"state"}
        and isinstance(handlers, dict)
        and str(handlers["state"]).endswith(".PyTreeHandler")
    )
    return bool(names) and names != {DEFAULT_ITEM} and not v1_pytree


def _items_by_listing(storage: Storage, entries: set[str]) -> tuple[dict, dict]:
    items, json_items = {}, {}
    for name in sorted(entries):
        inner = set(storage.sub(name).list())
        if TREE_METADATA in inner:
            items[name] = storage.sub(name)
        elif inner & {name, *JSON_FILES}:
            json_items[name] = storage.sub(name)
    return items, json_items


def step_number(name: str) -> int | None:
    """The step of an Orbax step folder name (``<step>`` or ``<prefix>_<step>``, ASCII digits), or None."""
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(2)) if m else None


def step_parts(name: str) -> tuple[str | None, int] | None:
    """(prefix or None, step) of a step folder name (``<step>`` or ``<prefix>_<step>``), or None."""
    m = _STEP_NAME.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else None


def _as_item_of_step(storage: Storage, meta: dict[str, Any]) -> Located:
    """A pytree item folder; inside a CheckpointManager step, with that step's metadata and metrics."""
    parent, name = storage.parent()
    step_meta = {} if meta else read_json(parent, CHECKPOINT_METADATA)
    handlers = step_meta.get("item_handlers") if isinstance(step_meta, dict) else None
    if not isinstance(handlers, dict) or handler_kind(handlers.get(name)) != "pytree":
        return Located(storage, {None: storage}, {}, meta, None)
    json_items = {n: parent.sub(n) for n, h in handlers.items() if handler_kind(h) == "json"}
    return Located(storage, {None: storage}, json_items, step_meta, step_number(name_of(parent)))


def _as_json_item_of_step(storage: Storage, entries: set[str]) -> Located | None:
    """A JSON item's own folder inside a CheckpointManager step (its value is the JSON), or None."""
    parent, name = storage.parent()
    if not entries & {name, *JSON_FILES}:
        return None
    step_meta = read_json(parent, CHECKPOINT_METADATA)
    handlers = step_meta.get("item_handlers") if isinstance(step_meta, dict) else None
    if not isinstance(handlers, dict) or handler_kind(handlers.get(name)) != "json":
        return None
    json_items = {n: parent.sub(n) for n, h in handlers.items() if handler_kind(h) == "json"}
    return Located(storage, {}, json_items, step_meta, step_number(name_of(parent)), json_root=name)


def only(located: Located, item: str) -> Located:
    """The one item ``item`` of a located step (``fc.restore(..., item=...)``): a pytree item as its own
    tree, a JSON item as its JSON. TargetMismatchError naming the items there are."""
    if item in located.items and item is not None:
        return Located(
            located.items[item], {None: located.items[item]}, located.json_items, located.meta, located.step
        )
    if item in located.json_items and item != METRICS_ITEM:
        return Located(
            located.json_items[item], {}, located.json_items, located.meta, located.step, json_root=item
        )
    names = located.all_names()
    if item in located.refused:
        raise UnsupportedOrbaxCheckpointError(
            f"{located.storage.url}: item {item!r} was written by {located.refused[item]}, which flax_ckpt does "
            f"not read (items it reads: {format_list(names)}). Restore it with orbax-checkpoint."
        )
    if not names or None in located.items:
        raise TargetMismatchError(
            f"{located.storage.url} holds one unnamed Orbax item (a StandardCheckpointer folder, or one item of "
            f"a step), so there is no item {item!r} to choose: restore it without item="
        )
    raise TargetMismatchError(
        f"{located.storage.url} has no item {item!r}; its items are {format_list(names)}"
    )


def locate(storage: Storage, item: str | None = None) -> Located:
    """The committed Orbax checkpoint in folder ``storage``: a StandardCheckpointer/PyTreeCheckpointer
    folder, a CheckpointManager step folder, or an item folder inside one (a pytree or a JSON item).
    ``item``: only that item of a step (``only``)."""
    located = _locate(storage)
    return located if item is None else only(located, item)


def _locate(storage: Storage) -> Located:
    entries = set(storage.list())
    if not entries:
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url} (the folder is missing or empty)")
    if commit_mod.is_temporary(name_of(storage)):
        raise CheckpointNotCommittedError(
            f"{storage.url} is the folder of an Orbax save in flight or one that crashed; it is never read"
        )
    meta = read_json(storage, CHECKPOINT_METADATA)
    meta = meta if isinstance(meta, dict) else {}
    if not storage.supports_rename and COMMIT_SUCCESS not in entries:
        raise CheckpointNotCommittedError(
            f"{storage.url} has no {COMMIT_SUCCESS}: on an object store an "
            "Orbax checkpoint without it is uncommitted and never read"
        )
    handlers = meta.get("item_handlers")
    if TREE_METADATA in entries:
        if isinstance(handlers, str) and handler_kind(handlers) != "pytree":
            raise UnsupportedOrbaxCheckpointError(
                f"{storage.url}: written by {handlers}, which flax_ckpt does not read (only PyTree and "
                "Standard checkpoint handlers). Restore it with orbax-checkpoint."
            )
        return _as_item_of_step(storage, meta)
    if CHECKPOINT_METADATA not in entries:
        json_item = _as_json_item_of_step(storage, entries)
        if json_item is not None:
            return json_item
    refused: dict[str, str] = {}
    if isinstance(handlers, dict):
        items, json_items, refused = _items_from_handlers(storage, handlers)
    else:
        _refuse_msgpack(storage)
        items, json_items = _items_by_listing(storage, entries)
    for item in items.values():
        if TREE_METADATA not in item.list():
            _refuse_msgpack(item)
            raise CorruptCheckpointError(
                f"{item.url}: the pytree item has no {TREE_METADATA}; the Orbax checkpoint is incomplete"
            )
    found = set(items) | set(json_items) | set(refused)
    names = tuple(sorted(n for n in found if n in items or (n in json_items and n != METRICS_ITEM)))
    named = _named(found, handlers)
    if not items and not (named and names):
        raise UnsupportedOrbaxCheckpointError(
            f"{storage.url}: an Orbax folder without any pytree item "
            f"(items: {format_list(sorted(json_items))}); nothing to restore"
        )
    return Located(
        storage,
        items,
        json_items,
        meta,
        step_number(name_of(storage)),
        names=names if named else None,
        refused=refused,
    )


def run_items(step: Storage) -> dict[str, str] | None:
    """The items a committed step of a run holds, for a step of named items (``args.Composite``):
    {item name: its handler} (the ``metrics`` item left out; handlers flax_ckpt does not read included,
    for the writer to refuse); None for a step of one unnamed item. New steps of the run get these."""
    located = _locate(step)
    if located.names is None:
        return None
    recorded = located.meta.get("item_handlers")
    recorded = recorded if isinstance(recorded, dict) else {}
    items = {
        n: str(recorded.get(n) or (STANDARD_HANDLER if n in located.items else JSON_HANDLER))
        for n in located.names
    }
    return {**items, **located.refused}


# ------------------------------------------------------------------- an Orbax CheckpointManager dir


def step_dirs(root: Storage, entries: list[str] | None = None) -> dict[int, str]:
    """{step: folder name} of the committed Orbax steps under a run directory ``root`` (``<step>`` or
    ``<prefix>_<step>`` folders, e.g. Orbax's ``step_prefix="ckpt"`` with a fixed length:
    ``ckpt_000010``); in-flight folders and flax_ckpt steps are ignored. ``entries``: a listing of
    ``root`` already made (None: listed here)."""
    found: dict[int, str] = {}
    for entry in root.list() if entries is None else entries:
        m = _STEP_NAME.fullmatch(entry)
        if m is None or commit_mod.is_temporary(entry) or not committed_step(root.sub(entry)):
            continue
        step = int(m.group(2))
        if step not in found or m.group(1) is None:
            found[step] = entry
    return found


def step_name(step: int, names: list[str]) -> str:
    """The folder name of a new step of an Orbax run whose step folders are ``names``: the same
    ``step_prefix`` and zero padding (``step_format_fixed_length``), so that Orbax finds it."""
    found = [m for m in map(_STEP_NAME.fullmatch, names) if m is not None]
    prefix = found[-1].group(1) if found else None
    padded = [len(m.group(2)) for m in found if m.group(2).startswith("0") and len(m.group(2)) > 1]
    digits = f"{int(step):0{max(padded, default=0)}d}"
    return f"{prefix}_{digits}" if prefix else digits


def step_folder(root: Storage, step: int) -> Storage:
    """The folder of committed Orbax step ``step`` of a run directory (CheckpointNotFoundError if none)."""
    dirs = step_dirs(root)
    if step not in dirs:
        raise CheckpointNotFoundError(
            f"no committed Orbax step {step} in {root.url} (steps: {sorted(dirs) or 'none'})"
        )
    return root.sub(dirs[step])


def committed_step(folder: Storage) -> bool:
    """An Orbax step folder that is committed: ``commit_success.txt`` (required on object stores), or on
    a local file system (where the rename commits) ``_CHECKPOINT_METADATA`` or an item's ``_METADATA``."""
    inner = set(folder.list())
    if MANIFEST in inner:
        return False  # a flax_ckpt step
    if COMMIT_SUCCESS in inner:
        return True
    return folder.supports_rename and (
        CHECKPOINT_METADATA in inner or any(TREE_METADATA in folder.sub(n).list() for n in sorted(inner))
    )


def _json_names(item: str) -> tuple[str, ...]:
    """The files a JSON item's value may live in, in the order they are looked for: named like the item
    (a manager's ``metrics/metrics``), JsonCheckpointHandler's ``metadata``, the v1 JsonHandler's
    ``data.json``, and this process's file of a grain item."""
    return (item, *JSON_FILES, process_file())


def read_json_item(storage: Storage, item: str) -> Any:
    """A JSON item's value, from the first of its files (``_json_names``) that exists; None if none does."""
    for name in _json_names(item):
        found = read_json(storage, name, checked=True)
        if found is not None:
            return found
    return None


def json_file(storage: Storage, item: str) -> str:
    """The file of JSON item ``item`` in its folder ``storage`` (as ``_json_names`` looks for it);
    CorruptCheckpointError when there is none (naming the grain files of other process counts there)."""
    names = _json_names(item)
    for name in names:
        if storage.exists(name):
            return name
    others = sorted(n for n in storage.list() if re.fullmatch(r"process_[0-9]+-of-[0-9]+\.json", n))
    if others:
        raise CorruptCheckpointError(
            f"{storage.url}: the grain item {item!r} holds {format_list(others)}, written by a job of another "
            f"process count, and no {names[-1]} for this process; restore it with as many processes as "
            "wrote it (grain's own handler needs the same)"
        )
    raise CorruptCheckpointError(
        f"{storage.url}: the JSON item {item!r} has no file "
        f"({format_list(list(names))}); the Orbax checkpoint is incomplete"
    )


def json_value(storage: Storage, item: str) -> Any:
    """A JSON item's value, parsed from its file (``json_file``)."""
    return read_json(storage, json_file(storage, item), checked=True)


def json_text(storage: Storage, item: str) -> bytes:
    """A JSON item's file as it is stored (checked against its ``.crc32c`` when flax_ckpt wrote it): a
    grain DataLoaderIterator's state, which its ``set_state`` takes as bytes."""
    name = json_file(storage, item)
    raw = storage.read(name, checks.MAX_MANIFEST_BYTES)
    _check_crc(storage, name, raw)
    return raw


def json_checksummed(storage: Storage, item: str) -> bool:
    """Whether a JSON item's file (as json_value finds it) carries flax_ckpt's checksum."""
    name = next((n for n in _json_names(item) if storage.exists(n)), None)
    return name is not None and checksummed(storage, name)


def step_metrics(located: Located) -> dict[str, Any] | None:
    """The metrics saved with a step (the ``metrics`` item, else ``_CHECKPOINT_METADATA``), or None."""
    if "metrics" in located.json_items:
        found = read_json_item(located.json_items["metrics"], "metrics")
        if isinstance(found, dict):
            return found
    m = located.meta.get("metrics")
    return m if isinstance(m, dict) and m else None


def json_items(located: Located) -> dict[str, Any]:
    """The JSON items of an Orbax step (composite checkpoints), ``{item name: value}``."""
    return {name: read_json_item(s, name) for name, s in located.json_items.items()}
