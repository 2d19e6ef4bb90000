"""A read-only CheckpointManager following a live run (issue 43, item 2): an evaluation job beside the
training job. It takes no lock, writes and deletes nothing, sees steps as they commit, and survives the
run's retention deleting the step it reads.

The writer is a real process saving every step with max_to_keep=2, SIGKILLed and restarted; the reader
runs here, restoring in a loop and comparing every restore bit for bit with the state of its step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from helpers import assert_bit_exact, die_with_parent, step_state, worker_env

SHAPE, SEED = (64, 256), 43


def state(step: int) -> dict:
    out = step_state(step, SHAPE, SEED)
    out["small"] = {f"b{i}": np.full((7,), step * 10 + i, np.int32) for i in range(8)}
    return out


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import flax_ckpt as fc
    from helpers import step_state
    directory, fmt, start = sys.argv[1], sys.argv[2], int(sys.argv[3])

    def state(step):
        out = step_state(step, %r, %d)
        out["small"] = {f"b{i}": np.full((7,), step * 10 + i, np.int32) for i in range(8)}
        return out

    with fc.CheckpointManager(directory, max_to_keep=2, format=fmt) as mgr:
        first = (mgr.latest_step() or start) + 1
        print("ready", first, flush=True)
        for step in range(first, first + 100000):
            mgr.save(step, state(step))
"""
    % (SHAPE, SEED)
)


def _writer(directory, fmt: str) -> subprocess.Popen:
    proc = forkserver.Popen(
        [sys.executable, "-c", WRITER, str(directory), fmt, "0"],
        env=worker_env(1),
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,
    )
    assert proc.stdout.readline().startswith("ready"), "the writer did not start"
    return proc


