"""The test suite's shared helpers: one of each, imported by test modules, support modules and workers.

Layout of tests/ (two kinds of non-test module, by how they run):

- ``test_*.py``: the tests. ``conftest.py``: the test process's set-up (8 CPU devices) and fixtures.
- Support modules, imported in-process as top-level modules (pytest puts tests/ on sys.path, the
  benchmarks insert it): this module; ``trees.py`` (pytree *builders* only: every dtype, mixed
  containers, a TrainState); ``s3_fixtures.py`` (fixtures, a plugin that conftest.py loads) and
  ``s3_server.py`` (moto's server, which s3_server starts as ``python -m moto.server``, and a fault
  proxy that runs in this process); ``gcs_fixtures.py`` and ``gcs_server.py`` (the same for
  fake-gcs-server, its front reusing that fault proxy); ``object_stores.py`` (what the tests of
  ``test_object_stores.py`` ask of either store);
  ``reliability_trials.py``, ``reliability_hostile.py``, ``reliability_s3.py`` (fault trials shared with
  benchmarks/faults.py). They stay in tests/ rather than a tests/support/ folder: the tests and
  benchmarks import them by their bare names, and nothing runs them as scripts.
- ``workers/``: the scripts that run as child processes (``python tests/workers/<name>.py ...``, from
  any cwd): ``mp_worker.py`` and ``tier_worker.py`` (processes of jax.distributed jobs),
  ``crash_worker.py`` and ``reliability_worker.py`` (savers that tests kill). Each puts tests/ on
  sys.path itself, so that it can import this module; the tests find them through ``WORKERS``.
  reliability_worker is also imported in-process, as ``workers.reliability_worker``, for its process
  handles (Zygote and spawn start copies of it).

Here: bit-exact comparison (``as_bytes``, ``leaf_bytes``, ``assert_bit_exact``, ``bit_exact``); states
that several modules build (``step_state``, ``crash_state``); manifest reading and crafting; child
processes (``free_port``, ``die_with_parent``, ``worker_env``); the worker side of a multi-process job
(``start_worker``, ``report``) and its launcher (``Job``). The library is used through its public API,
except for the manifest codec, imported once below.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.native import manifest as fmt  # the manifest codec (encode, FORMAT_*)
from flax_ckpt._src.serializers.raw import RawSerializer  # the one serializer the crash hooks wrap

TESTS = Path(__file__).resolve().parent
WORKERS = TESTS / "workers"
HOST = "127.0.0.1"
MANIFEST = MANIFEST

PathLike = str | os.PathLike


# --------------------------------------------------------------------------------- bit-exact comparison

def _is_none(x: Any) -> bool:
    return x is None


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def as_bytes(x: Any) -> tuple:
    """One leaf as a comparable tuple: equal tuples mean the same kind and the same bits.

    Arrays (jax or numpy, numpy scalars): (dtype, shape, bytes); typed PRNG keys: ("key", impl, the key
    data as an array); Python floats by their bits (NaN payloads and -0.0 count); anything else (int,
    bool, str, None, ...): (type name, value)."""
    if _is_key(x):
        return ("key", str(jax.random.key_impl(x)), as_bytes(jax.random.key_data(x)))
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        return (a.dtype.name, a.shape, a.tobytes())
    if isinstance(x, float):
        return ("float", np.float64(x).tobytes())
    return (type(x).__name__, x)


def leaf_bytes(tree: Any) -> dict[str, tuple]:
    """Every leaf (None included) as ``as_bytes``, keyed by its key path: equal dicts mean the same
    paths and the same bits, whatever the containers' types."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)[0]
    return {jax.tree_util.keystr(path): as_bytes(leaf) for path, leaf in leaves}


def assert_bit_exact(got: Any, want: Any, shardings: Any = None, *, types: bool = True) -> int:
    """Same structure (containers included), and every leaf the same bits (``as_bytes``); returns the
    number of leaves compared.

    ``types``: leaves must also have the same type (any two jax.Arrays count as one type); False for a
    caller that compares restored jax arrays with numpy ones. ``shardings``: a tree of the expected
    sharding of each leaf of ``got`` (None for a leaf compared whole): that leaf must have it, and each
    addressable shard must hold the bits of ``want`` at its index (what a process of a multi-process
    job can check)."""
    g, gdef = jax.tree_util.tree_flatten_with_path(got, is_leaf=_is_none)
    w, wdef = jax.tree_util.tree_flatten(want, is_leaf=_is_none)
    assert gdef == wdef, f"structure differs:\n{gdef}\n{wdef}"
    shards = [None] * len(w) if shardings is None else jax.tree_util.tree_leaves(shardings, is_leaf=_is_none)
    assert len(shards) == len(w), (len(shards), len(w))
    for (path, x), y, sharding in zip(g, w, shards):
        where = jax.tree_util.keystr(path)
        if types:
            assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (
                where, type(x), type(y))
        if sharding is None:
            assert as_bytes(x) == as_bytes(y), (where, x, y)
            continue
        y = np.asarray(y)
        assert x.shape == y.shape and np.dtype(x.dtype) == y.dtype, (where, x.shape, x.dtype, y.shape, y.dtype)
        assert x.sharding == sharding, (where, x.sharding, sharding)
        for shard in x.addressable_shards:
            assert as_bytes(shard.data) == as_bytes(y[shard.index]), (where, shard.index)
    return len(w)


