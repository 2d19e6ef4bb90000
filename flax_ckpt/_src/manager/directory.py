"""Directory: a run directory as a manager's store (manager/store.py), the persistent one.

Scope: the run's format and layout, its spare files (``Layout.recycler``), the step index (steps.py),
the directory lock and the removal of crashed saves' leftovers (the claim), the agreed restore
(agreed.py) and a read-only manager's restore beside the run it follows, retention after each commit,
the arena (the last durable snapshot, whose buffers the next snapshot refills), the busy-skip
(tiers/admission.py) and the save statistics. The memory tiers (tiers/tierset.py) hold one of these
as their persistent tier and migrate into it (``migrate``). Not here: when to save (schedule.py), the
writer (writer.py), the composition (manager.py).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

from flax_ckpt._src import layouts
from flax_ckpt._src.commit import distributed
from flax_ckpt._src.engine.fit import Fit
from flax_ckpt._src.engine.reader import Source
from flax_ckpt._src.engine.snapshot import Snapshot
from flax_ckpt._src.errors import CheckpointError, CheckpointLockedError, CheckpointNotFoundError
from flax_ckpt._src.manager.agreed import DAMAGE, AgreedRestore, TargetOf
from flax_ckpt._src.manager.stats import RestoreStats, SaveStats, publish
from flax_ckpt._src.manager.steps import StepIndex
from flax_ckpt._src.manager.vanishing import being_deleted
from flax_ckpt._src.native import sharing
from flax_ckpt._src.retention import Retention
from flax_ckpt._src.storage import ObjectStoreOptions, Storage, open_storage
from flax_ckpt._src.storage.lock import DirectoryLock
from flax_ckpt._src.tiers.admission import Admission
from flax_ckpt._src.window import Window

log = logging.getLogger("flax_ckpt")


class Directory:
    """The committed steps of one run directory, written and restored (a ``Store``).

    Args:
      directory: the folder or URL; created unless ``read_only``.
      format: the format asked for (None: the run's own; layouts.run_format).
      serializer: the native layout's serializer.
      tiered: memory tiers will sit in front (they need the native format).
      retention: which steps to keep.
      on_busy: "wait" or "skip" (tiers/admission.py).
      read_only: follow a run another process writes: no lock, nothing written.
      strict: a damaged newest step is an error, not a fallback.
      metadata: the JSON value recorded with every step.
      metric_writer: gets each save's statistics.
      storage_options: how to reach object stores.
    """

    def __init__(
        self,
        directory: Any,
        *,
        format: str | None,
        serializer: Any,
        tiered: bool,
        retention: Retention,
        on_busy: str,
        read_only: bool,
        strict: bool,
        metadata: Any,
        metric_writer: Any,
        storage_options: "ObjectStoreOptions | dict[str, Any] | None",
    ):
        self.storage: Storage = open_storage(directory, options=storage_options)
        self.url, self.read_only = self.storage.url, read_only
        self.prefix = distributed.job_prefix("manager", self.url)  # this run's agreement rounds
        if not read_only:  # a reader may start before the writer made the directory: it then sees no steps
            self.storage.makedirs()
        self.format, warning = layouts.run_format(self.storage, format, serializer, tiers=tiered)
        if warning is not None:
            log.warning("%s", warning)
        self.layout: layouts.Layout = layouts.layout(self.format, serializer)
        if not read_only and not tiered:  # native steps share unchanged chunks (sharing.enable)
            sharing.enable(self.layout, self.storage)
        self.recycler = None if read_only else self.layout.recycler(self.storage)
        self.index = StepIndex(self.storage, self.layout, self.prefix, serializer, self.recycler)
        self._restore = AgreedRestore(self.index, self.prefix, strict=strict)
        self._retention, self.metadata, self.metric_writer = retention, metadata, metric_writer
        self.admission = Admission(
            on_busy, self._vote if distributed.process_count() > 1 else None, self._warn
        )
        self.stats: Window[SaveStats] = Window()  # the newest saves, with totals
        self.restore_stats: Window[RestoreStats] = self._restore.stats
        self._arena: Snapshot | None = None  # the last durable snapshot, refilled by the next one
        self._refill = False  # the snapshot in flight is a copy: its buffers serve the next one
        self._created = time.perf_counter()
        self._lock: DirectoryLock | None = None
        self.claimed = False
        try:
            if not self.layout.foreign and not read_only:
                self.claim()
            self.index.scan(tidy=self.claimed)
        except BaseException:  # a directory that failed to open holds nothing: a retry can open it
            self.let_go()
            raise

    @property
    def strict(self) -> bool:
        return self._restore.strict

    @property
    def skipped(self) -> int:
        return self.admission.skipped

    @property
    def tier_stats(self) -> list[Any]:
        return []

    # ---------------------------------------------------------------------------------- claim

    def claim(self, state: Any = None) -> None:
        """Before the first write: the directory lock (one per job: its other processes share it) and
        the removal of crashed saves' leftovers. A native run claims its directory when it opens; an
        Orbax run at its first save (a restore-only manager writes nothing there), with a lock file
        that is removed again at close. ``state``: the first save's, refused (nothing written, no
        lock) when the run's steps cannot hold it (Layout.check_items)."""
        if self.claimed:
            return
        if state is not None:
            self.layout.check_items(state)
        if self.storage.local_path is not None and distributed.process_index() == 0:
            _held_here(self.storage.local_path)
            self._lock = DirectoryLock(self.storage.local_path, tidy=self.layout.foreign)
            _LOCKED.add(self)
        self.claimed = True
        if self.layout.foreign:
            self.index.scan(
                tidy=True
            )  # the view from the open may be stale by now; this scan removes the leftovers

    # ---------------------------------------------------------------------------------- steps

    def steps(self) -> list[int]:
        return self.index.steps()

    def local_folder(self, step: int) -> str | None:
        root = self.storage.local_path
        return None if root is None else os.path.join(root, self.index.folder_name(step))

    def reload(self) -> None:
        """Reads the committed steps again (every process adopts process 0's view)."""
        self.index.scan(tidy=False)

    def open(self, step: int, item: str | None = None) -> Source:
        return self.index.open(step, item)

    # ---------------------------------------------------------------------------------- save

    def admit(self, step: int, busy: bool, force: bool) -> bool:
        return self.admission.admit(step, busy, force)

    def _vote(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        return distributed.allgather(self.prefix, "admit", mine)

    def _warn(self, step: int) -> None:
        log.warning(
            "step %d not saved in %s: the previous save is still being written, and on_busy='skip' "
            "never holds training for it; further skips are counted in mgr.skipped, not logged",
            step,
            self.url,
        )

    def snapshot(self, step: int, state: Any, *, copy: bool, force: bool) -> Snapshot:
        """The run layout's snapshot, into the buffers of the previous durable one (no page faults of
        fresh memory)."""
        snap, self._arena = self.layout.snapshot(state, copy=copy, reuse=self._arena), None
        self._refill = copy
        return snap

    def save(
        self,
        step: int,
        snap: Snapshot,
        metrics: dict | None,
        t0: float,
        blocked: float,
        *,
        migrated: bool = False,
    ) -> None:
        """Background: writes and commits ``step`` (the layout brings device-copied shards to host
        first, raising a failed step's error), records it, applies retention. ``migrated``: a memory
        tier's copy (its buffers are the tier's: never refilled here)."""
        name = self.index.new_folder(step)
        times = self.layout.persist(
            snap, self.storage, name, step=step, metrics=metrics, metadata=self.metadata
        )
        self.index.add(step, name, metrics)
        stats = SaveStats(
            step,
            snap.nbytes,
            blocked,
            snap.seconds,
            times.write,
            times.commit,
            time.perf_counter() - t0,
            fsync_s=times.fsync,
            start_s=t0 - self._created,
            serialize_s=times.serialize,
            written_bytes=times.written,
            migrate_s=times.write + times.commit if migrated else 0.0,
            waited_for_device_s=snap.waited_s,
            snapshot_mode=snap.choice.mode if snap.choice else "",
            device_bytes=snap.choice.device_bytes if snap.choice else 0,
        )
        self.stats.append(stats)
        publish(stats, self.url, self.metric_writer)
        self.index.retain(self._retention)
        if self._refill and not migrated:
            self._arena = snap.reusable()  # durable now: the next snapshot may overwrite its buffers

    def migrate(self, step: int, snap: Snapshot, metrics: dict | None, t0: float, blocked: float) -> None:
        """A memory tier's copy of ``step`` written here (the migration's thread, or the caller's at close)."""
        self.save(step, snap, metrics, t0, blocked, migrated=True)

    def flush(self) -> None:
        """Nothing runs beyond the writer's job."""

    # ---------------------------------------------------------------------------------- restore

    def restore(
        self, step: int | None, target_of: TargetOf, shardings: Any, fit: Fit, item: str | None
    ) -> Any:
        """The agreed restore; a step restored makes the steps up to it this run's (resumed)."""
        if self.read_only:
            return self._restore_following(step, target_of, shardings, fit, item)
        restores = len(self.restore_stats)
        out = self._restore.restore(step, target_of, shardings, fit, item)
        if len(self.restore_stats) > restores:  # resumed the run: its steps up to this one are this run's
            self.index.resumed(self.restore_stats[-1].step)
            sharing.resumed(self.layout, self.restore_stats[-1].step)
        return out

    def read_ahead(self, prefetch: Any) -> None:
        """The next step read takes ``prefetch`` (native/prefetch.py: its buffers serve that step)."""
        self._restore.ahead = prefetch

    def read(self, step: int, target_of: TargetOf, shardings: Any, fit: Fit) -> Any:
        """``step`` read on this process alone (a memory tiers' restore plan's persistent source)."""
        return self._restore.read(step, target_of, shardings, fit)

    def resumed(self, step: int, tier: str, nbytes: int, seconds: float) -> None:
        """The memory tiers restored ``step`` from ``tier``: recorded (a persistent read recorded
        itself), and the run resumed from it."""
        if tier != "persistent":
            self.restore_stats.append(RestoreStats(step, tier, nbytes, seconds))
        self.index.resumed(step)

    def _restore_following(
        self, step: int | None, target_of: TargetOf, shardings: Any, fit: Fit, item: str | None
    ) -> Any:
        """A read-only manager's restore, beside a run that commits and deletes steps meanwhile: the steps
        are read again first; a step that the run's retention deleted while it was read (gone from the
        directory after the failure) is followed, for ``step=None``, by the newest step committed then,
        and is for a named step a CheckpointNotFoundError saying so. A step still there that fails to
        read is damage: for ``step=None`` the next newest step is tried with a warning (unless strict)."""
        skip: set[int] = set()  # steps deleted or damaged under this restore
        while True:
            self.reload()
            steps = self.index.steps()
            if step is not None and step not in steps:
                return self._restore.restore(step, target_of, shardings, fit, item)  # its not-found error
            left = [s for s in steps if s not in skip]
            if not left:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint in {self.url}"
                    + (f" (steps {sorted(skip)} were deleted or damaged while being read)" if skip else "")
                )
            s = left[-1] if step is None else step
            try:
                return self._restore.restore(s, target_of, shardings, fit, item)
            except (CheckpointError, OSError) as e:
                self._followed_failure(s, step, e)
                skip.add(s)

    def _followed_failure(self, s: int, step: int | None, e: Exception) -> None:
        """Step ``s`` failed to restore with ``e``: raised when it is still committed (damage, or a target
        that does not fit) and asked for (``step``) or strict; a CheckpointNotFoundError for a named
        step that was deleted meanwhile; else logged, and the next newest step is tried."""
        self.reload()
        if s in self.index.steps() and type(e).__name__ in DAMAGE and self._going(s):
            self.reload()  # its files go first (Orbax's deletion): once gone, it is not in the steps
        if s in self.index.steps():
            if step is not None or self.strict or type(e).__name__ not in DAMAGE:
                raise e
            log.warning(
                "step %d in %s is damaged (%s: %s); trying the next newest step",
                s,
                self.url,
                type(e).__name__,
                e,
            )
        elif step is not None:
            raise CheckpointNotFoundError(
                f"step {step} of {self.url} was deleted while it was being restored (the run "
                f"writing there removes old steps: its max_to_keep); committed steps now: "
                f"{self.index.steps()}. Restore one of those (step=None: the newest), or have the "
                "run keep the steps an evaluator reads (keep_period)"
            ) from e
        else:
            log.info(
                "step %d of %s was deleted while it was being restored; restoring the newest step",
                s,
                self.url,
            )

    def _going(self, step: int) -> bool:
        """Whether committed ``step``, which failed to read, is being deleted (manager/vanishing.py)."""
        return being_deleted(self.storage, self.index.folder_name(step))

    # ---------------------------------------------------------------------------------- close

    def close(self, *, at_exit: bool = False) -> None:
        """Releases the directory: the arena, the spare files, the lock."""
        self.let_go()

    def let_go(self) -> None:
        self._arena = None
        if self.recycler is not None:
            self.recycler.close()
        if self._lock is not None:
            self._lock.release()
            _LOCKED.discard(self)


_LOCKED: "weakref.WeakSet[Directory]" = weakref.WeakSet()  # directories whose lock this process holds


def _held_here(path: str) -> None:
    """CheckpointLockedError when a directory of this process, still open, holds the lock of ``path`` (a
    notebook cell run again after an exception, before ``close()``): the lock's own error would name
    this process's pid as if it were another's."""
    here = os.path.realpath(path)
    for earlier in list(_LOCKED):
        lock = earlier._lock
        if lock is not None and lock.fd >= 0 and os.path.realpath(os.path.dirname(lock.path)) == here:
            raise CheckpointLockedError(
                f"{earlier.url} is in use by an earlier CheckpointManager of this process (pid "
                f"{os.getpid()}), which was never closed (a notebook cell or a loop that raised before "
                "close()?). Close it first: call close() on it (the variable that held it, e.g. mgr.close(), "
                "or ckpt.close() for a CheckpointCallback, which closes an earlier callback of its directory "
                "itself); its save in flight is committed. Use `with fc.CheckpointManager(...) as mgr:` to "
                "close it even when the code raises"
            )
