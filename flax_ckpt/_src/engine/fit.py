"""How a restore fits a checkpoint to a target that differs from it: rename, missing, unexpected, cast.

Scope: ``Fit``, the restore options that travel together (validated once, where the user passed them);
``RestoreReport``, what a restore did with every key path; the renaming of the saved records' key
paths (``renamed``: no two leaves at one path, no leaf where another's path needs a folder;
``nestable``: renamed paths nested without loss); and the dtype policy of a cast with its per-chunk
conversion (``cast_problem``, ``cast_into``: every value checked against the target dtype). No I/O:
the target check that uses these is engine/leaves.py's, the reads that cast chunk by chunk
engine/reader.py's.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from flax_ckpt._src.errors import CastOverflowError, InvalidArgumentError, RenameCollisionError, format_list
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.tree import KeyPath

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import ml_dtypes
else:
    ml_dtypes = lazy("ml_dtypes", globals())  # imported on first use (lazy.py)

Rules = tuple[tuple["re.Pattern[str]", "str | None"], ...]
RenameArg = (
    Mapping[str, "str | None"] | Sequence[tuple[str, "str | None"]] | Callable[[str], "str | None"] | None
)


# ------------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class Fit:
    """How a restore may differ from the checkpoint. ``rules`` (ordered (regex, replacement) pairs) or
    ``rename_fn``: the checkpoint's key paths as the target names them; ``missing``: "error" or "keep"
    (target leaves the checkpoint lacks keep the target's values); ``unexpected``: "error" or "ignore"
    (checkpoint leaves the target lacks are not read); ``cast``: convert to the target's dtypes;
    ``report``: restore returns (tree, RestoreReport)."""

    rules: Rules = ()
    rename_fn: Callable[[str], "str | None"] | None = None
    missing: str = "error"
    unexpected: str = "error"
    cast: bool = False
    report: bool = False

    @classmethod
    def of(
        cls,
        partial: bool = False,
        rename: RenameArg = None,
        missing: str = "error",
        unexpected: str = "error",
        cast: bool = False,
        report: bool = False,
    ) -> "Fit":
        """The options as fc.restore takes them, checked (InvalidArgumentError, also a ValueError and a
        TypeError, before anything is read).
        ``partial=True`` is ``unexpected="ignore"`` (its older name)."""
        if missing not in ("error", "keep"):
            raise InvalidArgumentError(f'missing={missing!r}: expected "error" (default) or "keep"')
        if unexpected not in ("error", "ignore"):
            raise InvalidArgumentError(f'unexpected={unexpected!r}: expected "error" (default) or "ignore"')
        for name, v in (("partial", partial), ("cast", cast), ("report", report)):
            if not isinstance(v, bool):
                raise InvalidArgumentError(f"{name}={v!r}: expected True or False")
        rules, fn = _rules(rename)
        return cls(rules, fn, missing, "ignore" if partial else unexpected, cast, report)

    @property
    def relaxed(self) -> bool:
        """Whether anything differs from an exact restore (then restore logs its report)."""
        return bool(self.rules or self.rename_fn or self.cast) or (self.missing, self.unexpected) != (
            "error",
            "error",
        )


def as_fit(partial: "bool | Fit") -> Fit:
    """A Fit from a bool (``partial``: the checkpoint may hold more than the target) or a Fit itself."""
    return partial if isinstance(partial, Fit) else Fit.of(partial=bool(partial))


def _rules(rename: RenameArg) -> tuple[Rules, Callable[[str], "str | None"] | None]:
    if rename is None:
        return (), None
    if callable(rename) and not isinstance(rename, Mapping):
        return (), rename
    pairs = list(rename.items()) if isinstance(rename, Mapping) else list(rename)
    rules = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise InvalidArgumentError(
                f"rename: expected (regex, replacement) pairs, a dict of them or a function; got {pair!r}"
            )
        pattern, repl = pair
        if repl is not None and not isinstance(repl, str):
            raise InvalidArgumentError(
                f"rename: the replacement of {pattern!r} must be a str or None (do "
                f"not restore), not {type(repl).__name__}"
            )
        try:
            rules.append((re.compile(pattern), repl))
        except (re.error, TypeError) as e:
            raise InvalidArgumentError(f"rename: {pattern!r} is not a regular expression ({e})") from None
    return tuple(rules), None


# ------------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class RestoreReport:
    """What a restore did with every key path ('params/dense/kernel'), returned by restore(...,
    report=True) and logged as one line when rename, missing, unexpected or cast was given.

    ``restored``: target leaves read from the checkpoint; ``kept``: target leaves the checkpoint lacks,
    which kept the target's values (torch's ``missing_keys``); ``ignored``: checkpoint leaves not
    restored, because the target lacks them or a rename dropped them (``unexpected_keys``);
    ``dropped``: those of ``ignored`` that a rename rule dropped (replacement None);
    ``renamed``: (checkpoint key path, target key path) pairs; ``cast``: target leaves converted
    from the saved dtype."""

    restored: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()
    cast: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line: 'restored 192 leaves (12 renamed, 192 cast); kept 4 the checkpoint lacks: ...;
        ignored 2 a rename dropped: ...; ignored 3 the target lacks: ...'."""
        extra = [f"{len(v)} {k}" for k, v in (("renamed", self.renamed), ("cast", self.cast)) if v]
        dropped = set(self.dropped)
        lacks = [n for n in self.ignored if n not in dropped]
        parts = [
            (self.kept, "kept {} the checkpoint lacks"),
            (self.dropped, "ignored {} a rename dropped"),
            (lacks, "ignored {} the target lacks"),
        ]
        return (
            f"restored {len(self.restored)} leaves"
            + (f" ({', '.join(extra)})" if extra else "")
            + "".join(
                f"; {what.format(len(names))}: {format_list(list(names), 5)}"
                for names, what in parts
                if names
            )
        )


