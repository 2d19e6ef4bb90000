"""How a restore fits a checkpoint to a target that differs from it: rename, missing, unexpected, cast.

Scope: ``Fit``, the restore options that travel together (validated once, where the user passed them);
``RestoreReport``, what a restore did with every key path; the renaming of the saved records' key
paths (``renamed``); and the dtype policy of a cast with its per-chunk conversion (``cast_problem``,
``cast_into``). No I/O: the target check that uses these is engine/leaves.py's, the reads that cast
chunk by chunk engine/reader.py's.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from flax_ckpt._src.errors import CastOverflowError, RenameCollisionError, format_list
from flax_ckpt._src.records import LeafRecord
from flax_ckpt._src.lazy import lazy
ml_dtypes = lazy("ml_dtypes", globals())  # imported on first use (lazy.py)

Rules = tuple[tuple["re.Pattern[str]", "str | None"], ...]
RenameArg = Mapping[str, "str | None"] | Sequence[tuple[str, "str | None"]] | Callable[[str], "str | None"] | None


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
    def of(cls, partial: bool = False, rename: RenameArg = None, missing: str = "error",
           unexpected: str = "error", cast: bool = False, report: bool = False) -> "Fit":
        """The options as fc.restore takes them, checked (ValueError/TypeError before anything is read).
        ``partial=True`` is ``unexpected="ignore"`` (its older name)."""
        if missing not in ("error", "keep"):
            raise ValueError(f'missing={missing!r}: expected "error" (default) or "keep"')
        if unexpected not in ("error", "ignore"):
            raise ValueError(f'unexpected={unexpected!r}: expected "error" (default) or "ignore"')
        for name, v in (("partial", partial), ("cast", cast), ("report", report)):
            if not isinstance(v, bool):
                raise TypeError(f"{name}={v!r}: expected True or False")
        rules, fn = _rules(rename)
        return cls(rules, fn, missing, "ignore" if partial else unexpected, cast, report)

    @property
    def relaxed(self) -> bool:
        """Whether anything differs from an exact restore (then restore logs its report)."""
        return bool(self.rules or self.rename_fn or self.cast) or (self.missing, self.unexpected) != (
            "error", "error")


def as_fit(partial: "bool | Fit") -> Fit:
    """A Fit from what callers thread through as ``partial`` (a bool, or the Fit itself)."""
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
            raise TypeError(f"rename: expected (regex, replacement) pairs, a dict of them or a function; got {pair!r}")
        pattern, repl = pair
        if repl is not None and not isinstance(repl, str):
            raise TypeError(f"rename: the replacement of {pattern!r} must be a str or None (do not restore), "
                            f"not {type(repl).__name__}")
        try:
            rules.append((re.compile(pattern), repl))
        except (re.error, TypeError) as e:
            raise ValueError(f"rename: {pattern!r} is not a regular expression ({e})") from None
    return tuple(rules), None


# ------------------------------------------------------------------------------------------- report

@dataclass(frozen=True)
class RestoreReport:
    """What a restore did with every key path ('params/dense/kernel'), returned by restore(...,
    report=True) and logged as one line when rename, missing, unexpected or cast was given.

    ``restored``: target leaves read from the checkpoint; ``kept``: target leaves the checkpoint lacks,
    which kept the target's values (torch's ``missing_keys``); ``ignored``: checkpoint leaves not
    restored, because the target lacks them or a rename dropped them (``unexpected_keys``);
    ``renamed``: (checkpoint key path, target key path) pairs; ``cast``: target leaves converted
    from the saved dtype."""

    restored: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()
    cast: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line: 'restored 192 leaves (12 renamed, 192 cast); kept 4 the checkpoint lacks; ignored 3'."""
        extra = [f"{len(v)} {k}" for k, v in (("renamed", self.renamed), ("cast", self.cast)) if v]
        return (f"restored {len(self.restored)} leaves" + (f" ({', '.join(extra)})" if extra else "")
                + (f"; kept {len(self.kept)} the checkpoint lacks: {format_list(list(self.kept), 5)}"
                   if self.kept else "")
                + (f"; ignored {len(self.ignored)} the target lacks: {format_list(list(self.ignored), 5)}"
                   if self.ignored else ""))


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
    if collisions:
        raise RenameCollisionError(
            f"restore of {what}: rename= maps two checkpoint keys to one target key: " + "; ".join(collisions)
            + ". Fix: make the rules map each checkpoint key to its own target key, or drop one "
            "(replacement None); rules apply in order, the first that matches a key path wins.")
    if warn:
        for (pattern, repl), hit in zip(fit.rules, used):
            if not hit:
                warnings.warn(_unused(pattern, repl, saved, what), UserWarning, stacklevel=4)
    return Renamed(by_name, origin, dropped)


