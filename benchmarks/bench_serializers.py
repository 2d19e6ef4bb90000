"""flax_ckpt's serializers head to head: raw (numpy, packed files, crc32c per 8 MiB block) vs zarr3
(tensorstore, one zarr3 array per leaf, crc32c codec). The default serializer is chosen from this.

    python benchmarks/bench_serializers.py                     # mixed 256 MiB + 1000 small leaves, 3 rounds
    python benchmarks/bench_serializers.py --size-mb 64 --rounds 2

Workloads: "mixed" (benchmarks/fixtures.make_tree: a few large float32/bfloat16 arrays and ~400 small
ones) and "small" (1000 float32 leaves of 16 KiB: per-leaf overhead). Storages: a local folder (fsync,
page cache dropped with posix_fadvise(DONTNEED) before the cold restore) and memory:// (tensorstore's
in-memory kvstore, as the memory tier uses). Measures: save (to durable), restore into jax arrays on one
CPU device (cold and warm page cache), and a resharded restore onto 4 CPU devices (rows split 4 ways
where the first dimension allows it, replicated otherwise: the reads a multi-host restore makes).
Interleaved rounds, the serializer order alternating; medians, and raw's speed-up over zarr3 as the
median of per-round ratios.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

SERIALIZERS = ["raw", "zarr3"]


class Case:
    """One workload's trees: the state as jax arrays, and the two restore targets."""

    def __init__(self, name: str, flat: dict[str, np.ndarray]):
        import jax

        self.name, self.flat = name, flat
        devs = jax.devices("cpu")
        one = jax.sharding.SingleDeviceSharding(devs[0])
        mesh = jax.sharding.Mesh(np.array(devs[:4]), ("x",))
        P = jax.sharding.PartitionSpec

        def split(a: np.ndarray):
            rows = a.ndim and a.shape[0] % len(mesh.devices) == 0
            return jax.sharding.NamedSharding(mesh, P("x") if rows else P())

        self.tree = F.nest({k: jax.device_put(a, one) for k, a in flat.items()})
        self.target = F.nest(
            {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for k, a in flat.items()}
        )
        self.sharded = F.nest(
            {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=split(a)) for k, a in flat.items()}
        )


class Serializers(C.Scenario):
    """Contenders ``workload/storage/serializer``: each saves its workload (until durable on local
    disk), restores it cold (local disk only), warm, and resharded 4 ways; round 0 checks the bytes."""

    name = "serializers"

    def __init__(self, cases: list[Case], wheres: list[str], scratch: Path):
        self.cases, self.scratch = {c.name: c for c in cases}, scratch
        self.contenders = [f"{c.name}/{w}/{s}" for c in cases for w in wheres for s in SERIALIZERS]

    def time(self, name: str, r: int) -> dict[str, float]:
        import jax

        import flax_ckpt as fc
        from flax_ckpt._src.storage import open_storage

        case_name, where, ser = name.split("/")
        case, local, out = self.cases[case_name], where == "local", {}
        path: Any = (
            self.scratch / f"{case_name}-{ser}-{r}" if local else f"memory://bench/{case_name}-{ser}-{r}"
        )

        def restore(target: Any) -> float:
            t, got = C.timed(lambda: jax.block_until_ready(fc.restore(path, target)))
            if r == 0:
                F.same_bytes(case.flat, {k: np.asarray(v) for k, v in F.flat_items(got)})
            return t

        out["save"], _ = C.timed(
            lambda: (fc.save(path, case.tree, serializer=ser), local and F.fsync_tree(path))
        )
        if local:
            F.drop_cache(path)
            out["restore_cold"] = restore(case.target)
        out["restore_warm"] = restore(case.target)
        out["restore_4way"] = restore(case.sharded)
        gc.collect()
        if local:
            shutil.rmtree(path)
        else:
            parent, leaf = str(path).rsplit("/", 1)
            open_storage(parent).delete(leaf)
        return out

    def teardown(self) -> None:
        C.remove_scratch(self.scratch)


MEASURES = ["save", "restore_cold", "restore_warm", "restore_4way"]


def markdown(res: C.Results, cases: list[Case], wheres: list[str], rounds: int) -> str:
    lines = [
        f"{rounds} interleaved rounds; medians in seconds; 'raw speed-up' = t_zarr3 / t_raw "
        "(median of per-round ratios).",
        "",
        "| workload | storage | measure | raw | zarr3 | raw speed-up |",
        "|---|---|---|---:|---:|---:|",
    ]
    for case in cases:
        size = f"{case.name} ({len(case.flat)} leaves, {F.tree_bytes(case.flat) / C.MB:.0f} MiB)"
        for where in wheres:
            a, b = f"{case.name}/{where}/raw", f"{case.name}/{where}/zarr3"
            for m in MEASURES:
                if res.median(a, m) is not None:
                    lines.append(
                        f"| {size} | {where} | {m} | {C.fmt(res.median(a, m))} | "
                        f"{C.fmt(res.median(b, m))} | {C.fmt(res.paired_ratio(a, b, m))} |"
                    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = C.cli(__doc__.split("\n")[0], size_mb=256.0, rounds=3, scratch="serializers")
    ap.add_argument("--small-leaves", type=int, default=1000, help="leaves of the small workload (0: skip)")
    ap.add_argument("--storages", default="local,memory")
    args = ap.parse_args(argv)

    cases = [Case("mixed", F.make_tree(int(args.size_mb * C.MB)))]
    if args.small_leaves:
        cases.append(Case("small", F.many_small_tree(args.small_leaves, 16 << 10)))
    wheres = args.storages.split(",")
    info = C.machine_info(C.fresh_dir(args.scratch))
    res = C.run(Serializers(cases, wheres, args.scratch), args.rounds)
    body = {
        "benchmark": "serializers",
        "workloads": {c.name: {"leaves": len(c.flat), "nbytes": F.tree_bytes(c.flat)} for c in cases},
        "seconds": res.times,
    }
    C.report("serializers", args, info, body, markdown(res, cases, wheres, args.rounds))


if __name__ == "__main__":
    main()
