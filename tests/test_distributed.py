"""Multi-process saves and resharding restores on a real jax.distributed job (issue 5).

Real processes on this machine (tests/workers/mp_worker.py, started by helpers.Job): a coordinator on
127.0.0.1 at a free port, CPU devices, gloo collectives; no mock of JAX's runtime. One 2-process x
2-device job saves a TrainState (params, Adam state, step) with fc.save and with an async
CheckpointManager; restore jobs on 4x1, 1x4 and 1x1 read it back bit-exact, counting the bytes each
process reads; a 3-process job loses a process to SIGKILL in the middle of a save. Every process group
is killed when its job ends, also on failure, and every wait has a timeout.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.native.manifest import decode
from flax_ckpt._src.records import dtype_from_name, leaf_name
from flax_ckpt._src.storage import LocalStorage
from helpers import WORKERS, Job


def manifest_body(folder: Path) -> dict:
    """A native step's validated manifest body, with its leaves."""
    return decode((folder / "manifest.json").read_bytes(), str(folder))


WORKER = WORKERS / "mp_worker.py"
JOB_TIMEOUT_S = 100


def mp_job(tmp: Path, tag: str, mode: str, n: int, devices: int, **cfg: Any) -> Job:
    """N mp_worker processes (``devices`` CPU devices each) of one jax.distributed job, not started."""
    return Job(WORKER, tmp, tag, n, devices=devices, timeout=JOB_TIMEOUT_S, mode=mode, **cfg)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The 2-process x 2-device job: fc.save (raw, zarr3) and an async manager, on a 2-D mesh."""
    tmp = tmp_path_factory.mktemp("mp")
    job = mp_job(tmp, "save", "save", 2, 2, dir=str(tmp / "ck")).start()
    try:
        return tmp / "ck", job.check_ok(job.join())
    finally:
        job.kill()


@pytest.fixture(scope="module")
def restored(saved) -> dict[str, list[dict]]:
    """Restore jobs, run concurrently: 4 processes x 1 device, 1 x 4 and 1 x 1."""
    d, _ = saved
    jobs = {
        "4x1": mp_job(d.parent, "r41", "restore", 4, 1, dir=str(d), layouts=["x4"]),
        "1x4": mp_job(d.parent, "r14", "restore", 1, 4, dir=str(d), layouts=["m14"], plain=True),
        "1x1": mp_job(d.parent, "r11", "restore", 1, 1, dir=str(d), layouts=["one"]),
    }
    try:
        for job in jobs.values():
            job.start()
        return {k: job.check_ok(job.join()) for k, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()


# ------------------------------------------------------------------------------------------- save


@pytest.mark.timeout(150)
def test_two_processes_write_their_own_shards_once(saved):
    d, _ = saved
    body = manifest_body(d / "ts")
    assert body["process_count"] == 2 and body["step"] == 1
    tags = {name.split("/")[1].split(".")[0] for name in body["files"]}
    assert tags == {"p0", "p1"}  # each process wrote its own files
    arrays = [r for r in body["leaves"] if "chunks" in r]
    array_bytes = sum(
        int(np.prod(r["shape"])) * np.dtype(dtype_from_name(r["dtype"])).itemsize for r in arrays
    )
    assert sum(body["files"].values()) == array_bytes  # replicated shards were written exactly once
    # bias is P("model"): both halves live on process 0's devices (mesh row data=0, replica 0) and
    # again on process 1's (data=1, replica 1); only process 0 writes them
    bias = next(r for r in arrays if leaf_name(r) == "params/dense/bias")
    assert sorted(tuple(map(tuple, c["index"])) for c in bias["chunks"]) == [((0, 4),), ((4, 8),)]
    assert sorted(c["file"].split(".")[0] for c in bias["chunks"]) == ["data/p0", "data/p0"]
    kernel = next(r for r in arrays if leaf_name(r) == "params/dense/kernel")  # P("data", "model")
    assert sorted(c["file"].split(".")[0] for c in kernel["chunks"]) == ["data/p0"] * 2 + ["data/p1"] * 2
    assert not [e for e in os.listdir(d) if ".tmp-" in e]


@pytest.mark.timeout(150)
def test_two_processes_stream_their_own_shards_once(saved):
    """fc.save of arrays off the host (engine/transfer.py, forced on these CPU devices): each process
    streams its own shards in batches; restored bit-exact in the worker."""
    d, _ = saved
    body = manifest_body(d / "ts_stream")
    assert body["process_count"] == 2
    assert {name.split("/")[1].split(".")[0] for name in body["files"]} == {"p0", "p1"}
    assert all(re.fullmatch(r"data/p[01]\.(h|\d+)\.\d+\.bin", name) for name in body["files"]), body["files"]
    plain = manifest_body(d / "ts")
    assert sum(body["files"].values()) == sum(plain["files"].values())  # replicated shards written once
    kernel = next(r for r in body["leaves"] if leaf_name(r) == "params/dense/kernel")
    assert sorted(c["file"].split(".")[0] for c in kernel["chunks"]) == ["data/p0"] * 2 + ["data/p1"] * 2


@pytest.mark.timeout(150)
def test_metadata_shows_the_saved_multi_process_sharding(saved):
    d, results = saved
    want = {
        "type": "NamedSharding",
        "axis_names": ["data", "model"],
        "mesh_shape": [2, 2],
        "spec": ["data", "model"],
    }
    info = fc.metadata(str(d / "ts"))
    assert info.process_count == 2
    assert info.leaves["params/dense/kernel"].sharding == want
    assert info.leaves["opt_state/0/mu/embed/table"].sharding["spec"] == [None, "data"]
    assert all(r["kernel_sharding"] == want and r["process_count"] == 2 for r in results)


@pytest.mark.timeout(150)
def test_async_manager_on_two_processes_agrees_in_the_background(saved):
    d, results = saved
    p0, p1 = results
    assert p0["steps"] == p1["steps"] == [2, 3]  # max_to_keep=2: step 1 removed, by process 0
    assert p0["steps_rescanned"] == p1["steps_rescanned"] == [2, 3]
    assert sorted(e for e in os.listdir(d / "mgr") if not e.startswith(".")) == ["2", "3"]
    # process 0 started step 3 two seconds late: process 1's save returned at once and its
    # background writer waited for process 0 (the agreement is not on the training thread)
    assert p1["save3_returned_s"] < 1.0 and p1["save3_blocked_s"] < 1.0, p1
    assert p1["save3_wait_s"] > 1.0, p1


# ---------------------------------------------------------------------------------------- restore


@pytest.mark.timeout(200)
def test_restore_on_four_processes_reads_only_what_each_needs(restored):
    """Slow (tens of seconds, mostly its module's job): four real jax.distributed processes."""
    results = restored["4x1"]
    for r in results:  # bit-exact checked in the worker; here the bytes each process read
        x4 = r["x4"]
        assert x4["read"] == x4["needed"] < x4["stored"], x4
    assert sum(r["x4"]["read"] for r in results) < 4 * results[0]["x4"]["stored"]


@pytest.mark.timeout(200)
def test_restore_on_one_process_four_devices_and_one_device(restored):
    (one_by_four,), (one_by_one,) = restored["1x4"], restored["1x1"]
    assert one_by_one["one"]["read"] == one_by_one["one"]["stored"], one_by_one  # one box: each chunk once
    # four devices, four column boxes tiling the array: read together, each stored chunk once
    assert one_by_four["m14"]["read"] == one_by_four["m14"]["needed"] == one_by_four["m14"]["stored"], (
        one_by_four
    )
    assert one_by_four["plain_leaves"] > 0
    assert one_by_four["mgr_steps"] == [2, 3]


# ---------------------------------------------------------------------------------------- failure


@pytest.mark.timeout(150)
def test_process_killed_during_a_save_leaves_no_partial_step(tmp_path):
    d = tmp_path / "ck"
    job = mp_job(tmp_path, "kill", "kill", 3, 1, dir=str(d), timeout_s=4).start()
    try:
        results = job.join()
    finally:
        job.kill()
    assert job.procs[1].returncode == -signal.SIGKILL, job.logs()
    assert (tmp_path / "killed.json").exists()  # it died after writing its shards, before reporting
    p0, p2 = results[0], results[2]
    assert p0["ok"] and p2["ok"], job.logs()
    assert p0["cause_type"] == p2["cause_type"] == "DistributedError", (p0, p2)
    assert "process(es) [1] of 3 did not report" in p0["cause"], p0
    assert "failed on process 0" in p2["cause"] and "[1]" in p2["cause"], p2
    assert p0["detected_after_s"] < 30 and p2["detected_after_s"] < 30
    assert p0["steps"] == p2["steps"] == [1]
    assert sorted(os.listdir(d / "mgr")) == [".flax_ckpt.lock", "1"]  # no step 2, no staging folder left
    restored = fc.restore(str(d / "mgr" / "1"))
    assert restored["w"].tobytes() == np.arange(48, dtype=np.float32).reshape(12, 4).tobytes()
    assert restored["n"].tolist() == list(range(5)) and int(restored["local"]) == 0  # process 0's values


def test_process_0_writes_over_the_files_of_the_step_it_removed(tmp_path):
    """2 processes x 2 devices, max_to_keep=2: the process that removes steps (process 0) keeps their
    data files and writes its next file over one of them (commit/recycler.py); every kept step restores
    bit-exact on every process; nothing is left after close."""
    job = mp_job(tmp_path, "spares", "spares", 2, 2, dir=str(tmp_path / "ck")).start()
    try:
        p0, p1 = job.check_ok(job.join())
    finally:
        job.kill()
    assert p0["steps"] == p1["steps"] == [4, 5]
    inodes = p0["inodes"]
    for step in (4, 5):  # step - 3 was removed after step - 1 was committed
        assert set(inodes[str(step)]) == {"p0.0.bin", "p1.0.bin"}
        assert inodes[str(step)]["p0.0.bin"] in set(inodes[str(step - 3)].values()), (step, inodes)
    assert p0["left"] == p1["left"] == []
