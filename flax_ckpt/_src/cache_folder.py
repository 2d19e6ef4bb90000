"""The folder of a run's compilation cache: which folder is the cache's, and what in it the cache may delete.

Scope: the cache's root folder and the names in it. A root is the cache's once it holds the cache's
marker (``MARKER``, a JSON file with the cache's random id), which the first writer puts into a folder
that is missing or empty. Below the marker are one folder per JAX version and device kind, named
``jax<version>-jaxlib<version>-<kind>``, holding entries named ``<key>.<bytes>.<id>.xc`` and, on a local
disk, temporaries named ``.<id>-<random>.tmp`` while they are written. A root that holds anything else (a
run's steps, a user's files, another cache's entries with another id, a link, a FIFO) is refused whole:
nothing in it is read, written or deleted. So what the cache deletes is always a name of its own pattern,
carrying its own id, in its own marked root: it never deletes what it did not write.

On a local disk, as the memory tiers do (storage/owned.py): the root and its folders are created with mode
0700 and checked with lstat before anything in them is read; a symlink, another user's folder, or one
group or others can write is refused (an entry is code that JAX runs). Entries are listed by type without
following links: a link or a FIFO in place of an entry refuses the root, so nothing is read through a link
and no read waits on a FIFO. Object stores (``s3://``, ``gs://``) have no owners or modes to check.

Not here: the entries' bytes and JAX's interface (compile_cache.py).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass, field

from flax_ckpt._src.errors import StorageError
from flax_ckpt._src.storage import Storage
from flax_ckpt._src.storage.kv import KvStorage
from flax_ckpt._src.storage.owned import folder_problem

MARKER = "flax_ckpt_compile_cache.json"  # the root's marker: {"format": _FORMAT, "id": <16 hex>}
_FORMAT = "flax_ckpt compilation cache"
_ID = "[0-9a-f]{16}"
NAMESPACE = re.compile(r"jax[A-Za-z0-9_.+\-]{1,200}")  # compile_cache.namespace()'s folders
ENTRY = re.compile(rf"(?P<key>[A-Za-z0-9_.\-]{{1,200}})\.(?P<n>[0-9]{{1,15}})\.(?P<id>{_ID})\.xc")
_TMP = re.compile(rf"\.(?P<id>{_ID})-[0-9a-f]{{16}}\.tmp")
_MARKER_TMP = re.compile(re.escape(MARKER) + r"\.tmp-[0-9a-f]{32}")  # LocalStorage.write_if_absent's
TMP_AGE_S = 600.0  # a temporary this old is a write that died (a write takes milliseconds): removed


class NotTheCache(StorageError):
    """A location the compilation cache does not use: it holds what the cache did not write, or another
    user could write there. The message names it, what was found, and the fix."""


@dataclass
class Root:
    """A marked root as listed at open: its storage, its id (None: nothing there yet, as a process
    other than the writer found it), and per namespace folder its entries (name -> bytes) and
    temporaries (name -> age in seconds)."""

    storage: Storage
    id: str | None
    entries: dict[str, dict[str, int]] = field(default_factory=dict)
    tmps: dict[str, dict[str, float]] = field(default_factory=dict)

    def entry_name(self, key: str, nbytes: int) -> str:
        return f"{key}.{nbytes}.{self.id}.xc"

    def tmp_name(self) -> str:
        return f".{self.id}-{uuid.uuid4().hex[:16]}.tmp"


def key_of(name: str) -> str:
    """The key an entry's name stores (the name matches ENTRY)."""
    m = ENTRY.fullmatch(name)
    assert m is not None
    return m["key"]


