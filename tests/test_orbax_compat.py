"""Orbax interoperability, against the real orbax-checkpoint: Orbax writes and flax_ckpt reads, flax_ckpt
writes and Orbax reads, bit-exact, for TrainState with Adam state, bfloat16, scalars, nested containers
and arrays sharded over the 8-device CPU mesh of conftest.py; plus Orbax CheckpointManager directories.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from flax_ckpt._src.commit import atomic as commit
from flax_ckpt._src.engine.snapshot import snapshot
from flax_ckpt._src.orbax import locate, write
from flax_ckpt._src.orbax.layout import OrbaxLayout
from flax_ckpt._src.storage import open_storage, split_location
from helpers import as_bytes, assert_bit_exact

ocp = pytest.importorskip("orbax.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # orbax: "Sharding info not provided"

VARIANTS = [(True, True), (True, False), (False, True), (False, False)]  # (use_ocdbt, use_zarr3)


# ----------------------------------------------------------------------------------------- helpers


def _folder(path):
    parent, name = split_location(path)
    return parent.sub(name)


class oc:
    """The Orbax-layout internals these tests exercise, by path."""

    UnsupportedOrbaxCheckpointError = fc.UnsupportedOrbaxCheckpointError
    is_temporary_name = staticmethod(commit.is_temporary)

    @staticmethod
    def is_orbax(path):
        return locate.is_orbax(_folder(path))

    @staticmethod
    def list_steps(root):
        return sorted(locate.step_dirs(open_storage(root)))

    @staticmethod
    def step_path(root, step):
        return locate.step_folder(open_storage(root), step).url

    @staticmethod
    def read_step_metrics(root, step):
        return locate.step_metrics(locate.locate(locate.step_folder(open_storage(root), step)))

    @staticmethod
    def step_item_path(root, step):
        """The folder to restore for ``step``: its one pytree item, or the step folder with several."""
        located = locate.locate(locate.step_folder(open_storage(root), step))
        return next(iter(located.items.values())).url if len(located.items) == 1 else located.storage.url

    @staticmethod
    def json_items(path):
        return locate.json_items(locate.locate(_folder(path)))

    @staticmethod
    def snapshot(tree):
        return OrbaxLayout().snapshot(tree, copy=True)

    @staticmethod
    def save(path, tree, **options):
        parent, name = split_location(path)
        write.save_item(parent, name, snapshot(tree, copy=False), **options)

    @staticmethod
    def save_step(root, step, tree, **options):
        snap = tree if hasattr(tree, "leaves") and hasattr(tree, "nbytes") else oc.snapshot(tree)
        return write.save_step(open_storage(root), step, snap, **options)


# ----------------------------------------------------------------------------------------- helpers


def _mesh(shape=(4, 2), names=("x", "y")):
    return jax.sharding.Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _abstract(tree):
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
            if isinstance(x, (jax.Array, np.ndarray, np.generic))
            else x
        ),
        tree,
    )


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))


@pytest.fixture(scope="module")
def trained_state():
    return _train_state()


def _train_state():
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    return state.apply_gradients(grads=grads)  # mu, nu, count non-trivial


def _mixed(sharded: bool = True):
    """Leaves Orbax's StandardCheckpointer accepts: arrays, bfloat16, scalars, nested containers."""
    special = np.array([np.nan, -0.0, np.inf, 1e-45], np.float32)
    special.view(np.uint32)[0] = 0x7FC0_1234  # a NaN payload must survive
    a = jnp.arange(64, dtype=jnp.float32).reshape(8, 8)
    return {
        "a": jax.device_put(a, NamedSharding(_mesh(), P("x", "y"))) if sharded else a,
        "bf16": jnp.linspace(-3, 3, 6, dtype=jnp.bfloat16),
        "special": special,
        "ints": np.arange(6, dtype=np.int8).reshape(2, 3),
        "scalars": {"i": 7, "f": 2.5, "t": True},
        "nested": [jnp.zeros((2,)), {"deep": (jnp.ones((1, 3), jnp.int32), np.float16(1.5))}],
        "none": None,
        "empty": {},
    }


