"""The benchmarks' one runner: scenarios, interleaved rounds, statistics, reports, pooled reports.

A benchmark is a ``Scenario`` (asv's shape: ``setup``, one timed call per contender and round,
``teardown``; the contenders it compares and the floors it divides them by) run by ``run``: warm-up
rounds first (dropped), then ``rounds`` rounds, each running every contender once in an order rotated
by one a round, so that a burst of load from other users hits every side of a ratio. ``Results`` keeps
every round's seconds and gives medians, spread (the quartiles) and medians of per-round ratios;
``table`` writes them as markdown with the ratio to each named floor; ``cli`` gives the options every
benchmark shares, ``report`` the JSON (every round's seconds, the machine, the versions) and markdown
in bench_out/ (``FLAX_CKPT_BENCH_OUT`` moves it) that plots.py reads; ``child`` runs a measure in a
fresh process; ``python benchmarks/runner.py pool REPORT...`` pools the rounds of several reports.
Scratch folders: under /tmp/flax_ckpt_bench (``FLAX_CKPT_BENCH_DIR``), one per process, deleted when
the benchmark ends. What scenarios set up and measure with is in fixtures.py; old and new code (A/B
in fresh processes, a baseline's package beside this one) in ab.py.

    class Copy(runner.Scenario):                  # a scenario: what it sets up, times and compares
        name, contenders, floors = "copy", ["memcpy", "numpy-copy"], ["memcpy"]
        def setup(self): self.a, self.b = np.ones(1 << 20), np.empty(1 << 20)
        def time(self, name, r):
            t, _ = runner.timed(lambda: np.copyto(self.b, self.a) if name == "memcpy" else self.a.copy())
            return {"copy": t}
    res = runner.run(Copy(), rounds=5)
    print(runner.table(res, Copy.contenders, ["copy"], vs=Copy.floors))
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = Path(os.environ.get("FLAX_CKPT_BENCH_OUT", REPO / "bench_out"))  # ab.py gives each run its own
# per process, so that concurrent benchmark runs (and their clean-ups) never touch each other's files
SCRATCH = Path(os.environ.get("FLAX_CKPT_BENCH_DIR", "/tmp/flax_ckpt_bench")) / f"run-{os.getpid()}"
MB = 1 << 20


def remove_scratch(path: Path) -> None:
    """Deletes a benchmark's scratch folder, and this process's SCRATCH folder once it is empty."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        SCRATCH.rmdir()
    except OSError:
        pass


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


# ------------------------------------------------------------------------------------------- rounds


@dataclass
class Results:
    """Seconds per (contender, measure), one entry per round, in round order."""

    times: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # what a run on a budget did not start

    def add(self, contender: str, measure: str, seconds: float) -> None:
        self.times.setdefault(contender, {}).setdefault(measure, []).append(seconds)

    def median(self, contender: str, measure: str) -> float | None:
        v = self.times.get(contender, {}).get(measure)
        return statistics.median(v) if v else None

    def spread(self, contender: str, measure: str) -> tuple[float, float] | None:
        """The first and third quartiles over rounds (None below two rounds)."""
        v = self.times.get(contender, {}).get(measure)
        if not v or len(v) < 2:
            return None
        q = statistics.quantiles(v, n=4, method="inclusive")
        return q[0], q[2]

    def paired_ratio(self, a: str, b: str, measure: str) -> float | None:
        """Median over rounds of t_b / t_a (> 1: a is faster than b); pairs runs of the same round."""
        ta, tb = self.times.get(a, {}).get(measure), self.times.get(b, {}).get(measure)
        if not ta or not tb:
            return None
        return statistics.median(y / x for x, y in zip(ta, tb))


