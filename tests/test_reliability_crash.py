"""Crash consistency at scale and signals: real SIGKILLs of async manager saves, real SIGTERMs.

Extends test_crash.py (a few spawned kills) with forked savers (harness/reliability_worker.Zygote) so that
many kills are cheap, both serializers, savers with a memory tier, keep_period survival and
temporary-folder refusal after every kill. The 200-kill run is marked slow and skipped unless FLAX_CKPT_SLOW=1 (benchmarks/faults.py runs
it too). The SIGTERM children are fresh interpreters, because their exit path is what is tested.
"""

from __future__ import annotations

import os
import random

import pytest
from reliability_trials import CrashRun, crash_trial, sigterm_trial
from reliability_worker import Zygote

SLOW = os.environ.get("FLAX_CKPT_SLOW") == "1"
DEFAULT_KILLS = int(os.environ.get("FLAX_CKPT_RELIABILITY_KILLS", "8"))


@pytest.fixture(scope="module")
def zygote():
    with Zygote() as z:
        yield z


def kill_many(z: Zygote, directory: str, kills: int, seed: int, tiers: bool = False) -> CrashRun:
    """``kills`` SIGKILLs of savers alternating raw and zarr3 in one directory; every one judged."""
    rng, run = random.Random(seed), CrashRun(directory, tiers=tiers)
    for i in range(kills):
        outcome = crash_trial(z, run, rng, ("raw", "zarr3")[i % 2])
        assert outcome.ok, f"kill {i + 1}/{kills}: {outcome.kind}: {outcome.detail}"
    return run


@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_of_async_saves_loses_nothing(zygote, tmp_path):
    """SIGKILL at random moments of async saves loses no committed step. Slow (tens of seconds):
    DEFAULT_KILLS saver processes (forked from a zygote), each killed after real commits."""
    run = kill_many(zygote, str(tmp_path / "ckpts"), DEFAULT_KILLS, seed=7)
    assert len(run.reported) >= DEFAULT_KILLS, (
        "the savers committed too little for the kills to test anything"
    )


@pytest.mark.timeout(300)
def test_sigkill_of_saves_through_a_memory_tier_loses_nothing(zygote, tmp_path):
    """SIGKILL of savers through a memory tier loses no committed step. Slow (tens of seconds): several
    saver processes, each killed after real commits."""
    run = kill_many(zygote, str(tmp_path / "ckpts"), max(2, DEFAULT_KILLS // 2), seed=8, tiers=True)
    assert run.reported, "the savers committed nothing before the kills"


@pytest.mark.timeout(300)
def test_sigkill_of_saves_that_share_bytes_never_frees_what_a_kept_step_needs(zygote, tmp_path):
    """Savers of a state whose parts change at different rates (later steps share the bytes of earlier
    ones, retired by retention): after every kill each step restores bit-exact, retired folders are
    never read and at most one is referred to by no step (a kill between a removal and its sweep)."""
    rng, run = random.Random(11), CrashRun(str(tmp_path / "ckpts"), state="shared")
    for i in range(max(3, DEFAULT_KILLS // 2)):
        outcome = crash_trial(zygote, run, rng, "raw")
        assert outcome.ok, f"kill {i + 1}: {outcome.kind}: {outcome.detail}"
    assert len(run.reported) >= 3, "the savers committed too little for the kills to test anything"
    manifests = [p for p in (tmp_path / "ckpts").glob("*/manifest.json")]
    assert any('"shared"' in p.read_text() for p in manifests), "no step shared bytes: nothing was tested"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    not SLOW, reason="200 SIGKILLs take minutes: set FLAX_CKPT_SLOW=1 (or run benchmarks/faults.py)"
)
def test_two_hundred_sigkills(zygote, tmp_path):
    for part in range(10):  # a fresh directory every 20 kills bounds the disk use and re-reads
        kill_many(zygote, str(tmp_path / f"run{part}"), 20, seed=1000 + part, tiers=part % 2 == 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "scenario,twice",
    [("save", False), ("save", True), ("restore", False)],
    ids=["during-save", "twice-during-save", "during-restore"],
)
def test_sigterm_waits_for_the_save_in_flight_and_exits_cleanly(tmp_path, scenario, twice):
    outcome = sigterm_trial(str(tmp_path / "ckpts"), scenario, random.Random(3), twice=twice)
    assert outcome.ok, f"{outcome.kind}: {outcome.detail}"
