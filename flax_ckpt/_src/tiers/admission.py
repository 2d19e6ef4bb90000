"""Admission: whether a save the schedule asks for is made while the previous one is still being written.

Scope: the busy-skip of ``on_busy`` ("wait" or "skip"), its vote across processes and its count; used by
the memory tiers and by a manager's directory alike. Not here: when to save (the manager's schedule).
"""

from __future__ import annotations

from typing import Any, Callable

from flax_ckpt._src.errors import DistributedError

Vote = Callable[[dict[str, Any]], list[dict[str, Any]]]  # one key-value round: every process's message


class Admission:
    """``on_busy``: "wait" admits every step (the writer's back-pressure holds the caller); "skip" skips
    a step that finds the previous save still in flight, on any process (``vote``: a round of the
    caller's thread, None with one process), so that every process decides alike. ``warn(step)``: said
    at the first skip, once."""

    def __init__(self, on_busy: str, vote: Vote | None, warn: Callable[[int], None]):
        self.on_busy, self._vote, self._warn = on_busy, vote, warn
        self.skipped = 0  # steps skipped in all
        self._pending = 0  # steps skipped since the last admitted one

    def admit(self, step: int, busy: bool, force: bool) -> bool:
        """Whether to save ``step`` now, the writer ``busy`` or not; ``force`` always waits."""
        if self.on_busy == "wait" or force:
            return True
        if self._vote is not None:
            votes = self._vote({"step": step, "busy": busy})
            if any(v["step"] != step for v in votes):
                raise DistributedError(f"processes save different steps ({[v['step'] for v in votes]})")
            busy = any(v["busy"] for v in votes)
        if not busy:
            return True
        self.skipped += 1
        self._pending += 1
        if self.skipped == 1:
            self._warn(step)
        return False

    def take_skipped(self) -> int:
        """The steps skipped since the last call (the next save's record of them)."""
        n, self._pending = self._pending, 0
        return n
