"""Tiered checkpoints (issue 6): local memory, peer memory, persistent storage; differential copies.

Single-process tests drive a CheckpointManager with ``tiers=`` in this process. Multi-process tests run
real jobs (tests/workers/tier_worker.py, started by helpers.Job): N processes on a jax.distributed
coordinator at 127.0.0.1, CPU devices, gloo collectives, each process with its own local_dir standing for
its host; processes are killed with SIGKILL, folders deleted, jobs restarted, and every restore is
checked bit-exact on every process against the state of the step it reports. Every wait has a timeout;
every process group is killed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.tiers import encode as tier_encode
from flax_ckpt._src.tiers import store as tier_store
from helpers import WORKERS, Job, assert_bit_exact

WORKER = WORKERS / "tier_worker.py"
JOB_TIMEOUT_S = 90


# ------------------------------------------------------------------------------------- one process


def tuned(step: int, frozen: np.ndarray) -> dict[str, Any]:
    """A fine-tuning state: a large frozen backbone and a small trained head that changes every step."""
    rng = np.random.default_rng(step)
    return {
        "backbone": {"w": frozen},
        "head": {
            "w": jnp.asarray(rng.standard_normal((256, 256), np.float32)),
            "b": rng.standard_normal((256,)).astype(np.float32),
        },
        "step": step,
        "key": jax.random.key(step),
    }


@pytest.fixture
def frozen() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB


def test_differential_copy_costs_only_the_trained_part(tmp_path, frozen, caplog):
    caplog.set_level(logging.INFO, "flax_ckpt")
    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"), on_busy="wait", persist_interval_steps=100, cleanup=False
    )
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in range(1, 6):
            mgr.save(step, tuned(step, frozen))
        mgr.wait_until_finished()
        stats = mgr.tier_stats
    assert "peer-memory tier disabled (a single process" in caplog.text
    trained = tuned(0, frozen)["head"]["w"].nbytes + tuned(0, frozen)["head"]["b"].nbytes
    assert stats[0].base and stats[0].written > frozen.nbytes
    for s in stats[1:]:  # everything written: changed chunks, index; the 8 MiB backbone costs nothing
        assert not s.base and s.written <= 1.05 * trained, (s.step, s.written, trained)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:  # a restarted process
        assert mgr.all_steps() == [4, 5]
        assert_bit_exact(mgr.restore(target=tuned(0, frozen)), tuned(5, frozen), types=False)
        assert mgr.restore_stats[-1].tier == "local"
        assert_bit_exact(mgr.restore(4, target=tuned(0, frozen)), tuned(4, frozen), types=False)


def test_unchanged_jax_leaves_are_neither_copied_nor_hashed(tmp_path):
    backbone = jnp.asarray(np.random.default_rng(2).standard_normal((1024, 1024), np.float32))  # 4 MiB
    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"),
        on_busy="wait",
        persist_interval_steps=3,
        rebase_interval=2,
        cleanup=False,
    )
    states = {s: {"backbone": backbone, "head": jnp.full((64, 64), float(s))} for s in range(1, 7)}
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in range(1, 7):
            mgr.save(step, states[step])
        mgr.wait_until_finished()
        stats = {s.step: s for s in mgr.tier_stats}
    assert [s for s, t in stats.items() if t.base] == [1, 4]  # step 4's base is written from the views
    assert all(stats[s].reused == backbone.nbytes for s in (2, 3, 4, 5, 6))  # the same object since step 1
    assert all(stats[s].written < 64 * 64 * 4 + 4096 for s in (2, 3, 5, 6))
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in (5, 6):  # memory, then the migrated steps (3 and 6 were migrated from views)
            assert_bit_exact(mgr.restore(step, target=states[1]), states[step], types=False)
    assert_bit_exact(fc.restore(tmp_path / "ckpt" / "3", target=states[1]), states[3], types=False)
    assert_bit_exact(fc.restore(tmp_path / "ckpt" / "6", target=states[1]), states[6], types=False)


def test_an_unchanged_leaf_is_known_by_name_when_the_structure_around_it_changes(tmp_path):
    """A save of the structure saved last finds each leaf's previous array by position; a save of
    another structure (a leaf added before it, then removed) by name: the backbone, the same object
    throughout, is never copied again, whatever its place among the leaves."""
    backbone = jnp.asarray(np.random.default_rng(3).standard_normal((1024, 1024), np.float32))  # 4 MiB
    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"),
        on_busy="wait",
        persist_interval_steps=None,
        rebase_interval=10,
        max_to_keep=10,
        cleanup=False,
    )
    states = {s: {"backbone": backbone, "head": jnp.full((64, 64), float(s))} for s in range(1, 7)}
    for s in (3, 4):  # "a_extra" sorts first: the backbone is the second leaf, the head the third
        states[s] = {"a_extra": jnp.full((8,), float(s)), **states[s]}
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in range(1, 7):
            mgr.save(step, states[step])
        mgr.wait_until_finished()
        stats = {s.step: s for s in mgr.tier_stats}
        assert [s for s, t in stats.items() if t.base] == [1]
        assert all(stats[s].reused == backbone.nbytes for s in range(2, 7)), {
            s: t.reused for s, t in stats.items()
        }
        for step in range(1, 7):
            assert_bit_exact(mgr.restore(step, target=states[step]), states[step], types=False)


def test_small_changes_are_stored_as_compressed_xor_deltas(tmp_path):
    base = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"), on_busy="wait", persist_interval_steps=None, cleanup=False
    )
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        # deltas judged apart from the time budget (tests/test_tier_every_step.py tests it): on a busy
        # machine zlib's seconds would spend its credit and store chunks raw
        mgr.memory_tiers.policy.budget = tier_encode.DeltaBudget(share=1.0, credit_s=1e9)
        mgr.save(1, {"w": base})
        mgr.save(2, {"w": base + np.float32(1e-6) * base})  # every element changes a little
        mgr.wait_until_finished()
        written = [s.written for s in mgr.tier_stats]
        copy = tier_store.open_copy(os.path.join(mgr.memory_tiers.local_dir, "2"))
    assert {e[0] for s in copy.body["shards"] for e in s["chunks"]} == {"x"}
    assert written[1] < 0.8 * base.nbytes
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        assert mgr.restore()["w"].tobytes() == (base + np.float32(1e-6) * base).tobytes()


def _tmpfs_bytes(top: str) -> int:
    """The pages the files under ``top`` hold (each inode once)."""
    seen: dict[int, int] = {}
    for r, _, fs in os.walk(top):
        for n in fs:
            st = os.lstat(os.path.join(r, n))
            seen[st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["jax", "numpy"])
def test_memory_tier_holds_its_base_one_spare_and_the_differential_copies(tmp_path, kind):
    """Issue 41, item 6: a frozen 1 MiB leaf and differential copies of a few dozen bytes held 3.0x the
    state in tmpfs (the base and two full-size spare files: the spare a snapshot was taken into, still
    pinned when the writer prepared the next one). Now, measured after every save through a rebase: at
    most the base, one spare and the differential copies; while the old base is still kept for the
    differential copies that need it, it is the next spare (no third full-size file)."""
    frozen = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)  # 1 MiB
    leaf = jnp.asarray(frozen) if kind == "jax" else frozen
    cfg = fc.Tiers(
        local_dir=str(tmp_path / "shm"),
        on_busy="wait",
        persist_interval_steps=None,
        peer=False,
        cleanup=False,
        rebase_interval=4,
    )
    worst = 0.0
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=cfg) as mgr:
        for step in range(1, 12):
            mgr.save(step, {"frozen": leaf, "step": np.int32(step)})
            mgr.wait_until_finished()
            stats = mgr.tier_stats[-1]
            assert stats.base or stats.written < 1024, stats  # a differential copy of a few dozen bytes
            diffs = sum(s.written for s in mgr.tier_stats[-cfg.max_to_keep :] if not s.base)
            worst = max(worst, (_tmpfs_bytes(str(tmp_path / "shm")) - diffs) / frozen.nbytes)
        assert [s.step for s in mgr.tier_stats if s.base] == [1, 6, 11]
        assert_bit_exact(
            mgr.restore(target={"frozen": frozen, "step": np.int32(0)}),
            {"frozen": frozen, "step": np.int32(11)},
            types=False,
        )
    assert worst <= 2.1, f"{worst:.2f}x the state in tmpfs: more than the base and one spare"


def test_retention_rebase_cleanup_and_final_migration(tmp_path, frozen):
    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"),
        on_busy="wait",
        persist_interval_steps=4,
        max_to_keep=2,
        rebase_interval=3,
    )
    mgr = fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers)
    for step in range(1, 11):
        mgr.save(step, tuned(step, frozen))
        mgr.wait_until_finished()
        folders = tier_store.steps_in(mgr.memory_tiers.local_dir)
        assert len(folders) <= tiers.max_to_keep + 2, folders  # kept steps, the bases they need
    assert [s.step for s in mgr.tier_stats if s.base] == [1, 5, 9]  # a new base after 3 differential copies
    assert mgr.memory_tiers.committed("local") == [9, 10] and mgr.all_steps() == [4, 8, 9, 10]
    mgr.close()  # cleanup: step 10 lived only in memory, so it is migrated first; then the tiers go
    assert os.listdir(tmp_path / "shm") == []
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as again:
        assert again.all_steps() == [4, 8, 10]
        assert_bit_exact(again.restore(target=tuned(0, frozen)), tuned(10, frozen), types=False)
        assert again.restore_stats[-1].tier == "persistent"


def test_damaged_memory_copy_falls_back_with_a_warning(tmp_path, frozen, caplog):
    tiers = fc.Tiers(local_dir=str(tmp_path / "shm"), on_busy="wait", persist_interval_steps=2, cleanup=False)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in range(1, 4):
            mgr.save(step, tuned(step, frozen))
        local = mgr.memory_tiers.local_dir
    data = os.path.join(local, "3", tier_store.DATA)  # step 3: only the changed head, stored raw
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        assert_bit_exact(
            mgr.restore(target=tuned(0, frozen)), tuned(2, frozen), types=False
        )  # step 2: memory and persistent
    assert "could not restore from local memory" in caplog.text and "checksum mismatch" in caplog.text
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers, strict=True) as mgr:
        with pytest.raises(fc.CheckpointError, match="strict"):
            mgr.restore(target=tuned(0, frozen))


def _mapping_of(address: int) -> str:
    """The file (as /proc/self/maps names it) whose pages hold ``address`` in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_memory_restore_maps_the_copy_and_reused_pages_never_change_it(tmp_path):
    """A restore from local memory hands out the copy's own pages (no copy), and the tier, which writes
    new copies into the pages of removed ones, never writes into pages a restored array still uses."""

    def state(step: int) -> dict[str, Any]:  # every leaf changes: every copy is a full one
        return {"w": jnp.asarray(np.random.default_rng(step).standard_normal((1024, 1024), np.float32))}

    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"),
        on_busy="wait",
        persist_interval_steps=None,
        max_to_keep=1,
        cleanup=False,
    )
    target = {"w": jax.ShapeDtypeStruct((1024, 1024), np.float32, sharding=state(0)["w"].sharding)}
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        for step in range(1, 4):
            mgr.save(step, state(step))
        got = mgr.restore(3, target=target)
        local = mgr.memory_tiers.local_dir
        assert _mapping_of(got["w"].unsafe_buffer_pointer()) == os.path.join(local, "3", tier_store.DATA)
        spares = os.path.join(os.path.dirname(local), "spare-local")
        for step in range(4, 10):
            listed = os.listdir(spares) if os.path.isdir(spares) else []
            assert len(listed) <= 1  # memory stays bounded: one spare file at most
            spare_inode = os.stat(os.path.join(spares, listed[0])).st_ino if listed else None
            mgr.save(step, state(step))
            mgr.wait_until_finished()
            if spare_inode is not None:  # the new copy was written into the spare: the same file
                assert os.stat(os.path.join(local, str(step), tier_store.DATA)).st_ino == spare_inode
        assert spare_inode is not None  # files were reused
        assert np.asarray(got["w"]).tobytes() == np.asarray(state(3)["w"]).tobytes()  # untouched
        assert _mapping_of(got["w"].unsafe_buffer_pointer()).endswith("(deleted)")  # deleted, not reused
        assert_bit_exact(mgr.restore(target=target), state(9), types=False)
        numpy_target = mgr.restore(target={"w": np.zeros((1024, 1024), np.float32)})["w"]
        assert numpy_target.flags.writeable and numpy_target.tobytes() == np.asarray(state(9)["w"]).tobytes()
    assert not os.path.exists(spares)  # spare pages are freed at close, even with cleanup=False
    assert tier_store.steps_in(local) == [9]  # the copies themselves stay (cleanup=False)


