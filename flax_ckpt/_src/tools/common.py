"""What the tools share: a checkpoint's leaves by key path, read one at a time, and progress bars.

Scope: opening a checkpoint of either format (layouts.py decides) and reading single leaves through
the engine's Reader, as a restore without a target would give them. No policy, no printing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from flax_ckpt._src import layouts
from flax_ckpt._src.engine.reader import Reader
from flax_ckpt._src.storage import Storage, split_location


def bar(total: int, desc: str, progress: bool) -> tqdm:
    """A tqdm bar of bytes on stderr, shown only with ``progress``."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                leave=False, dynamic_ncols=True)


def folder_of(path: Any) -> Storage:
    parent, name = split_location(path)
    return parent.sub(name)


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
        return np.asarray(jax.random.key_data(v)) if isinstance(v, jax.Array) and jax.dtypes.issubdtype(
            v.dtype, jax.dtypes.prng_key) else v
