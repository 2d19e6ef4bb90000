"""Object storage, what only s3:// has: over a real S3-protocol server (moto's standalone server on
127.0.0.1, IAM auth on, so 403s are genuine), explicit options and a kvstore spec without credentials in
the environment, a missing bucket and refused keys (each a clear permanent error, not retried), and the
mapping of s3:// and gs:// URLs to tensorstore specs. The cases s3:// shares with gs:// (round trips, the
commit-object protocol, faults through a proxy, the manager, a 2-process save) are in
test_object_stores.py, run on both stores. Nothing leaves the machine.
"""

from __future__ import annotations

import time

import pytest
import tensorstore as ts

import flax_ckpt as fc
from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.engine import restore as engine
from flax_ckpt._src.engine.snapshot import snapshot
from flax_ckpt._src.native.layout import NativeLayout, open_native
from flax_ckpt._src.serializers import get_serializer
from flax_ckpt._src.storage import KvStorage, LocalStorage, ObjectStoreOptions, open_storage, split_location
from helpers import Within, assert_bit_exact
from object_stores import small_tree
from s3_fixtures import S3Place, point_env_at

# ------------------------------------------------------------------------------- explicit options


def test_kvstore_spec_and_explicit_options_without_credentials_in_env(s3: S3Place, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "FLAX_CKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var)
    keys = s3.server.admin
    opts = ObjectStoreOptions(
        endpoint=s3.endpoint,
        access_key_id=keys.access_key_id,
        secret_access_key=keys.secret_access_key,
        max_attempts=2,
        retry_delay_s=0.01,
    )
    parent = open_storage({"driver": "s3", "bucket": s3.bucket, "path": s3.prefix}, options=opts)
    assert parent.url == s3.url and parent.spec["aws_region"] == "us-east-1"
    tree = small_tree(2)
    NativeLayout(get_serializer("raw")).persist(
        snapshot(tree), parent, "ck", step=None, metrics=None, metadata=None
    )
    folder = parent.sub("ck")
    assert_bit_exact(engine.restore(open_native(folder), tree), tree)
    again, name = split_location(folder)
    assert (again.url, name) == (s3.url, "ck") and again.exists(f"ck/{MANIFEST}")


# ------------------------------------------------------------------------------- permanent errors


def test_missing_bucket_is_a_clear_permanent_error(s3: S3Place):
    with Within(5, "a save and a restore into a missing bucket (not retried)"):
        with pytest.raises(fc.StorageError, match="bucket does not exist") as err:
            fc.save("s3://no-such-bucket-x1/run/ck", small_tree())
        assert "s3://no-such-bucket-x1/run" in str(err.value)
        with pytest.raises(fc.StorageError, match="bucket does not exist"):
            fc.restore("s3://no-such-bucket-x1/run/ck")


def test_access_denied_is_a_clear_permanent_error(s3: S3Place, monkeypatch):
    other = s3.server.create_bucket()
    confined = s3.server.user_confined_to(other)
    point_env_at(monkeypatch, s3.endpoint, confined)
    with Within(10, "two refused operations and a save (not retried)"):
        with pytest.raises(fc.StorageError, match="permission denied") as err:
            fc.save(f"{s3.url}/ck", small_tree())
        assert f"{s3.url}" in str(err.value) and "not retried" in str(err.value)
        fc.save(f"s3://{other}/ok/ck", small_tree())  # the bucket it may use works with the same keys
        bad = open_storage(
            s3.url, options=ObjectStoreOptions(access_key_id="AKIAWRONG", secret_access_key="x")
        )
        with pytest.raises(fc.StorageError, match="permission denied"):
            bad.list()


# ------------------------------------------------------------------------- spec mapping (no server)


def test_s3_and_gs_urls_map_to_tensorstore_specs(monkeypatch):
    for var in (
        "FLAX_CKPT_S3_ENDPOINT",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
    ):
        monkeypatch.delenv(var, raising=False)
    gs = open_storage("gs://my-bucket/runs/a/")
    assert isinstance(gs, KvStorage) and gs.spec == {
        "driver": "gcs",
        "bucket": "my-bucket",
        "path": "runs/a/",
    }
    assert gs.url == "gs://my-bucket/runs/a" and gs.sub("7").kvstore_spec("z")["path"] == "runs/a/7/z/"
    ts.KvStore.Spec(gs.spec)  # a valid tensorstore spec
    assert open_storage({"driver": "gcs", "bucket": "my-bucket", "path": "x"}).url == "gs://my-bucket/x"
    with pytest.raises(ValueError, match="s3:// only"):
        open_storage("gs://my-bucket/x", options={"region": "eu-west-1"})
    gs_at = open_storage("gs://my-bucket/x", options={"endpoint": "http://127.0.0.1:1/"})  # tests/test_gcs.py
    assert gs_at.endpoint == "http://127.0.0.1:1" and gs_at.spec == {
        "driver": "gcs",
        "bucket": "my-bucket",
        "path": "x/",
    }
    s3s = open_storage("s3://bkt/p")
    assert s3s.spec == {"driver": "s3", "bucket": "bkt", "path": "p/"}  # region left to tensorstore
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("FLAX_CKPT_S3_ENDPOINT", "http://127.0.0.1:8")
    assert open_storage("s3://bkt/p").spec["endpoint"] == "http://127.0.0.1:8"
    explicit = open_storage(
        {"driver": "s3", "bucket": "bkt", "endpoint": "http://127.0.0.1:7"}, options={"region": "eu-west-1"}
    )
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
