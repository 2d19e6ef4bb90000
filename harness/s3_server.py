"""A real S3-protocol server on 127.0.0.1 for tests and benchmarks, and a fault-injecting proxy for it.

Scope: test infrastructure only (never imported by flax_ckpt). ``MotoS3`` runs moto's standalone
server in a child process bound to loopback, with IAM auth enforced so permission errors are genuine
403s; it creates an admin user (whose keys the tests use) and a user confined to one bucket.
``FaultProxy`` is an HTTP/1.1 proxy on loopback in front of it that fails a chosen share of requests
(503/500 answers, dropped or reset connections, truncated bodies, a request done upstream whose
answer is lost) so tests see how retries and the commit protocol behave. No traffic leaves the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import json
import os
import random
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Callable

import boto3
from basics import HOST, die_with_parent, free_port

REGION = "us-east-1"
MODES = ("503", "500", "drop", "reset", "truncate", "lost_reply")
_NO_AUTH_ACTIONS = 3  # create_user, put_user_policy, create_access_key (the admin's bootstrap)
_live: set[subprocess.Popen] = set()


@dataclass(frozen=True)
class Keys:
    access_key_id: str
    secret_access_key: str


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stops a server child (``sig``, then SIGKILL after 5 s); shared by gcs_server.py."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    _live.discard(proc)


@atexit.register
def _stop_all() -> None:
    for proc in list(_live):
        _stop(proc)


class MotoS3:
    """moto's S3 server as a child process on 127.0.0.1, with IAM auth on. Use as a context manager."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.admin: Keys | None = None

    def __enter__(self) -> "MotoS3":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_NO_AUTH_ACTIONS), MOTO_PORT=str(self.port))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
        )  # SIGTERM: moto shuts down
        _live.add(self.proc)
        try:
            self._wait_ready(timeout)
            self.admin = self._bootstrap_admin()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with code {self.proc.returncode}")
            with contextlib.suppress(OSError):
                with socket.create_connection((HOST, self.port), timeout=0.5):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"moto server on {self.endpoint} did not start within {timeout:.0f} s")

    def client(self, service: str, keys: Keys | None = None):
        keys = keys or self.admin or Keys("bootstrap", "bootstrap")
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=keys.access_key_id,
            aws_secret_access_key=keys.secret_access_key,
        )

    def _bootstrap_admin(self) -> Keys:
        iam = self.client("iam", Keys("bootstrap", "bootstrap"))
        iam.create_user(UserName="admin")
        iam.put_user_policy(
            UserName="admin", PolicyName="all", PolicyDocument=_policy(["s3:*", "iam:*"], ["*"])
        )
        k = iam.create_access_key(UserName="admin")["AccessKey"]
        return Keys(k["AccessKeyId"], k["SecretAccessKey"])

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"bucket-{uuid.uuid4().hex[:12]}"
        self.client("s3").create_bucket(Bucket=name)
        return name

    def user_confined_to(self, bucket: str) -> Keys:
        """Keys of a new user allowed everything on ``bucket`` and nothing else (403 elsewhere)."""
        iam, user = self.client("iam"), f"user-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=user)
        iam.put_user_policy(
            UserName=user,
            PolicyName="one-bucket",
            PolicyDocument=_policy(["s3:*"], [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]),
        )
        k = iam.create_access_key(UserName=user)["AccessKey"]
        return Keys(k["AccessKeyId"], k["SecretAccessKey"])

    def keys_under(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def get(self, bucket: str, key: str) -> bytes:
        return self.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client("s3").put_object(Bucket=bucket, Key=key, Body=data)


def _policy(actions: list[str], resources: list[str]) -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": actions, "Resource": resources}],
        }
    )


# ------------------------------------------------------------------------------------ fault proxy

Matcher = Callable[[str, str], bool]  # (method, path) -> whether this request may be failed


@dataclass
class Faults:
    """What the proxy does to requests: fail ``rate`` of those ``match`` accepts (rate 1: every one),
    with a mode drawn from ``modes``, reproducibly from ``seed``."""

    rate: float = 0.0
    modes: tuple[str, ...] = MODES
    match: Matcher | None = None
    seed: int = 0
    delay_s: float = 0.0  # added to every forwarded request, so that concurrent requests overlap
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown fault modes {sorted(unknown)}; use {MODES}")
        self.rng = random.Random(self.seed)

    def draw(self, method: str, path: str) -> str | None:
        if self.rate <= 0 or (self.match is not None and not self.match(method, path)):
            return None
        return self.rng.choice(self.modes) if self.rng.random() < self.rate else None


