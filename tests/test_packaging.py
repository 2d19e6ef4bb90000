"""What a user installs (issue 27): the wheel holds one top-level package, ``flax_ckpt``, with the
repository's ``callbacks/`` folder inside it as ``flax_ckpt.callbacks``; and a user's project with a
``callbacks.py`` or ``callbacks/`` of its own (common in training repositories) neither shadows our
callbacks nor is shadowed by them.

The wheel is built from a copy of the sources (the files setuptools reads), so that the build writes no
``build/`` or ``*.egg-info`` into the repository.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

import flax_ckpt as fc
from helpers import worker_env

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"flax_ckpt": "flax_ckpt", "callbacks": "flax_ckpt/callbacks"}  # repository folder -> in the wheel


def _builds_offline() -> bool:
    """Whether this environment's setuptools can build a wheel by itself (``bdist_wheel`` is part of
    setuptools from 70.1; before that it comes from the ``wheel`` package)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    if importlib.util.find_spec("wheel") is not None:
        return True
    major, minor = (int(p) for p in importlib.metadata.version("setuptools").split(".")[:2])
    return (major, minor) >= (70, 1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for f in ROOT.iterdir():  # pyproject.toml, README.md (the readme), constraints
        if f.is_file() and not f.name.startswith("."):
            shutil.copy2(f, src / f.name)
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # Without a build backend here, pip fetches the one pyproject.toml names (setuptools>=64) from the index.
    isolation = ["--no-build-isolation"] if _builds_offline() else []
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (built,) = out.glob("flax_ckpt-*.whl")
    with zipfile.ZipFile(built) as z:
        yield z


def test_the_wheel_holds_one_top_level_package_with_the_callbacks_inside(wheel):
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = [t for t in top if t.endswith(".dist-info")]
    assert len(dist_info) == 1 and top == {"flax_ckpt", *dist_info}, sorted(top)
    assert wheel.read(f"{dist_info[0]}/top_level.txt").decode().split() == ["flax_ckpt"]
    assert not [n for n in names if n.startswith("callbacks")], "a top-level callbacks package is installed"
    expected = {
        f"{inside}/{p.relative_to(ROOT / folder).as_posix()}"
        for folder, inside in PACKAGES.items()
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert "flax_ckpt/callbacks/checkpoint_callback.py" in expected
    shipped = {n for n in names if n.endswith(".py")}
    assert shipped == expected, (
        f"missing: {sorted(expected - shipped)}; unexpected: {sorted(shipped - expected)}"
    )
    assert wheel.read("flax_ckpt/callbacks/__init__.py") == (ROOT / "callbacks/__init__.py").read_bytes()
    entry_points = wheel.read(f"{dist_info[0]}/entry_points.txt").decode()
    assert "flax-ckpt = flax_ckpt._src.tools.cli:main" in entry_points


# A user's project: its own callbacks module, and a training script run from the project's folder
# (``python -c`` and ``python script.py`` both put that folder first on sys.path).
USER_CALLBACKS = "WHOSE = 'the user'\nCheckpointCallback = None  # a name of theirs, not ours\n"

USER_PROGRAM = textwrap.dedent("""
    import sys
    import callbacks as theirs  # the user's own module, imported first
    import flax_ckpt.callbacks
    from flax_ckpt.callbacks import CheckpointCallback
    import callbacks
    import jax, jax.numpy as jnp, numpy as np

    assert callbacks is theirs and callbacks.WHOSE == "the user" and callbacks.CheckpointCallback is None
    assert CheckpointCallback is flax_ckpt.callbacks.CheckpointCallback and callable(CheckpointCallback)
    assert flax_ckpt.callbacks.__name__ == "flax_ckpt.callbacks", flax_ckpt.callbacks.__name__
    print("theirs:", callbacks.__file__)

    def state(seed):
        rng = np.random.default_rng(seed)
        return {"params": {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32),
                           "b": jnp.asarray(rng.standard_normal(3), jnp.bfloat16)},
                "step": jnp.int32(seed), "key": jax.random.key(seed)}

    directory = sys.argv[1]
    with CheckpointCallback(directory, every_steps=1, preemption_signals=()) as ckpt:
        fresh, start = ckpt.restore_or(state(0))
        assert start == 0
        ckpt(7, state(7))
    with CheckpointCallback(directory, every_steps=1, preemption_signals=()) as ckpt:
        restored, start = ckpt.restore_or(state(0))
    assert start == 7
    bits = lambda t: [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(
        jax.tree.map(lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a, t))]
    assert bits(restored) == bits(state(7)), "not bit-exact"
    print("restored step", start)
""")


@pytest.mark.parametrize("layout", ["callbacks.py and callbacks/", "callbacks.py"])
def test_a_users_callbacks_module_in_the_working_directory_shadows_nothing(tmp_path, layout):
    project = tmp_path / "project"
    project.mkdir()
    (project / "callbacks.py").write_text(USER_CALLBACKS)
    theirs = project / "callbacks.py"
    if "callbacks/" in layout:  # a package beside the module: Python imports the package
        (project / "callbacks").mkdir()
        (project / "callbacks" / "__init__.py").write_text(USER_CALLBACKS)
        theirs = project / "callbacks" / "__init__.py"
    directory = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-c", USER_PROGRAM, str(directory)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=180,
        env=worker_env(devices=1),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"theirs: {theirs}" in r.stdout and "restored step 7" in r.stdout, r.stdout
    assert f"resumed from step 7 of {directory}" in r.stderr, r.stderr
    saved = fc.restore(directory / "7")  # what the child saved, read back here
    rng = np.random.default_rng(7)
    assert (
        np.asarray(saved["params"]["w"]).tobytes() == rng.standard_normal((5, 3)).astype(np.float32).tobytes()
    )
