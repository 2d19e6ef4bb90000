"""Every performance figure a user reads comes from one benchmark run, and says which.

docs/_static/figures.json is written by benchmarks/plots.py from the reports committed under
benchmarks/results/: every run's figures, with its machine, date and command, and the run each chart
is drawn from. A page section that states figures names its run(s) in a comment the reader does not
see, ``<!-- figures: <run> [<run> ...] -->``, which holds until the next heading. On the pages below,
every figure (``2.3 ms``, ``0.86 s``, ``4.5x``, ``3 times``, ``+22.0%``) outside code must be under
such a comment and be one of its runs' figures as rounded on the page; a chart shown in a section must
be drawn from a run the section names; figures.json and the generated tables must be what plots.py
writes from the committed reports.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
STATIC = ROOT / "docs" / "_static"
PAGES = [
    ROOT / "README.md",
    *(ROOT / "docs" / n for n in ("index.md", "performance.md", "accelerators.md", "training-loop.md")),
]
MARK = re.compile(r"<!-- figures: ([^>]*?) -->")
FIGURE = re.compile(
    r"(?<![\w.+-])(?P<sign>[+-]?)(?P<num>\d+(?:\.\d+)?)"
    r"(?:\s?(?P<time>ms|µs|s)\b|(?P<x>x)\b|\s?(?P<pct>%)|\s(?P<times>times)\b)"
)
CODE = re.compile(r"^```.*?^```|`[^`\n]*`|<!--(?! figures:).*?-->", re.MULTILINE | re.DOTALL)
IMAGE = re.compile(r"!\[[^\]]*\]\((?:docs/)?_static/(\w+\.png)\)")
SCALE = {"s": 1.0, "ms": 1e3, "µs": 1e6}


def _plots():
    spec = importlib.util.spec_from_file_location("plots", ROOT / "benchmarks" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures() -> dict:
    return json.loads((STATIC / "figures.json").read_text())


def sections(text: str) -> list[tuple[str, str]]:
    """``(heading, body)`` of each section of a markdown page, its code and comments blanked (the
    figures comments kept)."""
    text = CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.MULTILINE)
    return [("(top)", parts[0])] + list(zip(parts[1::2], parts[2::2]))


def held(match: re.Match, figures: list[tuple[str, float]]) -> bool:
    """Whether one of ``figures`` rounds to the figure stated, in its unit."""
    stated = float(match["sign"] + match["num"])
    decimals = len(match["num"].partition(".")[2])
    if match["time"]:
        unit, scale = "(s)", SCALE[match["time"]]
    elif match["x"] or match["times"]:
        unit, scale = "(x)", 1.0
    else:
        unit, scale = "(%)", 1.0
    for name, value in figures:
        if not name.endswith(unit):
            continue
        value *= scale
        if unit == "(%)" and not match["sign"]:
            value = abs(value)
        if abs(value - stated) <= 0.5 * 10**-decimals + 1e-9:
            return True
    return False


def check_page(text: str, runs: dict, charts: dict[str, str]) -> list[str]:
    """Every problem of one page: a figure with no run named, a run figures.json lacks, a figure the
    runs named do not hold, a chart drawn from a run the section does not name."""
    problems = []
    for heading, body in sections(text):
        named: list[str] = []
        pieces = MARK.split(body)  # text, runs, text, runs, text ...
        for i, piece in enumerate(pieces):
            if i % 2:
                named = piece.split()
                problems += [f"{heading}: no run {r!r} in figures.json" for r in named if r not in runs]
                continue
            figures = [kv for r in named if r in runs for kv in runs[r]["figures"].items()]
            for m in FIGURE.finditer(piece):
                if not named:
                    problems.append(f"{heading}: {m.group(0)!r} names no run (<!-- figures: <run> -->)")
                elif not held(m, figures):
                    problems.append(f"{heading}: {m.group(0)!r} is not a figure of {' '.join(named)}")
        for png in IMAGE.findall(body):
            run = charts.get(png)
            runs_here = [r for p in MARK.findall(body) for r in p.split()]
            if run is not None and run not in runs_here:
                problems.append(
                    f"{heading}: the chart {png} is drawn from {run}, which the section does not name"
                )
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_figure_on_the_page_is_its_runs(page):
    summary = _figures()
    problems = check_page(page.read_text(), summary["runs"], summary["charts"])
    assert problems == [], "\n".join(problems)


def test_the_fine_tuning_guide_shows_the_saving_from_one_run():
    """Issue 54: the fine-tuning guide's "What a save costs" shows the bytes and the time of a fine-tune's
    saves as a chart, and every figure it states is that run's (the rest of the page quotes no run)."""
    text = (ROOT / "docs" / "finetuning.md").read_text()
    start = text.index("## What a save costs")
    section = text[start : text.index("\n## ", start)]
    summary = _figures()
    assert "_static/shared.png" in section and "shared.png" in summary["charts"]
    assert MARK.search(section) and FIGURE.search(CODE.sub("", section))
    problems = check_page(section, summary["runs"], summary["charts"])
    assert problems == [], "\n".join(problems)


def test_a_figure_the_run_does_not_hold_is_caught():
    """The check itself: the same measurement stated as two values, only one of them the run's."""
    runs = {"r": {"figures": {"Orbax async save: blocked (s)": 0.3239, "Orbax / flax_ckpt: save (x)": 2.156}}}
    good = "## A\n<!-- figures: r -->\nOrbax blocks 324 ms; we are 2.2x and about 2 times faster.\n"
    assert check_page(good, runs, {}) == []
    assert check_page(good.replace("324 ms", "347 ms"), runs, {}) == ["## A: '347 ms' is not a figure of r"]
    assert check_page("## A\nOrbax blocks 324 ms.\n", runs, {})[0].endswith(
        "names no run (<!-- figures: <run> -->)"
    )
    chart = "## B\n<!-- figures: r -->\n![x](_static/every_step.png)\n"
    assert check_page(chart, runs, {"every_step.png": "other"})[0].startswith(
        "## B: the chart every_step.png"
    )


def test_figures_json_and_tables_are_what_plots_writes_from_the_committed_reports():
    plots = _plots()
    written = plots.tables(plots.reports([plots.RESULTS]))
    for name, text in written.items():
        assert (STATIC / name).read_text() == text, (
            f"docs/_static/{name} is not what the reports in benchmarks/results/ give: "
            "run python benchmarks/plots.py and commit what it writes"
        )
    summary = json.loads(written["figures.json"])
    for run in summary["runs"].values():
        assert run["machine"] and run["date"] and run["command"], run
