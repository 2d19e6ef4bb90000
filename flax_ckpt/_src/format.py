"""The on-disk layout of a native checkpoint: the manifest's schema, its versions and its validation.

A checkpoint is a folder holding ``manifest.json`` plus whatever the serializer wrote. The manifest is
also the commit record: a folder without a valid manifest is not a checkpoint. Its body is covered by
a crc32c, and every field is validated before anything it names is read, so a damaged or hostile
manifest gives an InvalidManifestError and never a read outside the folder or an absurd allocation. The
typed record of a leaf is records.py's; one checksummed JSON codec (``seal``/``unseal``) serves every file.
Nothing here touches array bytes; storage access goes through a Storage.
"""

from __future__ import annotations

import json
import math
import posixpath
from typing import Any, Sequence

import crc32c
import numpy as np

from flax_ckpt._src.errors import CheckpointError, InvalidManifestError
from flax_ckpt._src.records import dtype_from_name, leaf_name

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
    for j, ch in enumerate(chunks):
        index = c.typed(ch, "index", list, f"{f}.chunks[{j}]")
        if len(index) != len(shape):
            c.fail(f"{f}.chunks[{j}].index", f"rank {len(index)} differs from shape {shape}")
        for k, b in enumerate(index):
            if (not isinstance(b, list) or len(b) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in b)
                    or not 0 <= b[0] <= b[1] <= shape[k]):
                c.fail(f"{f}.chunks[{j}].index", f"{b!r} is not inside dimension {k} of {shape}")
    problem = tiling_problem([ch["index"] for ch in chunks], [(0, d) for d in shape])
    if problem is not None:
        c.fail(f"{f}.chunks (leaf {leaf_name(leaf)!r})", f"chunks do not tile the array of shape {shape} exactly: "
                                                        f"{problem}; the manifest is damaged or crafted")


_PAIRWISE_MAX = 32  # up to this many boxes a pure-Python pairwise check is the fastest
_CORNERS_MAX = 1 << 23  # corner rows the general check may build (see tiling_problem)


def tiling_problem(boxes: Sequence[Sequence[Sequence[int]]], bounds: Sequence[Sequence[int]]) -> str | None:
    """None when ``boxes`` (each [start, stop) per dimension, each inside ``bounds``) cover every
    element of ``bounds`` exactly once; else what is wrong, naming an element covered twice or never
    where one is found. Exact at any number of boxes, in O(n log n) for boxes on a grid (any chunk
    layout a save writes: along each dimension, two boxes' ranges coincide or do not overlap) and in
    O(n 2^d log n) otherwise, d the dimensions along which the boxes are cut (see _corner_problem); a
    layout too irregular for that bound is refused, never accepted unchecked."""
    if len(boxes) == 1 and len(boxes[0]) == len(bounds) and all(
            s == a and e == b for (s, e), (a, b) in zip(boxes[0], bounds)):
        return None  # one chunk holding the whole array: most leaves
    bounds = [(int(a), int(b)) for a, b in bounds]
    total = math.prod(b - a for a, b in bounds)
    items = [(j, b) for j, b in enumerate(boxes) if all(s < e for s, e in b)]
    volume = sum(math.prod(e - s for s, e in b) for _, b in items)
    if volume == total and len(items) <= 1:
        return None
    if not items:
        return _gap(volume, total, [a for a, _ in bounds])
    if len(items) <= _PAIRWISE_MAX:
        for x in range(len(items)):
            for y in range(x):
                (i, a), (j, b) = items[x], items[y]
                if all(max(p[0], q[0]) < min(p[1], q[1]) for p, q in zip(a, b)):
                    at = [max(p[0], q[0]) for p, q in zip(a, b)]
                    return f"chunks {j} and {i} both cover element {at}"
        return None if volume == total else _corner_problem(items, bounds) or _gap(volume, total, None)
    a = np.asarray([b for _, b in items], dtype=np.int64).reshape(len(items), len(bounds), 2)
    lo, hi = np.asarray([x for x, _ in bounds], np.int64), np.asarray([y for _, y in bounds], np.int64)
    cut = ~np.all((a[:, :, 0] == lo) & (a[:, :, 1] == hi), axis=0)  # dimensions some box does not span whole
    if not cut.any():
        return f"chunks {items[0][0]} and {items[1][0]} both cover element {lo.tolist()}"
    # On a grid: the boundaries of every dimension cut it into cells; each box is then one cell,
    # and the boxes tile exactly when no cell is taken twice and their volumes add up.
    cells = np.empty((len(items), int(cut.sum())), np.int64)
    for k, dim in enumerate(np.flatnonzero(cut)):
        edges = np.unique(a[:, dim, :])
        first, last = np.searchsorted(edges, a[:, dim, 0]), np.searchsorted(edges, a[:, dim, 1])
        if np.any(last - first != 1):
            break  # some box spans several cells: not a grid
        cells[:, k] = first
    else:
        order = np.lexsort(cells.T[::-1])
        same = np.all(cells[order[1:]] == cells[order[:-1]], axis=1)
        if same.any():
            x, y = sorted((int(order[np.argmax(same)]), int(order[np.argmax(same) + 1])))
            return f"chunks {items[x][0]} and {items[y][0]} both cover element {a[x, :, 0].tolist()}"
        return None if volume == total else _corner_problem(items, bounds) or _gap(volume, total, None)
    return _corner_problem(items, bounds) or (
        None if volume == total else _gap(volume, total, None))


