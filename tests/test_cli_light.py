"""The command line as a monitoring job or a person uses it (issue 43, item 9): ``info`` shows the
values of Python scalars and strings, and ``ls``/``verify``/``info`` of a local native run import no
jax (nor tensorstore) unless a step needs it, so that they answer quickly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np

import flax_ckpt as fc
from flax_ckpt._src.cli import main as cli


def test_info_shows_the_values_of_scalars_strings_and_empty_leaves(tmp_path, capsys):
    path = tmp_path / "ck"
    fc.save(path, {"w": np.ones(2, np.float32), "step": 7, "lr": 0.001, "name": "run-a", "flag": True,
                   "z": 1 + 2j, "none": None, "empty": {}}, step=7)
    assert cli(["info", str(path)]) == 0
    rows = {ln.split()[0]: ln.split()[1:] for ln in capsys.readouterr().out.splitlines()[4:-1]}
    assert rows["step"] == ["scalar", "int", "-", "0", "7"]
    assert rows["lr"] == ["scalar", "float", "-", "0", "0.001"]
    assert rows["name"] == ["string", "-", "-", "0", '"run-a"']
    assert rows["flag"][-1] == "True" and rows["z"][-1] == "(1+2j)"
    assert rows["none"][-1] == "None" and rows["empty"][-1] == "{}" and rows["w"][-1] == "-"
    assert cli(["info", str(path), "--json"]) == 0
    leaves = {d["key"]: d for d in json.loads(capsys.readouterr().out)["leaves"]}
    assert [leaves[k]["value"] for k in ("step", "lr", "name", "flag", "z", "none", "empty")] == [
        7, 0.001, "run-a", True, "(1+2j)", None, {}]
    assert "value" not in leaves["w"]  # arrays: their bytes are never read by info
