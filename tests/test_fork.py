"""Forked children leave the parent's run alone (issue 51, item 1).

A data loader's workers are forked from the training process (multiprocessing's fork start method, a
Pool, ``os.fork()``); they inherit its open CheckpointManager and CheckpointCallback, and used to close
them when they exited: the child released the parent's directory lock, migrated and deleted its memory
copies, saved its last step, and hung at exit when forked during a save. Each case runs in a real child
process (interpreter exit is what is tested), with real Pool workers and real forks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers import worker_env

TIMEOUT_S = 240

BESIDE_POOL = textwrap.dedent("""
    import multiprocessing as mp, os, sys
    import numpy as np
    import flax_ckpt as fc
    from flax_ckpt.callbacks import CheckpointCallback
    from helpers import assert_bit_exact

    root, method = sys.argv[1], sys.argv[2]
    tiers = fc.Tiers(local_dir=f"{root}/shm", persist_interval_steps=None, on_busy="wait")
    mgr = fc.CheckpointManager(f"{root}/run", tiers=tiers)
    base = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "b": np.ones(1000, np.float32)}
    mgr.save(1, base)
    mgr.wait_until_finished()
    cb = CheckpointCallback(f"{root}/cb", every_steps=100)
    cb(7, {"w": np.full(3, 7.0, np.float32)})  # off the schedule: the callback's close saves it

    with mp.get_context(method).Pool(2) as pool:  # workers that do their work and exit normally
        assert pool.map(abs, range(-4, 0)) == [4, 3, 2, 1]
        pool.close()
        pool.join()

    pid = os.fork()
    if pid == 0:  # a child that calls into the inherited manager and callback, then exits normally
        refused = []
        for call in (lambda: mgr.save(2, base, force=True), mgr.close, lambda: mgr.restore(1), cb.close):
            try:
                call()
            except fc.CheckpointError as e:
                refused.append("forked from process" in str(e) and str(os.getppid()) in str(e))
        sys.exit(0 if refused == [True] * 4 else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status

    try:  # the lock is still the parent's
        fc.CheckpointManager(f"{root}/run", tiers=tiers)
        raise AssertionError("a second manager opened the live run")
    except fc.CheckpointLockedError:
        pass
    assert mgr.all_steps() == [1] and not os.path.exists(f"{root}/run/1")  # not migrated by a child
    assert os.path.isdir(os.path.join(mgr.memory_tiers.local_dir, "1"))
    changed = dict(base, b=np.full(1000, 2.0, np.float32))
    mgr.save(2, changed)  # a differential copy against the memory copy of step 1
    mgr.wait_until_finished()
    assert_bit_exact(mgr.restore(2), changed)
    assert_bit_exact(mgr.restore(1), base)
    assert fc.CheckpointManager(f"{root}/cb", read_only=True).all_steps() == []  # nobody saved step 7 yet
    cb.close()
    mgr.close()
    print("parent done", flush=True)
""")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=worker_env(1),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_pool_workers_and_forked_children_leave_the_parents_run_alone(tmp_path, method):
    """Pool workers beside a tiered run and a callback exit without closing, migrating, deleting or
    saving anything; a forked child that calls save/close/restore gets a CheckpointError naming both
    processes; the parent keeps its lock, its memory copies and its differential steps, and its
    callback saves the last step once, at its own close."""
    done = _run(BESIDE_POOL, str(tmp_path), method)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "parent done"
    assert done.stderr.count("saved the last step 7") == 1, done.stderr[-3000:]  # by the parent only
    assert "Traceback" not in done.stderr and "was not closed" not in done.stderr, done.stderr[-3000:]
    import flax_ckpt as fc

    assert fc.CheckpointManager(tmp_path / "cb", read_only=True).all_steps() == [7]


DURING_SAVE = textwrap.dedent("""
    import os, sys, threading, time
    import numpy as np
    import flax_ckpt as fc
    from helpers import AfterWrite, assert_bit_exact, crash_state

    root = sys.argv[1]
    writing, release = threading.Event(), threading.Event()

    def held(written):  # the save stays in flight until the forked child has exited
        writing.set()
        release.wait()

    mgr = fc.CheckpointManager(f"{root}/run", serializer=AfterWrite(1, held))
    mgr.save(1, crash_state(1))
    writing.wait()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal exit: atexit hooks, weakref finalizers, module teardown
    for _ in range(6000):  # the child exits at once; a hung child never does (then: reported below)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("the forked child hung at exit", flush=True)
        sys.exit(4)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert mgr.all_steps() == [], mgr.all_steps()  # not committed by the child
    release.set()
    mgr.wait_until_finished()
    assert_bit_exact(mgr.restore(1), crash_state(1))
    try:
        fc.CheckpointManager(f"{root}/run")
        raise AssertionError("a second manager opened the live run")
    except fc.CheckpointLockedError:
        pass
    mgr.close()
    print("parent done", flush=True)
""")


def test_a_child_forked_during_a_save_exits_without_hanging_and_the_save_commits(tmp_path):
    """``os.fork()`` while the writer thread is in the middle of a save: the child exits at once (it
    used to wait forever for the parent's writer, which does not exist in the child), and the
    parent's save commits, restores bit-exact, and its lock stays held."""
    done = _run(DURING_SAVE, str(tmp_path))
    assert done.returncode == 0, done.stdout[-500:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "parent done"


CREDENTIALS = textwrap.dedent("""
    import os, sys
    from flax_ckpt._src.storage import endpoints

    profile = endpoints._profile_for_keys("AKIDEXAMPLE", "secret", None)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal exit: atexit hooks run
    os.waitpid(pid, 0)
    print(os.path.exists(profile["credentials_file"]), profile["credentials_file"], flush=True)
""")


def test_a_forked_child_leaves_the_parents_object_store_credentials_in_place(tmp_path):
    """Explicit object-store keys live in a private file removed at exit: by the process that made it,
    not by a forked child exiting first (the parent's next request would find no credentials)."""
    done = _run(CREDENTIALS)
    assert done.returncode == 0, done.stderr[-3000:]
    there, path = done.stdout.split()
    assert there == "True"
    assert not os.path.exists(path)  # the parent removed it at its own exit
