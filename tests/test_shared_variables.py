"""An nnx Variable that two parts of a state reach is stored once and restored shared.

flax 0.12's ``nnx.ModelAndOptimizer`` holds its model: a loop that checkpoints
``{"model": model, "optimizer": optimizer}`` reaches every parameter twice. The step stores each
Variable once (about the model's size, not twice it), and a resume writes it into the one Variable both
parts hold: bit-exact, still shared, and the next step trains on as an uninterrupted run. Arrays are
never merged: a plain pytree that holds one array twice stores and restores two leaves, as before.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax_ckpt as fc
from flax_ckpt.callbacks import CheckpointCallback, from_tree, to_tree
from helpers import leaf_bytes

nnx = pytest.importorskip("flax.nnx")
pytestmark = pytest.mark.skipif(
    not hasattr(nnx, "ModelAndOptimizer"), reason="nnx.ModelAndOptimizer is flax 0.11 on"
)

X = jnp.linspace(-1.0, 1.0, 2 * 512, dtype=jnp.float32).reshape(2, 512)


def create(seed: int):
    model = nnx.Linear(512, 512, rngs=nnx.Rngs(seed))  # 1.00 MiB of float32 (and a 2 KiB bias)
    return model, nnx.ModelAndOptimizer(model, optax.sgd(0.1))  # sgd: no state beyond its step


@nnx.jit
def train_step(optimizer, x):
    optimizer.update(nnx.grad(lambda m: jnp.mean(m(x) ** 2))(optimizer.model))


def stored_bytes(step_dir) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(step_dir) for f in files)


@pytest.mark.parametrize("given", ["objects", "states"])
def test_model_and_optimizer_store_the_model_once_and_resume_shared(ckpt_dir, given):
    """``given``: the nnx objects, or ``nnx.state`` of each (whose entries are the same Variables)."""

    def parts(model, optimizer):
        if given == "states":
            return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        return {"model": model, "optimizer": optimizer}

    model, optimizer = create(0)
    for _ in range(2):
        train_step(optimizer, X)
    with CheckpointCallback(ckpt_dir, every_steps=2) as ckpt:
        ckpt(2, parts(model, optimizer))
    model_bytes = sum(v.nbytes for v in jax.tree.leaves(nnx.state(model)))
    assert stored_bytes(ckpt_dir / "2") < 1.1 * model_bytes  # 2.0x when the model was stored twice
    saved = fc.metadata(ckpt_dir / "2").tree
    assert sorted(saved["optimizer"]) == ["step"] and sorted(saved["model"]) == ["bias", "kernel"]

    fresh, fresh_opt = create(1)
    with CheckpointCallback(ckpt_dir, every_steps=2) as ckpt:
        _, start = ckpt.restore_or(parts(fresh, fresh_opt))
    assert start == 2
    assert leaf_bytes(nnx.state(fresh_opt)) == leaf_bytes(nnx.state(optimizer))  # step and model, bit-exact
    assert fresh_opt.model is fresh and fresh_opt.model.kernel is fresh.kernel  # still one model
    train_step(optimizer, X)  # the uninterrupted run and the resumed one take the same step
    train_step(fresh_opt, X)
    assert leaf_bytes(nnx.state(fresh)) == leaf_bytes(nnx.state(model))  # the update reached `fresh`


def test_a_checkpoint_that_stored_the_model_twice_resumes_shared(ckpt_dir):
    """A step that holds the model under both parts (fc.save of both States, or an earlier version of
    the callback) restores both into the one model."""
    model, optimizer = create(0)
    train_step(optimizer, X)
    fc.save(ckpt_dir / "1", {"model": nnx.state(model), "optimizer": nnx.state(optimizer)})
    assert "model" in fc.metadata(ckpt_dir / "1").tree["optimizer"]
    fresh, fresh_opt = create(1)
    with CheckpointCallback(ckpt_dir) as ckpt:
        _, start = ckpt.restore_or({"model": fresh, "optimizer": fresh_opt})
    assert start == 1 and fresh_opt.model is fresh
    assert leaf_bytes(nnx.state(fresh_opt)) == leaf_bytes(nnx.state(optimizer))


def test_to_tree_and_from_tree_restore_a_shared_model_outside_the_callback(tmp_path):
    model, optimizer = create(0)
    train_step(optimizer, X)
    state = {"model": model, "optimizer": optimizer}
    assert "model" not in to_tree(state)["optimizer"]  # the model's Variables: under "model" alone
    fc.save(tmp_path / "ckpt", to_tree(state))
    fresh, fresh_opt = create(1)
    live = {"model": fresh, "optimizer": fresh_opt}
    from_tree(live, fc.restore(tmp_path / "ckpt", to_tree(live)))
    assert leaf_bytes(nnx.state(fresh_opt)) == leaf_bytes(nnx.state(optimizer)) and fresh_opt.model is fresh


def test_one_array_twice_in_a_pytree_is_two_leaves(ckpt_dir):
    """Arrays are not Variables: the same jax.Array under two keys is stored and restored as two."""
    w = jnp.arange(6.0, dtype=jnp.float32)
    with CheckpointCallback(ckpt_dir) as ckpt:
        ckpt(1, {"a": w, "b": w, "n": np.ones(2)}, force=True)
    assert sorted(fc.metadata(ckpt_dir / "1").tree) == ["a", "b", "n"]
    with CheckpointCallback(ckpt_dir) as ckpt:
        got, start = ckpt.restore_or({"a": jnp.zeros(6), "b": jnp.zeros(6), "n": np.zeros(2)})
    assert start == 1 and leaf_bytes(got) == leaf_bytes({"a": w, "b": w, "n": np.ones(2)})
