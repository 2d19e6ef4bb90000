"""Memory tiers on a shared host (issue 24, item 5): another local user must not be able to plant a copy
that a restore reads. The tiers' folders are created with mode 0700 and checked with lstat; a folder
or file owned by another user, writable by group or others, or a symlink, is refused with a
StorageError naming it (at start for folders, by skipping the copy for a copy).

Tests run as root here, so "another user" is a real chown to an unused uid (skipped when chown is
not allowed); every case uses real folders, files and links.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from typing import Any

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.tiers import store as tier_store
from helpers import assert_bit_exact

OTHER = 12345  # a uid no account uses: "another local user"
POISON = 999


def state(v: float) -> dict[str, Any]:
    return {"w": np.full((64, 64), v, np.float32), "b": np.arange(16, dtype=np.float32) + v}


def tiers(local: str, **kw: Any) -> fc.Tiers:
    return fc.Tiers(local_dir=local, on_busy="wait", persist_interval_steps=None, cleanup=False, **kw)


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
    with fc.CheckpointManager(d, tiers=fc.Tiers(local_dir=local, on_busy="wait", persist_interval_steps=1)) as mgr:
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
    assert any(w in caplog.text for w in (f"uid {OTHER}", "writable by group or others", "symbolic link"))
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


# ------------------------------------------------------------------------------------- folders

def _symlink_to_own_folder(path: str, tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    shutil.rmtree(path)
    os.symlink(real, path)


FOLDERS = {  # what is done to which folder -> the words of the refusal
    "local_dir-writable-by-others": ("local", lambda p, tmp: os.chmod(p, 0o777), "writable by group or others"),
    "local_dir-owned-by-another-user": ("local", lambda p, tmp: chown_tree(p), f"owned by uid {OTHER}"),
    "local_dir-is-a-symlink": ("local", _symlink_to_own_folder, "symbolic link"),
    "job-folder-writable-by-others": ("job", lambda p, tmp: os.chmod(p, 0o777), "writable by group or others"),
    "job-folder-is-a-symlink": ("job", _symlink_to_own_folder, "symbolic link"),
    "process-folder-owned-by-another-user": ("proc", lambda p, tmp: chown_tree(p), f"owned by uid {OTHER}"),
    "tier-folder-writable-by-others": ("tier", lambda p, tmp: os.chmod(p, 0o775), "writable by group or others"),
    "peer-folder-owned-by-another-user": ("peer", lambda p, tmp: chown_tree(p), f"owned by uid {OTHER}"),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_an_unsafe_folder_is_refused_at_start_naming_it(tmp_path, case):
    which, spoil, words = FOLDERS[case]
    d, local, root = victim_run(tmp_path)
    path = {"local": local, "job": os.path.dirname(root), "proc": root, "tier": os.path.join(root, "local"),
            "peer": os.path.join(root, "peer-p1")}[which]
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
    for p in (local, os.path.dirname(root), root, os.path.join(root, "local"), os.path.join(root, "local", "1")):
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
