"""The blocking half of every save: a copy of a tree that later mutation or donation cannot change.

Scope: one snapshot for every layout (native steps, Orbax items, memory-tier copies). It classifies
the leaves, copies jax.Array shards on their devices where that is chosen (engine/device.py: the copy is
dispatched on the device's stream and brought to host by ``Snapshot.complete`` on the writer's thread),
starts every other device-to-host transfer, and holds per leaf its typed record (what the
checkpoint will say of it) and this process's shards (arrays only: one per distinct box whose
replica_id is 0, so a replicated shard has exactly one writer). How the shards are stored is a
layout's business (native/layout.py, orbax/write.py, tiers/store.py). A training loop saves one
structure again and again: what does not change between those saves (key paths, kinds, records, the
shards' boxes) is learned at the first and checked, not rebuilt, at the next (``learned``). Shards
copied on their devices are hashed there first, and those unchanged since the last save are never
brought to host (engine/device_hash.py; ``Snapshot.complete``).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import crc32c
import numpy as np

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.engine import device, device_hash
from flax_ckpt._src.engine.arena import Arena
from flax_ckpt._src.engine.equal import same_bytes
from flax_ckpt._src.engine.leaves import key_data_shape
from flax_ckpt._src.engine.pause import gc_paused
from flax_ckpt._src.errors import CheckpointError, format_list
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.serializers import ArrayItem, Box, Shard, box_of
from flax_ckpt._src.storage.base import as_buffer

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

_ON_HOST = threading.Event()  # the ``on_host`` of every snapshot with nothing on a device: set for good
_ON_HOST.set()
_BIG = 1 << 20  # leaves of more bytes are copied on a small pool


@dataclass(slots=True)  # one per leaf of a snapshot: no __dict__ each
class HostLeaf:
    """One leaf of a snapshot: its record (without chunks), this process's host shards, the
    jax.Array's sharding (of its key data, for PRNG keys), and for non-array leaves the object."""

    record: LeafRecord
    shards: tuple[Shard, ...] = ()
    sharding: jax.sharding.Sharding | None = None
    obj: Any = None
    whole: bool = False  # its one shard is all of the array, the array's only one on this process

    @property
    def path(self) -> tree_mod.KeyPath:
        return self.record.path


