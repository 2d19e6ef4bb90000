"""The documentation's performance charts, tables and figures, drawn from the benchmarks' reports.

    python benchmarks/plots.py [--results benchmarks/results] [--out docs/_static]
    python benchmarks/plots.py --bench-out bench_out --out /tmp/preview   # with runs not yet committed

Reads the benchmarks' JSON reports and draws them (matplotlib, the `plot` extra); it measures nothing
and imports nothing of flax_ckpt. Of each kind of report in benchmarks/results/ (and ``--bench-out``)
the newest is drawn; benchmarks/README.md ("Charts and figures") lists what it writes under ``--out``.
figures.json holds every figure of every run: a page section quoting a run names it in a comment,
``<!-- figures: <run> -->``, and tests/test_figures.py checks it. PNGs carry no timestamp, so a chart
redrawn from the same report is byte-identical.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner as C  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LABELS = {
    "raw-file": "raw file (floor)",
    "raw-files-8t": "raw files, 8 threads",
    "flax_ckpt-raw": "flax_ckpt",
    "flax_ckpt-zarr3": "flax_ckpt zarr3",
    "orbax": "Orbax",
    "torch-dcp": "torch DCP",
    "floor": "one host copy (floor)",
    "write-floor": "write + fsync (floor)",
    "memory": "flax_ckpt memory tier",
    "persistent": "flax_ckpt manager",
    "orbax-emergency": "Orbax emergency",
    # bench_accelerator.py's contenders
    "device-copy": "on-device copy (floor)",
    "device-get": "jax.device_get (floor)",
    "raw-write": "raw write, 8 threads (floor)",
    "raw-read": "raw read, 8 threads (floor)",
    "device-put": "jax.device_put (floor)",
    "fc-async": "flax_ckpt async save",
    "fc-memory": "flax_ckpt memory tier",
    "fc-save": "flax_ckpt save",
    "fc-save@window=0": "flax_ckpt save, every transfer at once",
    "fc-restore": "flax_ckpt restore",
    "orbax-async": "Orbax async save",
    "orbax-save": "Orbax save",
    "orbax-restore": "Orbax restore",
}
COLORS = {
    "raw-file": "#9e9e9e",
    "raw-files-8t": "#bdbdbd",
    "flax_ckpt-raw": "#1565c0",
    "flax_ckpt-zarr3": "#64b5f6",
    "orbax": "#ef6c00",
    "torch-dcp": "#6a1b9a",
    "floor": "#9e9e9e",
    "write-floor": "#757575",
    "memory": "#2e7d32",
    "persistent": "#1565c0",
    "orbax-emergency": "#ffb74d",
    "device-copy": "#9e9e9e",
    "device-get": "#757575",
    "fc-async": "#1565c0",
    "fc-memory": "#2e7d32",
    "orbax-async": "#ef6c00",
}
MODELS = {"mlp": "A small MLP", "transformer": "A small Transformer"}
DEVICES = {"TPU v5 lite": "one TPU v5e chip", "TPU v5e": "one TPU v5e chip"}
ACCELERATOR_PLACEHOLDER = (
    "<!-- accelerator_table.md: written by benchmarks/plots.py. No accelerator report yet:\n"
    "     run benchmarks/bench_accelerator.py on the accelerator, then python benchmarks/plots.py -->\n"
    "*To be measured:* the table of what a save blocks on an accelerator (flax_ckpt, Orbax and the\n"
    "floors: an on-device copy, `jax.device_get`) is drawn here from `bench_accelerator.py`'s report.\n"
)
FONT = 13  # points at 100 dpi: about 9 pixels high on a chart shown 500 pixels wide
SMALL = 11


# ------------------------------------------------------------------------------------------- reports


def kinds(body: dict[str, Any], name: str) -> list[str]:
    """What a report holds: "save_restore", "every_step", "bench_scale", "accelerator" (a table of
    what saves cost on a device), "accelerator_loop" (a training loop with saves on a device),
    "resume" (a restart's phases, bench_resume.py) and "shared" (a fine-tune's saves, bench_shared.py)."""
    found = [k for k in ("save_restore", "every_step", "bench_scale") if name.startswith(k)]
    if "resume" in name and isinstance(body.get("medians"), dict) and isinstance(body.get("runs"), dict):
        found.append("resume")
    if isinstance(body.get("table"), dict) and body["table"] or isinstance(body.get("rows"), list):
        found.append("accelerator")
    if isinstance(body.get("loop"), dict) and body["loop"]:
        found.append("accelerator_loop")
    if "lora_over_full" in body and isinstance(body.get("machine"), dict) and "bytes_unshared" in body:
        found.append("shared")
    return found


def reports(dirs: list[pathlib.Path]) -> dict[str, dict[str, Any]]:
    """Every JSON report in ``dirs`` by run name (the file's stem), the first folder's where a name is
    in several, oldest first (by the date the report records)."""
    found: dict[str, dict[str, Any]] = {}
    for folder in dirs:
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            body = json.loads(path.read_text())
            if not isinstance(body, dict) or path.stem in found or not kinds(body, path.name):
                continue
            body["_file"] = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
            body["_run"] = path.stem
            found[path.stem] = body
    return dict(sorted(found.items(), key=lambda kv: (_date(kv[1]), kv[0])))


def newest(runs: dict[str, dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The newest report of ``kind`` among ``runs``, or None."""
    matching = [body for body in runs.values() if kind in kinds(body, body["_run"] + ".json")]
    return matching[-1] if matching else None


def _date(body: dict[str, Any]) -> str:
    return str(body.get("machine", {}).get("date", "?"))


def machine(body: dict[str, Any]) -> str:
    """The machine a report was measured on, in words."""
    m = body.get("machine", {})
    device = body.get("device") or m.get("devices")
    if device:
        words = next((v for k, v in DEVICES.items() if k in str(device)), str(device))
        return f"{words}, {m.get('cpus', '?')} host CPUs"
    return f"{m.get('cpus', '?')} shared CPUs ({m.get('cpu_model', 'CPU')}), {m.get('memory_gb', '?')} GB"


def command(body: dict[str, Any]) -> str:
    """The command that measured a report (its arguments as the report records them)."""
    args, run = body.get("args", {}), body.get("_run", "")
    if run.startswith("save_restore"):
        return (
            f"bench_save_restore.py --size-mb {float(args.get('size_mb', 0)):g} --rounds "
            f"{args.get('rounds', '?')} --contenders {args.get('contenders', '?')}"
        )
    if run.startswith("every_step"):
        return (
            f"bench_every_step.py --models {args.get('models')} --every {args.get('every')} "
            f"--steps {args.get('steps')} --rounds {args.get('rounds')}"
        )
    if run.startswith("bench_scale"):
        leaves = " ".join(map(str, args.get("leaves", [])))
        return f"bench_scale.py --leaves {leaves} --rounds {args.get('rounds')}"
    if "lora_over_full" in body:
        return f"bench_shared.py --frozen-mb {args.get('frozen_mb')} --rounds {args.get('rounds')}"
    if "parts" in args:
        steps = f" --steps {args['steps']}" if args.get("steps") and "loop" in args["parts"] else ""
        rounds = args.get("rounds") if args["parts"] == "table" else args.get("loop_rounds")
        return f"bench_accelerator.py --parts {args['parts']} --rounds {rounds}{steps}"
    return body.get("command", "?")


_median = statistics.median


# ------------------------------------------------------------------------------------------- figures


def figures(body: dict[str, Any]) -> dict[str, float]:
    """Every figure a page may quote from one report: ``"<what> (<unit>)": value``, the unit ``s``
    (seconds), ``x`` (a ratio) or ``%`` (an overhead, in percent)."""
    out: dict[str, float] = {}
    for kind in kinds(body, body.get("_run", "") + ".json"):
        out.update(FIGURES[kind](body))
    return out


def _save_restore_figures(body: dict[str, Any]) -> dict[str, float]:
    out, medians = {}, body["medians"]
    ours = medians.get("flax_ckpt-raw", {})
    for name, times in medians.items():
        for m, label in MEASURES:
            if times.get(m) is None:
                continue
            out[f"{LABELS.get(name, name)}: {label} (s)"] = times[m]
            if name != "flax_ckpt-raw" and ours.get(m):
                out[f"{LABELS.get(name, name)} / flax_ckpt: {label} (x)"] = times[m] / ours[m]
    return out


def _every_step_figures(body: dict[str, Any]) -> dict[str, float]:
    out = {}
    for model, by_every in overheads(body).items():
        for every, by_name in by_every.items():
            for name, measures in by_name.items():
                for measure, values in measures.items():
                    out[f"{model}, every {every}: {LABELS.get(name, name)}, {measure} (%)"] = 100 * _median(
                        values
                    )
    return out


def _scale_figures(body: dict[str, Any]) -> dict[str, float]:
    out = {}
    for row in body["leaves"].values():
        n = row["n"]
        out[f"{n} leaves: jax.device_put per leaf (s)"] = row["device_put_us"] / 1e6
        for key, label, _ in SCALE_MEASURES:
            if row["flax_ckpt_us"].get(key) is not None:
                out[f"{n} leaves: {label} per leaf (s)"] = row["flax_ckpt_us"][key] / 1e6
        for key, measure in row.get("orbax", {}).items():
            out[f"{n} leaves: Orbax {key} per leaf (s)"] = measure["us_per_leaf"] / 1e6
            if measure.get("flax_ckpt_faster_x"):
                out[f"{n} leaves: Orbax / flax_ckpt {key} (x)"] = measure["flax_ckpt_faster_x"]
    return out


def _accelerator_figures(body: dict[str, Any]) -> dict[str, float]:
    out = {}
    for name, numbers in accelerator_rows(body):
        for key, value in numbers.items():
            out[f"{LABELS.get(name, name)} [{name}]: {key.removesuffix('_ms')} (s)"] = value / 1e3
    for key, value in body.get("ratios", {}).items():
        out[f"{key} (x)"] = value
    return out


def _loop_figures(body: dict[str, Any]) -> dict[str, float]:
    out = {}
    for setting, by in body["loop"].items():
        base = by.get("none", [])
        for name, runs in by.items():
            if not runs:
                continue
            label = f"{setting}: {LABELS.get(name, name)} [{name}]"
            out[f"{label}: step (s)"] = _median([r["step_s"] for r in runs])
            if name == "none" or not base:
                continue
            out[f"{label}: overhead (%)"] = 100 * (
                _median([r["step_s"] / b["step_s"] for b, r in zip(base, runs)]) - 1
            )
            steady = [
                r["steady_step_s"] / b["steady_step_s"]
                for b, r in zip(base, runs)
                if b.get("steady_step_s") and r.get("steady_step_s")
            ]
            if steady:
                out[f"{label}: overhead while training (%)"] = 100 * (_median(steady) - 1)
            out[f"{label}: blocked per save (s)"] = _median([r["blocked_s"] for r in runs])
    return out


def summary(runs: dict[str, dict[str, Any]], charts: dict[str, str]) -> dict[str, Any]:
    """figures.json: every run's machine, date, command and figures, and the run each chart shows."""
    return {
        "about": "Written by benchmarks/plots.py from the reports named by 'file'; do not edit by hand. "
        "Pages quote a run with <!-- figures: <run> -->; tests/test_figures.py checks them.",
        "charts": charts,
        "runs": {
            run: {
                "file": body["_file"],
                "date": _date(body)[:16].replace("T", " "),
                "machine": machine(body),
                "command": command(body),
                "figures": {k: round(v, 6) for k, v in figures(body).items()},
            }
            for run, body in runs.items()
        },
    }


# ---------------------------------------------------------------------------------------------- draw


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": FONT,
            "axes.titlesize": FONT + 1,
            "axes.labelsize": FONT,
            "xtick.labelsize": SMALL + 1,
            "ytick.labelsize": SMALL + 1,
            "legend.fontsize": SMALL + 1,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "svg.hashsalt": "flax_ckpt",
            "svg.fonttype": "none",  # text stays text in an SVG: searchable, and tests read it
            "figure.dpi": 100,
        }
    )
    return plt


