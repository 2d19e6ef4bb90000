"""The on-disk layout of a native checkpoint: the manifest's schema, its versions and its validation.

A checkpoint is a folder holding ``manifest.json`` plus whatever the serializer wrote. The manifest is
also the commit record: a folder without a valid manifest is not a checkpoint. Its body is covered by
a crc32c, and every field is validated before anything it names is read, so a damaged or hostile
manifest gives an InvalidManifestError and never a read outside the folder or an absurd allocation.
Nothing here touches array bytes; storage access goes through a Storage.
"""

from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import crc32c
import ml_dtypes
import numpy as np

from flax_ckpt._src.errors import CheckpointError, InvalidManifestError

MANIFEST = "manifest.json"
FORMAT_NAME = "flax_ckpt"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20
MAX_NDIM = 64
MAX_DIM = 1 << 48
MAX_ARRAY_BYTES = 1 << 50
MAX_PATH_DEPTH = 512
MAX_CHUNKS_PER_LEAF = 1 << 20
MAX_JSON_DEPTH = 64  # metrics and user metadata; json.loads' recursion stays far off
MAX_LIST_GAPS = 1 << 20  # list slots without a leaf (children with no leaves, e.g. dataclasses of static fields)
LEAF_KINDS = ("jax", "numpy", "prng_key", "scalar", "string", "empty")
EMPTY_KINDS = ("none", "dict", "list", "tuple")
PY_TYPES = ("bool", "int", "float", "complex")


