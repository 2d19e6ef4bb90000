"""Steps of one run that share unchanged chunks: the references, the exact comparison, the deletion.

Scope: what docs/design.md ("Steps that share bytes") describes. ``Base``, the previous step of a run
as the next save compares with; ``Sharer``, the raw serializer's hook that turns a piece equal, byte for
byte, to the base's chunk of the same leaf and box into a reference to those bytes; ``shared_head``,
the manifest field listing the steps referred to; ``RunFiles``, the Storage a step's reads go through
(a name ``../<step>/<file>`` is a file of a sibling step, retired or not); and the deletion by
reference: ``referenced`` (what the committed manifests of a run name), ``remove_step`` (retire a step
a kept step refers to, remove it otherwise) and ``sweep`` (delete retired folders nothing names).
Not here: writing pieces (serializers/raw.py), the manifest schema's checks (native/manifest.py),
which steps retention removes (retention.py).

A retired step's folder is ``<step>.held-<id>`` (``id``: its manifest's, the nonce of its staging
folder): never a step, never a leftover. On a local folder a retirement is one rename. An object store
has no rename: there a retired step's data objects stay where they are, under ``<step>/``, its manifest
is deleted, and an object ``<step>.held-<id>`` (the hold, written first) lists them; a save there
names its data files after an id of its own (``data/p<i>-<id>.<n>.bin``, one id for all the processes
of a save: process 0's), so that a later save of the same step number never writes over them, and every
deletion under ``<step>/`` spares what a hold lists (the merged manifest's files, every process's).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import uuid
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from flax_ckpt._src.checks import MANIFEST, MAX_MANIFEST_BYTES, seal, unseal
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.engine.equal import same_bytes
from flax_ckpt._src.errors import CheckpointError, CorruptCheckpointError, StorageError
from flax_ckpt._src.native import trust
from flax_ckpt._src.records import leaf_name
from flax_ckpt._src.serializers.base import Box
from flax_ckpt._src.storage import Storage

log = logging.getLogger("flax_ckpt")

HELD_MARK = ".held-"
MIN_SHARED = 64 << 10  # pieces smaller than this are always written (raw.SHARE_MIN: not even asked)
_HELD = re.compile(r"([0-9]+)\.held-([0-9a-f]{32})")
_ID = re.compile(r"[0-9a-f]{32}")


def held_name(step: str, ident: str) -> str:
    """The folder of retired step ``step`` (its folder name) whose manifest's id is ``ident``."""
    return f"{step}{HELD_MARK}{ident}"


def is_held(entry: str) -> bool:
    """Whether a run directory's ``entry`` is a retired step's folder."""
    return _HELD.fullmatch(entry) is not None


def is_id(value: Any) -> bool:
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def staging_id(staging: str) -> str | None:
    """The id of a save from its staging folder's name (``<step>.tmp-<hex>``), or None."""
    head, mark, nonce = staging.rpartition(commit_mod.TMP_MARK)
    return nonce if mark and head and is_id(nonce) else None


def save_id(staging: str, run: Storage) -> str | None:
    """The id of a save into ``staging`` below the run directory ``run``: on a local folder its staging
    folder's nonce (``staging_id``); on an object store, where a step is written in place, a fresh one."""
    return staging_id(staging) if run.supports_rename else uuid.uuid4().hex


def file_tag(tag: str, run: Storage, shares: "tuple[str, Base | None] | None") -> str:
    """The tag of a save's data files (the raw serializer's ``data/<tag>.<n>.bin``): on an object store
    they carry the save's id (``shares``: (id, base) of a sharing save), or a fresh one, ``<tag>-<id>``,
    so that they never take the names of a retired save of the same step number whose objects a hold
    keeps (a local retired folder is renamed out of the way). A save by several processes agrees on one
    id (process 0's, distributed.SaveRound.agree): each process's files are ``p<i>-<id>``."""
    if run.supports_rename:
        return tag
    return f"{tag}-{shares[0] if shares is not None else uuid.uuid4().hex}"


def split_ref(name: str) -> tuple[str, str] | None:
    """(step folder, file) of a chunk record's ``../<step>/<file>``; None for a file of the step itself."""
    if not name.startswith("../"):
        return None
    step, _, rest = name[3:].partition("/")
    return step, rest


# ------------------------------------------------------------------------------------------ saving


def enable(layout: Any, run: Storage) -> None:
    """Makes a manager's native ``layout`` share unchanged chunks between the steps of ``run`` (a local
    folder or an object store, saved by one process or several; the raw serializer); any other layout
    is left as it is."""
    from flax_ckpt._src.serializers import raw

    if getattr(layout, "name", None) == "native" and isinstance(
        getattr(layout, "serializer", None), raw.RawSerializer
    ):
        layout.share = True


