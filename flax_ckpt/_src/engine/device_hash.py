"""Which shards copied on their devices are unchanged since the last save: a keyed hash on the device.

Scope: the hash (``digests``, computed by the shards' own devices on the copies a snapshot made there,
engine/device.py), the process's secret key, and the ``Ledger`` a saver keeps from one save to the
next (per shard: its digest, its host copy and the crc32c of its blocks). A snapshot brings to host only
the shards whose digest differs from the ledger's (engine/snapshot.py ``Snapshot.complete``); an
unchanged shard's data is the host copy the last save wrote, so whatever the writer does with it
(refer to the earlier step's bytes, hash or write them) it holds the right bytes. Not here: which
leaves are copied on their devices (device.py), the references between steps (native/sharing.py).

The hash, per shard and per lane (``LANES`` lanes, each with its own key): the shard's bytes as limbs
of at most 16 bits (one per 8- or 16-bit element, two per 32-bit one, in order), laid out in rows of
``B`` limbs (``B`` = 2^15, or 2^16 for shards of more than 2^31 limbs; the last row zero-padded) are
the coefficients ``m[q][j]`` of the polynomial ``H(r, s) = sum_q s^q sum_j m[q][j] r^j`` over the
field of ``P`` = 2^31 - 1, evaluated at the lane's secret ``r`` and ``s`` (uniform, from os.urandom).
Two different shards of one shape and dtype differ in some limb by less than ``P`` in absolute value,
so their difference is a nonzero polynomial of total degree at most ``B + Q`` (``Q``: the rows); by
the Schwartz-Zippel lemma one lane misses the change with probability at most ``(B + Q) / P``, and
four independent lanes with probability at most ``((B + Q) / P)^4``: at most 2^-60 for a shard of up
to 2^30 limbs (1 GiB of 8-bit or 2 GiB of 16- or 32-bit elements), 2^-56 up to 2^32 limbs (the most
hashed: a larger shard is always brought to host). This holds for any change (one bit of one
bfloat16, the last byte, a difference of 2^31 in one word, changes that cancel in a sum or an XOR, a
swap of two words), since the bytes cannot depend on the key: it never leaves the process. It is passed to each computation as an argument (never a constant of a compiled program, which a
compilation cache would write to disk), never stored, logged or shown in a repr. A process that
restarts draws a new key and has no ledger: its first save brings every shard to host (the host
path decides what is shared).

The arithmetic is in uint32 (JAX runs without 64-bit types by default): products of a 16-bit limb
and a 31-bit key in 16-bit halves, reduced modulo the Mersenne prime with shifts; each row's sum is
taken of the products' 16-bit halves in one variadic reduction (no overflow for rows of up to 2^16
limbs), which XLA fuses with the arithmetic: no temporary of the shard's size (on CPU the program's
temporaries are a few rows' sums: tests/test_device_hash.py checks ``memory_analysis``). Each
program's memory is checked where it is compiled, on any backend: a shard whose hash would need a temporary of more
than 1/32 of its bytes (or more than ``FLAX_CKPT_DEVICE_BUDGET``) is brought to host, never hashed.

Private switch, for tests and benchmarks (not a user setting): the environment variable
``_FLAX_CKPT_DEVICE_HASH``, read at each save: unset or ``auto`` (shards on accelerators),
``cpu`` (on CPU devices too, which ``FLAX_CKPT_DEVICE_SNAPSHOT=always`` copies on their devices: the
logic runs on a machine without an accelerator) or ``off`` (every shard brought to host, as without).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from flax_ckpt._src.lazy import lazy

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
    import jax.numpy as jnp
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)
    jnp = lazy("jax.numpy", globals())

P = (1 << 31) - 1  # the field's prime
LANES = 4  # independent lanes, each with its own key
MIN_BYTES = 64 << 10  # smaller shards are always brought to host (native/sharing.MIN_SHARED)
MAX_LIMBS = 1 << 32  # larger shards are always brought to host
_ROW = 1 << 15  # limbs per row (B) for shards of up to 2^31 limbs; 2^16 above
_MISSES = 2  # a shard whose bytes changed at this many saves in a row is no longer hashed, ...
_PROBE = 8  # ... but at every _PROBE-th save (a leaf that stopped changing is found again)
_ENV = "_FLAX_CKPT_DEVICE_HASH"
_TEMP = 32  # a shard's hash may use temporaries of at most 1/_TEMP of its bytes (1 MiB at least)


def mode() -> str:
    """The private switch (see the module): "auto", "cpu" or "off"."""
    m = os.environ.get(_ENV, "").strip().lower() or "auto"
    if m not in ("auto", "cpu", "off"):
        raise ValueError(f"{_ENV}={m!r}: use auto, cpu or off")
    return m


def hashable(x: Any, cpu_too: bool) -> bool:
    """Whether device array ``x`` (one shard) is hashed: large enough to share, not too large, of a
    dtype of 1, 2 or 4 bytes an element (not complex, not packed 2- or 4-bit), and on an accelerator
    (or a CPU, ``cpu_too``)."""
    dt = np.dtype(x.dtype)
    n = int(np.prod(x.shape)) * dt.itemsize
    if n < MIN_BYTES or dt.itemsize not in (1, 2, 4) or dt.kind == "c" or _limbs_of(dt) * n > MAX_LIMBS * 4:
        return False
    if any(dt.name.startswith(t) for t in ("int2", "int4", "uint2", "uint4", "float4")):
        return False
    return cpu_too or all(d.platform != "cpu" for d in x.sharding.device_set)


def _limbs_of(dt: np.dtype) -> int:
    """Limbs per element, scaled to per 4 bytes: 4 (8-bit), 2 (16-bit), 2 (32-bit: two limbs)."""
    return {1: 4, 2: 2, 4: 2}[dt.itemsize]


# ---------------------------------------------------------------------------------- the key


class _Key:
    """The process's secret: per lane ``r`` and ``s`` uniform in [0, P), and their powers (``r^j`` for
    j < 2^16, ``s^q`` for q <= 2^16) as uint32 tables, on each device once asked. No repr shows them."""

    def __init__(self) -> None:
        self._rs = [(_uniform(), _uniform()) for _ in range(LANES)]
        self._on: dict[int, tuple[Any, Any]] = {}

    def __repr__(self) -> str:
        return "<device_hash key: secret>"

    def tables(self, device: Any) -> tuple[Any, Any]:
        """(r powers (LANES, 2^16), s powers (LANES, 2^16 + 1)) on ``device``."""
        got = self._on.get(device.id)
        if got is None:
            t1 = np.stack([_powers(r, 1 << 16) for r, _ in self._rs])
            t2 = np.stack([_powers(s, (1 << 16) + 1) for _, s in self._rs])
            got = self._on[device.id] = (jax.device_put(t1, device), jax.device_put(t2, device))
        return got


def _uniform() -> int:
    """An integer uniform in [0, P), from os.urandom (rejection: no bias)."""
    while True:
        v = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        if v < P:
            return v


def _powers(base: int, n: int) -> np.ndarray:
    """``base^i mod P`` for i < n, as uint32 (numpy uint64: products of two residues fit)."""
    out = np.ones(n, np.uint64)
    k, pw = 1, base % P  # pw = base^k
    while k < n:
        m = min(k, n - k)
        out[k : k + m] = out[:m] * np.uint64(pw) % np.uint64(P)
        k, pw = k + m, pw * pw % P
    return out.astype(np.uint32)


@functools.cache
def _key() -> _Key:
    return _Key()


if hasattr(os, "register_at_fork"):  # a forked child draws a key of its own
    os.register_at_fork(after_in_child=_key.cache_clear)


# ---------------------------------------------------------------------------------- the arithmetic
# Every value is a uint32 congruent modulo P to what it stands for; ``_fold2`` makes it < 2^31.


def _fold(v: jax.Array) -> jax.Array:
    return (v & P) + (v >> 31)  # 2^31 = 1 (mod P)


def _fold2(v: jax.Array) -> jax.Array:
    return _fold(_fold(v))


def _shift16(x: jax.Array) -> jax.Array:
    """``x * 2^16`` (mod P), for x < 2^31 + 1: < 2^31 + 2^16."""
    return ((x & 0x7FFF) << 16) + (x >> 15)


def _mul_limb(m: jax.Array, t: jax.Array) -> jax.Array:
    """``m * t`` (mod P) for a limb m < 2^16 and t < 2^31, < 2^31. (One ``_fold`` of x < 2^32 - 1 is
    < 2^31: the per-limb work of the hash, kept to the fewest operations.)"""
    hi = _fold(_shift16(m * (t >> 16)))  # m * (t >> 16) < 2^31, so _shift16 of it <= 2^31
    return _fold(hi + _fold(m * (t & 0xFFFF)))  # m * (t & 0xFFFF) <= (2^16 - 1)^2


def _mul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` (mod P) for a, b < 2^31, < 2^31."""
    a1, a0, b1, b0 = a >> 16, a & 0xFFFF, b >> 16, b & 0xFFFF
    top = _fold2(2 * (a1 * b1))  # 2^32 = 2 (mod P)
    mid = _fold2(_shift16(_fold2(a1 * b0 + a0 * b1)))
    return _fold2(_fold2(top + mid) + _fold2(a0 * b0))


