"""Hostile folders on shared machines (issue 24, items 1-3 and 9): what others can put in a run directory.

Every case is built from real files (symlinks, FIFOs, hard links, folders, files of another user) and
checked through the manager and the flax-ckpt command (in-process: the same code as the console
script): the lock file is never opened through a link, nor written unless it is this user's own
regular file; only the exact temporary names our saves, our deletions and Orbax make are removed;
steps are named by ASCII digits only; a step folder whose manifest names another step is damaged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
from typing import Any, Callable

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src import layouts
from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.engine.snapshot import snapshot
from flax_ckpt._src.orbax import locate, write
from flax_ckpt._src.storage import open_storage
from flax_ckpt._src.storage.local import LocalStorage
from flax_ckpt._src.storage.lock import LOCK_FILE
from flax_ckpt._src.tools.cli import main as cli

OUTSIDE = b"the trainer's ssh config: must never be overwritten\n"


def tree(step: int) -> dict:
    return {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4) + step,
        "b": np.full((5,), step, np.int16),
        "step": step,
    }


def assert_tree(got: Any, step: int) -> None:
    want = tree(step)
    assert got["step"] == step
    for k in ("w", "b"):
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes()


def run_cli(capsys, *args: str) -> tuple[int, Any, str]:
    """``flax-ckpt <args> --json -q`` in this process: exit code, parsed stdout, stderr."""
    rc = cli([*args, "--json", "-q"])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip() else None, out.err


def never_hangs(fn: Callable[[], Any], seconds: float = 60) -> Any:
    """Runs ``fn`` in a thread and fails (instead of hanging the suite) if it does not return in time."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} hung for {seconds} s"
    if "err" in box:
        raise box["err"]
    return box.get("out")


# ------------------------------------------------------------------------------- 1. the lock file


def _run_with_step(tmp_path) -> tuple[str, str]:
    run, outside = tmp_path / "run", tmp_path / "outside"
    fc.save(run / "1", tree(1), step=1)
    outside.mkdir()
    (outside / "victim").write_bytes(OUTSIDE)
    return str(run), str(outside / "victim")


def _plant(kind: str, lock: str, victim: str) -> None:
    if kind == "symlink":
        os.symlink(victim, lock)
    elif kind == "dangling symlink":
        os.symlink(victim + ".new", lock)
    elif kind == "FIFO":
        os.mkfifo(lock)
    elif kind == "folder":
        os.mkdir(lock)
        with open(os.path.join(lock, "inside"), "wb") as f:
            f.write(OUTSIDE)
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "another user's file":
        with open(lock, "wb") as f:
            f.write(OUTSIDE)
        os.chown(lock, 65534, 65534)
    else:
        raise AssertionError(kind)


LOCK_CASES = {
    "symlink": "symbolic link",
    "dangling symlink": "symbolic link",
    "FIFO": "is a FIFO",
    "folder": "is a folder",
    "hard link": "hard link",
    "another user's file": "another user",
}


def _opener(how: str, run: str, capsys) -> str:
    """Opens ``run`` as a writer (a manager, or flax-ckpt prune); the error it raises, as text."""
    if how == "manager":
        with pytest.raises(fc.CheckpointError) as e:
            never_hangs(lambda: fc.CheckpointManager(run).close())
        assert isinstance(e.value, fc.StorageError)
        return str(e.value)
    rc, doc, err = never_hangs(lambda: run_cli(capsys, "prune", run, "--keep", "1"))
    assert rc != 0 and doc["error"]["type"] == "StorageError", (rc, doc, err)
    return doc["error"]["message"]