def open_root(root: Storage, *, writer: bool) -> Root:
    """The cache's root at ``root``, listed: its marker written first where the folder is missing or
    empty (``writer``). Raises NotTheCache for a folder that is not the cache's (see the module's
    docstring), StorageError or OSError where it cannot be listed."""
    path = root.local_path
    if path is not None and writer:
        _private_folder(path)
    names = _list(root)
    if names is None and not writer:  # nothing there yet
        return Root(root, None)
    names = names or {}
    marked = names.pop(MARKER, None)
    spaces = [n for n in names if not (_MARKER_TMP.fullmatch(n) and names[n] == "file")]
    if marked is None and not spaces and not writer:
        return Root(root, None)
    if marked is None and spaces:
        _refuse(root, spaces, "it has no marker: it is a run directory, or a folder of other files")
    if marked not in (None, "file"):
        _refuse(root, [MARKER], f"the marker is a {marked}")
    found = _marker(root) if marked else _mark(root)
    entries: dict[str, dict[str, int]] = {}
    tmps: dict[str, dict[str, float]] = {}
    for ns in spaces:
        if not NAMESPACE.fullmatch(ns):
            _refuse(root, [ns], f"a {names[ns]} not named as the cache's folders are")
        if names[ns] != "folder":
            _refuse(root, [ns], f"a {names[ns]} in place of one of its folders; links are never followed")
        entries[ns], tmps[ns] = {}, {}
        sub = root.sub(ns)
        for name, kind in (_list(sub) or {}).items():
            m = ENTRY.fullmatch(name) or _TMP.fullmatch(name)
            if m is None or m["id"] != found or kind != "file":
                why = (
                    f"another cache's, of id {m['id']}"
                    if m is not None and m["id"] != found
                    else f"a {kind}"
                    if kind != "file"
                    else "a name of no entry's pattern"
                )
                _refuse(root, [f"{ns}/{name}"], why)
            elif m.re is ENTRY:
                entries[ns][name] = int(m["n"])
            elif sub.local_path is not None:
                tmps[ns][name] = _age(os.path.join(sub.local_path, name))
    return Root(root, found, entries, tmps)


def namespace_folder(root: Root, ns: str, *, writer: bool) -> Storage:
    """The folder of namespace ``ns``; the writer creates it (mode 0700) where open_root found none
    (one it found was checked there)."""
    folder = root.storage.sub(ns)
    if writer and folder.local_path is not None:
        _private_folder(folder.local_path)
    return folder


def tidy(root: Root, keep: str) -> None:
    """Removes (the writer, at open) other namespaces' entries and folders, and temporaries at least
    TMP_AGE_S old: only names of this cache's pattern with its id, listed in its marked root."""
    for ns, entries in root.entries.items():
        folder = root.storage.sub(ns)
        old = [n for n, age in root.tmps.get(ns, {}).items() if age >= TMP_AGE_S]
        for name in old + ([] if ns == keep else sorted(entries)):
            try:
                folder.delete(name)
            except (OSError, StorageError):
                pass
        if ns != keep and folder.local_path is not None:
            try:
                os.rmdir(folder.local_path)  # only an empty folder: a file written meanwhile stays
            except OSError:
                pass


def _list(folder: Storage) -> dict[str, str] | None:
    """The names in ``folder`` with their kind ("file", "folder", or what else it is), links never
    followed; a local folder checked first (folder_problem). None where it is missing."""
    path = folder.local_path
    if isinstance(folder, KvStorage):  # an object store: one listing of every key below it
        names: dict[str, str] = {}
        for key in folder.list_all():
            top, _, rest = key.partition("/")
            names[top] = "folder" if rest else names.get(top, "file")
        return names or None
    assert path is not None, f"{folder.url}: a local folder or an object store"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    problem = folder_problem(st)
    if problem is not None:
        raise NotTheCache(
            f"{path} {problem}. A cache's entries are code that JAX runs, so nothing in it "
            "is used. Fix: remove it (as its owner, or root) and let flax_ckpt create it again (mode "
            "0700), or give the cache a folder only you can write"
        )
    with os.scandir(path) as it:
        return {e.name: _kind(e) for e in it}


def _kind(e: os.DirEntry) -> str:
    if e.is_symlink():
        return "symbolic link"
    if e.is_dir(follow_symlinks=False):
        return "folder"
    if e.is_file(follow_symlinks=False):
        return "file"
    return "FIFO, device or socket"


def _refuse(root: Storage, names: list[str], why: str) -> None:
    shown = ", ".join(repr(n) for n in sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    raise NotTheCache(
        f"{root.url} holds {shown}, which the cache did not write ({why}); nothing "
        "in it is read or deleted. Fix: give the cache a folder of its own, one that is missing or "
        "empty (flax_ckpt creates and marks it), such as <run>/compile_cache"
    )


def _marker(root: Storage) -> str:
    try:
        doc = json.loads(root.read(MARKER, 4096))
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not re.fullmatch(_ID, str(doc.get("id"))):
        _refuse(root, [MARKER], "it is not a marker of flax_ckpt's")
    return str(doc["id"])  # type: ignore[index]


def _mark(root: Storage) -> str:
    """Writes the marker into the empty root (the first writer's wins) and returns its id."""
    new = uuid.uuid4().hex[:16]
    written = root.write_if_absent(MARKER, json.dumps({"format": _FORMAT, "id": new}).encode())
    return new if written else _marker(root)


def _private_folder(path: str) -> None:
    """Creates ``path`` with mode 0700 (its parents as usual) unless it exists."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def _age(path: str) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except OSError:
        return 0.0
