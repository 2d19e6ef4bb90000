"""Memory tiers on a shared host (issue 24, item 5): another local user must not be able to plant a copy
that a restore reads. The tiers' folders are created with mode 0700 and checked with lstat; a folder
or file owned by another user, writable by group or others, or a symlink, is refused with a
StorageError naming it (at start for folders, by skipping the copy for a copy).

Tests run as root here, so "another user" is a real chown to an unused uid (skipped when chown is
not allowed); every case uses real folders, files and links.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src.tiers import store as tier_store
from helpers import assert_bit_exact, die_with_parent

OTHER = 12345  # a uid no account uses: "another local user"
POISON = 999


def state(v: float) -> dict[str, Any]:
    return {"w": np.full((64, 64), v, np.float32), "b": np.arange(16, dtype=np.float32) + v}


def tiers(local: str, **kw: Any) -> fc.Tiers:
    cfg = {"local_dir": local, "on_busy": "wait", "persist_interval_steps": None, "cleanup": False}
    return fc.Tiers(**{**cfg, **kw})


def chown_tree(path: str, uid: int = OTHER) -> None:
    """Gives ``path`` (and everything below) to ``uid``; skips the test where that is not allowed."""
    try:
        os.lchown(path, uid, uid)
        for root, dirs, files in os.walk(path):
            for n in dirs + files:
                os.lchown(os.path.join(root, n), uid, uid)
    except PermissionError:
        pytest.skip("chown to another uid needs root (CAP_CHOWN)")


def victim_run(tmp_path) -> tuple[str, str, str]:
    """The victim's run: steps 1 and 2 in local memory (nothing persistent). Returns (directory,
    local_dir, its process folder <local_dir>/<job>/p0)."""
    d, local = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    with fc.CheckpointManager(d, tiers=tiers(local)) as mgr:
        mgr.save(1, state(1.0))
        mgr.save(2, state(2.0))
        mgr.wait_until_finished()
        root = mgr.memory_tiers.root
    return d, local, root


def planted_copy(tmp_path) -> str:
    """A valid memory copy of step 999 holding poisoned weights, made by the attacker's own run
    (another directory, another local_dir): the folder ``<...>/local/999``."""
    local = str(tmp_path / "attacker-shm")
    with fc.CheckpointManager(tmp_path / "attacker-ckpt", tiers=tiers(local)) as mgr:
        mgr.save(POISON, state(-1e6))
        mgr.wait_until_finished()
        return os.path.join(mgr.memory_tiers.local_dir, str(POISON))


def owned_by_me(top: str) -> bool:
    me = os.geteuid()
    return all(os.lstat(os.path.join(r, n)).st_uid == me for r, ds, fs in os.walk(top) for n in ds + fs)


# ------------------------------------------------------------------------ planted job folder (the attack)


def test_a_job_folder_planted_by_another_user_is_refused_and_nothing_is_restored(tmp_path):
    """The reported attack: the job folder's name is sha256(directory)[:16], so another user creates it
    first, with a step-999 copy in it. The manager refuses to start, naming the folder and its owner;
    nothing of it is read, deleted or used."""
    d, local = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    with fc.CheckpointManager(
        d, tiers=fc.Tiers(local_dir=local, on_busy="wait", persist_interval_steps=1)
    ) as mgr:
        mgr.save(1, state(1.0))  # persisted; cleanup=True removes the memory tiers at close
        job = os.path.dirname(mgr.memory_tiers.root)
    assert not os.path.exists(job)
    planted = planted_copy(tmp_path)
    os.makedirs(os.path.join(job, "p0", "local"))
    shutil.copytree(planted, os.path.join(job, "p0", "local", str(POISON)))
    chown_tree(job)
    with pytest.raises(fc.StorageError) as info:
        fc.CheckpointManager(d, tiers=tiers(local))
    msg = str(info.value)
    assert f"job folder {job} is owned by uid {OTHER}" in msg and "mode 0o" in msg and "Fix:" in msg
    assert os.path.isdir(os.path.join(job, "p0", "local", str(POISON)))  # refused, not touched
    # a manager that failed to open released the directory: a retry opens it while the error is alive
    with fc.CheckpointManager(d) as mgr:  # the persistent steps are still there, and only they
        assert mgr.all_steps() == [1]
        assert_bit_exact(mgr.restore(target=state(0.0)), state(1.0))


# ------------------------------------------------------------------------- copies inside our own folder


def _index_link(copy: str, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(os.path.join(copy, tier_store.INDEX), outside / tier_store.INDEX)
    os.symlink(outside / tier_store.INDEX, os.path.join(copy, tier_store.INDEX))


PLANTS = {
    "copy-owned-by-another-user": lambda copy, tmp: chown_tree(copy),
    "data-file-owned-by-another-user": lambda copy, tmp: chown_tree(os.path.join(copy, tier_store.DATA)),
    "index-owned-by-another-user": lambda copy, tmp: chown_tree(os.path.join(copy, tier_store.INDEX)),
    "copy-folder-writable-by-others": lambda copy, tmp: os.chmod(copy, 0o777),
    "data-file-writable-by-others": lambda copy, tmp: os.chmod(os.path.join(copy, tier_store.DATA), 0o666),
    "index-is-a-symlink": _index_link,
    "data-file-hard-linked": lambda copy, tmp: os.link(os.path.join(copy, tier_store.DATA), tmp / "link"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_copy_in_our_folder_is_never_restored(tmp_path, caplog, plant):
    """A step-999 copy placed in the victim's own local tier (as only root or a lapse in the folder's
    mode allows), owned by another user, writable by others, or reached through a link: skipped with a
    warning naming it; the restore is the victim's newest step, bit-exact; the planted files are
    removed, never reused as the next copy's pages."""
    d, local, root = victim_run(tmp_path)
    target = os.path.join(root, "local", str(POISON))
    shutil.copytree(planted_copy(tmp_path), target)
    PLANTS[plant](target, tmp_path)
    caplog.set_level(logging.WARNING, "flax_ckpt")
    with fc.CheckpointManager(d, tiers=tiers(local)) as mgr:
        assert POISON not in mgr.all_steps()
        assert_bit_exact(mgr.restore(target=state(0.0)), state(2.0), types=False)
        assert mgr.restore_stats[-1].tier == "local"
        mgr.save(3, state(3.0))  # retention runs: spares are made of our own files only
        mgr.save(4, state(4.0))
        mgr.wait_until_finished()
        assert_bit_exact(mgr.restore(target=state(0.0)), state(4.0), types=False)
    assert f"ignoring memory copy {os.path.join(root, 'local')}/{POISON}" in caplog.text
    assert any(
        w in caplog.text
        for w in (f"uid {OTHER}", "writable by group or others", "symbolic link", "2 names (hard links)")
    )
    assert not os.path.exists(target) and owned_by_me(local)