class Scenario:
    """What one benchmark compares. ``setup`` builds the state and the contenders (once, untimed);
    ``time(name, r)`` runs contender ``name`` once in round ``r`` and returns ``{measure: seconds}``
    (a round below 0 is a warm-up: its figures are dropped; round 0 is where a scenario checks the
    bytes it read back); ``teardown`` frees what setup made, also after an error. ``contenders``: the
    names compared, in round 0's order; ``floors``: those the others are divided by in the report (a
    memcpy, a plain write: what the hardware allows); ``warmup``: rounds run first and dropped."""

    name = "bench"
    contenders: list[str] = []
    floors: list[str] = []
    warmup = 0

    def setup(self) -> None:
        pass

    def time(self, name: str, r: int) -> dict[str, float]:
        raise NotImplementedError

    def teardown(self) -> None:
        pass


def run(
    sc: Scenario,
    rounds: int,
    log: Callable[[str], None] = print,
    res: Results | None = None,
    *,
    budget: Callable[[], bool] | None = None,
    errors: Callable[[str, Exception], None] | None = None,
) -> Results:
    """``sc.warmup`` rounds, then ``rounds`` interleaved rounds of ``sc`` (each contender once a round,
    the order rotated by one a round); every round's seconds are added to ``res`` (a new one if None).
    On a budget (an accelerator's session): a contender is started only while ``budget()`` is True,
    else logged as skipped; with ``errors``, a contender that raises is handed to it with where it
    failed ("round R NAME") and the rounds go on."""
    res = Results() if res is None else res
    sc.setup()
    try:
        for r in range(-sc.warmup, rounds):
            for name in rotated(list(sc.contenders), r):
                if budget is not None and not budget():
                    res.skipped.append(f"round {r} {name}: past the budget")
                    continue
                try:
                    got = sc.time(name, r)
                except Exception as e:
                    if errors is None:
                        raise
                    errors(f"round {r} {name}", e)
                    continue
                for m, s in got.items() if r >= 0 else ():
                    res.add(name, m, s)
                log(f"round {r} {name:18s} " + "  ".join(f"{m} {s:.4g}" for m, s in got.items()))
    finally:
        sc.teardown()
    return res


def table(res: Results, names: list[str], measures: list[str], vs: Sequence[str] = ()) -> str:
    """Markdown, a row per contender and measure: the median over rounds with its quartiles, and for
    each name of ``vs`` (a floor, a peer) the median of per-round ratios t / t_vs (< 1: faster)."""
    vs = [v for v in vs if v in res.times]
    lines = [
        "| contender | measure | median [quartiles] | " + " | ".join(f"/ {v}" for v in vs) + " |",
        "|---|---|---:|" + "---:|" * len(vs),
    ]
    for n in names:
        for m in measures:
            t, q = res.median(n, m), res.spread(n, m)
            if t is None:
                continue
            cell = f"{t:.4g} s" + (f" [{q[0]:.3g}, {q[1]:.3g}]" if q else "")
            ratios = [fmt(res.paired_ratio(v, n, m)) if v != n else "1" for v in vs]
            lines.append(f"| {n} | {m} | {cell} | " + " | ".join(ratios) + " |")
    return "\n".join(lines) + "\n"


SECONDS = ("seconds", "times", "values")  # where a report keeps its Results (benchmarks name it so)


def pooled(reports: list[dict[str, Any]]) -> Results:
    """The per-round seconds of several reports of one benchmark, each with the same contenders and
    measures, as one Results: their rounds one report after another (a ratio's pairs stay those of
    one round)."""
    res, first = Results(), None
    for doc in reports:
        key = next((k for k in SECONDS if isinstance(doc.get(k), dict)), None)
        if key is None:
            raise SystemExit(f"a report without per-round seconds (none of {', '.join(SECONDS)})")
        got = {(n, m): v for n, by in doc[key].items() for m, v in by.items() if isinstance(v, list)}
        if first is not None and set(got) != first:
            raise SystemExit("pool reports of the same contenders and measures (their rounds are paired)")
        first = set(got)
        for (name, m), values in got.items():
            for v in values:
                res.add(name, m, v)
    return res


