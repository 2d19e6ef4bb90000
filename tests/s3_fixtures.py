"""pytest fixtures for object-storage tests: a moto S3 server on 127.0.0.1 and a fault proxy before it.

Scope: fixtures only (the servers live in harness/s3_server.py), loaded as a pytest plugin by conftest.py
(``pytest_plugins``), so every test module can ask for them by name; ``S3Place`` and ``point_env_at``
are imported by name where a test needs them. s3_server (boto3, moto) is imported only when a fixture
runs, so a run without the test extra (scripts/test_min.sh) still loads this plugin. ``s3`` points
flax_ckpt at the server through the usual environment variables (endpoint, keys, region, plus short
retry backoff so fault tests stay fast) and gives a fresh prefix per test; ``s3_faulty`` does the
same through a FaultProxy. Every server and proxy is stopped at teardown, also when the test fails.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from s3_server import FaultProxy, Keys, MotoS3

_CLEARED = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "FLAX_CKPT_STORAGE_CONCURRENCY",
)


@dataclass(frozen=True)
class S3Place:
    """Where one test writes: ``url`` is s3://<bucket>/<fresh prefix>; ``endpoint`` is what flax_ckpt
    talks to (the server, or the proxy in front of it)."""

    server: MotoS3
    bucket: str
    prefix: str
    endpoint: str
    proxy: FaultProxy | None = None

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def keys(self, under: str = "") -> list[str]:
        """Object keys below the prefix (relative to it), straight from the server."""
        base = f"{self.prefix}/{under}".rstrip("/")
        return [k[len(self.prefix) + 1 :] for k in self.server.keys_under(self.bucket, base)]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3]:
    """moto's S3 server (IAM auth on), one per test session, stopped at its end."""
    from s3_server import MotoS3

    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def s3_bucket(s3_server: MotoS3) -> str:
    return s3_server.create_bucket()


def point_env_at(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, keys: Keys, *, attempts: int = 6, delay_s: float = 0.005
) -> None:
    """The environment a user would set for an S3-compatible server, with short retry backoff."""
    from s3_server import REGION

    for var in _CLEARED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLAX_CKPT_S3_ENDPOINT", endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys.secret_access_key)
    monkeypatch.setenv("FLAX_CKPT_STORAGE_MAX_ATTEMPTS", str(attempts))
    monkeypatch.setenv("FLAX_CKPT_STORAGE_RETRY_DELAY", str(delay_s))


@pytest.fixture
def s3(s3_server: MotoS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> S3Place:
    """A fresh prefix on the S3 server, reached directly; the environment points flax_ckpt at it."""
    assert s3_server.admin is not None
    point_env_at(monkeypatch, s3_server.endpoint, s3_server.admin)
    return S3Place(s3_server, s3_bucket, f"t-{uuid.uuid4().hex[:10]}", s3_server.endpoint)


@pytest.fixture
def s3_faulty(s3_server: MotoS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Place]:
    """Like ``s3`` but through a FaultProxy (no faults until the test sets ``place.proxy.faults``)."""
    from s3_server import FaultProxy, Faults

    assert s3_server.admin is not None
    with FaultProxy(s3_server.port, Faults()) as proxy:
        point_env_at(monkeypatch, proxy.endpoint, s3_server.admin)
        yield S3Place(s3_server, s3_bucket, f"t-{uuid.uuid4().hex[:10]}", proxy.endpoint, proxy)
