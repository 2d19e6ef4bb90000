"""Legacy Flax msgpack files read as a restore Source, with the msgpack package and never pickle.

Scope: the bytes ``flax.serialization.to_bytes`` (and ``msgpack_serialize``) write, which
``flax.training.checkpoints.save_checkpoint`` stores as ``<dir>/checkpoint_<step>`` when Orbax is
off: a msgpack tree of maps (flax state dicts: str keys; lists as maps keyed "0", "1", ...), numbers,
strings and None, whose arrays are msgpack extension types (facts from flax 0.12.8's
``flax.serialization``): code 1 an ndarray, itself a msgpack array (shape, dtype name, C-order bytes); code
2 a Python complex (a msgpack array (real, imag)); code 3 a numpy scalar (as code 1, 0-d); arrays
over 1 GiB are split into ``{"__msgpack_chunked_array__": True, "shape": {...}, "chunks": {...}}``
maps of flat chunks. Arrays from ``save_checkpoint_multiprocess`` (``//GDAPlaceholder:`` strings,
their data in a ``<file>_gda`` folder) are not read.

Hostile input: every length msgpack may allocate is bounded by the file's size, nesting deeper than
MAX_DEPTH is refused, the tree's nodes and key paths may cost at most FREE_WORK plus WORK_PER_BYTE per
byte of the file (a file of one-byte leaves is refused before its leaves are built), its key paths
must make one tree (checks.check_tree), dtype names are numpy's and ml_dtypes' numeric types only
(records.dtype_from_name: no object, string or structured dtypes), and an array's bytes must be
exactly its shape times its itemsize, its shape one numpy can make (checks.shape_problem). Every array is decoded when the file is opened (the format has no index: shapes and dtypes
are inside the arrays' own bytes), so a file takes about twice its size in memory while it is opened
and its size after.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from flax_ckpt._src.checks import check_tree, shape_problem
from flax_ckpt._src.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedLeafError,
    format_list,
)
from flax_ckpt._src.foreign.files import CheckpointFile, FileSource, whole
from flax_ckpt._src.records import LeafRecord, dtype_from_name, keystr
from flax_ckpt._src.serializers import Box

MAX_DEPTH = 512  # a model's tree is a few tens deep; msgpack itself stops at 1024
MAX_NDIM = 64  # numpy's own limit
LEAF_COST = 64  # the work of one node of the tree, in units of a key's character (see _Budget)
FREE_WORK = 1 << 24  # what any file's tree may cost: 200,000 leaves named by 20 characters
WORK_PER_BYTE = 2  # and per byte of the file
CHUNKED = "__msgpack_chunked_array__"
GDA_PLACEHOLDER = "//GDAPlaceholder:"
EXT_NDARRAY, EXT_COMPLEX, EXT_NPSCALAR = 1, 2, 3
# First bytes of a msgpack map, array or extension type: what a Flax msgpack file starts with.
_FIRST = set(range(0x80, 0xA0)) | {0xDC, 0xDD, 0xDE, 0xDF, 0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8}


class _Bad:
    """An extension value that failed to decode: what is wrong, named with its key path by the walk."""

    def __init__(self, why: str):
        self.why = why


class _Chunks:
    """A chunked array: its flat chunks, one dtype, and the shape they make."""

    def __init__(self, parts: list[np.ndarray], shape: tuple[int, ...]):
        self.parts, self.shape, self.dtype = parts, shape, parts[0].dtype


def _limits(n: int) -> dict[str, int]:
    return dict(max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=n)


def _ndarray(payload: bytes) -> np.ndarray | _Bad:
    """flax's ``_ndarray_from_bytes`` checked: (shape, dtype name, bytes) with exactly the bytes the
    shape and dtype need, built with np.frombuffer (a read-only view of the decoded bytes)."""
    try:
        obj = msgpack.unpackb(payload, raw=True, use_list=True, **_limits(len(payload)))
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        return _Bad(f"its array record does not decode ({e or type(e).__name__})")
    if not isinstance(obj, list) or len(obj) != 3:
        return _Bad("its array record is not (shape, dtype, bytes)")
    shape, name, data = obj
    name = name.decode("ascii", "replace") if isinstance(name, bytes) else name
    try:
        dtype = dtype_from_name(name)
    except (ValueError, TypeError):
        return _Bad(
            f"its dtype {str(name)[:40]} is not a numeric dtype (object, string and structured dtypes "
            "are never read)"
        )
    problem = shape_problem(shape, dtype.itemsize)
    if problem:
        return _Bad(f"its array {problem}")
    if not isinstance(data, bytes):
        return _Bad("its array bytes are not a msgpack bin")
    need = math.prod(shape) * dtype.itemsize
    if need != len(data):
        return _Bad(
            f"{dtype.name}{str(shape).replace(' ', '')} needs {need} bytes but {len(data)} are stored"
        )
    return np.frombuffer(data, dtype).reshape(shape)


def _complex(payload: bytes) -> complex | _Bad:
    try:
        obj = msgpack.unpackb(payload, **_limits(len(payload)))
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        return _Bad(f"its complex number does not decode ({e or type(e).__name__})")
    if (
        not isinstance(obj, list)
        or len(obj) != 2
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in obj)
    ):
        return _Bad("its complex number is not (real, imag)")
    return complex(obj[0], obj[1])


def _ext(code: int, payload: bytes) -> Any:
    if code in (EXT_NDARRAY, EXT_NPSCALAR):
        return _ndarray(payload)
    if code == EXT_COMPLEX:
        return _complex(payload)
    return _Bad(f"msgpack extension type {code} is none of Flax's (1 ndarray, 2 complex, 3 numpy scalar)")


def _unpack(data: bytearray, where: str) -> Any:
    """The file's msgpack tree, every length bounded by the file's size; the error names the file."""
    if not data:
        raise CorruptCheckpointError(f"{where} is empty (a save that never finished, or a truncated copy)")
    if data[0] not in _FIRST:
        raise CheckpointNotFoundError(
            f"{where} is a file, not a checkpoint folder, and no checkpoint file flax_ckpt reads: not Flax msgpack "
            f"(flax.serialization.to_bytes, flax.training.checkpoints.save_checkpoint: it starts with byte "
            f"0x{data[0]:02x}, not a msgpack map) and not .safetensors. Pass the checkpoint's folder, or such a file"
        )
    try:
        return msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=False, ext_hook=_ext, **_limits(len(data))
        )
    except msgpack.ExtraData:
        raise CorruptCheckpointError(
            f"{where}: bytes after the end of the msgpack tree (two files concatenated, "
            "or damage); restore an older step or re-save it"
        ) from None
    except MemoryError:
        raise CheckpointError(
            f"{where}: out of memory decoding its {len(data)} bytes; read it on a machine with more memory"
        ) from None
    except msgpack.StackError:
        raise CorruptCheckpointError(
            f"{where}: msgpack nested too deep to read (damaged or crafted); nothing was restored"
        ) from None
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise CorruptCheckpointError(
            f"{where}: not a readable Flax msgpack file of {len(data)} bytes ({e or type(e).__name__}): truncated "
            "(a save that never finished, a partial copy) or damaged; restore an older step or re-save it"
        ) from None


def decode(data: bytearray, where: str) -> tuple[list[LeafRecord], dict[str, np.ndarray | _Chunks]]:
    """The leaves of a Flax msgpack file (in file order) and the arrays by leaf name. Every damaged
    leaf is named in one CorruptCheckpointError; leaves flax_ckpt has no kind for (bytes, multiprocess
    placeholders) in one UnsupportedLeafError. The tree's work is bounded by the file's size (``_Budget``)
    and its key paths checked as a native manifest's are (checks.check_tree)."""
    root = _unpack(data, where)
    leaves, arrays, bad, unsupported = [], {}, [], []
    budget = _Budget(len(data), where)
    stack: list[tuple[tuple, Any, int]] = [((), root, 0)]
    while stack:
        path, node, name_len = stack.pop()
        if len(path) > MAX_DEPTH:
            raise CorruptCheckpointError(
                f"{where}: the tree is nested more than {MAX_DEPTH} deep at "
                f"{keystr(path[:8])!r}/...: damaged or crafted; nothing was restored"
            )
        if isinstance(node, dict) and node and CHUNKED not in node:
            keys = list(node)
            wrong = [k for k in keys if isinstance(k, bool) or not isinstance(k, (str, int))]
            if wrong:
                bad.append(f"{keystr(path)!r}: map key {str(wrong[0])[:40]} is not a str or int")
                continue
            lens = [len(str(k)) for k in keys]
            budget.spend(path, len(keys), name_len, sum(lens))
            stack.extend(
                (path + (("key", k),), node[k], name_len + n + 1)
                for k, n in zip(reversed(keys), reversed(lens))
            )
        elif isinstance(node, list) and node:
            budget.spend(path, len(node), name_len, len(node) * len(str(len(node))))
            stack.extend(
                (path + (("idx", i),), node[i], name_len + len(str(i)) + 1)
                for i in reversed(range(len(node)))
            )
        else:
            leaf = _leaf(path, node, arrays, bad, unsupported)
            if leaf is not None:
                leaves.append(leaf)
    if bad:
        raise CorruptCheckpointError(
            f"{where}: damaged or crafted leaves (nothing was restored): {format_list(bad)}. "
            "Restore an older step, or re-save it with flax"
        )
    if unsupported:
        raise UnsupportedLeafError(
            f"{where}: leaves flax_ckpt does not restore (nothing was restored): {format_list(unsupported)}"
        )
    check_tree([leaf.path for leaf in leaves], _TreeCheck(where), lambda i: repr(leaves[i].name[:200]))
    return leaves, arrays


