"""Shared test set-up: 8 CPU devices in the test process so sharded layouts can be exercised."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

pytest_plugins = ["s3_fixtures"]  # the S3 fixtures (s3, s3_faulty, ...), for any test module to ask for


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh folder for checkpoints."""
    d = tmp_path / "ckpts"
    d.mkdir()
    return d
