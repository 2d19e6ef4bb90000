"""The documentation's performance charts and tables, drawn from the benchmarks' reports in bench_out/.

    python benchmarks/plots.py [--bench-out bench_out] [--out docs/_static] [--svg]

Scope: reading the newest JSON report of each benchmark and drawing it (matplotlib, the `plot` extra);
it measures nothing and imports nothing of flax_ckpt. A benchmark without a report is left out and
its chart is kept as it is. What it writes under ``--out``:

| file | from | shows |
|---|---|---|
| save_restore.png | save_restore-*.json (bench_save_restore.py) | save and restore seconds per contender |
| every_step.png | every_step-*.json (bench_every_step.py) | step-time overhead against the interval |
| per_leaf.png | bench_scale-*.json (bench_scale.py) | microseconds per leaf against the leaf count |
| accelerator.png | accelerator-*.json (bench_accelerator.py) | blocked time of a save per contender |
| perf_table.md | save_restore-*.json | the Performance page's current table |
| accelerator_table.md | accelerator-*.json, else a note: to be measured | the Accelerators page's table |

Each chart names the command that measured it, the date and the machine's CPU count. PNGs are written
without a timestamp, so a chart redrawn from the same report is byte-identical.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
LABELS = {
    "raw-file": "raw file (floor)",
    "raw-files-8t": "raw files, 8 threads",
    "flax_ckpt-raw": "flax_ckpt",
    "flax_ckpt-zarr3": "flax_ckpt zarr3",
    "orbax": "Orbax",
    "torch-dcp": "torch DCP",
    "floor": "memcpy floor",
    "write-floor": "write + fsync floor",
    "memory": "flax_ckpt memory tier",
    "persistent": "flax_ckpt manager",
    "orbax-emergency": "Orbax emergency",
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
}
ACCELERATOR_PLACEHOLDER = (
    "<!-- accelerator_table.md: written by benchmarks/plots.py. No accelerator report in bench_out/ yet:\n"
    "     run benchmarks/bench_accelerator.py on the accelerator, then python benchmarks/plots.py -->\n"
    "*To be measured:* the table of what a save blocks on an accelerator (flax_ckpt, Orbax and the\n"
    "floors: an on-device copy, `jax.device_get`) is drawn here from `bench_accelerator.py`'s report.\n"
)


def newest(bench_out: pathlib.Path, stem: str) -> dict[str, Any] | None:
    """The newest report ``<stem>-<time>.json`` in ``bench_out`` (names sort by time), or None."""
    found = sorted(bench_out.glob(f"{stem}-*.json"))
    if not found:
        return None
    body = json.loads(found[-1].read_text())
    body["_file"] = found[-1].name
    return body


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "svg.hashsalt": "flax_ckpt",
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


def _source(body: dict[str, Any], command: str) -> str:
    machine = body.get("machine", {})
    return f"{command}  ({machine.get('date', '?')[:10]}, {machine.get('cpus', '?')} CPUs)"


# ------------------------------------------------------------------------------------ save / restore

MEASURES = [
    ("save", "save"),
    ("restore_cold", "restore, cold cache"),
    ("restore_warm", "restore, warm cache"),
]


def save_restore_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    plt = _pyplot()
    medians = body["medians"]
    names = list(medians)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(MEASURES))]
        ys = [medians[name].get(m) or 0.0 for m, _ in MEASURES]
        bars = ax.bar(xs, ys, width, label=LABELS.get(name, name), color=COLORS.get(name))
        ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    ax.set_xticks(range(len(MEASURES)), [label for _, label in MEASURES])
    ax.set_ylabel("seconds (lower is better)")
    mib = body.get("nbytes", 0) / 2**20
    ax.set_title(f"Save and restore of a {mib:.0f} MiB state, {body.get('leaves', '?')} leaves", fontsize=11)
    args = body.get("args", {})
    command = (
        f"bench_save_restore.py --size-mb {float(args.get('size_mb', 0)):g} "
        f"--rounds {args.get('rounds', '?')}"
    )
    fig.text(0.01, -0.04, _source(body, command), fontsize=8, color="#555555")
    ax.legend(frameon=False, fontsize=9)
    return _save(fig, out, "save_restore", svg)


def perf_table(body: dict[str, Any]) -> str:
    """The Performance page's table: median seconds per contender and measure, and flax_ckpt's ratio."""
    medians = body["medians"]
    ours = medians.get("flax_ckpt-raw", {})
    lines = [
        "<!-- perf_table.md: written by benchmarks/plots.py from "
        f"bench_out/{body.get('_file', '?')}; do not edit by hand -->",
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
    date = body.get("machine", {}).get("date", "?")[:10]
    lines.append(
        f"A {mib:.0f} MiB state of {body.get('leaves', '?')} leaves, medians of "
        f"{args.get('rounds', '?')} interleaved rounds, {date}; "
        "in brackets, the time as a multiple of flax_ckpt's."
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------- checkpoint frequency


def every_step_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    """One row per model; wall time and process CPU time side by side (on a shared machine the CPU
    time is the steadier of the two)."""
    plt = _pyplot()
    summary = body["summary"]
    models = list(summary)
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.4 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        everies = sorted(summary[model], key=int)
        contenders = list(summary[model][everies[0]])
        for ax, measure, what in zip(row, ("wall", "cpu"), ("wall time", "process CPU time")):
            width = 0.8 / len(contenders)
            for i, name in enumerate(contenders):
                xs = [j + (i - (len(contenders) - 1) / 2) * width for j in range(len(everies))]
                ys = [100 * summary[model][e].get(name, {}).get(measure, 0.0) for e in everies]
                bars = ax.bar(xs, ys, width, label=LABELS.get(name, name), color=COLORS.get(name))
                ax.bar_label(bars, fmt="%+.0f%%", fontsize=7, padding=2)
            ax.axhline(0, color="black", linewidth=0.6)
            ax.set_xticks(range(len(everies)), [f"every {e} step{'s' * (e != '1')}" for e in everies])
            ax.set_ylabel(f"{what} vs no checkpoint (%)")
            ax.set_title(f"{model}: {what} per step", fontsize=11)
    axes[0][-1].legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    args = body.get("args", {})
    command = (
        f"bench_every_step.py --models {args.get('models')} --every {args.get('every')} "
        f"--steps {args.get('steps')} --rounds {args.get('rounds')}"
    )
    fig.text(0.01, -0.03, _source(body, command), fontsize=8, color="#555555")
    fig.tight_layout()
    return _save(fig, out, "every_step", svg)


# -------------------------------------------------------------------------------------- cost per leaf

SCALE_MEASURES = [
    ("save", "fc.save", "#1565c0"),
    ("restore", "fc.restore into a target", "#6a1b9a"),
    ("manager_save_blocked", "async save, blocked", "#2e7d32"),
    ("tier_save_blocked", "memory tier, blocked", "#00897b"),
]


def per_leaf_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    plt = _pyplot()
    leaves = sorted(body["leaves"].values(), key=lambda r: r["n"])
    ns = [r["n"] for r in leaves]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for key, label, color in SCALE_MEASURES:
        ax.plot(ns, [r["flax_ckpt_us"].get(key) for r in leaves], marker="o", label=label, color=color)
    ax.plot(
        ns,
        [r["device_put_us"] for r in leaves],
        linestyle="--",
        color="#9e9e9e",
        label="one jax.device_put per leaf",
    )
    for r in leaves:
        for key, marker in (("save", "s"), ("restore", "D")):
            if key in r.get("orbax", {}):
                ax.plot(
                    [r["n"]],
                    [r["orbax"][key]["us_per_leaf"]],
                    marker=marker,
                    linestyle="",
                    color=COLORS["orbax"],
                    label=f"Orbax {key}",
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(ns, [f"{n:,}" for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("leaves of 1 KiB")
    ax.set_ylabel("microseconds per leaf")
    ax.set_title("Cost per leaf", fontsize=11)
    ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    args = body.get("args", {})
    leaf_counts = " ".join(map(str, args.get("leaves", [])))
    command = f"bench_scale.py --leaves {leaf_counts} --rounds {args.get('rounds')}"
    fig.text(0.01, -0.06, _source(body, command), fontsize=8, color="#555555")
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
        numbers = {("blocked_ms" if name in _BLOCKING else "time_ms"): 1e3 * statistics.median(values)}
        durable = table.get(f"{name}:until_durable")
        if durable:
            numbers["until_durable_ms"] = 1e3 * statistics.median(durable)
        out.append((name, numbers))
    return out


def accelerator_table(body: dict[str, Any] | None) -> str:
    if body is None or not accelerator_rows(body):
        return ACCELERATOR_PLACEHOLDER
    rows = accelerator_rows(body)
    measures = sorted({k for _, numbers in rows for k in numbers})
    device = body.get("device") or body.get("machine", {}).get("devices", "the accelerator")
    lines = [
        f"<!-- accelerator_table.md: written by benchmarks/plots.py from bench_out/{body['_file']} -->",
        "| contender | " + " | ".join(measures) + " |",
        "|---|" + "---:|" * len(measures),
    ]
    for name, numbers in rows:
        lines.append(
            f"| {name} | " + " | ".join(f"{numbers[m]:.3g}" if m in numbers else "-" for m in measures) + " |"
        )
    lines += ["", f"Measured on {device} ({body.get('machine', {}).get('date', '?')[:10]})."]
    return "\n".join(lines) + "\n"


def accelerator_chart(body: dict[str, Any], out: pathlib.Path, svg: bool) -> list[pathlib.Path]:
    plt = _pyplot()
    rows = accelerator_rows(body)
    key = next((k for _, numbers in rows for k in numbers if "block" in k), None)
    if key is None:
        return []
    named = [(name, numbers[key]) for name, numbers in rows if key in numbers]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(named) + 1.2))
    bars = ax.barh([n for n, _ in named], [v for _, v in named], color="#1565c0")
    ax.bar_label(bars, fmt="%.3g", fontsize=8, padding=2)
    ax.invert_yaxis()
    ax.set_xlabel(f"{key} (lower is better)")
    device = body.get("device") or body.get("machine", {}).get("devices", "the accelerator")
    ax.set_title(f"What a save blocks on {device}", fontsize=11)
    return _save(fig, out, "accelerator", svg)


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> list[pathlib.Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench-out", type=pathlib.Path, default=REPO / "bench_out")
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "docs" / "_static")
    ap.add_argument("--svg", action="store_true", help="also write each chart as SVG")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[pathlib.Path] = []
    charts = [
        ("save_restore", save_restore_chart),
        ("every_step", every_step_chart),
        ("bench_scale", per_leaf_chart),
        ("accelerator", accelerator_chart),
    ]
    for stem, draw in charts:
        body = newest(args.bench_out, stem)
        if body is None:
            print(f"no {stem}-*.json in {args.bench_out}: its chart is left as it is")
            continue
        written += draw(body, args.out, args.svg)
    sr = newest(args.bench_out, "save_restore")
    if sr is not None:
        (args.out / "perf_table.md").write_text(perf_table(sr))
        written.append(args.out / "perf_table.md")
    (args.out / "accelerator_table.md").write_text(accelerator_table(newest(args.bench_out, "accelerator")))
    written.append(args.out / "accelerator_table.md")
    for path in written:
        print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return written


if __name__ == "__main__":
    main()