@pytest.mark.parametrize("how", ["manager", "prune"])
@pytest.mark.parametrize("kind", list(LOCK_CASES))
def test_a_lock_file_that_is_not_ours_is_refused_and_left_untouched(tmp_path, capsys, kind, how):
    if kind == "another user's file" and os.geteuid() != 0:
        pytest.skip("only root can make a file of another user here")
    run, victim = _run_with_step(tmp_path)
    lock = os.path.join(run, LOCK_FILE)
    _plant(kind, lock, victim)
    before = os.lstat(lock)
    msg = _opener(how, run, capsys)
    assert lock in msg and LOCK_CASES[kind] in msg and "Remove it" in msg, msg
    with open(victim, "rb") as f:
        assert f.read() == OUTSIDE  # the file outside the run: not truncated, not written
    assert not os.path.lexists(victim + ".new")  # a dangling link's target was not created
    after = os.lstat(lock)
    assert (stat.S_IFMT(after.st_mode), after.st_ino, after.st_size) == (
        stat.S_IFMT(before.st_mode),
        before.st_ino,
        before.st_size,
    )  # what was planted is left as found
    if kind == "another user's file":
        with open(lock, "rb") as f:
            assert f.read() == OUTSIDE
    assert sorted(os.listdir(run)) == sorted([LOCK_FILE, "1"])  # prune deleted nothing
    os.remove(lock) if not os.path.isdir(lock) else shutil.rmtree(lock)  # the fix the message names
    with fc.CheckpointManager(run, max_to_keep=1) as mgr:
        assert_tree(mgr.restore(), 1)
    with open(os.path.join(run, LOCK_FILE)) as f:
        assert f.read().startswith(f"pid {os.getpid()} ")


def test_our_own_lock_file_is_reused_and_contention_still_refused(tmp_path):
    run, _ = _run_with_step(tmp_path)
    fc.CheckpointManager(run).close()
    assert stat.S_ISREG(os.lstat(os.path.join(run, LOCK_FILE)).st_mode)  # a native run keeps its lock file
    with fc.CheckpointManager(run) as mgr:
        with pytest.raises(fc.CheckpointLockedError, match=f"pid {os.getpid()}"):
            fc.CheckpointManager(run)
        assert mgr.all_steps() == [1]


# --------------------------------------------------------------------- 2. only our temporary names

USER_FILES = {  # names a user keeps in a run directory: none of them is ours to remove
    "config.yaml.tmp-1": "file",
    "dataset.tmp-cache": "folder",
    "eval.orbax-checkpoint-tmp-results": "folder",
    "notes.deleting-later.txt": "file",
    "5.tmp-1": "file",
    "6.deleting-soon": "folder",
    "7.orbax-checkpoint-tmp-x": "folder",
    "notes.orbax-checkpoint-tmp": "file",
    "final.tmp-" + "ab" * 16: "folder",  # the name of a crashed fc.save of "final", which is no step
}


def _user_files(d) -> None:
    for name, kind in USER_FILES.items():
        if kind == "file":
            (d / name).write_bytes(OUTSIDE)
        else:
            (d / name).mkdir()
            (d / name / "keep.txt").write_bytes(OUTSIDE)


def _assert_user_files(d) -> None:
    for name, kind in USER_FILES.items():
        path = d / name / "keep.txt" if kind == "folder" else d / name
        assert path.read_bytes() == OUTSIDE, name


def _interrupted_save(monkeypatch, save: Callable[[], Any], at: str) -> None:
    """Runs ``save`` and stops it as a crash would, leaving its staging folder as the real code names
    it: at the commit (data written, no commit record) or at the rename (commit record written)."""
    with monkeypatch.context() as m:
        m.setattr(commit_mod, "abort", lambda *a, **k: None)  # a crash runs no clean-up
        if at == "commit":

            def crash(*a, **k):
                raise KeyboardInterrupt("crash before the commit")

            m.setattr(commit_mod, "commit", crash)
        else:

            def crash(self, src, dst):
                raise KeyboardInterrupt("crash before the rename")

            m.setattr(LocalStorage, "rename", crash)
        with pytest.raises(KeyboardInterrupt):
            save()


def _interrupted_deletion(monkeypatch, d, name: str, record: str) -> None:
    """Deletes step folder ``name`` with the real code and stops it after the un-commit (the rename)."""
    with monkeypatch.context() as m:

        def crash(self, name=""):
            raise KeyboardInterrupt("crash during the deletion")

        m.setattr(LocalStorage, "delete", crash)
        with pytest.raises(KeyboardInterrupt):
            commit_mod.remove(open_storage(d), name, record)


