"""Full disks and damaged bytes: saves onto a real full tmpfs, and every byte-range class of a
committed checkpoint truncated, deleted or bit-flipped, with both serializers.

Extends test_errors.py (fc.restore of one damaged data file) and test_manager.py (one flip, one
RLIMIT_FSIZE failure) to every class (data, zarr3 array metadata, manifest body, commit record),
every damage, manager fallback with its warning, and strict mode. The tmpfs tests mount one (root
only) and skip, saying why, where mounting is refused.
"""

from __future__ import annotations

import os
import random

import jax.numpy as jnp
import numpy as np
import pytest
from reliability_trials import (
    DAMAGE_CLASSES,
    DAMAGE_MODES,
    MountRefused,
    damage,
    damage_trial,
    disk_full_trial,
    is_enospc,
    small_state,
    tmpfs,
)

import flax_ckpt as fc

CASES = [
    (ser, cls, mode) for ser, classes in DAMAGE_CLASSES.items() for cls in classes for mode in DAMAGE_MODES
]


@pytest.fixture
def small_tmpfs(tmp_path):
    try:
        with tmpfs(str(tmp_path / "mnt"), "8m") as mount:
            yield mount
    except MountRefused as e:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root and mount permission): {e}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
def test_full_disk_fails_the_save_clearly_keeps_older_steps_and_recovers(small_tmpfs, serializer):
    for seed in range(2):  # two amounts of room left: the failing write differs
        outcome = disk_full_trial(small_tmpfs, serializer, random.Random(seed))
        assert outcome.ok, f"{outcome.kind}: {outcome.detail}"


@pytest.mark.timeout(120)
def test_full_tmpfs_fails_a_memory_tier_save_clearly_and_keeps_the_older_copy(small_tmpfs, tmp_path):
    """The memory tier writes through maps: a full tmpfs must be an error naming the file (pages are
    reserved before they are mapped), never a SIGBUS, and the copy before it must still restore."""

    def state(step: int, mib: int) -> dict:
        return {"w": jnp.asarray(np.random.default_rng(step).standard_normal(mib << 18, np.float32))}

    tiers = fc.Tiers(
        local_dir=os.path.join(small_tmpfs, "tiers"),
        persist_interval_steps=None,
        max_to_keep=1,
        cleanup=False,
    )
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in (1, 2):  # 2 MiB copies: the second is written into the spare the first left
            mgr.save(step, state(step, 2))
            mgr.wait_until_finished()
        with pytest.raises(fc.SaveFailedError) as info:  # 6 MiB: more than the 8 MiB tmpfs has left
            mgr.save(3, state(3, 6))
            mgr.wait_until_finished()
        assert is_enospc(info.value) and "data.bin" in repr(info.value.__cause__), repr(info.value.__cause__)
        target = {"w": jnp.zeros(2 << 18, jnp.float32)}
        assert np.asarray(mgr.restore(target=target)["w"]).tobytes() == np.asarray(state(2, 2)["w"]).tobytes()
        assert mgr.restore_stats[-1].tier == "local"
        mgr.save(4, state(4, 2))  # the tier goes on once a copy fits again
        mgr.wait_until_finished()
        assert np.asarray(mgr.restore(target=target)["w"]).tobytes() == np.asarray(state(4, 2)["w"]).tobytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("serializer,cls,mode", CASES, ids=["-".join(c) for c in CASES])
def test_damaged_newest_step_is_named_and_the_manager_falls_back(tmp_path, serializer, cls, mode):
    outcome = damage_trial(
        str(tmp_path / "ckpts"), serializer, cls, mode, random.Random(hash((cls, mode)) & 0xFFFF)
    )
    assert outcome.ok, f"{outcome.kind}: {outcome.detail}"


@pytest.mark.parametrize("cls", ["manifest", "commit"])
def test_strict_manager_refuses_a_damaged_newest_manifest(tmp_path, cls):
    d = tmp_path / "ckpts"
    with fc.CheckpointManager(d) as mgr:
        mgr.save(1, small_state(1))
        mgr.save(2, small_state(2))
    damage(str(d / "2"), cls, "flip", random.Random(0))
    with fc.CheckpointManager(d, strict=True) as mgr:
        with pytest.raises(fc.CheckpointError):
            mgr.restore()
