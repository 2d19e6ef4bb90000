"""One process of a multi-process test job (tests/test_distributed.py starts N of these, through
helpers.Job).

Usage: tests/workers/mp_worker.py '<json config>' with keys mode, dir, out, tag, process_id,
num_processes, port. The launcher sets XLA_FLAGS (CPU device count) and JAX_PLATFORMS=cpu; with
num_processes > 1 the worker joins a real jax.distributed job on 127.0.0.1 with gloo collectives
(helpers.start_worker). It writes its findings to <out>/<tag>.p<i>.json (helpers.report) and leaves with
os._exit (no shutdown barrier that a killed peer would hang).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)  # tests/: helpers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flax_ckpt as fc  # noqa: E402
from flax_ckpt._src import tree as tree_mod  # noqa: E402
from flax_ckpt._src.commit import distributed  # noqa: E402
from flax_ckpt._src.engine import restore as engine  # noqa: E402
from flax_ckpt._src.native.layout import open_native  # noqa: E402
from flax_ckpt._src.records import leaf_name  # noqa: E402
from flax_ckpt._src.serializers import box_of  # noqa: E402
from flax_ckpt._src.storage import LocalStorage  # noqa: E402
from helpers import AfterWrite, assert_bit_exact, kill_self, report, start_worker  # noqa: E402

# ------------------------------------------------------------------------------------------ the state


def _apply(params, x):
    return x @ params["dense"]["kernel"] + params["dense"]["bias"]


TX = optax.adam(1e-2)  # one transformation: TrainStates built from it share their static fields


def host_state(variant: int) -> train_state.TrainState:
    """A TrainState (params, Adam state after one update, step counter) of numpy arrays, identical on
    every process for the same ``variant``."""
    rng = np.random.default_rng(variant)
    params = {
        "dense": {
            "kernel": rng.standard_normal((8, 8), dtype=np.float32),
            "bias": rng.standard_normal((8,), dtype=np.float32),
        },
        "embed": {"table": rng.standard_normal((16, 8), dtype=np.float32).astype(jnp.bfloat16)},
    }
    cpu = jax.local_devices()[0]
    with jax.default_device(cpu):
        state = train_state.TrainState.create(apply_fn=_apply, params=params, tx=TX)
        grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5) * (variant + 1), params)
        state = state.apply_gradients(grads=grads)
    return jax.tree.map(np.asarray, state.replace(step=np.int32(state.step)))


LAYOUTS = {  # mesh shape, axis names, spec of kernel, bias, table (scalars are replicated)
    "save22": ((2, 2), ("data", "model"), P("data", "model"), P("model"), P(None, "data")),
    "x4": ((4,), ("x",), P(None, "x"), P("x"), P("x", None)),
    "m14": ((1, 4), ("data", "model"), P("data", "model"), P("model"), P(None, "data")),
    "x3": ((3,), ("x",), P(None), P(), P()),
}


def shardings(state: Any, layout: str) -> Any:
    if layout == "one":
        one = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: one, state)
    shape, names, kernel, bias, table = LAYOUTS[layout]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)

    def pick(path, _):
        key = jax.tree_util.keystr(path)
        spec = kernel if "kernel" in key else bias if "bias" in key else table if "table" in key else P()
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(pick, state)


def place(host: Any, shard_tree: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), host, shard_tree
    )


def abstract(host: Any, shard_tree: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), host, shard_tree)


class CountingStorage(LocalStorage):
    """A real local folder that counts the array bytes read through it (read_into)."""

    def __init__(self, root: str, counter: list[int] | None = None):
        super().__init__(root)
        self.counter = counter if counter is not None else [0]
        self._lock = threading.Lock()

    def sub(self, name: str) -> "CountingStorage":
        return CountingStorage(self._p(name), self.counter)

    def read_ranges(self, name: str, parts) -> None:  # every read of a LocalStorage comes through here
        super().read_ranges(name, parts)
        with self._lock:
            self.counter[0] += sum(memoryview(b).nbytes for _, buffers in parts for b in buffers)


def full_body(folder: str) -> dict:
    """A native step's manifest body with its leaves (a restore's source keeps them as records)."""
    from flax_ckpt._src.native.manifest import decode

    with open(os.path.join(folder, "manifest.json"), "rb") as f:
        return decode(f.read(), folder)


def needed_bytes(body: dict, shard_tree: Any) -> int:
    """Bytes the raw reader must read for this process's boxes: each stored chunk that overlaps a box
    a local device needs, once (boxes that tile one bounding box are read together; tiny chunks lie in
    one crc block, so they are read whole)."""
    by_name = {leaf_name(r): r for r in body["leaves"]}
    total = 0
    for path, sharding in tree_mod.flatten(shard_tree)[0]:
        if not isinstance(sharding, jax.sharding.Sharding):
            continue
        rec = by_name[tree_mod.keystr(path)]
        shape = tuple(rec["shape"])
        boxes = {box_of(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()}
        for ch in rec["chunks"]:
            if any(
                all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(ch["index"], box))
                for box in boxes
            ):
                total += ch["nbytes"]
    return total


# -------------------------------------------------------------------------------------------- modes


def mode_save(cfg: dict) -> dict:
    """2 processes x 2 devices: fc.save (raw and zarr3) and an async CheckpointManager."""
    d, i = cfg["dir"], jax.process_index()
    host = host_state(0)
    sh = shardings(host, "save22")
    state = place(host, sh)
    fc.save(os.path.join(d, "ts"), state, metadata={"run": "mp"}, step=1)
    fc.save(os.path.join(d, "ts_zarr"), state, serializer="zarr3")
    from flax_ckpt._src.engine import transfer

    off_host, transfer._off_host = transfer._off_host, lambda k: True  # streamed as from an accelerator
    try:
        fc.save(os.path.join(d, "ts_stream"), state, step=1)
    finally:
        transfer._off_host = off_host
    assert_bit_exact(fc.restore(os.path.join(d, "ts_stream"), abstract(host, sh)), host, sh, types=False)
    info = fc.metadata(os.path.join(d, "ts"))
    out: dict[str, Any] = {
        "kernel_sharding": info.leaves["params/dense/kernel"].sharding,
        "process_count": info.process_count,
    }
    mgr_dir = os.path.join(d, "mgr")
    mgr = fc.CheckpointManager(mgr_dir, max_to_keep=2, async_save=True)
    for step in (1, 2):
        mgr.save(step, place(host_state(step), sh), metrics={"loss": 1.0 / step})
    mgr.wait_until_finished()
    if i == 0:
        time.sleep(2.0)  # process 1's save of step 3 must not wait for process 0 on its own thread
    t0 = time.perf_counter()
    mgr.save(3, place(host_state(3), sh), metrics={"loss": 1.0 / 3})
    out["save3_returned_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    mgr.wait_until_finished()
    out["save3_wait_s"] = time.perf_counter() - t1
    out["save3_blocked_s"] = mgr.stats[-1].blocked_s
    out["steps"] = mgr.all_steps()
    assert_bit_exact(mgr.restore(target=abstract(host, sh)), host_state(3), sh, types=False)
    mgr.close()
    with fc.CheckpointManager(mgr_dir, max_to_keep=2) as again:  # a fresh scan agrees on every process
        out["steps_rescanned"] = again.all_steps()
        assert_bit_exact(again.restore(2, target=abstract(host, sh)), host_state(2), sh, types=False)
    return out


def mode_restore(cfg: dict) -> dict:
    """Restores the 2x2 save into ``cfg['layouts']``, counting the bytes each process reads."""
    host = host_state(0)
    out: dict[str, Any] = {}
    for layout in cfg["layouts"]:
        sh = shardings(host, layout)
        storage = CountingStorage(os.path.join(cfg["dir"], "ts"))
        source = open_native(storage)
        body = full_body(os.path.join(cfg["dir"], "ts"))
        got = engine.restore(source, abstract(host, sh))
        assert_bit_exact(got, host, sh, types=False)
        stored = sum(ch["nbytes"] for r in body["leaves"] for ch in r.get("chunks", []))
        out[layout] = {"read": storage.counter[0], "needed": needed_bytes(body, sh), "stored": stored}
        zarr = fc.restore(os.path.join(cfg["dir"], "ts_zarr"), abstract(host, sh))
        assert_bit_exact(zarr, host, sh, types=False)
        kernel = got.params["dense"]["kernel"]  # a cross-process reduction (gloo when N > 1)
        bits = jax.jit(lambda x: (jax.lax.bitcast_convert_type(x, jnp.int32) & 0xFFFF).sum())(kernel)
        want = int((host.params["dense"]["kernel"].view(np.int32) & 0xFFFF).sum())
        assert int(np.asarray(bits.addressable_data(0))) == want
    if cfg.get("plain"):
        plain = fc.restore(os.path.join(cfg["dir"], "ts"))  # no target: numpy arrays in nested dicts
        adam = host.opt_state[0]
        out["plain_leaves"] = assert_bit_exact(
            [plain["params"], plain["step"], plain["opt_state"][0]],
            [host.params, host.step, {"count": adam.count, "mu": adam.mu, "nu": adam.nu}],
            None,
            types=False,
        )
        with fc.CheckpointManager(os.path.join(cfg["dir"], "mgr")) as mgr:
            out["mgr_steps"] = mgr.all_steps()
            sh = shardings(host, cfg["layouts"][0])
            assert_bit_exact(mgr.restore(target=abstract(host, sh)), host_state(3), sh, types=False)
    return out


def record_and_die(marker: str):
    """After writing its shards: note which files, then SIGKILL (a process dying mid distributed save)."""

    def then(written) -> None:
        with open(marker, "w") as f:
            json.dump(sorted(written.files), f)
        kill_self()

    return then


def mode_kill(cfg: dict) -> dict:
    """3 processes x 1 device: step 1 saves; process 1 dies during step 2's save."""
    i = jax.process_index()
    host = {"w": np.arange(48, dtype=np.float32).reshape(12, 4), "b": np.ones(4, np.float32)}
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sh = {"w": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P())}
    ser = AfterWrite(2, record_and_die(os.path.join(cfg["out"], "killed.json"))) if i == 1 else None
    mgr = fc.CheckpointManager(os.path.join(cfg["dir"], "mgr"), async_save=True, serializer=ser)
    # process-local values too: a numpy array and an array on this process's device alone, different
    # on each process; the checkpoint keeps process 0's
    local = {"n": np.arange(5), "local": jax.device_put(np.int32(i), jax.local_devices()[0])}
    mgr.save(1, {**place(host, sh), **local})
    mgr.wait_until_finished()
    t0 = time.perf_counter()
    mgr.save(2, {**place(jax.tree.map(lambda a: a + 1, host), sh), **local})
    out: dict[str, Any] = {"save2_returned_s": time.perf_counter() - t0}
    try:
        mgr.wait_until_finished()
        out["error"] = None
    except fc.SaveFailedError as e:
        out.update(
            error=str(e),
            cause_type=type(e.__cause__).__name__,
            cause=str(e.__cause__),
            detected_after_s=time.perf_counter() - t0,
        )
    out["steps"] = mgr.all_steps()
    return out


