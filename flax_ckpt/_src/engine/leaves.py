"""What a checkpoint holds, leaf by leaf, against what a restore asks for.

Scope: the one target check of every layout (native steps, Orbax items, memory-tier copies): a
restore target's structure and leaves against the saved ``LeafRecord``s, every mismatch collected
into one error that names the key path, what was expected and what was found; the public
descriptions ``LeafInfo`` and ``CheckpointInfo`` (``fc.metadata``); and the one probe of PRNG key
implementations. No I/O.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.engine.diagnose import new_layers_fix, replicated_diagnosis, structure_diagnosis
from flax_ckpt._src.engine.fit import Fit, RestoreReport, cast_problem, renamed
from flax_ckpt._src.errors import (
    AbstractTargetLeafError,
    LeafMismatchError,
    StructureMismatchError,
    format_list,
)
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.records import LeafRecord

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)


_SHOWN = 20  # leaves an error lists, then a count of the rest


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
        return (
            f"key<{jax.random.key_impl(t) if isinstance(t, jax.Array) else t.dtype}>{list(t.shape)}".replace(
                " ", ""
            )
        )
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
        return (
            kind == "prng_key"
            and (impl is None or impl == leaf.key_impl)
            and tuple(t.shape) == leaf.logical_shape
        )
    if hasattr(t, "shape") and hasattr(t, "dtype"):
        return kind in ("jax", "numpy") and np.dtype(t.dtype) == leaf.dtype and tuple(t.shape) == leaf.shape
    scalar_kinds = python_scalar_kinds(t)
    if scalar_kinds is not None:
        if kind in (
            "jax",
            "numpy",
        ):  # e.g. TrainState.create's step=0 against the int32 array a jitted step saved
            return leaf.shape == () and leaf.dtype is not None and leaf.dtype.kind in scalar_kinds
        return kind == "scalar" and type(leaf.value) is type(t)
    if isinstance(t, str):
        return kind == "string"
    return False


class Fitted(NamedTuple):
    """A target checked against a checkpoint: per target leaf the saved record restored into it (None:
    the target's own value is kept), the target dtype of every leaf read with a cast (by saved key
    path), and the report."""

    chosen: list[LeafRecord | None]
    casts: dict[str, np.dtype]
    report: RestoreReport


def fit_target(
    saved: Sequence[LeafRecord],
    flat: Sequence[tuple[tree_mod.KeyPath, Any]],
    fit: Fit,
    *,
    what: str,
    where: str,
    hint: str = "",
    warn: bool = True,
) -> Fitted:
    """The saved leaf of every target leaf (in target order), matched by key path after ``fit``'s
    rename; raises StructureMismatchError (key paths on one side only, unless ``fit`` lets them be),
    AbstractTargetLeafError (a leaf to keep that has no value) or LeafMismatchError (every leaf whose
    shape, dtype or kind differs, dtypes only where ``fit`` does not cast them). ``what``: the checkpoint
    as the structure error names it; ``where``: the file the leaf error names; ``hint``: a sentence
    added to a structure error. Every message names a renamed leaf by both its key paths."""
    ren = renamed(saved, fit, what, warn=warn)
    names = [tree_mod.keystr(p) for p, _ in flat]
    missing = [n for n in names if n not in ren.by_name]
    unexpected: list[str] = []
    if len(ren.by_name) != len(names) - len(missing):
        wanted = set(names)
        unexpected = [n for n in ren.by_name if n not in wanted]
    _check_structure(
        missing if fit.missing == "error" else [],
        unexpected if fit.unexpected == "error" else [],
        ren.origin,
        what,
        where,
        hint,
    )
    by_target = dict(zip(names, (t for _, t in flat)))
    if missing:
        _check_kept(missing, by_target, what, ren.origin)
    chosen = [ren.by_name.get(n) for n in names]
    casts: dict[str, np.dtype] = {}
    bad = []
    for n, (_, t), leaf in zip(names, flat, chosen):
        if leaf is None or compatible(t, leaf):
            continue
        problem = castable(t, leaf) if fit.cast else ""
        if problem is None:
            casts[leaf.name] = np.dtype(t.dtype)
            continue
        bad.append(
            f"{_named(n, ren.origin)}: expected {describe_target(t)} (target), found {leaf.describe()}"
            + (f" ({problem})" if problem else "")
        )
    if bad:
        shown = "; ".join(bad[:_SHOWN]) + (f"; ... ({len(bad) - _SHOWN} more)" if len(bad) > _SHOWN else "")
        raise LeafMismatchError(
            f"restore of {len(bad)} leaves does not match the target: {shown} in "
            f"{where}. " + _mismatch_fix(flat, chosen, fit.cast, keep=fit.missing == "keep")
        )
    report = RestoreReport(
        restored=tuple(n for n, leaf in zip(names, chosen) if leaf is not None),
        kept=tuple(missing),
        ignored=_in_order(saved, set(ren.dropped) | {ren.by_name[n].name for n in unexpected}),
        renamed=tuple(
            (ren.origin[n], n) for n, leaf in zip(names, chosen) if leaf is not None and n in ren.origin
        ),
        cast=tuple(n for n, leaf in zip(names, chosen) if leaf is not None and leaf.name in casts),
        dropped=_in_order(saved, set(ren.dropped)),
    )
    return Fitted(chosen, casts, report)


def _in_order(saved: Sequence[LeafRecord], names: set[str]) -> tuple[str, ...]:
    return tuple(leaf.name for leaf in saved if leaf.name in names) if names else ()


def match_target(
    saved: Sequence[LeafRecord],
    flat: Sequence[tuple[tree_mod.KeyPath, Any]],
    *,
    partial: bool,
    what: str,
    where: str,
    hint: str = "",
) -> list[LeafRecord]:
    """fit_target without rename, keep or cast: the saved leaf of every target leaf (``partial``: the
    checkpoint may hold more)."""
    chosen = fit_target(saved, flat, Fit.of(partial=partial), what=what, where=where, hint=hint).chosen
    return typing.cast(
        list[LeafRecord], chosen
    )  # no None: without missing="keep" every target leaf has a match


def _named(name: str, origin: dict[str, str]) -> str:
    """A target key path as messages show it: 'backbone/x' (renamed from 'encoder/x')."""
    return f"{name!r} (renamed from {origin[name]!r})" if name in origin else repr(name)


def _check_structure(
    missing: list[str], unexpected: list[str], origin: dict[str, str], what: str, where: str, hint: str
) -> None:
    if not (missing or unexpected):
        return
    shown = [_named(n, origin) for n in unexpected]
    diagnosis = None if origin else structure_diagnosis(missing, unexpected)
    if diagnosis is not None:
        raise StructureMismatchError(
            f"restore of {what}: the target's structure differs from the checkpoint's. In the target but not "
            f"the checkpoint: {format_list(missing, _SHOWN)}. In the checkpoint but not the target: "
            f"{format_list(unexpected, _SHOWN)}. {diagnosis} {hint}Checkpoint: {where}"
        )
    raise StructureMismatchError(
        f"restore of {what}: the target's structure differs from the checkpoint's. "
        + (
            f'In the target but not the checkpoint: {format_list(missing, _SHOWN)} (pass missing="keep" to '
            "keep the target's own values there, e.g. the new layers of a larger model). "
            if missing
            else ""
        )
        + (
            f"In the checkpoint but not the target: {', '.join(shown[:_SHOWN])}"
            + (f", ... ({len(shown) - _SHOWN} more)" if len(shown) > _SHOWN else "")
            + ' (pass unexpected="ignore", or partial=True, to restore only the target\'s sub-tree). '
            if unexpected
            else ""
        )
        + (
            "Where they are one model's leaves under other names, map them with rename=. "
            if missing and unexpected
            else ""
        )
        + hint
        + f"Checkpoint: {where}"
    )


def is_abstract(t: Any) -> str | None:
    """Why target leaf ``t`` holds no value to keep (a jax.ShapeDtypeStruct, a deleted array), or None."""
    if isinstance(t, jax.Array):
        return "a deleted (donated) jax.Array" if t.is_deleted() else None
    if isinstance(t, (np.ndarray, np.generic)) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
        return None
    return f"an abstract {type(t).__name__} {describe_target(t)}"


def _check_kept(missing: list[str], by_target: dict[str, Any], what: str, origin: dict[str, str]) -> None:
    """missing="keep": every target leaf the checkpoint lacks must hold a value to keep."""
    bad = [f"{n!r} ({why})" for n in missing if (why := is_abstract(by_target[n])) is not None]
    if bad:
        raise AbstractTargetLeafError(
            f'restore of {what}: missing="keep" keeps the target\'s own value for a leaf the checkpoint lacks, '
            f"but the target holds none at {len(bad)} of them: "
            + ", ".join(bad[:20])
            + (f", ... ({len(bad) - 20} more)" if len(bad) > 20 else "")
            + ". Nothing was restored. Fix: build the target from an initialized model (model.init(...), "
            "nnx.state(model)) rather than jax.eval_shape, at least for these leaves, or map checkpoint keys "
            "onto them with rename=."
        )


def castable(t: Any, leaf: LeafRecord) -> str | None:
    """Why cast=True does not convert ``leaf`` into target leaf ``t`` (a message's note; "" where the
    mismatch says it), or None: only arrays of one shape are cast, never PRNG keys, Python scalars or
    other leaves; fit.cast_problem is the dtype policy."""
    if (
        leaf.kind not in ("jax", "numpy")
        or leaf.dtype is None
        or tree_mod.is_prng_key(t)
        or python_scalar_kinds(t) is not None
    ):
        return ""
    if not (hasattr(t, "shape") and hasattr(t, "dtype")) or tuple(t.shape) != leaf.shape:
        return ""
    try:
        dst = np.dtype(t.dtype)
    except TypeError:
        return ""
    return cast_problem(leaf.dtype, dst)


def _mismatch_fix(
    flat: Sequence[tuple[tree_mod.KeyPath, Any]],
    chosen: Sequence[LeafRecord | None],
    cast: bool = False,
    *,
    keep: bool = False,
) -> str:
    """The fix a LeafMismatchError suggests, from what differs: shapes (another model or config, or a
    new layer under a saved name), only dtypes (a cast meant on purpose), or kinds. ``keep``: the
    restore passed ``missing="keep"``."""
    pairs = [
        (t, leaf)
        for (_, t), leaf in zip(flat, chosen)
        if leaf is not None and not compatible(t, leaf) and (not cast or castable(t, leaf) is not None)
    ]
    shapes = [
        (_shape_of(t), leaf.logical_shape if leaf.is_array else () if leaf.kind == "scalar" else None)
        for t, leaf in pairs
    ]
    known = [(t, s) for t, s in shapes if t is not None and s is not None]
    if len(known) == len(shapes):
        replicated = replicated_diagnosis(known)
        if replicated is not None:
            return replicated
    arrays = [(t, leaf) for t, leaf in pairs if leaf.is_array and hasattr(t, "shape") and hasattr(t, "dtype")]
    reshaped = [leaf.name for t, leaf in arrays if tuple(t.shape) != leaf.logical_shape]
    if reshaped:
        return new_layers_fix(reshaped, keep)
    if arrays and len(arrays) == len(pairs) and not cast:
        return (
            "Fix: only dtypes differ: if a cast is meant, pass cast=True (each leaf is converted to the "
            "target's dtype as it is read), or restore into a target of the saved dtypes "
            "(fc.metadata(path).tree, or the model built with the saved param_dtype) and cast after, "
            "e.g. jax.tree.map(lambda x: x.astype(jnp.bfloat16), restored)."
        )
    if arrays and len(arrays) == len(pairs):
        return (
            "Fix: restore these into a target of the saved dtypes (fc.metadata(path).tree) and convert "
            "them yourself after."
        )
    return (
        "Fix: the target's leaf types differ from what was saved (fc.metadata(path).tree shows them): "
        "build the target the way the saving run did."
    )


def _shape_of(t: Any) -> tuple[int, ...] | None:
    """A target leaf's shape as a mismatch diagnosis compares it (a Python scalar's: ()), or None."""
    if hasattr(t, "shape") and hasattr(t, "dtype") and not tree_mod.is_prng_key(t):
        return tuple(t.shape)
    return () if python_scalar_kinds(t) is not None else None


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


def checkpoint_info(
    url: str,
    leaves: Sequence[LeafRecord],
    *,
    step: int | None,
    metrics: Any,
    metadata: Any,
    created: float,
    process_count: int,
    serializer: str,
    format: str,
) -> CheckpointInfo:
    infos = {leaf.name: leaf_info(leaf) for leaf in leaves}
    nested = tree_mod.nest((leaf.path, infos[leaf.name]) for leaf in leaves)
    return CheckpointInfo(
        url,
        nested,
        infos,
        step,
        metrics,
        metadata,
        created,
        process_count,
        serializer,
        sum(i.nbytes for i in infos.values()),
        format,
    )


__all__ = [
    "CheckpointInfo",
    "Fitted",
    "LeafInfo",
    "castable",
    "checkpoint_info",
    "compatible",
    "describe_target",
    "fit_target",
    "is_abstract",
    "key_data_shape",
    "leaf_info",
    "match_target",
    "python_scalar_kinds",
]