def test_a_copy_read_after_start_is_checked_again(tmp_path):
    """Ownership is checked where a copy is read, not only at start: a copy changed hands after the
    manager opened is refused at restore (the manager falls back to the next step)."""
    d, local, root = victim_run(tmp_path)
    with fc.CheckpointManager(d, tiers=tiers(local)) as mgr:
        chown_tree(os.path.join(root, "local", "2", tier_store.DATA))
        with pytest.raises(fc.StorageError, match=f"data file .*/2/data.bin is owned by uid {OTHER}"):
            tier_store.open_copy(os.path.join(root, "local", "2"))
        assert_bit_exact(mgr.restore(target=state(0.0)), state(1.0), types=False)


def _files_under(top: str) -> list[str]:
    return sorted(os.path.join(r, n) for r, _, fs in os.walk(top) for n in fs)


@pytest.mark.parametrize("differential", [False, True])
def test_a_file_with_a_second_hard_link_is_never_written_again(tmp_path, differential):
    """The reported attack (issue 44, item 2): a `cp -al` backup of the memory tiers in the same file
    system gives every data file a second name outside the tiers' folder. Retention used to make such a
    file a spare and write the next step into it, rewriting the backup. Now a file with more than one
    name is never written, mapped for a snapshot or reused; the run goes on saving and restoring."""
    d, local = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    cfg = tiers(local, max_to_keep=1, differential=differential, rebase_interval=1)
    with fc.CheckpointManager(d, tiers=cfg) as mgr:
        mgr.save(1, state(1.0))
        mgr.save(2, state(2.0))
        mgr.wait_until_finished()
        top = os.path.dirname(mgr.memory_tiers.root)
        backup = {}
        for k, f in enumerate(_files_under(top)):  # cp -al: every file of the tiers gets a second name
            os.link(f, tmp_path / f"backup-{k}")
            backup[tmp_path / f"backup-{k}"] = open(f, "rb").read()
        assert any(os.path.getsize(f) >= state(0.0)["w"].nbytes for f in backup)  # data files among them
        for step in range(3, 7):
            mgr.save(step, state(float(step)))
        mgr.wait_until_finished()
        for f, before in backup.items():
            assert open(f, "rb").read() == before, f"{f}: a file outside the memory tiers was written"
        assert_bit_exact(mgr.restore(target=state(0.0)), state(6.0), types=False)
        assert mgr.restore_stats[-1].tier == "local"
        assert os.lstat(os.path.join(mgr.memory_tiers.local_dir, "6", tier_store.DATA)).st_nlink == 1