def _orbax_write(path, tree, use_ocdbt=True, use_zarr3=False):
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
    ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(tree))


# -------------------------------------------------------------------------- Orbax -> flax_ckpt


@pytest.mark.parametrize("use_ocdbt,use_zarr3", VARIANTS)
def test_orbax_pytree_to_flax_ckpt(ckpt_dir, use_ocdbt, use_zarr3):
    tree = dict(_mixed(), text="hello", t=())
    path = str(ckpt_dir / "o")
    _orbax_write(path, tree, use_ocdbt, use_zarr3)
    assert oc.is_orbax(path)
    assert_bit_exact(tree, fc.restore(path, tree), types=False)
    plain = fc.restore(path)  # no target: dicts/lists of numpy arrays, Python scalars, strings
    assert isinstance(plain["a"], np.ndarray) and plain["scalars"] == {"i": 7, "f": 2.5, "t": True}
    assert plain["text"] == "hello" and plain["nested"][1]["deep"][0].dtype == np.int32
    assert as_bytes(plain["special"]) == as_bytes(tree["special"]) and plain["bf16"].dtype == jnp.bfloat16
    info = fc.metadata(path)
    assert info.format == "orbax" and info.leaves["a"].shape == (8, 8)
    assert info.leaves["a"].sharding == {
        "type": "NamedSharding",
        "axis_names": ["x", "y"],
        "mesh_shape": [4, 2],
        "spec": ["x", "y"],
    }
    assert info.serializer == f"orbax:{'zarr3' if use_zarr3 else 'zarr'}{'+ocdbt' if use_ocdbt else ''}"


def test_orbax_standard_trainstate_to_flax_ckpt(ckpt_dir, trained_state):
    state = trained_state
    tree = {"state": state, "rng": jax.random.key(5), "legacy_rng": jax.random.PRNGKey(6)}
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(ckpt_dir / "s", tree)
    ckptr.wait_until_finished()
    restored = fc.restore(ckpt_dir / "s", _abstract(tree))
    assert isinstance(restored["state"], train_state.TrainState)
    assert restored["state"].apply_fn is state.apply_fn  # rebuilt from the target, never stored
    assert_bit_exact(tree, restored, types=False)
    plain = fc.restore(ckpt_dir / "s")
    assert set(plain["state"]["opt_state"][0]) == {"count", "mu", "nu"}
    assert plain["state"]["opt_state"][1] is None  # optax EmptyState: Orbax stores it as None


def test_orbax_sharded_restores_onto_another_layout(ckpt_dir):
    x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
    saved = jax.device_put(x, NamedSharding(_mesh(), P("x", "y")))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(ckpt_dir / "s", {"w": saved})
    ckptr.wait_until_finished()
    other = NamedSharding(_mesh((2, 4), ("a", "b")), P("b", None))
    out = fc.restore(ckpt_dir / "s", {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other)})
    assert out["w"].sharding == other and np.array_equal(out["w"], x)
    assert [s.data.shape for s in out["w"].addressable_shards] == [(4, 8)] * 8
    by_arg = fc.restore(ckpt_dir / "s", shardings={"w": other})
    assert by_arg["w"].sharding == other and np.array_equal(by_arg["w"], x)


