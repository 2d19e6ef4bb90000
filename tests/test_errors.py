"""Every bad input gets a clear CheckpointError subclass naming the path (and leaf), and loses nothing."""

from __future__ import annotations

import ast
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_ckpt as fc
from helpers import leaf_of, manifest_body, write_manifest_body

TREE = {
    "params": {"dense": {"kernel": np.arange(24, dtype=np.float32).reshape(4, 6), "bias": np.zeros(6)}},
    "step": 3,
}


def saved(tmp_path, serializer="raw"):
    path = tmp_path / f"ck-{serializer}"
    fc.save(path, TREE, serializer=serializer)
    return path


def test_all_errors_share_one_base():
    for name in fc.__all__:
        obj = getattr(fc, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, fc.CheckpointError) and obj.__doc__


def test_missing_path(tmp_path):
    with pytest.raises(fc.CheckpointNotFoundError, match="does not exist") as e:
        fc.restore(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)


def test_folder_that_is_not_committed(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "data").mkdir()
    with pytest.raises(fc.CheckpointNotCommittedError, match="no committed checkpoint"):
        fc.restore(tmp_path / "half")
    staging = tmp_path / "7.tmp-abc"
    staging.mkdir()
    with pytest.raises(fc.CheckpointNotCommittedError, match="in flight"):
        fc.metadata(staging)


def test_save_over_committed_checkpoint_is_refused_and_keeps_it(tmp_path):
    path = saved(tmp_path)
    with pytest.raises(fc.CheckpointExistsError, match="never overwritten"):
        fc.save(path, {"other": np.ones(3)})
    np.testing.assert_array_equal(
        fc.restore(path)["params"]["dense"]["kernel"], TREE["params"]["dense"]["kernel"]
    )
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_structure_mismatch_lists_missing_and_unexpected(tmp_path):
    path = saved(tmp_path)
    target = {"params": {"dense": {"kernel": np.zeros((4, 6), np.float32), "scale": np.zeros(6)}}, "step": 0}
    with pytest.raises(fc.StructureMismatchError) as e:
        fc.restore(path, target)
    msg = str(e.value)
    assert "In the target but not the checkpoint: 'params/dense/scale'" in msg
    assert "In the checkpoint but not the target: 'params/dense/bias'" in msg
    assert str(path) in msg


def test_shape_and_dtype_mismatch_show_both_for_every_leaf(tmp_path):
    path = saved(tmp_path)
    target = {
        "params": {"dense": {"kernel": jnp.zeros((4, 6), jnp.bfloat16), "bias": np.zeros(5)}},
        "step": 0.0,
    }
    with pytest.raises(fc.LeafMismatchError) as e:
        fc.restore(path, target)
    msg = str(e.value)
    assert "'params/dense/kernel': expected bfloat16[4,6] (target), found float32[4,6]" in msg
    assert "'params/dense/bias': expected float64[5] (target), found float64[6]" in msg
    assert "'step': expected Python float (target), found Python int" in msg
    assert "manifest.json" in msg
    assert "Fix: shapes differ, so this checkpoint is from another model or config" in msg


@pytest.mark.parametrize("head_leaves", [2, 5])
def test_a_new_head_under_the_saved_name_gets_a_rename_rule_that_works_not_missing_keep(
    tmp_path, head_leaves
):
    """A fine-tune whose new head keeps the old head's name with another width, restored with
    missing="keep": the hint suggested missing="keep", which the user had passed. It gives the
    rename= rule that leaves out exactly the saved head (all of it past three leaves), and that rule,
    as printed, restores the body and keeps the new head."""
    names = ["bias", "kernel", "scale", "shift", "gate"][:head_leaves]
    saved_head = {n: np.full((4, 10), i, np.float32) for i, n in enumerate(names)}
    fc.save(tmp_path / "ck", {"params": {"body": np.ones(4, np.float32), "head": saved_head}})
    target = {
        "params": {"body": np.zeros(4, np.float32), "head": {n: np.zeros((4, 5), np.float32) for n in names}}
    }
    with pytest.raises(fc.LeafMismatchError) as e:
        fc.restore(tmp_path / "ck", target, missing="keep")
    msg = str(e.value)
    rule = re.search(r"rename=(\{r\"[^\"]+\": None\}) beside missing=\"keep\"", msg)
    assert rule is not None and 'or missing="keep" for new ones' not in msg, msg
    assert rule.group(1) == (
        '{r"params/head/bias|params/head/kernel": None}' if head_leaves == 2 else '{r"params/head/.*": None}'
    )
    restored = fc.restore(
        tmp_path / "ck", target, missing="keep", rename=ast.literal_eval(rule.group(1))
    )  # as printed
    assert np.array_equal(restored["params"]["body"], np.ones(4, np.float32))
    assert all(restored["params"]["head"][n] is target["params"]["head"][n] for n in names)
    with pytest.raises(fc.LeafMismatchError, match=r'keep the target\'s own with rename=\{r"params/head'):
        fc.restore(tmp_path / "ck", target)  # without missing="keep": the same rule, and missing="keep"