@dataclass
class Snapshot:
    """A host copy of a tree: nothing in it changes when the caller's arrays are mutated or donated."""

    leaves: list[HostLeaf]
    nbytes: int  # bytes of this process's shards
    seconds: float = 0.0
    owned: bool = False  # every shard buffer was allocated by the snapshot (copy=True): reusable
    crcs: dict[int, np.ndarray] = field(default_factory=dict)  # ``snapshot(checksum=n)``: by the id() of
    #   each buffer ``into`` gave (a shard's ``data``, alive as long as the snapshot), the crc32c (uint32)
    #   of every n bytes of it, made as it was copied
    checksum: int | None = None  # that n
    arena: Arena | None = None  # the arena ``into`` was (engine/arena.py): kept by ``reusable``
    pending: list[device.Pending] = field(default_factory=list)  # shards copied on their devices, brought
    #   to host by ``complete`` (their shards' ``data`` is None until then)
    choice: device.Choice | None = None  # what was copied on the devices, what to host
    waited_s: float = 0.0  # of the caller's time, spent waiting for the device (not a checkpoint's cost)
    ready_at: float | None = None  # when ``complete`` found the device copies done (perf_counter)
    on_host: threading.Event = field(default=_ON_HOST, repr=False)  # set once nothing of it waits for a
    #   device (``complete`` has run, or there was nothing to bring to host: then one shared, set event)
    hurry: threading.Event | None = field(default=None, repr=False)  # with device copies, set once something
    #   waits for this save: ``complete`` then starts every transfer left at once (engine/device.py WINDOW)
    unchanged: dict[int, list[Box]] = field(default_factory=dict)  # per leaf (index in ``leaves``) the
    #   boxes of its shards whose bytes the arena already held (compared, neither copied nor checksummed)
    since: tuple[str, str] | None = None  # (step folder, id) of the committed save that wrote those bytes
    #   (the arena's ``saved_as`` when this snapshot began), or None: then they are equal to nothing known
    fill: int = 0  # the arena's fill this snapshot is (``Arena.fills``): a layout marks it saved only if
    #   no other snapshot has filled the arena since
    prior: device_hash.Ledger | None = None  # with device copies hashed on their devices: what the last
    #   save knew of them (engine/device_hash.py), from ``reuse``
    ledger: device_hash.Ledger | None = None  # what this one knows of them, once ``complete`` has run
    hashing: str = ""  # "" (none hashed), "auto" (on accelerators) or "cpu" (CPU devices too)

    def __post_init__(self) -> None:
        if self.pending:
            self.on_host, self.hurry = threading.Event(), threading.Event()

    def complete(self) -> None:
        """Brings the shards copied on their devices to host (the writer's thread, before anything reads
        the shards): into the buffers ``into`` gave for them (checksummed as copied, as at the snapshot)
        or else the transfer's own buffer, the one host copy. A failed step that produced the state is
        raised here (engine/device.py ``to_host``); nothing has been written then."""
        if not self.pending:
            return
        assert self.hurry is not None, "a snapshot with device copies has its hurry event (__post_init__)"
        try:
            held, plan = self._hashed()
            rest = [p for i, p in enumerate(self.pending) if i not in held]
            hosts, self.ready_at = device.to_host(rest, self.hurry)
        finally:
            self.on_host.set()
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        got: dict[tuple[int, int], np.ndarray] = {}
        brought = iter(hosts)
        for i, p in enumerate(self.pending):
            if i in held:  # unchanged: the host copy the last save wrote, never brought again
                got[(p.leaf, p.shard)] = a = cast(np.ndarray, held[i].data)
                self.crcs[id(a)] = cast(np.ndarray, held[i].crcs)
                continue
            a = next(brought)
            if p.dest is not None:
                copies.append((p.dest, a))
                a = p.dest
            got[(p.leaf, p.shard)] = a
        crcs = copy_all(copies, self.checksum)
        self.crcs.update({id(d): c for (d, _), c in zip(copies, crcs or ()) if d.size})
        if plan:
            self._keep(held, plan, got)
        for i in sorted({p.leaf for p in self.pending}):
            lf = self.leaves[i]
            lf.shards = tuple(Shard(s.box, got.get((i, n), s.data)) for n, s in enumerate(lf.shards))
        self.pending = []  # the device copies are freed

    def _hashed(self) -> tuple[dict[int, device_hash.Entry], dict[int, device_hash.Planned]]:
        """With ``hashing``: which device copies (by index in ``pending``) hold the bytes the last save
        wrote (their digests computed on their devices equal the ledger's), and the plan of this save's
        ledger (device_hash.sort)."""
        if not self.hashing or self.checksum is None:
            return {}, {}
        cpu_too = self.hashing == "cpu"
        cands = [
            (i, self.leaves[p.leaf].record, self.leaves[p.leaf].shards[p.shard].box, p.dev)
            for i, p in enumerate(self.pending)
            if p.dest is None and device_hash.hashable(p.dev, cpu_too)
        ]
        try:
            return device_hash.sort(cands, self.prior)
        except Exception as e:  # the state's computation failed: raised as to_host raises it
            raise device.failed(e) from e

    def _keep(
        self,
        held: dict[int, device_hash.Entry],
        plan: dict[int, device_hash.Planned],
        got: dict[tuple[int, int], np.ndarray],
    ) -> None:
        """This save's ledger: per hashed shard its digest, host copy and block checksums (computed
        here for those brought to host, which the writer then takes as made); the unchanged shards are
        the earlier step's (``unchanged``, ``since``) when nothing else in this snapshot says another."""
        block = cast(int, self.checksum)
        data = {i: got[(self.pending[i].leaf, self.pending[i].shard)] for i in plan}
        fresh = [i for i, pl in plan.items() if i not in held and pl.digest is not None]
        for i, c in zip(fresh, block_crcs([data[i] for i in fresh], block)):
            self.crcs[id(data[i])] = c
        self.ledger = device_hash.ledger(plan, {i: (data[i], self.crcs.get(id(data[i]))) for i in plan})
        since = self.prior.saved_as if self.prior is not None else None
        if (
            held
            and since is not None
            and (self.since == since or (self.since is None and not self.unchanged))
        ):
            self.since = since
            for i in held:
                p = self.pending[i]
                self.unchanged.setdefault(p.leaf, []).append(self.leaves[p.leaf].shards[p.shard].box)
        self.prior = None  # the earlier copies this save did not keep are freed

    def reuse_buffers(self) -> dict[tuple[Any, Box], np.ndarray]:
        """This snapshot's buffers by (key path, box), for ``snapshot(reuse=...)``; none unless owned.
        Read-only views (of CPU jax arrays) are never handed out."""
        if not self.owned:
            return {}
        return {
            (lf.path, s.box): s.data
            for lf in self.leaves
            for s in lf.shards
            if s.data.flags.writeable and not (self.arena is not None and self.arena.holds(s.data))
        }  # the arena is reused whole

    def reusable(self) -> "Snapshot | None":
        """What to keep for the next save: its arena alone when it was taken into one, else this
        snapshot's own buffers (what ``reuse_buffers`` gives), or None when it has none. It holds no view
        of the caller's arrays (that would keep a saved state alive, and stop XLA from donating its
        buffers)."""
        if self.arena is not None:  # the next save's arena holds all that this one asked for (made now if
            # this one was too small): keeping other buffers would be a second copy
            ledger = self.ledger
            if ledger is not None:  # the step this save was committed as (the layout said), if it was
                ledger.saved_as = self.arena.saved_as if self.arena.fills == self.fill else None
            return Snapshot([], 0, owned=True, arena=self.arena.after(), prior=ledger)
        own = self.reuse_buffers()
        if not own:
            return None
        leaves = [
            HostLeaf(lf.record, tuple(s for s in lf.shards if (lf.path, s.box) in own))
            for lf in self.leaves
            if any((lf.path, s.box) in own for s in lf.shards)
        ]
        return Snapshot(leaves, sum(a.nbytes for a in own.values()), owned=True)

    def items(self) -> list[ArrayItem]:
        """The arrays as a serializer takes them (``leaf``: the index in ``leaves``), each shard with the
        checksums made as it was copied (``Shard.crc32c``) where there are some."""

        def shards(lf: HostLeaf) -> tuple[Shard, ...]:
            if not self.crcs:
                return lf.shards
            block = self.checksum
            assert block is not None, "checksums made as copied come with their block size"
            return tuple(
                s if (c := self.crcs.get(id(s.data))) is None else Shard(s.box, s.data, (block, c))
                for s in lf.shards
            )

        return [
            ArrayItem(i, lf.record.name, lf.record.array_dtype, lf.record.array_shape, shards(lf))
            for i, lf in enumerate(self.leaves)
            if lf.record.is_array
        ]


