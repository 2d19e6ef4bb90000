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
from helpers import leaf_bytes, worker_env

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
STEPS, EVERY = 600, 50  # ~0.3 ms a step: the margin between the signal and the end of the run
TIMEOUT_S = 120


def train_cmd(script: str, directory: Path) -> list[str]:
    return [sys.executable, str(EXAMPLES / script), "--directory", str(directory), "--steps", str(STEPS),
            "--every", str(EVERY), "--log-every", "1"]


def run(cmd: list[str], *, signal_at: int | None = None, sig: int = signal.SIGTERM) -> tuple[int, str]:
    """Runs ``cmd``; sends ``sig`` once it prints ``step <signal_at>``. Returns (status, output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=worker_env(devices=1))  # one CPU device, as a user has
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
    at = random.randint(EVERY + 1, STEPS // 3)
    context = f"train_nnx.py: SIGTERM after step {at}"
    status, out = run(train_cmd("train_nnx.py", tmp_path), signal_at=at, sig=signal.SIGTERM)
    saved = check_preempted_run(status, out, at, tmp_path, context)
    status, out = run(train_cmd("train_nnx.py", tmp_path))
    assert status == 0 and f"resumed from step {saved} " in out, f"{context}\n{out[-3000:]}"
    assert_same_run(reference("train_nnx.py"), tmp_path, out, context)


def test_linen_sigterm_at_a_random_step_via_the_preemption_demo_is_bit_identical(tmp_path, reference):
    """examples/preemption_demo.py sends SIGTERM to train_linen.py at a random step and restarts it."""
    at = 10 * random.randint(EVERY // 10 + 1, STEPS // 30)  # the demo's child reports every 10 steps
    context = f"preemption_demo.py: SIGTERM after step {at}"
    cmd = [sys.executable, str(EXAMPLES / "preemption_demo.py"), "--directory", str(tmp_path), "--steps",
           str(STEPS), "--every", str(EVERY), "--at", str(at)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * TIMEOUT_S, env=worker_env(devices=1))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{context}\n{out[-3000:]}"
    saved = re.search(r"run 1 saved step (\d+) and exited with status 143", out)
    assert saved and int(saved[1]) >= at and f"run 2 resumed from step {saved[1]} " in out, out[-3000:]
    assert_same_run(reference("train_linen.py"), tmp_path, out, context)


def test_linen_sigkill_resumes_from_last_scheduled_checkpoint_bit_identical(tmp_path, reference):
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
    the per-step call and the final close) and what is left of ``main`` is a plain training loop."""
    for script in ["train_linen.py", "train_nnx.py"]:
        lines = (EXAMPLES / script).read_text().splitlines()
        marked = [line.strip() for line in lines if line.endswith("  # ckpt")]
        assert len(marked) == 5, marked
        assert marked[0] == "from flax_ckpt.callbacks import CheckpointCallback  # ckpt"
        assert marked[1].startswith("ckpt = CheckpointCallback(")
        assert ".restore_or(" in marked[2] and marked[3].startswith("ckpt(step + 1, ")
        assert marked[4] == "ckpt.close()  # ckpt"
        main = lines[next(i for i, line in enumerate(lines) if line.startswith("def main(")):]
        rest = [line for line in main if not line.endswith("  # ckpt")]
        assert not [line for line in rest if "ckpt" in line or "Checkpoint" in line], script
