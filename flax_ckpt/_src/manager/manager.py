"""CheckpointManager: a run of checkpoints, a schedule, a writer and one store.

Scope: the composition, and the end of a manager nobody closed (at interpreter exit or garbage
collection). The parts: the schedule (schedule.py), the async writer (writer.py) and the store
(store.py's protocol): the run directory (directory.py: step index, layout, lock, retention, agreed
restore) or the memory tiers in front of it (tiers/tierset.py, holding that directory). The manager
asks the store, never which store it is. The path of a save, call by call, is stated once:
tests/test_layout.py (test_save_path_from_manager_to_file_write_is_six_calls).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np

from flax_ckpt._src import layouts
from flax_ckpt._src.commit import distributed
from flax_ckpt._src.engine import device
from flax_ckpt._src.engine.fit import Fit, RenameArg
from flax_ckpt._src.engine.leaves import CheckpointInfo
from flax_ckpt._src.engine.snapshot import metrics_json
from flax_ckpt._src.errors import CheckpointError, CheckpointNotFoundError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.manager.agreed import targets
from flax_ckpt._src.manager.directory import Directory
from flax_ckpt._src.manager.schedule import Schedule
from flax_ckpt._src.manager.stats import RestoreStats, SaveStats
from flax_ckpt._src.manager.store import Store
from flax_ckpt._src.manager.writer import AsyncWriter
from flax_ckpt._src.native.prefetch import Buffered, Prefetch, available_bytes
from flax_ckpt._src.retention import Retention
from flax_ckpt._src.serializers import Serializer
from flax_ckpt._src.storage import ObjectStoreOptions, Storage
from flax_ckpt._src.tiers import Tiers
from flax_ckpt._src.tiers.tierset import TierSet
from flax_ckpt._src.tree import is_ready, refuse_traced
from flax_ckpt._src.window import Window

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

log = logging.getLogger("flax_ckpt")
_POLL = 0.002  # seconds between looks at the state's progress while the writer writes (_wait_for_device)
_POLL_LONG = 0.1  # seconds between looks at the writer while it waits for its device copies
_GRACE = 0.005  # seconds an async save's write waits, so that the caller's next step is dispatched before the
#                 writer's Python competes with it for the GIL (writer.py); a tenth of the time between saves
#                 when they come faster; ended by anything that waits for the write


class CheckpointManager:
    """Periodic, asynchronous, retained checkpoints of a training run in ``directory``.

    Retention covers every committed step of the directory, also those this manager did not write;
    its first deletion of such steps logs a warning naming them. The directory lock (local folders)
    keeps two live managers from writing one directory: a native run takes it when the manager opens,
    an Orbax run at its first save (and removes it at close, so a manager that only restores an Orbax
    run writes nothing there). A manager left open is closed at interpreter exit (the save in flight
    finished, the lock released); one that is garbage collected finishes its save and releases the
    lock. Neither raises nor prints a traceback.

    ``read_only=True`` follows a run another process writes (an evaluation job beside training): it
    takes no lock and never writes or deletes anything (no directory created, no leftovers removed;
    ``save`` raises), rereads the committed steps in ``all_steps``, ``latest_step``, ``metrics``,
    ``best_step``, ``item_metadata`` and ``restore`` (``reload()`` does so explicitly), and a step that
    the run's retention deletes while it is restored is followed, for ``restore(step=None)``, by the
    newest step committed then; for a named step it is a CheckpointNotFoundError saying so. It reads
    the persistent directory only (``tiers=`` is refused).

    Args:
      directory: the run's folder (a local path, ``file://``, ``s3://``, ``gs://`` or ``memory://``
        URL), created if missing.
      save_interval_steps: save the steps divisible by it; "auto" tunes the interval to
        ``overhead_budget`` and ``mtbf_s``.
      max_to_keep: the newest N steps are kept; None keeps all.
      keep_period: steps divisible by it are kept forever.
      best_metric: the metric that ranks steps for ``keep_best`` and ``best_step``.
      best_mode: "min" or "max": which end of ``best_metric`` is best.
      keep_best: the best N steps by ``best_metric`` are also kept.
      async_save: ``save`` returns once the state is copied to host memory; the write runs in the
        background.
      serializer: "raw", "zarr3" or a ``fc.Serializer`` instance (native format).
      tiers: memory tiers (``fc.Tiers``) in front of the directory; None writes every save there.
      strict: ``restore(step=None)`` raises on a damaged newest step instead of falling back to an
        older one with a warning.
      metadata: any JSON value recorded with every step.
      format: the layout new steps are written in: None follows the directory ("orbax" when its steps
        are Orbax's, else "native"; a directory holding both follows its newest step, with a warning).
      overhead_budget: with "auto", the share of training time saves may take.
      mtbf_s: with "auto", the expected seconds between failures.
      metric_writer: anything with ``write_scalars(step, dict)`` (e.g. a clu MetricWriter): gets each
        save's statistics.
      storage_options: ``fc.ObjectStoreOptions`` (or a dict of them): how to reach s3:// and gs://.
      read_only: follow a run another process writes (see above): no lock, nothing written.
      on_busy: what a save does while the previous one is still being written: "wait" (the default)
        or "skip" (returns False at once, counted in ``skipped``); with ``tiers=`` it is
        ``Tiers.on_busy``.

    Raises:
      CheckpointLockedError: another live manager holds the directory.
      StorageError: the directory cannot be created or listed.
      TypeError: ``tiers`` is not a ``fc.Tiers``.
      ValueError: an option out of range, or a ``format`` that contradicts the steps there.

    Example:
      >>> import numpy as np
      >>> with fc.CheckpointManager("run", save_interval_steps=2, max_to_keep=2) as mgr:
      ...     for step in range(1, 7):
      ...         saved = mgr.save(step, {"w": np.full(3, step, np.float32)}, metrics={"loss": 1 / step})
      ...     mgr.wait_until_finished()
      ...     print(mgr.all_steps(), mgr.restore()["w"])
      [4, 6] [6. 6. 6.]
    """

    def __init__(
        self,
        directory: Any,
        *,
        save_interval_steps: "int | Literal['auto']" = 1,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        keep_best: int | None = None,
        async_save: bool = True,
        serializer: str | Serializer | None = None,
        tiers: Tiers | None = None,
        strict: bool = False,
        metadata: Any = None,
        format: Literal["native", "orbax"] | None = None,
        overhead_budget: float = 0.01,
        mtbf_s: float | None = None,
        metric_writer: Any = None,
        storage_options: "ObjectStoreOptions | dict[str, Any] | None" = None,
        read_only: bool = False,
        on_busy: Literal["wait", "skip"] | None = None,
    ):
        if read_only and tiers is not None:
            raise ValueError(
                "read_only=True reads the steps committed in the directory; it does not open "
                "memory tiers (they belong to the run that writes them): drop tiers="
            )
        if tiers is not None and not isinstance(tiers, Tiers):
            raise TypeError(f"tiers must be a flax_ckpt.Tiers, got {type(tiers).__name__}")
        self.read_only, self.async_save = read_only, async_save
        self.on_busy = _on_busy(on_busy, tiers)
        self._schedule = Schedule(save_interval_steps, overhead_budget, mtbf_s)
        self._retention = Retention(max_to_keep, keep_period, best_metric, best_mode, keep_best)
        self._writer = AsyncWriter()
        self._saved_at: float | None = None  # when the last save call that started a write began
        self._inflight: Any = None  # the on_host event of the snapshot given to the writer last (not the
        #   snapshot: its buffers are freed on the writer's thread when its job ends, never on the caller's)
        self._closed = False
        self._pid = os.getpid()  # the process that opened it: the only one that saves, closes, deletes
        self._busy = threading.RLock()  # one save (or close) at a time, whichever thread calls it
        self._prefetch: Prefetch | None = None  # the read of a step ahead of its restore (prefetch())
        try:
            self._directory = Directory(
                directory,
                format=format,
                serializer=serializer,
                tiered=tiers is not None,
                retention=self._retention,
                on_busy=self.on_busy,
                read_only=read_only,
                strict=strict,
                metadata=metadata,
                metric_writer=metric_writer,
                storage_options=storage_options,
            )
            # For tests and tools, not a stable API: this process's memory tiers (their folders ``root``
            # and ``local_dir``, ``committed(tier)``, ``last_plan`` of the last restore), or None.
            self.memory_tiers: TierSet | None = _memory_tiers(tiers, self._directory)  # after the scan
        except BaseException:  # a manager that failed to open holds nothing: a retry can open the directory
            self._closed = True
            self._writer.close()
            raise
        self._store: Store = self.memory_tiers or self._directory
        self.storage: Storage = self._directory.storage
        self.directory, self.format, self.layout = (
            self._directory.url,
            self._directory.format,
            self._directory.layout,
        )
        self.stats: Window[SaveStats] = self._directory.stats  # the newest 1000 saves, with totals
        self.restore_stats: Window[RestoreStats] = self._directory.restore_stats
        _OPEN.add(self)

    # the options as given (each part holds its own)
    save_interval_steps = property(lambda self: self._schedule.every)
    max_to_keep = property(lambda self: self._retention.max_to_keep)
    keep_period = property(lambda self: self._retention.keep_period)
    best_metric = property(lambda self: self._retention.best_metric)
    best_mode = property(lambda self: self._retention.best_mode)
    keep_best = property(lambda self: self._retention.keep_best)
    strict = property(lambda self: self._directory.strict)
    metadata = property(
        lambda self: self._directory.metadata,  # the JSON value recorded with every step
        lambda self, value: setattr(self._directory, "metadata", value),
    )
    metric_writer = property(
        lambda self: self._directory.metric_writer,
        lambda self, value: setattr(self._directory, "metric_writer", value),
    )
    skipped = property(lambda self: self._store.skipped)  # saves skipped because the writer was busy

    # ------------------------------------------------------------------------------------ directory

    def reload(self) -> None:
        """Reads the directory's committed steps again: steps committed since (by the run a read-only
        manager follows) appear, steps deleted since (by its retention) disappear. A read-only manager
        reloads by itself in ``all_steps``, ``latest_step``, ``restore`` and ``item_metadata``; a
        writing manager's own saves are in its view already (this waits for the one in flight). With
        several processes, a collective: every process adopts process 0's view."""
        self._check_process("reload")
        if not self.read_only:
            self._writer.wait()
        self._directory.reload()

    def all_steps(self) -> list[int]:
        """The committed steps, in the directory or (with tiers) in any memory tier.

        Returns:
          The step numbers, ascending.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run", async_save=False) as mgr:
          ...     _ = [mgr.save(s, {"w": np.zeros(2)}) for s in (1, 2)]
          ...     mgr.all_steps()
          [1, 2]
        """
        if self.read_only:
            self.reload()
        return self._store.steps()

    def latest_step(self) -> int | None:
        """The newest committed step.

        Returns:
          The largest of ``all_steps()``, or None when there is none.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run", async_save=False) as mgr:
          ...     print(mgr.latest_step(), mgr.save(3, {"w": np.zeros(2)}), mgr.latest_step())
          None True 3
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with ``step``.

        Args:
          step: a committed step of the directory.

        Returns:
          The metrics as saved, or None when the step has none or is not in the directory.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run", async_save=False) as mgr:
          ...     _ = mgr.save(1, {"w": np.zeros(2)}, metrics={"loss": 0.25})
          ...     mgr.metrics(1)
          {'loss': 0.25}
        """
        if self.read_only and step not in self._directory.index:
            self.reload()
        return self._directory.index.metrics(step)

    def best_step(self) -> int | None:
        """The committed step with the best ``best_metric`` (by ``best_mode``).

        Returns:
          That step, or None without ``best_metric`` or without a step that recorded it.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run", best_metric="loss", async_save=False) as mgr:
          ...     for step, loss in ((1, 0.5), (2, 0.1), (3, 0.3)):
          ...         _ = mgr.save(step, {"w": np.zeros(2)}, metrics={"loss": loss})
          ...     mgr.best_step()
          2
        """
        if self.read_only:
            self.reload()
        return self._retention.best_step(self._directory.index.all_metrics())

    @property
    def tier_stats(self) -> list[Any]:
        """Per-save records of the memory tiers (bytes written, reused, seconds per phase), the newest
        1000, with ``added`` and ``totals`` over all (a Window, as ``stats``); [] without tiers."""
        return Window.copy(self._store.tier_stats) if isinstance(self._store.tier_stats, Window) else []

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save: the schedule has it and it is not saved already.

        Args:
          step: a step number.

        Returns:
          True when the step is due and not in the directory.

        Example:
          >>> with fc.CheckpointManager("run", save_interval_steps=10) as mgr:
          ...     mgr.should_save(10), mgr.should_save(11)
          (True, False)
        """
        return step not in self._directory.index and self._schedule.due(step)

    @property
    def interval(self) -> int:
        """The steps between saves now in force (re-tuned continuously in "auto" mode; with several
        processes, the largest of their intervals, agreed at each save)."""
        return self._schedule.interval

    # ----------------------------------------------------------------------------------------- save

    def save(
        self, step: int, state: Any, *, metrics: dict[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Saves ``state`` as ``step`` if the schedule says so, or off schedule with ``force=True``.

        Returns once a snapshot exists that the caller's next steps cannot change (async): jax.Array
        leaves on accelerators copied on their devices' streams where they fit (the copy is ordered
        before any step that donates them, and ``save`` waits neither for the step computing the state
        nor for the transfer), the rest copied to host (a CPU state once computed: one copy,
        ``FLAX_CKPT_DEVICE_SNAPSHOT``); or once committed (sync). The transfer, write and commit
        run on the background writer, starting a few milliseconds later (the caller's next step is
        dispatched first) unless something waits for them.

        One save is in flight at a time. A save that finds it still in flight while ``state`` is still
        being computed (a loop that dispatches steps ahead of the device) waits until the writer is free
        or the state is computed, whichever first: the device is the bottleneck then (the time is
        ``waited_for_device_s`` in the statistics, apart from ``blocked_s``). A writer still busy after
        that follows ``on_busy``: "wait" holds the caller until it is free, "skip" returns False.

        Args:
          step: a non-negative step number; a step that is saved already is never overwritten.
          state: a pytree of arrays and Python scalars.
          metrics: JSON scalars stored with the step (they rank it for ``best_metric``).
          force: save even off the schedule (e.g. the last step of a run whose length is not a
            multiple of ``save_interval_steps``).

        Returns:
          True when the step is saved (or being saved); False when skipped: off the schedule without
          ``force``, already saved, or (with ``on_busy="skip"``) the previous save still in flight.

        Raises:
          SaveFailedError: a previous background save failed (its cause attached).
          CheckpointError: the manager is closed, or a leaf of ``state`` was deleted (donated).
          ValueError: ``step`` is not a non-negative int.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run", save_interval_steps=5) as mgr:
          ...     mgr.save(4, {"w": np.zeros(2)}), mgr.save(5, {"w": np.ones(2)})
          (False, True)
        """
        self._check_process("save")
        if self.read_only:
            raise CheckpointError(
                f"CheckpointManager({self.directory}, read_only=True) does not save "
                f"(step {step}); save through the run's own manager, or open one without "
                "read_only=True"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        leaves = jax.tree_util.tree_leaves(state)
        refuse_traced(state, leaves, f"save of step {step} in {self.directory}")
        with self._busy:  # threads saving through one manager: one save at a time, each step whole
            if self._closed:
                raise CheckpointError(f"CheckpointManager({self.directory}) is closed")
            if self._prefetch is not None:  # a run that saves did not restore what was read ahead: freed
                self._prefetch, prefetch = None, self._prefetch
                prefetch.release()
            return self._save(step, state, leaves, metrics, force)

    def _save(
        self, step: int, state: Any, leaves: list[Any], metrics: dict[str, Any] | None, force: bool
    ) -> bool:
        t0 = time.perf_counter()
        self._schedule.call_started(t0)
        try:
            if not self._writer.busy:
                self._writer.wait()  # raise a finished save's failure now
            if step in self._directory.index or (self._writer.busy and step == self._schedule.last_saved):
                log.info("step %d already saved in %s; skipped", step, self.directory)
                return False
            if not force and not self.should_save(step):
                log.debug(
                    "step %d is off the schedule (every %s steps) in %s: not saved; pass force=True to "
                    "save it anyway",
                    step,
                    self._schedule.interval,
                    self.directory,
                )
                return False
            if not self._directory.claimed:  # a tree the run's steps cannot hold: nothing written, no lock
                self._directory.claim(state)
                if step in self._directory.index:
                    log.info("step %d already saved in %s; skipped", step, self.directory)
                    return False
            metrics = metrics_json(metrics)
            waited = self._wait_for_device(leaves)
            if not self._store.admit(step, self._writer.busy, force):
                return False  # on_busy="skip": the previous save is being written; training does not wait
            self._writer.wait()  # back-pressure: one save in flight
            snap = self._store.snapshot(step, state, copy=self.async_save, force=force)
            snap.waited_s += waited
            blocked = time.perf_counter() - t0 - snap.waited_s
            self._inflight = snap.on_host
            self._schedule.saved(step, blocked, self._directory.prefix)
            grace = _GRACE if self._saved_at is None else min(_GRACE, 0.1 * (t0 - self._saved_at))
            self._saved_at = t0
            self._writer.submit(
                functools.partial(self._store.save, step, snap, metrics, t0, blocked),
                f"step {step} in {self.directory}",
                grace=grace if self.async_save else 0.0,
                hurry=snap.hurry,
            )
            if not self.async_save:
                self._writer.wait()
            return True
        finally:
            self._schedule.call_ended()

    def _wait_for_device(self, leaves: list[Any]) -> float:
        """When the writer is busy and the state (its ``leaves``) is still being computed (the loop
        dispatches steps ahead of the device), waits until the writer is free or the state is computed,
        whichever comes first: the device is the bottleneck meanwhile, so the loop loses nothing it would
        not lose at its next sync. Returns the seconds waited (reported as ``waited_for_device_s``, not
        ``blocked_s``); a writer still busy once the state is computed is the writer's own work
        (``on_busy`` decides)."""
        if not self._writer.busy:
            return 0.0
        last = next((x for x in reversed(leaves) if isinstance(x, jax.Array)), None)
        if last is None:  # nothing is computed (and jax's backends are not asked about: none may be up)
            return 0.0
        if device.host_only():  # a CPU state: only its last array is asked (a step's outputs are computed
            data = _data(last)  # together; the snapshot waits for any other leaf still computing; None:
            computing = [] if data is None or is_ready(data) else [data]  # deleted, the snapshot names it)
        else:
            computing = [x for x in map(_data, leaves) if x is not None and not is_ready(x)]
        if not computing:
            return 0.0
        t1 = time.perf_counter()
        on_host = self._inflight
        self._writer.hurry()  # the writer starts now (its grace ends)
        if device.copied_to_host(computing):  # the snapshot waits for the state anyway (a CPU state, or
            try:  # arrays on CPUs beside an accelerator): wait once, not polling; on_busy decides after
                jax.block_until_ready(computing)
            except getattr(jax.errors, "JaxRuntimeError", RuntimeError) as e:  # the step failed
                raise device.failed(e) from e
            return time.perf_counter() - t1
        while on_host is not None and not on_host.wait(_POLL_LONG) and self._writer.busy:
            pass  # its device copies are not done: the device is behind this state too
        while not self._writer.settle(_POLL):  # the writer's own work, while the state is computed
            while computing and is_ready(computing[-1]):
                computing.pop()
            if not computing:
                break
        return time.perf_counter() - t1

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (and, with tiers, its peer copy and migration) is durable.

        Raises:
          SaveFailedError: the save failed (its cause attached).

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run") as mgr:
          ...     _ = mgr.save(1, {"w": np.zeros(2)})
          ...     mgr.wait_until_finished()
          ...     fc.metadata("run/1").step
          1
        """
        self._check_process("wait_until_finished")
        self._writer.wait()
        self._store.flush()  # with tiers: the peer copy of the last save, and the migration in flight

    # -------------------------------------------------------------------------------------- restore

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        shardings: Any = None,
        partial: bool = False,
        item: str | None = None,
        target_for: Callable[[CheckpointInfo], Any] | None = None,
        rename: RenameArg = None,
        missing: str = "error",
        unexpected: str = "error",
        cast: bool = False,
        report: bool = False,
    ) -> Any:
        """Restores ``step``, or the newest good step, checked leaf by leaf against ``target``.

        Without ``step``, the newest committed step is restored; if it is damaged and the manager is not
        strict, the newest older one that is good, with a warning. A step found damaged leaves
        ``all_steps()``: a later ``save`` of its number writes it again (its folder moved aside, or
        kept while later steps share its bytes). With several processes (every
        process calls it), the step is decided once for all: all return the same step, or all fall
        back together to an older one, or all raise the same CheckpointError naming the process and
        file that failed.

        Args:
          step: the step to restore; None: the newest good one.
          target: a pytree of arrays or ``jax.ShapeDtypeStruct`` (as for ``fc.restore``); None gives
            nested dicts/lists of numpy arrays (typed PRNG keys as typed key arrays, as fc.restore).
          shardings: one sharding, or a tree of them, overriding the target's placement.
          partial: the older name of ``unexpected="ignore"``.
          item: one named item of an Orbax step (saved with ``args.Composite``).
          target_for: instead of ``target``, a function giving the target from the step's
            ``fc.CheckpointInfo`` (called for each step tried).
          rename: as for ``fc.restore``.
          missing: as for ``fc.restore``.
          unexpected: as for ``fc.restore``.
          cast: as for ``fc.restore``.
          report: also return a ``fc.RestoreReport``.

        Returns:
          The restored tree, or ``(tree, fc.RestoreReport)`` with ``report=True``.

        Raises:
          CheckpointNotFoundError: no committed step (or not ``step``).
          CorruptCheckpointError: ``step`` (or, when strict, the newest step) is damaged.
          TargetMismatchError: the target does not fit the checkpoint (the message lists every leaf).
          SaveFailedError: the save in flight failed.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run") as mgr:
          ...     _ = mgr.save(1, {"w": np.zeros(2, np.float32)})
          ...     _ = mgr.save(2, {"w": np.ones(2, np.float32)})
          ...     mgr.restore()["w"], mgr.restore(1)["w"]
          (array([1., 1.], dtype=float32), array([0., 0.], dtype=float32))
        """
        fit = Fit.of(
            partial=partial, rename=rename, missing=missing, unexpected=unexpected, cast=cast, report=report
        )
        self._check_process("restore")
        self._writer.wait()
        return self._store.restore(step, targets(target, target_for), shardings, fit, item)

    def prefetch(self, *, limit: int | None = None) -> int | None:
        """Starts reading the newest committed step into host memory on a background thread, so that a
        restore soon after (once the runtime has started and the program traced) costs little more
        than placing the arrays. With one process and a native step, its arrays are read and their
        checksums verified into buffers that the restore of that step takes instead of reading, as
        long as the step's manifest, records and files are still those that were read (a file changed
        since, another step, a leaf the read did not reach: read by the restore as ever; a restore
        that comes while the read runs stops it and reads the rest). Otherwise (several processes,
        each reading the files it wrote; an Orbax step) the files are read into the page cache. A
        step found damaged, a target that does not fit, or no restore at all costs this read and
        nothing else. The buffers are freed after the first restore, or at the first save, or by
        ``close()``, which stops the read.

        Args:
          limit: the most bytes read; None: half the memory the system has available.

        Returns:
          The step being read, or None: no committed step, a directory on an object store, memory
          tiers in front of it (their copies are in memory already), or a read-only manager.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run") as mgr:
          ...     _ = mgr.save(3, {"w": np.zeros(2, np.float32)})
          >>> with fc.CheckpointManager("run") as mgr:
          ...     mgr.prefetch(), mgr.restore()["w"]
          (3, array([0., 0.], dtype=float32))
        """
        step = self.latest_step()
        folder = None if step is None or self.read_only else self._store.local_folder(step)
        if step is None or folder is None:
            return None
        if self._prefetch is not None:
            self._prefetch.release()
        limit = available_bytes() // 2 if limit is None else limit
        if distributed.process_count() == 1:
            self._prefetch = Buffered(step, folder, limit, functools.partial(self._directory.open, step))
        else:
            self._prefetch = Prefetch(
                step, folder, limit, distributed.process_index(), distributed.process_count()
            )
        self._directory.read_ahead(self._prefetch)
        return step

    def item_metadata(self, step: int | None = None, *, item: str | None = None) -> CheckpointInfo:
        """``fc.metadata`` of a step of the run: what it holds, read without any array bytes.

        Args:
          step: a committed step; None: the newest.
          item: one named item of an Orbax step.

        Returns:
          A ``fc.CheckpointInfo``.

        Raises:
          CheckpointNotFoundError: no committed step.

        Example:
          >>> import numpy as np
          >>> with fc.CheckpointManager("run") as mgr:
          ...     _ = mgr.save(1, {"w": np.zeros((2, 3))}, metrics={"loss": 0.5})
          ...     mgr.wait_until_finished()
          ...     info = mgr.item_metadata()
          >>> info.step, info.metrics, info.leaves["w"].shape
          (1, {'loss': 0.5}, (2, 3))
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}")
        return self._directory.open(step, item).info()

    # ---------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Waits for the save in flight, then releases the directory (and, with tiers, closes them).

        Closing twice is harmless; ``with fc.CheckpointManager(...) as mgr:`` closes at the block's end.

        Raises:
          SaveFailedError: the save in flight failed (the directory is released all the same).

        Example:
          >>> import numpy as np
          >>> mgr = fc.CheckpointManager("run")
          >>> _ = mgr.save(1, {"w": np.zeros(2)})
          >>> mgr.close()
          >>> with fc.CheckpointManager("run") as again:
          ...     again.all_steps()
          [1]
        """
        self._check_process("close")
        with self._busy:  # a save on another thread ends first: it commits, then the manager closes
            self._close()

    def _close(self, *, at_exit: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if self._prefetch is not None:
            self._prefetch.release()
        try:
            self._writer.close()
        except BaseException:  # the save in flight failed: its error is raised, the store let go
            with contextlib.suppress(Exception):
                self._store.let_go()
            raise
        self._store.close(at_exit=at_exit)  # the tiers close their directory: it releases the lock

    def _check_process(self, call: str) -> None:
        """Refuses ``call`` in a process forked from the one that opened this manager (a data loader's
        worker, a multiprocessing Pool): the lock, the writer thread and the memory tiers are that
        process's, and a copy of them in a child would save, close or delete behind its back."""
        if self._pid != os.getpid():
            raise CheckpointError(
                f"CheckpointManager({self.directory}).{call}() in process {os.getpid()}, a child forked "
                f"from process {self._pid}, which opened it: only that process saves, restores or closes "
                "it (its lock, writer thread and memory tiers are that process's; the child leaves them "
                "alone at exit). Fix: call it in the parent, or open a manager of the child's own "
                "(read_only=True to read the run while the parent writes it)"
            )

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _let_go(self) -> None:
        """The end of a manager nobody closed, with no collective (another process may never join one):
        waits for the save and the migration in flight, then releases the lock. Raises their failure.
        The memory tiers stay, restorable by the next run as after a crash."""
        if getattr(self, "_closed", True) or self._pid != os.getpid():  # also one whose __init__ failed
            return  # a forked child's copy: its lock, writer and tiers are the parent's, left alone
        self._closed = True
        _OPEN.discard(self)
        try:
            self._writer.close()
        finally:
            self._store.let_go()

    def _close_at_exit(self) -> None:
        """At interpreter exit: close() (the store knows what it can still do: memory tiers across
        processes let go instead, closing them being a collective). A failure is logged as a warning,
        never raised."""
        if self._pid != os.getpid():  # a forked child exits: the parent's run is none of its business
            return
        try:
            with self._busy:
                self._close(at_exit=True)
        except Exception as e:
            log.warning(
                "CheckpointManager(%s) was not closed; closing it at interpreter exit failed: %s: %s",
                self.directory,
                type(e).__name__,
                e,
            )

    def __del__(self):  # garbage collection may run anywhere, on any thread: never raises, never prints
        try:
            self._let_go_reporting()
        except BaseException:  # interpreter teardown: module globals are gone, and the OS releases the lock
            pass

    def _let_go_reporting(self) -> None:
        try:
            self._let_go()
        except Exception as e:
            log.warning(
                "CheckpointManager(%s) was garbage-collected without close(): %s: %s",
                self.directory,
                type(e).__name__,
                e,
            )


