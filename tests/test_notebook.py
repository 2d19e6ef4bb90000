"""notebooks/finetune.ipynb runs top to bottom in a fresh kernel, in a temporary folder, so it cannot rot.

The notebook asserts its own claims (frozen layer unchanged, the best checkpoint restores to its stored
metric); this test only runs it and reports the failing cell.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "finetune.ipynb"


def test_finetune_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # one CPU device in the kernel, as a user has
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{NOTEBOOK.name} failed:\n{e}")
    assert (tmp_path / "pretrained" / "300").is_dir() and (tmp_path / "finetune").is_dir()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "best checkpoint (step" in outputs and "Dense_0 unchanged: True" in outputs