def test_orbax_manager_directory(ckpt_dir):
    root = ckpt_dir / "run"
    tree = {"w": jnp.arange(4.0), "step": 0}
    with ocp.CheckpointManager(
        root,
        options=ocp.CheckpointManagerOptions(max_to_keep=3, best_fn=lambda m: m["loss"], best_mode="min"),
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, args=ocp.args.StandardSave(dict(tree, step=step)), metrics={"loss": 1.0 / step})
    (root / "4.orbax-checkpoint-tmp-123").mkdir()  # an interrupted save: never a step
    assert oc.list_steps(root) == [1, 2, 3] and oc.is_temporary_name("4.orbax-checkpoint-tmp-123")
    assert oc.step_path(root, 2) == str(root / "2")
    assert oc.read_step_metrics(root, 2) == {"loss": 0.5}
    item = oc.step_item_path(root, 3)
    assert item.endswith(os.path.join("3", "default"))
    assert_bit_exact(dict(tree, step=3), fc.restore(item, tree), types=False)
    info = fc.metadata(item)  # an item folder knows its step and metrics
    assert info.step == 3 and info.metrics == {"loss": 1.0 / 3}
    assert fc.metadata(os.path.dirname(item)).step == 3
    with pytest.raises(fc.CheckpointNotFoundError, match="no committed Orbax step 9"):
        oc.step_item_path(root, 9)
    with pytest.raises(fc.CheckpointNotCommittedError, match="in flight"):
        fc.restore(_tmp_step(root))


def _tmp_step(root):
    tmp = root / "5.orbax-checkpoint-tmp-99"
    tmp.mkdir()
    (tmp / "_CHECKPOINT_METADATA").write_text("{}")
    return tmp


def test_orbax_composite_step_and_prefixed_names(ckpt_dir):
    root = ckpt_dir / "comp"
    state = {"w": jnp.ones((2, 2), jnp.bfloat16)}
    with ocp.CheckpointManager(
        root,
        item_names=("state", "config"),
        options=ocp.CheckpointManagerOptions(step_prefix="step", step_format_fixed_length=4),
    ) as mgr:
        mgr.save(
            7,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), config=ocp.args.JsonSave({"lr": 0.1, "layers": [2, 3]})
            ),
        )
    assert oc.list_steps(root) == [7]
    step_dir = root / "step_0007"
    assert oc.step_item_path(root, 7) == str(step_dir / "state")
    config = {"lr": 0.1, "layers": [2, 3]}  # named items restore as {item: value}, JSON items as their JSON
    assert_bit_exact(
        {"config": config, "state": state},
        fc.restore(step_dir, {"state": state, "config": None}),
        types=False,
    )
    assert_bit_exact(state, fc.restore(step_dir, state, item="state"), types=False)  # one item by itself
    assert oc.json_items(step_dir) == {"config": config}
    assert fc.metadata(step_dir).step == 7


def test_orbax_step_with_two_pytree_items(ckpt_dir):
    root = ckpt_dir / "two"
    params, opt = {"w": jnp.arange(6.0).reshape(2, 3)}, {"count": jnp.int32(4), "lr": 0.5}
    with ocp.CheckpointManager(root, item_names=("params", "opt")) as mgr:
        mgr.save(
            1, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt=ocp.args.StandardSave(opt))
        )
    assert oc.step_item_path(root, 1) == str(root / "1")  # several items: the step folder, {item: tree}
    both = {"params": params, "opt": opt}
    assert_bit_exact(both, fc.restore(root / "1", both), types=False)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    plain = fc.restore(root / "1", shardings=one_device)  # one sharding for every array; scalars stay Python
    assert plain["opt"]["lr"] == 0.5 and plain["params"]["w"].sharding == one_device
    with pytest.raises(fc.StructureMismatchError, match="pytree items 'opt', 'params'"):
        fc.restore(root / "1", params)


