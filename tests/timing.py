"""Where the suite's time goes: per test file, its wall time, the CPU time of the test process and the CPU
time of the processes it started (``resource.getrusage(RUSAGE_CHILDREN)``: children that were waited
for, with their own children), printed at the end of the run as a table, the costliest files first.

Loaded as a pytest plugin by conftest.py. Each test's figures travel to the xdist controller in its
teardown report's ``user_properties`` (so the table covers every worker). CPU time, not wall time, is
the figure to compare between runs on a shared machine: other work stretches wall time, not CPU time.

The files run longest first (``pytest_collection_modifyitems``): with one file to a worker (``--dist
loadfile``), a long file started last holds the whole run while the other worker idles. The order comes
from the wall times of the last run of each file here (pytest's cache), else from ``LONG_FILES`` (measured on a
2-core machine; a file missing from both runs after them, in its usual order).

``FLAX_CKPT_TEST_PROCS=1`` also counts the Python processes each file starts and how many of them
imported JAX, with their CPU time: the test process puts tests/_procs (a ``sitecustomize`` that reports
at exit) first on the PYTHONPATH its children inherit. Off by default: it changes the children's
environment, which a few tests examine. ``FLAX_CKPT_TEST_TIMING=0`` turns the table off.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

_KEY = "flax_ckpt_timing"
_PROCS_DIR = Path(__file__).parent / "_procs"
_LOG_VAR = "FLAX_CKPT_TEST_PROCS_LOG"


# Wall seconds per file (2 workers on a busy 2-core machine): the order in which files start where this
# checkout has no run of its own in pytest's cache yet.
LONG_FILES = {
    "tests/test_examples.py": 310,
    "tests/test_multihost.py": 231,
    "tests/test_compile_cache.py": 145,
    "tests/test_in_place_and_grain.py": 140,
    "tests/test_absl.py": 111,
    "tests/test_real_runs.py": 111,
    "tests/test_reliability_crash.py": 110,
    "tests/test_lint.py": 104,
    "tests/test_bench_side.py": 101,
    "tests/test_demo_log.py": 93,
    "tests/test_read_only.py": 81,
    "tests/test_shared_steps_object_stores.py": 79,
    "tests/test_tiers.py": 72,
    "tests/test_crash.py": 61,
    "tests/test_cli.py": 60,
    "tests/test_distributed.py": 58,
    "tests/test_cli_docs.py": 57,
    "tests/test_reader_attacks.py": 52,
    "tests/test_many_processes.py": 52,
    "tests/test_cli_live.py": 52,
    "tests/test_run_ahead.py": 51,
}
_CACHE_KEY = "flax_ckpt/file_wall_s"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    cache = getattr(config, "cache", None)
    measured = {**LONG_FILES, **((cache.get(_CACHE_KEY, None) if cache is not None else None) or {})}
    items.sort(key=lambda item: -measured.get(item.nodeid.split("::")[0], 0.0))  # stable: a file's order kept


def _enabled() -> bool:
    return os.environ.get("FLAX_CKPT_TEST_TIMING", "1") != "0"


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    cpu = r.ru_utime + r.ru_stime
    if who == resource.RUSAGE_CHILDREN and "forkserver" in sys.modules:
        cpu += sys.modules["forkserver"].CPU[0]  # the children forked for this process by its fork server
    return cpu


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_rows_key] = []
    if os.environ.get("FLAX_CKPT_TEST_PROCS") == "1" and _LOG_VAR not in os.environ:
        # The controller (or a run without xdist) chooses the log; xdist workers inherit the variables.
        fd, log = tempfile.mkstemp(prefix="flax_ckpt_procs_", suffix=".jsonl")
        os.close(fd)
        os.environ[_LOG_VAR] = log
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(_PROCS_DIR), os.environ.get("PYTHONPATH")])
        )
        config.stash[_log_key] = log


_rows_key = pytest.StashKey[list]()
_log_key = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    if not _enabled():
        yield
        return
    item.stash[_start_key] = (time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))
    yield


_start_key = pytest.StashKey[tuple]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    start = item.stash.get(_start_key, None)
    if report.when == "teardown" and start is not None:
        wall, cpu, children = start
        report.user_properties.append(
            (
                _KEY,
                {
                    "wall": time.perf_counter() - wall,
                    "cpu": _cpu(resource.RUSAGE_SELF) - cpu,
                    "children": _cpu(resource.RUSAGE_CHILDREN) - children,
                },
            )
        )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for key, value in getattr(report, "user_properties", ()):
        if key == _KEY:
            _ROWS.append((report.nodeid, value))


_ROWS: list[tuple[str, dict]] = []


def _procs(log: str | None) -> dict[str, dict[str, float]]:
    """Per file: Python processes started, those that imported JAX, and their CPU seconds."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"procs": 0, "jax": 0, "jax_cpu": 0.0})
    if not log or not os.path.exists(log):
        return out
    for line in Path(log).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        f = out[rec["test"].split("::")[0]]
        f["procs"] += 1
        if rec["jax"]:
            f["jax"] += 1
            f["jax_cpu"] += rec["cpu"]
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if not _enabled() or not _ROWS:
        return
    files: dict[str, dict[str, float]] = defaultdict(
        lambda: {"tests": 0, "wall": 0.0, "cpu": 0.0, "children": 0.0}
    )
    for nodeid, v in _ROWS:
        f = files[nodeid.split("::")[0]]
        f["tests"] += 1
        for k in ("wall", "cpu", "children"):
            f[k] += v[k]
    log = config.stash.get(_log_key, None)
    procs = _procs(log)
    w = terminalreporter.write_line
    terminalreporter.section("time per test file (CPU s: this process, and the processes it started)")
    head = f"{'wall s':>8} {'cpu s':>8} {'child s':>8} {'tests':>5}"
    if log:
        head += f" {'procs':>5} {'jax':>4} {'jax s':>7}"
    w(head + "  file")
    total = defaultdict(float)
    for name, f in sorted(files.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["children"])):
        line = f"{f['wall']:8.1f} {f['cpu']:8.1f} {f['children']:8.1f} {f['tests']:5d}"
        if log:
            p = procs[name]
            line += f" {p['procs']:5d} {p['jax']:4d} {p['jax_cpu']:7.1f}"
            for k in ("procs", "jax", "jax_cpu"):
                total[k] += p[k]
        w(f"{line}  {name}")
        for k in ("wall", "cpu", "children", "tests"):
            total[k] += f[k]
    line = f"{total['wall']:8.1f} {total['cpu']:8.1f} {total['children']:8.1f} {int(total['tests']):5d}"
    if log:
        line += f" {int(total['procs']):5d} {int(total['jax']):4d} {total['jax_cpu']:7.1f}"
    w(f"{line}  all ({len(files)} files)")
    if log:
        os.unlink(log)
    cache = getattr(config, "cache", None)
    if cache is not None and not config.option.keyword:  # not from a run of some of a file's tests
        stored = cache.get(_CACHE_KEY, None) or {}
        cache.set(_CACHE_KEY, {**stored, **{name: round(f["wall"], 1) for name, f in files.items()}})
