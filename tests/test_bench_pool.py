"""``benchmarks/bench_every_step.py --pool``: the ``--pairs`` rows of reports already written, pooled into
one table (the figures benchmarks/README.md quotes from several runs). Run as a user runs it, on
reports shaped as the benchmark writes them; nothing is measured."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_every_step.py"


def _report(path: pathlib.Path, baseline: str, procs: dict[str, list[dict]]) -> pathlib.Path:
    path.write_text(json.dumps({"args": {"baseline": baseline}, "everies": [1], "rows": {"mlp": procs}}))
    return path


def _proc(pairs: list[list[float]], python_ms: float, xla_ms: float, saves: int, asked: int) -> dict:
    return {
        "state_mb": 39.2,
        "1": {
            "pairs": pairs,
            "python_per_save": python_ms / 1e3,
            "xla_change": xla_ms / 1e3,
            "saves": saves,
            "asked": asked,
        },
    }


def _pool(*reports: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--pool", *map(str, reports)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _row(out: str, label: str) -> list[str]:
    rows = [line for line in out.splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, out
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_pool_joins_every_pair_and_process_of_a_contender_across_reports(tmp_path):
    # [wall alone, CPU alone, wall saving, CPU saving]: CPU ratios 1.10, 1.20 (first report), 1.50
    a = _report(
        tmp_path / "a.json",
        "/base/one",
        {
            "persistent": [_proc([[1, 1.0, 1, 1.1], [1, 1.0, 1, 1.2]], 14.0, 2.0, 40, 40)],
            "persistent@base": [_proc([[1, 2.0, 1, 2.2]], 15.0, -1.0, 20, 20)],
        },
    )
    b = _report(
        tmp_path / "b.json",
        "/base/two",
        {
            "persistent": [_proc([[1, 2.0, 1, 3.0]], 16.0, 6.0, 19, 20)],
            "persistent@base": [_proc([[1, 1.0, 1, 1.0]], 12.0, 0.0, 20, 20)],
        },
    )
    done = _pool(a, b)
    assert done.returncode == 0, done.stderr
    # 2 processes, 3 pairs; median of 1.1, 1.2, 1.5; sums (1.1 + 1.2 + 3.0) / (1 + 1 + 2)
    assert _row(done.stdout, "persistent") == [
        "persistent",
        "2",
        "3",
        "+20.0%",
        "+32.5%",
        "15.0",
        "+4.0 (+4.0)",
        "59/60",
    ]
    # a contender at a baseline is pooled per baseline folder, never across two
    assert _row(done.stdout, "persistent@base (/base/one)")[1:5] == ["1", "1", "+10.0%", "+10.0%"]
    assert _row(done.stdout, "persistent@base (/base/two)")[1:5] == ["1", "1", "+0.0%", "+0.0%"]


def test_pool_of_reports_without_pairs_says_so(tmp_path):
    report = _report(
        tmp_path / "plain.json", None, {"memory": [{"1": {"wall": 0.1, "cpu": 0.2, "saves": 5}}]}
    )
    done = _pool(report)
    assert done.returncode != 0
    assert "--pool: none of these reports has a --pairs row" in done.stderr, done.stderr