def test_orbax_v1_api_state_item(ckpt_dir):
    v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")
    tree = {"w": jnp.arange(3.0), "n": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        v1.save_pytree(ckpt_dir / "v1", tree)
    assert_bit_exact(tree, fc.restore(ckpt_dir / "v1", tree), types=False)


# -------------------------------------------------------------------------- flax_ckpt -> Orbax


@pytest.mark.parametrize("use_ocdbt,use_zarr3", VARIANTS)
def test_flax_ckpt_to_orbax(ckpt_dir, use_ocdbt, use_zarr3):
    tree = dict(_mixed(), rng=jax.random.key(2))
    path = ckpt_dir / "f"
    oc.save(path, tree, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
    restored = ocp.StandardCheckpointer().restore(path, _abstract(tree))
    assert_bit_exact(tree, restored, types=False)
    assert restored["a"].sharding == tree["a"].sharding
    plain = ocp.PyTreeCheckpointer().restore(path)  # without a target: placement from _sharding
    assert plain["a"].sharding == tree["a"].sharding and as_bytes(plain["a"]) == as_bytes(tree["a"])
    assert plain["scalars"] == {"i": 7, "f": 2.5, "t": True}
    assert_bit_exact(tree, fc.restore(path, tree), types=False)


def test_flax_ckpt_trainstate_to_orbax(ckpt_dir, trained_state):
    state = trained_state
    fc.save(ckpt_dir / "ts", state, format="orbax", metadata={"run": "a"})
    assert not (ckpt_dir / "ts" / "manifest.json").exists()
    assert_bit_exact(
        state, ocp.StandardCheckpointer().restore(ckpt_dir / "ts", _abstract(state)), types=False
    )
    assert_bit_exact(state, fc.restore(ckpt_dir / "ts", state), types=False)
    info = fc.metadata(ckpt_dir / "ts")
    assert info.metadata == {"run": "a"} and info.leaves["opt_state/0/count"].dtype == np.int32


def test_flax_ckpt_strings_and_empties_to_orbax_pytree(ckpt_dir):
    tree = {"name": "model-a", "e": {}, "l": [], "t": (), "n": None, "x": np.arange(3)}
    fc.save(ckpt_dir / "p", tree, format="orbax")
    back = ocp.PyTreeCheckpointer().restore(ckpt_dir / "p")
    assert back["name"] == "model-a" and back["e"] == {} and back["l"] == [] and back["n"] is None
    assert_bit_exact(tree, fc.restore(ckpt_dir / "p", tree), types=False)


def test_save_step_restored_by_orbax_manager(ckpt_dir):
    root = ckpt_dir / "mine"
    trees = {
        s: {"w": jax.device_put(jnp.full((8, 4), float(s)), NamedSharding(_mesh(), P("x"))), "step": s}
        for s in (10, 20)
    }
    for s, t in trees.items():
        oc.save_step(root, s, t, metrics={"loss": 1.0 / s})
    assert oc.list_steps(root) == [10, 20] and oc.read_step_metrics(root, 20) == {"loss": 0.05}
    with ocp.CheckpointManager(
        root, options=ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    ) as mgr:
        assert mgr.all_steps() == [10, 20] and mgr.latest_step() == 20 and mgr.best_step() == 20
        out = mgr.restore(20, args=ocp.args.StandardRestore(_abstract(trees[20])))
        assert_bit_exact(trees[20], out, types=False)
        assert_bit_exact(trees[10], mgr.restore(10), types=False)  # handler from _CHECKPOINT_METADATA
    assert_bit_exact(trees[10], fc.restore(oc.step_item_path(root, 10), trees[10]), types=False)
    with pytest.raises(fc.CheckpointExistsError):
        oc.save_step(root, 10, trees[10])


@pytest.mark.parametrize("device_copy", ["auto", "always"])
def test_snapshot_is_independent_of_later_mutation(ckpt_dir, monkeypatch, device_copy):
    # "always": the jax leaf is copied on its device and comes to host only in the background half,
    # which must bring it there itself (it failed with a shard of None before the layouts did)
    monkeypatch.setenv("FLAX_CKPT_DEVICE_SNAPSHOT", device_copy)
    host = np.arange(6, dtype=np.float32)
    tree = {"h": host, "d": jax.device_put(jnp.ones((8, 2)), NamedSharding(_mesh(), P("x")))}
    expected = jax.tree_util.tree_map(np.array, tree)
    snap = oc.snapshot(tree)  # the blocking half of an async save
    host[:] = -1
    with ThreadPoolExecutor(1) as pool:  # the background half
        assert pool.submit(oc.save_step, ckpt_dir / "bg", 3, snap).result() == str(ckpt_dir / "bg" / "3")
    assert_bit_exact(expected, fc.restore(oc.step_item_path(ckpt_dir / "bg", 3)), types=False)


def test_memory_storage_round_trip():
    tree = {"w": jnp.arange(5, dtype=jnp.bfloat16), "s": 1.5}
    fc.save("memory://orbax-compat/ck", tree, format="orbax")
    assert_bit_exact(tree, fc.restore("memory://orbax-compat/ck", tree), types=False)


# ----------------------------------------------------------------------------------------- errors


@pytest.fixture
def orbax_ckpt(ckpt_dir):
    tree = {"params": {"dense": {"kernel": jnp.ones((4, 6)), "bias": jnp.zeros(6)}}, "step": 3}
    path = ckpt_dir / "o"
    _orbax_write(path, tree, use_ocdbt=False, use_zarr3=True)
    return path, tree


def test_structure_mismatch_names_both_sides(orbax_ckpt):
    path, tree = orbax_ckpt
    wrong = {"params": {"dense": {"kernel": tree["params"]["dense"]["kernel"]}}, "step": 3, "extra": 1}
    with pytest.raises(fc.StructureMismatchError) as e:
        fc.restore(path, wrong)
    msg = str(e.value)
    assert "'extra'" in msg and "'params/dense/bias'" in msg and "partial=True" in msg and str(path) in msg
    part = fc.restore(
        path, {"params": {"dense": {"bias": jax.ShapeDtypeStruct((6,), jnp.float32)}}}, partial=True
    )
    assert np.array_equal(part["params"]["dense"]["bias"], np.zeros(6))


def test_leaf_mismatch_lists_every_leaf(orbax_ckpt):
    path, tree = orbax_ckpt
    wrong = jax.tree_util.tree_map(lambda x: x, tree)
    wrong["params"]["dense"]["kernel"] = jax.ShapeDtypeStruct((4, 6), jnp.bfloat16)
    wrong["params"]["dense"]["bias"] = jax.ShapeDtypeStruct((7,), jnp.float32)
    with pytest.raises(fc.LeafMismatchError) as e:
        fc.restore(path, wrong)
    msg = str(e.value)
    assert "'params/dense/kernel': expected bfloat16[4,6] (target), found float32[4,6]" in msg
    assert "'params/dense/bias': expected float32[7] (target), found float32[6]" in msg
    assert f"{path}/_METADATA" in msg


def test_missing_chunk_is_corruption(orbax_ckpt):
    path, tree = orbax_ckpt
    shutil.rmtree(path / "params.dense.kernel" / "c")  # zarr3 without OCDBT: the chunk folder
    with pytest.raises(fc.CorruptCheckpointError, match="params/dense/kernel"):
        fc.restore(path, tree)


def test_unknown_handler_is_refused(ckpt_dir):
    path = ckpt_dir / "arr"
    ocp.Checkpointer(ocp.ArrayCheckpointHandler()).save(path, args=ocp.args.ArraySave(np.arange(3)))
    assert oc.is_orbax(path)
    with pytest.raises(oc.UnsupportedOrbaxCheckpointError, match="ArrayCheckpointHandler"):
        fc.restore(path)


def test_not_found_and_not_orbax(ckpt_dir):
    assert not oc.is_orbax(ckpt_dir / "nothing")
    with pytest.raises(fc.CheckpointNotFoundError):
        fc.restore(ckpt_dir / "nothing")
    (ckpt_dir / "o").mkdir()
    (ckpt_dir / "o" / "_METADATA").write_text(json.dumps({"tree_metadata": 3}))
    with pytest.raises(fc.InvalidManifestError, match="tree_metadata"):
        fc.restore(ckpt_dir / "o")


def test_save_refuses_existing_and_unsupported_names(ckpt_dir, orbax_ckpt):
    path, tree = orbax_ckpt
    with pytest.raises(fc.CheckpointExistsError):
        fc.save(path, tree, format="orbax")
    with pytest.raises(fc.UnsupportedLeafError, match="'a.b'"):
        fc.save(ckpt_dir / "clash", {"a.b": 1, "a": {"b": 2}}, format="orbax")
    assert not any(n.startswith("clash") for n in os.listdir(ckpt_dir))


# ------------------------------------------------------ flax_ckpt's CheckpointManager (manager/manager.py)


def test_manager_resumes_an_orbax_run(ckpt_dir):
    root = ckpt_dir / "run"
    trees = {s: {"w": jnp.full((4,), float(s), jnp.bfloat16), "step": s} for s in (1, 2)}
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")  # Orbax keeps
    with ocp.CheckpointManager(root, options=options) as omgr:  # metrics only with best-metric retention
        for s, t in trees.items():
            omgr.save(s, args=ocp.args.StandardSave(t), metrics={"loss": 1.0 / s})
    with fc.CheckpointManager(root, async_save=False, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
        assert_bit_exact(trees[2], mgr.restore(target=trees[2]), types=False)
        assert mgr.metrics(2) == {"loss": 0.5}
        mgr.save(3, {"w": jnp.full((4,), 3.0, jnp.bfloat16), "step": 3}, metrics={"loss": 0.1})
        assert mgr.all_steps() == [2, 3]  # the run continues (in Orbax's layout); retention removed step 1
        assert not (root / "1").exists() and (root / "2").exists()
        assert mgr.restore(2, trees[2])["step"] == 2 and mgr.restore()["step"] == 3


def test_manager_writes_orbax_steps(ckpt_dir):
    root = ckpt_dir / "mine"
    tree = {"w": jax.device_put(jnp.arange(8.0), NamedSharding(_mesh(), P(("x", "y"))))}
    with fc.CheckpointManager(root, format="orbax", async_save=False) as mgr:
        mgr.save(5, tree, metrics={"loss": 0.1})
    with ocp.CheckpointManager(root) as omgr:
        assert omgr.all_steps() == [5]
        assert_bit_exact(tree, omgr.restore(5, args=ocp.args.StandardRestore(_abstract(tree))), types=False)


# ----------------------------------------------------------- small arrays encoded without tensorstore


def _ocdbt_items(folder) -> dict[bytes, bytes]:
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(folder) + "/"}}).result()
    return {k: kv.read(k).result().value for k in kv.list().result()}


