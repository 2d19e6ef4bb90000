"""Prefetch: a step's bytes read into host memory on a thread, before the restore asks for them.

Scope: one background read of one committed step folder on a local file system, started before the
program needs it (while the runtime starts and the program traces), within a bound (``limit`` bytes:
by default half the memory the system has available). Two kinds:

- ``Buffered`` (one process, a native step): the step opened as the restore opens it, and its array
  leaves read whole through the source's own verified read (``Source.read_many``: every crc32c
  checked) into host buffers. The restore of that step (manager/agreed.py) takes them through ``serve``: only
  from the same folder and manifest (its id and time, and the file itself unchanged: so the same
  records and checksums), for leaves whose files have not changed since before the prefetch read them
  (``st_ino``, ``st_size``, ``st_mtime_ns``, ``st_ctime_ns``; a commit renames a new file in, a write
  moves the times); every other leaf, another step, a changed file, a leaf whose read failed (damage:
  the restore's own read finds it) is read as ever. A served byte is one the verified read wrote. A prefetch still running when the
  restore comes is stopped (the leaf in flight finishes: the restore would read it anyway), and the
  restore reads what it had not read yet. The buffers are freed after that restore, or at close.
- ``Prefetch`` (several processes; ``Buffered`` too where the step it opens is not native, an Orbax
  step): the files only warmed into the operating system's
  page cache; the restore reads and verifies them as ever. Each process reads the files it wrote
  (``p<process>.*``, as the raw serializer names them) and the small ones (which boxes a process's
  restore reads depends on its target's sharding, not known yet).

Only regular files inside the step folder are read (the page-cache warm-up opens them beside a folder
descriptor, never through a link, and reads no FIFO; the buffered read goes through the folder's own
storage, which refuses both). Not here: which step the restore takes (manager/agreed.py), object stores (the
restore reads them as ever).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
from typing import Any, Callable, Sequence

import numpy as np

from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.engine.reader import Source, aligned_empty
from flax_ckpt._src.native import sharing
from flax_ckpt._src.native.layout import NativeSource
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.serializers import Box, local

log = logging.getLogger("flax_ckpt")
_BUFFER = 8 << 20  # bytes per read (one buffer, reused)
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITER = re.compile(r"p(\d+)\.")  # a data file written by process N (serializers/raw.py)
_BATCH = 64 << 20  # bytes of leaves the buffered read verifies in one batch (the stop waits for one)
_BATCH_LEAVES = 4096  # leaves in one batch at most (a tree of many small leaves)


def available_bytes() -> int:
    """The memory the system has available (free pages), 0 where it cannot say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class Prefetch:
    """Reads the regular files under ``folder`` (a step folder) on a daemon thread, at most ``limit``
    bytes; ``process``: with ``processes`` > 1, only files written by this process (and unnamed ones).

    ``nbytes``: bytes read so far; ``done``: set when the read ended (all read, the limit reached,
    cancelled, or an error, which is logged and dropped: the restore reads the step all the same)."""

    def __init__(self, step: int, folder: str, limit: int, process: int = 0, processes: int = 1):
        self.step, self.folder, self.limit = step, folder, limit
        self._process, self._processes = process, processes
        self.nbytes = 0
        self.done, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="flax_ckpt-prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the read and waits for the thread (a read in flight ends first: at most one buffer)."""
        self._stop.set()
        self._thread.join()

    def serve(self, step: int, source: Source) -> Source:
        """The source the restore of ``step`` reads (``source``, as the restore opened it): the page
        cache holds what this read; the restore reads and verifies it as ever."""
        self.stop()
        return source

    def release(self) -> None:
        """Stops the read; what it holds is freed."""
        self.stop()

    def cancel(self) -> None:
        """``release``: nothing read ahead is used."""
        self.release()

    def _run(self) -> None:
        buffer = bytearray(_BUFFER)
        try:
            for _, _, files, dir_fd in os.fwalk(self.folder, follow_symlinks=False):
                for name in sorted(files):
                    if self._stop.is_set() or self.nbytes >= self.limit:
                        return
                    if self._mine(name):
                        self._read(name, dir_fd, buffer)
        except OSError as e:  # a folder deleted or unreadable meanwhile: the restore says what it finds
            log.debug("prefetch of %s stopped: %s", self.folder, e)
        finally:
            self.done.set()

    def _mine(self, name: str) -> bool:
        writer = _WRITER.match(name)
        return self._processes == 1 or writer is None or int(writer.group(1)) == self._process

    def _read(self, name: str, dir_fd: int, buffer: bytearray) -> None:
        try:
            fd = os.open(name, _FLAGS, dir_fd=dir_fd)
        except OSError:  # a link, a file gone: skipped
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return  # a FIFO, a device: never read
            view = memoryview(buffer)
            while not self._stop.is_set() and self.nbytes < self.limit:
                n = os.readv(fd, [view[: min(len(view), self.limit - self.nbytes)]])
                if n <= 0:
                    return
                self.nbytes += n
        finally:
            os.close(fd)


