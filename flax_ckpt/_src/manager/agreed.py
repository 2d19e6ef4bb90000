"""The agreed restore: which committed step of a run directory every process of a job restores.

Scope: reading one step of the directory (any format, checked as it is read, with its RestoreStats),
and choosing the step: the newest (or the one asked for), tried in order, with a vote after each try
(distributed.vote: every process says whether it could read the step), falling back together past a
damaged step, and the one error every process raises when none can be restored. Not here: the memory
tiers' own restore (tiers/tierset.py), the view of the steps (steps.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from flax_ckpt._src.commit import distributed
from flax_ckpt._src.engine import restore as engine
from flax_ckpt._src.engine.fit import Fit
from flax_ckpt._src.engine.leaves import CheckpointInfo
from flax_ckpt._src.engine.reader import Source
from flax_ckpt._src.errors import CheckpointError, CheckpointNotFoundError, error_class
from flax_ckpt._src.manager.stats import RestoreStats
from flax_ckpt._src.manager.steps import StepIndex
from flax_ckpt._src.window import Window

log = logging.getLogger("flax_ckpt")
TargetOf = Callable[[Source], Any]  # the restore target for an opened step (restore's target_for)
DAMAGE = (
    "CorruptCheckpointError",
    "InvalidManifestError",
    "FileNotFoundError",
    "CheckpointNotFoundError",
    "NotADirectoryError",
)  # a step that cannot be read: restore falls back past it


def targets(target: Any, target_for: Callable[[CheckpointInfo], Any] | None) -> TargetOf:
    """restore's ``target`` or ``target_for`` as one function of the opened source: ``target_for`` reads
    the source's records, so no step is opened twice."""
    if target_for is None:
        return lambda source: target
    return lambda source: target_for(source.info())


class AgreedRestore:
    """Restores of the committed steps in ``steps`` (a StepIndex), agreed across processes under
    ``prefix`` (the manager's rounds). ``strict``: a damaged newest step is an error, not a fallback.
    ``stats``: one RestoreStats per step read from the directory."""

    def __init__(self, steps: StepIndex, prefix: str, *, strict: bool):
        self._steps, self._prefix, self.strict = steps, prefix, strict
        self.directory = steps.directory
        self.stats: Window[RestoreStats] = Window()  # the newest restores, with totals
        # a read of a step ahead of its restore (native/prefetch.py): the next read takes it (its buffers serve
        # that step when they are still what it holds) and frees it
        self.ahead: Any = None

    def restore(
        self, step: int | None, target_of: TargetOf, shardings: Any, fit: Fit, item: str | None
    ) -> Any:
        """``step`` (None: the newest committed step, falling back past damaged ones unless strict), on
        every process alike (a collective with several processes: first all adopt process 0's view).
        ``fit``: how the target may differ (engine/fit.py; a bool: partial). Every process sees the
        same records, so rename and structure decisions agree; an error on any process (a cast
        overflow in its shards) is raised by all, under its class (_first_agreed)."""
        if distributed.process_count() > 1:
            self._steps.agree()
        steps = self._steps.steps()

        def read(s: int) -> Any:
            return self.read(s, target_of, shardings, fit, item)

        if step is not None:
            if step not in steps:
                why = self._steps.ambiguity(step)
                raise CheckpointNotFoundError(
                    f"no committed step {step} in {self.directory} (steps: {steps})"
                    + (f": {why}" if why else "")
                )
            return self._first_agreed([step], read, fallback=False)
        damaged = self._steps.newest_damaged()
        if self.strict and damaged is not None and (not steps or damaged[0] > steps[-1]):
            raise damaged[1]  # strict: a damaged newest step is an error, not a fallback
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.directory}")
        return self._first_agreed(steps[::-1], read, fallback=not self.strict)

    def read(self, step: int, target_of: TargetOf, shardings: Any, fit: Fit, item: str | None = None) -> Any:
        """Restores ``step`` from the directory on this process alone (checking every checksum); with
        Fit.report, returns (tree, RestoreReport)."""
        t0 = time.perf_counter()
        source = self._steps.open(step, item)
        ahead, self.ahead = self.ahead, None
        try:
            source = source if ahead is None else ahead.serve(step, source)
            target = target_of(source)
            out = engine.restore(source, target, shardings=shardings, fit=fit)
        finally:
            if ahead is not None:
                ahead.release()
        stats = RestoreStats(
            step, "persistent", engine.restored_nbytes(source, target, fit), time.perf_counter() - t0
        )
        self.stats.append(stats)
        log.info(
            "restored step %d from %s: %.1f MB in %.2f s",
            step,
            self.directory,
            stats.nbytes / 1e6,
            stats.seconds,
        )
        return out

    def _first_agreed(self, candidates: list[int], read: Callable[[int], Any], *, fallback: bool) -> Any:
        """Tries ``candidates`` in order until one restores on every process. After each try the processes
        vote: all return the same step; or all discard what they read and fall back together to the next
        candidate, when every failure is damage and ``fallback`` allows it (each logs which process and
        why); or all raise the same error naming the processes that failed."""
        for i, s in enumerate(candidates):
            try:
                out, err = read(s), None
            except (CheckpointError, OSError) as e:
                out, err = None, e
            failures = distributed.vote(self._prefix, f"restore of {self.directory}", s, err)
            if not failures:
                return out
            out = None  # discard what this process read
            damage = all(kind in DAMAGE for kind, _ in failures.values())
            if damage:  # on every process alike: the vote is agreed
                self._steps.found_damaged(s, err or shared_error(self.directory, s, failures))
            if not damage or not fallback or i == len(candidates) - 1:
                if distributed.process_count() == 1:
                    assert err is not None, "one process votes only its own failure: this read's error"
                    raise err
                raise shared_error(self.directory, s, failures) from err
            for j, (kind, msg) in sorted(failures.items()):
                log.warning(
                    "step %d in %s is damaged on process %d (%s: %s); falling back to an older step",
                    s,
                    self.directory,
                    j,
                    kind,
                    msg,
                )
        raise AssertionError("unreachable")


def shared_error(directory: str, step: int, failures: dict[int, tuple[str, str]]) -> CheckpointError:
    """The one error every process raises when ``step`` cannot be restored on some process."""
    first = failures[min(failures)][0]
    detail = "; ".join(f"process {j}: {kind}: {msg}" for j, (kind, msg) in sorted(failures.items()))
    return error_class(first)(
        f"restore of step {step} of {directory} failed on "
        f"{'process' if len(failures) == 1 else 'processes'} "
        f"{', '.join(map(str, sorted(failures)))} (so on every process): {detail}"
    )
