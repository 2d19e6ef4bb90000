"""Cost linear in leaves and in bytes: many small leaves, and states near host memory.

    python benchmarks/bench_scale.py                       # leaves 1k/5k/20k/100k, sizes 1/4 GiB, 3 rounds
    python benchmarks/bench_scale.py --leaves 5000 20000 --sizes-gb 1 --rounds 2 --peers orbax

Part 1, leaves: N float32 leaves of 1 KiB, as jax arrays on the CPU. Per leaf, interleaved over rounds:
``jax.device_put`` of the same host arrays one by one (the floor: what any restore into jax arrays
pays per leaf), fc.save, fc.restore into the jax target, into a target sharded over 4 devices,
without a target, fc.metadata, opening a CheckpointManager on the run (scan + restore of the newest
step), an async manager save (the time it blocks the caller; then the same structure saved again, each
save timed until durable: the writer's work per leaf), the same in Orbax's layout (format="orbax")
and a memory-tier save (blocked, and to committed in memory). At ``--peer-leaves`` (20k) Orbax's
StandardCheckpointer and torch DCP are timed in the same rounds. Ratios: flax_ckpt / device_put per
leaf, and growth of the per-leaf cost with N.

Part 2, bytes: ``make_tree`` states (a few large arrays and ~400 small ones) of 1 and 4 GiB
(``--sizes-gb``; a size is skipped when free memory is short). Per GB: save and restore (warm page cache: the disk is not what is measured) for flax_ckpt and Orbax, and
the peak RSS above the state during each (VmHWM from /proc/self/status, reset through
/proc/self/clear_refs before each measurement).

Reports go to bench_out/bench_scale-<time>.{json,md}.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flax_ckpt as fc  # noqa: E402

GB = 1 << 30


# ------------------------------------------------------------------------------------------ part 1


def leaf_state(n: int) -> tuple[dict, Any]:
    host = F.nest(F.many_small_tree(n, 1024))
    return host, jax.block_until_ready(jax.tree.map(jax.device_put, host))


class Leaves(C.Scenario):
    """N leaves: contenders device_put (the floor, one per leaf), flax_ckpt (every per-leaf measure)
    and the peers (save, restore); one warm-up round (compiles, first touch of every code path)."""

    name, floors, warmup = "bench_scale", ["device_put"], 1

    def __init__(self, n: int, scratch: Path, peers: list[str]):
        self.n, self.scratch, self.contenders = n, scratch, ["device_put", "flax_ckpt", *peers]
        self.host, self.state = leaf_state(n)
        self.flat_host = jax.tree.leaves(self.host)
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
        sh = NamedSharding(mesh, P("x"))
        self.sharded_target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), self.host
        )

    def device_put(self) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready([jax.device_put(a) for a in self.flat_host])
        return time.perf_counter() - t0

    def time(self, name: str, r: int) -> dict[str, float]:
        d, res = C.fresh_dir(self.scratch / f"leaves-{self.n}-{r}-{name}"), C.Results()
        if name == "device_put":
            res.add(name, "per_leaf", self.device_put())
        elif name == "flax_ckpt":
            self.flax_ckpt(d, r, res)
        else:
            self.run_peer(name, d / name, res)
        shutil.rmtree(d, ignore_errors=True)
        return {m: v[0] for m, v in res.times[name].items()}

    def flax_ckpt(self, d: Path, r: int, res: C.Results) -> None:
        ck = d / "ck"
        t, _ = C.timed(lambda: fc.save(ck, self.state))
        res.add("flax_ckpt", "save", t)
        t, out = C.timed(lambda: jax.block_until_ready(fc.restore(ck, self.state)))
        res.add("flax_ckpt", "restore", t)
        if r < 0:
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), self.flat_host))
        del out
        t, out = C.timed(lambda: jax.block_until_ready(fc.restore(ck, self.sharded_target)))
        res.add("flax_ckpt", "restore_sharded", t)
        del out
        t, _ = C.timed(lambda: fc.restore(ck))
        res.add("flax_ckpt", "restore_no_target", t)
        t, _ = C.timed(lambda: fc.metadata(ck))
        res.add("flax_ckpt", "metadata", t)
        run = d / "run"
        self.manager_saves(run, "native", "manager_save", res)
        self.manager_saves(d / "orbax_format", "orbax", "orbax_format_save", res)  # format="orbax"

        def open_and_restore():
            with fc.CheckpointManager(run) as m:
                jax.block_until_ready(m.restore(target=self.state))

        t, _ = C.timed(open_and_restore)
        res.add("flax_ckpt", "manager_open_restore", t)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else d
        local = shm / f"flax_ckpt_bench_{os.getpid()}"
        tiers = fc.Tiers(local_dir=str(local), persist_interval_steps=None)
        with fc.CheckpointManager(d / "tiered", tiers=tiers) as mgr:
            t0 = time.perf_counter()
            mgr.save(1, self.state)
            res.add("flax_ckpt", "tier_save_blocked", time.perf_counter() - t0)
            mgr.wait_until_finished()
            res.add("flax_ckpt", "tier_save_memory", mgr.tier_stats[-1].memory_s)
        shutil.rmtree(local, ignore_errors=True)  # the tier's folder, left empty by close()

    def manager_saves(self, run: Path, fmt: str, name: str, res: C.Results) -> None:
        """An async manager save of the state in ``fmt`` (the time it blocks), then the same structure
        saved again, each save timed until durable (the writer's work per leaf)."""
        with fc.CheckpointManager(run, async_save=True, format=fmt) as mgr:
            t0 = time.perf_counter()
            mgr.save(1, self.state)
            res.add("flax_ckpt", f"{name}_blocked", time.perf_counter() - t0)
            mgr.wait_until_finished()
            again = []
            for step in (2, 3, 4):
                t0 = time.perf_counter()
                mgr.save(step, self.state)
                mgr.wait_until_finished()
                again.append(time.perf_counter() - t0)
            res.add("flax_ckpt", f"{name}_again_durable", statistics.median(again))

    def run_peer(self, peer: str, path: Path, res: C.Results) -> None:
        if peer == "orbax":
            import orbax.checkpoint as ocp

            target = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.state
            )
            with ocp.StandardCheckpointer() as ckptr:
                t0 = time.perf_counter()
                ckptr.save(path, self.state)
                ckptr.wait_until_finished()
                res.add("orbax", "save", time.perf_counter() - t0)
                t, _ = C.timed(lambda: jax.block_until_ready(ckptr.restore(path, target)))
                res.add("orbax", "restore", t)
        elif peer == "torch-dcp":
            import torch
            import torch.distributed.checkpoint as dcp

            sd = {k: torch.from_numpy(a) for k, a in F.flat_items(self.host)}
            t, _ = C.timed(lambda: dcp.save(sd, checkpoint_id=str(path), no_dist=True))
            res.add("torch-dcp", "save", t)
            out = {k: torch.empty_like(v) for k, v in sd.items()}
            t, _ = C.timed(lambda: dcp.load(out, checkpoint_id=str(path), no_dist=True))
            res.add("torch-dcp", "restore", t)


