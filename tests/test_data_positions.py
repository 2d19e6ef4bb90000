"""Data positions through the callback: a position that ``missing="keep"`` keeps is left alone, a stored
position the iterator refuses is a ``TargetMismatchError`` naming the item and the step, grain's
``repr(data_source)`` is not stored whole at every save, and ``EpochLoader`` resumes a loop that takes a
fresh iterator from its loader at every epoch (``for batch in loader``) mid-epoch, bit-exact."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import textwrap

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt.callbacks import CheckpointCallback, EpochLoader, to_tree
from test_in_place_and_grain import committed_steps, run_child

gp = pytest.importorskip("grain.python")

SOURCE = [np.full(3, i, np.int32) for i in range(40)]


def loader(source=SOURCE, seed=7):
    """A grain DataLoader (no worker processes) of batches of 4: ten batches an epoch."""
    sampler = gp.IndexSampler(
        len(source), shard_options=gp.NoSharding(), shuffle=True, num_epochs=1, seed=seed
    )
    return gp.DataLoader(data_source=source, sampler=sampler, operations=[gp.Batch(4)], worker_count=0)


def callback(directory):
    return CheckpointCallback(directory, every_steps=1, max_to_keep=None, preemption_signals=())


class Position:
    """An iterator whose position is bytes and whose set_state takes any bytes (zeros too)."""

    def __init__(self, text: bytes):
        self.text, self.set_calls = text, 0

    def __next__(self):
        return self.text

    def get_state(self):
        return self.text

    def set_state(self, state):
        self.text, self.set_calls = state, self.set_calls + 1


# --------------------------------------------------------------------- missing="keep" keeps the position


def test_init_from_with_missing_keep_leaves_a_grain_loader_where_it_is(tmp_path):
    """docs/finetuning.md's start of a fine-tune with a grain DataLoader in the state: the pretrained
    checkpoint has no data item, so the iterator keeps its own position and goes on from it."""
    fc.save(tmp_path / "pretrained", {"w": np.ones(3, np.float32)})
    expected = iter(loader())
    data = iter(loader())
    for _ in range(2):
        next(expected)
        next(data)
    with callback(tmp_path / "run") as ckpt:
        restored, start = ckpt.restore_or(
            {"w": np.zeros(3, np.float32), "data": data}, init_from=tmp_path / "pretrained", missing="keep"
        )
    assert start == 0 and restored["data"] is data and restored["w"].tolist() == [1.0, 1.0, 1.0]
    for _ in range(3):
        np.testing.assert_array_equal(next(data), next(expected))


def test_a_kept_position_is_never_given_to_set_state(tmp_path):
    """An iterator whose set_state accepts zeros was reset silently; now set_state is not called for a
    position the checkpoint lacks: after init_from, and when a run's own steps predate the item."""
    fc.save(tmp_path / "pretrained", {"w": np.ones(3, np.float32)})
    data = Position(b'{"index": 12}')
    with callback(tmp_path / "run") as ckpt:
        ckpt.restore_or(
            {"w": np.zeros(3, np.float32), "data": data}, init_from=tmp_path / "pretrained", missing="keep"
        )
        ckpt(1, {"w": np.zeros(3, np.float32)})  # this run's first steps hold no data item
    assert (data.text, data.set_calls) == (b'{"index": 12}', 0)
    with callback(tmp_path / "run") as ckpt:
        restored, start = ckpt.restore_or({"w": np.zeros(3, np.float32), "data": data}, missing="keep")
    assert start == 1 and (data.text, data.set_calls) == (b'{"index": 12}', 0)
    with callback(tmp_path / "again") as ckpt:  # a position the step holds is set, as always
        ckpt(1, {"data": Position(b'{"index": 99}')})
    with callback(tmp_path / "again") as ckpt:
        ckpt.restore_or({"data": data})
    assert (data.text, data.set_calls) == (b'{"index": 99}', 1)


# ------------------------------------------------------------------- a stored position the iterator refuses


def other_loaders_position():
    it = iter(loader(SOURCE[:8], seed=1))
    next(it)
    return it.get_state()


