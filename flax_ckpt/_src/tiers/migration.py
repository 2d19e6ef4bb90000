"""Migration: memory copies written to the persistent tier in the background, one at a time.

Scope: when a step is due (the first saved at or after each multiple of ``persist_interval_steps``,
or a forced save), the one migration in flight on a thread of its own, putting a due migration off
while the previous one runs (``on_busy="skip"``: a later step goes), and its failure, raised where
every process reaches (the next migration, ``flush``, ``close``). Not here: the write (the persistent
tier's ``migrate``), the copy migrated (tierset.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from flax_ckpt._src.errors import SaveFailedError

log = logging.getLogger("flax_ckpt")


class Migration:
    """``url``: the persistent tier's (named in failures); ``every``: Tiers.persist_interval_steps;
    ``on_busy``: Tiers.on_busy; ``last``: the newest step there at start."""

    def __init__(self, url: str, every: int | None, on_busy: str, last: int | None):
        self.url, self.every, self.on_busy = url, every, on_busy
        self.last = last  # the newest step migrated
        self.deferred = 0  # due migrations put off because the previous one was still running
        self.busy_somewhere = False  # agreed at the last local commit: some process's migration was in flight
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flax_ckpt-migrate")
        self._pending: tuple[int, Future] | None = None

    def running(self) -> bool:
        """Whether this process's migration is still in flight (its vote at a commit)."""
        return self._pending is not None and not self._pending[1].done()

    def offer(self, step: int, force: bool, job: Callable[[], object]) -> None:
        """``step`` was committed in memory: ``job`` migrates it when due, unless put off (every process
        decides alike: ``busy_somewhere`` is agreed); ``force`` always migrates."""
        if not force and (self.every is None or step // self.every <= (self.last or 0) // self.every):
            return
        if self.busy_somewhere and not force and self.on_busy == "skip":  # a later step goes once free;
            self.deferred += 1  # on_busy="wait" waits for the previous migration instead
            log.debug("migration of step %d put off: the previous one is still running", step)
            return
        self.start(step, job)

    def start(self, step: int, job: Callable[[], object]) -> None:
        """Runs ``job`` in the background, after the previous migration (whose failure is raised)."""
        self.wait()
        self.last = step
        self._pending = (step, self._pool.submit(job))

    def wait(self) -> None:
        """Waits for the migration in flight; raises its failure."""
        if self._pending is None:
            return
        (step, fut), self._pending = self._pending, None
        error = fut.exception()
        if error is not None:
            raise SaveFailedError(
                f"migration of step {step} to {self.url} failed: {type(error).__name__}: {error}"
            ) from error

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
