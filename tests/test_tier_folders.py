"""Memory copies belong to their run directory's volume, not to its path alone: two jobs whose
directories have one path on two volumes (two containers sharing one host tmpfs, each with its own
volume at that path) keep their memory copies apart (tiers/holdings.py folder_key: the device the
directory lies on), so neither deletes the other's memory-only steps. Simulated on one machine by one
path, a symbolic link led to one job's directory (on the disk of the test's tmp_path) and then to the
other's (on /dev/shm, another file system)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src.storage import open_storage
from flax_ckpt._src.tiers import holdings
from flax_ckpt._src.tools.ls import memory_tier_root

_CRASHING_JOB = """
import os, sys, numpy as np, flax_ckpt as fc
path, local = sys.argv[1], sys.argv[2]
t = fc.Tiers(local_dir=local, on_busy="wait", persist_interval_steps=None, cleanup=False)
mgr = fc.CheckpointManager(path, tiers=t)
for step in (1, 2, 3):
    mgr.save(step, {"w": np.full(64, float(step), np.float32)})
mgr.wait_until_finished()
print(mgr.all_steps(), mgr.memory_tiers.root, flush=True)
os._exit(0)  # a preempted job: its steps are in memory only, for the job's restart to resume from
"""


def _tiers(local: str) -> fc.Tiers:
    return fc.Tiers(local_dir=local, on_busy="wait", persist_interval_steps=None, cleanup=False)


def _point(link: Path, volume: Path) -> None:
    """The job's path now leads to ``volume``'s directory (another container's mount at one path)."""
    if link.is_symlink():
        link.unlink()
    link.symlink_to(volume, target_is_directory=True)


@pytest.fixture
def other_volume(tmp_path):
    """A folder on a file system other than tmp_path's (/dev/shm), removed after the test."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own, beside tmp_path's")
    folder = tempfile.mkdtemp(dir="/dev/shm", prefix="flax_ckpt-test-vol-")
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def test_two_jobs_with_one_path_on_two_volumes_keep_their_memory_only_steps(tmp_path, other_volume):
    vol_a, vol_b = tmp_path / "vol_a", other_volume / "vol_b"
    path, local = tmp_path / "run", str(tmp_path / "shm")
    vol_a.mkdir()
    vol_b.mkdir()
    _point(path, vol_a)
    job_a = forkserver.run(
        [sys.executable, "-c", _CRASHING_JOB, str(path), local],
        capture_output=True,
        text=True,
        cwd=str(Path(__file__).resolve().parents[1]),
        timeout=300,
    )
    assert job_a.returncode == 0, job_a.stderr
    *steps_a, root_a = job_a.stdout.split()
    assert "3]" in steps_a[-1]
    assert os.listdir(os.path.join(root_a, "local"))  # A's memory-only steps
    assert [n for n in os.listdir(vol_a) if n.isdigit()] == []
    _point(path, vol_b)  # job B: the same path, its own volume, the same tmpfs
    with fc.CheckpointManager(path, tiers=_tiers(local)) as b:
        assert b.all_steps() == []  # none of A's steps
        assert b.memory_tiers.root != root_a
        b.save(7, {"w": np.full(64, 7.0, np.float32)})
        b.wait_until_finished()
        assert b.memory_tiers.root == os.path.join(memory_tier_root(path, local), "p0")
    _point(path, vol_a)  # A restarts: its steps are still in memory
    with fc.CheckpointManager(path, tiers=_tiers(local)) as a:
        assert str(a.all_steps()).split() == steps_a
        np.testing.assert_array_equal(a.restore(3)["w"], np.full(64, 3.0, np.float32))
        assert a.memory_tiers.root == root_a
    # the key names the directory's volume beside its path: a run re-made on the same volume shares it
    key = holdings.folder_key(open_storage(path))
    _point(path, vol_b)
    assert holdings.folder_key(open_storage(path)) != key
    (tmp_path / "vol_c").mkdir()
    _point(path, tmp_path / "vol_c")
    assert holdings.folder_key(open_storage(path)) == key
