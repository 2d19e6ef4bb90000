"""The memory tiers' format: one process's copy of one step, stored differentially against a base.

Scope: the host snapshot of a tiered save, writing copies atomically into a tier folder, and opening
and checking them (from files, or from bytes a peer sent); the format itself, described here. Not
here: turning a snapshot into a copy against a base (which chunks are references, deltas or raw:
encode.py); reading copies back (load.py); the files themselves (maps, reuse of removed copies'
pages: files.py); which steps are kept, committed or restored, and all communication (tierset.py,
sync.py).

A copy is a folder ``<tier folder>/<step>/`` with ``data.bin`` and ``index.json`` (the index carries
a crc32c of its body and is written last; the folder is then renamed into place). Per shard the index
lists {"leaf", "box", "primary", "nbytes", "chunks"}, one entry per CHUNK bytes:
  ["r", crc, off, n]        raw bytes at ``off`` of this copy's data.bin
  ["b", crc, boff]          the same bytes as the base's data.bin at ``boff`` (costs nothing)
  ["x", crc, off, n, boff]  zlib(shuffle(raw XOR base bytes at boff)), n bytes at ``off``
``crc`` is the crc32c of the chunk's raw bytes (of "r" chunks: computed on the stored bytes as they
are copied into the data file's pages, by the snapshot of a full copy or else by the writer), verified
when the chunk is read back, so every stored byte is checked. A base has only
"r" entries, back to back per shard; each shard's stored bytes start on a 64-byte boundary (so that a
restore can hand them to jax as they lie). A differential copy names its base, a sibling folder, so
chains are one link long. A jax.Array leaf that is the very object saved at or before the base step
(arrays are immutable) is not even copied to host or compared: its shards are views of the base.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import crc32c
import numpy as np

from flax_ckpt._src import checks
from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.checks import seal, seal_text, unseal
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.engine.snapshot import HostLeaf, Snapshot, copy_all, snapshot
from flax_ckpt._src.errors import CorruptCheckpointError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.records import LeafRecord, dtype_from_name, leaf_name
from flax_ckpt._src.serializers import Box, Shard, box_of
from flax_ckpt._src.storage import LocalStorage
from flax_ckpt._src.storage.base import as_buffer
from flax_ckpt._src.tiers import files as tier_files
from flax_ckpt._src.tiers.files import SpareFolder

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

CHUNK = 1 << 20
INDEX, DATA, COMMIT = "index.json", "data.bin", "commit.json"
_FORMAT, _VERSION = "flax_ckpt-tier", 1


# ------------------------------------------------------------------------------------------- bytes


class Data:
    """The bytes of one data.bin: views through a read-only map (encoding, sending) and reads into a
    caller's buffer (restore, one kernel copy), or the same over bytes received from a peer."""

    def __init__(self, path: str | None = None, buf: memoryview | None = None):
        self.path, self._buf, self._id = path, buf, None
        if path is not None:  # this user's regular file, not a link (files.py); read as that very file
            st = os.lstat(path)
            tier_files.check_file(path, st, "data file")
            self.size, self._id = st.st_size, (st.st_dev, st.st_ino)
        else:
            assert buf is not None, "data is a file or a buffer"
            self.size = len(buf)

    def __len__(self) -> int:
        return self.size

    def view(self, lo: int, hi: int) -> memoryview:
        if self._buf is None:
            assert self.path is not None, "data without a buffer is a file"
            m = tier_files.map_read(self.path, self._id)
            self._buf = memoryview(m if m is not None else b"")
            if len(self._buf) != self.size:
                raise CorruptCheckpointError(
                    f"{self.path}: {len(self._buf)} bytes, was {self.size} when opened"
                )
        return self._buf[lo:hi]

    def read_into(self, off: int, out: memoryview) -> None:
        if self.path is None or self._buf is not None:
            out[:] = self.view(off, off + len(out))
            return
        fd, st = tier_files.open_own(self.path, "data file")  # no link followed, no FIFO waited on
        try:
            if (st.st_dev, st.st_ino) != self._id:
                raise CorruptCheckpointError(f"{self.path} was replaced since its copy was opened; not read")
            if os.preadv(fd, [out], off) != len(out):
                raise CorruptCheckpointError(f"{self.path}: truncated at {off}..{off + len(out)}")
        finally:
            os.close(fd)


