"""The test suite's shared helpers: one of each, imported by test modules, support modules and workers.

Layout of tests/ (two kinds of non-test module, by how they run):

- ``test_*.py``: the tests. ``conftest.py``: the test process's set-up (8 CPU devices, harness/ on
  sys.path) and fixtures.
- Support modules, imported in-process as top-level modules (pytest puts tests/ on sys.path): this
  module; ``trees.py`` (pytree *builders* only: every dtype, mixed containers, a TrainState);
  ``s3_fixtures.py`` (fixtures, a plugin that conftest.py loads) over harness/s3_server.py (moto's
  server and a fault proxy); ``gcs_fixtures.py`` over harness/gcs_server.py (the same for
  fake-gcs-server, its front reusing that fault proxy); ``object_stores.py`` (what the tests of
  ``test_object_stores.py`` ask of either store).
- ``workers/``: the scripts that run as child processes (``python tests/workers/<name>.py ...``, from
  any cwd): ``mp_worker.py`` and ``tier_worker.py`` (processes of jax.distributed jobs) and
  ``crash_worker.py`` (a saver that tests kill). Each puts tests/ on sys.path itself, so that it can
  import this module; the tests find them through ``WORKERS``.

What the benchmarks run too lives in harness/ (harness/basics.py says what is there): bit-exact
comparison (``as_bytes``, ``leaf_bytes``, ``assert_bit_exact``, ``bit_exact``), states that several
modules build (``step_state``, ``crash_state``), manifest reading and crafting, child processes
(``free_port``, ``die_with_parent``, ``worker_env``), the S3 and GCS servers, the fault trials and their saver
processes. This module puts harness/ on sys.path and gives those names too, so that a test imports
all it needs from here. Here only: the worker side of a multi-process job (``start_worker``,
``report``) and its launcher (``Job``), the crash hooks, and time limits judged on a busy machine
(``stretch``, ``Within``: a limit as on an idle machine times the slowdown measured now).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

import jax

TESTS = Path(__file__).resolve().parent
WORKERS = TESTS / "workers"
if str(TESTS.parent / "harness") not in sys.path:
    sys.path.insert(0, str(TESTS.parent / "harness"))

from basics import (  # noqa: E402  (harness/basics.py: shared with the benchmarks)
    HOST,
    MANIFEST,
    PathLike,
    as_bytes,
    assert_bit_exact,
    bit_exact,
    crash_state,
    die_with_parent,
    edit_manifest,
    encode_manifest,
    free_port,
    leaf_bytes,
    leaf_chunks,
    leaf_of,
    manifest_body,
    refused_port,
    step_state,
    worker_env,
    write_manifest_body,
    write_manifest_raw,
)

import forkserver  # noqa: E402  (tests/forkserver.py: Python children forked after JAX's import)

# The one serializer the crash hooks wrap.
from flax_ckpt._src.serializers.raw import RawSerializer  # noqa: E402

# ------------------------------------------------------------------------------------------- states


def in_place_checked() -> tuple[Callable[..., Any], list[int]]:
    """A stand-in for tiers/encode.py's ``_encode_in_place`` (install it in its place) that checks
    every full memory copy it writes in place against the piece-by-piece encoding of the same snapshot,
    index and data byte for byte, and the list of those copies' steps."""
    from flax_ckpt._src.tiers import encode as tier_encode

    steps: list[int] = []
    real = tier_encode._encode_in_place

    def checked(ts: Any, ident: dict, layouts: Any) -> Any:
        enc = real(ts, ident, layouts)
        if enc is not None:
            ref = tier_encode._encode_full(ts, ident)
            assert enc.index == ref.index
            assert bytes(enc.pieces[0]) == b"".join(bytes(p) for p in ref.pieces)
            steps.append(ident["step"])
        return enc

    return checked, steps


# ------------------------------------------------------------------------------ multi-process jobs


