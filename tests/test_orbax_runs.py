"""Runs written by the real orbax-checkpoint 0.12.8, as a user of flax_ckpt meets them: a manager run with
``step_prefix`` and fixed-length step names (listed and pruned by the flax-ckpt command, a real
subprocess, and continued by fc.CheckpointManager in Orbax's own layout, which Orbax then restores), a
run of named items (``args.Composite`` with JSON items), and a CheckpointManager that only restores an
Orbax run and leaves it exactly as it was.
"""

from __future__ import annotations

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt as fc
from test_cli import run, run_json
from helpers import assert_bit_exact

ocp = pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # orbax: "Sharding info not provided"

PREFIXED = dict(step_prefix="ckpt", step_format_fixed_length=6)


def tree(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"params": {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
                       "b": jnp.full((3,), step, jnp.bfloat16)}, "count": jnp.int32(step)}


def abstract(t):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)


def orbax_options(**kw):
    return ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min", **PREFIXED, **kw)


@pytest.fixture(scope="module")
def prefixed_run(tmp_path_factory):
    """Steps 1-3 of an Orbax CheckpointManager with step_prefix="ckpt", step_format_fixed_length=6."""
    root = tmp_path_factory.mktemp("orbax") / "prefixed"
    with ocp.CheckpointManager(root, options=orbax_options()) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, args=ocp.args.StandardSave(tree(s)), metrics={"loss": 1.0 / s})
    assert sorted(os.listdir(root)) == ["ckpt_000001", "ckpt_000002", "ckpt_000003"]
    return root


@pytest.fixture
def run_copy(prefixed_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(prefixed_run, copy)
    return copy


# ----------------------------------------------------------------------- item 1: one step discovery

def test_cli_ls_and_prune_see_prefixed_orbax_steps_like_the_manager(run_copy):
    doc = run_json("ls", str(run_copy))
    assert [(e["step"], e["name"], e["state"], e["format"]) for e in doc["steps"]] == [
        (1, "ckpt_000001", "committed", "orbax"), (2, "ckpt_000002", "committed", "orbax"),
        (3, "ckpt_000003", "committed", "orbax")]
    assert doc["steps"][1]["metrics"] == {"loss": 0.5}
    with fc.CheckpointManager(run_copy) as mgr:
        assert mgr.all_steps() == [e["step"] for e in doc["steps"]] and mgr.format == "orbax"
    assert run_json("prune", str(run_copy), "--keep", "2") == {
        "directory": str(run_copy), "dry_run": False, "deleted": [1], "kept": [2, 3]}
    assert sorted(os.listdir(run_copy)) == ["ckpt_000002", "ckpt_000003"]  # no lock file left behind
    with ocp.CheckpointManager(run_copy, options=orbax_options()) as omgr:  # Orbax agrees
        assert omgr.all_steps() == [2, 3]
        assert_bit_exact(tree(3), omgr.restore(3, args=ocp.args.StandardRestore(abstract(tree(3)))))


# ------------------------------------------------------------------ item 3: a run stays in one format

def test_manager_that_only_restores_an_orbax_run_writes_nothing_into_it(run_copy):
    crashed = run_copy / "ckpt_000004.orbax-checkpoint-tmp-1234"  # an Orbax save in flight (or crashed)
    crashed.mkdir()
    before = sorted(os.listdir(run_copy))
    with fc.CheckpointManager(run_copy, max_to_keep=1) as mgr:
        assert mgr.format == "orbax" and mgr.latest_step() == 3
        assert_bit_exact(tree(3), mgr.restore(target=tree(3)))
        assert sorted(os.listdir(run_copy)) == before  # no lock file, the in-flight folder untouched
    assert sorted(os.listdir(run_copy)) == before  # and no retention ran


def test_manager_continues_an_orbax_run_in_orbax_layout_and_orbax_restores_it(run_copy):
    (run_copy / "ckpt_000004.orbax-checkpoint-tmp-1234").mkdir()  # left by a crashed Orbax save
    with fc.CheckpointManager(run_copy, max_to_keep=3, async_save=False) as mgr:
        assert mgr.save(4, tree(4), metrics={"loss": 0.25})
        assert (run_copy / ".flax_ckpt.lock").exists()  # taken at the first save
        with pytest.raises(fc.CheckpointLockedError):  # two live writers never share the directory
            fc.CheckpointManager(run_copy).save(5, tree(5))
        assert mgr.all_steps() == [2, 3, 4]  # retention removed the oldest Orbax step
    assert sorted(os.listdir(run_copy)) == ["ckpt_000002", "ckpt_000003", "ckpt_000004"]
    with ocp.CheckpointManager(run_copy, options=orbax_options()) as omgr:
        assert omgr.all_steps() == [2, 3, 4] and omgr.best_step() == 4
        assert_bit_exact(tree(4), omgr.restore(4, args=ocp.args.StandardRestore(abstract(tree(4)))))
        assert_bit_exact(tree(2), omgr.restore(2, args=ocp.args.StandardRestore(abstract(tree(2)))))


def test_a_format_that_contradicts_the_directory_is_refused_naming_the_right_one(run_copy, tmp_path):
    before = sorted(os.listdir(run_copy))
    with pytest.raises(ValueError, match="format='orbax'"):
        fc.CheckpointManager(run_copy, format="native")
    with pytest.raises(ValueError, match="serializer= applies to native steps"):
        fc.CheckpointManager(run_copy, serializer="zarr3")
    assert sorted(os.listdir(run_copy)) == before
    native = tmp_path / "native"
    with fc.CheckpointManager(native, async_save=False) as mgr:
        mgr.save(1, tree(1))
    with pytest.raises(ValueError, match="format='native'"):
        fc.CheckpointManager(native, format="orbax")
    with fc.CheckpointManager(native, format="native") as mgr:
        assert mgr.format == "native"
    with fc.CheckpointManager(tmp_path / "empty", format="orbax", async_save=False) as mgr:
        mgr.save(7, tree(7))
    assert sorted(os.listdir(tmp_path / "empty")) == ["7"]  # an Orbax run of its own, no lock file left


def test_a_directory_of_both_formats_follows_its_newest_step_with_a_warning(run_copy, caplog):
    fc.save(run_copy / "5", tree(5), step=5)  # what an older flax_ckpt wrote into an Orbax run
    with caplog.at_level(logging.WARNING, logger="flax_ckpt"):
        with fc.CheckpointManager(run_copy, async_save=False) as mgr:
            assert mgr.format == "native" and mgr.all_steps() == [1, 2, 3, 5]
            mgr.save(6, tree(6))
    assert "holds both native steps (5) and Orbax steps (1, 2, 3)" in caplog.text
    assert (run_copy / "6" / "manifest.json").exists()


# --------------------------------------------------------------------------- item 2: named items

@pytest.fixture(scope="module")
def composite_run(tmp_path_factory):
    """Orbax runs of args.Composite: state (StandardSave) with metadata and dataset (JsonSave) at step 5;
    a one-item composite at step 1."""
    base = tmp_path_factory.mktemp("composite")
    with ocp.CheckpointManager(base / "three", item_names=("state", "metadata", "dataset")) as mgr:
        mgr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(tree(5)),
                                            metadata=ocp.args.JsonSave({"lr": 0.1, "model": "resnet18"}),
                                            dataset=ocp.args.JsonSave({"epoch": 2, "index": 17})))
    with ocp.CheckpointManager(base / "one", item_names=("state",)) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree(1))))
    return base