@dataclass
class Copy:
    """An opened copy: its index body, its data bytes, and its base (None for a base).

    ``index``: instead of a body, the sealed index bytes this process just wrote, parsed when the body
    is first needed (``step``: its step). A memory tier at every step makes each copy of adam's state
    a new base whose body is hardly ever read; kept parsed, its lists and dicts would outlive one save
    each and drive Python's full collections, which hold the GIL (benchmarks/README.md, "Figures from
    the module docstrings")."""

    where: str
    _body: dict[str, Any] | None
    data: Data
    base: "Copy | None"
    index: bytes | None = field(default=None, repr=False, compare=False)
    _step: int | None = field(default=None, repr=False, compare=False)
    _lookup: dict[str, dict[str, Any]] | None = field(default=None, repr=False, compare=False)
    _by_leaf: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def body(self) -> dict[str, Any]:
        if self._body is None:
            assert self.index is not None, "a copy has its body or its index bytes"
            self._body = decode_index(self.index, self.where)
        return self._body

    @property
    def base_data(self) -> Data:
        """The data of the base this copy is a delta of (its chunks "b" and "x" refer to it)."""
        assert self.base is not None, f"{self.where}: a copy whose chunks refer to a base has one"
        return self.base.data

    @property
    def step(self) -> int:
        return self._step if self._step is not None else self.body["step"]

    def lookup(self) -> dict[str, dict[str, Any]]:
        """Its shards by ``shard_key`` (made once: a base is looked up at every save)."""
        if self._lookup is None:
            self._lookup = {
                shard_key(self.body["leaves"][s["leaf"]], s["box"]): s for s in self.body["shards"]
            }
        return self._lookup

    def by_leaf(self) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Its leaves' records and shards by leaf name (made once, as ``lookup``)."""
        if self._by_leaf is None:
            out: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
            for s in self.body["shards"]:
                rec = self.body["leaves"][s["leaf"]]
                out.setdefault(leaf_name(rec), (rec, []))[1].append(s)
            self._by_leaf = out
        return self._by_leaf

    def array(self, s: dict[str, Any]) -> np.ndarray:
        """A base shard as a read-only view of its bytes (a base stores each shard back to back)."""
        rec = self.body["leaves"][s["leaf"]]
        start = s["chunks"][0][2] if s["chunks"] else 0
        buf = np.frombuffer(self.data.view(start, start + s["nbytes"]), np.uint8)
        return buf.view(dtype_from_name(rec["dtype"])).reshape(tuple(e - a for a, e in s["box"]))


# -------------------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class HostShard:
    leaf: int
    box: Box
    data: np.ndarray
    primary: bool  # this process writes it to persistent storage (replica 0 of a box, or a host value)
    base: dict[str, Any] | None = None  # the base's shard entry, when ``data`` is known to equal it


