"""A model's life after training: restore into a target that differs from the checkpoint.

Fine-tuning (a larger model from a smaller one's checkpoint: ``missing="keep"``; another module
naming: ``rename=``; a head left out: ``unexpected="ignore"``) and serving (``cast=True`` into
bfloat16), with the report of what was done, over every restore Source: native steps, Orbax steps,
memory-tier copies, through fc.restore, CheckpointManager.restore and CheckpointCallback.restore_or.
Every bad input is a named CheckpointError subclass, and nothing half-restored is handed back.
"""

from __future__ import annotations

import logging
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from flax_ckpt.callbacks import CheckpointCallback
from helpers import assert_bit_exact

BF16 = np.dtype(ml_dtypes.bfloat16)


def layers(n: int, seed: int, dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    return {
        f"layers_{i}": {
            "kernel": rng.standard_normal((8, 8)).astype(dtype),
            "bias": rng.standard_normal(8).astype(dtype),
        }
        for i in range(n)
    }


def model(n: int, seed: int) -> dict:
    return {"params": layers(n, seed), "step": np.int32(7)}


# ------------------------------------------------------------------------------------ missing/unexpected


def test_a_12_layer_checkpoint_into_a_16_layer_model_keeps_the_new_layers(tmp_path):
    fc.save(tmp_path / "small", model(12, 0))
    big = model(16, 1)
    with pytest.raises(fc.StructureMismatchError) as e:  # default: today's behaviour
        fc.restore(tmp_path / "small", big)
    msg = str(e.value)
    assert (
        "In the target but not the checkpoint: 'params/layers_12/bias'" in msg
        and "'params/layers_15/kernel'" in msg
    )
    assert 'missing="keep"' in msg and str(tmp_path / "small") in msg

    out, report = fc.restore(tmp_path / "small", big, missing="keep", report=True)
    new = {f"layers_{i}": big["params"][f"layers_{i}"] for i in range(12, 16)}
    want = {"params": {**model(12, 0)["params"], **new}, "step": np.int32(7)}
    assert_bit_exact(out, want)
    for i in range(12, 16):  # the target's own arrays, no copy
        assert out["params"][f"layers_{i}"]["kernel"] is big["params"][f"layers_{i}"]["kernel"]
    assert report.kept == tuple(f"params/layers_{i}/{k}" for i in range(12, 16) for k in ("bias", "kernel"))
    assert len(report.restored) == 12 * 2 + 1 and "step" in report.restored
    assert report.ignored == report.renamed == report.cast == ()


def test_unexpected_ignore_is_partial(tmp_path):
    fc.save(tmp_path / "big", model(16, 0))
    small = model(12, 1)
    with pytest.raises(fc.StructureMismatchError, match='unexpected="ignore"'):
        fc.restore(tmp_path / "big", small)
    out, report = fc.restore(tmp_path / "big", small, unexpected="ignore", report=True)
    assert_bit_exact(
        out,
        {
            "params": {k: v for k, v in layers(16, 0).items() if int(k.split("_")[1]) < 12},
            "step": np.int32(7),
        },
    )
    assert_bit_exact(fc.restore(tmp_path / "big", small, partial=True), out)  # its older name
    assert len(report.ignored) == 8 and "params/layers_15/kernel" in report.ignored and not report.kept


def test_missing_keep_refuses_an_abstract_target_leaf_and_names_it(tmp_path):
    fc.save(tmp_path / "small", model(2, 0))
    target = model(3, 1)
    target["params"]["layers_2"]["kernel"] = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    with pytest.raises(fc.AbstractTargetLeafError) as e:
        fc.restore(tmp_path / "small", target, missing="keep")
    msg = str(e.value)
    assert "'params/layers_2/kernel' (an abstract ShapeDtypeStruct float32[8,8])" in msg
    assert "'params/layers_2/bias'" not in msg and "jax.eval_shape" in msg
    assert isinstance(e.value, fc.StructureMismatchError)
    donated = jnp.ones(8)
    donated.delete()
    target["params"]["layers_2"] = {"kernel": np.zeros((8, 8), np.float32), "bias": donated}
    with pytest.raises(fc.AbstractTargetLeafError, match="'params/layers_2/bias' \\(a deleted"):
        fc.restore(tmp_path / "small", target, missing="keep")


def test_bad_option_values_are_refused_before_anything_is_read(tmp_path):
    with pytest.raises(ValueError, match="missing='drop': expected \"error\""):
        fc.restore(tmp_path / "nowhere", {}, missing="drop")
    with pytest.raises(ValueError, match="not a regular expression"):
        fc.restore(tmp_path / "nowhere", {}, rename={"(": "x"})
    with pytest.raises(TypeError, match="must be a str or None"):
        fc.restore(tmp_path / "nowhere", {}, rename=[("a", 1)])


# ------------------------------------------------------------------------------------------- rename


def encoder_tree(seed: int = 0) -> dict:
    return {"params": {"encoder": layers(2, seed), "head": {"w": np.ones((8, 3), np.float32)}}}


def test_rename_with_regex_and_none(tmp_path):
    fc.save(tmp_path / "ck", encoder_tree())
    target = {"params": {"backbone": layers(2, 9)}}
    rename = {r"params/encoder/(.*)": r"params/backbone/\1", r"params/head/.*": None}
    out, report = fc.restore(tmp_path / "ck", target, rename=rename, report=True)
    assert_bit_exact(out, {"params": {"backbone": layers(2, 0)}})
    assert ("params/encoder/layers_0/kernel", "params/backbone/layers_0/kernel") in report.renamed
    assert len(report.renamed) == 4 and report.ignored == ("params/head/w",) and not report.kept
    # an ordered list; the first rule that matches wins; a function does the same
    first = [
        (r"params/encoder/layers_0/(.*)", r"params/backbone/layers_0/\1"),
        (r"params/encoder/(.*)", r"params/backbone/\1"),
        (r"params/head/w", None),
    ]
    assert_bit_exact(fc.restore(tmp_path / "ck", target, rename=first), out)
    fn = lambda k: None if k.startswith("params/head") else k.replace("encoder", "backbone")  # noqa: E731
    assert_bit_exact(fc.restore(tmp_path / "ck", target, rename=fn), out)
    # without a target: the renamed tree, nested by the new paths
    plain = fc.restore(tmp_path / "ck", rename=rename)
    assert set(plain["params"]) == {"backbone"} and set(plain["params"]["backbone"]) == {
        "layers_0",
        "layers_1",
    }


def test_errors_name_the_original_and_the_renamed_path(tmp_path):
    fc.save(tmp_path / "ck", encoder_tree())
    target = {"params": {"backbone": layers(2, 9)}}
    target["params"]["backbone"]["layers_1"]["kernel"] = np.zeros((8, 9), np.float32)
    with pytest.raises(fc.LeafMismatchError) as e:
        fc.restore(
            tmp_path / "ck",
            target,
            rename={r"params/encoder/(.*)": r"params/backbone/\1"},
            unexpected="ignore",
        )
    assert (
        "'params/backbone/layers_1/kernel' (renamed from 'params/encoder/layers_1/kernel'): expected "
        "float32[8,9] (target), found float32[8,8]"
    ) in str(e.value)
    with pytest.raises(fc.StructureMismatchError) as e:
        fc.restore(
            tmp_path / "ck",
            {"params": {"backbone": layers(1, 9)}},
            rename={r"params/encoder/(.*)": r"params/backbone/\1"},
        )
    assert "'params/backbone/layers_1/bias' (renamed from 'params/encoder/layers_1/bias')" in str(e.value)


def test_two_checkpoint_keys_renamed_to_one_target_key_is_an_error_naming_both(tmp_path):
    fc.save(tmp_path / "ck", encoder_tree())
    with pytest.raises(fc.RenameCollisionError) as e:
        fc.restore(
            tmp_path / "ck",
            {"params": {"backbone": layers(1, 0)}},
            rename={r"params/encoder/layers_\d/(.*)": r"params/backbone/layers_0/\1"},
        )
    msg = str(e.value)
    assert (
        (
            "'params/encoder/layers_0/bias' and 'params/encoder/layers_1/bias' both to "
            "'params/backbone/layers_0/bias'"
        )
        in msg
        and "kernel" in msg
        and str(tmp_path / "ck") in msg
    )
    with pytest.raises(
        fc.RenameCollisionError,
        match="'params/encoder/layers_0/bias' and 'params/head/w' both to 'params/head/w'",
    ):
        fc.restore(tmp_path / "ck", {}, rename={r"params/encoder/layers_0/bias": "params/head/w"})


def test_a_rule_that_matches_nothing_warns_naming_it(tmp_path):
    fc.save(tmp_path / "ck", encoder_tree())
    target = {"params": {"backbone": layers(2, 9)}}
    rules = [
        (r"encoder/(.*)", r"backbone/\1"),
        (r"params/encoder/(.*)", r"params/backbone/\1"),
        (r"params/head/.*", None),
    ]
    with pytest.warns(
        UserWarning,
        match=r"rename rule 'encoder/\(\.\*\)' -> 'backbone/\\\\1' matched no key path"
        ".*matches part of 'params/encoder",
    ):
        fc.restore(tmp_path / "ck", target, rename=rules)
    with warnings.catch_warnings():  # a strict run: warnings are errors (as this suite runs)
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="matched no key path"):
            fc.restore(tmp_path / "ck", target, rename=rules)


