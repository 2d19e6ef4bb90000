"""What a restart after a preemption costs, from process start to the first training step, by phase.

    python benchmarks/bench_resume.py                 # the decoder of bench_accelerator.py (~1 GiB)
    python benchmarks/bench_resume.py --small         # a small decoder: a CPU in a minute or two
    python benchmarks/bench_resume.py --rounds 3 --modes fresh,fc,fc-nocache,orbax

Each measurement is a fresh process (as a restarted job is), in interleaved rounds (each round runs
every mode once, the order rotated by one per round). The phases, in seconds from the process's start
(the parent's clock when it starts the child): ``imports`` (jax, flax, optax, the checkpoint library),
``backend`` (the first jax operation: the device's runtime comes up), ``init`` (the program builds its
fresh TrainState, as a training script does before it restores), ``restore`` (the newest checkpoint
read into that state; none for ``fresh``), ``first_step`` (the first training step, done: compiled, or
loaded from a compilation cache, and run). Modes:

- ``fresh``: a run with no checkpoint: init, then the first step;
- ``fc``: a restarted run with ``CheckpointCallback`` as it is (its compilation cache in the run folder,
  filled by the run before the restart);
- ``fc-early``: the same with the callback made before the state is built, so that the programs that
  build it are loaded from the cache too;
- ``fc-nocache``: the same as ``fc`` with ``compile_cache=False``;
- ``fc-fn``: the README's pattern: the callback made first (its prefetch reads the newest step while
  the runtime starts), then ``restore_or(init)``, the function that builds the state: traced, never
  run, and restored into (``init`` is 0; ``restore`` is all of ``restore_or``); ``fc-fn-noprefetch``:
  the same with the prefetch stopped at once (not in the default modes);
- ``orbax``: Orbax's ``CheckpointManager`` restoring the same state (``StandardRestore``), no cache.

Beside each mode, its ``floor``: what no checkpoint library removes, the mode's own imports and runtime
start plus a warm step (the fresh run's second step, median), and ``over_floor``, its total less that.

The chart (docs/_static/resume.png) and the figures pages quote are drawn by plots.py from the report
once it is copied to benchmarks/results/ (a name with "resume" in it).

Before the rounds, one process (with the callback made before its state is built) trains two steps and
saves the state three ways (the callback's run with its cache, one without, Orbax's): the run that a
preemption stopped. Reported: the median of each phase's length per mode, the first step
after the restore's end, and ratios. The JSON report goes to bench_out/ (FLAX_CKPT_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runner as C  # noqa: E402
from bench_accelerator import FULL, SMALL  # noqa: E402

MODES = ("fresh", "fc", "fc-early", "fc-fn", "fc-nocache", "orbax")
PHASES = ("imports", "backend", "init", "restore", "first_step")


# ------------------------------------------------------------------------------------ the child


def child(mode: str, folder: Path, dims: dict[str, int]) -> dict[str, float]:
    """One process's run of ``mode``: the clock (time.time()) at the end of each phase."""
    marks: dict[str, float] = {}
    import jax
    import numpy as np
    import optax  # noqa: F401
    from flax import linen  # noqa: F401

    import flax_ckpt  # noqa: F401
    from flax_ckpt.callbacks import CheckpointCallback

    if mode in ("orbax", "seed"):
        import orbax.checkpoint as ocp
    marks["imports"] = time.time()
    fn_form = CheckpointCallback(folder / "fc", every_steps=1) if mode.startswith("fc-fn") else None
    if mode == "fc-fn-noprefetch" and fn_form is not None and fn_form.manager._prefetch is not None:
        fn_form.manager._prefetch.cancel()  # the same without the read ahead (an A/B of the prefetch)
    jax.block_until_ready(jax.numpy.zeros(1) + 1)
    marks["backend"] = time.time()
    from bench_accelerator import make_model

    init, step, _ = make_model(**dims)
    if fn_form is not None:  # the README's pattern: restore_or(the function that builds the state)
        state, start = fn_form.restore_or(init)
        assert start == 2, start
        marks["init"] = marks["backend"]
        jax.block_until_ready(state)
        marks["restore"] = time.time()
        jax.block_until_ready(step(state))
        marks["first_step"] = time.time()
        fn_form.close()
        return marks
    early = CheckpointCallback(folder / "fc", every_steps=1) if mode in ("fc-early", "seed") else None
    state = jax.block_until_ready(init())
    marks["init"] = time.time()
    if mode == "seed":
        leaves = jax.tree_util.tree_leaves(state)
        marks["state_mib"] = sum(x.nbytes for x in leaves if hasattr(x, "nbytes")) / C.MB
        marks["device"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"  # type: ignore[assignment]
        marks["jax"] = jax.__version__  # type: ignore[assignment]
        for _ in range(2):  # the run a preemption stops: its steps after the first get the state a step gave
            state = jax.block_until_ready(step(state))
        assert early is not None
        early(2, state)
        early.close()
        ckpt = CheckpointCallback(folder / "fc-nocache", every_steps=1, compile_cache=False)
        ckpt(2, state)
        ckpt.close()
        with ocp.CheckpointManager(folder / "orbax") as mgr:
            mgr.save(2, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
        return marks
    if mode in ("fc", "fc-early", "fc-nocache"):
        ckpt = early or CheckpointCallback(folder / mode, every_steps=1, compile_cache=mode == "fc")
        state, start = ckpt.restore_or(state)
        assert start == 2, start
        jax.block_until_ready(state)
        marks["restore"] = time.time()
        jax.block_until_ready(step(state))
        marks["first_step"] = time.time()
        ckpt.close()  # nothing pending: saves nothing
        return marks
    if mode == "orbax":
        with ocp.CheckpointManager(folder / "orbax") as mgr:
            abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
            state = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract))
            jax.block_until_ready(state)
        marks["restore"] = time.time()
        jax.block_until_ready(step(state))
        marks["first_step"] = time.time()
        return marks
    assert mode == "fresh", mode
    state = jax.block_until_ready(step(state))
    marks["first_step"] = time.time()
    jax.block_until_ready(step(state))
    marks["warm_step_s"] = time.time() - marks["first_step"]  # a length, not a clock
    np.asarray(0)
    return marks


