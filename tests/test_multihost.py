"""Global consistency across processes: every process restores the same step, whatever fails where.

Real jax.distributed jobs on 127.0.0.1 (gloo), one CPU device per process, 2 and 4 processes
(tests/workers/multihost_worker.py); damage is done to real files between the jobs; processes are really
SIGKILLed, hung and sent SIGTERM. A coordinator that dies (or freezes whole, SIGSTOP) ends every
process of a jax.distributed job at once: JAX's runtime terminates them from its own threads when
the coordination service stops answering (jax 0.10.2), so there is no Python error to give them;
what is tested then is that nothing hangs, nothing half-written is committed, and the restart resumes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from helpers import WORKERS, Job, free_port, worker_env

WORKER = WORKERS / "multihost_worker.py"
TIMEOUT_S = 150


def job(tmp: Path, tag: str, mode: str, n: int, **cfg) -> Job:
    return Job(
        WORKER, tmp, tag, n, devices=1, timeout=TIMEOUT_S, mode=mode, dir=str(tmp / "run"), **cfg
    ).start()


def run(tmp: Path, tag: str, mode: str, n: int, **cfg) -> list[dict]:
    j = job(tmp, tag, mode, n, **cfg)
    return j.check_ok(j.join())


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def damage_one_process(run_dir: Path, serializer: str, process: int) -> str:
    """Flips a byte of what ``process`` alone wrote of step 2 (its data file, or its zarr3 chunk)."""
    step = run_dir / "2"
    if serializer == "raw":
        victim = next((step / "data").glob(f"p{process}.*.bin"))
    else:
        body = json.loads((step / "manifest.json").read_text())["body"]
        w = next(r for r in body["leaves"] if r["path"] == [["key", "w"]])
        chunk = next(c for c in w["chunks"] if c["index"][0][0] == 8 * process)
        victim = step / chunk["array"] / chunk["key"]
    flip(victim)
    return victim.name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("serializer,n", [("raw", 2), ("raw", 4), ("zarr3", 2)])
def test_damage_on_one_process_makes_all_fall_back_together(tmp_path, serializer, n):
    assert [r["steps"] for r in run(tmp_path, "save", "save", n, serializer=serializer)] == [[1, 2]] * n
    damage_one_process(tmp_path / "run", serializer, n - 1)
    results = run(tmp_path, "restore", "restore", n)
    assert [(r["step"], r["exact"]) for r in results] == [(1, True)] * n  # never a mix of steps
    assert all(r["steps"] == [1] for r in results)  # step 2, found damaged, leaves every process's steps


@pytest.mark.timeout(300)
def test_steps_share_each_process_s_unchanged_shards_and_restore_anywhere(tmp_path):
    """Two processes save a state with a frozen sharded leaf: each refers to its own shard's bytes in
    step 1 (retired by max_to_keep=2, not deleted); every process restores step 3 exactly, and so does
    this one process alone, target-less (another topology)."""
    results = run(tmp_path, "share", "share", 2)
    assert [(r["steps"], r["exact"]) for r in results] == [([2, 3], True)] * 2
    body = json.loads((tmp_path / "run" / "3" / "manifest.json").read_text())["body"]
    (f,) = [leaf for leaf in body["leaves"] if leaf["path"] == [["key", "f"]]]
    assert sorted(c["file"] for c in f["chunks"]) == ["../1/data/p0.0.bin", "../1/data/p1.0.bin"]
    assert [n for n in os.listdir(tmp_path / "run") if n.startswith("1.held-")]
    got = fc.restore(tmp_path / "run" / "3")
    frozen = np.random.default_rng(99).standard_normal((16, 4096)).astype(np.float32)
    np.testing.assert_array_equal(got["f"], frozen)


@pytest.mark.timeout(300)
def test_damaged_shared_bytes_of_one_process_are_never_referred_to_again(tmp_path):
    """A bit of process 1's shard in the retired step 1 flips: every process finds steps 3 and 2
    damaged together; the next saves write that shard again (step 4 builds on no damaged step), and
    steps 4 and 5 restore exactly on every process."""
    run(tmp_path, "share", "share", 2)
    (held,) = [n for n in os.listdir(tmp_path / "run") if n.startswith("1.held-")]
    flip(tmp_path / "run" / held / "data" / "p1.0.bin")
    results = run(tmp_path, "again", "share_damaged", 2)
    assert [(r["error"], r["steps"], r["exact"]) for r in results] == [
        ("CorruptCheckpointError", [4, 5], True)
    ] * 2
    assert not [n for n in os.listdir(tmp_path / "run") if n.startswith("1.held-")]


@pytest.mark.timeout(300)
def test_strict_raises_the_same_error_on_every_process(tmp_path):
    run(tmp_path, "save", "save", 2, serializer="raw")
    victim = damage_one_process(tmp_path / "run", "raw", 1)
    results = run(tmp_path, "strict", "restore", 2, strict=True)
    assert {r["error"] for r in results} == {"CorruptCheckpointError"}
    assert results[0]["message"] == results[1]["message"]
    assert "step 2" in results[0]["message"] and "process 1:" in results[0]["message"]
    assert victim in results[0]["message"]


@pytest.mark.timeout(300)
def test_a_damaged_part_record_leaves_the_step_uncommitted_everywhere(tmp_path):
    results = run(tmp_path, "part", "part", 2)
    assert all("DistributedError" in r["save2"] and "damaged" in r["save2"] for r in results), results
    assert [(r["steps"], r["step"], r["exact"]) for r in results] == [([1], 1, True)] * 2
    assert sorted(os.listdir(tmp_path / "run")) == [".flax_ckpt.lock", "1"]


@pytest.mark.timeout(300)
def test_a_lagging_listing_still_sees_the_step_process_0_committed(tmp_path):
    run(tmp_path, "save", "save", 2)
    results = run(tmp_path, "lag", "lagging", 2)
    assert [(r["latest"], r["steps"], r["step"], r["exact"]) for r in results] == [(2, [1, 2], 2, True)] * 2


@pytest.mark.timeout(300)
def test_auto_interval_is_agreed_by_every_process(tmp_path):
    results = run(tmp_path, "auto", "auto", 2)
    assert results[0]["saved"] == results[1]["saved"] and len(results[0]["saved"]) >= 2, results
    assert results[0]["interval"] == results[1]["interval"]


def _finished(j: Job) -> list[int]:
    statuses = []
    for p in j.procs:
        try:
            statuses.append(p.wait(timeout=TIMEOUT_S))
        except subprocess.TimeoutExpired:
            j.kill()
            pytest.fail(f"a process hung after the coordinator died\n{j.logs()}")
    return statuses


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", ["save", "restore"])
def test_coordinator_killed_nothing_half_written_and_the_restart_resumes(tmp_path, phase):
    j = job(tmp_path, "kill", f"kill-{phase}", 2, timeout_s=10)
    try:
        statuses = _finished(j)  # JAX's runtime ends every process at once when the coordinator dies
    finally:
        j.kill()
    assert statuses[0] == -signal.SIGKILL, j.logs()
    if statuses[1] == 0:  # it met the timeout before JAX's runtime ended it: then it must have said so
        r = j.result(1)
        assert r.get("cause") == "DistributedError", (r, j.logs())
    run_dir = tmp_path / "run"
    assert not (run_dir / "2" / "manifest.json").exists()  # step 2 was never committed
    results = run(tmp_path, "again", "restore", 2)
    assert [(r["step"], r["exact"], r["steps"]) for r in results] == [(1, True, [1])] * 2
    assert sorted(os.listdir(run_dir)) == [".flax_ckpt.lock", "1"]  # the staging folder is gone


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", ["save", "restore"])
def test_hung_coordinator_gives_a_distributed_error_within_the_timeout(tmp_path, phase):
    j = job(tmp_path, "hang", f"hang-{phase}", 2, timeout_s=4)
    try:
        j.wait(lambda: j.path(1, ".json").exists())
    finally:
        j.kill()  # process 0 hangs: it never exits by itself
    r = j.result(1)
    assert r["ok"] and r["cause"] == "DistributedError", j.logs()
    assert r["error"] == ("SaveFailedError" if phase == "save" else "DistributedError")
    assert r["after_s"] < 3 * 4 + 10, r  # the timeout (twice it for a commit), not a hang
    assert not (tmp_path / "run" / "2" / "manifest.json").exists()
    results = run(tmp_path, "again", "restore", 2)
    assert [(r["step"], r["exact"]) for r in results] == [(1, True)] * 2


MULTI_CHILD = textwrap.dedent("""
    import sys, time
    import jax
    process_id, port, directory, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=process_id)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from flax_ckpt.callbacks import CheckpointCallback

    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    step_fn = jax.jit(lambda w: w * 1.0001 + 0.5, out_shardings=sh)
    init = jax.jit(lambda: {"w": jax.numpy.arange(12 * n, dtype=np.float32).reshape(-1, 3)}, out_shardings=sh)
    ckpt = CheckpointCallback(directory, every_steps=100)
    state, start = ckpt.restore_or(init)  # resumed: traced, each process restores its shards into sh
    assert state["w"].sharding == sh, state["w"].sharding
    print("start", start, flush=True)
    for step in range(start, 400):
        state = {"w": step_fn(state["w"])}
        time.sleep(0.01)
        print("step", step + 1, flush=True)
        ckpt(step + 1, state)
    ckpt.close()
    print("final", process_id, np.asarray(state["w"].addressable_shards[0].data).tobytes().hex(), flush=True)
