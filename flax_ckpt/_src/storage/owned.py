"""Files that flax_ckpt created and may write over, map or delete: the one check, and the one open.

Scope: whether a file is one this user created and nothing else reaches, and opening it so. Such a
file is a regular file (not a symlink, FIFO, socket or device), has exactly one name (a second hard
link, e.g. a ``cp -al`` backup, is another path to the same bytes, perhaps outside our folder: writing
the file would change it there too), is owned by this user and, where asked (``private``), writable
by nobody else. It is opened without following a symlink and without blocking on a FIFO, then checked
on the open descriptor (fstat), so what is checked is what is used. Which folder a file lies in is the
caller's: one it opened by descriptor (``dir_fd``), or one it checked with lstat. Users: the recycled
files of a run directory (commit/recycler.py) and the memory tiers' files (tiers/files.py). Not here:
what the files hold, where folders are checked (tiers/files.py, the compilation cache), the
directory lock (lock.py).
"""

from __future__ import annotations

import errno
import os
import stat

# Never through a symlink, never blocking (a FIFO), never inherited by a child process.
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotOwnFile(OSError):
    """A file that is not one this user created (see the module's docstring): ``problem`` says why.
    An OSError, so that code treating any OSError as "no such file to reuse" treats it so too."""

    def __init__(self, path: str, problem: str):
        super().__init__(errno.EPERM, problem, path)
        self.problem = problem


def kind(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    return (
        "a symbolic link"
        if stat.S_ISLNK(mode)
        else "a folder"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )


def who(uid: int) -> str:
    """``uid`` with its account name where there is one, for a message."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def file_problem(st: os.stat_result, *, private: bool = False) -> str | None:
    """Why ``st`` (an lstat or fstat) is not a file this user created and nothing else reaches, or None.
    ``private``: a file writable by group or others is refused too."""
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return f"is {kind(st.st_mode)}, not a regular file (mode {stat.filemode(st.st_mode)})"
    if st.st_nlink != 1:
        return (
            f"has {st.st_nlink} names (hard links): another name may lie outside this folder (a `cp -al` "
            "backup, say), and writing the file would change it there too"
        )
    if st.st_uid != me:
        return f"is owned by {who(st.st_uid)}, not by this user ({who(me)}); mode {mode:#o}"
    if private and mode & 0o022:
        return f"is writable by group or others (mode {mode:#o}, owner {who(st.st_uid)})"
    return None


def folder_problem(st: os.stat_result) -> str | None:
    """Why ``st`` (an lstat) is not a folder this user owns and nobody else can write (a symlink, a
    file, another user's folder, one writable by group or others), or None. The memory tiers' folders
    and the compilation cache's are checked so."""
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link, not a folder; links are never followed"
    if not stat.S_ISDIR(st.st_mode):
        return f"is not a folder (mode {stat.filemode(st.st_mode)})"
    if st.st_uid != me:
        return f"is owned by {who(st.st_uid)}, not by this user ({who(me)}); mode {mode:#o}"
    if mode & 0o022:
        return f"is writable by group or others (mode {mode:#o}, owner {who(st.st_uid)})"
    return None


def open_own(
    path: str,
    flags: int,
    *,
    dir_fd: int | None = None,
    private: bool = False,
    expect: tuple[int, int] | None = None,
) -> tuple[int, os.stat_result]:
    """Opens ``path`` (relative to ``dir_fd`` where given) with ``flags`` (never O_CREAT), without
    following a symlink or blocking on a FIFO, and checks the open file (``file_problem``; ``expect``:
    the (st_dev, st_ino) it must be). Returns (fd, its fstat); the fd blocks as usual and is closed on
    exec. Raises NotOwnFile naming ``path`` and the problem, or the OSError of the open."""
    try:
        fd = os.open(path, flags | OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise NotOwnFile(path, "is a symbolic link; links are never followed") from None
        raise
    try:
        st = os.fstat(fd)
        problem = file_problem(st, private=private)
        if problem is None and expect is not None and (st.st_dev, st.st_ino) != expect:
            problem = "is not the file put there (another file took its name)"
        if problem is not None:
            raise NotOwnFile(path, problem)
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


__all__ = ["NotOwnFile", "OPEN_FLAGS", "file_problem", "folder_problem", "kind", "open_own", "who"]
