"""One checkpoint file of another library, opened safely, and what its sources share.

Scope: ``CheckpointFile`` (a regular file opened without blocking: a FIFO, device or socket is refused
before anything is read; a file found by listing a run directory is never a symlink; a file that
changes while it is read is an error, never a mix of two versions: its identity is checked before and
after every read, and every read is read twice and compared, whatever its timestamps say), the step a file name gives
(``step_of``: ``checkpoint_<step>``, ``<prefix>_<step>`` or ``<step>``), and ``FileSource``, the part
of a restore Source every foreign file shares (no checksums: every leaf is unverified). Decoding a
format is its own module's (flax_msgpack.py, safetensors_file.py).
"""

from __future__ import annotations

import abc
import errno
import os
import re
import time
from typing import Any, Callable, Sequence

import numpy as np

from flax_ckpt._src.engine.equal import same_bytes
from flax_ckpt._src.engine.leaves import CheckpointInfo, checkpoint_info
from flax_ckpt._src.engine.reader import Damage, read_back
from flax_ckpt._src.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.serializers.base import Box
from flax_ckpt._src.storage.local import open_regular

_STEP_NAME = re.compile(r"(?:.+_)?([0-9]+)")  # ASCII digits only, as orbax/locate.py's step folder names


SETTLE_S = 10  # a file modified this recently (or stamped in the future) must have been left alone ...
QUIET_S = 0.5  # ... this long since its last change (CheckpointFile)
_AGAIN = 4 << 20  # bytes compared at a time


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def step_of(name: str) -> int | None:
    """The step a checkpoint file's name gives: flax's ``checkpoint_<step>`` (any ``<prefix>_``) or a
    bare ``<step>``; None for any other name (``checkpoint_tmp``, ``model.msgpack``)."""
    m = _STEP_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


class CheckpointFile:
    """A regular file, opened once to learn its identity (device, inode, size, mtime); every later read
    reopens it, refuses a file that is no longer the same one (replaced or rewritten meanwhile), and
    checks the same after reading, so that a write while it reads is an error, never a mix of two
    versions. Every read is also read a second time and the two compared, byte for byte (these formats
    carry no checksum): a write that had begun before the file was opened changes no identity it could
    see, and a file server's timestamps may be cached, coarse or set by a clock ahead of this one, so
    nothing here depends on them. A file whose last change is under SETTLE_S seconds old by this
    host's clock, or in its future, is accepted only once that change is QUIET_S seconds old. ``follow``:
    follow a symlink at ``path`` (a file the user names, e.g. a Hugging Face
    cache link); False for a file found by listing a run directory, where a link could lead out of it."""

    def __init__(self, path: str, *, follow: bool = True):
        self.path, self.follow = path, follow
        fd = self._open()
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self.size, self.mtime = st.st_size, st.st_mtime
        self._identity = _identity(st)
        self._recent = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < SETTLE_S * 10**9

    def _open(self) -> int:
        try:
            return open_regular(self.path, 0 if self.follow else os.O_NOFOLLOW)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {self.path} (the path does not exist)") from None
        except OSError as e:
            if e.errno == errno.ELOOP and not self.follow:
                raise CorruptCheckpointError(
                    f"{self.path} is a symbolic link inside a run directory; refusing to "
                    "follow it (it may lead out of the directory): pass the file it "
                    "points to"
                ) from None
            raise CorruptCheckpointError(f"{self.path}: cannot be read ({e.strerror})") from None

    def open_same(self) -> int:
        """A read-only fd of the file, which must still be the one opened first."""
        fd = self._open()
        try:
            self._same(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _same(self, fd: int) -> None:
        if _identity(os.fstat(fd)) != self._identity:
            raise CorruptCheckpointError(
                f"{self.path} changed while it was being read (replaced or rewritten); "
                "restore it again once nothing writes it"
            )

    def read(self, offset: int, out: memoryview) -> None:
        """Fills ``out`` with the bytes from ``offset`` on (CorruptCheckpointError when the file ends
        first, or changes meanwhile)."""
        fd = self.open_same()
        try:
            self._pread(fd, offset, out)
            self._read_again(fd, offset, out)  # by content: no clock, no cached attribute trusted
            self._same(fd)
            if self._recent:
                self._quiet(fd)
        finally:
            os.close(fd)

    def _quiet(self, fd: int) -> None:
        """Waits until the file's last change is QUIET_S old, then checks it is still the same: a writer
        that paused in the middle of a write (so that both reads saw the same half-written bytes and the
        file's times did not move) shows itself when it resumes."""
        last = max(self._identity[3], self._identity[4])
        wait = QUIET_S - (time.time_ns() - last) / 1e9
        if wait > 0:
            time.sleep(min(wait, QUIET_S))
            self._same(fd)

    def _pread(self, fd: int, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done : done + (1 << 30)]], offset + done)
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self.path}: ends at byte {offset + done}, before the "
                    f"{len(out)} bytes from {offset} (truncated)"
                )
            done += n

    def _read_again(self, fd: int, offset: int, out: memoryview) -> None:
        """Reads the bytes of ``out`` again, a part at a time, and compares: the file may be in the
        middle of a write that began before it was opened, unseen by its size and timestamps."""
        scratch = memoryview(bytearray(min(len(out), _AGAIN)))
        for at in range(0, len(out), _AGAIN):
            n = min(_AGAIN, len(out) - at)
            self._pread(fd, offset + at, scratch[:n])
            if not same_bytes(scratch[:n], out[at : at + n]):
                raise CorruptCheckpointError(
                    f"{self.path} changed while it was being read (bytes {offset + at} to "
                    f"{offset + at + n} differ when read again: it is being written); "
                    "restore it again once nothing writes it"
                )

    def head(self, n: int) -> bytes:
        """The first ``n`` bytes (fewer when the file is shorter)."""
        buf = bytearray(min(n, self.size))
        self.read(0, memoryview(buf))
        return bytes(buf)

    def read_all(self) -> bytearray:
        """The whole file (one buffer of its size, never copied again)."""
        try:
            buf = bytearray(self.size)
        except MemoryError:
            raise CheckpointError(
                f"{self.path}: cannot allocate {self.size} bytes to read it (out of "
                "memory); read it on a machine with more memory"
            ) from None
        self.read(0, memoryview(buf))
        return buf


