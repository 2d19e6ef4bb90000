"""Whether two buffers hold the same bytes: one comparison for every place that compares bytes whole.

Used by a snapshot comparing a shard with its arena's bytes (engine/snapshot.py), a save comparing a
piece with an earlier step's chunk read back (native/sharing.py), the memory tiers' differential
copies (tiers/encode.py) and the second read of a foreign file (foreign/files.py). Bytes, not values:
NaNs and signed zeros are compared as bits.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

_PROBE = 4 << 10  # bytes compared first by numpy (changed bytes usually differ at once)
_PIECE = 512 << 10  # then this many at a time (within a core's cache)


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's memcmp (a call through ctypes releases the GIL), or None where there is none."""
    try:
        f = ctypes.CDLL(None).memcmp  # the C library, loaded in every POSIX process
    except (OSError, TypeError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    return f


_memcmp = _libc_memcmp()


def _u8(buf: Any) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        assert buf.flags.c_contiguous, "compared as bytes"
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, np.uint8)


def same_bytes(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (C-contiguous arrays or contiguous buffers) hold the same bytes, stopping
    at the first difference: the C library's memcmp (about 1.5 times numpy's speed), else numpy in
    pieces that stay in cache, the first small, as 8-byte words where they divide."""
    x, y = _u8(a), _u8(b)
    n = x.nbytes
    if n != y.nbytes:
        return False
    if not n:
        return True
    if _memcmp is not None:  # both arrays stay alive (and contiguous) for the call
        return _memcmp(x.__array_interface__["data"][0], y.__array_interface__["data"][0], n) == 0
    lo, size = 0, _PROBE
    while lo < n:
        hi = min(n, lo + size)
        w = lo + (hi - lo) // 8 * 8
        if not np.array_equal(x[lo:w].view(np.uint64), y[lo:w].view(np.uint64)) or not np.array_equal(
            x[w:hi], y[w:hi]
        ):
            return False
        lo, size = hi, _PIECE
    return True