@pytest.mark.parametrize(
    "stored",
    [b"\xff\xfe\x00garbage", b'{"version": 2, "last_seen', b"[1, 2]", other_loaders_position()],
    ids=["garbage", "truncated-json", "json-list", "another-loaders"],
)
def test_a_position_the_loader_refuses_is_a_checkpoint_error_naming_step_and_item(tmp_path, stored):
    with callback(tmp_path / "run") as ckpt:
        ckpt(3, {"w": np.ones(2), "data": Position(stored)})
    before = sorted(os.listdir(tmp_path / "run"))
    data = iter(loader())
    with callback(tmp_path / "run") as ckpt:
        with pytest.raises(
            fc.TargetMismatchError, match=r"position stored for 'data' in step 3 of .*run"
        ) as e:
            ckpt.restore_or({"w": np.zeros(2), "data": data})
        assert "DataLoaderIterator" in str(e.value) and 'unexpected="ignore"' in str(e.value)
        assert ckpt.manager.all_steps() == [3]
    assert sorted(os.listdir(tmp_path / "run")) == before  # nothing of the run lost
    np.testing.assert_array_equal(next(data), next(iter(loader())))  # the iterator as it was


# --------------------------------------------------------------------- a position that holds the dataset


@dataclasses.dataclass
class Corpus:
    """A source whose dataclass repr holds every token (as the miniGPT tutorial's does)."""

    tokens: list

    def __len__(self):
        return len(self.tokens) // 8

    def __getitem__(self, i):
        return np.asarray(self.tokens[i * 8 : (i + 1) * 8], np.int32)


def corpus_iter(first_token=0):
    corpus = Corpus(list(range(first_token, first_token + 20000)))  # a repr of 120 KiB
    sampler = gp.IndexSampler(len(corpus), gp.NoSharding(), shuffle=True, num_epochs=1, seed=1)
    return iter(gp.DataLoader(data_source=corpus, sampler=sampler, operations=[gp.Batch(2)], worker_count=0))


def test_a_data_source_repr_is_stored_as_its_digest_and_checked_on_restore(tmp_path):
    data = corpus_iter()
    for _ in range(2):
        next(data)
    assert len(data.get_state()) > 100_000
    with callback(tmp_path / "run") as ckpt:
        ckpt(2, {"data": data})
    leaf = fc.metadata(tmp_path / "run" / "2").tree["data"]
    assert leaf.dtype == "uint8" and leaf.shape[0] < 1024  # not the corpus
    fresh = corpus_iter()
    with callback(tmp_path / "run") as ckpt:
        ckpt.restore_or({"data": fresh})
    for _ in range(3):
        np.testing.assert_array_equal(next(fresh), next(data))
    with callback(tmp_path / "run") as ckpt:  # another corpus: grain's own check still tells
        with pytest.raises(
            fc.TargetMismatchError, match="(?s)'data' in step 2.*DataSource in checkpoint does not"
        ):
            ckpt.restore_or({"data": corpus_iter(first_token=1)})


