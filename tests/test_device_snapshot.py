"""The snapshot taken on the device's stream (engine/device.py), on CPU devices (``always``).

- With ``auto`` (the default) a CPU state is never copied on the device: a save of a state still being
  computed waits for the step (``waited_for_device_s``) and makes one host copy, the memory tier's and
  the persistent manager's alike; a step donating the state right after ``save`` cannot change it.
- With ``always``, a save of a state still being computed returns long before the step ends (a copy
  is dispatched behind it; the writer brings it to host), and restores bit-exact.
- The copy is a new buffer: a donating step dispatched right after ``save`` cannot change what is saved
  (one device, and 8 devices sharded).
- Device memory: FLAX_CKPT_DEVICE_BUDGET=0 (no room) copies to host before ``save`` returns; a budget
  for some leaves copies those on the device and the rest to host; enough room copies all on the
  device. The choice and its bytes are in ``mgr.stats``.
- A donated (deleted) array passed to ``save``: a CheckpointError naming the leaf, nothing written.
- A step that fails on the device (an XLA error) after ``save`` returned: the next ``wait`` raises
  SaveFailedError whose cause names the failed computation; nothing of that step is written; the
  earlier steps restore.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.engine import device as dev
from flax_ckpt._src.engine.snapshot import snapshot
from helpers import assert_bit_exact

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def always(monkeypatch):
    monkeypatch.setenv("FLAX_CKPT_DEVICE_SNAPSHOT", "always")


@jax.jit
def _slow(a):
    """About a tenth of a second or more of one CPU core, its result the same as ``a``'s."""

    def body(_, c):
        m = jnp.tanh(c @ c.T) * 1e-6
        return c + (m[:, :1] - m[:, :1])

    return jax.lax.fori_loop(0, 30, body, a)


_step = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)


def _state(n: int = 256) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((n, n)).astype(np.float32)),
        "b": jnp.arange(n, dtype=jnp.int32),
        "key": jax.random.key(3),
        "step": 7,
    }


def test_a_save_of_a_state_still_computing_returns_before_the_step_ends(tmp_path, always):
    big = jnp.asarray(np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32))
    _slow(big).block_until_ready()
    t = time.perf_counter()
    _slow(big).block_until_ready()
    step_s = time.perf_counter() - t
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(0, {"w": big})  # warm: the copy compiled
        mgr.wait_until_finished()
        state = {"w": _slow(big)}
        assert not state["w"].is_ready()
        t = time.perf_counter()
        mgr.save(1, state)
        blocked = time.perf_counter() - t
        mgr.wait_until_finished()
        assert blocked < 0.15 * step_s, (blocked, step_s)
        assert mgr.stats[-1].snapshot_mode == "device"
        assert mgr.stats[-1].blocked_s < 0.15 * step_s
        assert_bit_exact(mgr.restore(1), {"w": np.asarray(state["w"])})


