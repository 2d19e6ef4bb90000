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

pytest_plugins = ["s3_fixtures", "gcs_fixtures"]  # the S3 and GCS fixtures (s3, s3_faulty, gcs, gcs_faulty, ...)


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh folder for checkpoints."""
    d = tmp_path / "ckpts"
    d.mkdir()
    return d
