"""What the hostile-input checks cost a restore: the exact-tiling check and the Orbax folder walk.

    python benchmarks/bench_checks.py                      # 20k leaves of 1 KiB, 6 rounds
    python benchmarks/bench_checks.py --leaves 5000 20000 --rounds 4
    python benchmarks/bench_checks.py --layouts orbax-per-array --rounds 8

Switched: the exact-tiling check (``checks.tiling_problem``, in the manifest's validation and where
the restore places chunks), the Orbax folder walk (``orbax.locate.walk``) and the lstat of every chunk
file (``orbax.folders._look``, only past a 64 MiB memory bound). An Orbax step of one folder per array
has no separate check pass (its checks are each open's flags and fstat): its two columns measure the
same code, the benchmark's noise. Restored: a native step (raw serializer; and zarr3) and an Orbax step
(OCDBT) written by fc.save, and one Orbax wrote with a folder per array (when orbax-checkpoint is
installed), each into a jax target.

Two measures, interleaved over rounds: (1) the time inside the check functions (a timer around
them; not around the per-file lstat of orbax/folders.py, whose timer would cost more than it); (2) the
wall-time cost, a restore with the checks against the same restore with each check replaced by the
answer it gave (tiling: no problem; walks: the files they found), in the runner's rotated order. The cost is
the difference of the two medians, and its share of the checked restore; on a noisy machine it
carries the noise of both medians (it can come out negative).

Reports go to bench_out/bench_checks-<time>.{json,md}.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()

import jax  # noqa: E402

import flax_ckpt as fc  # noqa: E402
from flax_ckpt._src import checks  # noqa: E402
from flax_ckpt._src.engine import reader as engine_reader  # noqa: E402
from flax_ckpt._src.native import manifest  # noqa: E402
from flax_ckpt._src.orbax import folders, locate  # noqa: E402
from flax_ckpt._src.orbax import read as orbax_read  # noqa: E402
from flax_ckpt._src.tiers import load as tier_load  # noqa: E402

SPENT = [0.0]
CHECKING = [True]  # False: every check answers what it answered before, without doing the work
FOUND: dict[tuple[str, ...], list[str]] = {}  # folders walked -> the files the walk found there
LOOKED: dict[tuple[str, str], object] = {}  # (folder, name) -> what folders._look answered


def _tiling(real):
    @functools.wraps(real)
    def tiling_problem(boxes, bounds):
        if not CHECKING[0]:
            return None
        t0 = time.perf_counter()
        try:
            return real(boxes, bounds)
        finally:
            SPENT[0] += time.perf_counter() - t0

    return tiling_problem


def _folder(real):
    @functools.wraps(real)
    def walk(roots):
        key = tuple(roots)
        if not CHECKING[0]:
            return list(FOUND[key])
        t0 = time.perf_counter()
        try:
            FOUND[key] = real(roots)
            return list(FOUND[key])
        finally:
            SPENT[0] += time.perf_counter() - t0

    return walk


def _look(real):
    """Not timed call by call: two clock reads cost more than the lstat itself (tens of thousands of
    calls), so the wall-time cost is this check's only measure."""

    @functools.wraps(real)
    def look(folder, where, name):
        if not CHECKING[0]:
            return LOOKED[where, name]
        out = LOOKED[where, name] = real(folder, where, name)
        return out

    return look


def _patch() -> None:
    """Every module that imported the checks by name gets the switchable, timed version."""
    tiling = _tiling(checks.tiling_problem)
    for mod in (checks, manifest, engine_reader, tier_load):
        if getattr(mod, "tiling_problem", None) is not None:
            mod.tiling_problem = tiling
    orbax_read.walk = _folder(locate.walk)
    folders._look = _look(folders._look)


def _restore(path: Path, tree, checking: bool) -> tuple[float, float]:
    CHECKING[0], SPENT[0] = checking, 0.0
    t0 = time.perf_counter()
    out = fc.restore(path, target=tree)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, SPENT[0]


