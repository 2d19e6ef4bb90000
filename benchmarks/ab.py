"""Old and new code side by side: any benchmark of this folder run alternately with the flax_ckpt
package of this checkout and with the one in ``--baseline`` (e.g. a ``git worktree`` of an earlier
commit), its JSON reports compared figure by figure.

    git worktree add --detach /tmp/flax_ckpt-base <commit>
    python benchmarks/ab.py --baseline /tmp/flax_ckpt-base --rounds 3 -- bench_async.py --size-mb 64
    python benchmarks/ab.py --baseline /tmp/flax_ckpt-base --rounds 3 --keys 'per_leaf' -- \
        bench_scale.py --leaves 1000 --sizes-gb --peers

Each round runs the benchmark twice, new and base in an order that alternates by round, each in a
fresh process whose ``PYTHONPATH`` puts the chosen package first (the process is asked which package
it imported; a mismatch stops the run) and whose report goes to a folder of its own
(``FLAX_CKPT_BENCH_OUT``). Every number in the reports (a list of numbers counts as its median) is
compared: the median over rounds for base and new, and new / base. ``--keys`` keeps the figures whose
key path matches a regular expression. (bench_every_step.py has its own ``--baseline``, which
interleaves inside one run.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def figures(doc: Any, path: str = "") -> dict[str, float]:
    """Every number of a JSON document by its key path (a list of numbers: its median)."""
    if isinstance(doc, bool):
        return {}
    if isinstance(doc, (int, float)):
        return {path: float(doc)}
    if (
        isinstance(doc, list)
        and doc
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in doc)
    ):
        return {path: float(statistics.median(doc))}
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    out: dict[str, float] = {}
    for k, v in items:
        out.update(figures(v, f"{path}/{k}" if path else str(k)))
    return out


def env_for(package_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_root), env.get("PYTHONPATH")]))
    return env


def check_package(side: str, root: Path) -> None:
    got = subprocess.run(
        [sys.executable, "-c", "import flax_ckpt, os; print(os.path.dirname(flax_ckpt.__file__))"],
        env=env_for(root),
        cwd=tempfile.gettempdir(),  # not this checkout: the current folder comes first on sys.path
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not got.startswith(str(root.resolve())):
        raise SystemExit(f"{side}: imported {got}, not the package under {root}")


def run_once(root: Path, bench: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="flax_ckpt-ab-") as out:
        env = dict(env_for(root), FLAX_CKPT_BENCH_OUT=out)
        subprocess.run(
            [sys.executable, str(HERE / bench[0]), *bench[1:]], env=env, check=True, stdout=subprocess.DEVNULL
        )
        reports = sorted(Path(out).glob("*.json"))
        if not reports:
            raise SystemExit(f"{bench[0]} wrote no JSON report")
        return figures(json.loads(reports[-1].read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, type=Path, help="a folder holding the old flax_ckpt package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", default=None, help="keep the figures whose key path matches this regex")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- BENCHMARK.py [its arguments]")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("name a benchmark after --")
    sides = {"new": REPO, "base": args.baseline}
    for side, root in sides.items():
        check_package(side, root)
    runs: dict[str, list[dict[str, float]]] = {"new": [], "base": []}
    for r in range(args.rounds):
        for side in ("new", "base") if r % 2 == 0 else ("base", "new"):
            runs[side].append(run_once(sides[side], bench))
            print(f"round {r} {side} done", file=sys.stderr, flush=True)
    keep = re.compile(args.keys) if args.keys else None
    keys = sorted(set().union(*runs["new"]) & set().union(*runs["base"]))
    print(
        f"{' '.join(bench)}: medians of {args.rounds} rounds, new = this checkout, base = {args.baseline}\n"
    )
    print("| figure | base | new | new / base |\n|---|---:|---:|---:|")
    for k in keys:
        if keep is not None and not keep.search(k):
            continue
        b = [x[k] for x in runs["base"] if k in x]
        n = [x[k] for x in runs["new"] if k in x]
        mb, mn = statistics.median(b), statistics.median(n)
        ratio = f"{mn / mb:.2f}" if mb else "-"
        print(f"| {k} | {mb:.6g} | {mn:.6g} | {ratio} |")


if __name__ == "__main__":
    main()
