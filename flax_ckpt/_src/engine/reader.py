"""How a restore reads one opened checkpoint: the ``Source`` every layout opens, and the ``Reader`` over it.

Scope: ``Source``, the protocol of one opened checkpoint of any layout (native step: native/layout.py;
Orbax item: orbax/read.py; memory-tier copy: tiers/load.py; other libraries' files: foreign/files.py):
its typed leaf records, where it is (for messages), how to fill a box of one leaf with verified bytes,
and what a verify of it finds (``Damage``; ``read_back``: the verify of a source read leaf by leaf).
``Reader`` reads the leaves of one source: a box into host memory, allocated within the source's
budget (a damaged or crafted record cannot make it allocate more than is stored); a cast converted
slab by slab as it is read, so no second copy of the state is held; and a leaf as restore gives it,
placed into the target's sharding (only the boxes this process's devices hold), onto a device, or as
numpy. Which leaves a restore reads, the target check and how many reads are in flight belong to
engine/restore.py; opening, validation and the byte layout belong to the sources.
"""

from __future__ import annotations

import copy
import math
import threading
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence, cast

import numpy as np

from flax_ckpt._src.checks import tiling_problem
from flax_ckpt._src.engine.fit import cast_into
from flax_ckpt._src.engine.leaves import CheckpointInfo, python_scalar_kinds
from flax_ckpt._src.errors import CheckpointError, CorruptCheckpointError, TargetMismatchError, format_list
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.serializers import Box, box_of

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

_ALIGN = 64  # restored host buffers start on this boundary (see aligned_empty)
_CAST_SLAB = 8 << 20  # a cast reads at most this many saved bytes at a time (or one row of its first axis)


class Source(Protocol):
    """One opened checkpoint, whatever its layout. ``url``: the checkpoint; ``where``: the file its
    records come from (both for messages); ``hint``: a sentence a structure error adds. ``budget``:
    bytes a restore may allocate (the bytes the checkpoint stores, with slack: a damaged or crafted
    record cannot make it allocate more), or None where no bound is known. ``remote``: every read is a
    request round trip (object stores, tensorstore drivers): leaves are read concurrently."""

    @property
    def url(self) -> str: ...

    @property
    def where(self) -> str: ...

    @property
    def hint(self) -> str: ...

    @property
    def leaves(self) -> Sequence[LeafRecord]: ...

    @property
    def remote(self) -> bool: ...

    @property
    def budget(self) -> int | None: ...

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        """Fills ``out`` (the extents of ``box``, the leaf's dtype) with verified bytes. ``box``: any box
        within the leaf (a cast reads a leaf in slabs of rows along its first axis)."""
        ...

    def read_many(self, requests: Sequence[tuple[LeafRecord, Box, np.ndarray]]) -> None:
        """``read`` for many boxes at once; a source may batch them (one read per file region)."""
        ...

    def view(self, leaf: LeafRecord, box: Box) -> np.ndarray | None:
        """The box as a verified read-only array over bytes never written again, or None."""
        ...

    def info(self) -> CheckpointInfo:
        """The checkpoint's CheckpointInfo (fc.metadata's answer), from its records alone."""
        ...

    def select(self, target: Any) -> "tuple[Source, Any]":
        """The part of this checkpoint ``target`` asks for, and the target to check against it: the
        source itself for most layouts; for an Orbax step of named items, only the items the target (a
        dict keyed by item names) names. Raises a TargetMismatchError naming what the source holds."""
        ...

    def unchecked(self) -> list[str]:
        """The leaves (key paths) whose stored bytes carry no checksum, so that reading them back proves
        nothing (a verify reports them as unverified); [] where every byte is checksummed."""
        ...

    def verify(self, update: Callable[[int], None]) -> "list[Damage]":
        """Re-reads every stored byte of every array leaf, checking every checksum, and returns the
        damage found ([]: none). ``update(n)``: called as each ``n`` bytes of leaves are read (a
        progress bar's). ``read_back`` is the verify of a source read leaf by leaf."""
        ...


