"""A .safetensors file read as a restore Source, parsed by its own simple format (no safetensors package).

Scope: the format (huggingface/safetensors' README): 8 bytes, the little-endian length N of a JSON
header; the header, ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str:
str}}``; then the tensors' bytes, C order, little-endian, offsets relative to the end of the header.
Checked before any tensor byte is read: N within the file and MAX_HEADER, every dtype one of
DTYPES, every shape one numpy can make, every tensor's bytes exactly its shape times its itemsize,
the tensors tiling the data exactly (no overlap, no gap, nothing after), and the names making one tree
of at most MAX_PATH_DEPTH levels and FREE_KEYS plus one key per HEADER_BYTES_PER_KEY header bytes. Tensor names are key paths: split at "/" when any name
has one, else at "." (``params.dense.kernel`` and ``params/dense/kernel`` are the same leaf). The
metadata of flax_ckpt's own export (tools/convert.py: ``"format": "flax_ckpt export"`` and the
JSON strings ``step``, ``metrics``, ``metadata``) give the step, metrics and user metadata back; any
other file's metadata is its user metadata, as stored. The arrays are read from the file by offset
when restored, never held whole.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from flax_ckpt._src.checks import MAX_PATH_DEPTH, check_tree, shape_problem
from flax_ckpt._src.errors import CheckpointError, CorruptCheckpointError, format_list
from flax_ckpt._src.foreign.files import CheckpointFile, FileSource, whole
from flax_ckpt._src.records import LeafRecord, dtype_from_name
from flax_ckpt._src.serializers import Box
from flax_ckpt._src.storage.base import as_buffer

MAX_HEADER = 100 << 20  # the safetensors library's own limit
EXPORT = "flax_ckpt export"
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
_BUDGET_SLACK = 64 << 20
FREE_KEYS = 1 << 20  # key paths' keys any header may hold (see _paths)
HEADER_BYTES_PER_KEY = 8  # and one per this many bytes of header (a real name's key takes about 16)


def looks_like(head: bytes, size: int) -> bool:
    """Whether a file's first bytes are a safetensors header's start (a length within the file, then '{')."""
    return len(head) >= 9 and struct.unpack("<Q", head[:8])[0] <= size - 8 and head[8:9] == b"{"


def _header(file: CheckpointFile) -> tuple[dict[str, Any], int]:
    where = file.path
    if file.size < 8:
        raise CorruptCheckpointError(
            f"{where}: {file.size} bytes, shorter than a safetensors header's 8-byte length (truncated)"
        )
    (n,) = struct.unpack("<Q", file.head(8))
    if n > min(MAX_HEADER, file.size - 8):
        raise CorruptCheckpointError(
            f"{where}: its header claims {n} bytes, more than the {file.size - 8} after its length"
            + (f" and the {MAX_HEADER} safetensors allows" if n > MAX_HEADER else "")
            + ": truncated, damaged or crafted; nothing was read"
        )
    raw = bytearray(n)
    file.read(8, memoryview(raw))
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{where}: its header is not valid JSON ({str(e)[:100]}); damaged"
        ) from None
    except MemoryError:
        raise CheckpointError(
            f"{where}: out of memory parsing its {n}-byte header; read it on a machine with more memory"
        ) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: its header is not a JSON object")
    return doc, 8 + n


def parse(file: CheckpointFile) -> tuple[list[LeafRecord], dict[str, tuple[int, int]], dict[str, str] | None]:
    """The leaves (in file order), each leaf's (offset in the file, bytes) and the ``__metadata__``;
    one CorruptCheckpointError naming every bad tensor."""
    doc, start = _header(file)
    where, data_len = file.path, file.size - start
    meta = doc.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise CorruptCheckpointError(f"{where}: its __metadata__ is not a map of strings")
    paths = _paths(list(doc), where, start - 8)
    leaves, spans, bad = [], {}, []
    for name, path in paths.items():
        entry = doc[name]
        problem, dtype, shape, span = _entry(entry, data_len)
        if problem:
            bad.append(f"{name!r}: {problem}")
            continue
        leaf = LeafRecord(path, "numpy", dtype, shape)
        leaves.append(leaf)
        spans[leaf.name] = (start + span[0], span[1] - span[0])
    if bad:
        raise CorruptCheckpointError(
            f"{where}: damaged or crafted tensors (nothing was restored): {format_list(bad)}"
        )
    _check_tiling(doc, paths, data_len, where)
    return leaves, spans, meta


def _entry(entry: Any, data_len: int) -> tuple[str | None, Any, Any, Any]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        return "not {dtype, shape, data_offsets}", None, None, None
    name, shape, span = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(name, str) or name not in DTYPES:
        return f"dtype {str(name)[:20]!r} is none of {', '.join(DTYPES)}", None, None, None
    dtype = dtype_from_name(DTYPES[name])
    problem = shape_problem(shape, dtype.itemsize)
    if problem:
        return problem, None, None, None
    if (
        not isinstance(span, list)
        or len(span) != 2
        or not all(type(x) is int for x in span)
        or not 0 <= span[0] <= span[1] <= data_len
    ):
        return f"data_offsets {str(span)[:60]} are not within the {data_len} bytes of data", None, None, None
    need = math.prod(shape) * dtype.itemsize
    if need != span[1] - span[0]:
        return (
            f"{DTYPES[name]}{shape} needs {need} bytes, its offsets span {span[1] - span[0]}",
            None,
            None,
            None,
        )
    return None, dtype, tuple(shape), tuple(span)


def _check_tiling(doc: dict, paths: dict, data_len: int, where: str) -> None:
    """The tensors' bytes tile the data section: sorted by offset, each starts where the last ended."""
    spans = sorted((tuple(doc[n]["data_offsets"]), n) for n in paths)
    at, last = 0, None
    for (begin, end), name in spans:
        if begin < at:
            raise CorruptCheckpointError(
                f"{where}: tensors {last!r} and {name!r} overlap (bytes {begin} to {at} of "
                "the data); damaged or crafted, nothing was restored"
            )
        if begin > at:
            raise CorruptCheckpointError(
                f"{where}: bytes {at} to {begin} of the data belong to no tensor (before "
                f"{name!r}); damaged or crafted, nothing was restored"
            )
        at, last = max(at, end), name
    if at != data_len:
        raise CorruptCheckpointError(
            f"{where}: {data_len - at} bytes after the last tensor belong to none "
            "(damaged, or two files concatenated); nothing was restored"
        )


