"""An ``nnx.Variable`` that several parts of a state reach is stored once, and restored shared.

Scope: the ``nnx.State`` objects that ``to_tree`` makes of a state's nnx parts, as one list in the
order jax flattens the state (a dict's keys sorted). flax 0.12's ``nnx.ModelAndOptimizer`` holds its
model, so ``{"model": model, "optimizer": optimizer}`` reaches each of the model's Variables twice:
as ``model/...`` and as ``optimizer/model/...``. As ``nnx.split`` does within one object, a Variable
is stored once, under the first key path that reaches it, and left out of the later parts. Restoring
in place writes its value into that one Variable object, which every part holds, so the parts stay
shared, as they were when saved.

Only Variables that are the same object count (flax 0.12's ``nnx.state`` gives a model's own
Variables; the copies older versions give are stored as they are). Arrays are never merged: a plain
pytree that holds one array twice stores it twice and restores two leaves, as any pytree. What does
not belong here: anything about the checkpoint's files.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax

PathParts = tuple[Any, ...]


def _flat(state: Any) -> list[tuple[PathParts, Any]]:
    """``(path parts, leaf)`` of an ``nnx.State``, a Variable counting as one leaf."""
    nnx = sys.modules["flax.nnx"]
    to_flat = getattr(nnx, "to_flat_state", None)
    flat = to_flat(state) if to_flat is not None else state.flat_state()
    return list(flat.items() if isinstance(flat, Mapping) else flat)


def _from_flat(state: Any, items: list[tuple[PathParts, Any]]) -> Any:
    """An ``nnx.State`` of ``items``, of ``state``'s class."""
    nnx = sys.modules["flax.nnx"]
    from_flat = getattr(nnx, "from_flat_state", None)
    if from_flat is not None:
        return from_flat(items, cls=type(state))
    return type(state).from_flat_path(dict(items))


def once_each(parts: list[Any], stored: Callable[[int, PathParts], bool] | None = None) -> list[Any]:
    """``parts`` with each ``nnx.State`` in it less the ``nnx.Variable`` objects an earlier State holds.

    Args:
      parts: the flattened parts of a state, ``nnx.State`` objects among other leaves (left as they are).
      stored: for a restore target, whether the checkpoint holds part ``i``'s Variable at ``path``
        (one that an earlier version stored twice): such a Variable is kept, and restored twice, with
        the same value.

    Returns:
      The list, each State with nothing dropped being the same object as given.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return parts
    seen: dict[int, Any] = {}  # id -> the Variable itself, alive while its id is compared
    out = []
    for i, part in enumerate(parts):
        if not isinstance(part, nnx.State):
            out.append(part)
            continue
        leaves = jax.tree_util.tree_leaves(part, is_leaf=lambda x: isinstance(x, nnx.Variable))
        variables = [v for v in leaves if isinstance(v, nnx.Variable)]
        if any(id(v) in seen for v in variables):
            kept = [
                (path, leaf)
                for path, leaf in _flat(part)
                if id(leaf) not in seen or not isinstance(leaf, nnx.Variable) or (stored and stored(i, path))
            ]
            part = _from_flat(part, kept)
        seen.update((id(v), v) for v in variables)
        out.append(part)
    return out


def holds(node: Any, path: tuple[Any, ...]) -> bool:
    """Whether ``node`` (a sub-tree of ``fc.CheckpointInfo.tree``) has something at ``path`` (nnx path
    parts: strings and ints)."""
    for k in path:
        if isinstance(node, dict) and (k in node or str(k) in node):
            node = node[k if k in node else str(k)]
        elif isinstance(node, list) and isinstance(k, int) and 0 <= k < len(node):
            node = node[k]
        else:
            return False
    return True