@pytest.mark.parametrize("compression", [True, False])
def test_small_arrays_are_stored_byte_for_byte_as_tensorstore_stores_them(tmp_path, monkeypatch, compression):
    """The small arrays that orbax/write.py encodes itself (one OCDBT transaction instead of a tensorstore
    open and write each, issue 43 item 10) are the same keys and bytes tensorstore writes, for every
    dtype encoded there, 0-d to 3-d, one-byte types and sharded jax arrays included; Orbax restores them."""
    orbax_write = write
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    tree = {
        "f32": jnp.arange(12.0).reshape(3, 4),
        "scalar": jnp.float32(2.5),
        "py": 7,
        "bf16": jnp.ones(5, jnp.bfloat16),
        "b": np.array([True, False, True]),
        "i8": np.arange(-3, 3, dtype=np.int8),
        "u64": np.arange(4, dtype=np.uint64),
        "c64": np.array([1 + 2j, -1j], np.complex64),
        "f16": np.full((2, 2, 2), 1.5, np.float16),
        "rep": jax.device_put(jnp.arange(6.0), jax.sharding.NamedSharding(mesh, P())),
        "split": jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh, P("x"))),
    }
    encoded = []
    real = orbax_write._write_small
    monkeypatch.setattr(
        orbax_write, "_write_small", lambda st, arrays, *a: (encoded.extend(arrays), real(st, arrays, *a))[1]
    )
    opened = []
    real_open = orbax_write.ts.open
    monkeypatch.setattr(
        orbax_write.ts, "open", lambda spec, *a, **k: (opened.append(spec), real_open(spec, *a, **k))[1]
    )
    orbax_write.save_item(open_storage(tmp_path), "here", snapshot(tree, copy=True), compression=compression)
    assert [spec["kvstore"]["path"] for spec in opened] == ["split"]  # tensorstore opens the sharded leaf
    monkeypatch.setattr(orbax_write.ts, "open", real_open)
    monkeypatch.setattr(orbax_write, "_SMALL", 0)  # every array through tensorstore
    orbax_write.save_item(
        open_storage(tmp_path), "tensorstore", snapshot(tree, copy=True), compression=compression
    )
    assert {orbax_write.param(lf) for lf, _ in encoded} == set(tree) - {"split"}  # "split": two chunks
    assert _ocdbt_items(tmp_path / "here") == _ocdbt_items(tmp_path / "tensorstore")
    got = ocp.PyTreeCheckpointer().restore(tmp_path / "here")
    for k, v in tree.items():
        want = np.asarray(v)
        assert np.array_equal(np.asarray(got[k]), want) and np.asarray(got[k]).dtype == want.dtype, k
    assert_bit_exact(fc.restore(tmp_path / "here", tree), tree)