def resumed(layout: Any, step: int) -> None:
    """A manager restored ``step`` (read whole, every block checked): the next save of its sharing
    ``layout`` compares with that step, not with the newest (which may be newer and damaged)."""
    if getattr(layout, "share", False):
        layout.resumed_from = str(step)


class Base:
    """The step a save compares with: its folder ``name`` and ``id``, per leaf number its key path and
    chunk records, the sizes of the files they name (``(step folder, file)``) and the ids of the steps
    holding them."""

    def __init__(
        self,
        name: str,
        ident: str,
        names: Sequence[str | None],
        chunks: dict[int, list[dict[str, Any]]],
        sizes: dict[tuple[str, str], int],
        ids: dict[str, str],
    ):
        self.name, self.id, self.names, self.chunks = name, ident, list(names), chunks
        self.sizes, self.ids = sizes, dict(ids, **{name: ident})

    @classmethod
    def from_body(cls, name: str, body: dict[str, Any]) -> "Base | None":
        """From a committed manifest's body (validated); None for a step without an id (never shared)."""
        if not is_id(body.get("id")):
            return None
        names, chunks = [], {}
        for i, leaf in enumerate(body["leaves"]):
            names.append(leaf_name(leaf) if "chunks" in leaf else None)
            if "chunks" in leaf:
                chunks[i] = leaf["chunks"]
        return cls(name, body["id"], names, chunks, *held_files(name, body["files"], body.get("shared")))

    def candidate(self, leaf: int, name: str, box: Box) -> dict[str, Any] | None:
        """The base's chunk record of leaf ``leaf`` (key path ``name``) covering exactly ``box``."""
        if leaf >= len(self.names) or self.names[leaf] != name or leaf not in self.chunks:
            return None
        index = [list(b) for b in box]  # as a record's "index" is written
        for ch in self.chunks[leaf]:
            if ch["index"] == index:
                return ch
        return None

    def located(self, record: dict[str, Any]) -> tuple[str, str]:
        """(step folder, file) holding a base record's bytes."""
        ref = split_ref(record["file"])
        return ref if ref is not None else (self.name, record["file"])


def held_files(
    name: str, files: dict[str, int], shared: dict[str, Any] | None
) -> tuple[dict[tuple[str, str], int], dict[str, str]]:
    """A base's ``sizes`` and ``ids``: of step folder ``name`` with data ``files`` ({file: size}) whose
    chunks refer to ``shared`` (a manifest's field, ``shared_head``): its own files and those its chunks
    name, not those of every earlier step."""
    sizes = {(name, f): n for f, n in files.items()}
    ids: dict[str, str] = {}
    for step, held in (shared or {}).items():
        ids[step] = held["id"]
        sizes.update({(step, f): n for f, n in held["files"].items()})
    return sizes, ids