# ------------------------------------------------------------------------------------- folders


def _symlink_to_own_folder(path: str, tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    shutil.rmtree(path)
    os.symlink(real, path)


FOLDERS = {  # what is done to which folder -> the words of the refusal
    "local_dir-writable-by-others": (
        "local",
        lambda p, tmp: os.chmod(p, 0o777),
        "writable by group or others",
    ),
    "local_dir-owned-by-another-user": ("local", lambda p, tmp: chown_tree(p), f"owned by uid {OTHER}"),
    "local_dir-is-a-symlink": ("local", _symlink_to_own_folder, "symbolic link"),
    "job-folder-writable-by-others": (
        "job",
        lambda p, tmp: os.chmod(p, 0o777),
        "writable by group or others",
    ),
    "job-folder-is-a-symlink": ("job", _symlink_to_own_folder, "symbolic link"),
    "process-folder-owned-by-another-user": ("proc", lambda p, tmp: chown_tree(p), f"owned by uid {OTHER}"),
    "tier-folder-writable-by-others": (
        "tier",
        lambda p, tmp: os.chmod(p, 0o775),
        "writable by group or others",
    ),
    "peer-folder-owned-by-another-user": ("peer", lambda p, tmp: chown_tree(p), f"owned by uid {OTHER}"),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_an_unsafe_folder_is_refused_at_start_naming_it(tmp_path, case):
    which, spoil, words = FOLDERS[case]
    d, local, root = victim_run(tmp_path)
    path = {
        "local": local,
        "job": os.path.dirname(root),
        "proc": root,
        "tier": os.path.join(root, "local"),
        "peer": os.path.join(root, "peer-p1"),
    }[which]
    if which == "peer":
        os.mkdir(path, 0o700)
    spoil(path, tmp_path)
    with pytest.raises(fc.StorageError) as info:
        fc.CheckpointManager(d, tiers=tiers(local))
    msg = str(info.value)
    assert path in msg and words in msg and "Fix:" in msg, msg
    if which in ("local", "job") and "symlink" in case:  # refused, not followed: nothing made in the target
        assert os.listdir(tmp_path / "real") == []


def test_folders_are_made_private_whatever_the_umask(tmp_path):
    """Folders are created with mode 0700 (os.mkdir's mode, not the umask's default), so a permissive
    umask cannot open them to other users; the default local_dir is per user."""
    assert fc.Tiers().local_dir == f"/dev/shm/flax_ckpt-{os.geteuid()}"
    local = str(tmp_path / "a" / "shm")
    old = os.umask(0)
    try:
        with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers(local)) as mgr:
            mgr.save(1, state(1.0))
            mgr.wait_until_finished()
            root = mgr.memory_tiers.root
    finally:
        os.umask(old)
    for p in (
        local,
        os.path.dirname(root),
        root,
        os.path.join(root, "local"),
        os.path.join(root, "local", "1"),
    ):
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o700, p
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers(local)) as mgr:  # and they are accepted
        assert_bit_exact(mgr.restore(target=state(0.0)), state(1.0), types=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root-owned folder")
def test_a_system_sticky_folder_is_accepted_as_local_dir(tmp_path):
    """local_dir may be a system folder like /dev/shm itself (root's, sticky: nobody replaces another's
    entries); the job folder made inside it is private."""
    local = tmp_path / "sys"
    local.mkdir()
    os.chmod(local, 0o1777)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers(str(local))) as mgr:
        mgr.save(1, state(1.0))
        mgr.wait_until_finished()
        assert stat.S_IMODE(os.lstat(os.path.dirname(mgr.memory_tiers.root)).st_mode) == 0o700
    os.chmod(local, 0o777)  # without the sticky bit: refused
    with pytest.raises(fc.StorageError, match="writable by group or others"):
        fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers(str(local)))