def test_a_large_position_kept_as_it_is_warns_once_naming_the_item_and_the_fix(caplog):
    """An Orbax run stores grain's file as it is: the position holds the corpus, and one warning says
    so, naming the item and the fix (a short __repr__)."""
    data = corpus_iter()
    with caplog.at_level(logging.WARNING, logger="flax_ckpt.callbacks"):
        for _ in range(3):
            to_tree({"corpus_data": data}, keep_bytes=True)
    warnings = [r.getMessage() for r in caplog.records if "corpus_data" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "repr(data_source)" in warnings[0] and "short __repr__" in warnings[0]
    assert "DataLoaderIterator" in warnings[0]


# ------------------------------------------------------------------------ a fresh iterator every epoch


def train(directory, stop_at=None):
    """Three epochs of `for batch in data`, saving every 4 steps; leaves the loop (a preemption's save
    at that step) after step ``stop_at``. (the batches seen as (step, first column), the final w)"""
    data = EpochLoader(loader())
    seen = []
    with callback(directory) as ckpt:
        restored, step = ckpt.restore_or({"w": np.zeros(3, np.int64), "data": data})
        w = restored["w"]
        for _ in range(data.epoch, 3):
            for batch in data:
                w, step = w * 3 + batch.sum(0), step + 1
                seen.append((step, batch[:, 0].tolist()))
                ckpt(step, {"w": w, "data": data})
                if step == stop_at:
                    return seen, w
    return seen, w


@pytest.mark.parametrize("stop_at", [4, 10, 13])  # mid-epoch, an epoch's last batch, the next epoch
def test_an_epoch_loader_resumes_mid_epoch_bit_exact(tmp_path, stop_at):
    whole, w = train(tmp_path / "whole")
    assert len(whole) == 30 and whole[0][1] == whole[10][1]  # each epoch a fresh iterator, as `for` gives
    first, _ = train(tmp_path / "run", stop_at)
    second, w_resumed = train(tmp_path / "run")
    assert first + second == whole and np.array_equal(w_resumed, w)


def test_a_data_loader_given_as_it_is_names_epoch_loader(tmp_path):
    with callback(tmp_path / "run") as ckpt:
        with pytest.raises(fc.UnsupportedLeafError, match=r"data: DataLoader.*EpochLoader\(loader\)"):
            ckpt(1, {"data": loader()})
    with pytest.raises(TypeError, match="no get_state"):
        EpochLoader([np.zeros(2)]).get_state()


EPOCH_LOOP = textwrap.dedent("""
    import hashlib, os, signal, sys
    import numpy as np
    import grain.python as grain  # the worker processes import this module again: nothing heavy here


    class Records:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return np.random.default_rng(i).standard_normal(3).astype(np.float32)

        def __repr__(self):
            return "Records(24)"


    if __name__ == "__main__":
        from absl import flags
        flags.FLAGS.mark_as_parsed()  # grain reads absl flags
        from flax_ckpt.callbacks import CheckpointCallback, EpochLoader

        directory, stop_in = sys.argv[1], int(sys.argv[2])
        sampler = grain.IndexSampler(24, grain.NoSharding(), shuffle=True, num_epochs=1, seed=0)
        loader = grain.DataLoader(data_source=Records(), sampler=sampler, operations=[grain.Batch(4)],
                                  worker_count=2)
        data = EpochLoader(loader)
        ckpt = CheckpointCallback(directory, every_steps=4)
        restored, step = ckpt.restore_or({"w": np.zeros(3, np.float32), "data": data})
        w = restored["w"]
        print("start", step, data.epoch, flush=True)
        for epoch in range(data.epoch, 2):
            for batch in data:
                step += 1
                print("batch", step, hashlib.sha256(batch.tobytes()).hexdigest()[:16], flush=True)
                w = w + batch.mean(0)
                if step == stop_in:
                    os.kill(os.getpid(), signal.SIGTERM)  # during this step: saved at its end
                ckpt(step, {"w": w, "data": data})
        ckpt.close()
        print("final", w.tobytes().hex(), flush=True)
        if stop_in == 0:  # an uninterrupted run of two epochs from a fresh loader, for the test to compare
            w, whole = np.zeros(3, np.float32), EpochLoader(loader)
            for epoch in range(2):
                for batch in whole:
                    w = w + batch.mean(0)
                    print("whole", hashlib.sha256(batch.tobytes()).hexdigest()[:16], flush=True)
            print("final", w.tobytes().hex(), flush=True)
""")


@pytest.mark.slow  # two programs that start grain's worker processes at every epoch: ~20 s of CPU
def test_an_epoch_loader_with_worker_processes_resumes_after_sigterm_mid_epoch(tmp_path):
    """Two epochs of six batches from a DataLoader with 2 worker processes: SIGTERM during the second
    epoch's third step saves step 9 and exits; the restarted run reads the batches an uninterrupted
    run reads from there (the same program prints those, from a fresh loader) and ends bit-exact.
    The default suite resumes the same loop in-process (above) and grain's worker processes across
    SIGTERM and SIGKILL (test_in_place_and_grain.py)."""
    script = tmp_path / "epochs.py"
    script.write_text(EPOCH_LOOP)
    run = tmp_path / "run"
    first = run_child(script, run, 9, expect=128 + signal.SIGTERM)
    assert committed_steps(run) == [4, 8, 9]
    resumed = run_child(script, run, 0)
    assert first[0] == "start 0 0" and resumed[0] == "start 9 1"
    whole = [line.split()[1] for line in resumed if line.startswith("whole")]
    assert len(whole) == 12 and whole[:6] == whole[6:]  # each epoch a fresh iterator, as `for` gives
    seen = [line.split()[1:] for line in first[1:] + resumed[1:] if line.startswith("batch")]
    assert seen == [[str(i + 1), h] for i, h in enumerate(whole)]
    finals = [line for line in resumed if line.startswith("final")]
    assert len(finals) == 2 and finals[0] == finals[1]
