"""A save decides on the device which shards are unchanged since the last save, and brings to host only
the others (engine/device_hash.py): the keyed hash sees every change that defeats a plain sum, an XOR,
a multiplication modulo 2^32 or a crc32c; it runs without a temporary of the shard's size; and a
manager's steps refer to the earlier bytes as when the host decides, restored bit-exact.

On this machine the shards lie on CPU devices: ``FLAX_CKPT_DEVICE_SNAPSHOT=always`` copies them on
their devices and the private switch ``_FLAX_CKPT_DEVICE_HASH=cpu`` hashes them there, as on an
accelerator. A transfer to host is counted where it happens (engine/device.py ``to_host``).
"""

from __future__ import annotations

import json
import os

import crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.engine import device, device_hash
from test_shared_in_memory import looked  # noqa: F401  (a fixture)
from test_shared_steps import _forge

MiB = 1 << 20


def _digest(a: np.ndarray) -> list[int]:
    (d,) = device_hash.digests([jnp.asarray(a)])
    assert d is not None, "a small shard's hash fits in memory"
    return d.tolist()


def _words(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32)


def _forgeries() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(what, original, changed): each change defeats some plain checksum (asserted by the test)."""
    w = _words(1 << 16)
    out = []
    c = w.copy()
    c[10] += np.uint32(1)
    c[40000] -= np.uint32(1)
    out.append(("cancel in a sum", w, c))
    c = w.copy()
    c[[5, 60000]] = c[[60000, 5]]
    out.append(("a swap of two words", w, c))
    c = w.copy()
    c[123] ^= np.uint32(1 << 31)
    out.append(("2^31 in one word", w, c))
    c = w.copy()
    c[7] ^= np.uint32(0xF0F0)
    c[9] ^= np.uint32(0xF0F0)
    out.append(("cancel in an XOR", w, c))
    b = np.random.default_rng(1).standard_normal(1 << 16).astype(ml_dtypes.bfloat16)
    c = b.copy()
    c.view(np.uint16)[31000] ^= 1
    out.append(("one bit of one bfloat16", b, c))
    u = np.random.default_rng(2).integers(0, 255, (1 << 17) + 3, dtype=np.uint8)
    c = u.copy()
    c[-1] ^= 0x80
    out.append(("the last byte", u, c))
    out.append(("equal crc32c", u, _forge(u, 1000, 70000)))
    return out


def test_the_hash_sees_every_change_that_defeats_a_sum_an_xor_a_product_or_a_crc():
    defeated = set()
    for what, a, b in _forgeries():
        wa, wb = a.view(np.uint8), b.view(np.uint8)
        u32 = lambda x: x[: len(x) // 4 * 4].view(np.uint32).astype(np.uint64)  # noqa: E731
        if u32(wa).sum() % 2**32 == u32(wb).sum() % 2**32:
            defeated.add("sum")
        if np.bitwise_xor.reduce(u32(wa)) == np.bitwise_xor.reduce(u32(wb)):
            defeated.add("xor")
        k = np.uint64(2**31)  # a product modulo 2^32 by an even key loses the top bit
        if (u32(wa) * k % 2**32).sum() % 2**32 == (u32(wb) * k % 2**32).sum() % 2**32:
            defeated.add("product mod 2^32")
        if crc32c.crc32c(wa.tobytes()) == crc32c.crc32c(wb.tobytes()):
            defeated.add("crc32c")
        assert _digest(a) != _digest(b), what
        assert _digest(a) == _digest(a.copy()), what
    assert defeated == {"sum", "xor", "product mod 2^32", "crc32c"}


def test_the_hash_needs_no_temporary_of_the_shard_s_size():
    d = jax.devices()[0]
    t1, t2 = device_hash._key().tables(d)
    for x in (jnp.zeros(16 * MiB, jnp.bfloat16), jnp.zeros((1024 + 3, 1024), jnp.float32)):
        stats = jax.jit(device_hash._digest).lower(x, t1, t2).compile().memory_analysis()
        assert stats is not None and stats.temp_size_in_bytes < x.nbytes // 100
        assert device_hash._program(x, d, t1, t2) is not None


def test_a_shard_whose_hash_would_need_memory_is_brought_to_host(tmp_path, on_device, monkeypatch):
    monkeypatch.setattr(device_hash, "_compiled", {})
    monkeypatch.setattr(device_hash, "_temp_bytes", lambda compiled: 1 << 40)  # as XLA might say
    base = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    with fc.CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, {"base": jnp.asarray(base)})
            mgr.wait_until_finished()
        np.testing.assert_array_equal(mgr.restore(2)["base"], base)
    assert on_device == [base.nbytes] * 3


def test_the_key_is_secret_and_drawn_per_process():
    key = device_hash._key()
    assert "secret" in repr(key) and str(key._rs[0][0]) not in repr(key)
    assert all(0 <= r < device_hash.P and 0 <= s < device_hash.P for r, s in key._rs)
    assert len({r for r, _ in key._rs}) == device_hash.LANES  # independent lanes


@pytest.fixture
def on_device(monkeypatch) -> list[int]:
    """Shards copied and hashed on their (CPU) devices; the bytes of each save's transfers to host."""
    monkeypatch.setenv("FLAX_CKPT_DEVICE_SNAPSHOT", "always")
    monkeypatch.setenv("_FLAX_CKPT_DEVICE_HASH", "cpu")
    moved: list[int] = []
    real = device.to_host

    def counted(pending, hurry=None):
        moved.append(sum(p.nbytes for p in pending))
        return real(pending, hurry)

    monkeypatch.setattr(device, "to_host", counted)
    return moved