def _save(fig: Any, out: pathlib.Path, name: str, svg: bool) -> list[pathlib.Path]:
    paths = [out / f"{name}.png"]
    fig.savefig(paths[0], metadata={"Software": None}, bbox_inches="tight")
    if svg:
        paths.append(out / f"{name}.svg")
        fig.savefig(paths[1], metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    fig.clf()
    return paths


def _source(fig: Any, body: dict[str, Any], y: float, note: str = "") -> None:
    """The command, date and machine under a chart, with the run's name to find it in figures.json."""
    text = f"{command(body)}\n{_date(body)[:10]}, {machine(body)}; run {body['_run']}{note}"
    fig.text(0.01, y, text, fontsize=SMALL - 1, color="#555555", va="top")


def _points(ax: Any, xs: list[float], rounds: list[list[float]], *, across: bool = False, **kw: Any) -> None:
    """Every round's value as a small dot beside its median: the spread a reader should see (``across``:
    on a horizontal bar, the values along x at height ``x``)."""
    for x, values in zip(xs, rounds):
        at = [x] * len(values)
        ax.plot(*((values, at) if across else (at, values)), ls="", marker="o", ms=4, color="black", **kw)


def _slots(i: int, n: int, groups: int) -> tuple[list[float], float]:
    """Where the i-th of n bars side by side stands in each of ``groups`` groups, and its width."""
    width = 0.8 / n
    return [j + (i - (n - 1) / 2) * width for j in range(groups)], width


# ------------------------------------------------------------------------------------ save / restore

MEASURES = [
    ("save", "save"),
    ("restore_cold", "restore, cold cache"),
    ("restore_warm", "restore, warm cache"),
]


def save_restore_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    plt = _pyplot()
    medians, seconds = body["medians"], body.get("seconds", {})
    names = list(medians)
    measures = [(m, label) for m, label in MEASURES if any(medians[n].get(m) for n in names)]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, name in enumerate(names):
        xs, width = _slots(i, len(names), len(measures))
        ys = [medians[name].get(m) or 0.0 for m, _ in measures]
        bars = ax.bar(xs, ys, width, label=LABELS.get(name, name), color=COLORS.get(name))
        ax.bar_label(bars, fmt="%.2f", fontsize=SMALL, padding=3)
        _points(ax, xs, [seconds.get(name, {}).get(m, []) for m, _ in measures], alpha=0.5)
    ax.set_xticks(range(len(measures)), [label for _, label in measures])
    ax.set_ylabel("seconds (lower is better)")
    mib = body.get("nbytes", 0) / 2**20
    size = f"{mib / 1024:.0f} GiB" if mib >= 1000 else f"{mib:.0f} MiB"
    ax.set_title(f"Save and restore of a {size} state ({body.get('leaves', '?')} leaves)")
    ax.legend(frameon=False)
    rounds = body.get("args", {}).get("rounds", "?")
    _source(fig, body, -0.02, f"\nbars: medians of {rounds} interleaved rounds; dots: each round")
    return _save(fig, out, "save_restore", svg)


def perf_table(body: dict[str, Any]) -> str:
    """The Performance page's table: median seconds per contender and measure, and flax_ckpt's ratio."""
    medians = body["medians"]
    ours = medians.get("flax_ckpt-raw", {})
    lines = [
        f"<!-- perf_table.md: written by benchmarks/plots.py from {body['_file']}; do not edit by hand -->",
        "| contender | " + " | ".join(label for _, label in MEASURES) + " |",
        "|---|" + "---:|" * len(MEASURES),
    ]
    for name, times in medians.items():
        cells = []
        for m, _ in MEASURES:
            t = times.get(m)
            cell = "-" if t is None else f"{t:.2f} s"
            if name != "flax_ckpt-raw" and t and ours.get(m):
                cell += f" ({t / ours[m]:.1f}x)"
            cells.append(cell)
        lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
    mib = body.get("nbytes", 0) / 2**20
    args = body.get("args", {})
    lines.append("")
    lines.append(
        f"A {mib:.0f} MiB state of {body.get('leaves', '?')} leaves, medians of "
        f"{args.get('rounds', '?')} interleaved rounds, {_date(body)[:10]}, {machine(body)}; "
        "in brackets, the time as a multiple of flax_ckpt's."
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------- checkpoint frequency


def overheads(body: dict[str, Any]) -> dict[str, dict[str, dict[str, dict[str, list[float]]]]]:
    """``{model: {every: {contender: {"wall": [...], "cpu": [...]}}}}``: each round's overhead against
    the loop without checkpoints of the same round (ratio − 1), or, in a report of ``--pairs``, against
    the same process's runs without saves; from the report's rounds; a report without them gives its
    medians as single values."""
    rows, out = body.get("rows"), {}
    if not rows:
        return {
            model: {
                e: {n: {k: [v[k]] for k in ("wall", "cpu")} for n, v in by.items()} for e, by in ev.items()
            }
            for model, ev in body["summary"].items()
        }
    for model, by in rows.items():
        base = by.get("none", [])
        for every in map(str, body.get("everies", [])):
            for name, runs in by.items():
                pairs = C.against(runs, base, every)
                if name == "none" or not pairs:
                    continue
                out.setdefault(model, {}).setdefault(every, {})[name] = {
                    k: [y[k] / x[k] - 1 for x, y in pairs] for k in ("wall", "cpu")
                }
    return out


def within_noise(values: list[float]) -> bool:
    """An overhead whose rounds do not all lie above zero, or whose median is not above zero."""
    return len(values) < 2 or min(values) <= 0 or _median(values) <= 0


def every_step_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    """One row per model; wall time and process CPU time side by side (on a shared machine the CPU
    time is the steadier of the two). Bars are medians; an overhead within noise of zero is drawn as
    a label, not a bar."""
    plt = _pyplot()
    data = overheads(body)
    models = list(data)
    fig, axes = plt.subplots(2 * len(models), 1, figsize=(8, 9 * len(models)), squeeze=False)
    for row, model in zip(axes.reshape(len(models), 2), models):
        everies = sorted(data[model], key=int)
        contenders = list(data[model][everies[0]])
        for ax, measure, what in zip(row, ("wall", "cpu"), ("wall time", "CPU time")):
            for i, name in enumerate(contenders):
                xs, width = _slots(i, len(contenders), len(everies))
                rounds = [[100 * v for v in data[model][e].get(name, {}).get(measure, [])] for e in everies]
                ys = [0.0 if within_noise(r) else _median(r) for r in rounds]  # noise: no bar
                bars = ax.bar(xs, ys, width, label=LABELS.get(name, name), color=COLORS.get(name))
                labels = ["noise" if within_noise(r) else f"+{_median(r):.0f}%" for r in rounds]
                ax.bar_label(bars, labels=labels, fontsize=SMALL - 1, padding=3, rotation=90)
                _points(ax, xs, rounds, alpha=0.45)
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set_xticks(range(len(everies)), [f"save every {e} step{'s' * (e != '1')}" for e in everies])
            ax.set_ylabel(f"extra {what} per step (%)")
            ax.set_title(f"{MODELS.get(model, model)}: {what}")
            ax.set_ylim(top=ax.get_ylim()[1] * 1.6)
    axes[0][0].legend(frameon=False, loc="upper left", ncol=2, fontsize=SMALL)
    rounds = body.get("args", {}).get("rounds", "?")
    fig.tight_layout()
    note = f"\nbars: medians of {rounds} interleaved rounds against the same loop without checkpoints; "
    note += "dots: each round;\n'noise': rounds on both sides of zero (no cost this run can tell apart)"
    _source(fig, body, 0.0, note)
    return _save(fig, out, "every_step", svg)


# -------------------------------------------------------------------------------------- cost per leaf

SCALE_MEASURES = [
    ("save", "fc.save", "#1565c0"),
    ("restore", "fc.restore into a target", "#6a1b9a"),
    ("manager_save_blocked", "async save, time it blocks", "#2e7d32"),
    ("tier_save_blocked", "memory tier, time it blocks", "#00897b"),
]


def per_leaf_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    plt = _pyplot()
    leaves = sorted(body["leaves"].values(), key=lambda r: r["n"])
    ns = [r["n"] for r in leaves]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for key, label, color in SCALE_MEASURES:
        ax.plot(ns, [r["flax_ckpt_us"].get(key) for r in leaves], marker="o", label=label, color=color)
        _points(ax, ns, [r.get("rounds_us", {}).get(key, []) for r in leaves], alpha=0.35)
    put = [r["device_put_us"] for r in leaves]
    ax.plot(ns, put, ls="--", color="#9e9e9e", label="one jax.device_put per leaf")
    for r in leaves:
        for key, marker in (("save", "s"), ("restore", "D")):
            if key in r.get("orbax", {}):
                y, orbax = r["orbax"][key]["us_per_leaf"], COLORS["orbax"]
                ax.plot([r["n"]], [y], marker=marker, ms=9, ls="", color=orbax, label=f"Orbax {key}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(ns, [f"{n:,}" for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("leaves in the state (1 KiB each)")
    ax.set_ylabel("microseconds per leaf")
    ax.set_title("What each leaf costs")
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * 30)  # room for the legend above the lines
    ax.legend(frameon=False, loc="upper left", ncol=2, fontsize=SMALL)
    rounds = body.get("args", {}).get("rounds", "?")
    dots = "dots: each round" if any(r.get("rounds_us") for r in leaves) else "(no per-round values kept)"
    note = f"\nlines: medians of {rounds} short interleaved rounds on a shared machine; {dots}"
    _source(fig, body, -0.04, note)
    return _save(fig, out, "per_leaf", svg)


# ---------------------------------------------------------------------------------------- accelerator


def accelerator_rows(body: dict[str, Any]) -> list[tuple[str, dict[str, float]]]:
    """``(contender, {measure: value})`` from an accelerator report. bench_accelerator.py's own report
    keeps each contender's seconds per round under "table" ({name: [s, ...]}, "name:until_durable"
    beside it): each becomes the median in ms, as "blocked_ms" for what returns before its write
    (the asynchronous saves and the two floors a save blocks on: an on-device copy, device_get) and
    "time_ms" for the rest, with "until_durable_ms" where recorded. A list of row dicts under "rows"
    (or "table"), each named by its first text field, is taken as it is."""
    rows = body.get("rows") or body.get("table") or []
    if isinstance(rows, dict):
        return _bench_rows(rows)
    out = []
    for row in rows if isinstance(rows, list) else []:
        name = next((v for v in row.values() if isinstance(v, str)), "?")
        numbers = {
            k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        out.append((name, numbers))
    return out


_BLOCKING = ("device-copy", "device-get", "fc-async", "fc-memory", "orbax-async")


def _bench_rows(table: dict[str, list[float]]) -> list[tuple[str, dict[str, float]]]:
    out = []
    for name, values in table.items():
        if ":" in name or not values:
            continue
        numbers = {("blocked_ms" if name in _BLOCKING else "time_ms"): 1e3 * _median(values)}
        durable = table.get(f"{name}:until_durable")
        if durable:
            numbers["until_durable_ms"] = 1e3 * _median(durable)
        out.append((name, numbers))
    return out


COLUMNS = {
    "blocked_ms": "training waits",
    "time_ms": "time",
    "until_durable_ms": "until durable",
}


def _ms(value: float) -> str:
    return f"{value:.3g} ms" if value < 1000 else f"{value / 1e3:.3g} s"


def accelerator_table(body: dict[str, Any] | None) -> str:
    if body is None or not accelerator_rows(body):
        return ACCELERATOR_PLACEHOLDER
    rows = accelerator_rows(body)
    measures = [m for m in COLUMNS if any(m in numbers for _, numbers in rows)]
    measures += sorted({k for _, numbers in rows for k in numbers} - set(measures))
    lines = [
        f"<!-- accelerator_table.md: written by benchmarks/plots.py from {body['_file']} -->",
        "| | " + " | ".join(COLUMNS.get(m, m) for m in measures) + " |",
        "|---|" + "---:|" * len(measures),
    ]
    for name, numbers in rows:
        cells = [
            _ms(numbers[m])
            if m.endswith("_ms") and m in numbers
            else f"{numbers.get(m, '-'):.3g}"
            if m in numbers
            else "-"
            for m in measures
        ]
        lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
    lines += ["", f"Medians of {command(body)}, {_date(body)[:10]}, {machine(body)}."]
    return "\n".join(lines) + "\n"


def accelerator_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    plt = _pyplot()
    rows = accelerator_rows(body)
    key = next((k for _, numbers in rows for k in numbers if "block" in k), None)
    if key is None:
        return []
    named = [(name, numbers[key]) for name, numbers in rows if key in numbers]
    table = body.get("table") if isinstance(body.get("table"), dict) else {}
    scale = 1e3 if key.endswith("_ms") else 1.0
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(named) + 1.6))
    labels = [LABELS.get(n, n) for n, _ in named]
    ax.barh(labels, [v for _, v in named], color=[COLORS.get(n, "#1565c0") for n, _ in named])
    for i, (name, value) in enumerate(named):
        values = [scale * v for v in table.get(name, [])]
        _points(ax, [i], [values], across=True, alpha=0.6)
        text = (f"{value:.2g}" if value < 10 else f"{value:.0f}") + (" ms" if scale == 1e3 else "")
        ax.text(max([value, *values]) * 1.25, i, text, va="center")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds the training loop waits (log scale, lower is better)")
    device = machine(body).split(",")[0]
    mib = body.get("state_mib")
    state = (
        f" ({mib / 1024:.0f} GiB state)" if mib and mib > 1000 else f" ({mib:.0f} MiB state)" if mib else ""
    )
    ax.set_title(f"What a save blocks on {device}{state}")
    ax.set_xlim(right=ax.get_xlim()[1] * 4)
    rounds = body.get("args", {}).get("rounds", "?")
    _source(fig, body, -0.02, f"\nbars: medians of {rounds} rounds; dots: each round")
    return _save(fig, out, "accelerator", svg)


RESUME_LABELS = {
    "fresh": "a fresh run (no checkpoint)",
    "fc": "flax_ckpt callback, made after the state",
    "fc-early": "flax_ckpt callback, made before the state",
    "fc-fn": "flax_ckpt callback, restore_or(the function that builds the state)",
    "fc-nocache": "flax_ckpt callback, compile_cache=False",
    "orbax": "Orbax CheckpointManager",
}
RESUME_PHASES = {
    "imports": "imports",
    "backend": "device runtime starts",
    "init": "state built",
    "restore": "checkpoint restored",
    "first_step": "first step (compile or load, run)",
}


def _resume_figures(body: dict[str, Any]) -> dict[str, float]:
    out, medians = {}, body["medians"]
    for mode, phases in medians.items():
        for phase, seconds in phases.items():
            out[f"restart, {RESUME_LABELS.get(mode, mode)}: {phase} (s)"] = seconds
        if mode != "fresh" and "fresh" in medians:
            first = phases["first_step"] / medians["fresh"]["first_step"]
            out[f"restart, {RESUME_LABELS.get(mode, mode)}: first step / a fresh run's (x)"] = first
            out[f"restart, {RESUME_LABELS.get(mode, mode)}: total / a fresh run's (x)"] = (
                phases["total"] / medians["fresh"]["total"]
            )
    return out


def resume_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    """A restart's phases: one bar per way of restarting, its phases stacked, each round's total a dot."""
    plt = _pyplot()
    medians = body["medians"]
    modes = [m for m in RESUME_LABELS if m in medians][::-1]
    fig, ax = plt.subplots(figsize=(10, 5.4))
    colors = ["#bbbbbb", "#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3"]
    phases = list(RESUME_PHASES)
    for i, phase in enumerate(phases):
        left = [sum(medians[m].get(p, 0.0) for p in phases[:i]) for m in modes]
        width = [medians[m].get(phase, 0.0) for m in modes]
        ax.barh(
            [RESUME_LABELS[m] for m in modes], width, left=left, color=colors[i], label=RESUME_PHASES[phase]
        )
    _points(ax, list(range(len(modes))), [[r["total"] for r in body["runs"][m]] for m in modes], across=True)
    n = body.get("rounds_run", body.get("rounds", 1))
    ax.set_xlabel("seconds from the process's start to the end of its first training step")
    ax.set_title(
        f"Restart after a preemption, {machine(body).split(',')[0]}, {body['state_mib'] / 1024:.1f} GiB state\n"
        f"bars: medians of {n} {'round' if n == 1 else 'rounds'} (each a fresh process); dots: each round"
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.35, -0.14), ncol=3, frameon=False)
    _source(fig, body, -0.12)
    return _save(fig, out, "resume", svg)