@dataclass
class TierSnapshot:
    """A tiered save's host copy: ``snap`` (what persistent storage gets) plus ``extra``, every other
    distinct box on this process's devices, so that each process can restore its devices alone.
    ``origin``: shards that are views of the base copy ``base_step`` (unchanged leaves)."""

    snap: Snapshot
    extra: list[HostShard]
    force: bool = False
    base_step: int | None = None
    origin: dict[tuple[int, Box], dict[str, Any]] = field(default_factory=dict)
    skipped: int = 0  # scheduled steps skipped since the previous save (Tiers.on_busy="skip")
    lent: tier_files.Lent | None = None  # the spare data file the shards were copied into, if any
    crcs: dict[int, np.ndarray] = field(default_factory=dict)  # of the shards copied into it: per CHUNK,
    #                                                           by id() of their ``data`` (Snapshot.crcs)
    _shards: list[HostShard] | None = field(default=None, repr=False)  # shards(), made once
    _at: list[int | None] | None = field(default=None, repr=False)  # where they lie in ``lent``
    part: Snapshot | None = field(default=None, repr=False)  # the snapshot of the leaves copied now

    # the device copies (engine/device.py): those of ``part``, brought to host by ``complete``
    choice = property(lambda self: self.part.choice if self.part is not None else None)

    @property
    def on_host(self) -> threading.Event:
        return (self.part if self.part is not None else self.snap).on_host

    @property
    def hurry(self) -> threading.Event | None:
        return (self.part if self.part is not None else self.snap).hurry

    @property
    def waited_s(self) -> float:
        return self.snap.waited_s

    @waited_s.setter
    def waited_s(self, value: float) -> None:
        self.snap.waited_s = value

    def complete(self) -> None:
        """Brings the shards copied on their devices to host (the writer's first call; see
        ``Snapshot.complete``), with their checksums where they went into the spare on loan."""
        if self.part is None or not self.part.pending:
            return
        self.part.complete()
        if self.crcs is not self.part.crcs:
            self.crcs.update(self.part.crcs)

    def shards(self) -> list[HostShard]:
        """Every shard, in the order a copy stores them: those copied into a spare on loan first, as
        they lie there (the layout a full copy's encoding gives them), then the others. Made once, when
        the snapshot is complete (the writer's first call): read-only."""
        if self._shards is None:
            own = [
                HostShard(i, s.box, s.data, True, self.origin.get((i, s.box)))
                for i, p in enumerate(self.snap.leaves)
                for s in p.shards
            ]
            out, at = own + self.extra, None
            if self.lent is not None:
                offs = [self.lent.offset(sh.data) for sh in out]
                order = sorted(range(len(out)), key=lambda k: (0, offs[k]) if offs[k] is not None else (1, k))
                out, at = [out[k] for k in order], [offs[k] for k in order]
            self._shards, self._at = out, at
        return self._shards

    def offsets(self) -> list[int | None] | None:
        """Where each shard (in ``shards()``' order) lies in the spare on loan (None: elsewhere, or
        empty); None without a loan."""
        self.shards()
        return self._at

    @property
    def nbytes(self) -> int:
        return sum(s.data.nbytes for s in self.shards())

    def verify_views(self) -> None:
        """Checks the bytes of base views against the base's crc32c (before they are migrated)."""
        for sh in self.shards():
            if sh.base is not None:
                mv = bytes_of(sh.data)
                for k, e in enumerate(sh.base["chunks"]):
                    if crc32c.crc32c(mv[k * CHUNK : (k + 1) * CHUNK]) != e[1]:
                        raise CorruptCheckpointError(
                            f"memory-tier base step {self.base_step}: checksum "
                            f"mismatch in leaf {sh.leaf} box {list(sh.box)}"
                        )


def _boxes(x: jax.Array) -> set[Box]:
    return {box_of(s.index, tuple(x.shape)) for s in x.addressable_shards}


