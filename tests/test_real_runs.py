"""What real training programs hit (issue 18): pmap metrics, the last steps of a run, the step's type
and weak type after a resume, an honest verify, and the smaller things a new user trips over."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import train_state

import flax_ckpt as fc
import forkserver
from flax_ckpt.callbacks import CheckpointCallback
from helpers import TESTS, assert_bit_exact, worker_env
from test_cli import run, run_json
from trees import train_state_tree

ROOT = os.path.dirname(TESTS)


# ------------------------------------------------------------------------------------------- metrics


def test_pmap_metrics_of_one_element_are_stored_as_numbers(ckpt_dir):
    loss = jax.pmap(lambda x: x.mean(), devices=jax.devices()[:1])(jnp.arange(6.0).reshape(1, 6))
    assert loss.shape == (1,)
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"w": jnp.ones(3)}, metrics={"loss": loss, "acc": np.float32(0.5), "n": np.array([[3]])})
        mgr.wait_until_finished()
        assert mgr.metrics(1) == {"loss": 2.5, "acc": 0.5, "n": 3}
        many = jax.pmap(lambda x: x.mean())(jnp.ones((8, 2)))  # one value per device: not a scalar
        with pytest.raises(fc.CheckpointError, match=r"metrics 'eval/loss': a jax.Array of shape \(8,\)"):
            mgr.save(2, {"w": jnp.ones(3)}, metrics={"eval": {"loss": many}})
        assert mgr.all_steps() == [1]  # nothing was written for step 2


# ------------------------------------------------------------------------------------ the last steps


def counted(step: int) -> dict:
    return {"w": jnp.full((3,), float(step)), "step": jnp.int32(step)}


def test_close_saves_the_last_step_of_a_run_off_schedule(ckpt_dir):
    with CheckpointCallback(ckpt_dir, every_steps=4, preemption_signals=()) as ckpt:
        state, start = ckpt.restore_or(counted(0))
        assert start == 0
        for step in range(start, 10):
            state = counted(step + 1)
            ckpt(step + 1, state)
        ckpt.manager.wait_until_finished()
        assert ckpt.manager.all_steps() == [4, 8]
    with CheckpointCallback(ckpt_dir, every_steps=4, preemption_signals=()) as again:
        restored, start = again.restore_or(counted(0))
        assert start == 10
        assert_bit_exact(restored, counted(10))


def test_finish_saves_an_explicit_final_state_and_waits(ckpt_dir):
    with CheckpointCallback(ckpt_dir, every_steps=100, preemption_signals=()) as ckpt:
        ckpt(1, counted(1))
        assert ckpt.finish(7, counted(7)) is True  # off schedule, durable on return
        assert ckpt.manager.all_steps() == [7] and (ckpt_dir / "7" / "manifest.json").exists()
        assert ckpt.finish(7, counted(7)) is False  # saved already: never overwritten


def test_close_skips_a_donated_last_state_with_a_warning(ckpt_dir, caplog):
    step_fn = jax.jit(lambda s: {"w": s["w"] + 1, "step": s["step"] + 1}, donate_argnums=0)
    ckpt = CheckpointCallback(ckpt_dir, every_steps=100, preemption_signals=())
    state = counted(0)
    for step in range(3):
        ckpt(step + 1, state)
        state = step_fn(state)  # donates what the callback was given
    with caplog.at_level(logging.WARNING, logger="flax_ckpt.callbacks"):
        ckpt.close()  # no exception: the arrays of step 3 are gone
    assert any("not saving step 3 at close" in r.message and "finish" in r.message for r in caplog.records)
    with fc.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.all_steps() == []


# ------------------------------------------------------------------------------ step type after resume


def _train(state):
    grads = jax.tree.map(jnp.zeros_like, state.params)
    return state.apply_gradients(grads=grads)


def test_resume_keeps_the_step_weak_typed_so_the_next_jitted_step_does_not_compile_again(ckpt_dir):
    step_fn = jax.jit(_train)
    fresh = train_state_tree()  # as a restarted program builds it: step is the Python int 0
    trained = step_fn(step_fn(fresh))
    assert trained.step.weak_type and step_fn._cache_size() == 2  # Python-int step, then the weak array
    with CheckpointCallback(ckpt_dir, every_steps=1, preemption_signals=()) as ckpt:
        ckpt(2, trained)
    with CheckpointCallback(ckpt_dir, every_steps=1, preemption_signals=()) as again:
        resumed, start = again.restore_or(fresh)
    assert start == 2 and int(resumed.step) == 2
    assert resumed.step.dtype == trained.step.dtype and resumed.step.weak_type == trained.step.weak_type
    assert all(not x.committed for x in jax.tree.leaves(resumed))  # placed as jit's own outputs are
    step_fn(resumed)
    assert step_fn._cache_size() == 2  # the executable of the uninterrupted run: no compile


def test_readme_abstract_target_recipe_works_on_a_fresh_train_state(tmp_path):
    trained = jax.jit(_train)(train_state_tree())
    fc.save(tmp_path / "ts", trained)
    state = train_state_tree()  # step is the Python int 0 here
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
        jax.eval_shape(lambda: state),
    )  # the README's recipe
    out = fc.restore(tmp_path / "ts", abstract)
    assert isinstance(out, train_state.TrainState) and out.step.weak_type and int(out.step) == 1
    assert_bit_exact(jax.tree.leaves(out.params), jax.tree.leaves(trained.params))
    assert type(fc.restore(tmp_path / "ts", state).step) is int  # a Python-int target gets a Python int


# ------------------------------------------------------------------------------------------- verify


def test_verify_never_says_ok_for_orbax_data_without_checksums(tmp_path):
    """verify says UNVERIFIED for Orbax data (no checksums), fails with --strict, and names a flipped byte
    it can detect. Slow (seconds): each verify is a CLI process."""
    ocp = pytest.importorskip("orbax.checkpoint")
    ob = tmp_path / "real"
    rng = np.random.default_rng(0)
    with ocp.StandardCheckpointer() as c:
        c.save(ob, {"w": rng.standard_normal((64, 64)).astype(np.float32), "b": np.ones(3, np.float32)})
    clean = run("verify", str(ob))
    assert clean.returncode == 0 and clean.stdout.startswith("UNVERIFIED") and "of 2 leaves" in clean.stdout
    assert run("verify", str(ob), "--strict").returncode == 3
    data = sorted(
        (os.path.join(d, f) for d, _, fs in os.walk(ob) if os.path.basename(d) == "d" for f in fs),
        key=os.path.getsize,
    )[-1]
    raw = bytearray(open(data, "rb").read())
    raw[len(raw) // 2] ^= 0x01
    open(data, "wb").write(bytes(raw))
    flipped = run("verify", str(ob))
    assert not flipped.stdout.startswith("OK"), flipped.stdout  # damaged, or at least unverified
    assert run("verify", str(ob), "--strict").returncode != 0


def test_verify_of_a_run_directory_checks_every_step(tmp_path):
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full(64, float(step), np.float32)})
    victim = next((tmp_path / "run" / "2" / "data").iterdir())
    raw = bytearray(victim.read_bytes())
    raw[5] ^= 0x01
    victim.write_bytes(bytes(raw))
    r = run("verify", str(tmp_path / "run"))
    assert r.returncode == 1 and "DAMAGED" in r.stdout and "/2" in r.stdout, r.stdout
    doc = run_json("verify", str(tmp_path / "run"), expect=1)
    assert doc["steps"] is not None and len(doc["steps"]) == 3


# ------------------------------------------------------------------------------------------- smaller


def test_a_generator_leaf_is_refused_naming_the_get_state_protocol(tmp_path):
    with pytest.raises(fc.UnsupportedLeafError, match=r"get_state\(\)/set_state\(\)"):
        fc.save(tmp_path / "g", {"w": np.ones(2), "batches": (i for i in range(3))})
    assert not (tmp_path / "g").exists()


def test_convert_to_safetensors_says_how_many_leaves_it_left_out(tmp_path):
    fc.save(
        tmp_path / "ck",
        {"params": {"w": np.ones(3, np.float32)}, "opt": {"count": 3}, "rng": jax.random.key(0)},
    )
    r = run("convert", str(tmp_path / "ck"), str(tmp_path / "m.safetensors"), "--subtree", "")
    assert r.returncode == 0 and "left out 2 leaves" in r.stdout, r.stdout


def test_progress_bars_only_on_a_terminal_or_when_asked(tmp_path):
    fc.save(tmp_path / "ck", {"w": np.ones(1000, np.float32)})
    assert run("verify", str(tmp_path / "ck")).stderr == ""  # stderr is a pipe here
    assert "verify" in run("verify", str(tmp_path / "ck"), "--progress").stderr


def test_resumed_line_is_visible_without_logging_set_up(tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np
        from flax_ckpt.callbacks import CheckpointCallback
        for _ in range(2):
            with CheckpointCallback({str(tmp_path / "run")!r}, every_steps=1, preemption_signals=()) as ckpt:
                state, start = ckpt.restore_or({{"w": np.zeros(2)}})
                ckpt(start + 1, {{"w": np.ones(2)}})
    """)
    r = forkserver.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=worker_env(1),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "no checkpoint in" in r.stderr and f"resumed from step 1 of {tmp_path / 'run'}" in r.stderr, (
        r.stderr
    )