class _NameCheck:
    """check_tree's ``fail`` for tensor names: a CorruptCheckpointError naming the file and the name."""

    def __init__(self, where: str, sep: str):
        self.where, self.sep = where, sep

    def fail(self, field: str, why: str):
        raise CorruptCheckpointError(
            f"{self.where}: tensor names that make no tree (split at {self.sep!r}): "
            f"{field}: {why}; rename them in the file (nothing was restored)"
        )


def _paths(names: list[str], where: str, header_bytes: int) -> dict[str, tuple[tuple[str, str], ...]]:
    """{tensor name: key path}: split at "/" when any name has one, else at "."; names that give one
    key path twice, a leaf that another name's path passes through, a path deeper than MAX_PATH_DEPTH,
    or more keys than FREE_KEYS plus one per HEADER_BYTES_PER_KEY bytes of the header (each key takes
    about a hundred bytes of memory) are refused (checks.check_tree: linear in the names' length)."""
    sep = "/" if any("/" in n for n in names) else "."
    check = _NameCheck(where, sep)
    keys = 0
    for n in names:
        if n.count(sep) >= MAX_PATH_DEPTH:
            check.fail(repr(n[:100]), f"{n.count(sep) + 1} keys deep, deeper than {MAX_PATH_DEPTH}")
        keys += n.count(sep) + 1
    if keys > FREE_KEYS + header_bytes // HEADER_BYTES_PER_KEY:
        check.fail(
            f"{len(names)} names",
            f"{keys} keys in a {header_bytes}-byte header, more than its size "
            f"allows ({FREE_KEYS} and one per {HEADER_BYTES_PER_KEY} bytes)",
        )
    paths = {n: tuple(("key", k) for k in n.split(sep)) for n in names}
    check_tree(list(paths.values()), check, lambda i: repr(names[i][:200]))
    return paths


def _export_fields(meta: dict[str, str] | None, where: str) -> tuple[int | None, Any, Any]:
    """(step, metrics, metadata): from flax_ckpt's export, its JSON fields; else (None, None, the
    file's metadata as stored)."""
    if not meta or meta.get("format") != EXPORT:
        return None, None, meta or None
    out = []
    for field in ("step", "metrics", "metadata"):
        try:
            out.append(json.loads(meta.get(field, "null")))
        except (ValueError, RecursionError):
            raise CorruptCheckpointError(
                f"{where}: __metadata__ field {field!r} of a flax_ckpt export is not JSON; damaged"
            ) from None
    step, metrics, metadata = out
    if step is not None and (type(step) is not int or step < 0):
        raise CorruptCheckpointError(f"{where}: __metadata__ field 'step' is {step!r}, not a step number")
    if metrics is not None and not isinstance(metrics, dict):
        raise CorruptCheckpointError(f"{where}: __metadata__ field 'metrics' is not a JSON object")
    return step, metrics, metadata


class SafetensorsSource(FileSource):
    """A .safetensors file as a restore Source: its header checked when opened, each array read from
    the file by offset (one pread into the restore's buffer)."""

    serializer, format = "safetensors", "safetensors"

    def __init__(self, file: CheckpointFile):
        super().__init__(file)
        self.leaves, self._spans, meta = parse(file)
        self.step, self.metrics, self.metadata = _export_fields(meta, file.path)

    @property
    def budget(self) -> int:
        return 2 * self.file.size + _BUDGET_SLACK

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        offset, nbytes = self._spans[leaf.name]
        if whole(box, leaf.array_shape):
            self.file.read(
                offset, memoryview(as_buffer(out.reshape(-1).view(np.uint8))) if out.size else memoryview(b"")
            )
            return
        full = np.empty(leaf.array_shape, leaf.array_dtype)
        self.file.read(
            offset, memoryview(as_buffer(full.reshape(-1).view(np.uint8))) if full.size else memoryview(b"")
        )
        out[...] = full[tuple(slice(s, e) for s, e in box)]

    def view(self, leaf: LeafRecord, box: Box) -> None:
        return None


__all__ = ["SafetensorsSource", "looks_like", "parse"]
