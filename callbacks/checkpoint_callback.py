"""CheckpointCallback: periodic, preemption-safe checkpoints and automatic resume for a training loop.

Scope: the three calls a training loop makes (construction, ``restore_or``, one call per step boundary)
and what happens on preemption. Built only on flax_ckpt's public API (``fc.CheckpointManager``); how the
user's state becomes a pytree lives in state.py, signals in preemption.py.

    ckpt = CheckpointCallback(directory, every_steps=100, max_to_keep=3)
    state, start_step = ckpt.restore_or(state)
    for step in range(start_step, num_steps):
        state, metrics = train_step(state, batch(step))
        ckpt(step + 1, state, metrics)
    ckpt.close()  # saves the last step if the schedule skipped it, waits until it is durable

``close()`` (also run at interpreter exit for a callback still open) saves the state of the last call
when that step was not saved, so a run whose length is not a multiple of ``every_steps`` keeps its
last steps; ``finish(step, state)`` does the same for an explicit step and state. On SIGTERM or SIGINT
the step in progress finishes; at its boundary the callback saves that step (off schedule), waits
until it is durable and exits (``SystemExit``, status ``128 + signal`` unless ``exit_code`` says
otherwise; in IPython, Jupyter or at the Python prompt it raises ``Preempted`` instead, which ends the
cell with one line and keeps the kernel), or, with ``exit_on_preemption=False``, sets ``ckpt.preempted``
and returns so the loop can break.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

import flax_ckpt as fc

from .announce import announce as _announce
from .preemption import PreemptionGuard
from .replicated import first_replica, replicate_like
from .resume import check_restored, state_for
from .state import from_tree, match_saved_scalars, target_tree, to_tree

log = logging.getLogger("flax_ckpt.callbacks")

Metrics = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


class CheckpointCallback:
    """Saves every ``every_steps`` steps, resumes from the newest checkpoint, and survives preemption.

    Args:
      directory: where the checkpoints go (a local path or a URL the manager accepts).
      every_steps: save the steps divisible by this (the manager's ``save_interval_steps``).
      max_to_keep: the newest N checkpoints are kept (None keeps all).
      exit_on_preemption: on preemption, exit after the save (True: ``SystemExit``; in an interactive
        session, IPython, Jupyter or the Python prompt, ``Preempted``, shown as one line) or set
        ``preempted`` and return (False).
      exit_code: the exit status after a preemption save; None gives 128 + the signal number (143 for
        SIGTERM), the status a scheduler sees for a job the signal killed, so it is not taken for success.
      preemption_signals: the signals that mean "preempted"; ``()`` installs no handler.
      force_after: the number of signals after which the previous handler runs, abandoning the save.
      replicated: the state given is replicated for ``jax.pmap`` (every jax array leaf stacked on a leading
        axis of the local devices, as ``flax.jax_utils.replicate`` makes it). Pass it as it is, every
        step: only when a step is saved is its first replica taken (device 0's copy of each leaf, in one
        jitted call: about a millisecond for 200 leaves, against a dispatch per leaf for
        ``jax_utils.unreplicate``), so the checkpoint holds the unreplicated state, which restores on
        any device count, with or without pmap; the steps that are not saved cost nothing.
        ``restore_or`` replicates the restored state onto the local devices again. The replicas are
        assumed equal (kept in sync by ``pmean``): the first is saved.
      compile_cache: keep JAX's compiled programs in ``<directory>/compile_cache`` (True), in another
        folder of their own (a path or URL: missing or empty at first, never a folder of other files,
        which is not used), or not (False), so that a resumed run loads its training step instead of
        compiling it again (``fc.use_compilation_cache``). A cache the program configured itself
        (``jax_compilation_cache_dir``) is used as it is.
      **manager_options: any other ``fc.CheckpointManager`` option (``keep_period``, ``best_metric``,
        ``best_mode``, ``keep_best``, ``async_save``, ``serializer``, ...).

    Raises:
      TypeError: ``save_interval_steps`` is given (``every_steps`` is that option here).
      CheckpointLockedError: another live manager holds the directory (and whatever
        ``fc.CheckpointManager`` raises for its options).

    Example:
      >>> import numpy as np
      >>> from flax_ckpt.callbacks import CheckpointCallback
      >>> def create_state():  # in a restart, only traced: the checkpoint's values replace it
      ...     return {"w": np.zeros(2, np.float32)}
      >>> ckpt = CheckpointCallback("run", every_steps=2)
      >>> state, start = ckpt.restore_or(create_state)
      >>> for step in range(start, 5):
      ...     state = {"w": state["w"] + 1}
      ...     _ = ckpt(step + 1, state, {"loss": 1 / (step + 1)})
      >>> ckpt.close()  # saves step 5, which the schedule skipped
      >>> ckpt = CheckpointCallback("run", every_steps=2)
      >>> ckpt.restore_or(create_state)
      ({'w': array([5., 5.], dtype=float32)}, 5)
      >>> ckpt.close()
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        every_steps: int = 100,
        max_to_keep: int | None = 3,
        *,
        exit_on_preemption: bool = True,
        exit_code: int | None = None,
        preemption_signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        force_after: int | None = 3,
        replicated: bool = False,
        compile_cache: bool | str | os.PathLike = True,
        **manager_options: Any,
    ):
        if "save_interval_steps" in manager_options:
            raise TypeError(
                "CheckpointCallback takes every_steps (it is the manager's save_interval_steps); "
                "pass one of them, not save_interval_steps"
            )
        self.every_steps = every_steps
        self.replicated = replicated
        _close_earlier(directory)
        self.manager = fc.CheckpointManager(
            directory, save_interval_steps=every_steps, max_to_keep=max_to_keep, **manager_options
        )
        self.preempted = False
        self._exit_on_preemption = exit_on_preemption
        self._exit_code = exit_code
        try:
            self._guard = PreemptionGuard(preemption_signals, force_after=force_after)
        except BaseException:
            self.manager.close()
            raise
        self._closed = False
        self._pending: tuple[int, Any, Metrics] | None = None  # the last call's step, state, metrics: unsaved
        self._pid = os.getpid()  # a child forked from this process (a data loader's worker) never closes it
        self.compile_cache = _use_compile_cache(directory, compile_cache, manager_options)
        self.manager.prefetch()  # the newest step's bytes read while the program starts (restore_or)
        _close_at_exit(self)

    # ------------------------------------------------------------------------------------------ resume

    def restore_or(
        self,
        state: Any,
        *,
        init_from: str | os.PathLike | None = None,
        continue_step: bool = False,
        rename: Any = None,
        missing: str = "error",
        unexpected: str = "error",
        cast: bool = False,
        report: bool = False,
    ) -> Any:
        """``(state restored from the newest good checkpoint, its step)``, or ``(state, 0)`` if there is none.

        ``state`` may be the function that builds the state: a restart then builds only its shapes.

        nnx objects and stateful iterators in ``state`` are updated in place; an ``nnx.State`` (also a
        filtered one, ``nnx.state(model, nnx.LoRAParam)``) is restored into its ``nnx.Variable``
        objects, which are the model's own, so the model holds the values (a State of copies is
        restored with a warning naming the fix, ``nnx.update(model, state)``). A resumed run restores
        its own newest step; ``init_from`` applies only to a run with no checkpoint yet.

        ``missing``, ``unexpected`` and ``cast`` fit the checkpoint restored to ``state``: the run's own
        newest step when it has one (a program that now saves more than its earlier steps hold resumes
        with ``missing="keep"``), else ``init_from``'s. ``rename`` applies to ``init_from`` when it is
        given (a resumed run's own steps already have the program's key paths), else to the run's own
        steps. Each logs a one-line ``fc.RestoreReport`` of what it changed.

        Args:
          state: the function that builds the fresh state (called with no argument), or that state: it
            gives the structure, dtypes and placement. With a step to resume from, a function is traced,
            never run (no compile, no computation, no device memory), and the step restored into its
            shapes, shardings and nnx objects; Python objects it returns (data iterators,
            ``random.Random``) are built and restored in place. ``missing="keep"``, ``replicated=True``
            and a fresh run call it.
          init_from: where a fresh run starts from: a checkpoint (any path fc.restore takes, e.g. a
            pretrained model's) or a run directory (another run's, native or Orbax: its newest good
            step, as its manager would restore it).
          continue_step: with ``init_from``, start at the step ``init_from`` was saved at (its run's
            step), so that a run continued in a new directory keeps its learning-rate schedule and data
            position; False (the default) starts at step 0, as a fine-tune does.
          rename: as fc.restore's: for ``init_from`` when given, else for the run's own steps.
          missing: as fc.restore's ("keep": leaves of ``state`` the checkpoint lacks keep their values).
          unexpected: as fc.restore's ("ignore": leaves of the checkpoint ``state`` lacks are not read).
          cast: as fc.restore's.
          report: also return the ``fc.RestoreReport`` (None when nothing was restored).

        Returns:
          ``(state, step)``: the restored state and the step to continue from; with ``report=True``,
          ``(state, step, report)``.

        Raises:
          TypeError: ``continue_step`` without ``init_from``.
          ValueError: ``continue_step`` with an ``init_from`` checkpoint that records no step.
          TargetMismatchError: ``state`` does not fit the checkpoint (the message lists every leaf).
          InvalidArgumentError: traced values (``restore_or`` called inside ``jax.jit``).
          CorruptCheckpointError: every step is damaged (or, when strict, the newest).

        Example:
          >>> import numpy as np
          >>> from flax_ckpt.callbacks import CheckpointCallback
          >>> fc.save("pretrained", {"w": np.ones(2, np.float32)})
          >>> ckpt = CheckpointCallback("run")
          >>> ckpt.restore_or({"head": np.zeros(1, np.float32), "w": np.zeros(2, np.float32)},
          ...                 init_from="pretrained", missing="keep")
          ({'head': array([0.], dtype=float32), 'w': array([1., 1.], dtype=float32)}, 0)
          >>> ckpt.close()
        """
        if continue_step and init_from is None:
            raise TypeError(
                "restore_or: continue_step=True carries init_from's step on; pass init_from=<the run or "
                "checkpoint to continue> (a run's own steps always resume at their step)"
            )
        fit = dict(missing=missing, unexpected=unexpected, cast=cast, report=report)
        own = dict(fit, rename=rename if init_from is None else None)
        resumes = bool(self.manager.all_steps()) and missing != "keep" and not self.replicated
        state, make_state = state_for(state, resumes)  # a function: its shapes alone (resume.py)
        if self.manager.all_steps():
            restored, step, got = self._restore_run(self.manager, state, own)
            if make_state is not None:
                check_restored(restored, make_state)
            _announce("resumed from step %d of %s", step, self.manager.directory)
            return (restored, step, got) if report else (restored, step)
        if init_from is None:
            _announce("no checkpoint in %s; starting from step 0", self.manager.directory)
            return (state, 0, None) if report else (state, 0)
        restored, saved_step, got = self._restore_init(state, init_from, dict(fit, rename=rename))
        step = 0
        if continue_step:
            if saved_step is None:
                raise ValueError(
                    f"restore_or(init_from={os.fspath(init_from)!r}, continue_step=True): that checkpoint "
                    "records no step (saved without step=, or an Orbax StandardCheckpointer folder); pass "
                    "the run directory or a step folder of it, or leave continue_step False to start at 0"
                )
            step = saved_step
        _announce(
            "no checkpoint in %s; starting from step %d with %s", self.manager.directory, step, init_from
        )
        return (restored, step, got) if report else (restored, step)

    def _restore_run(
        self, manager: fc.CheckpointManager, state: Any, options: dict[str, Any]
    ) -> tuple[Any, int, Any]:
        """``(state, step, report or None)`` from the newest good step of ``manager``'s run: the manager
        decides the step, alike on every process of a job."""
        used: list[Any] = []  # the target of the step restored (the last one tried)

        def target_for(info: fc.CheckpointInfo) -> Any:
            used[:] = [target_tree(state, info)]  # nnx parts as the step holds them: State or pure dict
            return match_saved_scalars(first_replica(used[0]) if self.replicated else used[0], info)

        restored = manager.restore(target_for=target_for, **options)
        restored, got = restored if options["report"] else (restored, None)
        step = manager.restore_stats[-1].step
        if self.replicated:
            restored = replicate_like(used[0], restored)
        return _into(state, restored, f"step {step} of {manager.directory}"), step, got

    def _restore_init(
        self, state: Any, init_from: Any, options: dict[str, Any]
    ) -> tuple[Any, int | None, Any]:
        """``(state, init_from's step or None, report or None)`` from ``init_from``: a checkpoint folder,
        else a run directory (its newest good step, through a read-only manager)."""
        info = _metadata_or_none(init_from)
        if info is None:
            run = _run_or_none(init_from)
            if run is not None:
                with run:
                    return self._restore_run(run, state, options)
        live = target_tree(state, info)
        restored = _restore_everywhere(init_from, first_replica(live) if self.replicated else live, options)
        restored, got = restored if options["report"] else (restored, None)
        if self.replicated:
            restored = replicate_like(live, restored)
        return _into(state, restored, os.fspath(init_from)), None if info is None else info.step, got

    def _tree(self, state: Any) -> Any:
        """The pytree saved for ``state`` (its first replica with ``replicated=True``)."""
        tree = to_tree(state, keep_bytes=self.manager.format == "orbax")  # Orbax: grain's file
        return first_replica(tree) if self.replicated else tree

    # ------------------------------------------------------------------------------------------ saving

    def __call__(self, step: int, state: Any, metrics: Metrics = None, *, force: bool = False) -> bool:
        """Call at each step boundary with the state after ``step`` steps; saves when the schedule says so.

        On preemption (a signal of ``preemption_signals``) saves this step, waits until it is durable,
        and exits (or, with ``exit_on_preemption=False``, sets ``preempted``). The last state given is
        saved by ``close()`` if its step was not.

        Args:
          step: the number of steps done.
          state: the training state (a pytree; nnx objects and stateful iterators are converted).
          metrics: JSON scalars, or a function returning them (called only when saving; an array
            with one element counts as its number), stored with the checkpoint and ranking it for
            ``best_metric``.
          force: save off the schedule (e.g. after an evaluation worth keeping).

        Returns:
          Whether it saved.

        Raises:
          SystemExit: after a preemption save, with ``exit_on_preemption=True``.
          SaveFailedError: a previous background save failed.
          CheckpointError: the callback is closed.

        Example:
          >>> import numpy as np
          >>> from flax_ckpt.callbacks import CheckpointCallback
          >>> with CheckpointCallback("run", every_steps=10) as ckpt:
          ...     ckpt(9, {"w": np.zeros(2)}), ckpt(10, {"w": np.ones(2)})
          (False, True)
        """
        if self._closed:
            raise fc.CheckpointError("CheckpointCallback is closed")
        stop = not self.preempted and self._guard.reached(step)
        saved = False
        if force or stop or self.manager.should_save(step):
            saved = self.manager.save(step, self._tree(state), metrics=_values(metrics), force=force or stop)
        self._pending = None if saved else (step, state, metrics)
        if saved and not stop and not self.preempted and self._guard.requested:
            stop = True  # a signal arrived while this step was being saved: it is the one to stop at
        if stop:
            self._stop(step)
        return saved

    def _stop(self, step: int) -> None:
        self.manager.wait_until_finished()
        self.preempted = True
        where = f"step {step} is saved in {self.manager.directory} and durable"
        if not self._exit_on_preemption:
            log.warning("preemption: %s; ckpt.preempted is True, leave the training loop", where)
            return
        code = self._exit_code
        if code is None:
            code = 128 + (self._guard.signum or signal.SIGTERM)
        if _interactive():  # SystemExit would print a traceback and IPython's "To exit: use 'exit'" warning
            log.warning("preemption: %s; stopping the training loop (run it again to resume)", where)
            self.close()
            raise Preempted(step, self.manager.directory, code, self._guard.signum)
        log.warning(
            "preemption: %s; exiting with status %d (restart to resume from step %d)", where, code, step
        )
        self.close()
        raise SystemExit(code)

    def finish(self, step: int, state: Any, metrics: Metrics = None) -> bool:
        """Saves ``step`` (off schedule if need be) unless it is saved already, and waits until every save
        is durable: the end of a run whose length is not a multiple of ``every_steps``, or whose final
        state is not the one the loop last passed.

        Args:
          step: the final step.
          state: the final state.
          metrics: as for a call.

        Returns:
          Whether it saved.

        Raises:
          SaveFailedError: this or a previous save failed.
          CheckpointError: the callback is closed.

        Example:
          >>> import numpy as np
          >>> from flax_ckpt.callbacks import CheckpointCallback
          >>> with CheckpointCallback("run", every_steps=10) as ckpt:
          ...     ckpt.finish(7, {"w": np.zeros(2)}), ckpt.manager.all_steps()
          (True, [7])
        """
        if self._closed:
            raise fc.CheckpointError("CheckpointCallback is closed")
        self._pending = None
        saved = step not in self.manager.all_steps() and self.manager.save(
            step, self._tree(state), metrics=_values(metrics), force=True
        )
        self.manager.wait_until_finished()
        return saved

    # ------------------------------------------------------------------------------------------- close

    def close(self) -> None:
        """Saves the state of the last call if its step was not saved (not after a preemption save),
        waits for the save in flight, releases the directory and puts back the signal handlers.

        Also run at interpreter exit for a callback still open, and by ``with CheckpointCallback(...)``.

        Raises:
          SaveFailedError: the final or an earlier save failed (the directory is released all the same).

        Example:
          >>> import numpy as np
          >>> from flax_ckpt.callbacks import CheckpointCallback
          >>> ckpt = CheckpointCallback("run", every_steps=10)
          >>> ckpt(3, {"w": np.zeros(2)})
          False
          >>> ckpt.close()
          >>> fc.metadata("run/3").step
          3
        """
        self._close(final_save=True, at_exit=False)

    def _close(self, *, final_save: bool, at_exit: bool) -> None:
        if self._closed:
            return
        if self._pid != os.getpid():  # a forked child: the run, its last step and its lock are the parent's
            if at_exit or not final_save:
                return  # the child exits (or drops its copy) without saving or closing anything
            raise fc.CheckpointError(
                f"CheckpointCallback({self.manager.directory}).close() in process {os.getpid()}, a child "
                f"forked from process {self._pid}, which opened it: only that process saves its last "
                "step and closes it. Fix: close it in the parent; a child that saves needs a "
                "CheckpointCallback of its own, on another directory"
            )
        self._closed = True
        _OPEN.discard(self)
        if self._guard.requested and not self.preempted:
            log.warning("preemption: a signal arrived after the last step boundary; nothing was left to save")
        try:
            if final_save:
                self._save_pending(at_exit)
            elif self._pending is not None and not self.preempted:
                log.warning(
                    "CheckpointCallback was garbage-collected without close(): step %d was not saved; "
                    "call ckpt.close() (or ckpt.finish(step, state)) after the training loop",
                    self._pending[0],
                )
            self.manager.close()
        finally:
            self._guard.close()
            if self.compile_cache is not None:
                self.compile_cache.close()

    def _save_pending(self, at_exit: bool) -> None:
        """The final save of close(): the last call's step, unless saved, preempted or its arrays gone."""
        pending, self._pending = self._pending, None
        if pending is None or self.preempted or pending[0] in self.manager.all_steps():
            return
        step, state, metrics = pending
        if at_exit and jax.process_count() > 1:  # a collective save that another process may never join
            log.warning(
                "not saving step %d at interpreter exit in a multi-process job (the other processes may "
                "have stopped elsewhere); call ckpt.close() or ckpt.finish(step, state) after the loop",
                step,
            )
            return
        tree = to_tree(state, keep_bytes=self.manager.format == "orbax")
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(tree)):
            log.warning(
                "not saving step %d at close: its arrays were deleted or donated after ckpt(%d, ...) (a "
                "jitted step with donate_argnums?); call ckpt.finish(step, state) with the live state "
                "after the loop",
                step,
                step,
            )
            return
        try:
            self.manager.save(
                step, first_replica(tree) if self.replicated else tree, metrics=_values(metrics), force=True
            )
            self.manager.wait_until_finished()
        except Exception as e:
            if not at_exit:
                raise
            log.warning(
                "could not save the last step %d at interpreter exit: %s: %s", step, type(e).__name__, e
            )
            return
        _announce("saved the last step %d in %s at close", step, self.manager.directory)

    def __enter__(self) -> "CheckpointCallback":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # no final save: garbage collection may run anywhere, on any thread
        if not getattr(self, "_closed", True):
            self._close(final_save=False, at_exit=False)


