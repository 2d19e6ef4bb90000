"""Retention: which committed steps a run keeps, and which one is its best. One pure policy, shared by
the manager (``Retention``) and the flax-ckpt command's prune (``steps_to_delete``; never a copy of it).
One ranking (``ranked``) decides both the best step and the best steps kept. The policy acts on one
format's steps at a time: in a directory holding steps of two formats, each keeps its own newest
steps, so the newest step of the directory (the one a manager resumes from) is always kept. No I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, TypeGuard


def ranked(values: Mapping[int, float | None], mode: Literal["min", "max"] = "min") -> list[int]:
    """Steps by their metric value, best first (``mode``: lower or higher is better); of equal values the
    newer step first. Steps without a finite value are left out: they never count as best."""
    scored = [(v, s) for s, v in values.items() if finite(v)]
    scored.sort(key=lambda vs: (vs[0] if mode == "min" else -vs[0], -vs[1]))
    return [s for _, s in scored]


def steps_to_delete(
    steps: Iterable[int],
    *,
    max_to_keep: int | None = None,
    keep_period: int | None = None,
    metrics: dict[int, float | None] | None = None,
    best_mode: Literal["min", "max"] = "min",
    keep_best: int | None = None,
    formats: Mapping[int, str] | None = None,
) -> list[int]:
    """The committed steps that retention removes, oldest first.

    Kept: the newest step always; the newest ``max_to_keep`` (all, when None); every step divisible by
    ``keep_period``; the ``keep_best`` best steps by ``metrics`` (steps without a value never count).
    ``formats``: {step: its format}; the rules then apply to each format's steps apart (the newest
    ``max_to_keep`` of each format kept, and so on). Steps it does not name are of one more format.
    """
    if formats:
        groups: dict[str | None, list[int]] = {}
        for s in set(steps):
            groups.setdefault(formats.get(s), []).append(s)
        return sorted(
            s
            for group in groups.values()
            for s in steps_to_delete(
                group,
                max_to_keep=max_to_keep,
                keep_period=keep_period,
                metrics=metrics,
                best_mode=best_mode,
                keep_best=keep_best,
            )
        )
    steps = sorted(set(steps))
    if not steps or max_to_keep is None:
        return []
    keep = set(steps[-max(1, max_to_keep) :]) if max_to_keep > 0 else {steps[-1]}
    keep.add(steps[-1])
    if keep_period:
        keep.update(s for s in steps if s % keep_period == 0)
    if keep_best and metrics:
        keep.update(ranked({s: v for s, v in metrics.items() if s in steps}, best_mode)[:keep_best])
    return [s for s in steps if s not in keep]


def finite(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Retention:
    """A manager's retention options, checked once: ``max_to_keep`` (newest N kept; None keeps all),
    ``keep_period`` (steps divisible by it kept forever), ``best_metric``/``best_mode``/``keep_best``
    (the best N by that metric also kept; ``best_step`` is the first of the same ranking)."""

    max_to_keep: int | None = None
    keep_period: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"
    keep_best: int | None = None

    def __post_init__(self):
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {self.max_to_keep!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.keep_best is not None and self.best_metric is None:
            raise ValueError("keep_best needs best_metric (the metric name to rank steps by)")

    def values(self, metrics: Mapping[int, dict[str, Any] | None]) -> dict[int, float | None]:
        """Each step's value of ``best_metric`` ({} without one), from {step: its saved metrics}."""
        return {s: (m or {}).get(self.best_metric) for s, m in metrics.items()} if self.best_metric else {}

    def best_step(self, metrics: Mapping[int, dict[str, Any] | None]) -> int | None:
        """The best step by ``best_metric`` (None without one, or when no step has a finite value)."""
        best = ranked(self.values(metrics), self.best_mode)
        return best[0] if best else None

    def doomed(
        self, metrics: Mapping[int, dict[str, Any] | None], formats: Mapping[int, str] | None = None
    ) -> list[int]:
        """The steps of {step: its saved metrics} that retention removes, oldest first; ``formats``
        ({step: its format}): each format's steps apart (``steps_to_delete``)."""
        return steps_to_delete(
            metrics,
            max_to_keep=self.max_to_keep,
            keep_period=self.keep_period,
            metrics=self.values(metrics),
            best_mode=self.best_mode,
            keep_best=self.keep_best,
            formats=formats,
        )
