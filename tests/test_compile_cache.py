"""A run's compilation cache (fc.use_compilation_cache, CheckpointCallback(compile_cache=...)): a resumed
run loads its compiled training step instead of compiling it; damaged, stale and unwritable caches are
ignored with one log line; the cache is bounded; a cache the program configured itself is left alone;
the manager and the tools never take it for a step.

Each run is a child process (a program of a user's, with the callback), since JAX's cache is one per
process. The children store every program (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0: the test's
programs compile in well under JAX's default of a second)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import forkserver
from helpers import worker_env

MANY = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import flax_ckpt as fc

location, max_bytes, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache = fc.use_compilation_cache(location, max_bytes=max_bytes)
results = []
for k in range(first, first + 6):  # six programs of their own, of one signature
    results.append(np.asarray(jax.jit(lambda x, k=k: jnp.sin(x * k) + k)(jnp.ones(8))).tolist())
info = cache.info()
print(json.dumps({"entries": info.entries, "nbytes": info.nbytes, "writes": info.writes, "hits": info.hits,
                  "results": results}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = worker_env(devices=1)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's own cache for its children: not here
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env.update(extra)
    return env


def _run(tmp: Path, run: "Path | str", steps: int, opts: dict | None = None, **env: str) -> tuple[dict, str]:
    """Runs PROGRAM (one file for all: a program's source lines are part of its cache key, so a restarted
    program is the same file) on ``run`` up to ``steps``."""
    script = Path(__file__).parent / "workers" / "compile_cache_program.py"
    p = forkserver.run(
        [sys.executable, str(script), str(run), str(steps), json.dumps(opts or {})],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _entries(run: Path) -> list[Path]:
    return sorted((run / "compile_cache").glob("*/*.xc"))


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run of two steps, with its cache: what a copy of it is resumed from."""
    tmp = tmp_path_factory.mktemp("two_steps")
    first, _ = _run(tmp, tmp / "run", 2)
    return tmp / "run", first


@pytest.fixture
def run(tmp_path, two_steps):
    """A copy of the two-step run, to resume or damage."""
    shutil.copytree(two_steps[0], tmp_path / "run", symlinks=True)
    return tmp_path / "run"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of the four steps run at once, without a cache."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out, _ = _run(tmp, tmp / "run", 4, {"compile_cache": False})
    assert not (tmp / "run" / "compile_cache").exists()
    return out["w"]


def test_a_resumed_run_loads_its_programs_instead_of_compiling(tmp_path, run, two_steps, uninterrupted):
    """A resumed run loads the programs its first run compiled. Slow (tens of seconds, in its fixtures):
    real training runs, each a process that compiles."""
    first = two_steps[1]
    assert first["start"] == 0 and first["hits"] == 0 and first["writes"] > 0
    assert len(_entries(run)) == first["entries"] > 0
    resumed, _ = _run(tmp_path, run, 4)
    assert resumed["start"] == 2
    assert resumed["hits"] > 0 and resumed["writes"] == 0  # every program it compiled was loaded
    assert resumed["w"] == uninterrupted  # and the loaded programs compute what compiled ones do


def test_damaged_entries_are_compiled_again_with_one_log_line(tmp_path, run, uninterrupted):
    for entry in _entries(run):
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0x40
        entry.write_bytes(bytes(data))
    resumed, err = _run(tmp_path, run, 4)
    assert resumed["hits"] == 0 and resumed["writes"] > 0 and resumed["w"] == uninterrupted
    assert err.count("is damaged or not this program's; compiling it again") == 1, err[-2000:]
    for entry in _entries(run):  # written anew, whole
        assert entry.stat().st_size == int(entry.name.rsplit(".", 3)[1])


def test_another_versions_programs_are_never_loaded_and_are_removed(tmp_path, run, uninterrupted):
    (ns,) = (p.name for p in (run / "compile_cache").iterdir() if p.is_dir())
    stale = run / "compile_cache" / "jax0.0.1-jaxlib0.0.1-cpu"
    os.rename(run / "compile_cache" / ns, stale)
    resumed, _ = _run(tmp_path, run, 4)
    assert resumed["hits"] == 0 and resumed["writes"] > 0 and resumed["w"] == uninterrupted
    assert sorted(os.listdir(run / "compile_cache")) == sorted([ns, "flax_ckpt_compile_cache.json"])


def test_an_unusable_cache_is_ignored_with_one_log_line(tmp_path, uninterrupted):
    run = tmp_path / "run"
    run.mkdir()
    (run / "compile_cache").write_bytes(b"not a folder")
    out, err = _run(tmp_path, run, 4)
    assert out["w"] == uninterrupted and out["writes"] == 0
    assert err.count("compilation cache at") == 1, err[-2000:]
    assert (run / "compile_cache").read_bytes() == b"not a folder"


