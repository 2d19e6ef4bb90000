"""A pmap loop's replicated state: its first replica for a save, and a restored state replicated back.

Scope: ``CheckpointCallback(replicated=True)``. A ``jax.pmap`` loop keeps one copy of the state per
local device, stacked on a leading axis (``flax.jax_utils.replicate``). Checkpointing that stack would tie
the checkpoint to the device count; ``flax.jax_utils.unreplicate`` at every step costs one dispatch per
leaf. Here the first replica is taken only when the callback saves: device 0's shard of every leaf,
squeezed in one jitted call, so the checkpoint holds the unreplicated state (restorable on any device
count, with or without pmap) and the steps in between cost nothing. Like ``unreplicate``, it assumes the
replicas are equal (a state kept in sync by ``pmean``): the first one is saved.

What does not belong here: when to save, signals, the nnx and iterator leaves (state.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_FIRST = jax.jit(lambda leaves: [x[0] for x in leaves])  # one dispatch for every leaf


def _replicated_leaves(tree: Any) -> tuple[list[Any], list[int], Any]:
    """(leaves, positions of the replicated jax arrays among them, treedef); a ValueError naming a jax
    array leaf without the leading axis of the local devices."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    n, where = jax.local_device_count(), []
    for i, (path, x) in enumerate(with_path):
        if not isinstance(x, jax.Array):
            continue  # Python scalars, numpy arrays, strings: saved as they are
        if x.ndim == 0 or x.shape[0] != n:
            raise ValueError(
                f"CheckpointCallback(replicated=True): leaf {jax.tree_util.keystr(path)} has shape "
                f"{x.shape}, not a leading axis of the {n} local devices (a state replicated for jax.pmap, "
                "e.g. with flax.jax_utils.replicate); pass the replicated state, or drop replicated=True"
            )
        where.append(i)
    return [x for _, x in with_path], where, treedef


def first_replica(tree: Any) -> Any:
    """``tree`` with each replicated jax array leaf replaced by its first replica, on the first device."""
    leaves, where, treedef = _replicated_leaves(tree)
    shards = [leaves[i].addressable_data(0) for i in where]
    squeeze = [s for s, i in zip(shards, where) if s.ndim == leaves[i].ndim]  # older jax: already squeezed
    squeezed = iter(_FIRST(squeeze)) if squeeze else iter(())
    for s, i in zip(shards, where):
        leaves[i] = next(squeezed) if s.ndim == leaves[i].ndim else s
    return jax.tree_util.tree_unflatten(treedef, leaves)


def replicate_like(live: Any, restored: Any) -> Any:
    """``restored`` (shaped like ``first_replica(live)``) with each leaf whose counterpart in ``live`` is a
    replicated jax array stacked on the local devices again, with that leaf's sharding."""
    leaves, where, treedef = _replicated_leaves(live)
    out = treedef.flatten_up_to(restored)
    for i in where:
        x = jnp.asarray(out[i])
        out[i] = jax.device_put(jnp.broadcast_to(x[None], leaves[i].shape), leaves[i].sharding)
    return jax.tree_util.tree_unflatten(treedef, out)
