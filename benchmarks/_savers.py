"""The training loop with saves that bench_every_step.py and bench_accelerator.py time, and the savers
it races.

Scope: ``warm_up`` and ``train`` (the loop, timed); ``Saver`` (one contender: ``save(step, state)`` in
the loop, whether it saved; ``finish()`` inside the timed region; ``close()`` after it) and the two
managers both benchmarks race, ``FcManager`` (flax_ckpt's, optionally with a local-memory tier in a
fresh /dev/shm folder) and ``OrbaxManager`` (Orbax's async CheckpointManager). Contenders only one
benchmark uses stay there.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


class Saver:
    """One loop contender; the base saves nothing."""

    saves: int | None = None  # saves actually made (None: those save() said it made)
    skipped: int | None = None

    def save(self, step: int, state: Any) -> bool:
        return True

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def warm_up(step: Callable[[Any], Any], state: Any, s: Saver | None, steps: int) -> Any:
    """``steps`` steps (compiled), then step 0 saved with ``s`` and finished, untimed (first-save costs
    apart; Orbax's managers save only steps above the newest they hold); returns the state."""
    import jax

    for _ in range(steps):
        state = jax.block_until_ready(step(state))
    if s is not None:
        s.save(0, state)
        s.finish()
        getattr(s, "mark", lambda: None)()
    return state


def train(
    step: Callable[[Any], Any],
    state: Any,
    steps: int,
    s: Saver | None,
    due: Callable[[int], bool],
    *,
    sync: bool = True,
    start: int = 0,
) -> tuple[Any, dict[str, Any]]:
    """``steps`` steps from ``state``, numbered ``start + 1`` on, each followed by
    ``jax.block_until_ready`` if ``sync``; step i is saved with ``s`` where ``due(i)``; then the state
    is waited for and ``s.finish()`` runs inside the timing. Returns the state and ``wall``, ``cpu``
    (process CPU: every thread's), ``steady`` (wall before the finish), ``each`` (each step's seconds:
    with a sync, until it is done), ``blocked`` (each save call's), ``saved`` (the steps saved) and
    ``made`` (the saves made)."""
    import jax

    out: dict[str, Any] = {"each": [], "blocked": [], "saved": [], "made": 0}
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(start + 1, start + steps + 1):
        a0 = time.perf_counter()
        state = step(state)
        if sync:
            state = jax.block_until_ready(state)
        out["each"].append(time.perf_counter() - a0)
        if s is not None and due(i):
            b0 = time.perf_counter()
            out["made"] += bool(s.save(i, state))
            out["blocked"].append(time.perf_counter() - b0)
            out["saved"].append(i)
    state = jax.block_until_ready(state)
    out["steady"] = time.perf_counter() - t0
    if s is not None:
        s.finish()
    out["wall"], out["cpu"] = time.perf_counter() - t0, time.process_time() - c0
    return state, out


class FcManager(Saver):
    """``fc.CheckpointManager(d, max_to_keep=...)``; with ``tiers``, a local-memory tier (no peer) in a
    fresh /dev/shm folder, persisted every ``persist_interval_steps`` (None: never); ``on_busy`` as the
    manager's (None: its default); ``package``: the module to take it from. ``mark`` and ``count`` give
    the tier's saves and busy-skips since ``mark``."""

    def __init__(
        self,
        d: Path,
        *,
        max_to_keep: int,
        tiers: bool = False,
        persist_interval_steps: int | None = None,
        on_busy: str | None = None,
        package: str = "flax_ckpt",
    ):
        import importlib

        fc = importlib.import_module(package)  # another name: a baseline beside it (bench_every_step.py)

        self.shm = Path(tempfile.mkdtemp(prefix="flax_ckpt_bench-", dir="/dev/shm")) if tiers else None
        kw = {}
        if tiers:
            kw["tiers"] = fc.Tiers(
                local_dir=str(self.shm), peer=False, persist_interval_steps=persist_interval_steps
            )
        if on_busy is not None:
            kw["on_busy"] = on_busy
        self.mgr = fc.CheckpointManager(d, max_to_keep=max_to_keep, **kw)
        self.tiers, self.first = tiers, 0

    def save(self, step: int, state: Any) -> bool:
        return bool(self.mgr.save(step, state))

    def finish(self) -> None:
        self.mgr.wait_until_finished()

    def mark(self) -> None:
        self.first = len(self.mgr.tier_stats)

    def count(self) -> None:
        if self.tiers:
            st = self.mgr.tier_stats[self.first :]
            self.saves, self.skipped = len(st), sum(s.skipped for s in st)

    def close(self) -> None:
        self.mgr.close()
        if self.shm is not None:
            shutil.rmtree(self.shm, ignore_errors=True)


class OrbaxManager(Saver):
    """Orbax's ``CheckpointManager(d, max_to_keep=...)``, saving with ``StandardSave`` (async)."""

    def __init__(self, d: Path, *, max_to_keep: int):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.mgr = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

    def save(self, step: int, state: Any) -> bool:
        return bool(self.mgr.save(step, args=self.ocp.args.StandardSave(state)))

    def finish(self) -> None:
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()
