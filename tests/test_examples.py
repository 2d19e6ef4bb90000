"""The examples, run as real subprocesses: they train, they resume, and an interrupted run ends exactly
where an uninterrupted one does.

The decisive tests: a real signal (SIGTERM: preemption; SIGKILL: a crash) sent to a real training
process at a random step; the test restarts it and it finishes. Every checkpoint both runs hold (the
final one included: parameters, optimizer state, PRNG keys, data position) must be bit-identical to the
uninterrupted run's. The random step is in the failure message, so a failure can be replayed.
"""

from __future__ import annotations

import logging
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import flax_ckpt as fc
import forkserver
from helpers import leaf_bytes, worker_env

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
STEPS, EVERY = 600, 50  # ~0.3 ms a step: the margin between the signal and the end of the run
TIMEOUT_S = 120
pytestmark = pytest.mark.usefixtures("jax_compile_cache")  # the runs of one example compile the same programs


def train_cmd(script: str, directory: Path) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLES / script),
        "--directory",
        str(directory),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--log-every",
        "1",
    ]


def run(cmd: list[str], *, signal_at: int | None = None, sig: int = signal.SIGTERM) -> tuple[int, str]:
    """Runs ``cmd``; sends ``sig`` once it prints ``step <signal_at>``. Returns (status, output)."""
    proc = forkserver.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=worker_env(devices=1)
    )  # one CPU device, as a user has
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if signal_at is not None and line.startswith(f"step {signal_at} "):
                proc.send_signal(sig)
                signal_at = None
        return proc.wait(), "".join(lines)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def checkpoints(directory: Path) -> dict[int, dict[str, tuple]]:
    """Every step of a run's directory, restored, as leaf_bytes (equal means bit-identical)."""
    with fc.CheckpointManager(directory) as mgr:
        return {step: leaf_bytes(mgr.restore(step)) for step in mgr.all_steps()}


