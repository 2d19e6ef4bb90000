"""Tiered checkpoints: local memory, peer memory and persistent storage, with differential copies.

Scope of the package: ``Tiers`` (the configuration) and ``Persistent`` (what the tiers need of the
persistent tier: a run directory, which they hold), here; and ``tierset.TierSet``, the store of a
CheckpointManager created with ``tiers=`` (manager/store.py): every save goes to the
memory tiers, every ``persist_interval_steps``-th is migrated to the manager's directory in the
background; restore (recover.py) picks the newest step complete across all processes in any
combination of tiers. What a process holds is holdings.py's, the copy format store.py's (files.py: the
private folders and data files), agreement and transfer sync.py's, the restore plan plan.py's,
reading a copy load.py's; persistent writes and reads are the directory's, through ``Persistent``.
TierSet's parts: policy.py (full or differential), ring.py (the peer exchange), migration.py,
admission.py (the busy-skip).

Per process, under ``<local_dir>/<digest of the manager's directory>/p<i>/``:
  local/<step>/          this process's shards of a step (the local-memory tier)
  peer-p<k>/<step>/      a replica of process k's shards (the peer-memory tier, held for k)
``local_dir`` defaults to ``/dev/shm/flax_ckpt-<uid>``, one per user. Every folder is created with mode
0700 and checked (lstat, no link followed) at start, as is every copy and file when it is read: one
owned by another user or writable by group or others is refused (files.py), so another user of a
shared host cannot plant a copy that a restore would read (the job folder's name is computable).
Each copy has its own commit record (``commit.json``), written once every process holds the step in
that tier (a key-value vote); a tier's commit never waits for another tier. Copies carry the run's
session id, so a restore never mixes copies of one step number written by different runs.

Placement: process i replicates to (i + k) % n, k the smallest shift such that no process's replica
lands in its own failure domain (host name + local_dir); with one domain, or one process, the peer
tier is off (logged). The replica of step s travels over a JAX collective at the next ``save`` (or
``wait_until_finished``/``close``), on the caller's thread, so the peer tier trails the local one by
one save. Memory per process and tier, between saves, is at most the max_to_keep copies and their
base (two bases only while copies made against the older one are kept), each at most the size of the
process's shards, plus one spare data file: the pages of the last removed copy, kept for the next copy
to be written into (files.py; none while two bases are kept: the older one's file becomes the spare
when it goes). With a frozen backbone and differential copies, that is the base, one spare and the
copies' changed bytes. A full copy's snapshot is taken straight into the spare's pages, its crc32c
computed as it is copied. Every snapshot is taken into a
spare so; one that would make a differential copy is first sampled against the base
(encode.changed_share): where more than about half of it would be stored (adam's state), it is
stored full, as it lies (nothing compared, nothing copied again). A differential copy that stores
more than half all the same makes the next rebase_interval copies full ones, twice as many after
each further one in a row (up to 64 times).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from flax_ckpt._src.engine.fit import Fit
from flax_ckpt._src.engine.snapshot import Snapshot
from flax_ckpt._src.storage import Storage

TargetOf = Callable[[Any], Any]  # the restore target for an opened copy or step (the manager's)


def default_local_dir() -> str:
    """This user's folder of the memory tiers in the host's tmpfs (created with mode 0700)."""
    return f"/dev/shm/flax_ckpt-{os.geteuid()}"


@dataclass(frozen=True)
class Tiers:
    """Where a CheckpointManager's checkpoints live besides its directory: memory tiers in front of it.

    Every save goes to this process's memory (and a replica to a peer's); every
    ``persist_interval_steps``-th is migrated to the manager's directory in the background; restore
    picks the newest step complete across all processes in any combination of tiers.

    Args:
      local_dir: host tmpfs folder of the memory tiers (one per host; processes whose local_dir or host
        differ count as different failure domains); by default ``/dev/shm/flax_ckpt-<uid>``. It must be
        this user's own folder (created with mode 0700 when missing) or root's sticky one (like
        /dev/shm); every folder and file the tiers use in it must be this user's, writable by nobody
        else.
      peer: replicate each process's copy to another failure domain (off with one domain).
      persist_interval_steps: the first saved step at or after each multiple of it is migrated to the
        manager's directory (None: never; ``save(force=True)`` always is).
      differential: store only the chunks changed since the tier's base copy.
      max_to_keep: committed steps kept per memory tier.
      rebase_interval: a new full base after this many differential copies.
      cleanup: at ``close``, migrate the newest step if it is only in memory, then delete this job's
        memory tiers.
      on_busy: what a ``save`` does when the previous save is still being written into the memory
        tiers: "skip" returns False at once, so that training never waits for a copy (skipped steps
        are counted in ``tier_stats``, the first is logged); "wait" holds the step until the previous
        save is committed. With several processes, a step is skipped by all when any one is busy.
        ``save(force=True)`` always waits. "Busy" is judged against the device: a save whose state is
        still being computed (the loop runs ahead of the device) first waits for the writer or the
        state, whichever is first, and that wait is reported as ``waited_for_device_s``.

    Raises:
      ValueError: ``on_busy`` is neither "skip" nor "wait", or an interval or count is not a positive
        int.

    Example:
      >>> import numpy as np
      >>> tiers = fc.Tiers(local_dir="shm", persist_interval_steps=2, on_busy="wait")
      >>> with fc.CheckpointManager("run", tiers=tiers) as mgr:
      ...     for step in range(1, 4):
      ...         _ = mgr.save(step, {"w": np.full(2, step, np.float32)})
      ...     mgr.wait_until_finished()
      ...     print(mgr.all_steps(), fc.metadata("run/2").step, mgr.restore()["w"])  # 2: migrated
      [2, 3] 2 [3. 3.]
    """

    local_dir: str = field(default_factory=default_local_dir)
    peer: bool = True
    persist_interval_steps: int | None = 10
    differential: bool = True
    max_to_keep: int = 2
    rebase_interval: int = 8
    cleanup: bool = True
    on_busy: str = "skip"

    def __post_init__(self):
        if self.on_busy not in ("skip", "wait"):
            raise ValueError(f"Tiers.on_busy must be 'skip' or 'wait', got {self.on_busy!r}")
        for name in ("persist_interval_steps", "max_to_keep", "rebase_interval"):
            v = getattr(self, name)
            if (v is not None or name != "persist_interval_steps") and (
                isinstance(v, bool) or not isinstance(v, int) or v < 1
            ):
                raise ValueError(f"Tiers.{name} must be a positive int, got {v!r}")


class Persistent(Protocol):
    """The persistent tier, as the memory tiers use it: a run directory (the manager's
    ``manager/directory.Directory``), given to a TierSet at start and held by it: the tiers migrate
    into it, restore from it, and close it when they close. The tiers import nothing of the manager."""

    url: str  # named in messages

    @property
    def strict(self) -> bool:
        """A damaged newest step is an error, not a fallback (the restore's default)."""
        ...

    @property
    def storage(self) -> Storage:
        """The directory's storage, where the run's identity is kept (holdings.RUN_FILE)."""
        ...

    def steps(self) -> list[int]:
        """The steps committed there now."""
        ...

    def migrate(self, step: int, snap: Snapshot, metrics: dict | None, t0: float, blocked: float) -> None:
        """Migrates ``step`` there (the migration thread, or the caller's at close): writes and commits
        ``snap``, as a save begun at ``t0`` (perf_counter) that held its caller ``blocked`` seconds."""
        ...

    def read(self, step: int, target_of: TargetOf, shardings: Any, fit: Fit) -> Any:
        """Restores ``step`` from there on this process (a restore plan's "persistent" source)."""
        ...

    def resumed(self, step: int, tier: str, nbytes: int, seconds: float) -> None:
        """The tiers restored ``step``, this process's shards from ``tier`` (``nbytes`` read from memory
        in ``seconds``): recorded, and the run resumed from it."""
        ...

    def close(self, *, at_exit: bool = False) -> None:
        """Releases the directory (the tiers closed)."""
        ...

    def let_go(self) -> None:
        """Releases the directory without a collective (a manager nobody closed)."""
        ...
