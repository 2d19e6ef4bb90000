"""A training loop that dispatches steps ahead of the device (no sync per step), saving every step.

On CPU devices (these tests) a save waits for the step computing its own state, then copies it to
host once (``FLAX_CKPT_DEVICE_SNAPSHOT=auto``); with ``always`` it copies on the device and returns.
"The writer is busy" is judged against the device's progress: a save that finds the previous one still
waiting for its device copy (the device behind the loop) waits for it, which costs the loop nothing
the device would not cost it anyway, and is reported as ``waited_for_device_s``, not ``blocked_s``. So
a memory tier asked to save every step saves (nearly) every step when a copy costs a fraction of a
step, and ``Tiers(on_busy="skip")`` skips only where the writer itself is the bottleneck.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt as fc
from helpers import assert_bit_exact

pytestmark = pytest.mark.timeout(300)

_N = 30


@jax.jit
def _train_step(state):
    """A step of a few tenths of a second on one CPU core over a small state (256 KiB): a copy is cheap."""
    w = state["w"]

    def body(_, c):
        return jnp.tanh(c @ c.T) @ c * 1e-3 + c

    h = jax.lax.fori_loop(0, 150, body, jnp.broadcast_to(w[:1], (384, 256)))
    return {"w": w * 0.999 + h[:256, :256] * 1e-6, "step": state["step"] + 1}


_train = jax.jit(_train_step.__wrapped__, donate_argnums=0)


def _run(mgr: fc.CheckpointManager, state):
    t = time.perf_counter()
    saved = []
    for step in range(1, _N + 1):
        state = _train(state)
        if mgr.save(step, state):
            saved.append(step)
    jax.block_until_ready(state)
    mgr.wait_until_finished()
    return state, saved, time.perf_counter() - t


def _start():
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32) * 0.05
    return {"w": jnp.asarray(w), "step": jnp.int32(0)}


@pytest.mark.parametrize("on_busy", ["skip", "wait"])
def test_memory_tier_every_step_of_a_loop_running_ahead_saves_most_steps(tmp_path, on_busy):
    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"),
        peer=False,
        persist_interval_steps=None,
        on_busy=on_busy,
        max_to_keep=2,
    )
    state = _train(_start())  # compiled
    jax.block_until_ready(state)
    with fc.CheckpointManager(tmp_path / "run", tiers=tiers) as mgr:
        state = _train(state)
        mgr.save(0, state, force=True)  # the device copy compiled
        mgr.wait_until_finished()
        state, saved, _ = _run(mgr, state)
        stats = mgr.tier_stats[1:]
        assert len(saved) >= 0.8 * _N, (len(saved), saved)
        assert sum(s.waited_for_device_s for s in stats) > 0  # the device ran behind the loop
        blocked = sorted(s.blocked_s for s in stats)
        waited = sorted(s.waited_for_device_s for s in stats)
        assert blocked[len(blocked) // 2] < waited[len(waited) // 2], (blocked, waited)
        last = mgr.restore(saved[-1])
    assert_bit_exact(last["w"], np.asarray(state["w"]), types=False)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_persistent_manager_on_busy_skip_judged_by_the_device(tmp_path, mode, monkeypatch):
    monkeypatch.setenv("FLAX_CKPT_DEVICE_SNAPSHOT", mode)
    state = _train(_start())
    jax.block_until_ready(state)
    with fc.CheckpointManager(tmp_path / "run", on_busy="skip", max_to_keep=2) as mgr:
        state = _train(state)
        mgr.save(0, state)
        mgr.wait_until_finished()
        state, saved, _ = _run(mgr, state)
        assert len(saved) >= 0.8 * _N, (len(saved), saved)
        assert mgr.skipped == _N - len(saved)
        stats = mgr.stats[1:]
        if mode == "auto":  # CPU devices: the save waits for its own state's step, then one host copy
            assert {s.snapshot_mode for s in stats} == {"host"}
            waited = sorted(s.waited_for_device_s for s in stats)
            blocked = sorted(s.blocked_s for s in stats)
            assert blocked[len(blocked) // 2] < waited[len(waited) // 2], (blocked, waited)
        else:
            assert {s.snapshot_mode for s in stats} <= {"device", "host"}  # "host": a state computed
            assert sum(s.snapshot_mode == "device" for s in stats) >= len(saved) / 2
        np.testing.assert_array_equal(mgr.restore(saved[-1])["w"], np.asarray(state["w"]))


def test_on_busy_is_given_once(tmp_path):
    with pytest.raises(ValueError, match="on_busy"):
        fc.CheckpointManager(tmp_path / "a", on_busy="later")
    with pytest.raises(ValueError, match=r"on_busy='wait' contradicts tiers=Tiers\(on_busy='skip'\)"):
        fc.CheckpointManager(tmp_path / "b", on_busy="wait", tiers=fc.Tiers(local_dir=str(tmp_path / "shm")))
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")  # nothing made
    with fc.CheckpointManager(
        tmp_path / "c", tiers=fc.Tiers(local_dir=str(tmp_path / "shm"), peer=False, on_busy="wait")
    ) as mgr:
        assert mgr.on_busy == "wait"
