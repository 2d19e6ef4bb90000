"""One process of a tiered-checkpoint test job (tests/test_tiers.py starts N of these, through
helpers.Job).

Usage: tests/workers/tier_worker.py '<json config>' with keys mode, dir (the manager's directory,
shared), local (this process's local_dir: each process stands for a host), out, tag, process_id,
num_processes, port, persist, and per mode: steps (train), until (loop), crash ({"process", "at":
"local"|"migrate", "step"}); optional: differential (False: every memory copy full), in_place (train:
every full copy written in place is checked byte for byte against the piece-by-piece encoding, and
its step reported). The launcher sets XLA_FLAGS (2 CPU devices) and JAX_PLATFORMS=cpu; the
worker joins a real jax.distributed job on 127.0.0.1 with gloo collectives (helpers.start_worker).
Findings go to <out>/<tag>.p<i>.json (helpers.report; a loop's restore to <tag>.p<i>.restored.json),
progress lines to <out>/<tag>.p<i>.progress. A worker that succeeded leaves through
jax.distributed.shutdown (a barrier); one that failed with os._exit (no barrier that a dead peer would
hang).

Modes: "train" saves steps 1..steps, waits until finished, reports, and waits to be killed; "restore"
restores the newest step and checks every local shard bit-exact; "loop" restores if there is anything
(checking it), then saves the following steps up to ``until`` and waits to be killed.
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
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc  # noqa: E402
from flax_ckpt._src.commit import distributed  # noqa: E402
from flax_ckpt._src.storage import local as storage_local  # noqa: E402
from helpers import AfterWrite, assert_bit_exact, in_place_checked, kill_self, report, start_worker  # noqa: E402


def host_state(step: int) -> dict[str, Any]:
    """The state at ``step``, identical on every process: a frozen part (the same at every step), a
    trained part, a replicated vector, a host value and a Python int."""
    rng = np.random.default_rng(step)
    return {
        "frozen": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
        "w": rng.standard_normal((16, 8)).astype(np.float32),
        "r": rng.standard_normal((4,)).astype(np.float32),
        "host": np.full((3,), step, np.int64),
        "step": step,
    }


def shardings() -> dict[str, Any]:
    """A (process, device) mesh: frozen split over both axes, w over processes only (replicated on a
    process's two devices), r replicated everywhere (process 1 holds a replica, process 0 writes it)."""
    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), -1), ("proc", "dev"))
    return {
        "frozen": NamedSharding(mesh, P("proc", "dev")),
        "w": NamedSharding(mesh, P("proc")),
        "r": NamedSharding(mesh, P()),
    }


def place(host: dict[str, Any]) -> dict[str, Any]:
    sh = shardings()
    return {
        k: jax.make_array_from_callback(v.shape, sh[k], lambda i, v=v: v[i]) if k in sh else v
        for k, v in host.items()
    }


def target() -> dict[str, Any]:
    sh, h = shardings(), host_state(0)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) if k in sh else v for k, v in h.items()}


def check_bit_exact(got: dict[str, Any], step: int) -> None:
    """Every local shard of the sharded leaves, and the host values, are the state of ``step``."""
    sh = shardings()
    want = host_state(step)
    assert_bit_exact(got, want, {k: sh.get(k) for k in want}, types=False)


def install_crash(cfg: dict[str, Any]) -> Any:
    """Where this process dies, if the config says so: in its local-tier save of a step (data and index
    written, folder not yet renamed) or in a migration (its shards written, not yet reported)."""
    crash = cfg.get("crash")
    if not crash or crash["process"] != jax.process_index():
        return None
    if crash["at"] == "migrate":
        return AfterWrite(crash["write"], kill_self)
    real = storage_local.fsync_dir

    def fsync_dir(path: str) -> None:
        if f"{os.sep}local{os.sep}{crash['step']}{'.tmp-'}" in path:
            os.kill(os.getpid(), signal.SIGKILL)
        real(path)

    storage_local.fsync_dir = fsync_dir  # what LocalStorage.sync calls before the commit's rename
    return None


