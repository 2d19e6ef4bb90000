"""Jobs of 8 and 16 processes: global consistency, preemption, elastic restarts and the memory tiers;
and what agreement costs as a job grows.

Real jax.distributed jobs on 127.0.0.1 (gloo), one CPU device per process, tiny states (a few KiB), so
what is tested is the agreement between many processes, not bytes (tests/workers/many_worker.py; the
tier jobs run tests/workers/tier_worker.py). Only the 8-process consistency case runs in every suite
run (about 15 s on 2 cores); the others are marked slow and run only with ``pytest -m slow`` (or
FLAX_CKPT_SLOW=1): a 16-process job takes about 13 s to start, run and stop on 2 cores. The cost of
the agreement itself at up to 8,192 processes is tested in this process: threads stand for the
processes of a job on an in-memory coordinator (key-value operations counted), and the merge of
8,192 processes' chunk records is timed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flax_ckpt as fc
from helpers import WORKERS, Job, Within, stretch

WORKER = WORKERS / "many_worker.py"
TIMEOUT_S = 240  # one job; 16 processes on 2 cores start in ~10 s, so this is a hang, never slowness
SLOW = os.environ.get("FLAX_CKPT_SLOW") == "1"


@pytest.fixture(autouse=True)
def _slow_only_when_asked(request):
    """The slow jobs run with ``-m slow`` (or FLAX_CKPT_SLOW=1), never in a plain suite run."""
    if (
        request.node.get_closest_marker("slow")
        and not SLOW
        and "slow" not in request.config.getoption("markexpr")
    ):
        pytest.skip("a long many-process job: run with -m slow (or FLAX_CKPT_SLOW=1)")


def job(tmp: Path, tag: str, mode: str, n: int, **cfg: Any) -> Job:
    return Job(
        WORKER, tmp, tag, n, devices=1, timeout=TIMEOUT_S, mode=mode, dir=str(tmp / "run"), **cfg
    ).start()


def run(tmp: Path, tag: str, mode: str, n: int, **cfg: Any) -> list[dict[str, Any]]:
    j = job(tmp, tag, mode, n, **cfg)
    return j.check_ok(j.join())


def damage(run_dir: Path, step: int, process: int) -> None:
    """Flips one byte of the data file that ``process`` alone wrote of ``step`` (its rows of "w")."""
    victim = next((run_dir / str(step) / "data").glob(f"p{process}.*.bin"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))


def listing(run_dir: Path) -> dict[str, list[str]]:
    return {
        str(p.relative_to(run_dir)): sorted(os.listdir(p)) for p in sorted(run_dir.rglob("*")) if p.is_dir()
    }


def check_consistent_fallback(tmp: Path, n: int, damaged: int) -> None:
    assert [r["steps"] for r in run(tmp, "save", "save", n)] == [[1, 2]] * n
    damage(tmp / "run", 2, damaged)
    results = run(tmp, "restore", "restore", n)
    # never a mix; step 2, found damaged, leaves every process's steps together
    assert [(r["step"], r["exact"], r["steps"]) for r in results] == [(1, True, [1])] * n


@pytest.mark.timeout(300)
def test_damaged_shard_on_one_of_eight_processes_all_restore_one_step(tmp_path):
    """A damaged shard on one of eight processes: all of them restore the same older step. Slow (tens of
    seconds): a job of eight real processes."""
    check_consistent_fallback(tmp_path, 8, damaged=5)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_damaged_shard_on_one_of_sixteen_processes_all_restore_one_step(tmp_path):
    check_consistent_fallback(tmp_path, 16, damaged=11)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_a_step_saved_by_8_restores_on_4_and_16_and_5_is_refused_on_every_process(tmp_path):
    run_dir = tmp_path / "run"
    assert [r["steps"] for r in run(tmp_path, "save", "save", 8)] == [[1, 2]] * 8
    before = listing(run_dir)
    # 5 processes cannot split the 48 saved rows: the same clear error on every process, nothing written
    bad = run(tmp_path, "five", "restore", 5)
    assert len({(r["error"], r["message"]) for r in bad}) == 1, bad
    assert bad[0]["error"] == "TargetMismatchError" and "restore of 'w'" in bad[0]["message"], bad[0]
    assert "[48, 8]" in bad[0]["message"] and "partitioned 5 times" in bad[0]["message"], bad[0]
    assert listing(run_dir) == before  # nothing committed half-way, nothing of the saved steps lost
    for n in (4, 16):
        results = run(tmp_path, f"n{n}", "restore", n)
        assert [(r["step"], r["exact"], r["steps"]) for r in results] == [(2, True, [1, 2])] * n
    assert listing(run_dir) == before
    with fc.CheckpointManager(run_dir) as mgr:  # and in one process, whole
        assert mgr.all_steps() == [1, 2]
        assert mgr.restore(2)["w"].shape == (48, 8)


def train(
    tmp: Path,
    tag: str,
    n: int,
    directory: Path,
    *,
    until: int,
    signal_to: int | None = None,
    at_step: int = 20,
) -> list[tuple[int, str]]:
    """A training job of ``n`` processes (many_worker's train mode); with ``signal_to``, that process
    gets SIGTERM once it has printed step ``at_step``. Every process's exit status and log."""
    j = Job(
        WORKER,
        tmp,
        tag,
        n,
        devices=1,
        timeout=TIMEOUT_S,
        mode="train",
        dir=str(directory),
        every=40,
        until=until,
    ).start()
    try:
        if signal_to is not None:
            log = j.path(signal_to, ".log")
            j.wait(lambda: f"step {at_step}\n" in log.read_text() or j.procs[signal_to].poll() is not None)
            j.procs[signal_to].send_signal(signal.SIGTERM)
        j.wait(lambda: all(p.poll() is not None for p in j.procs))
    finally:
        j.kill()
    return [(p.returncode, j.path(i, ".log").read_text()) for i, p in enumerate(j.procs)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_one_of_eight_processes_all_stop_at_one_step_and_resume_bit_identical(tmp_path):
    n, until, directory = 8, 120, tmp_path / "ckpts"
    first = train(tmp_path, "first", n, directory, until=until, signal_to=5)
    assert [s for s, _ in first] == [143] * n, [o[-2000:] for _, o in first]
    stops = {re.search(r"preemption: step (\d+) is saved", o)[1] for _, o in first}
    assert len(stops) == 1, stops  # every process saved the same step
    stop = int(stops.pop())
    assert stop < until
    resumed = train(tmp_path, "resumed", n, directory, until=until)
    assert [s for s, _ in resumed] == [0] * n, [o[-2000:] for _, o in resumed]
    assert all(f"start {stop}\n" in o for _, o in resumed)
    reference = train(tmp_path, "reference", n, tmp_path / "uninterrupted", until=until)
    final = lambda outs: sorted(re.search(r"final \d+ (\w+)", o)[0] for _, o in outs)  # noqa: E731
    assert final(resumed) == final(reference)  # every process's shard, bit for bit
    with fc.CheckpointManager(directory) as mgr:
        assert mgr.all_steps()[-1] == until
        assert np.asarray(mgr.restore(until)["w"]).shape == (48, 8)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiers_at_eight_processes_one_host_lost_restores_from_its_peer(tmp_path):
    n, lost = 8, 3

    def tier_job(tag: str, mode: str, **cfg: Any) -> list[dict[str, Any]]:
        j = Job(
            WORKERS / "tier_worker.py",
            tmp_path,
            tag,
            n,
            devices=1,
            timeout=TIMEOUT_S,
            mode=mode,
            dir=str(tmp_path / "ckpt"),
            per_process=lambda i: {"local": str(tmp_path / f"host{i}")},
            timeout_s=60,
            persist=3,
            **cfg,
        ).start()
        return j.check_ok(j.join(running=True))  # a train job keeps running, like hosts: killed here

    train = tier_job("train", "train", steps=4)
    assert all(r["local"] == r["peer"] == [3, 4] for r in train), train
    shutil.rmtree(tmp_path / f"host{lost}")  # host 3's memory is gone
    res = tier_job("host-lost", "restore")
    assert {r["restored"] for r in res} == {4}  # all on one step (each checked its shards bit-exact)
    assert len({str(r["sources"]) for r in res}) == 1  # one plan on every process
    sources = res[0]["sources"]
    assert sources[lost][0] == "peer" and sources[lost][1] != lost, sources
    assert [s for i, s in enumerate(sources) if i != lost] == [["local", i] for i in range(n) if i != lost]
    assert res[lost]["stats"] == ["peer"] and all(
        r["stats"] == ["local"] for i, r in enumerate(res) if i != lost
    )


# ------------------------------------------------------------- what agreement costs as the job grows


class FakeCoordinator:
    """The jax.distributed key-value store in memory, shared by threads that stand for processes;
    counts every call per calling process."""

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.cond = threading.Condition()
        self.calls: dict[int, int] = {}
        self.me = threading.local()

    def _count(self) -> None:
        self.calls[self.me.index] = self.calls.get(self.me.index, 0) + 1

    def key_value_set(self, key: str, value: str) -> None:
        with self.cond:
            self._count()
            self.kv[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.cond:
            self._count()
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.kv[key]

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.cond:
            self._count()
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def key_value_delete(self, prefix: str) -> None:
        with self.cond:
            self._count()
            for k in [k for k in self.kv if k == prefix or k.startswith(prefix)]:
                del self.kv[k]


@pytest.fixture
def threads_as_processes(monkeypatch):
    """Runs ``fn(index)`` on ``n`` threads that the agreement code takes for the processes of one job
    (their own index and rounds, one in-memory coordinator); each thread's result or exception, and
    the coordinator."""
    from flax_ckpt._src.commit import distributed

    coord = FakeCoordinator()
    rounds = threading.local()

    def next_round(prefix: str) -> str:
        mine = rounds.__dict__.setdefault("n", {})
        mine[prefix] = mine.get(prefix, -1) + 1
        return f"{prefix}/{mine[prefix]}"

    def go(n: int, fn, timeout: float = 120) -> tuple[list[Any], FakeCoordinator]:  # a hang limit
        monkeypatch.setattr(distributed, "process_count", lambda: n)
        monkeypatch.setattr(distributed, "process_index", lambda: coord.me.index)
        monkeypatch.setattr(distributed, "_client", lambda: coord)
        monkeypatch.setattr(distributed, "_next_round", next_round)
        distributed.set_timeout(timeout)
        out: list[Any] = [None] * n

        def run(i: int) -> None:
            coord.me.index = i
            try:
                out[i] = fn(i)
            except Exception as e:  # noqa: BLE001 - the test looks at it
                out[i] = e

        ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout + 120)
        return out, coord

    try:
        yield go
    finally:
        distributed.set_timeout(300)


@pytest.mark.parametrize("n", [16, 128])
def test_agreement_rounds_cost_linear_key_value_operations(threads_as_processes, n):
    from flax_ckpt._src.commit import distributed

    def job(i: int) -> Any:
        got = distributed.allgather("t", "x", {"i": i})
        view = distributed.lead("t", "view", {"from": i})
        votes = distributed.vote("t", "restore", 7, ValueError("bad") if i == n - 1 else None)
        return got, view, votes

    out, coord = threads_as_processes(n, job)
    assert all(r == out[0] for r in out), out[:2]
    got, view, votes = out[0]
    assert (
        got == [{"i": i} for i in range(n)]
        and view == {"from": 0}
        and votes == {n - 1: ("ValueError", "bad")}
    )
    # three rounds: each N + 1 sets, 2N - 1 gets (a round where every process read every key: N^2)
    assert sum(coord.calls.values()) <= 3 * (3 * n + 1), coord.calls
    assert coord.calls[0] <= 3 * (n + 3) and max(coord.calls[i] for i in range(1, n)) <= 3 * 2


def test_a_process_missing_from_a_round_is_named_to_every_process(threads_as_processes):
    from flax_ckpt._src.commit import distributed

    n, gone = 8, 5

    def job(i: int) -> Any:
        if i == gone:
            return None  # never joins the round
        return distributed.vote("t", "restore", 3, None)

    out, _ = threads_as_processes(n, job, timeout=stretch())  # 1 s as on an idle machine (helpers.stretch)
    errors = [r for i, r in enumerate(out) if i != gone]
    assert all(isinstance(e, fc.DistributedError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "process(es) [5] of 8 did not answer" in str(errors[0])


def test_processes_at_different_points_get_one_error(threads_as_processes):
    from flax_ckpt._src.commit import distributed

    out, _ = threads_as_processes(4, lambda i: distributed.vote("t", "restore", 3 if i != 2 else 4, None))
    assert all(isinstance(e, fc.DistributedError) for e in out) and len({str(e) for e in out}) == 1, out
    assert "different steps ([3, 3, 4, 3])" in str(out[0])


def _dedupe_pairwise(parts):
    """The merge as it was (every chunk against every earlier chunk of its leaf): the reference."""
    from flax_ckpt._src.commit.distributed import _box
    from flax_ckpt._src.serializers import Written, intersect

    seen: dict[int, list] = {}
    out = []
    for w in parts:
        chunks = {}
        for leaf, recs in w.chunks.items():
            boxes = seen.setdefault(leaf, [])
            if any(intersect(_box(r), b) is not None for r in recs for b in boxes):
                continue
            chunks[leaf] = recs
            boxes.extend(_box(r) for r in recs)
        out.append(Written(chunks, w.files))
    return out


@pytest.mark.parametrize("cells_max", [None, 1])  # 1: every chunk of more than one cell goes box by box
def test_merge_of_chunk_records_is_linear_and_keeps_what_it_kept(monkeypatch, cells_max):
    from flax_ckpt._src.commit import distributed
    from flax_ckpt._src.commit.distributed import dedupe
    from flax_ckpt._src.serializers import Written

    if cells_max is not None:
        monkeypatch.setattr(distributed, "_CELLS_MAX", cells_max)

    rng = np.random.default_rng(0)

    def rec(box):
        return {"index": [list(b) for b in box]}

    for trial in range(300):  # random layouts: grids, whole copies, odd overlapping boxes, 0-d, empty
        nproc, parts = int(rng.integers(1, 7)), []
        for _ in range(nproc):
            chunks = {}
            for leaf in range(3):
                kind = rng.integers(0, 4)
                if leaf == 2:
                    chunks[leaf] = [rec(())]  # a 0-d value every process holds
                elif kind == 0:
                    chunks[leaf] = [rec(((0, 8), (0, 6)))]  # a whole copy
                elif kind == 1:
                    k = int(rng.integers(0, 4))
                    chunks[leaf] = [rec(((2 * k, 2 * k + 2), (0, 6)))]  # a row block
                elif kind == 2:
                    a, b = sorted(rng.integers(0, 9, 2))
                    c, d = sorted(rng.integers(0, 7, 2))
                    chunks[leaf] = [rec(((int(a), int(b)), (int(c), int(d))))]  # any box, maybe empty
            parts.append(Written(chunks, {}))
        want = [w.chunks for w in _dedupe_pairwise(parts)]
        assert [w.chunks for w in dedupe(parts)] == want, (trial, [p.chunks for p in parts])
    if cells_max is not None:
        return
    # 8,192 processes, one row block of each of 4 leaves each, and copies of a process-local leaf
    n = 8192
    parts = [
        Written({**{leaf: [rec(((4 * j, 4 * j + 4), (0, 8)))] for leaf in range(4)}, 4: [rec(((0, 3),))]}, {})
        for j in range(n)
    ]
    with Within(10, "the merge of 8,192 processes' writes"):  # ~0.3 s idle; the pairwise merge took minutes
        merged = dedupe(parts)
    assert all(len(w.chunks) == 4 + (j == 0) for j, w in enumerate(merged))
