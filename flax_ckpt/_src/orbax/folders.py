"""The arrays of a local Orbax item saved with one folder per array (``use_ocdbt=False``), read without
tensorstore, so that a hostile folder needs no walk before the read.

Every file is reached from the item folder one name at a time, each folder and file opened
O_NOFOLLOW (a symlink is never followed) and O_NONBLOCK (a FIFO cannot block the open; the fstat that
gives the file's size refuses it, and anything else but a regular file, before a byte is read). So the
checks cost no pass of their own: no walk, no stat before each open (which measured 2-3% of a restore
of 20,000 small arrays). Opening an array reads only its zarr metadata; ``stored_bytes`` looks at
(lstat) every chunk file, for the restore's memory bound (read._budget), only when that bound is
asked. Reading decodes only the chunks a box needs, each to exactly its declared size.

What is read here is what Orbax 0.12.8 and flax_ckpt write in that layout: zarr v2 with zstd or no
compressor, and zarr3 with ``bytes`` then ``zstd``/``crc32c``, inside ``sharding_indexed`` (whose index
carries a crc32c) or not. Anything else raises ``Unsupported``: another codec or dtype, a symlink
anywhere below the item folder (symlinks inside a checkpoint are allowed, and the walk in
locate.walk resolves them), a grid of more than MAX_CHUNKS chunks. The caller then walks the folder and reads it through tensorstore, as before. A missing chunk
is damage (Orbax writes every chunk, and read.py asks tensorstore for no fill value either).

Chosen over a library: zarr-python reads these folders but opens files by path (following links) and
would be one more large dependency; zstandard decodes and crc32c checks, the rest is the zarr spec's
chunk keys and the sharding index, about 200 lines.
"""

from __future__ import annotations

import errno
import functools
import itertools
import json
import math
import os
import stat
import threading
from typing import TYPE_CHECKING, Any, Literal, Sequence

import crc32c
import numpy as np
import zstandard

from flax_ckpt._src.checks import shape_problem
from flax_ckpt._src.errors import CorruptCheckpointError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.storage.base import as_buffer

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import ml_dtypes
else:
    ml_dtypes = lazy("ml_dtypes", globals())  # imported on first use (lazy.py)

MAX_CHUNKS = 1 << 16  # chunk files of one array looked at when it is opened; more: Unsupported
MAX_METADATA = 1 << 20
MAX_CHUNK_SLACK = 64 << 20  # the bytes a chunk may declare beyond its array's (check_chunk)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NO_CHUNK = (1 << 64) - 1  # a sharding index entry of an inner chunk that was never written
_ZSTD = threading.local()  # a zstandard decompressor per thread (they are not thread-safe)


class Unsupported(Exception):
    """This array folder is not one read here; read it through tensorstore after walking the folder."""


def _refuse(path: str, mode: int) -> CorruptCheckpointError:
    kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO, device or socket"
    return CorruptCheckpointError(f"{path} is not a regular file ({kind}); refusing to read the checkpoint")