class Buffered(Prefetch):
    """One process, a native step: ``open_step()`` opens the step as the restore does, and its array
    leaves are read whole into host buffers through the source's verified read, in manifest order,
    while they fit in ``limit`` bytes. ``nbytes``: the bytes held (verified). See the module's
    docstring for what ``serve`` hands the restore."""

    def __init__(self, step: int, folder: str, limit: int, open_step: Callable[[], Source]):
        self._open = open_step
        self._source: NativeSource | None = None  # the step as the prefetch opened it
        self._held: dict[str, tuple[LeafRecord, np.ndarray]] = {}  # verified buffers by leaf name
        self._stats: dict[str, tuple[int, ...] | None] = {}  # each data file's, before it was read
        self._manifest: tuple[int, ...] | None = None  # the manifest's, before it was read
        self._served: dict[str, np.ndarray] = {}  # the buffers handed to a restore (``release`` frees)
        super().__init__(step, folder, limit)

    def _run(self) -> None:
        try:
            self._manifest = _identity(os.path.join(self.folder, MANIFEST))
            source = self._open()
            if not isinstance(source, NativeSource) or source.storage.local_path is None:
                super()._run()  # another layout's step: its files warmed into the page cache
                return
            self._source = source
            chosen, size = [], 0
            for leaf in source.leaves:
                if leaf.is_array and leaf.nbytes and all("file" in c for c in leaf.chunks):
                    if size + leaf.nbytes > self.limit:
                        break
                    chosen.append(leaf)
                    size += leaf.nbytes
            self._stats = {f: _stat(source, f) for f in {c["file"] for leaf in chosen for c in leaf.chunks}}
            batch: list[LeafRecord] = []
            size = 0
            for leaf in chosen:
                batch.append(leaf)
                size += leaf.nbytes
                if size >= _BATCH or len(batch) >= _BATCH_LEAVES:
                    if self._stop.is_set():
                        return
                    self._read_leaves(source, batch)
                    batch, size = [], 0
            if batch and not self._stop.is_set():
                self._read_leaves(source, batch)
        except Exception as e:  # the restore opens and reads the step itself, and says what it finds
            log.debug("prefetch of %s stopped: %s: %s", self.folder, type(e).__name__, e)
        finally:
            self.done.set()

    def _read_leaves(self, source: NativeSource, leaves: list[LeafRecord]) -> None:
        """Reads ``leaves`` whole (Source.read_many, verified); a batch that fails is read leaf by leaf,
        and a leaf that fails again (damaged, gone) is not kept."""
        requests = [
            (leaf, _whole(leaf), aligned_empty(leaf.array_shape, leaf.array_dtype)) for leaf in leaves
        ]
        try:
            source.read_many(requests)
        except Exception:
            kept = []
            for leaf, box, out in requests:
                try:
                    source.read(leaf, box, out)
                    kept.append((leaf, box, out))
                except Exception as e:
                    log.debug("prefetch of %s: leaf %r not kept: %s", self.folder, leaf.name, e)
            requests = kept
        for leaf, _, out in requests:
            out.flags.writeable = False  # never written again: the restore may hand it to device_put
            self._held[leaf.name] = (leaf, out)
            self.nbytes += out.nbytes

    def serve(self, step: int, source: Source) -> Source:
        """``source`` with the verified buffers of the leaves whose files have not changed since before
        the prefetch read them, when it is the step the prefetch read: the same folder, and the same
        manifest (its id and time, and the file itself unchanged since before it was read, so the
        same records and checksums); ``source`` itself otherwise."""
        self.stop()
        held, mine, self._held, self._source, self.nbytes = self._held, self._source, {}, None, 0
        if (
            step != self.step
            or not held
            or mine is None
            or not isinstance(source, NativeSource)
            or source.storage.url != mine.storage.url
            or _ident(source.body) != _ident(mine.body)
            or self._manifest is None
            or _stat(source, MANIFEST) != self._manifest
        ):
            return source
        good = {f for f, st in self._stats.items() if st is not None and _stat(source, f) == st}
        for name, (leaf, buf) in held.items():
            if len(good) == len(self._stats) or all(c["file"] in good for c in leaf.chunks):
                self._served[name] = buf
        return _Served(source, self._served) if self._served else source

    def release(self) -> None:
        """Stops the read; the buffers (held, or handed to a restore and not taken) are freed."""
        self.stop()
        self._held, self._source, self.nbytes = {}, None, 0
        self._served.clear()