def _s3_error(status: int, code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message></Error>"
    ).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes
    server: "_Server"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = getattr(self, "_upstream", None)
        if conn is None:
            conn = self._upstream = http.client.HTTPConnection(HOST, self.server.upstream_port, timeout=60)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        skip = {"transfer-encoding", "expect", "connection", "content-length"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._upstream = None
            raise
        return resp.status, resp.reason, resp.getheaders(), data

    def _reply(
        self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes, truncate: bool = False
    ) -> None:
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                self.send_header(k, v)
        length = (
            int(dict((k.lower(), v) for k, v in headers).get("content-length", len(data)))
            if self.command == "HEAD"
            else len(data)
        )
        self.send_header("Content-Length", str(length))
        self._end()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data[: len(data) // 2] if truncate else data)
        self.wfile.flush()

    def _abort(self, reset: bool) -> None:
        self._end()
        if reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _handle(self) -> None:
        body = self._body()
        faults = self.server.faults
        self._mode, self._open = faults.draw(self.command, self.path), True
        self.server.record(self.command, self.path, self._mode, +1)
        try:
            if faults.delay_s:
                time.sleep(faults.delay_s)
            self._answer(body, self._mode)
        finally:
            self._end()

    def _end(self) -> None:
        """Logs the request's end before the client can learn of it (so the log's order is causal)."""
        if self._open:
            self._open = False
            self.server.record(self.command, self.path, self._mode, -1)

    def _answer(self, body: bytes, mode: str | None) -> None:
        if mode in ("503", "500"):
            code = {
                "503": ("SlowDown", "Please reduce your request rate."),
                "500": ("InternalError", "We encountered an internal error. Please try again."),
            }[mode]
            self._reply(
                int(mode), "Injected", [("Content-Type", "application/xml")], _s3_error(int(mode), *code)
            )
            return
        if mode in ("drop", "reset"):
            self._abort(reset=mode == "reset")
            return
        try:
            status, reason, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException):
            self._abort(reset=False)
            return
        if mode == "lost_reply" or (mode == "truncate" and (self.command == "HEAD" or len(data) < 2)):
            self._abort(reset=False)  # done upstream, the client never learns it
            return
        self._reply(status, reason, headers, data, truncate=mode == "truncate")
        if mode == "truncate":
            self._abort(reset=False)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # many clients connect at once (the default backlog of 5 drops SYNs)

    def __init__(self, upstream_port: int, faults: Faults):
        super().__init__((HOST, 0), _Handler)
        self.upstream_port, self.faults = upstream_port, faults
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str, str, str | None]] = []  # ("begin"/"end", method, path, mode)
        self.in_flight = self.max_in_flight = 0
        self.sockets: set[socket.socket] = set()

    def record(self, method: str, path: str, mode: str | None, step: int) -> None:
        with self.lock:
            self.log.append(("begin" if step > 0 else "end", method, path, mode))
            self.in_flight += step
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if step < 0:
                return
            self.counts["requests"] += 1
            self.counts[f"requests:{method}"] += 1
            if mode:
                self.counts["injected"] += 1
                self.counts[f"injected:{mode}"] += 1

    def process_request(self, request, client_address) -> None:
        with self.lock:
            self.sockets.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self.lock:
            self.sockets.discard(request)
        super().shutdown_request(request)

    def close_all(self) -> None:
        with self.lock:
            socks = list(self.sockets)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream_port``; set ``faults`` to inject failures."""

    def __init__(self, upstream_port: int, faults: Faults | None = None):
        self._server = _Server(upstream_port, faults or Faults())
        self.port = self._server.server_address[1]
        self.endpoint = f"http://{HOST}:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True
        )
        self._thread.start()

    @property
    def faults(self) -> Faults:
        return self._server.faults

    @faults.setter
    def faults(self, value: Faults) -> None:
        self._server.faults = value

    @property
    def counts(self) -> Counter[str]:
        with self._server.lock:
            return Counter(self._server.counts)

    @property
    def log(self) -> list[tuple[str, str, str, str | None]]:
        """Every request as ("begin" | "end", method, path with query, injected mode or None)."""
        with self._server.lock:
            return list(self._server.log)

    @property
    def max_in_flight(self) -> int:
        with self._server.lock:
            return self._server.max_in_flight

    def reset_stats(self) -> None:
        with self._server.lock:
            self._server.counts.clear()
            self._server.log.clear()
            self._server.max_in_flight = self._server.in_flight

    def close(self) -> None:
        self._server.shutdown()
        self._server.close_all()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
