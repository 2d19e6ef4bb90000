"""What a target that differs from its checkpoint most likely is, and its fix: the common patterns.

Scope: pure functions from key paths and shapes to the sentences a restore's mismatch errors add after
their list of leaves (engine/leaves.py raises the errors): a target nested under another prefix, or
with NNX's ``/value`` after every key path (an ``nnx.State`` against a pure dict), a state saved
replicated by pmap (a leading device axis on every leaf) restored unreplicated, or the other way round,
and new layers under saved names (``new_layers_fix``).
No I/O, no jax.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Sequence

_VALUE = "/value"  # what an nnx.State adds after each Variable's key path (nnx.to_pure_dict drops it)


class _Side(NamedTuple):
    """How one side's key paths (the target's or the checkpoint's) differ from the other's: a prefix
    before each ('' if none) and whether each ends in '/value'."""

    prefix: str
    value: bool


def structure_diagnosis(missing: Sequence[str], unexpected: Sequence[str]) -> str | None:
    """For key paths in the target alone (``missing``) and in the checkpoint alone (``unexpected``),
    the diagnosis and fix when one prefix and/or a '/value' suffix maps every one onto the other
    side's; else None."""
    if not missing or len(missing) != len(unexpected):
        return None
    for target_value, ckpt_value in ((False, False), (True, False), (False, True)):
        t = _strip(missing, target_value)
        c = _strip(unexpected, ckpt_value)
        if t is None or c is None:
            continue
        sides = _prefixes(t, c)
        if sides is not None:
            target, ckpt = _Side(sides[0], target_value), _Side(sides[1], ckpt_value)
            return _explain(target, ckpt)
    return None


def _strip(names: Sequence[str], value: bool) -> list[str] | None:
    if not value:
        return list(names)
    if not all(n.endswith(_VALUE) and len(n) > len(_VALUE) for n in names):
        return None
    return [n[: -len(_VALUE)] for n in names]


def _prefixes(t: list[str], c: list[str]) -> tuple[str, str] | None:
    """('', '') when both sides name the same paths; (p, '') when the target's are 'p/' + the
    checkpoint's; ('', p) the other way round; else None."""
    tset, cset = set(t), set(c)
    if tset == cset:
        return ("", "")
    for longer, shorter, flip in ((tset, c, False), (cset, t, True)):
        first = shorter[0]
        candidates = [name[: -len(first) - 1] for name in longer if name.endswith("/" + first)]
        for p in candidates[:_TRIES]:
            if {f"{p}/{n}" for n in shorter} == longer:
                return ("", p) if flip else (p, "")
    return None


_TRIES = 4  # prefixes tried (each a pass over the names): a few, so a large mismatch stays linear


def _explain(target: _Side, ckpt: _Side) -> str:
    what = []
    if target.prefix:
        what.append(f"the target nests every leaf under '{target.prefix}/' where the checkpoint does not")
    if ckpt.prefix:
        what.append(f"the checkpoint nests every leaf under '{ckpt.prefix}/' where the target does not")
    if target.value:
        what.append(
            "the target's key paths end in '/value' (an nnx.State) where the checkpoint's do not (a "
            "pure dict, as nnx.to_pure_dict gives)"
        )
    if ckpt.value:
        what.append(
            "the checkpoint's key paths end in '/value' (a saved nnx.State) where the target's do "
            "not (a pure dict)"
        )
    fixes = []
    if target.value:
        fixes.append(
            "restore into nnx.to_pure_dict(state) and put the result back with "
            "nnx.replace_by_pure_dict(state, restored)"
        )
    if ckpt.value:
        fixes.append("restore into an nnx.State (nnx.state(model)) and convert it with nnx.to_pure_dict")
    if target.prefix and not ckpt.value:
        fixes.append(f"restore into the sub-tree under '{target.prefix}' alone")
    if ckpt.prefix and not target.value:
        fixes.append(f"nest the target under '{ckpt.prefix}' as the checkpoint does")
    src = (
        re.escape(f"{ckpt.prefix}/" if ckpt.prefix else "")
        + "(.*)"
        + (re.escape(_VALUE) if ckpt.value else "")
    )
    dst = (target.prefix + "/" if target.prefix else "") + r"\1" + (_VALUE if target.value else "")
    fixes.append(f"pass rename={{{src!r}: {dst!r}}}")
    return "Diagnosis: " + "; ".join(what) + ". Fix: " + ", or ".join(fixes) + "."


