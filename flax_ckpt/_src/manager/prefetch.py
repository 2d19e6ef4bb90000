"""Prefetch: a step's files read into host memory on a thread, before the restore asks for them.

Scope: one background read of one committed step folder on a local file system into the operating
system's page cache, so that a restore that comes later (after the runtime starts and the program
traces) reads memory instead of the disk. The read only warms: the restore reads, verifies every
checksum and agrees its step across processes as it always does, so a step that turns out damaged, a
target that does not match, or a restore that never comes costs the read and nothing else. Within a
bound (``limit`` bytes: by default half the memory the system has available), and only regular files
inside the step folder (opened beside a folder descriptor, never through a link; no FIFO is read).
With several processes each reads the files it wrote (``p<process>.*``, as the raw serializer names
them) and the small ones. Not here: which step the restore takes (agreed.py), object stores (a page
cache does not hold their bytes).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading

log = logging.getLogger("flax_ckpt")
_BUFFER = 8 << 20  # bytes per read (one buffer, reused)
_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITER = re.compile(r"p(\d+)\.")  # a data file written by process N (serializers/raw.py)


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

    def cancel(self) -> None:
        """Stops the read and waits for the thread (a read in flight ends first: at most one buffer)."""
        self._stop.set()
        self._thread.join()

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