def dtype_from_name(name: str) -> np.dtype:
    """numpy dtype names plus ml_dtypes ones (bfloat16, float8_e4m3fn, int4, ...)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"not a dtype name: {name!r}")
    ml = getattr(ml_dtypes, name, None)
    if isinstance(ml, type) and issubclass(ml, np.generic):  # not ml_dtypes.finfo: np.dtype(class) is object
        return np.dtype(ml)
    dt = np.dtype(name)
    if dt.kind not in "biufc":
        raise ValueError(f"unsupported dtype {name!r}")
    return dt


def dtype_name(dt: np.dtype) -> str:
    return np.dtype(dt).name


def seal(body: dict[str, Any], *, name: str, version: int) -> bytes:
    """A JSON document whose body is covered by a crc32c: ``{"format", "version", "crc32c", "body"}``,
    the body written canonically (sorted keys, no spaces) last, so that a reader finds and checks its
    bytes without parsing twice. One codec for every checksummed JSON file flax_ckpt writes (the
    manifest, the memory tiers' indexes)."""
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    head = {"format": name, "version": version, "crc32c": crc32c.crc32c(canon.encode())}
    return (json.dumps(head)[:-1] + _BODY + canon + "}\n").encode()


_BODY = ', "body": '


def unseal(raw: bytes | memoryview, *, name: str, version: int, where: str, what: str = "manifest",
           error: type[CheckpointError] = InvalidManifestError, max_bytes: int = 256 << 20) -> dict[str, Any]:
    """The verified body of a sealed document; ``error`` (naming ``where``) when it is not valid JSON,
    not of format ``name``/``version``, or its body's checksum does not match."""
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise error(f"{where}: {what} of {len(raw)} bytes exceeds {max_bytes}")
    doc, crc = _fast_parse(raw)
    if doc is None:
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise error(f"{where}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != name:
        raise error(f"{where}: not a {name} {what} (no \"format\": \"{name}\")")
    found = doc.get("version")
    if type(found) is not int or found != version:  # not True or 1.0
        raise error(f"{where}: unknown format version {found!r}; this flax_ckpt reads version {version}. "
                    "Upgrade flax_ckpt to read it.")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise error(f"{where}: {what} has no body object")
    if crc is None:
        crc = crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    if crc != doc.get("crc32c"):
        raise error(f"{where}: {what} checksum mismatch (expected {doc.get('crc32c')!r}, found {crc}); "
                    f"the {what} was modified or damaged")
    return body


def _fast_parse(raw: bytes) -> tuple[dict[str, Any] | None, int | None]:
    """As ``seal`` writes it: the head and the body parsed apart, the body's crc32c taken over its own
    bytes (they are the canonical form). (None, None) for anything else: the caller parses it whole."""
    at = raw.find(_BODY.encode())
    if at < 0 or not raw.endswith(b"}\n"):
        return None, None
    body_bytes = raw[at + len(_BODY):-2]
    try:
        head = json.loads(raw[:at] + b"}")
        if not isinstance(head, dict) or set(head) != {"format", "version", "crc32c"}:
            return None, None
        crc = crc32c.crc32c(body_bytes)
        if crc != head["crc32c"]:
            return None, None  # the slow path reports the mismatch (or finds another layout fine)
        body = json.loads(body_bytes)
    except (ValueError, RecursionError):
        return None, None
    return dict(head, body=body), crc


def encode(body: dict[str, Any], *, check: bool = False) -> bytes:
    """The manifest file's bytes (``seal``ed). ``check`` (saves): first validate ``body`` as restore
    will, so that nothing is committed that could not be read back (a tree nested deeper than
    MAX_PATH_DEPTH, metadata deeper than MAX_JSON_DEPTH, ...)."""
    if check:
        try:
            validate_body(body, "the manifest being written")
        except InvalidManifestError as e:
            raise CheckpointError(f"cannot save: restore would refuse this checkpoint ({e}); "
                                  "nothing was committed") from None
    return seal(body, name=FORMAT_NAME, version=FORMAT_VERSION)


def decode(raw: bytes, where: str) -> dict[str, Any]:
    """Parses and verifies a manifest file; returns its validated body."""
    body = unseal(raw, name=FORMAT_NAME, version=FORMAT_VERSION, where=where, max_bytes=MAX_MANIFEST_BYTES)
    validate_body(body, where)
    return body


class _Check:
    """Field checks that raise InvalidManifestError naming the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, msg: str):
        raise InvalidManifestError(f"{self.where}: field {field}: {msg}")

    def typed(self, obj: Any, key: str, types, field: str, optional: bool = False):
        if not isinstance(obj, dict):
            self.fail(field, f"expected an object, found {type(obj).__name__}")
        if key not in obj:
            if optional:
                return None
            self.fail(f"{field}.{key}", "missing")
        v = obj[key]
        if optional and v is None:
            return None
        if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            self.fail(f"{field}.{key}", f"expected {types}, found bool")
        if not isinstance(v, types):
            self.fail(f"{field}.{key}", f"expected {getattr(types, '__name__', types)}, found {type(v).__name__}")
        return v

    def nonneg_int(self, v: Any, field: str, limit: int):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > limit:
            self.fail(field, f"expected an integer in [0, {limit}], found {v!r}")
        return v


def check_relpath(name: Any, field: str, where: str) -> str:
    """A stored location must be a plain relative path inside the checkpoint folder."""
    if (not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name
            or posixpath.normpath(name) != name or name.split("/")[0] in ("..", ".")
            or any(p in ("..", ".", "") for p in name.split("/")) or name == MANIFEST):
        raise InvalidManifestError(f"{where}: field {field}: location {name!r} is not a relative path inside "
                                   "the checkpoint folder; refusing to read it")
    return name


def validate_leaf(leaf: Any, i: int, c: _Check) -> None:
    f = f"leaves[{i}]"
    path = c.typed(leaf, "path", list, f)
    if len(path) > MAX_PATH_DEPTH:
        c.fail(f + ".path", f"deeper than {MAX_PATH_DEPTH}")
    for j, e in enumerate(path):
        if (not isinstance(e, list) or len(e) != 2 or e[0] not in ("key", "attr", "idx")
                or isinstance(e[1], bool) or not isinstance(e[1], (str, int))
                or (e[0] == "idx" and (not isinstance(e[1], int) or not 0 <= e[1] < 1 << 31))
                or (e[0] == "attr" and not isinstance(e[1], str))):
            c.fail(f"{f}.path[{j}]", f"expected [\"key\"|\"attr\"|\"idx\", key], found {e!r}")
    kind = c.typed(leaf, "kind", str, f)
    if kind not in LEAF_KINDS:
        c.fail(f + ".kind", f"unknown leaf kind {kind!r}")
    if kind == "string":
        c.typed(leaf, "value", str, f)
    elif kind == "empty":
        if c.typed(leaf, "empty", str, f) not in EMPTY_KINDS:
            c.fail(f + ".empty", f"unknown {leaf['empty']!r}")
    elif kind == "scalar":
        py = c.typed(leaf, "py_type", str, f)
        if py not in PY_TYPES:
            c.fail(f + ".py_type", f"unknown {py!r}")
        if py in ("bool", "int"):
            c.typed(leaf, "value", bool if py == "bool" else int, f)
        else:
            hexv = c.typed(leaf, "value", str, f)
            if len(hexv) != (16 if py == "float" else 32) or any(ch not in "0123456789abcdef" for ch in hexv):
                c.fail(f + ".value", f"expected hex bytes of a {py}, found {hexv!r}")
    else:
        validate_array(leaf, f, c)


def validate_array(leaf: dict, f: str, c: _Check) -> None:
    try:
        dt = dtype_from_name(c.typed(leaf, "dtype", str, f))
    except (TypeError, ValueError) as e:
        c.fail(f + ".dtype", str(e))
    shape = c.typed(leaf, "shape", list, f)
    if len(shape) > MAX_NDIM:
        c.fail(f + ".shape", f"more than {MAX_NDIM} dimensions")
    for d in shape:
        c.nonneg_int(d, f + ".shape", MAX_DIM)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes > MAX_ARRAY_BYTES:
        c.fail(f + ".shape", f"{shape} of {dt} is {nbytes} bytes, more than any checkpoint holds")
    if leaf["kind"] == "prng_key":
        c.typed(leaf, "key_impl", str, f)
        key_shape = c.typed(leaf, "key_shape", list, f)
        for d in key_shape:
            c.nonneg_int(d, f + ".key_shape", MAX_DIM)
        if not key_shape or len(key_shape) > len(shape) or shape[len(shape) - len(key_shape):] != key_shape:
            c.fail(f + ".key_shape", f"{key_shape!r} is not the trailing dimensions of shape {shape}")
    c.typed(leaf, "sharding", dict, f, optional=True)
    chunks = c.typed(leaf, "chunks", list, f)
    if len(chunks) > MAX_CHUNKS_PER_LEAF:
        c.fail(f + ".chunks", "too many chunks")
    volume = 0
    for j, ch in enumerate(chunks):
        index = c.typed(ch, "index", list, f"{f}.chunks[{j}]")
        if len(index) != len(shape):
            c.fail(f"{f}.chunks[{j}].index", f"rank {len(index)} differs from shape {shape}")
        for k, b in enumerate(index):
            if (not isinstance(b, list) or len(b) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in b)
                    or not 0 <= b[0] <= b[1] <= shape[k]):
                c.fail(f"{f}.chunks[{j}].index", f"{b!r} is not inside dimension {k} of {shape}")
        volume += math.prod(b - a for a, b in index)
    if volume != math.prod(shape) or not boxes_disjoint([ch["index"] for ch in chunks]):
        c.fail(f + ".chunks", f"chunks do not tile the array of shape {shape} exactly")


def boxes_disjoint(boxes: Iterable[Sequence[Sequence[int]]]) -> bool:
    """Whether no two non-empty boxes overlap."""
    nonempty = [b for b in boxes if all(s < e for s, e in b)]
    if len(nonempty) < 2:
        return True
    a = np.asarray(nonempty, dtype=np.int64)  # (n, ndim, 2)
    if len(a) > 4096:  # volume already matches; pairwise check is quadratic
        return len({tuple(map(tuple, b)) for b in nonempty}) == len(nonempty)
    lo = np.maximum(a[:, None, :, 0], a[None, :, :, 0])
    hi = np.minimum(a[:, None, :, 1], a[None, :, :, 1])
    overlap = np.all(lo < hi, axis=-1)
    np.fill_diagonal(overlap, False)
    return not overlap.any()


def validate_body(body: dict, where: str) -> None:
    c = _Check(where)
    c.typed(body, "step", int, "body", optional=True)
    c.typed(body, "metrics", dict, "body", optional=True)
    for key in ("metrics", "metadata"):
        if json_depth(body.get(key)) > MAX_JSON_DEPTH:
            c.fail(f"body.{key}", f"nested deeper than {MAX_JSON_DEPTH} levels")
    c.typed(body, "process_count", int, "body")
    c.typed(body, "created", (int, float), "body")
    c.typed(body, "serializer", str, "body")
    files = c.typed(body, "files", dict, "body")
    for name, size in files.items():
        check_relpath(name, f"files[{name!r}]", where)
        c.nonneg_int(size, f"files[{name!r}]", MAX_ARRAY_BYTES)
    leaves = c.typed(body, "leaves", list, "body")
    for i, leaf in enumerate(leaves):
        validate_leaf(leaf, i, c)
    check_tree([leaf["path"] for leaf in leaves], c)


def json_depth(obj: Any) -> int:
    """How deeply lists and objects nest in ``obj`` (0 for a scalar); iterative, so any depth is safe."""
    depth, level = 0, [obj]
    while True:
        containers = [x for x in level if isinstance(x, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]


class _Node:
    """A folder of the key-path trie: its children by key string, and whether they are indices."""

    __slots__ = ("children", "group", "top")

    def __init__(self):
        self.children: dict[str, tuple[tuple[str, Any], Any]] = {}
        self.group: str | None = None  # "idx", "int" (dict keys) or "name"
        self.top = -1  # the largest index seen (a list of top + 1 slots is built on restore)


_LEAF = object()


def check_tree(paths: list[list], c: _Check) -> None:
    """The key paths must form one tree: no path is a prefix or a duplicate of another, also as key
    strings (what restore matches leaves by: ["key", 1], ["key", "1"] and ["attr", "1"] are one key),
    the children of a node are all indices or all names, and lists stay small (their slots total at
    most the number of leaves plus MAX_LIST_GAPS), so that nesting the result can neither fail nor
    allocate without bound."""
    if len(paths) > 1 and not all(paths):
        c.fail(f"leaves[{[bool(p) for p in paths].index(False)}].path", "the root is a leaf beside others")
    root, lists = _Node(), []
    for i, path in enumerate(paths):
        node = root
        for j, (kind, key) in enumerate(path):
            if node is _LEAF:
                c.fail(f"leaves[{i}].path", f"{path!r} passes through another leaf")
            group = "idx" if kind == "idx" else "int" if isinstance(key, int) else "name"
            if node.group not in (None, group):  # jax flattens no such node: it cannot sort mixed keys
                c.fail(f"leaves[{i}].path[{j}]", "a node mixes sequence indices, integer keys and names")
            if node.group is None and group == "idx":
                lists.append(node)
            node.group = group
            if kind == "idx":
                node.top = max(node.top, key)
            last = j == len(path) - 1
            prev = node.children.get(str(key))
            if prev is None:
                child = _LEAF if last else _Node()
                node.children[str(key)] = ((kind, key), child)
            elif prev[0] != (kind, key) or last:
                c.fail(f"leaves[{i}].path", f"{path!r} duplicates or contains the key path of another leaf")
            else:
                child = prev[1]
            node = child
    if sum(n.top + 1 for n in lists) > len(paths) + MAX_LIST_GAPS:
        c.fail("leaves", "sequence indices leave more gaps than any saved tree has")


# ------------------------------------------------------------------------------------------ records

@dataclass(frozen=True, eq=False)
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

    @property
    def name(self) -> str:
        """The key path as a string ('params/dense/kernel'): what leaves are matched and named by."""
        n = self.__dict__.get("_name")
        if n is None:
            n = keystr(self.path)
            object.__setattr__(self, "_name", n)
        return n

    @property
    def is_array(self) -> bool:
        return self.kind in ARRAY_KINDS

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize if self.is_array else 0

    @property
    def logical_shape(self) -> tuple[int, ...] | None:
        """The shape a user sees: for a PRNG key array, without the key data's trailing dimensions."""
        if self.kind == "prng_key":
            return self.shape[:len(self.shape) - len(self.key_shape)]
        return self.shape

    def with_chunks(self, chunks: Sequence[dict[str, Any]]) -> "LeafRecord":
        return LeafRecord(self.path, self.kind, self.dtype, self.shape, self.key_impl, self.key_shape, self.sharding,
                          tuple(chunks), self.value, self.python)

    def describe(self) -> str:
        """As error messages show it: float32[4,6], key<threefry2x32>[2], Python int, str, None, {}."""
        if self.kind in ("jax", "numpy"):
            text = f"{self.dtype.name}{list(self.shape)}".replace(" ", "")
            return f"Python scalar ({text})" if self.python else text
        if self.kind == "prng_key":
            return f"key<{self.key_impl}>{list(self.logical_shape)}".replace(" ", "")
        if self.kind == "scalar":
            return f"Python {type(self.value).__name__}"
        if self.kind == "string":
            return "str"
        if self.kind == "json":
            return "JSON item"
        return {"none": "None", "dict": "{}", "list": "[]", "tuple": "()"}[self.value]

    # The manifest's JSON form (see validate_leaf for its schema).

    def to_json(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"path": [[k, v] for k, v in self.path], "kind": self.kind}
        if self.kind == "empty":
            rec["empty"] = self.value
        elif self.kind == "string":
            rec["value"] = self.value
        elif self.kind == "scalar":  # ints and bools exactly in JSON, floats as their bytes (NaN payloads, -0.0)
            py = type(self.value).__name__
            rec["py_type"] = py
            rec["value"] = self.value if py in ("bool", "int") else \
                np.asarray(self.value, np.float64 if py == "float" else np.complex128).tobytes().hex()
        else:
            if self.kind == "prng_key":
                rec["key_impl"], rec["key_shape"] = self.key_impl, list(self.key_shape)
            rec.update(dtype=self.dtype.name, shape=list(self.shape), sharding=self.sharding,
                       chunks=list(self.chunks))
        return rec

    @staticmethod
    def from_json(rec: dict[str, Any]) -> "LeafRecord":
        """The record of a validated manifest leaf (validate_leaf)."""
        path = tuple((k, v) for k, v in rec["path"])
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
            return LeafRecord(path, kind, value={"float": float, "complex": complex}[py](
                np.frombuffer(bytes.fromhex(v), dt)[0]))
        key_shape = tuple(rec["key_shape"]) if kind == "prng_key" else None
        return LeafRecord(path, kind, dtype_from_name(rec["dtype"]), tuple(rec["shape"]), rec.get("key_impl"),
                          key_shape, rec.get("sharding"), tuple(rec.get("chunks", ())))


ARRAY_KINDS = ("jax", "numpy", "prng_key")  # leaf kinds with a dtype, a shape and chunks


def leaf_name(rec: dict[str, Any]) -> str:
    """The key path string of a leaf record in its JSON form (a manifest's or a memory-tier index's)."""
    return keystr([tuple(e) for e in rec["path"]])


def keystr(path: Sequence[tuple[str, Any]]) -> str:
    """'params/dense/kernel'; '/' and '%' inside keys are escaped so the string identifies the leaf."""
    if not path:
        return "<root>"
    return "/".join(str(k).replace("%", "%25").replace("/", "%2F") for _, k in path)