def final_accuracy(out: str) -> str:
    m = re.search(r"final accuracy (\S+) after", out)
    assert m, out[-2000:]
    return m[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs of each example (run on first use): script -> (checkpoints, accuracy, folder)."""
    cache: dict[str, tuple[dict, str, Path]] = {}

    def get(script: str) -> tuple[dict, str, Path]:
        if script not in cache:
            d = tmp_path_factory.mktemp(script.replace(".py", "_reference"))
            status, out = run(train_cmd(script, d))
            assert status == 0, out[-3000:]
            cache[script] = checkpoints(d), final_accuracy(out), d
        return cache[script]

    return get


def assert_same_run(ref: tuple[dict, str, Path], directory: Path, out: str, context: str) -> None:
    ref_ckpts, ref_acc, _ = ref
    got = checkpoints(directory)
    assert STEPS in got and STEPS in ref_ckpts, context
    common = sorted(set(got) & set(ref_ckpts))
    for step in common:
        assert got[step].keys() == ref_ckpts[step].keys(), f"{context}: step {step} structure differs"
        diff = [k for k in got[step] if got[step][k] != ref_ckpts[step][k]]
        assert not diff, f"{context}: step {step} differs from the uninterrupted run in {diff}"
    assert any("opt_state" in k for k in got[STEPS]), f"{context}: no optimizer state in {list(got[STEPS])}"
    assert final_accuracy(out) == ref_acc, context


def check_preempted_run(status: int, out: str, at: int, directory: Path, context: str) -> int:
    """The interrupted run saved an off-schedule step at or after ``at`` and exited 143; returns it."""
    assert status == 128 + signal.SIGTERM, f"{context}: status {status}\n{out[-3000:]}"
    saved = re.search(r"preemption: step (\d+) is saved in .* and durable; exiting with status 143", out)
    assert saved and int(saved[1]) >= at, f"{context}\n{out[-3000:]}"
    with fc.CheckpointManager(directory) as mgr:
        assert mgr.latest_step() == int(saved[1]), context  # the preemption save, committed
    return int(saved[1])


def test_nnx_sigterm_at_a_random_step_then_restart_is_bit_identical(tmp_path, reference):
    """examples/train_nnx.py SIGTERMed at a random step, then restarted: the run is the uninterrupted one.
    Slow (tens of seconds): two real runs of 600 steps, each a process that compiles its programs,
    compared with the module's reference run."""
    at = random.randint(EVERY + 1, STEPS // 3)
    context = f"train_nnx.py: SIGTERM after step {at}"
    status, out = run(train_cmd("train_nnx.py", tmp_path), signal_at=at, sig=signal.SIGTERM)
    saved = check_preempted_run(status, out, at, tmp_path, context)
    status, out = run(train_cmd("train_nnx.py", tmp_path))
    assert status == 0 and f"resumed from step {saved} " in out, f"{context}\n{out[-3000:]}"
    assert_same_run(reference("train_nnx.py"), tmp_path, out, context)


def test_linen_sigterm_at_a_random_step_via_the_preemption_demo_is_bit_identical(tmp_path, reference):
    """examples/preemption_demo.py sends SIGTERM to train_linen.py at a random step and restarts it. Slow
    (tens of seconds): the demo's two runs of 600 steps are real processes, each compiling its programs."""
    at = 10 * random.randint(EVERY // 10 + 1, STEPS // 30)  # the demo's child reports every 10 steps
    context = f"preemption_demo.py: SIGTERM after step {at}"
    cmd = [
        sys.executable,
        str(EXAMPLES / "preemption_demo.py"),
        "--directory",
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--at",
        str(at),
    ]
    proc = forkserver.run(
        cmd, capture_output=True, text=True, timeout=2 * TIMEOUT_S, env=worker_env(devices=1)
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{context}\n{out[-3000:]}"
    saved = re.search(r"run 1 saved step (\d+) and exited with status 143", out)
    assert saved and int(saved[1]) >= at and f"run 2 resumed from step {saved[1]} " in out, out[-3000:]
    assert_same_run(reference("train_linen.py"), tmp_path, out, context)


def test_the_demo_shows_only_the_library_s_log_lines_and_removes_its_temporary_folder(tmp_path):
    """Without --directory the preemption demo works in a new temporary folder and removes it when it
    succeeds; the example's logging shows flax_ckpt's INFO lines (the resume), not JAX's (issue 26).
    Slow (tens of seconds): the demo's two runs are real processes in which JAX looks for its backends,
    as for a user."""
    env = worker_env(devices=1)
    env.pop("JAX_PLATFORMS")  # as a user runs it: JAX looks for its backends and logs at INFO about it
    env["TMPDIR"] = str(tmp_path)
    cmd = [
        sys.executable,
        str(EXAMPLES / "preemption_demo.py"),
        "--steps",
        "120",
        "--every",
        "50",
        "--at",
        "60",
    ]
    proc = forkserver.run(cmd, capture_output=True, text=True, timeout=2 * TIMEOUT_S, env=env)
    out = proc.stdout + proc.stderr
    saved = re.search(r"run 1 saved step (\d+) and exited with status 143", out)  # a loaded machine may
    assert proc.returncode == 0 and saved and 60 <= int(saved[1]) < 120, out[-3000:]  # run past 60 first
    assert f"run 2 resumed from step {saved[1]} " in out, out[-3000:]
    assert re.search(rf"^\[run 2\] INFO flax_ckpt[.\w]*: resumed from step {saved[1]} ", out, re.M), out[
        -3000:
    ]
    assert not re.search(r"^\[run \d\] INFO (?!flax_ckpt)", out, re.M), out[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_linen_sigkill_resumes_from_last_scheduled_checkpoint_bit_identical(tmp_path, reference):
    """examples/train_linen.py SIGKILLed at a random step resumes from its last scheduled checkpoint and
    ends as the uninterrupted run. Slow (tens of seconds): two real runs of 600 steps, each a process
    that compiles its programs."""
    script = "train_linen.py"
    at = random.randint(2 * EVERY + 1, STEPS // 3)
    context = f"{script}: SIGKILL after step {at}"
    status, out = run(train_cmd(script, tmp_path), signal_at=at, sig=signal.SIGKILL)
    assert status == -signal.SIGKILL, f"{context}: status {status}\n{out[-3000:]}"
    status, out = run(train_cmd(script, tmp_path))
    resumed = re.search(r"resumed from step (\d+) ", out)
    assert status == 0 and resumed, f"{context}\n{out[-3000:]}"
    step = int(resumed[1])  # the save of step EVERY was durable before step 2 * EVERY ended
    assert step % EVERY == 0 and EVERY <= step < STEPS, f"{context}: resumed from {step}"
    assert_same_run(reference(script), tmp_path, out, context)


def test_examples_learn_and_a_finished_run_resumes_without_training(reference, capsys, caplog):
    """Every example's loss falls, and a run started again after it finished restores its last step and
    trains no more. Slow (seconds): it reads the module's reference runs (real processes) and restores
    each."""
    for script in ["train_linen.py", "train_nnx.py"]:
        _, acc, _ = reference(script)
        assert float(acc) > 0.9, script
    # A finished directory: running the example again (here, in this process) does no step.
    _, _, finished = reference("train_linen.py")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_linen
    finally:
        sys.path.remove(str(EXAMPLES))
    caplog.set_level(logging.INFO, logger="flax_ckpt.callbacks")
    train_linen.main(["--directory", str(finished), "--steps", str(STEPS), "--every", str(EVERY)])
    assert f"resumed from step {STEPS} " in caplog.text
    out = capsys.readouterr().out
    assert "final accuracy" in out and "\nstep " not in "\n" + out, out


def test_examples_differ_from_a_checkpoint_free_loop_by_the_marked_lines():
    """The README's claim: delete the lines marked `# ckpt` (the import, the construction, restore_or,
    the per-step call and the final close), uncomment the line `# without ckpt:` gives in restore_or's
    place (the state built, step 0), and what is left of ``main`` is a plain training loop."""
    for script in ["train_linen.py", "train_nnx.py"]:
        lines = (EXAMPLES / script).read_text().splitlines()
        marked = [line.strip() for line in lines if line.endswith("  # ckpt")]
        assert len(marked) == 5, marked
        assert marked[0] == "from flax_ckpt.callbacks import CheckpointCallback  # ckpt"
        assert marked[1].startswith("ckpt = CheckpointCallback(")
        assert ".restore_or(lambda: " in marked[2] and marked[3].startswith("ckpt(step + 1, ")
        assert marked[4] == "ckpt.close()  # ckpt"
        i = next(i for i, line in enumerate(lines) if ".restore_or(lambda: " in line)
        assert lines[i - 1].strip().startswith("# without ckpt: state, start = "), lines[i - 1]
        main = lines[next(i for i, line in enumerate(lines) if line.startswith("def main(")) :]
        # the comment "# without ckpt: <code>" above restore_or is <code> in the loop without checkpoints
        rest = [line.replace("# without ckpt: ", "") for line in main if not line.endswith("  # ckpt")]
        shown = 'logging.getLogger("flax_ckpt").setLevel('  # which log lines show: the example's own choice
        assert not [
            line
            for line in rest
            if ("ckpt" in line or "Checkpoint" in line) and not line.strip().startswith(shown)
        ], script


# ---------------------------------------------------------- the guide's loop snippets (docs/resuming.md), run


def readme_snippet(marker: str) -> str:
    """The ```python block of the "Resuming" guide (docs/resuming.md) that holds ``marker``."""
    page = (ROOT / "docs" / "resuming.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if marker in b]
    return code


@pytest.mark.filterwarnings("ignore::UserWarning")  # orbax: "Sharding info not provided"
def test_readme_snippet_continues_an_orbax_run_of_named_items(tmp_path):
    """The README's dict-of-items target: an Orbax run of args.Composite(state=..., meta=...) resumes into
    {"state": ..., "meta": ...}, trains on, and Orbax's own Composite restore reads the step written."""
    ocp = pytest.importorskip("orbax.checkpoint")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from flax_ckpt.callbacks import CheckpointCallback

    @jax.jit
    def train_step(state, batch):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((batch * w - 1.0) ** 2))(state["params"]["w"])
        return {
            "params": {"w": state["params"]["w"] - 0.1 * grad, "b": state["params"]["b"] + 1},
            "count": state["count"] + 1,
        }, {"loss": loss}

    def batch_at(step):
        return np.random.default_rng(step).standard_normal(4).astype(np.float32)

    rng = np.random.default_rng(0)
    saved = {
        "params": {"w": jnp.asarray(rng.standard_normal(4), jnp.float32), "b": jnp.full(2, 3, jnp.bfloat16)},
        "count": jnp.int32(3),
    }
    meta = {"lr": 0.1, "model": "mlp", "data": {"index": 3}}
    run_dir = tmp_path / "orbax_run"
    with ocp.CheckpointManager(run_dir, item_names=("state", "meta")) as mgr:
        mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(saved), meta=ocp.args.JsonSave(meta)))
    fresh = jax.tree_util.tree_map(jnp.zeros_like, saved)
    ns = {
        "CheckpointCallback": CheckpointCallback,
        "orbax_run_dir": str(run_dir),
        "state": fresh,
        "meta": {"lr": 0.0, "model": "", "data": {"index": 0}},
        "num_steps": 7,
        "train_step": train_step,
        "batch_at": batch_at,
    }
    exec(readme_snippet('restore_or({"state": state, "meta": meta})'), ns)
    assert ns["start"] == 3 and ns["meta"] == meta
    expected = saved  # the uninterrupted run: Orbax's step 3, then steps 3..6
    for step in range(3, 7):
        expected, _ = train_step(expected, batch_at(step))
    assert leaf_bytes(ns["state"]) == leaf_bytes(expected)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved)
    with ocp.CheckpointManager(run_dir, item_names=("state", "meta")) as mgr:
        assert mgr.all_steps() == [3, 7]
        theirs = mgr.restore(
            7, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
    assert leaf_bytes(theirs.state) == leaf_bytes(expected) and theirs.meta == meta


EPOCHS_PREAMBLE = '''
import hashlib, os, signal, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax_ckpt.callbacks import CheckpointCallback

directory, stop_in = sys.argv[1], int(sys.argv[2])  # stop_in: the step during which SIGTERM comes (0: none)
steps_per_epoch, num_epochs = 5, 3
data = np.random.default_rng(0).standard_normal((40, 3)).astype(np.float32)  # 5 batches of 8 an epoch


class Batches:
    """Shuffled batches, epoch after epoch; get_state()/set_state() give its position."""

    def __init__(self, data, batch_size, seed):
        self.data, self.batch_size, self.seed, self.epoch, self.index = data, batch_size, seed, 0, 0
        self.order = self.shuffle()

    def shuffle(self):
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.data))

    def __next__(self):
        if (self.index + 1) * self.batch_size > len(self.data):
            self.epoch, self.index = self.epoch + 1, 0
            self.order = self.shuffle()
        self.index += 1
        return self.data[self.order[(self.index - 1) * self.batch_size:self.index * self.batch_size]]

    def get_state(self):
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state):
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.order = self.shuffle()


tx = optax.adam(1e-2)


@jax.jit
def step_fn(state, batch):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch @ p["w"] - 1.0) ** 2))(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


calls = 0


def train_step(state, batch):
    global calls
    calls += 1
    print("batch", hashlib.sha256(np.ascontiguousarray(batch).tobytes()).hexdigest()[:16], flush=True)
    if calls == stop_in:
        os.kill(os.getpid(), signal.SIGTERM)  # preempted during this step
    return step_fn(state, batch)


params = {"w": jnp.zeros(3, jnp.float32)}
state = {"params": params, "opt": tx.init(params)}
batches = Batches(data, batch_size=8, seed=1)
'''


def test_readme_snippet_resumes_a_loop_of_epochs_mid_epoch_bit_exact(tmp_path):
    """The README's nested epoch/step loop, as a real program: SIGTERM in a random step inside an
    epoch, a restart; the batches seen and every checkpoint are those of an uninterrupted run. Slow
    (tens of seconds): three real runs of the program (the interrupted one, its restart and an
    uninterrupted one), each a process that imports JAX and compiles."""
    script = tmp_path / "epochs.py"
    script.write_text(EPOCHS_PREAMBLE + readme_snippet("steps_per_epoch") + 'print("done", flush=True)\n')
    total = 15  # steps_per_epoch * num_epochs
    at = random.choice([s for s in range(2, total) if s % 5])
    context = f"SIGTERM in step {at} (epoch {at // 5}, step {at % 5} of it)"

    def child(directory: Path, stop_in: int = 0) -> tuple[int, str]:
        return run([sys.executable, str(script), str(directory), str(stop_in)])

    def batches(out: str) -> list[str]:
        return [line.split()[1] for line in out.splitlines() if line.startswith("batch ")]

    status, ref_out = child(tmp_path / "reference")
    assert status == 0 and "done" in ref_out and len(batches(ref_out)) == total, ref_out[-3000:]
    status, first = child(tmp_path / "run", stop_in=at)
    assert status == 128 + signal.SIGTERM and len(batches(first)) == at, (
        f"{context}: {status}\n{first[-3000:]}"
    )
    status, second = child(tmp_path / "run")
    assert status == 0 and f"resumed from step {at} of" in second, f"{context}\n{second[-3000:]}"
    assert batches(first) + batches(second) == batches(ref_out), context  # the same batches, in order
    ref, got = checkpoints(tmp_path / "reference"), checkpoints(tmp_path / "run")
    assert sorted(got) == [at, total] and sorted(ref) == [total], (context, sorted(got))
    assert got[total] == ref[total], f"{context}: the final checkpoint differs from the uninterrupted run's"
    assert "['data']['epoch']" in got[total] and got[total]["['data']['epoch']"] == ("int", 2), list(
        got[total]
    )
