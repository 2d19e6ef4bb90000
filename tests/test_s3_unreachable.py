"""An s3:// endpoint that cannot be reached fails within seconds, naming the endpoint and the fix.

Scope: the fail-fast endpoint check of flax_ckpt/_src/storage/endpoints.py (check_endpoint) and the messages
of explain() for connection failures. A refused port on 127.0.0.1 and a host under .invalid (which
never resolves, and is not sent to a resolver) fail fast in a real child process, without tensorstore's
C++ (absl) log lines on stderr; a server that accepts connections keeps tensorstore's retries (503s,
then success); the check runs once per endpoint per process; an endpoint that dies after the check
fails after the retries with a message that does not suggest more retries. Traffic stays on loopback.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from itertools import count

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src.storage import ObjectStoreOptions, open_storage
from flax_ckpt._src.storage import endpoints as endpoints_mod
from helpers import HOST, Within, free_port, refused_port, worker_env

ABSL_LINE = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ", re.M
)  # e.g. "E1204 16:19:08.033383   11027 "
FAST_S = 10

_CHILD = r"""
import json, sys, time
import numpy as np
import flax_ckpt as fc

url, results = sys.argv[1], []
for name, op in (("save", lambda: fc.save(url + "/ck", {"w": np.ones(3)})),
                 ("restore", lambda: fc.restore(url + "/ck")),
                 ("manager", lambda: fc.CheckpointManager(url + "/run"))):
    t0 = time.perf_counter()
    try:
        op()
        results.append({"op": name, "error": None})
    except Exception as e:
        results.append({"op": name, "error": type(e).__name__, "checkpoint_error": isinstance(e, fc.CheckpointError),
                        "message": str(e), "seconds": time.perf_counter() - t0})
print(json.dumps(results))
"""


def child_env(tmp_path, endpoint: str) -> dict[str, str]:
    """A first-time user's environment: an endpoint, no credentials (tensorstore's default AWS chain,
    which logged to stderr), an empty HOME, and no EC2 metadata lookups (they would leave loopback)."""
    env = {
        k: v
        for k, v in worker_env(devices=1).items()
        if not k.startswith(("AWS_", "FLAX_CKPT_"))
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    home = tmp_path / "home"
    home.mkdir()
    return dict(env, HOME=str(home), AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["refused", "unresolvable"])
def test_unreachable_endpoint_fails_fast_and_quietly_in_a_real_process(tmp_path, kind):
    refused = contextlib.ExitStack()
    endpoint = (
        f"http://{HOST}:{refused.enter_context(refused_port())}"
        if kind == "refused"
        else "http://nosuchhost.invalid:9000"
    )
    env = child_env(tmp_path, endpoint)
    with refused, Within(45, "three operations and the interpreter's start") as limit:
        try:
            done = forkserver.run(
                [sys.executable, "-c", _CHILD, "s3://bucket/prefix"],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=240,
            )
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            pytest.fail(f"no error within {e.timeout:.0f} s (the retries ran)\nstderr: {stderr}")
    assert done.returncode == 0, done.stderr
    for r in json.loads(done.stdout.strip().splitlines()[-1]):
        assert r["error"] == "StorageError" and r["checkpoint_error"], r
        limit.check(r["seconds"], FAST_S, f"the child's {r['op']}")
        assert endpoint in r["message"] and "s3://bucket/prefix" in r["message"], r
        assert "Start the server, or fix the endpoint" in r["message"], r
        assert "environment variable AWS_ENDPOINT_URL" in r["message"], r
        assert "max_attempts" not in r["message"], r
    assert not ABSL_LINE.search(done.stderr), done.stderr


def test_refused_endpoint_from_options_names_its_source(monkeypatch):
    for var in ("FLAX_CKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    with refused_port() as port:
        endpoint = f"http://{HOST}:{port}"
        storage = open_storage(
            "s3://bucket/p",
            options=ObjectStoreOptions(
                endpoint=endpoint, access_key_id="x", secret_access_key="y", max_attempts=10
            ),
        )
        with Within(FAST_S, "a list from a refused endpoint"):
            with pytest.raises(fc.StorageError, match="refused the connection") as err:
                storage.list()
    assert endpoint in str(err.value) and "ObjectStoreOptions.endpoint" in str(err.value)
    assert str(err.value).startswith("s3://bucket/p: ")  # not wrapped again as "list of ... failed"


def test_a_name_no_resolver_accepts_fails_fast():
    endpoint = f"http://{'a' * 64}.example:9000"  # a label over 63 characters: not a valid host name
    with Within(FAST_S, "the check of a name no resolver accepts"):
        with pytest.raises(fc.StorageError, match="does not resolve"):
            endpoints_mod.check_endpoint(endpoint, "s3://bucket/p")


class Listener:
    """A TCP socket listening on 127.0.0.1 that counts the connections it accepts (and says nothing)."""

    def __init__(self):
        self.sock = socket.create_server((HOST, 0))
        self.sock.settimeout(0.2)
        self.endpoint = f"http://{HOST}:{self.sock.getsockname()[1]}"

    def accepted(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                return n
            conn.close()
            n += 1

    def close(self) -> None:
        self.sock.close()


def test_checked_once_per_endpoint_per_process(monkeypatch):
    # a fresh record of checked endpoints: an earlier test's listener may have had this port
    monkeypatch.setattr(endpoints_mod, "_checked", set())
    listener = Listener()
    try:
        for _ in range(3):
            endpoints_mod.check_endpoint(listener.endpoint, "s3://bucket/p")
        assert listener.accepted() == 1
    finally:
        listener.close()


def test_a_proxy_in_the_way_skips_the_check(monkeypatch):
    monkeypatch.setenv("http_proxy", f"http://{HOST}:{free_port()}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    endpoints_mod.check_endpoint(f"http://{HOST}:{free_port()}", "s3://bucket/p")  # only the proxy knows


def test_an_endpoint_that_dies_after_the_check_names_the_endpoint_not_more_retries(monkeypatch):
    listener = Listener()
    endpoints_mod.check_endpoint(listener.endpoint, "s3://bucket/p")  # reachable now: checked, and cached
    listener.close()  # the server goes away
    for var, value in {
        "AWS_ENDPOINT_URL": listener.endpoint,
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "FLAX_CKPT_STORAGE_MAX_ATTEMPTS": "2",
        "FLAX_CKPT_STORAGE_RETRY_DELAY": "0.005",
    }.items():
        monkeypatch.setenv(var, value)
    for var in ("FLAX_CKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(fc.StorageError, match="no connection to the endpoint") as err:
        fc.save("s3://bucket/p/ck", {"w": np.ones(3)})
    assert "s3://bucket/p" in str(err.value) and "AWS_ENDPOINT_URL" in str(err.value)
    assert "max_attempts" not in str(err.value)


def test_a_server_answering_503_keeps_the_retries(s3_faulty):
    from s3_server import Faults

    first = count()
    s3_faulty.proxy.faults = Faults(rate=1.0, modes=("503",), match=lambda method, path: next(first) < 3)
    tree = {"w": np.arange(12, dtype=np.float32)}
    fc.save(f"{s3_faulty.url}/ck", tree)
    np.testing.assert_array_equal(fc.restore(f"{s3_faulty.url}/ck", tree)["w"], tree["w"])
    assert s3_faulty.proxy.counts["injected:503"] == 3
