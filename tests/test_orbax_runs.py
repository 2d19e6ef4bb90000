"""Runs written by the real orbax-checkpoint 0.12.8, as a user of flax_ckpt meets them: a manager run with
``step_prefix`` and fixed-length step names (listed and pruned by the flax-ckpt command, a real
subprocess, and continued by fc.CheckpointManager in Orbax's own layout, which Orbax then restores), a
run of named items (``args.Composite`` with JSON items), and a CheckpointManager that only restores an
Orbax run and leaves it exactly as it was. Issue 27: new steps of a run of named items are those items
(restored by Orbax's own CheckpointManager, OCDBT on and off), refused when the tree does not fit, with
checksums that verify checks; retention that warns when it deletes steps the manager did not write.
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
from helpers import assert_bit_exact
from test_cli import run, run_json

ocp = pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # orbax: "Sharding info not provided"

PREFIXED = dict(step_prefix="ckpt", step_format_fixed_length=6)


def tree(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
            "b": jnp.full((3,), step, jnp.bfloat16),
        },
        "count": jnp.int32(step),
    }


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
        (1, "ckpt_000001", "committed", "orbax"),
        (2, "ckpt_000002", "committed", "orbax"),
        (3, "ckpt_000003", "committed", "orbax"),
    ]
    assert doc["steps"][1]["metrics"] == {"loss": 0.5}
    with fc.CheckpointManager(run_copy) as mgr:
        assert mgr.all_steps() == [e["step"] for e in doc["steps"]] and mgr.format == "orbax"
    assert run_json("prune", str(run_copy), "--keep", "2") == {
        "directory": str(run_copy),
        "dry_run": False,
        "deleted": [1],
        "kept": [2, 3],
        "formats": ["native", "orbax"],
        "left_alone": [],
    }
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
        mgr.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree(5)),
                metadata=ocp.args.JsonSave({"lr": 0.1, "model": "resnet18"}),
                dataset=ocp.args.JsonSave({"epoch": 2, "index": 17}),
            ),
        )
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
        theirs = omgr.restore(
            5, args=ocp.args.Composite(metadata=ocp.args.JsonRestore(), dataset=ocp.args.JsonRestore())
        )
    assert theirs.metadata == meta and theirs.dataset == data  # what Orbax itself gives back


def test_named_items_errors_name_the_items_present(composite_run, tmp_path):
    step = composite_run / "three" / "5"
    with pytest.raises(fc.StructureMismatchError) as e:
        fc.restore(step, tree(5))  # the state itself, not keyed by item
    msg = str(e.value)
    assert "the pytree items 'state' and the JSON items 'dataset', 'metadata'" in msg
    assert "{'state': ...}" in msg and "item='state'" in msg and "'params'" in msg
    with pytest.raises(
        fc.TargetMismatchError, match="no item 'opt'; its items are 'dataset', 'metadata', 'state'"
    ):
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


# ------------------------------------------------------- issue 27: an Orbax run of named items, continued

ITEMS = ("state", "meta", "dataset")


def meta(step: int) -> dict:
    return {"lr": 0.1 / (step + 1), "model": "resnet18"}


def dataset(step: int) -> dict:
    return {"epoch": step // 2, "index": 17 * step, "files": ["a", "b"]}


def items(step: int) -> dict:
    return {"state": tree(step), "meta": meta(step), "dataset": dataset(step)}


def orbax_manager(root, use_ocdbt: bool, **options):
    """The Orbax job of the run: step_prefix, best_fn on "loss"; with use_ocdbt=False it names its
    handlers (that is how Orbax turns OCDBT off), with OCDBT on it is told nothing about the items."""
    opts = ocp.CheckpointManagerOptions(
        step_prefix="ckpt", best_fn=lambda m: m["loss"], best_mode="min", **options
    )
    if use_ocdbt:
        return ocp.CheckpointManager(root, options=opts)
    return ocp.CheckpointManager(
        root,
        options=opts,
        item_handlers={
            "state": ocp.StandardCheckpointHandler(use_ocdbt=False),
            "meta": ocp.JsonCheckpointHandler(),
            "dataset": ocp.JsonCheckpointHandler(),
        },
    )


def orbax_composite(step: int) -> "ocp.args.Composite":
    return ocp.args.Composite(
        state=ocp.args.StandardSave(tree(step)),
        meta=ocp.args.JsonSave(meta(step)),
        dataset=ocp.args.JsonSave(dataset(step)),
    )


@pytest.fixture(scope="module", params=[True, False], ids=["ocdbt", "no-ocdbt"])
def items_run(request, tmp_path_factory):
    """Steps 1 and 2 of an Orbax job saving args.Composite(state=StandardSave, meta=JsonSave,
    dataset=JsonSave) with metrics, step_prefix="ckpt", OCDBT on or off; step 1 is its best."""
    root = tmp_path_factory.mktemp("items") / "run"
    with orbax_manager(root, request.param) as mgr:
        for s, loss in ((1, 0.2), (2, 0.5)):
            mgr.save(s, args=orbax_composite(s), metrics={"loss": loss})
    assert sorted(os.listdir(root)) == ["ckpt_1", "ckpt_2"]
    return root, request.param


@pytest.fixture
def items_copy(items_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(items_run[0], copy)
    return copy, items_run[1]


def test_new_steps_of_a_run_of_named_items_are_those_items_and_orbax_restores_them(items_copy):
    root, use_ocdbt = items_copy
    with fc.CheckpointManager(root, async_save=False) as mgr:
        assert mgr.format == "orbax"
        for s, loss in ((3, 0.1), (4, 0.3)):  # step 3 becomes the best of Orbax's best_fn
            assert mgr.save(s, items(s), metrics={"loss": loss})
    assert sorted(os.listdir(root)) == ["ckpt_1", "ckpt_2", "ckpt_3", "ckpt_4"]
    assert sorted(os.listdir(root / "ckpt_4")) == [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "dataset",
        "meta",
        "metrics",
        "state",
    ]
    with orbax_manager(root, use_ocdbt) as omgr:  # the Orbax evaluation job sharing the directory
        assert omgr.all_steps() == [1, 2, 3, 4] and omgr.best_step() == 3 and omgr.latest_step() == 4
        for s in (4, 3, 2):
            got = omgr.restore(
                s,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract(tree(s))), meta=ocp.args.JsonRestore()
                ),
            )
            assert_bit_exact(got.state, tree(s))
            assert got.meta == meta(s)
        got = omgr.restore(4, args=ocp.args.Composite(dataset=ocp.args.JsonRestore()))
        assert got.dataset == dataset(4)
        assert omgr.metrics(4) == {"loss": 0.3}
    if use_ocdbt:  # the handlers come from our _CHECKPOINT_METADATA: restore(step) alone works too
        with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(step_prefix="ckpt")) as omgr:
            got = omgr.restore(4)
        assert got.meta == meta(4) and got.dataset == dataset(4)
        assert_bit_exact(
            jax.tree_util.tree_map(np.asarray, got.state),
            jax.tree_util.tree_map(np.asarray, tree(4)),
            types=False,
        )
    back = fc.restore(root / "ckpt_4", {"state": tree(4), "meta": None, "dataset": None})
    assert back["meta"] == meta(4) and back["dataset"] == dataset(4)
    assert_bit_exact(back["state"], tree(4))


def test_callback_continues_a_run_of_named_items(items_copy):
    from flax_ckpt.callbacks import CheckpointCallback

    root, use_ocdbt = items_copy
    ckpt = CheckpointCallback(root, every_steps=1, max_to_keep=None)
    state, start = ckpt.restore_or(items(0))
    assert start == 2 and state["meta"] == meta(2) and state["dataset"] == dataset(2)
    for s in (3, 4):
        ckpt(s, items(s), {"loss": 1.0 / s})
    ckpt.close()
    with orbax_manager(root, use_ocdbt) as omgr:
        got = omgr.restore(
            4,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract(tree(4))),
                meta=ocp.args.JsonRestore(),
                dataset=ocp.args.JsonRestore(),
            ),
        )
    assert_bit_exact(got.state, tree(4))
    assert got.meta == meta(4) and got.dataset == dataset(4)


def test_a_tree_that_does_not_fit_the_runs_items_writes_nothing(items_copy):
    root, _ = items_copy
    before = {d: sorted(os.listdir(root / d)) for d in os.listdir(root)}
    with fc.CheckpointManager(root, async_save=False, max_to_keep=1) as mgr:
        with pytest.raises(fc.StructureMismatchError) as e:
            mgr.save(3, {"state": tree(3), "meta": meta(3)})
        msg = str(e.value)
        assert "the pytree items 'state' and the JSON items 'dataset', 'meta'" in msg
        assert "the saved dict has the keys 'meta', 'state' (missing: 'dataset')" in msg
        assert "Nothing was written" in msg
        with pytest.raises(fc.StructureMismatchError, match=r"not items of the run: 'opt'"):
            mgr.save(3, {**items(3), "opt": tree(3)})
        with pytest.raises(fc.StructureMismatchError, match="not items of the run: 'count', 'params'"):
            mgr.save(3, tree(3))  # the state alone, not keyed by item
        with pytest.raises(fc.StructureMismatchError, match="the saved value is a list"):
            mgr.save(3, [tree(3)])
        with pytest.raises(fc.UnsupportedLeafError) as e:
            mgr.save(3, {**items(3), "meta": {"lr": 0.1, "mask": np.ones(3)}})
        assert "the JSON item 'meta'" in str(e.value) and "nothing was written" in str(e.value)
        with pytest.raises(
            fc.UnsupportedLeafError, match="the JSON item 'dataset'.*set is not JSON-serializable"
        ):
            mgr.save(3, {**items(3), "dataset": {"seen": {1, 2}}})
        assert {d: sorted(os.listdir(root / d)) for d in os.listdir(root)} == before  # no lock file, no step
        assert mgr.all_steps() == [1, 2]
    assert {d: sorted(os.listdir(root / d)) for d in os.listdir(root)} == before


def test_steps_written_into_an_orbax_run_carry_checksums_that_verify_checks(items_copy):
    root, use_ocdbt = items_copy
    with fc.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(3, {**items(3), "state": {**tree(3), "name": "resnet"}}, metrics={"loss": 0.1})
    ours = run("verify", str(root / "ckpt_3"), "-q")
    assert ours.returncode == 0 and ours.stdout.startswith("OK "), ours.stdout + ours.stderr
    theirs = run("verify", str(root / "ckpt_2"), "-q")  # Orbax's own step: no checksum to check
    assert theirs.returncode == 0 and theirs.stdout.startswith("UNVERIFIED"), theirs.stdout
    with ocp.CheckpointManager(
        root,
        options=ocp.CheckpointManagerOptions(step_prefix="ckpt"),
        item_handlers={
            "state": ocp.PyTreeCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            "dataset": ocp.JsonCheckpointHandler(),
        },
    ) as omgr:
        got = omgr.restore(
            3, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(), meta=ocp.args.JsonRestore())
        )
    assert got.state["name"] == "resnet" and got.meta == meta(
        3
    )  # strings beside their checksum read by Orbax
    np.testing.assert_array_equal(got.state["params"]["w"], np.asarray(tree(3)["params"]["w"]))
    # a JSON item changed after the save (still valid JSON) no longer matches its checksum
    (root / "ckpt_3" / "meta" / "metadata").write_text('{"lr": 1.0, "model": "resnet18"}')
    with pytest.raises(fc.CorruptCheckpointError, match="metadata: its crc32c is"):
        fc.restore(root / "ckpt_3", item="meta")
    damaged = run("verify", str(root / "ckpt_3"), "-q")
    assert damaged.returncode == 1 and "crc32c" in damaged.stdout + damaged.stderr


def test_steps_of_one_unnamed_item_carry_crc32c_chunks_that_orbax_restores(run_copy, tmp_path):
    with fc.CheckpointManager(run_copy, async_save=False) as mgr:
        mgr.save(4, tree(4), metrics={"loss": 0.25})
    assert run("verify", str(run_copy / "ckpt_000004"), "-q").stdout.startswith("OK ")
    fc.save(tmp_path / "single", tree(5), format="orbax")
    assert run("verify", str(tmp_path / "single"), "-q").stdout.startswith("OK ")
    with ocp.StandardCheckpointer() as c:
        assert_bit_exact(tree(5), c.restore(tmp_path / "single", abstract(tree(5))))
    with ocp.CheckpointManager(run_copy, options=orbax_options()) as omgr:
        assert_bit_exact(tree(4), omgr.restore(4, args=ocp.args.StandardRestore(abstract(tree(4)))))


# ---------------------------------------------------------- issue 27: retention that says what it deletes


def test_retention_warns_once_when_it_deletes_steps_it_did_not_write(items_copy, caplog):
    from flax_ckpt.callbacks import CheckpointCallback

    root, _ = items_copy
    with caplog.at_level(logging.WARNING, logger="flax_ckpt"):
        ckpt = CheckpointCallback(root, every_steps=1)  # the callback's default max_to_keep=3
        for s in (3, 4, 5):
            ckpt(s, items(s), {"loss": 1.0})
        ckpt.close()
    assert sorted(os.listdir(root)) == ["ckpt_3", "ckpt_4", "ckpt_5"]  # Orbax's best step 1 went too
    warned = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
    assert len(warned) == 1, warned  # once per manager, though steps 1 and 2 went at two saves
    assert warned[0].startswith(
        f"retention (max_to_keep=3) deleted step 1 of {root}, which this manager did not write"
    )
    assert "max_to_keep=None" in warned[0] and "covers every step in its directory" in warned[0]
    assert (
        caplog.records[[r.getMessage() for r in caplog.records].index(warned[0])].levelno == logging.WARNING
    )


def test_retention_of_its_own_steps_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flax_ckpt"):
        with fc.CheckpointManager(tmp_path / "run", max_to_keep=1, async_save=False) as mgr:
            for s in (1, 2, 3):
                mgr.save(s, tree(s))
            assert mgr.all_steps() == [3]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
