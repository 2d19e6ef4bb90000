"""Object-store faults during save and restore: 5xx answers, dropped and reset connections, truncated
bodies and lost replies injected by harness/s3_server.py's FaultProxy in front of a real S3-protocol
server on loopback. A save that fails is a SaveFailedError and commits nothing partial; a restore is
bit-exact or a CheckpointError; nothing older is lost. Skipped where moto is not installed.
"""

from __future__ import annotations

import itertools
import random

import pytest

pytest.importorskip("moto", reason="the S3 fault tests need moto[server] (the test extra)")

from reliability_s3 import s3_restore_trial, s3_rig, s3_save_trial, s3_state  # noqa: E402
from s3_server import Faults  # noqa: E402

import flax_ckpt as fc  # noqa: E402

TRIALS = 3


@pytest.fixture(scope="module")
def rig():
    with s3_rig() as r:
        yield r


@pytest.mark.timeout(180)
@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
def test_faults_during_save_commit_nothing_partial_and_lose_nothing(rig, serializer):
    rng = random.Random(11)
    for i in range(TRIALS):
        outcome, note = s3_save_trial(rig, serializer, rng)
        assert outcome.ok, f"trial {i} ({note}): {outcome.kind}: {outcome.detail}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
def test_faults_during_restore_give_the_bytes_or_an_error(rig, serializer):
    """fc.restore of a step URL; a manager opened under faults is the benchmark's (it may hit the
    scan defect below at random)."""
    rng = random.Random(12)
    for i in range(TRIALS):
        outcome, note = s3_restore_trial(rig, serializer, rng, via="engine")
        assert outcome.ok, f"trial {i} ({note}): {outcome.kind}: {outcome.detail}"


def test_a_transient_error_while_a_manager_scans_does_not_hide_a_committed_step(rig):
    url = rig.url("scan-hides")
    with fc.CheckpointManager(url) as mgr:
        mgr.save(1, s3_state(1))
    failures = itertools.count()  # the first 4 GETs of the manifest answer 503: more than the retries
    rig.proxy.faults = Faults(
        rate=1.0,
        modes=("503",),
        match=lambda method, path: (
            method == "GET" and path.split("?")[0].endswith("/1/manifest.json") and next(failures) < 4
        ),
    )
    try:
        with fc.CheckpointManager(url) as mgr:  # may raise StorageError: saying so is fine, hiding is not
            assert mgr.latest_step() == 1
    except fc.StorageError:
        pass
    finally:
        rig.calm()
