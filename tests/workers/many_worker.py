"""One process of a many-process job (tests/test_many_processes.py starts 4 to 16 of these).

Usage: python tests/workers/many_worker.py '<json config>'. Every process has one CPU device and joins a
jax.distributed job on 127.0.0.1 (gloo collectives, helpers.start_worker). Unlike multihost_worker.py,
the state's global shape does not depend on the number of processes, so a step saved by one job size
restores in another (elastic restarts): "w" is (ROWS, COLS) float32 sharded by rows over every process,
"b" replicated, "step" a host value (a few KiB in all). Findings go to <out>/<tag>.p<i>.json
(helpers.report). Modes:
  save      saves ``steps`` (default [1, 2]) with a CheckpointManager, waits, reports the steps
  restore   restores the newest step (or ``step``) into this job's sharding; reports which step, whether
            every local shard is bit-exact, the steps, or the error (class and message) every process raised
  train     a training loop with a CheckpointCallback (every ``every`` steps up to ``until``): restores,
            steps a jitted function, prints "step <k>" per step and, at the end, "final <i> <hex of its
            shard>"; on SIGTERM the callback saves the step, waits and exits with 143 (no report: the
            test reads the log)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)  # tests/: helpers

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flax_ckpt as fc  # noqa: E402
from flax_ckpt._src.commit import distributed  # noqa: E402
from helpers import report, start_worker  # noqa: E402

ROWS, COLS = 48, 8  # 48 rows: 1, 2, 3, 4, 6, 8, 12, 16 processes divide it; 5 and 7 do not


def host_state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return {
        "w": rng.standard_normal((ROWS, COLS)).astype(np.float32),
        "b": np.full(COLS, float(step), np.float32),
        "step": np.int32(step),
    }


def shardings() -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {"w": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P()), "step": NamedSharding(mesh, P())}


def place(host: dict) -> dict:
    sh = shardings()
    return {k: jax.make_array_from_callback(v.shape, sh[k], lambda idx, v=v: v[idx]) for k, v in host.items()}


def target() -> dict:
    sh = shardings()
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in host_state(0).items()}


def exact(got: dict, step: int) -> bool:
    """Whether every local shard of ``got`` holds the bytes of ``step``'s state, in this job's sharding."""
    want, sh = host_state(step), shardings()
    for k, arr in got.items():
        if arr.shape != want[k].shape or arr.sharding != sh[k]:
            return False
        for s in arr.addressable_shards:
            if np.asarray(s.data).tobytes() != np.asarray(want[k][s.index]).tobytes():
                return False
    return True


def mode_save(cfg: dict) -> dict:
    with fc.CheckpointManager(cfg["dir"], max_to_keep=None) as mgr:
        for step in cfg.get("steps", [1, 2]):
            mgr.save(step, place(host_state(step)))
        mgr.wait_until_finished()
        return {"steps": mgr.all_steps()}


def mode_restore(cfg: dict) -> dict:
    with fc.CheckpointManager(cfg["dir"], max_to_keep=None) as mgr:
        t0 = time.perf_counter()
        try:
            got = mgr.restore(cfg.get("step"), target=target())
        except fc.CheckpointError as e:
            return {"error": type(e).__name__, "message": str(e), "steps": mgr.all_steps()}
        step = mgr.restore_stats[-1].step
        return {
            "step": step,
            "exact": exact(got, step),
            "steps": mgr.all_steps(),
            "seconds": time.perf_counter() - t0,
        }


def train(cfg: dict) -> None:
    """The SIGTERM test's loop (see the module docstring); exits through the callback on SIGTERM."""
    from flax_ckpt.callbacks import CheckpointCallback

    i = jax.process_index()
    sh = shardings()["w"]
    step_fn = jax.jit(lambda w: w * 1.0001 + 0.5, out_shardings=sh)
    state = {"w": place(host_state(0))["w"]}
    ckpt = CheckpointCallback(cfg["dir"], every_steps=cfg["every"])
    state, start = ckpt.restore_or(state)
    print("start", start, flush=True)
    for step in range(start, cfg["until"]):
        state = {"w": step_fn(state["w"])}
        time.sleep(0.01)
        print("step", step + 1, flush=True)
        ckpt(step + 1, state)
    ckpt.close()
    print("final", i, np.asarray(state["w"].addressable_shards[0].data).tobytes().hex(), flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.alarm(cfg.get("alarm_s", 300))  # a worker never outlives a stuck job
    distributed.set_timeout(cfg.get("timeout_s", 60))
    start_worker(cfg)
    if cfg["mode"] == "train":
        train(cfg)  # SystemExit(143) on SIGTERM; else a normal exit (jax's shutdown barrier at exit)
        return
    code = report(cfg, {"save": mode_save, "restore": mode_restore})
    if code == 0:
        jax.distributed.shutdown()  # a barrier: process 0, which hosts the coordinator, leaves last
    os._exit(code)


if __name__ == "__main__":
    main()
