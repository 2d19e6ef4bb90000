"""Memory and time of a save and a restore of N one-element leaves (issue 51 item 8).

    python benchmarks/probes/many_leaves.py --leaves 100000            # one process per measure
    python benchmarks/probes/many_leaves.py --leaves 1000000
    python benchmarks/probes/many_leaves.py --leaves 100000 --trace    # the 12 largest allocation sites

Each of save (``fc.save``), manager save (a synchronous CheckpointManager, 3 steps) and restore (into a
target, and without one) runs in a fresh child process on a state of N float32 leaves of one element,
as numpy arrays in a nested dict (100 leaves a dict). Reported: seconds, peak RSS above the RSS before
the call (VmHWM, reset first), in MiB and as a multiple of the manifest's size, and the manifest's
size. ``--trace``: tracemalloc's largest allocation sites at the peak, instead (slower).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C  # noqa: E402

MiB = 1 << 20


def state(n: int):
    import numpy as np

    tree: dict = {}
    for i in range(n):
        tree.setdefault(f"block{i // 100:05d}", {})[f"w{i % 100:02d}"] = np.full(1, i, np.float32)
    return tree


def measure(kind: str, n: int, folder: str, trace: bool) -> dict:
    import flax_ckpt as fc

    tree = state(n)
    path = os.path.join(folder, "ckpt")
    fc.save(os.path.join(folder, "warm"), state(200))  # imports and first-call set-up: not measured
    fc.restore(os.path.join(folder, "warm"))
    if kind.startswith("restore"):
        fc.save(path, tree)
    run = None
    if kind == "manager":
        run = fc.CheckpointManager(os.path.join(folder, "run"), async_save=False, max_to_keep=2)

    def call():
        if kind == "save":
            fc.save(path, tree)
        elif kind == "manager":
            for step in range(3):
                run.save(step, tree)
        elif kind == "restore":
            fc.restore(path, tree)
        else:
            fc.restore(path)

    if trace:
        import tracemalloc

        tracemalloc.start(8)
    seconds, peak, _ = C.peak_above(call)
    out = {"kind": kind, "leaves": n, "seconds": seconds, "peak": peak}
    if trace:
        import tracemalloc

        snap = tracemalloc.take_snapshot()
        out["traced_peak"] = tracemalloc.get_traced_memory()[1]
        out["top"] = [str(s) for s in snap.statistics("traceback")[:12]]
    if run is not None:
        run.close()
    manifest = (
        os.path.join(folder, "run", "2", "manifest.json")
        if kind == "manager"
        else os.path.join(path, "manifest.json")
    )
    out["manifest"] = os.path.getsize(manifest) if os.path.exists(manifest) else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, nargs="+", default=[100_000])
    ap.add_argument("--kinds", nargs="+", default=["save", "manager", "restore", "restore-no-target"])
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--child", nargs=2)
    args = ap.parse_args()
    if args.child:
        folder = tempfile.mkdtemp(prefix="many_leaves-")
        try:
            print(json.dumps(measure(args.child[0], int(args.child[1]), folder, args.trace)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    for n in args.leaves:
        for kind in args.kinds:
            cmd = [sys.executable, __file__, "--child", kind, str(n)] + (["--trace"] if args.trace else [])
            r = json.loads(
                subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            m = r["manifest"] or 0
            print(
                f"{kind:18s} {n:>8d} leaves: {r['seconds']:7.2f} s ({r['seconds'] / n * 1e6:5.1f} us/leaf), "
                f"peak {r['peak'] / MiB:7.1f} MiB"
                + (f" = {r['peak'] / m:4.1f}x the manifest ({m / MiB:.1f} MiB)" if m else ""),
                flush=True,
            )
            for line in r.get("top", []):
                print("   ", line)


if __name__ == "__main__":
    main()