def test_named_items_restore_as_a_dict_of_items_json_as_json(composite_run):
    step = composite_run / "three" / "5"
    meta, data = {"lr": 0.1, "model": "resnet18"}, {"epoch": 2, "index": 17}
    plain = fc.restore(step)
    assert list(plain) == ["dataset", "metadata", "state"]
    assert plain["metadata"] == meta and plain["dataset"] == data
    assert_bit_exact(jax.tree_util.tree_map(np.asarray, tree(5)), plain["state"])
    got = fc.restore(step, {"state": abstract(tree(5)), "metadata": None})  # only these items are read
    assert list(got) == ["metadata", "state"] and got["metadata"] == meta
    assert_bit_exact(tree(5), got["state"])
    assert_bit_exact(tree(5), fc.restore(step, tree(5), item="state"))
    assert fc.restore(step, item="dataset") == data
    assert fc.restore(step / "metadata") == meta  # a JSON item's own folder
    assert fc.metadata(step / "metadata").step == 5
    info = fc.metadata(step)
    assert set(info.tree) == {"dataset", "metadata", "state"} and info.leaves["metadata"].kind == "json"
    assert fc.metadata(step, item="state").leaves["params/w"].shape == (4, 3)
    one = fc.restore(composite_run / "one" / "1")  # one named item: still a dict of items
    assert list(one) == ["state"]
    assert_bit_exact(tree(1), fc.restore(composite_run / "one" / "1", {"state": tree(1)})["state"])
    with ocp.CheckpointManager(composite_run / "three", item_names=("state", "metadata", "dataset")) as omgr:
        theirs = omgr.restore(5, args=ocp.args.Composite(metadata=ocp.args.JsonRestore(),
                                                         dataset=ocp.args.JsonRestore()))
    assert theirs.metadata == meta and theirs.dataset == data  # what Orbax itself gives back


def test_named_items_errors_name_the_items_present(composite_run, tmp_path):
    step = composite_run / "three" / "5"
    with pytest.raises(fc.StructureMismatchError) as e:
        fc.restore(step, tree(5))  # the state itself, not keyed by item
    msg = str(e.value)
    assert "the pytree items 'state' and the JSON items 'dataset', 'metadata'" in msg
    assert "{'state': ...}" in msg and "item='state'" in msg and "'params'" in msg
    with pytest.raises(fc.TargetMismatchError, match="no item 'opt'; its items are 'dataset', 'metadata', 'state'"):
        fc.restore(step, item="opt")
    fc.save(tmp_path / "n", tree(1))
    with pytest.raises(fc.TargetMismatchError, match="native flax_ckpt checkpoint"):
        fc.restore(tmp_path / "n", item="state")


def test_manager_restores_named_items_and_leaves_no_lock_file(composite_run, tmp_path):
    root = tmp_path / "three"
    shutil.copytree(composite_run / "three", root)
    with fc.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [5]
        assert_bit_exact(tree(5), mgr.restore(item="state", target=tree(5)))
        assert mgr.restore(5, {"dataset": None})["dataset"] == {"epoch": 2, "index": 17}
        assert set(mgr.item_metadata(5).tree) == {"dataset", "metadata", "state"}
    assert sorted(os.listdir(root)) == ["5"]


def test_flax_ckpt_info_lists_json_items_of_a_step(composite_run):
    r = run("info", str(composite_run / "three" / "5"))
    assert r.returncode == 0, r.stderr
    assert any(line.split()[:2] == ["metadata", "json"] for line in r.stdout.splitlines()), r.stdout
