"""The native layout's manifest: its schema, its versions and its validation.

A checkpoint is a folder holding ``manifest.json`` plus whatever the serializer wrote. The manifest is
also the commit record: a folder without a valid manifest is not a checkpoint. Its body is covered by
a crc32c, and every field is validated before anything it names is read, so a damaged or hostile
manifest gives an InvalidManifestError and never a read outside the folder or an absurd allocation. The
typed record of a leaf is records.py's; the checksummed JSON codec (``seal``/``unseal``), the
tiling check and the key-path tree check are checks.py's, shared with the other layouts.
Nothing here touches array bytes; storage access goes through a Storage.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Literal, NoReturn, Sequence, TypeVar, cast, overload

from flax_ckpt._src.checks import (  # noqa: F401 (re-exported)
    MAX_LIST_GAPS,
    MAX_MANIFEST_BYTES,
    MAX_PATH_DEPTH,
    canonical,
    check_path,
    check_relpath,
    check_tree,
    numpy_bytes,
    seal,
    seal_parts,
    seal_text,
    sealed_body,
    tiling_problem,
    unseal,
)
from flax_ckpt._src.errors import CheckpointError, InvalidManifestError
from flax_ckpt._src.records import ARRAY_KINDS, LeafRecord, dtype_from_name, leaf_name

FORMAT_NAME = "flax_ckpt"
FORMAT_VERSION = 1
MAX_NDIM = 64
MAX_DIM = 1 << 48
MAX_ARRAY_BYTES = 1 << 50
MAX_CHUNKS_PER_LEAF = 1 << 20
MAX_JSON_DEPTH = 64  # metrics and user metadata; json.loads' recursion stays far off
LEAF_KINDS = ("jax", "numpy", "prng_key", "scalar", "string", "empty")
EMPTY_KINDS = ("none", "dict", "list", "tuple")
PY_TYPES = ("bool", "int", "float", "complex")


def encode(body: dict[str, Any], *, check: bool = False) -> bytes:
    """The manifest file's bytes (``seal``ed). ``check`` (saves): first validate ``body`` as restore
    will, so that nothing is committed that could not be read back (a tree nested deeper than
    MAX_PATH_DEPTH, metadata deeper than MAX_JSON_DEPTH, ...)."""
    if check:
        try:
            validate_body(body, "the manifest being written")
        except InvalidManifestError as e:
            raise CheckpointError(
                f"cannot save: restore would refuse this checkpoint ({e}); nothing was committed"
            ) from None
    return seal(body, name=FORMAT_NAME, version=FORMAT_VERSION)


class SaveManifests:
    """Makes the manifests of one writer's saves: ``encode(body, check=True)``, byte for byte, made
    faster for a structure saved before. The text is joined from each leaf record's canonical text,
    made once per record (LeafRecord.json_text), and its chunks' (a body of dicts per leaf, built and
    encoded again at every save, cost 30 us a leaf, and its containers, reaching the collector's
    oldest generation, a full collection at about every save of 5,000 leaves). A leaf is validated
    when it differs from the same leaf of the last save made here (its record's text or its chunks'
    boxes: what its validation reads), the tree when a key path changed, the rest at every save."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._was: tuple[list[str], list[int], list[Any], list[Any]] | None = None  # the last save's leaves:
        #           texts, chunk counts, chunk boxes (flat), key paths

    def encode(
        self,
        head: dict[str, Any],
        records: Sequence[LeafRecord],
        chunks: Sequence[list[dict[str, Any]] | None],
    ) -> bytes:
        """``head``: the body without "leaves"; per leaf its record and, for an array, its chunks."""
        texts = [r.json_text() for r in records]
        counts = [-1 if ch is None else len(ch) for ch in chunks]  # the chunks' boxes, flat: two lists a save
        boxes = [c.get("index") if isinstance(c, dict) else c for ch in chunks if ch for c in ch]
        with self._mutex:
            was = self._was
        if was is not None and was[1] == counts and was[2] == boxes:  # the boxes as last time: compare texts
            todo = [i for i, (t, w) in enumerate(zip(texts, was[0])) if t != w]
        else:
            todo = list(range(len(records)))
        same = was is not None and len(was[0]) == len(texts)
        c = _Check("the manifest being written")
        try:
            validate_head(head, c)
            for i in todo:
                validate_leaf(_leaf(records[i], chunks[i]), i, c)
            if was is None or not same or any(records[i].path != was[3][i] for i in todo):
                check_tree([r.path for r in records], c)  # as the lists of their JSON: the same checks
        except InvalidManifestError as e:
            raise CheckpointError(
                f"cannot save: restore would refuse this checkpoint ({e}); nothing was committed"
            ) from None
        with self._mutex:
            self._was = (texts, counts, boxes, [r.path for r in records])
        low = canonical({k: v for k, v in head.items() if k < "leaves"})[1:-1]
        high = canonical({k: v for k, v in head.items() if k > "leaves"})[1:-1]
        parts = ["{" + low + ("," if low else "") + '"leaves":[']
        parts += _joined(records, chunks, texts)
        parts.append("]" + ("," if high else "") + high + "}")
        return seal_parts(parts, name=FORMAT_NAME, version=FORMAT_VERSION)


