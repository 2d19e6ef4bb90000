"""benchmarks/runner.py, the one runner every benchmark uses: interleaved rounds with warm-up, the
statistics and ratio tables, a benchmark run as a user runs it (its JSON report read by plots.py), and
``ab.py`` against a baseline commit.

The in-process tests time nothing: their scenarios report seconds computed from the contender and the
round, so that what the runner does with them (order, warm-up, medians, paired ratios) is exact."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look the module up
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


runner = _module("runner")


class Fixed(runner.Scenario):
    """Contender "fast" takes 1 s a round, "slow" 3 s (4 s in round 1); the calls are recorded."""

    contenders, floors, warmup = ["fast", "slow", "other"], ["fast"], 2

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[str, int]] = []
        self.events: list[str] = []
        self.fail_at = fail_at

    def setup(self):
        self.events.append("setup")

    def time(self, name, r):
        self.calls.append((name, r))
        if r == self.fail_at:
            raise RuntimeError("a contender failed")
        seconds = {"fast": 1.0, "slow": 4.0 if r == 1 else 3.0, "other": 2.0 + r}[name]
        return {"save": seconds} if name != "other" else {"save": seconds, "restore": 0.5}

    def teardown(self):
        self.events.append("teardown")


def test_rounds_rotate_the_order_drop_the_warm_up_and_pair_ratios_by_round():
    sc = Fixed()
    res = runner.run(sc, rounds=3, log=lambda _: None)
    # two warm-up rounds (-2, -1), then 0..2; each round every contender once, rotated by one a round
    assert [r for _, r in sc.calls] == [-2] * 3 + [-1] * 3 + [0] * 3 + [1] * 3 + [2] * 3
    assert [n for n, r in sc.calls if r == 0] == ["fast", "slow", "other"]
    assert [n for n, r in sc.calls if r == 1] == ["slow", "other", "fast"]
    assert [n for n, r in sc.calls if r == -1] == ["other", "fast", "slow"]
    assert res.times["slow"]["save"] == [3.0, 4.0, 3.0]  # warm-up rounds dropped
    assert res.times["other"] == {"save": [2.0, 3.0, 4.0], "restore": [0.5] * 3}
    assert res.median("slow", "save") == 3.0 and res.spread("other", "save") == (2.5, 3.5)
    assert res.paired_ratio("fast", "slow", "save") == 3.0  # median of t_slow / t_fast per round
    table = runner.table(res, sc.contenders, ["save", "restore"], vs=sc.floors)
    assert "| slow | save | 3 s [3, 3.5] | 3.00 |" in table
    assert "| other | restore | 0.5 s [0.5, 0.5] | - |" in table  # no restore of the floor: no ratio
    assert sc.events == ["setup", "teardown"]


def test_a_failing_contender_still_tears_down():
    sc = Fixed(fail_at=0)
    with pytest.raises(RuntimeError, match="a contender failed"):
        runner.run(sc, rounds=2, log=lambda _: None)
    assert sc.events == ["setup", "teardown"] and sc.calls[-1] == ("fast", 0)


def test_pool_pairs_each_reports_rounds_and_refuses_reports_that_differ(tmp_path, capsys):
    one = {"seconds": {"a": {"save": [1.0, 2.0]}, "b": {"save": [2.0, 8.0]}}}
    two = {"values": {"a": {"save": [4.0]}, "b": {"save": [4.0]}}}  # bench_async.py's key
    res = runner.pooled([one, two])
    assert res.times == {"a": {"save": [1.0, 2.0, 4.0]}, "b": {"save": [2.0, 8.0, 4.0]}}
    assert res.paired_ratio("a", "b", "save") == 2.0  # of 2, 4 and 1: each pair from one round
    paths = []
    for i, doc in enumerate((one, two)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(doc))
    runner.main(["pool", *map(str, paths), "--vs", "a"])
    assert "| b | save | 4 s [3, 6] | 2.00 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="same contenders and measures"):
        runner.pooled([one, {"seconds": {"a": {"save": [1.0]}}}])


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
    return dict(
        os.environ, FLAX_CKPT_BENCH_DIR=str(tmp_path / "scratch"), FLAX_CKPT_BENCH_OUT=str(tmp_path / "out")
    )


def test_a_benchmark_writes_every_round_and_the_charts_read_its_report(tmp_path):
    """bench_save_restore.py with a 1 MiB state, as a user runs it; plots.py draws the Performance
    page's table from the report it wrote."""
    p = subprocess.run(
        [sys.executable, str(BENCH / "bench_save_restore.py"), "--size-mb", "1", "--rounds", "2"]
        + ["--contenders", "raw-file,flax_ckpt-raw", "--no-warm"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(tmp_path),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (report,) = (tmp_path / "out").glob("save_restore-*.json")
    body = json.loads(report.read_text())
    for name in ("raw-file", "flax_ckpt-raw"):
        assert len(body["seconds"][name]["save"]) == len(body["seconds"][name]["restore_cold"]) == 2
    assert body["args"]["rounds"] == "2" and body["machine"]["cpus"] == os.cpu_count()
    assert "| flax_ckpt-raw | save |" in p.stdout and "/ raw-file" in p.stdout
    assert not any((tmp_path / "scratch").iterdir())  # the scratch folder is gone
    plots = _module("plots")
    runs = plots.reports([tmp_path / "out"])
    table = plots.perf_table(plots.newest(runs, "save_restore"))
    assert report.name in table and "flax_ckpt" in table


def test_ab_runs_a_benchmark_against_a_baseline_commit(tmp_path):
    """``ab.py --baseline HEAD``: the commit checked out into a worktree for the run and removed after,
    each side's report compared figure by figure."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    p = subprocess.run(
        [sys.executable, str(BENCH / "ab.py"), "--baseline", "HEAD", "--rounds", "1", "--keys", "durable"]
        + ["--", "bench_shared.py", "--frozen-mb", "4", "--rounds", "1", "--saves", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(tmp_path),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "round 0 new done" in p.stderr and "round 0 base done" in p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("| durable_s/")]
    assert {r.split(" | ")[0] for r in rows} == {"| durable_s/lora", "| durable_s/full"}
    for row in rows:
        base, new, ratio = (float(x) for x in row.strip("| ").split(" | ")[1:])
        assert base > 0 and new > 0 and ratio == pytest.approx(new / base, abs=0.006)
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("baseline HEAD checked out in ")]
    tree = line.rsplit(" ", 1)[1]
    listed = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True)
    assert not pathlib.Path(tree).exists() and tree not in listed.stdout  # removed after the run
