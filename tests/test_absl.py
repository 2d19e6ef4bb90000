"""The resume line under absl (issue 27): a training program in the style of Flax's examples (``absl.app``,
``absl.logging`` at INFO) shows "resumed from step N of DIR" once on stderr, as its other INFO lines.

absl's default under ``app.run`` is INFO (the verbosity flag goes from WARNING to INFO once flags are
parsed) and its handler sits on the root logger, so the line is logged through it. Outside ``app.run``
(a program that parses flags itself, a launcher, a notebook) ``absl.logging.info`` calls
``logging.basicConfig()``: the root logger gets a handler but stays at WARNING while absl's logger is at
INFO, so the user's absl INFO lines show and a logged INFO line of ours would not.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from helpers import worker_env

PROGRAM = textwrap.dedent("""
    import sys
    from absl import app, flags, logging
    import jax, jax.numpy as jnp, optax
    from flax_ckpt.callbacks import CheckpointCallback

    flags.DEFINE_string("workdir", None, "where the checkpoints go")
    flags.DEFINE_integer("steps", 6, "training steps")
    flags.DEFINE_enum("how", "app", ["app", "app-default", "no-app"], "how the program runs")
    FLAGS = flags.FLAGS

    def main(argv):
        if FLAGS.how != "app-default":
            logging.set_verbosity(logging.INFO)  # what Flax's examples do
        logging.info("JAX process: %d / %d", jax.process_index(), jax.process_count())
        tx = optax.sgd(0.1)
        params = {"w": jnp.arange(4.0)}
        state = {"params": params, "opt": tx.init(params)}
        ckpt = CheckpointCallback(FLAGS.workdir, every_steps=2)
        state, start = ckpt.restore_or(state)
        for step in range(start, FLAGS.steps):
            grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(state["params"])
            updates, opt = tx.update(grads, state["opt"])
            state = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
            ckpt(step + 1, state)
        ckpt.close()
        logging.info("trained steps %d to %d", start, FLAGS.steps)

    if __name__ == "__main__":
        if "--how=no-app" in sys.argv:
            FLAGS(sys.argv)  # flags parsed by the program itself, main called directly
            main(sys.argv)
        else:
            app.run(main)
""")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("absl") / "train.py"
    path.write_text(PROGRAM)

    def run(workdir, *flags: str) -> subprocess.CompletedProcess:
        r = forkserver.run(
            [sys.executable, str(path), f"--workdir={workdir}", *flags],
            capture_output=True,
            text=True,
            timeout=180,
            env=worker_env(devices=1),
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    return run


@pytest.mark.parametrize("how", ["app", "app-default", "no-app"])
def test_the_resume_line_shows_once_under_absl_at_info(program, tmp_path, how):
    """Under absl at INFO (app.run, its default flags, or no app), the resume line shows once. Slow
    (seconds): two runs of the user's absl program, each a process."""
    workdir = tmp_path / "run"
    first = program(workdir, "--steps=3", f"--how={how}")
    assert "trained steps 0 to 3" in first.stderr, first.stderr  # the user's absl INFO lines show
    assert f"no checkpoint in {workdir}; starting from step 0" in first.stderr, first.stderr
    second = program(workdir, "--steps=6", f"--how={how}")
    assert "trained steps 3 to 6" in second.stderr, second.stderr
    assert second.stderr.count(f"resumed from step 3 of {workdir}") == 1, second.stderr
    with fc.CheckpointManager(workdir) as mgr:
        assert mgr.all_steps() == [3, 4, 6]  # step 3: saved by close() at the end of the first run
        np.testing.assert_allclose(mgr.restore(6)["params"]["w"], np.arange(4.0) * 0.8**6, rtol=1e-6)


def test_absl_verbosity_above_info_keeps_the_line_quiet(program, tmp_path):
    """The user's own choice: --verbosity=-1 (WARNING) drops INFO lines, this one too. Slow (seconds): two
    runs of the user's absl program, each a process."""
    workdir = tmp_path / "run"
    program(workdir, "--steps=2", "--how=app-default")
    quiet = program(workdir, "--steps=2", "--how=app-default", "--verbosity=-1")
    assert "resumed from step" not in quiet.stderr and "trained steps" not in quiet.stderr, quiet.stderr


GRAIN_PROGRAM = textwrap.dedent("""
    import logging, sys
    import grain, orbax.checkpoint  # leave the root logger at WARNING with a handler
    from absl import logging as absl_logging  # absl's verbosity at its default, WARNING
    import numpy as np
    from flax_ckpt.callbacks import CheckpointCallback

    def run(tag, steps):
        with CheckpointCallback(sys.argv[1], every_steps=1) as ckpt:
            _, start = ckpt.restore_or({"w": np.zeros(2)})
            for step in range(start, steps):
                ckpt(step + 1, {"w": np.full(2, step + 1.0)})
        print(f"{tag} done", file=sys.stderr, flush=True)

    assert logging.getLogger().handlers and logging.getLogger().level == logging.WARNING
    run("fresh", 2)
    run("resumed", 3)  # the line on stderr, though logging drops INFO lines
    logging.getLogger().setLevel(logging.INFO)
    run("logged", 4)  # through grain's handler, once
    logging.getLogger("flax_ckpt").setLevel(logging.WARNING)
    run("quiet", 5)  # the user's choice: no line
""")


def test_the_resume_line_shows_once_after_grain_and_orbax_set_up_logging(tmp_path):
    """grain's and orbax's imports leave logging where an INFO line reaches no one: the fresh start and
    the resume still show, once each, and once more through logging when the root logger takes INFO;
    setting the flax_ckpt logger above INFO silences them."""
    pytest.importorskip("grain")
    pytest.importorskip("orbax.checkpoint")
    program = tmp_path / "train.py"
    program.write_text(GRAIN_PROGRAM)
    workdir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, str(program), str(workdir)],
        capture_output=True,
        text=True,
        timeout=180,
        env=worker_env(devices=1),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    fresh, resumed, logged, quiet = r.stderr.split(" done\n")[:4]
    assert fresh.count(f"no checkpoint in {workdir}; starting from step 0") == 1, r.stderr
    assert resumed.count(f"resumed from step 2 of {workdir}") == 1, r.stderr
    assert logged.count("resumed from step 3 of") == 1, r.stderr
    assert f"INFO:flax_ckpt.callbacks:resumed from step 3 of {workdir}" in logged, r.stderr
    assert "resumed from step" not in quiet, r.stderr
