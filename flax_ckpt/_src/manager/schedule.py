"""The schedule: which steps a manager saves (``save_interval_steps``: a fixed interval, or "auto").

Scope: the interval in force and what it is measured from: with "auto", the time between the
manager's calls (a training step) and the time each save held the caller, fed to interval.py's
controller; with several processes, the largest of their intervals, agreed at each save. Not here:
whether a step is saved already (steps.py), ``force`` (the manager's).
"""

from __future__ import annotations

import time
from typing import Literal

from flax_ckpt._src.commit import distributed
from flax_ckpt._src.manager.interval import AutoInterval


class Schedule:
    """``every``: save the steps divisible by it, or "auto" (interval.py; ``overhead_budget``,
    ``mtbf_s``). Checked before the manager opens its directory."""

    def __init__(self, every: "int | Literal['auto']", overhead_budget: float, mtbf_s: float | None):
        self._auto = AutoInterval(overhead_budget, mtbf_s) if every == "auto" else None
        if self._auto is None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"save_interval_steps must be a positive int or 'auto', got {every!r}")
        self.every = every
        self._fixed = every if isinstance(every, int) else 0  # the interval when not "auto"
        self._agreed = 1  # "auto" with several processes: the interval all of them use (see saved)
        self.last_saved: int | None = None  # the step of the last save started
        self._last_call_end: float | None = None

    def due(self, step: int) -> bool:
        """Whether ``step`` is on the schedule (a step already saved is the caller's to rule out)."""
        if self._auto is not None:
            return self.last_saved is None or step - self.last_saved >= self.interval
        return step % self._fixed == 0

    @property
    def interval(self) -> int:
        """The steps between saves now in force (re-tuned continuously in "auto" mode; with several
        processes, the largest of their intervals, agreed at each save)."""
        if self._auto is None:
            return self._fixed
        return self._auto.interval() if distributed.process_count() == 1 else self._agreed

    def call_started(self, t0: float) -> None:
        """A save call began at ``t0`` (perf_counter): the training step since the last call ended."""
        if self._auto is not None and self._last_call_end is not None:
            self._auto.observe_step(t0 - self._last_call_end)

    def call_ended(self) -> None:
        self._last_call_end = time.perf_counter()

    def saved(self, step: int, blocked: float, prefix: str) -> None:
        """``step``'s save started, after holding the caller ``blocked`` seconds. With "auto" and several
        processes (a collective under ``prefix``, the manager's rounds: every process saves the same
        steps), all adopt the largest interval."""
        self.last_saved = step
        if self._auto is None:
            return
        self._auto.observe_save(blocked)
        if distributed.process_count() > 1:  # each process measures its own costs: all take the max
            votes = distributed.allgather(prefix, "interval", {"step": step, "k": self._auto.interval()})
            self._agreed = max(v["k"] for v in votes)