def _open_folder(root: str, parts: Sequence[str]) -> int:
    """An fd of the folder ``root/parts...``: ``root`` opened as given, every part O_NOFOLLOW beneath it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if not parts:
        return fd
    try:
        return _open_below(fd, parts, root)
    finally:
        os.close(fd)


def _open_below(fd: int, parts: Sequence[str], base: str) -> int:
    """An fd of the folder ``parts`` below the open folder ``fd`` (``base`` its path, for errors), every
    part opened O_NOFOLLOW: Unsupported at a symlink, CorruptCheckpointError at a file or FIFO."""
    cur, path = fd, base
    try:
        for name in parts:
            path = os.path.join(path, name)
            try:
                sub = os.open(name, _DIR, dir_fd=cur)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                mode = os.stat(name, dir_fd=cur, follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    raise Unsupported(f"{path} is a symlink") from None
                if stat.S_ISREG(mode):
                    raise CorruptCheckpointError(
                        f"{path} is a file where a folder was expected; refusing to read the checkpoint"
                    ) from None
                raise _refuse(path, mode) from None
            if cur != fd:
                os.close(cur)
            cur = sub
    except BaseException:
        if cur != fd:
            os.close(cur)
        raise
    return cur


def _look(folder: int, where: str, name: str) -> os.stat_result | None:
    """lstat of ``name`` in the open ``folder`` (``where`` its path): None when missing; Unsupported for
    a symlink; CorruptCheckpointError for anything but a regular file."""
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        if stat.S_ISLNK(st.st_mode):
            raise Unsupported(f"{where}/{name} is a symlink")
        raise _refuse(f"{where}/{name}", st.st_mode)
    return st


def _open_file(folder: int, where: str, name: str, max_bytes: int) -> tuple[int, os.stat_result]:
    """An fd of the regular file ``name`` in ``folder``, and its fstat (refused above ``max_bytes``):
    opened O_NOFOLLOW|O_NONBLOCK (a symlink is Unsupported; a FIFO is opened without blocking, then
    refused)."""
    try:
        fd = os.open(name, _FILE, dir_fd=folder)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}/{name} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Unsupported(f"{where}/{name} is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since it was looked at
            raise _refuse(f"{where}/{name}", st.st_mode)
        if st.st_size > max_bytes:
            raise CorruptCheckpointError(
                f"{where}/{name} holds {st.st_size} bytes, more than the {max_bytes} it "
                "may; refusing to read it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _pread(fd: int, path: str, st: os.stat_result, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes at each (offset, length) of ``ranges`` in the open file ``path`` (``st``: its fstat
    when opened, checked again after reading: a file written meanwhile is a CorruptCheckpointError,
    never a mix of two versions; Orbax's chunks carry no checksum)."""
    out = []
    for offset, length in ranges:
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CorruptCheckpointError(
                f"{path}: {length} bytes at offset {offset} lie past its end ({st.st_size} bytes)"
            )
        out.append(data)
    after = os.fstat(fd)
    if after.st_nlink == 0:  # unlinked meanwhile (which moves its ctime): missing, as at its open
        raise CorruptCheckpointError(f"{path} is missing (deleted while it was being read)")
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
        raise CorruptCheckpointError(
            f"{path} changed while it was being read (rewritten); restore it again once nothing writes it"
        )
    return out


def _read_file(folder: int, where: str, name: str, max_bytes: int) -> bytes:
    """The whole of regular file ``name`` in ``folder`` (see _open_file)."""
    fd, st = _open_file(folder, where, name, max_bytes)
    try:
        return _pread(fd, f"{where}/{name}", st, [(0, st.st_size)])[0]
    finally:
        os.close(fd)


def _size(shape: Sequence[int], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def check_chunk(chunk: Sequence[int], shape: Sequence[int], dtype: np.dtype) -> None:
    """A chunk is decoded whole (tensorstore too): one that declares more than its array's bytes plus
    MAX_CHUNK_SLACK is refused (ValueError) before anything is allocated for it."""
    if _size(chunk, dtype) > _size(shape, dtype) + MAX_CHUNK_SLACK:
        raise ValueError(
            f"chunks of shape {list(chunk)} ({_size(chunk, dtype)} bytes each) for an array of "
            f"shape {list(shape)}: more than a chunk of it can hold; refusing to decode them"
        )


@functools.cache
def _ml_dtypes() -> frozenset[str]:
    return frozenset(
        n
        for n in dir(ml_dtypes)
        if isinstance(getattr(ml_dtypes, n), type) and issubclass(getattr(ml_dtypes, n), np.generic)
    )


def _dtype(name: Any, zarr3: bool) -> np.dtype:
    """The numpy dtype of a zarr v2 ``dtype`` ("<f4", "|b1", "bfloat16") or zarr3 ``data_type``."""
    bare = name.lstrip("<>|") if isinstance(name, str) else None
    if bare in _ml_dtypes():
        return np.dtype(getattr(ml_dtypes, bare))
    if bare is None or (zarr3 and bare != name):
        raise Unsupported(f"dtype {name!r}")
    try:
        dt = np.dtype(name)
    except TypeError:
        raise Unsupported(f"dtype {name!r}") from None
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise Unsupported(f"dtype {name!r}")
    return dt


def _ints(value: Any, n: int | None, what: str, positive: bool) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or (n is not None and len(value) != n)
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and (d > 0 if positive else d >= 0) for d in value
        )
    ):
        raise ValueError(
            f"{what} {value!r} is not a list of {'positive' if positive else 'non-negative'} integers"
            + (f" of length {n}" if n is not None else "")
        )
    return tuple(value)


