"""Shared test set-up: 8 CPU devices in the test process so sharded layouts can be exercised; harness/
(what the tests share with the benchmarks: harness/basics.py) on sys.path."""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness")
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)

import pytest  # noqa: E402

pytest_plugins = [
    "s3_fixtures",
    "gcs_fixtures",
    "timing",
]  # the S3 and GCS fixtures (s3, s3_faulty, gcs, gcs_faulty, ...)


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh folder for checkpoints."""
    d = tmp_path / "ckpts"
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory):
    """A JAX compilation cache folder, new for each test session (so nothing compiled by an earlier run or
    another version is ever loaded)."""
    return tmp_path_factory.mktemp("jax_compilation_cache")


@pytest.fixture(scope="module")
def jax_compile_cache(jax_cache_dir):
    """Child processes started by this module's tests (their environment copies this one's) share a JAX
    compilation cache: a program that a child compiled before is loaded, not compiled again. For modules
    whose children run the same programs several times (``pytestmark = pytest.mark.usefixtures(...)``);
    not for a test that needs a compile to take its time (a signal sent during a first compile)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(jax_cache_dir))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program, not only slow ones
        yield
