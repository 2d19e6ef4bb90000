"""Store: what a CheckpointManager saves into and restores from, one small protocol, two implementations.

Scope: the protocol alone. Its implementations: ``directory.Directory`` (the run directory, the
persistent store) and ``tiers.tierset.TierSet`` (the memory tiers in front of a Directory, which they
migrate into). The manager is its schedule, its writer and one Store; it never asks which one.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

from flax_ckpt._src.engine.fit import Fit

TargetOf = Callable[[Any], Any]  # the restore target for an opened step or copy


class Taken(Protocol):
    """What ``Store.snapshot`` hands the manager, which gives it back to ``Store.save``: an
    ``engine.snapshot.Snapshot`` or the memory tiers' ``TierSnapshot``."""

    @property
    def waited_s(self) -> float:
        """The caller's seconds spent waiting for the device (not a checkpoint's cost)."""
        ...

    @waited_s.setter
    def waited_s(self, value: float) -> None: ...

    @property
    def on_host(self) -> threading.Event:
        """Set once nothing of the snapshot is left on the devices."""
        ...

    @property
    def hurry(self) -> threading.Event | None:
        """Set once something waits for this save: its transfers from the devices stop pacing (None:
        nothing is on a device)."""
        ...


class Store(Protocol):
    """Where a manager's saves go. The caller's thread calls ``admit``, ``snapshot``, ``flush``,
    ``restore``, ``steps`` and ``close``; the manager's writer calls ``save``, one at a time, never
    while ``snapshot`` or ``flush`` runs."""

    @property
    def skipped(self) -> int:
        """Saves skipped because the previous one was still being written (``on_busy="skip"``)."""
        ...

    @property
    def tier_stats(self) -> list[Any]:
        """Per-save records of the memory tiers ([] for a store without them)."""
        ...

    def admit(self, step: int, busy: bool, force: bool) -> bool:
        """Whether to save ``step`` now, the writer ``busy`` with the previous save or not (on_busy)."""
        ...

    def snapshot(self, step: int, state: Any, *, copy: bool, force: bool) -> Taken:
        """The blocking half of a save (the writer idle): ``state`` as the caller's next steps cannot
        change it (``copy``: copied to host memory)."""
        ...

    def save(self, step: int, snap: Any, metrics: dict | None, t0: float, blocked: float) -> None:
        """The background half (the writer's thread): ``snap`` (from ``snapshot``) written and
        committed as ``step``, a save begun at ``t0`` that held its caller ``blocked`` seconds."""
        ...

    def flush(self) -> None:
        """Waits for background work beyond the writer's (a peer copy, a migration); raises its failure."""
        ...

    def restore(
        self, step: int | None, target_of: TargetOf, shardings: Any, fit: Fit, item: str | None
    ) -> Any:
        """``step`` (None: the newest good one), checked against ``target_of``'s target."""
        ...

    def steps(self) -> list[int]:
        """The committed steps, ascending."""
        ...

    def local_folder(self, step: int) -> str | None:
        """The folder on a local file system that holds committed ``step`` whole, for a read ahead of
        its restore; None where a restore reads elsewhere (an object store, copies in memory)."""
        ...

    def close(self, *, at_exit: bool = False) -> None:
        """Ends the store (the writer closed); ``at_exit``: at interpreter exit, where a collective may
        never be joined."""
        ...

    def let_go(self) -> None:
        """The end of a manager nobody closed: no collective; waits for background work, releases."""
        ...
