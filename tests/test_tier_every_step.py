"""Checkpointing at every step with the memory tier: behaviour, not speed (benchmarks/bench_every_step.py
measures the speed).

- The encoder's choice per chunk: unchanged -> a reference to the base ("b", free); changed a little
  (a delta at least halves it) -> an XOR delta ("x") while the encoding budget has credit; changed a
  lot (adam's updates: most bytes of the XOR non-zero) -> raw ("r", a copy), never compressed; and no
  delta at all once the budget is spent.
- A save that finds the previous one still being written does not wait (``Tiers(on_busy="skip")``, the
  default): it returns False at once; the skipped steps are counted in ``tier_stats`` and logged once;
  ``on_busy="wait"`` and ``force=True`` wait. A migration that is due while the previous one still
  runs is put off, never waited for in the writer.
- Every copy kept (full, delta, raw, references) restores bit-exact.
- A full copy is taken on the caller's thread into the pages of its data file (one copy, checksummed
  as it is made), so the state's arrays are free for the next step to donate; a differential copy is
  tried only where a full copy's sample of its chunks says it pays.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.records import leaf_name
from flax_ckpt._src.tiers import encode as tier_encode
from flax_ckpt._src.tiers import store as tier_store
from flax_ckpt._src.tiers.migration import Migration
from helpers import assert_bit_exact, in_place_checked

pytestmark = pytest.mark.timeout(120)


def _state(step: int) -> dict[str, Any]:
    """Three 2 MiB leaves: ``frozen`` never changes, ``little`` changes in the 6th significant digit,
    ``adam`` by an adam-sized update (relative 2e-3, random): every chunk of the last two changes."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 1024)).astype(np.float32)
    little, adam = w.copy(), w.copy()
    for s in range(1, step + 1):
        little = little + np.float32(1e-6) * little
        adam = adam + np.float32(2e-3) * np.random.default_rng(s).standard_normal(w.shape).astype(np.float32)
    return {"frozen": w, "little": little, "adam": adam, "step": step}


def _kinds(mgr: fc.CheckpointManager, step: int) -> dict[str, set[str]]:
    copy = tier_store.open_copy(os.path.join(mgr.memory_tiers.local_dir, str(step)))
    out: dict[str, set[str]] = {}
    for s in copy.body["shards"]:
        out.setdefault(leaf_name(copy.body["leaves"][s["leaf"]]), set()).update(e[0] for e in s["chunks"])
    return out


def _tiers(tmp_path, **kw) -> fc.Tiers:
    kw.setdefault("persist_interval_steps", None)
    return fc.Tiers(local_dir=str(tmp_path / "shm"), peer=False, cleanup=False, **kw)


def test_encoder_stores_unchanged_as_references_small_changes_as_deltas_and_adam_updates_raw(tmp_path):
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=_tiers(tmp_path, max_to_keep=5)) as mgr:
        # what is worth a delta, judged apart from the time budget (its own test below): on a busy
        # machine zlib's seconds would spend the budget's credit and store the little chunks raw
        mgr.memory_tiers.policy.budget = tier_encode.DeltaBudget(share=1.0, credit_s=1e9)
        mgr.save(1, _state(1))
        mgr.wait_until_finished()
        mgr.save(2, _state(2))
        mgr.wait_until_finished()
        kinds = _kinds(mgr, 2)
        stats = mgr.tier_stats
    assert stats[0].base and not stats[1].base
    assert kinds["frozen"] == {"b"}  # not at all: references, free
    assert kinds["little"] == {"x"}  # a little: the delta is a quarter of the chunk
    assert kinds["adam"] == {"r"}  # a lot: compressing costs ~30 copies for ~40% fewer bytes: raw
    leaf = _state(0)["frozen"].nbytes
    assert stats[1].delta == leaf  # only the "little" chunks went through zlib
    assert stats[1].written < 1.5 * leaf  # adam's raw bytes, the little leaf's delta, no frozen bytes


def test_no_delta_once_the_encoding_budget_is_spent(tmp_path):
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=_tiers(tmp_path, max_to_keep=5)) as mgr:
        mgr.memory_tiers.policy.budget = tier_encode.DeltaBudget(share=0.0, credit_s=0.0)  # no time for zlib
        backbone = np.random.default_rng(7).standard_normal(2 << 20).astype(np.float32)  # 8 MiB: raw "little"
        for step in (1, 2):  # and "adam" are then under half of the bytes, so the copy is a differential one
            mgr.save(step, dict(_state(step), backbone=backbone.copy()))
            mgr.wait_until_finished()
        kinds = _kinds(mgr, 2)
        assert mgr.tier_stats[1].delta == 0 and not mgr.tier_stats[1].base
    assert kinds == {"frozen": {"b"}, "little": {"r"}, "adam": {"r"}, "backbone": {"b"}}


