"""restore_or(make_state): a resumed run evaluates the function abstractly (no computation, no device
memory) and restores into its shapes, shardings and nnx objects; a fresh run calls it. Bad input: the
function's error, a mismatch, traced values, another topology. And the manager's prefetch of the newest
step's files: what it reads, what it refuses, and that a damaged step still falls back.

Real arrays, real files, real JAX (8 CPU devices, conftest); nothing of the code under test is mocked.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from flax_ckpt._src.native.prefetch import Prefetch
from flax_ckpt.callbacks import CheckpointCallback
from helpers import file_digests


def _same(a: Any, b: Any) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb)
    )


def _linen_maker(ran: list[int]):
    def create() -> train_state.TrainState:
        params = {"w": jax.random.normal(jax.random.key(0), (4, 3)), "b": jnp.zeros(3)}
        jax.debug.callback(lambda: ran.append(1))  # runs only where the function is computed
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))

    return create


@jax.jit
def _linen_step(state: train_state.TrainState) -> train_state.TrainState:
    return state.apply_gradients(grads=jax.tree_util.tree_map(lambda p: p * 0.5 + 1, state.params))


def test_function_is_called_fresh_and_only_traced_on_resume(ckpt_dir):
    ran: list[int] = []
    create = _linen_maker(ran)
    with CheckpointCallback(ckpt_dir, every_steps=2, compile_cache=False) as ckpt:
        state, start = ckpt.restore_or(create)
        jax.effects_barrier()
        assert (start, len(ran)) == (0, 1) and isinstance(state.params["w"], jax.Array)
        for step in range(start, 4):
            state = _linen_step(state)
            ckpt(step + 1, state)
    with CheckpointCallback(ckpt_dir, every_steps=2, compile_cache=False) as ckpt:
        resumed, start = ckpt.restore_or(create)
        jax.effects_barrier()
    assert start == 4 and len(ran) == 1  # traced, never computed
    assert _same(resumed, state) and resumed.tx is not None
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(resumed))
    with CheckpointCallback(ckpt_dir, every_steps=2, compile_cache=False) as ckpt:
        as_state, _ = ckpt.restore_or(create())  # the state form gives the same
    assert _same(as_state, resumed)
    assert [(x.dtype, x.weak_type) for x in jax.tree_util.tree_leaves(as_state)] == [
        (x.dtype, x.weak_type) for x in jax.tree_util.tree_leaves(resumed)
    ]


class _Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a, self.b = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.b(nnx.relu(self.a(x)))


class _Batches:
    """A stateful iterator (grain's get_state/set_state protocol) over batches made from its position."""

    def __init__(self) -> None:
        self.i = 0

    def __next__(self) -> np.ndarray:
        self.i += 1
        return np.full((2, 4), self.i / 10, np.float32)

    def get_state(self) -> dict[str, int]:
        return {"i": self.i}

    def set_state(self, state: dict[str, Any]) -> None:
        self.i = int(state["i"])


def _make_nnx() -> dict[str, Any]:
    model = _Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return {"model": model, "optimizer": optimizer, "data": _Batches(), "rng": random.Random(3)}


@nnx.jit
def _nnx_step(model: _Model, optimizer: nnx.Optimizer, x: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


def _train(ckpt: CheckpointCallback | None, st: dict[str, Any], start: int, stop: int) -> list[Any]:
    out = []
    for step in range(start, stop):
        loss = _nnx_step(st["model"], st["optimizer"], jnp.asarray(next(st["data"])))
        out.append((np.asarray(loss).tobytes(), st["rng"].random()))
        if ckpt is not None:
            ckpt(step + 1, st)
    return out


def test_nnx_function_resumes_into_real_objects_as_an_uninterrupted_run(ckpt_dir):
    whole = _train(None, _make_nnx(), 0, 6)
    with CheckpointCallback(ckpt_dir, every_steps=3, compile_cache=False) as ckpt:
        st, start = ckpt.restore_or(_make_nnx)
        first = _train(ckpt, st, start, 3)
    with CheckpointCallback(ckpt_dir, every_steps=3, compile_cache=False) as ckpt:
        st, start = ckpt.restore_or(_make_nnx)
        assert start == 3 and st["data"].i == 3
        kernel = st["model"].a.kernel.get_value()
        assert isinstance(kernel, jax.Array) and not isinstance(kernel, jax.core.Tracer)
        second = _train(ckpt, st, start, 6)
    assert first + second == whole


def test_function_restores_into_its_shardings_and_reshards_another_topology(ckpt_dir):
    eight = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
    two = NamedSharding(jax.make_mesh((2,), ("d",), devices=jax.devices()[:2]), P(None, "d"))
    values = np.arange(32, dtype=np.float32).reshape(8, 4)
    with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
        replicated = NamedSharding(eight.mesh, P())
        ckpt(1, {"a": jax.device_put(values, eight), "b": jax.device_put(values[:, 0], replicated)})

    def make() -> dict[str, jax.Array]:
        a = jax.jit(lambda: jnp.zeros((8, 4)), out_shardings=two)()
        return {"a": a, "b": jax.device_put(jnp.zeros(8), eight)}

    with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
        st, start = ckpt.restore_or(make)
    assert start == 1
    assert st["a"].sharding == two and st["b"].sharding == eight  # the function's, not the saved ones
    assert np.array_equal(np.asarray(st["a"]), values) and np.array_equal(np.asarray(st["b"]), values[:, 0])


def _saved_run(ckpt_dir: Any) -> dict[str, str]:
    with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
        ckpt(1, {"w": jnp.ones((2, 3)), "n": jnp.int32(7)})
    return file_digests(ckpt_dir)


def test_a_function_that_raises_raises_and_touches_nothing(ckpt_dir):
    before = _saved_run(ckpt_dir)

    def broken() -> dict[str, Any]:
        raise RuntimeError("no such dataset")

    with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
        with pytest.raises(RuntimeError, match="no such dataset"):
            ckpt.restore_or(broken)
    assert file_digests(ckpt_dir) == before


@pytest.mark.parametrize(
    "other, said",
    [({"w": (3, 3)}, "float32[3,3]"), ({"w": (2, 3), "extra": (2,)}, "extra")],
    ids=["shape", "structure"],
)
def test_a_function_of_other_shapes_gives_the_error_of_a_state(ckpt_dir, other, said):
    before = _saved_run(ckpt_dir)

    def make() -> dict[str, Any]:
        return {"n": jnp.int32(0), **{k: jnp.zeros(shape) for k, shape in other.items()}}

    with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
        with pytest.raises(fc.TargetMismatchError) as as_fn:
            ckpt.restore_or(make)
        with pytest.raises(fc.TargetMismatchError) as as_state:
            ckpt.restore_or(make())
    assert type(as_fn.value) is type(as_state.value) and str(as_fn.value) == str(as_state.value)
    assert said in str(as_fn.value)
    assert file_digests(ckpt_dir) == before


def test_missing_keep_calls_the_function_so_new_leaves_have_values(ckpt_dir):
    _saved_run(ckpt_dir)

    def more() -> dict[str, Any]:
        return {"w": jnp.zeros((2, 3)), "n": jnp.int32(0), "head": jnp.full(2, 5.0)}

    with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
        st, start = ckpt.restore_or(more, missing="keep")
    assert start == 1 and np.array_equal(st["head"], [5.0, 5.0]) and np.array_equal(st["w"], np.ones((2, 3)))


def test_a_function_that_needs_values_is_called_with_a_warning(ckpt_dir, caplog):
    _saved_run(ckpt_dir)

    def reads_values() -> dict[str, Any]:
        w = jnp.zeros((2, 3))
        scale = float(w.sum()) + 1  # a value: cannot be traced
        return {"w": w * scale, "n": jnp.int32(0)}

    with caplog.at_level(logging.WARNING, "flax_ckpt.callbacks"):
        with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
            st, start = ckpt.restore_or(reads_values)
    assert start == 1 and np.array_equal(st["w"], np.ones((2, 3))) and int(st["n"]) == 7
    assert "needs the value of an array" in caplog.text


def test_traced_values_are_refused_before_anything_is_read(ckpt_dir):
    before = _saved_run(ckpt_dir)
    with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:
        for form in (lambda x: {"w": x, "n": jnp.int32(0)}, lambda x: lambda: {"w": x, "n": jnp.int32(0)}):
            with pytest.raises(fc.InvalidArgumentError, match="outside it"):
                jax.jit(lambda x, form=form: ckpt.restore_or(form(x))[0]["w"])(jnp.zeros((2, 3)))
    assert file_digests(ckpt_dir) == before


# ------------------------------------------------------------------------------------------ prefetch


def test_prefetch_reads_the_newest_step_and_nothing_outside_it(ckpt_dir, tmp_path):
    # several processes warm the page cache (each its own files): the read of one of two processes here
    outside = tmp_path / "secret"
    outside.write_bytes(b"x" * 1000)
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"w": np.zeros(1000, np.float32)})
        mgr.save(2, {"w": np.ones(1000, np.float32)})
    step = ckpt_dir / "2"
    stored = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    os.symlink(outside, step / "data" / "link.bin")
    os.mkfifo(step / "data" / "fifo.bin")  # a read of it would block forever
    read = Prefetch(2, str(step), 1 << 30, process=0, processes=2)
    assert read.done.wait(60) and read.nbytes == stored  # every file of the step, no link, no FIFO
    read = Prefetch(2, str(step), 100, process=0, processes=2)
    assert read.done.wait(60) and read.nbytes == 100


