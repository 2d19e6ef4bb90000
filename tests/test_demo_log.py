"""The demo's log speaks to a user: what was saved and restored, and what to try next.

scripts/demo.sh runs examples/train_linen.py, whose log shows flax_ckpt's INFO lines. Those lines say
what happened in a user's words (the step, where, its size, how long training waited), not the
library's internals (environment variables, the snapshot's placement on a CPU, a throughput that
rounds to zero, tier names); the script ends by saying where the checkpoints are and what to run
next.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import forkserver
from helpers import worker_env

ROOT = Path(__file__).resolve().parent.parent
INTERNAL = ("FLAX_CKPT_", "GB/s", "tier)", "snapshots are taken", "MiB on device")


def _train(directory: Path) -> str:
    env = worker_env(devices=1)
    env.pop("JAX_PLATFORMS", None)  # as a user runs it
    cmd = [sys.executable, str(ROOT / "examples" / "train_linen.py"), "--directory", str(directory)]
    cmd += ["--steps", "40", "--every", "20", "--log-every", "20"]
    proc = forkserver.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_the_demo_log_says_what_happened_in_users_words(tmp_path):
    """The example's log says what was saved and restored in a user's words, naming no internal. Slow (tens
    of seconds): two real runs of examples/train_linen.py in which JAX looks for its backends, as for a
    user."""
    first = _train(tmp_path / "run")
    assert re.search(r"saved step 20 to \S+run \([\d.]+ MB\): training waited [\d.]+ ms", first), first
    second = _train(tmp_path / "run")
    assert re.search(r"restored step 40 from \S+run: [\d.]+ MB in [\d.]+ s", second), second
    for word in INTERNAL:
        assert word not in first + second, f"{word!r} in the demo's log:\n{first}{second}"


def test_the_demo_ends_with_where_the_checkpoints_are_and_what_to_try_next():
    script = (ROOT / "scripts" / "demo.sh").read_text()
    tail = script[script.index("train_linen.py") :]
    assert "The checkpoints are in $DIR/" in tail and "flax-ckpt ls $DIR" in tail, tail
    assert not script.rstrip().splitlines()[-1].startswith("exec "), "nothing runs after an exec"
