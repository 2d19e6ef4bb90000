"""What real programs hit, round four (issue 50): a filtered ``nnx.State`` (a LoRA loop that checkpoints
only what trains) restored into its model, grain's ``DataLoader`` (its state is ``bytes``) resumed with
its next batches, and the smaller things: readable key paths of tuple states, typed PRNG keys from a
target-less restore, the restore report's wording."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt.callbacks import CheckpointCallback, from_tree, to_tree
from helpers import TESTS, worker_env

ROOT = os.path.dirname(TESTS)


def end_group(proc: subprocess.Popen) -> None:
    """Ends the process group of ``proc`` (a session leader) once ``proc`` has ended or is killed here:
    SIGTERM first, which ends grain's worker processes but not multiprocessing's resource tracker (it
    ignores SIGTERM), so that the tracker, once the workers are gone, unlinks the semaphores and shared
    memory they left in /dev/shm (a SIGKILL of the whole group left 50 files there at each run of this
    module); then SIGKILL for whatever is still there once the group stops shrinking."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        alive, quiet = group_size(proc.pid), 0
        while alive and quiet < 50:  # waits while the group shrinks; 50 polls (>= 5 s) without change end it
            time.sleep(0.1)
            now = group_size(proc.pid)
            quiet = 0 if now < alive else quiet + 1
            alive = now


def group_size(pgid: int) -> int:
    """How many live processes are in process group ``pgid`` (from /proc)."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            n += fields[2] == str(pgid) and fields[0] != "Z"
    return n


def run_child(script, *args, expect=0):
    """Runs ``script`` (a path) with ``args`` in a session of its own; its stdout lines, after checking
    its exit status. Whatever it started (grain's worker processes, which outlive a SIGKILL) is ended
    once it has ended (``end_group``); its output goes to files, which such processes cannot hold open."""
    out, err = script.with_suffix(".out"), script.with_suffix(".err")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = forkserver.Popen(
            [sys.executable, str(script), *map(str, args)],
            stdout=stdout,
            stderr=stderr,
            cwd=ROOT,
            env=worker_env(1),
            start_new_session=True,
        )
    try:
        proc.wait(timeout=300)
    finally:
        end_group(proc)
    assert proc.returncode == expect, out.read_text() + err.read_text()
    return out.read_text().splitlines()


# ------------------------------------------------------------------- a LoRA loop: nnx.state(model, filter)

LORA_LOOP = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from flax_ckpt.callbacks import CheckpointCallback

    directory, stop_in = sys.argv[1], int(sys.argv[2])  # stop_in: the step during which SIGTERM comes


    class Model(nnx.Module):
        def __init__(self, rngs):
            self.base = nnx.Linear(4, 4, rngs=rngs)          # frozen: rebuilt from its seed, not saved
            self.lora = nnx.LoRA(4, 2, 4, rngs=rngs)          # trains: LoRAParam


        def __call__(self, x):
            return self.base(x) + self.lora(x)


    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.LoRAParam)


    @nnx.jit
    def train_step(model, optimizer, x):
        grad_fn = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x[:, ::-1]) ** 2),
                                     argnums=nnx.DiffState(0, nnx.LoRAParam))
        loss, grads = grad_fn(model)
        optimizer.update(model, grads)
        return loss


    ckpt = CheckpointCallback(directory, every_steps=4)
    (_, optimizer), start = ckpt.restore_or((nnx.state(model, nnx.LoRAParam), optimizer))
    for step in range(start, 8):
        x = jax.random.normal(jax.random.key(step), (8, 4))
        loss = train_step(model, optimizer, x)
        print("loss", step + 1, float(loss).hex(), flush=True)
        if step + 1 == stop_in:
            os.kill(os.getpid(), signal.SIGTERM)  # preempted during this step: saved at its end, exit 143
        ckpt(step + 1, (nnx.state(model, nnx.LoRAParam), optimizer))
    ckpt.close()
    lora = nnx.state(model, nnx.LoRAParam)
    print("final", [np.asarray(v).tobytes().hex() for v in jax.tree.leaves(lora)], flush=True)
""")


def test_a_lora_loop_resumes_bit_exact_after_sigterm(tmp_path):
    """The loop checkpoints only what trains, ``(nnx.state(model, nnx.LoRAParam), optimizer)``: the
    restored LoRA weights go into the model (the State's Variables are the model's own), so the run
    goes on as one never interrupted, loss for loss, and ends with the same weights, bit for bit. Slow
    (tens of seconds): three real runs (SIGTERMed, resumed, uninterrupted), each a process that imports
    flax.nnx and compiles."""
    script = tmp_path / "lora.py"
    script.write_text(LORA_LOOP)
    whole = run_child(script, tmp_path / "whole", 0)
    first = run_child(script, tmp_path / "run", 6, expect=143)
    assert first == whole[:6]
    second = run_child(script, tmp_path / "run", 0)
    assert second == whole[6:], (second, whole)


