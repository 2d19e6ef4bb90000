"""The step index: which steps a run's directory holds committed, each step's folder and metrics, and
which step folders are damaged; one view, agreed across processes.

Scope: the scan of the directory (and, once the manager has claimed it, the removal of crashed saves' leftovers), the view every process adopts from
process 0, the bookkeeping of steps written and removed (``retain``: retention.py's policy carried
out), and opening a step's folder as a restore Source. Not here: when to save (schedule.py), which
steps to keep (retention.py), writing (manager.py) and restoring (agreed.py).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from flax_ckpt._src import layouts
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.commit import distributed
from flax_ckpt._src.commit.recycler import Recycler
from flax_ckpt._src.engine.reader import Source
from flax_ckpt._src.errors import CheckpointError, CheckpointNotFoundError, StorageError, error_class
from flax_ckpt._src.manager.vanishing import being_deleted
from flax_ckpt._src.native import damage, sharing
from flax_ckpt._src.retention import Retention
from flax_ckpt._src.storage import Storage

log = logging.getLogger("flax_ckpt")
_LISTINGS = 20  # listings of the directory in one scan at most, while the run deletes the steps listed


class StepIndex:
    """The committed steps of ``storage`` (a run directory), as this process knows them.

    Thread-safe: the background writer adds and removes steps while the caller's thread reads them.
    ``layout``: the run's own layout (new steps' folder names; an Orbax run's items follow its newest step).
    ``serializer``: the manager's ``serializer=``, which reads native steps whose manifest names it.
    ``recycler``: the run's recycled files (``Layout.recycler``), given the data files of removed steps.
    """

    def __init__(
        self,
        storage: Storage,
        layout: layouts.Layout,
        prefix: str,
        serializer: Any = None,
        recycler: Recycler | None = None,
    ):
        self.storage, self.layout, self._prefix, self._serializer = storage, layout, prefix, serializer
        self.recycler = recycler
        self.directory = storage.url
        self._mutex = threading.Lock()
        self._metrics: dict[int, dict[str, Any] | None] = {}
        self._folders: dict[int, layouts.StepFolder] = {}  # committed steps: folder name and format
        self._damaged: dict[int, tuple[Exception, layouts.StepFolder]] = {}  # step folders that fail to open
        self._leftovers: list[str] = []  # folders of crashed saves, removed once the directory is claimed
        self._written: set[int] = set()  # steps this index added: retention of any other step is announced
        self._found: set[int] = set()  # steps of _damaged a restore found damaged (retention counts them)
        self._retention_warned = False

    # ------------------------------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        with self._mutex:
            return sorted(self._metrics)

    def __contains__(self, step: int) -> bool:
        return step in self._metrics

    def metrics(self, step: int) -> dict[str, Any] | None:
        with self._mutex:
            if step not in self._metrics:
                raise CheckpointNotFoundError(f"no committed step {step} in {self.directory}")
            return self._metrics[step]

    def all_metrics(self) -> dict[int, dict[str, Any] | None]:
        """{step: its saved metrics} of every committed step (a copy)."""
        with self._mutex:
            return dict(self._metrics)

    def newest_damaged(self) -> tuple[int, Exception] | None:
        """The newest damaged step and why it cannot be opened, or None."""
        step = max(self._damaged, default=None)
        return None if step is None else (step, self._damaged[step][0])

    def ambiguity(self, step: int) -> str | None:
        """Why ``step`` is none of the run's steps when several folders name it (layouts.StepFolder), else None."""
        damaged = self._damaged.get(step)
        return None if damaged is None or not damaged[1].clash else str(damaged[0])

    def folder_name(self, step: int) -> str:
        """The name of step ``step``'s folder in the directory."""
        return (self._folders.get(step) or layouts.StepFolder(step, str(step), self.layout)).name

    def open(self, step: int, item: str | None = None) -> Source:
        """Step ``step``'s folder, in its own format, as a restore Source (``item``: one named item)."""
        folder = self._folders.get(step) or layouts.StepFolder(step, str(step), self.layout)
        return folder.layout.open(self.storage.sub(folder.name), item)

    # ------------------------------------------------------------------------------------- the view

    def scan(self, *, tidy: bool) -> None:
        """Rebuilds the view of committed steps from the directory and, with ``tidy`` (the directory is
        claimed), removes leftovers of crashes. With several processes, process 0 alone scans and
        removes, and every process adopts its view (steps, their folders and metrics, damaged steps):
        all restore and retain the same steps."""
        lead = distributed.process_index() == 0
        if distributed.process_count() > 1 and not lead:
            self.agree()
            return
        metrics, found, damaged, self._leftovers = self._read_directory()
        with self._mutex:
            self._metrics, self._folders, self._damaged = metrics, found, damaged
            self._found = set()
        self.layout.follow(self.storage, layouts.newest_own(self.layout, list(found.values())))
        if tidy and lead:
            for entry in self._leftovers:  # on an object store sparing what a hold keeps (native/sharing.py)
                if sharing.clear(self.storage, entry):
                    log.warning(
                        "removed %s/%s, left by an interrupted save or deletion", self.directory, entry
                    )
            self._leftovers = []
        if distributed.process_count() > 1:
            self.agree()

    def _read_directory(self) -> tuple[dict, dict, dict, list[str]]:
        """(metrics, folders, damaged, leftovers) of the committed steps of one listing of the directory
        in which no step left while it was read. A run that deletes steps meanwhile (its retention, seen
        by a reader following it) may have deleted every step listed, having committed newer ones: the
        directory is then listed again (what was read already is not read again), until a listing whose
        steps all stay while read, _LISTINGS at most (the last one's view): a view lacks every step only if
        the run deleted every step listed that many times over."""
        read: dict[tuple[str, str], Any] = {}  # (folder, format) -> its metrics, read during this scan
        for _ in range(_LISTINGS):
            folders, temporary = layouts.step_folders(self.storage, self._serializer)
            metrics, found, damaged, leftovers, vanished = {}, {}, {}, list(temporary), False
            for f in sorted(folders, key=lambda f: f.step, reverse=True):  # the newest first: the last to go
                key = (f.name, f.layout.name)
                ambiguous = f.ambiguity(self.directory)
                if ambiguous is not None:  # never read as the step (layouts.StepFolder.clash)
                    damaged[f.step] = (CheckpointError(ambiguous), f)
                    continue
                if key not in read:
                    try:
                        read[key] = f.layout.metrics(self.storage.sub(f.name))
                    except StorageError:
                        raise  # the store failed (after its retries): say so, never hide a step
                    except (CheckpointError, OSError) as e:
                        vanished |= self._unreadable(f, e, damaged, leftovers)
                        continue
                metrics[f.step], found[f.step] = read[key], f
            if not vanished:
                break
        for step, (e, _) in sorted(damaged.items()):
            log.warning("ignoring damaged step %d in %s: %s", step, self.directory, e)
        return dict(sorted(metrics.items())), dict(sorted(found.items())), damaged, leftovers

    def _unreadable(self, f: layouts.StepFolder, e: Exception, damaged: dict, leftovers: list[str]) -> bool:
        """Sorts a step folder that failed to open with ``e``: True when it is gone (deleted while the
        scan read it); else it is a leftover (an object-store step whose commit never came) or damaged."""
        if f.name not in self.storage.list() or being_deleted(self.storage, f.name):
            return True  # gone, or going: deleted by the run this manager follows (Orbax's files first)
        if not self.storage.supports_rename and not self.storage.sub(f.name).exists(f.layout.record):
            leftovers.append(f.name)  # an uncommitted object-store step: its commit object never came
        else:
            damaged[f.step] = (e, f)
        return False

    def agree(self) -> None:
        """Every process adopts process 0's view of the directory (a collective: at open and at each
        restore). Process 0 commits every step, so its view is the one that is right when another
        process's listing lags (object stores) or missed the end of a save that failed there."""
        with self._mutex:
            mine = {
                "steps": {
                    str(s): [self._folders[s].name, self._folders[s].layout.name, self._metrics.get(s)]
                    for s in self._metrics
                    if s in self._folders
                },
                "damaged": {
                    str(s): [type(e).__name__, str(e), f.name, f.layout.name]
                    for s, (e, f) in self._damaged.items()
                },
            }
        lead = distributed.lead(self._prefix, "view", mine)
        if distributed.process_index() == 0:
            return

        def folder(step: str, name: str, fmt: str) -> layouts.StepFolder:
            return layouts.StepFolder(int(step), name, layouts.named(fmt, self._serializer))

        with self._mutex:
            self._metrics = {int(s): m for s, (_, _, m) in lead["steps"].items()}
            self._folders = {int(s): folder(s, name, fmt) for s, (name, fmt, _) in lead["steps"].items()}
            self._damaged = {
                int(s): (error_class(kind)(msg), folder(s, name, fmt))
                for s, (kind, msg, name, fmt) in lead["damaged"].items()
            }

    # ------------------------------------------------------------------------------------- writing

    def new_folder(self, step: int) -> str:
        """The folder name of a new step (background writer): a damaged old folder of the same step is
        moved aside first (never deleted on a file system: ``<step>.damaged-<uuid>``; an object store
        has no rename, so there it is removed)."""
        damaged = self._damaged.pop(step, None)
        self._found.discard(step)
        if damaged is not None and distributed.process_index() == 0:
            if damaged[1].clash and self.storage.supports_rename:
                for name in damaged[1].clash:  # an ambiguous step: all its folders
                    self._moved(step, name, f"{name}.damaged-{uuid.uuid4().hex[:8]}")
            elif damaged[1].layout.shares:  # kept steps may refer to its bytes (native/damage.py)
                name = damaged[1].name
                self._moved(step, name, damage.set_aside(self.storage, name, damaged[1].layout.record))
            elif self.storage.supports_rename:
                self._moved(step, damaged[1].name, f"{damaged[1].name}.damaged-{uuid.uuid4().hex[:8]}")
            else:
                sharing.remove_folder(self.storage, damaged[1].name, damaged[1].layout.record)
                self._moved(step, damaged[1].name, None)
        with self._mutex:
            return layouts.step_name(self.layout, step, sorted(self._folders.values(), key=lambda f: f.step))

    def _moved(self, step: int, name: str, to: str | None) -> None:
        """Moves the damaged step ``step``'s folder ``name`` to ``to`` (``<name>.damaged-<hex>``:
        renamed here; a retired folder or None, removed: done already), saying so."""
        if to is not None and to.startswith(f"{name}.damaged-"):
            try:
                self.storage.rename(name, to)
            except FileNotFoundError:
                return  # gone (deleted by hand): nothing to move
        where = (
            "removed"
            if to is None
            else f"kept as {to} (later steps share its bytes; freed with the last of them)"
            if sharing.is_held(to)
            else f"moved to {to}"
        )
        log.warning(
            "step %d in %s was damaged; %s %s before saving it again", step, self.directory, name, where
        )

    def found_damaged(self, step: int, error: Exception) -> None:
        """A restore (agreed by every process) found committed ``step`` damaged: it is no step of the
        run any more (a save of its number writes it again, its folder set aside: ``new_folder``), and
        the run's saves neither build on it nor share what it names (native/damage.py)."""
        with self._mutex:
            folder = self._folders.pop(step, None)
            self._metrics.pop(step, None)
            if folder is None:
                return
            self._damaged[step] = (error, folder)
            self._found.add(step)
        damage.damaged(self.layout, self.storage, folder.name)

    def add(self, step: int, name: str, metrics: dict[str, Any] | None) -> None:
        """Records ``step``, just committed (by this manager) as folder ``name`` in the run's layout."""
        with self._mutex:
            self._metrics[step] = metrics
            self._folders[step] = layouts.StepFolder(step, name, self.layout)
            self._written.add(step)

    def resumed(self, step: int) -> None:
        """A restore of ``step`` resumed the run this directory holds: its steps up to ``step`` count as
        this manager's own, so retention deletes them without the warning about other runs' steps."""
        with self._mutex:
            self._written.update(s for s in self._folders if s <= step)

    def retain(self, retention: Retention) -> None:
        """Deletes the steps ``retention`` removes (every process drops them; process 0 deletes the
        folders), each format's steps apart (retention.py). Every committed step of the directory counts,
        also those this manager did not write (an earlier run's, an Orbax job's); the first time some of
        those go, a warning names them and the option that keeps them."""
        with self._mutex:
            # steps a restore found damaged count too: retention deletes them as it would have them
            found = {s: f for s, (_, f) in self._damaged.items() if s in self._found}
            folders = {**found, **self._folders}
            formats = {s: f.layout.name for s, f in folders.items()}
            metrics = {**{s: None for s in found}, **self._metrics}
        doomed = retention.doomed(metrics, formats)  # each format's steps apart
        lead = distributed.process_index() == 0
        gone = [folders[s].name for s in doomed if s in folders]
        # what the kept steps refer to (native/sharing.py): those steps are retired, not removed
        sweeps = lead and (self.storage.supports_rename or (self.layout.shares and doomed))
        entries = self.storage.list() if lead and (doomed or sweeps) else None
        refs = sharing.referenced(self.storage, gone, entries) if lead and doomed else None
        others = [s for s in doomed if s not in self._written and s not in found]
        retired = False
        for step in doomed:
            with self._mutex:
                folder = self._folders.pop(step, None)
                self._metrics.pop(step, None)
                if step in found:
                    folder = self._damaged.pop(step)[1]
                    self._found.discard(step)
                self._written.discard(step)  # what a long run keeps stays as many as its steps
            if folder is not None and lead:
                recycler = (
                    self.recycler if folder.layout.recycles else None
                )  # its data files: the next save's
                salvage = recycler.retire if recycler is not None else None
                if folder.layout.shares:
                    retired |= sharing.remove_step(
                        self.storage, folder.name, folder.layout.record, refs=refs, salvage=salvage
                    )
                else:
                    commit_mod.remove(self.storage, folder.name, folder.layout.record, salvage=salvage)
            log.info("retention removed step %d from %s", step, self.directory)
        if sweeps:  # retired folders (holds) that no kept step refers to any more. On a local folder
            # each doomed step is gone or retired now, so the kept steps' references and (unless one was
            # retired just now) the listing above still hold; an object store's sweep reads both again
            local = self.storage.supports_rename
            sharing.sweep(self.storage, refs if local else None, entries if local and not retired else None)
        if others and not self._retention_warned and distributed.process_index() == 0:
            self._retention_warned = True
            log.warning(
                "retention (max_to_keep=%d) deleted step%s %s of %s, which this manager did not write (%s there "
                "when it opened, e.g. an earlier run's or an Orbax job's, and it did not resume from them): a "
                "manager's retention covers every step "
                "in its directory. To keep them, pass max_to_keep=None (keeps every step)%s, or give this run a "
                "directory of its own. Said once per manager.",
                retention.max_to_keep,
                "s" if len(others) > 1 else "",
                ", ".join(map(str, others)),
                self.directory,
                "they were" if len(others) > 1 else "it was",
                ""
                if retention.keep_best
                else " or keep_best=N with best_metric=... (keeps the best N as well)",
            )