def test_a_dtype_only_mismatch_suggests_restoring_the_saved_dtype_and_casting(tmp_path):
    path = saved(tmp_path)
    target = {
        "params": {"dense": {"kernel": jnp.zeros((4, 6), jnp.bfloat16), "bias": np.zeros(6)}},
        "step": 0,
    }
    with pytest.raises(fc.LeafMismatchError) as e:
        fc.restore(path, target)
    msg = str(e.value)
    assert "Fix: only dtypes differ" in msg and "cast after" in msg
    assert "another model" not in msg


@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_data_is_detected_and_named(tmp_path, serializer, damage):
    path = saved(tmp_path, serializer)
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name not in ("manifest.json", "zarr.json"))
    victim = max(files, key=lambda p: p.stat().st_size)  # holds the kernel
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    with pytest.raises(fc.CorruptCheckpointError) as e:
        fc.restore(path)
    msg = str(e.value)
    assert "params/dense" in msg or victim.name in msg, msg
    assert str(path) in msg or victim.name in msg


def test_manifest_not_json(tmp_path):
    path = saved(tmp_path)
    (path / "manifest.json").write_text('{"format": "flax_ckpt", "version": 1, "body": {')
    with pytest.raises(fc.InvalidManifestError, match="not valid JSON"):
        fc.restore(path)


def test_manifest_edited_by_hand_fails_its_checksum(tmp_path):
    path = saved(tmp_path)
    doc = json.loads((path / "manifest.json").read_text())
    doc["body"]["leaves"][0]["shape"] = [4, 7]
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(fc.InvalidManifestError, match="checksum mismatch"):
        fc.restore(path)