# ------------------------------------------------------------------------------------------- rename


class Renamed(NamedTuple):
    """The saved records by the key path the target names them (``by_name``), where each came from
    (``origin``: target key path -> checkpoint key path, for renamed ones), and the checkpoint key
    paths a rule dropped (replacement None)."""

    by_name: dict[str, LeafRecord]
    origin: dict[str, str]
    dropped: list[str]


def renamed(saved: Sequence[LeafRecord], fit: Fit, what: str, *, warn: bool = True) -> Renamed:
    """Applies ``fit``'s rename to every saved key path: the first rule whose regex matches the whole
    path (re.fullmatch) gives the new path (its replacement expanded as re.sub's: \\1, \\g<name>), or
    drops the leaf (None). Raises RenameCollisionError naming every pair of checkpoint keys that meet at
    one target key; warns of a rule that matched nothing (``warn``)."""
    by_name: dict[str, LeafRecord] = {}
    origin: dict[str, str] = {}
    dropped: list[str] = []
    used = [False] * len(fit.rules)
    collisions = []
    for leaf in saved:
        new = _new_name(leaf.name, fit, used)
        if new is None:
            dropped.append(leaf.name)
            continue
        if new in by_name:
            collisions.append(f"{by_name[new].name!r} and {leaf.name!r} both to {new!r}")
            continue
        by_name[new] = leaf
        if new != leaf.name:
            origin[new] = leaf.name
    clashes = _folder_clashes(by_name, origin) if origin else []
    if collisions or clashes:
        two = f"maps two checkpoint keys to one target key: {'; '.join(collisions)}. " if collisions else ""
        folder = f"puts a leaf where a key path needs a folder: {'; '.join(clashes)}. " if clashes else ""
        raise RenameCollisionError(
            f"restore of {what}: rename= {two}{'rename= ' if two and folder else ''}{folder}Fix: make the "
            "rules map each checkpoint key to its own target key, never to a key path another leaf's path "
            "passes through, or drop one (replacement None); rules apply in order, the first that matches a "
            "key path wins."
        )
    if warn:
        for (pattern, repl), hit in zip(fit.rules, used):
            if not hit:
                warnings.warn(_unused(pattern, repl, saved, what), UserWarning, stacklevel=4)
    return Renamed(by_name, origin, dropped)


