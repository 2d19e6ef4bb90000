"""The benchmarks' one runner: scenarios, interleaved rounds, statistics, reports, A/B and side by side.

A benchmark is a ``Scenario`` (asv's shape: ``setup``, one timed call per contender and round,
``teardown``; the contenders it compares and the floors it divides them by) run by ``run``: warm-up
rounds first (dropped), then ``rounds`` rounds, each running every contender once in an order rotated
by one a round, so that a burst of load from other users hits every side of a ratio. ``Results`` keeps
every round's seconds and gives medians, spread (the quartiles) and medians of per-round ratios;
``table`` writes them as markdown with the ratio to a named floor; ``cli`` gives the options every
benchmark shares, ``report`` the JSON (every round's seconds, the machine, the versions) and markdown
in bench_out/ (``FLAX_CKPT_BENCH_OUT`` moves it) that plots.py reads. Old and new code: ``ab``
(``python benchmarks/ab.py``) runs any benchmark alternately with two packages in fresh processes;
``renamed_copy`` puts a baseline's package beside this one in one process (bench_every_step.py
``--side``); ``python benchmarks/runner.py pool REPORT...`` pools the rounds of several reports. Also here: the test pytree, page-cache control, scratch folders (default
/tmp/flax_ckpt_bench, one subfolder per process, deleted when the benchmark ends).

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
import gc
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = Path(os.environ.get("FLAX_CKPT_BENCH_OUT", REPO / "bench_out"))  # ab.py gives each run its own
# per process, so that concurrent benchmark runs (and their clean-ups) never touch each other's files
SCRATCH = Path(os.environ.get("FLAX_CKPT_BENCH_DIR", "/tmp/flax_ckpt_bench")) / f"run-{os.getpid()}"
MB = 1 << 20


# ---------------------------------------------------------------------------------------- the pytree


def make_tree(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A model-like flat state of about ``total_bytes``: a few large float32/bfloat16 arrays (~88%) and
    many small ones (biases, norms, optimizer counters; ~12% in ~400 leaves), with random contents.

    Keys are '/'-separated paths; ``nest`` turns them into nested dicts.
    """
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    tree: dict[str, np.ndarray] = {}

    def add(name: str, nbytes: int, dtype: np.dtype, cols: int) -> None:
        n = max(cols, int(nbytes) // dtype.itemsize // cols * cols)
        if dtype == bf16:
            a = rng.standard_normal(n, dtype=np.float32).astype(bf16)
        elif dtype.kind == "f":
            a = rng.standard_normal(n, dtype=np.float32).astype(dtype, copy=False)
        else:
            a = rng.integers(0, 1 << 30, n, dtype=dtype)
        tree[name] = a.reshape(-1, cols) if cols > 1 else a

    f32 = np.dtype(np.float32)
    add("params/embed/embedding", 0.30 * total_bytes, f32, 1024)
    add("params/head/kernel", 0.18 * total_bytes, f32, 1024)
    add("opt/mu/embed/embedding", 0.15 * total_bytes, bf16, 1024)
    add("opt/nu/embed/embedding", 0.10 * total_bytes, bf16, 1024)
    for i in range(6):  # medium: per-layer MLP kernels
        add(f"params/layer_{i}/mlp/kernel", 0.025 * total_bytes, f32, 256)
    small_budget = 0.12 * total_bytes
    sizes = np.exp(rng.uniform(np.log(256), np.log(max(512, small_budget / 50)), 400))
    sizes *= small_budget / sizes.sum()
    for i, s in enumerate(sizes):
        kind = ("bias", "scale", "count")[i % 3]
        dt = np.dtype(np.int32) if kind == "count" and i % 9 == 2 else f32
        add(f"params/block_{i // 8}/{kind}_{i % 8}", s, dt, 1)
    return tree


def many_small_tree(n_leaves: int, leaf_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n_leaves`` float32 vectors of ``leaf_bytes`` each (a worst case for per-leaf overhead)."""
    rng = np.random.default_rng(seed)
    return {
        f"layers/{i // 16}/w_{i % 16}": rng.standard_normal(leaf_bytes // 4, dtype=np.float32)
        for i in range(n_leaves)
    }


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in flat.items():
        d = out
        *head, last = k.split("/")
        for h in head:
            d = d.setdefault(h, {})
        d[last] = v
    return out


def flat_items(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k in sorted(tree) for kv in flat_items(tree[k], f"{prefix}{k}/")]
    return [(prefix[:-1], tree)]


def tree_bytes(flat: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in flat.values())


def same_bytes(expected: dict[str, np.ndarray], got: dict[str, Any]) -> None:
    """Raises AssertionError unless ``got`` (flat, any array type) holds exactly the bytes of ``expected``."""
    assert set(expected) == set(got), (sorted(set(expected) ^ set(got)))[:5]
    for k, a in expected.items():
        b = np.asarray(got[k])
        assert b.shape == a.shape and b.dtype == a.dtype, (k, b.shape, b.dtype, a.shape, a.dtype)
        assert np.array_equal(b.reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8)), k


# -------------------------------------------------------------------------------- files and the cache


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [Path(d) / f for d, _, fs in os.walk(path) for f in fs]


def write_raw_file(path: Path, arrays: Any) -> None:
    """The raw baseline's write: every array's bytes appended to one file with ``ndarray.tofile``
    (through the page cache), then fsynced."""
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(path: Path) -> None:
    """fsync every file and folder under ``path`` (cheap where the writer already did)."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = [path.parent] + ([Path(d) for d, _, _ in os.walk(path)] if path.is_dir() else [])
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: Path) -> None:
    """Evicts the (clean, fsynced) pages of every file under ``path`` from the page cache:
    posix_fadvise(POSIX_FADV_DONTNEED), applied the same way to every contender's files."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove_scratch(path: Path) -> None:
    """Deletes a benchmark's scratch folder, and this process's SCRATCH folder once it is empty."""
    shutil.rmtree(path, ignore_errors=True)
    try:
        SCRATCH.rmdir()
    except OSError:
        pass


def disk_usage(path: Path) -> int:
    return sum(f.stat().st_size for f in files_under(path))


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


def table(res: Results, names: list[str], measures: list[str], vs: list[str] = ()) -> str:
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


# ------------------------------------------------------------------------------ old and new code


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


def jax_cpu_env() -> None:
    """Benchmarks run jax on the host CPU, one device, quietly."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def adam_training(model: Any, xs: Any, ys: Any, lr: float) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """(init, step) of a Flax Linen ``model`` trained with optax adam (learning rate ``lr``) on one batch
    ``xs`` of integer labels ``ys``: ``init()`` gives a fresh TrainState, ``step(state)`` the next one
    (jitted, the state donated, as a training loop runs it)."""
    import jax
    import optax
    from flax.training import train_state

    def init():
        params = jax.jit(model.init)(jax.random.key(0), xs)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr))

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), y).mean()

    def _step(state, x, y):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

    step = jax.jit(_step, donate_argnums=0)
    return init, lambda s: step(s, xs, ys)


def child(argv: list[str], timeout: float | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs ``python *argv`` (a benchmark's own measure in a fresh process) and returns the JSON object
    on the last line of its output that starts with "{"; raises with its stderr if it failed."""
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{p.stderr[-3000:]}")
    return json.loads(line)


class RssPeak:
    """Samples this process's resident memory (/proc/self/statm) on a thread every ``interval``
    seconds from its creation; ``stop()`` gives the peak minus the resident memory at the start."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.page = interval, os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self.rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())
        return self.peak - self.base


def status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, ...), 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_above(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds, peak RSS above the RSS before the call in bytes, result)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return seconds, max(0, status_kb("VmHWM") - before) * 1024, out


if __name__ == "__main__":
    main()