def _limbs(x: jax.Array) -> list[jax.Array]:
    """The limbs of ``x`` in order, as uint32 arrays of the elements' count: one (8- or 16-bit
    elements) or two, low then high (32-bit)."""
    flat = x.reshape(-1)
    if flat.dtype == jnp.bool_:
        return [flat.astype(jnp.uint32)]
    size = np.dtype(flat.dtype).itemsize
    u = jax.lax.bitcast_convert_type(flat, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size])
    u = u.astype(jnp.uint32)
    return [u] if size < 4 else [u & 0xFFFF, u >> 16]


def _sums(a: jax.Array, b: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """The sums of ``a`` and of ``b`` along ``axis`` (uint32, wrapping), in one reduction: XLA fuses
    what computes them into it (two sums of one product would make it keep the product whole)."""
    zero = jnp.zeros((), jnp.uint32)
    out = jax.lax.reduce((a, b), (zero, zero), lambda x, y: (x[0] + y[0], x[1] + y[1]), (axis,))
    return out[0], out[1]


def _row_sums(rows: Sequence[jax.Array], keys: jax.Array) -> jax.Array:
    """Per lane and row, ``sum_j m[q][j] r^j`` (mod P), < 2^31: ``rows`` are the limbs (each (Q, W),
    limb c of element w at position w * len(rows) + c), ``keys`` the r powers (LANES, W * len(rows))."""
    k = len(rows)
    parts = []
    for c, m in enumerate(rows):
        t = keys[:, c::k][:, None, :]  # (LANES, 1, W)
        v = _mul_limb(m[None], t)  # (LANES, Q, W), fused into the sums
        parts.append(_sums(v & 0xFFFF, v >> 16, 2))  # < 2^32, < 2^31: no overflow
    lo, hi = parts[0]
    for a, b in parts[1:]:
        lo, hi = _fold2(lo) + _fold2(a), _fold2(hi) + _fold2(b)
    return _fold2(_fold2(_shift16(_fold2(hi))) + _fold2(lo))


def _digest(x: jax.Array, t1: jax.Array, t2: jax.Array) -> jax.Array:
    """The (LANES,) uint32 digest of ``x`` (see the module), canonical residues."""
    limbs = _limbs(x)
    k, n = len(limbs), limbs[0].shape[0]
    width = (_ROW if n * k <= (1 << 31) else 2 * _ROW) // k  # elements per row
    q, tail = divmod(n, width)
    rows: list[jax.Array] = []
    if q:
        main = [m[: q * width].reshape(q, width) for m in limbs]
        rows.append(_row_sums(main, t1[:, : width * k]))  # (LANES, q)
    if tail:
        last = [m[q * width :].reshape(1, tail) for m in limbs]
        rows.append(_row_sums(last, t1[:, : tail * k]))
    r = jnp.concatenate(rows, axis=1)  # (LANES, rows)
    v = _mul(r, t2[:, : r.shape[1]])
    total = _sums(v & 0xFFFF, v >> 16, 1)  # rows <= 2^16 + 1: no overflow
    h = _fold2(_fold2(_shift16(_fold2(total[1]))) + _fold2(total[0]))
    return jnp.where(h == P, 0, h)


_compiled: dict[tuple[Any, ...], Any] = {}  # (shape, dtype, device id) -> the compiled digest, or None


def _program(x: jax.Array, device: Any, t1: jax.Array, t2: jax.Array) -> Any:
    """The compiled digest of arrays like ``x`` on ``device``, or None where XLA would give it a
    temporary of more than ``_TEMP`` of the shard's bytes (or of ``FLAX_CKPT_DEVICE_BUDGET``): such a
    shard is brought to host, never hashed. Compiled once per shape and dtype (a training loop saves
    one structure again and again)."""
    sig = (tuple(x.shape), np.dtype(x.dtype).str, device.id)
    if sig not in _compiled:
        compiled = jax.jit(_digest).lower(x, t1, t2).compile()
        temp = _temp_bytes(compiled)
        budget = os.environ.get("FLAX_CKPT_DEVICE_BUDGET", "").strip()
        limit = max(1 << 20, int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize // _TEMP)
        if budget:
            limit = min(limit, int(float(budget)))
        _compiled[sig] = compiled if temp is not None and temp <= limit else None
    return _compiled[sig]


def _temp_bytes(compiled: Any) -> int | None:
    """The temporary bytes XLA allocates for ``compiled`` (None: the backend does not say)."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # a backend without a memory analysis: not hashed
        return None


def digests(xs: Sequence[jax.Array]) -> list[np.ndarray | None]:
    """The digest (LANES,) of each single-device array of ``xs`` (None for one whose hash would need
    too much of its device's memory, ``_program``): dispatched together, then waited for."""
    outs = []
    for x in xs:
        d = next(iter(x.sharding.device_set))
        t1, t2 = _key().tables(d)
        fn = _program(x, d, t1, t2)
        outs.append(None if fn is None else fn(x, t1, t2))
    return [None if o is None else np.asarray(o) for o in outs]


# ---------------------------------------------------------------------------------- the ledger


@dataclass(slots=True)
class Entry:
    """What a save knows of one shard it hashed: the leaf's record (compared by identity: a snapshot
    learns one per structure), the digest (None when not hashed at that save), the host copy that
    save wrote and the crc32c of its blocks (None with the digest), and ``run``, how many saves in a
    row it was not found unchanged."""

    record: Any
    digest: np.ndarray | None
    data: np.ndarray | None
    crcs: np.ndarray | None
    run: int = 0

    def hash_now(self) -> bool:
        """Whether the next save hashes this shard (see ``_MISSES``)."""
        return self.run < _MISSES or self.run % _PROBE == 0


@dataclass
class Ledger:
    """Per shard (by the leaf's record and the shard's box) what the last save knew (``Entry``), and
    the committed step that save was (``saved_as``: (step folder, id), or None)."""

    entries: dict[tuple[int, Any], Entry] = field(default_factory=dict)
    saved_as: tuple[str, str] | None = None

    def get(self, record: Any, box: Any) -> Entry | None:
        e = self.entries.get((id(record), box))
        return e if e is not None and e.record is record else None


@dataclass(frozen=True, slots=True)
class Planned:
    """What this save will know of a hashed shard (``sort``): its leaf's record, box, digest (None when
    not hashed now) and run."""

    record: Any
    box: Any
    digest: np.ndarray | None
    run: int


def sort(
    cands: Sequence[tuple[int, Any, Any, Any]], prior: Ledger | None
) -> tuple[dict[int, Entry], dict[int, Planned]]:
    """Of ``cands`` (index, leaf record, box, the shard's device copy), those unchanged since the save
    ``prior`` describes (by index: its entry, whose host copy holds the bytes) and the plan of every
    one's entry in this save's ledger. Each is hashed on its device but one whose bytes changed at each
    of the last saves (``Entry.hash_now``); one without a digest in ``prior`` is never unchanged."""
    olds = {i: prior.get(rec, box) if prior is not None else None for i, rec, box, _ in cands}
    now = [(i, dev) for i, _, _, dev in cands if (e := olds[i]) is None or e.hash_now()]
    digest = dict(zip([i for i, _ in now], digests([dev for _, dev in now])))
    held: dict[int, Entry] = {}
    plan: dict[int, Planned] = {}
    for i, rec, box, _ in cands:
        old, d = olds[i], digest.get(i)
        same = old is not None and old.digest is not None and d is not None and np.array_equal(old.digest, d)
        if same and old is not None and old.data is not None and old.crcs is not None:
            held[i] = old
        plan[i] = Planned(rec, box, d, 0 if i in held else min(255, old.run + 1) if old is not None else 0)
    return held, plan


def ledger(plan: dict[int, Planned], host: dict[int, tuple[np.ndarray, np.ndarray | None]]) -> Ledger:
    """This save's ledger from ``sort``'s plan and, per index, the shard's host copy and crc32c blocks
    (a shard not hashed now keeps neither: the next save cannot find it unchanged)."""
    out = Ledger()
    for i, pl in plan.items():
        data, crcs = host[i]
        kept = pl.digest is not None and crcs is not None
        out.entries[(id(pl.record), pl.box)] = Entry(
            pl.record, pl.digest if kept else None, data if kept else None, crcs if kept else None, pl.run
        )
    return out


__all__ = ["LANES", "P", "Entry", "Ledger", "Planned", "digests", "hashable", "ledger", "mode", "sort"]