@pytest.mark.parametrize("manager", ["persistent", "memory"])
def test_on_cpu_devices_auto_makes_one_host_copy_and_no_device_copy(tmp_path, manager, monkeypatch):
    from flax_ckpt._src.engine import snapshot as snap_mod

    dispatched, copied = [], []
    real_dispatch, real_copy_all = dev.dispatch, snap_mod.copy_all
    monkeypatch.setattr(
        dev, "dispatch", lambda ps: (dispatched.extend(p.nbytes for p in ps), real_dispatch(ps))
    )
    monkeypatch.setattr(
        snap_mod,
        "copy_all",
        lambda cs, *a: (copied.extend(d.nbytes for d, _ in cs), real_copy_all(cs, *a))[1],
    )
    tiers = (
        fc.Tiers(local_dir=str(tmp_path / "shm"), peer=False, persist_interval_steps=None)
        if manager == "memory"
        else None
    )
    big = jnp.asarray(np.random.default_rng(2).standard_normal((1024, 1024)).astype(np.float32))
    _slow(big).block_until_ready()
    with fc.CheckpointManager(tmp_path / "run", tiers=tiers) as mgr:
        mgr.save(0, {"w": big, "b": jnp.arange(7)})
        mgr.wait_until_finished()
        state = {"w": _slow(big), "b": jnp.arange(7)}
        assert not state["w"].is_ready()  # a loop running ahead: the save finds its state computing
        want = np.asarray(big)  # _slow's result equals its input
        dispatched.clear(), copied.clear()
        mgr.save(1, state)
        state = _step(state)  # donates the saved arrays at once
        jax.block_until_ready(state)
        mgr.wait_until_finished()
        s = (mgr.tier_stats if manager == "memory" else mgr.stats)[-1]
        assert dispatched == []  # no copy on the device: it would compete with the step for the cores
        assert sum(copied) == big.nbytes + 7 * 4, copied  # one host copy of each array
        if manager == "persistent":
            assert s.snapshot_mode == "host" and s.device_bytes == 0, s
        assert s.waited_for_device_s > 0, s  # the step's time, reported as the device's
        got = mgr.restore(1)
    assert_bit_exact(got["w"], want)


@pytest.mark.parametrize("how", ["device_put", "jit"])
@pytest.mark.parametrize("manager", ["persistent", "memory"])
def test_save_then_donate_at_once_restores_bit_exact(tmp_path, always, manager, how, monkeypatch):
    monkeypatch.setattr(dev, "_HOW", how)  # CPU devices copy by device_put, accelerators by a jitted copy
    tiers = (
        fc.Tiers(local_dir=str(tmp_path / "shm"), peer=False, persist_interval_steps=None)
        if manager == "memory"
        else None
    )
    state = _state()
    want = {k: np.asarray(jax.random.key_data(v) if k == "key" else v) for k, v in state.items()}
    with fc.CheckpointManager(tmp_path / "run", tiers=tiers) as mgr:
        mgr.save(1, state)
        state = _step({k: v for k, v in state.items() if k != "key"})  # donates the saved arrays
        state["w"].block_until_ready()
        mgr.wait_until_finished()
        got = mgr.restore(1)
    assert got["step"] == 7
    assert_bit_exact(
        {k: np.asarray(jax.random.key_data(v) if k == "key" else v) for k, v in got.items() if k != "step"},
        {k: v for k, v in want.items() if k != "step"},
    )


@pytest.mark.parametrize("how", ["device_put", "jit"])
def test_the_device_copy_is_a_new_buffer(always, how, monkeypatch):
    monkeypatch.setattr(dev, "_HOW", how)
    x = jnp.arange(1 << 16, dtype=jnp.float32)
    snap = snapshot({"x": x}, copy=True)
    (p,) = snap.pending
    assert p.dev.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    x.delete()  # the copy does not depend on the original
    snap.complete()
    np.testing.assert_array_equal(snap.leaves[0].shards[0].data, np.arange(1 << 16, dtype=np.float32))


def test_sharded_on_eight_devices_then_donated_restores_bit_exact(tmp_path, always):
    assert len(jax.devices()) == 8
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    shardings = {"w": NS(mesh, P("a", "b")), "v": NS(mesh, P("a")), "r": NS(mesh, P())}
    host = {
        "w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
        "v": np.arange(16, dtype=np.int32),
        "r": np.float32([1.5, 2.5, 3.5]),
    }
    state = {k: jax.device_put(v, shardings[k]) for k, v in host.items()}
    state = _step(state)  # computed: its shards are XLA's buffers
    want = {k: v * 2 + 1 for k, v in host.items()}
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, state)
        nxt = _step(state)
        assert all(x.is_deleted() for x in state.values())
        jax.block_until_ready(nxt)
        mgr.wait_until_finished()
        assert mgr.stats[-1].snapshot_mode == "device"
        assert mgr.stats[-1].device_bytes == sum(v.nbytes for v in host.values())  # one copy of each box
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in host.items()}
        got = mgr.restore(1, target)
    assert_bit_exact(got, want, shardings, types=False)