def describe_sharding(s: Any) -> dict[str, Any] | None:
    """What a checkpoint records of a jax sharding (for ``fc.metadata``; restore takes the target's)."""
    if s is None:
        return None
    if isinstance(s, jax.sharding.NamedSharding):
        assert isinstance(s.mesh, jax.sharding.Mesh), "an array's sharding has devices"
        spec = [None if p is None else (p if isinstance(p, str) else list(p)) for p in s.spec]
        return {
            "type": "NamedSharding",
            "axis_names": list(s.mesh.axis_names),
            "mesh_shape": [int(n) for n in s.mesh.devices.shape],
            "spec": spec,
        }
    return {"type": type(s).__name__, "num_devices": len(s.device_set)}


def host_array(x: Any, copy: bool) -> np.ndarray:
    """``x`` as a C-ordered numpy array: a fresh copy, or (copy=False) a view where one exists."""
    a = np.asarray(x)
    return np.array(a, order="C", copy=True) if copy else np.asarray(a, order="C")


def _host_into(old_buffers: dict, key: tuple[Any, Box], x: Any, copy: bool) -> np.ndarray:
    """``host_array(x, copy)``, copying into the previous snapshot's buffer of the same key, shape and
    dtype if there is one (already-faulted memory: several times cheaper to fill than a fresh
    allocation)."""
    buf = old_buffers.get(key)
    if buf is None:
        return host_array(x, copy)
    a = np.asarray(x)
    if buf.shape != a.shape or buf.dtype != a.dtype:
        return host_array(a, copy)
    np.copyto(buf, a)
    return buf


Into = Callable[[tuple[int, ...], np.dtype], "np.ndarray | None"]  # a buffer for a shard, or None


