"""Checkpoint frequency: what a checkpoint every 1, 10 and 100 steps costs a training loop.

    python benchmarks/bench_every_step.py                          # both models, every 1/10/100, 3 rounds
    python benchmarks/bench_every_step.py --models mlp --every 1,10 --steps 60 --rounds 3
    python benchmarks/bench_every_step.py --models mlp --every 1 --steps 20 --pairs 8 --rounds 4 \
        --ahead --contenders floor,memory,persistent          # each against its own runs without saves

Two plain Flax Linen loops trained with optax adam, jitted with the state donated, on the CPU device:
``mlp`` (an MLP 4x1024 on 256 inputs, batch 512: 39 MiB of state with adam's moments) and
``transformer`` (a 4-layer decoder, d_model 256, 4 heads, vocab 2048, sequence 64, batch 4). Every
step ends with ``jax.block_until_ready`` on the new state, as a loop that reads its loss each step does;
with ``--ahead`` it does not (a loop that dispatches steps ahead of the device, synced once at the end).

Contenders, each run in its own process (a fresh jax: no host copy cached by another contender):
- ``none``: the loop without checkpoints (the reference of every ratio);
- ``floor``: ``np.copyto`` of every leaf into buffers allocated once (the cost of one host copy);
- ``write-floor``: every leaf written back to back into one file and fsynced on a background thread,
  one file in flight, the two newest kept: the state made durable with no format at all;
- ``memory``: ``CheckpointManager(tiers=Tiers(local_dir=<tmpfs>, peer=False, persist_interval_steps=50))``,
  the default ``on_busy="skip"`` (a save that finds the previous one in flight is skipped: the table
  says how many saves were made);
- ``persistent``: ``CheckpointManager(dir, max_to_keep=2)`` (async, this machine's disk);
- ``orbax``: Orbax's ``CheckpointManager`` (async, max_to_keep=2, StandardSave);
- ``orbax-emergency``: Orbax's emergency ``CheckpointManager`` (local tmpfs + persistent), where the
  installed orbax-checkpoint has one that runs in a single CPU process; else the table says why not.
Each process runs the loop once per frequency (warm-up steps and one save first, untimed), timing
``--steps`` steps plus the final ``wait_until_finished`` (all the work a checkpoint causes is inside).

Interleaved rounds (the runner's). Reported per (model, frequency, contender): the median over rounds
of the wall-time ratio to ``none`` of the same round, minus one (the overhead), and the same for process
CPU time (every thread's: the checkpointer's background work included).

``--pairs N``: each contender's process runs the loop N times without saves and N times with, in turns
(ABBA), ``--steps`` steps each, and its overhead is the ratio to its own runs without saves (``none``
is then not needed: a loop moves from one process to the next). The report then also splits the CPU
above the runs without saves: the Python threads' (process CPU minus the threads Python did not
start) per save made, and the change of XLA's threads' per step.

``--side`` (with ``--pairs N --baseline DIR``; contenders memory and persistent): each process holds the
contender twice, this code's and the baseline's (DIR/flax_ckpt imported as ``flax_ckpt_base``), and
runs N rounds of four runs in turns (without saves, saving with one, without, saving with the other).
The table adds, per contender, this code's CPU minus the baseline's in the same round, in points of the
CPU without saves (mean, standard error).

    python benchmarks/bench_every_step.py --models mlp --every 1 --steps 20 --pairs 40 --rounds 4 \
        --ahead --contenders persistent --side --baseline /tmp/flax_ckpt-base

``--pool REPORT [REPORT ...]`` runs nothing: it pools the ``--pairs`` rows of reports already written
(every pair and every process of a contender, across reports) and prints one table per model and
frequency. A ``<contender>@base`` is pooled per baseline folder, which its label names.

    python benchmarks/bench_every_step.py --pool benchmarks/results/checks/cpu-every-step-pairs-*.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab  # noqa: E402
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402
from _savers import FcManager, OrbaxManager, Saver, train, warm_up  # noqa: E402

CONTENDERS = ["none", "floor", "write-floor", "memory", "persistent", "orbax", "orbax-emergency"]
MODELS = ["mlp", "transformer"]


# ------------------------------------------------------------------------------------------- models


def make_model(name: str) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn

    rng = np.random.default_rng(0)
    if name == "mlp":

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                for _ in range(4):
                    x = nn.relu(nn.Dense(1024)(x))
                return nn.Dense(10)(x)

        xs = jnp.asarray(rng.standard_normal((512, 256), dtype=np.float32))
        ys = jnp.asarray(rng.integers(0, 10, 512))
    elif name == "transformer":
        vocab, d, heads, layers, seq, batch = 2048, 256, 4, 4, 64, 4

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x):
                mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
                x = x + nn.SelfAttention(num_heads=heads)(nn.LayerNorm()(x), mask=mask)
                h = nn.Dense(4 * d)(nn.LayerNorm()(x))
                return x + nn.Dense(d)(nn.gelu(h))

        class Net(nn.Module):
            @nn.compact
            def __call__(self, tokens):
                x = nn.Embed(vocab, d)(tokens) + self.param("pos", nn.initializers.normal(0.02), (seq, d))
                for _ in range(layers):
                    x = Block()(x)
                return nn.Dense(vocab)(nn.LayerNorm()(x))

        xs = jnp.asarray(rng.integers(0, vocab, (batch, seq)))
        ys = jnp.asarray(rng.integers(0, vocab, (batch, seq)))
    else:
        raise ValueError(f"unknown model {name!r}")
    return F.adam_training(Net(), xs, ys, 1e-3)


# ------------------------------------------------------------------------------------- contenders


class Floor(Saver):
    def __init__(self, state: Any, _: Path):
        import jax
        import numpy as np

        self.bufs = [np.empty(np.shape(x), np.asarray(x).dtype) for x in jax.tree_util.tree_leaves(state)]

    def save(self, step: int, state: Any) -> bool:
        import jax
        import numpy as np

        for b, x in zip(self.bufs, jax.tree_util.tree_leaves(state)):
            np.copyto(b, np.asarray(x))
        return True


class WriteFloor(Saver):
    def __init__(self, state: Any, d: Path):
        import threading

        d.mkdir(parents=True, exist_ok=True)
        self.d, self.thread, self.threading = d, None, threading

    def _write(self, step: int, arrays: list) -> None:
        F.write_raw_file(self.d / f"{step}.bin", arrays)
        old = self.d / f"{step - 2}.bin"
        if old.exists():
            old.unlink()

    def save(self, step: int, state: Any) -> bool:
        import jax
        import numpy as np

        self.finish()
        arrays = [np.ascontiguousarray(np.asarray(x)) for x in jax.tree_util.tree_leaves(state)]
        self.thread = self.threading.Thread(target=self._write, args=(step, arrays))
        self.thread.start()
        return True

    def finish(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class OrbaxEmergency(Saver):
    """Orbax's emergency CheckpointManager: local checkpoints in tmpfs every save, persistent every 50."""

    def __init__(self, state: Any, d: Path):
        import jax
        import numpy as np
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as ecm

        self.shm = Path(tempfile.mkdtemp(prefix="flax_ckpt_bench-", dir="/dev/shm"))
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("replica", "data"))
        abstract = jax.tree_util.tree_map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if hasattr(x, "sharding") else x
            ),
            state,
        )
        options = ecm.CheckpointManagerOptions(
            local=ecm.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=ecm.PersistentCheckpointOptions(save_interval_steps=50, max_to_keep=2),
        )
        self.mgr = ecm.CheckpointManager(
            self.shm, d, global_mesh=mesh, abstract_state=abstract, options=options
        )

    def save(self, step: int, state: Any) -> bool:
        import orbax.checkpoint as ocp

        return bool(self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state))))

    def finish(self) -> None:
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()
        shutil.rmtree(self.shm, ignore_errors=True)


