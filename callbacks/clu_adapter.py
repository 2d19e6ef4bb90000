"""A clu ``PeriodicAction`` that hands each step to a ``CheckpointCallback`` (clu is an optional extra).

Scope: fitting CheckpointCallback into a clu-style loop, where hooks are called as ``hook(step)``::

    ckpt = CheckpointCallback(workdir, every_steps=1000)
    state, start = ckpt.restore_or(state)
    hooks = [periodic_actions.ReportProgress(num_train_steps=n), CheckpointAction(ckpt, lambda: state)]
    for step in range(start + 1, n + 1):
        state, metrics = train_step(state, next(batches))
        for hook in hooks:
            hook(step)

The action is called at every step (preemption is checked at each boundary); the callback's own
``every_steps`` decides when to save, and ``__call__`` returns True on the steps that saved. Importing
this module imports ``clu.periodic_actions`` (which needs tensorflow and tensorboard); nothing else in
callbacks/ imports clu.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from clu import periodic_actions  # pyright: ignore[reportMissingImports] (the optional clu extra)

from .checkpoint_callback import CheckpointCallback, Metrics


class CheckpointAction(periodic_actions.PeriodicAction):
    """``hook(step)`` saves ``state_fn()`` through ``ckpt`` on its schedule and on preemption.

    Args:
      ckpt: the callback that owns the schedule, the manager and the preemption handling.
      state_fn: returns the current training state (e.g. ``lambda: state``).
      metrics_fn: returns the metrics to store with a checkpoint; called only on steps that save.
    """

    def __init__(
        self,
        ckpt: CheckpointCallback,
        state_fn: Callable[[], Any],
        metrics_fn: Callable[[], Any] | None = None,
    ):
        super().__init__(every_steps=ckpt.every_steps)
        self._ckpt = ckpt
        self._state_fn = state_fn
        self._metrics: Metrics = metrics_fn

    def __call__(self, step: int, t: float | None = None) -> bool:
        """Called after every training step; True when this step was saved."""
        t = time.monotonic() if t is None else t
        self._init_and_check(step, t)  # clu's check that the hook runs once per step
        saved = self._ckpt(step, self._state_fn(), self._metrics)
        if saved:
            self._after_apply(step, t)
        return saved

    def _apply(self, step: int, t: float) -> None:
        self._ckpt(step, self._state_fn(), self._metrics, force=True)