def _copied_into(into: Into, x: Any, copies: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray | None:
    """The buffer ``into`` gives for ``x``'s shape and dtype (None when it gives none), ``x`` to be
    copied into it: the copies are made together at the end (``copy_all``)."""
    a = np.asarray(x)
    buf = into(a.shape, a.dtype)
    if buf is not None:
        copies.append((buf, a))
    return buf


_copier: ThreadPoolExecutor | None = None
_CPUS = os.cpu_count() or 1  # asked once: os.cpu_count() reads /sys at each call
_CACHED = 512 << 10  # bytes copied, then checksummed, at a time (within a core's L2 cache)


def copy_all(
    copies: list[tuple[np.ndarray, np.ndarray]],
    chunk: int | None = None,
    held: Sequence[np.ndarray | None] | None = None,
    same: np.ndarray | None = None,
    tries: Sequence[Sequence[bool] | None] | None = None,
) -> list[np.ndarray] | None:
    """Makes ``copies`` (destination, source) on up to 4 threads, in runs of about equal bytes: while a
    save holds the training loop, its cores are free, and one thread alone does not reach the memory's
    bandwidth. With ``chunk``: also the crc32c of every ``chunk`` bytes of each copy (from its start),
    returned per copy, in order. Each piece of 512 KiB is copied, then its copy checksummed while it is
    in the core's cache: the checksum covers the very bytes that will be written. (Checksumming the
    source first measured cheaper with cold caches, but costs about 0.9 ms more a save of 39 MiB in a
    training loop, whose step has just written the source: benchmarks/README.md.)

    ``held`` (with ``chunk``): per copy, None or the crc32c of every ``chunk`` bytes its destination
    holds now (a contiguous copy): each such chunk is compared with the source first, byte for byte,
    and where equal it is neither copied nor checksummed (its crc32c is ``held``'s). ``tries``: per
    copy with ``held``, None (compare every chunk) or a bool per chunk, False for a chunk copied without
    comparing. ``same``: a bool per copy, set False here for a copy with a chunk that differed or was
    not compared (left as given for the others)."""
    global _copier
    step = chunk or (4 << 20)
    # (copy, first chunk, destination, source, whether the unit is one chunk of bytes of a contiguous copy)
    units: list[tuple[int, int, np.ndarray, np.ndarray, bool]] = []
    for c, (d, a) in enumerate(copies):
        if not d.size:
            continue
        if not a.flags.c_contiguous:  # copied whole (numpy walks the strides), then checksummed
            units.append((c, 0, d, a, False))
            continue
        if d.nbytes <= step:  # one chunk (most leaves): no flat views to make
            units.append((c, 0, d, a, True))
            continue
        d8, a8 = d.reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8)
        units += [(c, k // step, d8[k : k + step], a8[k : k + step], True) for k in range(0, d8.nbytes, step)]
    crcs: list[np.ndarray] | None = None
    if chunk:  # one array for all: a list per copy would be one more object per leaf and save for the
        # garbage collector to follow
        ends = np.cumsum([-(-d.nbytes // step) for d, _ in copies], dtype=np.int64).tolist()
        every = np.zeros(ends[-1] if ends else 0, np.uint32)
        crcs = [every[a:b] for a, b in zip([0] + ends, ends)]

    def run(part: list[tuple[int, int, np.ndarray, np.ndarray, bool]]) -> None:
        for c, k, d, a, one in part:
            if crcs is not None and held is not None and (h := held[c]) is not None and one:
                t = None if tries is None else tries[c]
                if (t is None or t[k]) and same_bytes(d, a):  # the destination holds these bytes already
                    crcs[c][k] = h[k]
                    continue
                if same is not None:
                    same[c] = False
            if crcs is not None and one:  # copied, then the copy checksummed from the cache the copy
                if d.nbytes <= _CACHED:  # left it in
                    np.copyto(d, a)
                    crcs[c][k] = crc32c.crc32c(as_buffer(d))
                    continue
                d, a, crc = d.reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8), 0
                for j in range(0, d.nbytes, _CACHED):  # in pieces that stay in the core's cache
                    np.copyto(d[j : j + _CACHED], a[j : j + _CACHED])
                    crc = crc32c.crc32c(as_buffer(d[j : j + _CACHED]), crc)
                crcs[c][k] = crc
                continue
            np.copyto(d, a)
            if crcs is not None:
                flat = d.reshape(-1).view(np.uint8)
                for j in range(0, flat.nbytes, step):
                    crcs[c][k + j // step] = crc32c.crc32c(as_buffer(flat[j : j + step]))

    total = sum(u[2].nbytes for u in units)
    n = max(1, min(4, _CPUS, len(units), total // (8 << 20)))
    parts: list[list[tuple[int, int, np.ndarray, np.ndarray, bool]]] = [[] for _ in range(n)]
    acc = 0
    for u in units:  # contiguous runs: thread k takes the units that start in its share of the bytes
        parts[min(n - 1, acc * n // max(1, total))].append(u)
        acc += u[2].nbytes
    futures = []
    if n > 1:
        if _copier is None:
            _copier = ThreadPoolExecutor(4, thread_name_prefix="flax_ckpt-copy")
        futures = [_copier.submit(run, part) for part in parts[1:] if part]
    try:
        run(parts[0])
    finally:
        for f in futures:  # every copy ends before the buffers are used (or a failure is raised)
            f.exception()
    for f in futures:
        f.result()
    return crcs


def _on_cpu(x: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in x.sharding.device_set)


@dataclass(frozen=True, eq=False, slots=True)
class _Learned:
    """What a snapshot keeps of one leaf for the next save of the same structure (``tree.Flat.memo``),
    valid while the leaf at that place has the same ``sig`` (type, shape, dtype, sharding): its kind,
    and for arrays the record (without chunks), the box of the whole array, whether its only addressable
    shard is the whole array (``whole``: the array itself is the shard) and whether it lies on CPU."""

    sig: tuple[Any, ...]
    kind: str
    record: LeafRecord | None = None
    box: Box = ()
    whole: bool = False
    cpu: bool = False

    @property
    def array(self) -> LeafRecord:
        """``record``, of an array leaf (every array kind has one)."""
        assert self.record is not None, f"a {self.kind} leaf has no array record"
        return self.record


def _sig(x: Any) -> tuple[Any, ...]:
    if isinstance(x, jax.Array):
        return (type(x), x.shape, x.dtype, x.sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return (type(x), x.shape, x.dtype)
    return (type(x),)


def _learn(path: tree_mod.KeyPath, x: Any, kind: str, sig: tuple[Any, ...]) -> _Learned:
    if kind not in ("jax", "numpy", "prng_key"):
        return _Learned(sig, kind)
    key_impl = key_shape = None
    if kind == "prng_key":
        key_impl = str(jax.random.key_impl(x))
        x = jax.random.key_data(x)
        data_shape = key_data_shape(key_impl)
        assert data_shape is not None, f"jax knows the PRNG implementation {key_impl} of its own key"
        key_shape = tuple(x.shape[x.ndim - len(data_shape) :])
    shape, box = _whole(tuple(int(d) for d in x.shape))
    whole, cpu, desc = True, False, None
    if isinstance(x, jax.Array):
        shards = x.addressable_shards
        whole = (
            x.is_fully_addressable
            and len(shards) == 1
            and shards[0].replica_id == 0
            and box_of(shards[0].index, shape) == box
        )
        cpu, desc = _on_cpu(x), describe_sharding(x.sharding)
    rec = LeafRecord(path, kind, np.dtype(x.dtype), shape, key_impl, key_shape, desc)
    return _Learned(_shared(sig), kind, rec, box, whole, cpu)


@functools.lru_cache(maxsize=4096)
def _whole(shape: tuple[int, ...]) -> tuple[tuple[int, ...], Box]:
    """(shape, the box of all of it), one pair of objects for every leaf of that shape: a tree of many
    leaves has few shapes, and each leaf's memo keeps them (engine/snapshot.py ``learned``)."""
    return shape, tuple((0, d) for d in shape)


@functools.lru_cache(maxsize=4096)
def _shared(sig: tuple[Any, ...]) -> tuple[Any, ...]:
    """``sig`` itself, the first time an equal one was seen: one object for the leaves that share it."""
    return sig


def _array_leaf(
    x: Any,
    seen: _Learned,
    copy: bool,
    old_buffers: dict,
    into: Into | None,
    copies: list[tuple[np.ndarray, np.ndarray]],
) -> HostLeaf:
    if seen.kind == "prng_key":
        x = jax.random.key_data(x)
    rec = seen.array
    if isinstance(x, jax.Array):
        # A CPU array's host view is already a snapshot: jax arrays are immutable, the view keeps the
        # buffer alive through x.delete(), and XLA never donates a buffer that has host views (it
        # allocates the output instead). So CPU arrays are not copied; other devices' are. (A whole
        # array with ``into`` is copied by ``snapshot``'s loop itself, without this function.)
        parts = (
            [(x, seen.box)]
            if seen.whole
            else [
                (s.data, box_of(s.index, rec.array_shape)) for s in x.addressable_shards if s.replica_id == 0
            ]
        )

        def host(a: Any, b: Box) -> np.ndarray:
            if not seen.cpu:  # the transfer's own host buffer (started at the snapshot's beginning) is
                return host_array(a, False)  # the copy: nothing can change it; another copy would be a second
            buf = _copied_into(into, a, copies) if into is not None else None
            return buf if buf is not None else host_array(a, False)

        return HostLeaf(rec, tuple(Shard(b, host(a, b)) for a, b in parts), x.sharding, whole=seen.whole)
    buf = _copied_into(into, x, copies) if into is not None and copy else None
    buf = buf if buf is not None else _host_into(old_buffers, (rec.path, seen.box), x, copy)
    return HostLeaf(rec, (Shard(seen.box, buf),), whole=True)


_PY: tuple[type, ...] = (bool, int, float, complex)


def _value_leaf(path: tree_mod.KeyPath, x: Any, kind: str) -> HostLeaf:
    if kind == "empty":
        return HostLeaf(LeafRecord(path, kind, value=tree_mod.empty_kind(x)), obj=x)
    if kind == "string":
        return HostLeaf(LeafRecord(path, kind, value=str(x)), obj=x)
    py = next(t for t in _PY if isinstance(x, t))  # bool before int: a bool is an int too
    return HostLeaf(LeafRecord(path, kind, value=py(x)), obj=x)


def learned(flat: tree_mod.Flat, only: Sequence[int]) -> list[_Learned]:
    """What is known of the leaves ``only`` of ``flat``: kept from an earlier save of the same
    structure where the leaf's type, shape, dtype and sharding are still the same, else classified and
    recorded now (an UnsupportedLeafError names every leaf that cannot be stored)."""
    sigs = [_sig(flat.leaves[i]) for i in only]
    out = [k if (k := flat.memo[i]) is not None and k.sig == sig else None for i, sig in zip(only, sigs)]
    miss = [j for j, k in enumerate(out) if k is None]
    if miss:
        kinds = tree_mod.classify_all([(flat.paths[only[j]], flat.leaves[only[j]]) for j in miss])
        for j, kind in zip(miss, kinds):
            i = only[j]
            out[j] = flat.memo[i] = _learn(flat.paths[i], flat.leaves[i], kind, sigs[j])
    return cast(list[_Learned], out)  # every miss learned just above: no None is left


@gc_paused()
def snapshot(tree: Any, **options: Any) -> Snapshot:
    """``_snapshot(tree, **options)`` (its docstring says what it does), where a leaf whose
    computation failed on the device (an XLA runtime error of the training step, met when the state is
    waited for or copied to host) is a CheckpointError saying so, its cause attached."""
    try:
        return _snapshot(tree, **options)
    except getattr(jax.errors, "JaxRuntimeError", RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise device.failed(e) from e


def _snapshot(
    tree: Any,
    *,
    copy: bool = True,
    reuse: Snapshot | None = None,
    into: Into | None = None,
    checksum: int | None = None,
    only: Sequence[int] | None = None,
) -> Snapshot:
    """Copies every array shard this process writes to host memory (``copy=False`` reuses host buffers
    where possible: for synchronous saves, where nothing can change them meanwhile).

    ``tree``: a pytree, or one flattened by ``tree.flat`` (then ``only``: the indices of the leaves to
    snapshot, in order; ``leaves`` holds those). What does not change between saves of one structure
    (key paths, kinds, records, the shards' boxes) is learned once and kept (``learned``).

    ``reuse``: an earlier snapshot (copy=True) that nothing reads any more, e.g. the previous save's
    once it is durable; its buffers are overwritten where key path, box, shape and dtype match, which
    saves the page faults of fresh memory (most of a snapshot's time on a CPU host).

    ``into``: where every array shard is copied, CPU jax arrays too (whose host views are otherwise a
    snapshot already), called in the order of the leaves and of their shards (the memory tiers pass
    the pages of the data file the copy becomes, tiers/files.py ``Lent``); a shard it gives no buffer
    for is snapshotted as without it. Copying at once also releases the arrays: XLA can then donate
    them to the next step (host views would make it allocate new buffers). ``checksum``: the copies into
    those buffers also give the crc32c of every ``checksum`` bytes of each (``Snapshot.crcs``).

    With ``copy``, jax.Array leaves may be copied on their devices instead (engine/device.py decides:
    ``FLAX_CKPT_DEVICE_SNAPSHOT``, whether the state is still being computed, the devices' free memory):
    those shards' data is None until ``Snapshot.complete`` brings them to host, into the buffers
    ``into`` gave for them (CPU arrays) or else the transfer's own buffer. A leaf that was deleted
    (donated to a step) is a CheckpointError naming it, before anything is copied."""
    t0 = time.perf_counter()
    old_buffers = reuse.reuse_buffers() if (copy and reuse is not None) else {}
    flat = tree if isinstance(tree, tree_mod.Flat) else tree_mod.flat(tree)
    only = range(len(flat.leaves)) if only is None else only
    _refuse_deleted(flat, only)
    seen = learned(flat, only)
    arrays = [
        (j, jax.random.key_data(x) if k.kind == "prng_key" else x, k.whole, k.cpu)
        for j, k in enumerate(seen)
        if k.kind in ("jax", "prng_key")
        for x in (flat.leaves[only[j]],)
    ]
    on_dev, choice = device.choose(arrays) if copy else (set(), device.Choice("host", 0, 0))
    waited = _wait_for_host_part(arrays, on_dev, choice)
    for j, (i, k) in enumerate(zip(only, seen)):  # start every device-to-host transfer before waiting
        if k.kind == "jax" and not k.cpu and j not in on_dev:  # on any
            flat.leaves[i].copy_to_host_async()

    copies: list[tuple[np.ndarray, np.ndarray]] = []  # (buffer from ``into``, source), made at the end
    pending: list[device.Pending] = []  # shards copied on their devices
    data_of = {j: x for j, x, _, _ in arrays if j in on_dev}
    hashing = _hashing(copy, into, checksum) if on_dev else ""

    def leaf(j: int) -> HostLeaf:
        x, k = flat.leaves[only[j]], seen[j]
        if k.record is not None:
            return _array_leaf(x, k, copy, old_buffers, into, copies)
        return _value_leaf(flat.paths[only[j]], x, k.kind)

    leaves: list[Any] = [None] * len(seen)
    if into is None:  # ``into`` is called in order: one thread
        big = [
            j
            for j, k in enumerate(seen)
            if k.record is not None
            and not k.cpu  # copied, not a CPU
            and k.record.nbytes > _BIG
            and j not in on_dev
        ]  # array's view
        if len(big) > 1:
            with ThreadPoolExecutor(min(4, len(big))) as pool:
                for j, hl in zip(big, pool.map(leaf, big)):
                    leaves[j] = hl
    for j, k in enumerate(seen):
        if leaves[j] is not None:
            continue
        if j in on_dev:
            leaves[j] = _device_leaf(j, data_of[j], k, into, pending, hashing == "cpu")
            continue
        if into is not None and k.whole and k.cpu and k.kind in ("jax", "prng_key"):  # most leaves: one
            x = flat.leaves[only[j]]  # shard, one buffer (without _array_leaf's general path)
            data = jax.random.key_data(x) if k.kind == "prng_key" else x
            buf = _copied_into(into, data, copies)
            if buf is not None:
                leaves[j] = HostLeaf(k.array, (Shard(k.box, buf),), data.sharding, whole=True)
            else:  # ``into`` gave none for it (asked once): snapshotted as without it
                leaves[j] = _array_leaf(x, k, copy, old_buffers, None, copies)
            continue
        leaves[j] = leaf(j)
    if pending:
        device.dispatch(pending)
    arena = into if isinstance(into, Arena) and checksum else None
    if arena is not None and checksum:
        crcs, unchanged, since = _refill(arena, copies, leaves, checksum)
    else:
        crcs, unchanged, since = copy_all(copies, checksum), {}, None
    nbytes = sum(s.data.nbytes for hl in leaves for s in hl.shards if s.data is not None) + sum(
        p.nbytes for p in pending
    )
    if choice.cpu:  # ``choose`` left its bytes to count here
        choice = device.Choice("host", 0, nbytes, cpu=True)
    device.tell(choice)
    return Snapshot(
        leaves,
        nbytes,
        time.perf_counter() - t0,
        owned=copy,
        crcs={id(d): c for (d, _), c in zip(copies, crcs or ()) if d.size},
        checksum=checksum,
        arena=into if isinstance(into, Arena) else None,
        pending=pending,
        choice=choice,
        waited_s=waited,
        unchanged=unchanged,
        since=since,
        fill=arena.fills if arena is not None else 0,
        prior=reuse.prior if reuse is not None and hashing else None,
        hashing=hashing if pending else "",
    )


def _hashing(copy: bool, into: Into | None, checksum: int | None) -> str:
    """Whether a snapshot's device copies are hashed on their devices (engine/device_hash.py): those of
    a save into an arena with block checksums (the native layout's, whose steps share unchanged bytes),
    "auto" on accelerators, "cpu" on CPU devices too (the private switch), "" for none."""
    if not (copy and checksum and isinstance(into, Arena)):
        return ""
    m = device_hash.mode()
    return "" if m == "off" else m


def block_crcs(arrays: Sequence[np.ndarray], block: int) -> list[np.ndarray]:
    """The crc32c (uint32) of every ``block`` bytes of each C-contiguous array, on up to 4 threads."""
    flats = [a.reshape(-1).view(np.uint8) for a in arrays]
    out = [np.zeros(max(1, -(-f.nbytes // block)), np.uint32) for f in flats]
    units = [(c, k) for c, f in enumerate(flats) for k in range(0, max(1, f.nbytes), block)]

    def run(u: tuple[int, int]) -> None:
        c, k = u
        out[c][k // block] = crc32c.crc32c(as_buffer(flats[c][k : k + block]))

    global _copier
    if len(units) > 1:
        if _copier is None:
            _copier = ThreadPoolExecutor(4, thread_name_prefix="flax_ckpt-copy")
        list(_copier.map(run, units))
    else:
        for u in units:
            run(u)
    return out


_SAME_MIN = 64 << 10  # smaller shards are copied without comparing (a step's smaller pieces are written)
_MISSES = 2  # a chunk whose bytes changed at this many saves in a row is copied without comparing


def _refill(
    arena: Arena, copies: list[tuple[np.ndarray, np.ndarray]], leaves: list[HostLeaf], block: int
) -> tuple[list[np.ndarray], dict[int, list[Box]], tuple[str, str] | None]:
    """``copy_all(copies, block)`` into ``arena``, where each large shard the arena's last fill put in
    the same place is compared with those bytes first (neither copied nor checksummed where equal),
    but for its chunks whose bytes changed at each of the last _MISSES saves (a state that changes
    everywhere at every step pays for no comparison that fails; a chunk copied so is known unchanged by
    its crc32c and compared again at the next save).
    Returns the crc32c per copy, per leaf the boxes of its shards found equal, and the step the
    arena's bytes were committed as (``Arena.saved_as``, None when unknown). The arena's ledger then
    says what this fill holds."""
    keys, held, misses, since = _held(arena, copies, leaves, block)
    same = np.array([h is not None for h in held], bool)
    tries = [None if m is None else [r < _MISSES for r in m] for m in misses]
    crcs = copy_all(copies, block, held, same, tries)
    assert crcs is not None, "copy_all checksums what it is asked to"
    ledger = {}
    for c, (_, key, at) in keys.items():
        h, m, now = held[c], misses[c], crcs[c]
        # a chunk's run of changed saves, by its crc32c: one copied without comparing but unchanged
        # (a leaf that stopped changing) is compared again at the next save
        if h is None or m is None:
            run: tuple[int, ...] = (0,) * len(now)
        elif len(m) == 1:  # one block (most shards): no lists to make
            run = (0,) if now[0] == h[0] else (min(m[0] + 1, 255),)
        else:
            run = tuple(0 if x == y else min(r + 1, 255) for x, y, r in zip(now.tolist(), h.tolist(), m))
        ledger[at] = (key, now, run)
    arena.ledger = ledger
    unchanged: dict[int, list[Box]] = {}
    for c, (j, key, _) in keys.items():
        if same[c]:
            unchanged.setdefault(j, []).append(key[1])
    return crcs, unchanged, since


def _held(
    arena: Arena, copies: list[tuple[np.ndarray, np.ndarray]], leaves: list[HostLeaf], block: int
) -> tuple[
    dict[int, tuple[int, tuple, int]],
    list[np.ndarray | None],
    list[tuple[int, ...] | None],
    tuple[str, str] | None,
]:
    """A snapshot's fill of ``arena`` begins: per large contiguous copy (by its index in ``copies``)
    its leaf, what it copies (the arena's ledger key: the leaf's record, which a snapshot learns once
    per structure and compares by identity, and the shard's box) and where in the arena; per copy,
    the crc32c of the ``block``-byte blocks its destination holds where the arena's last complete fill
    copied the same there, else None, and then per block how many saves in a row its bytes changed;
    and the step those bytes were committed as. The arena forgets both now (its bytes are about to
    change: a fill that fails leaves it knowing nothing)."""
    prior, since = arena.ledger, arena.saved_as
    arena.ledger, arena.saved_as, arena.fills = {}, None, arena.fills + 1
    big = {id(d): c for c, (d, a) in enumerate(copies) if d.nbytes >= _SAME_MIN and a.flags.c_contiguous}
    keys: dict[int, tuple[int, tuple, int]] = {}
    if big:
        for j, lf in enumerate(leaves):
            for sh in lf.shards:
                c = big.get(id(sh.data))
                if c is not None:
                    keys[c] = (j, (lf.record, sh.box), arena.offset(sh.data))
    held: list[np.ndarray | None] = [None] * len(copies)
    misses: list[tuple[int, ...] | None] = [None] * len(copies)
    for c, (_, key, at) in keys.items():
        old = prior.get(at)  # the same record's box: the same dtype and shape
        if (
            old is not None
            and old[0][0] is key[0]
            and old[0][1] == key[1]
            and len(old[1]) == -(-copies[c][0].nbytes // block)
        ):
            held[c], misses[c] = old[1], old[2]
    return keys, held, misses, since


def _refuse_deleted(flat: tree_mod.Flat, only: Sequence[int]) -> None:
    """A CheckpointError naming every jax.Array leaf that was deleted (donated to a step) before it was
    saved; nothing is copied or written then."""
    gone = [flat.names[i] for i in only if isinstance(x := flat.leaves[i], jax.Array) and x.is_deleted()]
    if gone:
        raise CheckpointError(
            f"cannot save: {len(gone)} jax.Array leaves were deleted, e.g. donated to a jitted step "
            f"(donate_argnums) before this save: {format_list(gone)}. Save "
            "the state the step returned (save before the step that donates it, or after, its output); "
            "nothing was written"
        )


def _wait_for_host_part(
    arrays: list[tuple[int, Any, bool, bool]], on_dev: set[int], choice: device.Choice
) -> float:
    """Seconds spent waiting for the arrays that are copied to host now to be computed (the device's
    time, not a checkpoint's: the statistics report it apart from ``blocked_s``). The last one computed
    is taken for the state computed (a step's outputs are computed together; any other leaf still
    computing is waited for by its copy, np.asarray, and counted as the save's)."""
    if choice.ready:  # ``choose`` found them all computed
        return 0.0
    rest = [x for j, x, _, _ in arrays if j not in on_dev]
    if not rest or tree_mod.is_ready(rest[-1]):
        return 0.0
    t0 = time.perf_counter()
    jax.block_until_ready(rest)
    return time.perf_counter() - t0


def _device_leaf(
    j: int,
    data: jax.Array,
    seen: _Learned,
    into: Into | None,
    pending: list[device.Pending],
    hash_cpu: bool = False,
) -> HostLeaf:
    """A leaf whose shards are copied on their devices (``pending``; dispatched together at the end of
    the snapshot): its shards' data comes with ``Snapshot.complete``. A CPU array's host copy goes into
    ``into``'s buffer where it gives one (the arena, the memory tier's pages), as without the device,
    but for a shard hashed on its device (``hash_cpu``): its host copy is kept by the next save's
    ledger, as an accelerator's is (engine/device_hash.py)."""
    rec = seen.array
    parts = (
        [(data, seen.box)]
        if seen.whole
        else [
            (s.data, box_of(s.index, rec.array_shape)) for s in data.addressable_shards if s.replica_id == 0
        ]
    )
    shards = []
    for a, b in parts:
        mine = hash_cpu and device_hash.hashable(a, True)
        dest = into(tuple(a.shape), np.dtype(a.dtype)) if into is not None and seen.cpu and not mine else None
        pending.append(device.Pending(j, len(shards), a, dest))
        shards.append(Shard(b, cast(np.ndarray, None)))  # its data: Snapshot.complete sets it
    return HostLeaf(rec, tuple(shards), data.sharding, whole=seen.whole)


def jsonable(obj: Any, what: str) -> Any:
    """``obj`` as the JSON it is stored as (metrics, user metadata); CheckpointError when it is not
    JSON (no pickle is used). An array or numpy scalar with exactly one element (a 0-d array, a pmap's
    shape-(1,) metric) becomes its Python number; a larger array is an error naming its key path and
    shape."""
    if obj is None:
        return None
    try:
        return json.loads(json.dumps(_plain(obj, what, ()), default=_refuse))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must be JSON-serializable (no pickle is used): {e}") from None
    except RecursionError:
        raise CheckpointError(f"{what} is nested too deeply to store as JSON") from None


def metrics_json(metrics: Any) -> dict[str, Any] | None:
    """``metrics`` as stored: a dict of names to numbers (what ``best_metric``, retention and ``ls``
    read), each value through ``jsonable``; a CheckpointError naming the key otherwise, before anything
    is written."""
    metrics = jsonable(metrics, "metrics")
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise CheckpointError(
            f"metrics must be a dict of names to numbers, e.g. {{'loss': 0.25}}; got {type(metrics).__name__}"
        )
    bad = [k for k, v in metrics.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise CheckpointError(
            "metrics must be numbers (best_metric and retention compare them); not numbers: "
            + ", ".join(f"{k!r}: {metrics[k]!r:.40}" for k in bad[:5])
            + ". Put other values in metadata=... instead; nothing was written"
        )
    return metrics


def _plain(x: Any, what: str, path: tuple[Any, ...]) -> Any:
    """``x`` with every one-element array replaced by its Python number (containers walked)."""
    if isinstance(x, dict):
        return {k: _plain(v, what, path + (k,)) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v, what, path + (i,)) for i, v in enumerate(x)]
    if isinstance(x, (np.generic, np.ndarray, jax.Array)):
        if np.size(x) != 1:
            where = "/".join(map(str, path)) or "<root>"
            kind = "jax.Array" if isinstance(x, jax.Array) else "numpy array"
            raise CheckpointError(
                f"{what} {where!r}: a {kind} of shape {tuple(np.shape(x))} is not a scalar (stored as a JSON "
                "number, an array needs exactly one element): reduce it (e.g. .mean()) or take one replica's "
                "value (x[0] of a pmap's output)"
            )
        a = np.asarray(x).reshape(())
        return a.item() if a.dtype.kind in "biufc" else float(a)  # ml_dtypes (bfloat16, float8): a float
    return x


def _refuse(x: Any) -> Any:
    raise TypeError(f"{type(x).__name__} is not JSON-serializable")


__all__ = ["HostLeaf", "Snapshot", "describe_sharding", "host_array", "jsonable", "snapshot"]
