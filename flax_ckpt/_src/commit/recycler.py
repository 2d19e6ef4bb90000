"""Data files of a removed step, kept for the next save to write over (local file systems).

Scope: ``Recycler``, which a manager's retention hands the data files of the step it removes (the
``salvage`` of atomic.remove), and which LocalStorage.write takes a recycled file from (given to it as
its ``recycler``: storage imports nothing of this). Not here: which steps are removed (manager/steps.py), the
un-commit before (atomic.remove), the write itself (storage/local.py).

Writing over a file costs a file system less than creating one and deleting another (no block
allocation, freeing or discards; benchmarks/README.md, "Figures from the module docstrings"). A
manager saving often with
``max_to_keep`` removes one step at each save; its data files become the next save's.

Safety: the files are moved (renamed, never copied) from the un-committed folder of the removed step,
reached without following a symbolic link (a step folder or ``data/`` that is a link to a folder
elsewhere is never taken from: commit/atomic.py removes it as a link), into one private folder of the run's directory, named as an interrupted deletion
(``<step>.deleting-<uuid hex>``), which the next manager to open the directory removes if a crash left
it; ``close`` removes it otherwise. A recycled file is taken only as the very file put there (device
and inode), a regular file of this user with one link, opened without following a symlink or blocking
on a FIFO (storage/owned.py, the check the memory tiers' files get too); it is written from its start
and truncated to its new size, so the new file holds only the bytes written to it. Only the
files of the step removed last are kept (at most one step's worth of disk, what a save needs anyway).
Any failure here makes the next file a new one, as without a recycler.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid

from flax_ckpt._src.commit.atomic import DELETING_MARK, base_name
from flax_ckpt._src.storage import owned

MIN_BYTES = 1 << 20  # files smaller than this are created as before


def _usable(st: os.stat_result) -> bool:
    return owned.file_problem(st) is None and st.st_size >= MIN_BYTES


class Recycler:
    """The recycled files: the data files of the step a manager's retention removed last, kept in
    ``directory``'s private folder for LocalStorage.write to write over (see the module's docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._mutex = threading.Lock()
        self._fd: int | None = None  # their folder, opened once: never reached through a path again
        self._folder: str | None = None
        self._files: dict[str, tuple[int, int, int]] = {}  # name there -> (st_dev, st_ino, st_size)
        self._count = 0

    def retire(self, gone: str) -> None:
        """Keeps the data files of ``gone`` (a removed step's un-committed folder, about to be deleted),
        in place of those kept before."""
        data = _open_folder(gone)  # never through a link: a linked step or data/ keeps its files
        if data is None:
            return
        try:
            self._take_from(data, os.path.basename(gone))
        finally:
            os.close(data)

    def _take_from(self, data: int, retired: str) -> None:
        """Moves the usable data files of the folder ``data`` (a descriptor) into the private folder."""
        try:
            names = sorted(n for n in os.listdir(data) if n.endswith(".bin"))
        except OSError:
            return
        with self._mutex:
            self._clear()
            for name in names:
                try:
                    st = os.stat(name, dir_fd=data, follow_symlinks=False)
                    if not _usable(st):
                        continue
                    if self._fd is None:
                        self._make(retired)
                    key = f"{self._count}.bin"
                    self._count += 1
                    os.rename(name, key, src_dir_fd=data, dst_dir_fd=self._fd)
                    self._files[key] = (st.st_dev, st.st_ino, st.st_size)
                except OSError:
                    self._forget()
                    return

    def take(self, path: str, size: int, flags: int) -> int | None:
        """An fd, opened with ``flags`` (O_WRONLY and the like, never O_CREAT), of a recycled file moved to
        ``path`` (a new file's place in a staging folder): the smallest recycled file of at least ``size``
        bytes, else the largest. None when there is none, or when the file there is not the one kept (it is
        removed from ``path``): the caller then creates ``path``. The caller truncates it to its size."""
        if size < MIN_BYTES:
            return None
        with self._mutex:
            if not self._files:
                return None
            fits = [k for k, f in self._files.items() if f[2] >= size]
            key = (
                min(fits, key=lambda k: self._files[k][2])
                if fits
                else max(self._files, key=lambda k: self._files[k][2])
            )
            dev, ino, _ = self._files.pop(key)
            try:
                st = os.stat(key, dir_fd=self._fd, follow_symlinks=False)
                if not _usable(st) or (st.st_dev, st.st_ino) != (dev, ino):
                    _remove(key, self._fd)
                    return None
                os.rename(key, path, src_dir_fd=self._fd)
            except OSError:
                return None
        try:  # this very file, still ours alone (storage/owned.py); anything else there is removed
            fd, st = owned.open_own(path, flags, expect=(dev, ino))
        except OSError:
            _remove(path, None)
            return None
        if st.st_size < MIN_BYTES:
            os.close(fd)
            _remove(path, None)
            return None
        return fd

    def close(self) -> None:
        """Deletes the recycled files and their folder."""
        with self._mutex:
            self._forget()

    def _make(self, retired: str) -> None:
        name = f"{base_name(retired)}{DELETING_MARK}{uuid.uuid4().hex}"
        os.mkdir(os.path.join(self.directory, name), 0o700)
        self._fd = os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        self._folder = name

    def _clear(self) -> None:
        for key in self._files:
            _remove(key, self._fd)
        self._files.clear()

    def _forget(self) -> None:
        """Deletes every recycled file and the folder; the next retire makes a new one."""
        if self._fd is None:
            return
        assert self._folder is not None, "the folder is set with its descriptor"
        self._clear()
        os.close(self._fd)
        self._fd = None
        try:
            os.rmdir(os.path.join(self.directory, self._folder))
        except OSError:
            pass
        self._folder = None


def _open_folder(gone: str) -> int | None:
    """A descriptor of ``gone/data``, each opened without following a symbolic link (a step folder or
    data folder that is a link reaches files outside the run: those are never moved); None if either
    is not a folder of its own."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        step = os.open(gone, flags)
    except OSError:
        return None
    try:
        return os.open("data", flags, dir_fd=step)
    except OSError:
        return None
    finally:
        os.close(step)


def _remove(name: str, dir_fd: int | None) -> None:
    """Removes ``name`` (a file, link or folder put where a recycled file was), never following a link."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except IsADirectoryError:
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
    except OSError:
        pass


__all__ = ["MIN_BYTES", "Recycler"]
