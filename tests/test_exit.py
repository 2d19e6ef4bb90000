"""The end of a run (issue 26, items 2 and 17): a CheckpointManager nobody closed, and the lock file.

Item 2: a script that saves with a manager (sync, async, tiered, one whose save is still in flight, one
whose save fails) and ends without ``close()`` exits 0 without a traceback on stderr; its steps are
committed and restore bit-exact, the directory is free at once, and a save that failed is named on
stderr. A manager dropped mid-script (no garbage collection) frees its directory at once, tiers too.
Each case runs in a real child process: interpreter exit is what is tested.

Item 17: ``.flax_ckpt.lock`` stays in a native run's directory after a clean close (on purpose:
storage/lock.py), and the manager, ``flax-ckpt ls`` and ``flax-ckpt prune`` pass over it in silence.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import flax_ckpt as fc
from flax_ckpt._src.storage.lock import LOCK_FILE
from flax_ckpt._src.tiers.holdings import RUN_FILE
from flax_ckpt._src.tools import list_memory_tiers, list_steps
from flax_ckpt._src.tools.cli import main as cli
from helpers import assert_bit_exact, crash_state, step_state, worker_env

TIMEOUT_S = 240
SHAPE = (64, 33)

CHILD = textwrap.dedent("""
    import errno, gc, sys, time
    import flax_ckpt as fc
    from helpers import AfterWrite, assert_bit_exact, crash_state, step_state

    root, case = sys.argv[1], sys.argv[2]
    SHAPE = (64, 33)

    def slow_disk(written):  # the save is still in flight when the script ends
        time.sleep(1.0)

    def full_disk(written):
        time.sleep(0.5)
        raise OSError(errno.ENOSPC, "No space left on device")

    if case == "left-open":  # four managers, none closed
        managers = [fc.CheckpointManager(f"{root}/sync", async_save=False), fc.CheckpointManager(f"{root}/async"),
                    fc.CheckpointManager(f"{root}/tiered", tiers=fc.Tiers(local_dir=f"{root}/shm"))]
        for seed, mgr in enumerate(managers, 1):
            mgr.save(1, step_state(1, SHAPE, seed))
        managers.append(fc.CheckpointManager(f"{root}/slow", serializer=AfterWrite(1, slow_disk)))
        managers[-1].save(1, crash_state(1))
    elif case == "failing":
        full = fc.CheckpointManager(f"{root}/full", serializer=AfterWrite(1, full_disk))
        full.save(1, crash_state(1))
    elif case == "dropped":  # no collection runs: a dropped manager must let go of its directory itself
        gc.disable()
        for seed, name, tiers in ((4, "plain", None), (5, "tiered", fc.Tiers(local_dir=f"{root}/shm"))):
            mgr = fc.CheckpointManager(f"{root}/{name}", tiers=tiers)
            mgr.save(1, step_state(1, SHAPE, seed))
            mgr.wait_until_finished()
            del mgr
            again = fc.CheckpointManager(f"{root}/{name}", tiers=tiers)  # at once: no CheckpointLockedError
            assert again.all_steps() == [1], again.all_steps()  # tiered: from the memory tiers it left
            assert_bit_exact(again.restore(1), step_state(1, SHAPE, seed), types=False)
            again.save(2, step_state(2, SHAPE, seed), force=True)
            again.close()

        def train(directory):  # returns while its manager's migration is in flight (a slow disk)
            mgr = fc.CheckpointManager(directory, tiers=fc.Tiers(local_dir=f"{root}/shm", persist_interval_steps=1),
                                       serializer=AfterWrite(1, slow_disk))
            mgr.save(1, step_state(1, SHAPE, 6))
            time.sleep(0.3)

        train(f"{root}/migrating")
        for _ in range(300):  # free once the migration is done (it used to deadlock here, and at exit)
            try:
                fc.CheckpointManager(f"{root}/migrating").close()
                break
            except fc.CheckpointLockedError:
                time.sleep(0.1)
    print("end of script", flush=True)
