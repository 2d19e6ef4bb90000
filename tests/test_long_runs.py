"""A long run stays the same size: its statistics keep a window of the newest records with totals
over all (``mgr.stats``, ``mgr.restore_stats``, ``mgr.tier_stats``), and a save of many one-element
leaves costs time and memory per leaf that do not grow with the number of leaves."""

from __future__ import annotations

import numpy as np

import flax_ckpt as fc
from flax_ckpt._src import window


def test_statistics_keep_the_newest_records_and_totals_over_every_save(tmp_path, monkeypatch):
    monkeypatch.setattr(window, "SIZE", 5)
    state = {"w": np.ones(256, np.float32)}
    tiers = fc.Tiers(local_dir=str(tmp_path / "shm"), on_busy="wait", persist_interval_steps=4)
    with fc.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        for step in range(12):
            mgr.save(step, state)
        for _ in range(7):
            mgr.restore(11, state)
        assert [s.step for s in mgr.stats] == [7, 8, 9, 10, 11]
        assert mgr.stats.added == 12 and mgr.stats.totals["nbytes"] == 12 * state["w"].nbytes
        assert sum(s.durable_s for s in mgr.stats) < mgr.stats.totals["durable_s"]
        assert len(mgr.restore_stats) == 5 and mgr.restore_stats.added == 7
    with fc.CheckpointManager(tmp_path / "tiered", tiers=tiers) as mgr:
        for step in range(12):
            mgr.save(step, state)
            mgr.wait_until_finished()
        assert [s.step for s in mgr.tier_stats] == [7, 8, 9, 10, 11]
        assert mgr.tier_stats.added == 12 and mgr.tier_stats.totals["nbytes"] == 12 * state["w"].nbytes
