"""Child processes of the reliability suite, and the parent's handle on them.

Scope: processes that save, restore or churn checkpoints until a test faults them (SIGKILL, SIGTERM),
and nothing that judges the result (tests/reliability_trials.py does). Two ways to start one:

- ``Zygote``: one long-lived process that has paid the imports (jax, flax_ckpt) once and forks a child
  per trial, so hundreds of SIGKILL trials cost the save loop, not the interpreter start. Used for
  children that die by SIGKILL, whose exit path never runs.
- ``spawn``: a fresh interpreter (``python harness/reliability_worker.py SCENARIO DIR ...``), for
  children whose exit path is under test (SIGTERM handlers, interpreter shutdown joining the writer thread).

A child prints protocol lines on stdout: "started", "committed <step>" once a step is durable,
"inflight <step>" once ``save`` returned with the step in flight, "restoring", "handled" (its SIGTERM
handler finished waiting). States are deterministic functions of the step, so any process can check
a restore bit for bit.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable

import numpy as np

HARNESS = os.path.dirname(os.path.abspath(__file__))
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # harness/: basics, when run as a script

from basics import crash_state, die_with_parent, shared_state, step_state, worker_env  # noqa: E402

CRASH_KEEP = {"max_to_keep": 3, "keep_period": 5}  # retention of the crash children


def small_state(step: int) -> dict:
    """A 256 KiB state for fast churn (many commits and deletions per second)."""
    return {**step_state(step, (256, 256), 10_000), "tag": np.full((7,), step % 251, np.uint8)}


def big_state(step: int) -> dict:
    """A 32 MiB state, so a save stays in flight long enough for a signal to land in it."""
    return step_state(step, (2048, 4096), 20_000)


STATES: dict[str, Callable[[int], dict]] = {
    "crash": crash_state,
    "shared": shared_state,
    "small": small_state,
    "big": big_state,
}


def say(line: str) -> None:
    """One protocol line, in one write() (atomic on a pipe: a zygote and its child share stdout)."""
    os.write(1, (line + "\n").encode())


# ------------------------------------------------------------------------------------ child scenarios


def crash_tiers(directory: str):
    """The memory tier of a crash run: a folder beside ``directory`` (a host tmpfs in production),
    every third step migrated to the directory, nothing deleted at close (the next process resumes)."""
    import flax_ckpt as fc

    return fc.Tiers(
        local_dir=directory + ".shm", peer=False, persist_interval_steps=3, max_to_keep=2, cleanup=False
    )


def crash_loop(directory: str, serializer: str, state: str = "crash", tiers: str = "none") -> None:
    """Async manager saves with retention, forever; reports each step once it is durable.
    ``tiers`` "tiers": through a memory tier (crash_tiers) as well as the directory."""
    import flax_ckpt as fc

    say("started")  # before the manager opens: a kill may also land in its scan and cleanup
    make = STATES[state]
    keep = dict(CRASH_KEEP if state in ("crash", "shared") else {"max_to_keep": 2})
    if tiers == "tiers":
        keep["tiers"] = crash_tiers(directory)
    with fc.CheckpointManager(directory, serializer=serializer, **keep) as mgr:
        step = (mgr.latest_step() or 0) + 1
        while True:
            mgr.save(step, make(step))
            if step > 1 and (step - 1) in mgr.all_steps():
                say(f"committed {step - 1}")  # the previous save is durable once this one started
            step += 1


def sigterm_child(directory: str, scenario: str, serializer: str) -> None:
    """Saves (or restores) in a loop; its SIGTERM handler waits for the save in flight and exits 0.

    scenario "save": async saves of big states, "inflight <step>" after each; "restore": one
    committed step, then restores of it in a loop."""
    import flax_ckpt as fc

    mgr = fc.CheckpointManager(directory, serializer=serializer)

    def on_sigterm(signum, frame) -> None:
        mgr.wait_until_finished()
        mgr.close()
        say("handled")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    if scenario == "restore":
        mgr.save(1, big_state(1))
        mgr.wait_until_finished()
        say("restoring")
        while True:
            mgr.restore()
    step = (mgr.latest_step() or 0) + 1
    say("started")
    while True:
        mgr.save(step, big_state(step))
        say(f"inflight {step}")
        step += 1


SCENARIOS: dict[str, Callable[..., None]] = {"crash": crash_loop, "sigterm": sigterm_child}


# ------------------------------------------------------------------------------------------ zygote


def zygote_main() -> None:
    """Reads "fork SCENARIO ARGS..." / "reap PID" / "quit" from stdin; forks children that run a
    scenario with this process's imports already done. Replies "pid P" and "reaped P RC"."""
    import flax_ckpt  # noqa: F401  (the import every child would otherwise pay)

    die_with_parent()
    say("ready")
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "fork":
            pid = os.fork()
            if pid == 0:
                _run_child(args)
            say(f"pid {pid}")
        elif cmd == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            say(f"reaped {args[0]} {os.waitstatus_to_exitcode(status)}")
        elif cmd == "quit":
            return