class Sharer:
    """The raw serializer's ``share`` hook for one save against ``base``, reading its bytes from the run
    directory ``run``. Thread-safe (pieces are asked in parallel: hashlib releases the GIL). ``kept``:
    per leaf number, the boxes of shards whose bytes the snapshot found equal, byte for byte, to the
    base's own copy in memory (the arena the base step was written from: engine/arena.py); a piece
    inside one of them is the base's chunk without being hashed or read."""

    def __init__(
        self,
        base: Base,
        run: Storage,
        block: int,
        kept: dict[int, list[Box]] | None = None,
        suspect: "set[tuple[str, str | None, str]] | frozenset" = frozenset(),
        vouched: "trust.Trust | None" = None,
    ):
        self.base, self.files, self.block = base, RunFiles(run, base.ids, run=run), block
        self.kept, self.suspect, self.url = kept or {}, suspect, run.url
        self.trust = trust.Trust() if vouched is None else vouched
        self._there: dict[tuple[str, str], bool] = {}  # (step folder, file) -> found, once per save
        self.shared = 0  # bytes referred to instead of written
        self._mutex = threading.Lock()

    def __call__(
        self, leaf: int, name: str, box: Box, data: memoryview, crcs: Callable[[], tuple[int, ...]]
    ) -> dict[str, Any] | None:
        """A reference record for the piece ``data`` of leaf ``leaf`` in ``box`` when the base's chunk
        there holds the same bytes, else None: its crc32c blocks must equal ``crcs()``, and the chunk
        must be none that a step a restore found damaged names (``suspect``). A chunk this process
        has not vouched for (trust.py: it wrote the file, or read the chunk back) is read back and
        compared byte for byte: a new process's first share of it, and every share after damage was
        found. A vouched one is shared when the piece lies in a shard ``kept`` names (compared in
        memory with the very bytes the base wrote), or its SHA-256 equals the record's (``HASH``), or
        (a record without one) the chunk read back equals it. A record shared after a hash or a read
        carries the SHA-256; one shared from memory keeps the base record's (if any)."""
        n = len(data)
        old = self._chunk(leaf, name, box, n)
        if old is None or list(crcs()) != list(old["crc32c"]):
            return None
        step, file = self.base.located(old)
        ident = self.base.ids.get(step)
        if (step, ident, file) in self.suspect:  # named by a step a restore found damaged
            return None
        key = (self.url, step, ident, file, old["offset"])
        trusted = self.trust.vouched(key) and self._present(step, file)  # else read back
        if trusted and self._kept(leaf, box):
            record = dict(old, file=f"../{step}/{file}")
        else:
            digest = hashlib.sha256(data).hexdigest()
            if trusted and HASH in old:
                if old[HASH] != digest:
                    return None
            elif not self._equal(step, file, old, data):
                return None
            self.trust.vouch(key)
            record = dict(old, file=f"../{step}/{file}", **{HASH: digest})
        with self._mutex:
            self.shared += n
        return record

    def _present(self, step: str, file: str) -> bool:
        """Whether the file ``file`` of step folder ``step`` is there with the size the base records
        (asked once per file and save, on a local folder: one stat; an object store's files are not
        asked, a request each): a vouched file deleted by hand since is read back, and so written."""
        if not self.files.run.supports_rename:
            return True
        found = self._there.get((step, file))
        if found is None:
            try:
                self.files.check_size(f"../{step}/{file}", self.base.sizes[(step, file)])
                found = True
            except (OSError, KeyError, CheckpointError):
                found = False
            self._there[(step, file)] = found
        return found

    def _kept(self, leaf: int, box: Box) -> bool:
        """Whether ``box`` of leaf ``leaf`` lies inside a shard ``kept`` names."""
        return any(
            len(k) == len(box) and all(s <= lo and hi <= e for (lo, hi), (s, e) in zip(box, k))
            for k in self.kept.get(leaf, ())
        )

    def maybe(self, leaf: int, name: str, box: Box, nbytes: int, crcs: tuple[int, ...] | None) -> bool:
        """False when the piece of ``nbytes`` bytes of leaf ``leaf`` in ``box`` cannot be shared: the
        base has no chunk of that size there, or ``crcs`` (its crc32c blocks, when known) differ from
        that chunk's. Asked before ``__call__``, on the writer's thread: cheap, and never True alone."""
        old = self._chunk(leaf, name, box, nbytes)
        return old is not None and (crcs is None or list(crcs) == list(old["crc32c"]))

    def _chunk(self, leaf: int, name: str, box: Box, nbytes: int) -> dict[str, Any] | None:
        """The base's chunk record a piece of ``nbytes`` bytes of leaf ``leaf`` in ``box`` may share: of
        that key path and box, as many bytes and blocks of this save's size; None when there is none
        (or the piece is too small to be worth comparing)."""
        old = None if nbytes < MIN_SHARED else self.base.candidate(leaf, name, box)
        if old is None or old["nbytes"] != nbytes or old["block"] != self.block:
            return None
        return old

    def _equal(self, step: str, file: str, old: dict[str, Any], data: memoryview) -> bool:
        """Whether the stored bytes of ``old`` are ``data``, read a block at a time and compared as
        words, stopping at the first difference. (Equal bytes whose crc32c ``__call__`` found equal to
        the record's need no checksum of their own: a damaged or missing earlier chunk differs from
        ``data``, or fails to read, and is never referred to.)"""
        step_bytes = min(old["block"], _COMPARE)
        buf = bytearray(min(step_bytes, len(data)))
        try:
            for lo in range(0, len(data), step_bytes):
                hi = min(lo + step_bytes, len(data))
                view = memoryview(buf)[: hi - lo]
                self.files.read_into(f"../{step}/{file}", old["offset"] + lo, view)
                if not same_bytes(view, data[lo:hi]):
                    return False
        except (OSError, CheckpointError):
            return False
        return True


HASH = "sha256"  # a shared chunk record's field: the SHA-256 of its bytes, hex
_COMPARE = 4 << 20  # bytes read and compared at a time