def _modes(tmp_path, budget: int | None, monkeypatch) -> tuple[str, int]:
    if budget is not None:
        monkeypatch.setenv("FLAX_CKPT_DEVICE_BUDGET", str(budget))
    state = {"a": jnp.ones((64, 64), jnp.float32), "b": jnp.ones((128, 64), jnp.float32)}  # 16 and 32 KiB
    with fc.CheckpointManager(tmp_path / f"run{budget}") as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        s = mgr.stats[-1]
        assert_bit_exact(mgr.restore(1), {k: np.asarray(v) for k, v in state.items()})
    return s.snapshot_mode, s.device_bytes


def test_device_budget_none_some_enough(tmp_path, always, monkeypatch):
    assert _modes(tmp_path, 0, monkeypatch) == ("host", 0)  # no room: copied to host before save returns
    assert _modes(tmp_path, 20 << 10, monkeypatch) == ("split", 16 << 10)  # "a" fits, "b" does not
    assert _modes(tmp_path, 1 << 20, monkeypatch) == ("device", 48 << 10)
    monkeypatch.delenv("FLAX_CKPT_DEVICE_BUDGET")
    assert dev.headroom(jax.devices()[0]) is None  # CPU devices report no limit
    assert _modes(tmp_path, None, monkeypatch) == ("device", 48 << 10)


def test_no_room_waits_for_the_step_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAX_CKPT_DEVICE_BUDGET", "0")
    big = jnp.ones((1024, 1024), jnp.float32)
    _slow(big).block_until_ready()
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        state = {"w": _slow(big)}
        mgr.save(1, state)
        mgr.wait_until_finished()
        s = mgr.stats[-1]
    assert s.snapshot_mode == "host" and s.device_bytes == 0
    assert s.waited_for_device_s > 2 * s.blocked_s, s  # the step's time, reported apart from blocked_s


def test_headroom_from_memory_stats_leaves_a_margin():
    class Fake:
        id = 12345

        def memory_stats(self):
            return {"bytes_limit": 1000 << 20, "peak_bytes_in_use": 600 << 20, "bytes_in_use": 100 << 20}

    assert dev.headroom(Fake()) == (1000 - 600 - 100) << 20  # a tenth of the limit kept free