# ------------------------------------------------------------------ durability: what is fsynced, and when


class _SlowDisk:
    """os.fsync as on a disk where each one takes ``delay`` seconds: records which file or folder each fsync
    made durable and when it started and ended, and when each os.rename happened."""

    def __init__(self, monkeypatch, delay: float):
        self.fsyncs: list[tuple[str, float, float]] = []
        self.renames: list[tuple[str, str, float]] = []
        real_fsync, real_rename = os.fsync, os.rename

        def fsync(fd):
            path, t0 = os.readlink(f"/proc/self/fd/{fd}"), time.perf_counter()
            time.sleep(delay)
            real_fsync(fd)
            self.fsyncs.append((path, t0, time.perf_counter()))

        def rename(src, dst, **kw):
            real_rename(src, dst, **kw)
            self.renames.append((os.fspath(src), os.fspath(dst), time.perf_counter()))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        # another disk: no fsync timed on it yet (storage/local.py fsync_all decides by the last one)
        from flax_ckpt._src.storage import local

        monkeypatch.setattr(local, "_FSYNC_S", {})

    def rounds(self) -> int:
        """The most fsyncs that ran one after another (none overlapping the next): the fsyncs' depth."""
        n, last_end = 0, float("-inf")
        for _, start, end in sorted(self.fsyncs, key=lambda e: e[2]):
            if start >= last_end:
                n, last_end = n + 1, end
        return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads fsynced paths in /proc/self/fd (Linux)")
