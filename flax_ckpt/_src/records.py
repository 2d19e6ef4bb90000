"""The typed record of one saved leaf, whatever the layout, and the names it is matched by.

Scope: ``LeafRecord`` (what a native manifest, an Orbax ``_METADATA`` or a memory-tier index holds of
one leaf, as the engine checks targets against and reads from), dtype names (numpy's and ml_dtypes'),
key-path strings, and ``PersistTimes`` (what every layout's ``persist`` reports). No I/O; the native
manifest's schema and validation are native/manifest.py's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from flax_ckpt._src.checks import canonical
from flax_ckpt._src.lazy import lazy

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import ml_dtypes
else:
    ml_dtypes = lazy("ml_dtypes", globals())  # imported on first use (lazy.py)

ARRAY_KINDS = ("jax", "numpy", "prng_key")  # leaf kinds with a dtype, a shape and chunks


def dtype_from_name(name: str) -> np.dtype:
    """numpy dtype names plus ml_dtypes ones (bfloat16, float8_e4m3fn, int4, ...)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"not a dtype name: {name!r}")
    return _dtype_named(name)


@functools.lru_cache(maxsize=256)
def _dtype_named(name: str) -> np.dtype:
    try:  # numpy's own numbers first: ml_dtypes (seconds to import) only for the names numpy lacks
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt is not None and dt.kind in "biufc":
        return dt
    ml = getattr(ml_dtypes, name, None)
    if isinstance(ml, type) and issubclass(ml, np.generic):  # not ml_dtypes.finfo: np.dtype(class) is object
        return np.dtype(ml)
    if dt is None:
        raise TypeError(f"data type {name!r} not understood")
    raise ValueError(f"unsupported dtype {name!r}")


def dtype_name(dt: np.dtype) -> str:
    return np.dtype(dt).name