def test_delta_ratio_estimates_what_a_delta_saves():
    rng = np.random.default_rng(3)
    w = rng.standard_normal(1 << 18).astype(np.float32)
    ratio = lambda new: tier_encode.delta_ratio(memoryview(new.view(np.uint8)), memoryview(w.view(np.uint8)))
    assert ratio(w.copy()) == 0.0
    assert ratio(w + np.float32(1e-6) * w) < 0.4
    assert ratio(w + np.float32(2e-3) * rng.standard_normal(w.shape).astype(np.float32)) > 0.5
    assert ratio(rng.standard_normal(w.shape).astype(np.float32)) > 0.9


class _Gate:
    """Holds the memory tier's writer inside ``write_copy`` until opened."""

    def __init__(self, monkeypatch):
        self.open, self.entered = threading.Event(), threading.Event()
        real = tier_store.write_copy

        def write_copy(*a, **kw):
            self.entered.set()
            assert self.open.wait(60), "the test never opened the gate"
            return real(*a, **kw)

        monkeypatch.setattr(tier_store, "write_copy", write_copy)


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_a_save_that_finds_the_previous_in_flight_skips_without_waiting(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "flax_ckpt")
    gate = _Gate(monkeypatch)
    mgr = fc.CheckpointManager(tmp_path / "ckpt", tiers=_tiers(tmp_path, max_to_keep=5))
    try:
        assert mgr.save(1, _state(1))
        assert gate.entered.wait(30)
        for step in (2, 3):  # the writer is held: these return at once, unsaved
            t, out = _in_thread(lambda: mgr.save(step, _state(step)))
            t.join(5)
            assert not t.is_alive(), f"save({step}) waited for the save in flight"
            assert out == [False]
        gate.open.set()
        mgr.wait_until_finished()
        assert mgr.save(4, _state(4))  # the writer is free: the newest state is saved
        mgr.wait_until_finished()
        assert [(s.step, s.skipped) for s in mgr.tier_stats] == [(1, 0), (4, 2)]
        assert mgr.memory_tiers.skipped == 2 and mgr.all_steps() == [1, 4]
        assert caplog.text.count("not saved: the previous save is still being written") == 1
        assert_bit_exact(mgr.restore(4), _state(4), types=False)
    finally:
        gate.open.set()
        mgr.close()


@pytest.mark.parametrize("how", ["on_busy_wait", "force"])
def test_on_busy_wait_and_force_hold_the_step_until_the_previous_save_is_done(tmp_path, monkeypatch, how):
    gate = _Gate(monkeypatch)
    tiers = _tiers(tmp_path, max_to_keep=5, on_busy="wait" if how == "on_busy_wait" else "skip")
    mgr = fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers)
    try:
        assert mgr.save(1, _state(1))
        assert gate.entered.wait(30)
        t, out = _in_thread(lambda: mgr.save(2, _state(2), force=how == "force"))
        t.join(0.5)
        assert t.is_alive() and out == []  # held while the writer is
        gate.open.set()
        t.join(30)
        assert out == [True]
        mgr.wait_until_finished()
        assert [(s.step, s.skipped) for s in mgr.tier_stats] == [(1, 0), (2, 0)]
        assert mgr.memory_tiers.skipped == 0
    finally:
        gate.open.set()
        mgr.close()


def test_a_due_migration_is_put_off_while_the_previous_one_runs(tmp_path, monkeypatch):
    release = threading.Event()
    real = Migration.start

    def slow_first(self, step, job):  # the first migration runs until released
        return real(self, step, (lambda: (release.wait(60), job())) if step == 1 else job)

    monkeypatch.setattr(Migration, "start", slow_first)
    mgr = fc.CheckpointManager(
        tmp_path / "ckpt", tiers=_tiers(tmp_path, persist_interval_steps=1, max_to_keep=5)
    )
    try:
        assert mgr.save(1, _state(1))
        deadline = time.monotonic() + 120  # progress: two memory saves (a hang if the writer waits)
        for step in (2, 3):  # each due; the migration of step 1 still runs: neither waits for it
            while not mgr.save(step, _state(step)):
                assert time.monotonic() < deadline, (
                    f"step {step} never saved: the writer waits for the migration"
                )
                time.sleep(0.01)
        while len(mgr.tier_stats) < 3 or mgr.memory_tiers.deferred < 2:
            assert time.monotonic() < deadline, "the writer waits for the migration in flight"
            time.sleep(0.01)
        assert mgr.memory_tiers.persistent.steps() == []
        release.set()
        mgr.wait_until_finished()  # waits for the migration in flight (step 1)
        assert mgr.save(4, _state(4))  # due, nothing in flight: migrated
        mgr.wait_until_finished()
        assert mgr.memory_tiers.persistent.steps() == [1, 4] and mgr.memory_tiers.deferred == 2
    finally:
        release.set()
        mgr.close()
    assert_bit_exact(fc.restore(tmp_path / "ckpt" / "4"), _state(4), types=False)


