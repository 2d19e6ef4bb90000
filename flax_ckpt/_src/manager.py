"""CheckpointManager: when to save, what to keep, and which step to restore.

Scope: scheduling (``save_interval_steps``, ``force``), retention (``steps_to_delete``, a pure function
shared with the CLI's prune), latest/best bookkeeping rebuilt from the directory, the directory lock,
cleanup of crashed saves, per-save statistics, and restore with fallback to an older good step. The
path of a save: ``save`` -> checkpoint.snapshot (caller's thread) -> AsyncWriter.submit -> ``_persist``
-> checkpoint.persist -> serializer.write -> storage.write.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import threading
import uuid
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Literal

from flax_ckpt._src.engine import checkpoint as ckpt
from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src import distributed as distributed
from flax_ckpt._src.orbax import compat as orbax_compat
from flax_ckpt._src.errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError, CorruptCheckpointError,
                     InvalidManifestError, StorageError)
from flax_ckpt._src.serializers import Serializer, get_serializer
from flax_ckpt._src.storage import LocalStorage, Storage, open_storage
from flax_ckpt._src.tiers.store import TierSnapshot
from flax_ckpt._src.tiers import TierSet, Tiers
from flax_ckpt._src.interval import AutoInterval
from flax_ckpt._src.writer import AsyncWriter

log = logging.getLogger("flax_ckpt")
LOCK_FILE = ".flax_ckpt.lock"


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
        scored = [(v, s) for s, v in metrics.items() if s in steps and _finite(v)]
        scored.sort(key=lambda vs: (vs[0] if best_mode == "min" else -vs[0], -vs[1]))
        keep.update(s for _, s in scored[:keep_best])
    return [s for s in steps if s not in keep]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class SaveStats:
    """One save's costs. ``blocked_s``: time ``save`` held the caller (waiting for the previous save +
    snapshot); ``durable_s``: from the ``save`` call to the commit being durable."""

    step: int
    nbytes: int
    blocked_s: float
    snapshot_s: float
    write_s: float  # serialization (checksums), writes and fsyncs of the data, wall time
    commit_s: float  # manifest, folder fsyncs, rename
    durable_s: float
    fsync_s: float = 0.0  # part of write_s: seconds in fsync, summed over writer threads
    migrate_s: float = 0.0  # tiers: migration of this step to persistent storage
    start_s: float = 0.0  # when save was called, seconds since the manager was created
    serialize_s: float = 0.0  # part of write_s: checksums of the data, summed over writer threads
    written_bytes: int = 0  # bytes of data files written (local file systems)

    @property
    def throughput_gbps(self) -> float:
        return self.nbytes / max(self.write_s + self.commit_s, 1e-9) / 1e9


@dataclass(frozen=True)
class RestoreStats:
    """One restore: which step, from which tier, how many array bytes, how long (reading, checking
    checksums and placing on devices)."""

    step: int
    tier: str
    nbytes: int
    seconds: float


class DirectoryLock:
    """An flock on ``<dir>/.flax_ckpt.lock``: exclusive across processes and managers; released by the
    OS when the holder dies, so a crashed run never leaves it held."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise CheckpointLockedError(
                f"{directory} is in use by another CheckpointManager ({holder}); close it first. "
                "A lock held by a process that died is released by the OS.") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


