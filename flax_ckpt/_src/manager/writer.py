"""The async writer: one background save at a time, failures re-raised on the caller's next call.

Scope: threading and error propagation only. The caller snapshots the state first (engine/snapshot.py,
on its own thread: to host, or on the devices' streams); the job given to ``submit`` brings device
copies to host, serializes, writes, fsyncs and commits. At most one job is in flight: ``submit`` waits
for the previous one (back-pressure keeps host memory bounded by one snapshot). A job's exception is
raised as SaveFailedError (its cause is the original exception, with its traceback) from the next
``submit``, ``wait`` or ``close``.

A job may start after a ``grace``: the caller, back from ``save``, dispatches its next training step
in about a millisecond, releasing and taking back the GIL as it goes; a writer running Python code
meanwhile takes the GIL at the first release and keeps it up to the interpreter's switch interval
each time, which slows the dispatch (benchmarks/README.md, "Figures from the module docstrings").
Anything that waits
for the job (``wait``, the next ``submit``, ``close``) ends the grace at once.
"""

from __future__ import annotations

import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from flax_ckpt._src.errors import SaveFailedError


class AsyncWriter:
    def __init__(self, name: str = "flax_ckpt-writer"):
        worker: list[int] = []  # the pool thread's ident, once it runs (a list: no reference to self)
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix=name, initializer=lambda: worker.append(threading.get_ident())
        )
        self._worker = worker
        self._pending: Future | None = None
        self._hurry: threading.Event | None = None  # set: the job in flight starts now, grace or not
        self._own_hurry = threading.Event()  # ``_hurry`` of the jobs submitted without one
        self._label = ""
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self,
        job: Callable[[], object],
        label: str,
        *,
        grace: float = 0.0,
        hurry: threading.Event | None = None,
    ) -> Future:
        """Waits for the previous job (raising its failure), then starts ``job`` in the background,
        ``grace`` seconds later unless something waits for it first. ``hurry``: the event set once
        something waits for the job (the job may read it to stop pacing itself)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the writer is closed")
            self.wait()
            if hurry is None:  # the writer's own, for a job no one else hurries: set by nothing now (the
                hurry = self._own_hurry  # last job and its grace are over)
                hurry.clear()
            self._hurry = hurry
            if grace > 0:  # the pool's one thread takes its tasks in order: the grace, then the job
                self._pool.submit(self._hurry.wait, grace)
            self._pending, self._label = self._pool.submit(job), label
            return self._pending

    def wait(self) -> None:
        """Blocks until the job in flight is done; raises SaveFailedError if it failed."""
        if self._hurry is not None:
            self._hurry.set()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        exc = pending.exception()
        if exc is not None:
            raise SaveFailedError(
                f"background save of {self._label} failed: {type(exc).__name__}: {exc}. "
                "It was not committed; older checkpoints are untouched."
            ) from exc

    def settle(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for the job in flight (ending its grace); whether none is in
        flight now. Raises nothing: its failure is for the next ``wait``."""
        pending = self._pending
        if pending is None:
            return True
        self.hurry()
        futures.wait([pending], timeout)
        return pending.done()

    def hurry(self) -> None:
        """Ends the grace of the job in flight: it starts now. Returns at once."""
        if self._hurry is not None:
            self._hurry.set()

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        """Waits for the job in flight (raising its failure) and stops the thread. Also from the writer's
        own thread (a manager whose last reference a finished job dropped): that thread is not joined."""
        try:
            self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=threading.get_ident() not in self._worker)
