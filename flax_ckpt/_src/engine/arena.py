"""Page-aligned host memory that an async save's copies are laid out in, back to back, save after save.

Scope: one ``Arena`` per saver (a CheckpointManager keeps it with its reusable snapshot). It is a
snapshot's ``into`` (engine/snapshot.py): it hands out buffers in the order they are asked for, each
right after the previous one (at the dtype's alignment), from a private anonymous map. What that buys
a save that is written to files:

- copying CPU jax arrays releases them at once, so XLA can donate them to the next step (a host view
  held until the write ends makes it allocate and free new buffers every step);
- the crc32c of every block is made during the copy, while the bytes are in cache
  (``snapshot(checksum=...)``), so the writer never reads them again;
- the raw serializer puts buffers that lie back to back into one file in that order, so the file is a
  run of the arena's bytes, which the local storage writes with O_DIRECT straight from it (no staging
  copy; storage/local.py);
- the pages are faulted once, when the arena is first filled, not at every save;
- on Linux the map is advised to use transparent huge pages (``MADV_HUGEPAGE``; a no-op where the
  host's THP setting is "never"): 2 MiB pages fault 512 times fewer when the arena is first filled, and
  an O_DIRECT write pins 512 times fewer pages (measured: benchmarks/README.md, "Figures from the
  module docstrings"). Where the host's ``defrag`` setting compacts
  memory for advised maps, faulting a new arena waits for that once, on the writer's thread.

An arena is reset and filled again only when nothing reads its previous contents (the manager takes a
snapshot only once the previous save is durable). It never grows: a save that asks for more than it
holds gets no buffer for the rest (the snapshot copies those as without it) and ``wanted`` says what
the next arena needs: ``Arena.after`` makes that one, its pages faulted, once the save is durable, on
the writer's thread, and ``Arena.fit`` hands it to the next snapshot.

What an arena holds after a save is that save's bytes, and the next save of the same structure is
given the same buffers: its snapshot compares each large shard with the buffer's bytes before copying
it (engine/snapshot.py; not the blocks whose bytes changed at each of the last saves), and where they
are equal it neither copies nor checksums them. ``ledger`` says
what the last fill put where (the shard and the crc32c of its blocks: set by a snapshot once every copy
into the arena is made, emptied when the next one starts), ``saved_as`` which committed step wrote
those bytes (set by the native layout once the step is committed, cleared when a snapshot starts): a
shard found equal is then known, byte for byte, to be that step's chunk (native/sharing.py shares it
without reading or hashing it).
"""

from __future__ import annotations

import math
import mmap

import numpy as np

PAGE = mmap.PAGESIZE


def _up(n: int, to: int) -> int:
    return -(-n // to) * to


class Arena:
    """``capacity`` bytes (rounded up to pages) of host memory handed out back to back; see the module."""

    def __init__(self, capacity: int = 0):
        self.capacity = _up(max(0, capacity), PAGE)
        # private: a process forked later gets its own copy on write, not pages it shares with this one
        self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE) if self.capacity else None
        if self._map is not None and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel built without THP: 4 KiB pages, as without the advice
                pass
        self._bytes = np.frombuffer(self._map, np.uint8) if self._map is not None else np.empty(0, np.uint8)
        self.used = 0  # bytes handed out since the last reset (with alignment gaps)
        self.wanted = 0  # bytes asked for since the last reset, given or not
        self.ledger: dict[int, tuple[tuple, np.ndarray, tuple[int, ...]]] = {}  # offset -> (what the last
        #   complete fill copied there: the leaf's record, the shard's box; the crc32c of its blocks;
        #   per block, how many saves in a row its bytes changed): see the module
        self.saved_as: tuple[str, str] | None = None  # (step folder, manifest id) of the committed save
        #   whose bytes the last fill holds; None when unknown
        self.fills = 0  # snapshots that began filling it (engine/snapshot.py)
        self._base = self._bytes.__array_interface__["data"][0]
        self._given: dict[int, int] = {}  # id of each buffer handed out since the last reset -> its
        #   offset, so that ``offset`` need not ask numpy (about 1.4 us an array); ``_kept`` holds those
        #   buffers alive, so that no other object has one of those ids (ints only: nothing for the
        #   garbage collector to follow)
        self._kept: list[np.ndarray] = []

    @classmethod
    def fit(cls, previous: "Arena | None") -> "Arena":
        """``previous`` reset for the next save when it held all that its last save asked for; else a new
        arena of that size (an empty one the first time: that save copies as without an arena)."""
        if previous is not None and previous.wanted <= previous.capacity:
            previous.used = previous.wanted = 0
            previous._given, previous._kept = {}, []
            return previous
        return cls(previous.wanted if previous is not None else 0)

    def after(self) -> "Arena":
        """The arena for the next save, asked for once this one's save is durable (on the writer's
        thread): this one when it held all that its save asked for (``fit`` resets it), else a new one
        of that size with its pages faulted now, beside training, rather than by the next save's copy on
        the caller's thread (a 48 MiB arena's first fill: about 20 ms with 4 KiB pages, 130-175 ms where
        the kernel compacts memory for huge pages)."""
        if self.wanted <= self.capacity:
            return self
        arena = Arena(self.wanted)
        arena._bytes[::PAGE] = 0  # one write per page: every page allocated (a huge page at its first)
        return arena

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """A C-contiguous array of ``shape`` and ``dtype`` right after the last one handed out, or None
        when the arena is full."""
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        self.wanted = _up(self.wanted, dtype.alignment) + n
        start = _up(self.used, dtype.alignment)
        if start + n > self.capacity:
            return None
        self.used = start + n
        buf = np.ndarray(shape, dtype, buffer=self._map, offset=start)
        self._given[id(buf)] = start
        self._kept.append(buf)
        return buf

    def offset(self, a: np.ndarray) -> int:
        """Where buffer ``a`` (one this arena handed out) starts in its memory."""
        at = self._given.get(id(a))
        return at if at is not None else a.__array_interface__["data"][0] - self._base

    def holds(self, a: np.ndarray) -> bool:
        """Whether ``a`` lies in this arena's memory."""
        return self._map is not None and np.may_share_memory(a, self._bytes)


__all__ = ["Arena"]