def _state(base: np.ndarray, half: np.ndarray, step: int) -> dict:
    """New jax.Arrays at every step (as a jitted step returns them): a frozen base, a frozen bfloat16
    matrix, 256 KiB that change and a small leaf."""
    lora = np.random.default_rng(100 + step).standard_normal((256, 256)).astype(np.float32)
    return {
        "base": jnp.asarray(base),
        "half": jnp.asarray(half),
        "lora": jnp.asarray(lora),
        "n": jnp.asarray(step),
    }


def _files(step_dir) -> dict[str, str]:
    body = json.load(open(step_dir / "manifest.json"))["body"]
    return {leaf["path"][0][1]: leaf["chunks"][0]["file"] for leaf in body["leaves"] if "chunks" in leaf}


def test_unchanged_leaves_never_cross_to_host_and_steps_refer_to_their_bytes(tmp_path, on_device, looked):
    rng = np.random.default_rng(0)
    base = rng.standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    half = rng.standard_normal((512, 1024)).astype(ml_dtypes.bfloat16)  # 1 MiB
    lora = 256 * 256 * 4
    saved = {}
    with fc.CheckpointManager(tmp_path, max_to_keep=2) as mgr:
        for step in range(5):
            if step == 3:  # one bit of one bfloat16 element
                half = half.copy()
                half.view(np.uint16)[300, 700] ^= 1
            state = _state(base, half, step)
            looked.clear()
            mgr.save(step, state)
            mgr.wait_until_finished()
            saved[step] = {k: np.asarray(v) for k, v in state.items()}
            if step in (1, 2, 4):  # the base and the bfloat16 matrix stay on their devices
                assert on_device[-1] == lora + 4, step
                assert looked == []  # shared as the step that wrote them, neither hashed nor read
            if step == 3:
                assert on_device[-1] == lora + half.nbytes + 4
        assert _files(tmp_path / "4")["base"] == "../0/data/p0.0.bin"
        assert _files(tmp_path / "3")["half"].startswith("data/")  # the changed bit: written
        assert _files(tmp_path / "4")["half"].startswith("../3/")
        assert any(n.startswith("0.held-") for n in os.listdir(tmp_path))  # kept by reference
        for step in mgr.all_steps():
            got = mgr.restore(step)
            for k, want in saved[step].items():
                assert np.asarray(got[k]).tobytes() == want.tobytes(), (step, k)
    # a new process (a new manager: no ledger) brings everything to host, and still shares
    with fc.CheckpointManager(tmp_path, max_to_keep=2) as mgr:
        mgr.save(5, _state(base, half, 5))
        mgr.wait_until_finished()
        assert on_device[-1] == base.nbytes + half.nbytes + lora + 4
        assert _files(tmp_path / "5")["base"] == "../0/data/p0.0.bin"


def test_without_the_switch_a_cpu_state_is_brought_to_host_whole(tmp_path, on_device, monkeypatch):
    monkeypatch.delenv("_FLAX_CKPT_DEVICE_HASH")
    base = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    with fc.CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            mgr.save(step, {"base": jnp.asarray(base)})
            mgr.wait_until_finished()
    assert on_device == [base.nbytes] * 3


@pytest.mark.timeout(300)
def test_each_process_decides_for_its_own_shards(tmp_path, monkeypatch):
    from test_multihost import run

    monkeypatch.setenv("FLAX_CKPT_DEVICE_SNAPSHOT", "always")
    monkeypatch.setenv("_FLAX_CKPT_DEVICE_HASH", "cpu")
    results = run(tmp_path, "share", "share", 2)
    assert [(r["steps"], r["exact"]) for r in results] == [([2, 3], True)] * 2
    body = json.loads((tmp_path / "run" / "3" / "manifest.json").read_text())["body"]
    (f,) = [leaf for leaf in body["leaves"] if leaf["path"] == [["key", "f"]]]
    assert sorted(c["file"] for c in f["chunks"]) == ["../1/data/p0.0.bin", "../1/data/p1.0.bin"]
