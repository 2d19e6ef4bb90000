"""Aggregate save and restore throughput of one job on 1, 2 and 4 processes, same bytes, same devices.

    python benchmarks/bench_distributed.py                          # 256 MB, 4 CPU devices, 3 rounds
    python benchmarks/bench_distributed.py --size-mb 64 --rounds 1 --procs 1 2

The state is 8 float32 arrays of size/8 each, sharded by rows over all devices of the job (4 CPU
devices: 1 process x 4, 2 x 2, 4 x 1); each process creates only its own shards. Processes of a job
are real jax.distributed processes on 127.0.0.1 (gloo collectives); 1 process runs without
jax.distributed (the single-process path). Per round, timed on process 0 between key-value-store
barriers (so a number covers the slowest process):

- save: ``fc.save`` (raw serializer) until every process has returned (durable and committed);
- restore, cold: after the files' pages are dropped (posix_fadvise DONTNEED), ``fc.restore`` into the
  saved sharding until every array is ready;
- restore, warm: the same again, from the page cache;
- restore, resharded (cold): into the transposed layout P(None, "x") (every device reads a column block).

Throughput is total bytes / median seconds. Round 0 checks every restored shard bit-exact. The
worker of each job is this script itself (``--worker``). Reports go to bench_out/distributed-*.

What agreement costs as the job grows (``--agreement``; benchmarks/README.md, "At a thousand hosts"):

    python benchmarks/bench_distributed.py --agreement                  # 2, 4, 8, 16 processes, 3 rounds
    python benchmarks/bench_distributed.py --agreement --procs 2 4 --rounds 3

Jobs of N processes with one CPU device each and a tiny state (``--leaves`` float32 leaves of 4 rows
per process x 8, sharded by rows, plus a replicated vector and a step: a few KiB), so the times are
agreement, not bytes. Per round each job saves one step with a CheckpointManager and restores it
(a fresh manager each time, as a restarted job does). In the worker only (never in library code),
``distributed._client`` is replaced by a proxy that counts every call to the coordinator's key-value
store (key_value_set, blocking_key_value_get, key_value_dir_get, key_value_delete, ...) and the bytes of
keys and values sent and received, per process. Times are wall-clock marks (one machine, one clock):

- commit round: from the moment the last process finished writing its shards to the moment the last
  process saw the commit (its save returned from the agreement), so the slowest writer is not counted;
- p0 gather: process 0's wait for every peer's chunk records, reading and checking them, merging
  (dedupe) - the part of the commit round that grows with N on process 0;
- open view / restore vote: a restore's two key-value rounds, each from the moment the last process
  entered it to the moment the last one left it (so a slow reader's I/O is not counted);
- and, in this process, the merge at N = 16 ... 8192 synthetic processes (each holding one chunk of
  each leaf): ``distributed.dedupe`` and the manifest's exact tiling check, which process 0 runs on
  every save.

The report fits each count to a + b N + c N^2 (exact: the protocol's operations are a polynomial in
N) and each time to a + b N (a time is a sequence of key-value calls on one process; a quadratic
fitted to noisy times from 2 to 16 processes on few cores would be noise), and projects both to 1,024
and 8,192 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

LEAVES, COLS = 8, 1024
MEASURES = ("save", "restore_cold", "restore_warm", "restore_resharded_cold")


# ------------------------------------------------------------------------------------------- worker


def _block(leaf: int, rows: slice, cols: slice, nrows: int) -> Any:
    """Deterministic contents of rows x cols of leaf ``leaf`` (float32 bit patterns of a hash)."""
    import numpy as np

    r = np.arange(rows.start or 0, rows.stop if rows.stop is not None else nrows, dtype=np.uint32)
    c = np.arange(cols.start or 0, cols.stop if cols.stop is not None else COLS, dtype=np.uint32)
    salt = np.uint32((leaf * 0x9E3779B9) & 0xFFFFFFFF)
    x = (r[:, None] * np.uint32(COLS) + c[None, :]) * np.uint32(2654435761) ^ salt
    return x.view(np.float32)


def worker(cfg: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    n = cfg["procs"]
    if n > 1:
        addr = f"127.0.0.1:{cfg['port']}"
        jax.distributed.initialize(
            coordinator_address=addr, num_processes=n, process_id=cfg["rank"], coordinator_bind_address=addr
        )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_ckpt as fc
    from flax_ckpt._src.commit import distributed

    def barrier(name: str) -> None:
        if n > 1:
            distributed._client().wait_at_barrier(name, 600_000)

    nrows = cfg["bytes"] // LEAVES // (4 * COLS)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows, cols = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "x"))
    shape = (nrows, COLS)
    tree = {
        f"w{i}": jax.make_array_from_callback(shape, rows, lambda idx, i=i: _block(i, *idx, nrows))
        for i in range(LEAVES)
    }
    jax.block_until_ready(tree)

    def target(s):
        return {k: jax.ShapeDtypeStruct(shape, np.float32, sharding=s) for k in tree}

    def timed(name: str, fn) -> tuple[float, Any]:
        barrier(name + "-start")
        t0 = time.perf_counter()
        out = fn()
        barrier(name + "-end")
        return time.perf_counter() - t0, out

    times: dict[str, list[float]] = {m: [] for m in MEASURES}
    for r in range(cfg["rounds"]):
        path = os.path.join(cfg["dir"], f"r{r}")
        t, _ = timed(f"save{r}", lambda: fc.save(path, tree))
        times["save"].append(t)
        for m, sharding in (("restore_cold", rows), ("restore_warm", rows), ("restore_resharded_cold", cols)):
            if m.endswith("cold") and cfg["rank"] == 0:
                F.drop_cache(Path(path))
            t, got = timed(f"{m}{r}", lambda: jax.block_until_ready(fc.restore(path, target(sharding))))
            times[m].append(t)
            if r == 0:
                for i, (k, a) in enumerate(sorted(got.items(), key=lambda kv: int(kv[0][1:]))):
                    for sh in a.addressable_shards:
                        assert np.asarray(sh.data).tobytes() == _block(i, *sh.index, nrows).tobytes(), (m, k)
            del got
    if cfg["rank"] == 0:
        Path(cfg["out"]).write_text(json.dumps(times))
    sys.stdout.flush()
    os._exit(0)


# -------------------------------------------------------------------------------- agreement worker


class CountingClient:
    """The jax.distributed key-value client, counting calls and bytes (keys, values sent and received)
    per method; ``reset`` returns what was counted since the last reset."""

    def __init__(self, client: Any):
        self._client, self.ops, self.nbytes, self.seconds = client, {}, {}, {}

    def reset(self) -> dict[str, dict[str, Any]]:
        out = {"ops": dict(self.ops), "bytes": dict(self.nbytes), "seconds": dict(self.seconds)}
        self.ops, self.nbytes, self.seconds = {}, {}, {}
        return out

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._client, name)
        if not callable(fn):
            return fn

        def call(*args: Any, **kw: Any) -> Any:
            sent = sum(len(a) for a in args if isinstance(a, (str, bytes)))
            self.ops[name] = self.ops.get(name, 0) + 1
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kw)
            finally:
                self.nbytes[name] = self.nbytes.get(name, 0) + sent
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            got = (
                len(out)
                if isinstance(out, (str, bytes))
                else (sum(len(k) + len(v) for k, v in out) if isinstance(out, list) else 0)
            )
            self.nbytes[name] += got
            return out

        return call


def agreement_worker(cfg: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    n, rank = cfg["procs"], cfg["rank"]
    addr = f"127.0.0.1:{cfg['port']}"
    jax.distributed.initialize(
        coordinator_address=addr,
        num_processes=n,
        process_id=rank,
        coordinator_bind_address=addr,
        initialization_timeout=300,
    )
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_ckpt as fc
    from flax_ckpt._src.commit import distributed
    from flax_ckpt._src.manager import steps as steps_mod
    from flax_ckpt._src.serializers.raw import RawSerializer

    distributed.set_timeout(600)
    raw_client = distributed._client()
    counting = CountingClient(raw_client)
    distributed._client = lambda: counting  # the benchmark's proxy; library code is unchanged
    marks: dict[str, float] = {}

    def barrier(name: str) -> None:
        raw_client.wait_at_barrier(name, 600_000)

    class Marking(RawSerializer):
        def write(self, storage, items, *, tag):
            written = super().write(storage, items, tag=tag)
            marks["written"] = time.time()
            return written

    def wrap(
        owner: Any, name: str, before: str | None, after: str | None, seconds: str | None = None
    ) -> None:
        real = getattr(owner, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.time()
            if before:
                marks[before] = t0
            out = real(*a, **kw)
            if after:
                marks[after] = time.time()
            if seconds:
                marks[seconds] = marks.get(seconds, 0.0) + time.time() - t0
            return out

        setattr(owner, name, wrapper)

    wrap(distributed.SaveRound, "announce", None, "visible")
    wrap(distributed.SaveRound, "await_commit", None, "visible")
    wrap(distributed.SaveRound, "gather", None, None, "gather_s")
    wrap(distributed, "dedupe", None, None, "dedupe_s")
    wrap(distributed, "vote", "vote_in", "vote_out")
    wrap(steps_mod.StepIndex, "agree", "agree_in", "agree_out")

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    host = {
        f"w{i}": np.arange(4 * n * 8, dtype=np.float32).reshape(4 * n, 8) + i for i in range(cfg["leaves"])
    }
    host["b"] = np.ones(8, np.float32)
    tree = {
        k: jax.make_array_from_callback(v.shape, whole if k == "b" else rows, lambda idx, v=v: v[idx])
        for k, v in host.items()
    }
    tree["step"] = 0
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) if k != "step" else 0
        for k, v in tree.items()
    }
    jax.block_until_ready(tree)
    out: dict[str, list] = {"save": [], "restore": [], "open": []}
    with fc.CheckpointManager(cfg["dir"], serializer=Marking(), max_to_keep=2) as mgr:
        for r in range(cfg["rounds"] + 1):  # round 0 warms up (first save, compilation)
            barrier(f"save{r}")
            counting.reset()
            marks.clear()
            mgr.save(r + 1, dict(tree, step=r + 1))
            mgr.wait_until_finished()
            rec = {"kv": counting.reset(), "marks": dict(marks)}
            barrier(f"save{r}-end")
            if r:
                out["save"].append(rec)
    for r in range(cfg["rounds"] + 1):
        barrier(f"open{r}")
        counting.reset()
        marks.clear()
        t0 = time.time()
        with fc.CheckpointManager(cfg["dir"], serializer=Marking(), max_to_keep=2) as mgr:
            opened = {"kv": counting.reset(), "seconds": time.time() - t0}
            barrier(f"restore{r}")
            marks.clear()
            got = mgr.restore(target=target)
            rec = {"kv": counting.reset(), "marks": dict(marks), "read_s": mgr.restore_stats[-1].seconds}
            for k, a in got.items():
                if k != "step":
                    for sh in a.addressable_shards:
                        assert np.asarray(sh.data).tobytes() == host[k][sh.index].tobytes(), k
        barrier(f"restore{r}-end")
        if r:
            out["open"].append(opened)
            out["restore"].append(rec)
    Path(cfg["out"] + f".p{rank}.json").write_text(json.dumps(out))
    sys.stdout.flush()
    jax.distributed.shutdown()
    os._exit(0)


def run_agreement_job(procs: int, rounds: int, leaves: int, scratch: Path) -> dict[str, Any]:
    """One N-process job (agreement_worker); per round: the job-wide figures (see the docstring)."""
    folder = C.fresh_dir(scratch / f"a{procs}")
    out = str(scratch / f"a{procs}")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="3",
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
    )
    cfg = {
        "procs": procs,
        "port": _free_port(),
        "rounds": rounds,
        "leaves": leaves,
        "dir": str(folder),
        "out": out,
        "agreement": True,
    }
    t0 = time.time()
    _launch(procs, cfg, env, timeout=1800)
    per = [json.loads(Path(f"{out}.p{i}.json").read_text()) for i in range(procs)]

    def total(kind: str, r: int, what: str, only: int | None = None) -> int:
        recs = [per[i][kind][r]["kv"][what] for i in (range(procs) if only is None else [only])]
        return sum(sum(d.values()) for d in recs)

    def span(kind: str, r: int, first: str, last: str) -> float:
        ms = [per[i][kind][r]["marks"] for i in range(procs)]
        return max(m[last] for m in ms) - max(m[first] for m in ms)

    rows = []
    for r in range(rounds):
        rows.append(
            {
                "commit_round_s": span("save", r, "written", "visible"),
                "p0_gather_s": per[0]["save"][r]["marks"].get("gather_s", 0.0),
                "p0_dedupe_s": per[0]["save"][r]["marks"].get("dedupe_s", 0.0),
                "save_ops": total("save", r, "ops"),
                "save_bytes": total("save", r, "bytes"),
                "save_ops_p0": total("save", r, "ops", 0),
                "save_bytes_p0": total("save", r, "bytes", 0),
                "save_kinds": {
                    k: sum(per[i]["save"][r]["kv"]["ops"].get(k, 0) for i in range(procs))
                    for k in sorted({k for p in per for k in p["save"][r]["kv"]["ops"]})
                },
                "view_round_s": span("restore", r, "agree_in", "agree_out"),
                "vote_round_s": span("restore", r, "vote_in", "vote_out"),
                "read_s_max": max(per[i]["restore"][r]["read_s"] for i in range(procs)),
                "restore_ops": total("restore", r, "ops"),
                "restore_bytes": total("restore", r, "bytes"),
                "restore_ops_p0": total("restore", r, "ops", 0),
                "restore_bytes_p0": total("restore", r, "bytes", 0),
                "open_ops": total("open", r, "ops"),
                "open_bytes": total("open", r, "bytes"),
                "open_s_max": max(per[i]["open"][r]["seconds"] for i in range(procs)),
                "set_s": statistics.mean(
                    per[i]["save"][r]["kv"]["seconds"]["key_value_set"]
                    / per[i]["save"][r]["kv"]["ops"]["key_value_set"]
                    for i in range(procs)
                ),
            }
        )
    return {"rounds": rows, "job_s": time.time() - t0}


def synthetic_merge(ns: list[int], leaves: int, scratch: Path) -> dict[int, dict[str, float]]:
    """Process 0's share of a commit at N processes that each hold one row block of each leaf, in this
    process: reading and checking N - 1 part records (local files, as SaveRound.gather does), the merge
    (``distributed.dedupe``) and the manifest's exact tiling check of every leaf."""
    import crc32c

    from flax_ckpt._src.checks import tiling_problem
    from flax_ckpt._src.commit import distributed
    from flax_ckpt._src.serializers import Written
    from flax_ckpt._src.storage import LocalStorage

    out = {}
    for n in ns:
        parts = [
            Written(
                {
                    leaf: [
                        {
                            "index": [[4 * j, 4 * j + 4], [0, 8]],
                            "file": f"p{j}.bin",
                            "offset": 0,
                            "nbytes": 128,
                            "crc32c": 0,
                        }
                    ]
                    for leaf in range(leaves)
                },
                {f"p{j}.bin": 128},
            )
            for j in range(n)
        ]
        stage = LocalStorage(str(C.fresh_dir(scratch / f"parts{n}")))
        rnd = distributed.SaveRound("bench", "bench", 0, n)
        msgs = {}
        for j in range(1, n):
            body = json.dumps(
                {
                    "process": j,
                    "tree": "t",
                    "files": parts[j].files,
                    "chunks": {str(k): v for k, v in parts[j].chunks.items()},
                }
            ).encode()
            stage.write(f"parts/p{j}.json", [body])
            msgs[j] = {"part": f"parts/p{j}.json", "nbytes": len(body), "crc32c": crc32c.crc32c(body)}
        F.drop_cache(Path(stage.local_path))
        t0 = time.perf_counter()
        read = [parts[0]] + [rnd._read_part(stage, j, msgs[j], "t") for j in range(1, n)]
        t1 = time.perf_counter()
        merged = distributed.dedupe(read)
        t2 = time.perf_counter()
        for leaf in range(leaves):
            boxes = [r["index"] for w in merged for r in w.chunks.get(leaf, [])]
            assert tiling_problem(boxes, [[0, 4 * n], [0, 8]]) is None
        t3 = time.perf_counter()
        out[n] = {"read_parts_s": t1 - t0, "dedupe_s": t2 - t1, "tiling_s": t3 - t2}
        import shutil

        shutil.rmtree(stage.local_path)
    return out


