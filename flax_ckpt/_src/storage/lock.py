"""The directory lock: at most one live writer (a CheckpointManager, ``flax-ckpt prune``) per local folder.

Scope: an flock on ``<dir>/.flax_ckpt.lock``, exclusive across processes and managers and released by
the OS when its holder dies (a crashed run never leaves it held). ``tidy``: the file is removed again
at release when this lock created it, so that a directory of another format (an Orbax run) is left as
it was found. A lock file can thus disappear while someone waits to open it: acquiring checks that
the locked file is still the one at the path, and retries otherwise, so two holders never coexist.
Anyone who can write the directory can put something else at the lock's name: it is opened without
following links or blocking, and refused (StorageError naming it) unless it is this user's own regular
file with one link, so that nothing outside the directory is ever written through it.
Object stores have no lock (their managers rely on one process per job writing).
Without ``tidy`` (a native run) the lock file stays after release, on purpose: it holds nothing but the
last holder's pid and is ignored by the manager, ``ls`` and ``prune``; removing a file that another
opener may already hold open would let two processes lock two different files of one name (an older
flax_ckpt does not re-check the path), while a file that stays is one inode for every opener.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from flax_ckpt._src.errors import CheckpointLockedError, CheckpointNotFoundError, StorageError
from flax_ckpt._src.storage.owned import kind

LOCK_FILE = ".flax_ckpt.lock"
# Never through a link, never blocking (a FIFO), never inherited by a child process.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class DirectoryLock:
    """An flock on ``<directory>/.flax_ckpt.lock`` (CheckpointLockedError when a live holder has it).

    The lock file is opened without following links or blocking, and written (the holder's pid) only
    when it is this user's own regular file with one link: anything else at that name (a symlink, a
    FIFO, a folder, a hard link, another user's file) is a StorageError naming it, and is left as found."""

    def __init__(self, directory: str, *, tidy: bool = False):
        self.path, self.created, self.fd = os.path.join(directory, LOCK_FILE), False, -1
        self.pid = os.getpid()
        while True:
            created = False
            try:
                fd = os.open(self.path, _OPEN | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:
                try:
                    fd = os.open(self.path, _OPEN)
                except FileNotFoundError:
                    continue  # removed by a tidy holder between the two opens
                except OSError as e:
                    raise self._refused(e) from None
            except OSError as e:
                raise self._refused(e) from None
            try:
                self._check(os.fstat(fd))
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise CheckpointLockedError(
                    f"{directory} is in use by another CheckpointManager ({holder}); close it first. "
                    "A lock held by a process that died is released by the OS."
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if self._still_at_path(fd):
                break
            os.close(fd)  # a tidy holder removed the file we locked: lock the one there now
        self.fd, self.created, self.pid = fd, created and tidy, os.getpid()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)

    def _check(self, st: os.stat_result) -> None:
        """Refuses an open lock file that is not this user's own regular file with one link."""
        if not stat.S_ISREG(st.st_mode):
            raise self._error(f"is {kind(st.st_mode)}")
        if st.st_nlink != 1:
            raise self._error(
                f"is a hard link ({st.st_nlink} names for one file, perhaps one outside the directory)"
            )
        if st.st_uid != os.geteuid():
            raise self._error(
                f"belongs to another user (uid {st.st_uid}; this process runs as uid {os.geteuid()})"
            )

    def _refused(self, e: OSError) -> Exception:
        """The error for a lock file that could not be opened (``e``), saying what is at its name."""
        try:
            st = os.lstat(self.path)
        except OSError:
            st = None
        if st is None:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return CheckpointNotFoundError(
                    f"{os.path.dirname(self.path)} is not a folder; no lock can be taken there"
                )
            return StorageError(
                f"{self.path}: the directory's lock file cannot be created ({e.strerror or e}); "
                "a CheckpointManager (and flax-ckpt prune) needs a directory it can write"
            )
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(self.path)
            except OSError:
                target = "?"
            return self._error(f"is a symbolic link (to {target})")
        if not stat.S_ISREG(st.st_mode):
            return self._error(f"is {kind(st.st_mode)}")
        owner = f", belongs to uid {st.st_uid}" if st.st_uid != os.geteuid() else ""
        return self._error(f"cannot be opened ({e.strerror or e}{owner})")

    def _error(self, found: str) -> StorageError:
        return StorageError(
            f"{self.path} {found}: the directory's lock file must be a regular file of this user, so it was "
            f"left untouched and nothing was written there. Remove it (rm {self.path!r}; it holds no data) "
            "and open the directory again"
        )

    def _still_at_path(self, fd: int) -> bool:
        try:
            here, mine = os.lstat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def release(
        self, _unlink=os.unlink, _flock=fcntl.flock, _close=os.close, _un=fcntl.LOCK_UN, _pid=os.getpid
    ) -> None:
        """Unlocks (removing a ``tidy`` lock's own file first). The calls are bound at import: a manager
        nobody closed may release in interpreter teardown, when this module's globals are None. In a
        child forked from the holder, only the child's copy of the descriptor is closed: the flock
        belongs to the open file both share, and unlocking it would free the parent's live directory."""
        if self.fd >= 0 and _pid() != self.pid:
            _close(self.fd)
            self.fd = -1
        if self.fd >= 0:
            if self.created:
                try:
                    _unlink(self.path)  # while still held: a waiter then finds no file or a new one
                except FileNotFoundError:
                    pass
            _flock(self.fd, _un)
            _close(self.fd)
            self.fd = -1


__all__ = ["DirectoryLock", "LOCK_FILE"]
