"""Bit-exact round trips of every supported leaf and container, on every serializer and storage."""

from __future__ import annotations

import json
import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from helpers import assert_bit_exact, leaf_chunks
from trees import mixed_tree, train_state_tree

SERIALIZERS = ["raw", "zarr3"]


@pytest.fixture(params=["local", "memory"])
def location(request, tmp_path):
    """A fresh checkpoint path on each storage backend."""
    if request.param == "local":
        return lambda name: str(tmp_path / name)
    prefix = f"memory://rt-{uuid.uuid4().hex}"
    return lambda name: f"{prefix}/{name}"


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_mixed_tree_round_trip_with_target(location, serializer):
    tree = mixed_tree()
    path = location("ck")
    fc.save(path, tree, serializer=serializer, metadata={"run": "x"})
    assert_bit_exact(fc.restore(path, tree), tree)


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_restore_without_target_gives_plain_containers(location, serializer):
    tree = mixed_tree()
    path = location("ck")
    fc.save(path, tree, serializer=serializer)
    out = fc.restore(path)
    assert isinstance(out["jax"]["w"], np.ndarray) and out["jax"]["w"].dtype == np.float32
    np.testing.assert_array_equal(out["jax"]["w"], np.asarray(tree["jax"]["w"]))
    assert isinstance(out["point"], dict) and set(out["point"]) == {"x", "y"} and out["point"]["x"] == 3
    assert isinstance(out["point"]["y"], list)
    assert out["extra"]["b"] == 4 and "name" not in out["extra"]
    assert out["scalars"][1] == -(2**70) and out["scalars"][5] is True
    assert np.float64(out["scalars"][3]).tobytes() == np.float64(-0.0).tobytes()
    assert out["text"] == "héllo" and out["none"] is None
    assert out["empty_dict"] == {} and out["empty_list"] == [] and out["empty_tuple"] == ()
    assert out["int_keys"][3] == "three" and list(out["int_keys"]) == [3, 10]
    assert out["opt"][0]["mu"]["a"].shape == (3,)
    assert jax.dtypes.issubdtype(out["typed_key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(out["typed_key"]), jax.random.key_data(tree["typed_key"])
    )
    assert out["raw_key"].dtype == np.uint32


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_train_state_round_trip_gives_back_apply_fn_and_tx(tmp_path, serializer):
    state = train_state_tree()
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    state = state.apply_gradients(grads=grads)
    fc.save(tmp_path / "ts", state, serializer=serializer)
    template = train_state_tree()
    out = fc.restore(tmp_path / "ts", template)
    assert out.apply_fn == template.apply_fn and out.tx is template.tx
    assert int(out.step) == 1
    assert_bit_exact(out.params, state.params)
    assert_bit_exact(out.opt_state, state.opt_state)


def test_nnx_state_round_trip(tmp_path):
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

    model = Model(nnx.Rngs(0))
    _, state = nnx.split(model)
    fc.save(tmp_path / "nnx", state)
    fresh = Model(nnx.Rngs(1))
    graphdef, abstract = nnx.split(fresh)
    restored = fc.restore(tmp_path / "nnx", abstract)
    nnx.update(fresh, restored)
    np.testing.assert_array_equal(fresh.dense.kernel[...], model.dense.kernel[...])
    pure = fc.restore(tmp_path / "nnx")
    np.testing.assert_array_equal(pure["dense"]["kernel"]["value"], np.asarray(model.dense.kernel[...]))


def test_shape_dtype_struct_target_places_on_sharding(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("a", "b")))
    fc.save(tmp_path / "s", {"x": x})
    target_sharding = NamedSharding(Mesh(np.array(jax.devices()[:8]), ("d",)), P(None, "d"))
    out = fc.restore(
        tmp_path / "s", {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=target_sharding)}
    )
    assert out["x"].sharding == target_sharding
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))
    info = fc.metadata(tmp_path / "s")
    assert info.leaves["x"].sharding == {
        "type": "NamedSharding",
        "axis_names": ["a", "b"],
        "mesh_shape": [2, 2],
        "spec": ["a", "b"],
    }


def test_shardings_argument_overrides_placement_without_target(tmp_path):
    fc.save(tmp_path / "s", {"x": np.arange(16, dtype=np.int32).reshape(4, 4)})
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("d",)), P("d"))
    out = fc.restore(tmp_path / "s", shardings={"x": sharding})
    assert isinstance(out["x"], jax.Array) and out["x"].sharding == sharding


