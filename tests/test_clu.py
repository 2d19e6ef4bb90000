"""The clu adapter with the real clu (whose ``periodic_actions`` imports tensorflow): ``CheckpointAction``
as a clu ``PeriodicAction``, and a training loop in the style of Flax's lm1b example (absl.app, clu's
``ReportProgress`` with a metric writer beside ``CheckpointAction``, a jitted step that donates the
state) that is SIGTERM'd mid-run in a real process, resumed, and ends bit-identical to a run that was
never interrupted.

These run for real in .venv-clu (``scripts/test_clu.sh``, which ``.ci/run`` calls, installs the ``clu``
extra: clu, tensorflow-cpu, tensorboard); elsewhere the module is skipped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

pytest.importorskip(
    "clu.periodic_actions",
    reason="clu's periodic_actions needs clu, tensorflow and tensorboard "
    "(scripts/test_clu.sh; pip install flax-ckpt[clu])",
    exc_type=ImportError,
)

from clu import periodic_actions  # noqa: E402

import flax_ckpt as fc  # noqa: E402
from flax_ckpt.callbacks import CheckpointCallback  # noqa: E402
from flax_ckpt.callbacks.clu_adapter import CheckpointAction  # noqa: E402
from helpers import leaf_bytes, worker_env  # noqa: E402

TIMEOUT_S = 240


def small_state(seed: int = 0) -> dict[str, Any]:
    """A plain dict: params, optax state, a PRNG key, a data position."""
    k = jax.random.key(seed)
    params = {"w": jax.random.normal(k, (3, 4)), "b": jnp.zeros(4)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    return {
        "params": params,
        "opt_state": tx.init(params),
        "rng": jax.random.key(seed + 1),
        "data": {"epoch": 0, "index": 0},
    }


def bump(state: dict[str, Any]) -> dict[str, Any]:
    """A different state of the same structure (one fake training step)."""
    out = dict(state, params=jax.tree_util.tree_map(lambda x: x + 1, state["params"]))
    out["rng"] = jax.random.split(state["rng"])[0]
    out["data"] = {"epoch": 0, "index": state["data"]["index"] + 1}
    return out


@pytest.fixture
def signals_restored():
    """Checks that the callback left SIGTERM and SIGINT as it found them."""
    before = [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)]
    yield
    after = [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)]
    signal.signal(signal.SIGTERM, before[0])
    signal.signal(signal.SIGINT, before[1])
    assert after == before, "a callback left its signal handlers installed"


def test_clu_periodic_action_adapter(ckpt_dir, signals_restored):
    state = small_state()
    with CheckpointCallback(ckpt_dir, every_steps=2, exit_on_preemption=False) as ckpt:
        action = CheckpointAction(ckpt, lambda: state, metrics_fn=lambda: {"loss": 0.5})
        assert isinstance(action, periodic_actions.PeriodicAction)
        saved = []
        for step in range(1, 6):
            state = bump(state)
            if step == 5:
                os.kill(os.getpid(), signal.SIGTERM)
            if action(step):
                saved.append(step)
        assert saved == [2, 4, 5] and ckpt.preempted
        assert ckpt.manager.metrics(4) == {"loss": 0.5}
        with pytest.raises(ValueError, match="every step"):
            action(7)  # clu's own check: the hook must run at every step


# ------------------------------------------------------------------------- a loop in the lm1b style

LM1B_STYLE = textwrap.dedent('''
    """train.py of Flax's lm1b example, reduced: absl.app, clu's metric writer and ReportProgress, hooks
    called with the step after each train step, a jitted step that donates the state."""
    import time

    import jax
    import jax.numpy as jnp
    import optax
    from absl import app, flags, logging
    from clu import metric_writers, periodic_actions

    from flax_ckpt.callbacks import CheckpointCallback
    from flax_ckpt.callbacks.clu_adapter import CheckpointAction

    FLAGS = flags.FLAGS
    flags.DEFINE_string("workdir", None, "checkpoints and summaries")
    flags.DEFINE_integer("num_train_steps", 60, "steps to train")
    flags.DEFINE_integer("checkpoint_every_steps", 10, "steps between checkpoints")
    flags.DEFINE_float("step_seconds", 0.0, "sleep after each step (so that a signal lands mid-run)")

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 60)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-2))


    def batch_at(step):
        """The input pipeline: the batch of a step depends on the step only, as a resumed loader's does."""
        x = jax.random.normal(jax.random.fold_in(jax.random.key(1234), step), (16, 8))
        return x, jnp.sin(jnp.sum(x, axis=1, keepdims=True))


    def initial_state():
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"hidden": {"kernel": jax.random.normal(k1, (8, 32)) * 0.3, "bias": jnp.zeros(32)},
                  "out": {"kernel": jax.random.normal(k2, (32, 1)) * 0.3, "bias": jnp.zeros(1)}}
        return {"step": 0, "params": params, "opt_state": tx.init(params), "rng": jax.random.key(1)}


    def train_step(state, batch):
        x, y = batch
        rng, dropout_rng = jax.random.split(state["rng"])

        def loss_fn(p):
            h = jax.nn.relu(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
            h = jnp.where(jax.random.bernoulli(dropout_rng, 0.9, h.shape), h / 0.9, 0.0)
            return jnp.mean((h @ p["out"]["kernel"] + p["out"]["bias"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                "opt_state": opt_state, "rng": rng}, {"loss": loss}


    def main(argv):
        del argv
        logging.set_verbosity(logging.INFO)
        ckpt = CheckpointCallback(FLAGS.workdir + "/checkpoints", every_steps=FLAGS.checkpoint_every_steps)
        state, start_step = ckpt.restore_or(initial_state())
        print(f"start {start_step}", flush=True)
        writer = metric_writers.create_default_writer(FLAGS.workdir + "/summaries")
        p_train_step = jax.jit(train_step, donate_argnums=(0,))
        report_progress = periodic_actions.ReportProgress(num_train_steps=FLAGS.num_train_steps, writer=writer,
                                                          every_steps=5, every_secs=None)
        metrics = {}
        hooks = [report_progress,
                 CheckpointAction(ckpt, lambda: state, metrics_fn=lambda: {"loss": float(metrics["loss"])})]
        with metric_writers.ensure_flushes(writer):
            for step in range(start_step + 1, FLAGS.num_train_steps + 1):
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    state, metrics = p_train_step(state, batch_at(step))
                for h in hooks:
                    h(step)
                if step % 10 == 0:
                    with report_progress.timed("training_metrics"):
                        writer.write_scalars(step, {"loss": float(metrics["loss"])})
                print(f"step {step}", flush=True)
                time.sleep(FLAGS.step_seconds)
        ckpt.finish(FLAGS.num_train_steps, state)
        ckpt.close()
        print("finished", flush=True)


    if __name__ == "__main__":
        flags.mark_flags_as_required(["workdir"])
        app.run(main)
''')


def _train(script, workdir, *, sigterm_after: int | None = None) -> tuple[int, str]:
    """Runs the lm1b-style script to the end, or until it exits after a SIGTERM sent once it has printed
    ``step <sigterm_after>``. Returns its exit status and output."""
    env = dict(worker_env(devices=1), TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, str(script), f"--workdir={workdir}", "--step_seconds=0.05"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if sigterm_after is not None and re.match(rf"step {sigterm_after}\b", line):
                proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return status, "".join(lines)


def test_lm1b_style_loop_resumes_after_sigterm_bit_exact(tmp_path):
    """ReportProgress and CheckpointAction as the loop's hooks: SIGTERM after step 23 saves the step the
    loop is at and exits 143; restarted, the loop resumes there and its final state (params, optax state,
    PRNG key, step counter) is bit-identical to that of a run that never stopped."""
    script = tmp_path / "train.py"
    script.write_text(LM1B_STYLE)
    whole, cut = tmp_path / "whole", tmp_path / "cut"

    status, out = _train(script, whole)
    assert status == 0 and "start 0" in out and "finished" in out, out
    assert "steps_per_sec" in out, out  # ReportProgress reported through the writer

    status, out = _train(script, cut, sigterm_after=23)
    assert status == 143, out
    stopped = re.search(r"preemption: step (\d+) is saved", out)
    assert stopped and 23 <= int(stopped[1]) < 60, out
    assert "finished" not in out, out

    status, again = _train(script, cut)
    assert status == 0 and f"start {stopped[1]}\n" in again and "finished" in again, again
    # "step N" without its newline: absl's C++ log lines share the pipe and may land between the two
    assert re.search(rf"step {int(stopped[1]) + 1}\b", again) and re.search(r"step 60\b", again), again
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(cut / "summaries"))

    with fc.CheckpointManager(whole / "checkpoints") as a, fc.CheckpointManager(cut / "checkpoints") as b:
        assert a.all_steps()[-1] == b.all_steps()[-1] == 60
        want, got = a.restore(60), b.restore(60)
        assert leaf_bytes(got) == leaf_bytes(want)
        assert int(got["step"]) == 60
        for step in sorted(set(a.all_steps()) & set(b.all_steps())):
            assert leaf_bytes(b.restore(step)) == leaf_bytes(a.restore(step)), step
