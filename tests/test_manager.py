"""CheckpointManager: schedule, retention, restart, background failures, lock, cleanup, snapshots."""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src.retention import Retention, ranked, steps_to_delete
from helpers import assert_bit_exact, manifest_body


def state(step: int) -> dict:
    return {"w": np.full((64, 64), step, np.float32), "step": step}


# ------------------------------------------------------------------------------------- retention rules


def test_max_to_keep_keeps_newest():
    assert steps_to_delete(range(1, 7), max_to_keep=2) == [1, 2, 3, 4]
    assert steps_to_delete(range(1, 7), max_to_keep=None) == []


def test_keep_period_keeps_multiples_forever():
    assert steps_to_delete(range(1, 11), max_to_keep=2, keep_period=4) == [1, 2, 3, 5, 6, 7]


def test_keep_best_keeps_best_even_when_old_and_never_the_newest():
    losses = {1: 0.1, 2: 0.5, 3: 0.2, 4: 0.9, 5: 0.8}
    assert steps_to_delete(losses, max_to_keep=1, metrics=losses, keep_best=2) == [2, 4]
    assert steps_to_delete(losses, max_to_keep=1, metrics=losses, keep_best=1, best_mode="max") == [1, 2, 3]
    # the newest is kept even though it is worst and max_to_keep is spent on best ones (orbax#526)
    worst_last = {1: 0.1, 2: 0.2, 3: 9.0}
    assert 3 not in steps_to_delete(worst_last, max_to_keep=1, metrics=worst_last, keep_best=2)


def test_steps_without_the_metric_never_count_as_best():
    metrics = {1: None, 2: float("nan"), 3: 0.3, 4: None}
    assert steps_to_delete(metrics, max_to_keep=1, metrics=metrics, keep_best=1) == [1, 2]


def test_all_rules_combined():
    metrics = {s: float(abs(s - 7)) for s in range(1, 21)}
    gone = steps_to_delete(metrics, max_to_keep=3, keep_period=10, metrics=metrics, keep_best=2)
    kept = sorted(set(range(1, 21)) - set(gone))
    # best two: 7 (0.0), then 8 over 6 (tie at 1.0: the newer wins); 10 by period; 18-20 newest
    assert kept == [7, 8, 10, 18, 19, 20]


def test_best_step_and_keep_best_share_one_ranking(tmp_path):
    values = {1: 0.2, 2: 0.1, 3: 0.1, 4: float("nan"), 5: None}
    assert ranked(values) == [3, 2, 1] and ranked(values, "max") == [1, 3, 2]  # a tie: the newer first
    metrics = {s: {"loss": v} for s, v in values.items()}
    retention = Retention(max_to_keep=1, best_metric="loss", keep_best=1)
    assert retention.best_step(metrics) == 3 and retention.doomed(metrics) == [1, 2, 4]
    with fc.CheckpointManager(tmp_path / "run") as mgr:  # the memory tiers' test hook, without tiers
        assert mgr.memory_tiers is None and mgr.tier_stats == []


# ----------------------------------------------------------------------------------- manager on disk


@pytest.mark.parametrize("async_save", [True, False])
def test_schedule_force_and_retention_on_disk(ckpt_dir, async_save):
    with fc.CheckpointManager(ckpt_dir, save_interval_steps=3, max_to_keep=2, async_save=async_save) as mgr:
        saved = [s for s in range(1, 11) if mgr.save(s, state(s))]
        assert saved == [3, 6, 9]
        assert mgr.save(10, state(10), force=True)
        assert not mgr.save(10, state(10), force=True)  # already saved: skipped
        mgr.wait_until_finished()
        assert mgr.all_steps() == [9, 10] and mgr.latest_step() == 10
        assert sorted(e for e in os.listdir(ckpt_dir) if not e.startswith(".")) == ["10", "9"]
        np.testing.assert_array_equal(mgr.restore()["w"], state(10)["w"])
        np.testing.assert_array_equal(mgr.restore(9, state(0))["w"], state(9)["w"])
        with pytest.raises(fc.CheckpointNotFoundError, match="no committed step 3"):
            mgr.restore(3)