class Damage(NamedTuple):
    """One damaged part of a checkpoint, as ``Source.verify`` finds it: ``leaf`` (key path) and ``file``
    (relative to the checkpoint folder) where known, and what is wrong."""

    leaf: str | None
    file: str | None
    message: str


def read_back(source: Source, update: Callable[[int], None]) -> list[Damage]:
    """``Source.verify`` of a source read leaf by leaf: reads every array leaf back through a Reader
    (within the source's budget), one at a time, so that each damaged leaf is named."""
    reader, found = Reader(source), []
    for leaf in source.leaves:
        if not leaf.is_array:
            continue
        try:
            reader.host(leaf)
        except (CheckpointError, OSError, ValueError) as e:
            found.append(Damage(leaf.name, None, str(e)))
        update(leaf.nbytes)
    return found


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-ordered array whose data starts on a 64-byte boundary: jax.device_put onto a
    CPU device then uses the buffer as is instead of copying it (XLA copies unaligned host buffers)."""
    n = math.prod(shape) * dtype.itemsize
    if n < _ALIGN:  # one object, not a view of a larger buffer: a tree of 10^6 small leaves holds them all
        return np.empty(shape, dtype)
    raw = np.empty(n + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off : off + n].view(dtype).reshape(shape)


class Pending:
    """A leaf whose host array waits for the batched jax.device_put (engine/restore.py's read_all)."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


class Reader:
    """Reads leaves of one source: ``host`` (a box into numpy), ``value`` (a leaf as restore gives it),
    with allocation bounded by the source's budget. ``prefetch`` reads many boxes in one batch first.
    ``casts``: the dtype to convert some leaves to (by saved key path), slab by slab as they are read
    (``_cast``): the leaf's buffer is allocated once, in the target's dtype."""

    def __init__(self, source: Source, casts: dict[str, np.dtype] | None = None):
        self.source = source
        self._casts = casts or {}
        self._budget: int | None | bool = False  # False: not asked yet (a local source walks its folder)
        self._mutex = threading.Lock()
        self._ready: dict[tuple[str, Box], np.ndarray] = {}  # prefetched boxes
        self._boxes: dict[tuple[Any, tuple[int, ...]], tuple[dict[Any, Box], Box | None]] = {}

    def host(self, leaf: LeafRecord, box: Box | None = None, *, device: bool = False) -> np.ndarray:
        """A box of a leaf in host memory. ``device``: it only goes on to jax.device_put, so a verified
        read-only view of bytes the source holds in memory will do (``Source.view``), where one exists."""
        box = box or tuple((0, d) for d in leaf.array_shape)
        ready = self._ready.pop((leaf.name, box), None)
        if ready is not None:
            return ready
        dtype = self._casts.get(leaf.name)
        if dtype is not None:
            out = self._allocate(leaf, box, dtype)
            for slab in slabs(box, leaf.array_dtype.itemsize):
                self._cast(leaf, slab, out[local_rows(slab, box)])
            return out
        if device:
            v = self.source.view(leaf, box)
            if v is not None:
                return v
        out = self._allocate(leaf, box)
        self.source.read(leaf, box, out)
        return out

    def _allocate(self, leaf: LeafRecord, box: Box, dtype: np.dtype | None = None) -> np.ndarray:
        """An uninitialized buffer for a box (of ``dtype``, default the leaf's), within the budget (the
        saved bytes it holds); the source's read must fill all of it (native chunks and memory-copy
        shards are checked to tile it exactly: checks.tiling_problem)."""
        extents = tuple(e - s for s, e in box)
        saved = leaf.dtype  # per leaf: an attribute, not array_dtype's property call
        assert saved is not None, f"{leaf.name}: a {leaf.kind} leaf has no dtype"
        nbytes = math.prod(extents) * saved.itemsize
        self._reserve(nbytes, leaf)
        try:
            return aligned_empty(extents, dtype or saved)
        except MemoryError:
            raise CheckpointError(
                f"{self.source.where} leaf {leaf.name!r}: cannot allocate {nbytes} bytes to "
                "restore it (out of memory); restore on a machine with more memory, or a "
                "sub-tree with partial=True"
            ) from None

    def _cast(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        """Reads ``box`` into a buffer of the saved dtype and converts it into ``out`` (fit.cast_into)."""
        tmp = np.empty(tuple(e - s for s, e in box), leaf.array_dtype)
        self.source.read(leaf, box, tmp)
        cast_into(tmp, out, leaf.name, self.source.where)

    def prefetch(self, wanted: Sequence[tuple[LeafRecord, Box]]) -> None:
        """Reads these boxes in one batch (``Source.read_many``); ``host`` then hands them out. Boxes to
        cast are read in batches of at most _CAST_SLAB saved bytes, each converted as its batch lands."""
        requests = []
        batch: list[tuple[LeafRecord, Box, np.ndarray]] = []
        held = 0  # saved bytes of the boxes in batch
        for leaf, box in wanted:
            dtype = self._casts.get(leaf.name)
            if dtype is not None:
                batch.append((leaf, box, self._allocate(leaf, box, dtype)))
                held += batch[-1][2].size * leaf.array_dtype.itemsize
                if held >= _CAST_SLAB:
                    self._prefetch_cast(batch)
                    batch, held = [], 0
                continue
            v = self.source.view(leaf, box)
            if v is not None:
                self._ready[(leaf.name, box)] = v
            else:
                requests.append((leaf, box, self._allocate(leaf, box)))
        self._prefetch_cast(batch)
        self.source.read_many(requests)
        self._ready.update({(leaf.name, box): out for leaf, box, out in requests})

    def _prefetch_cast(self, batch: list[tuple[LeafRecord, Box, np.ndarray]]) -> None:
        if not batch:
            return
        tmps = [(leaf, box, np.empty(out.shape, leaf.array_dtype)) for leaf, box, out in batch]
        self.source.read_many(tmps)
        for (leaf, box, out), (_, _, tmp) in zip(batch, tmps):
            cast_into(tmp, out, leaf.name, self.source.where)
            self._ready[(leaf.name, box)] = out

    def _reserve(self, nbytes: int, leaf: LeafRecord) -> None:
        """Memory stays bounded by what is stored: a restore allocates at most the source's budget,
        whatever its records claim."""
        with self._mutex:
            if self._budget is False:
                self._budget = self.source.budget
            if self._budget is not None and nbytes > self._budget:
                raise CorruptCheckpointError(
                    f"{self.source.where} leaf {leaf.name!r}: needs {nbytes} bytes, more than the checkpoint "
                    "folder can hold; its records claim data that is not there (damaged or crafted); "
                    "nothing was allocated"
                )
            if self._budget is not None:
                self._budget -= nbytes

    def _device_boxes(
        self, leaf: LeafRecord, sharding: jax.sharding.Sharding
    ) -> tuple[dict[Any, Box], Box | None]:
        """Each local device's box, and the one box to read for all of them when they tile one bounding
        box (the usual case: no stored byte is then read twice), else None (read each box). Computed
        once per sharding and shape (a large tree has many leaves of few layouts)."""
        key = (sharding, leaf.array_shape)
        found = self._boxes.get(key)
        if found is None:
            try:
                found = self._boxes[key] = self._layout(leaf.array_shape, sharding)
            except (
                ValueError
            ) as e:  # jax: a dimension the mesh does not divide (e.g. 48 rows over 5 processes)
                raise TargetMismatchError(
                    f"restore of {leaf.name!r} from {self.source.where}: the saved shape {list(leaf.array_shape)} "
                    f"cannot be laid out as the target's sharding {sharding} asks, over {jax.process_count()} "
                    f"process(es) and {_device_count(sharding)} device(s): {e}. Fix: restore with a process "
                    "and device count whose mesh divides the saved shape, or pass shardings= (e.g. a "
                    "replicated or another mesh axis) for this leaf"
                ) from None
        return found

    @staticmethod
    def _layout(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[dict[Any, Box], Box | None]:
        boxes = {}
        for dev, index in sharding.addressable_devices_indices_map(shape).items():
            assert index is not None, f"the addressable device {dev} holds a part of the array"
            boxes[dev] = box_of(index, shape)
        unique = set(boxes.values())
        if len(unique) == 1:
            return boxes, next(iter(unique))
        bbox = tuple((min(b[d][0] for b in unique), max(b[d][1] for b in unique)) for d in range(len(shape)))
        if tiling_problem(list(unique), bbox) is None:
            return boxes, bbox
        return boxes, None

    def host_box(self, leaf: LeafRecord, target: Any, sharding: Any) -> Box | None:
        """The one box ``value`` reads of an array leaf for ``target``/``sharding`` (None: several)."""
        shape = leaf.shape  # per leaf: an attribute, not array_shape's property call
        assert shape is not None, f"{leaf.name}: a {leaf.kind} leaf has no shape"
        if leaf.python or python_scalar_kinds(target) is not None or leaf.kind == "prng_key":
            return tuple((0, d) for d in shape)
        sharding = sharding or placement_of(target)
        if sharding is None:
            return tuple((0, d) for d in shape)
        return self._device_boxes(leaf, sharding)[1]

    def sharded(self, leaf: LeafRecord, sharding: jax.sharding.Sharding, puts: list | None = None) -> Any:
        """Reads only the boxes this process's devices hold (see _device_boxes). A sharding of this
        process's devices alone is placed with one jax.device_put of the array (several times cheaper
        than a device_put per device); one spanning processes gets its local shards one by one."""
        boxes, whole = self._device_boxes(leaf, sharding)
        unique = set(boxes.values())
        if whole is not None and sharding.is_fully_addressable:  # then ``whole`` is the whole array:
            return self._put(self.host(leaf, whole, device=True), sharding, puts)  # jax slices it per device
        if whole is not None:
            arr = self.host(leaf, whole, device=True)
            cache = {b: arr[tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(b, whole))] for b in unique}
        else:
            cache = {b: self.host(leaf, b, device=True) for b in unique}
        arrays = [jax.device_put(cache[box], dev) for dev, box in boxes.items()]
        return jax.make_array_from_single_device_arrays(leaf.array_shape, sharding, arrays)

    @staticmethod
    def _put(host: np.ndarray, sharding: Any, puts: list | None) -> Any:
        if puts is None:
            return jax.device_put(host, sharding)
        puts.append((host, sharding))
        return Pending(len(puts) - 1)

    def value(self, leaf: LeafRecord, target: Any, sharding: Any, puts: list | None = None) -> Any:
        """The leaf as restore gives it for ``target`` (None: no target) and ``sharding``. The target's
        leaf type is kept: a Python scalar target gets a Python scalar of its type (whatever 0-d array
        was saved), a weak-typed 0-d jax target a weak-typed array (as jit gives a Python scalar), an
        uncommitted target an uncommitted array (placement_of), so that jit compiles nothing new.
        ``puts``: a list collecting (host array, sharding) placements for one batched jax.device_put,
        returning Pending markers for them (engine/restore.py's read_all)."""
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
            # wrap_key_data takes a numpy array as well (its stub says jax.Array): no copy made here
            key = jax.random.wrap_key_data(cast("jax.Array", data), impl=leaf.key_impl)
            sharding = sharding or placement_of(target)
            return jax.device_put(key, sharding) if sharding is not None else key
        if leaf.python and target is None:
            return self.host(leaf)[()].item()  # a Python number stored as a 0-d array
        if python_scalar_kinds(target) is not None:  # e.g. TrainState.create's step=0: a Python int back
            return type(target)(self.host(leaf)[()].item())
        sharding = sharding or placement_of(target)
        if getattr(target, "weak_type", False) and leaf.shape == ():
            weak = weak_scalar(self.host(leaf), sharding)
            if weak is not None:
                return weak
        if sharding is None:
            if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
                return self._put(self.host(leaf, device=True), None, puts)
            arr = self.host(leaf)
            return arr[()] if isinstance(target, np.generic) else arr
        return self.sharded(leaf, sharding, puts)


def slabs(box: Box, itemsize: int, limit: int | None = None) -> list[Box]:
    """``box`` cut along its first axis into slabs of at most ``limit`` bytes (default _CAST_SLAB), at
    least one row each."""
    if not box:
        return [box]
    limit = _CAST_SLAB if limit is None else limit
    row = math.prod(e - s for s, e in box[1:]) * itemsize
    step = max(1, limit // row) if row else box[0][1] - box[0][0] or 1
    (lo, hi), rest = box[0], box[1:]
    return [((a, min(a + step, hi)),) + rest for a in range(lo, hi, step)] or [box]


def local_rows(slab: Box, box: Box) -> tuple[slice | EllipsisType, ...]:
    """Where ``slab`` (rows of ``box``) lies in an array holding ``box``."""
    return (slice(slab[0][0] - box[0][0], slab[0][1] - box[0][0]),) if box else (Ellipsis,)


def placement_of(target: Any) -> Any:
    """Where a target leaf asks its restored array to be: its sharding; None for an uncommitted jax.Array
    (one jax put on the default device by itself, as a fresh TrainState.create's and jit's outputs
    from them are: restored committed, the next jitted step would compile again) and for anything
    without a sharding."""
    if isinstance(target, jax.Array) and not target.committed:
        return None
    return getattr(target, "sharding", None)


def _device_count(sharding: Any) -> str:
    """How many devices a sharding spans, as a message says it (an abstract mesh has no devices)."""
    try:
        return str(len(sharding.device_set))
    except (ValueError, AttributeError):
        return "an abstract mesh's"


def placements(
    what: str, names: Sequence[str], targets: Sequence[Any], overrides: dict[str, Any]
) -> list[Any]:
    """Where restore places each leaf: its ``overrides`` entry (shardings=, by key path) or the target
    leaf's own placement (placement_of), a sharding over an abstract mesh (what jax.eval_shape and
    nnx.eval_shape give under jax.set_mesh) made concrete by the mesh in context of the same axes.
    Raises TargetMismatchError naming every leaf whose abstract mesh no mesh in context matches."""
    out, unplaced, made = [], [], {}
    for name, target in zip(names, targets):
        sharding = (overrides.get(name) if overrides else None) or placement_of(target)
        if sharding is not None and isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
            if sharding not in made:
                made[sharding] = _concrete(sharding)
            if made[sharding] is None:
                unplaced.append(name)
            sharding = made[sharding]
        out.append(sharding)
    if unplaced:
        raise TargetMismatchError(_unplaced(what, unplaced, [s for s in made if made[s] is None][0]))
    return out


def _concrete(sharding: Any) -> Any:
    """A NamedSharding over an abstract mesh on the mesh in context with the same axes, or None."""
    mesh = jax.sharding.get_mesh()
    if mesh.empty or mesh.shape_tuple != sharding.mesh.shape_tuple:
        return None
    return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _unplaced(what: str, names: list[str], sharding: Any) -> str:
    mesh = jax.sharding.get_mesh()
    found = (
        "no mesh is in context" if mesh.empty else f"the mesh in context has other axes ({mesh.shape_tuple})"
    )
    return (
        f"restore of {what}: {len(names)} leaves are placed over an abstract mesh "
        f"({sharding.mesh.shape_tuple}), as jax.eval_shape and nnx.eval_shape give under jax.set_mesh, "
        f"and {found}: {format_list(names)}. Nothing was read. Fix: restore inside "
        "`with jax.set_mesh(mesh):` with the mesh the target was built with, or pass shardings= "
        "(shardings on devices) for these leaves."
    )


def weak_scalar(value: np.ndarray, sharding: Any) -> jax.Array | None:
    """A weak-typed 0-d jax array holding exactly the bits of ``value`` (jax makes one of a Python
    number), placed by ``sharding``; None where no Python number gives that dtype and those bits
    (e.g. int8, bfloat16, a NaN payload a float64 round trip would change)."""
    out = jax.device_put(value[()].item(), sharding)
    if out.dtype != value.dtype or np.asarray(out).tobytes() != value.tobytes():
        return None
    return out


__all__ = [
    "Damage",
    "Pending",
    "Reader",
    "Source",
    "aligned_empty",
    "local_rows",
    "placement_of",
    "placements",
    "read_back",
    "slabs",
    "weak_scalar",
]
