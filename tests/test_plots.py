"""benchmarks/plots.py draws the documentation's charts and tables from benchmark reports.

Reports shaped as the benchmarks write them (only the fields the charts read) go into a temporary
bench_out/; the charts must come out as PNG images, the Performance table must hold every contender, a
chart is byte-identical when redrawn from the same report, and the Accelerators page's table is a note
saying it is to be measured until an accelerator report exists, then that report's rows.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest

pytest.importorskip("matplotlib")
ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"
MACHINE = {"date": "2026-01-02T03:04:05", "cpus": 2}


def _plots():
    spec = importlib.util.spec_from_file_location("plots", ROOT / "benchmarks" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reports(bench_out: pathlib.Path) -> None:
    bench_out.mkdir()
    medians = {
        "raw-file": {"save": 0.3, "restore_cold": 0.25, "restore_warm": 0.05},
        "flax_ckpt-raw": {"save": 0.16, "restore_cold": 0.2, "restore_warm": 0.11},
        "orbax": {"save": 0.74, "restore_cold": 0.78, "restore_warm": 0.56},
    }
    (bench_out / "save_restore-20260102-030405.json").write_text(
        json.dumps(
            {
                "machine": MACHINE,
                "args": {"size_mb": "128.0", "rounds": "2"},
                "leaves": 410,
                "nbytes": 128 << 20,
                "medians": medians,
            }
        )
    )

    def rounds(*overheads):  # one loop's per-round times, as bench_every_step.py reports them
        return [
            {e: {"wall": 0.1 * (1 + o), "cpu": 0.1 * (1 + o), "saves": 4} for e in ("1", "10")}
            for o in overheads
        ]

    rows = {
        "none": rounds(0, 0, 0),
        "floor": rounds(0.06, 0.07, 0.08),
        "memory": rounds(-0.52, 0.02, 0.1),  # on both sides of zero: noise, not a negative cost
        "orbax": rounds(1.9, 2.0, 2.2),
    }
    (bench_out / "every_step-20260102-030405.json").write_text(
        json.dumps(
            {
                "machine": MACHINE,
                "args": {"models": "mlp", "every": "1,10", "steps": 40, "rounds": 3},
                "rows": {"mlp": rows},
                "everies": [1, 10],
                "summary": {},
            }
        )
    )
    leaves = {
        str(n): {
            "n": n,
            "device_put_us": 40.0,
            "flax_ckpt_us": {
                "save": 60.0,
                "restore": 120.0,
                "manager_save_blocked": 9.0,
                "tier_save_blocked": 7.0,
            },
            "rounds_us": {"save": [55.0, 60.0, 70.0], "restore": [110.0, 120.0, 125.0]},
            **(
                {"orbax": {"save": {"us_per_leaf": 1300.0}, "restore": {"us_per_leaf": 900.0}}}
                if n == 1000
                else {}
            ),
        }
        for n in (1000, 5000)
    }
    (bench_out / "bench_scale-20260102-030405.json").write_text(
        json.dumps({"machine": MACHINE, "args": {"leaves": [1000, 5000], "rounds": 1}, "leaves": leaves})
    )


def test_charts_and_tables_from_reports(tmp_path):
    plots, bench_out, out = _plots(), tmp_path / "bench_out", tmp_path / "static"
    _reports(bench_out)
    written = plots.main(["--results", str(bench_out), "--out", str(out)])
    names = sorted(p.name for p in written)
    assert names == [
        "accelerator_table.md",
        "every_step.png",
        "figures.json",
        "per_leaf.png",
        "perf_table.md",
        "save_restore.png",
    ], names
    for name in ("every_step.png", "per_leaf.png", "save_restore.png"):
        assert (out / name).read_bytes().startswith(PNG), name
    table = (out / "perf_table.md").read_text()
    for label in ("raw file (floor)", "flax_ckpt", "Orbax", "0.74 s (4.6x)", "128 MiB", "410 leaves"):
        assert label in table, (label, table)
    assert "To be measured" in (out / "accelerator_table.md").read_text()
    first = (out / "save_restore.png").read_bytes()
    plots.main(["--results", str(bench_out), "--out", str(out)])
    assert (out / "save_restore.png").read_bytes() == first, "a redrawn chart differs: a timestamp in it?"


def test_accelerator_report_fills_the_table_and_its_chart(tmp_path):
    plots, bench_out, out = _plots(), tmp_path / "bench_out", tmp_path / "static"
    bench_out.mkdir()
    (bench_out / "accelerator-20260102-030405.json").write_text(
        json.dumps(
            {
                "machine": MACHINE,
                "device": "TPU v5 lite",
                "rows": [
                    {"contender": "on-device copy", "blocked_s": 0.006},
                    {"contender": "flax_ckpt async save", "blocked_s": 0.012, "durable_s": 2.0},
                ],
            }
        )
    )
    written = plots.main(["--results", str(bench_out), "--out", str(out)])
    assert sorted(p.name for p in written) == ["accelerator.png", "accelerator_table.md", "figures.json"]
    table = (out / "accelerator_table.md").read_text()
    assert "| flax_ckpt async save | 0.012 | 2 |" in table and "one TPU v5e chip" in table, table
    assert (out / "accelerator.png").read_bytes().startswith(PNG)


def test_bench_accelerators_own_report_gives_medians_in_ms(tmp_path):
    """bench_accelerator.py's report keeps seconds per round by contender: the table gives their
    medians in ms, what a save blocks apart from the synchronous calls' whole time."""
    plots, bench_out, out = _plots(), tmp_path / "bench_out", tmp_path / "static"
    bench_out.mkdir()
    (bench_out / "accelerator-20260102-030405.json").write_text(
        json.dumps(
            {
                "machine": dict(MACHINE, devices="1 x tpu TPU v5 lite"),
                "table": {
                    "device-copy": [0.005, 0.004, 0.006],
                    "fc-async": [0.002, 0.003, 0.001],
                    "fc-async:until_durable": [2.0, 3.0, 1.0],
                    "fc-save": [1.5, 1.4, 1.6],
                },
            }
        )
    )
    written = plots.main(["--results", str(bench_out), "--out", str(out)])
    assert sorted(p.name for p in written) == ["accelerator.png", "accelerator_table.md", "figures.json"]
    table = (out / "accelerator_table.md").read_text()
    assert "| flax_ckpt async save | 2 ms | - | 2 s |" in table, table
    assert "| flax_ckpt save | - | 1.5 s | - |" in table, table
    assert "one TPU v5e chip" in table and "1 x tpu" not in table and "fc-async" not in table, table