def cli(doc: str | None, **defaults: Any) -> argparse.ArgumentParser:
    """The options benchmarks share, with their defaults: ``rounds``, ``size_mb``, ``contenders`` (a
    list: ``--contenders a,b``), ``scratch`` (a folder under SCRATCH); a benchmark adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if "rounds" in defaults:
        ap.add_argument("--rounds", type=int, default=defaults["rounds"], help="interleaved rounds")
    if "size_mb" in defaults:
        ap.add_argument("--size-mb", type=type(defaults["size_mb"]), default=defaults["size_mb"])
    if "contenders" in defaults:
        ap.add_argument("--contenders", default=",".join(defaults["contenders"]), help="comma-separated")
    if "scratch" in defaults:
        ap.add_argument("--scratch", type=Path, default=SCRATCH / defaults["scratch"])
    return ap


def against(runs: list[dict[str, Any]], none: list[dict[str, Any]], every: str) -> list[tuple[dict, dict]]:
    """bench_every_step.py's rounds of one contender at one interval, each with the run it is compared
    with: its own runs without saves (``--pairs``: the row's ``alone``), else ``none`` of the same round."""
    if any("alone" in r.get(every, {}) for r in runs):
        return [(r[every]["alone"], r[every]) for r in runs if every in r]
    return [(b[every], r[every]) for b, r in zip(none, runs) if every in b and every in r]


def rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names)
    return names[k:] + names[:k]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# ------------------------------------------------------------------------------------------ reports


def _sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def machine_info(scratch: Path) -> dict[str, Any]:
    import numpy

    info: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": _sh("lscpu | sed -n 's/^Model name: *//p'"),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "scratch": str(scratch),
        "filesystem": _sh(f"df -T {scratch.parent if not scratch.exists() else scratch} | tail -1"),
        "block_devices": _sh("lsblk -d -o NAME,SIZE,ROTA,TYPE | grep -v zram"),
    }
    for mod in ("jax", "orbax.checkpoint", "torch", "tensorstore", "crc32c"):
        try:
            m = __import__(mod, fromlist=["_"])
            info[mod] = getattr(m, "__version__", "?")
        except Exception:
            pass
    return info


def fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.2f}{unit}" if x < 100 else f"{x:.0f}{unit}"


def write_report(stem: str, body: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    OUT_DIR.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    js, md = OUT_DIR / f"{stem}-{stamp}.json", OUT_DIR / f"{stem}-{stamp}.md"
    js.write_text(json.dumps(body, indent=1, default=str))
    md.write_text(markdown)
    return js, md


def report(stem: str, args: argparse.Namespace, info: dict[str, Any], body: dict[str, Any], md: str) -> None:
    """Writes ``body`` (with the arguments and the machine, its load at the end) as JSON and ``md`` as
    markdown to OUT_DIR, and prints the markdown."""
    info["loadavg_end"] = os.getloadavg()
    body = {**body, "args": {k: str(v) for k, v in vars(args).items()}, "machine": info}
    js, mdp = write_report(stem, body, md)
    print("\n" + md)
    print(f"wrote {js} and {mdp}")


def main(argv: list[str] | None = None) -> None:
    """``python benchmarks/runner.py pool REPORT [REPORT ...] [--vs NAME ...]``: reports of one
    benchmark pooled (``pooled``) into one table, ratios to the contenders named by ``--vs``."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("command", choices=["pool"])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--vs", nargs="*", default=[], help="contenders the others are divided by")
    args = ap.parse_args(argv)
    res = pooled([json.loads(p.read_text()) for p in args.reports])
    measures = list(dict.fromkeys(m for by in res.times.values() for m in by))
    print(f"{len(args.reports)} reports pooled\n\n" + table(res, list(res.times), measures, vs=args.vs))


def child(argv: list[str], timeout: float | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs ``python *argv`` (a benchmark's own measure in a fresh process) and returns the JSON object
    on the last line of its output that starts with "{"; raises with its stderr if it failed."""
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{p.stderr[-3000:]}")
    return json.loads(line)


if __name__ == "__main__":
    main()
