"""CheckpointManager: when to save, what to keep, and which step to restore.

Scope: scheduling (``save_interval_steps``, ``force``), retention (retention.py's ``steps_to_delete``,
shared with the CLI's prune), latest/best bookkeeping rebuilt from the directory, the directory lock,
cleanup of crashed saves, per-save statistics, and restore with fallback to an older good step. Steps
are written in one format (layouts.Layout) and read in whichever format each step folder has. The path
of a save: ``save`` (snapshot, caller's thread) -> AsyncWriter.submit -> ``_persist`` -> Layout.persist
-> serializer.write -> storage.write.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
import time
from dataclasses import asdict
from typing import Any, Callable, Literal

from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src import layouts
from flax_ckpt._src.commit import distributed
from flax_ckpt._src.engine import restore as engine
from flax_ckpt._src.engine.leaves import CheckpointInfo
from flax_ckpt._src.engine.snapshot import Snapshot, jsonable
from flax_ckpt._src.errors import (CheckpointError, CheckpointNotFoundError, StorageError,
                                   error_class)
from flax_ckpt._src.interval import AutoInterval
from flax_ckpt._src.retention import finite, steps_to_delete
from flax_ckpt._src.stats import RestoreStats, SaveStats
from flax_ckpt._src.serializers import Serializer
from flax_ckpt._src.storage import ObjectStoreOptions, Storage, open_storage
from flax_ckpt._src.storage.lock import LOCK_FILE, DirectoryLock
from flax_ckpt._src.tiers import TierSet, Tiers
from flax_ckpt._src.tiers.store import TierSnapshot
from flax_ckpt._src.writer import AsyncWriter

log = logging.getLogger("flax_ckpt")
_DAMAGE = ("CorruptCheckpointError", "InvalidManifestError", "FileNotFoundError", "CheckpointNotFoundError",
           "NotADirectoryError")  # a step that cannot be read: restore falls back past it
__all__ = ["CheckpointManager", "DirectoryLock", "LOCK_FILE", "RestoreStats", "SaveStats"]
TargetOf = Callable[[engine.Source], Any]  # the restore target for an opened step (restore's target_for)


def _target_of(target: Any, target_for: Callable[[CheckpointInfo], Any] | None) -> TargetOf:
    """restore's ``target`` or ``target_for`` as one function of the opened source: ``target_for`` reads
    the source's records, so no step is opened twice."""
    if target_for is None:
        return lambda source: target
    return lambda source: target_for(source.info())


