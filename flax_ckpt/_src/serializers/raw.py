"""The numpy-only serializer: shards packed into a few raw files, crc32c per 8 MiB block.

Large shards are split along their first axis into sub-chunks so that writes run in parallel over
several files and partial reads (resharding) touch only the rows they need. Reads go straight into the
destination buffer when a chunk is wanted whole, and the sub-chunks of one large leaf are read in
parallel (a shared pool of READ_THREADS). Knows nothing of trees or manifests beyond its own chunk
fields: {"file", "offset", "nbytes", "block", "crc32c": [per block]}.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence, cast

import crc32c
import numpy as np

from flax_ckpt._src.checks import check_relpath
from flax_ckpt._src.errors import CorruptCheckpointError, InvalidManifestError
from flax_ckpt._src.serializers import for_each_overlap, local
from flax_ckpt._src.serializers.base import ArrayItem, Box, Shard, StoredArray, Written
from flax_ckpt._src.storage import Storage
from flax_ckpt._src.storage.base import as_buffer, span

BLOCK = 8 << 20
SUBCHUNK = 64 << 20
MAX_FILES = 8
READ_THREADS = 8
SHARE_THREADS = 4  # pieces compared with an earlier step's at once (native/sharing.py)
SHARE_MIN = 64 << 10  # smaller pieces are always written: their bytes cost less than the comparison
PARALLEL_READ_MIN = 16 << 20  # a leaf's chunks are read in parallel when it needs at least this many bytes
_SMALL_PIECE, _SMALL_RUN = (
    4096,
    1 << 20,
)  # pieces under _SMALL_PIECE bytes are copied into runs of ~_SMALL_RUN
_RUN_BATCH = 4096  # whole chunks read_many reads with one ranged read (their buffers' views held at once)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    """One pool for the chunk reads of every restore in this process (bounded I/O concurrency; its
    tasks never wait on each other, so callers on other pools may block on them safely)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="flax_ckpt-raw-read")
        return _pool


def _crcs(buf: memoryview) -> tuple[int, ...]:
    """The crc32c of each BLOCK; a tuple of ints (written as a JSON list), which the garbage collector
    stops following once it has seen it (a save's chunk records live until its manifest is written)."""
    return tuple([crc32c.crc32c(buf[i : i + BLOCK]) for i in range(0, len(buf), BLOCK)]) or (0,)


_INDEX: dict[Box, list[list[int]]] = {}  # a box's "index" field, shared by every chunk record of that box
_INDEX_MAX = 1 << 18


def _index(box: Box) -> list[list[int]]:
    """A chunk record's "index" (read-only): made once per box, so that saving one structure again
    allocates no lists for it (objects made at every save, alive until its manifest is written,
    reach the collector's oldest generation and make it walk the whole heap)."""
    out = _INDEX.get(box)
    if out is None:
        if len(_INDEX) >= _INDEX_MAX:
            _INDEX.clear()
        out = _INDEX[box] = [list(b) for b in box]
    return out


def _blocks_ok(chunk: dict, buf: memoryview) -> bool:
    block, crcs = chunk["block"], chunk["crc32c"]
    return all(crc32c.crc32c(buf[k * block : (k + 1) * block]) == crcs[k] for k in range(len(crcs)))


def _bytes(a: np.ndarray) -> memoryview:
    """The bytes of C-contiguous array ``a``, as a memoryview over its memory (writable when ``a`` is;
    an empty one for an empty array, whose buffer may not be exported)."""
    return memoryview(as_buffer(a.reshape(-1).view(np.uint8))) if a.size else memoryview(bytearray(0))


