"""What a first-time user meets (issue 26, items 1, 3 and 14): a file where a directory belongs, a run
directory given to fc.restore, metrics that are not numbers. Each is a CheckpointError naming the path
or key and the fix, and nothing is written."""

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
    for make in (lambda: fc.CheckpointManager(afile), lambda: CheckpointCallback(afile, every_steps=1),
                 lambda: fc.save(afile / "1", TREE), lambda: fc.CheckpointManager(afile / "run")):
        with pytest.raises(fc.CheckpointError, match=f"{afile} is a file, not a folder"):
            make()
    assert afile.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["afile"]


def test_restore_of_a_run_directory_names_its_steps(tmp_path):
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        for step in (400, 450, 500):
            mgr.save(step, TREE, force=True)
    for call in (lambda: fc.restore(tmp_path / "run", TREE), lambda: fc.metadata(tmp_path / "run")):
        with pytest.raises(fc.CheckpointNotFoundError, match=r"is a directory of steps \[400, 450, 500\].*"
                                                             r"run/500\).*CheckpointManager"):
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