def test_partial_restore_reads_only_the_subtree(tmp_path):
    tree = {"params": {"w": np.ones((256, 256), np.float32)}, "opt": {"m": np.zeros((512, 512), np.float32)}}
    fc.save(tmp_path / "p", tree)
    # damage the bytes of opt/m: a restore that read them would fail its checksum
    chunk = leaf_chunks(tmp_path / "p")["opt/m"][0]
    with open(tmp_path / "p" / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + 100)
        f.write(b"\xff")
    out = fc.restore(tmp_path / "p", {"params": {"w": np.zeros((256, 256), np.float32)}}, partial=True)
    assert set(out) == {"params"}
    np.testing.assert_array_equal(out["params"]["w"], tree["params"]["w"])
    with pytest.raises(fc.StructureMismatchError, match="partial=True"):
        fc.restore(tmp_path / "p", {"params": {"w": np.zeros((256, 256), np.float32)}})
    with pytest.raises(fc.CorruptCheckpointError, match="opt/m"):
        fc.restore(tmp_path / "p")


def test_metadata_reads_no_array_bytes(tmp_path):
    tree = {"w": np.ones((100, 10), np.float32), "step": 3}
    fc.save(tmp_path / "m", tree, step=3, metrics={"loss": 0.5}, metadata={"lr": 0.1})
    for f in (tmp_path / "m" / "data").iterdir():
        f.unlink()  # metadata must not need them
    info = fc.metadata(tmp_path / "m")
    assert info.step == 3 and info.metrics == {"loss": 0.5} and info.metadata == {"lr": 0.1}
    assert info.tree["w"].shape == (100, 10) and info.tree["w"].dtype == np.float32
    assert info.nbytes == 4000 and info.process_count == 1


def test_large_array_is_split_into_subchunks_and_restored(tmp_path):
    x = np.random.default_rng(0).standard_normal((3000, 7000)).astype(np.float32)  # 84 MB > one sub-chunk
    fc.save(tmp_path / "big", {"x": x})
    assert len(list((tmp_path / "big" / "data").iterdir())) > 1
    np.testing.assert_array_equal(fc.restore(tmp_path / "big")["x"], x)


# ------------------------------------------------------------------------------------ property-based

leaf = st.one_of(
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=8),
    st.none(),
    st.sampled_from(["float32", "int8", "uint16", "float16", "bool", "complex64", "int64"]).flatmap(
        lambda dt: st.lists(st.integers(0, 3), max_size=3).map(
            lambda shape: np.random.default_rng(len(shape)).integers(0, 100, shape).astype(dt)
        )
    ),
)
trees = st.recursive(
    leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.tuples(kids, kids),
        st.dictionaries(st.text(min_size=1, max_size=5), kids, max_size=3),
    ),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees, serializer=st.sampled_from(SERIALIZERS))
def test_random_pytrees_round_trip_bit_exact(tmp_path, tree, serializer):
    path = tmp_path / uuid.uuid4().hex
    fc.save(path, tree, serializer=serializer)
    assert_bit_exact(fc.restore(path, tree), tree)


def test_python_scalar_target_accepts_the_0d_array_a_jitted_step_saved(tmp_path):
    """TrainState.create starts step as a Python int; after a jitted step it is an int32 array. Restore
    keeps the target's leaf type: a Python int target gets a Python int back."""
    state = train_state_tree()
    trained = jax.jit(lambda s: s.apply_gradients(grads=jax.tree_util.tree_map(jnp.zeros_like, s.params)))(
        state
    )
    fc.save(tmp_path / "ts", trained)
    out = fc.restore(tmp_path / "ts", train_state_tree())
    assert type(out.step) is int and out.step == 1
    fc.save(tmp_path / "f", {"lr": np.float32(0.5)})
    with pytest.raises(fc.LeafMismatchError, match="expected Python int"):
        fc.restore(tmp_path / "f", {"lr": 3})


# ---------------------------------------------------------------------- one structure saved again
# A save keeps what it learned of a structure (key paths, records, shard boxes) for the next save of
# the same treedef (tree.flat, engine/snapshot.learned): every later save must still record each leaf
# as it is then.