class _Chain:
    """A zarr3 codec list of ``bytes`` then zstd/crc32c (a zarr v2 chunk is one too), decoding one chunk
    of ``shape`` (its elements in ``order``)."""

    def __init__(self, codecs: Any, dtype: np.dtype, shape: tuple[int, ...], order: Literal["C", "F"] = "C"):
        if (
            not isinstance(codecs, list)
            or not codecs
            or not isinstance(codecs[0], dict)
            or codecs[0].get("name") != "bytes"
        ):
            raise Unsupported(f"codecs {codecs!r}")
        endian = (codecs[0].get("configuration") or {}).get("endian", "little")
        if endian not in ("little", "big"):
            raise Unsupported(f"endian {endian!r}")
        self.dtype = dtype.newbyteorder("<" if endian == "little" else ">") if dtype.itemsize > 1 else dtype
        self.shape, self.raw = shape, _size(shape, dtype)
        self.order: Literal["C", "F"] = order
        self.steps: list[tuple[str, int]] = []  # (codec, the size it decodes to; -1 unknown), as encoded
        size = self.raw
        for c in codecs[1:]:
            name = c.get("name") if isinstance(c, dict) else None
            if name == "crc32c":
                self.steps.append(("crc32c", size))
                size = -1 if size < 0 else size + 4
            elif name == "zstd" and size >= 0:
                self.steps.append(("zstd", size))
                size = -1
            else:
                raise Unsupported(f"codec {c!r}")
        self.checksummed = any(s == "crc32c" for s, _ in self.steps)
        self.compressed = any(s == "zstd" for s, _ in self.steps)

    def decode(self, data: bytes, path: str, into: np.ndarray | None = None) -> np.ndarray:
        """The chunk ``data`` holds, as an array of ``shape``: decoded into ``into`` where given (a
        C-contiguous array of ``shape`` and ``dtype``; zstd writes straight into it)."""
        view, last, in_place = memoryview(data), len(self.steps) - 1, False
        for k, (codec, size) in enumerate(reversed(self.steps)):
            if codec == "crc32c":
                if len(view) < 4 or crc32c.crc32c(view[:-4]) != int.from_bytes(view[-4:], "little"):
                    raise CorruptCheckpointError(f"{path}: checksum mismatch (crc32c codec)")
                view = view[:-4]
            else:
                in_place = into is not None and k == last
                view = unzstd(
                    view,
                    size,
                    path,
                    into.reshape(-1).view(np.uint8) if into is not None and in_place else None,
                )
        if len(view) != self.raw:
            raise CorruptCheckpointError(
                f"{path}: a chunk of {len(view)} bytes where {self.raw} were declared"
            )
        if in_place and into is not None:  # (in_place: into is given)
            return into
        chunk = np.frombuffer(view, self.dtype).reshape(self.shape, order=self.order)
        if into is not None:
            into[...] = chunk
            return into
        return chunk


def unzstd(data: Any, size: int, path: str, into: np.ndarray | None = None) -> memoryview:
    """One zstd frame decoded to exactly ``size`` bytes, into ``into`` (a uint8 array of ``size``) or a
    new buffer: never more allocated, a frame declaring another size, cut short, or with bytes after it
    refused."""
    dctx = getattr(_ZSTD, "d", None)
    if dctx is None:
        dctx = _ZSTD.d = zstandard.ZstdDecompressor()
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, size):
            raise CorruptCheckpointError(
                f"{path}: a zstd frame of {declared} bytes where a chunk of {size} was declared"
            )
        out = memoryview(as_buffer(into) if into is not None else bytearray(size))
        with dctx.stream_reader(data, read_size=max(1, len(data)), read_across_frames=True) as reader:
            n = 0
            while n < size:
                got = reader.readinto(out[n:])
                if not got:
                    break
                n += got
            try:
                more = reader.read(1)
            except zstandard.ZstdError:  # not a frame
                more = b"?"
    except zstandard.ZstdError as e:
        raise CorruptCheckpointError(f"{path}: zstd: {e}") from None
    if n != size or more:
        raise CorruptCheckpointError(
            f"{path}: a zstd chunk of {n if not more else 'more than ' + str(n)} bytes "
            f"where {size} were declared (cut short, or bytes past its frame)"
        )
    return out