# --------------------------------------------------------------------------------------------- cast


def test_cast_float32_to_bfloat16_and_back_is_numpy_astype(tmp_path):
    rng = np.random.default_rng(3)
    big = (rng.standard_normal((1100, 2048)) * 100).astype(np.float32)  # 9 MB: read in two slabs
    tree = {
        "big": big,
        "small": rng.standard_normal((7, 5)).astype(np.float32),
        "n": np.arange(5, dtype=np.int32),
        "key": jax.random.key(1),
        "count": 3,
    }
    fc.save(tmp_path / "f32", tree)
    target = {
        "big": jnp.zeros(big.shape, jnp.bfloat16),
        "small": np.zeros((7, 5), BF16),
        "n": np.zeros(5, np.int32),
        "key": jax.random.key(0),
        "count": 0,
    }
    with pytest.raises(fc.LeafMismatchError, match="pass cast=True"):
        fc.restore(tmp_path / "f32", target)
    out, report = fc.restore(tmp_path / "f32", target, cast=True, report=True)
    assert out["big"].dtype == jnp.bfloat16 and isinstance(out["small"], np.ndarray)
    np.testing.assert_array_equal(np.asarray(out["big"]).view(np.uint16), big.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(out["small"].view(np.uint16), tree["small"].astype(BF16).view(np.uint16))
    assert_bit_exact({k: out[k] for k in ("n", "key", "count")}, {k: tree[k] for k in ("n", "key", "count")})
    assert report.cast == ("big", "small")

    served = jax.tree.map(np.asarray, {"big": out["big"], "small": out["small"]})
    fc.save(tmp_path / "bf16", served)
    f32 = {"big": np.zeros(big.shape, np.float32), "small": np.zeros((7, 5), np.float32)}
    back = fc.restore(tmp_path / "bf16", f32, cast=True)
    np.testing.assert_array_equal(back["big"], served["big"].astype(np.float32))
    np.testing.assert_array_equal(back["small"], served["small"].astype(np.float32))


def test_cast_of_scalars_and_empty_arrays(tmp_path):
    fc.save(
        tmp_path / "ck",
        {
            "s": np.array(2.5, np.float32),
            "e": np.zeros((0, 4), np.float32),
            "j": jnp.arange(3, dtype=jnp.int8),
        },
    )
    out = fc.restore(
        tmp_path / "ck",
        {
            "s": np.zeros((), np.float64),
            "e": np.zeros((0, 4), BF16),
            "j": jax.ShapeDtypeStruct((3,), jnp.float32),
        },
        cast=True,
    )
    assert (
        out["s"].dtype == np.float64
        and out["s"] == 2.5
        and out["e"].shape == (0, 4)
        and out["e"].dtype == BF16
    )
    assert (
        isinstance(out["j"], jax.Array) and out["j"].dtype == jnp.float32 and out["j"].tolist() == [0, 1, 2]
    )


def test_an_exact_restore_reports_and_logs_nothing_new(tmp_path, caplog):
    fc.save(tmp_path / "ck", model(2, 0))
    with caplog.at_level(logging.INFO, logger="flax_ckpt"):
        out = fc.restore(tmp_path / "ck", model(2, 1))
        again, report = fc.restore(tmp_path / "ck", model(2, 1), report=True)
    assert "restored 5 leaves" not in caplog.text
    assert_bit_exact(out, model(2, 0)) and assert_bit_exact(again, out)
    assert report == fc.RestoreReport(restored=tuple(sorted(report.restored)))
    assert report.summary() == "restored 5 leaves"


def test_cast_into_a_sharded_target(tmp_path):
    x = np.random.default_rng(4).standard_normal((64, 32)).astype(np.float32)
    fc.save(tmp_path / "ck", {"x": x})
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    sharding = NamedSharding(mesh, P("a", "b"))
    target = {"x": jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=sharding)}
    out = fc.restore(tmp_path / "ck", target, cast=True)
    assert out["x"].sharding == sharding and out["x"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["x"]).view(np.uint16), x.astype(BF16).view(np.uint16))


