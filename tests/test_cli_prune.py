"""``flax-ckpt prune`` and retention (issue 44, item 1): each format's steps apart, never the steps a
manager resumes from, every deletion checked before the first, other libraries' files listed and left
alone unless their format is named, no lock file left in a folder that is not a native run, and every
error a CheckpointError with the exit status the command documents. Real files throughout: native and
Orbax steps written by flax_ckpt, legacy Flax ``checkpoint_<step>`` files written by flax itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src import tools as fi
from flax_ckpt._src.engine.snapshot import snapshot
from flax_ckpt._src.orbax import write
from flax_ckpt._src.storage import open_storage
from flax_ckpt._src.storage.lock import LOCK_FILE
from flax_ckpt._src.tools.cli import main as cli

serialization = pytest.importorskip("flax.serialization")


def tree(step: int) -> dict:
    return {"w": np.arange(6, dtype=np.float32) + step, "step": step}


def native_steps(d, steps) -> None:
    with fc.CheckpointManager(d, async_save=False) as mgr:
        for s in steps:
            mgr.save(s, tree(s), metrics={"loss": 1.0 / s})


def flax_files(d, steps) -> dict[str, bytes]:
    """Legacy Flax checkpoint files (flax.serialization.to_bytes, as save_checkpoint writes them)."""
    os.makedirs(d, exist_ok=True)
    written = {}
    for s in steps:
        data = serialization.to_bytes({"params": {"w": np.full(3, float(s), np.float32)}, "step": s})
        with open(os.path.join(d, f"checkpoint_{s}"), "wb") as f:
            f.write(data)
        written[f"checkpoint_{s}"] = data
    return written


def prune_cli(capsys, *args: str) -> tuple[int, dict, str]:
    """``flax-ckpt prune <args> --json -q`` in this process: exit status, stdout's JSON, stderr."""
    rc = cli(["prune", *args, "--json", "-q"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_flax_files_beside_native_steps_never_cost_the_native_steps(tmp_path, capsys):
    d = tmp_path / "run"
    native_steps(d, (1, 2))
    files = flax_files(d, (3, 4))
    rc, dry, _ = prune_cli(capsys, str(d), "--keep", "1", "--dry-run")
    assert rc == 0 and (dry["would_delete"], dry["kept"]) == ([1], [2])
    assert dry["left_alone"] == ["checkpoint_3", "checkpoint_4"]
    rc, real, err = prune_cli(capsys, str(d), "--keep", "1")
    assert rc == 0, err
    assert (real["deleted"], real["kept"], real["left_alone"]) == (
        dry["would_delete"],
        dry["kept"],
        dry["left_alone"],
    )
    assert sorted(os.listdir(d)) == [LOCK_FILE, "2", "checkpoint_3", "checkpoint_4"]
    assert all((d / n).read_bytes() == b for n, b in files.items())
    with fc.CheckpointManager(d, max_to_keep=1) as mgr:  # what the manager's own retention keeps
        assert mgr.all_steps() == [2] and mgr.restore()["step"] == 2


def test_a_folder_of_flax_files_alone_is_pruned_only_when_their_format_is_named(tmp_path, capsys):
    d = tmp_path / "flax"
    files = flax_files(d, (3, 4, 5))
    rc, doc, err = prune_cli(capsys, str(d), "--keep", "1")
    assert rc == 0 and not err and doc["deleted"] == [] and doc["left_alone"] == sorted(files)
    assert sorted(os.listdir(d)) == sorted(files)  # no lock file left behind either
    rc, dry, _ = prune_cli(capsys, str(d), "--keep", "1", "--format", "flax_msgpack", "--dry-run")
    assert rc == 0 and (dry["would_delete"], dry["kept"], dry["formats"]) == ([3, 4], [5], ["flax_msgpack"])
    rc, real, err = prune_cli(capsys, str(d), "--keep", "1", "--format", "flax_msgpack")
    assert rc == 0 and (real["deleted"], real["kept"]) == ([3, 4], [5]), err
    assert os.listdir(d) == ["checkpoint_5"] and (d / "checkpoint_5").read_bytes() == files["checkpoint_5"]


def test_each_format_keeps_its_own_newest_steps_in_prune_and_in_the_manager(tmp_path, capsys):
    """Orbax steps 1-3 and native steps 4-5 (an older flax_ckpt continued Orbax runs natively)."""

    def mixed(name):
        d = tmp_path / name
        for s in (1, 2, 3):
            write.save_step(open_storage(d), s, snapshot(tree(s)), metrics={"loss": 1.0 / s})
        for s in (4, 5):
            fc.save(d / str(s), tree(s), step=s)
        return d

    d = mixed("prune")
    rc, doc, _ = prune_cli(capsys, str(d), "--keep", "1", "--dry-run")
    assert (doc["would_delete"], doc["kept"]) == ([1, 2, 4], [3, 5])
    assert fi.prune(d, keep=1).deleted == [1, 2, 4]
    assert [(e.step, e.format) for e in fi.list_steps(d)] == [(3, "orbax"), (5, "native")]
    assert fi.prune(d, keep=1, format="orbax").deleted == []
    m = mixed("manager")
    with fc.CheckpointManager(
        m, max_to_keep=1, async_save=False
    ) as mgr:  # writes native steps (the newest's)
        mgr.save(6, tree(6))
        assert mgr.all_steps() == [3, 6] and mgr.restore()["step"] == 6
    assert sorted(os.listdir(m)) == [LOCK_FILE, "3", "6"]


def test_a_deletion_that_fails_is_a_storage_error_naming_it_and_leaves_no_lock(tmp_path, capsys):
    """Orbax steps with a 220-character step_prefix: a deletion's first move (renaming the step to
    ``<name>.deleting-<uuid>``) fails with ENAMETOOLONG, a real failure whoever runs the test."""
    d, prefix = tmp_path / "run", "p" * 220
    for s in (1, 2, 3):
        write.save_step(open_storage(d), s, snapshot(tree(s)), metrics={"loss": 1.0 / s})
        os.rename(d / str(s), d / f"{prefix}_{s}")
    assert [(e.step, e.format) for e in fi.list_steps(d)] == [(1, "orbax"), (2, "orbax"), (3, "orbax")]
    rc, doc, err = prune_cli(capsys, str(d), "--keep", "1")
    assert rc == 2 and doc["error"]["type"] == "StorageError", doc
    assert (
        f"{d}/{prefix}_1" in doc["error"]["message"]
        and "deleted before it: nothing" in doc["error"]["message"]
    )
    assert sorted(os.listdir(d)) == [f"{prefix}_{s}" for s in (1, 2, 3)]  # nothing deleted, no lock file


def test_options_out_of_range_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["prune", str(tmp_path), "--keep", "0"])
    assert e.value.code == 2 and "argument --keep: must be at least 1, got 0" in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_never_a_traceback(tmp_path):
    """A safetensors header whose dtype is a list (issue 44, item 9): whatever the reader raises, the
    command prints one line and exits 2."""
    header = json.dumps({"a": {"dtype": [], "shape": [2], "data_offsets": [0, 8]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    r = subprocess.run(
        [sys.executable, "-m", "flax_ckpt", "info", str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("flax-ckpt info: error: "), (
        r.stderr
    )
