"""Checkpoints of a state on an accelerator: what a save blocks, what a durable save and a restore cost.

    python benchmarks/bench_accelerator.py                 # on whatever jax.devices() gives (it says which)
    python benchmarks/bench_accelerator.py --small         # a tiny model: runs on a CPU in under a minute
    python benchmarks/bench_accelerator.py --parts table --rounds 3 --budget-s 300

One process (an accelerator is held by one process at a time). The state: a Flax Linen decoder
(layers under ``nn.scan``, so ~70 leaves with adam's moments), trained one step with optax adam;
about 1 GiB by default (d_model 1024, 6 layers, vocab 8192).

(a) ``table``: per round, each contender once, the order rotated by one per round; every contender
gets a fresh on-device copy of the state (jax caches an array's host copy: a second transfer of the
same array is free). Medians over rounds of:
- floors: ``device-copy`` (a jitted copy of the state on its devices), ``device-get``
  (``jax.device_get``: the transfer), ``raw-write`` (the host copy written as 8 files by 8 threads,
  fsynced), ``raw-read`` (those files read back by 8 threads into new buffers), ``device-put``
  (the host copy placed back with ``jax.device_put``);
- flax_ckpt: ``fc-async`` and ``fc-memory`` (blocked time of ``save`` of a persistent
  ``CheckpointManager`` and of one with memory tiers only, ``fc.Tiers(peer=False,
  persist_interval_steps=None)``; kept across rounds, the write of one round waited for untimed before
  the next), ``fc-save`` (``fc.save``: durable), ``fc-restore`` (``fc.restore`` of that checkpoint into
  the state's shardings, the files' pages dropped from the cache first, until the arrays are ready);
  ``fc-save@window=0``: fc.save with every transfer started at once (``fc-save@threads=N`` also
  works: N writer threads);
- Orbax: ``orbax-async`` (blocked time of its ``CheckpointManager.save``), ``orbax-save``
  (``Checkpointer(StandardCheckpointHandler)``: synchronous), ``orbax-restore``.
The first round checks that ``fc.save`` then ``fc.restore`` gives back the state bit for bit.

(b) ``loop``: the training loop (``jit`` with the state donated) with a save every 1, 10 and 100 steps
(``--steps``: the steps timed for each; the saves come after steps 1, 1+every, ...), with and without
a sync per step (``jax.block_until_ready`` on the state after every step, or only at the end):
``none``, ``device-get`` (``jax.device_get`` of the state: a blocking host copy), ``device-copy``
(a jitted on-device copy kept until the next), ``device-copy-thread`` (that copy brought to host and
written raw by a thread: the floor of a background save), ``fc-async`` (a persistent
``CheckpointManager``, max_to_keep 1; ``fc-async-skip``: with ``on_busy="skip"``), ``fc-memory``
(memory tiers only) and ``orbax-async`` (Orbax's ``CheckpointManager``, max_to_keep 1). Each run:
warm-up steps and a save first (untimed), then the timed steps and the final ``wait_until_finished``.
Reported: ms per step, the overhead against ``none`` of the same round and setting (median of
per-round ratios − 1), the saves made of those asked for, the median blocked time of a ``save`` call,
and the median, 90th percentile and longest step (a step that waits for the device or the host shows
there).

Every contender is guarded (a failure is recorded, the others go on); the JSON report is rewritten in
bench_out/ after every measurement; ``--budget-s`` stops starting measurements past that many
seconds. Everything written goes under a scratch folder (and /dev/shm for the memory tiers) that is
deleted as it goes and at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402
from _savers import FcManager, OrbaxManager, Saver, train, warm_up  # noqa: E402

TABLE = [
    "device-copy",
    "device-get",
    "raw-write",
    "raw-read",
    "device-put",
    "fc-async",
    "fc-memory",
    "fc-save",
    "fc-save@window=0",
    "fc-restore",
    "orbax-async",
    "orbax-save",
    "orbax-restore",
]
LOOP = [
    "none",
    "device-get",
    "device-copy",
    "device-copy-thread",
    "fc-async",
    "fc-async-skip",
    "fc-memory",
    "orbax-async",
]
FULL = dict(d=1024, layers=6, heads=16, vocab=8192, seq=512, batch=8)
SMALL = dict(d=128, layers=2, heads=4, vocab=1024, seq=32, batch=2)


# ------------------------------------------------------------------------------------------ the model


def make_model(d: int, layers: int, heads: int, vocab: int, seq: int, batch: int):
    """(init, step, copy): a fresh TrainState, the donated training step, a jitted on-device copy."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            x = x + nn.SelfAttention(num_heads=heads)(nn.LayerNorm()(x), mask=mask)
            h = nn.Dense(4 * d)(nn.LayerNorm()(x))
            return x + nn.Dense(d)(nn.gelu(h)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, d)(tokens) + self.param("pos", nn.initializers.normal(0.02), (seq, d))
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)
            x, _ = stack()(x, None)
            return nn.Dense(vocab)(nn.LayerNorm()(x))

    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.integers(0, vocab, (batch, seq)))
    ys = jnp.asarray(rng.integers(0, vocab, (batch, seq)))
    init, step = F.adam_training(Net(), xs, ys, 1e-4)
    copy = jax.jit(lambda t: jax.tree_util.tree_map(jnp.copy, t))
    return init, step, copy