def test_an_integer_cast_that_would_overflow_is_an_error_naming_the_leaf(tmp_path):
    fc.save(
        tmp_path / "ck", {"ids": np.array([1, -5, 1000], np.int64), "ok": np.array([1, -128, 127], np.int64)}
    )
    out = fc.restore(tmp_path / "ck", {"ids": np.zeros(3, np.int16), "ok": np.zeros(3, np.int8)}, cast=True)
    np.testing.assert_array_equal(out["ok"], np.array([1, -128, 127], np.int8))
    with pytest.raises(fc.CastOverflowError) as e:
        fc.restore(tmp_path / "ck", {"ids": np.zeros(3, np.int8), "ok": np.zeros(3, np.int8)}, cast=True)
    msg = str(e.value)
    assert (
        "restore of 'ids': cast=True cannot convert int64 to int8: values in [-5, 1000] lie outside int8's"
        in msg
    )
    assert "Fix:" in msg and isinstance(e.value, fc.LeafMismatchError)
    with pytest.raises(fc.CastOverflowError, match=r"'ids'.*int64 to uint16: values in \[-5, 1000\]"):
        fc.restore(tmp_path / "ck", {"ids": np.zeros(3, np.uint16), "ok": np.zeros(3, np.int16)}, cast=True)


def test_a_float_cast_that_would_overflow_is_an_error(tmp_path):
    fc.save(tmp_path / "ck", {"w": np.array([1.0, 3.4e38, np.inf], np.float32)})
    with pytest.raises(fc.CastOverflowError, match="'w'.*float32 to bfloat16: 1 finite values"):
        fc.restore(tmp_path / "ck", {"w": np.zeros(3, BF16)}, cast=True)
    fc.save(tmp_path / "i", {"w": np.array([1, 70000], np.int32)})
    with pytest.raises(fc.CastOverflowError, match="int32 to float16"):
        fc.restore(tmp_path / "i", {"w": np.zeros(2, np.float16)}, cast=True)


