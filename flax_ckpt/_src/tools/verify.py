"""``flax-ckpt verify``: re-read every stored byte of a checkpoint and check every checksum.

Scope: native checkpoints chunk by chunk through their serializer (so one damaged leaf or file never
hides another), Orbax checkpoints leaf by leaf (tensorstore checks what Orbax's codecs checksum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from flax_ckpt._src import formats
from flax_ckpt._src.engine.native import NativeSource
from flax_ckpt._src.engine.restore import Reader, Source
from flax_ckpt._src.errors import CheckpointError, CorruptCheckpointError, InvalidManifestError, StorageError
from flax_ckpt._src.format import MANIFEST
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.tools.common import bar, folder_of

_READ_ERRORS = (CheckpointError, OSError, ValueError)


@dataclass(frozen=True)
class Problem:
    """One piece of damage: ``leaf`` (key path) and ``file`` (relative to the checkpoint) where known."""

    leaf: str | None
    file: str | None
    message: str


def verify(path: Any, *, progress: bool = False) -> list[Problem]:
    """Re-reads every stored byte of ``path`` and checks every checksum; returns what is damaged.

    An empty list means sound. A damaged manifest is one problem (nothing it names can be trusted).
    Raises CheckpointNotFoundError or CheckpointNotCommittedError when there is no committed
    checkpoint to verify."""
    folder = folder_of(path)
    fmt = formats.detect(folder)
    try:
        source = fmt.open(folder)
    except (InvalidManifestError, CorruptCheckpointError) as e:
        if fmt.name == "native":
            return [Problem(None, MANIFEST, str(e))]
        return [Problem(None, None, str(e))]
    except _READ_ERRORS as e:
        if fmt.name == "native":
            raise
        return [Problem(None, None, str(e))]
    if isinstance(source, NativeSource):
        return _verify_native(source, progress)
    return _verify_leaves(source, progress)


def _verify_native(source: NativeSource, progress: bool) -> list[Problem]:
    problems = list(_check_files(source))
    arrays = [leaf for leaf in source.leaves if leaf.is_array]
    with bar(sum(leaf.nbytes for leaf in arrays), "verify", progress) as b:
        for leaf in arrays:
            problems.extend(_verify_leaf(source, leaf, b))
    return problems


def _check_files(source: NativeSource) -> Iterator[Problem]:
    for fname, size in sorted(source.body["files"].items()):
        try:
            source.storage.check_size(fname, size)
        except (CorruptCheckpointError, StorageError, OSError) as e:
            yield Problem(None, fname, str(e))


def _chunk_file(chunk: dict[str, Any]) -> str:
    """The stored object a chunk lives in, relative to the checkpoint folder (raw file or zarr3 cell)."""
    return chunk["file"] if "file" in chunk else f"{chunk['array']}/{chunk['key']}"


def _verify_leaf(source: NativeSource, leaf: LeafRecord, b: Any) -> list[Problem]:
    """Reads every chunk of one leaf; one Problem per damaged file of the leaf (the first failure's
    message, with the count of damaged chunks when there are several)."""
    failures: dict[str, list[str]] = {}
    for chunk in leaf.chunks:
        box = tuple(tuple(x) for x in chunk["index"])
        extents = tuple(e - s for s, e in box)
        if math.prod(extents) == 0 and extents:
            continue
        out = np.empty(extents, leaf.dtype)
        try:
            source.serializer.read(source.storage, leaf.with_chunks([chunk]), box, out,
                                   f"{source.storage.url} leaf {leaf.name!r}")
        except (CorruptCheckpointError, StorageError, OSError) as e:
            failures.setdefault(_chunk_file(chunk), []).append(str(e))
        b.update(out.nbytes)
    return [Problem(leaf.name, f, msgs[0] + (f" (and {len(msgs) - 1} more damaged chunks of this leaf in {f})"
                                             if len(msgs) > 1 else "")) for f, msgs in failures.items()]


def _verify_leaves(source: Source, progress: bool) -> list[Problem]:
    """Reads every array leaf back, one at a time, so that each damaged array is named."""
    reader, problems = Reader(source), []
    arrays = [leaf for leaf in source.leaves if leaf.is_array]
    with bar(sum(leaf.nbytes for leaf in arrays), "verify", progress) as b:
        for leaf in arrays:
            try:
                reader.host(leaf)
            except _READ_ERRORS as e:
                problems.append(Problem(leaf.name, None, str(e)))
            b.update(leaf.nbytes)
    return problems
