"""A manager writes a new save's data files over those of the step its retention removed (commit/recycler.py):
the very files it kept, never a link, another user's or another file put in their place, and nothing
of them is left after close or a crash."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src.commit import atomic as commit_mod
from helpers import assert_bit_exact


def _state(step: int, rows: int = 768) -> dict:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((rows, 1024)).astype(np.float32),
        "b": np.full(7, step, np.int64),
    }  # 3 MiB


def _data_files(run, step: int) -> dict[str, os.stat_result]:
    folder = run / str(step) / "data"
    return {n: os.lstat(folder / n) for n in os.listdir(folder)}


def _pool(run) -> list:
    return [p for p in run.iterdir() if commit_mod.is_temporary(p.name)]


def test_a_removed_steps_files_become_the_next_saves_and_hold_only_its_bytes(tmp_path):
    run = tmp_path / "run"
    states = {}
    with fc.CheckpointManager(run, max_to_keep=2) as mgr:
        inodes = {}
        for step, rows in enumerate([768, 768, 768, 512, 1024, 768]):  # shrinks, then grows
            states[step] = _state(step, rows)
            mgr.save(step, states[step])
            mgr.wait_until_finished()
            inodes[step] = {st.st_ino for st in _data_files(run, step).values()}
            if step >= 3:  # step - 3, removed once step - 1 was committed, kept its file: this save's is it
                assert inodes[step] == inodes[step - 3], step
            if step >= 2:
                (pool,) = _pool(run)
                assert stat.S_IMODE(pool.stat().st_mode) == 0o700
            for s in mgr.all_steps():
                assert_bit_exact(mgr.restore(s, states[s]), states[s])
            files = json.loads((run / str(step) / "manifest.json").read_bytes())["body"]["files"]
            assert {
                f"data/{n}": st.st_size for n, st in _data_files(run, step).items()
            } == files  # nothing past the end
            assert sum(files.values()) == states[step]["w"].nbytes + states[step]["b"].nbytes
        assert mgr.all_steps() == [4, 5]
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["4", "5"]
    assert not _pool(run)


@pytest.mark.parametrize("swap", ["symlink", "hardlink", "other file", "fifo", "folder"])
def test_a_recycled_file_replaced_by_anything_else_is_never_written(tmp_path, swap):
    run, victim = tmp_path / "run", tmp_path / "victim.bin"
    victim.write_bytes(b"v" * (4 << 20))
    before = (victim.read_bytes(), victim.stat().st_mtime_ns)
    with fc.CheckpointManager(run, max_to_keep=2) as mgr:
        for step in range(3):
            mgr.save(step, _state(step))
            mgr.wait_until_finished()
        (pool,) = _pool(run)
        (recycled,) = list(pool.iterdir())
        recycled.unlink()
        if swap == "symlink":
            recycled.symlink_to(victim)
        elif swap == "hardlink":
            os.link(victim, recycled)
        elif swap == "other file":
            recycled.write_bytes(b"x" * (4 << 20))
        elif swap == "fifo":
            os.mkfifo(recycled)
        else:
            recycled.mkdir()
            (recycled / "inner.bin").write_bytes(b"y" * 10)
        state = _state(3)
        mgr.save(3, state)
        mgr.wait_until_finished()
        assert_bit_exact(mgr.restore(3, state), state)
        for st in _data_files(run, 3).values():
            assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before
    assert victim.stat().st_nlink == 1  # the hard link went with the recycled files' folder


def test_recycled_files_left_by_a_crash_are_removed_by_the_next_manager(tmp_path):
    run = tmp_path / "run"
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import flax_ckpt as fc
        from test_recycler import _state
        mgr = fc.CheckpointManager({str(run)!r}, max_to_keep=2)
        for step in range(3):
            mgr.save(step, _state(step))
            mgr.wait_until_finished()
        os._exit(0)  # no close: as a crash
    """)
    forkserver.run([sys.executable, "-c", code], check=True, timeout=120)
    assert len(_pool(run)) == 1
    with fc.CheckpointManager(run, max_to_keep=2) as mgr:
        assert not _pool(run)
        assert mgr.all_steps() == [1, 2]
        assert_bit_exact(mgr.restore(2, _state(2)), _state(2))