""")


def _run_children(
    tmp: Path, tag: str, n: int, directory: Path, signal_to: int | None = None
) -> list[tuple[int, str]]:
    script = tmp / "multi.py"
    script.write_text(MULTI_CHILD)
    env = worker_env(1)
    port = str(free_port())
    logs = [tmp / f"{tag}.p{i}.log" for i in range(n)]
    procs = [
        forkserver.Popen(
            [sys.executable, str(script), str(i), port, str(directory), str(n)],
            env=env,
            stdout=logs[i].open("w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(n)
    ]
    watchdog = threading.Timer(TIMEOUT_S, lambda: [p.kill() for p in procs])
    watchdog.start()
    try:
        if signal_to is not None:
            while "step 60\n" not in logs[signal_to].read_text() and procs[signal_to].poll() is None:
                threading.Event().wait(0.05)
            procs[signal_to].send_signal(signal.SIGTERM)
        statuses = [p.wait() for p in procs]
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [(s, log.read_text()) for s, log in zip(statuses, logs)]


@pytest.mark.timeout(400)
def test_sigterm_to_one_of_four_processes_all_stop_at_one_step_and_resume_bit_identical(tmp_path):
    """SIGTERM to one of four jax.distributed processes: all save the same step and stop; resumed, they end
    bit-identical to an uninterrupted job. Slow (a minute): three jobs of four real processes
    (preempted, resumed, uninterrupted), each starting JAX and gloo collectives."""
    n, directory = 4, tmp_path / "ckpts"
    first = _run_children(tmp_path, "first", n, directory, signal_to=2)
    assert [s for s, _ in first] == [143] * n, [o[-2000:] for _, o in first]
    stops = {re.search(r"preemption: step (\d+) is saved", o)[1] for _, o in first}
    assert len(stops) == 1, stops  # every process saved the same step
    stop = int(stops.pop())
    resumed = _run_children(tmp_path, "resumed", n, directory)
    assert [s for s, _ in resumed] == [0] * n, [o[-2000:] for _, o in resumed]
    assert all(f"start {stop}\n" in o for _, o in resumed)
    reference = _run_children(tmp_path, "reference", n, tmp_path / "uninterrupted")
    final = lambda outs: sorted(re.search(r"final \d+ (\w+)", o)[0] for _, o in outs)  # noqa: E731
    assert final(resumed) == final(reference)  # every process's shard, bit for bit
    with fc.CheckpointManager(directory) as mgr:
        assert mgr.all_steps() == [200, 300, 400]  # max_to_keep=3 removed the preemption step afterwards
        assert np.asarray(mgr.restore(400)["w"]).shape == (4 * n, 3)


INIT_CHILD = textwrap.dedent("""
    import sys
    import jax
    process_id, port, directory, pretrained, n = (int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4],
                                                  int(sys.argv[5]))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=process_id)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flax_ckpt as fc
    from flax_ckpt.callbacks import CheckpointCallback

    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    state = {"w": jax.make_array_from_callback((2 * n,), sh, lambda idx: np.zeros(2 * n, np.int8)[idx])}
    ckpt = CheckpointCallback(directory, every_steps=100, preemption_signals=())
    try:
        state, start = ckpt.restore_or(state, init_from=pretrained, cast=True)
        print("ok", start, np.asarray(state["w"].addressable_shards[0].data).tolist(), flush=True)
    except fc.CheckpointError as e:
        print("error", type(e).__name__, e, flush=True)
    ckpt.close()