def test_casts_never_go_down_the_chain_nor_touch_keys_or_scalars(tmp_path):
    fc.save(
        tmp_path / "ck",
        {"f": np.ones(3, np.float32), "c": np.ones(2, np.complex64), "k": jax.random.key(0), "s": 1.5},
    )
    target = {
        "f": np.zeros(3, np.int32),
        "c": np.zeros(2, np.float32),
        "k": jax.random.key(0, impl="rbg"),
        "s": 1,
    }
    with pytest.raises(fc.LeafMismatchError) as e:
        fc.restore(tmp_path / "ck", target, cast=True)
    msg = str(e.value)
    assert (
        "'f': expected int32[3] (target), found float32[3] (cast=True does not convert float float32 to "
        "integer int32" in msg
    )
    assert "'c': expected float32[2]" in msg and "complex" in msg
    assert "'k': expected key<rbg>[]" in msg and "'s': expected Python int" in msg
    with pytest.raises(ValueError, match="pass a target"):
        fc.restore(tmp_path / "ck", cast=True)


# ------------------------------------------------------------------------------- manager, callback


def test_manager_restore_takes_the_options(tmp_path, caplog):
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"params": {"encoder": layers(2, 0)}})
        mgr.wait_until_finished()
        target = {"params": {"backbone": layers(2, 5, BF16), "head": {"w": np.full((8, 3), 2.0, np.float32)}}}
        with caplog.at_level(logging.INFO, logger="flax_ckpt"):
            out, report = mgr.restore(
                target=target,
                rename={"params/encoder/(.*)": r"params/backbone/\1"},
                missing="keep",
                cast=True,
                report=True,
            )
    want = jax.tree.map(lambda a: a.astype(BF16), layers(2, 0))
    assert_bit_exact(out["params"]["backbone"], want)
    assert out["params"]["head"]["w"] is target["params"]["head"]["w"]
    assert report.kept == ("params/head/w",) and len(report.cast) == len(report.renamed) == 4
    assert (
        "restored 4 leaves (4 renamed, 4 cast); kept 1 the checkpoint lacks: 'params/head/w'" in caplog.text
    )
    assert mgr.restore_stats[-1].step == 1