class FileSource(abc.ABC):
    """What every foreign file's restore Source shares: one file (``url`` and ``where``), read locally,
    no checksums (``unchecked``: every leaf but empty containers; ``verify`` reads every array back,
    which finds truncation and changes, never flipped bits). Subclasses set ``leaves``, ``file``,
    ``serializer``, ``format`` and ``step``/``metrics``/``metadata``."""

    hint = ""
    remote = False
    serializer = ""
    format = ""
    step: int | None = None
    metrics: dict[str, Any] | None = None
    metadata: Any = None
    leaves: Sequence[LeafRecord]  # set by each file's source when it parses the file
    budget: int | None  # see Source.budget

    def __init__(self, file: CheckpointFile):
        self.file, self.url, self.where = file, file.path, file.path

    @abc.abstractmethod
    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        """See Source.read."""

    @abc.abstractmethod
    def view(self, leaf: LeafRecord, box: Box) -> np.ndarray | None:
        """See Source.view."""

    def select(self, target: Any) -> tuple["FileSource", Any]:
        return self, target

    def unchecked(self) -> list[str]:
        """Every leaf but empty containers: these formats carry no checksum, so verify proves nothing."""
        return [leaf.name for leaf in self.leaves if leaf.kind != "empty"]

    def verify(self, update: Callable[[int], None]) -> list[Damage]:
        return read_back(self, update)

    def info(self) -> CheckpointInfo:
        return checkpoint_info(
            self.url,
            self.leaves,
            step=self.step,
            metrics=self.metrics,
            metadata=self.metadata,
            created=self.file.mtime,
            process_count=1,
            serializer=self.serializer,
            format=self.format,
        )

    def read_many(self, requests: Any) -> None:
        for leaf, box, out in requests:
            self.read(leaf, box, out)


def whole(box: Any, shape: tuple[int, ...]) -> bool:
    return all(s == 0 and e == d for (s, e), d in zip(box, shape))


__all__ = ["CheckpointFile", "FileSource", "step_of", "whole"]
