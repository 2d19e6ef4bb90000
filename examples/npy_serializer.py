"""A flax_ckpt serializer written from public names alone: one ``.npy`` file per chunk.

    import flax_ckpt as fc
    from npy_serializer import NpySerializer

    fc.save(path, tree, serializer=NpySerializer())
    with fc.CheckpointManager(directory, serializer=NpySerializer()) as mgr:
        ...

Every shard of every array becomes ``<tag>/<leaf>.<shard>.npy``, which ``np.load`` opens by itself
(dtypes numpy lacks, such as bfloat16, are stored as unsigned integers of their width). The manifest
records the name "npy"; a restore, ``fc.metadata`` and ``flax-ckpt verify`` find the serializer by it
among the entry points of installed packages, so the package that ships it declares in its
pyproject.toml:

    [project.entry-points."flax_ckpt.serializers"]
    npy = "npy_serializer:NpySerializer"

No checksums here: flax_ckpt keeps a crc32c of every block of every object written through
``storage`` and checks every byte ``read`` gets back (tests/test_serializer_api.py runs this file).
"""

from __future__ import annotations

import io
import math
from typing import Sequence

import numpy as np

import flax_ckpt as fc


class NpySerializer(fc.Serializer):
    """Each shard of each array is one .npy file; a chunk record is its box and its file."""

    name = "npy"

    def write(self, storage: fc.Storage, items: Sequence[fc.ArrayItem], *, tag: str) -> fc.Written:
        chunks: dict[int, list[dict]] = {}
        for item in items:
            chunks[item.leaf] = []
            for j, shard in enumerate(item.shards):
                file = f"{tag}/{item.leaf}.{j}.npy"
                buf = io.BytesIO()
                np.save(buf, _portable(shard.data), allow_pickle=False)
                storage.write(file, [buf.getbuffer()])
                chunks[item.leaf].append({"index": [list(b) for b in shard.box], "file": file})
        return fc.Written(chunks)

    def read(
        self, storage: fc.Storage, leaf: fc.StoredArray, box: fc.Box, out: np.ndarray, where: str
    ) -> None:
        for chunk in leaf.chunks:  # a restore into another sharding asks for parts of several chunks
            cbox = [tuple(b) for b in chunk["index"]]
            overlap = [(max(c0, b0), min(c1, b1)) for (c0, c1), (b0, b1) in zip(cbox, box)]
            if any(s >= e for s, e in overlap):
                continue
            nbytes = math.prod(e - s for s, e in cbox) * out.itemsize
            data = np.load(io.BytesIO(storage.read(chunk["file"], nbytes + 65536)), allow_pickle=False)
            src = tuple(slice(s - c, e - c) for (s, e), (c, _) in zip(overlap, cbox)) or (Ellipsis,)
            dst = tuple(slice(s - b, e - b) for (s, e), (b, _) in zip(overlap, box)) or (Ellipsis,)
            out[dst] = data[src].view(out.dtype)


def _portable(data: np.ndarray) -> np.ndarray:
    """``data`` in a dtype .npy files name (ml_dtypes' bfloat16, float8, int4: unsigned of their width)."""
    return data if data.dtype.type.__module__ == "numpy" else data.view(f"u{data.dtype.itemsize}")