def test_every_kept_copy_restores_bit_exact(tmp_path):
    """Bases, deltas, raw chunks and references, across a rebase, each step restored from memory."""
    tiers = _tiers(tmp_path, max_to_keep=7, rebase_interval=3)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        mgr.memory_tiers.policy.budget = tier_encode.DeltaBudget(
            share=1.0, credit_s=60.0
        )  # deltas however loaded
        for step in range(1, 8):
            mgr.save(step, _state(step))
            mgr.wait_until_finished()
        assert [s.step for s in mgr.tier_stats if s.base] == [1, 5]
        assert all(s.delta for s in mgr.tier_stats if not s.base)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:  # a restarted process
        assert mgr.all_steps() == list(range(1, 8))
        for step in range(1, 8):
            assert_bit_exact(mgr.restore(step), _state(step), types=False)
            assert mgr.restore_stats[-1].tier == "local"


def test_a_full_copy_is_taken_into_its_data_file_and_the_arrays_are_free_to_donate(tmp_path, monkeypatch):
    """A full memory copy is made on the caller's thread straight into the pages of the data file it
    becomes, so ``save`` returns holding nothing of the state: the next jitted step can donate its
    arrays while the copy is still being written (a host view held by the writer would make XLA keep
    them and allocate new buffers); the checksums are made as it is copied. Every copy, and the steps
    migrated from those pages, restore bit-exact."""
    import jax
    import jax.numpy as jnp

    train = jax.jit(lambda s: jax.tree_util.tree_map(lambda a: a * 1.001 + 0.5, s), donate_argnums=0)
    rng = np.random.default_rng(3)
    state = {
        "w": jnp.asarray(rng.standard_normal((512, 1024), np.float32)),
        "b": jnp.asarray(rng.standard_normal((1000,), np.float32)),
        "n": jnp.arange(7),
    }
    saved: dict[int, dict[str, np.ndarray]] = {}
    gate, real = threading.Event(), tier_store.write_copy

    def held(*args, **kwargs):
        assert gate.wait(60)
        return real(*args, **kwargs)

    pending, real_encode = [], tier_encode.encode  # per copy, the checksums left for the writer to make

    def encode(*args, **kwargs):
        enc = real_encode(*args, **kwargs)
        pending.append(len(enc.pending))
        return enc

    monkeypatch.setattr(tier_encode, "encode", encode)
    tiers = _tiers(tmp_path, on_busy="wait", persist_interval_steps=2, max_to_keep=2)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        try:
            for step in range(6):
                saved[step] = {k: np.array(v) for k, v in state.items()}
                if step == 5:  # the writer held until the next step has run
                    monkeypatch.setattr(tier_store, "write_copy", held)
                mgr.save(step, state)
                if step < 5:
                    mgr.wait_until_finished()
                before = state
                state = train(state)
                jax.block_until_ready(state)
                if (
                    step >= 3
                ):  # once a spare data file exists (the first copies make one), and copies are full
                    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(before)), step
        finally:
            gate.set()
        mgr.wait_until_finished()
        assert all(s.base for s in mgr.tier_stats[2:])
        # the checksums made as each copy was taken are the index's: the writer computes none again
        assert len(pending) == 6 and pending[0] and not any(pending[3:]), pending
        for step in (4, 5):
            assert_bit_exact(mgr.restore(step), saved[step], types=False)
            assert mgr.restore_stats[-1].tier == "local"
    for step in (2, 4):  # migrated from the snapshot's pages
        assert_bit_exact(fc.restore(tmp_path / "ckpt" / str(step)), saved[step], types=False)


