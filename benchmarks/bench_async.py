"""Asynchronous saves: how long training is blocked, how long until durable, host memory, step overhead.

    python benchmarks/bench_async.py                          # 1024 MiB state, 5 rounds + training run
    python benchmarks/bench_async.py --size-mb 64 --rounds 2 --train-steps 60

Part 1, the same ~1 GB state (benchmarks/fixtures.make_tree) saved asynchronously by
- flax_ckpt: ``CheckpointManager(async_save=True, max_to_keep=1).save(step, state)`` then
  ``wait_until_finished()``; the state as jax CPU arrays, and "flax_ckpt-numpy", the same bytes as
  numpy arrays (either way copied into the manager's arena, engine/arena.py);
- Orbax: ``CheckpointManager`` (async, max_to_keep=1) with ``args.StandardSave``, then
  ``wait_until_finished()``;
- torch DCP: ``async_save(state_dict, no_dist=True)`` (its default stager), then ``future.result()``;
- memcpy floor: ``np.copyto`` of every array into buffers allocated and touched beforehand, one thread:
  the least a host snapshot can cost on this machine;
- flax_ckpt-numpy-snapshot-reuse: ``snapshot(numpy_state, reuse=previous)`` (engine/snapshot.py), what the
  manager would block for on a numpy state if it kept the previous save's host buffers (measured on
  its own; no write).
One manager per library for all rounds, after one untimed warm-up save (so one-off set-up is not
counted); every round saves a new step, the order of libraries rotated. "blocked" is the time the save
call holds the caller; "durable" is from the save call until the library says the step is on disk
(for the managers this includes retention deleting the previous step; torch's folders are deleted
untimed). Peak RSS: resident memory sampled every 2 ms (runner.RssPeak) from the save call until durable, minus
the resident memory just before it. Ratios are medians of per-round ratios.

Part 2, a small Flax MLP trained with optax adam for ``--train-steps`` steps with a checkpoint every 10
steps (async), vs the same loop without checkpoints (and with Orbax's manager), interleaved rounds.
Two overheads, each the median of per-round ratios: wall time per step, and process CPU time per step
(all threads, so the checkpointer's background work counts; on a shared machine it varies far less than
wall time, which other users' load moves by tens of percent).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

ALL = ["memcpy", "flax_ckpt", "flax_ckpt-numpy", "flax_ckpt-numpy-snapshot-reuse", "orbax", "torch-dcp"]
BLOCK_ONLY = ("memcpy", "flax_ckpt-numpy-snapshot-reuse")  # no durable time: they write nothing


class Async:
    """start(step) returns when the caller may go on; finish() returns once the step is durable."""

    name: str

    def start(self, step: int) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class Memcpy(Async):
    name = "memcpy"

    def __init__(self, flat: dict[str, np.ndarray]):
        self.flat = flat
        self.bufs = {k: np.empty_like(a) for k, a in flat.items()}
        for b in self.bufs.values():
            b.fill(0)

    def start(self, step: int) -> None:
        for k, a in self.flat.items():
            np.copyto(self.bufs[k], a)

    def finish(self) -> None:
        pass


class FlaxCkpt(Async):
    name = "flax_ckpt"

    def __init__(self, state: Any, directory: Path, name: str = "flax_ckpt"):
        import flax_ckpt as fc

        self.state, self.name = state, name
        self.mgr = fc.CheckpointManager(directory, max_to_keep=1, async_save=True)

    def start(self, step: int) -> None:
        assert self.mgr.save(step, self.state, force=True)

    def finish(self) -> None:
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()


class SnapshotReuse(Async):
    """engine/snapshot.py's snapshot with the previous snapshot's buffers: the blocking part only."""

    name = "flax_ckpt-numpy-snapshot-reuse"

    def __init__(self, state: Any):
        from flax_ckpt._src.engine import snapshot as checkpoint

        self.snapshot, self.state = checkpoint.snapshot, state
        self.prev = checkpoint.snapshot(state, copy=True)

    def start(self, step: int) -> None:
        self.prev = self.snapshot(self.state, copy=True, reuse=self.prev)

    def finish(self) -> None:
        pass


class Orbax(Async):
    name = "orbax"

    def __init__(self, state: Any, directory: Path):
        import orbax.checkpoint as ocp

        self.ocp, self.state = ocp, state
        opts = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        self.mgr = ocp.CheckpointManager(directory, options=opts)

    def start(self, step: int) -> None:
        self.mgr.save(step, args=self.ocp.args.StandardSave(self.state))

    def finish(self) -> None:
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()


class TorchDCP(Async):
    name = "torch-dcp"

    def __init__(self, flat: dict[str, np.ndarray], directory: Path):
        import torch.distributed.checkpoint as dcp

        from bench_save_restore import to_torch

        self.dcp, self.dir = dcp, directory
        self.sd = {k: to_torch(a) for k, a in flat.items()}
        self.fut: Any = None
        self.step = -1
        directory.mkdir(parents=True, exist_ok=True)

    def start(self, step: int) -> None:
        self.step = step
        r = self.dcp.async_save(self.sd, checkpoint_id=str(self.dir / str(step)), no_dist=True)
        self.fut = getattr(r, "upload_completion", r)

    def finish(self) -> None:
        self.fut.result()
        F.fsync_tree(self.dir / str(self.step))  # sync_files=True already; a no-op check

    def prune(self) -> None:
        for p in self.dir.iterdir():
            if p.name != str(self.step):
                shutil.rmtree(p)


def jax_state(flat: dict[str, np.ndarray]) -> Any:
    import jax

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.block_until_ready(F.nest({k: jax.device_put(a, cpu) for k, a in flat.items()}))


def build(
    names: list[str], flat: dict[str, np.ndarray], scratch: Path, state: Any = None
) -> dict[str, Async]:
    if state is None and {"flax_ckpt", "orbax"} & set(names):
        state = jax_state(flat)
    make: dict[str, Callable[[], Async]] = {
        "memcpy": lambda: Memcpy(flat),
        "flax_ckpt": lambda: FlaxCkpt(state, scratch / "flax_ckpt"),
        "flax_ckpt-numpy": lambda: FlaxCkpt(F.nest(flat), scratch / "flax_ckpt-numpy", "flax_ckpt-numpy"),
        "flax_ckpt-numpy-snapshot-reuse": lambda: SnapshotReuse(F.nest(flat)),
        "orbax": lambda: Orbax(state, scratch / "orbax"),
        "torch-dcp": lambda: TorchDCP(flat, scratch / "torch"),
    }
    unknown = [n for n in names if n not in make]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {ALL}")
    return {n: make[n]() for n in names}


def one(c: Async, step: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    c.start(step)
    t1 = time.perf_counter()
    c.finish()
    t2 = time.perf_counter()
    if isinstance(c, TorchDCP):
        c.prune()
    gc.collect()
    return t1 - t0, t2 - t0


def rss_child(name: str, size_mb: float, scratch: Path) -> None:
    """In a fresh process: the state is built, then resident memory is sampled while the contender is
    set up and saves twice (so buffers it keeps between saves count); prints the peak over the base."""
    import json

    flat = F.make_tree(int(size_mb * C.MB))
    state = jax_state(flat) if name in ("flax_ckpt", "orbax") else None
    gc.collect()
    rss = F.RssPeak()
    c = build([name], flat, C.fresh_dir(scratch), state)[name]
    for step in (0, 1):
        one(c, step)
    c.close()
    print(json.dumps({"name": name, "nbytes": F.tree_bytes(flat), "extra": rss.stop(), "base": rss.base}))


def run_rss(names: list[str], size_mb: float, scratch: Path) -> dict[str, float]:
    """Peak resident memory above the state's, per contender, each in its own process (MiB)."""
    out = {}
    for n in names:
        argv = [__file__, "--rss-child", n, "--size-mb", str(size_mb), "--scratch", str(scratch / f"rss-{n}")]
        r = C.child(argv)
        out[n] = r["extra"] / C.MB
        print(
            f"peak RSS {n:26s} +{out[n]:6.0f} MiB over the state's process ({r['extra'] / r['nbytes']:.2f}x state)",
            flush=True,
        )
    return out