def _folder_clashes(by_name: dict[str, LeafRecord], origin: dict[str, str]) -> list[str]:
    """Each key path (after a rename) that is a leaf where another leaf's path needs a folder ('p' and
    'p/q': restored as nested dicts, one would replace the other), where a rename made either."""

    def shown(n: str) -> str:
        return f"{origin[n]!r} (renamed to {n!r})" if n in origin else repr(n)

    clashes = []
    for name in by_name:
        at = name.find("/")
        while at >= 0:
            folder = name[:at]
            if folder in by_name and (name in origin or folder in origin):
                clashes.append(f"{shown(folder)} is a leaf where {shown(name)} needs a folder")
                break
            at = name.find("/", at + 1)
    return clashes


def nestable(paths: list[KeyPath]) -> list[KeyPath]:
    """Key paths that tree.nest builds into nested dicts/lists without losing a leaf: a folder holding
    both sequence positions and dict keys (a rename put a named key beside a list's entries) becomes
    one dict keyed by both."""
    kinds: dict[tuple, set[bool]] = {}
    for p in paths:
        for d in range(len(p)):
            kinds.setdefault(_folder(p, d), set()).add(p[d][0] == "idx")
    mixed = {f for f, seen in kinds.items() if len(seen) > 1}
    if not mixed:
        return paths
    return [
        tuple(
            ("key", k) if kind == "idx" and _folder(p, d) in mixed else (kind, k)
            for d, (kind, k) in enumerate(p)
        )
        for p in paths
    ]


def _folder(path: KeyPath, depth: int) -> tuple:
    """The folder of ``path``'s entry at ``depth`` as tree.nest sees it (dict keys and attributes alike)."""
    return tuple((kind == "idx", k) for kind, k in path[:depth])


def _new_name(name: str, fit: Fit, used: list[bool]) -> str | None:
    if fit.rename_fn is not None:
        new = fit.rename_fn(name)
        if new is not None and not isinstance(new, str):
            raise InvalidArgumentError(
                f"rename function: for {name!r} it returned {new!r}; expected a str or None"
            )
        return new
    for k, (pattern, repl) in enumerate(fit.rules):
        m = pattern.fullmatch(name)
        if m is None:
            continue
        used[k] = True
        if repl is None:
            return None
        try:
            return m.expand(repl)
        except (re.error, IndexError) as e:
            raise InvalidArgumentError(
                f"rename: replacement {repl!r} of {pattern.pattern!r} fails on {name!r} ({e})"
            ) from None
    return name


def _unused(pattern: "re.Pattern[str]", repl: str | None, saved: Sequence[LeafRecord], what: str) -> str:
    """The warning for a rule that matched no key path, with the paths it matches part of."""
    near = [leaf.name for leaf in saved if pattern.search(leaf.name)][:3]
    hint = (
        f"; it matches part of {format_list(near)}, and rules match whole key paths: prefix it with '.*' "
        "or the path's first keys"
        if near
        else ""
    )
    return f"rename rule {pattern.pattern!r} -> {repl!r} matched no key path of {what}{hint}"


# --------------------------------------------------------------------------------------------- cast

_ORDER = {"b": 0, "i": 1, "f": 2, "c": 3}
_NAMES = {"b": "bool", "i": "integer", "f": "float", "c": "complex"}


def family(dt: np.dtype) -> str | None:
    """'b', 'i' (signed or unsigned), 'f' or 'c' for numpy's and ml_dtypes' dtypes; None otherwise."""
    if dt.kind in "biufc":
        return "i" if dt.kind == "u" else dt.kind
    for probe, fam in ((ml_dtypes.finfo, "f"), (ml_dtypes.iinfo, "i")):
        try:
            probe(dt)
            return fam
        except (ValueError, TypeError):
            pass
    return None