def test_user_files_with_temporary_looking_names_survive_open_save_retention_and_prune(
    tmp_path, capsys, monkeypatch
):
    d = tmp_path / "run"
    for s in (1, 2, 3):
        fc.save(d / str(s), tree(s), step=s)
    _user_files(d)
    _interrupted_save(monkeypatch, lambda: fc.save(d / "4", tree(4), step=4), "commit")
    _interrupted_save(monkeypatch, lambda: fc.save(d / "5", tree(5), step=5), "rename")
    _interrupted_deletion(monkeypatch, d, "2", MANIFEST)
    leftovers = sorted(set(os.listdir(d)) - set(USER_FILES) - {"1", "3"})
    assert len(leftovers) == 3 and all(commit_mod.is_temporary(e) for e in leftovers), leftovers
    staged = next(e for e in leftovers if e.startswith("5.tmp-"))
    assert (d / staged / MANIFEST).exists()  # committed inside, never renamed: still never read
    with pytest.raises(fc.CheckpointNotCommittedError, match="in flight"):
        fc.restore(d / staged)
    rc, doc, _ = run_cli(capsys, "ls", str(d))
    assert rc == 0 and sorted((s["name"], s["state"]) for s in doc["steps"]) == [
        ("1", "committed"),
        ("3", "committed"),
    ]
    assert sorted((s["name"], s["state"]) for s in doc["leftovers"]) == sorted(
        (e, "deleting" if ".deleting-" in e else "in-flight") for e in leftovers
    )
    with fc.CheckpointManager(d, max_to_keep=2) as mgr:  # the open removes the leftovers, nothing else
        assert mgr.all_steps() == [1, 3]
        assert sorted(os.listdir(d)) == sorted([LOCK_FILE, "1", "3", *USER_FILES])
        _assert_user_files(d)
        for s in (6, 7):  # saves and retention
            mgr.save(s, tree(s))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [6, 7]
        assert_tree(mgr.restore(), 7)
    _assert_user_files(d)
    rc, doc, err = run_cli(capsys, "prune", str(d), "--keep", "1")
    assert rc == 0 and doc["deleted"] == [6], (doc, err)
    assert sorted(os.listdir(d)) == sorted([LOCK_FILE, "7", *USER_FILES])
    _assert_user_files(d)


def test_orbax_runs_user_files_survive_and_orbax_leftovers_are_removed(tmp_path, capsys, monkeypatch):
    epath = pytest.importorskip("etils.epath")
    atomicity = pytest.importorskip("orbax.checkpoint._src.path.atomicity")
    d = tmp_path / "orbax-run"
    for s in (1, 2, 3):
        write.save_step(open_storage(d), s, snapshot(tree(s), copy=False), name=f"ckpt_{s:06d}")
    _user_files(d)
    orbax_tmp = atomicity._get_tmp_directory(epath.Path(d / "ckpt_000004")).name  # orbax 0.12.8's own name
    assert orbax_tmp == "ckpt_000004.orbax-checkpoint-tmp"
    (d / orbax_tmp / "default").mkdir(parents=True)
    (d / "ckpt_000005.orbax-checkpoint-tmp-1010101").mkdir()  # older Orbax releases add a timestamp
    _interrupted_save(
        monkeypatch,
        lambda: write.save_step(open_storage(d), 8, snapshot(tree(8), copy=False), name="ckpt_000008"),
        "commit",
    )
    leftovers = sorted(set(os.listdir(d)) - set(USER_FILES) - {"ckpt_000001", "ckpt_000002", "ckpt_000003"})
    assert len(leftovers) == 3 and any(e.startswith("ckpt_000008.orbax-checkpoint-tmp-") for e in leftovers)
    with fc.CheckpointManager(d, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        mgr.save(9, tree(9))  # the first save claims the run: leftovers go, user files stay
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 9]
        assert_tree(mgr.restore(), 9)
    assert sorted(os.listdir(d)) == sorted(["ckpt_000003", "ckpt_000009", *USER_FILES])
    _assert_user_files(d)
    rc, doc, _ = run_cli(capsys, "prune", str(d), "--keep", "1")
    assert rc == 0 and doc["deleted"] == [3]
    assert sorted(os.listdir(d)) == sorted(["ckpt_000009", *USER_FILES])
    _assert_user_files(d)


