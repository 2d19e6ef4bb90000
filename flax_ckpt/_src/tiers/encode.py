"""Encoding a tiered save's host snapshot into a copy, differentially against a base.

Scope: ``encode`` (a TierSnapshot -> an Encoded copy ready to write), and the choices it makes per
chunk: a reference to the base's bytes, an XOR delta (``shuffle``d, zlib'd), or raw bytes;
``delta_ratio``, the sample that says whether a delta pays, and ``DeltaBudget``, the CPU time that
compression may take. Not here: the format of a copy (its folder, index and chunk entries, described
in store.py), taking the snapshot, writing, opening and checking copies (store.py); decoding deltas
back (load.py).

A chunk is unchanged when its bytes equal the base's: its entry then names the base's bytes and
carries the base's crc32c (a damaged base fails its check at restore). A shard that is a view of the
base (a jax.Array leaf unchanged since it, store.py) is not even compared: its entries are the base's.
A full copy (no base: a new base, and every copy of adam's state at every step) has only raw chunks;
its index is written straight as text (``_encode_full``).
"""

from __future__ import annotations

import functools
import threading
import time
import zlib
from typing import Any

import crc32c
import numpy as np

from flax_ckpt._src.checks import canonical
from flax_ckpt._src.engine.equal import same_bytes
from flax_ckpt._src.storage.base import as_buffer
from flax_ckpt._src.tiers import files as tier_files
from flax_ckpt._src.tiers.store import (
    CHUNK,
    Copy,
    Encoded,
    HostShard,
    TierSnapshot,
    bytes_of,
    encode_index,
    shard_key,
)


def _u8(buf: Any) -> np.ndarray:
    return np.frombuffer(buf, np.uint8)


