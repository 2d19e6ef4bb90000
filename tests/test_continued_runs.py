"""Runs continued by a program that changed (issue 50): ``restore_or`` fits the run's own steps with
``missing``/``unexpected``/``rename`` (a program that now saves more, or less, than its earlier steps
hold), in the native layout and in Orbax's; and ``init_from`` takes another run's directory (its
newest good step) and, with ``continue_step=True``, carries that run's step on."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt.callbacks import CheckpointCallback
from helpers import assert_bit_exact


def params(step: int) -> dict:
    return {"w": np.full((2, 3), step, np.float32), "b": np.arange(3, dtype=np.float32) + step}


def grown(step: int) -> dict:
    """What the program saves now: its parameters plus an rng and a data position it did not save before."""
    return {
        "params": params(step),
        "rngs": np.full(2, 100 + step, np.uint32),
        "data_pos": np.int64(10 * step),
    }


def callback(directory, **kw) -> CheckpointCallback:
    return CheckpointCallback(directory, every_steps=1, max_to_keep=None, preemption_signals=(), **kw)


def old_run(directory, steps=(1, 2)) -> None:
    """A run whose steps hold the parameters only (the program before it grew)."""
    with callback(directory) as ckpt:
        for s in steps:
            ckpt(s, {"params": params(s)})


def test_a_program_that_saves_more_continues_its_own_native_run(tmp_path, caplog):
    old_run(tmp_path / "run")
    with callback(tmp_path / "run") as ckpt:
        with pytest.raises(fc.StructureMismatchError) as e:
            ckpt.restore_or(grown(0))
        assert 'missing="keep"' in str(e.value) and "'rngs'" in str(e.value)  # the suggestion...
        with caplog.at_level(logging.INFO, logger="flax_ckpt"):
            state, step, report = ckpt.restore_or(grown(0), missing="keep", report=True)  # ...works
        assert step == 2 and sorted(report.kept) == ["data_pos", "rngs"]
        assert "kept 2 the checkpoint lacks" in caplog.text
        assert_bit_exact(state, {**grown(0), "params": params(2)})
        ckpt(3, grown(3))
    with callback(tmp_path / "run") as ckpt:  # from now on the run's steps hold all of it
        state, step = ckpt.restore_or(grown(0))
    assert step == 3
    assert_bit_exact(state, grown(3))


def test_a_program_that_saves_less_or_renames_continues_its_own_run(tmp_path):
    with callback(tmp_path / "run") as ckpt:
        ckpt(1, grown(1))
    with callback(tmp_path / "run") as ckpt:
        state, step, report = ckpt.restore_or({"params": params(0)}, unexpected="ignore", report=True)
        assert step == 1 and sorted(report.ignored) == ["data_pos", "rngs"]
        assert_bit_exact(state, {"params": params(1)})
        renamed = {"kernel": params(0)["w"], "bias": params(0)["b"]}
        state, step = ckpt.restore_or(
            {"params": renamed},
            rename={"params/w": "params/kernel", "params/b": "params/bias"},
            unexpected="ignore",
        )
        assert_bit_exact(state, {"params": {"kernel": params(1)["w"], "bias": params(1)["b"]}})


def test_a_program_that_saves_more_continues_an_orbax_run_in_place(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as omgr:  # the program before: a "state" item of parameters only
        for s in (1, 2):
            omgr.save(s, args=ocp.args.Composite(state=ocp.args.StandardSave({"params": params(s)})))
    with callback(root) as ckpt:
        with pytest.raises(fc.StructureMismatchError) as e:
            ckpt.restore_or({"state": grown(0)})
        assert 'missing="keep"' in str(e.value) and "'state/rngs'" in str(e.value)
        state, step = ckpt.restore_or({"state": grown(0)}, missing="keep")
        assert step == 2
        assert_bit_exact(state["state"], {**grown(0), "params": params(2)})
        ckpt(3, {"state": grown(3)})
    assert sorted(os.listdir(root)) == ["1", "2", "3"]
    with ocp.CheckpointManager(root) as omgr:  # Orbax reads the grown step as its own
        got = omgr.restore(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore({**grown(0), "data_pos": np.zeros((), np.int64)})
            ),
        )
    assert_bit_exact(dict(got.state), {**grown(3), "data_pos": np.asarray(30, np.int64)}, types=False)


def test_init_from_a_run_directory_restores_its_newest_good_step_and_can_carry_the_step(tmp_path, caplog):
    with callback(tmp_path / "a") as ckpt:
        for s in (3, 6):
            ckpt(s, grown(s))
    # the default: a fine-tune of the run's newest step starts at step 0
    with callback(tmp_path / "fresh") as ckpt:
        state, step = ckpt.restore_or(grown(0), init_from=tmp_path / "a")
    assert step == 0
    assert_bit_exact(state, grown(6))
    # continue_step=True: the run goes on where the other left off, in a directory of its own
    with callback(tmp_path / "b") as ckpt:
        state, step = ckpt.restore_or(grown(0), init_from=tmp_path / "a", continue_step=True)
        assert step == 6
        assert_bit_exact(state, grown(6))
        ckpt(7, grown(7))
    assert fc.metadata(tmp_path / "b" / "7").step == 7 and not os.path.exists(tmp_path / "a" / "7")
    # a step folder carries its own step
    with callback(tmp_path / "c") as ckpt:
        _, step = ckpt.restore_or(grown(0), init_from=tmp_path / "a" / "3", continue_step=True)
    assert step == 3
    # the newest good step, as the run's manager restores it: a damaged step 6 falls back to step 3
    data = max(
        (os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "a" / "6") for f in fs),
        key=os.path.getsize,
    )
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with callback(tmp_path / "d") as ckpt, caplog.at_level(logging.WARNING):
        state, step = ckpt.restore_or(grown(0), init_from=tmp_path / "a", continue_step=True)
    assert step == 3
    assert_bit_exact(state, grown(3))


def test_continue_step_needs_a_checkpoint_that_records_a_step(tmp_path):
    fc.save(tmp_path / "pretrained", grown(5))  # saved without step=
    with callback(tmp_path / "run") as ckpt:
        with pytest.raises(ValueError, match="records no step"):
            ckpt.restore_or(grown(0), init_from=tmp_path / "pretrained", continue_step=True)
        with pytest.raises(TypeError, match="continue_step=True carries init_from's step"):
            ckpt.restore_or(grown(0), continue_step=True)
        assert ckpt.restore_or(grown(0), init_from=tmp_path / "pretrained")[1] == 0
