"""``flax-ckpt diff``: two checkpoints compared leaf by leaf (native or Orbax, in any combination).

Scope: which leaves are only in one checkpoint, and which differ in type or value: arrays with the
max absolute difference, PRNG keys as equal or not (by implementation and key data; a difference of
key bits means nothing), other leaves by value. No printing (cli.py's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flax_ckpt._src.tools.common import Leaves, bar


@dataclass(frozen=True)
class LeafDiff:
    """A leaf present in both checkpoints whose type or values differ. ``max_abs_diff`` is None when
    the values cannot be compared numerically (different shapes or kinds, strings, PRNG keys)."""

    key: str
    a: str
    b: str
    max_abs_diff: float | None


@dataclass(frozen=True)
class DiffResult:
    only_in_a: list[str]
    only_in_b: list[str]
    differing: list[LeafDiff]
    same: int

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differing)


def _describe(leaves: Leaves, key: str) -> str:
    """float32[3], key<threefry2x32>[2] (the implementation is the record's: LeafInfo has none), or the kind."""
    info = leaves.info.leaves[key]
    if info.kind == "prng_key":
        return leaves.records[key].describe()
    if info.dtype is None:
        return info.kind
    return f"{info.dtype.name}{list(info.shape or ())}".replace(" ", "")


def diff(a: Any, b: Any, *, progress: bool = False) -> DiffResult:
    """Compares two checkpoints leaf by leaf (native or Orbax, in any combination).

    NaNs in the same places count as equal; a NaN against a number is an infinite difference. Arrays
    of the same shape but different dtypes are compared as float64 and reported as differing."""
    la, lb = Leaves(a), Leaves(b)
    ka, kb = la.keys(), lb.keys()
    sa, sb = set(ka), set(kb)
    common = [k for k in ka if k in sb]
    differing, same = [], 0
    with bar(sum(la.nbytes(k) + lb.nbytes(k) for k in common), "diff", progress) as b:
        for k in common:
            d = _diff_leaf(k, la, lb)
            b.update(la.nbytes(k) + lb.nbytes(k))
            if d is None:
                same += 1
            else:
                differing.append(d)
    return DiffResult([k for k in ka if k not in sb], [k for k in kb if k not in sa], differing, same)


def _diff_leaf(key: str, la: Leaves, lb: Leaves) -> LeafDiff | None:
    ia, ib = la.info.leaves[key], lb.info.leaves[key]
    da, db = _describe(la, key), _describe(lb, key)
    if "prng_key" in (ia.kind, ib.kind):
        return _diff_keys(key, la, lb, da, db)
    va, vb = la.data(key), lb.data(key)
    if ia.dtype is None or ib.dtype is None:
        if ia.kind == ib.kind and _same_value(va, vb):
            return None
        return LeafDiff(key, _value_repr(va, da), _value_repr(vb, db), _scalar_diff(va, vb))
    if _array_kind(ia.kind) != _array_kind(ib.kind) or ia.shape != ib.shape:
        return LeafDiff(key, da, db, None)
    x, y = np.asarray(va), np.asarray(vb)
    if da == db and x.tobytes() == y.tobytes():
        return None
    m = max_abs_diff(x, y)
    return None if (da == db and m == 0.0) else LeafDiff(key, da, db, m)


def _diff_keys(key: str, la: Leaves, lb: Leaves, da: str, db: str) -> LeafDiff | None:
    """PRNG keys are equal or not (same implementation, shape and key data); never a max |a-b|."""
    if da == db and np.asarray(la.data(key)).tobytes() == np.asarray(lb.data(key)).tobytes():
        return None
    return LeafDiff(key, da, db, None)


def _array_kind(kind: str) -> str:
    """jax and numpy arrays compare alike (a restore without a target turns one into the other)."""
    return "array" if kind in ("jax", "numpy") else kind


def max_abs_diff(x: np.ndarray, y: np.ndarray) -> float:
    """max |x - y| in float64 (complex: modulus); NaN vs NaN is 0, NaN vs a number is inf."""
    if x.size == 0:
        return 0.0
    wide = np.complex128 if np.iscomplexobj(x) or np.iscomplexobj(y) else np.float64
    fx, fy = x.astype(wide), y.astype(wide)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(fx - fy)
        nx, ny = np.isnan(fx), np.isnan(fy)
        d = np.where(nx & ny, 0.0, np.where(nx | ny, np.inf, d))
        d = np.where(np.isnan(d), 0.0, d)  # inf - inf of the same sign
    return float(d.max())


def _same_value(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, (float, complex)):
        return np.asarray(x).tobytes() == np.asarray(y).tobytes()
    return x == y


def _scalar_diff(x: Any, y: Any) -> float | None:
    num = (int, float, complex)
    if isinstance(x, num) and isinstance(y, num) and not isinstance(x, bool) and not isinstance(y, bool):
        return max_abs_diff(np.asarray(x), np.asarray(y))
    return None


def _value_repr(v: Any, desc: str) -> str:
    if isinstance(v, (bool, int, float, complex, str)):
        return f"{type(v).__name__} {v!r}"
    return desc
