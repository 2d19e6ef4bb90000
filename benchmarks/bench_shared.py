"""A fine-tune's saves: a frozen base and a small part that changes, against a state that changes whole.

    python benchmarks/bench_shared.py                      # 32 MiB frozen + 0.75 MiB changing, 5 rounds
    python benchmarks/bench_shared.py --frozen-mb 256 --rounds 3
    python benchmarks/ab.py --baseline /tmp/flax_ckpt-base --rounds 3 --keys 'full' -- bench_shared.py
    source benchmarks/tpu_env.sh && FLAX_CKPT_BENCH_OUT=$OUT python3 benchmarks/bench_shared.py --device

Two states of the same size, each saved by its own ``CheckpointManager`` (async_save=True,
max_to_keep=2, the default serializer), after two untimed warm-up saves:
- "lora": ``--frozen-mb`` MiB of frozen matrices (4 MiB each) plus ``--changing-mb`` MiB that change at
  every save (LoRA factors and their adam moments);
- "full": the same shapes, every byte changed at every save (two states saved alternately).
"durable" is from the save call until ``wait_until_finished`` returns (retention included). Each round
saves each state once, the order alternating; figures are medians over rounds, and "lora_over_full" the
median of per-round ratios. "bytes": what 10 saves of the lora state leave on disk with
``max_to_keep=None`` and with 2, against one full state plus what changed (issue 54's bound: 1.3x).

``--device`` (``OnDevice``): the states as jax.Arrays on the default device (``--frozen-mb`` 1024 and
``--changing-mb`` 8 by default there) in 16 MiB leaves, each step's made by a jitted step that donates
the last (the frozen leaves new arrays of equal bytes, every byte of the full state changed), saved at
every one of ``--steps`` steps by an async ``CheckpointManager(max_to_keep=2)``: each state with the
device deciding what changed (engine/device_hash.py, "/device") and with the host deciding
(``_FLAX_CKPT_DEVICE_HASH=off``, "/host"); per run the medians after the first save of the time
``save`` blocks, the time until durable and the bytes brought from the device to host; and the hash
alone over the frozen part (seconds, the compiled program's temporary bytes).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ab  # noqa: E402
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

if "--device" not in sys.argv:
    F.jax_cpu_env()
warnings.filterwarnings("ignore")

import flax_ckpt as fc  # noqa: E402


def states(frozen_mb: int, changing_mb: float) -> tuple[dict, list[dict], list[dict]]:
    """(frozen part, changing parts for every save, fully changed states (two, saved alternately))."""
    rng = np.random.default_rng(0)
    n = max(1, frozen_mb // 4)
    frozen = {f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(n)}
    per = int(changing_mb * C.MB / 4 / 6)
    changing = [{k: rng.standard_normal(per, dtype=np.float32) for k in "abcdef"} for _ in range(4)]
    full = [
        {
            "frozen": {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in frozen.items()},
            "lora": changing[i],
        }
        for i in range(2)
    ]
    return frozen, changing, full


def makers(frozen_mb: int, changing_mb: float) -> tuple[Callable[[int], dict], Callable[[int], dict]]:
    """(the fine-tune's state at a step, the fully changed state at a step), from ``states``."""
    frozen, changing, full = states(frozen_mb, changing_mb)

    def lora(step: int) -> dict:
        return {"frozen": frozen, "lora": changing[step % len(changing)]}

    def whole(step: int) -> dict:
        return full[step % 2]

    return lora, whole


def saves(directory, make, count: int, **kw) -> list[float]:
    """Seconds until durable of ``count`` saves (after two untimed ones) of ``make(step)``."""
    out = []
    with fc.CheckpointManager(directory, max_to_keep=kw.pop("max_to_keep", 2), **kw) as mgr:
        for step in range(count + 2):
            state = make(step)
            t0 = time.perf_counter()
            mgr.save(step, state)
            mgr.wait_until_finished()
            if step >= 2:
                out.append(time.perf_counter() - t0)
    return out


class Shared(C.Scenario):
    """Each state saved ``count`` times by a fresh manager: the median seconds until durable."""

    name, contenders, floors = "bench_shared", ["lora", "full"], ["full"]

    def __init__(self, makes: dict[str, Callable[[int], dict]], count: int):
        self.makes, self.count = makes, count

    def time(self, name: str, r: int) -> dict[str, float]:
        d = C.fresh_dir(C.SCRATCH / f"{name}-{r}")
        try:
            return {"durable": statistics.median(saves(d, self.makes[name], self.count))}
        finally:
            C.remove_scratch(d)


def device_run(directory, frozen_mb: int, changing_mb: float, whole: bool, steps: int) -> dict:
    """One run of ``--device``: per save after the first, blocked and durable seconds and bytes brought
    to host (engine/device.py ``to_host``, counted), and the snapshot modes seen."""
    import jax

    from flax_ckpt._src.engine import device

    keys = iter(jax.random.split(jax.random.key(0), 1024))
    frozen = {f"w{i}": jax.random.normal(next(keys), (2048, 2048)) for i in range(max(1, frozen_mb // 16))}
    per = int(changing_mb * C.MB / 4 / 6)
    state = {"frozen": frozen, "lora": {k: jax.random.normal(next(keys), (per,)) for k in "abcdef"}}
    f = lambda x: -x if whole else x * 1.0  # noqa: E731  (frozen: new arrays, equal bytes)
    step_fn = jax.jit(
        lambda s: {"frozen": jax.tree.map(f, s["frozen"]), "lora": jax.tree.map(lambda x: -x, s["lora"])},
        donate_argnums=0,
    )
    moved: list[int] = []
    real = device.to_host

    def counted(pending, hurry=None):
        moved.append(sum(p.nbytes for p in pending))
        return real(pending, hurry)

    device.to_host = counted
    out: dict = {"blocked_s": [], "durable_s": [], "host_bytes": []}
    try:
        with fc.CheckpointManager(directory, max_to_keep=2) as mgr:
            for step in range(steps):
                state = step_fn(state)
                jax.block_until_ready(state)
                moved.clear()
                t0 = time.perf_counter()
                mgr.save(step, state)
                t1 = time.perf_counter()
                mgr.wait_until_finished()
                if step:
                    out["blocked_s"].append(t1 - t0)
                    out["durable_s"].append(time.perf_counter() - t0)
                    out["host_bytes"].append(sum(moved))
            out["modes"] = sorted({s.snapshot_mode for s in mgr.stats})
    finally:
        device.to_host = real
    out["changed_bytes"] = sum(x.nbytes for x in state["lora"].values())
    return out


def hash_probe(frozen_mb: int) -> dict:
    """The device hash alone (engine/device_hash.py) over ``frozen_mb`` MiB of 16 MiB leaves: seconds
    (median of 5, after one untimed) and the compiled program's temporary bytes."""
    import jax

    from flax_ckpt._src.engine import device_hash as dh

    xs = [jax.random.normal(jax.random.key(i), (2048, 2048)) for i in range(max(1, frozen_mb // 16))]
    d = next(iter(xs[0].devices()))
    t1, t2 = dh._key().tables(d)
    stats = jax.jit(dh._digest).lower(xs[0], t1, t2).compile().memory_analysis()
    temp = -1 if stats is None else stats.temp_size_in_bytes
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        dh.digests(xs)
        times.append(time.perf_counter() - t0)
    return {"hash_s": statistics.median(times[1:]), "hash_temp_bytes": int(temp), "leaf_bytes": xs[0].nbytes}


class OnDevice(C.Scenario):
    """``--device``: each state saved every step by a fresh manager, the device or the host deciding."""

    name = "bench_shared_device"
    contenders = ["lora/device", "full/device", "lora/host", "full/host"]
    floors = ["full/host"]

    def __init__(self, frozen_mb: int, changing_mb: float, steps: int):
        self.frozen_mb, self.changing_mb, self.steps = frozen_mb, changing_mb, steps
        self.on = os.environ.get("_FLAX_CKPT_DEVICE_HASH", "auto")
        self.runs: dict[str, list[dict]] = {}

    def time(self, name: str, r: int) -> dict[str, float]:
        os.environ["_FLAX_CKPT_DEVICE_HASH"] = self.on if name.endswith("/device") else "off"
        d = C.fresh_dir(C.SCRATCH / f"{name.replace('/', '-')}-{r}")
        try:
            out = device_run(d, self.frozen_mb, self.changing_mb, name.startswith("full"), self.steps)
        finally:
            C.remove_scratch(d)
        self.runs.setdefault(name, []).append(out)
        return {k: statistics.median(out[f"{k}_s"]) for k in ("blocked", "durable")}


def main_device(args) -> None:
    sc = OnDevice(args.frozen_mb or 1024, args.changing_mb or 8.0, args.steps)
    res = C.run(sc, args.rounds)
    probe = hash_probe(sc.frozen_mb)
    host_bytes = {n: statistics.median(x for run in sc.runs[n] for x in run["host_bytes"]) for n in sc.runs}
    changed = sc.runs["lora/device"][0]["changed_bytes"]
    body = {
        "machine": C.machine_info(C.SCRATCH),
        "args": dict(vars(args), frozen_mb=sc.frozen_mb, changing_mb=sc.changing_mb),
        "rounds_s": res.times,
        "runs": sc.runs,
        "hash": probe,
        "blocked_s": {n: res.median(n, "blocked") for n in sc.contenders},
        "durable_s": {n: res.median(n, "durable") for n in sc.contenders},
        "host_bytes": host_bytes,
        "lora_over_full": res.paired_ratio("full/device", "lora/device", "durable"),
        "full_device_over_host": res.paired_ratio("full/host", "full/device", "durable"),
        "lora_host_bytes_over_changed": host_bytes["lora/device"] / changed,
    }
    md = "".join(
        f"{n}: blocked {C.fmt(body['blocked_s'][n] * 1e3, ' ms')}, durable "
        f"{C.fmt(body['durable_s'][n] * 1e3, ' ms')}, to host {host_bytes[n] / C.MB:.1f} MiB\n"
        for n in sc.contenders
    ) + (
        f"lora/full (device) {body['lora_over_full']:.3f}; full device/host {body['full_device_over_host']:.3f}; "
        f"lora bytes to host / changed {body['lora_host_bytes_over_changed']:.3f}\n"
        f"hash of {sc.frozen_mb} MiB on the device: {probe['hash_s'] * 1e3:.1f} ms, temporaries "
        f"{probe['hash_temp_bytes']} B for a {probe['leaf_bytes'] >> 20} MiB leaf\n"
    )
    js, _ = C.write_report("bench_shared_device", body, md)
    print(md + f"report: {js}")


def main() -> None:
    ap = C.cli(__doc__.splitlines()[0], rounds=5)
    ap.add_argument("--frozen-mb", type=int, default=None, help="32 (1024 with --device)")
    ap.add_argument("--changing-mb", type=float, default=None, help="0.75 (8 with --device)")
    ap.add_argument("--saves", type=int, default=4, help="timed saves per state per round")
    ap.add_argument("--device", action="store_true", help="jax.Arrays on the default device (see above)")
    ap.add_argument("--steps", type=int, default=20, help="--device: saves per run, one per step")
    args = ap.parse_args()
    if args.device:
        return main_device(args)
    args.frozen_mb, args.changing_mb = args.frozen_mb or 32, args.changing_mb or 0.75
    lora, whole = makers(args.frozen_mb, args.changing_mb)
    res = C.run(Shared({"lora": lora, "full": whole}, args.saves), args.rounds)
    times = {n: res.times[n]["durable"] for n in Shared.contenders}
    nbytes = {}
    for keep in (None, 2):
        d = C.fresh_dir(C.SCRATCH / f"bytes-{keep}")
        with fc.CheckpointManager(d, max_to_keep=keep, async_save=False) as mgr:
            for step in range(10):
                mgr.save(step, lora(step))
        nbytes[f"keep_{keep}"] = F.disk_usage(d)
        C.remove_scratch(d)
    one = F.tree_bytes(dict(F.flat_items(lora(0))))
    changed = F.tree_bytes(dict(F.flat_items(lora(0)["lora"])))
    bound = {"keep_None": one + 9 * changed, "keep_2": one + 2 * changed}
    body = {
        "machine": C.machine_info(C.SCRATCH),
        "args": vars(args),
        "durable_s": {"lora": statistics.median(times["lora"]), "full": statistics.median(times["full"])},
        "lora_over_full": res.paired_ratio("full", "lora", "durable"),
        "rounds_s": times,  # per state, each round's median
        "bytes": nbytes,
        "bytes_unshared": {"keep_None": 10 * one, "keep_2": 2 * one},  # every save writing the whole state
        "bytes_over_bound": {k: nbytes[k] / bound[k] for k in nbytes},
        "state_bytes": one,
        "changed_bytes": changed,
    }
    md = (
        f"durable: lora {C.fmt(body['durable_s']['lora'] * 1e3, ' ms')}, full "
        f"{C.fmt(body['durable_s']['full'] * 1e3, ' ms')}, lora/full {body['lora_over_full']:.3f}\n"
        f"bytes of 10 saves: {nbytes['keep_None'] / C.MB:.1f} MiB (keep all), {nbytes['keep_2'] / C.MB:.1f} MiB "
        f"(max_to_keep=2); over one state + what changed: {body['bytes_over_bound']['keep_None']:.3f}, "
        f"{body['bytes_over_bound']['keep_2']:.3f}\n"
    )
    js, _ = C.write_report("bench_shared", body, md)
    print(md + f"report: {js}")


if __name__ == "__main__":
    main()