class Checks(C.Scenario):
    """Contenders "<layout>: checked" (the restore with its checks, the time inside them) and
    "<layout>: answered" (each check replaced by the answer it gave in ``setup``'s restore)."""

    def __init__(self, paths: dict[str, Path], tree):
        self.paths, self.tree = paths, tree
        self.contenders = [f"{n}: {m}" for n in paths for m in ("checked", "answered")]

    def setup(self) -> None:
        for path in self.paths.values():
            _restore(path, self.tree, True)  # warm up, and record what every check answers

    def time(self, name: str, r: int) -> dict[str, float]:
        layout, mode = name.rsplit(": ", 1)
        t, spent = _restore(self.paths[layout], self.tree, mode == "checked")
        return {"restore": t, "in_checks": spent} if mode == "checked" else {"restore": t}


def layouts(n: int, tree, keep: set[str]) -> dict[str, Path]:
    """The step of ``tree`` in each layout of ``keep``, written under SCRATCH."""
    paths = {}
    for name, kw in (
        ("native raw", {}),
        ("native zarr3", {"serializer": "zarr3"}),
        ("orbax ocdbt", {"format": "orbax"}),
    ):
        paths[name] = C.SCRATCH / f"{n}-{name.replace(' ', '-')}"
        fc.save(paths[name], tree, **kw)
    try:  # one folder per array (Orbax's use_ocdbt=False): the walk visits every array's folder
        import orbax.checkpoint as ocp
    except ImportError:
        print("orbax-checkpoint is not installed: no per-array Orbax case")
    else:
        paths["orbax per-array (Orbax wrote it)"] = C.SCRATCH / f"{n}-orbax-plain"
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)).save(
            paths["orbax per-array (Orbax wrote it)"], args=ocp.args.PyTreeSave(tree)
        )
    return {name: p for name, p in paths.items() if "-".join(name.split(" (")[0].split()) in keep}


def main() -> None:
    ap = C.cli(__doc__.split("\n")[0], rounds=6)
    ap.add_argument("--leaves", type=int, nargs="+", default=[20000])
    ap.add_argument("--leaf-bytes", type=int, default=1024)
    ap.add_argument(
        "--layouts",
        default="native-raw,native-zarr3,orbax-ocdbt,orbax-per-array",
        help="comma-separated, of those named in the default",
    )
    args = ap.parse_args()
    _patch()
    rows = []
    C.SCRATCH.mkdir(parents=True, exist_ok=True)
    try:
        for n in args.leaves:
            tree = F.nest({k: jax.numpy.asarray(v) for k, v in F.many_small_tree(n, args.leaf_bytes).items()})
            paths = layouts(n, tree, set(args.layouts.split(",")))
            res = C.run(Checks(paths, tree), args.rounds)
            for name in paths:
                checked = res.median(f"{name}: checked", "restore") or 0.0
                unchecked = res.median(f"{name}: answered", "restore")
                rows.append(
                    {
                        "leaves": n,
                        "layout": name,
                        "restore_s": checked,
                        "unchecked_s": unchecked,
                        "in_checks_s": res.median(f"{name}: checked", "in_checks"),
                        "cost_share": (checked - (unchecked or 0.0)) / checked,
                    }
                )
    finally:
        C.remove_scratch(C.SCRATCH)
    lines = [
        "| leaves | layout | restore (median s) | checks answered, not done (median s) | wall-time cost "
        "| inside the checks (median s) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['leaves']} | {r['layout']} | {r['restore_s']:.3f} | {r['unchecked_s']:.3f} | "
        f"{100 * r['cost_share']:+.2f}% | {r['in_checks_s']:.4f} |"
        for r in rows
    ]
    text = "\n".join(lines)
    print(text)
    C.write_report("bench_checks", {"args": vars(args), "rows": rows}, text)


if __name__ == "__main__":
    main()
