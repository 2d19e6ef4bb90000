"""The automatic checkpoint interval: ``save_interval_steps="auto"``.

Scope: a small controller fed with measured step times and measured save costs; it says how many
steps to leave between saves. Two rules, the larger wins:

- overhead budget: a save blocks training for ``C`` seconds (``SaveStats.blocked_s``: snapshot plus
  any wait for the previous save); with step time ``t`` and interval ``k`` the overhead is
  ``C / (k t)``, so ``k >= C / (budget * t)``.
- Young/Daly (when a mean time between failures ``M`` is given): the interval that minimises expected
  lost work plus checkpoint cost is ``tau = sqrt(2 C M)`` seconds (Young 1974; Daly 2006 adds ``- C``,
  negligible when ``C << M``), i.e. ``k = tau / t`` steps.

Measurements are exponential moving averages, so the interval re-tunes as step time or save cost change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AutoInterval:
    budget: float = 0.01
    mtbf_s: float | None = None
    max_steps: int = 1_000_000
    smoothing: float = 0.3
    step_s: float | None = None
    cost_s: float | None = None

    def __post_init__(self):
        if not 0 < self.budget < 1:
            raise ValueError(f"overhead_budget must be in (0, 1), got {self.budget!r}")
        if self.mtbf_s is not None and self.mtbf_s <= 0:
            raise ValueError(f"mtbf_s must be positive, got {self.mtbf_s!r}")

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_step(self, seconds: float) -> None:
        """Time of one training step (between two calls to the manager, excluding the save itself)."""
        self.step_s = self._ema(self.step_s, max(seconds, 1e-9))

    def observe_save(self, blocked_s: float) -> None:
        """Time one save held the training thread."""
        self.cost_s = self._ema(self.cost_s, max(blocked_s, 0.0))

    def interval(self) -> int:
        """Steps between saves; 1 until both a step time and a save cost have been measured."""
        if self.step_s is None or self.cost_s is None:
            return 1
        k = self.cost_s / (self.budget * self.step_s)
        if self.mtbf_s is not None:
            k = max(k, math.sqrt(2 * self.cost_s * self.mtbf_s) / self.step_s)
        return int(min(self.max_steps, max(1, math.ceil(k))))