def test_a_state_of_copies_is_restored_with_a_warning_naming_the_fix(ckpt_dir, caplog):
    """A State whose leaves are not a model's Variables (arrays here; nnx.VariableState in flax
    versions whose nnx.state gives copies) reaches no model: restore_or says so and names the fix."""
    nnx = pytest.importorskip("flax.nnx")
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt:
        ckpt(1, {"lora": nnx.State({"a": jnp.ones(3)})})
    with CheckpointCallback(ckpt_dir, every_steps=1) as ckpt, caplog.at_level(logging.WARNING):
        restored, start = ckpt.restore_or({"lora": nnx.State({"a": jnp.zeros(3)})})
    assert start == 1 and np.asarray(restored["lora"]["a"]).tolist() == [1.0, 1.0, 1.0]
    assert "the nnx.State at 'lora' holds copies" in caplog.text
    assert "nnx.update(model, state)" in caplog.text


# --------------------------------------------------------------------- grain's DataLoader: bytes state

GRAIN_LOOP = textwrap.dedent('''
    import hashlib, os, signal, sys
    import numpy as np
    import grain.python as grain  # the worker processes import this module again: nothing heavy here


    class Records:
        """An in-memory data source: 64 records of 3 floats."""

        def __len__(self):
            return 64

        def __getitem__(self, i):
            return np.random.default_rng(i).standard_normal(3).astype(np.float32)

        def __repr__(self):  # grain checks that a restored position is of the same source by its repr
            return "Records(64)"


    def batches():
        sampler = grain.IndexSampler(64, grain.ShardOptions(0, 1), shuffle=True, num_epochs=None, seed=0)
        loader = grain.DataLoader(data_source=Records(), sampler=sampler, operations=[grain.Batch(4)],
                                  worker_count=2)
        return iter(loader)  # get_state() returns bytes


    if __name__ == "__main__":
        from absl import flags
        flags.FLAGS.mark_as_parsed()  # grain reads absl flags
        import jax.numpy as jnp
        from flax_ckpt.callbacks import CheckpointCallback

        directory, stop_in, sig = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        ckpt = CheckpointCallback(directory, every_steps=2)
        (state, data), start = ckpt.restore_or(({"w": jnp.zeros(3)}, batches()))
        print("start", start, flush=True)
        for step in range(start, 10):
            batch = next(data)
            print("batch", step + 1, hashlib.sha256(batch.tobytes()).hexdigest()[:16], flush=True)
            state = {"w": state["w"] + batch.mean(0)}
            if step + 1 == stop_in:
                os.kill(os.getpid(), getattr(signal, sig))  # during this step
            ckpt(step + 1, (state, data))
        ckpt.close()
        print("final", np.asarray(state["w"]).tobytes().hex(), flush=True)
''')


def committed_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_a_grain_data_loader_resumes_with_the_same_batches_after_sigterm_and_sigkill(tmp_path):
    """grain's DataLoader (2 worker processes) gives its position as bytes: stored as it is, given back
    to set_state, so a run stopped by SIGTERM (saved at that step), resumed, then killed by SIGKILL
    (resumed from the newest committed step), sees the batches of an uninterrupted run from each
    step it resumes at, and ends with the same state. Slow (a minute): four real runs (SIGTERMed,
    resumed then SIGKILLed, resumed, uninterrupted), each a process with two grain worker processes."""
    pytest.importorskip("grain.python")
    script = tmp_path / "grain_loop.py"
    script.write_text(GRAIN_LOOP)
    whole = run_child(script, tmp_path / "whole", 0, "SIGTERM")
    assert whole[0] == "start 0" and len(whole) == 12
    batch_at = {int(line.split()[1]): line for line in whole if line.startswith("batch")}
    run = tmp_path / "run"

    assert run_child(script, run, 3, "SIGTERM", expect=143) == whole[:4]  # saves step 3, exits
    assert committed_steps(run)[-1] == 3
    resumed = run_child(script, run, 7, "SIGKILL", expect=-signal.SIGKILL)
    assert resumed == ["start 3", *(batch_at[s] for s in range(4, 8))]
    newest = committed_steps(run)[-1]  # 4 or 6: the save of step 6 may have been cut short
    assert newest in (4, 6)
    resumed = run_child(script, run, 0, "SIGTERM")
    assert resumed == [f"start {newest}", *(batch_at[s] for s in range(newest + 1, 11)), whole[-1]]