def test_manager_with_memory_tiers_restores_a_copy_with_the_options(tmp_path):
    tiers = fc.Tiers(local_dir=str(tmp_path / "shm"), persist_interval_steps=100, cleanup=False)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        mgr.save(1, {"w": np.arange(16, dtype=np.float32), "old": np.ones(3, np.float32)})
        mgr.wait_until_finished()
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        out, report = mgr.restore(
            target={"weights": np.zeros(16, BF16), "new": np.full(2, 5.0)},
            cast=True,
            rename={"w": "weights", "old": None},
            missing="keep",
            report=True,
        )
        assert mgr.restore_stats[-1].tier == "local"
    np.testing.assert_array_equal(out["weights"].astype(np.float32), np.arange(16, dtype=np.float32))
    assert out["weights"].dtype == BF16 and report.ignored == ("old",) and report.kept == ("new",)


def test_restore_or_starts_a_fresh_run_from_a_pretrained_checkpoint_and_resumes_its_own(tmp_path):
    fc.save(tmp_path / "pretrained", {"params": {"encoder": layers(2, 0)}, "step": 90000})
    state = {"params": {"backbone": layers(2, 5), "head": {"w": np.zeros((8, 3), np.float32)}}, "step": 0}
    opts = dict(
        init_from=tmp_path / "pretrained",
        rename={"params/encoder/(.*)": r"params/backbone/\1", "step": None},
        missing="keep",
    )
    ckpt = CheckpointCallback(tmp_path / "run", every_steps=1, preemption_signals=())
    try:
        started, step = ckpt.restore_or(state, **opts)
        assert step == 0 and started["step"] == 0
        assert_bit_exact(started["params"], {"backbone": layers(2, 0), "head": state["params"]["head"]})
        tuned = jax.tree.map(lambda a: a + 1, started)
        ckpt(1, tuned)
    finally:
        ckpt.close()
    ckpt = CheckpointCallback(tmp_path / "run", every_steps=1, preemption_signals=())
    try:
        resumed, step = ckpt.restore_or(state, **opts)  # its own newest step, exactly
    finally:
        ckpt.close()
    assert step == 1
    assert_bit_exact(jax.tree.map(np.asarray, resumed["params"]), tuned["params"])


# -------------------------------------------------------------------------------------------- orbax


def test_an_orbax_checkpoint_restores_with_rename_and_cast(tmp_path):
    fc.save(tmp_path / "ob", encoder_tree(), format="orbax")
    target = {"params": {"backbone": jax.tree.map(lambda a: np.zeros(a.shape, BF16), layers(2, 0))}}
    out, report = fc.restore(
        tmp_path / "ob",
        target,
        rename={r"params/encoder/(.*)": r"params/backbone/\1"},
        unexpected="ignore",
        cast=True,
        report=True,
    )
    want = jax.tree.map(lambda a: a.astype(BF16), layers(2, 0))
    assert_bit_exact(out["params"]["backbone"], want, types=False)
    assert report.ignored == ("params/head/w",) and len(report.cast) == 4
