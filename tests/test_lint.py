"""ruff (lint with import sorting; format) and pyright (basic mode) pass, as configured in pyproject.toml.

Both come with the test extra (``pip install -e ".[test]"``; scripts/test.sh installs it) and run
offline: ruff is one binary, pyright's wheel carries its JavaScript and the ``nodejs`` extra a Node.js.
What each covers today, and what it leaves out until that code is cleaned, is in pyproject.toml
(``[tool.ruff]``, ``[tool.pyright]``).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What `ruff format --check` holds to the formatter: the whole repository (pyproject.toml excludes docs/,
# notebooks/ and Markdown files).
FORMATTED = ["."]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        pytest.fail(f"{tool} is not installed: pip install -e '.[test]' (scripts/test.sh does)")
    env = dict(os.environ, PYRIGHT_PYTHON_IGNORE_WARNINGS="1")  # no version check over the network
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_ruff_lint():
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format():
    r = _run("ruff", "format", "--check", "--no-cache", *FORMATTED)
    assert r.returncode == 0, r.stdout + r.stderr


def test_pyright_basic():
    """0 errors, and no module left out (a new module is checked from its first line)."""
    assert not tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pyright"].get("exclude")
    r = _run("pyright", "--pythonpath", sys.executable)
    assert r.returncode == 0 and "\n0 errors," in "\n" + r.stdout, r.stdout + r.stderr


def test_configured_paths_exist():
    """A module that moved leaves no stale path behind: pyright would skip a missing one silently."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    paths = [*config["pyright"]["include"], *config["pyright"].get("exclude", [])]
    paths += list(config["ruff"]["lint"]["per-file-ignores"]) + FORMATTED
    assert [p for p in paths if not (ROOT / p).exists()] == []