class Preempted(KeyboardInterrupt):
    """Raised by ``CheckpointCallback`` instead of ``SystemExit`` in an interactive session (IPython,
    Jupyter, the Python prompt) after a preemption save: it ends the cell's training loop, leaves the
    kernel running, and shows one line instead of a traceback. A ``KeyboardInterrupt``, so that an
    ``except Exception`` in the loop does not swallow it.

    Attributes: ``step`` (saved and durable), ``directory``, ``code`` (the exit status a script would
    have had), ``signum`` (the signal received, or None)."""

    def __init__(self, step: int, directory: str, code: int, signum: int | None):
        name = signal.Signals(signum).name if signum in set(signal.Signals) else "preemption"
        super().__init__(
            f"{name}: step {step} is saved in {directory} and durable; the training loop "
            f"stopped. Run the cell again to resume from step {step}"
        )
        self.step, self.directory, self.code, self.signum = step, directory, code, signum

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines in place of a traceback
        return [f"Preempted: {self}"]


def _use_compile_cache(
    directory: str | os.PathLike, setting: bool | str | os.PathLike, options: dict[str, Any]
) -> "fc.CompilationCache | None":
    """Installs the run's compilation cache as ``compile_cache`` says; None without one."""
    if setting is False or setting is None:
        return None
    location = f"{os.fspath(directory).rstrip('/')}/compile_cache" if setting is True else setting
    return fc.use_compilation_cache(location, options=options.get("storage_options"))