_PART = 1 << 20  # characters of the manifest's text joined at a time (see _joined)


def _joined(
    records: Sequence[LeafRecord], chunks: Sequence[list[dict[str, Any]] | None], texts: Sequence[str]
) -> list[str]:
    """The leaves' texts, comma-separated, as a few parts of about _PART characters each: a leaf's text
    with its chunks lives only until its part is joined (a list of them all would be the manifest's
    size again, and their join once more)."""
    out: list[str] = []
    run: list[str] = []
    size = 0
    for i, (r, ch, t) in enumerate(zip(records, chunks, texts)):
        piece = _leaf_text(r, ch, t)
        run.append(piece if not i else "," + piece)
        size += len(piece)
        if size >= _PART:
            out.append("".join(run))
            run, size = [], 0
    out.append("".join(run))
    return out


def _leaf(record: LeafRecord, chunks: list[dict[str, Any]] | None) -> dict[str, Any]:
    return record.to_json() if chunks is None else dict(record.to_json(), chunks=chunks)


_NO_CHUNKS = (
    '{"chunks":[]'  # how an array record's canonical text starts: "chunks" sorts before its other keys
)


def _leaf_text(record: LeafRecord, chunks: list[dict[str, Any]] | None, text: str) -> str:
    """canonical(_leaf(record, chunks)); ``text``: the record's (``json_text``)."""
    if chunks is None:
        return text
    if text.startswith(_NO_CHUNKS + ","):
        return '{"chunks":' + canonical(chunks) + text[len(_NO_CHUNKS) :]
    return canonical(_leaf(record, chunks))


def decode(raw: bytes, where: str) -> dict[str, Any]:
    """Parses and verifies a manifest file; returns its validated body."""
    body = unseal(raw, name=FORMAT_NAME, version=FORMAT_VERSION, where=where)  # at most MAX_MANIFEST_BYTES
    validate_body(body, where)
    return body


def decode_records(raw: bytes, where: str) -> tuple[dict[str, Any], list[LeafRecord]]:
    """``decode``'s checks, in its order, with its errors; returns the body without "leaves" and a
    record per leaf. A manifest as ``seal`` writes it (its body's crc32c checked first, over all of
    it) is parsed leaf by leaf, each leaf validated and turned into its record before the next is
    parsed, so its dicts never all exist at once (they are ~7 times the text; a record ~4), and equal
    keys, key-path entries and shapes are shared between records. Anything else (a body written with
    spaces, duplicate keys, bad JSON, a wrong checksum) goes through ``decode``, which reports it."""
    if len(raw) <= MAX_MANIFEST_BYTES:
        found = sealed_body(raw)
        if found is not None and found[0].get("format") == FORMAT_NAME:
            version = found[0].get("version")
            if type(version) is int and version == FORMAT_VERSION:
                try:  # json.loads' decoding of bytes that start with '{"'
                    return _streamed(str(found[1], "utf-8", "surrogatepass"), where)
                except (_NotCanonical, UnicodeDecodeError):
                    pass
    body = decode(raw, where)
    leaves = body.pop("leaves")
    return body, [LeafRecord.from_json(r) for r in leaves]


class _NotCanonical(Exception):
    """The body is not as ``seal`` writes it (or not JSON): ``decode`` parses it whole instead."""


_SCAN = cast(Any, json.JSONDecoder()).scan_once  # json.loads' own scanner (its defaults), one value at
#   a time (an attribute its type stub does not declare)