class _Layout:
    """What one zarr metadata file says, parsed once per distinct file (an array's folder shares it
    with every array of the same shape and dtype): ``shape``, ``chunk``, ``dtype`` (native byte
    order), ``compressed``, ``checksummed``, chunk keys and how a chunk decodes."""

    def __init__(self, raw: bytes, zarr3: bool):
        self.metadata = json.loads(raw)
        if not isinstance(self.metadata, dict):
            raise ValueError("not a JSON object")
        self.index: _Chain | None = None
        (self._zarr3 if zarr3 else self._zarr2)(self.metadata)
        problem = shape_problem(list(self.shape), self.dtype.itemsize)
        if problem:  # e.g. [0, 2**61, 2**61]: nothing to read, but no array numpy can make
            raise ValueError(problem)
        self.grid = tuple(-(-d // c) for d, c in zip(self.shape, self.chunk))
        self.chunks = math.prod(self.grid)
        if self.chunks > MAX_CHUNKS or (self.index is not None and math.prod(self.per_shard) > MAX_CHUNKS):
            raise Unsupported(f"{self.chunks} chunks")
        check_chunk(self.inner.shape, self.shape, self.dtype)
        self.folders: dict[tuple[str, ...], list[str]] = {}  # chunk files by their folder below the array's
        for idx in itertools.product(*map(range, self.grid)) if self.chunks else ():  # product makes tuples
            key = self.key(idx)
            self.folders.setdefault(key[:-1], []).append(key[-1])

    def _zarr2(self, m: dict[str, Any]) -> None:
        if (
            m.get("zarr_format") != 2
            or m.get("filters") not in (None, [])
            or m.get("order", "C") not in ("C", "F")
        ):
            raise Unsupported("zarr v2 filters or order")
        self.shape = _ints(m["shape"], None, "shape", False)
        self.chunk = _ints(m["chunks"], len(self.shape), "chunks", True)
        self.stored_dtype = _dtype(m["dtype"], False)
        comp = m.get("compressor")
        if comp is not None and not (isinstance(comp, dict) and comp.get("id") == "zstd"):
            raise Unsupported(f"compressor {comp!r}")
        sep = m.get("dimension_separator", ".")
        if sep not in (".", "/"):
            raise Unsupported(f"dimension_separator {sep!r}")
        self.dtype, self.compressed, self.checksummed = (
            self.stored_dtype.newbyteorder("="),
            comp is not None,
            False,
        )
        endian = {"<": "little", ">": "big"}.get(self.stored_dtype.byteorder, "little")
        codecs = [{"name": "bytes", "configuration": {"endian": endian}}] + (
            [{"name": "zstd"}] if comp else []
        )
        self.inner = _Chain(codecs, self.dtype, self.chunk, m.get("order", "C"))
        self.key = lambda idx: tuple(sep.join(map(str, idx)).split("/")) if idx else ("0",)

    def _zarr3(self, m: dict[str, Any]) -> None:
        if m.get("zarr_format") != 3 or m.get("node_type") != "array" or m.get("storage_transformers"):
            raise Unsupported("zarr3 node")
        self.shape = _ints(m["shape"], None, "shape", False)
        grid = m["chunk_grid"]
        if grid.get("name") != "regular":
            raise Unsupported(f"chunk grid {grid!r}")
        self.chunk = _ints(grid["configuration"]["chunk_shape"], len(self.shape), "chunk_shape", True)
        self.dtype = _dtype(m["data_type"], True)
        enc: dict[str, Any] = m.get("chunk_key_encoding") or {"name": "default"}
        sep = (enc.get("configuration") or {}).get("separator", "/" if enc.get("name") == "default" else ".")
        if enc.get("name") not in ("default", "v2") or sep not in (".", "/"):
            raise Unsupported(f"chunk key encoding {enc!r}")
        if enc["name"] == "default":
            self.key = lambda idx: tuple(("c" + "".join(sep + str(i) for i in idx)).split("/"))
        else:
            self.key = lambda idx: tuple(sep.join(map(str, idx)).split("/")) if idx else ("0",)
        codecs = m["codecs"]
        if (
            isinstance(codecs, list)
            and len(codecs) == 1
            and isinstance(codecs[0], dict)
            and codecs[0].get("name") == "sharding_indexed"
        ):
            conf = codecs[0]["configuration"]
            inner_shape = _ints(conf["chunk_shape"], len(self.shape), "inner chunk_shape", True)
            if any(c % i for c, i in zip(self.chunk, inner_shape)):
                raise ValueError(f"inner chunk shape {list(inner_shape)} does not divide {list(self.chunk)}")
            self.per_shard = tuple(c // i for c, i in zip(self.chunk, inner_shape))
            self.inner = _Chain(conf["codecs"], self.dtype, inner_shape)
            self.index = _Chain(conf.get("index_codecs"), np.dtype("<u8"), (*self.per_shard, 2))
            location = conf.get("index_location", "end")
            if (
                self.index.compressed
                or self.index.dtype != np.dtype("<u8")
                or location not in ("start", "end")
            ):
                raise Unsupported("sharding index codecs")
            self.index_at_end = location == "end"
            self.index_size = math.prod(self.per_shard) * 16 + 4 * sum(
                s == "crc32c" for s, _ in self.index.steps
            )
        else:
            self.inner = _Chain(codecs, self.dtype, self.chunk)
        self.compressed, self.checksummed = self.inner.compressed, self.inner.checksummed


_LAYOUTS: dict[tuple[bytes, bool], _Layout] = {}  # shared by every array with the same metadata file
_LAYOUTS_MAX, _CACHED_MAX = 4096, 4096  # layouts kept; bytes of a metadata file kept as a key


def _layout(raw: bytes, zarr3: bool) -> _Layout:
    found = _LAYOUTS.get((raw, zarr3))
    if found is None:
        found = _Layout(raw, zarr3)
        if len(raw) <= _CACHED_MAX:
            if len(_LAYOUTS) >= _LAYOUTS_MAX:
                _LAYOUTS.clear()
            _LAYOUTS[raw, zarr3] = found
    return found


class FolderArray:
    """One array folder of a local Orbax item, opened: ``shape``, ``dtype`` (native byte order),
    ``metadata`` (its zarr metadata as stored), ``compressed``; ``stored_bytes()``, ``read(box, out)``."""

    def __init__(self, root: str, param: str, zarr3: bool):
        self.root, self.parts, self.path = root, tuple(param.split("/")), root + "/" + param
        name = "zarr.json" if zarr3 else ".zarray"
        fd = _open_folder(root, self.parts)
        try:
            raw = _read_file(fd, self.path, name, MAX_METADATA)
            try:
                self.layout = _layout(raw, zarr3)
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                raise CorruptCheckpointError(
                    f"{self.path}/{name}: not zarr metadata this layout writes: {e}"
                ) from None
        finally:
            os.close(fd)
        lay = self.layout
        self.shape, self.dtype, self.metadata, self.compressed = (
            lay.shape,
            lay.dtype,
            lay.metadata,
            lay.compressed,
        )

    def stored_bytes(self) -> int:
        """The bytes of the chunk files the grid declares, each looked at (lstat): a missing one counts
        0 (its read says so), a FIFO, device or socket is a CorruptCheckpointError, a symlink
        Unsupported."""
        total = 0
        fd = _open_folder(self.root, self.parts)
        try:
            for parts, names in self.layout.folders.items():
                try:
                    sub = _open_below(fd, parts, self.path)
                except FileNotFoundError:
                    continue
                where = "/".join((self.path, *parts))
                try:
                    for name in names:
                        st = _look(sub, where, name)
                        total += st.st_size if st is not None else 0
                finally:
                    if sub != fd:
                        os.close(sub)
        finally:
            os.close(fd)
        return total

    def read(self, box: Sequence[tuple[int, int]], out: np.ndarray) -> None:
        """Fills ``out`` with ``box`` of the array. Unsupported at a symlink (the caller walks the
        folder, then reads the array through tensorstore); CorruptCheckpointError for damage."""
        lay = self.layout
        if any(s >= e for s, e in box):
            return
        first = [s // c for (s, _), c in zip(box, lay.chunk)]
        last = [(e - 1) // c for (_, e), c in zip(box, lay.chunk)]
        for idx in itertools.product(*(range(a, b + 1) for a, b in zip(first, last))):
            origin = [i * c for i, c in zip(idx, lay.chunk)]
            key = lay.key(idx)
            folder = _open_folder(self.root, self.parts + key[:-1])  # at most two fds held, then one
            where = "/".join((self.path, *key[:-1]))
            try:
                if lay.index is not None:
                    self._read_shard(folder, where, key[-1], origin, box, out)
                else:
                    data = _read_file(folder, where, key[-1], 2 * lay.inner.raw + (1 << 16))
                    _decode_into(lay.inner, data, f"{where}/{key[-1]}", origin, box, out)
            finally:
                os.close(folder)

    def _read_shard(
        self,
        folder: int,
        where: str,
        name: str,
        origin: list[int],
        box: Sequence[tuple[int, int]],
        out: np.ndarray,
    ) -> None:
        """The inner chunks of one shard that ``box`` needs: its index read and checked, then only them."""
        lay, path = self.layout, f"{where}/{name}"
        inner, n = lay.inner, math.prod(lay.per_shard)
        assert lay.index is not None, "a sharded layout has its index codecs"
        most = n * (2 * inner.raw + (1 << 16)) + lay.index_size
        fd, st = _open_file(folder, where, name, most)
        size = st.st_size
        try:
            at_index = size - lay.index_size if lay.index_at_end else 0
            if at_index < 0:
                raise CorruptCheckpointError(f"{path}: {size} bytes, too short for its shard index")
            index = lay.index.decode(
                _pread(fd, path, st, [(at_index, lay.index_size)])[0], f"{path} (shard index)"
            ).reshape(n, 2)
            wanted = []
            for j, sub in enumerate(itertools.product(*map(range, lay.per_shard))):
                at = [o + i * c for o, i, c in zip(origin, sub, inner.shape)]
                if all(a < e and a + c > s for a, c, (s, e) in zip(at, inner.shape, box)):
                    offset, length = int(index[j, 0]), int(index[j, 1])
                    if offset == _NO_CHUNK and length == _NO_CHUNK:
                        raise CorruptCheckpointError(f"{path}: inner chunk {list(sub)} was never written")
                    if offset + length > size:
                        raise CorruptCheckpointError(
                            f"{path}: inner chunk {list(sub)} lies past the file's end"
                        )
                    wanted.append((at, offset, length))
            for (at, _, _), data in zip(wanted, _pread(fd, path, st, [(o, ln) for _, o, ln in wanted])):
                _decode_into(inner, data, path, at, box, out)
        finally:
            os.close(fd)


def _decode_into(
    chain: _Chain,
    data: bytes,
    path: str,
    origin: Sequence[int],
    box: Sequence[tuple[int, int]],
    out: np.ndarray,
) -> None:
    """The part inside ``box`` of the chunk ``data`` holds (its first element at ``origin``) into
    ``out``: decoded straight into ``out`` when the whole chunk lands on a contiguous part of it."""
    src, dst = [], []
    for o, c, (s, e) in zip(origin, chain.shape, box):
        lo, hi = max(o, s), min(o + c, e)
        src.append(slice(lo - o, hi - o))
        dst.append(slice(lo - s, hi - s))
    region = out[(*dst, ...)]  # a view, also of a 0-d out
    if (
        region.shape == chain.shape
        and region.flags.c_contiguous
        and region.dtype == chain.dtype
        and (chain.order == "C" or region.ndim <= 1)
    ):
        chain.decode(data, path, into=region)
    else:
        region[...] = chain.decode(data, path)[tuple(src)]
