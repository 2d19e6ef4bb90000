"""A folder on a local (or network) file system: plain os calls, every write fsynced.

Scope: LocalStorage, the Storage protocol (base.py) over a folder, and open_regular (the one checked
open of a file for reading, also used by foreign/files.py). Reads never leave the folder
(symlinks are resolved and refused when they point outside) and never block (special files are
refused before they are opened for reading).

Large files on a local block-device file system (ext4, xfs, btrfs) are written with O_DIRECT, straight
from memory where the buffers lie back to back from a page boundary (an async save's arena,
engine/arena.py), else through a page-aligned staging buffer: the disk reads the bytes from there,
instead of the kernel copying them into the page cache and writing them back later. That copy is
most of what a write costs the CPU, taken from the cores a training step is using; the staging copy
costs a fraction of it (benchmarks/README.md, "Figures from the module docstrings"). Elsewhere (tmpfs,
NFS, FUSE, any file system that refuses O_DIRECT, or FLAX_CKPT_DIRECT_IO=0) files go through the page
cache. Either way the bytes on disk are the same and fsynced before ``write`` returns.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import shutil
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal, Sequence

import numpy as np

from flax_ckpt._src.errors import CorruptCheckpointError, StorageError
from flax_ckpt._src.storage.base import Buffer, span

_IO_STEP = 1 << 30  # bytes per preadv call
WRITE_STEP = 256 << 10  # bytes per writev call (see write_all; benchmarks/README.md)
_IOV_MAX = min(
    os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024
)  # buffers per writev/preadv
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; 0 elsewhere: every write through the page cache
DIRECT_MIN = (
    1 << 20
)  # files of at least this many bytes are written with O_DIRECT where the file system allows
DIRECT_FILE_SYSTEMS = frozenset({"ext4", "xfs", "btrfs"})
_ALIGN = 4096  # O_DIRECT: memory address, file offset and length multiples of the logical block (<= 4096)
_STAGE = 4 << 20  # bytes of one staging buffer: one O_DIRECT write
_STAGES_KEPT = 8  # staging buffers kept for the next save (one per file written at once)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on folders
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FSYNC_S: dict[int, float] = {}  # device (st_dev) -> seconds fsync_all's last fsync there took
AT_ONCE_S = 1e-3  # fsync_all runs at once the fsyncs of a device where its last one took this long


def fsync_all(paths: Sequence[str]) -> None:
    """fsyncs the files and folders ``paths``; returns once every one ended, raising the first failure.
    Where an fsync is slow (a network file system: a device where this function's last fsync took
    AT_ONCE_S or more, or none was timed yet) they run on several threads at once (the first on the
    calling thread, the rest on a pool): a journaling file system makes them durable together, in about
    the time of one. Where it is fast (a local disk: ~0.1 ms a folder) one after another on the calling
    thread: handing one to another thread costs more CPU (~0.07 ms) than that, for no time saved."""
    calls: list[tuple[int | None, Callable[[], None]]] = []  # (device, fsync)
    at_once = False
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:  # fsync_file raises it, in its turn
            calls.append((None, functools.partial(fsync_file, p)))
            continue
        calls.append((st.st_dev, functools.partial(fsync_dir if stat.S_ISDIR(st.st_mode) else fsync_file, p)))
        at_once = at_once or _FSYNC_S.get(st.st_dev, AT_ONCE_S) >= AT_ONCE_S
    first: BaseException | None = None
    for k, (dev, call) in enumerate(calls):
        if at_once and len(calls) - k > 1:  # the rest at once: slow fsyncs (or one just now)
            try:
                _at_once(calls[k:])
            except BaseException as e:
                first = first or e
            break
        t0 = time.perf_counter()
        try:
            call()
        except BaseException as e:  # every fsync ends before a failure is raised
            first = first or e
        took = time.perf_counter() - t0
        if dev is not None:
            _FSYNC_S[dev] = took
        at_once = took >= AT_ONCE_S
    if first is not None:
        raise first


def _at_once(calls: Sequence[tuple[int | None, Callable[[], None]]]) -> None:
    """Runs ``calls`` ((device, fsync)) at once, the first on this thread; keeps each device's time."""

    def timed(dev: int | None, call: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            call()
        finally:
            if dev is not None:
                _FSYNC_S[dev] = time.perf_counter() - t0

    pending = [_sync_pool().submit(timed, *c) for c in calls[1:]]  # the first on this thread, meanwhile
    try:
        timed(*calls[0])
    finally:
        for f in pending:  # every fsync ended before a failure is raised
            f.exception()
    for f in pending:
        f.result()


_SYNC_POOL: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child starts its own threads
_SYNC_POOL_LOCK = threading.Lock()


def _sync_pool() -> ThreadPoolExecutor:
    with _SYNC_POOL_LOCK:
        pid = os.getpid()
        if pid not in _SYNC_POOL:
            _SYNC_POOL.clear()
            _SYNC_POOL[pid] = ThreadPoolExecutor(8, thread_name_prefix="flax_ckpt-fsync")
        return _SYNC_POOL[pid]


def open_regular(path: str, flags: int = 0) -> int:
    """A read-only fd of the regular file at ``path``, opened without blocking (so a FIFO cannot hang the
    open) plus ``flags`` (e.g. O_NOFOLLOW). os.open's OSError passes through for the caller to name; a
    folder, FIFO, device or socket is a CorruptCheckpointError, its fd closed."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
        raise CorruptCheckpointError(f"{path} is not a regular file ({kind}); refusing to read it")
    return fd


class LocalStorage:
    """A folder on a local (or network) file system. Writes are fsynced before they return."""

    supports_rename = True
    context = None

    def __init__(self, root: str | os.PathLike, *, recycler: Any = None):
        """``recycler``: where a new large file may come from instead of being created (a manager's
        commit/recycler.Recycler, given to the folders below this one too): ``recycler.take(path, size,
        flags)`` moves an old file of its own to ``path`` and opens it, or returns None."""
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.local_path = self.root
        self.recycler = recycler
        self._resolved: dict[str, str] = {}  # name -> checked real path (symlinks resolved once per file)

    def _p(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/")) if name else self.root

    def sub(self, name: str) -> "LocalStorage":
        """The folder ``name`` below this one."""
        return LocalStorage(self._p(name), recycler=self.recycler)

    def parent(self) -> "tuple[LocalStorage, str]":
        return LocalStorage(os.path.dirname(self.root)), os.path.basename(self.root)

    def write(self, name: str, buffers: Sequence[Buffer]) -> float:
        """Writes and fsyncs the file ``name``; returns the seconds the fsync took. A large file on a
        local block-device file system is written with O_DIRECT (see the module's docstring). With a
        ``recycler``, a file of at least 1 MiB may be an old one it hands over, written from its start
        and truncated to its new size."""
        path = self._p(name)
        folder = os.path.dirname(path)
        LocalStorage(folder).makedirs()
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
        size = sum(len(v) for v in views)
        direct = size >= DIRECT_MIN and direct_io(folder)
        fd = (
            self.recycler.take(path, size, os.O_WRONLY | (_O_DIRECT if direct else 0))
            if self.recycler
            else None
        )
        reused, flags = fd is not None, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            if fd is None:
                fd = os.open(path, flags | _O_DIRECT, 0o644) if direct else os.open(path, flags, 0o644)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            _refuses_direct(folder)
            direct, fd = False, os.open(path, flags, 0o644)
        try:
            if direct:
                _write_direct(fd, views, folder)
            else:
                write_all(fd, views)
            if reused:  # an old file written over from its start: it ends where the new bytes end
                os.ftruncate(fd, size)
            t0 = time.perf_counter()
            os.fsync(fd)
            return time.perf_counter() - t0
        except OSError as e:
            if e.filename is None:  # os.write/fsync name no file: a full disk should say which
                raise type(e)(e.errno, f"{e.strerror} (writing {path})", path) from e
            raise
        finally:
            os.close(fd)

    def write_if_absent(self, name: str, data: bytes) -> bool:
        """Writes ``name`` unless it exists (False then); the file appears whole or not at all."""
        path = self._p(name)
        if os.path.lexists(path):
            return False
        tmp = f"{name}.tmp-{uuid.uuid4().hex}"  # a temporary name (commit/atomic.py is_temporary), never read
        try:
            self.write(tmp, [data])
            os.link(self._p(tmp), path)
        except FileExistsError:
            return False
        finally:
            if os.path.lexists(self._p(tmp)):
                os.unlink(self._p(tmp))
        fsync_dir(os.path.dirname(path))
        return True

    def _inside(self, name: str) -> str:
        """The real path of ``name``, refused (CorruptCheckpointError) when a symlink takes it out of the
        folder; resolved once per name and storage object (a restore reads many leaves from one file)."""
        real = self._resolved.get(name)
        if real is not None:
            return real
        path = self._p(name)
        real = os.path.realpath(path)
        root = self._resolved.get("")
        if root is None:
            root = self._resolved[""] = os.path.realpath(self.root)
        if real != root and not real.startswith(root + os.sep):
            raise CorruptCheckpointError(
                f"{path} resolves to {real}, outside the checkpoint folder {root}; refusing to read it"
            )
        if name:
            self._resolved[name] = real
        return real

    def _open_regular(self, name: str) -> tuple[int, str]:
        """A read-only fd of the regular file ``name``, and its path. FileNotFoundError and
        NotADirectoryError pass through; a FIFO, device, folder, over-long name or symlink loop is a
        CorruptCheckpointError (opened O_NONBLOCK, so a FIFO cannot block the open)."""
        path = self._inside(name)
        try:
            return open_regular(path), path
        except (FileNotFoundError, NotADirectoryError):
            raise
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: cannot be read ({e.strerror})") from None

    def read(self, name: str, max_bytes: int) -> bytes:
        """The whole file ``name``; CorruptCheckpointError when it holds more than ``max_bytes``.
        Allocates what the file holds (plus one byte, to see it grow), never ``max_bytes``; a file
        whose size or times change while it is read is a CorruptCheckpointError, one deleted meanwhile a
        FileNotFoundError (as if it had been deleted before)."""
        fd, path = self._open_regular(name)
        with os.fdopen(fd, "rb") as f:
            before = os.fstat(fd)
            size = before.st_size
            if size > max_bytes:
                raise CorruptCheckpointError(
                    f"{path} holds {size} bytes, more than the {max_bytes} it may; refusing to read it"
                )
            data = f.read(size + 1)
            after = os.fstat(fd)
        if after.st_nlink == 0:  # unlinked meanwhile (its ctime moved): gone, not rewritten
            raise FileNotFoundError(errno.ENOENT, f"{path} was deleted while it was being read", path)
        if len(data) != size:
            raise CorruptCheckpointError(
                f"{path} changed size while it was being read ({size} bytes, then "
                f"{len(data)}{'+' if len(data) > size else ''}); read it again once "
                "nothing writes it"
            )
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
            size,
            before.st_mtime_ns,
            before.st_ctime_ns,
        ):
            raise CorruptCheckpointError(
                f"{path} changed while it was being read (rewritten); read it again once nothing writes it"
            )
        return data

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.read_ranges(name, [(offset, [out])])

    def read_ranges(self, name: str, parts: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """Fills, for each (offset, buffers) of ``parts``, the buffers with the bytes from ``offset`` on,
        back to back: one open of the file, one preadv per part (in batches of IOV_MAX buffers)."""
        fd, path = self._open_regular(name)
        try:
            for offset, buffers in parts:
                views = [memoryview(b).cast("B") for b in buffers]
                _pread_all(fd, path, offset, [v for v in views if len(v)], sum(len(v) for v in views))
        finally:
            os.close(fd)

    def _size(self, name: str) -> int | None:
        try:
            return os.stat(self._p(name)).st_size
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return os.path.isfile(self._p(name))

    def kind(self) -> Literal["missing", "file", "folder"]:
        return "folder" if os.path.isdir(self.root) else "file" if os.path.lexists(self.root) else "missing"

    def check_size(self, name: str, expected: int) -> None:
        """Raises CorruptCheckpointError unless the file exists with exactly ``expected`` bytes."""
        found = self._size(name)
        if found != expected:
            raise CorruptCheckpointError(
                f"{self._p(name)}: "
                + (
                    "missing"
                    if found is None
                    else f"truncated or extended: expected {expected} bytes, found {found}"
                )
            )

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, name: str = "") -> None:
        path = self._p(name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=False)
        elif os.path.lexists(path):
            os.unlink(path)

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename; fails (EEXIST/ENOTEMPTY) when dst exists and is not empty."""
        os.rename(self._p(src), self._p(dst))

    def sync(self, name: str = "", *, tree: bool = True) -> None:
        """fsyncs the folder ``name`` and (``tree``) every folder below it (files are fsynced when written),
        all at once (fsync_all)."""
        if not tree:
            fsync_dir(self._p(name))
            return
        fsync_all([dirpath for dirpath, _, _ in os.walk(self._p(name))])

    def makedirs(self) -> None:
        """Creates this folder (and its parents). A file in the way is a StorageError naming it."""
        try:
            os.makedirs(self.root, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            blocker = self.root
            while blocker and not os.path.exists(blocker):  # the deepest part of the path that exists
                blocker = os.path.dirname(blocker)
            raise StorageError(
                f"cannot create the folder {self.root}: {blocker} is a file, not a folder. Give "
                "a checkpoint directory that is a folder or does not exist yet (nothing was "
                "written)"
            ) from None
        except OSError as e:
            raise StorageError(f"cannot create the folder {self.root}: {e.strerror}") from None

    def stored_bytes(self) -> int:
        """The bytes in the regular files under this folder. Refuses (CorruptCheckpointError) symlinks
        that leave the folder and special files (FIFOs, devices, sockets), before any data is read:
        nothing outside a checkpoint is read, and no read blocks. One walk per folder."""
        root, total = os.path.realpath(self.root), 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                    if stat.S_ISLNK(st.st_mode):
                        real = os.path.realpath(path)
                        if real != root and not real.startswith(root + os.sep):
                            raise CorruptCheckpointError(
                                f"{path} resolves to {real}, outside the checkpoint "
                                f"folder {root}; refusing to read the checkpoint"
                            )
                        st = os.stat(path)
                except FileNotFoundError:
                    continue  # deleted meanwhile; reads will say so
                except OSError as e:
                    raise CorruptCheckpointError(
                        f"{path}: {e.strerror}; refusing to read the checkpoint"
                    ) from None
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
                elif not stat.S_ISDIR(st.st_mode):
                    raise CorruptCheckpointError(
                        f"{path} is not a regular file (a FIFO, device or socket); "
                        "refusing to read the checkpoint"
                    )
        return total

    def kvstore_spec(self, name: str = "") -> dict[str, Any]:
        """tensorstore's spec of the folder ``name``; StorageError when its path is not valid UTF-8
        (tensorstore takes UTF-8 paths only)."""
        path = self._p(name)
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise StorageError(
                f"{path!r} is not a valid UTF-8 path: tensorstore (the Orbax format, the zarr3 "
                "serializer) cannot open it. Rename the folder, or use format='native' with the "
                "raw serializer"
            ) from None
        return {"driver": "file", "path": path + "/"}


def _pread_all(fd: int, path: str, offset: int, views: list[memoryview], total: int) -> None:
    pos, i = offset, 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        n = os.preadv(fd, batch, pos)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path}: truncated (needed bytes {offset}..{offset + total}, file ends at {pos})"
            )
        pos += n
        while n and i < len(views):  # drop the buffers filled, shorten a partly filled one
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0


_fs_direct: dict[int, bool] = {}  # st_dev -> whether its file system takes O_DIRECT writes


def direct_io(folder: str) -> bool:
    """Whether large files in ``folder`` are written with O_DIRECT: Linux, not FLAX_CKPT_DIRECT_IO=0,
    and the folder's file system one of DIRECT_FILE_SYSTEMS (by /proc/self/mountinfo, once per device)
    that has not refused it in this process."""
    if not _O_DIRECT or os.environ.get("FLAX_CKPT_DIRECT_IO", "auto").strip().lower() in (
        "0",
        "off",
        "false",
        "no",
    ):
        return False
    dev = os.stat(folder).st_dev
    known = _fs_direct.get(dev)
    if known is None:
        known = _fs_direct[dev] = _fs_type(dev) in DIRECT_FILE_SYSTEMS
    return known


def _fs_type(dev: int) -> str | None:
    """The type of the file system mounted from device ``dev`` (e.g. "ext4"), or None if unknown."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:  # id parent major:minor root mount-point options [optional...] - type source ...
                fields = line.split()
                if len(fields) > 3 and fields[2] == want and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        pass
    return None


def _refuses_direct(folder: str) -> None:
    """Remembers that the file system of ``folder`` refused an O_DIRECT open or write (EINVAL)."""
    try:
        _fs_direct[os.stat(folder).st_dev] = False
    except OSError:
        pass


class _Stages:
    """Page-aligned staging buffers (private anonymous maps) for O_DIRECT writes, kept for the next save."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        # private: a process forked later gets its own copy on write, not pages it shares with this one
        return mmap.mmap(-1, _STAGE, flags=mmap.MAP_PRIVATE)

    def give(self, stage: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < _STAGES_KEPT:
                self._free.append(stage)
                return
        stage.close()


_stages = _Stages()


def _address(v: memoryview) -> int:
    return np.frombuffer(v, np.uint8).ctypes.data


def _runs(views: list[memoryview]) -> list[tuple[int, memoryview]]:
    """The buffers with those that lie back to back in memory merged: (address, one view of them all).
    A merged view spans exactly the memory of its buffers, which ``views`` keeps alive meanwhile."""
    runs: list[tuple[int, list[memoryview]]] = []
    end = -1
    for v in views:
        a = _address(v)
        if a == end:
            runs[-1][1].append(v)
        else:
            runs.append((a, [v]))
        end = a + len(v)
    return [
        (
            a,
            vs[0] if len(vs) == 1 else span(a, sum(map(len, vs))),
        )
        for a, vs in runs
    ]


def _write_direct(fd: int, views: list[memoryview], folder: str) -> None:
    """Writes the buffers back to back into ``fd`` (opened with O_DIRECT). A run of buffers that lie back
    to back in memory from a page boundary (a snapshot's arena, engine/arena.py) and start where the file
    is page-aligned is written straight from memory, but for its last part that is not a multiple of
    _ALIGN; everything else is copied into a staging buffer and written from it a whole buffer at a
    time. The last part of the file that is not a multiple of _ALIGN, and everything after a write the
    file system refuses (EINVAL), goes through the page cache."""
    stage: mmap.mmap | None = None
    try:
        fill = pos = 0
        direct = True
        for address, v in _runs(views):
            i = 0
            if not fill and address % _ALIGN == 0 and len(v) >= _ALIGN:  # pos is aligned while fill is 0
                i = len(v) - len(v) % _ALIGN
                direct = _pwrite_all(fd, v[:i], pos, direct, folder)
                pos += i
            if i < len(v) and stage is None:
                stage = _stages.take()
                buf = memoryview(stage)
            while i < len(v):
                n = min(len(v) - i, _STAGE - fill)
                buf[fill : fill + n] = v[i : i + n]
                fill, i = fill + n, i + n
                if fill == _STAGE:
                    direct = _pwrite_all(fd, buf, pos, direct, folder)
                    pos, fill = pos + _STAGE, 0
        whole = fill - fill % _ALIGN
        if whole:
            direct = _pwrite_all(fd, buf[:whole], pos, direct, folder)
        if fill > whole:
            _pwrite_all(fd, buf[whole:fill], pos + whole, _buffered(fd, direct), folder)
    finally:
        if stage is not None:
            buf.release()
            _stages.give(stage)


def _buffered(fd: int, direct: bool) -> bool:
    """Turns O_DIRECT off for the rest of ``fd``'s writes; returns False (the new mode)."""
    if direct:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
    return False


def _pwrite_all(fd: int, buf: memoryview, pos: int, direct: bool, folder: str) -> bool:
    """Writes all of ``buf`` at ``pos``; returns whether fd is still in O_DIRECT mode (a write refused
    with EINVAL, e.g. a block larger than _ALIGN, or a short write that leaves the rest unaligned,
    goes on through the page cache)."""
    done = 0
    while done < len(buf):
        part = buf[done:]
        if direct and (len(part) % _ALIGN or (pos + done) % _ALIGN):
            direct = _buffered(fd, direct)
        try:
            n = os.pwrite(fd, part, pos + done)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            _refuses_direct(folder)
            direct = _buffered(fd, direct)
            continue
        if n == 0:  # a regular file takes at least one byte or raises; never loop on nothing
            raise OSError(errno.EIO, "write made no progress")
        done += n
    return direct


def write_all(fd: int, views: list[memoryview]) -> None:
    """Writes the buffers back to back with writev: one syscall for many small leaves (at most IOV_MAX
    buffers), at most WRITE_STEP bytes per call (one long write holds up other threads of the process
    in the kernel: a training step waiting on its accelerator among them)."""
    i = 0
    while i < len(views):
        iov, held = [], 0
        for v in views[i : i + _IOV_MAX]:
            iov.append(v[: WRITE_STEP - held])
            held += len(iov[-1])
            if held >= WRITE_STEP:
                break
        n = os.writev(fd, iov)
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0
