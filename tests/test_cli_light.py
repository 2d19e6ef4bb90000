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
import pytest

import flax_ckpt as fc
from flax_ckpt._src.tools.cli import main as cli


def test_info_shows_the_values_of_scalars_strings_and_empty_leaves(tmp_path, capsys):
    path = tmp_path / "ck"
    fc.save(
        path,
        {
            "w": np.ones(2, np.float32),
            "step": 7,
            "lr": 0.001,
            "name": "run-a",
            "flag": True,
            "z": 1 + 2j,
            "none": None,
            "empty": {},
        },
        step=7,
    )
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
        7,
        0.001,
        "run-a",
        True,
        "(1+2j)",
        None,
        {},
    ]
    assert "value" not in leaves["w"]  # arrays: their bytes are never read by info


HEAVY = ("jax", "tensorstore", "ml_dtypes")
IMPORTED = (
    "import sys; from flax_ckpt._src.tools.cli import main; rc = main(sys.argv[1:]); "
    "print(sorted(m for m in %r if m in sys.modules), file=sys.stderr); sys.exit(rc)" % (HEAVY,)
)


def _cpu(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``python *argv`` in a fresh interpreter: its result and the CPU seconds it took (user +
    system: what the machine's load inflates least)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def _cli_cpu(*args: str) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """Runs the command in a fresh interpreter: its result, the CPU seconds it took and which of HEAVY
    it imported."""
    r, cpu = _cpu("-c", IMPORTED, *args)
    return r, cpu, json.loads(r.stderr.strip().splitlines()[-1].replace("'", '"'))


CPU_RATIO = 5  # a command's CPU time, in fresh interpreters that import numpy (about 3 here, 13 for jax)


def _numpy_start() -> float:
    """The unit a command's CPU time is judged in, measured now on this machine: the CPU seconds of a
    fresh interpreter that imports numpy (as every command does), the least of three. Skips the test
    when three identical starts differ by more than twice: CPU times here are too noisy to judge."""
    runs = [_cpu("-c", "import numpy")[1] for _ in range(3)]
    if max(runs) > 2 * min(runs):
        pytest.skip(f"three starts of `python -c 'import numpy'` took {runs} s of CPU: too noisy to judge")
    return min(runs)


def test_ls_verify_and_info_of_a_local_native_run_import_no_jax_and_cost_a_few_numpy_imports(tmp_path):
    """Each command costs at most CPU_RATIO times the CPU of an interpreter that imports numpy (the least
    of two runs each, calibrated in this run: a busy machine slows both alike); importing jax alone costs
    about 13 times as much."""
    run = tmp_path / "run"
    for s in (1, 2, 3):
        fc.save(
            run / str(s),
            {"w": np.full((4, 4), s, np.float32), "b": np.ones(3, np.int8), "step": s},
            step=s,
            metrics={"loss": 1.0 / s},
        )
    unit = _numpy_start()
    for args in (
        ["ls", str(run)],
        ["verify", str(run)],
        ["info", str(run / "3")],
        ["prune", str(run), "--keep", "3"],
    ):
        cpus = []
        for _ in range(2):
            r, cpu, heavy = _cli_cpu(*args)
            assert r.returncode == 0, (args, r.stdout, r.stderr)
            assert heavy == [], (args, heavy)
            cpus.append(cpu)
        assert min(cpus) < CPU_RATIO * unit, (args, cpus, f"an interpreter importing numpy: {unit:.3f} s")
    r, _, _ = _cli_cpu("ls", str(run))
    assert [ln.split()[0] for ln in r.stdout.splitlines()[1:]] == ["1", "2", "3"]


def test_a_step_that_needs_jax_still_gets_it(tmp_path):
    """A bfloat16 leaf needs ml_dtypes to be described, a zarr3 step tensorstore: imported then."""
    import jax.numpy as jnp

    fc.save(tmp_path / "bf16", {"w": jnp.ones(3, jnp.bfloat16)})
    r, _, heavy = _cli_cpu("info", str(tmp_path / "bf16"))
    assert r.returncode == 0 and "bfloat16" in r.stdout and "ml_dtypes" in heavy, (r.stdout, r.stderr)
    fc.save(tmp_path / "zarr", {"w": np.ones(3, np.float32)}, serializer="zarr3")
    r, _, heavy = _cli_cpu("verify", str(tmp_path / "zarr"))
    assert r.returncode == 0 and r.stdout.startswith("OK ") and "tensorstore" in heavy, (r.stdout, r.stderr)