def start_worker(cfg: Mapping[str, Any]) -> None:
    """The start of every process of a multi-process test job (cfg: num_processes, process_id, port):
    CPU collectives over gloo and, in a job of more than one process, joining its jax.distributed
    coordinator on 127.0.0.1. Call it before anything uses a JAX backend."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    n = cfg["num_processes"]
    if n > 1:
        address = f"{HOST}:{cfg['port']}"
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=n,
            process_id=cfg["process_id"],
            coordinator_bind_address=address,
            initialization_timeout=60,
        )


def report(cfg: Mapping[str, Any], modes: Mapping[str, Callable[[dict], dict]]) -> int:
    """Runs ``modes[cfg["mode"]](cfg)`` and writes its findings as {"ok": True, ...} (or {"ok": False,
    "traceback": ...}, the traceback also on stderr) to <out>/<tag>.p<process_id>.json, which appears
    whole. Returns the exit code the worker should leave with (0 or 1)."""
    try:
        result, code = {"ok": True, **modes[cfg["mode"]](cfg)}, 0
    except BaseException:
        result, code = {"ok": False, "traceback": traceback.format_exc()}, 1
        print(result["traceback"], file=sys.stderr, flush=True)
    path = os.path.join(cfg["out"], f"{cfg['tag']}.p{cfg['process_id']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


class Job:
    """N processes of one test job, each running ``worker`` (a script) with one argument, its JSON
    config: ``cfg`` plus out (``tmp``), tag, num_processes, port (free, when n > 1), process_id and what
    ``per_process(i)`` adds. Process i writes <tmp>/<tag>.p<i>.log (stdout and stderr) and reports to
    <tmp>/<tag>.p<i>.json (``report``). Every process runs in its own session and dies with the test
    process; ``kill`` kills the process groups; every wait ends after ``timeout`` s with the logs."""

    def __init__(
        self,
        worker: PathLike,
        tmp: PathLike,
        tag: str,
        n: int,
        *,
        devices: int,
        timeout: float,
        per_process: Callable[[int], dict] | None = None,
        **cfg: Any,
    ):
        self.worker, self.tmp, self.tag, self.n, self.timeout = str(worker), Path(tmp), tag, n, timeout
        self.cfg = dict(cfg, out=str(tmp), tag=tag, num_processes=n, port=free_port() if n > 1 else 0)
        self.env = worker_env(devices)
        self.per_process = per_process
        self.procs: list[subprocess.Popen] = []

    def path(self, i: int, suffix: str) -> Path:
        """Process i's file <tmp>/<tag>.p<i><suffix> (".log", ".json", ...)."""
        return self.tmp / f"{self.tag}.p{i}{suffix}"

    def start(self) -> "Job":
        for i in range(self.n):
            cfg = dict(self.cfg, process_id=i, **(self.per_process(i) if self.per_process else {}))
            with open(self.path(i, ".log"), "w") as log:
                self.procs.append(
                    forkserver.Popen(
                        [sys.executable, self.worker, json.dumps(cfg)],
                        env=self.env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
                )
        return self

    def wait(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """Waits until ``done()``; past the timeout, kills the job and fails the test with its logs."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                self.kill()
                import pytest

                pytest.fail(f"job {self.tag} did not finish within {timeout} s\n{self.logs()}")
            time.sleep(0.1)

    def join(self, *, running: bool = False, timeout: float | None = None) -> list[dict[str, Any]]:
        """Waits until every process has exited (``running``: until every one has reported, for
        workers that keep running like hosts), kills what is left, and returns each one's findings."""

        def done() -> bool:
            if running:
                return all(self.path(i, ".json").exists() for i in range(self.n))
            return all(p.poll() is not None for p in self.procs)

        try:
            self.wait(done, timeout)
        finally:
            self.kill()
        return [self.result(i) for i in range(self.n)]

    def result(self, i: int, kind: str = "") -> dict[str, Any]:
        """Process i's findings (<tag>.p<i><kind>.json); {"ok": False, "missing": True} if it wrote none."""
        path = self.path(i, f"{kind}.json")
        return json.loads(path.read_text()) if path.exists() else {"ok": False, "missing": True}

    def progress(self, i: int) -> list[dict[str, Any]]:
        """The JSON lines process i appended to <tag>.p<i>.progress."""
        path = self.path(i, ".progress")
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def check_ok(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert all(r["ok"] for r in results), f"{results}\n{self.logs()}"
        return results

    def logs(self) -> str:
        return "\n".join(
            f"--- {self.tag} p{i} (rc {p.poll()}):\n" + self.path(i, ".log").read_text()[-4000:]
            for i, p in enumerate(self.procs)
        )

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait(timeout=30)


class AfterWrite(RawSerializer):
    """The raw serializer, but ``then(written)`` runs right after this process wrote its shards of write
    number ``at`` (before it reports them or commits): how a test kills or hangs a process mid-save."""

    def __init__(self, at: int, then: Callable[[Any], None]):
        super().__init__()
        self.at, self.then, self.calls = at, then, 0

    def write(self, storage, items, *, tag):
        written = super().write(storage, items, tag=tag)
        self.calls += 1
        if self.calls == self.at:
            self.then(written)
        return written


def kill_self(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------ time on a busy machine


def stretch() -> float:
    """How many times the machine's load stretches wall time now: the wall time of a fixed piece of
    CPU work (about 30 ms of one idle core) over the CPU time this thread spent on it. 1 on an idle
    machine; about N / cores with N runnable processes."""
    wall, cpu, x = time.perf_counter(), time.thread_time(), 0
    for i in range(400_000):
        x += i * i
    return max(1.0, (time.perf_counter() - wall) / max(time.thread_time() - cpu, 1e-3))


class Within:
    """A limit on wall time, stated as on an idle machine and judged as a ratio: ``seconds`` times the
    load's stretch measured just before and just after the timed span (the larger), so that a busy
    machine raises the limit with the slowdown it causes, while an operation that retries, waits or
    runs far longer than it should still fails.

    ``with Within(5, "a permanent error"):`` times its block. After it, ``check(elapsed, seconds, what)``
    judges a span timed elsewhere (a child process's own figure for one of its operations) with the
    same stretch.
    """

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what, self.factor = seconds, what, 1.0

    def __enter__(self) -> "Within":
        self.factor, self.t0 = stretch(), time.perf_counter()
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        elapsed = time.perf_counter() - self.t0
        self.factor = max(self.factor, stretch())
        if exc_type is None:
            self.check(elapsed)

    def check(self, elapsed: float, seconds: float | None = None, what: str | None = None) -> None:
        """Asserts that ``elapsed`` is under ``seconds`` (default: the block's limit) times the stretch."""
        seconds, what = seconds or self.seconds, what or self.what
        limit = seconds * self.factor
        assert elapsed < limit, (
            f"{what} took {elapsed:.2f} s: more than {seconds} s on an idle machine times "
            f"{self.factor:.1f}, the stretch of wall time that this machine's load causes now"
        )


def file_digests(folder: Any) -> dict[str, str]:
    """{path under ``folder``: sha256 of its bytes} of every file below it (to see a folder untouched)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(dirpath, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out