def shuffle(x: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(x.reshape(-1, itemsize).T) if itemsize > 1 and len(x) % itemsize == 0 else x


def _xor_delta(raw: memoryview, old: memoryview, itemsize: int) -> bytes | None:
    """zlib of the byte-shuffled XOR, or None when that is not clearly smaller than the chunk."""
    z = zlib.compress(as_buffer(shuffle(np.bitwise_xor(_u8(raw), _u8(old)), itemsize)), 1)
    return z if len(z) < 0.9 * len(raw) else None


def delta_ratio(raw: memoryview, old: memoryview) -> float:
    """The share of non-zero bytes in the XOR of a changed chunk and its base, sampled (_PROBES runs of
    _PROBE bytes spread over the chunk: a few microseconds): about what its delta compresses to, since
    zlib stores the zero bytes of the XOR (the bits a small update leaves alone) almost for free and
    the others (noise in the low mantissa bits) hardly at all. Adam's updates touch 60-90% of the
    bytes: not worth a delta; a change in the 6th significant digit, or a few rows of a table, far fewer."""
    n = len(raw)
    if n <= _PROBES * _PROBE:
        x = np.bitwise_xor(_u8(raw), _u8(old))
    else:
        step = (n - _PROBE) // (_PROBES - 1)
        a, b = np.lib.stride_tricks.as_strided, (_PROBES, _PROBE)
        x = np.bitwise_xor(a(_u8(raw), b, (step, 1)), a(_u8(old), b, (step, 1)))
    return float(np.count_nonzero(x)) / max(1, x.size)


class DeltaBudget:
    """When a changed chunk is worth a delta. Storing a chunk raw costs a copy (several GB/s); its zlib'd
    XOR, about 100-300 MB/s of one core: 20-50 times more, for at best a smaller copy in memory. So a
    delta is made only (1) where it pays in bytes: the sampled XOR (``delta_ratio``) is at most
    ``_WORTH`` non-zero, i.e. the delta at least halves the chunk; and (2) while the tiers' encoding
    budget has credit: compression may use ``_SHARE`` of one core's time, measured (each delta's
    seconds are charged; credit accrues with wall time, up to ``_CREDIT_S``). Past that, changed
    chunks are stored raw, at memcpy speed, and the copy is committed as fast as a full one. Unchanged
    chunks are always references to the base (free). One per TierSet; thread-safe (encoding tasks
    run on a pool)."""

    def __init__(self, share: float | None = None, credit_s: float | None = None):
        self.share = _SHARE if share is None else share
        self.cap = _CREDIT_S if credit_s is None else credit_s
        self.credit, self._t = self.cap, None
        self._mutex = threading.Lock()
        self.spent_s = 0.0  # seconds of compression so far
        self.zipped = self.saved = 0  # bytes compressed, and bytes that saved

    def refill(self, now: float) -> None:
        """At each save (now: perf_counter)."""
        with self._mutex:
            if self._t is not None:
                self.credit = min(self.cap, self.credit + self.share * (now - self._t))
            self._t = now

    def worth(self, ratio: float) -> bool:
        with self._mutex:
            return ratio <= _WORTH and self.credit > 0

    def charge(self, seconds: float, nbytes: int, saved: int) -> None:
        with self._mutex:
            self.credit -= seconds
            self.spent_s += seconds
            self.zipped += nbytes
            self.saved += saved


_WORTH = 0.5  # a delta only where at most this share of the XOR's bytes is non-zero
_SHARE = 0.05  # of one core's time, at most, for compression (credit accrues with wall time)
_CREDIT_S = 0.05  # the most compression seconds saved up: a burst beside training stays short
_PROBES, _PROBE = 16, 256  # delta_ratio's sample of a chunk


def changed_share(ts: TierSnapshot, base: Copy, budget: DeltaBudget | None = None) -> float:
    """About the share of ``ts``'s bytes that a differential copy against ``base`` would store, from
    _SAMPLES places spread evenly over those bytes, each ``delta_ratio`` of the _PROBE_BYTES there and
    the base's (all of them: 0.2-0.7 ms in all): nothing where it is unchanged, that share where
    ``budget`` would make the chunk a delta, else all of it. How the writer says whether a copy that
    would be differential is worth one, without trying it (a differential copy of adam's state
    compares every chunk and saves nothing). Views of the base count as unchanged."""
    shards = ts.shards()
    total = sum(sh.data.nbytes for sh in shards)
    if not total:
        return 0.0
    lookup, recs = base.lookup(), {}
    changed, at, k = 0.0, 0, 0
    for sh in shards:
        n, mine, b = sh.data.nbytes, None, None
        while k < _SAMPLES and (k + 0.5) * total / _SAMPLES < at + n:
            pos = int((k + 0.5) * total / _SAMPLES) - at
            k += 1
            if sh.base is not None:
                continue
            if mine is None:  # the shard's first sample: its bytes and the base's shard
                if sh.leaf not in recs:
                    recs[sh.leaf] = ts.snap.leaves[sh.leaf].record.json()
                mine, b = _u8(bytes_of(sh.data)), lookup.get(shard_key(recs[sh.leaf], sh.box))
            if b is None or b["nbytes"] != n:
                changed += 1
                continue
            c, lo = divmod(pos, CHUNK)  # _PROBE_BYTES at the sample's place in its chunk
            lo = max(0, min(lo, min(CHUNK, n - c * CHUNK) - _PROBE_BYTES))
            e = b["chunks"][c]
            raw = memoryview(as_buffer(mine[c * CHUNK + lo : c * CHUNK + lo + _PROBE_BYTES]))
            r = delta_ratio(raw, base.data.view(e[2] + lo, e[2] + lo + len(raw)))
            changed += r if r == 0 or (budget is not None and budget.worth(r)) else 1
        at += n
    return changed / _SAMPLES


_SAMPLES, _PROBE_BYTES = 32, _PROBES * _PROBE  # changed_share's sample: delta_ratio reads all of it
_SEGMENT = 8  # chunks per encoding task: shards are encoded in segments on tier_files.pool()
_ALIGN = 64  # each shard's stored bytes start on this boundary: a view of them is then used by
#              jax.device_put on a CPU device without a copy (restore from memory)


def encode(
    ts: TierSnapshot,
    ident: dict[str, Any],
    base: Copy | None,
    *,
    delta: bool,
    budget: DeltaBudget | None = None,
    layouts: FullLayouts | None = None,
) -> Encoded:
    """Encodes a snapshot; against a base, unchanged chunks become references to it, and changed ones
    deltas where ``budget`` says they pay (none without one). Shards are encoded in segments of
    _SEGMENT chunks on a thread pool (checksums, comparisons and zlib release the GIL); ``pieces``
    are data.bin's bytes in order, alignment padding included. A full copy of a snapshot taken into a
    spare on loan (``ts.lent``) is laid out as its shards already lie there, and fills the spare; a
    differential one is written to another file (store.write_copy gives the loan back). ``layouts``:
    the writer's memory of its last full copy's layout, which a full copy of the same structure, lying
    where that layout puts it, reuses (``_encode_in_place``)."""
    if base is None:
        enc = _encode_in_place(ts, ident, layouts) if layouts is not None else None
        return enc if enc is not None else _encode_full(ts, ident)
    budget = budget if delta else None
    recs = [lf.record.json() for lf in ts.snap.leaves]  # shared by the records' copies: read-only
    lookup = base.lookup()
    base.data.view(0, 0)  # map it once, before the tasks read it
    shards, tasks = [], []
    for sh in ts.shards():
        mv, itemsize = bytes_of(sh.data), sh.data.dtype.itemsize
        crcs = _copied_crcs(ts, sh.data, len(mv))
        shard = {"leaf": sh.leaf, "box": [list(x) for x in sh.box], "primary": sh.primary, "nbytes": len(mv)}
        if sh.base is not None and base.step == ts.base_step:
            shard["chunks"] = [["b", e[1], e[2]] for e in sh.base["chunks"]]  # the very bytes of the base
            tasks.append([])
        else:
            b = lookup.get(shard_key(recs[sh.leaf], sh.box))
            b = b if b is not None and b["nbytes"] == len(mv) else None
            step = _SEGMENT * CHUNK
            if b is None:  # no base shard: raw entries, nothing to compare (no task to pay for)
                tasks.append([_Done(_encode_segment(mv, 0, len(mv), None, None, itemsize, None, crcs))])
            else:
                tasks.append(
                    [
                        tier_files.pool().submit(
                            _encode_segment, mv, lo, min(lo + step, len(mv)), b, base, itemsize, budget, crcs
                        )
                        for lo in range(0, len(mv), step)
                    ]
                )
        shards.append(shard)
    pieces: list[memoryview] = []
    pending: list[tuple[int, list, int]] = []
    off = 0
    for shard, futures in zip(shards, tasks):
        if not futures:  # references to the base (set above), or an empty shard compared with its base
            shard.setdefault("chunks", [])
            continue
        shard["chunks"] = []
        for f in futures:
            for entry, piece in f.result():
                if piece is not None:
                    if off % _ALIGN and not any(e[0] != "b" for e in shard["chunks"]):
                        pad = -off % _ALIGN  # the shard's first stored byte
                        pieces.append(memoryview(bytes(pad)))
                        off += pad
                    entry[2] = off
                    if entry[1] is None:
                        pending.append((len(pieces), entry, 1))
                    pieces.append(piece)
                    off += len(piece)
                shard["chunks"].append(entry)
    body = dict(ident, base=base.step, chunk=CHUNK, data=off, leaves=recs, shards=shards)
    # a differential copy is written elsewhere: its loan is given back (store.write_copy)
    return Encoded(body, b"" if pending else encode_index(body), pieces, off, pending, ts.lent, base.step)


def _encode_full(ts: TierSnapshot, ident: dict[str, Any]) -> Encoded:
    """``encode`` without a base: every chunk raw, each shard's bytes from a 64-byte boundary, back to
    back (as a spare on loan holds them: a full copy fills it, its tail stored and never referenced);
    the index is written as its canonical text in parts (checks.canonical), never built as a body: a
    copy at every step has hundreds of shards and chunk entries, whose lists and dicts cost more than
    the text and, surviving a save, the garbage collector's full collections. A shard whose chunks'
    crc32c the snapshot made is one piece; otherwise each chunk is, its checksum a hole in the text that
    the writer fills (``pending``)."""
    text: list[str] = [""]  # the body up to the "shards" value (made below, once ``data`` is known), the
    #                         shards, then the rest of the body
    pieces: list[memoryview] = []
    pending: list[tuple[int, list, int]] = []
    off = 0
    for sh in ts.shards():
        mv = bytes_of(sh.data)
        n = len(mv)
        crcs = _copied_crcs(ts, sh.data, n)
        text.append(("," if len(text) > 1 else "") + _shard_head(sh.box))
        if n and off % _ALIGN:
            pad = -off % _ALIGN
            pieces.append(memoryview(bytes(pad)))
            off += pad
        if crcs is not None and n:
            pieces.append(mv)
        for c, k in enumerate(range(0, n, CHUNK)):
            m = min(CHUNK, n - k)
            if crcs is not None:
                text.append(f'{"," if c else ""}["r",{crcs[c]},{off + k},{m}]')
                continue
            pending.append((len(pieces), text, len(text) + 1))
            pieces.append(mv[k : k + m])
            text += ['["r",' if not c else ',["r",', "", f",{off + k},{m}]"]
        text.append(f'],"leaf":{sh.leaf},"nbytes":{n},"primary":{"true" if sh.primary else "false"}}}')
        off += n
    lent = ts.lent
    if lent is not None and off < len(lent.map):  # the spare's tail
        pieces.append(memoryview(lent.map)[off:])
        off = len(lent.map)
    text[0], tail = _body_ends(ts, ident, off)
    text.append(tail)
    enc = Encoded(None, b"", pieces, off, pending, lent, None, text)
    if not pending:
        enc.complete([])
    return enc


def _body_ends(ts: TierSnapshot, ident: dict[str, Any], data: int) -> tuple[str, str]:
    """A full copy's index text before its "shards" list (up to its "[") and after it (from its "]"):
    the body's other keys, sorted as canonical text has them."""
    fields: dict[str, str | None] = {
        k: str(v) if type(v) is int else canonical(v)  # an int's JSON is its str (bool is not an int here)
        for k, v in dict(ident, base=None, chunk=CHUNK, data=data).items()
    }
    fields["leaves"] = "[" + ",".join(lf.record.json_text() for lf in ts.snap.leaves) + "]"
    fields["shards"] = None
    keys = sorted(fields)
    at = keys.index("shards")
    head = "{" + ",".join(f"{_key(k)}:{fields[k]}" for k in keys[:at]) + ("," if at else "") + '"shards":['
    return head, "]" + "".join(f",{_key(k)}:{fields[k]}" for k in keys[at + 1 :]) + "}"


@functools.lru_cache(maxsize=64)
def _key(k: str) -> str:
    """A body key's canonical text (the same few keys at every save)."""
    return canonical(k)


class FullLayout:
    """Where a full copy puts each shard of one sequence (leaf, box, bytes, primary) in a spare of one
    size, as ``_encode_full`` lays them out: each shard's offset (None when empty), its chunks' count,
    the padding between shards, and the index's "shards" text with a ``%d`` for each chunk's crc32c.
    Made once for a structure (``FullLayouts``), it turns a full copy at every step into one check and
    one formatting, instead of a record and a memoryview per shard and chunk."""

    def __init__(self, key: tuple[Any, ...], shards: list[HostShard]):
        self.key = key
        self.offsets: list[int | None] = []
        self.counts: list[int] = []  # chunks, of the non-empty shards
        self.pads: list[tuple[int, int]] = []
        parts, off = [], 0
        for j, sh in enumerate(shards):
            n = sh.data.nbytes
            pad = -off % _ALIGN if n else 0  # as _encode_full pads
            if pad:
                self.pads.append((off, off + pad))
                off += pad
            self.offsets.append(off if n else None)
            if n:
                self.counts.append(-(-n // CHUNK))
            parts.append(("," if j else "") + _shard_head(sh.box).replace("%", "%%"))
            parts += [f'{"," if k else ""}["r",%d,{off + k},{min(CHUNK, n - k)}]' for k in range(0, n, CHUNK)]
            parts.append(f'],"leaf":{sh.leaf},"nbytes":{n},"primary":{"true" if sh.primary else "false"}}}')
            off += n
        self.end = off
        self.text = "".join(parts)


class FullLayouts:
    """What a writer keeps of its last full copy's layout (``encode``'s ``layouts``)."""

    def __init__(self) -> None:
        self.last: FullLayout | None = None


def _encode_in_place(ts: TierSnapshot, ident: dict[str, Any], layouts: FullLayouts) -> Encoded | None:
    """A full copy of a snapshot that lies in its spare on loan exactly where ``_encode_full`` would
    put it, every chunk's crc32c made by the snapshot's copy: the whole spare is the data file (only
    the padding between shards is written, with zeros), and the index is the layout's text with the
    checksums. None when the snapshot is not so (``_encode_full`` then encodes it piece by piece); its
    result is the same, byte for byte (tests/test_tier_every_step.py, tests/test_tiers.py)."""
    lent, shards, at = ts.lent, ts.shards(), ts.offsets()
    if lent is None or not ts.crcs or at is None:
        return None
    key = (len(lent.map), *[(sh.leaf, sh.box, sh.data.nbytes, sh.primary) for sh in shards])
    lay = layouts.last
    if lay is None or lay.key != key:
        lay = layouts.last = FullLayout(key, shards)
    if lay.end > len(lent.map) or at != lay.offsets:
        return None
    found = [ts.crcs.get(id(sh.data)) for sh in shards if sh.data.nbytes]
    crcs = [c for c in found if c is not None]
    if len(crcs) != len(found) or [len(c) for c in crcs] != lay.counts:
        return None
    for lo, hi in lay.pads:
        lent.zero(lo, hi)
    head, tail = _body_ends(ts, ident, len(lent.map))
    flat = np.concatenate(crcs).tolist() if crcs else []
    enc = Encoded(
        None, b"", [memoryview(lent.map)], len(lent.map), [], lent, None, [head, lay.text % tuple(flat), tail]
    )
    enc.complete([])
    return enc


def _copied_crcs(ts: TierSnapshot, data: np.ndarray, n: int) -> list[int] | None:
    """The crc32c of each chunk of a shard's ``n`` bytes made as the snapshot copied them, or None (the
    writer makes them)."""
    crcs = ts.crcs.get(id(data)) if ts.crcs and n else None
    return crcs.tolist() if crcs is not None and len(crcs) == -(-n // CHUNK) else None


@functools.lru_cache(maxsize=4096)
def _shard_head(box: tuple[tuple[int, int], ...]) -> str:
    return '{"box":' + canonical([list(x) for x in box]) + ',"chunks":['


class _Done:
    """A result at hand, read like a future's."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


def _encode_segment(
    mv: memoryview,
    lo: int,
    hi: int,
    b: dict[str, Any] | None,
    base: Copy | None,
    itemsize: int,
    budget: DeltaBudget | None,
    crcs: list[int] | None = None,
) -> list[tuple[list, memoryview | None]]:
    """Entries (offsets left to encode) and stored bytes of the chunks of ``mv[lo:hi]``. A chunk equal
    to the base's is a reference ("b", the base's crc32c: a damaged base then fails its check at
    restore); a changed one is a delta where ``budget`` says that pays (DeltaBudget), else raw.
    ``crcs``: the chunks' crc32c where the snapshot made them as it copied (else the writer does)."""
    out = []
    for k in range(lo, hi, CHUNK):
        raw = mv[k : k + CHUNK]
        crc = crcs[k // CHUNK] if crcs is not None else None
        if b is not None:
            assert base is not None, "a leaf's base entry comes with its base copy"
            be = b["chunks"][k // CHUNK]
            old = base.data.view(be[2], be[2] + len(raw))
            if same_bytes(raw, old):
                out.append((["b", be[1], be[2]], None))
                continue
            if budget is not None and budget.worth(delta_ratio(raw, old)):
                t0 = time.perf_counter()
                z = _xor_delta(raw, old, itemsize)
                budget.charge(time.perf_counter() - t0, len(raw), len(raw) - len(z) if z is not None else 0)
                if z is not None:
                    out.append(
                        (
                            ["x", crc32c.crc32c(raw) if crc is None else crc, None, len(z), be[2]],
                            memoryview(z),
                        )
                    )
                    continue
        out.append((["r", crc, None, len(raw)], raw))  # else its crc32c is computed as it is written
    return out
