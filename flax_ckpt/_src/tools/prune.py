"""``flax-ckpt prune``: delete the steps the manager's retention rules would delete (retention.py's
``steps_to_delete``, never a copy of it), under the directory's lock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src import layouts
from flax_ckpt._src.errors import CheckpointNotFoundError
from flax_ckpt._src.retention import steps_to_delete
from flax_ckpt._src.storage import Storage, open_storage
from flax_ckpt._src.storage.lock import DirectoryLock
from flax_ckpt._src.tools.ls import list_steps


@dataclass(frozen=True)
class PruneResult:
    kept: list[int]
    deleted: list[int]
    dry_run: bool


def prune(directory: Any, *, keep: int | None, keep_period: int | None = None, best_metric: str | None = None,
          best_mode: Literal["min", "max"] = "min", keep_best: int | None = None,
          dry_run: bool = False) -> PruneResult:
    """Deletes committed steps the manager's retention (``retention.steps_to_delete``) would remove.

    Takes the directory's lock, so it never races a live CheckpointManager (CheckpointLockedError); in
    an Orbax run it removes the lock file again. Steps are deleted by their folder names (an Orbax
    ``step_prefix`` run's ``ckpt_000003``). Folders of saves in flight and damaged steps are left alone."""
    if keep is not None and keep < 1:
        raise ValueError(f"--keep must be >= 1, got {keep}")
    if keep_best is not None and best_metric is None:
        raise ValueError("keep_best needs best_metric (the metric name to rank steps by)")
    root = open_storage(directory)
    foreign = root.kind() == "folder" and any(f.layout.foreign for f in layouts.step_folders(root)[0])
    lock = _lock(root, tidy=foreign) if not dry_run else None  # another library's run: leave no lock file
    try:
        committed = {e.step: e for e in list_steps(directory) if e.committed and e.step is not None}
        metrics = {s: (e.metrics or {}).get(best_metric) for s, e in committed.items()} if best_metric else None
        doomed = steps_to_delete(committed, max_to_keep=keep, keep_period=keep_period, metrics=metrics,
                                 best_mode=best_mode, keep_best=keep_best)
        if not dry_run:
            for s in doomed:
                commit_mod.remove(root, committed[s].name, layouts.layout(committed[s].format).record)
    finally:
        if lock is not None:
            lock.release()
    return PruneResult(sorted(set(committed) - set(doomed)), doomed, dry_run)


def _lock(root: Storage, tidy: bool) -> Any:
    """The manager's directory lock (local folders; object stores have none to take)."""
    if root.local_path is None:
        return None
    if root.kind() != "folder":
        raise CheckpointNotFoundError(f"{root.url} is not a folder of checkpoints")
    return DirectoryLock(root.local_path, tidy=tidy)
