"""A pause of Python's cyclic garbage collector around the engine's per-leaf loops.

Scope: one context manager, ``with gc_paused():``, which is also a decorator, ``@gc_paused()`` (a
function paused as a whole). Restoring or snapshotting a tree of many leaves allocates many small
objects; each allocation burst triggers collections that walk the whole heap, so without a pause the
cost per leaf grows with the size of the tree (measured: 2x from 2k to 20k leaves). The pause is
nested and thread-safe (the collector is re-enabled when the last pause ends, and only if it was
enabled when the first began); nothing the engine allocates is cyclic garbage, and whatever the
caller's code made meanwhile is collected once the pause ends. Used on the caller's thread only
(snapshot, open, restore), never around the background writer, so a save in flight never holds the
collector off while training runs.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
