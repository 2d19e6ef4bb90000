"""Atomic commit: a checkpoint becomes visible all at once, or not at all.

Two protocols behind one small interface, chosen by the storage:
- rename (local file systems): write into ``<name>.tmp-<uuid>/``, fsync files and folders, write the
  manifest, fsync, rename to ``<name>``, fsync the parent. A crash leaves a tmp folder, never read.
- commit object (object stores, no rename): write data in place, then the manifest last; it is the
  commit record. Deletion removes the manifest first, so a half-deleted step is never read as committed.
One process commits, after every process has written (distributed.py arranges the agreement).
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from typing import Callable

from flax_ckpt._src.errors import CheckpointExistsError, StorageError
from flax_ckpt._src.format import MANIFEST
from flax_ckpt._src.storage import LocalStorage, Storage, fsync_dir

log = logging.getLogger(__name__)
TMP_MARK = ".tmp-"
DELETING_MARK = ".deleting-"


def is_temporary(entry: str) -> bool:
    """Names of in-flight saves and interrupted deletions: never checkpoints, removable by a manager."""
    return TMP_MARK in entry or DELETING_MARK in entry


def is_committed(parent: Storage, name: str) -> bool:
    return parent.sub(name).exists(MANIFEST)


def staging_name(parent: Storage, name: str, nonce: str | None = None) -> str:
    """Where a save of ``name`` writes before commit; refuses a name that is already taken."""
    if is_committed(parent, name):
        raise CheckpointExistsError(f"{parent.url}/{name} is a committed checkpoint; checkpoints are never "
                                    "overwritten (save to a new path or delete it first)")
    if not parent.supports_rename:
        return name
    if isinstance(parent, LocalStorage) and parent.sub(name).list():
        raise CheckpointExistsError(f"{parent.url}/{name} exists and is not a committed checkpoint; "
                                    "remove it or save elsewhere")
    return f"{name}{TMP_MARK}{nonce or uuid.uuid4().hex}"


def commit(parent: Storage, staging: str, name: str, manifest: bytes) -> None:
    """Writes the manifest and makes ``staging`` visible as ``name`` atomically."""
    step = parent.sub(staging)
    if not parent.supports_rename:
        _commit_object(parent, step, name, manifest)
        return
    step.write(MANIFEST, [manifest])
    rename_into_place(parent, staging, name)


def rename_into_place(parent: Storage, staging: str, name: str) -> None:
    """fsyncs ``staging``'s folders, renames it to ``name`` (refusing an existing one), fsyncs the parent."""
    assert isinstance(parent, LocalStorage)
    parent.fsync_tree(staging)
    try:
        parent.rename(staging, name)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise CheckpointExistsError(f"{parent.url}/{name} appeared while saving; not overwritten "
                                        f"(the new data stays in {staging} until cleaned up)") from e
        raise
    fsync_dir(parent.root)


def abort(parent: Storage, staging: str) -> None:
    """Removes what an uncommitted save wrote (never a committed checkpoint)."""
    if parent.supports_rename and not is_temporary(staging):
        return
    if not parent.supports_rename:
        try:
            if not is_committed(parent, staging):
                parent.delete(staging)
        except StorageError as e:  # the store is failing: what is left is uncommitted, so never read
            log.warning("could not remove the uncommitted %s/%s (a manager removes it when it "
                        "next starts): %s", parent.url, staging, e)
        return
    parent.delete(staging)


def _commit_object(parent: Storage, step: Storage, name: str, manifest: bytes) -> None:
    """Object stores: every data object is written; the manifest, written once and last, commits.
    Written only if absent, so a commit that appeared meanwhile (another writer) is not replaced."""
    write_if_absent = getattr(step, "write_if_absent", None)
    if write_if_absent is None:
        step.write(MANIFEST, [manifest])
    elif not write_if_absent(MANIFEST, manifest):
        raise CheckpointExistsError(f"{parent.url}/{name} was committed by another writer while this save "
                                    "ran; not overwritten (its data objects may mix both saves: delete it "
                                    "and save again)")


def remove(parent: Storage, name: str, *, salvage: Callable[[str], None] | None = None) -> None:
    """Deletes a committed checkpoint, un-committing it first (atomically) so it is never half-read.
    ``salvage`` (local file systems): called with the un-committed folder's path before it is deleted,
    to take files out of it (the memory tiers keep a data file's pages for the next copy)."""
    if parent.supports_rename:
        assert isinstance(parent, LocalStorage)
        gone = f"{name}{DELETING_MARK}{uuid.uuid4().hex}"
        parent.rename(name, gone)
        fsync_dir(parent.root)
        if salvage is not None:
            salvage(os.path.join(parent.root, gone))
        parent.delete(gone)
    else:
        parent.sub(name).delete(MANIFEST)
        parent.delete(name)
