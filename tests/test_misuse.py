"""Misuse that must fail cleanly: threads saving through one manager, saves inside traced functions,
malformed stored state, tools on runs without steps, a follower beside Orbax's own writer. Each a
CheckpointError (or ValueError) naming what happened and the fix, or the tool's plain answer."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_ckpt as fc

THREADS, STEPS = 8, 6


def _state(step: int) -> dict:
    return {"a": jnp.full((256, 257), step, jnp.float32), "b": jnp.arange(3000, dtype=jnp.int32) * step}


def test_threads_saving_through_one_manager_commit_every_step_intact(tmp_path):
    """Item 4: 8 threads save 24 steps each through one manager: every save that returned True
    restores bit-exact (it used to commit steps whose data failed their checksum: two snapshots taken
    at once into one host buffer)."""
    mgr = fc.CheckpointManager(tmp_path / "run")
    real, inside, met = mgr._store.snapshot, [0], [0]

    def snapshot(*args, **kwargs):  # the race made likely: each snapshot waits a little for another
        inside[0] += 1
        t0 = time.perf_counter()
        while inside[0] < 2 and time.perf_counter() - t0 < 0.02:
            time.sleep(0.001)
        met[0] = max(met[0], inside[0])
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] -= 1

    mgr._store.snapshot = snapshot
    saved: dict[int, bool] = {}
    errors: list[BaseException] = []

    def saver(t: int) -> None:
        try:
            for k in range(STEPS):
                step = t * STEPS + k + 1
                saved[step] = mgr.save(step, _state(step), force=True)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mgr.wait_until_finished()
    assert errors == []
    assert sorted(s for s, ok in saved.items() if ok) == list(range(1, THREADS * STEPS + 1))
    assert mgr.all_steps() == list(range(1, THREADS * STEPS + 1))
    damaged = []
    for step in mgr.all_steps():
        try:
            got = mgr.restore(step)
        except fc.CorruptCheckpointError as e:
            damaged.append((step, str(e)[:120]))
            continue
        want = jax.device_get(_state(step))
        if not all(np.array_equal(got[k], want[k]) for k in want):
            damaged.append((step, "values differ"))
    mgr.close()
    assert damaged == []
    assert met[0] == 1  # one snapshot at a time


# --------------------------------------------------------------------- item 9: errors that name the fix


@pytest.mark.parametrize("mode", ["never", "auto"])
@pytest.mark.parametrize("async_save", [True, False])
def test_a_step_that_failed_on_the_device_is_a_checkpoint_error(tmp_path, monkeypatch, mode, async_save):
    """The state's computation failed on the device (an XLA runtime error, e.g. out of memory),
    met where ``save`` waits for it on the host path (FLAX_CKPT_DEVICE_SNAPSHOT=never, or leaves over
    the budget): a CheckpointError saying so, its cause attached, nothing committed (it was the raw
    JaxRuntimeError)."""
    from flax_ckpt._src.engine import snapshot as snapshot_mod

    def failed(*_):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0G")

    monkeypatch.setenv("FLAX_CKPT_DEVICE_SNAPSHOT", mode)
    monkeypatch.setenv("FLAX_CKPT_DEVICE_BUDGET", "0")
    monkeypatch.setattr(snapshot_mod, "_wait_for_host_part", failed)
    with fc.CheckpointManager(tmp_path / "run", async_save=async_save) as mgr:
        with pytest.raises(fc.CheckpointError, match="failed on the device .*RESOURCE_EXHAUSTED") as e:
            mgr.save(1, _state(1))
        assert isinstance(e.value.__cause__, jax.errors.JaxRuntimeError)
        assert mgr.all_steps() == []


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "lots"])
def test_a_device_budget_that_is_no_number_of_bytes_is_a_value_error_naming_it(tmp_path, monkeypatch, value):
    monkeypatch.setenv("FLAX_CKPT_DEVICE_SNAPSHOT", "always")
    monkeypatch.setenv("FLAX_CKPT_DEVICE_BUDGET", value)
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        with pytest.raises(ValueError, match=f"FLAX_CKPT_DEVICE_BUDGET='{value}': give a finite number"):
            mgr.save(1, _state(1))


def test_close_from_another_thread_during_save_waits_for_it(tmp_path):
    """close() called on another thread while save() runs: the save commits, then the manager closes
    (it was a raw RuntimeError from the save: the writer closed under it)."""
    mgr = fc.CheckpointManager(tmp_path / "run", async_save=False)
    real, in_save, closing, closed = (
        mgr._store.snapshot,
        threading.Event(),
        threading.Event(),
        threading.Event(),
    )

    def snapshot(*args, **kwargs):  # the save is inside; close() is called meanwhile
        in_save.set()
        closing.wait()
        closed.wait(0.5)  # a close that does not wait for the save is done by now
        return real(*args, **kwargs)

    mgr._store.snapshot = snapshot
    result: list = []
    saver = threading.Thread(target=lambda: result.append(_call(mgr.save, 1, _state(1))))
    saver.start()
    in_save.wait()

    def close():
        closing.set()
        mgr.close()
        closed.set()

    closer = threading.Thread(target=close)
    closer.start()
    saver.join()
    closer.join()
    assert result == [True]
    assert closed.is_set()
    assert fc.CheckpointManager(tmp_path / "run", read_only=True).all_steps() == [1]
    with pytest.raises(fc.CheckpointError, match="is closed"):
        mgr.save(2, _state(2))


def _call(f, *args):
    try:
        return f(*args)
    except Exception as e:  # noqa: BLE001  (compared by the test)
        return e


def test_save_inside_jit_is_a_checkpoint_error_saying_so(tmp_path):
    with fc.CheckpointManager(tmp_path / "run") as mgr:

        @jax.jit
        def step(x):
            mgr.save(1, {"params": {"w": x}})
            return x + 1

        with pytest.raises(fc.CheckpointError, match=r"\['params'\]\['w'\] is a tracer .* inside a traced"):
            step(jnp.ones(3))
        assert mgr.all_steps() == []


@pytest.mark.parametrize("transform", ["jit", "vmap", "grad", "scan"])
def test_fc_save_inside_a_traced_function_is_a_checkpoint_error_saying_so(tmp_path, transform):
    """``fc.save`` inside jit/vmap/grad/scan was a raw ConcretizationTypeError (or TracerArrayConversion
    error); it is the CheckpointError the manager gives, naming the leaf and the fix, and writes nothing."""
    where = tmp_path / "ck"

    def f(x):
        fc.save(where, {"params": {"w": x}})
        return (x * 2.0).sum()

    traced = {
        "jit": lambda x: jax.jit(f)(x),
        "vmap": lambda x: jax.vmap(f)(x[None]),
        "grad": lambda x: jax.grad(f)(x),
        "scan": lambda x: jax.lax.scan(lambda c, _: (c, f(c)), x, None, length=2),
    }[transform]
    with pytest.raises(fc.CheckpointError, match=r"save to .*ck: leaf \['params'\]\['w'\] is a tracer"):
        traced(jnp.ones(3))
    assert not where.exists()


@pytest.mark.parametrize("damage", ["position", "zeros", "flag", "nan", "inf"])
def test_a_malformed_stored_random_state_is_refused(tmp_path, damage):
    """The stored state of Python's ``random`` (628 words): a position past the 624 words was a raw
    ValueError of random.setstate; all-zero words were accepted, and random() returned 0.0 forever; a
    gauss_next flag other than 0/1, or a gauss_next that is no finite number (random.gauss() would
    return it next), was accepted. Refused, naming the step and the item."""
    import random

    from flax_ckpt.callbacks import CheckpointCallback
    from flax_ckpt.callbacks.state import encode_random

    words = np.zeros(628, np.uint32)
    if damage == "position":
        words[:624], words[624] = np.arange(1, 625), 700
    elif damage != "zeros":
        words = encode_random(random.Random(3).getstate())
        words[625] = 2 if damage == "flag" else 1
        words[626:] = np.array([0.5 if damage == "flag" else float(damage)], "<f8").view("<u4")
    with fc.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(5, {"rng": words, "w": np.ones(2, np.float32)})
    cb = CheckpointCallback(tmp_path / "run")
    live = random.Random(1)
    before = live.getstate()
    with pytest.raises(
        fc.CorruptCheckpointError, match="random generator at 'rng' is not one it can resume"
    ) as e:
        cb.restore_or({"rng": live, "w": np.zeros(2, np.float32)})
    cb.close()
    assert str(e.value).startswith(f"step 5 of {tmp_path / 'run'}: "), e.value
    assert live.getstate() == before


def test_verify_on_a_run_with_a_config_file_and_no_step_says_no_steps(tmp_path, capsys):
    from flax_ckpt._src.tools.cli import main as cli

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"lr": 0.1}')
    assert cli(["ls", str(tmp_path / "run")]) == 0
    assert cli(["verify", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"no steps in {tmp_path / 'run'}: nothing to verify" in out, out


@pytest.mark.parametrize("named", [True, False])
def test_a_follower_beside_orbax_deleting_a_step_reports_it_gone_not_damaged(
    tmp_path, monkeypatch, caplog, named
):
    """Orbax's own manager deletes a step's files first (many at a time, in no order), then its folder:
    a read-only follower that meets the step half deleted reports it gone (a named step: a
    CheckpointNotFoundError naming the steps there; the listing: not there), never damaged (it was a
    CorruptCheckpointError, or a "damaged step" warning at each listing). The deletion goes on by one
    file each time the follower looks at the folder (so that it progresses however busy the machine)."""
    import logging
    import os
    import shutil
    import types

    try:
        from flax_ckpt._src.manager import vanishing
    except ImportError:  # before the fix: nothing watches the folder, so the deletion stays half done
        vanishing = types.SimpleNamespace()

    run = tmp_path / "run"
    with fc.CheckpointManager(run, format="orbax", async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full(64, step, np.float32), "b": np.arange(8) * step})
    follower = fc.CheckpointManager(run, read_only=True)
    assert follower.all_steps() == [1, 2, 3]
    files = sorted(os.path.join(top, n) for top, _, names in os.walk(run / "1") for n in names)
    for path in files[: len(files) // 2 + 1]:  # Orbax's deleter is half way through step 1
        os.unlink(path)
    left = files[len(files) // 2 + 1 :]
    real = getattr(vanishing, "_entries", None)

    def look(path):  # the deleter removes one more file between two looks, then the folder
        if left:
            os.unlink(left.pop())
        else:
            shutil.rmtree(run / "1", ignore_errors=True)
        return real(path)

    monkeypatch.setattr(vanishing, "_entries", look, raising=False)
    caplog.set_level(logging.WARNING, "flax_ckpt")
    if named:
        with pytest.raises(fc.CheckpointNotFoundError, match=r"step 1 .*\[2, 3\]"):
            follower.restore(1)
    else:
        assert follower.all_steps() == [2, 3]
        assert follower.restore()["b"].tolist() == (np.arange(8) * 3).tolist()
    assert [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()] == []
    assert not (run / "1").exists()


def test_a_step_orbax_starts_deleting_while_the_follower_reads_it_is_reported_gone(tmp_path, monkeypatch):
    """The deletion begins after the follower listed the step and before it read its arrays: the
    step's metadata is still there (so the listing keeps it) but its array files are gone; the
    follower watches the folder empty, and a named step is a CheckpointNotFoundError saying it was
    deleted while being restored (it was a CorruptCheckpointError)."""
    import os
    import shutil
    import types

    try:
        from flax_ckpt._src.manager import vanishing
    except ImportError:  # before the fix
        vanishing = types.SimpleNamespace()

    run = tmp_path / "run"
    with fc.CheckpointManager(run, format="orbax", async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(64, step, np.float32)})
    follower = fc.CheckpointManager(run, read_only=True)
    assert follower.all_steps() == [1, 2]
    files = sorted(os.path.join(top, n) for top, _, names in os.walk(run / "1") for n in names)
    data = [p for p in files if not os.path.basename(p).startswith(("_", "commit_success"))]
    left = [p for p in files if p not in data]
    restore = follower._directory._restore.restore

    def begun(*args, **kwargs):  # Orbax's deleter starts with the array files
        for path in data:
            if os.path.exists(path):
                os.unlink(path)
        return restore(*args, **kwargs)

    real = getattr(vanishing, "_entries", None)

    def look(path):  # ... and goes on by one file each time the follower looks, then the folder
        if left:
            os.unlink(left.pop())
        else:
            shutil.rmtree(run / "1", ignore_errors=True)
        return real(path)

    monkeypatch.setattr(follower._directory._restore, "restore", begun)
    monkeypatch.setattr(vanishing, "_entries", look, raising=False)
    with pytest.raises(fc.CheckpointNotFoundError, match="step 1 .* was deleted while it was being restored"):
        follower.restore(1)


@pytest.mark.parametrize("inside", ["tensorboard", "compile_cache", "data", "default"])
def test_verify_on_a_run_with_only_a_folder_of_its_own_says_no_steps(tmp_path, capsys, inside):
    """A run that holds only a folder (``tensorboard/``, or the ``compile_cache/`` the callback creates
    before its first save) has no steps: exit 0, as for a file. A checkpoint's part (a native
    ``data/``, an Orbax item with its files) is a save that never committed: exit 2."""
    from flax_ckpt._src.tools.cli import main as cli

    sub = tmp_path / "run" / inside
    sub.mkdir(parents=True)
    part = {"data": "p0-1a2b.0.bin", "default": "_METADATA"}.get(inside, "events.out.tfevents.1")
    (sub / part).write_bytes(b"x")
    own = inside in ("tensorboard", "compile_cache")
    assert cli(["verify", str(tmp_path / "run")]) == (0 if own else 2)
    captured = capsys.readouterr()
    if own:
        assert f"no steps in {tmp_path / 'run'}: nothing to verify" in captured.out, captured
    else:
        assert "holds no committed checkpoint" in captured.err, captured