def fit(ns: list[int], ys: list[float], *, count: bool) -> tuple[list[float], str]:
    """A count (exact: the protocol's operations are a polynomial in N) is fitted to a + b N + c N^2; a
    time to a + b N by least squares (each is a sequence of key-value calls on one process, or the merge
    on process 0, so linear in N once the merge is; with 2 to 16 processes on few cores a quadratic term
    fitted to noisy times would be noise squared). Returns the coefficients and the growth."""
    import numpy as np

    x, y = np.asarray(ns, float), np.asarray(ys, float)
    if count and len(ns) >= 3:
        c, b, a = np.polyfit(x, y, 2)
        if abs(c) * x.max() ** 2 > 0.05 * max(abs(y.max()), 1.0):  # not the digits of longer keys
            return [float(a), float(b), float(c)], "N^2"
    b, a = np.polyfit(x, y, 1)
    return [float(a), float(b), 0.0], "N" if b * x.max() > 0.05 * max(abs(y.max()), 1e-9) else "flat"


def project(coef: list[float], n: int) -> float:
    return coef[0] + coef[1] * n + coef[2] * n * n


def agreement_main(args: argparse.Namespace) -> None:
    procs = args.procs if args.procs != [1, 2, 4] else [2, 4, 8, 16]
    scratch = C.SCRATCH / "agreement"
    info = C.machine_info(C.SCRATCH)
    jobs = {}
    synth_ns = [16, 64, 256, 1024, 2048] if args.quick_merge else [16, 64, 256, 1024, 2048, 4096, 8192]
    try:
        for n in procs:
            jobs[n] = run_agreement_job(n, args.rounds, args.leaves, scratch)
            print(f"{n} processes: {jobs[n]['job_s']:.1f} s", flush=True)
        synth = synthetic_merge(synth_ns, args.leaves, scratch)
    finally:
        if scratch.exists():
            import shutil

            shutil.rmtree(scratch)
    med = {
        n: {k: statistics.median(r[k] for r in j["rounds"]) for k in j["rounds"][0] if k != "save_kinds"}
        for n, j in jobs.items()
    }
    cols = [
        ("commit_round_s", "commit round (s)"),
        ("p0_gather_s", "p0 gather (s)"),
        ("view_round_s", "restore view round (s)"),
        ("vote_round_s", "restore vote round (s)"),
        ("read_s_max", "restore read, slowest (s)"),
        ("save_ops", "kv ops / save"),
        ("save_ops_p0", "kv ops / save, p0"),
        ("save_bytes", "kv bytes / save"),
        ("restore_ops", "kv ops / restore"),
        ("restore_bytes", "kv bytes / restore"),
        ("open_ops", "kv ops / open"),
    ]
    lines = [
        f"# What agreement costs, {args.leaves + 2} leaves, {args.rounds} rounds (medians)\n",
        "| processes | " + " | ".join(c for _, c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for n in procs:
        lines.append(
            f"| {n} | "
            + " | ".join(
                f"{med[n][k]:.4f}" if k.endswith("_s") or k.endswith("_max") else f"{med[n][k]:.0f}"
                for k, _ in cols
            )
            + " |"
        )
    kinds = {n: jobs[n]["rounds"][0]["save_kinds"] for n in procs}
    lines += [
        "",
        "key-value operations of one save, by kind (all processes): "
        + "; ".join(f"{n}: {kinds[n]}" for n in procs),
        "",
    ]
    lines += ["| measure | growth | 1,024 processes | 8,192 processes |", "|---|---|---|---|"]
    fits = {}
    for k, c in cols:
        unit = "s" if k.endswith("_s") or k.endswith("_max") else ""
        coef, growth = fit(procs, [med[n][k] for n in procs], count=not unit)
        fits[k] = {"coef": coef, "growth": growth}
        lines.append(
            f"| {c} | {growth} | {project(coef, 1024):,.3g} {unit} | {project(coef, 8192):,.3g} {unit} |"
        )
    lines += [
        "",
        "key-value call, mean seconds per set (all processes): "
        + ", ".join(f"{n}: {med[n]['set_s'] * 1e6:.0f} us" for n in procs),
    ]
    lines += [
        "",
        "| synthetic processes | read N-1 part records, cold (s) | dedupe (s) | exact tiling check (s) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {n} | {v['read_parts_s']:.4f} | {v['dedupe_s']:.4f} | {v['tiling_s']:.4f} |"
        for n, v in synth.items()
    ]
    md = "\n".join(lines) + f"\n\nmachine: {info.get('cpus')} CPUs, load {os.getloadavg()}\n"
    js, mdp = C.write_report(
        "distributed-agreement",
        {"info": info, "args": vars(args), "jobs": jobs, "medians": med, "fits": fits, "synthetic": synth},
        md,
    )
    print(md)
    print(f"report: {mdp}")


# ------------------------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(procs: int, devices: int, nbytes: int, rounds: int, scratch: Path) -> dict[str, list[float]]:
    folder = C.fresh_dir(scratch / f"n{procs}")
    out = scratch / f"n{procs}.json"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TF_CPP_MIN_LOG_LEVEL="3",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // procs}",
    )
    cfg = {
        "procs": procs,
        "port": _free_port(),
        "bytes": nbytes,
        "rounds": rounds,
        "dir": str(folder),
        "out": str(out),
    }
    _launch(procs, cfg, env, timeout=1200)
    return json.loads(out.read_text())


def _launch(procs: int, cfg: dict[str, Any], env: dict[str, str], *, timeout: float) -> None:
    """Runs a job of ``procs`` workers (this script with --worker, ranks 0..procs-1) to its end; a
    failed or overdue one stops the benchmark, its processes killed."""
    ps = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(dict(cfg, rank=i))],
            env=env,
            start_new_session=True,
        )
        for i in range(procs)
    ]
    try:
        for p in ps:
            if p.wait(timeout=timeout) != 0:
                raise SystemExit(f"{procs}-process job failed (rc {p.returncode})")
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--devices", type=int, default=4, help="devices of the whole job")
    ap.add_argument("--agreement", action="store_true", help="what agreement costs at 2, 4, 8, 16 processes")
    ap.add_argument("--leaves", type=int, default=4, help="--agreement: sharded leaves of the tiny state")
    ap.add_argument("--quick-merge", action="store_true", help="--agreement: synthetic merge up to 2048 only")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        return agreement_worker(cfg) if cfg.get("agreement") else worker(cfg)
    if args.agreement:
        return agreement_main(args)
    nbytes = args.size_mb * C.MB
    scratch = C.SCRATCH / "distributed"
    info = C.machine_info(C.SCRATCH)
    results = {}
    try:
        for n in args.procs:
            results[n] = run_job(n, args.devices, nbytes, args.rounds, scratch)
    finally:
        if scratch.exists():
            import shutil

            shutil.rmtree(scratch)
    rows = ["| processes x devices | " + " | ".join(MEASURES) + " |", "|---" * (len(MEASURES) + 1) + "|"]
    for n, times in results.items():
        cells = [
            f"{nbytes / statistics.median(times[m]) / 1e9:.2f} GB/s ({statistics.median(times[m]):.2f} s)"
            for m in MEASURES
        ]
        rows.append(f"| {n} x {args.devices // n} | " + " | ".join(cells) + " |")
    md = (
        f"# Distributed save/restore, {args.size_mb} MB, {args.rounds} rounds (medians)\n\n"
        + "\n".join(rows)
        + f"\n\nmachine: {info.get('cpus')} CPUs, load {os.getloadavg()}\n"
    )
    js, mdp = C.write_report("distributed", {"info": info, "args": vars(args), "seconds": results}, md)
    print(md)
    print(f"report: {mdp}")


if __name__ == "__main__":
    main()