class CheckpointManager:
    """Periodic, asynchronous, retained checkpoints of a training run in ``directory``.

    Each option has one meaning: ``save_interval_steps`` (save steps divisible by it), ``max_to_keep``
    (newest N kept; None keeps all), ``keep_period`` (steps divisible by it kept forever),
    ``best_metric``/``best_mode``/``keep_best`` (the best N by that metric also kept), ``async_save``,
    ``serializer`` ('raw', 'zarr3' or an instance), ``strict`` (restore(step=None) raises on a damaged
    newest step instead of falling back to an older one with a warning).
    """

    def __init__(self, directory: Any, *, save_interval_steps: "int | Literal['auto']" = 1,
                 max_to_keep: int | None = None,
                 keep_period: int | None = None, best_metric: str | None = None,
                 best_mode: Literal["min", "max"] = "min", keep_best: int | None = None,
                 async_save: bool = True, serializer: "str | Serializer | None" = None, tiers: Any = None,
                 strict: bool = False, metadata: Any = None, format: Literal["flax_ckpt", "orbax"] = "flax_ckpt",
                 overhead_budget: float = 0.01,
                 mtbf_s: float | None = None, metric_writer: Any = None):
        self._auto = AutoInterval(overhead_budget, mtbf_s) if save_interval_steps == "auto" else None
        if self._auto is not None and distributed.process_count() > 1:
            raise ValueError("save_interval_steps='auto' measures one process's timings, so processes of a "
                             "multi-process job could pick different steps; pass an int interval there")
        if self._auto is None and (isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int)
                                   or save_interval_steps < 1):
            raise ValueError(f"save_interval_steps must be a positive int or 'auto', got {save_interval_steps!r}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep!r}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if format not in ("flax_ckpt", "orbax"):
            raise ValueError(f"format must be 'flax_ckpt' or 'orbax', got {format!r}")
        self.format = format
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric (the metric name to rank steps by)")
        if tiers is not None and not isinstance(tiers, Tiers):
            raise TypeError(f"tiers must be a flax_ckpt.Tiers, got {type(tiers).__name__}")
        if tiers is not None and format != "flax_ckpt":
            raise ValueError("tiers= needs format='flax_ckpt' (the memory tiers migrate native checkpoints)")
        self._tiers: TierSet | None = None
        self.storage: Storage = open_storage(directory)
        self.directory = self.storage.url
        self.save_interval_steps, self.max_to_keep, self.keep_period = save_interval_steps, max_to_keep, keep_period
        self.best_metric, self.best_mode, self.keep_best = best_metric, best_mode, keep_best
        self.async_save, self.strict, self.metadata = async_save, strict, metadata
        self.metric_writer = metric_writer  # anything with write_scalars(step, dict), e.g. a clu MetricWriter
        self._last_call_end: float | None = None
        self._spare: ckpt.Snapshot | None = None  # the last durable snapshot, refilled by the next save
        self._created = time.perf_counter()
        self._last_saved: int | None = None
        self.serializer = get_serializer(serializer)
        self._lock: DirectoryLock | None = None
        if isinstance(self.storage, LocalStorage):
            os.makedirs(self.storage.root, exist_ok=True)
            if distributed.process_index() == 0:  # one lock per job: its other processes share it
                self._lock = DirectoryLock(self.storage.root)
        self._mutex = threading.Lock()
        self._metrics: dict[int, dict[str, Any] | None] = {}
        self._damaged: dict[int, Exception] = {}  # step folders whose manifest fails validation
        self.stats: list[SaveStats] = []
        self.restore_stats: list[RestoreStats] = []
        self._writer = AsyncWriter()
        self._closed = False
        self._scan()
        if tiers is not None:  # after the scan: the tiers need the persistent steps
            self._tiers = TierSet(tiers, self.directory, set(self._metrics))

    # ------------------------------------------------------------------------------------ directory

    def _scan(self) -> None:
        """Rebuilds the view of committed steps from the directory and removes leftovers of crashes.
        With several processes, process 0 alone removes, and every process adopts its list of steps."""
        lead = distributed.process_index() == 0
        self._orbax = set(orbax_compat.list_steps(self.storage))
        for entry in self.storage.list():
            if commit_mod.is_temporary(entry) or orbax_compat.is_temporary_name(entry):
                if lead:
                    log.warning("removing %s/%s, left by an interrupted save or deletion",
                                self.directory, entry)
                    self.storage.delete(entry)
                continue
            if not entry.isdigit() or int(entry) in self._orbax:
                continue
            step = int(entry)
            try:
                body = ckpt.read_manifest(self.storage.sub(entry))
            except StorageError:
                raise  # the store failed (after its retries): say so rather than hide a committed step
            except (CheckpointError, OSError) as e:
                if not commit_mod.is_committed(self.storage, entry) and not self.storage.supports_rename:
                    if lead:  # an uncommitted object-store step: its commit object never came
                        self.storage.delete(entry)
                else:
                    log.warning("ignoring damaged step %d in %s: %s", step, self.directory, e)
                    self._damaged[step] = e
                continue
            self._metrics[step] = body.get("metrics")
        for step in self._orbax:  # steps written by Orbax (or by format="orbax"): resumed like ours
            self._metrics[step] = orbax_compat.read_step_metrics(self.storage, step)
        if distributed.process_count() > 1:
            steps = distributed.agree_steps(self.directory, list(self._metrics))
            self._metrics = {s: self._metrics.get(s) for s in steps}

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
            scored = [(v, s) for s, v in self._metric_values().items() if _finite(v)]
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
            return self._last_saved is None or step - self._last_saved >= self._auto.interval()
        return step % self.save_interval_steps == 0

    @property
    def interval(self) -> int:
        """The steps between saves now in force (re-tuned continuously in "auto" mode)."""
        return self._auto.interval() if self._auto is not None else self.save_interval_steps

    # ----------------------------------------------------------------------------------------- save

    def save(self, step: int, state: Any, *, metrics: dict[str, Any] | None = None, force: bool = False) -> bool:
        """Saves ``state`` as ``step`` if the schedule says so (or ``force``); False when skipped.

        Returns once the state is copied to host memory (async) or committed (sync). Raises a previous
        background failure as SaveFailedError."""
        if self._closed:
            raise CheckpointError(f"CheckpointManager({self.directory}) is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        if self._auto is not None and self._last_call_end is not None:
            self._auto.observe_step(t0 - self._last_call_end)
        try:
            return self._save(step, state, metrics, force, t0)
        finally:
            self._last_call_end = time.perf_counter()

    def _save(self, step: int, state: Any, metrics: dict | None, force: bool, t0: float) -> bool:
        if not self._writer.busy:
            self._writer.wait()  # raise a finished save's failure now
        if step in self._metrics or (self._writer.busy and step == self._last_saved):
            log.info("step %d already saved in %s; skipped", step, self.directory)
            return False
        if not force and not self.should_save(step):
            return False
        metrics = ckpt._jsonable(metrics, "metrics")
        self._writer.wait()  # back-pressure: one save in flight
        if self._tiers is not None:  # first sends the previous step's copy to its peer (a collective)
            snap = self._tiers.snapshot(step, state, copy=self.async_save, force=force)
        elif self.format == "orbax":
            snap = orbax_compat.snapshot(state, copy=self.async_save)
        else:  # refill the previous durable snapshot's buffers: no page faults of fresh memory
            snap, self._spare = ckpt.snapshot(state, copy=self.async_save, reuse=self._spare), None
        blocked = time.perf_counter() - t0
        self._last_saved = step
        if self._auto is not None:
            self._auto.observe_save(blocked)
        self._writer.submit(lambda: self._persist(step, snap, metrics, t0, blocked), f"step {step} in {self.directory}")
        if not self.async_save:
            self._writer.wait()
        return True

    def _persist(self, step: int, snap: Any, metrics: dict | None, t0: float, blocked: float) -> None:
        if isinstance(snap, TierSnapshot):  # memory tiers; migration comes back here with a plain Snapshot
            return self._tiers.save(step, snap, metrics, lambda s: self._persist(step, s, metrics, t0, blocked),
                                    t0, blocked)
        if self.format == "orbax":
            t1 = time.perf_counter()
            orbax_compat.save_step(self.storage, step, snap, metrics=metrics, metadata=self.metadata)
            times = ckpt.PersistTimes(write=time.perf_counter() - t1)
            self._orbax.add(step)
        else:
            self._set_aside_damaged(step)
            times = ckpt.persist(snap, self.storage, str(step), self.serializer, step=step, metrics=metrics,
                                 metadata=self.metadata)
        with self._mutex:
            self._metrics[step] = metrics
        stats = SaveStats(step, snap.nbytes, blocked, getattr(snap, "seconds", 0.0), times.write, times.commit,
                          time.perf_counter() - t0, fsync_s=times.fsync, start_s=t0 - self._created,
                          serialize_s=times.serialize, written_bytes=times.written,
                          migrate_s=times.write + times.commit if self._tiers is not None else 0.0)
        self._record(stats)
        self._apply_retention()
        if self._tiers is None and self.format == "flax_ckpt" and self.async_save:
            self._spare = snap  # durable now: the next snapshot may overwrite its buffers

    def _set_aside_damaged(self, step: int) -> None:
        """A new save of a step whose old folder is damaged moves the old one aside (never deletes it on a
        file system: ``<step>.damaged-<uuid>``; an object store has no rename, so there it is removed)."""
        if self._damaged.pop(step, None) is None or distributed.process_index() != 0:
            return
        if isinstance(self.storage, LocalStorage):
            aside = f"{step}.damaged-{uuid.uuid4().hex[:8]}"
            self.storage.rename(str(step), aside)
            log.warning("step %d in %s was damaged; moved to %s before saving it again", step, self.directory, aside)
        else:
            commit_mod.remove(self.storage, str(step))
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
        with self._mutex:
            doomed = steps_to_delete(self._metrics, max_to_keep=self.max_to_keep, keep_period=self.keep_period,
                                     metrics=self._metric_values(), best_mode=self.best_mode,
                                     keep_best=self.keep_best)
        for step in doomed:
            if distributed.process_index() == 0:  # every process drops the step; process 0 deletes it
                commit_mod.remove(self.storage, self._folder_name(step))
            self._orbax.discard(step)
            with self._mutex:
                self._metrics.pop(step, None)
            log.info("retention removed step %d from %s", step, self.directory)

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is durable; raises its failure as SaveFailedError."""
        self._writer.wait()
        if self._tiers is not None:  # the peer copy of the last save, and the migration in flight
            self._tiers.flush()

    # -------------------------------------------------------------------------------------- restore

    def restore(self, step: int | None = None, target: Any = None, *, shardings: Any = None,
                partial: bool = False) -> Any:
        """Restores ``step`` (default: the newest committed step; if it is damaged and the manager is not
        strict, the newest older one that is good, with a warning)."""
        self._writer.wait()
        if self._tiers is not None:
            return self._restore_tiered(step, target, shardings, partial)
        if step is not None:
            if step not in self.all_steps():
                raise CheckpointNotFoundError(f"no committed step {step} in {self.directory} "
                                              f"(steps: {self.all_steps()})")
            return self._restore_step(step, target, shardings, partial)
        steps = self.all_steps()
        damaged = max(self._damaged, default=None)
        if self.strict and damaged is not None and (not steps or damaged > steps[-1]):
            raise self._damaged[damaged]  # strict: a damaged newest step is an error, not a fallback
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}")
        for i, s in enumerate(reversed(steps)):
            try:
                return self._restore_step(s, target, shardings, partial)
            except (CorruptCheckpointError, InvalidManifestError, FileNotFoundError) as e:
                if self.strict or i == len(steps) - 1:
                    raise
                log.warning("step %d in %s is damaged (%s); falling back to an older step", s,
                            self.directory, e)
        raise AssertionError("unreachable")

    def _restore_tiered(self, step: int | None, target: Any, shardings: Any, partial: bool) -> Any:
        """With tiers= (every process calls it): the newest step complete across processes in some
        combination of tiers, each process reading from the fastest tier holding its shards."""
        t0 = time.perf_counter()
        self._tiers.flush()
        with self._mutex:
            persistent = set(self._metrics)
        out, plan, nbytes = self._tiers.restore(
            step, target, shardings=shardings, partial=partial, persistent=persistent, strict=self.strict,
            restore_persistent=lambda s: self._restore_step(s, target, shardings, partial))
        tier = plan.sources[distributed.process_index()][0]
        if tier != "persistent":  # _restore_step recorded the persistent ones
            self.restore_stats.append(RestoreStats(plan.step, tier, nbytes, time.perf_counter() - t0))
        return out

    def _folder_name(self, step: int) -> str:
        if step in self._orbax:
            return orbax_compat.step_path(self.storage, step).rstrip("/").rsplit("/", 1)[-1]
        return str(step)

    def _restore_step(self, step: int, target: Any, shardings: Any, partial: bool) -> Any:
        t0 = time.perf_counter()
        if step in self._orbax:
            path = orbax_compat.step_item_path(self.storage, step)
            out = ckpt.restore(path, target, shardings=shardings, partial=partial)
            nbytes = ckpt.metadata(path).nbytes
        else:
            folder, body = self._open(step)
            out = ckpt.restore_body(folder, body, target, shardings=shardings, partial=partial)
            nbytes = ckpt.restored_nbytes(body, target, partial)
        stats = RestoreStats(step, "persistent", nbytes, time.perf_counter() - t0)
        self.restore_stats.append(stats)
        log.info("restored step %d from %s (%s tier): %.1f MB in %.2f s", step, self.directory, stats.tier,
                 stats.nbytes / 1e6, stats.seconds)
        return out

    def _open(self, step: int) -> tuple[Storage, dict[str, Any]]:
        folder = self.storage.sub(str(step))
        return folder, ckpt.read_manifest(folder)

    def item_metadata(self, step: int | None = None) -> ckpt.CheckpointInfo:
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}")
        if step in self._orbax:
            return ckpt.metadata(orbax_compat.step_item_path(self.storage, step))
        folder, body = self._open(step)
        return ckpt.info_from_body(folder.url, body)

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