class _Budget:
    """The work a file's tree may cost: LEAF_COST per node plus the lengths of its key path and name,
    at most FREE_WORK plus WORK_PER_BYTE per byte of the file. A tree of real arrays costs a fraction
    of it; a file of one-byte empty leaves, or of many leaves below one long key, is refused before
    its leaves are built (each takes hundreds of bytes of memory wherever a restore goes)."""

    def __init__(self, size: int, where: str):
        self.left, self.size, self.where = FREE_WORK + WORK_PER_BYTE * size, size, where

    def spend(self, path: tuple, children: int, name_len: int, key_chars: int) -> None:
        self.left -= children * (LEAF_COST + len(path) + 1 + name_len + 1) + key_chars
        if self.left < 0:
            raise CorruptCheckpointError(
                f"{self.where}: its tree costs more than its {self.size} bytes can hold (at "
                f"{keystr(path[:8])[:200]!r}: {children} children); a file of tiny or deeply named leaves, "
                "damaged or crafted: nothing was restored"
            )


class _TreeCheck:
    """check_tree's ``fail``: a CorruptCheckpointError naming the file and the leaf."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, why: str):
        raise CorruptCheckpointError(
            f"{self.where}: leaves that make no tree: {field}: {why}; damaged or "
            "crafted, nothing was restored"
        )


def _leaf(path: tuple, node: Any, arrays: dict, bad: list[str], unsupported: list[str]) -> LeafRecord | None:
    name = keystr(path)
    if isinstance(node, _Bad):
        bad.append(f"{name!r}: {node.why}")
    elif isinstance(node, np.ndarray):
        arrays[name] = node
        return LeafRecord(path, "numpy", node.dtype, node.shape)
    elif isinstance(node, dict) and CHUNKED in node:
        found = _chunked(node)
        if isinstance(found, _Bad):
            bad.append(f"{name!r}: {found.why}")
        else:
            arrays[name] = found
            return LeafRecord(path, "numpy", found.dtype, found.shape)
    elif node is None or node == {} or node == []:
        return LeafRecord(path, "empty", value={type(None): "none", dict: "dict", list: "list"}[type(node)])
    elif isinstance(node, (bool, int, float, complex)):
        return LeafRecord(path, "scalar", value=node)
    elif isinstance(node, str) and node.startswith(GDA_PLACEHOLDER):
        unsupported.append(
            f"{name!r} (an array saved by flax's save_checkpoint_multiprocess, stored in the "
            "checkpoint's _gda folder: restore it with flax.training.checkpoints.restore_checkpoint)"
        )
    elif isinstance(node, str):
        return LeafRecord(path, "string", value=node)
    else:
        unsupported.append(
            f"{name!r} (a {type(node).__name__} value: flax_ckpt restores arrays, numbers, strings "
            "and None; read it with flax.serialization.msgpack_restore)"
        )
    return None


def _chunked(node: dict) -> _Chunks | _Bad:
    """flax's ``_unchunk`` checked: flat chunks of one dtype whose sizes add up to the shape's."""
    shape, chunks = node.get("shape"), node.get("chunks")
    if (
        set(node) != {CHUNKED, "shape", "chunks"}
        or not isinstance(shape, dict)
        or not isinstance(chunks, dict)
    ):
        return _Bad("a chunked array without exactly its 'shape' and 'chunks' maps")
    got = [shape.get(str(i)) for i in range(len(shape))]
    dims = [d for d in got if type(d) is int and 0 <= d < 1 << 62]
    if len(got) > MAX_NDIM or len(dims) != len(got):
        return _Bad("a chunked array whose shape is not a map of sizes keyed '0', '1', ...")
    found = [chunks.get(str(i)) for i in range(len(chunks))]
    parts = [p for p in found if isinstance(p, np.ndarray) and p.ndim == 1]
    if not found or len(parts) != len(found):
        return _Bad("a chunked array whose chunks are not flat arrays keyed '0', '1', ...")
    if len({p.dtype for p in parts}) != 1:
        return _Bad(
            f"a chunked array whose chunks have several dtypes ({sorted({p.dtype.name for p in parts})})"
        )
    if sum(p.size for p in parts) != math.prod(dims):
        return _Bad(
            f"a chunked array of shape {dims} whose chunks hold {sum(p.size for p in parts)} elements"
        )
    return _Chunks(parts, tuple(dims))


class MsgpackSource(FileSource):
    """A Flax msgpack file as a restore Source: decoded whole when opened (decode), its arrays held as
    read-only views of the decoded bytes, handed to jax.device_put as they are (``view``). ``step``:
    from the file's name (``checkpoint_<step>``); no metrics or metadata (the format has none)."""

    serializer, format = "flax msgpack", "flax_msgpack"
    budget = None  # every array is in memory already, its size checked against its own bytes

    def __init__(self, file: CheckpointFile, step: int | None):
        super().__init__(file)
        data = file.read_all()
        self.leaves, self._arrays = decode(data, file.path)
        self.step = step

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        stored = self._arrays[leaf.name]
        if isinstance(stored, _Chunks) and whole(box, leaf.array_shape):
            flat, at = out.reshape(-1), 0
            for part in stored.parts:
                flat[at : at + part.size] = part
                at += part.size
            return
        full = np.concatenate(stored.parts).reshape(stored.shape) if isinstance(stored, _Chunks) else stored
        out[...] = full[tuple(slice(s, e) for s, e in box)]

    def view(self, leaf: LeafRecord, box: Box) -> np.ndarray | None:
        stored = self._arrays[leaf.name]
        return stored if isinstance(stored, np.ndarray) and whole(box, leaf.array_shape) else None


__all__ = ["MsgpackSource", "decode"]