def test_full_copies_into_the_data_file_keep_every_dtype_and_layout_bit_exact(tmp_path):
    """The copy into a data file's pages, split into byte ranges over threads: bfloat16, bool, 0-d,
    PRNG keys, a transposed and a strided numpy array, a leaf larger than the spare (the copy outgrows
    it) and an empty one restore bit-exact from memory."""
    import jax
    import jax.numpy as jnp

    def state(step: int, big: int = 1) -> dict[str, Any]:
        rng = np.random.default_rng(step)
        return {
            "bf16": jnp.asarray(rng.standard_normal((700, 1100)), jnp.bfloat16),
            "mask": jnp.asarray(rng.random((333, 77)) > 0.5),
            "scalar": jnp.float32(step),
            "key": jax.random.key(step),
            "empty": np.zeros((0, 5), np.float32),
            "t": rng.standard_normal((900, 1300)).astype(np.float32).T,
            "strided": rng.integers(0, 255, 9_000_001, dtype=np.uint8)[::3],
            "grows": rng.standard_normal(big << 20).astype(np.float32),
            "odd": rng.integers(0, 255, 1001, dtype=np.uint8),
            "name": f"run-{step}",
            "n": step,
        }

    tiers = _tiers(tmp_path, on_busy="wait", max_to_keep=8)
    saved = {}
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in range(6):
            saved[step] = state(step, 1 if step < 4 else 3)  # steps 4, 5: 8 MiB more than the spare holds
            mgr.save(step, saved[step], metrics={"loss": 1 / (step + 3), "acc": step})
            mgr.wait_until_finished()
        for step in range(6):
            assert_bit_exact(
                mgr.restore(step, target=state(0, 1 if step < 4 else 3)), saved[step], types=False
            )
            assert mgr.restore_stats[-1].tier == "local"
            _check_full_copy(os.path.join(mgr.memory_tiers.local_dir, str(step)))


def _check_full_copy(folder: str) -> None:
    """A full copy's index (written as text, tiers/encode.py) is the canonical JSON of its body, and every
    chunk's crc32c is that of its bytes in data.bin, each shard's from a 64-byte boundary."""
    import json

    import crc32c

    raw = open(os.path.join(folder, tier_store.INDEX), "rb").read()
    canon = raw[raw.index(b'"body": ') + len(b'"body": ') : -2]
    body = json.loads(canon)
    assert canon.decode() == json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert tier_store.decode_index(raw, folder) == body and body["base"] is None
    data = open(os.path.join(folder, tier_store.DATA), "rb").read()
    assert len(data) == body["data"]
    for s in body["shards"]:
        assert s["nbytes"] == sum(e[3] for e in s["chunks"])
        assert not s["chunks"] or s["chunks"][0][2] % 64 == 0
        for kind, crc, off, n in s["chunks"]:
            assert kind == "r" and crc == crc32c.crc32c(data[off : off + n])


