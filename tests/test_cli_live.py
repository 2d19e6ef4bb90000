"""``flax-ckpt verify``, ``ls`` and ``info`` beside a live run (issue 43, items 1 and 9): a step that a
manager's retention deletes while they read it is gone, never damaged; the listing shows steps, with
saves in flight and deletions in one line; an empty run says so in one message whatever its format.

The stress test runs a real manager in a child process saving every step with ``max_to_keep=2``
(native and Orbax layouts) while this process verifies, lists and reads the run in a loop.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src import tools as fi
from flax_ckpt._src.errors import CheckpointNotFoundError
from flax_ckpt._src.tools.cli import main as cli
from flax_ckpt._src.tools.common import read_info

WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    import flax_ckpt as fc
    directory, fmt, stop = sys.argv[1:4]
    tree = {f"l{i}": np.full((64,), float(i), np.float32) for i in range(40)}
    with fc.CheckpointManager(directory, max_to_keep=2, format=fmt) as mgr:
        step = 0
        while not os.path.exists(stop):
            step += 1
            mgr.save(step, dict(tree, step=step))
""")


def _false_reports(d: str) -> tuple[list, int]:
    """One round of verify, ls and info of every listed step: what they wrongly call damaged, and
    how many steps verify found deleted under it."""
    wrong = []
    try:
        r = fi.check(d)
        wrong += [("verify", p) for p in r.problems]
        gone = len(r.gone)
    except Exception as e:  # noqa: BLE001 - any error is a false report: the run is healthy
        wrong.append(("verify", repr(e)))
        gone = 0
    try:
        for e in fi.list_steps(d):
            if e.state in ("invalid", "uncommitted"):
                wrong.append(("ls", e))
            elif e.committed:
                try:
                    read_info(os.path.join(d, e.name))
                except CheckpointNotFoundError:
                    pass  # deleted since it was listed: gone, and said so
                except Exception as x:  # noqa: BLE001
                    wrong.append(("info", repr(x)))
    except Exception as e:  # noqa: BLE001
        wrong.append(("ls", repr(e)))
    return wrong, gone


@pytest.mark.parametrize("fmt", ["native", "orbax"])
def test_verify_ls_and_info_beside_a_live_run_never_report_damage(tmp_path, fmt):
    """verify, ls and info beside a run that saves every step never report damage (a step deleted while
    read is gone, not damaged). Slow (tens of seconds): a real writer process, at least 50 rounds of the
    checks beside it, and the CLI as processes."""
    d, stop = str(tmp_path / "run"), str(tmp_path / "stop")
    writer = forkserver.Popen([sys.executable, "-c", WRITER, d, fmt, stop])
    try:
        deadline = time.monotonic() + 120
        while not (os.path.isdir(d) and any(e.committed for e in fi.list_steps(d))):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer did not start"
            time.sleep(0.05)
        wrong, gone, rounds, start = [], 0, 0, time.monotonic()
        while (gone < 3 or rounds < 50) and time.monotonic() - start < 240:  # progress, or a stuck writer
            found, g = _false_reports(d)
            wrong, gone, rounds = wrong + found, gone + g, rounds + 1
        cmd = subprocess.run(
            [sys.executable, "-m", "flax_ckpt", "verify", d, "--json", "-q"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        open(stop, "w").close()
        writer.wait(timeout=120)
    assert writer.returncode == 0
    assert not wrong, (len(wrong), rounds, wrong[:3])
    assert gone >= 1, f"no step was deleted under verify in {rounds} rounds (240 s): the test saw no race"
    assert cmd.returncode == 0 and json.loads(cmd.stdout)["ok"], (cmd.stdout, cmd.stderr)
    assert fi.check(d).problems == []  # still good once the writer stopped


def test_a_step_deleted_while_verify_reads_it_is_gone_not_damaged(tmp_path, capsys, monkeypatch):
    """The deletion is a real manager's retention, run from verify's progress bar once it has read
    the first of step 1's two leaves: the second is then missing."""
    d = tmp_path / "run"
    with fc.CheckpointManager(d, async_save=False) as mgr:
        for s in (1, 2):
            mgr.save(s, {"a": np.full((1000,), float(s), np.float32), "b": np.ones(1000, np.float32)})
    deleted = []

    class Bar:  # verify's tqdm bar: its first update deletes step 1 through retention
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def update(self, n):
            if not deleted:  # step 1's first leaf is read
                with fc.CheckpointManager(d, max_to_keep=1, async_save=False) as m:
                    m.save(3, {"w": np.zeros(1000, np.float32)})
                deleted.append(sorted(os.listdir(d)))

    monkeypatch.setattr(importlib.import_module("flax_ckpt._src.tools.verify"), "bar", lambda *a, **k: Bar())
    rc = cli([str(x) for x in ("verify", d, "--json", "-q")])
    doc = json.loads(capsys.readouterr().out)
    assert deleted and "1" not in deleted[0] and "2" not in deleted[0]
    assert rc == 0 and doc["ok"] and doc["gone"] == [1, 2] and doc["problems"] == [] and doc["steps"] == [], (
        doc
    )


def test_ls_lists_steps_and_sums_up_leftovers_in_one_line(tmp_path, capsys):
    d = tmp_path / "run"
    for s in (1, 2):
        fc.save(d / str(s), {"w": np.ones(3)}, step=s)
    (d / f"3.tmp-{'ab' * 16}").mkdir()
    (d / f"3.tmp-{'ab' * 16}" / "part").write_bytes(b"x" * 10)
    (d / f"25.deleting-{'cd' * 16}").mkdir()
    assert cli(["ls", str(d)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[1:-1]] == ["1", "2"]
    assert lines[-1] == (
        f"leftovers: 1 save in flight, 1 deletion in progress (or interrupted: the next manager to open "
        f"the directory removes them), 10 B: 3.tmp-{'ab' * 16}, 25.deleting-{'cd' * 16}"
    )
    assert cli(["ls", str(d), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in doc["steps"]] == ["1", "2"]
    assert [(x["name"], x["state"]) for x in doc["leftovers"]] == [
        (f"3.tmp-{'ab' * 16}", "in-flight"),
        (f"25.deleting-{'cd' * 16}", "deleting"),
    ]


@pytest.mark.parametrize("leftover", [None, "5.tmp-" + "ef" * 16, "ckpt_5.orbax-checkpoint-tmp-1234"])
def test_an_empty_run_is_one_message_whatever_its_format(tmp_path, capsys, leftover):
    d = tmp_path / "run"
    d.mkdir()
    if leftover:
        (d / leftover).mkdir()
    assert cli(["ls", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"no steps in {d}"
    assert cli(["verify", str(d)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"no steps in {d}: nothing to verify"
    assert cli(["info", str(d)]) == 2
    assert (
        f"CheckpointNotFoundError: no steps in {d}: a run directory without committed steps"
        in capsys.readouterr().err
    )
