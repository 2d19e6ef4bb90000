"""The memory tiers' files in tmpfs: read maps, and data files written into reused pages.

Scope: mapping a copy's data file read-only (every map is registered, so that a file is never written
again while anything maps it: a restore hands such pages out as the restored arrays themselves),
writing a new data file through a shared map, into the pages of a retired one when there is one, and
retiring data files. Which copies exist, and what their bytes mean, is store.py's business.

Why reuse: in tmpfs, writing into pages that a file already has costs a memcpy; a new file's pages
must first be allocated and zeroed by the kernel, which here costs about three times the copy. So a
data file whose copy was removed by retention is kept (at most ``SpareFolder.keep`` of them per tier
folder, counting one that a snapshot still reads) and becomes the next copy's data file. A retired
file that some map still shows (a restored array made of its pages, a snapshot viewing a base) is
deleted instead: its pages stay with their readers and are freed with them. Pages are reserved with
posix_fallocate before they are mapped, so a full tmpfs is an OSError (ENOSPC) naming the file, never
a SIGBUS.

Ownership (a shared host's tmpfs is world-writable, and the job folder's name is computable by
anyone): every folder of the tiers is created with mode 0700 (``private_folder``) and checked with
lstat, never through a symlink; a folder or file owned by another user, writable by group or others,
or a symlink, is refused (StorageError naming it, its owner and mode, and the fix) before anything in
it is read, written into or reused. A file is used only while it has one name (storage/owned.py): a
second hard link (a user's `cp -al` backup, perhaps outside the tiers' folder) makes it neither read
nor reused, so the other name's bytes never change; a base is mapped when it is written, so a link
given it later does not stop the copies made against it. ``local_dir`` itself may also be a system
folder (owned by root, sticky, like /dev/shm).
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import crc32c
import numpy as np

from flax_ckpt._src.errors import CorruptCheckpointError, StorageError
from flax_ckpt._src.storage import owned
from flax_ckpt._src.storage.base import as_buffer
from flax_ckpt._src.storage.local import write_all

_lock = threading.RLock()  # orders map_read against SpareFolder.retire (check for maps, then move)
_readers: dict[tuple[int, int], list[weakref.ref]] = {}
_pool: ThreadPoolExecutor | None = None
_CPUS = os.cpu_count() or 1  # asked once: os.cpu_count() reads /sys at each call


def pool() -> ThreadPoolExecutor:
    """Threads for chunk work (checksums, comparisons, copies) shared by the memory tiers' encoding,
    writing and reading; its tasks never wait on each other."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(min(4, _CPUS), thread_name_prefix="flax_ckpt-tier")
        return _pool


# ------------------------------------------------------------------------------------- ownership


