"""Old and new code side by side: any benchmark of this folder run alternately with the flax_ckpt
package of this checkout and with the one in ``--baseline`` (a folder holding an earlier package, e.g.
a ``git worktree`` of an earlier commit, or a commit, checked out for the run and removed after), its
JSON reports compared figure by figure (``ab``). ``renamed_copy`` puts a baseline's package beside
this one in one process (bench_every_step.py ``--side``).

    python benchmarks/ab.py --baseline main --rounds 3 -- bench_async.py --size-mb 64
    git worktree add --detach /tmp/flax_ckpt-base <commit>
    python benchmarks/ab.py --baseline /tmp/flax_ckpt-base --rounds 3 --keys 'per_leaf' -- \
        bench_scale.py --leaves 1000 --sizes-gb --peers

Each round runs the benchmark twice, new and base in an order that alternates by round, each in a
fresh process whose ``PYTHONPATH`` puts the chosen package first (the process is asked which package
it imported; a mismatch stops the run) and whose report goes to a folder of its own
(``FLAX_CKPT_BENCH_OUT``). Every number in the reports (a list of numbers counts as its median) is
compared: the median over rounds for base and new, and new / base. ``--keys`` keeps the figures whose
key path matches a regular expression. (bench_every_step.py's ``--side`` holds both codes in one
process.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BASE = "flax_ckpt_base"  # the name a baseline's package is imported under beside this one


def renamed_copy(baseline: str, dest: Path) -> Path:
    """A copy of ``baseline``/flax_ckpt as package ``BASE`` under ``dest`` (returned): every name
    ``flax_ckpt`` in its Python files becomes ``flax_ckpt_base`` (its imports are absolute), so that
    one process imports both packages. Its format names change with it: it reads only what it wrote."""
    src = Path(baseline) / "flax_ckpt"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--side: {src} holds no flax_ckpt package (pass --baseline DIR, DIR/flax_ckpt)")
    out = dest / BASE
    shutil.rmtree(out, ignore_errors=True)
    for f in src.rglob("*"):
        if "__pycache__" in f.parts or not f.is_file():
            continue
        to = out / f.relative_to(src)
        to.parent.mkdir(parents=True, exist_ok=True)
        if f.suffix == ".py":
            to.write_text(re.sub(r"\bflax_ckpt\b", BASE, f.read_text()))
        else:
            shutil.copyfile(f, to)
    return dest


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


def baseline_tree(baseline: str, keep: list[Path]) -> Path:
    """``baseline`` as a folder holding a flax_ckpt package: a folder as it is, else a commit of this
    repository checked out (``git worktree add --detach``) into a temporary folder added to ``keep``."""
    if Path(baseline).is_dir():
        return Path(baseline)
    tmp = Path(tempfile.mkdtemp(prefix="flax_ckpt-base-"))
    keep.append(tmp)
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tmp), baseline], check=True
    )
    print(f"baseline {baseline} checked out in {tmp}", file=sys.stderr, flush=True)
    return tmp


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
        script = Path(__file__).resolve().parent / bench[0]
        subprocess.run(
            [sys.executable, str(script), *bench[1:]], env=env, check=True, stdout=subprocess.DEVNULL
        )
        reports = sorted(Path(out).glob("*.json"))
        if not reports:
            raise SystemExit(f"{bench[0]} wrote no JSON report")
        return figures(json.loads(reports[-1].read_text()))


def ab(baseline: str, rounds: int, bench: list[str], keys: str | None = None) -> str:
    """``bench`` (a script of this folder and its arguments) run ``rounds`` times with this checkout's
    package and as often with ``baseline``'s (a folder or a commit), alternately, each in a fresh
    process reporting to a folder of its own; every figure of their JSON reports compared: the median
    over rounds of base and new, and new / base (markdown). ``keys``: a regex on the figures' key paths."""
    made: list[Path] = []
    try:
        sides = {"new": REPO, "base": baseline_tree(baseline, made)}
        for side, root in sides.items():
            check_package(side, root)
        runs: dict[str, list[dict[str, float]]] = {"new": [], "base": []}
        for r in range(rounds):
            for side in ("new", "base") if r % 2 == 0 else ("base", "new"):
                runs[side].append(run_once(sides[side], bench))
                print(f"round {r} {side} done", file=sys.stderr, flush=True)
    finally:
        for tmp in made:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tmp)], check=False)
    keep = re.compile(keys) if keys else None
    lines = [f"{' '.join(bench)}: medians of {rounds} rounds, new = this checkout, base = {baseline}\n"]
    lines.append("| figure | base | new | new / base |\n|---|---:|---:|---:|")
    for k in sorted(set().union(*runs["new"]) & set().union(*runs["base"])):
        if keep is None or keep.search(k):
            mb = statistics.median(x[k] for x in runs["base"] if k in x)
            mn = statistics.median(x[k] for x in runs["new"] if k in x)
            lines.append(f"| {k} | {mb:.6g} | {mn:.6g} | {f'{mn / mb:.2f}' if mb else '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--baseline", required=True, help="a folder holding the old flax_ckpt package, or a commit"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", default=None, help="keep the figures whose key path matches this regex")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- BENCHMARK.py [its arguments]")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("name a benchmark after --")
    print(ab(args.baseline, args.rounds, bench, args.keys))
