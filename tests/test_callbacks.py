"""CheckpointCallback: schedule, resume of every state shape, preemption (flag, exit, double signal,
signal during a save, during the first compile), and handler restore (the clu adapter: test_clu.py).

Signals are real: ``os.kill`` to this process (its handler runs on the main thread right after), or to a
real subprocess. Nothing of the code under test is mocked.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import flax_ckpt as fc
import forkserver
from flax_ckpt.callbacks import CheckpointCallback, PreemptionGuard, to_tree
from helpers import Job, leaf_bytes, worker_env

TIMEOUT_S = 120


def small_state(seed: int = 0) -> dict[str, Any]:
    """A plain dict: params, optax state (with an EmptyState), PRNG keys both styles, a data position."""
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, (3, 4)), "b": jnp.zeros(4)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    return {
        "params": params,
        "opt_state": tx.init(params),
        "rng": jax.random.key(seed + 1),
        "legacy_rng": jax.random.PRNGKey(seed + 2),
        "data": {"epoch": 0, "index": 0},
    }


def bump(state: dict[str, Any]) -> dict[str, Any]:
    """A different state of the same structure (one fake training step)."""

    def plus_one(x: Any) -> Any:
        is_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        return x + 1 if isinstance(x, jax.Array) and not is_key else x

    out = jax.tree_util.tree_map(plus_one, state)
    out["rng"] = jax.random.split(state["rng"])[0]
    out["data"] = {"epoch": state["data"]["epoch"], "index": state["data"]["index"] + 1}
    return out


@pytest.fixture
def signals_restored():
    """Checks that the test's callbacks left SIGTERM and SIGINT as they found them. A test that installs
    its own handler first appends it to the yielded list (it is the one expected back at the end)."""
    before = [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)]
    expected = list(before)
    yield expected
    after = [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)]
    signal.signal(signal.SIGTERM, before[0])
    signal.signal(signal.SIGINT, before[1])
    assert after == expected[-2:], "a callback left its signal handlers installed"


# ------------------------------------------------------------------------------------------ schedule


def test_schedule_saves_every_n_steps_and_keeps_max_to_keep(ckpt_dir, signals_restored):
    state = small_state()
    with CheckpointCallback(ckpt_dir, every_steps=3, max_to_keep=2) as ckpt:
        saved = [step for step in range(1, 11) if ckpt(step, state := bump(state), {"loss": 1.0 / step})]
        ckpt.manager.wait_until_finished()
        assert saved == [3, 6, 9]
        assert ckpt.manager.all_steps() == [6, 9]
        assert ckpt(10, state, force=True)
        ckpt.manager.wait_until_finished()
        assert ckpt.manager.all_steps() == [9, 10]
        assert ckpt.manager.metrics(9) == {"loss": pytest.approx(1 / 9)}


def test_metrics_function_is_called_only_on_steps_that_save(ckpt_dir, signals_restored):
    calls = []
    with CheckpointCallback(ckpt_dir, every_steps=4) as ckpt:
        for step in range(1, 9):
            ckpt(step, small_state(), lambda step=step: calls.append(step) or {"acc": step / 10})
    assert calls == [4, 8]


def test_save_interval_steps_is_refused_in_favour_of_every_steps(ckpt_dir):
    with pytest.raises(TypeError, match="every_steps"):
        CheckpointCallback(ckpt_dir, save_interval_steps=5)


def test_manager_options_pass_through(ckpt_dir, signals_restored):
    with CheckpointCallback(
        ckpt_dir,
        every_steps=1,
        max_to_keep=1,
        best_metric="acc",
        best_mode="max",
        keep_best=1,
        async_save=False,
    ) as ckpt:
        for step, acc in enumerate([0.5, 0.9, 0.7, 0.6], start=1):
            ckpt(step, small_state(step), {"acc": acc})
        assert ckpt.manager.best_step() == 2 and ckpt.manager.all_steps() == [2, 4]


# --------------------------------------------------------------------------------- resume, by shape


def test_restore_or_without_checkpoint_returns_the_state_and_zero(ckpt_dir, signals_restored):
    state = small_state()
    with CheckpointCallback(ckpt_dir) as ckpt:
        got, start = ckpt.restore_or(state)
    assert got is state and start == 0


def test_plain_dict_with_optax_state_keys_and_data_position(ckpt_dir, signals_restored):
    state = bump(bump(small_state()))
    with CheckpointCallback(ckpt_dir, every_steps=2) as ckpt:
        ckpt(2, state)
    with CheckpointCallback(ckpt_dir, every_steps=2) as ckpt:
        got, start = ckpt.restore_or(small_state())
    assert start == 2
    assert leaf_bytes(got) == leaf_bytes(state)
    assert type(got["opt_state"]) is type(state["opt_state"])  # optax's named tuples, not dicts
    assert got["data"] == {"epoch": 0, "index": 2}  # Python ints stay Python ints


class ExtraState(train_state.TrainState):
    rng: jax.Array
    batch_stats: dict
    epoch: int


def _train_state(seed: int) -> ExtraState:
    params = {"dense": {"kernel": jnp.full((2, 3), float(seed)), "bias": jnp.zeros(3)}}
    return ExtraState.create(
        apply_fn=lambda *a: None,
        params=params,
        tx=optax.sgd(0.1, momentum=0.9),
        rng=jax.random.key(seed),
        batch_stats={"mean": jnp.ones(3)},
        epoch=0,
    )


def test_train_state_subclass_with_extra_fields(ckpt_dir, signals_restored):
    state = _train_state(0)
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    state = state.apply_gradients(grads=grads).replace(rng=jax.random.split(state.rng)[0], epoch=3)
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        ckpt(1, state)
    fresh = _train_state(7)  # step is the Python int 0 here, an int32 array in the checkpoint
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        got, start = ckpt.restore_or(fresh)
    assert start == 1 and isinstance(got, ExtraState) and got.tx is fresh.tx
    assert leaf_bytes(got) == leaf_bytes(state) and got.epoch == 3


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.dropout(self.linear(x)))


class Position:
    """A grain-style iterator position: get_state / set_state."""

    def __init__(self):
        self.index = 0

    def get_state(self) -> dict[str, int]:
        return {"index": self.index}

    def set_state(self, state: dict[str, int]) -> None:
        self.index = state["index"]


def test_nnx_model_optimizer_and_stateful_iterator_restored_in_place(ckpt_dir, signals_restored):
    def make(seed):
        model = Tiny(nnx.Rngs(params=seed, dropout=seed + 1))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), Position()

    model, opt, pos = make(0)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        if hasattr(nnx, "Pytree"):  # flax >= 0.11: the optimizer is told the model
            opt.update(model, grads)
        else:
            opt.update(grads)
        return loss

    for _ in range(3):
        step(model, opt, jnp.ones((4, 3)))
        pos.index += 1
    with CheckpointCallback(ckpt_dir, every_steps=3) as ckpt:
        ckpt(3, (model, opt, pos))
    expected = leaf_bytes(to_tree((model, opt, pos)))

    model2, opt2, pos2 = make(5)
    with CheckpointCallback(ckpt_dir, every_steps=3) as ckpt:
        (m, o, p), start = ckpt.restore_or((model2, opt2, pos2))
    assert start == 3 and m is model2 and o is opt2 and p is pos2 and pos2.index == 3
    assert leaf_bytes(to_tree((model2, opt2, pos2))) == expected
    # and training continues identically from both
    assert (
        np.asarray(step(model, opt, jnp.ones((4, 3)))).tobytes()
        == np.asarray(step(model2, opt2, jnp.ones((4, 3)))).tobytes()
    )


def test_restore_or_skips_a_damaged_newest_step(ckpt_dir, signals_restored):
    state = small_state()
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        ckpt(1, state)
        ckpt(2, bump(state))
    (ckpt_dir / "2" / "manifest.json").write_text("{ not json")
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        got, start = ckpt.restore_or(small_state(3))
    assert start == 1 and leaf_bytes(got) == leaf_bytes(state)


def test_restore_or_when_every_step_is_damaged_raises_and_deletes_nothing(ckpt_dir, signals_restored):
    state = small_state()
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        ckpt(1, state)
        ckpt(2, bump(state))
    for step in (1, 2):  # one flipped byte in every data file: each step reads back damaged
        for f in (ckpt_dir / str(step) / "data").iterdir():
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            f.write_bytes(bytes(raw))
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:  # never a silent start from step 0
        with pytest.raises(fc.CorruptCheckpointError, match="crc32c"):
            ckpt.restore_or(small_state(3))
    assert sorted(p.name for p in ckpt_dir.iterdir() if p.name.isdigit()) == ["1", "2"]


def test_restore_or_opens_the_step_it_restores_once(ckpt_dir, signals_restored, monkeypatch):
    from flax_ckpt._src.native import layout as native

    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        ckpt(1, small_state())
    opened = []
    real = native._open_native
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:  # (its scan opened the step for its metrics)

        def counted(storage: Any, *a: Any) -> Any:  # the opens of restore_or's own thread (the prefetch
            if threading.current_thread() is threading.main_thread():  # opens it on its own)
                opened.append(storage.url)
            return real(storage, *a)

        monkeypatch.setattr(native, "_open_native", counted)
        got, start = ckpt.restore_or(small_state(3))
    assert start == 1 and leaf_bytes(got) == leaf_bytes(small_state())
    assert len(opened) == 1, opened  # its records serve both the target and the read


@pytest.mark.parametrize("persist", [None, 1])
def test_restore_or_with_tiers_gives_the_state_types(tmp_path, signals_restored, persist):
    """From a memory copy (persist=None) or the persistent step: arrays as jax arrays, the step of a fresh
    TrainState-like Python int as the weak-typed array a jitted step makes of it."""
    tiers = lambda: fc.Tiers(local_dir=str(tmp_path / "shm"), persist_interval_steps=persist, cleanup=False)  # noqa: E731
    fresh = {"w": jnp.zeros(3), "step": 0}
    step_fn = jax.jit(lambda s: {"w": s["w"] + 1, "step": s["step"] + 1})
    with CheckpointCallback(tmp_path / "run", every_steps=1, tiers=tiers()) as ckpt:
        live = step_fn(fresh)
        ckpt(1, live)
    if persist is not None:  # the host's memory is gone: the persistent step is the one left
        shutil.rmtree(tmp_path / "shm")
    with CheckpointCallback(tmp_path / "run", every_steps=1, tiers=tiers()) as ckpt:
        got, start = ckpt.restore_or(fresh)
        tier = ckpt.manager.restore_stats[-1].tier
    assert start == 1 and tier == ("local" if persist is None else "persistent")
    assert isinstance(got["w"], jax.Array) and isinstance(got["step"], jax.Array)
    assert got["step"].weak_type == live["step"].weak_type and got["step"].dtype == live["step"].dtype
    assert leaf_bytes(got) == leaf_bytes(live)


# -------------------------------------------------------------------------------------- preemption


def test_sigterm_with_flag_saves_that_step_and_sets_preempted(ckpt_dir, signals_restored):
    state = small_state()
    with CheckpointCallback(ckpt_dir, every_steps=100, exit_on_preemption=False) as ckpt:
        assert not ckpt(1, state)
        os.kill(os.getpid(), signal.SIGTERM)
        assert not ckpt.preempted  # nothing happens between boundaries
        assert ckpt(2, bump(state)) and ckpt.preempted
        assert ckpt.manager.all_steps() == [2]  # off schedule, and already durable
        assert not ckpt(3, state)  # handled once; the loop should have broken
    with fc.CheckpointManager(ckpt_dir) as mgr:
        assert leaf_bytes(mgr.restore(2, target=to_tree(state))) == leaf_bytes(bump(state))


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_exits_after_saving_with_status_128_plus_signal(ckpt_dir, signals_restored, sig, status):
    ckpt = CheckpointCallback(ckpt_dir, every_steps=100)
    ckpt(1, small_state())
    os.kill(os.getpid(), sig)
    with pytest.raises(SystemExit) as exc:
        ckpt(2, small_state())
    assert exc.value.code == status
    with fc.CheckpointManager(ckpt_dir) as mgr:  # the callback closed itself: the directory is free
        assert mgr.all_steps() == [2]


def test_exit_code_and_signals_are_configurable(ckpt_dir, signals_restored):
    previous = signal.getsignal(signal.SIGINT)
    ckpt = CheckpointCallback(ckpt_dir, exit_code=0, preemption_signals=(signal.SIGTERM,))
    assert signal.getsignal(signal.SIGINT) is previous  # SIGINT left alone
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        ckpt(1, small_state())
    assert exc.value.code == 0


def test_signal_on_a_scheduled_step_does_not_save_twice(ckpt_dir, signals_restored):
    with CheckpointCallback(ckpt_dir, every_steps=2, exit_on_preemption=False) as ckpt:
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt(2, small_state()) and ckpt.preempted
        assert ckpt.manager.all_steps() == [2]


def test_double_signal_saves_once_and_third_runs_the_previous_handler(ckpt_dir, signals_restored):
    received = []
    signal.signal(signal.SIGTERM, handler := lambda s, f: received.append(s))
    signals_restored += [handler, signal.getsignal(signal.SIGINT)]
    with CheckpointCallback(ckpt_dir, every_steps=100, exit_on_preemption=False) as ckpt:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == []  # the second is logged and ignored
        assert ckpt(1, small_state()) and ckpt.preempted and ckpt.manager.all_steps() == [1]
        os.kill(os.getpid(), signal.SIGTERM)  # the third: the user insists
        assert received == [signal.SIGTERM]


def test_signal_during_a_save_in_flight(ckpt_dir, signals_restored):
    big = {"w": jnp.arange(2_000_000, dtype=jnp.float32)}  # 8 MB: the background write takes a while
    with CheckpointCallback(ckpt_dir, every_steps=3, exit_on_preemption=False) as ckpt:
        assert ckpt(3, big)  # returns once snapshotted; the write continues in the background
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt(4, {"w": big["w"] + 1}) and ckpt.preempted
        assert ckpt.manager.all_steps() == [3, 4]  # both committed: the in-flight one was not lost
        assert np.asarray(ckpt.manager.restore(4)["w"])[0] == 1


def test_signal_while_this_step_is_being_saved_stops_at_this_step(ckpt_dir, signals_restored):
    class SignalsWhileSaved(Position):
        def get_state(self):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the callback's save
            return super().get_state()

    with CheckpointCallback(ckpt_dir, every_steps=2, exit_on_preemption=False) as ckpt:
        assert not ckpt(1, {"pos": Position()})
        assert ckpt(2, {"pos": SignalsWhileSaved()}) and ckpt.preempted
        assert ckpt.manager.all_steps() == [2]  # no extra step, no second save


def test_signal_before_the_first_step_saves_step_one(ckpt_dir, signals_restored):
    ckpt = CheckpointCallback(ckpt_dir, every_steps=100, exit_on_preemption=False)
    os.kill(os.getpid(), signal.SIGTERM)  # e.g. during restore_or or the first compile
    state, start = ckpt.restore_or(small_state())
    assert ckpt(start + 1, bump(state)) and ckpt.preempted
    ckpt.close()


def test_close_restores_the_previous_handlers(ckpt_dir, signals_restored):
    mine = lambda s, f: None  # noqa: E731
    signal.signal(signal.SIGTERM, mine)
    signals_restored += [mine, signal.getsignal(signal.SIGINT)]
    int_before = signal.getsignal(signal.SIGINT)
    ckpt = CheckpointCallback(ckpt_dir)
    assert signal.getsignal(signal.SIGTERM) is not mine and signal.getsignal(signal.SIGINT) is not int_before
    ckpt.close()
    assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is int_before
    ckpt.close()  # idempotent
    with pytest.raises(fc.CheckpointError, match="closed"):
        ckpt(1, small_state())


def test_guard_off_the_main_thread_installs_nothing(signals_restored):
    before = signal.getsignal(signal.SIGTERM)
    guards = []
    t = threading.Thread(target=lambda: guards.append(PreemptionGuard()))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is before and not guards[0].reached(1)


CHILD = textwrap.dedent("""
    import os, sys, time
    import jax, jax.numpy as jnp, optax
    from flax_ckpt.callbacks import CheckpointCallback

    tx = optax.adam(1e-2)
    params = {"w": jnp.ones((32, 32)) / 32}
    state = {"params": params, "opt": tx.init(params), "rng": jax.random.key(0)}
    ballast = {"table": jnp.zeros(8_000_000)}  # 32 MB: the preemption save takes a moment

    @jax.jit
    def train_step(state):
        def loss(p):
            x = jax.random.normal(state["rng"], (8, 32))
            for _ in range(60):  # a deep unrolled graph: the first compile takes a while
                x = jnp.tanh(x @ p["w"])
            return jnp.sum(x ** 2)
        g = jax.grad(loss)(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], u), "opt": opt,
                "rng": jax.random.split(state["rng"])[0]}

    ckpt = CheckpointCallback(sys.argv[1], every_steps=100)
    (state, ballast), start = ckpt.restore_or((state, ballast))
    print("start", start, "compiling", flush=True)
    for step in range(start, 5):
        state = train_step(state)
        if step == start:
            print("first step done", flush=True)
        ckpt(step + 1, (state, ballast))
    print("finished", flush=True)