def manager(cfg: dict[str, Any], serializer: Any = None) -> fc.CheckpointManager:
    tiers = fc.Tiers(
        local_dir=cfg["local"],
        on_busy="wait",
        persist_interval_steps=cfg["persist"],
        cleanup=False,
        differential=cfg.get("differential", True),
    )
    return fc.CheckpointManager(cfg["dir"], tiers=tiers, serializer=serializer)


def report_restore(mgr: fc.CheckpointManager) -> dict[str, Any]:
    got = mgr.restore(target=target())
    plan = mgr.memory_tiers.last_plan
    check_bit_exact(got, plan.step)
    return {
        "restored": plan.step,
        "sources": [list(s) for s in plan.sources],
        "stats": [s.tier for s in mgr.restore_stats],
    }


def progress(cfg: dict[str, Any], mgr: fc.CheckpointManager, step: int) -> None:
    tiers = mgr.memory_tiers
    line = {
        "saved": step,
        "local": max(tiers.committed("local"), default=0),
        "peer": max(tiers.committed("peer"), default=0),
        "persistent": max(tiers.persistent.steps(), default=0),
    }
    with open(os.path.join(cfg["out"], f"{cfg['tag']}.p{jax.process_index()}.progress"), "a") as f:
        f.write(json.dumps(line) + "\n")


def check_in_place() -> list[int]:
    """The steps whose full memory copy is written where its snapshot lies (tiers/encode.py
    ``_encode_in_place``), each checked against the piece-by-piece encoding (helpers.in_place_checked)."""
    from flax_ckpt._src.tiers import encode as tier_encode

    tier_encode._encode_in_place, steps = in_place_checked()
    return steps


def mode_train(cfg: dict[str, Any]) -> dict[str, Any]:
    in_place = check_in_place() if cfg.get("in_place") else None
    mgr = manager(cfg)
    for step in range(1, cfg["steps"] + 1):
        mgr.save(step, place(host_state(step)))
    mgr.wait_until_finished()
    ts = mgr.memory_tiers
    return {
        "local": ts.committed("local"),
        "peer": ts.committed("peer"),
        "steps": mgr.all_steps(),
        "peer_dst": ts.ring.dst,
        "written": [[s.step, s.written, s.nbytes, s.base] for s in mgr.tier_stats],
        "in_place": in_place,
    }


def mode_restore(cfg: dict[str, Any]) -> dict[str, Any]:
    mgr = manager(cfg)
    out = {"steps": mgr.all_steps(), **report_restore(mgr)}
    mgr.close()
    return out


def mode_loop(cfg: dict[str, Any]) -> dict[str, Any]:
    mgr = manager(cfg, install_crash(cfg))
    out: dict[str, Any] = {"steps": mgr.all_steps()}
    start = 0
    if out["steps"]:
        out.update(report_restore(mgr))
        start = out["restored"]
    with open(os.path.join(cfg["out"], f"{cfg['tag']}.p{jax.process_index()}.restored.json"), "w") as f:
        json.dump(out, f)
    for step in range(start + 1, cfg["until"] + 1):
        mgr.save(step, place(host_state(step)))
        progress(cfg, mgr, step)
        if step in cfg.get("flush_at", []):
            mgr.wait_until_finished()
            progress(cfg, mgr, step)
    mgr.wait_until_finished()
    progress(cfg, mgr, cfg["until"])
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    start_worker(cfg)
    distributed.set_timeout(cfg.get("timeout_s", 30))
    code = report(cfg, {"train": mode_train, "restore": mode_restore, "loop": mode_loop})
    if code == 0 and cfg["mode"] in ("train", "loop"):
        time.sleep(600)  # a host that keeps running until the test kills it
    if code == 0:
        jax.distributed.shutdown()  # a barrier: process 0, which hosts the coordinator, leaves last
    os._exit(code)


if __name__ == "__main__":
    main()