class Sharing:
    """The raw serializer asking ``sharer`` for each piece: a Serializer for write_streamed's batches
    (every one of a save's ``write`` calls shares)."""

    def __init__(self, serializer: Any, sharer: Sharer):
        self.serializer, self.sharer, self.name = serializer, sharer, serializer.name

    def write(self, storage: Storage, items: Sequence[Any], *, tag: str) -> Any:
        return self.serializer.write(storage, items, tag=tag, share=self.sharer)


def shared_head(chunks: dict[int, list[dict[str, Any]]], base: Base | None) -> dict[str, Any] | None:
    """The manifest's ``shared`` field: {step folder: {"id", "files": {file: size}}} of every file of
    another step that ``chunks`` name; None when they name none."""
    out: dict[str, Any] = {}
    for recs in chunks.values():
        for ch in recs:
            ref = split_ref(ch.get("file", ""))
            if ref is None:
                continue
            if base is None or ref[0] not in base.ids or ref not in base.sizes:
                raise CheckpointError(f"a chunk refers to {ch['file']}, which the base step does not hold")
            held = out.setdefault(ref[0], {"id": base.ids[ref[0]], "files": {}})
            held["files"][ref[1]] = base.sizes[ref]
    return out or None


def base_named(run: Storage, agreed: Any) -> Base | None:
    """The base of a save of several processes: ``agreed`` is [step folder, id] as process 0 chose it
    (None: no base); None when this process cannot read that step or finds another id there (it then
    writes all its shards: what process 0's manifest names stays what process 0 read)."""
    if not (isinstance(agreed, list) and len(agreed) == 2 and is_id(agreed[1])):
        return None
    name = str(agreed[0])
    if commit_mod.step_number(name) is None:
        return None
    try:
        from flax_ckpt._src.native.manifest import decode

        body = decode(run.sub(name).read(MANIFEST, MAX_MANIFEST_BYTES), f"{run.url}/{name}/{MANIFEST}")
    except (OSError, CheckpointError):
        return None
    base = Base.from_body(name, body)
    return base if base is not None and base.id == agreed[1] else None


def newest_base(
    run: Storage,
    exclude: str,
    known: Base | None,
    first: str | None = None,
    avoid: "set[tuple[str, str | None]] | frozenset" = frozenset(),
) -> Base | None:
    """The base of a save into ``run``: step folder ``first`` (the step the manager restored) when it is
    still committed, else the committed native step with the highest number (but ``exclude``, the step
    being saved); ``known`` when it is that step (the last one this layout committed). None when there
    is none, or its manifest cannot be read (the save then writes all). ``known`` is taken, without
    listing the run, while it is committed (on a local folder: with its id) and no restored step comes
    first: any committed step of the run is a sound base, and on an object store a listing is a
    request that lists every object of the run. ``avoid``: (step folder, id) of steps a restore found
    damaged (damage.damaged), never a base."""
    if known is not None and (known.name, known.id) in avoid:
        known = None
    if known is not None and first is None and known.name != exclude:
        # a local step's manifest is stat'ed, its reading kept by its identity (``_head``): the very one
        same = (
            own_id(run, known.name) == known.id
            if run.supports_rename
            else run.sub(known.name).exists(MANIFEST)
        )
        if same:
            return known
    steps = sorted(
        (n for n in map(commit_mod.step_number, run.list()) if n is not None and str(n) != exclude),
        reverse=True,
    )
    if first is not None and first != exclude and int(first) in steps:
        steps.insert(0, int(first))
    for step in steps[: 3 + len(avoid)]:
        name = str(step)
        if known is not None and known.name == name and run.sub(name).exists(MANIFEST):
            return known
        try:
            from flax_ckpt._src.native.manifest import decode

            body = decode(run.sub(name).read(MANIFEST, MAX_MANIFEST_BYTES), f"{run.url}/{name}/{MANIFEST}")
        except (OSError, CheckpointError):
            continue
        if (name, body.get("id")) not in avoid:
            return Base.from_body(name, body)
    return None


# ------------------------------------------------------------------------------------------ reading


class _FolderGone(CorruptCheckpointError):
    """The folder holding a shared step's bytes is gone (the message names it)."""


