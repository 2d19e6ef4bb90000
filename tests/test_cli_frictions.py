"""What a first-time user of the flax-ckpt command hits (issue "What a first-time user hits", items 5,
6, 8 and 15): convert carries step and metrics over (and names what a format cannot hold), an export
gets the mode every other file gets, diff says whether PRNG keys are equal (with their implementation)
instead of a meaningless difference, and --help answers without importing jax or tensorstore.

Checkpoints are built once per module; the command runs as a real subprocess where what is checked is
the command's own output (text, JSON, exit status, imports, file modes), else in-process.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src import tools as fi

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = os.path.join(os.path.dirname(sys.executable), "flax-ckpt")
HEAVY = ("jax", "tensorstore")


def cli(*args: str, env: dict | None = None, umask: int = -1) -> subprocess.CompletedProcess:
    """The installed console script (else ``python -m flax_ckpt``, the same code), output captured."""
    cmd = [SCRIPT, *args] if os.path.exists(SCRIPT) else [sys.executable, "-m", "flax_ckpt", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, umask=umask)


def cli_json(*args: str, expect: int = 0, umask: int = -1) -> dict:
    r = cli(*args, "--json", "-q", umask=umask)
    assert r.returncode == expect, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    """Step 3 of a run, native: params, a PRNG key, metrics and user metadata."""
    path = tmp_path_factory.mktemp("frictions") / "run" / "3"
    fc.save(
        path,
        {"params": {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}, "rng": jax.random.key(0)},
        step=3,
        metrics={"loss": 0.25},
        metadata={"cfg": "a"},
    )
    return str(path)


def carried(path: str) -> tuple:
    info = fc.metadata(path)
    return info.format, info.step, info.metrics, info.metadata


# --------------------------------------------------------------- item 5: convert keeps step and metrics


def test_convert_to_an_orbax_step_folder_and_back_keeps_step_metrics_and_metadata(src, tmp_path):
    ob, back = str(tmp_path / "3"), str(tmp_path / "back")
    doc = cli_json("convert", src, ob, "--to", "orbax")
    assert (doc["left_out"], doc["fields_left_out"]) == (0, {})
    assert carried(ob) == ("orbax", 3, {"loss": 0.25}, {"cfg": "a"})
    doc = cli_json("convert", ob, back)
    assert (doc["to"], doc["left_out"]) == ("native", 0)
    assert carried(back) == ("native", 3, {"loss": 0.25}, {"cfg": "a"})
    assert fi.diff(src, ob).identical and fi.diff(src, back).identical


def test_orbax_itself_lists_the_converted_step_with_its_metrics(src, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    fi.convert(src, tmp_path / "3", to="orbax")
    with ocp.CheckpointManager(tmp_path) as m:
        assert m.all_steps() == [3]
        assert m.metrics(3) == {"loss": 0.25}


def test_convert_to_orbax_under_another_name_keeps_metrics_and_names_the_step_left_out(src, tmp_path):
    ob, back = str(tmp_path / "exported"), str(tmp_path / "back")
    r = cli("convert", src, ob, "--to", "orbax", "-q")
    assert r.returncode == 0, r.stderr
    assert "left out step 3: Orbax's layout records a step only as the name of a step folder" in r.stdout
    assert f"convert into {tmp_path}/3 to keep it" in r.stdout
    assert carried(ob) == ("orbax", None, {"loss": 0.25}, {"cfg": "a"})
    r = fi.convert(ob, back)
    assert (r.left_out, r.fields_left_out) == (0, {})
    assert carried(back) == ("native", None, {"loss": 0.25}, {"cfg": "a"})


def test_convert_to_an_orbax_folder_named_for_another_step_is_refused_before_reading(src, tmp_path):
    dst = tmp_path / "ckpt_5"
    with pytest.raises(fc.CheckpointError) as e:
        fi.convert(src, dst, to="orbax")
    msg = str(e.value)
    assert str(dst) in msg and "step 5" in msg and "is step 3" in msg and f"{tmp_path}/3" in msg
    assert not dst.exists()


def test_library_result_counts_leaves_and_fields_left_out(src, tmp_path):
    r = fi.convert(src, tmp_path / "o", to="orbax")
    assert r.left_out == 1 and list(r.fields_left_out) == ["step"]
    e = fi.convert(src, tmp_path / "all.safetensors", to="safetensors", subtree="")
    assert (e.skipped, e.outside, e.fields_left_out, e.left_out) == (["rng"], [], {}, 1)


# ------------------------------------------- items 5 and 6: a safetensors export, its metadata and mode


def test_safetensors_export_carries_step_metrics_metadata_and_follows_the_umask(src, tmp_path):
    from safetensors import safe_open

    dst = str(tmp_path / "model.safetensors")
    doc = cli_json("convert", src, dst, umask=0o022)
    assert doc["left_out"] == 1 and doc["outside"] == ["rng"] and doc["fields_left_out"] == {}
    assert os.stat(dst).st_mode & 0o777 == 0o644  # safetensors alone writes 0o600
    with safe_open(dst, "np") as f:
        meta = f.metadata()
    assert {k: json.loads(meta[k]) for k in ("step", "metrics", "metadata")} == {
        "step": 3,
        "metrics": {"loss": 0.25},
        "metadata": {"cfg": "a"},
    }


@pytest.mark.parametrize("umask", [0o027, 0o077])
def test_export_mode_is_a_checkpoint_files_mode_under_any_umask(src, tmp_path, umask):
    old = os.umask(umask)
    try:
        fi.convert(src, tmp_path / "m.safetensors", to="safetensors")
        fc.save(tmp_path / "native", {"w": np.ones(2)})
    finally:
        os.umask(old)
    mode = os.stat(tmp_path / "m.safetensors").st_mode & 0o777
    assert mode == 0o644 & ~umask == os.stat(tmp_path / "native" / "manifest.json").st_mode & 0o777
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


# ------------------------------------------------------------------- item 8: diff of PRNG keys


def test_diff_says_keys_differ_with_their_implementation_never_a_number(tmp_path):
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    fc.save(a, {"rng": jax.random.key(0), "keys": jax.random.split(jax.random.key(0), 2)})
    fc.save(b, {"rng": jax.random.key(1), "keys": jax.random.split(jax.random.key(0), 2)})
    fc.save(c, {"rng": jax.random.key(0, impl="rbg"), "keys": jax.random.split(jax.random.key(0), 2)})
    fi.convert(a, d, to="orbax")
    r = fi.diff(a, b)
    assert [(x.key, x.a, x.b, x.max_abs_diff) for x in r.differing] == [
        ("rng", "key<threefry2x32>[]", "key<threefry2x32>[]", None)
    ]
    assert r.same == 1  # the equal key array
    [x] = fi.diff(a, c).differing
    assert (x.a, x.b, x.max_abs_diff) == ("key<threefry2x32>[]", "key<rbg>[]", None)
    assert fi.diff(a, d).identical  # the same keys through Orbax's layout
    out = cli("diff", a, b, "-q")
    assert out.returncode == 1
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("differs: rng"))
    assert line == "differs: rng  key<threefry2x32>[] vs key<threefry2x32>[]  key data differ"
    assert "max |a-b|" not in out.stdout and "key<>" not in out.stdout
    assert "1 leaf identical, 1 differ" in out.stdout


# --------------------------------------------------- item 15: --help without jax or tensorstore


def imported(stderr: str) -> set[str]:
    """The top-level packages a ``-X importtime`` run imported."""
    return {
        m.group(1).strip().split(".")[0]
        for m in re.finditer(r"^import time:[^|]*\|[^|]*\|(.*)$", stderr, re.M)
    }


@pytest.mark.parametrize(
    "args, code, says",
    [
        (["--help"], 0, "usage: flax-ckpt [-h] COMMAND"),
        (["convert", "--help"], 0, "usage: flax-ckpt convert"),
        (["convert", "a", "b", "--to", "onnx"], 2, "argument --to: invalid choice: 'onnx'"),
        (["prune", "some/dir"], 2, "the following arguments are required: --keep"),
        ([], 2, "the following arguments are required: COMMAND"),
    ],
)
def test_help_and_argument_errors_import_neither_jax_nor_tensorstore(args, code, says):
    r = cli(*args, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == code and says in r.stdout + r.stderr, (r.returncode, r.stdout, r.stderr[-2000:])
    mods = imported(r.stderr)
    assert "flax_ckpt" in mods and not mods & set(HEAVY), sorted(mods & set(HEAVY))


def test_python_m_help_is_as_light():
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flax_ckpt", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "convert" in r.stdout
    assert not imported(r.stderr) & set(HEAVY)


def test_the_public_api_is_imported_on_first_use(tmp_path):
    code = (
        "import sys, flax_ckpt as fc; before = [m for m in %r if m in sys.modules]; "
        "from flax_ckpt import *; print(before, CheckpointManager is fc.CheckpointManager, "
        "issubclass(fc.StorageError, fc.CheckpointError), 'jax' in sys.modules)" % (HEAVY,)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["[]", "True", "True", "True"], r.stderr
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        fc.nothing_here  # noqa: B018
    assert dir(fc) == sorted(fc.__all__ + ["__version__"]) and all(getattr(fc, n) for n in fc.__all__)


def test_type_checkers_see_exactly_the_names_imported_at_run_time():
    """The TYPE_CHECKING imports of flax_ckpt/__init__.py (what IDEs and type checkers read) and the
    table its __getattr__ imports from (_SOURCES) name the same things from the same modules."""
    tree = ast.parse((ROOT / "flax_ckpt" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    static = {(node.module, a.name) for node in block.body for a in node.names if a.asname == a.name}
    assert len(static) == len(block.body)
    assert static == {(m, n) for m, names in fc._SOURCES.items() for n in names}