def test_a_training_step_that_donates_restored_arrays_leaves_the_memory_copy_intact(tmp_path):
    """Restored arrays are the copy's read-only pages; a jitted step that donates them (as training
    loops do) must neither crash nor write into the copy: the next restore is still the saved step."""
    state = {"w": jnp.asarray(np.random.default_rng(7).standard_normal((512, 1024), np.float32))}
    tiers = fc.Tiers(
        local_dir=str(tmp_path / "shm"), on_busy="wait", persist_interval_steps=None, cleanup=False
    )
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x.at[0, 0].set(42.0) * 2, s), donate_argnums=0)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        got = mgr.restore(
            1,
            target=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state),
        )
        assert _mapping_of(got["w"].unsafe_buffer_pointer()).endswith(os.path.join("1", tier_store.DATA))
        for _ in range(3):
            got = step_fn(got)
        assert float(got["w"][0, 0]) == 42.0 * 2
        assert_bit_exact(mgr.restore(1, target=state), state, types=False)
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:  # and from the files themselves
        assert_bit_exact(mgr.restore(1, target=state), state, types=False)


def test_failed_migration_is_raised_and_memory_still_serves(tmp_path):
    from flax_ckpt._src.serializers.raw import RawSerializer

    class DiskFull(RawSerializer):
        def write(self, storage, items, *, tag):
            raise OSError(28, "No space left on device")

    tiers = fc.Tiers(local_dir=str(tmp_path / "shm"), on_busy="wait", persist_interval_steps=1, cleanup=False)
    state = {"w": np.arange(8.0)}
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers, serializer=DiskFull()) as mgr:
        mgr.save(1, state)
        with pytest.raises(fc.SaveFailedError, match="migration of step 1") as info:
            mgr.wait_until_finished()
        assert "No space left" in str(info.value.__cause__)
        assert mgr.all_steps() == [1]  # committed in local memory, not persisted
        assert mgr.restore()["w"].tobytes() == state["w"].tobytes()