def _problem(path: str, st: os.stat_result, *, folder: bool, system_ok: bool = False) -> str | None:
    """Why ``st`` (an lstat of ``path``) is not this user's own folder (for a file: one this user
    created, with one name, writable by nobody else: storage/owned.py), or None."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        try:
            to = os.readlink(path)
        except OSError:
            to = "?"
        return f"is a symbolic link (to {to!r}), not a {'folder' if folder else 'file'}; links are never followed"
    if not folder:
        return owned.file_problem(st, private=True)
    if system_ok and stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and mode & stat.S_ISVTX:
        return None  # /dev/shm, /tmp: nobody replaces our entries
    return owned.folder_problem(st)


def _refuse(path: str, what: str, problem: str, *, folder: bool) -> StorageError:
    if folder:
        return StorageError(
            f"memory tiers: {what} {path} {problem}. Another local user could have "
            "planted checkpoints there, so nothing in it is read. Fix: remove it (as its "
            "owner, or root) and let flax_ckpt create it again (mode 0700), or set "
            "Tiers(local_dir=...) to a folder only you can write"
        )
    return StorageError(
        f"memory tiers: {what} {path} {problem}. It is neither read nor written: its bytes "
        "may not be this run's (another user could have planted it), and writing it could "
        "change a file outside the memory tiers. Fix: remove it (as its owner, or root; "
        "other names of it keep their bytes); the copy holding it is then saved again or "
        "ignored"
    )


def check_folder(path: str, what: str, *, system_ok: bool = False) -> None:
    """Refuses ``path`` (lstat: a symlink is refused, not followed) unless it is a folder owned by this
    user and not writable by group or others (``system_ok``: or root's sticky folder, like /dev/shm)."""
    problem = _problem(path, os.lstat(path), folder=True, system_ok=system_ok)
    if problem is not None:
        raise _refuse(path, what, problem, folder=True)


def private_folder(path: str, what: str, *, system_ok: bool = False) -> str:
    """Creates ``path`` with mode 0700 unless it exists (its parent must), then check_folder; returns it."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_folder(path, what, system_ok=system_ok)
    return path


def check_file(path: str, st: os.stat_result, what: str = "file") -> None:
    """Refuses a file (``st``: its lstat or fstat) not owned by this user, writable by others, or not
    a regular file (a symlink, a FIFO)."""
    problem = _problem(path, st, folder=False)
    if problem is not None:
        raise _refuse(path, what, problem, folder=False)


def open_own(path: str, what: str = "file", flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """Opens ``path`` with ``flags`` without following a symlink or blocking on a FIFO, and check_file's
    it on the open descriptor (storage/owned.py); returns (fd, its fstat)."""
    try:
        return owned.open_own(path, flags, private=True)
    except owned.NotOwnFile as e:
        try:
            problem = _problem(path, os.lstat(path), folder=False) or e.problem
        except OSError:
            problem = e.problem
        raise _refuse(path, what, problem, folder=False) from None


# ------------------------------------------------------------------------------------------ maps


def map_read(path: str, expect: tuple[int, int] | None = None) -> mmap.mmap | None:
    """A read-only shared map of ``path`` (None for an empty file), registered until it is freed.
    ``expect``: the (device, inode) the file had when its copy was opened (a replaced file is refused)."""
    with _lock:
        fd, st = open_own(path, "data file")
        try:
            if expect is not None and (st.st_dev, st.st_ino) != expect:
                raise CorruptCheckpointError(f"{path} was replaced since its copy was opened; not read")
            if st.st_size == 0:
                return None
            m = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        key = (st.st_dev, st.st_ino)
        _readers[key] = [r for r in _readers.get(key, []) if r() is not None] + [weakref.ref(m)]
        return m


def pin(key: tuple[int, int], holder: object) -> None:
    """Counts ``holder`` as a reader of the file ``key`` (device, inode) while it lives: a snapshot
    taken into a spare's pages, until its migration has read them. Such a file is never reused."""
    with _lock:
        _readers[key] = [r for r in _readers.get(key, []) if r() is not None] + [weakref.ref(holder)]


def _mapped(st: os.stat_result) -> bool:
    key = (st.st_dev, st.st_ino)
    alive = [r for r in _readers.get(key, []) if r() is not None]
    if alive:
        _readers[key] = alive
    else:
        _readers.pop(key, None)
    return bool(alive)


class SpareFolder:
    """Retired data files of one tier folder, kept for the next copies to write into. The shared map
    each file was written through is kept with it (mapping 256 MiB again costs about half a copy)."""

    def __init__(self, folder: str, keep: int = 1):
        self.folder, self.keep = folder, keep
        self._mutex = threading.Lock()
        self._maps: dict[tuple[int, int], mmap.mmap] = {}  # the files this writer mapped, by inode
        self._lent: Lent | None = None

    def _files(self) -> list[tuple[int, str, bool]]:
        """The spares, smallest first: (size, path, busy); busy while on loan, or while some map or
        snapshot still holds its pages (not written then, but counted: never more than ``keep`` spares).
        A file that is not this user's own with one name (storage/owned.py) is left out: never
        reused."""
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            path = os.path.join(self.folder, n)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if _problem(path, st, folder=False) is None:
                with _lock:
                    busy = _mapped(st) or (self._lent is not None and path == self._lent.path)
                out.append((st.st_size, path, busy))
        return sorted(out)

    def _free(self) -> list[tuple[int, str]]:
        """The spares a copy may write into now, smallest first: (size, path)."""
        return [(n, path) for n, path, busy in self._files() if not busy]

    def lend(self, size: int) -> "Lent | None":
        """The spare that the next copy's data file will be (at least ``size`` bytes, already mapped), for
        a snapshot to copy the state straight into its pages: that copy is then the only one (``write``
        finds those bytes in place). None when there is no such spare. One loan at a time; it ends with
        the ``write`` that is given it, or ``give_back``."""
        with self._mutex:
            if self._lent is not None:
                return None
            for n, path in self._free():
                if n < size:
                    continue
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                m = self._maps.get((st.st_dev, st.st_ino))
                if m is not None and len(m) == st.st_size:
                    self._lent = Lent(path, (st.st_dev, st.st_ino), m)
                    return self._lent
            return None

    def give_back(self, lent: "Lent | None") -> None:
        """Ends a loan that no ``write`` took (a failed snapshot): the file is a spare again."""
        with self._mutex:
            if lent is not None and self._lent is lent:
                self._lent = None

    def _drop(self, key: tuple[int, int]) -> None:
        m = self._maps.pop(key, None)
        try:
            if m is not None:
                m.close()
        except BufferError:  # a failed write's traceback still holds a view: unmapped when it goes
            pass

    def _remove(self, path: str, st: os.stat_result | None = None) -> None:
        st = st or os.lstat(path)
        self._drop((st.st_dev, st.st_ino))
        os.unlink(path)

    def retire(self, path: str) -> None:
        """``path`` (a data file no copy of the tier uses any more) becomes a spare, or is deleted if
        something maps it, if ``keep`` spares as large are kept (a larger file replaces the smallest
        spare: the next full copy then finds pages enough, not a differential copy's few), or if it is
        not this user's own file with one name (storage/owned.py: writing it could change a file
        elsewhere)."""
        with self._mutex, _lock:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return
            if self.keep < 1 or _mapped(st) or _problem(path, st, folder=False) is not None:
                self._remove(path, st)
                return
            files = self._files()
            lent = self._lent.path if self._lent is not None else None
            small = next((f for f in files if f[1] != lent), None)
            if len(files) >= self.keep and small is not None and small[0] < st.st_size:  # a busy one's pages
                self._remove(small[1])  # go with its readers
                files.remove(small)
            if len(files) >= self.keep:
                self._remove(path, st)
                return
            private_folder(self.folder, "spare folder")
            spare = os.path.join(self.folder, uuid.uuid4().hex)
            os.rename(path, spare)
            key = (st.st_dev, st.st_ino)
            if key not in self._maps and st.st_size:  # map it now, between saves, not in the next one
                try:
                    fd, _ = owned.open_own(spare, os.O_RDWR, private=True, expect=key)
                except owned.NotOwnFile:  # linked or replaced since the check: never written
                    self._remove(spare)
                    return
                try:
                    self._maps[key] = _map_shared(fd, st.st_size)
                finally:
                    os.close(fd)

    def write(
        self, path: str, pieces: Sequence[np.ndarray], checksum: Sequence[bool], lent: "Lent | None" = None
    ) -> list[int | None]:
        """Creates ``path`` holding ``pieces`` (uint8 arrays) back to back; returns the crc32c of each
        piece whose ``checksum`` is set, computed on the bytes as stored, right after copying them
        (still in cache). Into the spare whose size is closest above theirs (else the largest),
        through its map; without a spare, written to a new file (where a map would fault each new
        page in one by one, write() is about twice as fast). With ``lent`` (see ``lend``), into that
        spare, where pieces that are views of its map at their very place are not copied again; its
        size is kept (``pieces`` must then fill it)."""
        size = sum(len(p) for p in pieces)
        placed: set[int] = set()  # pieces already at their place in the lent map
        with self._mutex:
            if lent is not None:
                if self._lent is not lent:
                    raise RuntimeError(f"{lent.path}: not on loan from {self.folder}")
                self._lent = None
                placed = lent.placed(pieces, size)
                fit = (len(lent.map), lent.path)
            else:
                files = self._free()
                fit = next((f for f in files if f[0] >= size), files[-1] if files else None)
            if fit is not None:
                os.rename(fit[1], path)
        crcs: list[int | None] = [None] * len(pieces)
        fd, reused = self._open(path, fit is not None)
        if not reused:
            fit, placed = None, set()
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            if fit is not None and size == 0:
                with self._mutex:
                    self._drop(key)
                os.ftruncate(fd, 0)
            if fit is None or size == 0:
                _parts(pieces, lambda a, b: _checksum(pieces, checksum, crcs, a, b))
                _write_all(fd, path, pieces)
                return crcs
            m = self._maps.get(key)
            if m is None or len(m) != size:
                with self._mutex:
                    self._drop(key)
                m = _reserve(fd, size, path)
                with self._mutex:
                    self._maps[key] = m
        finally:
            os.close(fd)
        out = np.frombuffer(m, np.uint8)
        offs = np.cumsum([0] + [len(v) for v in pieces]).tolist()

        placed = placed if lent is not None and m is lent.map else set()
        todo = [j for j in range(len(pieces)) if (j not in placed and len(pieces[j])) or checksum[j]]

        def copy(a: int, b: int) -> None:
            for j in todo[a:b]:
                if j not in placed:
                    out[offs[j] : offs[j + 1]] = pieces[j]
                if checksum[j]:
                    crcs[j] = crc32c.crc32c(as_buffer(out[offs[j] : offs[j + 1]]))

        try:
            if todo:  # none when a snapshot copied and checksummed every piece in place: no threads woken
                _parts([pieces[j] for j in todo], copy)
        finally:
            del out
        return crcs

    def _open(self, path: str, reused: bool) -> tuple[int, bool]:
        """An fd to write ``path``: the spare just moved there (``reused``) if it is still this user's own
        file with one name (storage/owned.py), else a new file (the spare's name is removed then; other
        names keep their bytes). Returns (fd, whether it is the spare)."""
        if reused:
            try:
                return owned.open_own(path, os.O_RDWR, private=True)[0], True
            except owned.NotOwnFile:  # linked since it was listed: never written
                with self._mutex:
                    self._remove(path)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), False

    def prepare(self, size: int) -> None:
        """Makes sure a spare of at least ``size`` bytes exists, its pages allocated and mapped: done
        between saves (the writer's idle time), so the next copy writes into pages that exist. Never a
        second one: where a spare as large is still busy (a snapshot taken into its pages, not yet
        migrated), the next copy is written without one; a busy one too small is removed (its pages go
        with their readers)."""
        with self._mutex:
            files = self._files()
            if size <= 0 or self.keep < 1 or any(n >= size for n, _, _ in files):
                return
            free = [(n, path) for n, path, busy in files if not busy]
            if not free:
                lent = self._lent.path if self._lent is not None else None
                for _, path, _ in [f for f in files if f[1] != lent][: len(files) - self.keep + 1]:
                    self._remove(path)
            private_folder(self.folder, "spare folder")
            if free:
                path = free[-1][1]
                try:
                    fd, st = owned.open_own(path, os.O_RDWR, private=True)
                except owned.NotOwnFile:  # linked since it was listed: never written
                    self._remove(path)
                    return
            else:
                path = os.path.join(self.folder, uuid.uuid4().hex)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                st = os.fstat(fd)
            try:
                self._drop((st.st_dev, st.st_ino))
                try:
                    self._maps[(st.st_dev, st.st_ino)] = _reserve(fd, size, path)
                except OSError:  # no room for a spare: the next copy is written without one
                    os.unlink(path)
                    return
            finally:
                os.close(fd)

    def release(self) -> None:
        """Deletes every spare not on loan (one a snapshot still reads keeps its pages until it goes):
        while two bases are kept, the older one's file becomes the next spare, so no third full-size
        file is held."""
        with self._mutex:
            for _, path, _ in self._files():
                if self._lent is None or path != self._lent.path:
                    try:
                        self._remove(path)
                    except FileNotFoundError:
                        pass

    def close(self) -> None:
        """Unmaps every file (a deleted file's pages are freed only once nothing maps them)."""
        with self._mutex:
            for key in list(self._maps):
                self._drop(key)