def test_temporary_names_are_exactly_ours():
    hexes = "0123456789abcdef" * 2
    for name, base in [
        (f"7.tmp-{hexes}", "7"),
        (f"7.deleting-{hexes}", "7"),
        ("7.orbax-checkpoint-tmp", "7"),
        ("ckpt_07.orbax-checkpoint-tmp-1712", "ckpt_07"),
        (f"final.tmp-{hexes}", "final"),
    ]:
        assert commit_mod.is_temporary(name) and commit_mod.base_name(name) == base, name
    for name in [
        *USER_FILES,
        f"7.tmp-{hexes.upper()}",
        f"7.tmp-{hexes}0",
        f"7.tmp-{hexes}.bak",
        "7.tmp-",
        ".tmp-" + hexes,
        "7.orbax-checkpoint-tmp-",
        "7.orbax-checkpoint-tmp-12x",
        "7.damaged-0123abcd",
    ]:
        if name not in (f"final.tmp-{'ab' * 16}", "notes.orbax-checkpoint-tmp"):  # exact, but of no step
            assert not commit_mod.is_temporary(name) and commit_mod.base_name(name) == name, name


# --------------------------------------------------------------------------- 3. ASCII digits only

UNICODE_STEPS = ["²", "٣", "𝟑", "３", "3²", "١٠"]  # superscript, Arabic-Indic, math bold, fullwidth


def test_folders_named_by_unicode_digits_are_no_steps(tmp_path, capsys, caplog):
    d = tmp_path / "run"
    for s in (1, 3):
        fc.save(d / str(s), tree(s), step=s)
    for name in UNICODE_STEPS:  # each a valid copy of step 1: read as a step, it would shadow step 3
        shutil.copytree(d / "1", d / name)
    with caplog.at_level(logging.WARNING, logger="flax_ckpt"):
        with fc.CheckpointManager(d, max_to_keep=1) as mgr:
            assert mgr.all_steps() == [1, 3]
            assert_tree(mgr.restore(), 3)
            assert_tree(mgr.restore(3), 3)
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]
    rc, doc, _ = run_cli(capsys, "ls", str(d))
    assert rc == 0 and [(s["name"], s["step"], s["state"]) for s in doc["steps"]] == [
        ("1", 1, "committed"),
        ("3", 3, "committed"),
    ]
    rc, doc, _ = run_cli(capsys, "verify", str(d))
    assert rc == 0 and doc["steps"] == [1, 3]
    rc, doc, _ = run_cli(capsys, "prune", str(d), "--keep", "1")
    assert rc == 0 and doc["deleted"] == [1]
    assert sorted(os.listdir(d)) == sorted([LOCK_FILE, "3", *UNICODE_STEPS])  # left as found
    for name in UNICODE_STEPS:
        assert_tree(fc.restore(d / name), 1)
    assert commit_mod.step_number("3") == 3 and all(commit_mod.step_number(n) is None for n in UNICODE_STEPS)


def test_orbax_step_names_need_ascii_digits(tmp_path):
    d = tmp_path / "orbax-run"
    for s in (1, 3):
        write.save_step(open_storage(d), s, snapshot(tree(s), copy=False), name=f"ckpt_{s}")
    for name in ("ckpt_٣", "ckpt_𝟑", "٣", "²"):
        shutil.copytree(d / "ckpt_1", d / name)
    assert locate.step_number("ckpt_3") == 3 and locate.step_number("ckpt_٣") is None
    assert locate.step_dirs(open_storage(d)) == {1: "ckpt_1", 3: "ckpt_3"}
    assert locate.step_name(4, ["ckpt_1", "ckpt_٣"]) == "ckpt_4"
    with fc.CheckpointManager(d) as mgr:
        assert mgr.all_steps() == [1, 3]
        assert_tree(mgr.restore(), 3)


# ---------------------------------------------------------- 9. a step folder under another step's name