""")


def test_signals_during_the_first_compile_in_a_real_process(tmp_path):
    """A SIGTERM lands while the child compiles its first step, a second one while it saves: it finishes
    that step, saves it, exits 143; restarted, it resumes from step 1 and finishes."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = worker_env(devices=1)  # one CPU device, as a user has
    cmd = [sys.executable, str(script), str(tmp_path / "ckpts")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "compiling" in line or "received SIGTERM;" in line:
                proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    out = "".join(lines)
    assert status == 143, out
    assert out.index("received SIGTERM;") < out.index("first step done"), out  # arrived before it ended
    assert "received SIGTERM again (2 signals)" in out and "preemption: step 1 is saved" in out, out
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert again.returncode == 0 and "start 1 " in again.stdout and "finished" in again.stdout, again


MULTI_CHILD = textwrap.dedent("""
    import json, sys, time
    from helpers import start_worker
    cfg = json.loads(sys.argv[1])
    start_worker(cfg)
    import jax.numpy as jnp
    from flax_ckpt.callbacks import CheckpointCallback

    ckpt = CheckpointCallback(cfg["dir"], every_steps=1000)
    state, start = ckpt.restore_or({"w": jnp.zeros(4)})
    for step in range(start, 5000):
        state = {"w": state["w"] + 1}
        time.sleep(0.005)
        print("step", step + 1, flush=True)
        ckpt(step + 1, state)
""")


def test_two_processes_stop_at_the_same_step_when_one_gets_sigterm(tmp_path):
    """jax.distributed with 2 CPU processes: SIGTERM to process 1 only; JAX's preemption sync point makes
    both save the same step and exit 143."""
    script = tmp_path / "multi.py"
    script.write_text(MULTI_CHILD)
    directory = tmp_path / "ckpts"
    job = Job(script, tmp_path, "multi", 2, devices=1, timeout=TIMEOUT_S, dir=str(directory)).start()
    logs = [job.path(i, ".log") for i in range(2)]
    try:
        job.wait(lambda: "step 50\n" in logs[1].read_text() or job.procs[1].poll() is not None)
        job.procs[1].send_signal(signal.SIGTERM)
        job.join()  # until both have exited
    finally:
        job.kill()
    statuses = [p.returncode for p in job.procs]
    outs = [log.read_text() for log in logs]
    assert statuses == [143, 143], outs
    steps = [re.search(r"preemption: step (\d+) is saved", out) for out in outs]
    assert steps[0] and steps[1] and steps[0][1] == steps[1][1], outs
    with fc.CheckpointManager(directory) as mgr:
        assert mgr.all_steps() == [int(steps[0][1])]
        assert np.asarray(mgr.restore(int(steps[0][1]))["w"]).tolist() == [float(steps[0][1])] * 4


# ------------------------------------------------------------------------------- pmap (issue 43, 3)

PMAP_WORKER = textwrap.dedent("""
    import hashlib, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import jax_utils
    from flax.training import train_state
    from flax_ckpt.callbacks import CheckpointCallback
    from helpers import leaf_bytes
    directory, mode, until = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def digest(tree):
        return hashlib.sha256(repr(sorted(leaf_bytes(tree).items())).encode()).hexdigest()[:16]

    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.zeros(4)}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.1))

    def train_step(s):
        grads = jax.tree_util.tree_map(lambda p: jnp.sin(p + s.step), s.params)
        return s.apply_gradients(grads=grads)

    if mode == "pmap":  # the loop of Flax's wmt example: the state replicated, the step pmapped
        state = jax_utils.replicate(state)
        step_fn = jax.pmap(train_step)
    else:
        step_fn = jax.jit(train_step)
    ckpt = CheckpointCallback(directory, every_steps=3, max_to_keep=None, replicated=mode == "pmap")
    state, start = ckpt.restore_or(state)
    one = jax_utils.unreplicate(state) if mode == "pmap" else state
    if mode == "pmap":  # every replica holds the restored state, on every local device
        assert state.params["w"].shape[0] == jax.local_device_count()
        assert all(np.array_equal(state.params["w"][i], one.params["w"])
                   for i in range(jax.local_device_count()))
    print("restored", start, digest(one), flush=True)
    for step in range(start, until):
        state = step_fn(state)
        ckpt(step + 1, state)
    ckpt.close()
    print("saved", until, digest(jax_utils.unreplicate(state) if mode == "pmap" else state), flush=True)
""")


def _pmap_run(directory, mode: str, devices: int, until: int) -> tuple[tuple[int, str], tuple[int, str]]:
    r = forkserver.run(
        [sys.executable, "-c", PMAP_WORKER, str(directory), mode, str(until)],
        env=worker_env(devices),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    restored, saved = lines["restored"].split(), lines["saved"].split()
    return (int(restored[0]), restored[1]), (int(saved[0]), saved[1])


def test_pmap_state_saved_replicated_restores_on_other_device_counts(ckpt_dir):
    """A pmap loop on 8 devices passes its replicated state every step (replicated=True); the checkpoint
    restores bit-exact into an unreplicated TrainState on 1 device, whose run continues and saves, and
    that checkpoint restores into the replicated state of an 8-device pmap loop again."""
    _, (six, on_eight) = _pmap_run(ckpt_dir, "pmap", 8, 6)
    (start, restored), (nine, on_one) = _pmap_run(ckpt_dir, "single", 1, 9)
    assert (start, restored) == (six, on_eight)
    (start, restored), _ = _pmap_run(ckpt_dir, "pmap", 8, 12)
    assert (start, restored) == (nine, on_one)
    info = fc.metadata(ckpt_dir / "12")
    assert info.tree["params"]["w"].shape == (3, 4)  # stored unreplicated


def test_replicated_refuses_a_leaf_without_the_device_axis(ckpt_dir):
    with CheckpointCallback(ckpt_dir, every_steps=1, replicated=True, preemption_signals=()) as ckpt:
        with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(3,\), not a leading axis of the 8"):
            ckpt(1, {"w": jnp.zeros(3)})


# ------------------------------------------------------------------- nnx.State targets (issue 43, 5)


def _trained_tiny(seed: int) -> tuple[Tiny, Any]:
    model = Tiny(nnx.Rngs(params=seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_callback_checkpoint_restores_into_an_nnx_state_target(ckpt_dir, signals_restored):
    """What the callback saved for an nnx model and optimizer restores with the NNX guides' target,
    nnx.state(model), through fc.restore and the manager, bit-exact, and nnx.update puts it in place."""
    model, opt = _trained_tiny(1)
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        ckpt(1, {"model": model, "opt": opt})
    fresh, fresh_opt = _trained_tiny(7)
    target = {"model": nnx.state(fresh), "opt": nnx.state(fresh_opt)}
    got = fc.restore(ckpt_dir / "1", target)
    assert isinstance(got["model"], nnx.State)
    assert leaf_bytes(got) == leaf_bytes({"model": nnx.state(model), "opt": nnx.state(opt)})
    with fc.CheckpointManager(ckpt_dir, read_only=True) as mgr:
        again = mgr.restore(target={"model": nnx.state(fresh)}, partial=True)["model"]  # the model alone
    nnx.update(fresh, again)
    assert leaf_bytes(nnx.state(fresh)) == leaf_bytes(nnx.state(model))


@pytest.mark.parametrize("stored", ["state", "pure"])
def test_restore_or_resumes_from_fc_save_of_an_nnx_state(ckpt_dir, signals_restored, stored):
    """A run step saved by fc.save from nnx.state(model) (as the NNX guides save), or from its pure dict
    (an earlier version of the callback stored that), is resumed by restore_or into live nnx objects."""
    model, opt = _trained_tiny(2)
    pure = getattr(nnx, "to_pure_dict", None) or (lambda s: s.to_pure_dict())  # flax 0.10.0: a method
    as_saved = (lambda s: s) if stored == "state" else pure
    fc.save(ckpt_dir / "5", {"model": as_saved(nnx.state(model)), "opt": as_saved(nnx.state(opt))})
    fresh, fresh_opt = _trained_tiny(9)
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        got, start = ckpt.restore_or({"model": fresh, "opt": fresh_opt})
    assert start == 5 and got["model"] is fresh and got["opt"] is fresh_opt
    assert leaf_bytes(nnx.state(fresh)) == leaf_bytes(nnx.state(model))
    assert leaf_bytes(nnx.state(fresh_opt)) == leaf_bytes(nnx.state(opt))


# ------------------------------------------------------------------------------ Python's random state


def test_python_random_state_is_one_array_and_restores_bit_exact(ckpt_dir, signals_restored):
    """random.getstate()'s tuple and a random.Random (gauss_next set in both) are stored as one uint32
    array each; restore_or gives back an equal tuple and sets the Random in place, so both draw what
    they would have drawn."""
    src = random.Random(11)
    src.gauss(0.0, 1.0)  # leaves gauss_next set: it is part of the state
    other = random.Random(12)
    state = {"tuple": src.getstate(), "rng": other, "step": 4}
    other.gauss(0.0, 1.0)
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        ckpt(1, state)
    tree = fc.metadata(ckpt_dir / "1").tree
    for name in ("tuple", "rng"):
        assert tree[name].shape == (628,) and tree[name].dtype == np.uint32, tree[name]
    expected_tuple = [src.gauss(0.0, 1.0), src.random()]
    expected_rng = [other.gauss(0.0, 1.0), other.random(), other.getrandbits(64)]
    fresh = random.Random(99)
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        got, start = ckpt.restore_or({"tuple": random.Random(98).getstate(), "rng": fresh, "step": 0})
    assert start == 1 and got["rng"] is fresh and got["tuple"] == state["tuple"]
    again = random.Random()
    again.setstate(got["tuple"])
    assert [again.gauss(0.0, 1.0), again.random()] == expected_tuple
    assert [fresh.gauss(0.0, 1.0), fresh.random(), fresh.getrandbits(64)] == expected_rng


def test_python_random_state_stored_leaf_by_leaf_still_restores(ckpt_dir, signals_restored):
    """A checkpoint holding random.getstate() as the tuple it is (627 leaves: what earlier versions
    stored) restores into a tuple and into a random.Random target, gauss_next set or not."""
    src = random.Random(21)
    src.gauss(0.0, 1.0)
    fc.save(ckpt_dir / "3", {"a": src.getstate(), "b": random.Random(22).getstate()})  # b: gauss_next None
    expected = src.getstate()
    target_rng = random.Random(0)
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        got, start = ckpt.restore_or({"a": target_rng, "b": random.Random(5).getstate()})
    assert start == 3 and got["a"] is target_rng and target_rng.getstate() == expected
    assert got["b"] == random.Random(22).getstate()


RANDOM_CHILD = textwrap.dedent("""
    import json, os, random, signal, sys
    import numpy as np
    from flax_ckpt.callbacks import CheckpointCallback

    directory, out, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    random.seed(7)
    rng = random.Random(8)
    ckpt = CheckpointCallback(directory, every_steps=1)
    state, start = ckpt.restore_or({"global": random, "rng": rng, "w": np.zeros(2, np.float32)})
    with open(out, "a") as f:
        for step in range(start, 8):
            f.write(json.dumps([step, random.random(), random.gauss(0, 1), rng.gauss(0, 1)]) + "\\n")
            f.flush()
            if step == stop_at and start == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # a preemption: this step is saved, then exit 143
            ckpt(step + 1, {"global": random, "rng": rng, "w": state["w"] + step})
    ckpt.close()
""")


def test_python_random_draws_after_a_preempted_resume_equal_an_uninterrupted_run(tmp_path):
    """A real program draws from the random module and a random.Random each step; SIGTERMed at step 3 and
    restarted, it draws exactly what a run never interrupted draws."""
    script = tmp_path / "child.py"
    script.write_text(RANDOM_CHILD)
    env = worker_env(devices=1)

    def run(name: str, stop_at: int) -> list[int]:
        out = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, str(script), str(tmp_path / name), str(out), str(stop_at)]
        return [forkserver.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env).returncode]

    assert run("whole", -1) == [0]
    assert run("cut", 3) == [143] and run("cut", 3) == [0]
    whole = (tmp_path / "whole.jsonl").read_text().splitlines()
    assert len(whole) == 8 and (tmp_path / "cut.jsonl").read_text().splitlines() == whole