class RunFiles:
    """The Storage a shared step's reads go through: its own files from ``storage``, a name
    ``../<step>/<file>`` from that step of the run (on a local folder its retired folder
    ``<step>.held-<id>`` first, then ``<step>``; looked up again once when a file vanished: a retirement
    between the two; on an object store ``<step>/``, where a retired step's objects stay). ``ids``:
    {step folder: the id of the save holding the bytes} (the manifest's ``shared``)."""

    def __init__(self, storage: Storage, ids: dict[str, str], *, run: Storage | None = None):
        self._s, self._ids = storage, ids
        self._run = run
        self._at: dict[str, Storage] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s, name)

    @property
    def run(self) -> Storage:
        if self._run is None:
            self._run = self._s.parent()[0]
        return self._run

    def holder(self, step: str, *, again: bool = False) -> Storage:
        """The folder holding the bytes of step folder ``step``."""
        if step in self._at and not again:
            return self._at[step]
        ident = self._ids.get(step)
        if ident is None:
            raise CorruptCheckpointError(f"{self._s.url}: a chunk refers to step {step}, not in its manifest")
        if not self.run.supports_rename:  # its data objects' names carry the id (file_tag)
            self._at[step] = found = self.run.sub(step)
            return found
        held = self.run.sub(held_name(step, ident))
        if held.kind() == "folder":
            found = held
        elif own_id(self.run, step) == ident:  # never a later save of the same step number
            found = self.run.sub(step)
        else:
            raise _FolderGone(self._gone(step, ident))
        self._at[step] = found
        return found

    def _gone(self, step: str, ident: str) -> str:
        """Why the bytes of step folder ``step`` (save ``ident``) cannot be read: its folder is gone."""
        where = f"{self.run.url}/{held_name(step, ident)}"
        if not self._in_run():
            return (
                f"{self._s.url}: this step shares the bytes of step {step} of its run, whose folder "
                f"({where}, or {step}/ with id {ident}) is not beside it: a step that shares is readable "
                "only in its run's directory; `flax-ckpt convert` of the step in its run makes a "
                "self-contained copy"
            )
        return (
            f"{self._s.url}: this step shares the bytes of step {step} (saved with id {ident}), and the "
            f"folder holding them is missing: {where} (a removed step kept for the bytes later steps "
            f"share), or {self.run.url}/{step} with that id. It was deleted or replaced by hand: put it "
            "back, or restore a step that does not name it (a manager falls back by itself)"
        )

    def _in_run(self) -> bool:
        """Whether the step read lies in a run directory (a step folder beside other steps), not copied
        out of it."""
        try:
            name = self._s.parent()[1]
            entries = self.run.list()
        except (OSError, CheckpointError):
            return True
        if commit_mod.step_number(name) is None:
            return False
        return any(e != name and (is_held(e) or commit_mod.step_number(e) is not None) for e in entries)

    def _call(self, name: str, op: Callable[[Storage, str], Any]) -> Any:
        ref = split_ref(name)
        if ref is None:
            return op(self._s, name)
        try:
            return op(self.holder(ref[0]), ref[1])
        except (FileNotFoundError, CorruptCheckpointError):
            return op(self.holder(ref[0], again=True), ref[1])

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        try:
            self._call(name, lambda s, n: s.read_into(n, offset, out))
        except FileNotFoundError:
            raise CorruptCheckpointError(self._missing(name)) from None

    def read_ranges(self, name: str, parts: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self._call(name, lambda s, n: s.read_ranges(n, parts))

    def check_size(self, name: str, expected: int) -> None:
        try:
            self._call(name, lambda s, n: s.check_size(n, expected))
        except _FolderGone:
            raise
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e}" + self._hint(name)) from None

    def _missing(self, name: str) -> str:
        return f"{self._s.url}: data file {name} is missing" + self._hint(name)

    def _hint(self, name: str) -> str:
        ref = split_ref(name)
        if ref is None:
            return ""
        if self._in_run():
            return (
                f" (this step shares the bytes of step {ref[0]} of its run, {self.run.url}: that file of "
                "the step's folder is missing or damaged)"
            )
        return (
            f" (this step shares the bytes of step {ref[0]} of its run, {self.run.url}: a step that shares "
            "is readable only in its run's directory; `flax-ckpt convert` makes a self-contained copy)"
        )

    def stored_bytes(self) -> int | None:
        """The bytes of the step's folder and of every folder it refers to."""
        own = self._s.stored_bytes()
        if own is None:
            return None
        total = own
        for step in self._ids:
            n = self.holder(step).stored_bytes()
            if n is None:
                return None
            total += n
        return total


# ------------------------------------------------------------------------------------------ deleting


_Head = tuple["str | None", "dict[str, str] | None"]
_HEADS: dict[tuple[str, int, int, int], _Head] = {}  # (manifest path, inode, mtime, size) -> head
_HEADS_MAX = 4096