def _snapshot(directory) -> dict[str, tuple]:
    """Every entry under ``directory`` with its size and modification time."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), directory)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("fmt", ["native", "orbax"])
def test_reader_follows_a_live_writer_that_is_killed(ckpt_dir, fmt):
    """Restores in a loop while a writer saves every step (max_to_keep=2) and is SIGKILLed and restarted
    three times: every restore is bit-exact for the step it reports, the steps it sees advance, and no
    restore fails (a step deleted while read is followed by the newest one). Slow (tens of seconds): the
    writer is a real process, started four times, and the reader waits for its commits."""
    writer = _writer(ckpt_dir, fmt)
    reader = fc.CheckpointManager(ckpt_dir, read_only=True)
    restored, kills, deadline = [], 0, time.monotonic() + 300  # a hang: 3 rounds take seconds when idle
    try:
        while reader.latest_step() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer's first step
        while kills < 3 and time.monotonic() < deadline:
            first = reader.latest_step()
            round_end = time.monotonic() + 1.5
            while time.monotonic() < round_end or reader.latest_step() <= first + 5:
                got = reader.restore()
                step = reader.restore_stats[-1].step
                assert_bit_exact(got, _as_saved(state(step)), types=False)
                restored.append(step)
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(timeout=30)
            writer.stdout.close()
            kills += 1
            writer = _writer(ckpt_dir, fmt)
    finally:
        writer.kill()
        writer.wait(timeout=30)
        writer.stdout.close()
        reader.close()
    assert kills == 3, f"only {kills} kills in 300 s ({len(restored)} restores)"
    assert len(set(restored)) > 10 and restored == sorted(restored), restored
    assert reader.latest_step() is not None


def _as_saved(tree: dict) -> dict:
    """``tree`` as a restore without a target gives it back (numpy arrays; the step as it was stored)."""
    return tree


def test_reader_takes_no_lock_and_writes_nothing(ckpt_dir):
    """Beside a writing manager of this process (which holds the lock) and with a crashed save's leftover
    folder: the reader opens, lists, restores and closes, and the directory is byte for byte as it was."""
    leftover = ckpt_dir / ("3.tmp-" + "ab" * 16)
    with fc.CheckpointManager(ckpt_dir, max_to_keep=2, async_save=False) as writer:
        writer.save(1, state(1))
        writer.save(2, state(2))
        (leftover / "data").mkdir(parents=True)
        before = _snapshot(ckpt_dir)
        with fc.CheckpointManager(ckpt_dir, read_only=True) as reader:
            assert reader.all_steps() == [1, 2] and reader.latest_step() == 2
            assert_bit_exact(reader.restore(), _as_saved(state(2)), types=False)
            assert reader.item_metadata().step == 2
            with pytest.raises(fc.CheckpointError, match=r"read_only=True\) does not save"):
                reader.save(3, state(3))
            assert _snapshot(ckpt_dir) == before
            writer.save(3, state(3))  # the writer's retention deletes step 1; the reader sees it
            assert reader.all_steps() == [2, 3]
            before = _snapshot(ckpt_dir)
        assert _snapshot(ckpt_dir) == before
    assert leftover.is_dir()


def test_reader_of_a_directory_not_made_yet(tmp_path):
    """An evaluator that starts before the run: no steps, nothing created; the steps appear once saved."""
    directory = tmp_path / "run"
    reader = fc.CheckpointManager(directory, read_only=True)
    assert reader.latest_step() is None and not directory.exists()
    with pytest.raises(fc.CheckpointNotFoundError):
        reader.restore()
    with fc.CheckpointManager(directory, async_save=False) as writer:
        writer.save(5, state(5))
    assert reader.latest_step() == 5
    assert_bit_exact(reader.restore(), _as_saved(state(5)), types=False)
    reader.close()


def test_named_step_deleted_while_read_is_a_clear_error(ckpt_dir):
    """A named step that the run deletes while the reader reads it: CheckpointNotFoundError saying it was
    deleted while being restored (and which steps exist); step=None instead restores the newest."""
    with fc.CheckpointManager(ckpt_dir, async_save=False) as writer:
        writer.save(1, state(1))
        writer.save(2, state(2))
    reader = fc.CheckpointManager(ckpt_dir, read_only=True)

    def delete_step_1(info):  # runs once the step is opened, before its arrays are read
        with fc.CheckpointManager(ckpt_dir, max_to_keep=1, async_save=False) as w:
            w.save(3, state(3))
        return None

    with pytest.raises(fc.CheckpointNotFoundError, match=r"step 1 of .* was deleted while it was being"):
        reader.restore(1, target_for=delete_step_1)
    calls = []

    def delete_newest_once(info):
        if not calls:
            with fc.CheckpointManager(ckpt_dir, max_to_keep=1, async_save=False) as w:
                w.save(4, state(4))
        calls.append(info.step)
        return None

    got = reader.restore(target_for=delete_newest_once)
    assert calls == [3, 4] and reader.restore_stats[-1].step == 4
    assert_bit_exact(got, _as_saved(state(4)), types=False)
    reader.close()


def test_read_only_refuses_tiers(ckpt_dir):
    with pytest.raises(ValueError, match="drop tiers="):
        fc.CheckpointManager(ckpt_dir, read_only=True, tiers=fc.Tiers(local_dir=str(ckpt_dir / "m")))


def test_reader_sees_metrics_and_best_step_of_new_steps(ckpt_dir):
    reader = fc.CheckpointManager(ckpt_dir, read_only=True, best_metric="loss")
    with fc.CheckpointManager(ckpt_dir, async_save=False) as writer:
        writer.save(1, state(1), metrics={"loss": 0.5})
        writer.save(2, state(2), metrics={"loss": 0.25})
        assert reader.metrics(2) == {"loss": 0.25} and reader.best_step() == 2
        writer.save(3, state(3), metrics={"loss": 0.75})
        assert reader.best_step() == 2 and reader.metrics(3) == {"loss": 0.75}
    reader.close()


def _saves_once_after(monkeypatch, module, name: str, writer, steps: list[int]) -> list[int]:
    """Replaces ``module.name`` (a directory listing of the reader's scan) by a function that, the first
    time it returns, has ``writer`` save ``steps``: the run commits (and its retention deletes) right after
    the reader listed the directory, as a busy machine can arrange. Returns the steps saved so far."""
    real, saved = getattr(module, name), []

    def listing_then_saves(*args, **kwargs):
        out = real(*args, **kwargs)
        while len(saved) < len(steps):
            saved.append(steps[len(saved)])
            writer.save(saved[-1], state(saved[-1]))
        return out

    monkeypatch.setattr(module, name, listing_then_saves)
    return saved


@pytest.mark.parametrize("fmt", ["native", "orbax"])
def test_reader_scan_outrun_by_the_writer_still_sees_steps(ckpt_dir, monkeypatch, fmt):
    """The run saves two steps (max_to_keep=2) between the reader's listing of the directory and its
    reading of the steps listed: every step it listed is gone by then, yet steps are committed all along.
    The reader sees the new ones (it once concluded 'no committed checkpoint')."""
    from flax_ckpt._src import layouts

    with fc.CheckpointManager(ckpt_dir, max_to_keep=2, async_save=False, format=fmt) as writer:
        writer.save(1, state(1))
        writer.save(2, state(2))
        reader = fc.CheckpointManager(ckpt_dir, read_only=True)
        saved = _saves_once_after(monkeypatch, layouts, "step_folders", writer, [3, 4])
        assert reader.latest_step() == 4 and saved == [3, 4]
        assert_bit_exact(reader.restore(), _as_saved(state(4)), types=False)
        reader.close()


def test_reader_never_takes_a_new_orbax_step_for_a_damaged_one(ckpt_dir, monkeypatch, caplog):
    """An Orbax step committed while the reader's scan lists the directory is not read as a native step
    and reported damaged (the scan once listed the directory twice: Orbax steps first, the rest after)."""
    from flax_ckpt._src.orbax import locate

    with fc.CheckpointManager(ckpt_dir, max_to_keep=2, async_save=False, format="orbax") as writer:
        writer.save(1, state(1))
        writer.save(2, state(2))
        reader = fc.CheckpointManager(ckpt_dir, read_only=True)
        _saves_once_after(monkeypatch, locate, "step_dirs", writer, [3])
        with caplog.at_level("WARNING", logger="flax_ckpt"):
            assert reader.all_steps() == [2, 3]
        assert "damaged" not in caplog.text
        assert_bit_exact(reader.restore(), _as_saved(state(3)), types=False)
        reader.close()
