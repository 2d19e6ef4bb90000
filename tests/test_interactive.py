"""CheckpointCallback in a real Jupyter kernel (issue 43, items 6 and 8): a cell run again after its loop
raised works (the earlier, unclosed callback of the kernel is closed, with a warning), and a Ctrl-C
(SIGINT, the kernel's interrupt) or a SIGTERM sent to the kernel saves, ends the loop with one line
(``Preempted``) instead of SystemExit's traceback and IPython's "To exit" warning, and leaves the kernel
running, so that running the cell again resumes from the saved step.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient

TIMEOUT_S = 120

LOOP = textwrap.dedent("""
    import time
    import numpy as np
    from flax_ckpt.callbacks import CheckpointCallback
    ckpt = CheckpointCallback(DIR, every_steps=EVERY)
    state, start = ckpt.restore_or({"w": np.zeros(3)})
    print("start", start, flush=True)
    for step in range(start, 40):
        state = {"w": state["w"] + 1}
        if step == FAIL_AT:
            raise ValueError("the loop failed at step %d" % step)
        if step == start + 3:
            print("looping", flush=True)
        time.sleep(SLEEP)
        ckpt(step + 1, state)
    ckpt.close()
    print("done", int(state["w"][0]), flush=True)
""")


def _cell(directory, *, every: int, fail_at: int, sleep: float) -> str:
    return f"DIR, EVERY, FAIL_AT, SLEEP = {str(directory)!r}, {every}, {fail_at}, {sleep}\n" + LOOP


def _outputs(cell) -> str:
    return "".join(
        o.get("text", "") + "".join(o.get("traceback", [])) + o.get("ename", "")
        for o in cell.get("outputs", [])
    )


def test_cell_run_again_after_its_loop_raised(tmp_path):
    """Cell 1 saves steps 5 and 10, then raises at step 12 without ckpt.close(); running it again (its
    code unchanged but for the failure) resumes from step 10 and finishes: the callback of the first run
    is closed with a warning saying so, instead of CheckpointLockedError naming the kernel's own pid."""
    directory = tmp_path / "run"
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(_cell(directory, every=5, fail_at=12, sleep=0)),
        nbformat.v4.new_code_cell(_cell(directory, every=5, fail_at=-1, sleep=0)),
    ]
    NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", allow_errors=True).execute()
    first, again = _outputs(nb.cells[0]), _outputs(nb.cells[1])
    assert "ValueError" in first and "the loop failed at step 12" in first
    assert "CheckpointLockedError" not in again, again
    assert "start 10" in again and "done 40" in again, again
    assert "was never closed" in again and "closing it now" in again, again
    assert sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())[-1] == 40


def _drain(kc, msg_id: str, until: str | None = None) -> tuple[str, list[dict]]:
    """The text a cell printed (streams and errors) until ``until`` appears, or until it ends; its errors."""
    text, errors, deadline = "", [], time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=TIMEOUT_S)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text += content["text"]
        elif kind == "error":
            errors.append(content)
            text += content["ename"] + "\n" + "\n".join(content["traceback"])
        elif kind == "status" and content["execution_state"] == "idle":
            return text, errors
        if until is not None and until in text:
            return text, errors
    raise AssertionError(f"the cell did not finish in {TIMEOUT_S} s:\n{text}")


@pytest.mark.parametrize("how", ["interrupt", "SIGTERM"])
def test_interrupt_in_a_kernel_saves_and_stops_without_system_exit(tmp_path, how):
    """The kernel's interrupt (SIGINT, what Ctrl-C and the stop button send) or a SIGTERM while the loop
    runs: the step is saved, the cell ends with one ``Preempted`` line (no SystemExit, no traceback, no
    "To exit" warning), the kernel lives on, and the cell run again resumes from the saved step."""
    directory = tmp_path / "run"
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=TIMEOUT_S)
        msg_id = kc.execute(_cell(directory, every=1000, fail_at=-1, sleep=0.05))
        text, _ = _drain(kc, msg_id, until="looping")
        if how == "interrupt":
            km.interrupt_kernel()
        else:
            os.kill(km.provisioner.process.pid, signal.SIGTERM)
        more, errors = _drain(kc, msg_id)
        text += more
        assert [e["ename"] for e in errors] == ["Preempted"], text
        [line] = errors[0]["traceback"]
        name = "SIGINT" if how == "interrupt" else "SIGTERM"
        assert line.startswith(f"Preempted: {name}: step ") and "durable" in line, line
        assert "SystemExit" not in text and "To exit" not in text and "Traceback" not in text, text
        saved = int(line.split("step ")[1].split()[0])
        assert (directory / str(saved)).is_dir()
        msg_id = kc.execute(_cell(directory, every=1000, fail_at=-1, sleep=0))  # the kernel lives on
        text, errors = _drain(kc, msg_id)
        assert not errors and f"start {saved}" in text and "done 40" in text, text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