def test_best_metric_and_metrics_survive_a_restart(ckpt_dir):
    losses = [0.9, 0.3, 0.5, 0.1, 0.7, 0.8]
    with fc.CheckpointManager(ckpt_dir, max_to_keep=2, best_metric="loss", keep_best=1) as mgr:
        for s, loss in enumerate(losses, start=1):
            mgr.save(s, state(s), metrics={"loss": loss, "acc": 1 - loss})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4, 5, 6] and mgr.best_step() == 4
    with fc.CheckpointManager(ckpt_dir, max_to_keep=2, best_metric="loss", keep_best=1) as mgr:
        assert mgr.all_steps() == [4, 5, 6] and mgr.best_step() == 4
        assert mgr.metrics(5) == {"loss": 0.7, "acc": pytest.approx(0.3)}
        mgr.save(7, state(7), metrics={"loss": 0.6})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4, 6, 7]  # retention resumed from the directory
        np.testing.assert_array_equal(mgr.restore(mgr.best_step())["w"], state(4)["w"])


def test_save_waits_for_the_save_in_flight(ckpt_dir):
    big = {"w": np.ones((2048, 2048), np.float32)}
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, big)
        mgr.save(2, big)  # returns only after step 1 is committed (one save in flight at most)
        assert os.path.exists(ckpt_dir / "1" / "manifest.json")


def test_mutation_and_donation_after_save_do_not_change_what_is_written(ckpt_dir):
    host = np.arange(1_000_000, dtype=np.float32)
    dev = jnp.arange(1_000_000, dtype=jnp.float32)
    expected_host, expected_dev = host.copy(), np.asarray(dev).copy()
    donate = jax.jit(lambda x: x * 0 - 1, donate_argnums=0)
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"host": host, "dev": dev})
        host[:] = -1  # mutate right after save returns
        out = donate(dev)  # donate the buffer right after save returns
        out.block_until_ready()
        mgr.wait_until_finished()
        restored = mgr.restore()
    np.testing.assert_array_equal(restored["host"], expected_host)
    np.testing.assert_array_equal(restored["dev"], expected_dev)


def test_reused_snapshot_buffers_never_leak_into_an_earlier_step(ckpt_dir):
    """The manager refills the previous durable snapshot's host buffers; each step keeps its own bytes."""
    host = np.zeros((512, 512), np.float32)
    with fc.CheckpointManager(ckpt_dir) as mgr:
        for s in range(1, 5):
            host[:] = s
            mgr.save(s, {"w": host, "n": s})
        mgr.wait_until_finished()
        for s in range(1, 5):
            np.testing.assert_array_equal(mgr.restore(s)["w"], np.full((512, 512), s, np.float32))


def test_stats_are_recorded_and_logged(ckpt_dir, caplog):
    caplog.set_level(logging.INFO, logger="flax_ckpt")
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state(1))
        mgr.wait_until_finished()
        s = mgr.stats[-1]
    assert s.step == 1 and s.nbytes == 64 * 64 * 4
    assert 0 <= s.blocked_s <= s.durable_s and s.write_s >= 0 and s.throughput_gbps > 0
    assert any("saved step 1" in r.getMessage() for r in caplog.records)


def test_debug_logging_gives_every_field_of_a_save_and_info_only_its_line(ckpt_dir, caplog):
    """At DEBUG the logger gets every field of each save's statistics; at INFO only the one line per
    save (the fields are not gathered then)."""
    caplog.set_level(logging.INFO, logger="flax_ckpt")
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state(1))
        mgr.wait_until_finished()
        assert not [r for r in caplog.records if "save statistics" in r.getMessage()]
        caplog.set_level(logging.DEBUG, logger="flax_ckpt")
        mgr.save(2, state(2))
        mgr.wait_until_finished()
    (line,) = [r.getMessage() for r in caplog.records if "save statistics" in r.getMessage()]
    assert "'step': 2" in line and "'nbytes': 16384" in line and "'blocked_s'" in line, line


# ------------------------------------------------------------------------------------------ failures


