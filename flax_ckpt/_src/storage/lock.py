"""The directory lock: at most one live writer (a CheckpointManager, ``flax-ckpt prune``) per local folder.

Scope: an flock on ``<dir>/.flax_ckpt.lock``, exclusive across processes and managers and released by
the OS when its holder dies (a crashed run never leaves it held). ``tidy``: the file is removed again
at release when this lock created it, so that a directory of another format (an Orbax run) is left as
it was found. A lock file can thus disappear while someone waits to open it: acquiring checks that
the locked file is still the one at the path, and retries otherwise, so two holders never coexist.
Object stores have no lock (their managers rely on one process per job writing).
"""

from __future__ import annotations

import fcntl
import os

from flax_ckpt._src.errors import CheckpointLockedError

LOCK_FILE = ".flax_ckpt.lock"


class DirectoryLock:
    """An flock on ``<directory>/.flax_ckpt.lock`` (CheckpointLockedError when a live holder has it)."""

    def __init__(self, directory: str, *, tidy: bool = False):
        self.path, self.created = os.path.join(directory, LOCK_FILE), False
        while True:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self.created = tidy
            except FileExistsError:
                try:
                    self.fd = os.open(self.path, os.O_RDWR)
                except FileNotFoundError:
                    continue  # removed by a tidy holder between the two opens
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(self.fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(self.fd)
                raise CheckpointLockedError(
                    f"{directory} is in use by another CheckpointManager ({holder}); close it first. "
                    "A lock held by a process that died is released by the OS.") from None
            if self._still_at_path():
                break
            os.close(self.fd)  # a tidy holder removed the file we locked: lock the one there now
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)

    def _still_at_path(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self.fd >= 0:
            if self.created:
                try:
                    os.unlink(self.path)  # while still held: a waiter then finds no file or a new one
                except FileNotFoundError:
                    pass
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


__all__ = ["DirectoryLock", "LOCK_FILE"]
