"""``flax-ckpt verify``: re-read every stored byte of a checkpoint, or of every step of a run, and check
every checksum.

Scope: asking a checkpoint's Source to verify itself (``Source.verify``: a native checkpoint chunk by
chunk through its serializer, so one damaged leaf or file never hides another; an Orbax checkpoint
leaf by leaf, tensorstore checking what Orbax's codecs checksum) and which leaves carry no checksum
(``Source.unchecked``: Orbax's zarr v2 and zstd-compressed zarr3 data, strings, JSON items), reported
as unverified, never as sound. A run directory (layouts.step_folders) has each committed step
verified. How a format stores its bytes is its own (native/, orbax/), never this module's.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from flax_ckpt._src import layouts
from flax_ckpt._src.errors import (
    CheckpointError,
    CheckpointNotCommittedError,
    CorruptCheckpointError,
    InvalidManifestError,
)
from flax_ckpt._src.native import sharing
from flax_ckpt._src.storage import Storage
from flax_ckpt._src.tools.common import bar, folder_of, identity, is_empty_run

_READ_ERRORS = (CheckpointError, OSError, ValueError)


@dataclass(frozen=True)
class Problem:
    """One piece of damage: ``leaf`` (key path) and ``file`` (relative to the checkpoint) where known;
    ``step`` when a run directory was verified."""

    leaf: str | None
    file: str | None
    message: str
    step: int | None = None


@dataclass(frozen=True)
class Report:
    """What ``check`` found. ``problems``: damage (empty: nothing damaged was found). ``unverified``:
    leaves read back whose bytes carry no checksum ("<step>/<key path>" in a run), so damage there
    cannot be seen; ``leaves``: how many leaves were checked. ``steps``: the steps verified in a run
    directory (None for one checkpoint); ``skipped``: step folders of a run that hold no committed
    checkpoint. ``linked``: files of a local checkpoint that have other hard links (relative paths,
    "<step folder>/<file>" in a run): the same bytes under another name, maybe outside the checkpoint,
    where a write changes the checkpoint too. Not damage (``cp -al`` backups make them), so reported
    only; restores read such files as any other. ``gone``: steps of a run deleted (or replaced) while
    they were read, e.g. by a live manager's retention: not damage, and not counted in ``steps``."""

    problems: list[Problem]
    unverified: list[str]
    leaves: int
    steps: list[int] | None = None
    skipped: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)

    @property
    def sound(self) -> bool:
        """Nothing damaged and every leaf proven by a checksum."""
        return not self.problems and not self.unverified


def verify(path: Any, *, progress: bool = False) -> list[Problem]:
    """Re-reads every stored byte of ``path`` (a checkpoint, or every step of a run directory) and
    checks every checksum; returns what is damaged. An empty list means nothing damaged was found;
    ``check`` also says which leaves carry no checksum to check."""
    return check(path, progress=progress).problems


def check(path: Any, *, progress: bool = False) -> Report:
    """``verify`` with the whole report. A damaged manifest is one problem (nothing it names can be
    trusted). Raises CheckpointNotFoundError or CheckpointNotCommittedError when there is no committed
    checkpoint to verify (a folder that is neither a checkpoint nor a run directory)."""
    folder = folder_of(path)
    if layouts.recognize(folder) is None:  # no checkpoint's files: maybe a run directory
        steps, temporary = layouts.step_folders(folder, files=True)
        if steps or is_empty_run(folder, temporary):
            return _check_run(folder, steps, progress)
    return dataclasses.replace(_check_one(folder, progress), linked=hard_links(folder))


def _check_one(folder: Storage, progress: bool, fmt: layouts.Layout | None = None) -> Report:
    fmt = fmt or layouts.detect(folder)  # a run's step: its StepFolder's layout, which checks the step
    try:
        source = fmt.open(folder)
    except (InvalidManifestError, CorruptCheckpointError) as e:
        return Report([Problem(None, fmt.manifest, str(e))], [], 0)
    except _READ_ERRORS as e:
        if not fmt.evident:  # maybe no committed checkpoint there: CheckpointNotFoundError and the like
            raise
        return Report([Problem(None, None, str(e))], [], 0)
    checked = sum(1 for leaf in source.leaves if leaf.kind != "empty")
    unchecked = source.unchecked()
    with bar(sum(leaf.nbytes for leaf in source.leaves if leaf.is_array), "verify", progress) as b:
        damage = source.verify(b.update)
    return Report([Problem(*d) for d in damage], unchecked, checked)


def _check_run(root: Storage, steps: list[layouts.StepFolder], progress: bool) -> Report:
    problems, unverified, verified, skipped, leaves, linked, gone = [], [], [], [], 0, [], []
    for f in steps:
        ambiguous = f.ambiguity(root.url)
        if ambiguous is not None:  # several folders name this step: none is verified as it
            problems.append(Problem(None, f.name, ambiguous, f.step))
            continue
        try:
            r = _check_step(root, f, progress)
        except CheckpointNotCommittedError:
            if not sharing.only_held(root, f.name):  # a retired step's objects (object stores) are no step
                skipped.append(f.name)
            continue
        if r is None:
            gone.append(f.step)
            continue
        verified.append(f.step)
        leaves += r.leaves
        problems += [Problem(p.leaf, p.file, p.message, f.step) for p in r.problems]
        unverified += [f"{f.name}/{k}" for k in r.unverified]
        linked += [f"{f.name}/{k}" for k in hard_links(root.sub(f.name))]
    return Report(problems, unverified, leaves, verified, skipped, linked, gone)


def _check_step(root: Storage, f: layouts.StepFolder, progress: bool, tries: int = 3) -> Report | None:
    """One step of a run, checked while it stays the same folder (``identity``): damage, or a failure
    to open it, counts only if the step was there, unchanged, from before the read to after it. A step
    deleted meanwhile (a live manager's retention) is None; one replaced meanwhile is checked again."""
    folder = root.sub(f.name)
    for _ in range(tries):
        before = identity(folder, f.layout.record)
        if before is None:
            return None
        try:
            r = _check_one(folder, progress, f.layout)
        except CheckpointNotCommittedError:
            raise
        except _READ_ERRORS:
            if identity(folder, f.layout.record) == before:
                raise
            continue
        if not r.problems or identity(folder, f.layout.record) == before:
            return r
    return None  # changed under every read: a step being rewritten over and over, never seen whole


def hard_links(folder: Storage) -> list[str]:
    """The regular files under a local checkpoint folder that have more than one hard link (relative
    paths, sorted); [] on object stores. Symlinks are not followed (restores refuse those leading out)."""
    if folder.local_path is None:
        return []
    found = []
    for dirpath, _, filenames in os.walk(folder.local_path):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # removed meanwhile
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                found.append(os.path.relpath(path, folder.local_path))
    return sorted(found)