# ------------------------------------------------------------------ whose job folder (issue 44, items 3, 4)


def test_a_new_run_at_a_deleted_runs_path_never_restores_its_memory_copies(tmp_path, caplog):
    """The reported case (item 3): run A saves steps 1-15 with tiers (cleanup=False) and stops; `rm -rf`
    of its directory; a new manager at the same path used to report latest_step 15 and restore A's
    state from memory. The job folder now belongs to the run directory's identity: A's copies are
    another run's, ignored with a warning (never restored or migrated) and removed."""
    d, local = str(tmp_path / "run"), str(tmp_path / "shm")
    with fc.CheckpointManager(d, tiers=tiers(local, max_to_keep=3)) as mgr:
        for step in range(1, 16):
            mgr.save(step, state(float(step)))
        mgr.wait_until_finished()
        root = mgr.memory_tiers.root
    shutil.rmtree(d)
    caplog.set_level(logging.WARNING, "flax_ckpt")
    with fc.CheckpointManager(d, tiers=tiers(local, cleanup=True)) as mgr:  # whose close() migrates
        assert mgr.latest_step() is None and mgr.all_steps() == []
        with pytest.raises(fc.CheckpointNotFoundError):
            mgr.restore(target=state(0.0))
        assert tier_store.steps_in(os.path.join(root, "local")) == []
    assert f"{root} holds copies of steps [" in caplog.text
    assert f"13, 14, 15] of another run of {d}" in caplog.text
    with fc.CheckpointManager(d) as plain:
        assert plain.all_steps() == []  # nothing of A's was migrated into the new run


def test_the_same_run_still_resumes_from_memory(tmp_path, caplog):
    """The identity changes nothing for the run itself: a manager reopened on its directory restores
    its newest step from memory, without a warning."""
    d, local, root = victim_run(tmp_path)
    caplog.set_level(logging.WARNING, "flax_ckpt")
    with fc.CheckpointManager(d, tiers=tiers(local)) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert_bit_exact(mgr.restore(target=state(0.0)), state(2.0), types=False)
        assert mgr.restore_stats[-1].tier == "local"
    assert "another run" not in caplog.text


def test_two_managers_on_one_memory_url_in_one_process(tmp_path):
    """Two live managers of one memory:// URL would share a job folder: the second is refused
    (CheckpointLockedError naming the folder); once the first is closed, the next one opens and
    resumes its steps (one process: one memory:// store)."""
    url, local = f"memory://{tmp_path.name}/run", str(tmp_path / "shm")
    with fc.CheckpointManager(url, tiers=tiers(local)) as a:
        a.save(2, state(2.0))
        a.wait_until_finished()
        with pytest.raises(fc.CheckpointLockedError, match="memory tiers: .* is in use by another live"):
            fc.CheckpointManager(url, tiers=tiers(local))
    with fc.CheckpointManager(url, tiers=tiers(local)) as b:
        assert b.all_steps() == [2]
        assert_bit_exact(b.restore(target=state(0.0)), state(2.0), types=False)


_JOB_A = """
import sys, numpy as np, flax_ckpt as fc
url, local = sys.argv[1], sys.argv[2]
t = fc.Tiers(local_dir=local, on_busy="wait", persist_interval_steps=None, cleanup=False)
mgr = fc.CheckpointManager(url, tiers=t)
mgr.save(2, {"w": np.full((256, 256), 2001.0, np.float32)})
mgr.wait_until_finished()
got = mgr.restore(target={"w": np.zeros((256, 256), np.float32)})
print("ready", flush=True)
sys.stdin.readline()
again = mgr.restore(target={"w": np.zeros((256, 256), np.float32)})
print(float(got["w"].min()), float(got["w"].max()), float(again["w"][0, 0]), mgr.latest_step(), flush=True)
"""