def _run_child(args: list[str]) -> None:
    code = 0
    try:
        die_with_parent()
        SCENARIOS[args[0]](*args[1:])
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        os._exit(code)


class Lines:
    """The stdout of a child process, line by line, with timeouts (a reader thread feeds a queue)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.q = proc, queue.Queue()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def next(self, timeout: float) -> str | None:
        """The next line; None at end of output; raises TimeoutError after ``timeout`` s."""
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output from pid {self.proc.pid} within {timeout:.0f} s") from None

    def until(self, want: Callable[[str], bool], timeout: float, seen: list[str]) -> str:
        """Reads lines (appending each to ``seen``) until one satisfies ``want``; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next(max(0.01, deadline - time.monotonic()))
            if line is None:
                raise EOFError(f"pid {self.proc.pid} ended its output; seen: {seen[-5:]}")
            seen.append(line)
            if want(line):
                return line


def stop(proc: subprocess.Popen) -> None:
    """Kills a child this suite started (by its pid) and waits for it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


class Zygote:
    """A forking server of children (see the module docstring). Use as a context manager."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(),
        )
        self.lines = Lines(self.proc)
        try:
            self.lines.until(lambda s: s == "ready", 120, [])
        except BaseException:
            stop(self.proc)
            raise

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def fork(self, *args: str, ready: str = "started", timeout: float = 60) -> tuple[int, list[str]]:
        """Forks a child running SCENARIOS[args[0]](*args[1:]); returns its pid once it printed
        ``ready`` (and the lines seen so far)."""
        self._send("fork " + " ".join(args))
        seen: list[str] = []
        pid_line = self.lines.until(lambda s: s.startswith("pid "), timeout, seen)
        if ready not in seen:
            self.lines.until(lambda s: s == ready, timeout, seen)
        return int(pid_line.split()[1]), seen

    def kill(self, pid: int, seen: list[str], sig: int = signal.SIGKILL, timeout: float = 60) -> int:
        """Sends ``sig`` to a child, reaps it, and returns its exit code; its remaining output (every
        line it wrote before it died) is appended to ``seen``."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        self._send(f"reap {pid}")
        line = self.lines.until(lambda s: s.startswith(f"reaped {pid} "), timeout, seen)
        seen.remove(line)
        return int(line.split()[2])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop(self.proc)


def spawn(*args: str) -> tuple[subprocess.Popen, Lines]:
    """A fresh interpreter running SCENARIOS[args[0]](*args[1:]) (see the module docstring)."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=worker_env(),
    )
    return proc, Lines(proc)


if __name__ == "__main__":
    die_with_parent()
    if sys.argv[1] == "zygote":
        zygote_main()
    else:
        SCENARIOS[sys.argv[1]](*sys.argv[2:])
