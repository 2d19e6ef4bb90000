"""What the tools share: a checkpoint's leaves by key path, read one at a time, and progress bars.

Scope: opening a checkpoint of either format (layouts.py decides) and reading single leaves through
the engine's Reader, as a restore without a target would give them. No policy, no printing.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Any

import numpy as np

from flax_ckpt._src import layouts
from flax_ckpt._src.engine.reader import Reader
from flax_ckpt._src.errors import CheckpointError, CheckpointNotFoundError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.orbax.locate import ORBAX_PARTS
from flax_ckpt._src.storage import Storage, split_location
from flax_ckpt._src.storage.lock import LOCK_FILE

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)


def bar(total: int, desc: str, progress: bool) -> Any:
    """A tqdm bar of bytes on stderr, shown only with ``progress``."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
        leave=False,
        dynamic_ncols=True,
    )


def folder_of(path: Any) -> Storage:
    parent, name = split_location(path)
    return parent.sub(name)


def identity(folder: Storage, record: str | None) -> tuple | None:
    """What tells a step at its name from another one, now: on a local file system, the folder's (or
    file's) inode and modification time and its commit record's; on an object store, whether its commit
    record is there. None when it is gone (deleted, or renamed away to be deleted)."""
    if folder.local_path is None:
        if record and folder.exists(record):
            return ("committed",)
        return ("uncommitted",) if folder.list() else None
    try:
        st = os.lstat(folder.local_path)
    except OSError:
        return None
    found = (st.st_dev, st.st_ino, st.st_mtime_ns)
    if record and stat.S_ISDIR(st.st_mode):
        try:
            r = os.lstat(os.path.join(folder.local_path, record))
            found += (r.st_ino, r.st_mtime_ns, r.st_size)
        except OSError:
            found += (None,)
    return found


def read_info(path: Any, tries: int = 3) -> tuple[Any, dict[str, Any]]:
    """``fc.metadata(path)`` (a CheckpointInfo) for the tools, and {key path: value} of the leaves whose
    value the checkpoint's records hold (Python scalars, strings, empty containers and None: no array
    bytes read). A checkpoint that fails to open counts as damaged only if it stayed the same from
    before the read to after it; one deleted meanwhile (a live manager's retention) is a
    CheckpointNotFoundError that says so; one replaced is read again."""
    folder = folder_of(path)
    if layouts.recognize(folder) is None:
        steps, temporary = layouts.step_folders(folder, files=True)
        if not steps and is_empty_run(folder, temporary):
            raise CheckpointNotFoundError(
                f"no steps in {folder.url}: a run directory without committed "
                "steps (yet), so there is no checkpoint to show"
            )
    for _ in range(tries):
        before = identity(folder, layouts.detect(folder).record)
        try:
            source = layouts.open_checkpoint(folder)
            return source.info(), {leaf.name: _value(leaf) for leaf in source.leaves if not leaf.is_array}
        except CheckpointNotFoundError:
            raise
        except (CheckpointError, OSError, ValueError):
            after = identity(folder, layouts.detect(folder).record)
            if after == before:
                raise
            if after is None:
                raise CheckpointNotFoundError(
                    f"{folder.url} was deleted while it was read (by a live "
                    "manager's retention?): it is gone, not damaged"
                ) from None
    raise CheckpointNotFoundError(
        f"{folder.url} changed under each of {tries} reads (rewritten over and "
        "over?); read it once it is left alone"
    )


def _value(leaf: Any) -> Any:
    """The value the record of a leaf that is no array holds, as a restore without a target gives it."""
    if leaf.kind == "empty":
        return {"none": None, "dict": {}, "list": [], "tuple": ()}[leaf.value]
    return leaf.value


def is_empty_run(folder: Storage, temporary: list[str]) -> bool:
    """Whether ``folder``, which holds no checkpoint and no step, is a run directory without steps
    yet: a folder that is empty, or holds only saves in flight, interrupted deletions, a manager's
    lock file, and files and folders of the run's own (a config file written before the first step,
    ``tensorboard/``, the run's ``compile_cache/``), whatever the run's format. A folder with a part of
    a checkpoint (a native ``data/``, an Orbax item's files: a save that never committed) is not."""
    if folder.kind() != "folder":
        return False
    return all(
        n in temporary or n == LOCK_FILE or folder.sub(n).kind() == "file" or _own_folder(folder.sub(n), n)
        for n in folder.list()
    )


_CHECKPOINT_PARTS = frozenset({"data", *ORBAX_PARTS})  # a native checkpoint's data/, Orbax's item files


def _own_folder(sub: Storage, name: str) -> bool:
    """Whether ``sub`` (named ``name`` in its parent) is a folder that holds no part of a checkpoint:
    not a native checkpoint's ``data/``, and none of Orbax's files directly in it."""
    if name in _CHECKPOINT_PARTS or sub.kind() != "folder":
        return False
    return not any(n in _CHECKPOINT_PARTS or n.startswith("ocdbt.process_") for n in sub.list())


class Leaves:
    """The leaves of one checkpoint (native or Orbax) by key path, read one at a time."""

    def __init__(self, path: Any):
        self.source = layouts.open_checkpoint(folder_of(path))
        self.info = self.source.info()
        self.records = {leaf.name: leaf for leaf in self.source.leaves}
        self._reader = Reader(self.source)

    def keys(self) -> list[str]:
        return list(self.records)

    def nbytes(self, key: str) -> int:
        return self.info.leaves[key].nbytes

    def value(self, key: str) -> Any:
        """The leaf as a restore without a target gives it (numpy arrays, PRNG key arrays, scalars)."""
        return self._reader.value(self.records[key], None, None)

    def data(self, key: str) -> Any:
        """Like ``value``, but a PRNG key as its raw key data (a numpy array) so it can be compared."""
        leaf = self.records[key]
        if leaf.kind == "prng_key":
            return self._reader.host(leaf)
        v = self.value(key)
        return (
            np.asarray(jax.random.key_data(v))
            if isinstance(v, jax.Array) and jax.numpy.issubdtype(v.dtype, jax.dtypes.prng_key)
            else v
        )