def test_two_jobs_on_one_memory_url_never_share_memory_copies(tmp_path, caplog):
    """The reported case (item 4): two processes (two jobs) on one memory:// URL shared a tier job folder:
    job A's zero-copy restored array changed under it (2001.0 became 6002.0) and A's restore returned
    B's step 7. Now B is refused while A lives; A's arrays and steps stay its own. After A is gone, B
    opens: A's copies are another run's (A's memory:// store died with it), ignored and removed."""
    url, local = f"memory://{tmp_path.name}/shared", str(tmp_path / "shm")
    a = forkserver.Popen(
        [sys.executable, "-c", _JOB_A, url, local],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).resolve().parents[1]),
        preexec_fn=die_with_parent,
    )
    try:
        assert a.stdout.readline().strip() == "ready"
        with pytest.raises(fc.CheckpointLockedError, match="memory tiers: .* is in use by another live"):
            b = fc.CheckpointManager(url, tiers=tiers(local))
            b.save(7, {"w": np.full((256, 256), 6002.0, np.float32)})  # what the old code let B do
            b.wait_until_finished()
            b.close()
        out, _ = a.communicate("go\n", timeout=120)
    finally:
        a.kill()
    assert a.returncode == 0 and out.split() == ["2001.0", "2001.0", "2001.0", "2"], out
    caplog.set_level(logging.WARNING, "flax_ckpt")
    with fc.CheckpointManager(url, tiers=tiers(local)) as b:
        assert b.all_steps() == []
    assert "of another run of" in caplog.text


_FULL_DISK = """
import json, resource, signal, sys, numpy as np, flax_ckpt as fc
d, local = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit is then an OSError (EFBIG)
t = fc.Tiers(local_dir=local, on_busy="wait", persist_interval_steps=None, cleanup=True)
mgr = fc.CheckpointManager(d, tiers=t)
mgr.save(1, {"w": np.full((512, 512), 1.5, np.float32)})
mgr.wait_until_finished()
if sys.argv[3] == "rlimit":  # every file is full past 64 KiB from now on
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
else:  # the directory's file system is filled up
    with open(sys.argv[3], "wb") as f:
        try:
            while True:
                f.write(bytes(64 << 10))
                f.flush()
        except OSError:
            pass
try:
    mgr.close()
    print(json.dumps({"raised": None}))
except BaseException as e:
    print(json.dumps({"raised": type(e).__name__, "checkpoint_error": isinstance(e, fc.CheckpointError),
                      "message": str(e)}))
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted at <tmp_path>/disk (skips where mounting is not allowed), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.parametrize("full", ["rlimit", "tmpfs"])
def test_close_on_a_full_disk_during_the_final_migration_is_a_checkpoint_error(tmp_path, request, full):
    """Item 9 (close on a full disk): the final migration of a step held only in memory failed with a raw
    OSError. Now it is a SaveFailedError naming the step and the directory, and nothing is lost: the
    memory tiers are kept, and the next manager restores the step from them. The full disk is a real
    one, filled after the save: RLIMIT_FSIZE of 64 KiB (EFBIG past it), or a 2 MiB tmpfs filled up
    (ENOSPC; where this runs as root)."""
    disk = request.getfixturevalue("small_disk") if full == "tmpfs" else tmp_path
    d, local = str(disk / "run"), str(tmp_path / "shm")
    filler = "rlimit" if full == "rlimit" else str(disk / "filler")
    run = forkserver.run(
        [sys.executable, "-c", _FULL_DISK, d, local, filler],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).resolve().parents[1]),
        preexec_fn=die_with_parent,
    )
    if full == "tmpfs":
        os.unlink(filler)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["raised"] == "SaveFailedError" and got["checkpoint_error"], (got, run.stderr[-2000:])
    assert "step 1" in got["message"] and d in got["message"] and "Nothing was removed" in got["message"]
    with fc.CheckpointManager(d, tiers=tiers(local)) as mgr:
        want = {"w": np.full((512, 512), 1.5, np.float32)}
        assert_bit_exact(mgr.restore(target={"w": np.zeros((512, 512), np.float32)}), want, types=False)
        assert mgr.restore_stats[-1].tier == "local"