AT_EXIT_CHILD = textwrap.dedent("""
    import logging, sys
    import jax.numpy as jnp
    from flax_ckpt.callbacks import CheckpointCallback

    directory, steps = sys.argv[1], int(sys.argv[2])
    if "--log" in sys.argv:
        logging.basicConfig(level=logging.INFO)
    ckpt = CheckpointCallback(directory, every_steps=10)
    state, start = ckpt.restore_or({"w": jnp.zeros(3)})
    for step in range(start, steps):
        state = {"w": state["w"] + 1}
        ckpt(step + 1, state)
    print("done", flush=True)  # no close(): the callback is closed at interpreter exit
""")


def test_an_open_callback_saves_its_last_step_at_interpreter_exit(tmp_path):
    """A callback left open saves its last step when the interpreter exits, and the next run resumes from
    it. Slow (seconds): real interpreters, since what is tested is their exit."""
    script, directory = tmp_path / "child.py", tmp_path / "ckpts"
    script.write_text(AT_EXIT_CHILD)

    def child(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run(  # a real interpreter's exit, not a forked child's
            [sys.executable, str(script), str(directory), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            env=worker_env(1),
        )
        assert r.returncode == 0 and "done" in r.stdout, r.stderr
        return r

    first = child("7")
    assert f"saved the last step 7 in {directory} at close" in first.stderr, first.stderr
    second = child("12")
    assert second.stderr.count(f"resumed from step 7 of {directory}") == 1, second.stderr
    third = child("12", "--log")  # with logging set up: through the callbacks logger, once
    assert third.stderr.count("resumed from step 12 of") == 1
    assert f"INFO:flax_ckpt.callbacks:resumed from step 12 of {directory}" in third.stderr, third.stderr
    with fc.CheckpointManager(directory) as mgr:
        assert mgr.all_steps() == [7, 10, 12]
        assert np.asarray(mgr.restore(12)["w"]).tolist() == [12.0] * 3


def test_restore_keeps_the_target_leaf_type_and_weak_type(tmp_path):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    weak = jax.jit(lambda n: n + 1)(3)  # a Python int through jit: a weak-typed int32
    assert weak.weak_type
    fc.save(
        tmp_path / "c",
        {"step": weak, "count": jnp.int32(9), "lr": np.float32(0.5), "scale": jnp.asarray(1.5)},
    )
    out = fc.restore(tmp_path / "c", {"step": 0, "count": 0, "lr": 0.0, "scale": 0.0})
    assert (type(out["step"]), out["step"], type(out["count"]), type(out["lr"])) == (int, 4, int, float)
    replicated = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), P())
    abstract = jax.eval_shape(lambda: {"step": 0, "count": jnp.int32(0), "scale": 0.0})
    got = fc.restore(tmp_path / "c", {**abstract, "lr": 0.0}, shardings=replicated)
    assert got["step"].weak_type and got["step"].dtype == jnp.int32 and int(got["step"]) == 4
    assert got["step"].sharding == replicated and got["scale"].weak_type and float(got["scale"]) == 1.5
    assert not got["count"].weak_type and type(got["lr"]) is float
    assert type(fc.restore(tmp_path / "c", {**abstract, "lr": np.float32(0)})["lr"]) is np.float32
    strong = fc.restore(tmp_path / "c", {"step": jnp.int32(0), "count": weak, "lr": 0.0, "scale": 0.0})
    assert not strong["step"].weak_type and strong["count"].weak_type  # the target's, not the saved one's