def _head(run: Storage, name: str) -> _Head:
    """(its id, {step folder: id} it refers to) of step folder ``name``'s committed manifest: (None, {})
    for a folder without one (an Orbax step, a native one never committed); (None, None) when the
    manifest cannot be read (what it refers to is then unknown). A committed manifest never changes:
    on a local folder its reading is kept, by the file's identity (inode, mtime, size)."""
    try:
        key = _head_key(run, name)
    except (FileNotFoundError, NotADirectoryError):
        return None, {}
    except OSError:
        return None, None
    if key in _HEADS:
        return _HEADS[key]
    try:
        raw = run.sub(name).read(MANIFEST, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None, {}
    except (OSError, StorageError):  # what it refers to is unknown
        return None, None
    try:
        body = unseal(
            raw, name="flax_ckpt", version=1, where=f"{run.url}/{name}", max_bytes=MAX_MANIFEST_BYTES
        )
    except (CheckpointError, ValueError):
        return None, None
    head = head_of(body)
    _keep(key, head)
    return head


def head_of(body: dict[str, Any]) -> _Head:
    """(its id, {step folder: id} it refers to) of a manifest's ``body``; the second None when its
    ``shared`` field is malformed (what it refers to is then unknown)."""
    ident = body.get("id") if is_id(body.get("id")) else None
    shared = body.get("shared") or {}
    if not isinstance(shared, dict):
        return ident, None
    out: dict[str, str] = {}
    for step, held in shared.items():
        if not isinstance(held, dict) or not is_id(held.get("id")):
            return ident, None
        out[step] = held["id"]
    return ident, out


def _head_key(run: Storage, name: str) -> tuple[str, int, int, int] | None:
    """What ``_HEADS`` keeps step folder ``name``'s reading by: its manifest's path and identity (inode,
    mtime, size), stat'ed now (OSError when it cannot be); None off a local folder (nothing kept)."""
    if run.local_path is None:
        return None
    path = os.path.join(run.local_path, name, MANIFEST)
    st = os.stat(path, follow_symlinks=False)
    return path, st.st_ino, st.st_mtime_ns, st.st_size


def _keep(key: tuple[str, int, int, int] | None, head: _Head) -> None:
    if key is None:
        return
    if len(_HEADS) >= _HEADS_MAX:
        _HEADS.clear()
    _HEADS[key] = head


def remember(run: Storage, name: str, ident: str | None, shared: dict[str, str] | None) -> None:
    """Keeps what ``_head`` would read of step folder ``name``'s manifest, just committed by this
    process with id ``ident`` and referring to ``shared`` ({step folder: id}; as ``head_of`` gives
    them): retention and the sweep after the save then need not read it again. Local folders only (as
    ``_head``'s keeping)."""
    try:
        _keep(_head_key(run, name), (ident, None if shared is None else dict(shared)))
    except OSError:
        pass


def referenced(
    run: Storage, gone: Sequence[str] = (), entries: Sequence[str] | None = None
) -> set[tuple[str, str]] | None:
    """The (step folder, id) pairs that the committed native steps of ``run`` (but those in ``gone``)
    refer to; None when some step folder's manifest cannot be read: then nothing may be freed.
    ``entries``: ``run.list()``, when the caller has just listed it."""
    out: set[tuple[str, str]] = set()
    for entry in run.list() if entries is None else entries:
        if commit_mod.step_number(entry) is None or entry in gone:
            continue
        shared = _head(run, entry)[1]
        if shared is None:
            return None
        out.update(shared.items())
    return out


def refers_to(run: Storage, name: str) -> dict[str, str] | None:
    """{step folder: id} whose bytes committed step folder ``name`` refers to (None: unknown)."""
    return _head(run, name)[1]


def own_id(run: Storage, name: str) -> str | None:
    """The id in the manifest of step folder ``name`` (None: none, or unreadable)."""
    return _head(run, name)[0]


def remove_step(
    run: Storage,
    name: str,
    record: str,
    *,
    refs: set[tuple[str, str]] | None,
    salvage: Callable[[str], None] | None = None,
) -> bool:
    """Deletes the committed native step folder ``name`` of ``run``, or, when a kept step refers to its
    bytes (or ``refs``, the pairs ``referenced`` gave for the kept steps, is None: unknown), retires it:
    on a local folder one rename to ``<name>.held-<id>``; on an object store its hold written, then its
    manifest deleted (``retire``). Returns whether it was retired."""
    if not run.supports_rename:
        body = committed_body(run, name)
        ident = body.get("id") if body and is_id(body.get("id")) else None
        if body and ident is not None and (refs is None or (name, ident) in refs):
            retire(run, name, record, ident, body["files"])
            return True
        if body == {} and (refs is None or any(step == name for step, _ in refs)):
            log.warning(  # what its objects are is unknown: a kept step may name them
                "%s/%s: its manifest cannot be read just now, so it is kept (a kept step may refer to its "
                "bytes); `flax-ckpt prune` removes it once it reads again",
                run.url,
                name,
            )
            return False
        remove_folder(run, name, record)
        return False
    ident = own_id(run, name)
    if ident is not None and (refs is None or (name, ident) in refs):
        run.rename(name, held_name(name, ident))
        run.sync(tree=False)
        return True
    commit_mod.remove(run, name, record, salvage=salvage)
    return False


def sweep(
    run: Storage, refs: set[tuple[str, str]] | None = None, entries: Sequence[str] | None = None
) -> list[str]:
    """Deletes every retired folder (object store: every hold and the objects it lists) of ``run`` that
    no committed step refers to (``refs``: as ``referenced`` gives them, read here when None); returns
    their names. Nothing is deleted when a committed step's manifest cannot be read. ``entries``:
    ``run.list()``, when the caller knows it (no folder retired since it listed)."""
    entries = run.list() if entries is None else entries
    held = [e for e in entries if is_held(e)]
    if not held:
        return []
    if refs is None:
        refs = referenced(run)
        if refs is None:
            log.warning(
                "%s: a step's manifest cannot be read, so the retired folders %s are kept (what it refers "
                "to is unknown); `flax-ckpt prune` deletes them once that step is repaired or removed",
                run.url,
                ", ".join(held),
            )
            return []
    gone = []
    for entry in held:
        m = _HELD.fullmatch(entry)
        assert m is not None, "is_held matched it"
        if (m.group(1), m.group(2)) in refs:
            continue
        if not run.supports_rename:
            if _free(run, m.group(1), m.group(2), entries):
                gone.append(entry)
            continue
        doomed = f"{m.group(1)}{commit_mod.DELETING_MARK}{uuid.uuid4().hex}"  # a leftover if interrupted
        run.rename(entry, doomed)
        run.delete(doomed)
        gone.append(entry)
    return gone


# ------------------------------------------------------------------------- object stores: holds
#
# No rename: a retired step's data objects stay under ``<step>/``. Its hold ``<step>.held-<id>``, an
# object beside the step folders, lists them (a sealed document, checksummed). The order of the writes
# and deletes leaves, after a kill between any two, either the step (committed, whole) or its objects
# with a hold listing them, never a manifest naming a deleted object:
#   retire: 1. write the hold, 2. delete the manifest (a kill between: the step is still committed; the
#           next retention retires it again, or a sweep finds the step committed and deletes the hold);
#   free (sweep, nothing refers to the hold's step and id): 1. delete the listed objects, 2. delete the
#           hold (a kill between: the hold stays, the next sweep deletes the rest and then it);
#   any other deletion under ``<step>/`` (a failed save's objects, a step removed, a crashed save's
#           leftovers) spares the objects a hold of ``<step>`` lists.

_HOLD = "flax_ckpt-held"  # the hold's sealed document's format name


@runtime_checkable
class _Listing(Protocol):
    """A storage that lists every object below it (an object store's KvStorage)."""

    def list_all(self) -> list[str]: ...


def committed_body(run: Storage, name: str) -> dict[str, Any] | None:
    """The body of step folder ``name``'s committed manifest; None when it has none, {} when it cannot
    be decoded. A failing store raises (StorageError): what it holds is then unknown."""
    try:
        raw = run.sub(name).read(MANIFEST, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    try:
        body = unseal(
            raw, name="flax_ckpt", version=1, where=f"{run.url}/{name}", max_bytes=MAX_MANIFEST_BYTES
        )
    except (CheckpointError, ValueError):
        return {}
    return body if isinstance(body.get("files"), dict) else {}


def retire(run: Storage, name: str, record: str, ident: str, files: dict[str, int]) -> None:
    """Retires the committed step ``name`` (id ``ident``, data objects ``files``) on an object store:
    its hold first, then its manifest deleted."""
    hold = seal({"step": name, "id": ident, "files": files}, name=_HOLD, version=1, what="hold")
    run.write(held_name(name, ident), [hold])
    run.sub(name).delete(record)


def _hold_files(run: Storage, entry: str) -> set[str] | None:
    """The objects (below its step folder) the hold ``entry`` lists; None when it cannot be read."""
    try:
        raw = run.read(entry, MAX_MANIFEST_BYTES)
        body = unseal(raw, name=_HOLD, version=1, where=f"{run.url}/{entry}", what="hold")
    except FileNotFoundError:
        return set()
    except (OSError, CheckpointError, ValueError):
        return None
    files = body.get("files")
    return set(files) if isinstance(files, dict) else None


def held_objects(run: Storage, name: str, entries: Sequence[str] | None = None) -> set[str] | None:
    """The objects under step folder ``name`` of an object-store run that its holds keep (empty on a
    local folder, where a retired step has a folder of its own); None when a hold cannot be read (then
    nothing under ``name`` may be deleted). ``entries``: the run's listing, when just made."""
    if run.supports_rename:
        return set()
    out: set[str] = set()
    for entry in run.list() if entries is None else entries:
        m = _HELD.fullmatch(entry)
        if m is None or m.group(1) != name:
            continue
        files = _hold_files(run, entry)
        if files is None:
            return None
        out |= files
    return out


def only_held(run: Storage, name: str, entries: Sequence[str] | None = None) -> bool:
    """Whether folder ``name`` of an object-store run holds nothing but what its holds keep (a retired
    step's objects: no step, no leftover)."""
    if run.supports_rename:
        return False
    keep = held_objects(run, name, entries)
    folder = run.sub(name)
    return bool(keep) and isinstance(folder, _Listing) and set(folder.list_all()) <= keep


def clear(run: Storage, name: str) -> int:
    """Deletes what is under folder ``name`` of ``run`` but the objects a hold keeps (object stores;
    on a local folder the folder, whole); returns how many objects (or folders) it deleted."""
    keep = held_objects(run, name)
    if keep is None:
        log.warning(
            "%s/%s: a hold of this step cannot be read, so nothing under it is deleted (what the hold keeps "
            "is unknown)",
            run.url,
            name,
        )
        return 0
    if not keep:
        run.delete(name)
        return 1
    folder = run.sub(name)
    doomed = [k for k in folder.list_all() if k not in keep] if isinstance(folder, _Listing) else []
    for key in doomed:
        folder.delete(key)
    return len(doomed)


def remove_folder(run: Storage, name: str, record: str) -> None:
    """Deletes the step folder ``name`` (committed or not), its commit ``record`` first, sparing what a
    hold keeps (``clear``)."""
    if run.supports_rename:
        commit_mod.remove(run, name, record)
        return
    run.sub(name).delete(record)
    clear(run, name)


def abort(parent: Storage, staging: str, record: str) -> None:
    """``atomic.abort`` (commit/atomic.py) for a native save: removes what an uncommitted save wrote,
    on an object store sparing what a hold of the same step number keeps."""
    if parent.supports_rename:
        commit_mod.abort(parent, staging, record)
        return
    try:
        if not parent.sub(staging).exists(record):
            clear(parent, staging)
    except (StorageError, OSError) as e:  # the store is failing: what is left is uncommitted, never read
        log.warning(
            "could not remove the uncommitted %s/%s (a manager removes it when it next starts): %s",
            parent.url,
            staging,
            e,
        )


def _free(run: Storage, step: str, ident: str, entries: Sequence[str]) -> bool:
    """Deletes the hold ``<step>.held-<ident>`` that nothing refers to and the objects it lists, those
    first; returns whether it is gone. A hold whose step is still committed with that id (a retirement
    interrupted before the manifest's deletion) is deleted alone: the step stays, whole."""
    entry = held_name(step, ident)
    body = committed_body(run, step)
    if body == {}:
        log.warning("%s/%s: its manifest cannot be read, so the hold %s stays", run.url, step, entry)
        return False
    if body is not None and body.get("id") == ident:
        run.delete(entry)
        return True
    files = _hold_files(run, entry)
    others = held_objects(run, step, [e for e in entries if e != entry])
    if files is None or others is None:
        log.warning("%s/%s: a hold cannot be read, so it and what it keeps stay", run.url, entry)
        return False
    mine = set(body["files"]) if body else set()  # a later save of the step number: its own objects
    folder = run.sub(step)
    for f in sorted(files - others - mine):
        folder.delete(f)
    run.delete(entry)
    return True


__all__ = [
    "Base",
    "abort",
    "clear",
    "file_tag",
    "held_objects",
    "only_held",
    "remove_folder",
    "save_id",
    "HELD_MARK",
    "RunFiles",
    "Sharer",
    "held_name",
    "is_held",
    "newest_base",
    "referenced",
    "remove_step",
    "shared_head",
    "staging_id",
    "sweep",
]
