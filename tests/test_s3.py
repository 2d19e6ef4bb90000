"""Object storage: fc.save / restore / metadata and the manager over a real S3-protocol server.

The server is moto's standalone S3 server on 127.0.0.1 (IAM auth on, so 403s are genuine); fault tests
go through a proxy that fails requests (503/500, dropped or reset connections, truncated bodies,
replies lost after the server acted). Nothing leaves the machine. Also covered: the commit-object
protocol (objects first, manifest last and only if absent, deletion manifest first), permanent errors,
explicit options, and the mapping of s3:// and gs:// to tensorstore specs.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import flax_ckpt as fc
from flax_ckpt._src.engine import restore as engine
from flax_ckpt._src.native.layout import NativeLayout, open_native
from flax_ckpt._src.engine.snapshot import snapshot
from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src.storage import kv as storage_mod
from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.serializers import get_serializer
from flax_ckpt._src.storage import KvStorage, LocalStorage, ObjectStoreOptions, open_storage, split_location

from helpers import assert_bit_exact
from s3_fixtures import S3Place, point_env_at
from s3_server import Faults
from trees import mixed_tree

SERIALIZERS = ["raw", "zarr3"]


def small_tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32), "b": rng.integers(0, 9, (7,), np.int64),
            "step": seed, "nested": {"h": rng.standard_normal((5, 3)).astype(np.float16)}}


def manifest_keys(place: S3Place) -> list[str]:
    return [k for k in place.keys() if k.endswith("/" + MANIFEST) or k == MANIFEST]


# ------------------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_save_restore_metadata_bit_exact(s3: S3Place, serializer: str):
    tree = mixed_tree()
    path = f"{s3.url}/ck"
    fc.save(path, tree, serializer=serializer, metadata={"run": "s3"}, step=3, metrics={"loss": 0.5})
    assert_bit_exact(fc.restore(path, tree), tree)
    plain = fc.restore(path)
    np.testing.assert_array_equal(plain["jax"]["w"], np.asarray(tree["jax"]["w"]))
    info = fc.metadata(path)
    assert (info.step, info.metrics, info.metadata, info.serializer) == (3, {"loss": 0.5}, {"run": "s3"}, serializer)
    assert info.leaves["jax/w"].shape == (3, 4)
    assert "ck/" + MANIFEST in s3.keys()  # really on the server, under the prefix


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_sharded_save_restores_into_another_sharding(s3: S3Place, serializer: str):
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = Mesh(devices, ("data", "model"))
    x = jax.device_put(np.arange(32 * 6, dtype=np.float32).reshape(32, 6), NamedSharding(mesh, P("data", "model")))
    path = f"{s3.url}/sharded"
    fc.save(path, {"x": x}, serializer=serializer)
    other = NamedSharding(mesh, P("model", None))
    out = fc.restore(path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other)})
    assert out["x"].sharding == other
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))


def test_large_reads_run_as_parallel_ranged_requests(s3_faulty: S3Place, monkeypatch):
    monkeypatch.setattr(storage_mod, "_PART", 64 << 10)  # 64 KiB parts: a 1 MiB leaf takes 16 requests
    tree = {"big": np.random.default_rng(1).standard_normal((256, 1024)).astype(np.float32)}
    path = f"{s3_faulty.url}/big"
    fc.save(path, tree, serializer="raw")
    s3_faulty.proxy.faults = Faults(delay_s=0.05)  # every request takes 50 ms, so concurrent ones overlap
    s3_faulty.proxy.reset_stats()
    assert_bit_exact(fc.restore(path, tree), tree)
    gets = [e for e in s3_faulty.proxy.log if e[0] == "begin" and e[1] == "GET" and "/data/" in e[2]]
    assert len(gets) >= 16
    assert s3_faulty.proxy.max_in_flight >= 8


def test_refuses_to_overwrite_a_committed_checkpoint(s3: S3Place):
    path = f"{s3.url}/ck"
    fc.save(path, small_tree())
    with pytest.raises(fc.CheckpointExistsError, match=s3.url):
        fc.save(path, small_tree(1))
    assert_bit_exact(fc.restore(path, small_tree()), small_tree())


def test_kvstore_spec_and_explicit_options_without_credentials_in_env(s3: S3Place, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "FLAX_CKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var)
    keys = s3.server.admin
    opts = ObjectStoreOptions(endpoint=s3.endpoint, access_key_id=keys.access_key_id,
                              secret_access_key=keys.secret_access_key, max_attempts=2, retry_delay_s=0.01)
    parent = open_storage({"driver": "s3", "bucket": s3.bucket, "path": s3.prefix}, options=opts)
    assert parent.url == s3.url and parent.spec["aws_region"] == "us-east-1"
    tree = small_tree(2)
    NativeLayout(get_serializer("raw")).persist(snapshot(tree), parent, "ck", step=None, metrics=None, metadata=None)
    folder = parent.sub("ck")
    assert_bit_exact(engine.restore(open_native(folder), tree), tree)
    again, name = split_location(folder)
    assert (again.url, name) == (s3.url, "ck") and again.exists(f"ck/{MANIFEST}")


# --------------------------------------------------------------------------------- commit protocol

def test_uncommitted_step_is_ignored_by_restore_and_listing(s3: S3Place):
    fc.save(f"{s3.url}/1", small_tree(1))
    fc.save(f"{s3.url}/2", small_tree(2))
    s3.server.client("s3").delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/2/{MANIFEST}")  # data, no commit
    assert any(k.startswith("2/data/") for k in s3.keys())
    with pytest.raises(fc.CheckpointNotCommittedError, match="no committed checkpoint"):
        fc.restore(f"{s3.url}/2")
    with pytest.raises(fc.CheckpointNotCommittedError):
        fc.metadata(f"{s3.url}/2")
    with fc.CheckpointManager(s3.url, async_save=False) as mgr:
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    assert not any(k.startswith("2/") for k in s3.keys())  # the manager removed the leftovers


def test_commit_object_is_written_last_and_only_once(s3_faulty: S3Place):
    path = f"{s3_faulty.url}/ck"
    fc.save(path, {"a": np.ones((300, 300), np.float32), "b": np.arange(10)}, serializer="zarr3")
    log = s3_faulty.proxy.log
    writes = [(i, e) for i, e in enumerate(log) if e[1] == "PUT"]
    manifest = [i for i, e in writes if e[2].split("?")[0].endswith("/ck/" + MANIFEST)]
    assert len(manifest) == 2  # begin and end of one PUT
    data_ends = [i for i, e in writes if e[0] == "end" and not e[2].split("?")[0].endswith(MANIFEST)]
    assert data_ends and max(data_ends) < manifest[0]  # every data object was stored before the commit


def test_commit_refuses_a_commit_object_written_meanwhile(s3: S3Place):
    parent = open_storage(s3.url)
    parent.sub("ck").write("data/x.bin", [b"x"])
    s3.server.put(s3.bucket, f"{s3.prefix}/ck/{MANIFEST}", b"another writer's commit")
    with pytest.raises(fc.CheckpointExistsError, match="committed by another writer"):
        commit_mod.commit(parent, "ck", "ck", MANIFEST, b"ours")
    assert s3.server.get(s3.bucket, f"{s3.prefix}/ck/{MANIFEST}") == b"another writer's commit"


def test_delete_removes_the_commit_object_first(s3_faulty: S3Place):
    parent = open_storage(s3_faulty.url)
    fc.save(f"{s3_faulty.url}/ck", small_tree())
    # every delete of a data object fails: the step must end up uncommitted, never half-deleted & visible
    s3_faulty.proxy.faults = Faults(rate=1.0, modes=("503",), match=lambda m, p: m in ("DELETE", "POST")
                                    and MANIFEST not in p)
    s3_faulty.proxy.reset_stats()
    with pytest.raises(fc.StorageError, match=f"{s3_faulty.url}/ck"):
        commit_mod.remove(parent, "ck", MANIFEST)
    deletes = [e for e in s3_faulty.proxy.log if e[0] == "begin" and e[1] in ("DELETE", "POST")]
    assert MANIFEST in deletes[0][2]
    assert not commit_mod.is_committed(parent, "ck", MANIFEST) and any(k.startswith("ck/data/") for k in s3_faulty.keys())
    s3_faulty.proxy.faults = Faults()
    commit_mod.remove(parent, "ck", MANIFEST)  # a retry finishes the job
    assert s3_faulty.keys() == []


# ---------------------------------------------------------------------------------------- faults

@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_transient_faults_are_retried_and_commit_correct_checkpoints(s3_faulty: S3Place, serializer: str):
    s3_faulty.proxy.faults = Faults(rate=0.25, seed=7)
    tree = mixed_tree()
    path = f"{s3_faulty.url}/ck"
    fc.save(path, tree, serializer=serializer)
    assert_bit_exact(fc.restore(path, tree), tree)
    counts = s3_faulty.proxy.counts
    assert counts["injected"] >= 5, counts
    assert len({m for m in counts if m.startswith("injected:")}) >= 3, counts


def test_faults_beyond_the_retries_fail_clearly_and_commit_nothing(s3_faulty: S3Place):
    s3_faulty.proxy.faults = Faults(rate=1.0, modes=("503", "reset"),
                                    match=lambda m, p: m == "PUT" and "/data/" in p)
    path = f"{s3_faulty.url}/ck"
    t0 = time.perf_counter()
    with pytest.raises(fc.StorageError, match="outlasted every retry") as err:
        fc.save(path, small_tree())
    assert s3_faulty.url in str(err.value) and time.perf_counter() - t0 < 20
    assert manifest_keys(s3_faulty) == []
    s3_faulty.proxy.faults = Faults()
    with pytest.raises((fc.CheckpointNotCommittedError, fc.CheckpointNotFoundError)):
        fc.restore(path)
    fc.save(path, small_tree())  # the same step saves fine once the store recovers
    assert_bit_exact(fc.restore(path, small_tree()), small_tree())


@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
def test_random_faults_never_commit_a_corrupt_checkpoint(s3_faulty: S3Place, monkeypatch, serializer: str):
    point_env_at(monkeypatch, s3_faulty.endpoint, s3_faulty.server.admin, attempts=2, delay_s=0.002)
    outcomes = []
    for i in range(6):
        s3_faulty.proxy.faults = Faults(rate=0.35, seed=100 + i)
        path, tree = f"{s3_faulty.url}/{i}", small_tree(i)
        try:
            fc.save(path, tree, serializer=serializer)
            outcomes.append("saved")
        except fc.StorageError as e:
            assert s3_faulty.url in str(e)
            outcomes.append("failed")
        s3_faulty.proxy.faults = Faults()
        if commit_mod.is_committed(open_storage(s3_faulty.url), str(i), MANIFEST):
            assert_bit_exact(fc.restore(path, tree), tree)  # committed => complete and correct
        else:
            assert outcomes[-1] == "failed"
    assert "saved" in outcomes and "failed" in outcomes, outcomes


# ------------------------------------------------------------------------------- permanent errors

def test_missing_bucket_is_a_clear_permanent_error(s3: S3Place):
    t0 = time.perf_counter()
    with pytest.raises(fc.StorageError, match="bucket does not exist") as err:
        fc.save("s3://no-such-bucket-x1/run/ck", small_tree())
    assert "s3://no-such-bucket-x1/run" in str(err.value)
    with pytest.raises(fc.StorageError, match="bucket does not exist"):
        fc.restore("s3://no-such-bucket-x1/run/ck")
    assert time.perf_counter() - t0 < 5  # not retried


def test_access_denied_is_a_clear_permanent_error(s3: S3Place, monkeypatch):
    other = s3.server.create_bucket()
    confined = s3.server.user_confined_to(other)
    point_env_at(monkeypatch, s3.endpoint, confined)
    t0 = time.perf_counter()
    with pytest.raises(fc.StorageError, match="permission denied") as err:
        fc.save(f"{s3.url}/ck", small_tree())
    assert f"{s3.url}" in str(err.value) and "not retried" in str(err.value)
    fc.save(f"s3://{other}/ok/ck", small_tree())  # the bucket it may use works with the same keys
    bad = open_storage(s3.url, options=ObjectStoreOptions(access_key_id="AKIAWRONG", secret_access_key="x"))
    with pytest.raises(fc.StorageError, match="permission denied"):
        bad.list()
    assert time.perf_counter() - t0 < 10


# --------------------------------------------------------------------------- manager over S3

def test_manager_save_list_restore_and_retention(s3: S3Place):
    url = f"{s3.url}/run"
    with fc.CheckpointManager(url, max_to_keep=2) as mgr:
        for step in range(1, 5):
            assert mgr.save(step, small_tree(step), metrics={"loss": 1.0 / step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
        assert_bit_exact(mgr.restore(target=small_tree(4)), small_tree(4))
    assert sorted({k.split("/")[1] for k in s3.keys("run")}) == ["3", "4"]  # older steps' objects are gone
    with fc.CheckpointManager(url, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4
        assert_bit_exact(mgr.restore(3, small_tree(3)), small_tree(3))


# ------------------------------------------------------------------------- spec mapping (no server)

def test_s3_and_gs_urls_map_to_tensorstore_specs(monkeypatch):
    for var in ("FLAX_CKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION",
                "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    gs = open_storage("gs://my-bucket/runs/a/")
    assert isinstance(gs, KvStorage) and gs.spec == {"driver": "gcs", "bucket": "my-bucket", "path": "runs/a/"}
    assert gs.url == "gs://my-bucket/runs/a" and gs.sub("7").kvstore_spec("z")["path"] == "runs/a/7/z/"
    ts.KvStore.Spec(gs.spec)  # a valid tensorstore spec
    assert open_storage({"driver": "gcs", "bucket": "my-bucket", "path": "x"}).url == "gs://my-bucket/x"
    with pytest.raises(ValueError, match="s3:// only"):
        open_storage("gs://my-bucket/x", options={"endpoint": "http://127.0.0.1:1"})
    s3s = open_storage("s3://bkt/p")
    assert s3s.spec == {"driver": "s3", "bucket": "bkt", "path": "p/"}  # region left to tensorstore
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("FLAX_CKPT_S3_ENDPOINT", "http://127.0.0.1:8")
    assert open_storage("s3://bkt/p").spec["endpoint"] == "http://127.0.0.1:8"
    explicit = open_storage({"driver": "s3", "bucket": "bkt", "endpoint": "http://127.0.0.1:7"}, options={"region": "eu-west-1"})
    assert explicit.spec["endpoint"] == "http://127.0.0.1:7" and explicit.spec["aws_region"] == "eu-west-1"
    parent, name = split_location("s3://bkt/p/run/12")
    assert (parent.url, parent.spec["path"], name) == ("s3://bkt/p/run", "p/run/", "12")
    assert isinstance(open_storage({"driver": "file", "path": "/tmp/x"}), LocalStorage)
    with pytest.raises(fc.StorageError, match="no bucket"):
        open_storage("s3:///p")
    with pytest.raises(ValueError, match="FLAX_CKPT_STORAGE_MAX_ATTEMPTS"):
        monkeypatch.setenv("FLAX_CKPT_STORAGE_MAX_ATTEMPTS", "many")
        open_storage("s3://bkt/p")
    with pytest.raises(ValueError, match="together"):
        ObjectStoreOptions(access_key_id="a")



@pytest.mark.timeout(200)
def test_two_process_sharded_save_and_manager_over_s3(s3: S3Place, tmp_path):
    """A real 2-process jax.distributed job (gloo, 127.0.0.1) saving sharded state to the S3 server:
    each process uploads its own shards, process 0 writes the one manifest last; retention deletes."""
    from test_distributed import mp_job

    job = mp_job(tmp_path, "s3", "s3", 2, 2, dir=s3.url).start()
    try:
        results = job.check_ok(job.join())
    finally:
        job.kill()
    assert [r["steps"] for r in results] == [[2, 3], [2, 3]]
    body = open_native(open_storage(f"{s3.url}/ts")).body
    assert body["process_count"] == 2
    assert {name.split("/")[1].split(".")[0] for name in body["files"]} == {"p0", "p1"}
    assert not [k for k in s3.keys("ts") if k.startswith("ts/parts/")]  # the per-process parts are merged
    assert sorted({k.split("/")[1] for k in s3.keys("mgr")}) == ["2", "3"]  # step 1's objects are gone