def cast_problem(src: np.dtype, dst: np.dtype) -> str | None:
    """Why cast=True does not convert ``src`` to ``dst``, or None. Casts go along bool -> integer ->
    float -> complex, never back: float to integer would drop fractions, complex to real the imaginary
    part, anything to bool its values (convert those yourself, after a restore in the saved dtype)."""
    a, b = family(src), family(dst)
    if a is None or b is None:
        return (
            f"cast=True converts only bool, integer, float and complex dtypes, not {src.name} to {dst.name}"
        )
    if _ORDER[b] < _ORDER[a]:
        return (
            f"cast=True does not convert {_NAMES[a]} {src.name} to {_NAMES[b]} {dst.name} (it would lose "
            "more than rounding)"
        )
    return None


def _max(dt: np.dtype) -> float:
    fam = family(dt)
    if fam == "c":
        return float(np.finfo(dt).max)
    return (
        float(ml_dtypes.finfo(dt).max)
        if fam == "f"
        else float(ml_dtypes.iinfo(dt).max)
        if fam == "i"
        else 1.0
    )


def _int_range(dt: np.dtype) -> tuple[int, int]:
    if family(dt) == "b":
        return 0, 1
    info = ml_dtypes.iinfo(dt)
    return int(info.min), int(info.max)


def cast_into(src: np.ndarray, dst: np.ndarray, name: str, where: str) -> None:
    """Converts one chunk ``src`` (the saved dtype) into ``dst`` (the target's) as numpy's astype
    does (round to nearest even), checking that every value fits: an integer target's range holds
    it; a float target holds it after rounding (no finite value becomes inf, NaN or the largest value
    by saturation; no NaN or inf becomes something else: a dtype without them, such as float8_e4m3fn or
    float4_e2m1fn); CastOverflowError naming the leaf and a value otherwise."""
    a, b = family(src.dtype), family(dst.dtype)
    if b == "i" and a in ("b", "i") and src.size:
        lo, hi = _int_range(dst.dtype)
        slo, shi = _int_range(src.dtype)
        if slo < lo or shi > hi:
            vlo, vhi = int(src.min()), int(src.max())
            if vlo < lo or vhi > hi:
                raise CastOverflowError(
                    _overflow(
                        name,
                        src.dtype,
                        dst.dtype,
                        f"values in [{vlo}, {vhi}] lie outside {dst.dtype.name}'s range [{lo}, {hi}]",
                        where,
                    )
                )
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dst, src, casting="unsafe")
    if b in ("f", "c") and src.size:
        problem = _float_problem(src, dst)
        if problem is not None:
            raise CastOverflowError(_overflow(name, src.dtype, dst.dtype, problem, where))


class _Float(NamedTuple):
    """What a float dtype holds beyond finite values, and the magnitude from which a value rounds past
    its largest (``limit``; ``tie``: a value of exactly ``limit`` rounds to the largest)."""

    inf: bool
    nan: bool
    lo: float
    hi: float
    limit: float
    tie: bool


@functools.lru_cache(maxsize=None)
def _float_traits(dt: np.dtype) -> _Float:
    with np.errstate(over="ignore", invalid="ignore"):
        special = np.array([np.inf, np.nan]).astype(dt)
    info = np.finfo(dt) if family(dt) == "c" else ml_dtypes.finfo(dt)
    hi = float(info.max)
    ulp = 2.0 ** (math.floor(math.log2(hi)) - int(info.nmant))
    return _Float(
        bool(np.isinf(special[0])),
        bool(np.isnan(special[1])),
        float(info.min),
        hi,
        hi + ulp / 2,
        (hi / ulp) % 2 == 0,
    )