def test_unknown_format_version(tmp_path):
    path = saved(tmp_path)
    doc = json.loads((path / "manifest.json").read_text())
    doc["version"] = 99
    (path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(fc.InvalidManifestError, match="unknown format version 99"):
        fc.restore(path)


@pytest.mark.parametrize(
    "location", ["../../etc/passwd", "/etc/passwd", "data/../../x", "data//x", "./data/x"]
)
def test_locations_outside_the_folder_are_refused(tmp_path, location):
    path = saved(tmp_path)
    body = manifest_body(path)
    old = body["leaves"][0]["chunks"][0]["file"]
    body["files"][location] = body["files"].pop(old)
    for leaf in body["leaves"]:
        for ch in leaf.get("chunks", []):
            ch["file"] = location
    write_manifest_body(path, body)
    with pytest.raises(fc.InvalidManifestError, match="not a relative path inside"):
        fc.restore(path)


def test_symlink_out_of_the_folder_is_not_followed(tmp_path):
    path = saved(tmp_path)
    outside = tmp_path / "outside.bin"
    data_file = next((path / "data").iterdir())
    outside.write_bytes(data_file.read_bytes())
    data_file.unlink()
    data_file.symlink_to(outside)
    with pytest.raises(fc.CorruptCheckpointError, match="outside the checkpoint folder"):
        fc.restore(path)


@pytest.mark.parametrize("shape", [[2**40, 2**40], [-1, 6], [10**30], ["4", 6], [1] * 100])
def test_absurd_shapes_are_refused_before_allocating(tmp_path, shape):
    path = saved(tmp_path)
    body = manifest_body(path)
    leaf = leaf_of(body, "kernel")
    leaf["shape"] = shape
    write_manifest_body(path, body)
    with pytest.raises(fc.InvalidManifestError, match="leaves"):
        fc.restore(path)


def test_chunks_that_do_not_tile_the_array_are_refused(tmp_path):
    path = saved(tmp_path)
    body = manifest_body(path)
    leaf = leaf_of(body, "kernel")
    leaf["chunks"].append(dict(leaf["chunks"][0]))
    write_manifest_body(path, body)
    with pytest.raises(fc.InvalidManifestError, match="tile"):
        fc.restore(path)


def test_unsupported_leaf_names_key_path_and_type_and_writes_nothing(tmp_path):
    with pytest.raises(fc.UnsupportedLeafError) as e:
        fc.save(tmp_path / "bad", {"ok": np.ones(2), "fn": lambda x: x, "nested": [object()]})
    msg = str(e.value)
    assert "fn: function" in msg and "nested/0: object" in msg
    assert not os.listdir(tmp_path)


def test_non_json_metadata_is_refused_before_writing(tmp_path):
    with pytest.raises(fc.CheckpointError, match="JSON-serializable"):
        fc.save(tmp_path / "bad", {"x": np.ones(2)}, metadata={"when": object()})
    assert not os.listdir(tmp_path)


def test_a_mesh_that_does_not_divide_the_saved_shape_is_a_target_mismatch_naming_the_leaf(tmp_path):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    fc.save(tmp_path / "ck", {"w": np.arange(48 * 8, dtype=np.float32).reshape(48, 8)})
    five = NamedSharding(Mesh(np.array(jax.devices()[:5]), ("x",)), P("x"))  # 48 rows over 5 devices
    with pytest.raises(
        fc.TargetMismatchError, match=r"restore of 'w' .*\[48, 8\].*Fix: restore with a process"
    ):
        fc.restore(tmp_path / "ck", {"w": jax.ShapeDtypeStruct((48, 8), np.float32, sharding=five)})
    assert fc.restore(tmp_path / "ck")["w"].shape == (48, 8)  # nothing lost


# ------------------------------------------------------------------- issue 44 item 9: no raw errors


@pytest.mark.parametrize("fmt", ["native", "orbax"])
@pytest.mark.parametrize("what", ["link to an empty folder", "dangling link", "file", "link to a file"])
def test_a_save_onto_a_link_or_a_file_is_refused_and_touches_nothing(tmp_path, what, fmt):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_bytes(b"mine")
    dest = tmp_path / "dest"
    if what == "file":
        dest = tmp_path / "file"
    else:
        dest.symlink_to(
            tmp_path
            / {"link to an empty folder": "empty", "dangling link": "nowhere", "link to a file": "file"}[what]
        )
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(fc.CheckpointExistsError, match="Fix:") as e:
        fc.save(dest, {"w": np.ones(3)}, format=fmt)
    assert str(dest) in str(e.value)
    assert sorted(os.listdir(tmp_path)) == before and not os.listdir(tmp_path / "empty")
    assert (tmp_path / "file").read_bytes() == b"mine"
    fc.save(tmp_path / "empty", {"w": np.ones(3)}, format=fmt)  # the folder the link names takes it
    assert fc.restore(tmp_path / "empty")["w"].tolist() == [1, 1, 1]


def test_a_run_path_that_is_not_utf8_works_natively_and_is_a_clear_error_for_orbax(tmp_path):
    run = os.fsdecode(os.fsencode(tmp_path) + b"/run\xff")
    with fc.CheckpointManager(run) as mgr:
        mgr.save(1, {"w": np.arange(3)})
        mgr.wait_until_finished()
        assert mgr.restore()["w"].tolist() == [0, 1, 2]
    assert b"1" in os.listdir(os.fsencode(tmp_path) + b"/run\xff")
    with pytest.raises(fc.StorageError, match="not valid UTF-8.*Fix: save to a UTF-8 path"):
        fc.save(run + "/orbax", {"w": np.ones(2)}, format="orbax")
    assert not os.path.lexists(run + "/orbax")


# --------------------------------------------- issue 43 item 7: abstract-mesh targets (jax.set_mesh)


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="jax.set_mesh is newer than this jax (0.7+)")
def test_a_target_over_an_abstract_mesh_restores_with_the_mesh_in_context_or_is_a_clear_error(tmp_path):
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])

    def model():
        return nnx.Linear(
            4,
            6,
            rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b")),
        )

    with jax.set_mesh(mesh):
        state = nnx.state(model())
        fc.save(tmp_path / "ck", state)
        abstract = nnx.state(nnx.eval_shape(model))  # leaves over mesh.abstract_mesh
        out = fc.restore(tmp_path / "ck", abstract)
    kernel = out["kernel"][...]
    assert kernel.sharding == NamedSharding(mesh, P("a", "b"))
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(state["kernel"][...]))

    with pytest.raises(fc.TargetMismatchError) as e:  # no mesh in context
        fc.restore(tmp_path / "ck", abstract)
    msg = str(e.value)
    assert "2 leaves are placed over an abstract mesh" in msg and "no mesh is in context" in msg
    assert "'kernel/value'" in msg and "jax.set_mesh" in msg and str(tmp_path / "ck") in msg
    other = jax.make_mesh((4, 1), ("a", "b"), devices=jax.devices()[:4])
    with jax.set_mesh(other):
        with pytest.raises(fc.TargetMismatchError, match="the mesh in context has other axes"):
            fc.restore(tmp_path / "ck", abstract)
    with pytest.raises(fc.TargetMismatchError, match="2 leaves .*'bias/value', 'kernel/value'"):  # no target
        fc.restore(tmp_path / "ck", shardings=NamedSharding(mesh.abstract_mesh, P()))


# ------------------------------------------ issue 43 item 4: readable errors with their diagnosis