def replicated_diagnosis(shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """For the (target shape, saved shape) of every mismatched leaf, the diagnosis and fix when all
    differ by one leading axis of the same size k (pmap's replicated state on k devices), on one
    side; else None."""
    if not shapes:
        return None
    for saved_side in (True, False):
        longer = [s if saved_side else t for t, s in shapes]
        shorter = [t if saved_side else s for t, s in shapes]
        if all(len(a) == len(b) + 1 and a[1:] == b for a, b in zip(longer, shorter)):
            sizes = {a[0] for a in longer}
            if len(sizes) == 1:
                return _replicated(sizes.pop(), saved_side)
    return None


def _replicated(k: int, saved_side: bool) -> str:
    if saved_side:
        return (
            f"Diagnosis: every leaf differs only by a leading axis of {k}: the checkpoint holds a state "
            f"replicated by pmap over {k} device(s), saved without unreplicating it. Fix: restore it "
            f"with the replicated target (a leading axis of {k} on every leaf: "
            f"flax.jax_utils.replicate(state) on {k} device(s), or "
            f"jax.ShapeDtypeStruct(({k},) + x.shape, x.dtype) per leaf) and unreplicate the result "
            "(flax.jax_utils.unreplicate), or from now on save flax.jax_utils.unreplicate(state)."
        )
    return (
        f"Diagnosis: every leaf of the target differs only by a leading axis of {k}: the target is a "
        "state replicated by pmap, the checkpoint is not. Fix: restore into the unreplicated state and "
        "replicate the result (flax.jax_utils.replicate(restored))."
    )


__all__ = ["replicated_diagnosis", "structure_diagnosis"]


def new_layers_fix(names: Sequence[str], keep: bool) -> str:
    """The fix for saved leaves ``names`` whose shapes differ from the target's, as a new layer under a
    saved name makes them (a new head of another width): leave the saved ones out with a ``rename=``
    rule that matches exactly them (or every leaf under their common folder, past three), and keep the
    target's own with ``missing="keep"``. ``keep``: ``missing="keep"`` was passed already, and kept
    nothing here, since the checkpoint has these leaves."""
    if len(names) <= 3:
        pattern = "|".join(re.escape(n) for n in names)
    else:
        parts = [n.split("/") for n in names]
        common = [p[0] for p in zip(*parts) if len(set(p)) == 1][: min(len(p) for p in parts) - 1]
        head = "/".join(common)
        pattern = f"{re.escape(head)}/.*" if head else "|".join(re.escape(n) for n in names)
    rule = f'r"{pattern}"' if '"' not in pattern else repr(pattern)
    if keep:
        return (
            'Fix: missing="keep" keeps only the target leaves the checkpoint lacks, and it has these, saved '
            "with other shapes. For a new layer under a saved name (a new head), leave the saved ones out: "
            f'rename={{{rule}: None}} beside missing="keep" keeps the target\'s own. Otherwise build the '
            "target with the config it was saved with (fc.metadata(path).tree shows every saved shape)."
        )
    return (
        "Fix: shapes differ, so this checkpoint is from another model or config: build the target with the "
        "config it was saved with (fc.metadata(path).tree shows every saved shape and dtype), or restore "
        "only the leaves that fit: for a new layer under a saved name (a new head), leave the saved ones "
        f'out and keep the target\'s own with rename={{{rule}: None}}, missing="keep"; for leaves saved '
        'but not in the target, unexpected="ignore" (partial=True).'
    )