def test_a_structure_saved_again_records_every_leaf_as_it_is_now(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    first = {
        "a": jnp.arange(6, dtype=jnp.float32),
        "b": np.ones((2, 3), np.int32),
        "c": 1,
        "d": jnp.zeros(8),
        "e": jax.random.key(0),
    }
    second = {
        "a": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),  # dtype and shape changed
        "b": 2.5,  # an array became a Python float
        "c": np.arange(3, dtype=np.int64),  # a Python int became an array
        "d": jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x"))),  # sharded over 4 devices
        "e": jax.random.key(1, impl="rbg"),
    }  # another key implementation: other key data
    assert jax.tree_util.tree_structure(first) == jax.tree_util.tree_structure(second)
    fc.save(str(tmp_path / "1"), first)
    fc.save(str(tmp_path / "2"), second)
    assert_bit_exact(fc.restore(str(tmp_path / "1"), first), first)
    assert_bit_exact(
        fc.restore(str(tmp_path / "2"), second),
        second,
        {"a": None, "b": None, "c": None, "d": second["d"].sharding, "e": None},
    )
    info = fc.metadata(str(tmp_path / "2")).leaves
    assert (info["a"].dtype, info["a"].shape) == (np.dtype(jnp.bfloat16), (2, 3))
    assert info["b"].kind == "scalar" and info["c"].kind == "numpy"
    assert info["d"].sharding["type"] == "NamedSharding" and info["d"].sharding["mesh_shape"] == [4]
    plain = fc.restore(str(tmp_path / "2"))
    assert plain["b"] == 2.5 and isinstance(plain["b"], float)
    # and back to the first form: nothing of the second is kept
    fc.save(str(tmp_path / "3"), first)
    assert_bit_exact(fc.restore(str(tmp_path / "3"), first), first)
    assert fc.metadata(str(tmp_path / "3")).leaves["d"].sharding["type"] == "SingleDeviceSharding"


def test_an_unsupported_leaf_in_a_structure_saved_before_is_still_refused(tmp_path):
    fc.save(str(tmp_path / "1"), {"w": jnp.ones(3), "n": 1})
    with pytest.raises(fc.UnsupportedLeafError, match="n: object"):
        fc.save(str(tmp_path / "2"), {"w": jnp.ones(3), "n": object()})
    assert not (tmp_path / "2").exists()


@pytest.mark.parametrize("key", [True, 1.0])
def test_a_key_refused_is_refused_after_a_structure_of_equal_treedef_was_saved(tmp_path, key):
    """{True: x} and {1: x} (and {1.0: x}) have equal treedefs; the bool or float key is still refused."""
    fc.save(str(tmp_path / "1"), {int(key): jnp.ones(2)})
    with pytest.raises(fc.UnsupportedLeafError, match=f"dict key {key!r}"):
        fc.save(str(tmp_path / "2"), {key: jnp.ones(2)})
    assert not (tmp_path / "2").exists()


def test_a_save_keeps_no_reference_to_the_arrays_it_saved(tmp_path):
    """What is kept of a structure between saves holds no leaf, nor does a closed manager: a model saved
    and dropped is freed."""
    import gc
    import weakref

    tree = {"w": jnp.ones((256, 256)), "b": np.zeros(4)}
    refs = [weakref.ref(tree["w"]), weakref.ref(tree["b"])]
    fc.save(str(tmp_path / "1"), tree)
    managers = [
        fc.CheckpointManager(str(tmp_path / "run")),  # and its managers, once closed
        fc.CheckpointManager(
            str(tmp_path / "tiered"),
            tiers=fc.Tiers(local_dir=str(tmp_path / "shm"), peer=False, persist_interval_steps=2),
        ),
    ]
    for mgr in managers:
        with mgr:
            mgr.save(1, tree)
            mgr.save(2, tree)
            mgr.wait_until_finished()
    del tree
    gc.collect()
    assert [r() for r in refs] == [None, None]


# ------------------------------------------------------------------- a manifest made from parts
# A writer makes each save's manifest as text from parts it keeps (native/manifest.SaveManifests): it
# must be the canonical encoding of the body, byte for byte, and validated as restore validates it.


def _manifest(path) -> bytes:
    return (path / "manifest.json").read_bytes()


def _canonical(raw: bytes) -> bytes:
    from flax_ckpt._src.checks import seal

    body = json.loads(raw)["body"]
    return seal(body, name="flax_ckpt", version=1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees)
def test_the_manifest_is_the_canonical_encoding_of_its_body(tmp_path, tree):
    path = tmp_path / uuid.uuid4().hex
    fc.save(path, tree, metadata={"run": "x", "lr": [1e-3, 0.5]})
    assert _manifest(path) == _canonical(_manifest(path))


