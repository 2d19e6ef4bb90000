"""The one restore of every layout: saved leaves -> the target's structure, placed on its devices.

Scope: a ``Source`` is one opened checkpoint of any layout (native step: engine/native.py; Orbax
item: orbax/read.py; memory-tier copy: tiers/load.py): its typed leaf records, where it is (for
messages), and how to fill a box of one leaf with verified bytes. ``restore`` checks the target leaf by
leaf (engine/leaves.py), reads what each leaf needs (only the boxes this process's devices hold) and
places it: into the target's sharding, onto a device, or as numpy arrays without a target. Opening,
validation and the byte layout belong to the sources.
"""

from __future__ import annotations

import copy
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, Sequence

import jax
import numpy as np

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.engine.leaves import match_target, python_scalar_kinds
from flax_ckpt._src.errors import CorruptCheckpointError
from flax_ckpt._src.format import LeafRecord, boxes_disjoint
from flax_ckpt._src.serializers import Box, box_of

_IO_THREADS = 8
_REMOTE_THREADS = 32  # object stores: reads in flight at once
_BIG_LEAF = 1 << 20  # restore reads leaves of at least this many bytes on a pool
_ALIGN = 64  # restored host buffers start on this boundary (see aligned_empty)


class Source(Protocol):
    """One opened checkpoint, whatever its layout. ``url``: the checkpoint; ``where``: the file its
    records come from (both for messages); ``hint``: a sentence a structure error adds. ``budget``:
    bytes a restore may allocate (the bytes the checkpoint stores, with slack: a damaged or crafted
    record cannot make it allocate more), or None where no bound is known. ``remote``: every read is a
    request round trip (object stores, tensorstore drivers): leaves are read concurrently."""

    url: str
    where: str
    hint: str
    leaves: Sequence[LeafRecord]
    remote: bool

    @property
    def budget(self) -> int | None: ...

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        """Fills ``out`` (the extents of ``box``, the leaf's dtype) with verified bytes."""

    def view(self, leaf: LeafRecord, box: Box) -> np.ndarray | None:
        """The box as a verified read-only array over bytes never written again, or None."""

    def select(self, target: Any) -> "tuple[Source, Any]":
        """The part of this checkpoint ``target`` asks for, and the target to check against it: the
        source itself for most layouts; for an Orbax step of named items, only the items the target (a
        dict keyed by item names) names. Raises a TargetMismatchError naming what the source holds."""


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-ordered array whose data starts on a 64-byte boundary: jax.device_put onto a
    CPU device then uses the buffer as is instead of copying it (XLA copies unaligned host buffers)."""
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off:off + n].view(dtype).reshape(shape)


def _volume(box: Box) -> int:
    return math.prod(e - s for s, e in box)


class Reader:
    """Reads leaves of one source: ``host`` (a box into numpy), ``value`` (a leaf as restore gives it),
    with allocation bounded by the source's budget."""

    def __init__(self, source: Source):
        self.source = source
        self._budget: int | None | bool = False  # False: not asked yet (a local source walks its folder)
        self._mutex = threading.Lock()

    def host(self, leaf: LeafRecord, box: Box | None = None, *, device: bool = False) -> np.ndarray:
        """A box of a leaf in host memory. ``device``: it only goes on to jax.device_put, so a verified
        read-only view of bytes the source holds in memory will do (``Source.view``), where one exists."""
        box = box or tuple((0, d) for d in leaf.shape)
        if device:
            v = self.source.view(leaf, box)
            if v is not None:
                return v
        extents = tuple(e - s for s, e in box)
        self._reserve(math.prod(extents) * leaf.dtype.itemsize, leaf)
        out = aligned_empty(extents, leaf.dtype)
        self.source.read(leaf, box, out)
        return out

    def _reserve(self, nbytes: int, leaf: LeafRecord) -> None:
        """Memory stays bounded by what is stored: a restore allocates at most the source's budget,
        whatever its records claim."""
        with self._mutex:
            if self._budget is False:
                self._budget = self.source.budget
            if self._budget is not None and nbytes > self._budget:
                raise CorruptCheckpointError(
                    f"{self.source.where} leaf {leaf.name!r}: needs {nbytes} bytes, more than the checkpoint "
                    "folder can hold; the manifest claims data that is not there (damaged or crafted); "
                    "nothing was allocated")
            if self._budget is not None:
                self._budget -= nbytes

    def sharded(self, leaf: LeafRecord, sharding: jax.sharding.Sharding) -> jax.Array:
        """Reads only the boxes this process's devices hold; when they tile one bounding box (the usual
        case), that box is read once and sliced, so no stored byte is read twice."""
        shape = leaf.shape
        boxes = {dev: box_of(index, shape) for dev, index in sharding.addressable_devices_indices_map(shape).items()}
        unique = set(boxes.values())
        bbox = tuple((min(b[d][0] for b in unique), max(b[d][1] for b in unique)) for d in range(len(shape)))
        if len(unique) > 1 and sum(_volume(b) for b in unique) == _volume(bbox) and boxes_disjoint(unique):
            whole = self.host(leaf, bbox, device=True)
            cache = {b: whole[tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(b, bbox))] for b in unique}
        else:
            cache = {b: self.host(leaf, b, device=True) for b in unique}
        arrays = [jax.device_put(cache[box], dev) for dev, box in boxes.items()]
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    def value(self, leaf: LeafRecord, target: Any, sharding: Any) -> Any:
        """The leaf as restore gives it for ``target`` (None: no target) and ``sharding``. The target's
        leaf type is kept: a Python scalar target gets a Python scalar of its type (whatever 0-d array
        was saved), a weak-typed 0-d jax target a weak-typed array (as jit gives a Python scalar)."""
        kind = leaf.kind
        if kind == "json":
            return copy.deepcopy(leaf.value)
        if kind == "empty":
            if target is not None or leaf.value == "none":
                return target
            return {"dict": {}, "list": [], "tuple": ()}[leaf.value]
        if kind in ("string", "scalar"):
            return leaf.value
        if kind == "prng_key":
            data = self.host(leaf, device=True)
            key = jax.random.wrap_key_data(data, impl=leaf.key_impl)
            sharding = sharding or getattr(target, "sharding", None)
            return jax.device_put(key, sharding) if sharding is not None else key
        if leaf.python and target is None:
            return self.host(leaf)[()].item()  # a Python number stored as a 0-d array
        if python_scalar_kinds(target) is not None:  # e.g. TrainState.create's step=0: a Python int back
            return type(target)(self.host(leaf)[()].item())
        if sharding is None and target is not None:
            sharding = getattr(target, "sharding", None)
        if getattr(target, "weak_type", False) and leaf.shape == ():
            weak = weak_scalar(self.host(leaf), sharding)
            if weak is not None:
                return weak
        if sharding is None:
            if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
                return jax.device_put(self.host(leaf, device=True))
            arr = self.host(leaf)
            return arr[()] if isinstance(target, np.generic) else arr
        return self.sharded(leaf, sharding)


