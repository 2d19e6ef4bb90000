"""The flax-ckpt command, run as a real subprocess on real checkpoints (sound, damaged, Orbax), and the
library functions behind it (flax_ckpt._src.tools) in-process.

Each subprocess imports jax (seconds on a shared CPU), so checkpoints are built once per module and
the subprocess count is kept small; finer cases run the same code in-process through flax_ckpt._src.tools.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from flax_ckpt._src import tools as fi
from flax_ckpt._src.commit.atomic import ORBAX_TMP_MARK
from flax_ckpt._src.engine.snapshot import snapshot
from flax_ckpt._src.manager import CheckpointManager
from flax_ckpt._src.orbax import locate, write
from flax_ckpt._src.storage import open_storage
from flax_ckpt._src.tools.cli import build_parser
from helpers import leaf_chunks

SCRIPT = os.path.join(os.path.dirname(sys.executable), "flax-ckpt")


def run(*args: str, module: bool = False) -> subprocess.CompletedProcess:
    """Runs the installed console script (or ``python -m flax_ckpt``) and captures its output."""
    module = module or not os.path.exists(SCRIPT)  # not installed with `pip install -e`: the same code
    cmd = [sys.executable, "-m", "flax_ckpt", *args] if module else [SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def run_json(*args: str, expect: int = 0) -> dict:
    r = run(*args, "--json", "-q")
    assert r.returncode == expect, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


def state(scale: float = 1.0) -> dict:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    kernel = jax.device_put(
        jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) * scale, NamedSharding(mesh, P("data", "model"))
    )
    return {
        "params": {"dense": {"kernel": kernel, "bias": jnp.full((8,), scale, jnp.bfloat16)}},
        "opt": {"mu": np.full((4, 4), scale, np.float32)},
        "rng": jax.random.key(0),
        "step": 3,
        "name": "run-a",
        "none": None,
    }


def chunk(ckpt: str, key: str) -> dict:
    """The first stored chunk of leaf ``key`` (raw serializer: file, offset, nbytes)."""
    return leaf_chunks(ckpt)[key][0]


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def write_memory_copies(directory, local_dir: str) -> None:
    """What a tiered manager of ``directory`` leaves in its memory tiers (tier_store's format): process
    0 holds step 3 committed locally, step 7 written but not yet committed, and a replica of process
    1's step 3 in its peer tier; plus a crashed write."""
    from flax_ckpt._src.tiers import encode as tier_encode
    from flax_ckpt._src.tiers import store as tier_store

    root = fi.memory_tier_root(directory, local_dir)
    for folder, step, process, commit in [
        ("local", 3, 0, True),
        ("local", 7, 0, False),
        ("peer-p1", 3, 1, True),
    ]:
        ident = {"step": step, "session": "s1", "process": process, "process_count": 2}
        snap = tier_store.take_snapshot(
            {"w": np.full(4, float(step))},
            copy=True,
            force=False,
            step=step,
            seen=tier_store.Seen(),
            base=None,
        )
        enc = tier_encode.encode(snap, ident, None, delta=False)
        tier_store.write_copy(os.path.join(root, "p0", folder), step, enc)
        if commit:
            tier_store.mark_committed(os.path.join(root, "p0", folder, str(step)), {"tier": folder, **ident})
    os.makedirs(os.path.join(root, "p0", "local", "8.tmp-" + "dead" * 8))


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> dict[str, str]:
    """A run directory (steps 1-3 committed, one in flight, one with a damaged manifest, one never
    committed) and damaged copies of its step 3: flipped bytes, truncated file, corrupt manifest."""
    root = tmp_path_factory.mktemp("cli")
    run_dir = root / "run"
    for s in (1, 2, 3):
        fc.save(run_dir / str(s), state(float(s)), step=s, metrics={"loss": 1.0 / s}, metadata={"cfg": "a"})
    os.makedirs(run_dir / "4.tmp-0123abcd0123abcd0123abcd0123abcd" / "data")
    paths = {"run": str(run_dir), "s1": str(run_dir / "1"), "s3": str(run_dir / "3")}
    for name in ("flipped", "truncated", "manifest", "missing"):
        paths[name] = str(root / name)
        shutil.copytree(run_dir / "3", paths[name])
    for key in ("opt/mu", "params/dense/kernel"):
        c = chunk(paths["flipped"], key)
        flip(os.path.join(paths["flipped"], c["file"]), c["offset"] + 1)
    c = chunk(paths["truncated"], "params/dense/bias")
    os.truncate(os.path.join(paths["truncated"], c["file"]), c["offset"] + 2)
    with open(os.path.join(paths["manifest"], "manifest.json"), "r+") as f:
        text = f.read().replace(
            '"float32"', '"float64"', 1
        )  # still valid JSON; the checksum no longer matches
        f.seek(0)
        f.write(text)
    os.remove(os.path.join(paths["missing"], chunk(paths["missing"], "opt/mu")["file"]))
    shutil.copytree(paths["manifest"], run_dir / "5")
    os.makedirs(run_dir / "6" / "data")
    fc.save(root / "zarr", state(3.0), serializer="zarr3", step=3)
    paths["zarr"] = str(root / "zarr")
    paths["shm"] = str(root / "shm")
    write_memory_copies(run_dir, paths["shm"])
    return paths


# ---------------------------------------------------------------------------------------- help


def test_help_of_the_console_script_lists_every_command():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for cmd in ("ls", "info", "verify", "diff", "convert", "prune"):
        assert cmd in r.stdout


@pytest.mark.parametrize("cmd", ["ls", "info", "verify", "diff", "convert", "prune"])
def test_every_subcommand_has_help_and_json(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: flax-ckpt {cmd}" in out and "--json" in out


# ------------------------------------------------------------------------------------------ ls


def test_ls_shows_steps_state_size_and_metrics(ck):
    doc = run_json("ls", ck["run"], "--local-dir", ck["shm"])
    by = {e["name"]: e for e in doc["steps"] if e["tier"] == "persistent"}
    assert [e["step"] for e in doc["steps"]] == [1, 2, 3, 3, 3, 5, 6, 7]  # steps only: leftovers apart
    memory = [(e["step"], e["tier"], e["state"]) for e in doc["steps"] if e["tier"] != "persistent"]
    assert memory == [
        (3, "local-memory p0", "committed"),
        (3, "peer-memory p0 (of p1)", "committed"),
        (7, "local-memory p0", "uncommitted"),
    ]
    assert [(e["step"], e["tier"], e["state"]) for e in doc["leftovers"]] == [
        (4, "persistent", "in-flight"),
        (8, "local-memory p0", "in-flight"),
    ]
    assert [by[n]["state"] for n in ("1", "2", "3", "5", "6")] == [
        "committed",
        "committed",
        "committed",
        "invalid",
        "uncommitted",
    ]
    assert by["3"]["committed"] and not by["5"]["committed"] and by["3"]["tier"] == "persistent"
    assert by["2"]["metrics"] == {"loss": 0.5} and by["3"]["nbytes"] > 400
    assert "checksum mismatch" in by["5"]["problem"]
    text = run("ls", ck["run"])
    assert text.returncode == 0
    line3 = next(ln for ln in text.stdout.splitlines() if ln.startswith("3 "))
    assert "committed" in line3 and "loss=0.333333" in line3 and "KiB" in line3
    assert text.stdout.splitlines()[-1] == (
        "leftovers: 1 save in flight (or interrupted: the next manager to open "
        "the directory removes them), 0 B: 4.tmp-0123abcd0123abcd0123abcd0123abcd"
    )


# ---------------------------------------------------------------------------------------- info


def test_info_shows_tree_shapes_dtypes_bytes_sharding_and_totals(ck):
    r = run("info", ck["s3"])
    assert r.returncode == 0, r.stderr
    kernel = next(ln for ln in r.stdout.splitlines() if ln.startswith("params/dense/kernel"))
    assert kernel.split()[:5] == ["params/dense/kernel", "jax", "float32", "[8,8]", "256"]
    assert "NamedSharding(mesh=(data=4,model=2),spec=(data,model))" in kernel
    assert "total: 7 leaves (4 arrays), 344 bytes" in r.stdout and "step 3" in r.stdout
    doc = run_json("info", ck["s3"])
    leaves = {d["key"]: d for d in doc["leaves"]}
    assert leaves["params/dense/bias"]["dtype"] == "bfloat16" and leaves["params/dense/bias"]["shape"] == [8]
    assert leaves["params/dense/kernel"]["sharding"]["spec"] == ["data", "model"]
    assert doc["total"] == {"leaves": 7, "arrays": 4, "nbytes": 344}
    assert doc["metrics"] == {"loss": pytest.approx(1 / 3)} and doc["metadata"] == {"cfg": "a"}


def test_info_of_a_damaged_manifest_is_an_error_with_exit_2(ck):
    doc = run_json("info", ck["manifest"], expect=2)
    assert doc["error"]["type"] == "InvalidManifestError" and "manifest.json" in doc["error"]["message"]


def test_missing_path_exits_2_and_says_so_via_python_m(ck):
    r = run("verify", ck["run"] + "/404", module=True)
    assert r.returncode == 2 and "CheckpointNotFoundError" in r.stderr and "does not exist" in r.stderr
    r = run("info", ck["run"])  # a manager's directory, not one step
    assert (
        r.returncode == 2
        and f"is a directory of steps [1, 2, 3]: pass one of them, e.g. {ck['s3']}" in r.stderr
    )


# -------------------------------------------------------------------------------------- verify


def test_verify_sound_checkpoint_exits_0_with_progress_on_stderr_only(ck):
    r = run("verify", ck["s3"], "--json", "--progress")  # stderr is a pipe here: bars only when asked for
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {
        "path": ck["s3"],
        "ok": True,
        "problems": [],
        "verified": True,
        "leaves": 6,
        "unverified": 0,
        "unverified_leaves": [],
        "steps": None,
        "skipped": [],
        "linked": [],
        "gone": [],
    }
    assert "verify" in r.stderr  # the tqdm bar, never in stdout
    quiet = run("verify", ck["zarr"], "-q")
    assert quiet.returncode == 0 and quiet.stdout.startswith("OK ") and quiet.stderr == ""


def test_verify_flipped_bytes_names_every_damaged_leaf_and_file(ck):
    r = run("verify", ck["flipped"], "-q")
    assert r.returncode == 1
    assert "DAMAGED" in r.stdout and "2 problems in 2 leaves" in r.stdout
    for key in ("opt/mu", "params/dense/kernel"):
        line = next(ln for ln in r.stdout.splitlines() if f"leaf {key} " in ln)
        assert "file data/p0.0.bin" in line and "checksum mismatch" in line
    assert "params/dense/bias" not in r.stdout


def test_verify_truncated_file_names_the_file_and_the_leaves_past_its_end(ck):
    doc = run_json("verify", ck["truncated"], expect=1)
    assert not doc["ok"]
    assert any(p["leaf"] is None and "truncated" in p["message"] for p in doc["problems"])
    cut = chunk(ck["s3"], "params/dense/bias")
    past_end = {
        k
        for k, cs in leaf_chunks(ck["s3"]).items()
        if any(c["file"] == cut["file"] and c["offset"] + c["nbytes"] > cut["offset"] + 2 for c in cs)
    }
    assert "params/dense/bias" in past_end and len(past_end) < 4  # the fixture cut inside the file
    assert {p["leaf"] for p in doc["problems"] if p["leaf"]} == past_end
    assert all(p["file"] == cut["file"] for p in doc["problems"])


def test_verify_corrupt_manifest_exits_1_naming_the_manifest(ck):
    doc = run_json("verify", ck["manifest"], expect=1)
    [p] = doc["problems"]
    assert p["file"] == "manifest.json" and "checksum mismatch" in p["message"]


def test_verify_library_reports_missing_file_and_zarr3_damage(ck, tmp_path):
    problems = fi.verify(ck["missing"])
    gone = chunk(ck["s3"], "opt/mu")["file"]
    assert any(p.leaf is None and "missing" in p.message for p in problems)
    assert all(p.file == gone for p in problems)
    assert {p.leaf for p in problems if p.leaf} == {
        k for k, cs in leaf_chunks(ck["s3"]).items() if any(c["file"] == gone for c in cs)
    }
    z = str(tmp_path / "zarr")
    shutil.copytree(ck["zarr"], z)
    cells = sorted(os.path.join(d, f) for d, _, fs in os.walk(z) for f in fs if "/c/" in os.path.join(d, f))
    flip(cells[0], 2)
    problems = fi.verify(z)
    assert len(problems) == 1 and problems[0].leaf is not None and problems[0].file in cells[0]
    assert fi.verify(ck["s3"]) == []


# ---------------------------------------------------------------------------------------- diff


def test_diff_lists_differing_leaves_with_max_abs_difference(ck):
    r = run("diff", ck["s1"], ck["s3"], "-q")
    assert r.returncode == 1
    kernel = next(ln for ln in r.stdout.splitlines() if "params/dense/kernel" in ln)
    assert kernel.startswith("differs:") and "max |a-b| = 126" in kernel  # 63 * (3 - 1)
    assert "4 leaves identical, 3 differ, 0 only in A, 0 only in B" in r.stdout
    same = run_json("diff", ck["s3"], ck["zarr"])
    assert same["identical"] and same["same"] == 7


def test_diff_library_only_in_one_dtype_change_and_nans(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    fc.save(a, {"x": np.array([1.0, np.nan, 3.0], np.float32), "y": np.ones(2), "s": "p", "k": 1})
    fc.save(b, {"x": np.array([1.0, np.nan, 3.5], np.float32), "z": np.ones(2), "s": "q", "k": 1})
    r = fi.diff(a, b)
    assert r.only_in_a == ["y"] and r.only_in_b == ["z"] and r.same == 1 and not r.identical
    d = {x.key: x for x in r.differing}
    assert d["x"].max_abs_diff == 0.5 and d["s"].max_abs_diff is None and d["s"].a == "str 'p'"
    c = str(tmp_path / "c")
    fc.save(c, {"x": np.array([1.0, np.nan, 3.0], np.float64), "y": np.ones(2), "s": "p", "k": 1})
    [dx] = fi.diff(a, c).differing
    assert (dx.key, dx.a, dx.b, dx.max_abs_diff) == ("x", "float32[3]", "float64[3]", 0.0)
    assert fi.max_abs_diff(np.array([np.nan, 1.0]), np.array([0.0, 1.0])) == np.inf


# ------------------------------------------------------------------------------------- convert


def test_convert_exports_params_to_safetensors(ck, tmp_path):
    from safetensors import safe_open

    dst = str(tmp_path / "model.safetensors")
    doc = run_json("convert", ck["s3"], dst)
    assert doc["to"] == "safetensors" and doc["leaves"] == 2 and doc["nbytes"] == 256 + 16
    with safe_open(dst, "np") as f:
        assert set(f.keys()) == {"dense.kernel", "dense.bias"}
        np.testing.assert_array_equal(f.get_tensor("dense.kernel"), np.arange(64.0).reshape(8, 8) * 3)
        assert json.loads(f.metadata()["step"]) == 3 and f.metadata()["subtree"] == "params"
    with open(dst, "rb") as f:  # numpy cannot load bfloat16 from safetensors; check the header instead
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["dense.bias"]["dtype"] == "BF16" and header["dense.bias"]["shape"] == [8]
    again = run("convert", ck["s3"], dst, "-q")
    assert again.returncode == 2 and "CheckpointExistsError" in again.stderr


def test_convert_library_native_to_zarr3_and_safetensors_errors(ck, tmp_path):
    dst = str(tmp_path / "n")
    r = fi.convert(ck["s3"], dst, to="native", serializer="zarr3")
    assert (r.to, r.leaves) == ("native", 7)
    info = fc.metadata(dst)
    assert info.serializer == "zarr3" and info.step == 3 and info.metrics == {"loss": pytest.approx(1 / 3)}
    assert fi.diff(ck["s3"], dst).identical
    all_leaves = fi.convert(ck["s3"], str(tmp_path / "all.safetensors"), to="safetensors", subtree="")
    assert all_leaves.leaves == 3 and set(all_leaves.skipped) == {
        "step",
        "name",
        "none",
        "rng",
    }  # keys skipped
    bad = str(tmp_path / "bad")
    fc.save(bad, {"params": {"a": np.zeros(2, np.complex128), "b": {"c": np.ones(1)}, "b.c": np.ones(1)}})
    with pytest.raises(fc.CheckpointError, match="complex128") as e:
        fi.convert(bad, str(tmp_path / "bad.safetensors"), to="safetensors")
    assert "both map to tensor name 'b.c'" in str(e.value) and "Cast those leaves" in str(e.value)
    assert not os.path.exists(tmp_path / "bad.safetensors")
    with pytest.raises(fc.CheckpointError, match="no leaves under 'nothing'"):
        fi.convert(bad, str(tmp_path / "x.safetensors"), to="safetensors", subtree="nothing")


# ------------------------------------------------------------------------------------------ orbax


def test_orbax_layout_info_convert_both_ways_and_diff(ck, tmp_path):
    ob = str(tmp_path / "orbax")
    assert run_json("convert", ck["s3"], ob, "--to", "orbax")["to"] == "orbax"
    assert os.path.exists(os.path.join(ob, "_CHECKPOINT_METADATA")) and not os.path.exists(
        os.path.join(ob, "manifest.json")
    )
    info = run_json("info", ob)
    leaves = {d["key"]: d for d in info["leaves"]}
    assert info["format"] == "orbax" and leaves["params/dense/bias"]["dtype"] == "bfloat16"
    assert leaves["params/dense/kernel"]["shape"] == [8, 8]
    back = str(tmp_path / "back")
    assert run_json("convert", ob, back)["to"] == "native"  # the default target is the other layout
    assert fi.detect_format(back) == "native" and fi.verify(ob) == [] and fi.verify(back) == []
    assert fi.diff(ck["s3"], ob).identical and fi.diff(ob, back).identical


def test_checkpoint_written_by_orbax_itself_and_a_damaged_one(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    ob = str(tmp_path / "real")
    tree = {"params": {"w": jnp.arange(6.0).reshape(2, 3), "b": np.ones(3, np.float32)}}
    with ocp.StandardCheckpointer() as c:
        c.save(ob, tree)
    r = run("verify", ob)
    assert r.returncode == 0 and "every leaf reads back" in r.stdout, r.stderr
    info = run_json("info", ob)
    assert info["format"] == "orbax" and info["total"] == {"leaves": 2, "arrays": 2, "nbytes": 36}
    bad = str(tmp_path / "bad")
    shutil.copytree(ob, bad)
    data = [os.path.join(d, f) for d, _, fs in os.walk(bad) if os.path.basename(d) == "d" for f in fs]
    assert data  # OCDBT data files
    for f in data:
        os.truncate(f, 4)
    problems = fi.verify(bad)
    assert problems and all(bad in p.message for p in problems), problems
    damaged = run("verify", bad, "-q")
    assert damaged.returncode == 1 and "DAMAGED" in damaged.stdout


def test_ls_and_prune_an_orbax_manager_directory(tmp_path):
    d = tmp_path / "om"
    for s in (1, 2, 3):
        write.save_step(open_storage(d), s, snapshot({"w": np.full(3, float(s))}), metrics={"loss": 1.0 / s})
    os.makedirs(d / f"4{ORBAX_TMP_MARK}-123")
    entries = fi.list_steps(d)
    assert [(e.step, e.state, e.format) for e in entries] == [
        (1, "committed", "orbax"),
        (2, "committed", "orbax"),
        (3, "committed", "orbax"),
        (4, "in-flight", None),
    ]
    assert entries[1].metrics == {"loss": 0.5}
    r = fi.prune(d, keep=2)
    assert (r.deleted, r.kept) == ([1], [2, 3]) and sorted(locate.step_dirs(open_storage(d))) == [2, 3]


# --------------------------------------------------------------------------------------- prune


def test_prune_uses_manager_retention_with_dry_run(ck, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(ck["run"], d)
    dry = run_json("prune", str(d), "--keep", "1", "--dry-run")
    assert dry == {
        "directory": str(d),
        "dry_run": True,
        "would_delete": [1, 2],
        "kept": [3],  # no "deleted"
        "formats": ["native", "orbax"],
        "left_alone": [],
    }
    assert sorted(os.listdir(d)) == ["1", "2", "3", "4.tmp-0123abcd0123abcd0123abcd0123abcd", "5", "6"]
    r = run("prune", str(d), "--keep", "1", "--best-metric", "loss", "--best-mode", "max", "--keep-best", "1")
    assert r.returncode == 0, r.stderr
    assert "deleted: 2" in r.stdout and "kept: 1, 3" in r.stdout
    assert [e.name for e in fi.list_steps(d)] == [
        "1",
        "3",
        "4.tmp-0123abcd0123abcd0123abcd0123abcd",
        "5",
        "6",
    ]


def test_prune_refuses_while_a_manager_holds_the_directory(tmp_path):
    d = tmp_path / "live"
    with CheckpointManager(d, async_save=False) as m:
        for s in (1, 2, 3):
            m.save(s, {"a": np.ones(2)})
        with pytest.raises(fc.CheckpointLockedError):
            fi.prune(d, keep=1)
        assert fi.prune(d, keep=1, dry_run=True).deleted == [1, 2]
    assert fi.prune(d, keep=2).deleted == [1]
    assert [e.step for e in fi.list_steps(d)] == [2, 3]