# ---------------------------------------------------------------------------------- shared steps

SHARED_LABELS = {"lora": "frozen base + what trains", "full": "every byte changed"}


def _shared_figures(body: dict[str, Any]) -> dict[str, float]:
    out = {f"fine-tune, {SHARED_LABELS[k]}: durable (s)": v for k, v in body["durable_s"].items()}
    out["fine-tune: durable, frozen base / every byte changed (x)"] = body["lora_over_full"]
    for keep, words in (("keep_None", "all kept"), ("keep_2", "max_to_keep=2")):
        out[f"fine-tune, 10 saves, {words}: on disk / one state + what changed (x)"] = body[
            "bytes_over_bound"
        ][keep]
        out[f"fine-tune, 10 saves, {words}: writing all / sharing (x)"] = (
            body["bytes_unshared"][keep] / body["bytes"][keep]
        )
    return out


def shared_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    """A fine-tune's saves: the bytes 10 saves leave on disk, sharing against every save writing the
    whole state, and the time until a save is durable, the frozen base's against a state changed whole."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    mib = 1 << 20
    keeps = [("keep_None", "all 10 kept"), ("keep_2", "max_to_keep=2")]
    ys = range(len(keeps))
    whole = [body["bytes_unshared"][k] / mib for k, _ in keeps]
    shared = [body["bytes"][k] / mib for k, _ in keeps]
    left.barh([y + 0.2 for y in ys], whole, height=0.4, color="#bdbdbd", label="every save writes all")
    left.barh([y - 0.2 for y in ys], shared, height=0.4, color=COLORS["persistent"], label="flax_ckpt")
    for y, (w, s_) in enumerate(zip(whole, shared)):
        left.text(w, y + 0.2, f" {w:.0f}", va="center", fontsize=SMALL)
        left.text(s_, y - 0.2, f" {s_:.0f}", va="center", fontsize=SMALL)
    left.set_yticks(list(ys), [w for _, w in keeps])
    left.set_xlabel("MiB on disk after 10 saves")
    left.legend(loc="upper right", frameon=False)
    names = ["full", "lora"]
    ms = [body["durable_s"][n] * 1e3 for n in names]
    right.barh(range(2), ms, color=["#bdbdbd", COLORS["persistent"]], height=0.5)
    for y, n in enumerate(names):
        _points(right, [y], [[v * 1e3 for v in body.get("rounds_s", {}).get(n, [])]], across=True)
        right.text(ms[y], y + 0.3, f" {ms[y]:.0f} ms", va="center", fontsize=SMALL)
    right.set_yticks(range(2), [SHARED_LABELS[n] for n in names])
    right.set_xlabel("ms from save() until durable")
    frozen = body["args"]["frozen_mb"]
    fig.suptitle(
        f"A fine-tune's saves: {frozen} MiB frozen + {body['changed_bytes'] / mib:.2f} MiB that trains "
        f"(durable in {body['lora_over_full']:.2f}x the time)",
        fontsize=FONT + 1,
    )
    fig.tight_layout()
    _source(fig, body, -0.02, "; bars: medians of rounds, dots: each round")
    return _save(fig, out, "shared", svg)


FIGURES = {
    "save_restore": _save_restore_figures,
    "every_step": _every_step_figures,
    "bench_scale": _scale_figures,
    "accelerator": _accelerator_figures,
    "accelerator_loop": _loop_figures,
    "resume": _resume_figures,
    "shared": _shared_figures,
}
CHARTS = [
    ("save_restore", "save_restore.png", save_restore_chart),
    ("every_step", "every_step.png", every_step_chart),
    ("bench_scale", "per_leaf.png", per_leaf_chart),
    ("accelerator", "accelerator.png", accelerator_chart),
    ("resume", "resume.png", resume_chart),
    ("shared", "shared.png", shared_chart),
]


def tables(runs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The generated pages' tables and figures.json, by file name, from the reports (no matplotlib)."""
    charts = {png: body["_run"] for kind, png, _ in CHARTS if (body := newest(runs, kind)) is not None}
    out = {
        "accelerator_table.md": accelerator_table(newest(runs, "accelerator")),
        "figures.json": json.dumps(summary(runs, charts), indent=1, sort_keys=False) + "\n",
    }
    sr = newest(runs, "save_restore")
    if sr is not None:
        out["perf_table.md"] = perf_table(sr)
    return out


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=pathlib.Path, default=RESULTS, help="the committed reports")
    ap.add_argument(
        "--bench-out", type=pathlib.Path, default=None, help="also these reports (bench_out/: a preview)"
    )
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "_static")
    ap.add_argument("--svg", action="store_true", help="also write each chart as SVG")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = reports([args.results, *([args.bench_out] if args.bench_out else [])])
    written: list[pathlib.Path] = []
    for kind, _, draw in CHARTS:
        body = newest(runs, kind)
        if body is None:
            print(f"no {kind} report in {args.results}: its chart is left as it is")
            continue
        written += draw(body, args.out, args.svg)
    for name, text in tables(runs).items():
        (args.out / name).write_text(text)
        written.append(args.out / name)
    for path in written:
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return written


if __name__ == "__main__":
    main()
