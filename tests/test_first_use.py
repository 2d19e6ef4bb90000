"""What a first-time user meets (issue 26, items 1, 3, 9 and 14): a file where a directory belongs, a run
directory given to fc.restore, metrics that are not numbers (each a CheckpointError naming the path or
key and the fix, with nothing written), and an off-schedule save (False, and a DEBUG line saying why)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt.callbacks import CheckpointCallback

TREE = {"w": np.arange(4, dtype=np.float32)}


def test_a_file_given_as_a_directory_is_a_checkpoint_error_naming_it(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for make in (
        lambda: fc.CheckpointManager(afile),
        lambda: CheckpointCallback(afile, every_steps=1),
        lambda: fc.save(afile / "1", TREE),
        lambda: fc.CheckpointManager(afile / "run"),
    ):
        with pytest.raises(fc.CheckpointError, match=f"{afile} is a file, not a folder"):
            make()
    assert afile.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["afile"]


def test_restore_of_a_run_directory_names_its_steps(tmp_path):
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        for step in (400, 450, 500):
            mgr.save(step, TREE, force=True)
    for call in (lambda: fc.restore(tmp_path / "run", TREE), lambda: fc.metadata(tmp_path / "run")):
        with pytest.raises(
            fc.CheckpointNotFoundError,
            match=r"is a directory of steps \[400, 450, 500\].*"
            r"run/500\).*CheckpointManager",
        ):
            call()
    os.makedirs(tmp_path / "crashed")  # a folder without a manifest and without steps: as before
    with pytest.raises(fc.CheckpointError, match="holds no committed checkpoint"):
        fc.restore(tmp_path / "crashed")


@pytest.mark.parametrize("metrics", [{"loss": "x"}, {"loss": [1.0]}, {"ok": 1.0, "flag": True}, [0.5]])
def test_metrics_that_are_not_numbers_are_refused_before_anything_is_written(tmp_path, metrics):
    with pytest.raises(fc.CheckpointError, match="metrics must be"):
        fc.save(tmp_path / "ck", TREE, metrics=metrics)
    with pytest.raises(fc.CheckpointError, match="metrics must be"):
        fc.save(tmp_path / "ob", TREE, metrics=metrics, format="orbax")
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(fc.CheckpointError, match="metrics must be"):
            mgr.save(1, TREE, metrics=metrics)
        assert mgr.all_steps() == []
    assert sorted(os.listdir(tmp_path)) == ["run"]
    with fc.CheckpointManager(tmp_path / "run") as mgr:  # numbers (and a numpy scalar) are fine
        assert mgr.save(1, TREE, metrics={"loss": np.float32(0.25), "step_count": 3}) is not False
    assert fc.metadata(tmp_path / "run" / "1").metrics == {"loss": 0.25, "step_count": 3}


def test_an_off_schedule_save_says_why_at_debug(tmp_path, caplog):
    with fc.CheckpointManager(tmp_path / "run", save_interval_steps=10) as mgr:
        with caplog.at_level("DEBUG", logger="flax_ckpt"):
            assert mgr.save(15, TREE) is False
        assert "step 15 is off the schedule (every 10 steps)" in caplog.text and "force=True" in caplog.text
        assert mgr.all_steps() == []
        assert mgr.save(15, TREE, force=True) is True and mgr.save(20, TREE) is True
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.all_steps() == [15, 20]


def test_a_resumed_run_deletes_its_own_earlier_steps_without_a_warning(tmp_path, caplog):
    run = tmp_path / "run"
    ckpt = CheckpointCallback(run, every_steps=1, max_to_keep=2, preemption_signals=())
    for s in (1, 2):
        ckpt(s, TREE)
    ckpt.close()
    with caplog.at_level("WARNING", logger="flax_ckpt"):
        ckpt = CheckpointCallback(run, every_steps=1, max_to_keep=2, preemption_signals=())
        state, start = ckpt.restore_or(TREE)  # resumes the run: steps 1 and 2 are its own
        for s in (start + 1, start + 2):
            ckpt(s, state)
        ckpt.close()
    with fc.CheckpointManager(run) as mgr:
        assert mgr.all_steps() == [3, 4]
    assert not [r for r in caplog.records if "retention" in r.getMessage()], caplog.text
    with caplog.at_level("WARNING", logger="flax_ckpt"):  # without resuming, they are another run's
        with fc.CheckpointManager(run, max_to_keep=1) as mgr:
            mgr.save(5, TREE)
    assert "which this manager did not write" in caplog.text