class CheckpointManager:
    """Periodic, asynchronous, retained checkpoints of a training run in ``directory``.

    Each option has one meaning: ``save_interval_steps`` (save steps divisible by it; "auto": see
    interval.py), ``max_to_keep`` (newest N kept; None keeps all), ``keep_period`` (steps divisible by
    it kept forever), ``best_metric``/``best_mode``/``keep_best`` (the best N by that metric also kept),
    ``async_save``, ``serializer`` ('raw', 'zarr3' or an instance), ``strict`` (restore(step=None)
    raises on a damaged newest step instead of falling back to an older one with a warning),
    ``format`` (the layout new steps are written in: None, the default, follows the directory, so a run
    stays in one format: "orbax" when its steps are Orbax's, else "native"; an explicit "native" or
    "orbax" that contradicts the steps there is a ValueError; a directory holding both follows its
    newest step, with a warning; in an Orbax run of named items, ``args.Composite``'s, a step is a
    dict keyed by exactly those items), ``tiers`` (memory tiers, fc.Tiers), ``storage_options``
    (fc.ObjectStoreOptions: how to reach s3:// and gs://). Retention covers every committed step of the
    directory, also those this manager did not write; its first deletion of such steps logs a warning
    naming them.

    The directory lock (local folders) keeps two live managers from writing one directory. A native
    run takes it when the manager opens; an Orbax run at its first save (then also removing leftovers
    of crashed saves), and removes the lock file again at close, so a manager that only restores an
    Orbax run writes nothing into it.
    """

    def __init__(self, directory: Any, *, save_interval_steps: "int | Literal['auto']" = 1,
                 max_to_keep: int | None = None,
                 keep_period: int | None = None, best_metric: str | None = None,
                 best_mode: Literal["min", "max"] = "min", keep_best: int | None = None,
                 async_save: bool = True, serializer: "str | Serializer | None" = None, tiers: Any = None,
                 strict: bool = False, metadata: Any = None, format: Literal["native", "orbax"] | None = None,
                 overhead_budget: float = 0.01, mtbf_s: float | None = None, metric_writer: Any = None,
                 storage_options: "ObjectStoreOptions | dict[str, Any] | None" = None):
        self._auto = AutoInterval(overhead_budget, mtbf_s) if save_interval_steps == "auto" else None
        self._agreed_interval = 1  # "auto" with several processes: the interval all of them use (see save)
        if self._auto is None and (isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int)
                                   or save_interval_steps < 1):
            raise ValueError(f"save_interval_steps must be a positive int or 'auto', got {save_interval_steps!r}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metric name to rank steps by)")
        if tiers is not None and not isinstance(tiers, Tiers):
            raise TypeError(f"tiers must be a flax_ckpt.Tiers, got {type(tiers).__name__}")
        self._tiers: TierSet | None = None
        self.storage: Storage = open_storage(directory, options=storage_options)
        self.directory = self.storage.url
        self._prefix = distributed.job_prefix("manager", self.directory)  # this run's agreement rounds
        self.storage.makedirs()
        self.format = self._follow(format, serializer, tiers)
        self.layout: layouts.Layout = layouts.layout(self.format, serializer)
        self.save_interval_steps, self.max_to_keep, self.keep_period = save_interval_steps, max_to_keep, keep_period
        self.best_metric, self.best_mode, self.keep_best = best_metric, best_mode, keep_best
        self.async_save, self.strict, self.metadata = async_save, strict, metadata
        self.metric_writer = metric_writer  # anything with write_scalars(step, dict), e.g. a clu MetricWriter
        self._last_call_end: float | None = None
        self._spare: Snapshot | None = None  # the last durable snapshot, refilled by the next save
        self._created = time.perf_counter()
        self._last_saved: int | None = None
        self._lock: DirectoryLock | None = None
        self._claimed = False
        self._leftovers: list[str] = []  # folders of crashed saves, removed once the directory is claimed
        self._mutex = threading.Lock()
        self._metrics: dict[int, dict[str, Any] | None] = {}
        self._folders: dict[int, layouts.StepFolder] = {}  # committed steps: folder name and format
        self._damaged: dict[int, tuple[Exception, layouts.StepFolder]] = {}  # step folders that fail to open
        self.stats: list[SaveStats] = []
        self.restore_stats: list[RestoreStats] = []
        self._writer = AsyncWriter()
        self._closed = False
        self._written: set[int] = set()  # steps this manager wrote: retention of any other step is announced
        self._retention_warned = False
        try:
            if not self.layout.foreign:
                self._claim()
            self._scan()
            if tiers is not None:  # after the scan: the tiers need the persistent steps
                self._tiers = TierSet(tiers, self.directory, set(self._metrics))
        except BaseException:  # a manager that failed to open holds nothing: a retry can open the directory
            self._closed = True
            self._writer.close()
            if self._lock is not None:
                self._lock.release()
            raise

    # ------------------------------------------------------------------------------------ directory

    def _follow(self, requested: str | None, serializer: Any, tiers: Any) -> str:
        """The format of new steps: the run's own (layouts.run_format), from the committed step folders."""
        folders, _ = layouts.step_folders(self.storage)
        committed = [f for f in folders
                     if f.layout.name == "orbax" or commit_mod.is_committed(self.storage, f.name, f.layout.record)]
        fmt, warning = layouts.run_format(requested, committed, self.directory)
        if warning is not None:
            log.warning("%s", warning)
        followed = f"{self.directory} holds Orbax steps, so this run's new steps are Orbax's too, and "
        if fmt == "orbax" and requested is None and serializer is not None:
            raise ValueError(followed + "serializer= applies to native steps only; drop serializer= (or give a "
                             "native run a directory of its own)")
        if tiers is not None and fmt != "native":
            raise ValueError((followed if requested is None else "") + "tiers= needs format='native' (the memory "
                             "tiers migrate native checkpoints)")
        return fmt

    def _claim(self) -> None:
        """Before the first write: the directory lock (one per job: its other processes share it) and
        the removal of crashed saves' leftovers. A native run claims its directory when the manager
        opens; an Orbax run at its first save (a restore-only manager writes nothing there), with a
        lock file that is removed again at close."""
        if self._claimed:
            return
        if self.storage.local_path is not None and distributed.process_index() == 0:
            self._lock = DirectoryLock(self.storage.local_path, tidy=self.layout.foreign)
        self._claimed = True
        if self.layout.foreign:
            self._scan()  # the view from the open may be stale by now; this scan removes the leftovers

    def _scan(self) -> None:
        """Rebuilds the view of committed steps from the directory and, once the directory is claimed,
        removes leftovers of crashes. With several processes, process 0 alone scans and removes, and
        every process adopts its view (steps, their folders and metrics, damaged steps): all restore
        and retain the same steps."""
        lead = distributed.process_index() == 0
        if distributed.process_count() > 1 and not lead:
            self._agree_view()
            return
        folders, temporary = layouts.step_folders(self.storage)
        self._metrics, self._folders, self._damaged = {}, {}, {}
        self._leftovers = list(temporary)
        for f in folders:
            try:
                metrics = f.layout.metrics(self.storage.sub(f.name))
            except StorageError:
                raise  # the store failed (after its retries): say so rather than hide a committed step
            except (CheckpointError, OSError) as e:
                if not self.storage.supports_rename and not self.storage.sub(f.name).exists(f.layout.record):
                    self._leftovers.append(f.name)  # an uncommitted object-store step: its commit object never came
                else:
                    log.warning("ignoring damaged step %d in %s: %s", f.step, self.directory, e)
                    self._damaged[f.step] = (e, f)
                continue
            self._metrics[f.step], self._folders[f.step] = metrics, f
        if self.format == "orbax":  # new steps get the items of the run's newest step (args.Composite's names)
            orbax = [f for f in self._folders.values() if f.layout.name == "orbax"]
            self.layout.follow(self.storage, max(orbax, key=lambda f: f.step).name if orbax else None)
        if self._claimed and lead:
            for entry in self._leftovers:
                log.warning("removing %s/%s, left by an interrupted save or deletion", self.directory, entry)
                self.storage.delete(entry)
            self._leftovers = []
        if distributed.process_count() > 1:
            self._agree_view()

    def _agree_view(self) -> None:
        """Every process adopts process 0's view of the directory (a collective: at open and at each
        restore). Process 0 commits every step, so its view is the one that is right when another
        process's listing lags (object stores) or missed the end of a save that failed there."""
        with self._mutex:
            mine = {"steps": {str(s): [self._folders[s].name, self._folders[s].layout.name, self._metrics.get(s)]
                              for s in self._metrics if s in self._folders},
                    "damaged": {str(s): [type(e).__name__, str(e), f.name, f.layout.name]
                                for s, (e, f) in self._damaged.items()}}
        lead = distributed.allgather(self._prefix, "view", mine)[0]
        if distributed.process_index() == 0:
            return
        with self._mutex:
            self._metrics = {int(s): m for s, (_, _, m) in lead["steps"].items()}
            self._folders = {int(s): layouts.StepFolder(int(s), name, layouts.layout(fmt))
                             for s, (name, fmt, _) in lead["steps"].items()}
            self._damaged = {int(s): (error_class(kind)(msg), layouts.StepFolder(int(s), name, layouts.layout(fmt)))
                             for s, (kind, msg, name, fmt) in lead["damaged"].items()}

    def all_steps(self) -> list[int]:
        with self._mutex:
            steps = set(self._metrics)
        return sorted(steps | set(self._tiers.steps())) if self._tiers is not None else sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, Any] | None:
        with self._mutex:
            if step not in self._metrics:
                raise CheckpointNotFoundError(f"no committed step {step} in {self.directory}")
            return self._metrics[step]

    def _metric_values(self) -> dict[int, float | None]:
        return {s: (m or {}).get(self.best_metric) for s, m in self._metrics.items()} if self.best_metric else {}

    def best_step(self) -> int | None:
        if self.best_metric is None:
            return None
        with self._mutex:
            scored = [(v, s) for s, v in self._metric_values().items() if finite(v)]
        if not scored:
            return None
        return min(scored, key=lambda vs: (vs[0] if self.best_mode == "min" else -vs[0], -vs[1]))[1]

    @property
    def tier_stats(self) -> list[Any]:
        """Per-save records of the memory tiers (bytes written, reused, seconds per phase); [] without tiers."""
        return list(self._tiers.stats) if self._tiers is not None else []

    def should_save(self, step: int) -> bool:
        if step in self._metrics:
            return False
        if self._auto is not None:
            return self._last_saved is None or step - self._last_saved >= self.interval
        return step % self.save_interval_steps == 0

    @property
    def interval(self) -> int:
        """The steps between saves now in force (re-tuned continuously in "auto" mode; with several
        processes, the largest of their intervals, agreed at each save)."""
        if self._auto is None:
            return self.save_interval_steps
        return self._auto.interval() if distributed.process_count() == 1 else self._agreed_interval

    # ----------------------------------------------------------------------------------------- save

    def save(self, step: int, state: Any, *, metrics: dict[str, Any] | None = None, force: bool = False) -> bool:
        """Saves ``state`` as ``step`` if the schedule says so, or off schedule with ``force=True`` (e.g. the
        last step of a run whose length is not a multiple of ``save_interval_steps``); False when skipped
        (off schedule without ``force``, or a step that is saved already, which is never overwritten).

        Returns once the state is copied to host memory (async) or committed (sync). Raises a previous
        background failure as SaveFailedError. The path of a save: this method (snapshot on the
        caller's thread) -> AsyncWriter.submit -> ``_persist`` (background) -> Layout.persist ->
        serializer.write -> storage.write."""
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.directory}) is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        if self._auto is not None and self._last_call_end is not None:
            self._auto.observe_step(t0 - self._last_call_end)
        try:
            if not self._writer.busy:
                self._writer.wait()  # raise a finished save's failure now
            if step in self._metrics or (self._writer.busy and step == self._last_saved):
                log.info("step %d already saved in %s; skipped", step, self.directory)
                return False
            if not force and not self.should_save(step):
                return False
            if not self._claimed:
                if self.format == "orbax":  # a tree that does not fit the run's items: nothing written, no lock
                    self.layout.check_items(state)
                self._claim()
                if step in self._metrics:
                    log.info("step %d already saved in %s; skipped", step, self.directory)
                    return False
            metrics = jsonable(metrics, "metrics")
            self._writer.wait()  # back-pressure: one save in flight
            if self._tiers is not None:  # first sends the previous step's copy to its peer (a collective)
                snap = self._tiers.snapshot(step, state, copy=self.async_save, force=force)
            else:  # refill the previous durable snapshot's buffers: no page faults of fresh memory
                snap, self._spare = self.layout.snapshot(state, copy=self.async_save, reuse=self._spare), None
            blocked = time.perf_counter() - t0
            self._last_saved = step
            if self._auto is not None:
                self._auto.observe_save(blocked)
                if distributed.process_count() > 1:  # each process measures its own costs: all take the max
                    votes = distributed.allgather(self._prefix, "interval", {"step": step, "k": self._auto.interval()})
                    self._agreed_interval = max(v["k"] for v in votes)
            self._writer.submit(functools.partial(self._persist, step, snap, metrics, t0, blocked),
                                f"step {step} in {self.directory}")
            if not self.async_save:
                self._writer.wait()
            return True
        finally:
            self._last_call_end = time.perf_counter()

    def _persist(self, step: int, snap: Any, metrics: dict | None, t0: float, blocked: float) -> None:
        if isinstance(snap, TierSnapshot):  # memory tiers; migration comes back here with a plain Snapshot
            return self._tiers.save(step, snap, metrics, lambda s: self._persist(step, s, metrics, t0, blocked),
                                    t0, blocked)
        self._set_aside_damaged(step)
        with self._mutex:
            name = layouts.step_name(self.format, step, sorted(self._folders.values(), key=lambda f: f.step))
        times = self.layout.persist(snap, self.storage, name, step=step, metrics=metrics, metadata=self.metadata)
        with self._mutex:
            self._metrics[step] = metrics
            self._folders[step] = layouts.StepFolder(step, name, self.layout)
            self._written.add(step)
        stats = SaveStats(step, snap.nbytes, blocked, snap.seconds, times.write, times.commit,
                          time.perf_counter() - t0, fsync_s=times.fsync, start_s=t0 - self._created,
                          serialize_s=times.serialize, written_bytes=times.written,
                          migrate_s=times.write + times.commit if self._tiers is not None else 0.0)
        self._record(stats)
        self._apply_retention()
        if self._tiers is None and self.async_save:
            self._spare = snap  # durable now: the next snapshot may overwrite its buffers

    def _set_aside_damaged(self, step: int) -> None:
        """A new save of a step whose old folder is damaged moves the old one aside (never deletes it on a
        file system: ``<step>.damaged-<uuid>``; an object store has no rename, so there it is removed)."""
        damaged = self._damaged.pop(step, None)
        if damaged is None or distributed.process_index() != 0:
            return
        if self.storage.supports_rename:
            aside = f"{damaged[1].name}.damaged-{uuid.uuid4().hex[:8]}"
            self.storage.rename(damaged[1].name, aside)
            log.warning("step %d in %s was damaged; moved to %s before saving it again", step, self.directory, aside)
        else:
            commit_mod.remove(self.storage, damaged[1].name, damaged[1].layout.record)
            log.warning("step %d in %s was damaged; removed before saving it again", step, self.directory)

    def _record(self, stats: SaveStats) -> None:
        self.stats.append(stats)
        log.info("saved step %d to %s: %.1f MB, blocked %.1f ms, durable after %.2f s (%.2f GB/s)", stats.step,
                 self.directory, stats.nbytes / 1e6, stats.blocked_s * 1e3, stats.durable_s, stats.throughput_gbps)
        log.debug("save statistics: %s", asdict(stats))
        if self.metric_writer is not None:
            scalars = {f"checkpoint/{k}": v for k, v in asdict(stats).items() if k != "step"}
            self.metric_writer.write_scalars(stats.step, scalars)

    def _apply_retention(self) -> None:
        """Deletes the steps retention removes: every committed step of the directory counts, also those
        this manager did not write (an earlier run's, an Orbax job's); the first time some of those go, a
        warning names them and the option that keeps them."""
        with self._mutex:
            doomed = steps_to_delete(self._metrics, max_to_keep=self.max_to_keep, keep_period=self.keep_period,
                                     metrics=self._metric_values(), best_mode=self.best_mode,
                                     keep_best=self.keep_best)
        for step in doomed:
            with self._mutex:
                folder = self._folders.pop(step, None)
                self._metrics.pop(step, None)
            if folder is not None and distributed.process_index() == 0:  # every process drops it; process 0 deletes
                commit_mod.remove(self.storage, folder.name, folder.layout.record)
            log.info("retention removed step %d from %s", step, self.directory)
        others = [s for s in doomed if s not in self._written]
        if others and not self._retention_warned and distributed.process_index() == 0:
            self._retention_warned = True
            log.warning(
                "retention (max_to_keep=%d) deleted step%s %s of %s, which this manager did not write (%s there "
                "when it opened, e.g. an earlier run's or an Orbax job's): a manager's retention covers every step "
                "in its directory. To keep them, pass max_to_keep=None (keeps every step)%s, or give this run a "
                "directory of its own. Said once per manager.", self.max_to_keep, "s" if len(others) > 1 else "",
                ", ".join(map(str, others)), self.directory, "they were" if len(others) > 1 else "it was",
                "" if self.keep_best else " or keep_best=N with best_metric=... (keeps the best N as well)")

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is durable; raises its failure as SaveFailedError."""
        self._writer.wait()
        if self._tiers is not None:  # the peer copy of the last save, and the migration in flight
            self._tiers.flush()

    # -------------------------------------------------------------------------------------- restore

    def restore(self, step: int | None = None, target: Any = None, *, shardings: Any = None,
                partial: bool = False, item: str | None = None,
                target_for: Callable[[CheckpointInfo], Any] | None = None) -> Any:
        """Restores ``step`` (default: the newest committed step; if it is damaged and the manager is not
        strict, the newest older one that is good, with a warning). ``item``: one named item of an
        Orbax step (saved with args.Composite), as fc.restore's. ``target_for``: instead of ``target``,
        a function giving the target from the step's CheckpointInfo (called for each step tried).

        With several processes (every process calls it), the step is decided once for all: each process
        restores what it must read, checking every checksum as it reads, then they compare; all return
        the same step, or all fall back together to an older one (each discarding what it read), or all
        raise the same CheckpointError naming the process and file that failed."""
        self._writer.wait()
        target_of = _target_of(target, target_for)
        if self._tiers is not None:
            if item is not None:
                raise ValueError("item= selects an item of an Orbax step; a tiered manager holds native steps")
            return self._restore_tiered(step, target_of, shardings, partial)
        if distributed.process_count() > 1:
            self._agree_view()
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointNotFoundError(f"no committed step {step} in {self.directory} (steps: {steps})")
            return self._restore_agreed([step], target_of, shardings, partial, item, fallback=False)
        damaged = max(self._damaged, default=None)
        if self.strict and damaged is not None and (not steps or damaged > steps[-1]):
            raise self._damaged[damaged][0]  # strict: a damaged newest step is an error, not a fallback
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}")
        return self._restore_agreed(steps[::-1], target_of, shardings, partial, item, fallback=not self.strict)

    def _restore_agreed(self, candidates: list[int], target_of: TargetOf, shardings: Any, partial: bool,
                        item: str | None, fallback: bool) -> Any:
        """Tries ``candidates`` in order until one restores on every process (see ``restore``)."""
        for i, s in enumerate(candidates):
            try:
                out, err = self._restore_step(s, target_of, shardings, partial, item), None
            except (CheckpointError, OSError) as e:
                out, err = None, e
            failures = self._vote(s, err)
            if not failures:
                return out
            out = None  # discard what this process read
            damage = all(kind in _DAMAGE for kind, _ in failures.values())
            if not damage or not fallback or i == len(candidates) - 1:
                if distributed.process_count() == 1:
                    raise err
                raise self._shared_error(s, failures) from err
            for j, (kind, msg) in sorted(failures.items()):
                log.warning("step %d in %s is damaged on process %d (%s: %s); falling back to an older step",
                            s, self.directory, j, kind, msg)
        raise AssertionError("unreachable")

    def _vote(self, step: int, err: BaseException | None) -> dict[int, tuple[str, str]]:
        """{process: (error type, message)} of every process that could not restore ``step``."""
        return distributed.vote(self._prefix, f"restore of {self.directory}", step, err)

    def _shared_error(self, step: int, failures: dict[int, tuple[str, str]]) -> CheckpointError:
        """The one error every process raises when ``step`` cannot be restored on some process."""
        first = failures[min(failures)][0]
        detail = "; ".join(f"process {j}: {kind}: {msg}" for j, (kind, msg) in sorted(failures.items()))
        return error_class(first)(f"restore of step {step} of {self.directory} failed on "
                                  f"{'process' if len(failures) == 1 else 'processes'} "
                                  f"{', '.join(map(str, sorted(failures)))} (so on every process): {detail}")

    def _restore_tiered(self, step: int | None, target_of: TargetOf, shardings: Any, partial: bool) -> Any:
        """With tiers= (every process calls it): the newest step complete across processes in some
        combination of tiers, each process reading from the fastest tier holding its shards."""
        t0 = time.perf_counter()
        self._tiers.flush()
        with self._mutex:
            persistent = set(self._metrics)
        out, plan, nbytes = self._tiers.restore(
            step, target_of, shardings=shardings, partial=partial, persistent=persistent, strict=self.strict,
            restore_persistent=lambda s: self._restore_step(s, target_of, shardings, partial))
        tier = plan.sources[distributed.process_index()][0]
        if tier != "persistent":  # _restore_step recorded the persistent ones
            self.restore_stats.append(RestoreStats(plan.step, tier, nbytes, time.perf_counter() - t0))
        return out

    def _open(self, step: int, item: str | None = None) -> engine.Source:
        folder = self._folders.get(step) or layouts.StepFolder(step, str(step), self.layout)
        return folder.layout.open(self.storage.sub(folder.name), item)

    def _restore_step(self, step: int, target_of: TargetOf, shardings: Any, partial: bool,
                      item: str | None = None) -> Any:
        t0 = time.perf_counter()
        source = self._open(step, item)
        target = target_of(source)
        out = engine.restore(source, target, shardings=shardings, partial=partial)
        stats = RestoreStats(step, "persistent", engine.restored_nbytes(source, target, partial),
                             time.perf_counter() - t0)
        self.restore_stats.append(stats)
        log.info("restored step %d from %s (%s tier): %.1f MB in %.2f s", step, self.directory, stats.tier,
                 stats.nbytes / 1e6, stats.seconds)
        return out

    def item_metadata(self, step: int | None = None, *, item: str | None = None) -> CheckpointInfo:
        """fc.metadata of ``step`` (default: the newest), or of one named item of an Orbax step."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}")
        return self._open(step, item).info()

    # ---------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Waits for the save in flight, then releases the directory. Raises a background failure."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
            if self._tiers is not None:
                self._tiers.close(lambda: set(self._metrics),
                                  lambda s, snap, m: self._persist(s, snap, m, time.perf_counter(), 0.0))
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        lock = getattr(self, "_lock", None)
        if lock is not None and lock.fd >= 0 and not getattr(self, "_closed", True):
            try:
                self._writer.close()
            except Exception:
                pass
            lock.release()