class Lent:
    """A spare on loan (``SpareFolder.lend``): its path, inode and writable map."""

    def __init__(self, path: str, key: tuple[int, int], m: mmap.mmap):
        self.path, self.key, self.map = path, key, m
        self._bytes = np.frombuffer(m, np.uint8)  # every buffer ``take`` gives is a view of it (no
        #                                           memoryview of the map per buffer)
        self._base = self._bytes.ctypes.data
        self._next = 0
        self._given: dict[int, int] = {}  # id of each buffer ``take`` gave -> where it starts; ``_kept``
        self._kept: list[np.ndarray] = []  # holds them alive, so no other object has one of those ids

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """The next ``shape``/``dtype`` buffer in the map, on the layout a full copy's encoding gives
        (each non-empty shard on a 64-byte boundary, back to back), or None when the map is full."""
        n = math.prod(shape) * dtype.itemsize
        lo = self._next + (-self._next % 64 if n else 0)
        if lo + n > len(self.map):
            return None
        self._next = lo + n
        buf = self._bytes[lo : lo + n].view(dtype).reshape(shape)
        self._given[id(buf)] = lo
        self._kept.append(buf)
        return buf

    def zero(self, lo: int, hi: int) -> None:
        """Writes zeros to bytes ``lo:hi`` of the map (padding between a copy's shards)."""
        self._bytes[lo:hi] = 0

    @property
    def used(self) -> bool:
        """Whether ``take`` gave out any of the map."""
        return self._next > 0

    def offset(self, a: np.ndarray) -> int | None:
        """Where ``a``'s bytes lie in the map, or None when they lie elsewhere."""
        if not a.nbytes:
            return None
        at = self._given.get(id(a))  # a buffer ``take`` gave: known without asking numpy for its
        if at is not None:  #           address (about 1.3 us an array)
            return at
        at = a.ctypes.data - self._base
        return at if 0 <= at < len(self.map) else None

    def placed(self, pieces: Sequence[np.ndarray], size: int) -> set[int]:
        """The pieces (``size`` bytes back to back) already at their place in the map, not copied again.
        A piece that lies in the map elsewhere is an error (copying it there could overwrite a piece not
        copied yet), as are pieces that do not fill the map."""
        if size != len(self.map):
            raise RuntimeError(f"{self.path}: {size} bytes to write into a map of {len(self.map)}")
        out, off = set(), 0
        for j, p in enumerate(pieces):
            at = self.offset(p)
            if at is not None and at != off:
                raise RuntimeError(
                    f"{self.path}: a snapshot's bytes lie at {at} of the map, the copy puts them at {off}"
                )
            if at is not None:
                out.add(j)
            off += len(p)
        return out