@pytest.mark.parametrize("missing", [None, 0, 2])
def test_fsync_all_runs_the_fsyncs_at_once_and_ends_them_all_before_a_failure(tmp_path, monkeypatch, missing):
    """fsync_all (the folders of a step at its commit) fsyncs its paths at once, the first on the calling
    thread: on a disk where an fsync takes 0.2 s, three take one round. A path that cannot be fsynced
    (``missing``: the first, or one on the pool) raises its error, but only once every other fsync
    ended."""
    from flax_ckpt._src.storage.local import fsync_all

    paths = []
    for i in range(3):
        (tmp_path / f"d{i}").mkdir()
        paths.append(str(tmp_path / f"d{i}"))
    if missing is not None:
        paths[missing] = str(tmp_path / "gone")
    disk = _SlowDisk(monkeypatch, delay=0.2)
    if missing is None:
        fsync_all(paths)
    else:
        with pytest.raises(FileNotFoundError):
            fsync_all(paths)
    monkeypatch.undo()
    done = sorted(p for p, _, _ in disk.fsyncs)
    assert done == sorted(p for p in paths if not p.endswith("gone")), done
    assert disk.rounds() == 1, f"fsyncs one after another: {disk.fsyncs}"


@pytest.mark.parametrize("slow_from", [None, 1])
def test_fsync_all_on_a_fast_disk_runs_one_after_another_on_the_calling_thread(
    tmp_path, monkeypatch, slow_from
):
    """Where the device's last fsync was fast (a local disk: well under a millisecond), fsync_all runs the
    fsyncs one after another on the calling thread: handing one to another thread costs more than it
    (issue 53). Once one takes long (``slow_from``: the second of five), the rest run at once, the first
    of them on the calling thread."""
    from flax_ckpt._src.storage import local

    paths = []
    for i in range(5):
        (tmp_path / f"d{i}").mkdir()
        paths.append(str(tmp_path / f"d{i}"))
    monkeypatch.setattr(local, "_FSYNC_S", {os.stat(tmp_path).st_dev: 0.0})
    calls: list[tuple[int, int, float, float]] = []

    def fsync(fd):
        k, t0 = len(calls), time.perf_counter()
        if slow_from is not None and k >= slow_from:
            time.sleep(0.2)
        calls.append((k, threading.get_ident(), t0, time.perf_counter()))

    monkeypatch.setattr(os, "fsync", fsync)
    local.fsync_all(paths)
    monkeypatch.undo()
    assert len(calls) == 5
    me = threading.get_ident()
    if slow_from is None:
        assert all(ident == me for _, ident, _, _ in calls), calls
        return
    by_order = sorted(calls, key=lambda c: c[2])
    assert [ident for _, ident, _, _ in by_order[:2]] == [me, me], by_order  # one after another, then
    rest = by_order[2:]  # the slow one's successors at once, the first on this thread
    assert sum(ident == me for _, ident, _, _ in rest) == 1, rest
    assert max(start for _, _, start, _ in rest) < min(end for _, _, _, end in rest), f"not at once: {rest}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads fsynced paths in /proc/self/fd (Linux)")