""")


def run_child(tmp_path, case: str) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), case],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=worker_env(devices=1),
    )


def assert_quiet_exit(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0 and "end of script" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def reopen(directory) -> fc.CheckpointManager:
    """A manager of ``directory``, opened at once: CheckpointLockedError if the child still held it."""
    return fc.CheckpointManager(directory)


def test_managers_left_open_exit_silently_with_their_steps_committed(tmp_path):
    """Sync, async, tiered and a save still in flight at exit (a slow disk): exit 0, nothing on stderr;
    each step committed and bit-exact, each directory free; the tiered manager closed as close() does
    (its step migrated to the directory, its memory tiers removed)."""
    r = run_child(tmp_path, "left-open")
    assert_quiet_exit(r)
    assert not r.stderr.strip(), r.stderr
    saved = {
        "sync": step_state(1, SHAPE, 1),
        "async": step_state(1, SHAPE, 2),
        "tiered": step_state(1, SHAPE, 3),
        "slow": crash_state(1),
    }
    for name, want in saved.items():
        with reopen(tmp_path / name) as mgr:
            assert mgr.all_steps() == [1], name
            assert_bit_exact(mgr.restore(1), want, types=False)
        run_file = [RUN_FILE] if name == "tiered" else []  # the run's identity, kept for its memory tiers
        assert sorted(os.listdir(tmp_path / name)) == sorted([LOCK_FILE, "1", *run_file]), name  # no staging
    assert list_memory_tiers(tmp_path / "tiered", str(tmp_path / "shm")) == []


def test_a_save_failing_at_exit_is_named_on_stderr_without_a_traceback(tmp_path):
    r = run_child(tmp_path, "failing")
    assert_quiet_exit(r)
    assert f"CheckpointManager({tmp_path / 'full'}) was not closed" in r.stderr, r.stderr
    assert "step 1" in r.stderr and "No space left on device" in r.stderr and "not committed" in r.stderr, (
        r.stderr
    )
    with reopen(tmp_path / "full") as mgr:  # free; the crashed save's folder is removed, nothing committed
        assert mgr.all_steps() == []


def test_a_dropped_manager_frees_its_directory_at_once(tmp_path):
    """``del mgr`` without close() and without garbage collection: a new manager opens the directory at
    once (a tiered one held itself in a reference cycle, keeping the lock until a collection), and reads
    the step the dropped one left in the memory tiers; one dropped during its migration lets go of the
    directory when the migration is done."""
    r = run_child(tmp_path, "dropped")
    assert_quiet_exit(r)
    for seed, name in ((4, "plain"), (5, "tiered")):
        with reopen(tmp_path / name) as mgr:
            assert mgr.all_steps() == ([1, 2] if name == "plain" else [2]), (
                name
            )  # tiered: 1 was in memory only
            assert_bit_exact(mgr.restore(2), step_state(2, SHAPE, seed), types=False)
    with reopen(tmp_path / "migrating") as mgr:
        assert_bit_exact(mgr.restore(1), step_state(1, SHAPE, 6), types=False)


# ------------------------------------------------------------------------------------- item 17: lock file


def cli_out(capsys, *args: str) -> str:
    assert cli(list(args)) == 0
    out, err = capsys.readouterr()
    assert not err.strip(), err
    return out


def test_the_lock_file_stays_and_ls_prune_and_the_manager_ignore_it(tmp_path, capsys, caplog, recwarn):
    run = tmp_path / "run"
    with fc.CheckpointManager(run) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, step_state(step, SHAPE, 6))
        mgr.wait_until_finished()
        assert [e.name for e in list_steps(run)] == ["1", "2", "3"]  # while held too
    lock = run / LOCK_FILE
    assert lock.is_file() and lock.read_text().startswith("pid ")  # kept: it holds only the last holder's pid
    caplog.set_level(logging.DEBUG, logger="flax_ckpt")

    assert LOCK_FILE not in cli_out(capsys, "ls", str(run))
    assert [s["name"] for s in json.loads(cli_out(capsys, "ls", str(run), "--json", "-q"))["steps"]] == [
        "1",
        "2",
        "3",
    ]
    pruned = json.loads(cli_out(capsys, "prune", str(run), "--keep", "1", "--json", "-q"))
    assert pruned["deleted"] == [1, 2] and pruned["kept"] == [3]
    assert sorted(os.listdir(run)) == [LOCK_FILE, "3"]
    with fc.CheckpointManager(run) as mgr:
        assert mgr.all_steps() == [3]

    shutil.rmtree(run / "3")  # a directory holding nothing but the lock file
    assert json.loads(cli_out(capsys, "ls", str(run), "--json", "-q"))["steps"] == []
    assert json.loads(cli_out(capsys, "prune", str(run), "--keep", "1", "--json", "-q"))["kept"] == []
    with fc.CheckpointManager(run) as mgr:
        assert mgr.all_steps() == [] and mgr.latest_step() is None
    assert sorted(os.listdir(run)) == [LOCK_FILE]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [str(w.message) for w in recwarn] == []


@pytest.mark.parametrize("tidy", [False, True])
def test_release_works_after_module_teardown(tmp_path, monkeypatch, tidy):
    """What a manager nobody closed meets in interpreter teardown: storage/lock.py's globals set to None."""
    from flax_ckpt._src.storage import lock as lock_mod

    held = lock_mod.DirectoryLock(str(tmp_path), tidy=tidy)
    monkeypatch.setattr(lock_mod, "fcntl", None)
    monkeypatch.setattr(lock_mod, "os", None)
    held.release()
    monkeypatch.undo()
    assert (tmp_path / LOCK_FILE).exists() != tidy
    lock_mod.DirectoryLock(str(tmp_path)).release()  # free