def _scan(s: str, at: int) -> tuple[Any, int]:
    try:
        return _SCAN(s, at)
    except (StopIteration, ValueError, RecursionError):
        raise _NotCanonical from None


def _streamed(s: str, where: str) -> tuple[dict[str, Any], list[LeafRecord]]:
    """``decode_records`` of a body's text: its fields apart from "leaves" parsed as they are, the
    leaves one by one. The first invalid leaf is raised after the fields were checked (``decode``
    checks them first); the key paths are checked as one tree as ``decode`` does."""
    if not s.startswith('{"'):
        raise _NotCanonical
    body: dict[str, Any] = {}
    records: list[LeafRecord] | None = None
    failed: InvalidManifestError | None = None
    at = 1
    try:
        while True:
            key, at = _scan(s, at)
            if s[at] != ":" or key in body or (key == "leaves" and records is not None):
                raise _NotCanonical  # spaces, or a key twice (json.loads keeps the last)
            at += 1
            if key == "leaves" and s[at] == "[":
                records, failed, at = _leaves(s, at + 1, where)
            else:
                body[key], at = _scan(s, at)
            if s[at] == "," and s[at + 1] == '"':
                at += 1
                continue
            if s[at] == "}" and at == len(s) - 1:
                break
            raise _NotCanonical
    except IndexError:
        raise _NotCanonical from None
    c = _Check(where)
    validate_head(body, c)
    if records is None:  # "leaves" missing, or not a list (a list is parsed above): refused as decode does
        c.typed(body, "leaves", list, "body")
        raise _NotCanonical
    if failed is not None:
        raise failed
    check_tree([r.path for r in records], c)
    return body, records


def _leaves(s: str, at: int, where: str) -> tuple[list[LeafRecord], InvalidManifestError | None, int]:
    """The records of the leaves array starting at ``at`` (past its "["), the first leaf's validation
    error (the leaves after it parsed but not kept), and where the array ends (past its "]")."""
    records: list[LeafRecord] = []
    if s[at] == "]":
        return records, None, at + 1
    c, memo, failed, i = _Check(where), {}, None, 0
    while True:
        leaf, at = _scan(s, at)
        if failed is None:
            try:
                validate_leaf(leaf, i, c)
                records.append(_record(leaf, memo))
            except InvalidManifestError as e:
                failed, records = e, []
        i += 1
        if s[at] == "]":
            return records, failed, at + 1
        if s[at] != ",":
            raise _NotCanonical
        at += 1


def _record(leaf: dict[str, Any], memo: dict[Any, Any]) -> LeafRecord:
    """``LeafRecord.from_json(leaf)`` of a validated leaf, its key-path entries, shape, kind and its
    chunk records' keys and strings taken from ``memo`` where an earlier leaf had equal ones (one
    object each instead of one per leaf: the chunk records stay dicts, as serializers read them)."""
    m = memo.setdefault
    path = tuple(m(e, e) for e in ((k, v) for k, v in leaf["path"]))
    kind = leaf["kind"] = m(leaf["kind"], leaf["kind"])
    if kind not in ARRAY_KINDS:
        return LeafRecord.from_json(leaf, path)
    shape = tuple(leaf["shape"])
    chunks = tuple(
        {m(k, k): (m(v, v) if type(v) is str else v) for k, v in ch.items()} for ch in leaf["chunks"]
    )
    key_shape = tuple(leaf["key_shape"]) if kind == "prng_key" else None
    return LeafRecord(
        path,
        kind,
        dtype_from_name(leaf["dtype"]),
        m(shape, shape),
        leaf.get("key_impl"),
        key_shape,
        leaf.get("sharding"),
        chunks,
    )


_T = TypeVar("_T")