@dataclass(frozen=True, eq=False, slots=True)
class LeafRecord:
    """One leaf as a checkpoint holds it, whatever the layout (native manifest, Orbax ``_METADATA``,
    memory-tier index): the typed form the engine checks targets against and reads from.

    ``kind`` is one of LEAF_KINDS. Arrays ("jax", "numpy", "prng_key") have ``dtype`` and the stored
    ``shape`` (for PRNG keys including the trailing ``key_shape`` of the key data, with ``key_impl``),
    their ``sharding`` description and ``chunks``, the records of whoever stores their bytes (a
    serializer; validated by it). ``python``: an array that is a Python number stored as a 0-d array
    (Orbax's "scalar"), given back as a number. Other kinds carry ``value``: the Python number
    ("scalar"), the text ("string"), the empty container's kind ("empty": one of EMPTY_KINDS) or, for
    the kind "json" that only Orbax sources have (an Orbax JSON item, never in a native manifest), the
    parsed JSON document."""

    path: tuple[tuple[str, Any], ...]
    kind: str
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None
    key_impl: str | None = None
    key_shape: tuple[int, ...] | None = None
    sharding: dict[str, Any] | None = None
    chunks: tuple[dict[str, Any], ...] = ()
    value: Any = None
    python: bool = False
    # made on first use and kept (slots, not a __dict__: a record per leaf, 10^6 of them in a large tree)
    _name: str | None = field(default=None, init=False, repr=False)
    _text: str | None = field(default=None, init=False, repr=False)
    _json: dict[str, Any] | None = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        """The key path as a string ('params/dense/kernel'): what leaves are matched and named by."""
        n = self._name
        if n is None:
            n = keystr(self.path)
            object.__setattr__(self, "_name", n)
        return n

    @property
    def is_array(self) -> bool:
        return self.kind in ARRAY_KINDS

    @property
    def array_dtype(self) -> np.dtype:
        """``dtype``, of a leaf known to be an array (every array kind has one)."""
        assert self.dtype is not None, f"{self.name}: a {self.kind} leaf has no dtype"
        return self.dtype

    @property
    def array_shape(self) -> tuple[int, ...]:
        """``shape``, of a leaf known to be an array (every array kind has one)."""
        assert self.shape is not None, f"{self.name}: a {self.kind} leaf has no shape"
        return self.shape

    @property
    def nbytes(self) -> int:
        if not self.is_array:
            return 0
        shape, dtype = self.shape, self.dtype  # read per leaf of a restore: no property calls
        assert shape is not None and dtype is not None, f"{self.name}: a {self.kind} leaf has no shape"
        return math.prod(shape) * dtype.itemsize

    @property
    def logical_shape(self) -> tuple[int, ...] | None:
        """The shape a user sees: for a PRNG key array, without the key data's trailing dimensions."""
        if self.kind == "prng_key":
            return self.array_shape[: len(self.array_shape) - len(self._key_shape)]
        return self.shape

    @property
    def _key_shape(self) -> tuple[int, ...]:
        assert self.key_shape is not None, f"{self.name}: a PRNG key leaf has a key_shape"
        return self.key_shape

    def with_chunks(self, chunks: Sequence[dict[str, Any]]) -> "LeafRecord":
        return LeafRecord(
            self.path,
            self.kind,
            self.dtype,
            self.shape,
            self.key_impl,
            self.key_shape,
            self.sharding,
            tuple(chunks),
            self.value,
            self.python,
        )

    def describe(self) -> str:
        """As error messages show it: float32[4,6], key<threefry2x32>[2], Python int, str, None, {}."""
        if self.kind in ("jax", "numpy"):
            text = f"{self.array_dtype.name}{list(self.array_shape)}".replace(" ", "")
            return f"Python scalar ({text})" if self.python else text
        if self.kind == "prng_key":
            logical = self.array_shape[: len(self.array_shape) - len(self._key_shape)]  # logical_shape
            return f"key<{self.key_impl}>{list(logical)}".replace(" ", "")
        if self.kind == "scalar":
            return f"Python {type(self.value).__name__}"
        if self.kind == "string":
            return "str"
        if self.kind == "json":
            return "JSON item"
        return {"none": "None", "dict": "{}", "list": "[]", "tuple": "()"}[self.value]

    # The manifest's JSON form (see validate_leaf for its schema).

    def json(self) -> dict[str, Any]:
        """``to_json()``, made once per record and shared: read-only (a snapshot of a structure saved
        before reuses its records, engine/snapshot.py, so a memory-tier copy at every step does not
        build them again). Only the memory tiers' differential copies ask for it: a manifest is made
        from ``json_text`` (a dict per leaf, kept, is ~7 times the leaf's text)."""
        j = self._json
        if j is None:
            j = self.to_json()
            object.__setattr__(self, "_json", j)
        return j

    def json_text(self) -> str:
        """``to_json()`` in its canonical text (checks.canonical), made once per record and kept."""
        t = self._text
        if t is None:
            t = canonical(self._json if self._json is not None else self.to_json())
            object.__setattr__(self, "_text", t)
        return t

    def to_json(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"path": [[k, v] for k, v in self.path], "kind": self.kind}
        if self.kind == "empty":
            rec["empty"] = self.value
        elif self.kind == "string":
            rec["value"] = self.value
        elif (
            self.kind == "scalar"
        ):  # ints and bools exactly in JSON, floats as their bytes (NaN payloads, -0.0)
            py = type(self.value).__name__
            rec["py_type"] = py
            rec["value"] = (
                self.value
                if py in ("bool", "int")
                else np.asarray(self.value, np.float64 if py == "float" else np.complex128).tobytes().hex()
            )
        else:
            if self.kind == "prng_key":
                rec["key_impl"], rec["key_shape"] = self.key_impl, list(self._key_shape)
            rec.update(
                dtype=self.array_dtype.name,
                shape=list(self.array_shape),
                sharding=self.sharding,
                chunks=list(self.chunks),
            )
        return rec

    @staticmethod
    def from_json(rec: dict[str, Any], path: "tuple[tuple[str, Any], ...] | None" = None) -> "LeafRecord":
        """The record of a validated manifest leaf (validate_leaf); ``path``: its key path, when the
        caller made it already."""
        path = tuple((k, v) for k, v in rec["path"]) if path is None else path
        kind = rec["kind"]
        if kind == "empty":
            return LeafRecord(path, kind, value=rec["empty"])
        if kind == "string":
            return LeafRecord(path, kind, value=rec["value"])
        if kind == "scalar":
            py, v = rec["py_type"], rec["value"]
            if py in ("bool", "int"):
                return LeafRecord(path, kind, value=v)
            dt = np.float64 if py == "float" else np.complex128
            return LeafRecord(
                path,
                kind,
                value={"float": float, "complex": complex}[py](np.frombuffer(bytes.fromhex(v), dt)[0]),
            )
        key_shape = tuple(rec["key_shape"]) if kind == "prng_key" else None
        return LeafRecord(
            path,
            kind,
            dtype_from_name(rec["dtype"]),
            tuple(rec["shape"]),
            rec.get("key_impl"),
            key_shape,
            rec.get("sharding"),
            tuple(rec.get("chunks", ())),
        )


def leaf_name(rec: dict[str, Any]) -> str:
    """The key path string of a leaf record in its JSON form (a manifest's or a memory-tier index's)."""
    return keystr([tuple(e) for e in rec["path"]])


def keystr(path: Sequence[tuple[str, Any]]) -> str:
    """'params/dense/kernel'; '/' and '%' inside keys are escaped so the string identifies the leaf."""
    if not path:
        return "<root>"
    return "/".join(str(k).replace("%", "%25").replace("/", "%2F") for _, k in path)


@dataclass
class PersistTimes:
    """Seconds spent in each background phase of one save (fsync, serialize and written: as this
    process's serializer reported them in its ``Written``)."""

    write: float = 0.0
    commit: float = 0.0
    fsync: float = 0.0  # part of write: summed over writer threads (local file systems)
    serialize: float = 0.0  # part of write: checksums, summed over writer threads
    written: int = 0  # bytes handed to storage (data files)