def test_a_donated_array_passed_to_save_is_refused_naming_it(tmp_path, always):
    state = _step({"params": {"w": jnp.ones(8)}, "opt": jnp.zeros(4)})
    _step(state)  # donates every leaf of ``state``
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(fc.CheckpointError, match=r"deleted.*donate.*'opt', 'params/w'"):
            mgr.save(1, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == []
    assert os.listdir(tmp_path / "run") in ([], [".flax_ckpt.lock"]) or all(
        not e[0].isdigit() for e in os.listdir(tmp_path / "run")
    )


_fail = {"on": False}


def _check(v):
    if _fail["on"]:
        raise ValueError("injected device failure")
    return np.asarray(v) + 1


@jax.jit
def _failing(a):  # a pure callback: its failure is the step's outputs', no effect token poisoned
    return jax.pure_callback(_check, jax.ShapeDtypeStruct(a.shape, a.dtype), a)


@pytest.mark.parametrize("manager", ["persistent", "memory"])
def test_a_step_that_fails_on_the_device_is_a_clear_error_and_nothing_is_written(tmp_path, always, manager):
    tiers = (
        fc.Tiers(local_dir=str(tmp_path / "shm"), peer=False, persist_interval_steps=None)
        if manager == "memory"
        else None
    )
    big = jnp.ones((1024, 1024), jnp.float32)
    _failing(_slow(big)).block_until_ready()
    with fc.CheckpointManager(tmp_path / "run", tiers=tiers) as mgr:
        mgr.save(1, {"w": _failing(big)})
        mgr.wait_until_finished()
        _fail["on"] = True
        try:
            state = {"w": _failing(_slow(big))}  # fails once the slow step is done: after save returned
            mgr.save(2, state)
            with pytest.raises(fc.SaveFailedError, match="step 2") as info:
                mgr.wait_until_finished()
        finally:
            _fail["on"] = False
        cause = info.value.__cause__
        assert isinstance(cause, fc.CheckpointError) and "failed on the device" in str(cause)
        assert isinstance(cause.__cause__, jax.errors.JaxRuntimeError)
        assert mgr.all_steps() == [1]
        np.testing.assert_array_equal(mgr.restore(1)["w"], np.full((1024, 1024), 2, np.float32))
        mgr.save(3, {"w": big})  # the manager goes on
    assert not [e for e in os.listdir(tmp_path / "run") if e.startswith("2")]  # nothing of step 2 at all


class _Landing:
    """A device copy whose transfer to host is logged: ("start", k) at ``copy_to_host_async``, ("land",
    k) when its host value is taken."""

    sharding = type("S", (), {"device_set": {type("D", (), {"platform": "tpu"})()}})()

    def __init__(self, k: int, nbytes: int, log: list, on_land=None):
        self.k, self.log, self.on_land = k, log, on_land
        self.host = np.full(nbytes, k, np.uint8)

    def block_until_ready(self):
        return self

    def copy_to_host_async(self):
        self.log.append(("start", self.k))

    def __array__(self, dtype=None, copy=None):
        self.log.append(("land", self.k))
        if self.on_land is not None:
            self.on_land(self.k)
        return self.host


def _pending(sizes, log, on_land=None):
    out = []
    for k, n in enumerate(sizes):
        p = dev.Pending(k, 0, np.zeros(n, np.uint8), None)
        p.dev, p.src = _Landing(k, n, log, on_land), None
        out.append(p)
    return out


def test_transfers_to_host_keep_at_most_the_window_in_flight(monkeypatch):
    monkeypatch.setattr(dev, "WINDOW", 30)
    sizes = [10, 10, 10, 10, 45, 10, 5, 5]
    log: list = []
    hosts, _ = dev.to_host(_pending(sizes, log))
    assert [h.tobytes() for h in hosts] == [bytes([k]) * n for k, n in enumerate(sizes)]
    started = [k for e, k in log if e == "start"]
    assert started == list(range(len(sizes)))  # in order, each once
    flight: set = set()
    for e, k in log:
        if e == "start":
            flight.add(k)
            held = sum(sizes[j] for j in flight)
            assert held <= 30 or len(flight) == 1, (log, flight)  # a piece over the window goes alone
        else:
            assert k in flight and k == min(flight), log  # waited for in order, once started
            flight.discard(k)


def test_something_waiting_for_the_save_starts_every_transfer_left(monkeypatch):
    import threading

    monkeypatch.setattr(dev, "WINDOW", 10)
    hurry = threading.Event()
    log: list = []
    hosts, _ = dev.to_host(_pending([10] * 6, log, lambda k: k == 1 and hurry.set()), hurry)
    assert len(hosts) == 6
    before_land_2 = log[: log.index(("land", 2))]
    assert [k for e, k in before_land_2 if e == "start"] == list(range(6)), log  # paced, then all at once
    assert log[:4] == [("start", 0), ("land", 0), ("start", 1), ("land", 1)], log


def test_a_wait_for_the_writer_sets_the_hurry_of_its_job():
    import threading

    from flax_ckpt._src.manager.writer import AsyncWriter

    hurry, seen = threading.Event(), []
    w = AsyncWriter()
    try:
        w.submit(lambda: seen.append(hurry.wait(30)), "job", hurry=hurry)
        w.wait()  # the job waits for its hurry: without it, 30 s
        assert seen == [True]
    finally:
        w.close()
