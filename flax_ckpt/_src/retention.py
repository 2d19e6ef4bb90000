"""Retention: which committed steps a run keeps. One pure policy, shared by the manager and the
flax-ckpt command's prune (never a copy of it). No I/O.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal


def steps_to_delete(steps: Iterable[int], *, max_to_keep: int | None = None, keep_period: int | None = None,
                    metrics: dict[int, float | None] | None = None, best_mode: Literal["min", "max"] = "min",
                    keep_best: int | None = None) -> list[int]:
    """The committed steps that retention removes, oldest first.

    Kept: the newest step always; the newest ``max_to_keep`` (all, when None); every step divisible by
    ``keep_period``; the ``keep_best`` best steps by ``metrics`` (steps without a value never count).
    """
    steps = sorted(set(steps))
    if not steps or max_to_keep is None:
        return []
    keep = set(steps[-max(1, max_to_keep):]) if max_to_keep > 0 else {steps[-1]}
    keep.add(steps[-1])
    if keep_period:
        keep.update(s for s in steps if s % keep_period == 0)
    if keep_best and metrics:
        scored = [(v, s) for s, v in metrics.items() if s in steps and finite(v)]
        scored.sort(key=lambda vs: (vs[0] if best_mode == "min" else -vs[0], -vs[1]))
        keep.update(s for _, s in scored[:keep_best])
    return [s for s in steps if s not in keep]


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
