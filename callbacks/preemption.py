"""Preemption notices: turn SIGTERM/SIGINT into a request that the training loop honours at a step boundary.

Scope: installing and restoring signal handlers, counting signals, and agreeing across processes on the
step at which to stop. Nothing here saves: ``CheckpointCallback`` asks ``reached(step)`` at every step
boundary and does the saving.

* One process: a handler records the signal (the process is not interrupted: the step, a compile in
  progress or a save in flight all carry on). A repeated signal is logged and ignored, so a scheduler that
  sends SIGTERM twice does not kill the save; the ``force_after``-th signal (default 3) runs the handler
  that was there before (SIGINT: KeyboardInterrupt; SIGTERM: the default action, death), for a person who
  really wants out of a loop that never reaches a boundary.
* Several processes (``jax.process_count() > 1``): JAX's preemption service already listens for SIGTERM
  in every process and spreads the notice; ``reached(step)`` asks
  ``jax.experimental.multihost_utils.reached_preemption_sync_point`` so every process stops at the same
  step. No Python handler is installed then (it would replace JAX's); a process-local signal would make
  the processes disagree on the step, which hangs a collective save.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable, Sequence

import jax

log = logging.getLogger("flax_ckpt.callbacks")

Handler = Callable[[int, FrameType | None], Any] | int | None


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptionGuard:
    """Records preemption signals until ``close()``; ``reached(step)`` says when to stop and save.

    Args:
      signals: the signals that mean "preempted"; ``()`` installs nothing (preemption then only comes from
        JAX's preemption service in a multi-process job).
      force_after: the number of signals after which the previous handler runs (None: never).
    """

    def __init__(
        self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT), *, force_after: int | None = 3
    ):
        if force_after is not None and force_after < 2:
            raise ValueError(f"force_after must be >= 2 or None, got {force_after!r}")
        self.signum: int | None = None
        self.count = 0
        self._force_after = force_after
        self._previous: dict[int, Handler] = {}
        self._multiprocess = jax.distributed.is_initialized() and jax.process_count() > 1
        if self._multiprocess:
            log.info(
                "preemption: %d processes; using JAX's preemption sync point, no signal handlers",
                jax.process_count(),
            )
        else:
            self._install(tuple(signals))

    @property
    def requested(self) -> bool:
        """Whether a preemption signal has arrived (this process only)."""
        return self.signum is not None

    def _install(self, signals: tuple[int, ...]) -> None:
        if signals and threading.current_thread() is not threading.main_thread():
            log.warning(
                "preemption: not on the main thread, so no signal handlers are installed; "
                "construct the callback on the main thread to be preemption-safe"
            )
            return
        for s in signals:
            self._previous[s] = signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum
            log.warning(
                "preemption: received %s; finishing this step, then saving and stopping", _name(signum)
            )
            return
        if self._force_after is not None and self.count >= self._force_after:
            log.warning(
                "preemption: received %s (%d signals); giving up on the step-boundary save",
                _name(signum),
                self.count,
            )
            self._forward(signum, frame)
            return
        log.warning(
            "preemption: received %s again (%d signals); still saving at the next step boundary%s",
            _name(signum),
            self.count,
            "" if self._force_after is None else f", {self._force_after} signals force a stop",
        )

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        self.close()
        signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        signal.raise_signal(signum)

    def reached(self, step: int) -> bool:
        """Whether this step boundary is where the run stops and saves; call it at every boundary."""
        if self._multiprocess:
            return self._sync_point(step)
        return self.requested

    def _sync_point(self, step: int) -> bool:
        from jax.experimental import multihost_utils

        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError as e:  # the preemption service is off (jax_enable_preemption_service=False)
            log.warning("preemption: handling is off in this multi-process job: %s", e)
            self._multiprocess = False
            return self.requested

    def close(self) -> None:
        """Puts back the handlers that were installed before (where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._on_signal:
                signal.signal(s, signal.SIG_DFL if previous is None else previous)
            else:
                log.info("preemption: %s's handler was replaced by someone else; leaving theirs", _name(s))
        self._previous.clear()
