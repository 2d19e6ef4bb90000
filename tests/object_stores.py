"""One face for the two object stores the tests run against, and the helpers their test modules share.

Scope: support for tests/test_object_stores.py (the cases that run on both stores, parametrized over
them), test_s3.py and test_gcs.py (the cases only one store has). ``Store`` wraps where one test
writes, an ``S3Place`` (s3_fixtures.py: moto, a FaultProxy before it) or a ``GcsPlace``
(gcs_fixtures.py: fake-gcs-server, a GcsFront before it), and says what the two protocols say
differently: how the server deletes an object, which requests write an object, read data or delete,
which faults fail every data upload, and the environment that points flax_ckpt at the store.
``STORES`` maps a URL scheme ("s3", "gs") to its class; each class names the fixtures that give its
place (``fixture`` direct, ``faulty_fixture`` through a fault proxy of its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pytest

from flax_ckpt._src.checks import MANIFEST
from gcs_fixtures import GcsPlace, point_env_at_gcs
from s3_fixtures import S3Place, point_env_at

if TYPE_CHECKING:
    from s3_server import FaultProxy, Faults

SERIALIZERS = ["raw", "zarr3"]


def small_tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "b": rng.integers(0, 9, (7,), np.int64),
        "step": seed,
        "nested": {"h": rng.standard_normal((5, 3)).astype(np.float16)},
    }


def manifest_keys(place: S3Place | GcsPlace | Store) -> list[str]:
    return [k for k in place.keys() if k.endswith("/" + MANIFEST) or k == MANIFEST]


class Store:
    """A fresh prefix on one store: ``url`` (<scheme>://<bucket>/<prefix>), ``keys`` straight from the
    server, ``server`` (put / get by bucket and key), ``proxy`` (the fault proxy flax_ckpt talks through;
    the session's GcsFront for a direct gs:// place, None for a direct s3:// one)."""

    scheme: ClassVar[str]
    fixture: ClassVar[str]
    faulty_fixture: ClassVar[str]
    delete_methods: ClassVar[tuple[str, ...]]  # the requests that delete objects
    random_faults: ClassVar[
        tuple[int, float]
    ]  # (attempts, fault rate) at which 6 saves both fail and succeed

    def __init__(self, place: S3Place | GcsPlace):
        self.place = place
        self.url, self.bucket, self.prefix = place.url, place.bucket, place.prefix
        self.endpoint, self.server, self.keys = place.endpoint, place.server, place.keys

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url})"

    @property
    def proxy(self) -> FaultProxy | None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Deletes object ``key`` (relative to the prefix) on the server, behind flax_ckpt's back."""
        raise NotImplementedError

    def point_env(self, monkeypatch: pytest.MonkeyPatch, *, attempts: int, delay_s: float) -> None:
        """The environment for this store again, with other retry settings."""
        raise NotImplementedError

    def written(self, method: str, path: str) -> str | None:
        """The object a request (as the proxy logs it) writes, None for any other request."""
        raise NotImplementedError

    def reads_data(self, method: str, path: str) -> bool:
        """Whether a request reads an object's bytes (not its metadata, not a listing)."""
        raise NotImplementedError

    def failing_data_uploads(self) -> Faults:
        """Faults that fail every upload of a data object, whatever the retries."""
        raise NotImplementedError


class S3Store(Store):
    scheme, fixture, faulty_fixture = "s3", "s3", "s3_faulty"
    delete_methods = ("DELETE", "POST")  # POST: DeleteObjects, many keys a request
    random_faults = (2, 0.35)

    @property
    def proxy(self) -> FaultProxy | None:
        return self.place.proxy

    def delete(self, key: str) -> None:
        self.server.client("s3").delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")

    def point_env(self, monkeypatch: pytest.MonkeyPatch, *, attempts: int, delay_s: float) -> None:
        point_env_at(monkeypatch, self.endpoint, self.server.admin, attempts=attempts, delay_s=delay_s)

    def written(self, method: str, path: str) -> str | None:
        return path.split("?")[0] if method == "PUT" else None

    def reads_data(self, method: str, path: str) -> bool:
        return method == "GET" and "/data/" in path

    def failing_data_uploads(self) -> Faults:
        from s3_server import Faults

        return Faults(rate=1.0, modes=("503", "reset"), match=lambda m, p: m == "PUT" and "/data/" in p)


class GcsStore(Store):
    scheme, fixture, faulty_fixture = "gs", "gcs", "gcs_faulty"
    delete_methods = ("DELETE",)  # POST is an upload
    random_faults = (1, 0.4)

    @property
    def proxy(self) -> FaultProxy | None:
        return self.place.front

    def delete(self, key: str) -> None:
        self.server.delete(self.bucket, f"{self.prefix}/{key}")

    def point_env(self, monkeypatch: pytest.MonkeyPatch, *, attempts: int, delay_s: float) -> None:
        point_env_at_gcs(monkeypatch, self.endpoint, attempts=attempts, delay_s=delay_s)

    def written(self, method: str, path: str) -> str | None:
        q = parse_qs(urlsplit(path).query)
        return unquote(q["name"][0]) if "name" in q and "/upload/" in path else None

    def reads_data(self, method: str, path: str) -> bool:
        return method == "GET" and "alt=media" in path

    def failing_data_uploads(self) -> Faults:
        from s3_server import Faults

        return Faults(rate=1.0, modes=("503", "500"), match=lambda m, p: m == "POST" and "data%2F" in p)


STORES: dict[str, type[Store]] = {cls.scheme: cls for cls in (S3Store, GcsStore)}