class Seen:
    """Since when each jax.Array leaf has been the same object: a weak reference to the array saved
    last at each place, and the first step it was saved at, in lists by the leaves' order in ``names``
    (the key names of the structure last saved: ``tree.flat`` hands out the same list object while the
    structure is the same, so a save of it looks its leaves up by position, not by name)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.refs: list[weakref.ref | None] = []
        self.since: list[int] = []

    def aligned(self, names: list[str]) -> tuple[list[weakref.ref | None], list[int]]:
        """The references and first steps in the order of ``names`` (None, 0 for a name not seen)."""
        if names is self.names:
            return self.refs, self.since
        at = {n: k for k, n in enumerate(self.names)}
        ks = [at.get(n) for n in names]
        return (
            [None if k is None else self.refs[k] for k in ks],
            [0 if k is None else self.since[k] for k in ks],
        )


def take_snapshot(
    state: Any,
    *,
    copy: bool,
    force: bool,
    step: int,
    seen: Seen,
    base: Copy | None,
    into: tier_files.Lent | None = None,
) -> TierSnapshot:
    """Copies ``state`` to host, except jax.Array leaves unchanged since ``base`` (their shards become
    views of it). ``seen`` is updated: it tracks since when each leaf has been the same object.
    ``into``: a spare data file on loan, whose pages the shards are copied into, on the layout the
    full copy they become has (the views of ``base`` follow them there, see TierSnapshot.shards)."""
    flat = tree_mod.flat(state)
    held: dict[str, Any] | None = None  # the base's leaves by name: looked up only for a leaf unchanged since
    reuse: dict[int, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    fresh: list[int] = []
    old_refs, old_since = seen.aligned(flat.names)
    refs: list[weakref.ref | None] = [None] * len(flat.leaves)
    first = [0] * len(flat.leaves)
    for i, x in enumerate(flat.leaves):
        if isinstance(x, jax.Array) and not x.is_deleted():
            ref = old_refs[i]
            if ref is not None and ref() is x:
                since = old_since[i]
            else:
                ref, since = weakref.ref(x), step
            refs[i], first[i] = ref, since
            if base is not None and since <= base.step:
                name = flat.names[i]
                held = base.by_leaf() if held is None else held
                data = jax.random.key_data(x) if tree_mod.is_prng_key(x) else x
                if name in held and {tuple(map(tuple, s["box"])) for s in held[name][1]} == _boxes(data):
                    reuse[i] = held[name]
                    continue
        fresh.append(i)
    seen.names, seen.refs, seen.since = flat.names, refs, first
    take = into.take if into is not None else None
    part = (
        snapshot(flat, copy=copy, into=take, checksum=CHUNK if take is not None else None, only=fresh)
        if fresh
        else Snapshot([], 0)
    )
    plans: list[Any] = [None] * len(flat.leaves)
    for i, p in zip(fresh, part.leaves):
        plans[i] = p
    ts = TierSnapshot(Snapshot(plans, 0), [], force, base.step if reuse and base is not None else None)
    for i, (rec, shards) in reuse.items():
        assert base is not None, "leaves are reused from a base"
        views = [(tuple(map(tuple, s["box"])), base.array(s), s) for s in shards]
        record = dataclasses.replace(LeafRecord.from_json(rec), path=flat.paths[i])
        plans[i] = HostLeaf(record, tuple(Shard(b, a) for b, a, s in views if s["primary"]))
        ts.extra += [HostShard(i, b, a, False, s) for b, a, s in views if not s["primary"]]
        ts.origin.update({(i, b): s for b, _, s in views})
    copies: list[tuple[np.ndarray, np.ndarray]] = []  # the other processes' boxes, into ``take``'s buffers
    for i in fresh:
        ts.extra += _replicas(i, flat.leaves[i], plans[i], take, copies)
    ts.lent, ts.crcs = into, part.crcs
    if (
        copies
    ):  # copied as the snapshot's are, with their chunks' crc32c (a full copy is then written in place)
        ts.crcs = dict(part.crcs)
        made = copy_all(copies, CHUNK)
        assert made is not None, "copy_all checksums what it is asked to"
        ts.crcs.update({id(d): c for (d, _), c in zip(copies, made) if d.size})
    if (
        into is not None and into.used
    ):  # its pages are this snapshot's while it lives (a migration reads them)
        tier_files.pin(into.key, ts)
    ts.snap.nbytes = part.nbytes + sum(s.data.nbytes for i in reuse for s in plans[i].shards)
    ts.snap.seconds, ts.snap.choice, ts.snap.waited_s = part.seconds, part.choice, part.waited_s
    ts.part = part
    return ts


def _replicas(
    i: int, x: Any, plan: HostLeaf, take: Any, copies: list[tuple[np.ndarray, np.ndarray]]
) -> list[HostShard]:
    """The boxes on this process's devices that another process writes to persistent storage: into
    ``take``'s buffers where it gives them (each (buffer, source) is added to ``copies``, for the caller
    to copy), else copied now."""
    if plan.whole or not isinstance(x, jax.Array) or not plan.record.is_array:
        return []
    x = jax.random.key_data(x) if plan.record.kind == "prng_key" else x
    have, out = {s.box for s in plan.shards}, []
    for s in x.addressable_shards:
        box = box_of(s.index, tuple(x.shape))
        if box not in have:
            have.add(box)
            a = np.asarray(s.data)
            buf = take(a.shape, a.dtype) if take is not None else None
            if buf is not None:
                copies.append((buf, a))
            out.append(
                HostShard(i, box, buf if buf is not None else np.array(a, order="C", copy=True), False)
            )
    return out


# ---------------------------------------------------------------------------------------- copies


@dataclass
class Encoded:
    """A copy ready to write: ``pieces`` are data.bin's bytes in order; ``index`` is final once the
    crc32c of the ``pending`` pieces (piece index, and where its checksum goes: a list and a position
    in it) are filled in by ``complete``. The index is sealed from ``body`` or, for a full copy, from
    ``text``: its canonical text in parts (encode.py writes it without building the body)."""

    body: dict[str, Any] | None
    index: bytes
    pieces: list[memoryview]
    data_nbytes: int
    pending: list[tuple[int, list, int]] = field(default_factory=list)
    lent: tier_files.Lent | None = None  # the spare whose pages already hold the pieces lying in it
    base: int | None = None  # the base step of a differential copy
    text: list[str] | None = None
    received: bool = False  # as a peer sent it: index final, nothing known of it here

    @classmethod
    def received_from(cls, index: memoryview, data: memoryview) -> "Encoded":
        """A copy as a peer sent it (index final, one piece)."""
        return cls(None, bytes(index), [data], len(data), received=True)

    @property
    def written(self) -> int:
        return self.data_nbytes + len(self.index)

    @property
    def full(self) -> bool:
        return not self.received and self.base is None

    def complete(self, crcs: Sequence[int | None]) -> None:
        """Fills in the pending checksums (``crcs``: per piece, as written) and seals the index."""
        for j, where, at in self.pending:
            where[at] = crcs[j] if where is not self.text else str(crcs[j])
        self.pending = []
        if self.text is not None:
            self.index = seal_text(
                "".join(self.text), name=_FORMAT, version=_VERSION, what="memory-tier index"
            )
        else:
            assert self.body is not None, "an index is sealed from its text or its body"
            self.index = encode_index(self.body)


def _u8(buf: Any) -> np.ndarray:
    return np.frombuffer(buf, np.uint8)


def bytes_of(a: np.ndarray) -> memoryview:
    """A host array's bytes, flat (a copy only where it is not contiguous)."""
    return (
        memoryview(as_buffer(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        if a.size
        else memoryview(b"")
    )


def shard_key(rec: dict[str, Any], box: Any) -> str:
    """A shard's key in any copy (path, dtype, box): how a shard finds its base's."""
    return json.dumps([rec["path"], rec["dtype"], [list(x) for x in box]])


def encode_index(body: dict[str, Any]) -> bytes:
    return seal(body, name=_FORMAT, version=_VERSION, what="memory-tier index")


def decode_index(raw: bytes | memoryview, where: str) -> dict[str, Any]:
    return unseal(
        raw,
        name=_FORMAT,
        version=_VERSION,
        where=f"{where}/{INDEX}",
        what="memory-tier index",
        error=CorruptCheckpointError,
    )


def _check(copy: Copy) -> Copy:
    """Bounds of every entry against the bytes present: a damaged index never reads out of range."""
    b, n, base_n = copy.body, len(copy.data), len(copy.base.data) if copy.base is not None else 0
    if len(copy.data) != b["data"] or (b["base"] is None) != (copy.base is None):
        raise CorruptCheckpointError(f"{copy.where}/{DATA}: {n} bytes, the index says {b['data']}")
    if copy.base is not None and (
        copy.base.body["base"] is not None
        or any(copy.base.body[k] != b[k] for k in ("session", "process", "process_count"))
    ):
        raise CorruptCheckpointError(f"{copy.where}: base {b['base']} belongs to another run or process")
    for s in b["shards"]:
        rec = b["leaves"][s["leaf"]]
        size = math.prod(e - a for a, e in s["box"]) * dtype_from_name(rec["dtype"]).itemsize
        if size != s["nbytes"] or len(s["chunks"]) != math.ceil(size / b["chunk"]):
            raise CorruptCheckpointError(
                f"{copy.where}/{INDEX}: shard {s['box']} of {leaf_name(rec)!r} is inconsistent"
            )
        for k, e in enumerate(s["chunks"]):
            span = min(b["chunk"], size - k * b["chunk"])
            if (
                e[0] not in ("r", "b", "x")
                or (e[0] == "r" and e[3] != span)
                or (e[0] != "b" and e[2] + e[3] > n)
                or (e[0] != "r" and (copy.base is None or e[-1] + span > base_n))
            ):
                raise CorruptCheckpointError(f"{copy.where}/{INDEX}: chunk {e} lies outside the stored bytes")
    return copy


def open_copy(folder: str, *, with_base: bool = True) -> Copy:
    """Opens ``<tier folder>/<step>`` (and its base, a sibling folder), its index verified. The
    folder and its files must be this user's own and writable by nobody else (files.py)."""
    tier_files.check_folder(folder, "memory copy")
    fd, _ = tier_files.open_own(os.path.join(folder, INDEX), "copy index")
    with os.fdopen(fd, "rb") as f:
        body = decode_index(f.read(checks.MAX_MANIFEST_BYTES + 1), folder)
    base = None
    if body["base"] is not None and with_base:
        base = open_copy(os.path.join(os.path.dirname(folder), str(body["base"])), with_base=False)
    copy = Copy(folder, body, Data(os.path.join(folder, DATA)), base)
    return _check(copy) if with_base else copy


def copy_from_parts(parts: Sequence[memoryview], where: str) -> Copy:
    """A copy sent by a peer: [index, data] or [index, data, base index, base data]."""
    if len(parts) not in (2, 4):
        raise CorruptCheckpointError(f"{where}: expected a copy (2 or 4 parts), received {len(parts)}")
    base = (
        Copy(where + " (base)", decode_index(parts[2], where), Data(buf=parts[3]), None)
        if len(parts) == 4
        else None
    )
    return _check(Copy(where, decode_index(parts[0], where), Data(buf=parts[1]), base))


def copy_parts(folder: str) -> list[list[memoryview]]:
    """What a holder sends so that a copy can be restored elsewhere: the copy and its base."""
    copy = open_copy(folder)
    parts = [[memoryview(encode_index(copy.body))], [copy.data.view(0, len(copy.data))]]
    if copy.base is not None:
        parts += [[memoryview(encode_index(copy.base.body))], [copy.base.data.view(0, len(copy.base.data))]]
    return parts


def write_copy(tier_dir: str, step: int, enc: Encoded, spares: SpareFolder | None = None) -> None:
    """Writes ``tier_dir/<step>`` atomically with the engine's commit (staging folder, the index as the
    commit record, rename), replacing a copy of that step left by an earlier run; a crash leaves only a
    staging folder, removed at the next start. data.bin goes into a spare's pages when ``spares`` has
    one; the pending checksums are computed on the stored bytes as they are written, then the index
    (written last) is made."""
    parent = LocalStorage(tier_dir)
    os.makedirs(os.path.dirname(tier_dir), exist_ok=True)
    tier_files.private_folder(tier_dir, "tier folder")
    staging = f"{step}{commit_mod.TMP_MARK}{uuid.uuid4().hex}"
    try:
        os.mkdir(os.path.join(tier_dir, staging), 0o700)
        flags = [False] * len(enc.pieces)
        for j, _, _ in enc.pending:
            flags[j] = True
        loan, enc.lent = enc.lent, None  # a loan not taken here (the copy outgrew it) goes back below
        lent = (
            loan
            if (loan is not None and spares is not None and enc.full and enc.data_nbytes == len(loan.map))
            else None
        )
        try:
            crcs = (spares or SpareFolder("", keep=0)).write(
                os.path.join(tier_dir, staging, DATA), [_u8(p) for p in enc.pieces], flags, lent
            )
        finally:
            if loan is not None and spares is not None:
                spares.give_back(loan)
        if enc.pending:
            enc.complete(crcs)
        if os.path.lexists(os.path.join(tier_dir, str(step))):
            remove_copy(tier_dir, step, spares)
        commit_mod.commit(parent, staging, str(step), INDEX, enc.index)
    except BaseException:
        parent.delete(staging)
        raise


def remove_copy(tier_dir: str, step: int, spares: tier_files.SpareFolder | None = None) -> None:
    """Deletes ``tier_dir/<step>`` (un-committed first, so it is never half-read); its data.bin
    becomes a spare when ``spares`` takes it."""
    salvage = (lambda gone: spares.retire(os.path.join(gone, DATA))) if spares is not None else None
    try:
        commit_mod.remove(LocalStorage(tier_dir), str(step), INDEX, salvage=salvage)
    except FileNotFoundError:  # no such copy
        pass


def mark_committed(folder: str, record: dict[str, Any]) -> None:
    """The tier's commit record of this copy: written once every process holds the step there."""

    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(json.dumps(record).encode())

    commit_mod.commit_file(LocalStorage(folder), COMMIT, write, replace=True)


def unmark(folder: str) -> None:
    try:
        os.unlink(os.path.join(folder, COMMIT))
    except FileNotFoundError:
        pass


def steps_in(tier_dir: str) -> list[int]:
    try:
        return sorted(s for s in map(commit_mod.step_number, os.listdir(tier_dir)) if s is not None)
    except FileNotFoundError:
        return []
