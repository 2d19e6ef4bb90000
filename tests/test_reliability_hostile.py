"""Hostile checkpoints: every crafted case refused with a CheckpointError, nothing read outside the
folder, nothing written, bounded memory, the manager falling back; every manifest field deleted or
given a wrong type; and a bounded hypothesis run over the manifest parser and the serializers' checks.

Extends test_errors.py (a few traversal paths, one symlink, five shapes). benchmarks/faults.py runs
the fuzzer longer (FLAX_CKPT_FUZZ_EXAMPLES here sets the default-suite count).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from reliability_hostile import CASES, fuzz_trial, hostile_trial, wrong_types_trial
from reliability_trials import Tally

import flax_ckpt as fc

HOSTILE = [(case, ser) for case, (sers, _) in CASES.items() for ser in sers]
FUZZ_EXAMPLES = int(os.environ.get("FLAX_CKPT_FUZZ_EXAMPLES", "200"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case,serializer", HOSTILE, ids=[f"{c}-{s}" for c, s in HOSTILE])
def test_crafted_checkpoint_is_refused(tmp_path, case, serializer):
    outcome = hostile_trial(str(tmp_path), case, serializer)
    if outcome is None:
        pytest.skip(f"{case}: this machine cannot build it (mknod needs CAP_MKNOD)")
    assert outcome.ok, f"{outcome.kind}: {outcome.detail}"


def assert_clean(tally: Tally) -> None:
    assert tally.trials and tally.counts["exact"] == tally.trials, "\n".join(tally.failures)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
def test_every_field_deleted_or_with_a_wrong_type_is_refused_or_harmless(tmp_path, serializer):
    tally = Tally("wrong types")
    wrong_types_trial(str(tmp_path), serializer, tally)
    assert_clean(tally)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
def test_fuzzed_manifests_raise_only_documented_errors(tmp_path, serializer):
    tally = Tally("fuzz")
    fuzz_trial(str(tmp_path), serializer, FUZZ_EXAMPLES, tally)
    assert_clean(tally)


def nested(depth: int, leaf, key: str | None = "a"):
    for _ in range(depth):
        leaf = {key: leaf} if key else [leaf]
    return leaf


def test_save_refuses_what_restore_would_refuse_and_commits_nothing(tmp_path):
    """A tree deeper than MAX_PATH_DEPTH, or metadata deeper than MAX_JSON_DEPTH, used to save and then
    never restore (a silent loss); saves now refuse them."""
    with pytest.raises(fc.CheckpointError, match="cannot save.*deeper than 512"):
        fc.save(tmp_path / "deep", nested(600, np.ones(1)))
    with pytest.raises(fc.CheckpointError, match="cannot save.*metadata.*deeper than 64"):
        fc.save(tmp_path / "meta", {"x": np.ones(1)}, metadata=nested(100, 1, key=None))
    assert not os.listdir(tmp_path)
    with fc.CheckpointManager(tmp_path / "mgr") as mgr:  # metrics are numbers: nested ones refused at once
        with pytest.raises(fc.CheckpointError, match="metrics must be numbers.*'deep'"):
            mgr.save(1, {"x": np.ones(1)}, metrics={"deep": nested(100, 1)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == []
    fc.save(tmp_path / "ok", nested(500, np.ones(1)), metadata=nested(60, 1, key=None))  # at the limits: fine
    assert fc.restore(tmp_path / "ok") is not None