def test_which_zarr_codecs_checksum_the_data(tmp_path):
    import tensorstore as ts

    from flax_ckpt._src.orbax.read import data_checksummed

    made = []

    def metadata(codecs, driver="zarr3"):
        made.append(tmp_path / f"a{len(made)}")
        spec = {
            "driver": driver,
            "kvstore": {"driver": "file", "path": str(made[-1])},
            "metadata": {"shape": [4], "data_type": "uint8", "codecs": codecs}
            if driver == "zarr3"
            else {"shape": [4], "dtype": "|u1", "compressor": {"id": "zstd", "level": 1}},
        }
        return ts.open(spec, create=True).result().spec().to_json()["metadata"]

    assert data_checksummed(metadata([{"name": "bytes"}, {"name": "crc32c"}]))
    assert not data_checksummed(
        metadata([{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 1}}])
    )
    inner = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": [2],
            "codecs": [{"name": "bytes"}],
            "index_codecs": [{"name": "bytes"}, {"name": "crc32c"}],
        },
    }
    assert not data_checksummed(metadata([inner]))  # Orbax's zarr3: only the shard index is checksummed
    inner["configuration"]["codecs"].append({"name": "crc32c"})
    assert data_checksummed(metadata([inner]))
    assert not data_checksummed(metadata([], driver="zarr"))