def test_a_structure_saved_again_is_validated_once_and_written_canonically(tmp_path, monkeypatch):
    """A manager's saves of one structure validate its leaves once (then those that changed), the rest
    of the body at every save; each manifest stays canonical and restores bit-exact."""
    from flax_ckpt._src.native import manifest as manifest_mod

    calls = []
    real = manifest_mod.validate_leaf

    def counted(*a):  # on the writer's thread: the saves' validation, not the restores'
        if threading.current_thread().name.startswith("flax_ckpt-writer"):
            calls.append(a[1])
        return real(*a)

    monkeypatch.setattr(manifest_mod, "validate_leaf", counted)
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    state = dict(
        mixed_tree(),
        key=jax.random.key(3),
        s="text",
        none=None,
        empty={},
        sharded=jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x"))),
        big=np.arange(5 << 20, dtype=np.float32),
    )  # big: two raw sub-chunks
    with fc.CheckpointManager(tmp_path / "m", max_to_keep=None) as mgr:
        for step in range(4):
            state = jax.tree_util.tree_map(
                lambda x: (
                    x + 1
                    if isinstance(x, (np.ndarray, jax.Array))
                    and x.dtype != bool
                    and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                    else x
                ),
                state,
            )
            mgr.save(step, state, metrics={"loss": 1.0 / (step + 1)})
            mgr.wait_until_finished()
            raw = _manifest(tmp_path / "m" / str(step))
            assert raw == _canonical(raw)
            assert_bit_exact(mgr.restore(step, state), state, jax.tree_util.tree_map(lambda x: None, state))
            if step == 0:
                n = len(json.loads(raw)["body"]["leaves"])
                assert sorted(calls) == list(range(n))
            else:  # nothing changed but the arrays' values: no leaf validated again
                assert calls == []
            calls.clear()
        state["s"] = "other text"  # one leaf changed: it alone is validated again
        calls.clear()
        mgr.save(4, state)
        mgr.wait_until_finished()
        paths = [rec["path"] for rec in json.loads(_manifest(tmp_path / "m" / "4"))["body"]["leaves"]]
        assert [paths[i] for i in calls] == [[["key", "s"]]]
        state["added"] = np.ones(2)  # a leaf added: every leaf and the tree validated again
        calls.clear()
        mgr.save(5, state)
        mgr.wait_until_finished()
        assert sorted(calls) == list(range(n + 1))
        for step in (4, 5):
            raw = _manifest(tmp_path / "m" / str(step))
            assert raw == _canonical(raw)
        assert_bit_exact(mgr.restore(5, state), state, jax.tree_util.tree_map(lambda x: None, state))
        calls.clear()
        mgr.metadata = _deep(100)  # the same structure, a body that restore would refuse: still refused
        with pytest.raises(fc.CheckpointError, match="cannot save.*metadata.*deeper than 64"):
            mgr.save(6, state)
            mgr.wait_until_finished()
        assert calls == [] and mgr.all_steps() == [0, 1, 2, 3, 4, 5]
        mgr.metadata = None
        state["s"] = _deep(600, "x")  # as many leaves, one path changed: that leaf is refused
        with pytest.raises(fc.CheckpointError, match="cannot save.*deeper than 512"):
            mgr.save(7, state)
            mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 1, 2, 3, 4, 5]


def _deep(depth: int, out=1):
    for _ in range(depth):
        out = [out]
    return out


def test_canonical_json_is_json_dumps_byte_for_byte_and_fails_as_it_does():
    """checks.canonical (every sealed document: the manifest, the memory tiers' indexes) writes what
    ``json.dumps(value, sort_keys=True, separators=(",", ":"))`` writes, with the encoder made once; a
    value json.dumps refuses is refused with json.dumps' own error."""
    import json

    from flax_ckpt._src.checks import canonical

    values = [
        {"b": [1, 2.5, 'é\n"\\'], "a": None, "c": {"z": True, "y": False, "x": []}},
        [float("nan"), float("inf"), -0.0, 1e300, 2**70, -(2**63)],
        {"3.5": 1, "s": "\u2603\U0001f600"},
        {3: "int keys", 1: "sorted as numbers"},
        "just a string",
        7,
        [],
    ]
    for v in values:
        assert canonical(v) == json.dumps(v, sort_keys=True, separators=(",", ":")), v
    circular: list = []
    circular.append(circular)
    with pytest.raises(ValueError, match="Circular reference"):
        canonical(circular)
    with pytest.raises(TypeError, match="not JSON serializable"):
        canonical({"a": object()})
    with pytest.raises(TypeError):
        canonical({1: 2, "a": 3})  # keys that do not sort
    assert canonical({"after": "failures"}) == '{"after":"failures"}'  # the encoder is still good
