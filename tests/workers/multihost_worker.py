"""One process of a multi-host consistency job (tests/test_multihost.py starts N of these).

Usage: python tests/workers/multihost_worker.py '<json config>'. Every process has one CPU device and joins a
jax.distributed job on 127.0.0.1 (gloo collectives); it writes what it saw to
``<out>/<tag>.p<i>.json`` and exits. Modes:
  save      saves steps 1 and 2 of a state sharded over the processes (``serializer``)
  restore   restores the newest step (``strict``), reports which step and whether it is bit-exact
  part      step 2's save with process 1's part record damaged before process 0 reads it
  lagging   process 1's listing of the directory hides step 2 (an object store's lagging view)
  auto      save_interval_steps="auto" with a different step time per process
  compile-cache  a sharded program compiled with the run's compilation cache (fc.use_compilation_cache)
  kill-save / kill-restore / hang-save / hang-restore: process 0 (the coordinator) is SIGKILLed, or its
            program hangs (the coordination service in it still runs), in its save of step 2 or in
            its restore's vote
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
from flax_ckpt._src.storage import LocalStorage  # noqa: E402
from helpers import AfterWrite, report, start_worker  # noqa: E402

ROWS = 8  # rows per process


def host_state(step: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((ROWS * n, 16)).astype(np.float32),
        "b": np.full(16, float(step), np.float32),
        "step": np.int32(step),
    }


def shardings(n: int) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {"w": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P()), "step": NamedSharding(mesh, P())}


def place(host: dict, sh: dict) -> dict:
    return {k: jax.make_array_from_callback(v.shape, sh[k], lambda idx, v=v: v[idx]) for k, v in host.items()}


def target(n: int) -> dict:
    sh = shardings(n)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in host_state(0, n).items()}


def exact(got: dict, step: int, n: int) -> bool:
    """Whether this process's shards of ``got`` are the bytes of ``step``'s state."""
    want = host_state(step, n)
    for k, arr in got.items():
        for s in arr.addressable_shards:
            if np.asarray(s.data).tobytes() != np.asarray(want[k][s.index]).tobytes():
                return False
    return True


def die_or_hang(kind: str) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10**6)  # a hung program: the coordination service's own threads keep running


def manager(cfg: dict, **kw: Any) -> fc.CheckpointManager:
    return fc.CheckpointManager(cfg["dir"], serializer=kw.pop("serializer", cfg.get("serializer")), **kw)


def mode_save(cfg: dict, n: int) -> dict:
    sh = shardings(n)
    with manager(cfg) as mgr:
        for step in (1, 2):
            mgr.save(step, place(host_state(step, n), sh))
        mgr.wait_until_finished()
        return {"steps": mgr.all_steps()}


def mode_share(cfg: dict, n: int) -> dict:
    """Steps 1-3 of a state whose sharded leaf "f" never changes (max_to_keep=2: step 1 retired, its
    bytes kept for steps 2 and 3); then a restore of step 3 on every process."""
    sh = dict(shardings(n), f=shardings(n)["w"])
    frozen = np.random.default_rng(99).standard_normal((ROWS * n, 4096)).astype(np.float32)
    with manager(cfg, max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, place(dict(host_state(step, n), f=frozen), sh))
        mgr.wait_until_finished()
        tgt = dict(target(n), f=jax.ShapeDtypeStruct(frozen.shape, frozen.dtype, sharding=sh["f"]))
        got = mgr.restore(target=tgt)
    ok = all(
        np.asarray(s.data).tobytes() == frozen[s.index].tobytes() for s in got.pop("f").addressable_shards
    )
    return {"steps": mgr.all_steps(), "exact": ok and exact(got, 3, n)}


def mode_share_damaged(cfg: dict, n: int) -> dict:
    """After mode_share and a flipped bit in process 1's shard of the retired step 1: a restore (every
    step damaged, on every process alike), then steps 4 and 5 of the same frozen leaf, restored."""
    sh = dict(shardings(n), f=shardings(n)["w"])
    frozen = np.random.default_rng(99).standard_normal((ROWS * n, 4096)).astype(np.float32)
    with manager(cfg, max_to_keep=2) as mgr:
        try:
            mgr.restore()
            error = ""
        except fc.CheckpointError as e:
            error = type(e).__name__
        for step in (4, 5):
            mgr.save(step, place(dict(host_state(step, n), f=frozen), sh))
        mgr.wait_until_finished()
        tgt = dict(target(n), f=jax.ShapeDtypeStruct(frozen.shape, frozen.dtype, sharding=sh["f"]))
        got = mgr.restore(5, target=tgt)
    ok = all(
        np.asarray(s.data).tobytes() == frozen[s.index].tobytes() for s in got.pop("f").addressable_shards
    )
    return {"error": error, "steps": mgr.all_steps(), "exact": ok and exact(got, 5, n)}


def mode_restore(cfg: dict, n: int) -> dict:
    with manager(cfg, strict=cfg.get("strict", False)) as mgr:
        try:
            got = mgr.restore(target=target(n))
        except fc.CheckpointError as e:
            return {"error": type(e).__name__, "message": str(e), "steps": mgr.all_steps()}
        step = mgr.restore_stats[-1].step
        return {"step": step, "exact": exact(got, step, n), "steps": mgr.all_steps()}


def mode_part(cfg: dict, n: int) -> dict:
    """Process 1 damages its own part record of step 2 right after writing it (before announcing it)."""
    real = distributed.SaveRound.publish

    def publish(self, stage, written, digest):
        stage_write = stage.write

        def write(name, buffers):
            stage_write(name, buffers)
            if name.startswith("parts/") and self.where.endswith("/2"):
                path = os.path.join(stage.local_path, name)
                data = bytearray(open(path, "rb").read())
                data[len(data) // 2] ^= 0x01
                open(path, "wb").write(bytes(data))

        stage.write = write
        real(self, stage, written, digest)

    if jax.process_index() == 1:
        distributed.SaveRound.publish = publish
    sh = shardings(n)
    out: dict[str, Any] = {}
    with manager(cfg) as mgr:
        mgr.save(1, place(host_state(1, n), sh))
        mgr.wait_until_finished()
        mgr.save(2, place(host_state(2, n), sh))
        try:
            mgr.wait_until_finished()
            out["save2"] = "ok"
        except fc.SaveFailedError as e:
            out["save2"] = f"{type(e.__cause__).__name__}: {e.__cause__}"
    with manager(cfg) as mgr:
        got = mgr.restore(target=target(n))
        out.update(steps=mgr.all_steps(), step=mgr.restore_stats[-1].step, exact=exact(got, 1, n))
    return out


class Lagging(LocalStorage):
    """A listing that does not show step 2 yet (as an object store's listing may lag a commit)."""

    def list(self) -> list[str]:
        return [e for e in super().list() if e != "2"]


def mode_lagging(cfg: dict, n: int) -> dict:
    directory = Lagging(cfg["dir"]) if jax.process_index() == 1 else cfg["dir"]
    with fc.CheckpointManager(directory) as mgr:
        latest, steps = mgr.latest_step(), mgr.all_steps()
        got = mgr.restore(target=target(n))
        return {
            "latest": latest,
            "steps": steps,
            "step": mgr.restore_stats[-1].step,
            "exact": exact(got, mgr.restore_stats[-1].step, n),
        }


def mode_auto(cfg: dict, n: int) -> dict:
    """Each process "trains" at its own speed; all must save the same steps."""
    sh = shardings(n)
    state = place(host_state(1, n), sh)
    saved = []
    with manager(cfg, save_interval_steps="auto", overhead_budget=0.05) as mgr:
        for step in range(1, 41):
            time.sleep(0.002 * (1 + 3 * jax.process_index()))
            if mgr.save(step, state):
                saved.append(step)
        mgr.wait_until_finished()
        return {"saved": saved, "interval": mgr.interval}


def mode_coordinator(cfg: dict, n: int) -> dict:
    """Steps 1 (committed) and 2; process 0 dies or hangs in its save of step 2 or in the restore."""
    kind, phase = cfg["mode"].split("-")
    i = jax.process_index()
    sh = shardings(n)
    out: dict[str, Any] = {}
    ser = AfterWrite(2, lambda _: die_or_hang(kind)) if i == 0 and phase == "save" else None
    mgr = manager(cfg, serializer=ser)
    mgr.save(1, place(host_state(1, n), sh))
    mgr.wait_until_finished()
    t0 = time.perf_counter()
    try:
        if phase == "save":
            mgr.save(2, place(host_state(2, n), sh))
            mgr.wait_until_finished()
        else:
            if i == 0:
                real = distributed._round  # every key-value round (allgather, lead, vote) goes through it

                def round_(prefix, what, value, reduce):
                    if what == "vote":  # the restore's vote
                        die_or_hang(kind)
                    return real(prefix, what, value, reduce)

                distributed._round = round_
            mgr.restore(target=target(n))
        out["error"] = None
    except fc.CheckpointError as e:
        cause = e.__cause__ if isinstance(e, fc.SaveFailedError) else e
        out.update(error=type(e).__name__, cause=type(cause).__name__, message=str(cause))
    out["after_s"] = time.perf_counter() - t0
    return out


def mode_compile_cache(cfg: dict, n: int) -> dict:
    """A sharded program (a sum across the processes) compiled with the run's compilation cache on."""
    cache = fc.use_compilation_cache(os.path.join(cfg["dir"], "compile_cache"))
    assert cache is not None
    sh = shardings(n)
    x = place(host_state(1, n), sh)
    total = jax.jit(lambda t: (t["w"] * 2.0).sum() + t["b"].sum())(x)
    info = cache.info()
    return {"total": float(total), "hits": info.hits, "misses": info.misses, "writes": info.writes}


MODES = {
    "compile-cache": mode_compile_cache,
    "save": mode_save,
    "restore": mode_restore,
    "share": mode_share,
    "share_damaged": mode_share_damaged,
    "part": mode_part,
    "lagging": mode_lagging,
    "auto": mode_auto,
    "kill-save": mode_coordinator,
    "kill-restore": mode_coordinator,
    "hang-save": mode_coordinator,
    "hang-restore": mode_coordinator,
}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.alarm(cfg.get("alarm_s", 120))  # a worker never outlives a stuck job
    distributed.set_timeout(cfg.get("timeout_s", 30))
    start_worker(cfg)
    n = cfg["num_processes"]
    code = report(cfg, {mode: (lambda c, f=f: f(c, n)) for mode, f in MODES.items()})
    if code == 0 and not cfg["mode"].startswith(("kill", "hang")):  # there process 0 is gone or hung
        jax.distributed.shutdown()  # a barrier: process 0, which hosts the coordinator, leaves last
    os._exit(code)


if __name__ == "__main__":
    main()