def test_a_full_copy_written_where_the_snapshot_lies_equals_the_copy_encoded_piece_by_piece(
    tmp_path, monkeypatch
):
    """A full copy whose snapshot lies in its data file where the encoding puts it is written from the
    layout kept since the last one (encode.FullLayout): its index and data bytes are those of the
    piece-by-piece encoding, byte for byte, with the structure unchanged, after a leaf changed size
    (the old bytes left under the new padding are zeroed) and after a leaf was added; a 4-device array
    sharded on 2 devices (replicas of other boxes among its shards), bfloat16, a PRNG key, an empty
    leaf, odd sizes and a 3-chunk leaf. Every step restores bit-exact from memory."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sharded = NamedSharding(mesh, PartitionSpec("a", None))

    def state(step: int) -> dict[str, Any]:
        rng = np.random.default_rng(step)
        odd = 1001 if step < 3 else 1501  # from step 3 the shards after it lie 512 bytes further
        out = {
            "bf16": jnp.asarray(rng.standard_normal((300, 700)), jnp.bfloat16),
            "odd": rng.integers(0, 255, odd, dtype=np.uint8),
            "key": jax.random.key(step),
            "empty": np.zeros((0, 3), np.float32),
            "three": rng.standard_normal(700_000).astype(np.float32),
            "sharded": jax.device_put(rng.standard_normal((64, 333)).astype(np.float32), sharded),
            "n": step,
        }
        if step >= 5:
            out["added"] = rng.standard_normal(777).astype(np.float32)
        return out

    checked, compared = in_place_checked()
    monkeypatch.setattr(tier_encode, "_encode_in_place", checked)
    saved = {}
    with fc.CheckpointManager(
        tmp_path / "ckpt", tiers=_tiers(tmp_path, on_busy="wait", max_to_keep=8)
    ) as mgr:
        for step in range(8):
            saved[step] = state(step)
            mgr.save(step, saved[step])
            mgr.wait_until_finished()
        # the first copy has no spare yet; each structure's or size's first copy into one makes its layout
        assert compared == [1, 2, 4, 6, 7], compared  # 3 and 5 outgrew the spare: encoded piece by piece
        for step in range(8):
            got = mgr.restore(step, target=state(step))
            assert_bit_exact(got, saved[step], types=False)
            assert mgr.restore_stats[-1].tier == "local"
            _check_full_copy(os.path.join(mgr.memory_tiers.local_dir, str(step)))


def test_the_copy_into_a_data_file_gives_the_crc32c_of_every_chunk_it_copied():
    """engine.snapshot.copy_all(copies, chunk): the copies are made (split over threads), and each
    destination's crc32c per ``chunk`` bytes from its start equals a separate pass over it, for
    contiguous, transposed and strided sources, a tail chunk and an empty array."""
    import crc32c

    from flax_ckpt._src.engine import snapshot as snap_mod

    rng = np.random.default_rng(9)
    sources = [
        rng.standard_normal(3 << 20).astype(np.float32),
        rng.standard_normal((700, 900)).astype(np.float32).T,
        rng.integers(0, 255, 3_000_001, dtype=np.uint8)[::3],
        np.zeros((0, 4), np.float32),
        rng.standard_normal(5).astype(np.float64),
    ]
    copies = [(np.empty(a.shape, a.dtype), a) for a in sources]
    chunk = 1 << 20
    crcs = snap_mod.copy_all(copies, chunk)
    for (d, a), got in zip(copies, crcs):
        assert np.array_equal(d, a)
        flat = d.reshape(-1).view(np.uint8)
        assert got.tolist() == [crc32c.crc32c(flat[k : k + chunk]) for k in range(0, flat.nbytes, chunk)]
    assert snap_mod.copy_all([(np.empty(4, np.int32), np.arange(4, dtype=np.int32))]) is None


def test_a_copy_is_differential_only_where_a_sample_against_the_base_says_it_pays(tmp_path):
    """Adam changes every byte: a differential copy costs a comparison of every chunk and saves nothing.
    Each copy that would be differential is first sampled against the base (32 places): while they
    differ, it is stored full as the snapshot lies in its data file, and the next 1, 3, 7, ... such
    copies are stored full without a sample; once the state stops changing, the next sample says so
    and the copies are differential again (references to the base only), a rebase every
    rebase_interval."""
    tiers = _tiers(tmp_path, on_busy="wait", rebase_interval=2, max_to_keep=2)
    rng = np.random.default_rng(4)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in range(12):
            mgr.save(step, {"adam": rng.standard_normal((256, 1024)).astype(np.float32)})
        still = rng.standard_normal((256, 1024)).astype(np.float32)
        for step in range(12, 20):
            mgr.save(step, {"adam": still.copy()})  # new arrays, the same bytes: compared, not views
        mgr.wait_until_finished()
        # samples at steps 1, 3, 7 (adam: full), then 1, 3, 7 copies stored full unsampled; step 15's
        # sample finds the state unchanged since step 14; a rebase at 17 (rebase_interval 2)
        assert [s.step for s in mgr.tier_stats if not s.base] == [15, 16, 18, 19]
        assert all(s.written < 8192 for s in mgr.tier_stats if not s.base)  # references only
        for step in (18, 19):  # the kept steps: a full copy and a copy of references to it
            assert_bit_exact(mgr.restore(step, target={"adam": still}), {"adam": still}, types=False)
            assert mgr.restore_stats[-1].tier == "local"


def test_changed_share_samples_the_chunks_that_a_differential_copy_would_store(tmp_path):
    """encode.changed_share: 0 for a snapshot equal to the base, 1 for one that differs everywhere,
    about the share of bytes changed in between (32 samples)."""
    a = np.random.default_rng(5).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB: 8 chunks
    tiers = _tiers(tmp_path, on_busy="wait")
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        mgr.save(0, {"w": a})
        mgr.wait_until_finished()
        base = tier_store.open_copy(os.path.join(mgr.memory_tiers.local_dir, "0"))
        b = a.copy()
        b[: 2048 // 4] += 1  # the first quarter of the rows: 2 of the 8 chunks
        c = a + 1
        share = {}
        for name, x in (("same", a.copy()), ("quarter", b), ("all", c)):
            ts = tier_store.take_snapshot(
                {"w": x}, copy=True, force=False, step=1, seen=tier_store.Seen(), base=None
            )
            share[name] = tier_encode.changed_share(ts, base)
    assert share == {"same": 0.0, "quarter": 0.25, "all": 1.0}


def test_on_busy_is_validated():
    with pytest.raises(ValueError, match="on_busy"):
        fc.Tiers(on_busy="drop")
