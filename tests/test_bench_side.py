"""``benchmarks/bench_every_step.py --side``: a contender of this code and of a baseline's code in one
process, in turns with runs without saves (how benchmarks/README.md compares the persistent manager
with an earlier commit on a machine whose XLA threads move from one process to the next). Run as a
user runs it: the baseline is this checkout's own package, imported under another name."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_every_step.py"


def _bench(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, FLAX_CKPT_BENCH_DIR=str(tmp_path / "scratch"), FLAX_CKPT_BENCH_OUT=str(tmp_path / "out")
    )
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "mlp", "--every", "1", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


def test_side_runs_both_codes_in_one_process_and_reports_their_difference(tmp_path):
    p = _bench(
        tmp_path,
        *("--steps", "2", "--pairs", "2", "--rounds", "1", "--ahead", "--contenders", "persistent"),
        *("--side", "--baseline", str(ROOT)),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (report,) = (tmp_path / "out").glob("every_step-*.json")
    rows = json.loads(report.read_text())["rows"]["mlp"]
    (new,), (base,) = rows["persistent"], rows["persistent@base"]
    assert new["package"] == str(ROOT / "flax_ckpt")
    # the baseline's package, renamed so that both import in one process, from a folder the run removed
    assert pathlib.Path(base["package"]).name == "flax_ckpt_base"
    assert not pathlib.Path(base["package"]).exists()
    for row in (new["1"], base["1"]):
        assert len(row["pairs"]) == 2 and row["saves"] == row["asked"] == 4
    # per round: (CPU saving with this code - with the baseline's) / CPU of the round's runs without saves
    want = [(a[3] - b[3]) / a[1] for a, b in zip(new["1"]["pairs"], base["1"]["pairs"])]
    assert new["1"]["side_diff"] == want
    assert "- persistent, every 1: " in p.stdout and "over 2 rounds in 1 processes" in p.stdout
    pooled = subprocess.run(
        [sys.executable, str(SCRIPT), "--pool", str(report)], capture_output=True, text=True, timeout=300
    )
    assert pooled.returncode == 0, pooled.stderr
    assert "--side, persistent minus its baseline in the same rounds:" in pooled.stdout
    assert not list((tmp_path / "scratch").glob("side-*"))


def test_side_refuses_what_it_cannot_compare(tmp_path):
    cases = [
        (
            ("--pairs", "2", "--baseline", str(ROOT), "--contenders", "orbax"),
            "--side runs memory and persistent",
        ),
        (
            ("--baseline", str(ROOT), "--contenders", "persistent"),
            "--side needs --pairs N and --baseline DIR",
        ),
        (("--pairs", "2", "--contenders", "persistent"), "--side needs --pairs N and --baseline DIR"),
        (
            ("--pairs", "2", "--baseline", str(tmp_path), "--contenders", "persistent"),
            "holds no flax_ckpt package",
        ),
    ]
    for args, message in cases:
        p = _bench(tmp_path, "--side", *args)
        assert p.returncode != 0 and message in p.stderr, (args, p.stderr[-1000:])
        assert not (tmp_path / "out").exists()  # nothing ran, no report