def _map_shared(fd: int, size: int) -> mmap.mmap:
    """A writable shared map of the whole file, its page tables filled at once."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def _reserve(fd: int, size: int, path: str) -> mmap.mmap:
    """Sizes the file to ``size`` bytes, reserves its pages (a full tmpfs is an OSError naming
    ``path`` here, never a SIGBUS at a write through the map) and maps it."""
    os.ftruncate(fd, size)  # shrinking frees the tail; growing leaves a hole for fallocate
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (reserving {size} bytes for {path})", path) from None
    return _map_shared(fd, size)


def _checksum(pieces: Sequence[np.ndarray], checksum: Sequence[bool], crcs: list, a: int, b: int) -> None:
    for j in range(a, b):
        if checksum[j]:
            crcs[j] = crc32c.crc32c(as_buffer(pieces[j]))


def _parts(pieces: Sequence[np.ndarray], work: Callable[[int, int], None]) -> None:
    """Runs ``work(a, b)`` over ranges of ``pieces`` of about equal bytes on pool(), and waits for all
    of them (none may still write into a map when it is closed) before raising the first failure."""
    sizes = [len(p) for p in pieces]
    total = sum(sizes)
    n = max(1, min(len(pieces), 2 * _CPUS, total // (4 << 20)))
    if n == 1:
        return work(0, len(pieces))
    bounds, acc, k = [0], 0, 1
    for j, sz in enumerate(sizes):
        acc += sz
        if acc >= k * total / n and len(bounds) < n:
            bounds.append(j + 1)
            k += 1
    bounds.append(len(pieces))
    futures = [pool().submit(work, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    wait(futures)
    for f in futures:
        f.result()


def _write_all(fd: int, path: str, pieces: Sequence[np.ndarray]) -> None:
    """The pieces back to back, with the storage's bounded writev (storage/local.py write_all: at most
    WRITE_STEP bytes a call); an OSError names ``path``."""
    try:
        write_all(fd, [memoryview(as_buffer(p)).cast("B") for p in pieces if p.nbytes])
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror} (writing {path})", path) from None