def test_background_failure_is_raised_next_and_commits_nothing(ckpt_dir):
    """A real write failure (file size limit: EFBIG, like a full disk) in the background thread."""
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state(1))
        mgr.wait_until_finished()
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            mgr.save(2, {"w": np.ones((1024, 1024), np.float32)})  # 4 MB > 1 MB limit
            with pytest.raises(fc.SaveFailedError, match="step 2") as e:
                mgr.wait_until_finished()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old_handler)
        assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.__traceback__ is not None
        assert mgr.all_steps() == [1]
        assert sorted(e for e in os.listdir(ckpt_dir) if not e.startswith(".")) == ["1"]
        np.testing.assert_array_equal(mgr.restore()["w"], state(1)["w"])
        assert mgr.save(3, state(3))  # works again once space returns
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]


def test_background_failure_is_raised_from_the_next_save(ckpt_dir):
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, state(1))
        mgr.wait_until_finished()
        os.makedirs(ckpt_dir / "2")  # something occupies the step's name: the commit must refuse it
        (ckpt_dir / "2" / "junk").write_text("x")
        mgr.save(2, state(2))
        with pytest.raises(fc.SaveFailedError) as e:
            mgr.save(3, state(3))
        assert isinstance(e.value.__cause__, fc.CheckpointExistsError)
        assert (ckpt_dir / "2" / "junk").read_text() == "x"