def bit_exact(got: Any, want: Any, **kw: Any) -> bool:
    """Whether ``assert_bit_exact(got, want, **kw)`` holds (for judges that count, not fail)."""
    try:
        assert_bit_exact(got, want, **kw)
    except AssertionError:
        return False
    return True


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


def step_state(step: int, shape: tuple[int, ...], seed: int) -> dict:
    """A state that is a deterministic function of ``step``: a float32 "w" of ``shape`` drawn from
    ``seed + step``, and the step. Each caller keeps its own seed and shape (its own size)."""
    rng = np.random.default_rng(seed + step)
    return {"w": rng.standard_normal(shape).astype(np.float32), "step": step}


def crash_state(step: int) -> dict:
    """The crash tests' state (4 MB): one big float leaf and small ones (workers/crash_worker.py and
    reliability_worker.py save it, tests restore and compare it)."""
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((1024, 1024)).astype(np.float32),
            "b": {"x": rng.integers(0, 255, (3000,), dtype=np.uint8), "step": step}}


# ----------------------------------------------------------------------------------------- manifests

def manifest_body(ckpt: PathLike) -> dict:
    """The body of a checkpoint's manifest, as stored."""
    return json.loads(Path(ckpt, MANIFEST).read_bytes())["body"]


def write_manifest_raw(ckpt: PathLike, data: bytes) -> None:
    """Replaces a checkpoint's manifest file by ``data``, whatever it is."""
    Path(ckpt, MANIFEST).write_bytes(data)


def write_manifest_body(ckpt: PathLike, body: dict) -> None:
    """Writes a crafted manifest with a valid checksum, so only what was crafted is wrong."""
    write_manifest_raw(ckpt, fmt.encode(body))


def encode_manifest(body: dict) -> bytes:
    """A manifest file for ``body``: with a valid checksum, or where the codec cannot encode it (keys
    json cannot sort: an int beside strings) the same layout with checksum 0."""
    try:
        return fmt.encode(body)
    except (ValueError, TypeError):
        return json.dumps({"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "crc32c": 0,
                           "body": body}).encode()


def edit_manifest(ckpt: PathLike, change: Callable[[dict], Any]) -> None:
    """Reads the manifest body, lets ``change`` edit it in place, writes it back with a valid checksum."""
    body = manifest_body(ckpt)
    change(body)
    write_manifest_body(ckpt, body)


def leaf_of(body: dict, name: str) -> dict:
    """The record of the first leaf whose key path ends in ``name``."""
    return next(lf for lf in body["leaves"] if lf["path"] and lf["path"][-1][1] == name)


def leaf_chunks(ckpt: PathLike) -> dict[str, list[dict]]:
    """The stored chunks of every array leaf ("a/b" key -> chunk records: file, offset, nbytes, ...)."""
    return {"/".join(str(k) for _, k in leaf["path"]): leaf["chunks"]
            for leaf in manifest_body(ckpt)["leaves"] if "chunks" in leaf}


# ----------------------------------------------------------------------------------- child processes

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (or as a Popen ``preexec_fn``): Linux sends it ``sig`` when its parent dies (prctl
    PR_SET_PDEATHSIG), so no child outlives a killed test run. Does nothing where prctl is missing."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)
    except (OSError, AttributeError):
        pass


def worker_env(devices: int | None = None) -> dict[str, str]:
    """The environment of a child process: this one's, with JAX on CPU and tests/ first on PYTHONPATH
    (so a child script can import this module). ``devices``: the CPU devices JAX gives the child
    (XLA_FLAGS; 1: one, as a user has); None keeps this process's XLA_FLAGS."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


# ------------------------------------------------------------------------------ multi-process jobs

def start_worker(cfg: Mapping[str, Any]) -> None:
    """The start of every process of a multi-process test job (cfg: num_processes, process_id, port):
    CPU collectives over gloo and, in a job of more than one process, joining its jax.distributed
    coordinator on 127.0.0.1. Call it before anything uses a JAX backend."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    n = cfg["num_processes"]
    if n > 1:
        address = f"{HOST}:{cfg['port']}"
        jax.distributed.initialize(coordinator_address=address, num_processes=n, process_id=cfg["process_id"],
                                   coordinator_bind_address=address, initialization_timeout=60)


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

    def __init__(self, worker: PathLike, tmp: PathLike, tag: str, n: int, *, devices: int, timeout: float,
                 per_process: Callable[[int], dict] | None = None, **cfg: Any):
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
                self.procs.append(subprocess.Popen(
                    [sys.executable, self.worker, json.dumps(cfg)], env=self.env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent))
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
        return "\n".join(f"--- {self.tag} p{i} (rc {p.poll()}):\n" + self.path(i, ".log").read_text()[-4000:]
                         for i, p in enumerate(self.procs))

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