def test_a_step_folder_copied_to_another_name_is_damaged_not_that_step(tmp_path, capsys, caplog):
    d = tmp_path / "run"
    with fc.CheckpointManager(d) as mgr:
        for s in (1, 2):
            mgr.save(s, tree(s))
    shutil.copytree(d / "1", d / "9")  # its manifest says step 1
    with caplog.at_level(logging.WARNING, logger="flax_ckpt"):
        with fc.CheckpointManager(d, max_to_keep=5) as mgr:
            assert mgr.all_steps() == [1, 2]
            assert_tree(mgr.restore(), 2)  # the newest good step, not step 1's bytes as step 9
            with pytest.raises(fc.CheckpointNotFoundError):
                mgr.restore(9)
    warned = [r.getMessage() for r in caplog.records if "damaged step 9" in r.getMessage()]
    assert warned and "folder name says step 9 but its manifest says step 1" in warned[0], warned
    with fc.CheckpointManager(d, strict=True) as mgr:  # strict: a damaged newest step is an error
        with pytest.raises(
            fc.InvalidManifestError, match="folder name says step 9 but its manifest says step 1"
        ):
            mgr.restore()
    rc, doc, _ = run_cli(capsys, "ls", str(d))
    nine = next(s for s in doc["steps"] if s["name"] == "9")
    assert rc == 0 and nine["state"] == "invalid" and "manifest says step 1" in nine["problem"]
    assert cli(["ls", str(d)]) == 0  # the table says why, too
    assert "folder name says step 9 but its manifest says step 1" in capsys.readouterr().out
    rc, doc, _ = run_cli(capsys, "verify", str(d))
    assert rc != 0 and [p["step"] for p in doc["problems"]] == [9]
    assert "folder name says step 9 but its manifest says step 1" in doc["problems"][0]["message"]
    rc, doc, _ = run_cli(capsys, "prune", str(d), "--keep", "1")
    assert rc == 0 and doc["deleted"] == [1] and (d / "9").is_dir()  # a damaged step is never pruned
    assert_tree(fc.restore(d / "9"), 1)  # alone (no run), the folder still restores what it holds
    with fc.CheckpointManager(d) as mgr:  # a new step 9 sets the copy aside, never deletes it
        mgr.save(9, tree(9))
        mgr.wait_until_finished()
        assert_tree(mgr.restore(), 9)
    aside = [e for e in os.listdir(d) if e.startswith("9.damaged-")]
    assert len(aside) == 1 and fc.metadata(d / aside[0]).step == 1


@pytest.mark.parametrize("src,dst", [("1", "9"), ("2", "05"), ("1", "0"), ("2", "20000000000000000000000")])
def test_copies_under_other_step_names_never_shadow_the_run(tmp_path, src, dst):
    d = tmp_path / "run"
    for s in (1, 2):
        fc.save(d / str(s), tree(s), step=s)
    shutil.copytree(d / src, d / dst)
    with fc.CheckpointManager(d) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert_tree(mgr.restore(), 2)
    with pytest.raises(
        fc.InvalidManifestError, match=f"says step {int(dst)} but its manifest says step {src}"
    ):
        layouts.step_folders(open_storage(d))[0][-1 if int(dst) > 2 else 0].layout.open(
            open_storage(d).sub(dst)
        )
    assert_tree(fc.restore(d / dst), int(src))


def test_single_checkpoints_restore_under_any_name(tmp_path):
    fc.save(tmp_path / "final", tree(5), step=5)
    fc.save(tmp_path / "7", tree(5), step=5)  # a lone folder named like another step
    shutil.copytree(tmp_path / "7", tmp_path / "x" / "12")
    for path in (tmp_path / "final", tmp_path / "7", tmp_path / "x" / "12"):
        assert_tree(fc.restore(path), 5)
        assert fc.metadata(path).step == 5
    d = tmp_path / "run"  # a checkpoint saved without step= records none: any step folder name fits it
    fc.save(d / "4", tree(4))
    with fc.CheckpointManager(d) as mgr:
        assert mgr.all_steps() == [4]
        assert_tree(mgr.restore(), 4)
