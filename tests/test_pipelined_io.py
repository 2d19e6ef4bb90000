"""A synchronous save of arrays off the host: transfers started at once, each piece written as it lands.

engine/transfer.py streams the arrays that lie on an accelerator. CI has only CPU devices, whose host
view is free, so these tests treat CPU arrays as if they lay on a device (``_off_host``) and run the
real streamed path: its pieces, batches, files, manifest and commit, restored bit-exact.
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from flax_ckpt._src.engine import transfer
from flax_ckpt._src.storage.local import LocalStorage
from helpers import assert_bit_exact, leaf_chunks


@pytest.fixture
def streaming(monkeypatch):
    """CPU arrays streamed as if they lay on an accelerator, in small batches (several files)."""
    monkeypatch.setattr(transfer, "_off_host", lambda k: True)
    monkeypatch.setattr(transfer, "_BATCH_MIN", 64 << 10)
    monkeypatch.setattr(transfer, "_BATCH_MAX", 64 << 10)
    calls = []
    real = transfer.write_streamed

    def spy(*a, **kw):
        calls.append(kw["tag"])
        return real(*a, **kw)

    monkeypatch.setattr(transfer, "write_streamed", spy)
    import flax_ckpt._src.native.layout as layout_mod

    monkeypatch.setattr(layout_mod, "write_streamed", spy)
    return calls


def _state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((300, 128), dtype=np.float32)),  # 150 KiB: 3 pieces
            "b": jnp.asarray(rng.standard_normal(7).astype(ml_dtypes.bfloat16)),
            "empty": jnp.zeros((0, 3), jnp.float32),
        },
        "opt": {
            "mu": jnp.asarray(rng.standard_normal((64, 64), dtype=np.float32)),
            "count": jnp.asarray(5, jnp.int32),
        },
        "host": np.arange(10, dtype=np.int64),
        "key": jax.random.key(3),
        "step": 7,
    }


def _data_files(path) -> list[str]:
    return sorted(os.listdir(os.path.join(path, "data")))


def test_streamed_save_round_trips_bit_exact(tmp_path, streaming):
    state = _state()
    fc.save(tmp_path / "c", state)
    assert streaming == ["p0"]
    files = _data_files(tmp_path / "c")
    assert "p0.h.0.bin" in files and len(files) >= 4, files  # the host leaf, then batches of pieces
    assert len(leaf_chunks(tmp_path / "c")["params/w"]) == 3  # cut along its first axis, 64 KiB each
    assert_bit_exact(fc.restore(tmp_path / "c", state), state)
    untargeted = fc.restore(tmp_path / "c")
    np.testing.assert_array_equal(untargeted["params"]["w"], np.asarray(state["params"]["w"]))


def test_streamed_save_sharded_over_eight_devices(tmp_path, streaming):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(1)
    layouts = {
        "rows": P("data", None),
        "both": P("data", "model"),
        "replicated": P(),
        "cols": P(None, "model"),
    }
    state = {
        name: jax.device_put(rng.standard_normal((256, 96), dtype=np.float32), NamedSharding(mesh, spec))
        for name, spec in layouts.items()
    }
    fc.save(tmp_path / "c", state)
    assert streaming == ["p0"]
    chunks = leaf_chunks(tmp_path / "c")
    assert len(chunks["replicated"]) == 2  # one writer of the replicated array, cut in two pieces
    assert len(chunks["both"]) == 8  # each of the 8 distinct shards, once
    shardings = {k: v.sharding for k, v in state.items()}
    assert_bit_exact(fc.restore(tmp_path / "c", state), state, shardings)
    other = NamedSharding(mesh, P("model", "data"))  # into another layout: every box read from its chunks
    got = fc.restore(tmp_path / "c", state, shardings=other)
    assert_bit_exact(got, state, {k: other for k in state})


def test_writes_start_before_the_last_transfer_lands(tmp_path, streaming, monkeypatch):
    """The first batch's file is durable while the last piece's transfer is still held back."""
    state = {f"w{i}": jnp.full((128, 128), i, jnp.float32) for i in range(6)}  # 64 KiB each: a batch each
    last = state["w5"]
    written, landed = threading.Event(), []
    real_host, real_write = transfer._host_value, LocalStorage.write

    def host(part):
        if part is last:
            landed.append(written.wait(timeout=120))  # the transfer of w5 lands only once a file is written
        return real_host(part)

    def write(self, name, buffers):
        out = real_write(self, name, buffers)
        if name.startswith("data/"):
            written.set()
        return out

    monkeypatch.setattr(transfer, "_host_value", host)
    monkeypatch.setattr(LocalStorage, "write", write)
    fc.save(tmp_path / "c", state)
    assert landed == [True]
    assert_bit_exact(fc.restore(tmp_path / "c", state), state)


def test_transfers_start_in_order_within_the_window(tmp_path, streaming, monkeypatch):
    """Beyond WINDOW bytes, a transfer starts only once the oldest in flight has landed: they land in
    the order the batches are written, the first soon."""
    state = {f"w{i}": jnp.full((128, 128), i, jnp.float32) for i in range(8)}  # 64 KiB each
    monkeypatch.setattr(transfer, "WINDOW", 3 * (64 << 10))
    names = {id(x): k for k, x in state.items()}
    events, real_host, real_start = [], transfer._host_value, transfer._start

    def start(x):
        events.append(("start", names[id(x)]))
        real_start(x)

    def host(part):
        if threading.current_thread().name == "flax_ckpt-transfer":
            events.append(("landed", names[id(part)]))
        return real_host(part)

    monkeypatch.setattr(transfer, "_start", start)
    monkeypatch.setattr(transfer, "_host_value", host)
    fc.save(tmp_path / "c", state)
    assert [k for e, k in events if e == "start"] == list(state)
    flight = 0
    for e, _ in events:
        flight += 1 if e == "start" else -1
        assert flight <= 3, events
    assert ("landed", "w0") in events and events.index(("landed", "w0")) < events.index(("start", "w3"))
    assert_bit_exact(fc.restore(tmp_path / "c", state), state)


def test_streamed_write_makes_no_host_copy(tmp_path, streaming, monkeypatch):
    """Every buffer handed to storage lies in the host value of the array it comes from."""
    state = {"a": jnp.arange(40000, dtype=jnp.float32), "b": jnp.ones((50, 300), jnp.float32)}
    spans = [(np.asarray(x).ctypes.data, np.asarray(x).ctypes.data + x.nbytes) for x in state.values()]
    seen, real_write = [], LocalStorage.write

    def write(self, name, buffers):
        for b in buffers if name.startswith("data/") else ():
            addr = np.frombuffer(b, np.uint8).ctypes.data if len(memoryview(b)) else None
            if addr is not None:
                seen.append(any(lo <= addr < hi for lo, hi in spans))
        return real_write(self, name, buffers)

    monkeypatch.setattr(LocalStorage, "write", write)
    fc.save(tmp_path / "c", state)
    assert seen and all(seen), seen
    assert_bit_exact(fc.restore(tmp_path / "c", state), state)


@pytest.mark.parametrize("window", [0, 2 * (64 << 10)])  # all at once; two in flight (the feeder thread)
def test_failed_transfer_leaves_nothing_and_raises(tmp_path, streaming, monkeypatch, window):
    monkeypatch.setattr(transfer, "WINDOW", window)
    state = {f"w{i}": jnp.full((128, 128), i, jnp.float32) for i in range(6)}
    real_host = transfer._host_value

    def host(part):
        if part is state["w3"]:
            raise RuntimeError("INTERNAL: transfer failed")
        return real_host(part)

    monkeypatch.setattr(transfer, "_host_value", host)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="transfer failed"):
        fc.save(tmp_path / "c", state)
    assert os.listdir(tmp_path) == []  # the staging folder removed, nothing committed
    assert threading.active_count() <= before
    monkeypatch.setattr(transfer, "_host_value", real_host)
    fc.save(tmp_path / "c", state)  # the same path saves once the transfer works
    assert_bit_exact(fc.restore(tmp_path / "c", state), state)


def test_donated_state_is_a_clear_error(tmp_path, streaming):
    state = {"params": {"w": jnp.ones((8, 8)), "b": jnp.zeros(8)}, "step": 3}
    step = jax.jit(lambda s: jax.tree_util.tree_map(lambda v: v + 1, s), donate_argnums=0)
    step(state)
    with pytest.raises(fc.CheckpointError, match=r"'params/b', 'params/w'.*donated") as info:
        fc.save(tmp_path / "c", state)
    assert "nothing was written" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_manager_without_async_save_streams(tmp_path, streaming):
    state = _state()
    with fc.CheckpointManager(tmp_path / "run", async_save=False, max_to_keep=1) as mgr:
        for step in (1, 2):
            state["opt"]["count"] = jnp.asarray(step, jnp.int32)
            mgr.save(step, state)
        assert mgr.all_steps() == [2]
        assert_bit_exact(mgr.restore(2, state), state)
    assert streaming == ["p0", "p0"]


def test_cpu_arrays_take_the_plain_path(tmp_path):
    """Without an accelerator nothing is streamed: one write of every array, as before."""
    state = _state()
    assert not isinstance(transfer.streamed(state), transfer.Streamed)
    fc.save(tmp_path / "c", state)
    assert _data_files(tmp_path / "c") == ["p0.0.bin"]
    assert_bit_exact(fc.restore(tmp_path / "c", state), state)


def test_pieces_are_cut_at_the_batch_size():
    x = np.zeros((10, 4), np.float32)  # rows of 16 bytes
    pieces = transfer._split(0, x, ((0, 10), (0, 4)), x.nbytes, 48)
    assert [(p.box, p.rows, p.nbytes) for p in pieces] == [
        (((0, 3), (0, 4)), slice(0, 3), 48),
        (((3, 6), (0, 4)), slice(3, 6), 48),
        (((6, 9), (0, 4)), slice(6, 9), 48),
        (((9, 10), (0, 4)), slice(9, 12), 16),
    ]
    assert transfer._batch_bytes(1 << 30) == 32 << 20  # four batches per writer thread
    assert transfer._batch_bytes(1 << 20) == transfer._BATCH_MIN


def test_batches_keep_order_and_size():
    pieces = [transfer.Piece(i, None, (), None, n) for i, n in enumerate([10, 10, 30, 0, 50, 5])]
    got = [[p.leaf for p in b] for b in transfer.batches(pieces, 30)]
    assert got == [[0, 1], [2, 3], [4], [5]]