class _Check:
    """Field checks that raise InvalidManifestError naming the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, msg: str) -> NoReturn:
        raise InvalidManifestError(f"{self.where}: field {field}: {msg}")

    @overload
    def typed(
        self, obj: Any, key: str, types: type[_T], field: str, optional: Literal[False] = False
    ) -> _T: ...
    @overload
    def typed(self, obj: Any, key: str, types: type[_T], field: str, optional: bool) -> _T | None: ...
    @overload
    def typed(
        self, obj: Any, key: str, types: tuple[type, ...], field: str, optional: bool = False
    ) -> Any: ...
    def typed(self, obj: Any, key: str, types: Any, field: str, optional: bool = False) -> Any:
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
            self.fail(
                f"{field}.{key}", f"expected {getattr(types, '__name__', types)}, found {type(v).__name__}"
            )
        return v

    def nonneg_int(self, v: Any, field: str, limit: int):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > limit:
            self.fail(field, f"expected an integer in [0, {limit}], found {v!r}")
        return v


def validate_leaf(leaf: Any, i: int, c: _Check) -> None:
    f = f"leaves[{i}]"
    check_path(c.typed(leaf, "path", list, f), f + ".path", c)
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
    nbytes = numpy_bytes(shape, dt.itemsize)  # zero dimensions aside: numpy refuses [0, 2**61, 2**61]
    if nbytes > MAX_ARRAY_BYTES:
        c.fail(f + ".shape", f"{shape} of {dt} spans {nbytes} bytes, more than any checkpoint holds")
    if leaf["kind"] == "prng_key":
        c.typed(leaf, "key_impl", str, f)
        key_shape = c.typed(leaf, "key_shape", list, f)
        for d in key_shape:
            c.nonneg_int(d, f + ".key_shape", MAX_DIM)
        if not key_shape or len(key_shape) > len(shape) or shape[len(shape) - len(key_shape) :] != key_shape:
            c.fail(f + ".key_shape", f"{key_shape!r} is not the trailing dimensions of shape {shape}")
    c.typed(leaf, "sharding", dict, f, optional=True)
    chunks = c.typed(leaf, "chunks", list, f)
    if len(chunks) > MAX_CHUNKS_PER_LEAF:
        c.fail(f + ".chunks", "too many chunks")
    for j, ch in enumerate(chunks):
        index = c.typed(ch, "index", list, f"{f}.chunks[{j}]")
        if len(index) != len(shape):
            c.fail(f"{f}.chunks[{j}].index", f"rank {len(index)} differs from shape {shape}")
        for k, b in enumerate(index):
            if (
                not isinstance(b, list)
                or len(b) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in b)
                or not 0 <= b[0] <= b[1] <= shape[k]
            ):
                c.fail(f"{f}.chunks[{j}].index", f"{b!r} is not inside dimension {k} of {shape}")
    problem = tiling_problem([ch["index"] for ch in chunks], [(0, d) for d in shape])
    if problem is not None:
        c.fail(
            f"{f}.chunks (leaf {leaf_name(leaf)!r})",
            f"chunks do not tile the array of shape {shape} exactly: "
            f"{problem}; the manifest is damaged or crafted",
        )


def validate_body(body: dict, where: str) -> None:
    c = _Check(where)
    validate_head(body, c)
    leaves = c.typed(body, "leaves", list, "body")
    for i, leaf in enumerate(leaves):
        validate_leaf(leaf, i, c)
    check_tree([leaf["path"] for leaf in leaves], c)


def validate_head(body: dict, c: _Check) -> None:
    """Every field of the body but its leaves."""
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
        check_relpath(name, f"files[{name!r}]", c.where)
        c.nonneg_int(size, f"files[{name!r}]", MAX_ARRAY_BYTES)
    ident = c.typed(body, "id", str, "body", optional=True)
    if ident is not None and not _is_id(ident):
        c.fail("body.id", f"expected 32 hex digits, found {ident!r}")
    shared = c.typed(body, "shared", dict, "body", optional=True)
    for step, held in (shared or {}).items():
        f = f"shared[{step!r}]"
        if not (step.isascii() and step.isdigit()):
            c.fail(f, "not a step folder of the run (digits)")
        if not _is_id(c.typed(held, "id", str, f)):
            c.fail(f + ".id", f"expected 32 hex digits, found {held['id']!r}")
        for name, size in c.typed(held, "files", dict, f).items():
            check_relpath(name, f"{f}.files[{name!r}]", c.where)
            c.nonneg_int(size, f"{f}.files[{name!r}]", MAX_ARRAY_BYTES)


def _is_id(value: str) -> bool:
    """A save's id (native/sharing.py): 32 lowercase hex digits."""
    return len(value) == 32 and all(ch in "0123456789abcdef" for ch in value)


def json_depth(obj: Any) -> int:
    """How deeply lists and objects nest in ``obj`` (0 for a scalar); iterative, so any depth is safe."""
    depth, level = 0, [obj]
    while True:
        containers = [x for x in level if isinstance(x, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]
