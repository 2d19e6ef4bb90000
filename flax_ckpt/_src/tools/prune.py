"""``flax-ckpt prune``: delete the steps the manager's retention rules would delete (retention.py's
``steps_to_delete``, never a copy of it), under the directory's lock.

Scope: which steps of a run directory go (each format's steps apart, as a manager's retention does;
by default only the formats a manager resumes from: native and Orbax steps), checking every deletion
before the first one, and the deletions. Other libraries' files (legacy Flax ``checkpoint_<step>``
files, ``.safetensors`` files) are listed as left alone, and pruned only when their format is named.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from flax_ckpt._src import layouts
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.errors import CheckpointError, CheckpointNotFoundError, StorageError
from flax_ckpt._src.native import sharing
from flax_ckpt._src.retention import steps_to_delete
from flax_ckpt._src.storage import Storage, open_storage
from flax_ckpt._src.storage.lock import DirectoryLock
from flax_ckpt._src.tools.ls import StepEntry, list_steps

RESUMABLE = layouts.FORMATS  # the formats whose steps a CheckpointManager lists and resumes from
PRUNABLE = (*RESUMABLE, "flax_msgpack")  # the formats ``format=`` may name


@dataclass(frozen=True)
class PruneResult:
    """What ``prune`` deleted (or, with ``dry_run``, would delete) and kept, as steps of the formats it
    acted on (``formats``); ``left_alone``: names of checkpoints of other formats in the directory,
    never deleted (another library's files, or steps of a format not named by ``format=``)."""

    kept: list[int]
    deleted: list[int]
    dry_run: bool
    formats: tuple[str, ...] = RESUMABLE
    left_alone: list[str] = field(default_factory=list)


def prune(
    directory: Any,
    *,
    keep: int | None,
    keep_period: int | None = None,
    best_metric: str | None = None,
    best_mode: Literal["min", "max"] = "min",
    keep_best: int | None = None,
    dry_run: bool = False,
    format: str | None = None,
) -> PruneResult:
    """Deletes committed steps the manager's retention (``retention.steps_to_delete``) would remove.

    Args:
      directory: a run directory (local, or an object store URL).
      keep: keep the newest ``keep`` steps of each format (>= 1).
      keep_period, best_metric, best_mode, keep_best: as CheckpointManager's retention options.
      dry_run: decide, delete nothing; a real run given the same directory deletes exactly these.
      format: act on this format's steps only ("native", "orbax", or "flax_msgpack": legacy Flax
        ``checkpoint_<step>`` files, pruned only when named here). None: native and Orbax steps, each
        format's apart, as a manager's retention does.

    Returns:
      A PruneResult. Steps of other formats are listed in ``left_alone``, never deleted.

    Raises:
      ValueError: for options out of range. CheckpointLockedError: a live CheckpointManager holds the
      directory (the directory's lock; an Orbax run or a folder of another library's files is left
      without a lock file). CheckpointNotFoundError: no such folder. StorageError: a deletion failed
      (the message names what was deleted before). Nothing is deleted unless every step to delete is
      found as listed first; damaged steps and saves in flight are never deleted.
    """
    _check_options(keep, keep_best, best_metric, format)
    formats = (format,) if format is not None else RESUMABLE
    root = open_storage(directory)
    lock = None if dry_run else _lock(root)
    try:
        entries = list_steps(directory)
        acted = {e.step: e for e in entries if e.committed and e.step is not None and e.format in formats}
        metrics = {s: (e.metrics or {}).get(best_metric) for s, e in acted.items()} if best_metric else None
        doomed = steps_to_delete(
            acted,
            max_to_keep=keep,
            keep_period=keep_period,
            metrics=metrics,
            best_mode=best_mode,
            keep_best=keep_best,
            formats={s: e.format for s, e in acted.items() if e.format is not None},
        )
        if not dry_run:
            _delete(root, [acted[s] for s in doomed])
    finally:
        if lock is not None:
            lock.release()
    kept = sorted(set(acted) - set(doomed))
    return PruneResult(kept, doomed, dry_run, formats, _left_alone(root, entries, formats))


def _check_options(
    keep: int | None, keep_best: int | None, best_metric: str | None, format: str | None
) -> None:
    if keep is not None and keep < 1:
        raise ValueError(f"--keep must be >= 1, got {keep}")
    if keep_best is not None and best_metric is None:
        raise ValueError("keep_best needs best_metric (the metric name to rank steps by)")
    if format is not None and format not in PRUNABLE:
        raise ValueError(f"format={format!r}: prune acts on one of {', '.join(PRUNABLE)}")


def _left_alone(root: Storage, entries: list[StepEntry], formats: tuple[str, ...]) -> list[str]:
    """Checkpoints of other formats in the directory: steps of other formats and .safetensors files."""
    names = [e.name for e in entries if (e.committed and e.format not in formats) or e.state == "ambiguous"]
    try:
        names += [n for n in root.list() if n.endswith(".safetensors")]
    except (CheckpointError, OSError):
        pass  # listed once already by list_steps: a folder that fails now is gone; nothing to add
    return sorted(set(names))


def _lock(root: Storage) -> Any:
    """The manager's directory lock (local folders; object stores have none to take). A folder that
    holds no steps of flax_ckpt's own format (an Orbax run, another library's files, nothing) is left
    without a lock file."""
    if root.local_path is None:
        return None
    if root.kind() != "folder":
        raise CheckpointNotFoundError(f"{root.url} is not a folder of checkpoints")
    folders, _ = layouts.step_folders(root)
    return DirectoryLock(root.local_path, tidy=all(f.layout.foreign for f in folders))


def _delete(root: Storage, doomed: list[StepEntry]) -> None:
    """Deletes ``doomed``, after checking that every one of them is still there as listed."""
    found = {f.name: f for f in layouts.step_folders(root, files=True)[0]}
    # what the kept steps refer to (native/sharing.py): a step they refer to is retired, not removed
    refs = sharing.referenced(root, [e.name for e in doomed]) if doomed else None
    plans = [(e, _plan(root, e, found.get(e.name), refs)) for e in doomed]  # every check before the first
    done: list[str] = []
    for e, remove in plans:
        try:
            remove()
        except OSError as err:
            raise StorageError(
                f"prune could not delete {root.url.rstrip('/')}/{e.name} ({err}); deleted before it: "
                f"{', '.join(done) or 'nothing'}. The step is either still whole or gone (a deletion starts "
                "with an atomic rename); run prune again once fixed"
            ) from err
        done.append(e.name)
    sharing.sweep(root)  # retired folders (object stores: holds) no kept step refers to any more


def _plan(
    root: Storage, e: StepEntry, f: layouts.StepFolder | None, refs: set[tuple[str, str]] | None
) -> Callable[[], object]:
    """How to delete step ``e`` (``f``: its step folder, listed again now), checked now: a
    CheckpointNotFoundError if it is no longer as it was listed."""
    where = f"{root.url.rstrip('/')}/{e.name}"
    changed = CheckpointNotFoundError(
        f"prune deleted nothing: {where} (step {e.step}, {e.format}) is no "
        "longer as it was listed (another process changed the directory); run "
        "prune again"
    )
    if f is None or f.layout.name != e.format:
        raise changed
    if root.sub(e.name).kind() == "file":  # another library's checkpoint file, named by format=
        try:
            path = os.path.join(root.local_path or "", e.name)
            regular = root.local_path is not None and stat.S_ISREG(os.lstat(path).st_mode)
        except OSError:
            regular = False
        if not regular:
            raise changed
        return lambda: root.delete(e.name)
    try:
        f.layout.metrics(root.sub(e.name))  # committed, and opens
    except (CheckpointError, OSError, ValueError):
        raise changed from None
    if f.layout.shares:
        return lambda: sharing.remove_step(root, e.name, f.layout.record, refs=refs)
    return lambda: commit_mod.remove(root, e.name, f.layout.record)
