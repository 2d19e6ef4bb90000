"""A long run's records, bounded: the newest of them, and totals over all of them.

Scope: ``Window``, the list a CheckpointManager keeps its per-save, per-restore and per-copy records in
(``mgr.stats``, ``mgr.restore_stats``, ``mgr.tier_stats``). What the records hold is theirs
(manager/stats.py, tiers/tierset.py). No I/O.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
SIZE = 1000  # records kept of each kind (the newest): about 0.5 MiB of a run's saves


class Window(list, Generic[T]):
    """The newest ``size`` records of a run (a list: index, slice, iterate, ``len``), with ``added``
    (records added in all) and ``totals`` ({numeric field: its sum over every record added}): a long
    run's statistics stay the same size however many saves it makes."""

    def __init__(self, size: int | None = None):
        super().__init__()
        self.size, self.added = SIZE if size is None else size, 0
        self.totals: dict[str, float] = {}

    def append(self, record: T) -> None:
        """Adds ``record`` (a dataclass), dropping the oldest one kept past ``size``."""
        super().append(record)
        self.added += 1
        if is_dataclass(record):
            for f in fields(record):
                v: Any = getattr(record, f.name)
                if isinstance(v, (int, float)) and not isinstance(v, bool) and f.name != "step":
                    self.totals[f.name] = self.totals.get(f.name, 0) + v
        if len(self) > self.size:
            del self[0]

    def copy(self) -> Window[T]:
        """A copy of the records kept, with the same ``added`` and ``totals``."""
        out: Window[T] = Window(self.size)
        out.extend(self)
        out.added, out.totals = self.added, dict(self.totals)
        return out