def _data(x: Any) -> jax.Array | None:
    """The jax.Array holding leaf ``x``'s bytes (a PRNG key's data), or None (not a jax.Array, deleted)."""
    if not isinstance(x, jax.Array) or x.is_deleted():
        return None
    if isinstance(x.dtype, np.dtype):  # numpy's dtypes (bfloat16's too): not a key; asked first, it is cheap
        return x
    return jax.random.key_data(x) if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _on_busy(on_busy: str | None, tiers: Any) -> str:
    """The manager's ``on_busy``: given, or the tiers' (fc.Tiers(on_busy=...)), or "wait"."""
    if on_busy not in (None, "wait", "skip"):
        raise ValueError(f"on_busy must be 'wait' or 'skip', got {on_busy!r}")
    if tiers is not None and isinstance(tiers, Tiers):
        if on_busy is not None and on_busy != tiers.on_busy:
            raise ValueError(
                f"on_busy={on_busy!r} contradicts tiers=Tiers(on_busy={tiers.on_busy!r}); "
                "give it once, in Tiers"
            )
        return tiers.on_busy
    return on_busy or "wait"


_OPEN: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()  # managers to close at interpreter exit


def _memory_tiers(tiers: Tiers | None, directory: Directory) -> TierSet | None:
    """The memory tiers in front of ``directory`` (None without ``tiers``), which they hold and close; a
    failure to start them releases the directory."""
    if tiers is None:
        return None
    try:
        return TierSet(tiers, directory)
    except BaseException:
        directory.let_go()
        raise


def _close_open_managers() -> None:
    for manager in list(_OPEN):
        manager._close_at_exit()


def _register_exit_hook() -> None:
    """Has the managers still open closed at interpreter exit, before concurrent.futures stops its threads
    (the writer's; which happens before ``atexit`` handlers run) and before module teardown:
    ``threading._register_atexit``, whose hooks run in reverse order of registration, so this one (the
    writer's import registered concurrent.futures' first) runs before concurrent.futures', and after
    those of the callbacks (registered later), whose close saves through their manager; ``atexit``
    where it does not exist."""
    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(_close_open_managers)
    except RuntimeError:  # already shutting down threads
        atexit.register(_close_open_managers)


_register_exit_hook()