def _file_buffers(arrays: Sequence[np.ndarray], views: Sequence[memoryview]) -> list[memoryview | bytearray]:
    """The buffers that hold ``arrays``' bytes (``views``: each one's ``_bytes``, which the caller made
    for its checksums) back to back, for one write: arrays that lie back to back in memory (views of
    one buffer: a snapshot's arena, which holds a file's image, engine/arena.py; a shard split in
    pieces) as one view of them all, which the storage writes straight from memory (O_DIRECT where it
    can); runs under _SMALL_PIECE bytes copied together into buffers of about
    _SMALL_RUN (a million small leaves: a buffer, not a view each). Only views of one buffer are asked
    for their address. The views hold no reference: ``arrays`` (the caller's) keeps their memory alive
    while they are written."""
    out: list[memoryview | bytearray] = []
    small = bytearray()
    run: list[int] = []  # indices of arrays back to back in memory, ``size`` bytes in all, ending at
    size, end = 0, None  # address ``end`` (None: not asked yet)

    def flush() -> None:
        nonlocal small
        if size < _SMALL_PIECE:
            for k in run:
                small += views[k]
            if len(small) >= _SMALL_RUN:
                out.append(small)
                small = bytearray()
        else:
            if small:
                out.append(small)
                small = bytearray()
            out.append(views[run[0]] if len(run) == 1 else span(cast(int, end) - size, size))
        run.clear()

    for i, a in enumerate(arrays):
        if not a.size:
            continue
        if run:
            last = arrays[run[-1]]
            if (
                a.base is not None
                and a.base is last.base
                and a.flags.c_contiguous
                and last.flags.c_contiguous
            ):
                if end is None:
                    end = _address(last, views[run[-1]]) + last.nbytes
                if _address(a, views[i]) == end:
                    run.append(i)
                    size, end = size + a.nbytes, end + a.nbytes
                    continue
            flush()
        run.append(i)
        size, end = a.nbytes, None
    if run:
        flush()
    if small:
        out.append(small)
    return out


def _address(a: np.ndarray, view: memoryview) -> int:
    """Where ``a``'s bytes (``view``: its ``_bytes``) start in memory: through ctypes for a writable
    view (an arena's buffer: a quarter of numpy's 1.1 us)."""
    if view.readonly:
        return a.__array_interface__["data"][0]
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _whole(data: np.ndarray) -> bool:
    """Whether ``_split`` keeps ``data`` as one piece (most shards)."""
    return data.ndim == 0 or data.nbytes <= SUBCHUNK or data.shape[0] < 2


