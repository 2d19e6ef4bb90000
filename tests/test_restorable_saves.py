"""A save never commits a step that restore would refuse, so retention never deletes a good step for
one that cannot be read back: what restore bounds (the size of a manifest or of Orbax's JSON files,
checks.MAX_MANIFEST_BYTES, one constant for both sides) a save checks before its commit, and key
names Orbax's layout holds (a top-level ``""`` key, which Orbax itself round-trips) round-trip."""

from __future__ import annotations

import os

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src import checks
from flax_ckpt._src.commit import atomic as commit_mod

LIMIT = 20_000  # bytes: a manifest of a few leaves fits, one of 400 leaves does not


def _wide(n: int) -> dict:
    return {f"layer_{i:04d}_with_a_long_name": np.full(2, i, np.float32) for i in range(n)}


def _left(run) -> list[str]:
    return sorted(n for n in os.listdir(run) if not n.startswith("."))


@pytest.mark.parametrize("fmt", ["native", "orbax"])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_over_the_manifest_limit_restore_reads_commits_nothing_and_keeps_the_good_step(
    tmp_path, monkeypatch, fmt, async_save
):
    monkeypatch.setattr(checks, "MAX_MANIFEST_BYTES", LIMIT)
    run = tmp_path / "run"
    good = _wide(3)
    with fc.CheckpointManager(run, max_to_keep=1, async_save=async_save, format=fmt) as mgr:
        mgr.save(1, good)
        mgr.wait_until_finished()
        with pytest.raises(fc.CheckpointError, match=f"more than the {LIMIT} that restore reads") as e:
            mgr.save(2, _wide(400))
            mgr.wait_until_finished()
        assert "nothing was committed" in str(e.value) or "nothing was committed" in str(e.value.__cause__)
        assert mgr.all_steps() == [1]
        assert _left(run) == ["1"]  # no step 2, no staging folder left
        for k, v in mgr.restore(1, good).items():
            np.testing.assert_array_equal(v, good[k])
    with fc.CheckpointManager(run, async_save=False) as mgr:
        assert mgr.all_steps() == [1]
        monkeypatch.setattr(checks, "MAX_MANIFEST_BYTES", 600)  # restore reads the limit save checked
        with pytest.raises(fc.CheckpointError, match="more than the 600"):
            mgr.restore(1)


def test_a_top_level_empty_key_in_orbax_layout_round_trips_and_retention_keeps_a_restorable_step(tmp_path):
    import orbax.checkpoint as ocp

    run = tmp_path / "run"
    tree = {"": np.arange(3.0), "a": {"": np.ones(2, np.int32)}, "b": np.zeros(2)}
    with fc.CheckpointManager(run, format="orbax", max_to_keep=1, async_save=False) as mgr:
        mgr.save(1, {"b": np.ones(2)})
        mgr.save(2, tree)
        assert mgr.all_steps() == [2]
        restored = mgr.restore(2)
    (name,) = [n for n in os.listdir(run) if commit_mod.step_number(n) == 2]
    by_orbax = ocp.StandardCheckpointer().restore(str(run / name / "default"))
    for got in (restored, by_orbax):
        np.testing.assert_array_equal(got[""], tree[""])
        np.testing.assert_array_equal(got["a"][""], tree["a"][""])
        np.testing.assert_array_equal(got["b"], tree["b"])