def _rchar() -> int:
    """Bytes this process has read through read system calls (any file, page cache or not)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


needs_io = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="no /proc/self/io to count reads")
_BIG = 2 << 20  # float32 elements: 8 MiB


def _prefetched(ckpt_dir: Any, **kw: Any) -> fc.CheckpointManager:
    mgr = fc.CheckpointManager(ckpt_dir)
    assert mgr.prefetch(**kw) == 2
    assert mgr._prefetch is not None and mgr._prefetch.done.wait(60)
    return mgr


@needs_io
def test_a_restore_after_the_prefetch_reads_no_data_again_and_is_exact(ckpt_dir):
    rng = np.random.default_rng(0)
    saved = {
        "big": rng.standard_normal(_BIG).astype(np.float32),
        "small": [rng.integers(0, 1 << 30, i + 1).astype(np.int32) for i in range(20)],
        "key": jax.random.key(5),
        "n": 7,
    }
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {**saved, "big": np.zeros(_BIG, np.float32)})
        mgr.save(2, saved)
    target = {**jax.tree_util.tree_map(jnp.asarray, {**saved, "n": 0}), "n": 0}
    for restore in (lambda m: m.restore(target=target), lambda m: m.restore()):  # jax arrays, numpy
        with _prefetched(ckpt_dir) as mgr:
            before = _rchar()
            out = restore(mgr)
            assert _rchar() - before < _BIG  # the manifest: no data file read again
            assert mgr._prefetch.nbytes == 0  # the buffers went to the restore
        assert np.asarray(out["big"]).tobytes() == saved["big"].tobytes() and out["n"] == 7
        assert all(np.array_equal(a, b) for a, b in zip(out["small"], saved["small"]))
        assert np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(saved["key"]))
    with fc.CheckpointManager(ckpt_dir) as mgr:  # a restore while the read runs: it stops, the rest is read
        assert mgr.prefetch() == 2
        assert np.asarray(mgr.restore(target=target)["big"]).tobytes() == saved["big"].tobytes()


@needs_io
def test_a_file_changed_after_the_prefetch_is_read_again(ckpt_dir, caplog):
    w = np.arange(_BIG, dtype=np.float32)
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"w": np.zeros(_BIG, np.float32)})
        mgr.save(2, {"w": w})
    (data,) = (ckpt_dir / "2" / "data").iterdir()
    with _prefetched(ckpt_dir) as mgr:  # the same bytes written again: read again, as they are now
        data.write_bytes(data.read_bytes())
        before = _rchar()
        assert mgr.restore()["w"].tobytes() == w.tobytes() and _rchar() - before >= w.nbytes
    with _prefetched(ckpt_dir) as mgr:  # damaged after the prefetch verified it: found, never served
        raw = bytearray(data.read_bytes())
        raw[10] ^= 1
        data.write_bytes(bytes(raw))
        with caplog.at_level(logging.WARNING, "flax_ckpt"):
            assert not mgr.restore()["w"].any()  # step 1's zeros
        assert "falling back" in caplog.text


@needs_io
def test_the_prefetch_holds_at_most_its_limit_and_close_frees_it(ckpt_dir):
    saved = {"a": np.full(_BIG, 1, np.float32), "b": np.full(_BIG, 2, np.float32)}
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, saved)
        mgr.save(2, saved)
    with _prefetched(ckpt_dir, limit=6 * _BIG) as mgr:  # bytes: room for one leaf of two
        assert mgr._prefetch.nbytes == 4 * _BIG
        before = _rchar()
        out = mgr.restore()
        assert 4 * _BIG <= _rchar() - before < 5 * _BIG  # the other leaf alone was read
        assert all(np.array_equal(out[k], v) for k, v in saved.items())
    mgr = _prefetched(ckpt_dir)
    buffers = [weakref.ref(b) for _, b in mgr._prefetch._held.values()]
    assert len(buffers) == 2 and mgr._prefetch.nbytes == 8 * _BIG
    mgr.close()  # no restore came: what the prefetch holds is freed
    gc.collect()
    assert all(b() is None for b in buffers)
    with _prefetched(ckpt_dir) as mgr:  # a run that saves instead of restoring frees them too
        buffers = [weakref.ref(b) for _, b in mgr._prefetch._held.values()]
        assert len(buffers) == 2 and mgr.save(3, saved)
        gc.collect()
        assert all(b() is None for b in buffers)


def test_prefetch_of_a_damaged_step_costs_only_the_read(ckpt_dir, caplog):
    with fc.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, {"w": np.zeros(1000, np.float32)})
        mgr.save(2, {"w": np.ones(1000, np.float32)})
    (data,) = (ckpt_dir / "2" / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[10] ^= 1
    data.write_bytes(bytes(raw))
    before = file_digests(ckpt_dir)
    with caplog.at_level(logging.WARNING, "flax_ckpt"):
        with CheckpointCallback(ckpt_dir, every_steps=1, compile_cache=False) as ckpt:  # prefetches step 2
            st, start = ckpt.restore_or(lambda: {"w": jnp.zeros(1000)})
    assert start == 1 and np.array_equal(st["w"], np.zeros(1000)) and "falling back" in caplog.text
    assert file_digests(ckpt_dir) == before