def saver(name: str, state: Any, d: Path, package: str = "flax_ckpt") -> Saver | None:
    return {
        "none": lambda: None,
        "floor": lambda: Floor(state, d),
        "write-floor": lambda: WriteFloor(state, d),
        "memory": lambda: FcManager(d, max_to_keep=2, tiers=True, persist_interval_steps=50, package=package),
        "persistent": lambda: FcManager(d, max_to_keep=2, package=package),
        "orbax": lambda: OrbaxManager(d, max_to_keep=2),
        "orbax-emergency": lambda: OrbaxEmergency(state, d),
    }[name.split("@")[0]]()


# ------------------------------------------------------------------------------------------ a child


def native_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process that Python did not start (XLA's), by tid, from
    /proc/self/task/<tid>/schedstat (nanoseconds). With ``--pairs`` the rest of the process's CPU is
    its Python threads': the loop's and the checkpointer's."""
    python = {str(t.native_id) for t in threading.enumerate()}
    out = {}
    for tid in set(os.listdir("/proc/self/task")) - python:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # ended meanwhile; or no schedstat in this kernel
            continue
    return out


def timed(
    step: Callable[[Any], Any], state: Any, steps: int, ahead: bool, s: Saver | None, every: int, at: int
) -> tuple[Any, int, tuple[float, float, int, float]]:
    """``steps`` steps numbered on from ``at``, each ``every``-th saved with ``s`` (None: no saves), the
    checkpointer's work finished inside (``_savers.train``). Returns the state, the last step number,
    and (wall, process CPU, saves made, CPU of the threads Python did not start: XLA's)."""
    n0 = native_cpu()
    state, got = train(step, state, steps, s, lambda i: i % every == 0, sync=not ahead, start=at)
    n1 = native_cpu()
    return (
        state,
        at + steps,
        (got["wall"], got["cpu"], got["made"], sum(v - n0[t] for t, v in n1.items() if t in n0)),
    )


def counted(s: Saver | None, made: int) -> dict[str, Any]:
    """A row's saves made (the saver's own count where it keeps one, else ``made``) and busy-skips."""
    if s is not None:
        getattr(s, "count", lambda: None)()
    return {
        "saves": s.saves if s is not None and s.saves is not None else made,
        "skipped": s.skipped if s is not None else None,
    }


def paired_row(
    got: list[list[float]], xla: list[list[float]], made: int, n: int, every: int
) -> dict[str, Any]:
    """A ``--pairs`` row from its pairs (``got``: [wall alone, CPU alone, wall saving, CPU saving];
    ``xla``: XLA's threads' CPU [alone, saving]), ``made`` saves over ``n`` steps saving: per step the
    means, the saves asked for, the Python threads' CPU (the loop's and the checkpointer's) above the
    runs without saves per save made, and XLA's threads' change per step."""
    python = sum(g[3] - x[1] - (g[1] - x[0]) for g, x in zip(got, xla))
    return {
        "wall": sum(g[2] for g in got) / n,
        "cpu": sum(g[3] for g in got) / n,
        "alone": {"wall": sum(g[0] for g in got) / n, "cpu": sum(g[1] for g in got) / n},
        "pairs": got,
        "asked": n // every,
        "xla_pairs": xla,
        "python_per_save": python / made if made else None,
        "xla_change": sum(x[1] - x[0] for x in xla) / n,
    }


BASE = ab.BASE  # the name --side imports the baseline's package under


def child(
    contender: str,
    model: str,
    everies: list[int],
    steps: int,
    scratch: Path,
    ahead: bool = False,
    pairs: int = 0,
    side: bool = False,
) -> dict[str, Any]:
    """One process: the loop once per frequency; {every: {wall, cpu, saves, skipped}} or {"error"}.
    ``ahead``: no sync per step (the loop runs ahead of the device), one at the end. ``pairs``: instead
    of one run of ``steps`` steps, ``pairs`` pairs of runs, one without saves and one with, in turns
    (each row then also has ``alone``, the runs without saves, and ``pairs``, every pair's
    [wall alone, CPU alone, wall saving, CPU saving]). ``side`` (with ``pairs``): two savers of
    ``contender``, this flax_ckpt's and the baseline's (package ``BASE``), and ``pairs`` rounds of four
    runs in turns, rotated a place a round: without saves, saving with the one, without, saving with
    the other, each saving run against the mean of its round's two runs without saves. Returns then
    {"side": {contender: row, contender@base: row}}, the first row with ``side_diff``: per round,
    (CPU saving with this code − with the baseline's) / CPU alone."""
    import importlib

    import jax
    import numpy as np

    init, step = make_model(model)
    modes = {"new": contender, "base": f"{contender}@base"} if side else {"new": contender}
    packages = {"new": "flax_ckpt", "base": BASE}
    out: dict[str, dict[str, Any]] = {n: {"state_mb": None} for n in modes.values()}
    if contender in ("memory", "persistent"):  # which flax_ckpt ran
        for k, n in modes.items():
            out[n]["package"] = os.path.dirname(importlib.import_module(packages[k]).__file__ or "")
    for every in everies:
        d = C.fresh_dir(scratch / f"{contender}-{model}-{every}")
        state = jax.block_until_ready(step(init()))
        mb = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(state)) / C.MB
        savers: dict[str, Saver | None] = {}
        try:
            for k in modes:
                savers[k] = saver(contender, state, d / k, package=packages[k])
            for s in savers.values():
                state = warm_up(step, state, s, 3)
            at: dict[str, int] = {}  # the last step number given (saves' steps grow), per saver with side

            def block(mode: str) -> tuple[float, float, int, float]:
                nonlocal state
                key = mode if side else ""
                state, at[key], got = timed(
                    step, state, steps, ahead, savers.get(mode), every, at.get(key, 0)
                )
                return got

            if not pairs:
                wall, cpu, made, _ = block("new")
                rows = {"new": {"wall": wall / steps, "cpu": cpu / steps} | counted(savers["new"], made)}
            else:  # alone and saving in turns (ABBA with one saver: a drift falls on both alike)
                got = {m: [] for m in modes}
                xla = {m: [] for m in modes}
                made = dict.fromkeys(modes, 0)
                turn = ["none", "new", "none", "base"] if side else ["none", "new"]
                for k in range(pairs):
                    r = [(m, block(m)) for m in turn[k % len(turn) :] + turn[: k % len(turn)]]
                    alone = [b for m, b in r if m == "none"]
                    w0, c0, x0 = (statistics.mean(b[i] for b in alone) for i in (0, 1, 3))
                    for m, b in r:
                        if m != "none":
                            got[m].append([w0, c0, b[0], b[1]])
                            xla[m].append([x0, b[3]])
                            made[m] += b[2]
                rows = {
                    m: paired_row(got[m], xla[m], made[m], steps * pairs, every) | counted(savers[m], made[m])
                    for m in modes
                }
                if side:
                    rows["new"]["side_diff"] = [(a[3] - b[3]) / a[1] for a, b in zip(got["new"], got["base"])]
            for m, row in rows.items():
                out[modes[m]].update({"state_mb": mb, str(every): row})
        except Exception as e:  # e.g. an orbax without a single-process emergency manager
            return {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            for s in savers.values():
                if s is not None:
                    s.close()
            shutil.rmtree(d, ignore_errors=True)
    return {"side": out} if side else out[contender]


# ----------------------------------------------------------------------------------------- the parent


def run(args) -> dict[str, Any]:
    everies = [int(e) for e in args.every.split(",")]
    rows: dict[str, Any] = {}
    side = None
    if args.side:
        bad = [c for c in args.contenders.split(",") if c not in ("memory", "persistent")]
        if bad:
            raise SystemExit(
                f"--side runs memory and persistent (not {','.join(bad)}) with --pairs N and --baseline DIR"
            )
        if not args.pairs or not args.baseline:
            raise SystemExit("--side needs --pairs N and --baseline DIR")
        C.SCRATCH.parent.mkdir(parents=True, exist_ok=True)
        side = ab.renamed_copy(args.baseline, Path(tempfile.mkdtemp(prefix="side-", dir=C.SCRATCH.parent)))
    try:
        C.run(EveryStep(args, everies, rows, side), args.rounds, log=lambda _: None)
    finally:
        if side is not None:
            shutil.rmtree(side, ignore_errors=True)
    return {"rows": rows, "everies": everies}


class EveryStep(C.Scenario):
    """Contenders ``model/contender``: each runs in a child process of its own (this script with
    ``--child``), whose rows (per frequency: wall and CPU per step, saves...) go to ``rows``; seconds
    a step with saves, per frequency, to the runner."""

    def __init__(self, args: Any, everies: list[int], rows: dict[str, Any], side: Path | None):
        self.args, self.everies, self.rows, self.side = args, everies, rows, side
        self.contenders = [f"{m}/{c}" for m in args.models.split(",") for c in args.contenders.split(",")]

    def time(self, name: str, r: int) -> dict[str, float]:
        args, side = self.args, self.side
        model, c = name.split("/")
        cmd = [__file__, "--child", c, "--models", model, "--every", args.every, "--steps", str(args.steps)]
        cmd += (["--ahead"] if args.ahead else []) + (["--pairs", str(args.pairs)] if args.pairs else [])
        cmd += ["--side"] if side is not None else []
        path = [str(side)] if side is not None else []
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*path, os.environ.get("PYTHONPATH")]))
        )
        try:
            res = C.child(cmd, timeout=args.timeout, env=env)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            res = {"error": str(e).strip()[-300:]}
        out = {}
        for label, got in (res.get("side") or {c: res}).items():
            self.rows.setdefault(model, {}).setdefault(label, []).append(got)
            at = [e for e in self.everies if str(e) in got]
            brief = got.get("error") or "  ".join(
                f"every {e}: {got[str(e)]['wall'] * 1e3:.1f} ms/step, CPU {got[str(e)]['cpu'] * 1e3:.1f} "
                f"ms, {got[str(e)]['saves']} saves"
                for e in at
            )
            base = os.path.abspath(str(side))
            if label.endswith("@base") and "package" in got and not got["package"].startswith(base):
                raise SystemExit(f"{label} imported {got['package']}, not the baseline's package")
            print(f"round {r} {model:11s} {label:16s} {brief}", flush=True)
            out.update({f"{label} every {e}": got[str(e)]["wall"] for e in at})
        return out