def _corner_problem(items: list[tuple[int, Any]], bounds: list[tuple[int, int]]) -> str | None:
    """The general exact check. A box's indicator is a signed sum of the 2^d orthants at its corners
    (x >= corner in every dimension); the boxes tile ``bounds`` exactly iff their corner sums minus
    those of ``bounds`` cancel at every point. Where they do not, the lexicographically first corner
    left over is an element whose coverage is 1 plus its sum (no other orthant reaches it). Dimensions
    no box cuts are left out. Returns None (exact), a description, or a refusal for layouts that would
    need more than _CORNERS_MAX corners."""
    a = np.asarray([b for _, b in items], dtype=np.int64).reshape(len(items), len(bounds), 2)
    lo, hi = np.asarray([x for x, _ in bounds], np.int64), np.asarray([y for _, y in bounds], np.int64)
    dims = np.flatnonzero(~np.all((a[:, :, 0] == lo) & (a[:, :, 1] == hi), axis=0))
    if (len(items) + 1) << len(dims) > _CORNERS_MAX:
        return (f"{len(items)} chunks cut {len(dims)} dimensions in a layout that is not a grid; too irregular "
                "to check, refused")
    masks = (np.arange(1 << len(dims))[:, None] >> np.arange(len(dims))[None, :]) & 1  # (2^d, d)
    signs = 1 - 2 * (masks.sum(axis=1) % 2)
    s, e = a[:, dims, 0], a[:, dims, 1]
    corners = np.where(masks[None], e[:, None, :], s[:, None, :]).reshape(-1, len(dims))
    whole = np.where(masks, hi[dims][None], lo[dims][None])
    points = np.concatenate([corners, whole])
    weights = np.concatenate([np.tile(signs, len(items)), -signs])
    order = np.lexsort(points.T[::-1])
    points, weights = points[order], weights[order]
    starts = np.flatnonzero(np.r_[True, np.any(points[1:] != points[:-1], axis=1)])
    sums = np.add.reduceat(weights, starts)
    left = np.flatnonzero(sums)
    if not len(left):
        return None
    at = lo.copy()
    at[dims] = points[starts[left[0]]]
    covered = 1 + int(sums[left[0]])
    return f"element {at.tolist()} is covered by {'no chunk' if covered == 0 else f'{covered} chunks'}"


def _gap(volume: int, total: int, at: list[int] | None) -> str:
    where = f"element {at} is covered by no chunk; " if at is not None and volume < total else ""
    return f"{where}the chunks hold {volume} elements, the array {total}"


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