def _float_problem(src: np.ndarray, dst: np.ndarray) -> str | None:
    """What of ``src`` its conversion ``dst`` (a float or complex dtype) does not hold, or None."""
    t = _float_traits(dst.dtype)
    if t.inf:  # IEEE layouts: a value rounds past the largest exactly when it becomes inf
        if _max(dst.dtype) >= _max(src.dtype) or not _non_finite(dst):
            return None  # the first: no value of src's dtype can (NaN and inf stay NaN and inf)
        lost = np.isfinite(src) & ~np.isfinite(dst)
        if not lost.any():
            return None
        return (
            f"{int(lost.sum())} finite values (e.g. {src[lost].flat[0]!r}) exceed {dst.dtype.name}'s "
            f"largest, {_max(dst.dtype):g}"
        )
    if _all_held(src, dst, t):
        return None
    bad = _unheld(src, dst, t)
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    value, became = src.flat[i], dst.flat[i]
    fam = family(src.dtype)
    if fam == "f" and np.isnan(value):
        why = f"{dst.dtype.name} has no NaN"
    elif fam == "f" and np.isinf(value):
        why = f"{dst.dtype.name} has no infinity"
    else:
        why = f"outside {dst.dtype.name}'s finite range [{t.lo:g}, {t.hi:g}] (or a value it cannot hold)"
    return f"{int(bad.sum())} values (e.g. {_shown(value)} would become {_shown(became)}): {why}"


def _all_held(src: np.ndarray, dst: np.ndarray, t: _Float) -> bool:
    """The common case at the cost of two reductions (no temporary arrays): every value of ``src`` lies
    within the limits (a NaN makes its maximum NaN, which does not) and ``dst`` holds no NaN. False:
    look value by value (_unheld)."""
    if family(src.dtype) != "b":
        lo, hi = float(src.min()), float(src.max())
        if not (-t.limit < lo and hi < t.limit):
            return False
    return not (t.nan and np.isnan(dst).any())


def _unheld(src: np.ndarray, dst: np.ndarray, t: _Float) -> np.ndarray:
    """Where ``dst``, a dtype without infinity, does not hold ``src``'s value: beyond the largest after
    rounding (inf included), NaN without a NaN, or turned into NaN (a value it cannot hold at all:
    float8_e8m0fnu holds no zero nor negative values)."""
    limit = np.float64(t.limit)  # compared in float64, whatever src's dtype (a weak scalar would round)
    with np.errstate(invalid="ignore"):
        if t.tie:
            bad = (src > limit) | (src < -limit)
        else:
            bad = (src >= limit) | (src <= -limit)
        src_nan = np.isnan(src) if family(src.dtype) in ("f", "c") else None
        if t.nan:
            new_nan = np.isnan(dst)
            bad |= new_nan if src_nan is None else new_nan & ~src_nan
        elif src_nan is not None:
            bad |= src_nan
    return bad


def _shown(x: Any) -> str:
    """A value as a message shows it: False, 7, 1000.0, inf, nan."""
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    return str(int(x)) if isinstance(x, (int, np.integer)) else repr(float(x))


_EXPONENT = {
    "bfloat16": (np.uint16, 0x7F80),
    "float16": (np.uint16, 0x7C00),
    "float32": (np.uint32, 0x7F800000),
}  # IEEE layouts: all exponent bits set = inf/NaN


def _non_finite(dst: np.ndarray) -> bool:
    """Whether ``dst`` holds an inf or NaN: one pass over its exponent bits for the IEEE layouts (the
    common casts), else numpy's isfinite. Only then is the exact check against the source made."""
    bits = _EXPONENT.get(dst.dtype.name) if dst.dtype.isnative else None
    if bits is None or not dst.flags.c_contiguous:
        return not np.isfinite(dst).all()
    view, mask = bits
    return bool(((dst.view(view) & view(mask)) == view(mask)).any())


def _overflow(name: str, src: np.dtype, dst: np.dtype, what: str, where: str) -> str:
    return (
        f"restore of {name!r}: cast=True cannot convert {src.name} to {dst.name}: {what}, in {where}. "
        f"Nothing was handed back. Fix: restore it into a wider dtype than {dst.name}, or without cast= "
        "into the saved dtype (fc.metadata(path).tree) and convert the values yourself."
    )


__all__ = [
    "Fit",
    "RestoreReport",
    "Renamed",
    "as_fit",
    "cast_into",
    "cast_problem",
    "family",
    "nestable",
    "renamed",
]