def summarize(out: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rows, everies = out["rows"], out["everies"]
    lines, summary = [], {}
    for model, by in rows.items():
        mb = next((r["state_mb"] for runs in by.values() for r in runs if r.get("state_mb")), 0)
        paired = any(
            "alone" in v for runs in by.values() for r in runs for v in r.values() if isinstance(v, dict)
        )
        lines += [
            f"\n**{model}** ({mb:.1f} MiB of state incl. adam), overhead against "
            + ("the same process's runs without saves (--pairs)" if paired else "`none`")
            + " (median of per-round ratios − 1): wall / process CPU; saves made of those asked for\n",
            "| every | " + " | ".join(c for c in by if c != "none") + " |",
            "|---|" + "---|" * sum(c != "none" for c in by),
        ]
        base = by.get("none", [])
        for e in everies:
            cells = []
            for c, runs in by.items():
                if c == "none":
                    continue
                err = next((r["error"] for r in runs if "error" in r), None)
                pairs = C.against(runs, base, str(e))
                if not pairs:
                    cells.append(f"n/a ({err[:60]})" if err else "n/a")
                    continue
                w = statistics.median(y["wall"] / x["wall"] for x, y in pairs) - 1
                cpu = statistics.median(y["cpu"] / x["cpu"] for x, y in pairs) - 1
                saves = statistics.median(y["saves"] for _, y in pairs)
                asked = pairs[0][1].get("asked", out.get("steps", 0) // e)
                summary.setdefault(model, {}).setdefault(str(e), {})[c] = {
                    "wall": w,
                    "cpu": cpu,
                    "saves": saves,
                }
                cell = f"{w:+.0%} / {cpu:+.0%}"
                if c != "floor":  # saves made of those asked for (a manager may skip or refuse some)
                    cell += f" ({saves:g}/{asked})"
                cells.append(cell)
            alone = [r[str(e)]["alone"] for runs in by.values() for r in runs if "alone" in r.get(str(e), {})]
            alone += [b[str(e)] for b in base if str(e) in b]
            none_ms = statistics.median(a["wall"] for a in alone) * 1e3 if alone else 0
            lines.append(f"| {e} ({none_ms:.0f} ms/step) | " + " | ".join(cells) + " |")
        lines += _over_floor(by, everies, summary.setdefault(model, {}))
        lines += _split(by, everies, summary.setdefault(model, {}))
        lines += _side(by, everies, summary.setdefault(model, {}))
    return "\n".join(lines), summary


def side_stats(diffs: list[float]) -> tuple[float, float, int]:
    """--side's per-round differences (this code's CPU minus the baseline's, over the CPU without saves):
    their mean, its standard error, and the rounds in which this code cost less."""
    return statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5, sum(x < 0 for x in diffs)


def _side(by: dict[str, list], everies: list[int], summary: dict[str, Any]) -> list[str]:
    """With --side: per contender, this code's CPU saving minus the baseline's in the same round of the
    same process, over the CPU of that round's runs without saves: the mean over every round of every
    process, its standard error, and the rounds in which this code cost less."""
    lines = []
    for c, runs in by.items():
        for e in everies:
            d = [x for r in runs for x in r.get(str(e), {}).get("side_diff", [])]
            if len(d) < 2:
                continue
            mean, se, less = side_stats(d)
            summary.setdefault(str(e), {}).setdefault(c, {}).update(side_diff=mean, side_se=se)
            if not lines:
                lines.append(
                    "\n--side: this code's CPU minus the baseline's, in the same round of the same process, "
                    "in points of the CPU without saves (mean ± standard error; rounds where this code cost less):\n"
                )
            lines.append(
                f"- {c}, every {e}: {mean:+.1%} ± {se:.1%} over {len(d)} rounds in {len(runs)} processes; "
                f"less in {less}"
            )
    return lines


def _wall(row: dict[str, Any]) -> float:
    """A row's wall time per step; with --pairs, as a ratio to its own runs without saves."""
    return row["wall"] / row["alone"]["wall"] if "alone" in row else row["wall"]


def _over_floor(by: dict[str, list], everies: list[int], summary: dict[str, Any]) -> list[str]:
    """The same, against the floor of the same round (what a contender costs beyond one host copy of
    the state, which every checkpoint of a donated state makes): the wall ratio, median over rounds."""
    floor = by.get("floor", [])
    others = [c for c in by if c not in ("none", "floor")]
    if not floor or not others:
        return []
    lines = [
        "\nAgainst `floor` of the same round (median of per-round wall ratios − 1):\n",
        "| every | " + " | ".join(others) + " |",
        "|---|" + "---|" * len(others),
    ]
    for e in everies:
        cells = []
        for c in others:
            pairs = [(f[str(e)], r[str(e)]) for f, r in zip(floor, by[c]) if str(e) in f and str(e) in r]
            if not pairs:
                cells.append("n/a")
                continue
            w = statistics.median(_wall(y) / _wall(x) for x, y in pairs) - 1
            summary.setdefault(str(e), {}).setdefault(c, {})["over_floor"] = w
            cells.append(f"{w:+.0%}")
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return lines


def _split(by: dict[str, list], everies: list[int], summary: dict[str, Any]) -> list[str]:
    """With --pairs: where the process CPU above the runs without saves went, the median over the
    contender's processes. The Python threads' (the loop's, the checkpointer's: what a save itself
    costs) per save made, and the change of XLA's threads' (the step's own compute) per step, which moves
    with the machine's load and with what a save does to the cores' caches."""
    rows = {
        c: runs
        for c, runs in by.items()
        if any("xla_change" in r.get(str(e), {}) for r in runs for e in everies)
    }
    if not rows:
        return []
    lines = [
        "\nWhere the CPU above the runs without saves went (--pairs; median over processes): the Python "
        "threads' (the loop's and the checkpointer's) in ms per save made / XLA's threads' change in ms "
        "per step:\n",
        "| every | " + " | ".join(rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for e in everies:
        cells = []
        for c, runs in rows.items():
            got = [r[str(e)] for r in runs if r.get(str(e), {}).get("python_per_save") is not None]
            if not got:
                cells.append("n/a")
                continue
            py = statistics.median(g["python_per_save"] for g in got) * 1e3
            xla = statistics.median(g["xla_change"] for g in got) * 1e3
            summary.setdefault(str(e), {}).setdefault(c, {}).update(python_ms_per_save=py, xla_ms_change=xla)
            cells.append(f"{py:.1f} / {xla:+.1f}")
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return lines


def pool(reports: list[dict[str, Any]]) -> str:
    """The ``--pairs`` rows of several reports pooled, as markdown: per model and frequency, a row per
    contender (``<contender>@base`` per baseline folder) with its processes and pairs, the median of the
    pairs' CPU ratios and the ratio of their sums (minus one), the median over processes of the Python
    threads' ms per save made, the median and mean of XLA's threads' change in ms per step, and the saves
    made of those asked for; and per contender run with ``--side``, its difference from its baseline
    (``side_stats`` of every round). Raises SystemExit when no report has a paired row."""
    got: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in reports:
        for model, by in r.get("rows", {}).items():
            for c, procs in by.items():
                label = f"{c} ({r.get('args', {}).get('baseline')})" if "@" in c else c
                for proc in procs:
                    for e, row in proc.items():
                        if not isinstance(row, dict) or not row.get("pairs"):
                            continue
                        new = dict(pairs=[], py=[], xla=[], side=[], saves=0, asked=0, procs=0)
                        d = got.setdefault((model, e), {}).setdefault(label, new)
                        d["side"] += row.get("side_diff", [])
                        d["pairs"] += row["pairs"]
                        d["procs"] += 1
                        d["saves"] += row.get("saves") or 0
                        d["asked"] += row.get("asked") or 0
                        if row.get("python_per_save") is not None:
                            d["py"].append(row["python_per_save"] * 1e3)
                        if row.get("xla_change") is not None:
                            d["xla"].append(row["xla_change"] * 1e3)
    if not got:
        raise SystemExit("--pool: none of these reports has a --pairs row (run with --pairs N)")
    lines = []
    for (model, e), by in got.items():
        lines += [
            f"\n**{model}**, every {e} (CPU over the same process's runs without saves, pooled over "
            f"{len(reports)} report(s))\n",
            "| contender | processes | pairs | median of pairs | ratio of sums | Python ms per save "
            "(median) | XLA's change, ms per step, median (mean) | saves |",
            "|---|---:|---:|---:|---:|---:|---|---:|",
        ]
        for label, d in by.items():
            ratios = [c1 / c0 for _, c0, _, c1 in d["pairs"]]
            sums = sum(p[3] for p in d["pairs"]) / sum(p[1] for p in d["pairs"])
            py = f"{statistics.median(d['py']):.1f}" if d["py"] else "n/a"
            mx = d["xla"] and (statistics.median(d["xla"]), statistics.mean(d["xla"]))
            xla = f"{mx[0]:+.1f} ({mx[1]:+.1f})" if mx else "n/a"
            lines.append(
                f"| {label} | {d['procs']} | {len(ratios)} | {statistics.median(ratios) - 1:+.1%} | "
                f"{sums - 1:+.1%} | {py} | {xla} | {d['saves']}/{d['asked']} |"
            )
        for label, d in by.items():
            if len(d["side"]) > 1:
                mean, se, less = side_stats(d["side"])
                lines.append(
                    f"\n--side, {label} minus its baseline in the same rounds: {mean:+.1%} ± {se:.1%} of the "
                    f"CPU without saves over {len(d['side'])} rounds; less in {less}"
                )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--every", default="1,10,100")
    ap.add_argument("--steps", type=int, default=100, help="timed steps per frequency")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    ap.add_argument(
        "--baseline",
        default=None,
        help="with --side: a folder holding the flax_ckpt package to compare (e.g. a git worktree)",
    )
    ap.add_argument(
        "--ahead", action="store_true", help="no sync per step: the loop runs ahead of the device"
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="each contender's process runs the loop without and with saves in turns, this many pairs "
        "of --steps steps each, and is compared with its own runs without saves (not with `none`): a "
        "machine whose speed drifts from one process to the next moves both alike",
    )
    ap.add_argument(
        "--pool",
        nargs="+",
        metavar="REPORT",
        help="run nothing: pool the --pairs rows of these reports (JSON) and print the table",
    )
    ap.add_argument(
        "--side",
        action="store_true",
        help="with --pairs and --baseline: each process runs a contender (memory, persistent) of this "
        "code and of the baseline's side by side, in turns with runs without saves; the table adds the "
        "difference of the two in the same process",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pool:
        print(pool([json.loads(Path(p).read_text()) for p in args.pool]))
        return
    F.jax_cpu_env()
    if args.child:
        scratch = C.SCRATCH
        try:
            everies = [int(e) for e in args.every.split(",")]
            res = child(
                args.child, args.models, everies, args.steps, scratch, args.ahead, args.pairs, args.side
            )
        finally:
            C.remove_scratch(scratch)
        print(json.dumps(res), flush=True)
        return
    info = C.machine_info(C.SCRATCH)
    out = run(args)
    out["steps"] = args.steps
    table, summary = summarize(out)
    md = (
        f"# Checkpoint frequency\n\n`{' '.join(sys.argv)}`: {args.rounds} interleaved rounds, {args.steps} "
        f"timed steps per frequency, {info.get('cpus')} CPUs, load average at start {info.get('loadavg_start')}\n"
        + table
        + "\n"
    )
    js, mdp = C.write_report(
        "every_step", {"machine": info, "args": vars(args), **out, "summary": summary}, md
    )
    print(md)
    print(f"wrote {mdp} and {js}")


if __name__ == "__main__":
    main()