def test_damaged_newest_step_falls_back_unless_strict(ckpt_dir, caplog):
    with fc.CheckpointManager(ckpt_dir) as mgr:
        for s in (1, 2):
            mgr.save(s, state(s))
    data = next((ckpt_dir / "2" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[10] ^= 1
    data.write_bytes(bytes(raw))
    with fc.CheckpointManager(ckpt_dir) as mgr:
        with caplog.at_level(logging.WARNING, logger="flax_ckpt"):
            np.testing.assert_array_equal(mgr.restore()["w"], state(1)["w"])
        assert any("falling back" in r.getMessage() for r in caplog.records)
    with fc.CheckpointManager(ckpt_dir, strict=True) as mgr:
        with pytest.raises(fc.CorruptCheckpointError):
            mgr.restore()


# ------------------------------------------------------------------------------------ lock, cleanup


def test_second_manager_of_this_process_is_refused_saying_so(ckpt_dir):
    """An earlier, unclosed manager of this process on the same directory (a notebook cell run again):
    the error says that this process's own earlier manager holds it, and how to close it."""
    earlier = fc.CheckpointManager(ckpt_dir)
    earlier.save(1, state(1))
    with pytest.raises(
        fc.CheckpointLockedError,
        match=r"in use by an earlier CheckpointManager of this process "
        rf"\(pid {os.getpid()}\), which was never closed .* mgr.close\(\)",
    ):
        fc.CheckpointManager(str(ckpt_dir) + "/../" + ckpt_dir.name)
    earlier.close()
    with fc.CheckpointManager(ckpt_dir) as mgr:  # free again once closed
        assert_bit_exact(mgr.restore(1), state(1), types=False)


def test_lock_of_a_killed_process_is_released(ckpt_dir):
    code = (
        "import flax_ckpt as fc, sys, time; m = fc.CheckpointManager(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(60)"
    )
    proc = forkserver.Popen([sys.executable, "-c", code, str(ckpt_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(fc.CheckpointLockedError, match=f"pid {proc.pid}"):
            fc.CheckpointManager(ckpt_dir)
        proc.kill()
        proc.wait(timeout=30)
        fc.CheckpointManager(ckpt_dir).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_leftovers_of_crashed_saves_are_removed(ckpt_dir):
    fc.save(ckpt_dir / "1", state(1))
    for leftover in ("2.tmp-" + "0123abcd" * 4, "1.deleting-" + "feed" * 8):
        (ckpt_dir / leftover / "data").mkdir(parents=True)
    (ckpt_dir / "notes").mkdir()
    with fc.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.all_steps() == [1]
    assert sorted(os.listdir(ckpt_dir)) == [".flax_ckpt.lock", "1", "notes"]


def test_bad_options_are_refused():
    for kwargs, msg in [
        ({"save_interval_steps": 0}, "save_interval_steps"),
        ({"max_to_keep": 0}, "max_to_keep"),
        ({"best_mode": "low"}, "best_mode"),
        ({"keep_best": 2}, "best_metric"),
    ]:
        with pytest.raises(ValueError, match=msg):
            fc.CheckpointManager("/tmp/never-created-flax-ckpt", **kwargs)
    assert not os.path.exists("/tmp/never-created-flax-ckpt")


def test_restore_from_empty_directory(ckpt_dir):
    with fc.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.latest_step() is None and mgr.best_step() is None
        with pytest.raises(fc.CheckpointNotFoundError, match="no committed checkpoint"):
            mgr.restore()


def test_saves_from_a_thread_while_main_thread_works(ckpt_dir):
    import threading

    with fc.CheckpointManager(ckpt_dir, max_to_keep=2) as mgr:
        t = threading.Thread(target=lambda: [mgr.save(s, state(s)) for s in range(1, 6)])
        t.start()
        total = sum(float(jnp.sum(jnp.ones((256, 256)) * i)) for i in range(50))
        t.join(timeout=60)
        mgr.wait_until_finished()
        assert total > 0 and mgr.all_steps() == [4, 5]
        assert manifest_body(ckpt_dir / "5")["step"] == 5


def test_saving_a_step_whose_folder_is_damaged_sets_the_old_one_aside(ckpt_dir):
    with fc.CheckpointManager(ckpt_dir) as mgr:
        for s in (1, 2):
            mgr.save(s, state(s))
    manifest = ckpt_dir / "2" / "manifest.json"
    manifest.write_text(manifest.read_text()[:-20])  # damaged: no longer valid JSON
    with fc.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.all_steps() == [1]
        assert mgr.save(2, state(20))  # the resumed run reaches step 2 again
        mgr.wait_until_finished()
        np.testing.assert_array_equal(mgr.restore(2)["w"], state(20)["w"])
    aside = [e for e in os.listdir(ckpt_dir) if e.startswith("2.damaged-")]
    assert len(aside) == 1 and (ckpt_dir / aside[0] / "data").is_dir()  # kept for inspection, not deleted


def test_an_async_write_waits_a_grace_for_the_callers_next_step_unless_something_waits_for_it(
    tmp_path, monkeypatch
):
    """An async save's write starts a grace after the save call (so that the caller's next step is
    dispatched before the writer competes for the GIL: manager._GRACE, made 120 s here to be seen), at
    most a tenth of the time since the previous save; the next save's back-pressure,
    wait_until_finished and close end it at once; a synchronous save never waits for it. Every step is
    committed and restores."""
    import time

    from flax_ckpt._src.manager import directory as directory_mod
    from flax_ckpt._src.manager import manager as manager_mod

    grace = 120.0  # far above what the steps below take on a busy machine: only an ended grace is quick
    monkeypatch.setattr(manager_mod, "_GRACE", grace)
    started: list[int] = []
    real = directory_mod.Directory.save

    def persist(self, step, *args, **kwargs):
        started.append(step)
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(directory_mod.Directory, "save", persist)

    def until(n: int) -> None:
        deadline = time.monotonic() + grace / 2  # progress: a write started by itself, well before the grace
        while len(started) < n and time.monotonic() < deadline:
            time.sleep(0.01)

    with fc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(0, state(0))  # a first save: the whole grace
        time.sleep(0.5)
        assert started == []
        mgr.save(1, state(1))  # its back-pressure ends step 0's grace; step 1's is a tenth of 0.5 s
        assert started == [0] and mgr.all_steps() == [0]
        until(2)
        assert started == [0, 1]  # started by itself, nothing waiting for it
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(2, state(2))
        time.sleep(0.3)
        assert started == [0, 1]
        mgr.wait_until_finished()
        assert started == [0, 1, 2] and mgr.all_steps() == [0, 1, 2]
        mgr.save(3, state(3))  # a tenth of 0.3 s or more: close ends it if it is still running
    assert started == [0, 1, 2, 3]
    t0 = time.monotonic()
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(4, state(4))
    assert started == [0, 1, 2, 3, 4] and time.monotonic() - t0 < grace / 2  # close ended its grace
    with fc.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(5, state(5))  # committed when it returns
        assert started[-1] == 5 and mgr.all_steps() == [0, 1, 2, 3, 4, 5]
        for step in range(6):
            np.testing.assert_array_equal(mgr.restore(step, target=state(0))["w"], state(step)["w"])