class _Served(NativeSource):
    """A native step whose leaves in ``buffers`` (whole, verified, by name) are served from memory:
    ``view`` hands a whole leaf's buffer over once (no copy), ``read`` copies a box of it (a cast's
    slab, a numpy result); the other leaves are read as ``NativeSource`` reads them."""

    def __init__(self, source: NativeSource, buffers: dict[str, np.ndarray]):
        super().__init__(source.storage, source.body, source.leaves, source.serializer)
        self._buffers = buffers

    def view(self, leaf: LeafRecord, box: Box) -> np.ndarray | None:
        whole = _whole(leaf)
        buf = self._buffers.pop(leaf.name, None) if box == whole else self._buffers.get(leaf.name)
        if buf is None:
            return super().view(leaf, box)
        return buf if box == whole else buf[local(box, whole)]

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        buf = self._buffers.get(leaf.name)
        if buf is None:
            super().read(leaf, box, out)
        else:
            out[...] = buf[local(box, _whole(leaf))]

    def read_many(self, requests: Sequence[tuple[LeafRecord, Box, np.ndarray]]) -> None:
        rest = []
        for leaf, box, out in requests:
            if leaf.name in self._buffers:
                self.read(leaf, box, out)
            else:
                rest.append((leaf, box, out))
        if rest:
            super().read_many(rest)


def _whole(leaf: LeafRecord) -> Box:
    return tuple((0, d) for d in leaf.array_shape)


def _ident(body: dict[str, Any]) -> tuple[Any, ...]:
    """What tells one save's manifest from another's of the same step folder."""
    return body.get("step"), body.get("id"), body.get("created")


def _stat(source: NativeSource, name: str) -> tuple[int, ...] | None:
    """The identity of file ``name`` of the step (``../<step>/<file>``: the sibling step's that holds
    it): inode, size, modification and change times; None where it cannot be found."""
    ref = sharing.split_ref(name)
    try:
        if ref is None:
            root = source.storage.local_path
        else:
            holder = getattr(source.files, "holder", None)
            root = holder(ref[0]).local_path if holder is not None else None
            name = ref[1]
    except Exception:  # a holder that cannot be found (sharing's CheckpointError): not served
        return None
    return None if root is None else _identity(os.path.join(root, *name.split("/")))


def _identity(path: str) -> tuple[int, ...] | None:
    """A file's inode, size, modification and change times; None where it cannot be found."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
