"""What the hostile-input checks cost a restore: the exact-tiling check and the Orbax folder walk.

    python benchmarks/bench_checks.py                      # 20k leaves of 1 KiB, 5 rounds
    python benchmarks/bench_checks.py --leaves 5000 20000 --rounds 3

Every restore checks that each leaf's chunks tile it exactly (``checks.tiling_problem``: in the
native manifest's validation and again where the restore places chunks) and, for an Orbax step,
walks its folder before tensorstore opens anything (``orbax.locate.check_folder``: links out,
FIFOs). Per round, interleaved: fc.restore of a native step (raw serializer; and zarr3), of an
Orbax step (ocdbt) written by fc.save and of one Orbax wrote with a folder per array (when
orbax-checkpoint is installed), each into a jax target, with those functions wrapped by a
timer that sums their time. The report gives the median restore time, the median time inside the
checks, and their share of the restore (the wrapper's own cost counts against the checks, so the
share is an upper bound).

Reports go to bench_out/bench_checks-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

C.jax_cpu_env()

import jax  # noqa: E402

import flax_ckpt as fc  # noqa: E402
from flax_ckpt._src import checks  # noqa: E402
from flax_ckpt._src.engine import restore as engine_restore  # noqa: E402
from flax_ckpt._src.native import manifest  # noqa: E402
from flax_ckpt._src.orbax import locate, read as orbax_read  # noqa: E402
from flax_ckpt._src.tiers import load as tier_load  # noqa: E402

SPENT = [0.0]


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[0] += time.perf_counter() - t0
    return wrapper


def _patch() -> None:
    """Every module that imported the checks by name gets the timed version."""
    tiling = _timed(checks.tiling_problem)
    for mod in (checks, manifest, engine_restore, tier_load):
        if getattr(mod, "tiling_problem", None) is not None:
            mod.tiling_problem = tiling
    walk = _timed(locate.check_folder)
    for mod in (locate, orbax_read):
        if getattr(mod, "check_folder", None) is not None:
            mod.check_folder = walk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leaves", type=int, nargs="+", default=[20000])
    ap.add_argument("--leaf-bytes", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    _patch()
    rows = []
    C.SCRATCH.mkdir(parents=True, exist_ok=True)
    try:
        for n in args.leaves:
            tree = C.nest({k: jax.numpy.asarray(v) for k, v in C.many_small_tree(n, args.leaf_bytes).items()})
            paths = {}
            for name, kw in (("native raw", {}), ("native zarr3", {"serializer": "zarr3"}),
                             ("orbax ocdbt", {"format": "orbax"})):
                paths[name] = C.SCRATCH / f"{n}-{name.replace(' ', '-')}"
                fc.save(paths[name], tree, **kw)
            try:  # one folder per array (Orbax's use_ocdbt=False): the walk visits every array's folder
                import orbax.checkpoint as ocp
            except ImportError:
                print("orbax-checkpoint is not installed: no per-array Orbax case")
            else:
                paths["orbax per-array (Orbax wrote it)"] = C.SCRATCH / f"{n}-orbax-plain"
                ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)).save(
                    paths["orbax per-array (Orbax wrote it)"], args=ocp.args.PyTreeSave(tree))
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, path in paths.items():  # interleaved
                    SPENT[0] = 0.0
                    t0 = time.perf_counter()
                    out = fc.restore(path, target=tree)
                    jax.block_until_ready(out)
                    times[name].append((time.perf_counter() - t0, SPENT[0]))
                    del out
            for name, ts in times.items():
                total = statistics.median(t for t, _ in ts)
                spent = statistics.median(s for _, s in ts)
                rows.append({"leaves": n, "layout": name, "restore_s": total, "checks_s": spent,
                             "share": spent / total})
    finally:
        C.remove_scratch(C.SCRATCH)
    lines = ["| leaves | layout | restore (median s) | in the checks (median s) | share of restore |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['leaves']} | {r['layout']} | {r['restore_s']:.3f} | {r['checks_s']:.4f} | {100 * r['share']:.2f}% |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    C.write_report("bench_checks", {"args": vars(args), "rows": rows}, text)


if __name__ == "__main__":
    main()
