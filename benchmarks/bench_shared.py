"""A fine-tune's saves: a frozen base and a small part that changes, against a state that changes whole.

    python benchmarks/bench_shared.py                      # 32 MiB frozen + 0.75 MiB changing, 5 rounds
    python benchmarks/bench_shared.py --frozen-mb 256 --rounds 3
    python benchmarks/ab.py --baseline /tmp/flax_ckpt-base --rounds 3 --keys 'full' -- bench_shared.py

Two states of the same size, each saved by its own ``CheckpointManager`` (async_save=True,
max_to_keep=2, the default serializer), after two untimed warm-up saves:
- "lora": ``--frozen-mb`` MiB of frozen matrices (4 MiB each) plus ``--changing-mb`` MiB that change at
  every save (LoRA factors and their adam moments);
- "full": the same shapes, every byte changed at every save (two states saved alternately).
"durable" is from the save call until ``wait_until_finished`` returns (retention included). Each round
saves each state once, the order alternating; figures are medians over rounds, and "lora_over_full" the
median of per-round ratios. "bytes": what 10 saves of the lora state leave on disk with
``max_to_keep=None`` and with 2, against one full state plus what changed (issue 54's bound: 1.3x).
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


def main() -> None:
    ap = C.cli(__doc__.splitlines()[0], rounds=5)
    ap.add_argument("--frozen-mb", type=int, default=32)
    ap.add_argument("--changing-mb", type=float, default=0.75)
    ap.add_argument("--saves", type=int, default=4, help="timed saves per state per round")
    args = ap.parse_args()
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