def test_bytes_in_a_get_state_are_stored_as_uint8_and_given_back_as_bytes(tmp_path):
    """Any get_state() that returns bytes (or holds them): a uint8 array in the checkpoint, bytes again
    for set_state, whatever the length of the position's text now."""

    class Position:
        def __init__(self, text):
            self.text = text

        def get_state(self):
            return {"text": self.text, "n": len(self.text)}

        def set_state(self, state):
            assert isinstance(state["text"], bytes)
            self.text = state["text"]

    with CheckpointCallback(tmp_path / "run", every_steps=1) as ckpt:
        ckpt(1, {"data": Position(b'{"index": 12345}')})
    leaf = fc.metadata(tmp_path / "run" / "1").tree["data"]["text"]
    assert (leaf.dtype, leaf.shape) == ("uint8", (16,))
    data = Position(b'{"index": 0}')  # a shorter text than the one saved
    with CheckpointCallback(tmp_path / "run", every_steps=1) as ckpt:
        (restored, start) = ckpt.restore_or({"data": data})
    assert start == 1 and restored["data"] is data and data.text == b'{"index": 12345}'
    assert to_tree({"d": data})["d"]["text"].tobytes() == data.text
    from_tree({"d": data}, {"d": {"text": np.frombuffer(b"xy", np.uint8), "n": 2}})
    assert data.text == b"xy"


# ---------------------------------------------------------------------------------- the smaller items


def test_a_target_less_restore_gives_typed_keys_as_the_docs_say(tmp_path):
    """Without a target, a typed key comes back a typed key (the docs say so, and how to get its
    words); a raw key is a uint32 array, numpy like everything else."""
    key, raw = jax.random.key(3), jax.random.PRNGKey(4)
    fc.save(tmp_path / "1", {"key": key, "raw": raw, "w": jnp.ones(2)})
    got = fc.restore(tmp_path / "1")
    assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
    assert np.array_equal(np.asarray(jax.random.key_data(got["key"])), jax.random.key_data(key))
    assert isinstance(got["raw"], np.ndarray) and isinstance(got["w"], np.ndarray)
    assert np.array_equal(got["raw"], raw)
    with pytest.raises(TypeError):
        np.asarray(got["key"])  # what the docs warn of
    engine_md = open(os.path.join(ROOT, "docs", "engine.md")).read()
    for doc in (fc.restore.__doc__, engine_md):
        assert "typed key arrays" in doc and "jax.random.key_data(key)" in doc


def test_the_report_tells_leaves_a_rename_dropped_from_leaves_the_target_lacks(tmp_path):
    fc.save(tmp_path / "1", {"params": {"encoder": {"w": jnp.ones(2)}, "head": {"w": jnp.ones(3)}}, "opt": 1})
    target = {"params": {"backbone": {"w": jnp.zeros(2)}}}
    _, report = fc.restore(
        tmp_path / "1",
        target,
        rename={r"params/encoder/(.*)": r"params/backbone/\1", r"params/head/.*": None},
        unexpected="ignore",
        report=True,
    )
    assert report.ignored == ("opt", "params/head/w") and report.dropped == ("params/head/w",)
    assert report.summary() == (
        "restored 1 leaves (1 renamed); ignored 1 a rename dropped: 'params/head/w'; "
        "ignored 1 the target lacks: 'opt'"
    )
    _, report = fc.restore(tmp_path / "1", rename={r"params/head/.*": None}, report=True)  # no target
    assert report.dropped == ("params/head/w",)
    assert report.summary() == "restored 2 leaves; ignored 1 a rename dropped: 'params/head/w'"


def test_the_documented_loops_name_their_parts():
    """The guides and the examples give the callback a dict of named parts, so that `flax-ckpt info`
    shows 'model/...', 'optimizer/...', 'data/...' rather than a tuple's '0/', '1/', '2/'."""
    import glob
    import re

    loops = re.compile(r"restore_or\(\(|ckpt\([^,()]+, \(")
    files = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    files += glob.glob(os.path.join(ROOT, "examples", "*.py")) + [os.path.join(ROOT, "examples", "README.md")]
    tuples = [
        f"{os.path.relpath(f, ROOT)}: {m.group(0)}" for f in files for m in loops.finditer(open(f).read())
    ]
    assert tuples == []
    info = open(os.path.join(ROOT, "docs", "training-loop.md")).read()
    assert "its parts are `0/`, `1/`, `2/`" in info
