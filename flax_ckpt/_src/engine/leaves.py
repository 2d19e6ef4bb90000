"""What a checkpoint holds, leaf by leaf, against what a restore asks for.

Scope: the one target check of every layout (native steps, Orbax items, memory-tier copies): a
restore target's structure and leaves against the saved ``LeafRecord``s, every mismatch collected
into one error that names the key path, what was expected and what was found; the public
descriptions ``LeafInfo`` and ``CheckpointInfo`` (``fc.metadata``); and the one probe of PRNG key
implementations. No I/O.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.errors import LeafMismatchError, StructureMismatchError, format_list
from flax_ckpt._src.records import LeafRecord


@functools.lru_cache(maxsize=64)
def key_data_shape(impl: str) -> tuple[int, ...] | None:
    """The key data shape of one key of PRNG implementation ``impl`` (None: this jax does not know it)."""
    try:
        return tuple(jax.random.key_data(jax.random.key(0, impl=impl)).shape)
    except (ValueError, TypeError, KeyError):
        return None


# ----------------------------------------------------------------------------------------- target

def describe_target(t: Any) -> str:
    """A restore target leaf as error messages show it: float32[4,6], key<threefry2x32>[2], Python int."""
    if tree_mod.is_prng_key(t):
        return f"key<{jax.random.key_impl(t) if isinstance(t, jax.Array) else t.dtype}>{list(t.shape)}".replace(" ", "")
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return f"{np.dtype(t.dtype).name}{list(t.shape)}".replace(" ", "")
    if isinstance(t, (bool, int, float, complex)):
        return f"Python {type(t).__name__}"
    if isinstance(t, str):
        return "str"
    kind = tree_mod.empty_kind(t)
    return {"none": "None", "dict": "{}", "list": "[]", "tuple": "()"}.get(kind or "", type(t).__name__)


def python_scalar_kinds(t: Any) -> str | None:
    """For a Python scalar target, the numpy dtype kinds of the 0-d arrays it restores from."""
    for typ, kinds in ((bool, "b"), (int, "iu"), (float, "f"), (complex, "c")):
        if isinstance(t, typ):
            return kinds
    return None


def compatible(t: Any, leaf: LeafRecord) -> bool:
    """Whether target leaf ``t`` can receive ``leaf`` without a cast."""
    kind = leaf.kind
    if kind == "json":  # an Orbax JSON item is given back as stored, whatever the target says
        return True
    if tree_mod.empty_kind(t) is not None:  # empty containers hold no data: any saved one will do
        return kind == "empty"
    if tree_mod.is_prng_key(t):
        impl = str(jax.random.key_impl(t)) if isinstance(t, jax.Array) else None
        return kind == "prng_key" and (impl is None or impl == leaf.key_impl) and \
            tuple(t.shape) == leaf.logical_shape
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return kind in ("jax", "numpy") and np.dtype(t.dtype) == leaf.dtype and tuple(t.shape) == leaf.shape
    scalar_kinds = python_scalar_kinds(t)
    if scalar_kinds is not None:
        if kind in ("jax", "numpy"):  # e.g. TrainState.create's step=0 against the int32 array a jitted step saved
            return leaf.shape == () and leaf.dtype.kind in scalar_kinds
        return kind == "scalar" and type(leaf.value) is type(t)
    if isinstance(t, str):
        return kind == "string"
    return False


def match_target(saved: Sequence[LeafRecord], flat: Sequence[tuple[tree_mod.KeyPath, Any]], *, partial: bool,
                 what: str, where: str, hint: str = "") -> list[LeafRecord]:
    """The saved leaf of every target leaf (in target order), matched by key path; raises
    StructureMismatchError (key paths on one side only) or LeafMismatchError (every leaf whose shape,
    dtype or kind differs). ``what``: the checkpoint as the structure error names it; ``where``: the
    file the leaf error names; ``hint``: a sentence added to a structure error."""
    by_name = {leaf.name: leaf for leaf in saved}
    names = [tree_mod.keystr(p) for p, _ in flat]
    missing = [n for n in names if n not in by_name]
    unexpected = []
    if not partial and len(by_name) != len(names) - len(missing):
        wanted = set(names)
        unexpected = [n for n in by_name if n not in wanted]
    if missing or unexpected:
        raise StructureMismatchError(
            f"restore of {what}: the target's structure differs from the checkpoint's. "
            + (f"In the target but not the checkpoint: {format_list(missing)}. " if missing else "")
            + (f"In the checkpoint but not the target: {format_list(unexpected)} "
               "(pass partial=True to restore only the target's sub-tree). " if unexpected else "")
            + hint + f"Checkpoint: {where}")
    chosen = [by_name[n] for n in names]
    bad = [f"{n!r}: expected {describe_target(t)} (target), found {leaf.describe()}"
           for n, (_, t), leaf in zip(names, flat, chosen) if not compatible(t, leaf)]
    if bad:
        raise LeafMismatchError(f"restore of {len(bad)} leaves does not match the target: " + "; ".join(bad)
                                + f" in {where}. " + _mismatch_fix(flat, chosen))
    return chosen


def _mismatch_fix(flat: Sequence[tuple[tree_mod.KeyPath, Any]], chosen: Sequence[LeafRecord]) -> str:
    """The fix a LeafMismatchError suggests, from what differs: shapes (another model or config),
    only dtypes (a cast meant on purpose), or kinds."""
    pairs = [(t, leaf) for (_, t), leaf in zip(flat, chosen) if not compatible(t, leaf)]
    arrays = [(t, leaf) for t, leaf in pairs if leaf.is_array and hasattr(t, "shape") and hasattr(t, "dtype")]
    if any(tuple(t.shape) != leaf.logical_shape for t, leaf in arrays):
        return ("Fix: shapes differ, so this checkpoint is from another model or config: build the target "
                "with the config it was saved with (fc.metadata(path).tree shows every saved shape and "
                "dtype), or restore only the leaves that fit: a target without the others, with partial=True.")
    if arrays and len(arrays) == len(pairs):
        return ("Fix: only dtypes differ: if a cast is meant, restore into a target of the saved dtypes "
                "(fc.metadata(path).tree, or the model built with the saved param_dtype) and cast after, "
                "e.g. jax.tree.map(lambda x: x.astype(jnp.bfloat16), restored).")
    return ("Fix: the target's leaf types differ from what was saved (fc.metadata(path).tree shows them): "
            "build the target the way the saving run did.")


# --------------------------------------------------------------------------------------- metadata

@dataclass(frozen=True)
class LeafInfo:
    """What a checkpoint says of one leaf; reads no array bytes."""

    kind: str
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    sharding: dict[str, Any] | None
    nbytes: int

    def __repr__(self) -> str:
        return f"LeafInfo({self.kind}, {self.dtype}{list(self.shape) if self.shape is not None else ''})"


@dataclass(frozen=True)
class CheckpointInfo:
    """fc.metadata(path): the tree of LeafInfo, step, metrics, user metadata; reads no array bytes.
    ``format``: "native" (flax_ckpt's own layout) or "orbax"."""

    path: str
    tree: Any
    leaves: dict[str, LeafInfo]
    step: int | None
    metrics: dict[str, Any] | None
    metadata: Any
    created: float
    process_count: int
    serializer: str
    nbytes: int
    format: str = "native"


def leaf_info(leaf: LeafRecord) -> LeafInfo:
    if not leaf.is_array:
        return LeafInfo(leaf.kind, None, None, None, 0)
    kind = "scalar" if leaf.python else leaf.kind
    return LeafInfo(kind, leaf.logical_shape, leaf.dtype, leaf.sharding, leaf.nbytes)


def checkpoint_info(url: str, leaves: Sequence[LeafRecord], *, step: int | None, metrics: Any, metadata: Any,
                    created: float, process_count: int, serializer: str, format: str) -> CheckpointInfo:
    infos = {leaf.name: leaf_info(leaf) for leaf in leaves}
    nested = tree_mod.nest((leaf.path, infos[leaf.name]) for leaf in leaves)
    return CheckpointInfo(url, nested, infos, step, metrics, metadata, created, process_count, serializer,
                          sum(i.nbytes for i in infos.values()), format)


__all__ = ["CheckpointInfo", "LeafInfo", "checkpoint_info", "compatible", "describe_target", "key_data_shape",
           "leaf_info", "match_target", "python_scalar_kinds"]