def _values(metrics: Metrics) -> dict[str, Any] | None:
    """The metrics of a step as the manager's ``save`` takes them: called if a callable, as a dict."""
    values = metrics() if callable(metrics) else metrics
    return None if values is None else dict(values)


def _interactive() -> bool:
    """Whether this is an interactive session (an IPython shell or Jupyter kernel, or the Python prompt),
    where SystemExit would end the kernel's cell with a traceback, or the interpreter itself."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return (get is not None and get() is not None) or hasattr(sys, "ps1") or bool(sys.flags.interactive)


def _into(state: Any, restored: Any, source: str) -> Any:
    """``from_tree(state, restored)``; a restored value the live state cannot take (a stored random
    state no generator resumes from) is a CorruptCheckpointError that names ``source`` too; a data
    position its iterator refuses, a TargetMismatchError naming the item and ``source``."""
    try:
        return from_tree(state, restored, source=source)
    except fc.CorruptCheckpointError as e:
        raise fc.CorruptCheckpointError(f"{source}: {e}") from None


def _metadata_or_none(path: Any) -> fc.CheckpointInfo | None:
    """fc.metadata of ``path``, or None where it has none to give (the restore then says why)."""
    try:
        return fc.metadata(path)
    except (fc.CheckpointError, OSError, ValueError):
        return None


def _run_or_none(path: Any) -> fc.CheckpointManager | None:
    """A read-only manager of the run directory ``path`` when it holds committed steps, else None (the
    restore of ``path`` as one checkpoint then says why it is not one)."""
    try:
        run = fc.CheckpointManager(path, read_only=True)
    except (fc.CheckpointError, OSError, ValueError):
        return None
    if run.all_steps():
        return run
    run.close()
    return None


def _restore_everywhere(path: Any, target: Any, options: dict[str, Any]) -> Any:
    """fc.restore of ``path`` into ``target`` on every process of a job, or a CheckpointError on every
    one: a process reads only its own shards, so a failure (a value its shards hold that cast cannot
    convert, a damaged file only it reads) may be seen by one process alone; the others must not train on."""
    error: fc.CheckpointError | None = None
    try:
        restored = fc.restore(path, target, **options)
    except fc.CheckpointError as e:
        error, restored = e, None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
        if error is None and failed.any():
            raise fc.CheckpointError(
                f"restore of init_from={path} failed on process {int(np.flatnonzero(failed)[0])} (its error "
                "says why), so no process starts from it: fix that, then restart every process"
            )
    if error is not None:
        raise error
    return restored


_OPEN: "weakref.WeakSet[CheckpointCallback]" = weakref.WeakSet()  # callbacks to close at exit
_HOOKED: list[bool] = []


def _close_at_exit(cb: CheckpointCallback) -> None:
    """Has ``cb`` closed (with its final save) when the interpreter exits, without keeping it alive.

    The hook must run before ``concurrent.futures`` stops taking work (the saves use thread pools),
    which happens before ``atexit`` handlers run: CPython's ``threading._register_atexit`` is the hook
    concurrent.futures itself uses (called in reverse order of registration, so ours runs first);
    ``atexit`` where it does not exist."""
    _OPEN.add(cb)
    if _HOOKED:
        return
    _HOOKED.append(True)
    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(_close_open_callbacks)
    except RuntimeError:  # already shutting down threads
        atexit.register(_close_open_callbacks)


def _same_directory(a: Any, b: Any) -> bool:
    a, b = os.fspath(a), os.fspath(b)
    return a == b if "://" in a or "://" in b else os.path.realpath(a) == os.path.realpath(b)


def _close_earlier(directory: Any) -> None:
    """Closes the callbacks of this process still open on ``directory`` (a notebook cell run again after
    its loop raised, before ``ckpt.close()``), with a warning: each waits for its save in flight and puts
    back its signal handlers; the state of its last call is not saved (the loop failed after it)."""
    for cb in list(_OPEN):
        if not _same_directory(cb.manager.directory, directory):
            continue
        log.warning(
            "CheckpointCallback(%s), made earlier in this process, was never closed (a notebook "
            "cell whose loop raised before ckpt.close()?); closing it now, after its save in flight, "
            "without saving its last state. Use `with CheckpointCallback(...) as ckpt:` to close it "
            "even when the loop raises",
            cb.manager.directory,
        )
        cb._pending = None
        try:
            cb._close(final_save=False, at_exit=False)
        except Exception as e:
            log.warning(
                "closing the earlier CheckpointCallback(%s) raised %s: %s; its last save may be lost",
                cb.manager.directory,
                type(e).__name__,
                e,
            )


def _close_open_callbacks() -> None:
    for cb in list(_OPEN):
        try:
            cb._close(final_save=True, at_exit=True)
        except Exception as e:  # never a traceback at interpreter exit: say what happened instead
            log.warning(
                "closing CheckpointCallback(%s) at interpreter exit failed: %s: %s",
                cb.manager.directory,
                type(e).__name__,
                e,
            )
