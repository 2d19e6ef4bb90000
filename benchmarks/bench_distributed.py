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
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    nbytes = args.size_mb * C.MB
    scratch = C.SCRATCH / "distributed"
    info = C.machine_info(C.SCRATCH)
    results = {}
    try:
        for n in args.procs:
            results[n] = run_job(n, args.devices, nbytes, args.rounds, scratch)
    finally:
        C.remove_scratch(scratch)  # and this process's scratch folder, left empty before
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