class Saves(C.Scenario):
    """Each contender saves a new step: "blocked" while the save call holds the caller, "durable" until
    the library says the step is on disk; one warm-up save each (one-off set-up is not timed)."""

    name, floors, warmup = "async", ["memcpy"], 1

    def __init__(self, names: list[str], flat: dict[str, np.ndarray], scratch: Path):
        self.contenders, self.flat, self.scratch = names, flat, scratch

    def setup(self) -> None:
        self.objs = build(self.contenders, self.flat, self.scratch)

    def time(self, name: str, r: int) -> dict[str, float]:
        blocked, durable = one(self.objs[name], r + 1)
        return {"blocked": blocked} if name in BLOCK_ONLY else {"blocked": blocked, "durable": durable}

    def teardown(self) -> None:
        for c in getattr(self, "objs", {}).values():
            c.close()


# ----------------------------------------------------------------------------------------- training


def make_training(width: int, depth: int, batch: int, seed: int = 0):
    import jax.numpy as jnp
    from flax import linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(depth):
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(10)(x)

    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.standard_normal((batch, 256), dtype=np.float32))
    return F.adam_training(MLP(), xs, jnp.asarray(rng.integers(0, 10, batch)), 1e-3)


def train_run(
    init, step, n: int, saver: Callable[[int, Any], None] | None, every: int
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per step; CPU time counts every thread of the process, so
    it includes the checkpointer's background work and varies less with other users' load."""
    import jax

    state = jax.block_until_ready(step(init()))  # compiled before timing
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(1, n + 1):
        state = step(state)
        if saver is not None and i % every == 0:
            saver(i, state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def run_training(args, scratch: Path) -> tuple[C.Results, dict[str, Any]]:
    import jax

    init, step = make_training(args.train_width, args.train_depth, args.train_batch)
    s0 = init()
    nbytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(s0))
    info = {
        "state_mb": nbytes / C.MB,
        "params": sum(x.size for x in jax.tree_util.tree_leaves(s0.params)),
        "width": args.train_width,
        "depth": args.train_depth,
        "batch": args.train_batch,
        "steps": args.train_steps,
        "every": args.every,
    }
    print(
        f"training: MLP {args.train_depth}x{args.train_width}, state {nbytes / C.MB:.1f} MiB, "
        f"{args.train_steps} steps, checkpoint every {args.every}",
        flush=True,
    )
    return C.run(Training(args, init, step, scratch), args.train_rounds), info


class Training(C.Scenario):
    """The loop without checkpoints, with flax_ckpt's async manager and with Orbax's, saving every
    ``args.every`` steps: seconds and process CPU seconds per step."""

    contenders = ["no checkpoints", "flax_ckpt", "orbax"]

    def __init__(self, args: Any, init: Callable, step: Callable, scratch: Path):
        self.args, self.init, self.step, self.scratch = args, init, step, scratch

    def time(self, name: str, r: int) -> dict[str, float]:
        import orbax.checkpoint as ocp

        import flax_ckpt as fc

        d, n, every = (
            C.fresh_dir(self.scratch / f"train-{name.replace(' ', '_')}"),
            self.args.train_steps,
            self.args.every,
        )
        if name == "no checkpoints":
            wall, cpu = train_run(self.init, self.step, n, None, every)
        elif name == "flax_ckpt":
            mgr = fc.CheckpointManager(d, max_to_keep=2, async_save=True)
            wall, cpu = train_run(self.init, self.step, n, lambda i, s: mgr.save(i, s), every)
            mgr.close()
        else:
            om = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(max_to_keep=2))
            wall, cpu = train_run(
                self.init, self.step, n, lambda i, s: om.save(i, args=ocp.args.StandardSave(s)), every
            )
            om.wait_until_finished()
            om.close()
        shutil.rmtree(d)
        return {
            "s_per_step": wall,
            "cpu_s_per_step": cpu,
        }  # seconds per step: paired ratios read as slowdowns


# ------------------------------------------------------------------------------------------ report


def markdown(
    res: C.Results,
    names: list[str],
    nbytes: int,
    rounds: int,
    rss: dict[str, float],
    train: tuple[C.Results, dict[str, Any]] | None,
) -> str:
    lines = []
    if nbytes:
        mem = ", ".join(f"{n} {v:.0f} MiB ({v * C.MB / nbytes:.2f}x)" for n, v in rss.items())
        lines += [f"State: {nbytes / C.MB:.0f} MiB, {rounds} interleaved rounds after one warm-up save.", ""]
        lines += [f"Peak RSS over the state's: {mem}.", ""] if rss else []
    if nbytes and res.times:
        lines += ["Ratios: medians of per-round ratios t / t_B (< 1: faster).", ""]
        lines.append(C.table(res, names, ["blocked", "durable"], vs=["memcpy", "orbax", "torch-dcp"]))
    if train:
        tr, info = train
        lines += [
            "",
            f"Training: flax MLP {info['depth']}x{info['width']} ({info['params']} params, state "
            f"{info['state_mb']:.1f} MiB incl. adam), batch {info['batch']}, {info['steps']} steps, "
            f"async checkpoint every {info['every']} steps (max_to_keep=2).",
            "",
            "Per step; the ratio to the loop without checkpoints is 1 + the overhead.",
            "",
            C.table(tr, Training.contenders, ["s_per_step", "cpu_s_per_step"], vs=["no checkpoints"]),
        ]
    return "\n".join(lines) + "\n"


def targets(res: C.Results, train: tuple[C.Results, dict[str, Any]] | None) -> dict[str, Any]:
    mc = res.paired_ratio("flax_ckpt", "memcpy", "blocked")
    orb = res.paired_ratio("flax_ckpt", "orbax", "blocked")
    out: dict[str, Any] = {"blocked_x_memcpy": 1 / mc if mc else None, "blocked_faster_than_orbax": orb}
    met = {
        "blocking <= 1.5x memcpy floor": mc is not None and 1 / mc <= 1.5,
        "blocking no more than orbax's": orb is not None and orb >= 1.0,
    }
    if train:
        slow = train[0].paired_ratio("no checkpoints", "flax_ckpt", "s_per_step")
        cpu = train[0].paired_ratio("no checkpoints", "flax_ckpt", "cpu_s_per_step")
        out["train_overhead_wall"] = slow - 1 if slow else None
        out["train_overhead_cpu"] = cpu - 1 if cpu else None
        met["training-step overhead < 2% (wall)"] = slow is not None and slow - 1 < 0.02
        met["training-step overhead < 2% (CPU)"] = cpu is not None and cpu - 1 < 0.02
    out["met"] = met
    return out


def main(argv: list[str] | None = None) -> None:
    ap = C.cli(__doc__.split("\n")[0], size_mb=1024.0, rounds=5, contenders=ALL, scratch="async")
    ap.add_argument("--train-steps", type=int, default=100, help="0 skips the training part")
    ap.add_argument("--train-rounds", type=int, default=6)
    ap.add_argument("--train-width", type=int, default=512)
    ap.add_argument("--train-depth", type=int, default=4)
    ap.add_argument("--train-batch", type=int, default=1024)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-memory runs")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child:
        try:
            return rss_child(args.rss_child, args.size_mb, args.scratch)
        finally:
            C.remove_scratch(args.scratch)

    names = [n for n in args.contenders.split(",") if n]
    scratch = C.fresh_dir(args.scratch)
    info = C.machine_info(scratch)
    train, rss = None, {}
    try:
        res, nbytes = C.Results(), 0
        if names and args.size_mb > 0 and args.rounds > 0:
            flat = F.make_tree(int(args.size_mb * C.MB))
            nbytes = F.tree_bytes(flat)
            print(f"state: {len(flat)} leaves, {nbytes / C.MB:.0f} MiB; contenders {names}", flush=True)
            res = C.run(Saves(names, flat, scratch), args.rounds)
            del flat
            gc.collect()
        if names and args.size_mb > 0 and not args.no_rss:
            rss = run_rss([n for n in names if n != "flax_ckpt-numpy-snapshot-reuse"], args.size_mb, scratch)
            nbytes = nbytes or F.tree_bytes(F.make_tree(int(args.size_mb * C.MB)))
        if args.train_steps:
            train = run_training(args, scratch)
    finally:
        C.remove_scratch(scratch)
    md = markdown(res, names, nbytes, args.rounds, rss, train)
    tg = targets(res, train) if "flax_ckpt" in names and "memcpy" in names and args.rounds else {}
    if tg:
        md += (
            "\nIssue 3 targets (flax_ckpt): "
            + "; ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in tg["met"].items())
            + "\n"
        )
    body = {
        "benchmark": "async",
        "nbytes": nbytes,
        "values": res.times,
        "peak_rss_over_state_mb": rss,
        "training": {"info": train[1], "s_per_step": train[0].times} if train else None,
        "targets": tg,
    }
    C.report("async", args, info, body, md)


if __name__ == "__main__":
    main()