def test_charts_draw_every_round_and_no_negative_overhead(tmp_path):
    """The frequency chart labels an overhead whose rounds straddle zero as noise, never as a negative
    cost; every chart says what its bars are (medians of how many rounds), the run and the machine; the
    accelerator chart speaks users' words, not the benchmark's contender names."""
    plots, bench_out, out = _plots(), tmp_path / "bench_out", tmp_path / "static"
    _reports(bench_out)
    (bench_out / "accelerator-20260102-030405.json").write_text(
        json.dumps(
            {
                "machine": dict(MACHINE, devices="1 x tpu TPU v5 lite"),
                "args": {"parts": "table", "rounds": 3},
                "table": {"device-copy": [0.005, 0.004, 0.006], "fc-async": [0.002, 0.003, 0.001]},
            }
        )
    )
    plots.main(["--results", str(bench_out), "--out", str(out), "--svg"])
    svg = {p.stem: p.read_text() for p in out.glob("*.svg")}
    assert sorted(svg) == ["accelerator", "every_step", "per_leaf", "save_restore"], sorted(svg)
    every = svg["every_step"]
    assert "noise" in every and "+200%" in every and "+7%" in every, "medians and the noise label"
    assert not re.search(r">\s*-\d+%", every), "a negative overhead drawn as a result"
    for name, text in svg.items():
        assert re.search(r"medians of \d+ (short )?(interleaved )?rounds", text), name
        assert "dots: each round" in text and ("2 shared CPUs" in text or "TPU v5e" in text), name
    assert "flax_ckpt async save" in svg["accelerator"] and "one TPU v5e chip" in svg["accelerator"]
    assert "fc-async" not in svg["accelerator"] and "1 x tpu" not in svg["accelerator"]
    assert "blocked_ms" not in svg["accelerator"]


def test_the_committed_charts_are_the_ones_the_pages_show():
    static = ROOT / "docs" / "_static"
    for name in ("save_restore.png", "every_step.png", "per_leaf.png", "accelerator.png", "shared.png"):
        assert (static / name).read_bytes().startswith(PNG), name
        assert (static / name).stat().st_size < 200_000, f"{name}: keep committed charts small"
    assert "_static/save_restore.png" in (ROOT / "README.md").read_text()
    assert "_static/shared.png" in (ROOT / "docs" / "finetuning.md").read_text()


def test_a_fine_tune_report_gives_its_chart_and_figures(tmp_path):
    """bench_shared.py's report (issue 54): the fine-tuning guide's chart, and its figures by name."""
    plots, bench_out, out = _plots(), tmp_path / "bench_out", tmp_path / "static"
    bench_out.mkdir()
    body = {
        "machine": MACHINE,
        "args": {"frozen_mb": 32, "changing_mb": 0.75, "rounds": 3, "saves": 4},
        "durable_s": {"lora": 0.03, "full": 0.1},
        "lora_over_full": 0.3,
        "rounds_s": {"lora": [0.03, 0.031, 0.029], "full": [0.1, 0.11, 0.09]},
        "bytes": {"keep_None": 41_000_000, "keep_2": 36_000_000},
        "bytes_unshared": {"keep_None": 343_000_000, "keep_2": 68_600_000},
        "bytes_over_bound": {"keep_None": 1.001, "keep_2": 1.0},
        "state_bytes": 34_300_000,
        "changed_bytes": 786432,
    }
    (bench_out / "bench_shared-20260102-030405.json").write_text(json.dumps(body))
    plots.main(["--results", str(bench_out), "--out", str(out)])
    assert (out / "shared.png").read_bytes().startswith(PNG)
    summary = json.loads((out / "figures.json").read_text())
    assert summary["charts"]["shared.png"] == "bench_shared-20260102-030405"
    run = summary["runs"]["bench_shared-20260102-030405"]
    assert run["command"] == "bench_shared.py --frozen-mb 32 --rounds 3"
    assert run["figures"]["fine-tune: durable, frozen base / every byte changed (x)"] == 0.3
    assert run["figures"]["fine-tune, 10 saves, all kept: writing all / sharing (x)"] == round(343 / 41, 6)


def test_a_paired_report_is_compared_with_its_own_runs_without_saves():
    """A report of ``bench_every_step.py --pairs`` has no ``none``: each contender's rounds carry their
    own runs without saves (``alone``), and the overheads are taken against those."""
    plots = _plots()

    def row(alone, saving):
        return {
            "1": {"wall": saving, "cpu": 2 * saving, "alone": {"wall": alone, "cpu": 2 * alone}, "saves": 8}
        }

    body = {"everies": [1], "rows": {"mlp": {"memory": [row(0.10, 0.11), row(0.20, 0.24)]}}}
    got = plots.overheads(body)["mlp"]["1"]["memory"]
    assert got["wall"] == pytest.approx([0.10, 0.20]) and got["cpu"] == pytest.approx([0.10, 0.20]), got