def test_a_cache_the_program_configured_is_left_as_it_is(tmp_path, uninterrupted):
    own = tmp_path / "own_cache"
    out, _ = _run(tmp_path, tmp_path / "run", 4, JAX_COMPILATION_CACHE_DIR=str(own))
    assert out["location"] is None and out["w"] == uninterrupted
    assert not (tmp_path / "run" / "compile_cache").exists()
    assert any(own.iterdir())  # JAX's own cache got the programs


def _many(script: Path, location: Path, max_bytes: int, first: int) -> dict:
    p = forkserver.run(
        [sys.executable, str(script), str(location), str(max_bytes), str(first)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """The MANY program's script, and a cache of its six programs (first=0): what a copy starts from."""
    tmp = tmp_path_factory.mktemp("six")
    script, location = tmp / "many.py", tmp / "cache"
    script.write_text(MANY)
    out = _many(script, location, 1 << 30, 0)
    assert out["writes"] >= 6
    return script, location, out


def test_the_cache_holds_at_most_max_bytes(tmp_path, six):
    script, location = six[0], tmp_path / "cache"
    shutil.copytree(six[1], location)
    unbounded = six[2]
    one = max(f.stat().st_size for f in location.glob("*/*.xc"))
    bound = unbounded["nbytes"] // 2 + one
    newer = _many(script, location, bound, 100)  # six other programs: the unused ones make room for them
    on_disk = sum(f.stat().st_size for f in location.glob("*/*.xc"))
    assert on_disk == newer["nbytes"] <= bound
    assert newer["writes"] >= 3


def test_entries_swapped_between_programs_are_compiled_again_never_run(tmp_path, six):
    script, location = six[0], tmp_path / "cache"
    shutil.copytree(six[1], location)
    a, b = sorted(location.glob("*/jit__lambda-*.xc"))[:2]  # two programs of one signature
    (ka, _, tail), (kb, _, _) = (p.name.split(".", 2) for p in (a, b))  # <key>.<bytes>.<the rest>
    da, db = a.read_bytes(), b.read_bytes()
    a.unlink()
    b.unlink()  # each stored under the other's key, its length in its name: it checks out but for its key
    a.with_name(f"{ka}.{len(db)}.{tail}").write_bytes(db)
    b.with_name(f"{kb}.{len(da)}.{tail}").write_bytes(da)
    again = _many(script, location, 1 << 30, 0)
    assert again["results"] == six[2]["results"]  # each program computes its own result
    assert again["writes"] == 2 and again["hits"] == six[2]["writes"] - 2  # the two compiled, stored again


def test_the_manager_and_the_tools_leave_the_cache_alone(tmp_path, run):
    before = {p: p.read_bytes() for p in _entries(run)}
    assert before
    cli = [sys.executable, "-m", "flax_ckpt._src.tools.cli"]
    ls = subprocess.run([*cli, "ls", str(run)], env=_env(), capture_output=True, text=True, timeout=300)
    assert ls.returncode == 0, ls.stderr
    lines = ls.stdout.splitlines()
    assert [line for line in lines if "compile_cache" in line] == [
        next(line for line in lines if line.startswith("compile_cache/: "))
    ]
    assert f"{len(before)} compiled programs" in ls.stdout
    assert len([line for line in lines if line.split()[:1] in (["1"], ["2"])]) == 2
    for args in (["prune", str(run), "--keep", "1"], ["verify", str(run)]):
        p = subprocess.run([*cli, *args], env=_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
    import flax_ckpt as fc

    with fc.CheckpointManager(run, read_only=True) as mgr:
        assert mgr.all_steps() == [2]
    assert {p: p.read_bytes() for p in _entries(run)} == before


def test_use_compilation_cache_refuses_a_bad_bound():
    import flax_ckpt as fc

    for bad in (0, -1, 1.5, "1GB"):
        with pytest.raises(ValueError, match="max_bytes"):
            fc.use_compilation_cache("/nonexistent", max_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_a_run_on_an_object_store_keeps_its_cache_there(tmp_path, store, request, uninterrupted):
    """Slow (tens of seconds): real training runs against the store, each a process that compiles."""
    place = request.getfixturevalue(store)  # the environment points flax_ckpt (and the children) at it
    first, _ = _run(tmp_path, place.url, 2)  # type: ignore[arg-type]
    assert first["writes"] > 0 and first["location"].startswith(place.url + "/compile_cache/")
    stored = [k for k in place.keys("compile_cache") if k.endswith(".xc")]
    assert len(stored) == first["entries"]
    resumed, _ = _run(tmp_path, place.url, 4)  # type: ignore[arg-type]
    assert resumed["start"] == 2 and resumed["hits"] > 0 and resumed["writes"] == 0
    assert resumed["w"] == uninterrupted