def weak_scalar(value: np.ndarray, sharding: Any) -> jax.Array | None:
    """A weak-typed 0-d jax array holding exactly the bits of ``value`` (jax makes one of a Python
    number), placed by ``sharding``; None where no Python number gives that dtype and those bits
    (e.g. int8, bfloat16, a NaN payload a float64 round trip would change)."""
    out = jax.device_put(value[()].item(), sharding)
    if out.dtype != value.dtype or np.asarray(out).tobytes() != value.tobytes():
        return None
    return out


def flat_shardings(shardings: Any, names: Sequence[str]) -> dict[str, Any]:
    """``shardings`` (one Sharding for every array, or a tree of them by key path) by leaf name."""
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        return {k: shardings for k in names}
    flat, _ = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))
    return {tree_mod.keystr(tuple(tree_mod.entry(k) for k in p)): s for p, s in flat}


def restore(source: Source, target: Any = None, *, shardings: Any = None, partial: bool = False) -> Any:
    """Restores ``source`` into ``target``'s structure (checked leaf by leaf), or without a target into
    nested dicts/lists of numpy arrays, Python scalars and strings (PRNG keys as key arrays)."""
    source, target = source.select(target)
    reader = Reader(source)
    if target is None:
        leaves = list(source.leaves)
        smap = flat_shardings(shardings, [leaf.name for leaf in leaves])
        values = read_all(reader, [(leaf, None, smap.get(leaf.name)) for leaf in leaves])
        return tree_mod.nest((leaf.path, v) for leaf, v in zip(leaves, values))
    flat, treedef = tree_mod.flatten(target)
    chosen = match_target(source.leaves, flat, partial=partial, what=source.url, where=source.where,
                          hint=source.hint)
    smap = flat_shardings(shardings, [leaf.name for leaf in chosen])
    values = read_all(reader, [(leaf, t, smap.get(leaf.name)) for leaf, (_, t) in zip(chosen, flat)])
    return jax.tree_util.tree_unflatten(treedef, values)


def restored_nbytes(source: Source, target: Any, partial: bool) -> int:
    """Array bytes a restore of ``source`` into ``target`` reads."""
    source, target = source.select(target)
    wanted = None
    if target is not None and partial:
        wanted = {tree_mod.keystr(p) for p, _ in tree_mod.flatten(target)[0]}
    return sum(leaf.nbytes for leaf in source.leaves if wanted is None or leaf.name in wanted)


def read_all(reader: Reader, jobs: list[tuple[LeafRecord, Any, Any]]) -> list[Any]:
    """Reads every leaf: the large ones on a pool, the small ones meanwhile on this thread (a pool task
    per small leaf costs more in thread hand-offs than the read itself). Where every read is a
    request round trip (object stores), all leaves go to a wide pool."""
    if reader.source.remote:
        with ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            return list(pool.map(lambda j: reader.value(*j), jobs))
    big = [i for i, (leaf, _, _) in enumerate(jobs) if leaf.nbytes >= _BIG_LEAF]
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


__all__ = ["Reader", "Source", "aligned_empty", "flat_shardings", "read_all", "restore", "restored_nbytes",
           "weak_scalar"]