# ------------------------------------------------------------------------------------ the parent


def spawn(mode: str, folder: Path, dims: dict[str, int]) -> dict[str, float]:
    """Runs ``mode`` in a fresh process; the length of each phase it went through (seconds)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [sys.executable, __file__, "--child", mode, "--folder", str(folder), "--dims", json.dumps(dims)]
    t0 = time.time()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{mode}: exit {p.returncode}\n{p.stderr[-3000:]}")
    marks = json.loads(p.stdout.strip().splitlines()[-1])
    out: dict[str, Any] = {k: marks[k] for k in ("device", "state_mib", "jax", "warm_step_s") if k in marks}
    last = t0
    for phase in PHASES:
        if phase in marks:
            out[phase] = marks[phase] - last
            last = marks[phase]
    out["total"] = last - t0
    return out


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """The median of each phase per mode, with its ``floor`` (the mode's imports and runtime start plus
    the fresh run's warm step) and ``over_floor`` (its total less that floor)."""
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items() if rs}
    warm = med.get("fresh", {}).get("warm_step_s")
    for phases in med.values():
        if warm is not None and "backend" in phases:
            phases["floor"] = phases["imports"] + phases["backend"] + warm
            phases["over_floor"] = phases["total"] - phases["floor"]
    return med


def summarize(body: dict[str, Any]) -> str:
    """A Markdown table of the medians, and the ratios the docs quote."""
    med = body["medians"]
    cols = (*PHASES, "total", "floor", "over_floor")
    rows = ["| mode | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for mode, phases in med.items():
        cells = [f"{phases[p]:.2f}" if p in phases else "-" for p in cols]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines = [f"Restart to first step, {body['device']} ({body['state_mib']:.0f} MiB state), "]
    lines[0] += f"medians of {body.get('rounds_run', body['rounds'])} rounds, seconds:"
    lines += ["", *rows, ""]
    for mode in ("fc", "fc-early", "fc-fn", "fc-fn-noprefetch", "fc-nocache", "orbax"):
        if mode in med and "fresh" in med:
            lines.append(
                f"- {mode}: first step {med[mode]['first_step']:.2f} s after the restore's end, "
                f"{med[mode]['first_step'] / med['fresh']['first_step']:.2f}x a fresh run's first step; "
                f"total {med[mode]['total']:.2f} s ({med[mode]['total'] / med['fresh']['total']:.2f}x fresh"
                + (f"; floor + {med[mode]['over_floor']:.2f} s)" if "over_floor" in med[mode] else ")")
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="a small decoder (a CPU)")
    ap.add_argument("--model", default=None, help="d,layers,heads,vocab,seq,batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--budget-s", type=float, default=None, help="start no round after this many seconds")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dims", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        marks = child(args.child, Path(args.folder), json.loads(args.dims))
        print(json.dumps(marks), flush=True)
        return
    dims = dict(SMALL if args.small else FULL)
    if args.model:
        dims = dict(zip(FULL, map(int, args.model.split(","))))
    modes = args.modes.split(",")
    folder = C.SCRATCH / "resume"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    body: dict[str, Any] = {"dims": dims, "rounds": args.rounds, "runs": {m: [] for m in modes}}
    body["command"] = "bench_resume.py " + " ".join(sys.argv[1:])
    try:
        body["seed"] = spawn("seed", folder, dims)  # the parent never opens the device: a child holds it
        body["device"], body["state_mib"] = body["seed"].pop("device"), body["seed"].pop("state_mib")
        body["jax"] = body["seed"].pop("jax")
        print(f"{body['device']}, state {body['state_mib']:.0f} MiB; seeded in {body['seed']['total']:.1f} s")
        t0 = time.time()
        for r in range(args.rounds):
            if args.budget_s is not None and r and time.time() - t0 > args.budget_s:
                break
            body["rounds_run"] = r + 1
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                res = spawn(mode, folder, dims)
                body["runs"][mode].append(res)
                print(f"round {r} {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
        body["medians"] = medians(body["runs"])
    except Exception as e:  # a contender's failure: the report keeps what ran
        body["error"] = repr(e)[-3000:]
        print(body["error"], flush=True)
    finally:
        shutil.rmtree(C.SCRATCH, ignore_errors=True)
    body.setdefault("medians", medians(body["runs"]))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    C.OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = C.OUT_DIR / f"resume-{stamp}.json"
    body["machine"] = C.machine_info(C.OUT_DIR)
    path.write_text(json.dumps(body, indent=1))
    md = summarize(body)
    path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
