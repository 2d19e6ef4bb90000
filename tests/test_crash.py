"""SIGKILL at random moments of saves: the directory always restores to a committed step, bit-exact."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from helpers import WORKERS, assert_bit_exact, crash_state, worker_env

KILLS = int(os.environ.get("FLAX_CKPT_CRASH_KILLS", "6"))


_PACE: dict[str, float] = {}  # seconds per commit of each mode's worker, as measured in this run


def run_and_kill(directory: str, mode: str, rng: random.Random, start: int = 1) -> int:
    """Starts the worker and SIGKILLs it at a random moment counted in its progress, not in seconds (a
    busy machine moves it with the worker): after 0 to 2 commits (0: during its first save), plus a
    random fraction of one commit's time as measured in this run. Returns the newest step it had
    reported committed (0 if none)."""
    proc = forkserver.Popen(
        [sys.executable, str(WORKERS / "crash_worker.py"), directory, mode, str(start)],
        stdout=subprocess.PIPE,
        text=True,
        env=worker_env(),
    )
    lines: list[str] = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        commits, t0 = rng.randint(0, 2), time.monotonic()
        while sum(ln.startswith("committed") for ln in lines) < commits:
            line = proc.stdout.readline()  # a hang here is the test's timeout
            assert line, f"the worker exited before its commit {len(lines) + 1}: {lines[-3:]}"
            lines.append(line)
        if commits:
            _PACE[mode] = (time.monotonic() - t0) / commits
        time.sleep(rng.uniform(0.0, _PACE.get(mode, 0.0)))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    steps = [int(line.split()[1]) for line in [*lines, *out.splitlines()] if line.startswith("committed")]
    return max(steps, default=0)


def committed_steps(directory: str) -> list[int]:
    return sorted(int(e) for e in os.listdir(directory) if e.isdigit())


@pytest.mark.timeout(300)
def test_sigkill_during_plain_saves_never_leaves_a_readable_partial(tmp_path):
    """SIGKILL at random moments of fc.save: what is committed restores bit-exact, what is not is refused.
    Slow (tens of seconds): KILLS saver processes, each killed after a random number of commits."""
    rng = random.Random(1234)
    directory = str(tmp_path)
    start, saves = 1, 0
    for _ in range(KILLS):
        reported = run_and_kill(directory, "save", rng, start)
        steps = committed_steps(directory)
        assert reported <= (steps[-1] if steps else 0)  # what the worker saw committed is there
        for s in steps:  # every visible step restores bit-exact: the old ones and the new one
            assert_bit_exact(fc.restore(os.path.join(directory, str(s))), crash_state(s))
        for e in os.listdir(directory):  # anything else is a tmp folder, refused as a checkpoint
            if not e.isdigit():
                assert ".tmp-" in e
                with pytest.raises(fc.CheckpointNotCommittedError):
                    fc.restore(os.path.join(directory, e))
        saves += len(steps) - (start - 1)
        start = (steps[-1] if steps else 0) + 1
    assert saves > 0, "the worker never committed a save: the kills came too early to test anything"


@pytest.mark.timeout(300)
def test_sigkill_during_async_manager_saves_restores_newest_committed(tmp_path):
    """SIGKILL at random moments of async manager saves: the newest committed step restores bit-exact and
    nothing half-written is left. Slow (tens of seconds): KILLS saver processes, each killed after a
    random number of commits."""
    rng = random.Random(99)
    directory = str(tmp_path)
    newest_reported = 0
    for _ in range(KILLS):
        newest_reported = max(newest_reported, run_and_kill(directory, "manager", rng))
        with fc.CheckpointManager(directory, max_to_keep=3, keep_period=5) as mgr:
            steps = mgr.all_steps()
            assert not [e for e in os.listdir(directory) if ".tmp-" in e or ".deleting-" in e]
            if newest_reported:
                assert steps and steps[-1] >= newest_reported
            if steps:
                latest = mgr.latest_step()
                assert_bit_exact(mgr.restore(), crash_state(latest))
                recent = [s for s in steps if s % 5]
                assert len(recent) <= 4  # max_to_keep (3), plus one whose deletion the kill interrupted
                np.testing.assert_array_equal(mgr.restore(steps[0])["w"], crash_state(steps[0])["w"])
