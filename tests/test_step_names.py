"""A run's step folders as the file system shows them: a step folder (or its ``data/``) that is a
symbolic link to a folder elsewhere is removed as a link by retention and prune, never followed (the
recycler never moves a file out of it); folders whose names stand for one step number (``10`` and
``00010``) make that step ambiguous everywhere: never restored, retained, pruned or verified as one."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src import tools as fc_tools
from flax_ckpt._src.commit.recycler import MIN_BYTES
from flax_ckpt._src.tools.prune import prune
from helpers import file_digests


def _state(value: float) -> dict:
    return {"w": np.full(MIN_BYTES // 2, value, np.float32)}  # 2 MiB: its data file is recycled


def _link_away(run, away, step: int, what: str) -> None:
    """Moves step ``step``'s folder (``what`` "step") or its data/ ("data") to ``away`` (a folder of the
    same disk) and leaves a symbolic link in its place."""
    src = run / str(step) if what == "step" else run / str(step) / "data"
    dst = away / f"{what}{step}"
    shutil.move(src, dst)
    os.symlink(dst, src)


@pytest.mark.parametrize("what", ["step", "data"])
def test_retention_and_prune_remove_a_linked_step_as_a_link_and_leave_its_target(tmp_path, what, caplog):
    run, away = tmp_path / "run", tmp_path / "away"
    away.mkdir()
    with fc.CheckpointManager(run, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    _link_away(run, away, 1, what)
    _link_away(run, away, 2, what)
    before = file_digests(away)
    assert len(before) == (4 if what == "step" else 2)
    with caplog.at_level(logging.WARNING, logger="flax_ckpt"):
        with fc.CheckpointManager(run, max_to_keep=2, async_save=False) as mgr:
            assert mgr.all_steps() == [1, 2]
            for step in (3, 4, 5):  # retention removes 1 (its files would be recycled), then 2, 3
                mgr.save(step, _state(step))
            assert mgr.all_steps() == [4, 5]
    assert file_digests(away) == before  # byte for byte: nothing moved, written over or deleted there
    assert not os.path.lexists(run / "1") and not os.path.lexists(run / "2")
    if what == "step":
        assert f"{run / '1'} was a symbolic link to {away / 'step1'}" in caplog.text
    # prune removes a linked step the same way
    with fc.CheckpointManager(run, async_save=False) as mgr:
        mgr.save(6, _state(6))
    _link_away(run, away, 5, what)
    before = file_digests(away)
    assert prune(run, keep=1).deleted == [4, 5]
    assert file_digests(away) == before
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["6"]


def test_folders_that_name_one_step_make_it_ambiguous_for_the_manager_ls_prune_and_verify(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    with fc.CheckpointManager(run, async_save=False) as mgr:
        mgr.save(5, {"w": np.full(3, 5.0)})
        mgr.save(10, {"w": np.full(3, 10.0)})
    with fc.CheckpointManager(other, async_save=False) as mgr:
        mgr.save(10, {"w": np.full(3, -1.0)})  # a stale step 10, copied in as 00010
    shutil.copytree(other / "10", run / "00010")
    with fc.CheckpointManager(run, async_save=False, max_to_keep=1) as mgr:
        assert mgr.all_steps() == [5]  # neither folder is taken for step 10
        np.testing.assert_array_equal(mgr.restore()["w"], np.full(3, 5.0))
        with pytest.raises(fc.CheckpointError, match="ambiguous step 10: the folders 00010 and 10"):
            mgr.restore(10)
    entries = {e.name: e for e in fc_tools.list_steps(run)}
    assert entries["10"].state == entries["00010"].state == "ambiguous"
    assert "move the others out of the run directory" in (entries["10"].problem or "")
    result = prune(run, keep=1)
    assert (result.deleted, result.kept) == ([], [5])
    assert {"10", "00010"} <= set(result.left_alone)
    assert (run / "10").is_dir() and (run / "00010").is_dir()
    problems = fc_tools.verify(run)
    assert sorted(p.file for p in problems) == ["00010", "10"]
    assert all(p.step == 10 and "ambiguous step 10" in p.message for p in problems)
    shutil.rmtree(run / "00010")  # the fix the message names: the step is the run's again
    with fc.CheckpointManager(run, async_save=False) as mgr:
        np.testing.assert_array_equal(mgr.restore(10)["w"], np.full(3, 10.0))
