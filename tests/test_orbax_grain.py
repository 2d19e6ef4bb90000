"""An Orbax run with grain's data item (issue 50): written by orbax-checkpoint with
``args.Composite(state=StandardSave, data=grain's PyGrainCheckpointSave)``, as nanodo writes its run.
flax_ckpt shows the item (fc.metadata, ``flax-ckpt info``), restores it into the iterators through
``CheckpointCallback.restore_or``, and writes the steps it adds with the item in grain's layout, so that
Orbax with grain's handler restores them and the data continues with the same batches."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import flax_ckpt as fc
from helpers import assert_bit_exact
from test_cli import run

ocp = pytest.importorskip("orbax.checkpoint")
gp = pytest.importorskip("grain.python")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # orbax: "Sharding info not provided"

SOURCE = [np.full(3, i, np.int32) for i in range(64)]


def loader_iter():
    """A grain DataLoader's iterator (its get_state() is bytes) over a small in-memory source."""
    sampler = gp.IndexSampler(len(SOURCE), shard_options=gp.NoSharding(), shuffle=True, num_epochs=1, seed=7)
    return iter(gp.DataLoader(data_source=SOURCE, sampler=sampler, operations=[gp.Batch(4)], worker_count=0))


def dataset_iter():
    """A grain IterDataset's iterator (its get_state() is a dict)."""
    return iter(gp.MapDataset.source(SOURCE).shuffle(seed=3).batch(4).to_iter_dataset())


def batches(make, n: int) -> list[np.ndarray]:
    it = make()
    return [np.asarray(next(it)) for _ in range(n)]


def state(step: int) -> dict:
    return {"params": {"w": np.full((2, 3), step, np.float32)}, "step": np.asarray(step, np.int32)}


def composite(step: int, data, ds) -> "ocp.args.Composite":
    return ocp.args.Composite(
        state=ocp.args.StandardSave(state(step)),
        data=gp.PyGrainCheckpointSave(data),
        ds=gp.PyGrainCheckpointSave(ds),
    )


@pytest.fixture(scope="module")
def grain_run(tmp_path_factory):
    """Steps 1 and 2 of an Orbax job that takes one batch of each iterator per step."""
    root = tmp_path_factory.mktemp("grain") / "run"
    data, ds = loader_iter(), dataset_iter()
    with ocp.CheckpointManager(root) as mgr:
        for s in (1, 2):
            next(data), next(ds)
            mgr.save(s, args=composite(s, data, ds))
    assert sorted(os.listdir(root / "2" / "data")) == ["commit_success.txt", "process_0-of-1.json"]
    return root