""")


@pytest.mark.parametrize("overflow", [False, True])
def test_init_from_is_restored_on_every_process_or_refused_on_every_one(tmp_path, overflow):
    """restore_or(init_from=..., cast=True) in a 2-process job: each process reads its own shard; a value
    only process 1's shard holds that int8 cannot hold stops both processes, not just process 1."""
    n = 2
    values = np.array([1, 2, 3, 1000 if overflow else 4], np.int64)  # process 1 holds elements 2 and 3
    fc.save(tmp_path / "pretrained", {"w": values})
    script = tmp_path / "init.py"
    script.write_text(INIT_CHILD)
    port, env = str(free_port()), worker_env(1)
    procs = [
        forkserver.Popen(
            [
                sys.executable,
                str(script),
                str(i),
                port,
                str(tmp_path / "run"),
                str(tmp_path / "pretrained"),
                str(n),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(n)
    ]
    outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    lines = [
        next((ln for ln in out.splitlines() if ln.startswith(("ok ", "error "))), out[-2000:]) for out in outs
    ]
    if not overflow:
        assert lines == ["ok 0 [1, 2]", "ok 0 [3, 4]"], outs
        return
    assert lines[1].startswith("error CastOverflowError") and "'w'" in lines[1], outs
    assert lines[0].startswith("error CheckpointError") and "failed on process 1" in lines[0], outs


def test_every_process_reads_the_compilation_cache_and_process_0_alone_writes_it(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the test's small program too
    first = run(tmp_path, "first", "compile-cache", 2)
    assert first[0]["writes"] > 0 and first[1]["writes"] == 0
    assert first[0]["hits"] == first[1]["hits"] == 0
    again = run(tmp_path, "again", "compile-cache", 2)  # a restarted job
    assert again[0]["hits"] > 0 and again[0]["misses"] == 0
    assert again[1]["hits"] + again[1]["misses"] > 0  # process 1 looks its program up too
    assert again[0]["writes"] == again[1]["writes"] == 0
    # (on a CPU JAX keys a program by its process's device: process 1's is not the one process 0 stored)
    assert again[0]["total"] == again[1]["total"] == first[0]["total"]
