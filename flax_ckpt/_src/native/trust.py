"""What a step that shares bytes may refer to without reading it: bytes its writer verified.

Scope: ``Trust``, the chunks of a run one writer (a manager's layout; each process its own) may refer
to without reading them (it wrote their files, or read them back equal to what it saves), forgotten
when a restore finds damage there (native/damage.py). Not here: the comparison of a piece with its
base's chunk (sharing.Sharer), what a damaged step means for later saves (damage.py).
"""

from __future__ import annotations

import threading
from typing import Any

from flax_ckpt._src.storage import Storage

Key = tuple[str, str, str | None, str, int]  # (run url, step folder, id, file, offset) of a stored chunk
_MAX = 4096  # files (of any step) a Trust keeps; beyond, it starts afresh: a read more, never a wrong share


class Trust:
    """The chunks one writer (a manager's layout) may refer to without reading them: files it wrote
    (a save of its own, by its id) and chunks it read back equal to bytes it saved. Thread-safe."""

    def __init__(self) -> None:
        # (url, step folder, id, file) -> offsets of its chunks read back equal
        self._verified: dict[tuple[str, str, str | None, str], set[int]] = {}
        self._wrote: dict[tuple[str, str, str], frozenset[str]] = {}  # (url, step folder, id) -> files
        self._mutex = threading.Lock()

    def vouched(self, key: Key) -> bool:
        """Whether the chunk at ``key`` may be referred to without reading it."""
        url, step, ident, file, offset = key
        if ident is not None and file in self._wrote.get((url, step, ident), ()):
            return True
        return offset in self._verified.get((url, step, ident, file), ())

    def vouch(self, key: Key) -> None:
        """The chunk at ``key`` was read back equal to bytes a save holds."""
        with self._mutex:
            if len(self._verified) >= _MAX and key[:4] not in self._verified:
                self._verified.clear()
            self._verified.setdefault(key[:4], set()).add(key[4])

    def wrote(self, run: Storage, name: str, ident: str, files: Any) -> None:
        """This writer wrote ``files`` (names) of the save ``ident`` of step folder ``name`` in ``run``."""
        with self._mutex:
            if len(self._wrote) >= _MAX:
                self._wrote.clear()
            self._wrote[(run.url, name, ident)] = frozenset(files)

    def forget(self, run: Storage) -> None:
        """Nothing of ``run`` is vouched for any more: each chunk is read again before it is shared."""
        with self._mutex:
            self._verified = {k: v for k, v in self._verified.items() if k[0] != run.url}
            self._wrote = {k: v for k, v in self._wrote.items() if k[0] != run.url}
