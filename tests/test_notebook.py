"""notebooks/finetune.ipynb runs top to bottom in a fresh kernel, in a temporary folder, so it cannot rot;
it writes its checkpoints under a temporary folder of its own, removes it at the end, and shows only the
library's log lines. The kernel imports flax_ckpt from a copy laid out as the wheel installs it (no
``examples/`` or other repository file beside it), so the notebook runs from a plain install.
It is stored with its outputs (the site shows them, the timeline chart among them), and they are
current: running it again prints the same text, up to what changes from run to run (the temporary
folder, times, addresses) and the last digits of a computed float (XLA's CPU kernels differ by CPU
model: an AMD machine without AVX-512 prints the same loss 1e-7 apart). After a change that moves them:
``.venv/bin/jupyter execute --inplace notebooks/finetune.ipynb``.

The notebook asserts its own claims (frozen layer unchanged, the best checkpoint restores to its stored
metric); this test only runs it and reports the failing cell.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "finetune.ipynb"
INSTALLED = {"flax_ckpt": "flax_ckpt", "callbacks": "flax_ckpt/callbacks"}  # as the wheel holds them
CHANGING = [
    (re.compile(r"\S*finetune_notebook_\w+"), "<work>"),  # the temporary folder
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:ms|s)\b"), "<time>"),
    (re.compile(r"0x[0-9a-f]+"), "<address>"),
]
FLOAT = re.compile(r"-?\d+\.\d{6,}(?:e[-+]?\d+)?")  # a computed value printed whole, as repr prints it
REL_TOL = 1e-4  # CPU models differ by ~1e-7; a changed model or training moves the loss far more


def same_text(old: str, new: str) -> bool:
    """The same text, its long floats equal within ``REL_TOL``."""
    if FLOAT.sub("<float>", old) != FLOAT.sub("<float>", new):
        return False
    return all(
        math.isclose(float(a), float(b), rel_tol=REL_TOL)
        for a, b in zip(FLOAT.findall(old), FLOAT.findall(new))
    )


def text_outputs(nb) -> list[str]:
    """Per code cell, what it printed (stdout, then stderr) and the text of what it displayed."""
    out = []
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        streams = {"stdout": "", "stderr": ""}
        shown = []
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                streams[o.name] += o.text
            elif "data" in o:
                shown.append(o.data.get("text/plain", ""))
        text = streams["stdout"] + "\n--- stderr\n" + streams["stderr"] + "\n--- shown\n" + "\n".join(shown)
        for pattern, by in CHANGING:
            text = pattern.sub(by, text)
        out.append(text)
    return out


def installed_copy(site: Path) -> Path:
    """The package as ``pip install`` puts it into ``site`` (tests/test_packaging.py checks the wheel
    holds these folders and nothing else): no repository around it."""
    for folder, inside in INSTALLED.items():
        shutil.copytree(ROOT / folder, site / inside, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return site


def test_finetune_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    """The notebook runs in a fresh Jupyter kernel and prints what its stored outputs show. Slow (tens of
    seconds): a kernel process that imports JAX and trains, as a user's does."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # one CPU device in the kernel, as a user has
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # as a user has: JAX looks for its backends
    (tmp_path / "cwd").mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the kernel's tempfile folder
    site = installed_copy(tmp_path / "site")
    monkeypatch.setenv("PYTHONPATH", str(site))  # before the venv's editable install of the repository
    nb = nbformat.read(NOTEBOOK, as_version=4)
    stored = text_outputs(nb)
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])), (
        f"{NOTEBOOK.name} is stored without its outputs: run it and store them (see above)"
    )
    nb.cells.append(nbformat.v4.new_code_cell("import flax_ckpt\nprint(flax_ckpt.__file__)"))
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path / "cwd")}}
    )
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{NOTEBOOK.name} failed:\n{e}")
    where = nb.cells.pop().outputs[0].text.strip()
    assert Path(where).is_relative_to(site), f"the kernel imported flax_ckpt from {where}, not {site}"
    assert list((tmp_path / "cwd").iterdir()) == []  # nothing left beside the notebook
    assert list((tmp_path / "tmp").iterdir()) == []  # its checkpoints (about 190 MB) removed
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "best checkpoint (step" in outputs and "Dense_0 unchanged: True" in outputs
    assert "step 300 loss" in outputs and "removed" in outputs and "exists: False" in outputs
    assert "INFO flax_ckpt" in outputs and "INFO jax" not in outputs  # only the library's lines
    fresh = text_outputs(nb)
    assert len(fresh) == len(stored)
    for i, (old, new) in enumerate(zip(stored, fresh)):
        assert same_text(old, new), f"{NOTEBOOK.name}: code cell {i + 1} now prints\n{new}\nbut stores\n{old}"


def test_a_stored_output_matches_only_up_to_the_last_digits_of_a_float():
    old = "step 300, metrics {'loss': 0.06777171045541763}, 107656 bytes in 22 leaves"
    assert same_text(old, old.replace("0.06777171045541763", "0.06777171790599823"))  # another CPU model
    assert not same_text(old, old.replace("0.06777171045541763", "0.06812345678901234"))  # another run
    assert not same_text(old, old.replace("107656", "107657"))
    assert not same_text(old, old.replace("step 300", "step 200"))
    assert not same_text(old, old + " 0.1234567")  # a float more