def mode_s3(cfg: dict) -> dict:
    """2 processes x 2 devices over s3:// (the endpoint and keys come from the environment): fc.save,
    then an async manager with retention; process 0 checks every step restores bit-exact."""
    d = cfg["dir"]
    host = host_state(0)
    sh = shardings(host, "save22")
    fc.save(d + "/ts", place(host, sh), step=1)
    with fc.CheckpointManager(d + "/mgr", max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, place(host_state(step), sh), metrics={"loss": 1.0 / step})
        mgr.wait_until_finished()
        steps = mgr.all_steps()
        assert_bit_exact(mgr.restore(target=abstract(host, sh)), host_state(3), sh, types=False)
    assert_bit_exact(fc.restore(d + "/ts", abstract(host, sh)), host, sh, types=False)
    # steps that share: 4 saves, max_to_keep=2, a frozen part sharded across both processes (128 KiB a
    # shard) and replicated (process 0 writes it), 16 KiB that change; every process restores each kept step
    ssh = shared_shardings()
    with fc.CheckpointManager(d + "/share", max_to_keep=2) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, place(shared_state(step), ssh))
        mgr.wait_until_finished()
        shared_steps = mgr.all_steps()
        for step in shared_steps:
            want = shared_state(step)
            assert_bit_exact(mgr.restore(step, abstract(want, ssh)), want, ssh, types=False)
    return {"steps": steps, "shared_steps": shared_steps}