LEAF_MEASURES = [
    "save",
    "restore",
    "restore_sharded",
    "restore_no_target",
    "metadata",
    "manager_save_blocked",
    "manager_save_again_durable",
    "manager_open_restore",
    "tier_save_blocked",
    "tier_save_memory",
    "orbax_format_save_blocked",
    "orbax_format_save_again_durable",
]


def leaves_part(ns: list[int], rounds: int, peer_n: int, peers: list[str], scratch: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in ns:
        bench = Leaves(n, scratch, peers if n == peer_n else [])
        res = C.run(bench, rounds)
        per = {m: 1e6 * res.median("flax_ckpt", m) / n for m in LEAF_MEASURES}
        dp = 1e6 * res.median("device_put", "per_leaf") / n
        row = {
            "n": n,
            "device_put_us": dp,
            "flax_ckpt_us": per,
            "rounds_us": {  # every round's microseconds per leaf: the charts draw their spread
                m: [1e6 * t / n for t in res.times["flax_ckpt"].get(m, [])] for m in LEAF_MEASURES
            },
            "vs_device_put": {
                m: statistics.median(
                    t / d for t, d in zip(res.times["flax_ckpt"][m], res.times["device_put"]["per_leaf"])
                )
                for m in LEAF_MEASURES
            },
        }
        for peer in peers if n == peer_n else []:
            row[peer] = {
                m: {
                    "us_per_leaf": 1e6 * res.median(peer, m) / n,
                    "flax_ckpt_faster_x": res.paired_ratio("flax_ckpt", peer, m),
                }
                for m in ("save", "restore")
            }
        out[str(n)] = row
        del bench
        gc.collect()
    return out


# ------------------------------------------------------------------------------------------ part 2


class Size(C.Scenario):
    """A large state saved and restored (warm page cache) by flax_ckpt and Orbax: seconds, and the peak
    RSS above the state during each (``<measure>_peak``, bytes)."""

    def __init__(self, names: list[str], state: dict, target: dict, scratch: Path):
        self.contenders, self.state, self.target, self.scratch = names, state, target, scratch

    def time(self, name: str, r: int) -> dict[str, float]:
        path, state, target, out = C.fresh_dir(self.scratch / str(r)) / name, self.state, self.target, {}
        if name == "flax_ckpt":
            save = lambda: fc.save(path, state)  # noqa: E731
            restore = lambda: jax.block_until_ready(fc.restore(path, target))  # noqa: E731
        else:
            import orbax.checkpoint as ocp

            ckptr = ocp.StandardCheckpointer()
            save = lambda: (ckptr.save(path, state), ckptr.wait_until_finished())  # noqa: E731
            restore = lambda: jax.block_until_ready(ckptr.restore(path, target))  # noqa: E731
        out["save"], out["save_peak"], _ = F.peak_above(save)
        out["restore"], out["restore_peak"], got = F.peak_above(restore)
        del got
        if name == "orbax":
            ckptr.close()
        shutil.rmtree(path.parent, ignore_errors=True)
        gc.collect()
        return out


def size_part(sizes: list[float], rounds: int, scratch: Path, with_orbax: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for gb in sizes:
        total = int(gb * GB)
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        need = 3.2 if with_orbax else 2.3  # the state, what a restore reads into, Orbax's own copies
        if free < need * total:
            print(f"size {gb} GiB: skipped, {free / GB:.1f} GiB free (this needs ~{need}x)", flush=True)
            continue
        host = F.make_tree(total)
        state = jax.block_until_ready(
            {k: jax.device_put(a) for k, a in host.items()}
        )  # no transfer in flight
        del host
        gc.collect()
        nbytes = sum(a.nbytes for a in state.values())
        target = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for k, a in state.items()}
        names = ["flax_ckpt"] + (["orbax"] if with_orbax else [])
        res = C.run(Size(names, state, target, scratch / f"size-{gb}"), rounds)
        rss = {n: {m: res.times[n][f"{m}_peak"] for m in ("save", "restore")} for n in names}
        row: dict[str, Any] = {"gib": gb, "nbytes": nbytes}
        for name in names:
            row[name] = {
                m: {
                    "s_per_gb": res.median(name, m) / (nbytes / 1e9),
                    "peak_rss_above_state_x": statistics.median(rss[name][m]) / nbytes,
                }
                for m in ("save", "restore")
            }
        if with_orbax:
            row["flax_ckpt_faster_x"] = {
                m: res.paired_ratio("flax_ckpt", "orbax", m) for m in ("save", "restore")
            }
        out[str(gb)] = row
        state = target = None  # free the state before the next size
        gc.collect()
    return out


# ---------------------------------------------------------------------------------------- report


def markdown(leaves: dict[str, Any], sizes: dict[str, Any], rounds: int) -> str:
    lines = [
        f"Leaves of 1 KiB, {rounds} interleaved rounds, medians; us per leaf (x one jax.device_put per leaf).",
        "",
    ]
    cols = [
        "save",
        "restore",
        "restore_sharded",
        "restore_no_target",
        "metadata",
        "manager_open_restore",
        "manager_save_blocked",
        "manager_save_again_durable",
        "tier_save_blocked",
        "tier_save_memory",
        "orbax_format_save_blocked",
        "orbax_format_save_again_durable",
    ]
    lines.append("| leaves | device_put | " + " | ".join(cols) + " |")
    lines.append("|---:|---:|" + "---:|" * len(cols))
    for row in leaves.values():
        cells = [f"{row['flax_ckpt_us'][c]:.0f} ({row['vs_device_put'][c]:.2f}x)" for c in cols]
        lines.append(f"| {row['n']} | {row['device_put_us']:.0f} | " + " | ".join(cells) + " |")
    ns = sorted(int(k) for k in leaves)
    if 5000 in ns and 20000 in ns:
        g = {c: leaves["20000"]["flax_ckpt_us"][c] / leaves["5000"]["flax_ckpt_us"][c] for c in cols}
        lines += [
            "",
            "Per-leaf cost growth from 5k to 20k leaves: " + ", ".join(f"{c} {v:.2f}x" for c, v in g.items()),
        ]
    for row in leaves.values():
        for peer in ("orbax", "torch-dcp"):
            if peer in row:
                lines.append(
                    f"\nAt {row['n']} leaves, {peer}: "
                    + ", ".join(
                        f"{m} {v['us_per_leaf']:.0f} us/leaf (flax_ckpt {v['flax_ckpt_faster_x']:.2f}x faster)"
                        for m, v in row[peer].items()
                    )
                )
    if sizes:
        lines += [
            "",
            "| state | contender | save s/GB | restore s/GB | peak RSS above state: save | restore |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for row in sizes.values():
            for name in ("flax_ckpt", "orbax"):
                if name in row:
                    v = row[name]
                    lines.append(
                        f"| {row['gib']} GiB | {name} | {v['save']['s_per_gb']:.2f} | "
                        f"{v['restore']['s_per_gb']:.2f} | {v['save']['peak_rss_above_state_x']:.2f}x | "
                        f"{v['restore']['peak_rss_above_state_x']:.2f}x |"
                    )
            if "flax_ckpt_faster_x" in row:
                f = row["flax_ckpt_faster_x"]
                lines.append(
                    f"| {row['gib']} GiB | flax_ckpt vs Orbax | {f['save']:.2f}x faster | "
                    f"{f['restore']:.2f}x faster | | |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = C.cli(__doc__, rounds=3)
    ap.add_argument("--leaves", type=int, nargs="*", default=[1000, 5000, 20000, 100000])
    ap.add_argument(
        "--peer-leaves", type=int, default=20000, help="leaf count at which Orbax and torch DCP run"
    )
    ap.add_argument("--peers", nargs="*", default=["orbax", "torch-dcp"])
    ap.add_argument("--sizes-gb", type=float, nargs="*", default=[1, 4])
    ap.add_argument("--no-orbax-sizes", action="store_true", help="part 2 without Orbax")
    args = ap.parse_args(argv)
    peers = [p for p in args.peers if p != "torch-dcp" or _has_torch()]
    scratch = C.SCRATCH
    try:
        info = C.machine_info(scratch.parent)
        leaves = leaves_part(args.leaves, args.rounds, args.peer_leaves, peers, scratch)
        sizes = size_part(args.sizes_gb, args.rounds, scratch, not args.no_orbax_sizes)
        md = markdown(leaves, sizes, args.rounds)
        js, mdp = C.write_report(
            "bench_scale", {"machine": info, "args": vars(args), "leaves": leaves, "sizes": sizes}, md
        )
        print(md)
        print(f"wrote {js} and {mdp}")
    finally:
        C.remove_scratch(scratch)


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401

        return True
    except ImportError:
        print("torch is not installed (pip install torch==2.13.0): torch DCP left out")
        return False


if __name__ == "__main__":
    main()