def _new_name(name: str, fit: Fit, used: list[bool]) -> str | None:
    if fit.rename_fn is not None:
        new = fit.rename_fn(name)
        if new is not None and not isinstance(new, str):
            raise TypeError(f"rename function: for {name!r} it returned {new!r}; expected a str or None")
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
            raise ValueError(f"rename: replacement {repl!r} of {pattern.pattern!r} fails on {name!r} ({e})") from None
    return name


def _unused(pattern: "re.Pattern[str]", repl: str | None, saved: Sequence[LeafRecord], what: str) -> str:
    """The warning for a rule that matched no key path, with the paths it matches part of."""
    near = [leaf.name for leaf in saved if pattern.search(leaf.name)][:3]
    hint = (f"; it matches part of {format_list(near)}, and rules match whole key paths: prefix it with '.*' "
            "or the path's first keys" if near else "")
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
        return f"cast=True converts only bool, integer, float and complex dtypes, not {src.name} to {dst.name}"
    if _ORDER[b] < _ORDER[a]:
        return (f"cast=True does not convert {_NAMES[a]} {src.name} to {_NAMES[b]} {dst.name} (it would lose "
                "more than rounding)")
    return None


def _max(dt: np.dtype) -> float:
    fam = family(dt)
    if fam == "c":
        return float(np.finfo(dt).max)
    return float(ml_dtypes.finfo(dt).max) if fam == "f" else float(ml_dtypes.iinfo(dt).max) if fam == "i" else 1.0


def _int_range(dt: np.dtype) -> tuple[int, int]:
    if family(dt) == "b":
        return 0, 1
    info = ml_dtypes.iinfo(dt)
    return int(info.min), int(info.max)


def cast_into(src: np.ndarray, dst: np.ndarray, name: str, where: str) -> None:
    """Converts one chunk ``src`` (the saved dtype) into ``dst`` (the target's) as numpy's astype
    does (round to nearest even), first checking that the values fit: an integer target's range holds
    every value, and no finite value becomes inf or NaN (CastOverflowError naming the leaf)."""
    a, b = family(src.dtype), family(dst.dtype)
    if b == "i" and a in ("b", "i") and src.size:
        lo, hi = _int_range(dst.dtype)
        slo, shi = _int_range(src.dtype)
        if slo < lo or shi > hi:
            vlo, vhi = int(src.min()), int(src.max())
            if vlo < lo or vhi > hi:
                raise CastOverflowError(_overflow(name, src.dtype, dst.dtype, f"values in [{vlo}, {vhi}] lie "
                                                  f"outside {dst.dtype.name}'s range [{lo}, {hi}]", where))
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dst, src, casting="unsafe")
    if b in ("f", "c") and a != "b" and src.size and _max(dst.dtype) < _max(src.dtype) and _non_finite(dst):
        lost = np.isfinite(src) & ~np.isfinite(dst)
        if lost.any():
            value = src[lost].flat[0]
            raise CastOverflowError(_overflow(name, src.dtype, dst.dtype, f"{int(lost.sum())} finite values (e.g. "
                                              f"{value!r}) exceed {dst.dtype.name}'s largest, {_max(dst.dtype):g}",
                                              where))


_EXPONENT = {"bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00),
             "float32": (np.uint32, 0x7F800000)}  # IEEE layouts: all exponent bits set = inf/NaN


def _non_finite(dst: np.ndarray) -> bool:
    """Whether ``dst`` holds an inf or NaN: one pass over its exponent bits for the IEEE layouts (the
    common casts), else numpy's isfinite. Only then is the exact check against the source made."""
    bits = _EXPONENT.get(dst.dtype.name) if dst.dtype.isnative else None
    if bits is None or not dst.flags.c_contiguous:
        return not np.isfinite(dst).all()
    view, mask = bits
    return bool(((dst.view(view) & view(mask)) == view(mask)).any())


def _overflow(name: str, src: np.dtype, dst: np.dtype, what: str, where: str) -> str:
    return (f"restore of {name!r}: cast=True cannot convert {src.name} to {dst.name}: {what}, in {where}. "
            f"Nothing was handed back. Fix: restore it into a wider dtype than {dst.name}, or without cast= "
            "into the saved dtype (fc.metadata(path).tree) and convert the values yourself.")


__all__ = ["Fit", "RestoreReport", "Renamed", "as_fit", "cast_into", "cast_problem", "family", "renamed"]
