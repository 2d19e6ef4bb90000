"""Preemption, end to end: training gets SIGTERM mid-run, saves, exits; a restart resumes and finishes.

    python examples/preemption_demo.py [--directory DIR] [--steps 600] [--at 250]

This script plays the cluster scheduler. It starts examples/train_linen.py as a subprocess, sends it
SIGTERM once it reports step --at (as a scheduler does before evicting a job), and watches it finish
the step in progress, save it, and exit with status 143. Then it starts the same command again: the new
process resumes from the saved step and completes the run. Only the standard library is imported here.
Without --directory it works in a new temporary folder, removed when the demo succeeds (named when
it fails, for a look).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Sequence

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_linen.py")
TIMEOUT_S = 300


def run(cmd: list[str], label: str, *, signal_at: int | None = None) -> tuple[int, str]:
    """Runs ``cmd``, echoing its output with ``label``; sends SIGTERM after it prints ``step <signal_at>``.
    Returns (exit status, output). The child is killed if it outlives TIMEOUT_S."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "saved step" not in line:  # the manager's per-save statistics are long
                print(f"[{label}] {line}", end="", flush=True)
            if signal_at is not None and line.startswith(f"step {signal_at} "):
                print(f"[demo] sending SIGTERM to the training process (pid {proc.pid})", flush=True)
                proc.send_signal(signal.SIGTERM)
                signal_at = None
        return proc.wait(), "".join(lines)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--directory",
        help="checkpoint directory, kept (default: a new temporary one, removed after a successful demo)",
    )
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--at", type=int, default=250, help="send SIGTERM once this step is reported")
    args = p.parse_args(argv)
    if args.directory:
        return demo(args, args.directory)
    directory = tempfile.mkdtemp(prefix="preemption_demo_")
    status = demo(args, directory)
    if status == 0:
        shutil.rmtree(directory)  # the demo's own folder: nothing in it is worth keeping
    else:
        print(f"[demo] its checkpoints are kept for a look in {directory}", flush=True)
    return status


def demo(args: argparse.Namespace, directory: str) -> int:
    """Run 1 is preempted at step ``args.at``; run 2 must resume at the saved step and finish."""
    cmd = [
        sys.executable,
        TRAIN,
        "--directory",
        directory,
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--log-every",
        "10",
    ]
    print(f"[demo] run 1: {' '.join(cmd)}", flush=True)
    status, out = run(cmd, "run 1", signal_at=args.at)
    saved = re.search(r"preemption: step (\d+) is saved", out)
    if status != 128 + signal.SIGTERM or saved is None:
        print(f"[demo] FAILED: expected a preemption save and exit status 143, got status {status}")
        return 1
    print(f"[demo] run 1 saved step {saved[1]} and exited with status {status}; restarting", flush=True)
    status, out = run(cmd, "run 2")
    resumed = re.search(r"resumed from step (\d+)", out)
    if status != 0 or resumed is None or resumed[1] != saved[1]:
        print(f"[demo] FAILED: run 2 should resume from step {saved[1]} and finish; status {status}")
        return 1
    print(f"[demo] run 2 resumed from step {resumed[1]} and finished all {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