def test_plan_never_mixes_steps_or_runs():
    from flax_ckpt._src.tiers.plan import choose, peer_shift

    def inv(local, peer=None):
        return {
            "local": {str(s): v for s, v in local.items()},
            "peer": {str(k): {str(s): v for s, v in steps.items()} for k, steps in (peer or {}).items()},
        }

    x, y = "run-x", "run-y"
    # step 9: written everywhere, but no process holds a commit record (the vote never finished);
    # step 8: committed, but process 1's copy is from another run; step 7: process 1 lost its local copy
    invs = [
        inv({9: [x, False], 8: [x, True], 7: [x, True]}, {1: {7: [x, True]}}),
        inv({9: [x, False], 8: [y, True]}),
    ]
    plan = choose(invs, {6}, None, set())
    assert (plan.step, plan.sources) == (7, (("local", 0), ("peer", 0)))
    assert choose(invs, {6, 7}, None, {(1, "peer", 7)}).sources == (("local", 0), ("persistent", None))
    assert choose(invs, {6}, None, {(1, "peer", 7)}).sources == (("persistent", None),) * 2
    assert choose(invs, set(), 8, set()) is None
    # one record suffices: every process voted that its copy was complete before any record was written
    invs[1]["local"]["9"] = [x, True]
    assert choose(invs, set(), None, set()).sources == (("local", 0), ("local", 1))
    assert peer_shift(["h0", "h0", "h1", "h1"]) == 2 and peer_shift(["h0", "h1", "h2"]) == 1
    assert peer_shift(["h0", "h0"]) is None and peer_shift(["h0"]) is None


