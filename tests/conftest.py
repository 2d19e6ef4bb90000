"""Shared test set-up: 8 CPU devices in the test process so sharded layouts can be exercised."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

pytest_plugins = ["s3_fixtures", "gcs_fixtures"]  # the S3 and GCS fixtures (s3, s3_faulty, gcs, gcs_faulty, ...)


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh folder for checkpoints."""
    d = tmp_path / "ckpts"
    d.mkdir()
    return d