@pytest.mark.parametrize("fmt,step", [("orbax", None), ("orbax", 3), ("native", None)])
def test_a_save_makes_every_file_and_folder_durable_in_four_rounds_of_fsyncs(
    tmp_path, monkeypatch, fmt, step
):
    """Each file and folder of the checkpoint is fsynced before the rename that commits it, and the parent
    after it, with fsyncs that do not wait for each other run at once: on a disk where an fsync takes
    0.2 s, at most four rounds (the data; the commit record; the folders; the parent), in the Orbax layout
    as in the native one (issue 43 item 10: tensorstore's own fsyncs, one after another, and the folders
    fsynced one by one made an Orbax-format save of small leaves wait for ten)."""
    tree = {f"layer{i}": {"w": np.full((4, 4), i, np.float32), "b": jnp.arange(4.0) + i} for i in range(20)}
    tree["name"] = "run"  # a string leaf: Orbax's _strings.json
    disk = _SlowDisk(monkeypatch, delay=0.2)
    path = tmp_path / ("ck" if step is None else str(step))  # step 3: an Orbax CheckpointManager step
    fc.save(path, tree, format=fmt, step=step)
    monkeypatch.undo()
    ((staging, final, renamed_at),) = [r for r in disk.renames if r[1] == str(path)]
    before = {p for p, _, end in disk.fsyncs if end <= renamed_at}
    want = {
        staging + os.path.join(d, n)[len(str(path)) :]
        for d, dirs, files in os.walk(path)
        for n in [*dirs, *files]
    } | {staging}
    assert not want - before, f"not fsynced before the commit's rename: {sorted(want - before)}"
    parent = [start for p, start, _ in disk.fsyncs if p == str(tmp_path)]
    assert any(start >= renamed_at for start in parent), "the parent folder was not fsynced after the rename"
    listing = "\n".join(f"{s:.2f}-{e:.2f} {p}" for p, s, e in sorted(disk.fsyncs, key=lambda f: f[1]))
    assert disk.rounds() <= 4, f"fsyncs one after another:\n{listing}"
    assert_bit_exact(fc.restore(path, tree), tree)