def leaves_of(state: Any) -> list[Any]:
    import jax

    return jax.tree_util.tree_leaves(state)


def abstract(state: Any) -> Any:
    import jax

    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
        ),
        state,
    )


# ------------------------------------------------------------------------------------ the raw floors


def _shares(arrays: list[Any], n: int) -> list[list[int]]:
    """Leaf indices in ``n`` runs of about equal bytes."""
    total = sum(a.nbytes for a in arrays) or 1
    out: list[list[int]] = [[] for _ in range(n)]
    acc = 0
    for i, a in enumerate(arrays):
        out[min(n - 1, (2 * acc + a.nbytes) * n // (2 * total))].append(i)
        acc += a.nbytes
    return out


def raw_write(host: list[Any], folder: Path, threads: int = 8) -> None:
    """The host copy as ``threads`` files, each written by its own thread and fsynced."""
    import numpy as np

    C.fresh_dir(folder)

    def one(k: int, idx: list[int]) -> None:
        fd = os.open(folder / f"{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in idx:
                mv = memoryview(np.ascontiguousarray(host[i]).reshape(-1).view(np.uint8))
                while len(mv):
                    mv = mv[os.write(fd, mv) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    _on_threads([lambda k=k, idx=idx: one(k, idx) for k, idx in enumerate(_shares(host, threads))])


def raw_read(host: list[Any], folder: Path, threads: int = 8) -> list[Any]:
    """Those files read back by ``threads`` threads into new buffers."""
    import numpy as np

    out: list[Any] = [None] * len(host)

    def one(k: int, idx: list[int]) -> None:
        with open(folder / f"{k}.bin", "rb", buffering=0) as f:
            for i in idx:
                a = np.empty(host[i].shape, host[i].dtype)
                f.readinto(memoryview(a.reshape(-1).view(np.uint8)))
                out[i] = a

    _on_threads([lambda k=k, idx=idx: one(k, idx) for k, idx in enumerate(_shares(host, threads))])
    return out


def _on_threads(jobs: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # re-raised on the caller's thread
            errors.append(e)

    ts = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


# ------------------------------------------------------------------------------------------ reports


class Report:
    """Results as they come, rewritten to bench_out/accelerator-<stamp>.json after each one."""

    def __init__(self, info: dict[str, Any], args: dict[str, Any]):
        C.OUT_DIR.mkdir(exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.path = C.OUT_DIR / f"accelerator-{stamp}.json"
        self.body: dict[str, Any] = {
            "machine": info,
            "args": args,
            "table": {},
            "loop": {},
            "errors": [],
            "checks": {},
            "skipped": [],
        }

    def table(self, name: str, seconds: float, extra: dict[str, float] | None = None) -> None:
        self.body["table"].setdefault(name, []).append(seconds)
        for k, v in (extra or {}).items():
            self.body["table"].setdefault(f"{name}:{k}", []).append(v)
        self.flush()

    def loop(self, key: str, contender: str, res: dict[str, Any]) -> None:
        self.body["loop"].setdefault(key, {}).setdefault(contender, []).append(res)
        self.flush()

    def error(self, where: str, e: BaseException) -> None:
        msg = f"{where}: {type(e).__name__}: {e}"[:600]
        print("  ERROR", msg, flush=True)
        self.body["errors"].append({"where": where, "error": msg, "trace": traceback.format_exc()[-2000:]})
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.body, indent=1, default=str))
        tmp.replace(self.path)


class Clock:
    """The run's time budget: ``ok()`` is False once ``budget`` seconds have passed."""

    def __init__(self, budget: float | None):
        self.t0, self.budget = time.perf_counter(), budget

    def ok(self) -> bool:
        return self.budget is None or time.perf_counter() - self.t0 < self.budget


# ----------------------------------------------------------------------------------------- (a) table


class Table(C.Scenario):
    """The contenders of the table, sharing one state, its host copy and the files they read back;
    each records its seconds (and extras) in the report as it goes."""

    def __init__(self, state: Any, copy: Callable[[Any], Any], scratch: Path, rep: Report, names: list[str]):
        import jax

        import flax_ckpt as fc

        self.jax, self.fc, self.state, self.copy, self.rep = jax, fc, state, copy, rep
        self.scratch, self.contenders = scratch, names
        self.host = [a for a in jax.device_get(leaves_of(copy(state)))]
        self.shardings = [x.sharding for x in leaves_of(state)]
        self.target = abstract(state)
        self.step = 0
        self.managers: dict[str, Any] = {}
        self.shm = (
            Path(tempfile.mkdtemp(prefix="flax_ckpt_bench-", dir="/dev/shm"))
            if os.path.isdir("/dev/shm")
            else scratch / "shm"
        )

    def fresh(self) -> Any:
        return self.jax.block_until_ready(self.copy(self.state))

    def time(self, name: str, r: int) -> dict[str, float]:
        self.run(name, r == 0)
        return {"ms": self.rep.body["table"][name][-1] * 1e3}

    def run(self, name: str, first: bool) -> None:
        """``name``: a contender; ``fc-save@threads=N`` / ``fc-save@window=B``: fc.save with N writer
        threads / B bytes of transfers in flight (engine/transfer.py's THREADS, WINDOW; 0: all at once)."""
        if name.startswith("fc-save@"):
            from flax_ckpt._src.engine import transfer

            knob, value = name.split("@")[1].split("=")
            attr = {"threads": "THREADS", "window": "WINDOW"}[knob]
            old = getattr(transfer, attr)
            setattr(transfer, attr, int(value))
            try:
                return self.c_fc_save(first, name)
            finally:
                setattr(transfer, attr, old)
        getattr(self, "c_" + name.replace("-", "_"))(first)

    # floors
    def c_device_copy(self, first: bool) -> None:
        s = self.fresh()
        t, out = C.timed(lambda: self.jax.block_until_ready(self.copy(s)))
        del out
        self.rep.table("device-copy", t)

    def c_device_get(self, first: bool) -> None:
        s = self.fresh()
        t, _ = C.timed(lambda: self.jax.device_get(s))
        self.rep.table("device-get", t)

    def c_raw_write(self, first: bool) -> None:
        d = self.scratch / "raw"
        t, _ = C.timed(lambda: raw_write(self.host, d))
        self.rep.table("raw-write", t)

    def c_raw_read(self, first: bool) -> None:
        d = self.scratch / "raw"
        if not d.exists():
            raw_write(self.host, d)
        F.drop_cache(d)
        t, _ = C.timed(lambda: raw_read(self.host, d))
        self.rep.table("raw-read", t)

    def c_device_put(self, first: bool) -> None:
        t, out = C.timed(lambda: self.jax.block_until_ready(self.jax.device_put(self.host, self.shardings)))
        del out
        self.rep.table("device-put", t)

    # flax_ckpt
    def _manager(self, name: str) -> Any:
        if name not in self.managers:
            if name == "fc-memory":
                tiers = self.fc.Tiers(local_dir=str(self.shm), peer=False, persist_interval_steps=None)
                mgr = self.fc.CheckpointManager(self.scratch / name, max_to_keep=1, tiers=tiers)
            elif name == "fc-async":
                mgr = self.fc.CheckpointManager(self.scratch / name, max_to_keep=1)
            else:
                import orbax.checkpoint as ocp

                options = ocp.CheckpointManagerOptions(max_to_keep=1)
                mgr = ocp.CheckpointManager(self.scratch / name, options=options)
            self.managers[name] = mgr
            self._save(name, mgr, self.fresh())  # the first save (allocations, compilation) untimed
            mgr.wait_until_finished()
        return self.managers[name]

    def _save(self, name: str, mgr: Any, s: Any) -> Any:
        self.step += 1
        if name.startswith("orbax"):
            import orbax.checkpoint as ocp

            return mgr.save(self.step, args=ocp.args.StandardSave(s))
        return mgr.save(self.step, s)

    def _async(self, name: str) -> None:
        mgr = self._manager(name)
        s = self.fresh()
        t, _ = C.timed(lambda: self._save(name, mgr, s))
        total = t + C.timed(mgr.wait_until_finished)[0]
        self.rep.table(name, t, {"until_durable": total})

    def c_fc_async(self, first: bool) -> None:
        self._async("fc-async")

    def c_fc_memory(self, first: bool) -> None:
        self._async("fc-memory")

    def c_orbax_async(self, first: bool) -> None:
        self._async("orbax-async")

    def _fc_path(self) -> Path:
        return self.scratch / "fc-save" / "ckpt"

    def c_fc_save(self, first: bool, name: str = "fc-save") -> None:
        path = self._fc_path()
        shutil.rmtree(path.parent, ignore_errors=True)
        path.parent.mkdir(parents=True)
        s = self.fresh()
        t, _ = C.timed(lambda: self.fc.save(path, s))
        self.rep.table(name, t)

    def c_fc_restore(self, first: bool) -> None:
        path = self._fc_path()
        if not path.exists():
            self.c_fc_save(False)
        F.drop_cache(path)
        t, out = C.timed(lambda: self.jax.block_until_ready(self.fc.restore(path, self.target)))
        self.rep.table("fc-restore", t)
        if first:
            self._check("fc-save-restore", out)

    def _check(self, name: str, out: Any) -> None:
        import numpy as np

        got = self.jax.device_get(leaves_of(out))
        same = len(got) == len(self.host) and all(
            a.shape == b.shape
            and a.dtype == b.dtype
            and np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
            for a, b in zip(got, self.host)
        )
        self.rep.body["checks"][name] = "bit-exact" if same else "DIFFERENT"
        print(f"  check {name}: {self.rep.body['checks'][name]}", flush=True)

    # Orbax
    def _orbax_path(self) -> Path:
        return self.scratch / "orbax-save" / "ckpt"

    def c_orbax_save(self, first: bool) -> None:
        import orbax.checkpoint as ocp

        path = self._orbax_path()
        shutil.rmtree(path.parent, ignore_errors=True)
        path.parent.mkdir(parents=True)
        s = self.fresh()
        ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        t, _ = C.timed(lambda: ckptr.save(path, args=ocp.args.StandardSave(s)))
        ckptr.close()
        self.rep.table("orbax-save", t)

    def c_orbax_restore(self, first: bool) -> None:
        import orbax.checkpoint as ocp

        path = self._orbax_path()
        if not path.exists():
            self.c_orbax_save(False)
        F.drop_cache(path)
        ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        t, out = C.timed(
            lambda: self.jax.block_until_ready(
                ckptr.restore(path, args=ocp.args.StandardRestore(self.target))
            )
        )
        ckptr.close()
        self.rep.table("orbax-restore", t)
        if first:
            self._check("orbax-save-restore", out)

    def teardown(self) -> None:
        for name, mgr in self.managers.items():
            try:
                mgr.close()
            except Exception as e:
                self.rep.error(f"close {name}", e)
        shutil.rmtree(self.shm, ignore_errors=True)
        for sub in ["raw", "fc-save", "orbax-save"] + list(self.managers):
            shutil.rmtree(self.scratch / sub, ignore_errors=True)


def run_table(
    state: Any, copy: Callable, scratch: Path, rep: Report, rounds: int, clock: Clock, contenders: list[str]
) -> None:
    table = Table(state, copy, scratch, rep, contenders)
    res = C.run(table, rounds, budget=clock.ok, errors=lambda where, e: rep.error(f"table {where}", e))
    rep.body["skipped"] += [f"table {s}" for s in res.skipped]


# ------------------------------------------------------------------------------------------ (b) loop


class DeviceGet(Saver):
    def save(self, step: int, state: Any) -> bool:
        import jax

        jax.device_get(state)
        return True


class DeviceCopy(Saver):
    def __init__(self, copy: Callable[[Any], Any]):
        self.copy, self.kept = copy, None

    def save(self, step: int, state: Any) -> bool:
        self.kept = self.copy(state)  # dispatched on the device's stream; kept until the next save
        return True


class DeviceCopyThread(Saver):
    """The floor of a background save: a jitted on-device copy, then one thread brings it to host
    (``jax.device_get``) and writes it as 8 files on 8 threads, fsynced; a save asked while the
    previous one runs waits for it."""

    def __init__(self, copy: Callable[[Any], Any], d: Path):
        self.copy, self.d, self.thread = copy, d, None

    def save(self, step: int, state: Any) -> bool:
        import jax

        self.finish()
        kept = self.copy(state)

        def run() -> None:
            host = leaves_of(jax.device_get(kept))
            raw_write(host, C.fresh_dir(self.d / "raw"))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return True

    def finish(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def saver(name: str, d: Path, copy: Callable) -> Saver | None:
    return {
        "none": lambda: None,
        "device-get": DeviceGet,
        "device-copy": lambda: DeviceCopy(copy),
        "device-copy-thread": lambda: DeviceCopyThread(copy, d),
        "fc-async": lambda: FcManager(d, max_to_keep=1),
        "fc-async-skip": lambda: FcManager(d, max_to_keep=1, on_busy="skip"),
        "fc-memory": lambda: FcManager(d, max_to_keep=1, tiers=True),
        "orbax-async": lambda: OrbaxManager(d, max_to_keep=1),
    }[name]()


def loop_once(
    name: str, state: Any, step: Callable, copy: Callable, every: int, steps: int, sync: bool, scratch: Path
) -> tuple[Any, dict[str, Any]]:
    """One timed loop; returns the state (donated along the way) and its figures. ``name@window=B``:
    the contender with B bytes of device-to-host transfers in flight (engine/device.py's WINDOW);
    ``name@wstep=B``: with B bytes per write call (storage/local.py's WRITE_STEP)."""
    if "@" in name:
        from flax_ckpt._src.engine import device
        from flax_ckpt._src.storage import local

        knob, value = name.split("@")[1].split("=")
        mod, attr = {"window": (device, "WINDOW"), "wstep": (local, "WRITE_STEP")}[knob]
        old = getattr(mod, attr)
        setattr(mod, attr, int(value))
        try:
            return loop_once(name.split("@")[0], state, step, copy, every, steps, sync, scratch)
        finally:
            setattr(mod, attr, old)
    d = C.fresh_dir(scratch / f"loop-{name}")
    s = saver(name, d / "ckpt", copy)
    try:
        state = warm_up(step, state, s, 2)
        state, got = train(step, state, steps, s, lambda i: (i - 1) % every == 0, sync=sync)
    finally:
        if s is not None:
            s.close()
        shutil.rmtree(d, ignore_errors=True)
    each, saved = got["each"], got["saved"]

    def after(i: int) -> int:  # steps since the last save before step i (-1: none yet)
        return next((i - j for j in reversed(saved) if j < i), -1)

    slow = sorted(range(len(each)), key=each.__getitem__)[-3:]  # the slowest steps: how long after a save
    slowest = [(round(each[k] * 1e3, 1), after(k + 1)) for k in reversed(slow)]
    each = sorted(each)
    return state, {
        "slowest_ms_and_steps_after_save": slowest,
        "step_s": got["wall"] / steps,
        "steady_step_s": got["steady"] / steps,
        "saves": got["made"],
        "asked": len(range(1, steps + 1, every)),
        "blocked_s": statistics.median(got["blocked"]) if got["blocked"] else 0.0,
        "step_p50_s": each[len(each) // 2],
        "step_p90_s": each[len(each) * 9 // 10],
        "step_max_s": each[-1],
    }


def run_loop(
    state: Any,
    init: Callable,
    step: Callable,
    copy: Callable,
    scratch: Path,
    rep: Report,
    rounds: int,
    clock: Clock,
    contenders: list[str],
    plan: dict[int, int],
    syncs: tuple[bool, ...] = (True, False),
) -> None:
    import jax

    for r in range(rounds):
        for sync in syncs:
            for every, steps in plan.items():
                key = f"{'sync' if sync else 'nosync'}/{every}"
                for name in C.rotated(contenders, r):
                    if not clock.ok():
                        rep.body["skipped"].append(f"loop round {r} {key} {name}: past --budget-s")
                        continue
                    try:
                        state, res = loop_once(name, state, step, copy, every, steps, sync, scratch)
                        rep.loop(key, name, res)
                        print(
                            f"round {r} loop {key:11s} {name:12s} {res['step_s'] * 1e3:8.1f} ms/step  "
                            f"saves {res['saves']}/{res['asked']}  "
                            f"blocked {res['blocked_s'] * 1e3:.1f} ms  "
                            f"step p50/p90/max {res['step_p50_s'] * 1e3:.1f}/{res['step_p90_s'] * 1e3:.1f}/"
                            f"{res['step_max_s'] * 1e3:.1f} ms  slowest {res['slowest_ms_and_steps_after_save']}",
                            flush=True,
                        )
                    except Exception as e:
                        rep.error(f"loop round {r} {key} {name}", e)
                        state = jax.block_until_ready(step(init()))  # the donated state may be gone


# ------------------------------------------------------------------------------------------ summary


def _med(v: list[float] | None) -> float | None:
    return statistics.median(v) if v else None


def summarize(body: dict[str, Any]) -> str:
    t = body["table"]
    m = {k: _med(v) for k, v in t.items()}
    lines = [
        f"# Checkpoints on {body['machine'].get('devices')}\n",
        f"state: {body.get('state_mib', 0):.0f} MiB in {body.get('state_leaves')} leaves; "
        f"{body['args'].get('rounds')} rounds; date {body['machine'].get('date')}\n",
        "| contender | median | note |",
        "|---|---:|---|",
    ]
    for name in TABLE + sorted(k for k in m if "@" in k and ":" not in k and k not in TABLE):
        if m.get(name) is not None:
            note = ""
            if f"{name}:until_durable" in m:
                note = f"until durable {C.fmt(m[name + ':until_durable'] * 1e3)} ms"
            lines.append(f"| {name} | {m[name] * 1e3:.1f} ms | {note} |")
    ratios = {}

    def ratio(label: str, a: str, b: float | None) -> None:
        if m.get(a) is not None and b:
            ratios[label] = m[a] / b

    if m.get("device-get") is not None and m.get("raw-write") is not None:
        ratio("fc-save / max(device-get, raw-write)", "fc-save", max(m["device-get"], m["raw-write"]))
    ratio("orbax-save / fc-save", "orbax-save", m.get("fc-save"))
    ratio("fc-save@window=0 / fc-save", "fc-save@window=0", m.get("fc-save"))
    if m.get("raw-read") is not None and m.get("device-put") is not None:
        ratio("fc-restore / (raw-read + device-put)", "fc-restore", m["raw-read"] + m["device-put"])
    ratio("orbax-restore / fc-restore", "orbax-restore", m.get("fc-restore"))
    ratio("fc-async / device-copy", "fc-async", m.get("device-copy"))
    ratio("fc-memory / device-copy", "fc-memory", m.get("device-copy"))
    ratio("orbax-async / device-copy", "orbax-async", m.get("device-copy"))
    body["ratios"] = ratios
    if ratios:
        lines += ["", "| ratio (of medians) | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    loop = body["loop"]
    if loop:
        cols = LOOP + sorted({c for by in loop.values() for c in by if c not in LOOP})
        lines += [
            "",
            "Loop: ms per step; overhead against `none` (median of per-round ratios − 1), with the "
            "wait for the last save at the end, and without it (steady); saves made / asked; median "
            "blocked per save",
            "",
            "| setting | " + " | ".join(cols) + " |",
            "|---|" + "---|" * len(cols),
        ]
        for key, by in loop.items():
            base = by.get("none", [])
            cells = []
            for c in cols:
                runs = by.get(c, [])
                if not runs:
                    cells.append("-")
                    continue
                ms = statistics.median(r["step_s"] for r in runs) * 1e3
                pairs = [(b["step_s"], r["step_s"]) for b, r in zip(base, runs)]
                over = (
                    ""
                    if not pairs or c == "none"
                    else f" {statistics.median(y / x for x, y in pairs) - 1:+.1%}"
                )
                pairs = [(b.get("steady_step_s"), r.get("steady_step_s")) for b, r in zip(base, runs)]
                pairs = [(x, y) for x, y in pairs if x and y]
                if pairs and c != "none":  # the loop's cost without the wait for its last save
                    over += f" (steady {statistics.median(y / x for x, y in pairs) - 1:+.1%})"
                made = statistics.median(r["saves"] for r in runs)
                blocked = statistics.median(r["blocked_s"] for r in runs) * 1e3
                saves = "" if c == "none" else f" ({made:g}/{runs[0]['asked']}, {blocked:.1f} ms)"
                cells.append(f"{ms:.1f}{over}{saves}")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if body["checks"]:
        lines += ["", "checks: " + ", ".join(f"{k} {v}" for k, v in body["checks"].items())]
    if body["errors"]:
        lines += ["", "errors:"] + [f"- {e['error']}" for e in body["errors"]]
    if body["skipped"]:
        lines += ["", f"skipped (budget): {len(body['skipped'])} measurements"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- main


def device_info() -> dict[str, Any]:
    import jax

    devs = jax.devices()
    kind = getattr(devs[0], "device_kind", "")
    info: dict[str, Any] = {
        "devices": f"{len(devs)} x {devs[0].platform} {kind}",
        "backend": jax.default_backend(),
    }
    try:
        stats = devs[0].memory_stats() or {}
        info["device_memory_gib"] = round(stats.get("bytes_limit", 0) / (1 << 30), 2)
    except Exception:
        pass
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--small", action="store_true", help="a tiny model and few steps (a CPU in under a minute)"
    )
    ap.add_argument("--parts", default="table,loop")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the table")
    ap.add_argument("--loop-rounds", type=int, default=2)
    ap.add_argument("--steps", default=None, help="every:steps timed (default 1:10,10:50,100:100)")
    ap.add_argument("--table", default=",".join(TABLE), help="table contenders")
    ap.add_argument("--loop", default=",".join(LOOP), help="loop contenders")
    ap.add_argument("--model", default=None, help="d,layers,heads,vocab,seq,batch")
    ap.add_argument(
        "--sync",
        choices=["both", "sync", "nosync"],
        default="both",
        help="loops with a sync per step, without, or both",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (a diagnosis of GIL contention)",
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="start no measurement after this many seconds"
    )
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import jax
    import numpy as np

    dims = dict(SMALL if args.small else FULL)
    if args.model:
        dims = dict(zip(FULL, map(int, args.model.split(","))))
    plan_text = args.steps or ("1:4,10:12" if args.small else "1:10,10:50,100:100")
    plan = {int(a): int(b) for a, b in (p.split(":") for p in plan_text.split(","))}
    clock = Clock(args.budget_s)
    scratch = C.SCRATCH
    info = {**C.machine_info(scratch), **device_info()}
    print(f"devices: {info['devices']} (jax {jax.__version__}, backend {info['backend']})", flush=True)
    rep = Report(info, {**vars(args), "dims": dims, "plan": plan})
    try:
        init, step, copy = make_model(**dims)
        state = jax.block_until_ready(step(init()))
        leaves = leaves_of(state)
        rep.body["state_mib"] = sum(np.dtype(x.dtype).itemsize * x.size for x in leaves) / C.MB
        rep.body["state_leaves"] = len(leaves)
        print(f"state: {rep.body['state_mib']:.0f} MiB in {len(leaves)} leaves", flush=True)
        if "table" in args.parts:
            run_table(state, copy, scratch, rep, args.rounds, clock, args.table.split(","))
        if "loop" in args.parts:
            syncs = {"both": (True, False), "sync": (True,), "nosync": (False,)}[args.sync]
            run_loop(
                state,
                init,
                step,
                copy,
                scratch,
                rep,
                args.loop_rounds,
                clock,
                args.loop.split(","),
                plan,
                syncs,
            )
    except Exception as e:
        rep.error("setup", e)
    finally:
        C.remove_scratch(scratch)
        md = summarize(rep.body)
        rep.flush()
        rep.path.with_suffix(".md").write_text(md)
        print(md)
        print(f"wrote {rep.path} and {rep.path.with_suffix('.md')}", flush=True)


if __name__ == "__main__":
    main()