@pytest.fixture
def run_copy(grain_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(grain_run, copy)
    return copy


def test_metadata_and_info_show_the_grain_item(grain_run):
    info = fc.metadata(grain_run / "2")
    assert info.leaves["data"].kind == "json" and info.leaves["ds"].kind == "json"
    assert info.leaves["state/params/w"].shape == (2, 3)
    r = run("info", str(grain_run / "2"))
    assert r.returncode == 0, r.stderr
    rows = {
        line.split()[0]: line.split()[1]
        for line in r.stdout.splitlines()
        if line.split()[:1] in (["data"], ["ds"])
    }
    assert rows == {"data": "json", "ds": "json"}, r.stdout
    assert "'next_index': 2" in r.stdout  # the IterDataset's position, readable
    assert fc.restore(grain_run / "2", item="ds") == {"next_index": 2}


def test_callback_resumes_the_iterators_and_orbax_with_grains_handler_continues_our_step(run_copy):
    from flax_ckpt.callbacks import CheckpointCallback

    ref_data, ref_ds = batches(loader_iter, 6), batches(dataset_iter, 6)  # the uninterrupted run
    data, ds = loader_iter(), dataset_iter()
    ckpt = CheckpointCallback(run_copy, every_steps=1, max_to_keep=None, preemption_signals=())
    try:
        restored, start = ckpt.restore_or({"state": state(0), "data": data, "ds": ds})
        assert start == 2 and restored["data"] is data and restored["ds"] is ds
        assert_bit_exact(restored["state"], state(2))
        np.testing.assert_array_equal(next(data), ref_data[2])  # the batch step 3 trains on
        np.testing.assert_array_equal(next(ds), ref_ds[2])
        assert ckpt(3, {"state": state(3), "data": data, "ds": ds})
    finally:
        ckpt.close()
    step3 = run_copy / "3"
    # grain's layout: this process's file holds the iterator's state as grain's handler writes it
    assert (step3 / "data" / "process_0-of-1.json").read_bytes() == data.get_state()
    assert (step3 / "ds" / "process_0-of-1.json").read_text() == json.dumps(ds.get_state(), indent=4)
    handlers = json.loads((step3 / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert handlers["data"] == handlers["ds"] == "grain._src.python.checkpoint.handler.CheckpointHandler"
    fresh_data, fresh_ds = loader_iter(), dataset_iter()
    with ocp.CheckpointManager(run_copy) as omgr:
        assert omgr.latest_step() == 3
        got = omgr.restore(
            3,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(state(0)),
                data=gp.PyGrainCheckpointRestore(fresh_data),
                ds=gp.PyGrainCheckpointRestore(fresh_ds),
            ),
        )
    assert_bit_exact(dict(got.state), state(3), types=False)
    for k in (3, 4, 5):  # the batches after step 3, as the uninterrupted run has them
        np.testing.assert_array_equal(next(fresh_data), ref_data[k])
        np.testing.assert_array_equal(next(fresh_ds), ref_ds[k])
    again_data, again_ds = loader_iter(), dataset_iter()  # and flax_ckpt reads its own step back alike
    back = fc.restore(step3, {"state": state(0), "data": again_data.get_state(), "ds": None})
    again_data.set_state(back["data"])
    again_ds.set_state(back["ds"])
    np.testing.assert_array_equal(next(again_data), ref_data[3])
    np.testing.assert_array_equal(next(again_ds), ref_ds[3])


def test_a_grain_item_of_other_process_counts_is_named(run_copy):
    os.rename(run_copy / "2" / "ds" / "process_0-of-1.json", run_copy / "2" / "ds" / "process_3-of-4.json")
    with pytest.raises(fc.CorruptCheckpointError, match=r"'process_3-of-4.json'.*process_0-of-1.json"):
        fc.restore(run_copy / "2", item="ds")


def test_init_from_an_orbax_run_carries_its_step_and_data_position(grain_run, tmp_path):
    """nanodo's checkpoint_restore_dir: a new run in a directory of its own continues the Orbax run at
    its step, with its data position."""
    from flax_ckpt.callbacks import CheckpointCallback

    ref = batches(dataset_iter, 3)
    ds = dataset_iter()
    with CheckpointCallback(tmp_path / "new", every_steps=1, preemption_signals=()) as ckpt:
        restored, start = ckpt.restore_or(
            {"state": state(0), "ds": ds}, init_from=grain_run, continue_step=True
        )
        assert start == 2
        assert_bit_exact(restored["state"], state(2))
        np.testing.assert_array_equal(next(ds), ref[2])
        ckpt(3, {"state": state(3), "ds": ds})
    assert fc.metadata(tmp_path / "new" / "3").format == "native"


def test_our_grain_files_verify_and_an_iterator_given_to_the_manager_is_refused(run_copy):
    ds = dataset_iter()
    before = sorted(os.listdir(run_copy))
    with fc.CheckpointManager(run_copy, async_save=False) as mgr:
        with pytest.raises(fc.UnsupportedLeafError, match=r"'ds': iterator.get_state\(\)"):
            mgr.save(3, {"state": state(3), "data": loader_iter().get_state(), "ds": ds})
        assert sorted(os.listdir(run_copy)) == before  # nothing was written
        mgr.save(3, {"state": state(3), "data": loader_iter().get_state(), "ds": ds.get_state()})
    ours = run("verify", str(run_copy / "3"), "-q")
    assert ours.returncode == 0 and ours.stdout.startswith("OK "), ours.stdout + ours.stderr
    (run_copy / "3" / "ds" / "process_0-of-1.json").write_text('{"next_index": 9}')
    with pytest.raises(fc.CorruptCheckpointError, match="process_0-of-1.json"):
        fc.restore(run_copy / "3", item="ds")


@pytest.mark.parametrize("item", ["data", "ds"])
def test_a_grain_item_that_is_a_json_list_is_named_with_its_step(run_copy, item):
    """Valid JSON that is no iterator state (a list) in an Orbax run's grain file: a TargetMismatchError
    naming the item and the step, not grain's TypeError or a pytree ValueError; nothing changes."""
    from flax_ckpt.callbacks import CheckpointCallback

    (run_copy / "2" / item / "process_0-of-1.json").write_text("[1, 2]")
    before = sorted(os.listdir(run_copy))
    with CheckpointCallback(run_copy, every_steps=1, preemption_signals=()) as ckpt:
        with pytest.raises(fc.TargetMismatchError, match=f"position stored for '{item}' in step 2 of"):
            ckpt.restore_or({"state": state(0), "data": loader_iter(), "ds": dataset_iter()})
    assert sorted(os.listdir(run_copy)) == before and (run_copy / "2" / item / "process_0-of-1.json").exists()
