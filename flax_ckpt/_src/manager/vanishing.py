"""Whether a step folder that failed to read is being deleted (by the run a read-only manager follows).

Scope: one question, asked only after a step failed to open or read: is its folder going away? Orbax's
own manager deletes a step by removing its files first, many at a time and in no fixed order, then the
folder: meanwhile the step is neither whole nor gone, and its failures are those of damage (a missing
file, no commit record). The folder is watched instead of judged at once: gone, or losing entries at
every look, it is being deleted; unchanged for ``_STABLE`` looks in a row, it is what it is (damage,
or a save in flight). Local folders only (an object store's step is a listing, not a folder that
empties). No clock decides: the looks wait for the deletion to make progress, ``_LOOKS`` at most.
"""

from __future__ import annotations

import os
import time

from flax_ckpt._src.storage import Storage

_PAUSE = 0.02  # seconds between looks
_STABLE = 3  # looks in a row without a change: the folder is not being deleted
_LOOKS = 500  # looks at most (a deletion that keeps removing files for that long is still a deletion)


def _entries(path: str) -> frozenset[str] | None:
    """Every path under ``path`` (relative), or None when it is gone."""
    if not os.path.lexists(path):
        return None
    found = []
    for top, dirs, files in os.walk(path):
        found += [os.path.relpath(os.path.join(top, n), path) for n in dirs + files]
    return frozenset(found) if os.path.lexists(path) else None


def being_deleted(storage: Storage, name: str) -> bool:
    """Whether step folder ``name`` of ``storage`` is gone or being deleted: watched until it is gone
    (True), or unchanged for a few looks in a row (False), or it gains entries (False: a writer)."""
    root = storage.local_path
    if root is None:  # an object store: its listing said (the caller's)
        return False
    path = os.path.join(root, name)
    last, stable = _entries(path), 0
    for _ in range(_LOOKS):
        if last is None:
            return True
        time.sleep(_PAUSE)
        now = _entries(path)
        if now is None:
            return True
        if now == last:
            stable += 1
            if stable >= _STABLE:
                return False
        elif not now < last:
            return False  # it gains entries: written, not deleted
        else:
            stable = 0
        last = now
    return True


__all__ = ["being_deleted"]