def shared_state(step: int) -> dict:
    """640 KiB that never change and 16 KiB that change at every ``step`` (mode_s3's shared run)."""
    rng = np.random.default_rng(7)
    frozen = {"w": rng.standard_normal((1024, 128), dtype=np.float32)}
    frozen["r"] = rng.standard_normal((256, 128), dtype=np.float32)
    return {
        "frozen": frozen,
        "lora": np.random.default_rng(100 + step).standard_normal((4, 1024), dtype=np.float32),
    }


def shared_shardings() -> dict:
    """shared_state's: its 512 KiB matrix sharded over the 4 devices of the 2 processes, the rest replicated."""
    mesh = Mesh(np.array(jax.devices()), ("x",))
    return {
        "frozen": {"w": NamedSharding(mesh, P("x")), "r": NamedSharding(mesh, P())},
        "lora": NamedSharding(mesh, P()),
    }


def mode_spares(cfg: dict) -> dict:
    """2 processes x 2 devices, an async manager with max_to_keep=2 saving a 8 MiB sharded leaf five
    times: process 0, which removes steps, writes its next files over the removed step's (commit/recycler.py);
    every process restores every kept step bit-exact. Reports each step's data files (name -> inode)."""
    d = cfg["dir"] + "/mgr"
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    sh = NamedSharding(mesh, P(("a", "b")))

    def state(step: int) -> dict:
        host = np.random.default_rng(step).standard_normal((2048, 1024), dtype=np.float32)
        return {"w": jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx]), "host": host}

    inodes: dict[str, dict[str, int]] = {}
    with fc.CheckpointManager(d, max_to_keep=2) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": state(step)["w"]})
            mgr.wait_until_finished()
            distributed.allgather(
                "spares-test", f"saved-{step}", {}
            )  # a barrier: process 0's retention is done
            if jax.process_index() == 0:
                folder = os.path.join(d, str(step), "data")
                inodes[str(step)] = {
                    n: os.stat(os.path.join(folder, n)).st_ino for n in sorted(os.listdir(folder))
                }
            for kept in mgr.all_steps():
                out = mgr.restore(kept, {"w": jax.ShapeDtypeStruct((2048, 1024), jnp.float32, sharding=sh)})
                for shard in out["w"].addressable_shards:
                    assert np.array_equal(np.asarray(shard.data), state(kept)["host"][shard.index]), kept
        steps = mgr.all_steps()
    distributed.allgather("spares-test", "closed", {})
    left = sorted(n for n in os.listdir(d) if not n.isdigit() and not n.startswith("."))
    return {"steps": steps, "inodes": inodes, "left": left}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.alarm(cfg.get("alarm_s", 120))  # a worker never outlives a stuck job, even an orphaned one
    distributed.set_timeout(cfg.get("timeout_s", 30))
    start_worker(cfg)
    code = report(
        cfg,
        {"save": mode_save, "restore": mode_restore, "kill": mode_kill, "s3": mode_s3, "spares": mode_spares},
    )
    if code == 0 and cfg["num_processes"] > 1 and cfg["mode"] != "kill":  # kill: a peer is gone
        jax.distributed.shutdown()  # a barrier: process 0, which hosts the coordinator, leaves last
    if cfg["mode"] == "kill" and cfg["process_id"] == 0:  # no barrier with a peer gone: process 0 stays
        _await_reports(cfg, [j for j in range(2, cfg["num_processes"])])  # until the other survivors
    os._exit(code)  #                   have reported (losing the coordinator first aborts them)


def _await_reports(cfg: dict, others: list[int]) -> None:
    """Waits until processes ``others`` have written their reports (the worker's alarm ends a wait for
    one that never does)."""
    paths = [os.path.join(cfg["out"], f"{cfg['tag']}.p{j}.json") for j in others]
    while not all(os.path.exists(p) for p in paths):
        time.sleep(0.05)


if __name__ == "__main__":
    main()
