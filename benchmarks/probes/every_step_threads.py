"""Whose CPU an every-step save costs: the library's threads, or XLA's, in one process, in turns.

    PYTHONPATH=<a checkout> python benchmarks/probes/every_step_threads.py [blocks] [--steps N] [--model M]

A model of bench_every_step.py (``mlp``, the default: 39 MiB of state with adam; ``transformer``), a
loop that runs ahead of the device (no sync per step). One process runs blocks of ``--steps`` steps
(default 20) in turns, ABBA-like, in these modes:

- ``alone``: the loop without checkpoints;
- ``sync``: ``jax.block_until_ready`` on the state after each step (what any wait for the step costs
  XLA's threads, with nothing copied);
- ``floor``: ``np.copyto`` of every leaf into buffers allocated once, after each step, on the loop's
  thread (one host copy, no checksum);
- ``memory``: ``CheckpointManager(tiers=Tiers(local_dir=<tmpfs>, peer=False))`` saving every step;
- ``persistent``: ``CheckpointManager(<a folder in the temporary folder>, max_to_keep=2)`` saving every
  step (bench_every_step.py's ``persistent``: this machine's disk).

Per block and thread, the CPU time from ``/proc/self/task/<tid>/schedstat`` (nanoseconds, not clock
ticks), summed by thread name: the loop's thread, the library's (``flax_ckpt-*``) and XLA's
(``tf_XLAEigen`` and the other unnamed threads). Printed per mode: the median over its blocks of ms
per step for each group, process CPU and wall, and process CPU over ``alone``. The library's figure is
steady (±0.5 ms between runs); XLA's moves by ±10 ms with the machine's load, which is why the loop's
ratio to ``alone`` does and the library's cost per save does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import flax_ckpt as fc  # noqa: E402
from bench_every_step import make_model, threads_ms  # noqa: E402

MODES = ("alone", "memory", "persistent", "floor", "sync")


def group(name: str) -> str:
    if name == "MainThread":
        return "loop"
    return "library" if name.startswith("flax_ckpt") else "xla"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("blocks", type=int, nargs="?", default=48)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="mlp", choices=("mlp", "transformer"))
    args = ap.parse_args()
    init, step = make_model(args.model)
    shm, root = tempfile.mkdtemp(dir="/dev/shm"), tempfile.mkdtemp(dir="/dev/shm")
    disk = tempfile.mkdtemp()
    state = jax.block_until_ready(step(init()))
    bufs = [np.empty(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(state)]
    res: dict[str, dict[str, list[float]]] = {}
    n, s = args.steps, 10
    order = list(MODES) + list(MODES)[::-1]
    try:
        tiers = fc.Tiers(local_dir=shm, peer=False, persist_interval_steps=None)
        with (
            fc.CheckpointManager(os.path.join(root, "run"), tiers=tiers) as mgr,
            fc.CheckpointManager(os.path.join(disk, "run"), max_to_keep=2) as pmgr,
        ):
            for i in range(3):
                state = jax.block_until_ready(step(state))
                for m in (mgr, pmgr):
                    m.save(i, state, force=True)
                    m.wait_until_finished()
            for b in range(args.blocks):
                mode = order[b % len(order)]
                t0, c0, w0 = threads_ms(), time.process_time(), time.perf_counter()
                for i in range(s, s + n):
                    state = step(state)
                    if mode == "memory":
                        mgr.save(i, state)
                    elif mode == "persistent":
                        pmgr.save(i, state)
                    elif mode == "floor":
                        for buf, x in zip(bufs, jax.tree_util.tree_leaves(state)):
                            np.copyto(buf, np.asarray(x))
                    elif mode == "sync":
                        jax.block_until_ready(state)
                jax.block_until_ready(state)
                mgr.wait_until_finished()
                pmgr.wait_until_finished()
                s += n
                t1, c1, w1 = threads_ms(), time.process_time(), time.perf_counter()
                row = {"loop": 0.0, "library": 0.0, "xla": 0.0}
                for k, v in t1.items():
                    row[group(k[1])] += (v - t0.get(k, 0.0)) / n
                row["process"], row["wall"] = (c1 - c0) / n * 1e3, (w1 - w0) / n * 1e3
                for k, v in row.items():
                    res.setdefault(mode, {}).setdefault(k, []).append(v)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    alone = statistics.median(res["alone"]["process"])
    print(f"ms per step, medians of {args.blocks // len(MODES)} blocks of {n} steps per mode:")
    print(f"{'mode':8s} {'loop':>7s} {'library':>8s} {'xla':>7s} {'process':>8s} {'wall':>7s}  over alone")
    for mode in MODES:
        m = {k: statistics.median(v) for k, v in res[mode].items()}
        print(
            f"{mode:8s} {m['loop']:7.2f} {m['library']:8.2f} {m['xla']:7.2f} {m['process']:8.2f} "
            f"{m['wall']:7.2f}  {m['process'] / alone - 1:+.1%}"
        )


if __name__ == "__main__":
    main()