def _split(box: Box, data: np.ndarray) -> list[tuple[Box, np.ndarray]]:
    """Splits a shard along axis 0 into pieces of about SUBCHUNK bytes."""
    if _whole(data):
        return [(box, data)]
    rows = max(1, SUBCHUNK // max(1, data.nbytes // data.shape[0]))
    (s0, _), rest = box[0], box[1:]
    return [
        (((s0 + r, s0 + min(r + rows, data.shape[0])),) + rest, data[r : r + rows])
        for r in range(0, data.shape[0], rows)
    ]


def _pieces(shard: Shard) -> list[tuple[Box, np.ndarray, tuple[int, ...] | None]]:
    """``_split`` of a shard, each piece with its BLOCK checksums where the shard's (``Shard.crc32c``,
    made as it was copied) cover exactly its blocks, else None (computed when it is written)."""
    data = np.asarray(shard.data, order="C")
    known = (
        shard.crc32c[1]
        if shard.crc32c is not None
        and shard.crc32c[0] == BLOCK
        and len(shard.crc32c[1]) == -(-data.nbytes // BLOCK)
        else None
    )
    if known is not None and _whole(data):  # one piece: its checksums are the shard's
        return [(shard.box, data, tuple(known.tolist()) if data.nbytes else None)]
    out, offset = [], 0
    for box, part in _split(shard.box, data):
        n, crcs = part.nbytes, None
        if known is not None and n and offset % BLOCK == 0 and (n % BLOCK == 0 or offset + n == data.nbytes):
            crcs = tuple(known[offset // BLOCK : offset // BLOCK + -(-n // BLOCK)].tolist())  # as _crcs
        out.append((box, part, crcs))
        offset += n
    return out


Share = Callable[[int, str, Box, memoryview, Callable[[], tuple[int, ...]]], "dict[str, Any] | None"]
_Piece = tuple[int, Box, np.ndarray, "tuple[int, ...] | None"]


def _unshared(
    pieces: list[_Piece], names: dict[int, str], share: Share, chunks: dict[int, list[dict[str, Any]]]
) -> list[_Piece]:
    """The pieces to write: each one ``share`` gives a record for (a reference to equal bytes stored
    before) goes into ``chunks`` instead; the others keep the checksums computed for asking. Pieces are
    asked in parallel (what ``share`` does, hashing and reading, releases the GIL)."""

    def ask(piece: _Piece) -> tuple[dict[str, Any] | None, tuple[int, ...] | None]:
        leaf, box, data, crcs = piece
        mv = _bytes(data)
        made: list[tuple[int, ...]] = []

        def sums() -> tuple[int, ...]:
            if crcs is not None:
                return crcs
            if not made:
                made.append(_crcs(mv))
            return made[0]

        return share(leaf, names[leaf], box, mv, sums), crcs if crcs is not None else (
            made[0] if made else None
        )

    # a piece whose checksums are known and differ from the earlier chunk's is answered here (a lookup
    # and a compare), without a thread: a state that changed whole starts none
    maybe = getattr(share, "maybe", None)
    asked = [
        p
        for p in pieces
        if p[2].nbytes >= SHARE_MIN and (maybe is None or maybe(p[0], names[p[0]], p[1], p[2].nbytes, p[3]))
    ]
    if len(asked) > 1:
        with ThreadPoolExecutor(min(SHARE_THREADS, len(asked)), thread_name_prefix="flax_ckpt-share") as pool:
            answers = dict(zip(map(id, asked), pool.map(ask, asked)))
    else:
        answers = {id(p): ask(p) for p in asked}
    out = []
    for p in pieces:
        record, crcs = answers.get(id(p), (None, p[3]))
        if record is None:
            out.append((p[0], p[1], p[2], crcs))
        else:
            chunks[p[0]].append(dict(record, index=_index(p[1])))
    return out


class RawSerializer:
    name = "raw"

    def __init__(self, max_files: int = MAX_FILES):
        self.max_files = max_files

    def write(
        self, storage: Storage, items: Sequence[ArrayItem], *, tag: str, share: Share | None = None
    ) -> Written:
        """See Serializer.write. ``share`` (the native layout's steps that share bytes,
        native/sharing.py): asked for each piece; a record it gives is stored instead of the piece."""
        pieces = [
            (item.leaf, box, data, crcs)
            for item in items
            for shard in item.shards
            for box, data, crcs in _pieces(shard)
        ]
        chunks: dict[int, list[dict[str, Any]]] = {item.leaf: [] for item in items}
        if share is not None:
            pieces = _unshared(pieces, {item.leaf: item.name for item in items}, share, chunks)
        total = sum(p[2].nbytes for p in pieces)
        nfiles = max(1, min(self.max_files, len(pieces), math.ceil(total / SUBCHUNK)))
        # files of about equal bytes, each a run of the pieces in the order given: that of a snapshot's
        # arena (engine/arena.py), so that a file's pieces lie back to back in memory and are written
        # straight from it
        bins: list[list[tuple[int, Box, np.ndarray, tuple[int, ...] | None]]] = [[] for _ in range(nfiles)]
        acc = 0
        for p in pieces:
            bins[min(nfiles - 1, (2 * acc + p[2].nbytes) * nfiles // max(1, 2 * total))].append(p)
            acc += p[2].nbytes
        bins = [b for b in bins if b] or [[]]
        names = [f"data/{tag}.{i}.bin" for i in range(len(bins))]

        def write_file(i: int) -> tuple[float, float]:
            """Writes file i; returns (seconds of checksums, seconds of fsync)."""
            offset, t0, views = 0, time.perf_counter(), []
            for leaf, box, data, crcs in bins[i]:
                mv = _bytes(data)
                views.append(mv)
                chunks[leaf].append(
                    {
                        "index": _index(box),
                        "file": names[i],
                        "offset": offset,
                        "nbytes": len(mv),
                        "block": BLOCK,
                        "crc32c": crcs or _crcs(mv),
                    }
                )
                offset += len(mv)
            bufs = _file_buffers([data for _, _, data, _ in bins[i]], views)
            serialize_s = time.perf_counter() - t0
            return serialize_s, storage.write(names[i], bufs)

        if len(bins) == 1:
            times = [write_file(0)]
        else:
            with ThreadPoolExecutor(len(bins)) as pool:
                times = list(pool.map(write_file, range(len(bins))))
        return Written(
            chunks,
            {name: sum(p[2].nbytes for p in b) for name, b in zip(names, bins)},
            fsync_s=sum(f for _, f in times),
            serialize_s=sum(s for s, _ in times),
        )

    def view(self, storage: Storage, leaf: StoredArray, box: Box, where: str) -> None:
        return None  # files on disk: read, never mapped

    def validate(self, leaf: StoredArray, files: dict[str, int], where: str) -> None:
        itemsize = leaf.dtype.itemsize
        for j, ch in enumerate(leaf.chunks):
            f = f"chunks[{j}]"
            name = ch.get("file")
            if not isinstance(name, str) or name not in files:  # the names in files are checked already
                name = check_relpath(name, f + ".file", where)
            offset, nbytes, block = ch.get("offset"), ch.get("nbytes"), ch.get("block")
            crcs = ch.get("crc32c")
            if (
                name not in files
                or type(offset) is not int  # not a bool either
                or type(nbytes) is not int
                or type(block) is not int
                or offset < 0
                or nbytes < 0
                or block <= 0
                or block % 16
                or not isinstance(crcs, list)
            ):
                raise InvalidManifestError(f"{where}: leaf chunk {f} has invalid raw fields {ch!r}")
            volume = math.prod(b - a for a, b in ch["index"])
            if nbytes != volume * itemsize or offset + nbytes > files[name]:
                raise InvalidManifestError(
                    f"{where}: leaf chunk {f}: {nbytes} bytes at {offset} do not match "
                    f"its box ({volume} elements of {itemsize} bytes) or file {name}"
                )
            if len(crcs) != max(1, math.ceil(nbytes / block)) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in crcs
            ):
                raise InvalidManifestError(f"{where}: leaf chunk {f}: wrong number of checksums")

    def read(self, storage: Storage, leaf: StoredArray, box: Box, out: np.ndarray, where: str) -> None:
        parts = list(for_each_overlap(leaf, box))
        if len(parts) < 2 or out.nbytes < PARALLEL_READ_MIN:
            for chunk, cbox, ov in parts:
                self._read_chunk(storage, chunk, cbox, ov, box, out, where)
            return
        futures = [
            _read_pool().submit(self._read_chunk, storage, chunk, cbox, ov, box, out, where)
            for chunk, cbox, ov in parts
        ]
        wait(futures)  # every read has stopped writing into out before anything is raised
        for f in futures:
            f.result()

    def read_many(
        self, storage: Storage, requests: Sequence[tuple[StoredArray, Box, np.ndarray]], where: str
    ) -> None:
        """Fills every (leaf, box, out) of ``requests``. Boxes that are one whole chunk each (the small
        leaves of a large tree) are read in batches: per data file, chunks that lie back to back become
        one ranged read into their outputs (one open per file, one preadv per run of chunks), then every
        chunk's blocks are checked. Anything else, and any request whose batch fails (so that its error
        names the file and the leaf), goes through ``read``."""
        runs: dict[str, list[tuple[int, int, StoredArray, Box, np.ndarray, dict]]] = {}
        rest = []
        for leaf, box, out in requests:
            parts = list(for_each_overlap(leaf, box))
            chunk = parts[0][0] if len(parts) == 1 else None
            if (
                chunk is None
                or parts[0][1] != box
                or not out.flags.c_contiguous
                or out.nbytes != chunk["nbytes"]
            ):
                rest.append((leaf, box, out))
                continue
            runs.setdefault(chunk["file"], []).append(
                (chunk["offset"], chunk["nbytes"], leaf, box, out, chunk)
            )
        for name, every in runs.items():
            every.sort(key=lambda it: it[0])
            for at in range(0, len(every), _RUN_BATCH):
                rest += self._read_run(storage, name, every[at : at + _RUN_BATCH])
        for leaf, box, out in rest:
            self.read(storage, leaf, box, out, f"{where} leaf {leaf.name!r}")

    def _read_run(
        self, storage: Storage, name: str, items: list[tuple[int, int, StoredArray, Box, np.ndarray, dict]]
    ) -> list[tuple[StoredArray, Box, np.ndarray]]:
        """Reads whole chunks of file ``name`` (sorted by offset) into their outputs with one ranged read,
        then checks their blocks; returns the requests to read again one by one (a failed read, a
        damaged chunk: ``read`` names it)."""
        rest: list[tuple[StoredArray, Box, np.ndarray]] = []
        ranges: list[tuple[int, list[memoryview]]] = []
        end = None
        for offset, nbytes, _, _, out, _ in items:
            view = _bytes(out)
            if offset != end:
                ranges.append((offset, []))
            ranges[-1][1].append(view)
            end = offset + nbytes
        try:
            storage.read_ranges(name, ranges)
        except (OSError, CorruptCheckpointError):
            return [(leaf, box, out) for _, _, leaf, box, out, _ in items]
        for _, _, leaf, box, out, chunk in items:
            if not _blocks_ok(
                chunk,
                _bytes(out),
            ):
                rest.append((leaf, box, out))
        return rest

    def _read_chunk(
        self, storage: Storage, chunk: dict, cbox: Box, ov: Box, box: Box, out: np.ndarray, where: str
    ) -> None:
        """Fills the part ``ov`` of ``out`` (which holds ``box``) from one chunk covering ``cbox``."""
        dst = out[local(ov, box)]
        shape = tuple(e - s for s, e in cbox)
        if ov == cbox and dst.flags.c_contiguous:
            buf = _bytes(dst)
            self._read_blocks(storage, chunk, 0, len(buf), buf, where)
            return
        # rows [r0, r1) of the chunk along axis 0 hold the overlap; read and verify just those
        rowbytes = chunk["nbytes"] // shape[0] if shape and shape[0] else chunk["nbytes"]
        r0, r1 = (ov[0][0] - cbox[0][0], ov[0][1] - cbox[0][0]) if shape else (0, 1)
        tmp = np.empty(((r1 - r0) * rowbytes,), np.uint8)
        self._read_blocks(storage, chunk, r0 * rowbytes, r1 * rowbytes, memoryview(as_buffer(tmp)), where)
        rows = tmp.view(out.dtype).reshape((r1 - r0,) + shape[1:])
        dst[...] = rows[(slice(None),) + local(ov, cbox)[1:]]

    def _read_blocks(
        self, storage: Storage, chunk: dict, lo: int, hi: int, out: memoryview, where: str
    ) -> None:
        """Reads chunk bytes [lo, hi) into out, verifying every block they touch."""
        block, nbytes, crcs = chunk["block"], chunk["nbytes"], chunk["crc32c"]
        if hi <= lo:
            return
        b0, b1 = lo // block, math.ceil(hi / block)
        s, e = b0 * block, min(b1 * block, nbytes)
        aligned = s == lo and e == hi
        buf = out if aligned else memoryview(bytearray(e - s))
        try:
            storage.read_into(chunk["file"], chunk["offset"] + s, buf)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{where}: data file {chunk['file']} is missing") from None
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{where}: {err}") from None
        for k in range(b0, b1):
            part = buf[k * block - s : min((k + 1) * block, nbytes) - s]
            if crc32c.crc32c(part) != crcs[k]:
                raise CorruptCheckpointError(
                    f"{where}: checksum mismatch in {chunk['file']} bytes {chunk['offset'] + k * block}.."
                    f"{chunk['offset'] + k * block + len(part)} (crc32c expected {crcs[k]}, found "
                    f"{crc32c.crc32c(part)}); the data file is damaged"
                )
        if not aligned:
            out[:] = buf[lo - s : hi - s]
