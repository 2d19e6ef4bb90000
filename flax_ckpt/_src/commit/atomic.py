"""Atomic commit: a checkpoint becomes visible all at once, or not at all.

Scope: the one commit of every layout (native steps, Orbax steps and items, memory-tier copies), by
the storage's declared capability:
- rename (local file systems): write into ``<name><mark><nonce>/``, write the commit record last,
  fsync files and folders, rename to ``<name>``, fsync the parent. A crash leaves a temporary folder,
  never read, removed by the next manager.
- commit object (object stores, no rename): write data in place, then the commit record last, only if
  absent. Deletion removes the commit record first, so a half-deleted step is never read as committed.
Each layout names its commit record (native: manifest.json; Orbax: commit_success.txt; a memory
copy: its index). One process commits, after every process has written (commit/distributed.py arranges the
agreement). Also the atomic placement of a single file (``commit_file``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import uuid
from typing import Callable, Sequence

from flax_ckpt._src.errors import CheckpointExistsError, StorageError
from flax_ckpt._src.storage import Storage, fsync_dir

log = logging.getLogger(__name__)
TMP_MARK = ".tmp-"
DELETING_MARK = ".deleting-"
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax's own in-flight folders: never read, cleaned up alike
# The exact names made here (``<name>.tmp-<uuid4 hex>``: staging_name, commit_file, the memory tiers;
# ``<name>.deleting-<uuid4 hex>``: remove) and by Orbax (0.12.8: ``<name>.orbax-checkpoint-tmp``; older
# releases and orbax/write.py: ``<name>.orbax-checkpoint-tmp-<timestamp>``). Nothing else is temporary:
# a user's ``config.yaml.tmp-1`` or ``eval.orbax-checkpoint-tmp-results`` is never read nor removed.
_TEMPORARY = re.compile(
    r"(.+?)(?:\.tmp-[0-9a-f]{32}|\.deleting-[0-9a-f]{32}|\.orbax-checkpoint-tmp(?:-[0-9]+)?)"
)


def step_number(name: str) -> int | None:
    """The step a folder name stands for: ASCII digits only ("²", "٣" or "𝟑" name no step), else None."""
    return int(name) if name.isascii() and name.isdigit() else None


def is_temporary(entry: str) -> bool:
    """Names of in-flight saves and interrupted deletions, exactly as they are made: never
    checkpoints, never read. A manager removes those of its run's steps (layouts.step_folders)."""
    return _TEMPORARY.fullmatch(entry) is not None


def is_committed(parent: Storage, name: str, record: str) -> bool:
    """Whether ``parent/name`` holds its commit ``record`` (native: manifest.json)."""
    return parent.sub(name).exists(record)


def base_name(entry: str) -> str:
    """The name a temporary folder stands for ("7" for "7.tmp-<hex>" or "7.orbax-checkpoint-tmp-123");
    any other name unchanged."""
    m = _TEMPORARY.fullmatch(entry)
    return entry if m is None else m.group(1)


def staging_name(
    parent: Storage, name: str, *, record: str, mark: str = TMP_MARK, nonce: str | None = None
) -> str:
    """Where a save of ``name`` writes before commit; refuses a name that is already taken (a folder
    holding the commit ``record``, or on a file system any folder that is not empty)."""
    if parent.sub(name).exists(record):
        raise CheckpointExistsError(
            f"{parent.url}/{name} is a committed checkpoint; checkpoints are never "
            "overwritten (save to a new path or delete it first)"
        )
    if not parent.supports_rename:
        return name
    if parent.sub(name).list():
        raise CheckpointExistsError(
            f"{parent.url}/{name} exists and is not a committed checkpoint; "
            "remove it or save elsewhere (checkpoints are never overwritten)"
        )
    return f"{name}{mark}{nonce or uuid.uuid4().hex}"


def commit(
    parent: Storage,
    staging: str,
    name: str,
    record: str,
    data: bytes,
    before: Sequence[tuple[str, bytes]] = (),
) -> None:
    """Makes ``staging`` visible as ``name`` atomically: writes the files ``before``, then the commit
    ``record`` (on an object store only if absent: a commit that appeared meanwhile is not replaced),
    then, on a file system, fsyncs and renames."""
    folder = parent.sub(staging)
    for n, d in before:
        folder.write(n, [d])
    if not parent.supports_rename:
        if not folder.write_if_absent(record, data):
            raise CheckpointExistsError(
                f"{parent.url}/{name} was committed by another writer while this save "
                "ran; not overwritten (its data objects may mix both saves: delete it "
                "and save again)"
            )
        return
    folder.write(record, [data])
    parent.sync(staging)
    try:
        parent.rename(staging, name)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise CheckpointExistsError(
                f"{parent.url}/{name} appeared while saving; not overwritten "
                f"(the new data stays in {staging} until cleaned up)"
            ) from e
        raise
    parent.sync(tree=False)


def abort(parent: Storage, staging: str, record: str) -> None:
    """Removes what an uncommitted save wrote (never a committed checkpoint)."""
    if parent.supports_rename:
        if is_temporary(staging):
            parent.delete(staging)
        return
    try:
        if not parent.sub(staging).exists(record):
            parent.delete(staging)
    except StorageError as e:  # the store is failing: what is left is uncommitted, so never read
        log.warning(
            "could not remove the uncommitted %s/%s (a manager removes it when it next starts): %s",
            parent.url,
            staging,
            e,
        )


def remove(parent: Storage, name: str, record: str, *, salvage: Callable[[str], None] | None = None) -> None:
    """Deletes a committed checkpoint, un-committing it first (atomically) so it is never half-read.
    ``salvage`` (file systems): called with the un-committed folder's path before it is deleted, to
    take files out of it (the memory tiers keep a data file's pages for the next copy)."""
    if parent.supports_rename:
        gone = f"{name}{DELETING_MARK}{uuid.uuid4().hex}"
        parent.rename(name, gone)
        parent.sync(tree=False)
        assert parent.local_path is not None, "a storage that renames is a local folder"
        path = os.path.join(parent.local_path, gone)
        if not _real_folder(path, f"{parent.url.rstrip('/')}/{name}"):
            os.unlink(path)  # a link (or a file) in the run's place: removed as such, never followed
            return
        if salvage is not None:
            salvage(path)
        parent.delete(gone)  # storage.delete: a link inside is unlinked, never followed (shutil.rmtree)
    else:
        parent.sub(name).delete(record)
        parent.delete(name)


def _real_folder(path: str, shown: str) -> bool:
    """Whether ``path`` (a step just un-committed) is a folder of its own, not a symbolic link to one
    elsewhere: a link is removed as a link, its target left as it is (with a warning naming both)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        return True
    target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    log.warning(
        "%s was %s; removed it as such, without reading, moving or deleting anything it points to%s",
        shown,
        f"a symbolic link to {target}" if target is not None else "not a folder",
        f" ({target} is left as it was: delete it yourself if it is no longer needed)" if target else "",
    )
    return False


def commit_file(folder: Storage, name: str, write: Callable[[str], None], *, replace: bool) -> None:
    """Places one file atomically in a local folder: ``write(path)`` fills a temporary file, which is
    fsynced and then renamed over ``name`` (``replace``) or linked to it (refusing an existing one:
    CheckpointExistsError). A crash leaves at most the temporary file."""
    if folder.local_path is None:
        raise StorageError(f"{folder.url}: single files are placed on local file systems only")
    path = os.path.join(folder.local_path, *name.split("/"))
    tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex}"
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise CheckpointExistsError(f"{path} appeared meanwhile; not overwritten") from None
        fsync_dir(os.path.dirname(path))
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