def test_tiers_config_is_validated(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep"):
        fc.Tiers(max_to_keep=0)
    with pytest.raises(ValueError, match="persist_interval_steps"):
        fc.Tiers(persist_interval_steps=0)
    with pytest.raises(TypeError, match="flax_ckpt.Tiers"):
        fc.CheckpointManager(tmp_path, tiers={"local_dir": "/dev/shm"})


# ----------------------------------------------------------------------------------- multi-process


def tier_job(tmp: Path, tag: str, mode: str, n: int = 2, **cfg: Any) -> Job:
    """N tier_worker processes of one jax.distributed job, started; process i's local_dir is <tmp>/host<i>."""
    return Job(
        WORKER,
        tmp,
        tag,
        n,
        devices=2,
        timeout=JOB_TIMEOUT_S,
        mode=mode,
        dir=str(tmp / "ckpt"),
        per_process=lambda i: {"local": str(tmp / f"host{i}")},
        **cfg,
    ).start()


def tier_results(tmp: Path, tag: str, mode: str, **cfg: Any) -> list[dict[str, Any]]:
    """Runs a tier job until every process has reported (a train or loop job then keeps running, like
    hosts: it is killed here); every one's findings, all ok."""
    job = tier_job(tmp, tag, mode, **cfg)
    return job.check_ok(job.join(running=True))


@pytest.mark.timeout(300)
def test_three_failure_classes_restore_the_newest_surviving_step(tmp_path):
    """Slow (tens of seconds): a multi-process job for each class of failure."""
    train = tier_results(tmp_path, "train", "train", steps=7, persist=3)
    assert train[0]["local"] == train[0]["peer"] == [6, 7] and train[0]["peer_dst"] == 1
    assert all(not b for _, _, _, b in train[0]["written"][1:])  # differential after the first save

    def restore(tag: str) -> list[dict[str, Any]]:
        res = tier_results(tmp_path, tag, "restore", persist=3)
        assert res[0]["restored"] == res[1]["restored"] and res[0]["sources"] == res[1]["sources"]
        return res

    # (1) every process killed (SIGKILL above) and restarted: all shards from local memory
    r = restore("all-killed")
    assert r[0]["restored"] == 7 and r[0]["sources"] == [["local", 0], ["local", 1]]
    assert r[1]["stats"] == ["local"]
    # (2) host 1 lost (its tmpfs gone): its shards come from its peer, process 0's from local memory
    shutil.rmtree(tmp_path / "host1")
    r = restore("host-lost")
    assert r[0]["restored"] == 7 and r[0]["sources"] == [["local", 0], ["peer", 0]]
    assert r[1]["stats"] == ["peer"]
    # (3) every memory tier gone: the newest migrated step, from persistent storage
    for host in tmp_path.glob("host[0-9]"):
        shutil.rmtree(host)
    r = restore("memory-lost")
    assert r[0]["restored"] == 6 and r[0]["sources"] == [["persistent", None]] * 2


@pytest.mark.timeout(300)
def test_full_copies_holding_other_processes_boxes_are_written_where_the_snapshot_lies(tmp_path):
    """2 processes x 2 devices, every memory copy full: process 1 holds replicas of boxes process 0
    writes to persistent storage (r, replicated everywhere), which it keeps in its copies too. They are
    copied and checksummed as the snapshot's own shards are, so every process's full copies after the
    first (which has no spare data file yet) are written where the snapshot lies, each byte for byte
    the piece-by-piece encoding (checked in the workers); every process restores the newest step
    bit-exact from its local memory."""
    train = tier_results(tmp_path, "train", "train", steps=6, persist=None, differential=False, in_place=True)
    for r in train:
        assert r["local"] == [5, 6] and all(base for _, _, _, base in r["written"])
        assert r["in_place"] == [2, 3, 4, 5, 6], r["in_place"]
    r = tier_results(tmp_path, "restore", "restore", persist=None, differential=False)
    assert r[0]["restored"] == r[1]["restored"] == 6
    assert r[0]["sources"] == [["local", 0], ["local", 1]] and r[1]["stats"] == ["local"]


@pytest.mark.timeout(300)
def test_crash_in_a_memory_save_or_a_migration_never_mixes_steps(tmp_path):
    """A process that dies in its memory-tier save, or in a migration, leaves no step mixed from two saves.
    Slow (tens of seconds): multi-process jobs run, crash and restore again."""
    # process 1 dies in its local-tier save of step 5 (written, not renamed); process 0 has committed
    # nothing of step 5: the vote never completed
    job = tier_job(
        tmp_path,
        "crash-local",
        "loop",
        persist=2,
        until=9,
        flush_at=[4],
        crash={"process": 1, "at": "local", "step": 5},
    )
    job.wait(lambda: job.procs[1].poll() is not None)
    job.kill()
    assert job.procs[1].returncode == -signal.SIGKILL
    assert max(p["local"] for p in job.progress(0)) == 4
    assert any(".tmp-" in e for e in os.listdir(next((tmp_path / "host1").rglob("local"))))
    # restart: step 4 from local memory everywhere; then process 1 dies inside the migration of step 6
    job = tier_job(
        tmp_path,
        "crash-migrate",
        "loop",
        persist=2,
        until=9,
        crash={"process": 1, "at": "migrate", "write": 1},
    )
    job.wait(lambda: job.procs[1].poll() is not None)
    job.kill()
    first = job.result(0, ".restored")
    assert first["restored"] == 4 and first["sources"] == [["local", 0], ["local", 1]]
    reported = max(p["local"] for p in job.progress(0))
    # restart: the newest step committed in memory (step 6 was, before its migration began), bit-exact
    r = tier_results(tmp_path, "after-migrate", "restore", persist=2)
    assert r[0]["restored"] >= max(6, reported) and r[0]["sources"][0][0] == "local"
    # memory lost: persistent storage holds step 4 (the migration of step 6 never committed)
    for host in tmp_path.glob("host[0-9]"):
        shutil.rmtree(host)
    r = tier_results(tmp_path, "persistent-only", "restore", persist=2)
    assert r[0]["restored"] == 4 and r[0]["sources"] == [["persistent", None]] * 2
    assert sorted(e for e in os.listdir(tmp_path / "ckpt") if e.isdigit()) == ["2", "4"]


@pytest.mark.timeout(300)
def test_a_job_at_a_deleted_runs_path_agrees_to_ignore_its_memory_copies(tmp_path):
    """Issue 44, item 3, with 2 processes: a job saves steps 1-7 in memory (persist=None) and is killed;
    its directory is deleted; a new job at the same path finds no step on any process (every process
    sees every folder's run id in the start round and decides alike), saves its own, and restores them."""
    train = tier_results(tmp_path, "train", "train", steps=7, persist=None)
    assert train[0]["local"] == [6, 7]
    shutil.rmtree(tmp_path / "ckpt")
    fresh = tier_results(tmp_path, "fresh", "loop", persist=None, until=3)
    assert [r["steps"] for r in fresh] == [[], []]
    r = tier_results(tmp_path, "resume", "restore", persist=None)
    assert r[0]["restored"] == r[1]["restored"] == 3 and r[0]["sources"] == [["local", 0], ["local", 1]]