def wide_state(n=100):
    return {
        "params": {
            f"layer{i:03d}": {"w": np.full((3, 4), i, np.float32), "b": np.zeros(4, np.float32)}
            for i in range(n)
        },
        "step": 5,
    }


def test_a_replicated_pmap_state_restored_unreplicated_says_so_in_a_short_message(tmp_path):
    import jax
    from flax import jax_utils

    state = wide_state()
    fc.save(tmp_path / "ck", jax_utils.replicate(state))  # what a pmap loop saves: a leading axis of 8
    with pytest.raises(fc.LeafMismatchError) as e:
        fc.restore(tmp_path / "ck", state)
    msg = str(e.value)
    assert len(msg) < 3000 and msg.count("expected") == 20 and "; ... (181 more) in " in msg
    assert "every leaf differs only by a leading axis of 8" in msg and "replicated by pmap" in msg
    assert "flax.jax_utils.unreplicate" in msg and "another model" not in msg
    replicated = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8,) + np.shape(x), np.asarray(x).dtype), state)
    replicated["step"] = jax.ShapeDtypeStruct((8,), np.int32)
    restored = jax_utils.unreplicate(fc.restore(tmp_path / "ck", replicated))  # the fix it names
    np.testing.assert_array_equal(restored["params"]["layer007"]["w"], state["params"]["layer007"]["w"])

    fc.save(tmp_path / "plain", state)
    with pytest.raises(
        fc.LeafMismatchError,
        match="the target is a state replicated by pmap.*"
        r"flax\.jax_utils\.replicate\(restored\)",
    ):
        fc.restore(tmp_path / "plain", jax_utils.replicate(state))


def nnx_state():
    from flax import nnx

    return nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))


@pytest.mark.skipif(not hasattr(nnx, "to_pure_dict"), reason="nnx.to_pure_dict is newer than this flax")
@pytest.mark.parametrize(
    "saved, target, diagnosis",
    [
        (
            "pure",
            "state",
            "the target's key paths end in '/value' (an nnx.State) where the checkpoint's do not",
        ),
        (
            "state",
            "pure",
            "the checkpoint's key paths end in '/value' (a saved nnx.State) where the target's",
        ),
        ("pure", "nested pure", "the target nests every leaf under 'model/' where the checkpoint does not"),
        (
            "tuple of pure",
            "state",
            "the checkpoint nests every leaf under '0/' where the target does not; the "
            "target's key paths end in '/value'",
        ),
    ],
)
def test_a_prefix_or_value_nesting_difference_is_diagnosed_with_a_rename_that_works(
    tmp_path, saved, target, diagnosis
):
    import re

    from flax import nnx

    state = nnx_state()
    pure = nnx.to_pure_dict(state)
    trees = {"pure": pure, "state": state, "nested pure": {"model": pure}, "tuple of pure": (pure,)}
    fc.save(tmp_path / "ck", trees[saved])
    with pytest.raises(fc.StructureMismatchError) as e:
        fc.restore(tmp_path / "ck", trees[target])
    msg = str(e.value)
    assert diagnosis in msg and 'missing="keep"' not in msg
    if "'/value'" in diagnosis:
        assert "nnx.to_pure_dict" in msg
    rule = re.search(r"pass rename=(\{.*?\})", msg).group(1)
    out = fc.restore(tmp_path / "ck", trees[target], rename=eval(rule))  # the rule the message gives works
    got = nnx.to_pure_dict(out) if target == "state" else out.get("model", out)
    np.testing.assert_array_equal(np.asarray(got["kernel"]), np.asarray(pure["kernel"]))


# -------------------------------------- issue 43 item 7: every error from a restore is a CheckpointError


@pytest.mark.parametrize(
    "kwargs, found",
    [
        (dict(target={}, missing="drop"), "missing='drop'"),
        (dict(target={}, unexpected="drop"), "unexpected='drop'"),
        (dict(target={}, cast="yes"), "cast='yes': expected True or False"),
        (dict(target={}, rename={"(": "x"}), "not a regular expression"),
        (dict(target={}, rename=[("a", 1)]), "must be a str or None"),
        (dict(target={}, rename=["abc"]), "expected \\(regex, replacement\\) pairs"),
        (dict(rename={"params/(.*)": r"\2"}), "fails on"),
        (dict(rename=lambda name: 7), "it returned 7"),
        (dict(cast=True), "pass a target"),
    ],
)
def test_a_bad_restore_argument_is_a_checkpoint_error_and_still_a_value_or_type_error(
    tmp_path, kwargs, found
):
    path = saved(tmp_path)
    with pytest.raises(fc.CheckpointError, match=found) as e:
        fc.restore(path, **kwargs)
    assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)
