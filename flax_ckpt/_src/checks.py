"""Checks both layouts share: sealed JSON documents, stored locations, exact tilings.

Scope: ``seal``/``unseal`` (the checksummed JSON codec of every document flax_ckpt writes: the native
manifest, the memory tiers' indexes), ``check_relpath`` (a stored location is a plain relative path
inside its folder; used by the serializers and Orbax's reader), ``tiling_problem`` (a leaf's chunks
cover it exactly: disjoint and complete, used wherever chunk records are trusted: the native manifest's
validation, the restore placement, the memory tiers' copies), ``check_path``/``check_tree`` (key paths
that make one tree a restore can nest, in linear time: the native manifest, Orbax's ``_METADATA``,
safetensors names, Flax msgpack trees) and ``shape_problem`` (a shape numpy can make an array of).
Nothing here reads storage.
"""

from __future__ import annotations

import json
import math
import posixpath
from typing import Any, Callable, Sequence

import crc32c
import numpy as np

from flax_ckpt._src.errors import CheckpointError, InvalidManifestError

MANIFEST = (
    "manifest.json"  # the native layout's commit record (native/manifest.py): no stored location names it
)
MAX_MANIFEST_BYTES = 256 << 20  # the largest sealed document or Orbax JSON file read, and so written (a
#                                  manifest, a process's part of one, a memory-tier index, Orbax _METADATA);
#                                  read as checks.MAX_MANIFEST_BYTES wherever used, so one value binds both
MAX_NDIM = 64  # numpy's own limit
MAX_ARRAY_BYTES = 1 << 50  # more than any array a checkpoint holds


def seal(body: dict[str, Any], *, name: str, version: int, what: str = "manifest") -> bytes:
    """A JSON document whose body is covered by a crc32c: ``{"format", "version", "crc32c", "body"}``,
    the body written canonically (sorted keys, no spaces) last, so that a reader finds and checks its
    bytes without parsing twice. One codec for every checksummed JSON file flax_ckpt writes (the
    manifest, the memory tiers' indexes)."""
    return seal_text(canonical(body), name=name, version=version, what=what)


def canonical(value: Any) -> str:
    """``value`` as a sealed document's body writes it: JSON with sorted keys and no spaces
    (``json.dumps(value, sort_keys=True, separators=(",", ":"))``, byte for byte)."""
    if _ENCODE is not None:
        try:
            return "".join(_ENCODE(value, 0))
        except Exception:  # json.dumps raises what it raises (a circular value: its ValueError)
            pass
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _not_json(o: Any) -> Any:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def _encoder() -> Callable[[Any, int], Any] | None:
    """The C encoder json.dumps makes at every call with canonical's options, made once (a manifest
    encodes a list per leaf at every save: 2 us a call less), without json.dumps' check for circular
    values (canonical asks json.dumps again on any failure, which names it); None without _json."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        enc = make(None, _not_json, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, True)
        ok = "".join(enc({"b": [1, 2.5, "\u00e9"], "a": None}, 0)) == json.dumps(
            {"b": [1, 2.5, "\u00e9"], "a": None}, sort_keys=True, separators=(",", ":")
        )
    except Exception:  # another Python's encoder takes other arguments: json.dumps then
        return None
    return enc if ok else None


_ENCODE = _encoder()


def seal_text(canon: str, *, name: str, version: int, what: str = "manifest") -> bytes:
    """``seal`` of a body given as its canonical text (``canonical(body)``), for a writer that builds
    that text from parts it keeps (the memory tiers' index of a full copy, tiers/encode.py)."""
    head = {"format": name, "version": version, "crc32c": crc32c.crc32c(canon.encode())}
    return check_written((json.dumps(head)[:-1] + _BODY + canon + "}\n").encode(), what)


def seal_parts(parts: list[str], *, name: str, version: int, what: str = "manifest") -> bytes:
    """``seal_text("".join(parts))``, byte for byte, holding less at once: the parts are encoded and
    checksummed one by one (and ``parts`` emptied as they are), so that the body is never held as text
    and as bytes together (a manifest of 10^6 leaves is ~200 MB)."""
    crc, body = 0, []
    parts.reverse()
    while parts:
        body.append(parts.pop().encode())
        crc = crc32c.crc32c(body[-1], crc)
    head = {"format": name, "version": version, "crc32c": crc}
    body[:0] = [(json.dumps(head)[:-1] + _BODY).encode()]
    body.append(b"}\n")
    return check_written(b"".join(body), what)


def check_written(raw: bytes, what: str) -> bytes:
    """``raw``, a document about to be written, unless restore would refuse to read it back (more
    than MAX_MANIFEST_BYTES): then a CheckpointError, before anything is committed."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"cannot save: its {what} would hold {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} "
            "that restore reads, so the checkpoint could never be restored; nothing was committed. "
            "Save fewer leaves (e.g. stack per-layer arrays into one), shorter key paths, or fewer "
            "chunks per leaf"
        )
    return raw


_BODY = ', "body": '


def unseal(
    raw: bytes | memoryview,
    *,
    name: str,
    version: int,
    where: str,
    what: str = "manifest",
    error: type[CheckpointError] = InvalidManifestError,
    max_bytes: int | None = None,
) -> dict[str, Any]:
    """The verified body of a sealed document; ``error`` (naming ``where``) when it is not valid JSON,
    not of format ``name``/``version``, or its body's checksum does not match."""
    raw = bytes(raw)
    max_bytes = MAX_MANIFEST_BYTES if max_bytes is None else max_bytes
    if len(raw) > max_bytes:
        raise error(f"{where}: {what} of {len(raw)} bytes exceeds {max_bytes}")
    doc, crc = _fast_parse(raw)
    if doc is None:
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise error(f"{where}: not valid JSON ({e}); the checkpoint is damaged") from None
    if not isinstance(doc, dict) or doc.get("format") != name:
        raise error(f'{where}: not a {name} {what} (no "format": "{name}")')
    found = doc.get("version")
    if type(found) is not int or found != version:  # not True or 1.0
        raise error(
            f"{where}: unknown format version {found!r}; this flax_ckpt reads version {version}. "
            "Upgrade flax_ckpt to read it."
        )
    body = doc.get("body")
    if not isinstance(body, dict):
        raise error(f"{where}: {what} has no body object")
    if crc is None:
        crc = crc32c.crc32c(canonical(body).encode())
    if crc != doc.get("crc32c"):
        raise error(
            f"{where}: {what} checksum mismatch (expected {doc.get('crc32c')!r}, found {crc}); "
            f"the {what} was modified or damaged"
        )
    return body


def _fast_parse(raw: bytes) -> tuple[dict[str, Any] | None, int | None]:
    """As ``seal`` writes it: the head and the body parsed apart, the body's crc32c taken over its own
    bytes (they are the canonical form). (None, None) for anything else: the caller parses it whole."""
    found = sealed_body(raw)
    if found is None:
        return None, None
    head, body_bytes = found
    try:
        body = json.loads(bytes(body_bytes))
    except (ValueError, RecursionError):
        return None, None
    return dict(head, body=body), head["crc32c"]


def sealed_body(raw: bytes) -> tuple[dict[str, Any], memoryview] | None:
    """(the head, a view of the body's bytes) of a document as ``seal`` writes it whose body's crc32c, taken over
    those bytes, is the head's; None for anything else (``unseal`` then parses it whole and says what
    is wrong). The body is not parsed."""
    at = raw.find(_BODY.encode())
    if at < 0 or not raw.endswith(b"}\n"):
        return None
    try:
        head = json.loads(raw[:at] + b"}")
    except (ValueError, RecursionError):
        return None
    if not isinstance(head, dict) or set(head) != {"format", "version", "crc32c"}:
        return None
    body_bytes = memoryview(raw)[at + len(_BODY) : -2]
    if crc32c.crc32c(body_bytes) != head["crc32c"]:
        return None  # the slow path reports the mismatch (or finds another layout fine)
    return head, body_bytes


def check_relpath(name: Any, field: str, where: str) -> str:
    """A stored location must be a plain relative path inside the checkpoint folder."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or posixpath.normpath(name) != name
        or name.split("/")[0] in ("..", ".")
        or any(p in ("..", ".", "") for p in name.split("/"))
        or name == MANIFEST
    ):
        raise InvalidManifestError(
            f"{where}: field {field}: location {name!r} is not a relative path inside "
            "the checkpoint folder; refusing to read it"
        )
    return name


_PAIRWISE_MAX = 32  # up to this many boxes a pure-Python pairwise check is the fastest


_CORNERS_MAX = 1 << 23  # corner rows the general check may build (see tiling_problem)


def tiling_problem(boxes: Sequence[Sequence[Sequence[int]]], bounds: Sequence[Sequence[int]]) -> str | None:
    """None when ``boxes`` (each [start, stop) per dimension, each inside ``bounds``) cover every
    element of ``bounds`` exactly once; else what is wrong, naming an element covered twice or never
    where one is found. Exact at any number of boxes, in O(n log n) for boxes on a grid (any chunk
    layout a save writes: along each dimension, two boxes' ranges coincide or do not overlap) and in
    O(n 2^d log n) otherwise, d the dimensions along which the boxes are cut (see _corner_problem); a
    layout too irregular for that bound is refused, never accepted unchecked."""
    if (
        len(boxes) == 1
        and len(boxes[0]) == len(bounds)
        and all(s == a and e == b for (s, e), (a, b) in zip(boxes[0], bounds))
    ):
        return None  # one chunk holding the whole array: most leaves
    bounds = [(int(a), int(b)) for a, b in bounds]
    total = math.prod(b - a for a, b in bounds)
    grid = _grid(boxes, bounds, total) if len(boxes) > _PAIRWISE_MAX else None
    if grid is not None:  # many boxes: the empty ones dropped and the volumes added up in numpy
        keep = np.all(grid[:, :, 0] < grid[:, :, 1], axis=1)
        items: Sequence[tuple[int, Any]] = _Kept(np.flatnonzero(keep), boxes)
        grid = grid[keep]
        volume = int(np.prod(grid[:, :, 1] - grid[:, :, 0], axis=1).sum())
    else:
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
        return (
            None
            if volume == total
            else _corner_problem(_array(items, bounds), bounds) or _gap(volume, total, None)
        )
    a = grid if grid is not None else _array(items, bounds)
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
        return None if volume == total else _corner_problem(a, bounds) or _gap(volume, total, None)
    return _corner_problem(a, bounds) or (None if volume == total else _gap(volume, total, None))


class _Kept(Sequence[tuple[int, Any]]):
    """(index, box) of the boxes at the indices ``at`` (an array), each made when asked for: a million
    boxes checked on a grid never need them all."""

    def __init__(self, at: np.ndarray, boxes: Sequence[Any]):
        self.at, self.boxes = at, boxes

    def __len__(self) -> int:
        return len(self.at)

    def __getitem__(self, k: Any) -> Any:
        j = int(self.at[k])
        return j, self.boxes[j]


def _array(items: Sequence[tuple[int, Any]], bounds: list[tuple[int, int]]) -> np.ndarray:
    """The boxes of ``items`` as an int64 array of shape (boxes, dimensions, 2)."""
    return np.asarray([b for _, b in items], dtype=np.int64).reshape(len(items), len(bounds), 2)


def _grid(boxes: Sequence[Sequence[Sequence[int]]], bounds: list[tuple[int, int]], total: int) -> Any:
    """``boxes`` as an int64 array of shape (boxes, dimensions, 2), or None where numpy would not hold
    them exactly (not integers, not all of ``len(bounds)`` dimensions) or where a box leaves ``bounds``
    or their volumes could add up past int64 (``tiling_problem`` then checks them one by one)."""
    if not total or len(boxes) * total >= 1 << 62:
        return None
    try:
        a = np.asarray(boxes)
    except (ValueError, TypeError, OverflowError):
        return None
    if a.dtype.kind not in "iu" or a.shape != (len(boxes), len(bounds), 2):
        return None
    a = a.astype(np.int64, copy=False)
    lo, hi = np.asarray([x for x, _ in bounds], np.int64), np.asarray([y for _, y in bounds], np.int64)
    if not (np.all(a[:, :, 0] >= lo) and np.all(a[:, :, 1] <= hi)):
        return None
    return a


def _corner_problem(a: np.ndarray, bounds: list[tuple[int, int]]) -> str | None:
    """The general exact check. A box's indicator is a signed sum of the 2^d orthants at its corners
    (x >= corner in every dimension); the boxes tile ``bounds`` exactly iff their corner sums minus
    those of ``bounds`` cancel at every point. Where they do not, the lexicographically first corner
    left over is an element whose coverage is 1 plus its sum (no other orthant reaches it). Dimensions
    no box cuts are left out. Returns None (exact), a description, or a refusal for layouts that would
    need more than _CORNERS_MAX corners. ``a``: the boxes (none empty), as ``_array`` gives them."""
    lo, hi = np.asarray([x for x, _ in bounds], np.int64), np.asarray([y for _, y in bounds], np.int64)
    dims = np.flatnonzero(~np.all((a[:, :, 0] == lo) & (a[:, :, 1] == hi), axis=0))
    if (len(a) + 1) << len(dims) > _CORNERS_MAX:
        return (
            f"{len(a)} chunks cut {len(dims)} dimensions in a layout that is not a grid; too irregular "
            "to check, refused"
        )
    masks = (np.arange(1 << len(dims))[:, None] >> np.arange(len(dims))[None, :]) & 1  # (2^d, d)
    signs = 1 - 2 * (masks.sum(axis=1) % 2)
    s, e = a[:, dims, 0], a[:, dims, 1]
    corners = np.where(masks[None], e[:, None, :], s[:, None, :]).reshape(-1, len(dims))
    whole = np.where(masks, hi[dims][None], lo[dims][None])
    points = np.concatenate([corners, whole])
    weights = np.concatenate([np.tile(signs, len(a)), -signs])
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


# ------------------------------------------------------------------ key paths and trees (every layout)

MAX_PATH_DEPTH = 512  # keys in one leaf's key path; a model's tree is a few tens deep
MAX_LIST_GAPS = (
    1 << 20
)  # list slots without a leaf (children with no leaves, e.g. dataclasses of static fields)
MAX_INDEX = 1 << 31  # a sequence index


def check_path(path: Any, field: str, c: Any) -> None:
    """A key path as manifests store it: a list of at most MAX_PATH_DEPTH ``["key"|"attr"|"idx", key]``
    (an index an int in [0, MAX_INDEX), an attribute a str); else ``c.fail(field, why)``, which raises."""
    if not isinstance(path, list):
        c.fail(field, f"expected a list of keys, found {type(path).__name__}")
    if len(path) > MAX_PATH_DEPTH:
        c.fail(field, f"{len(path)} keys deep, deeper than {MAX_PATH_DEPTH}")
    for j, e in enumerate(path):
        if (
            not isinstance(e, list)
            or len(e) != 2
            or e[0] not in ("key", "attr", "idx")
            or isinstance(e[1], bool)
            or not isinstance(e[1], (str, int))
            or (e[0] == "idx" and (not isinstance(e[1], int) or not 0 <= e[1] < MAX_INDEX))
            or (e[0] == "attr" and not isinstance(e[1], str))
        ):
            c.fail(f"{field}[{j}]", f'expected ["key"|"attr"|"idx", key], found {str(e)[:100]}')


class _Node:
    """A folder of the key-path trie: its children by key string, and whether they are indices."""

    __slots__ = ("children", "group", "top")

    def __init__(self):
        self.children: dict[str, tuple[tuple[str, Any], Any]] = {}
        self.group: str | None = None  # "idx", "int" (dict keys) or "name"
        self.top = -1  # the largest index seen (a list of top + 1 slots is built on restore)


_LEAF = _Node()  # the child a leaf is: a sentinel, never walked into (check_tree fails first)


def check_tree(
    paths: Sequence[Sequence[Sequence[Any]]],
    c: Any,
    label: Callable[[int], str] = lambda i: f"leaves[{i}].path",
) -> None:
    """The key paths (each checked by check_path, or built as it would accept them) must form one
    tree: no path is a prefix or a duplicate of another, also as key strings (what restore matches
    leaves by: ["key", 1], ["key", "1"] and ["attr", "1"] are one key), the children of a node are all
    indices or all names, and lists stay small (their slots total at most the number of leaves plus
    MAX_LIST_GAPS), so that nesting the result can neither fail nor allocate without bound. One pass
    over the keys: linear time. ``c.fail(field, why)`` raises, the field ``label(i)`` for the i-th path
    (a manifest's ``leaves[i].path``, another layout's leaf name)."""
    if len(paths) > 1 and not all(paths):
        c.fail(label([bool(p) for p in paths].index(False)), "the root is a leaf beside others")
    root, lists = _Node(), []
    for i, path in enumerate(paths):
        node = root
        for j, (kind, key) in enumerate(path):
            if node is _LEAF:
                c.fail(label(i), f"its key path passes through the leaf {_keys(path[:j])!r}")
            group = "idx" if kind == "idx" else "int" if isinstance(key, int) else "name"
            if node.group not in (None, group):  # jax flattens no such node: it cannot sort mixed keys
                c.fail(f"{label(i)}[{j}]", "a node mixes sequence indices, integer keys and names")
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
                c.fail(label(i), f"its key path {_keys(path)!r} duplicates or contains another leaf's")
            else:
                child = prev[1]
            node = child
    if sum(n.top + 1 for n in lists) > len(paths) + MAX_LIST_GAPS:
        c.fail(
            label(max(range(len(paths)), key=lambda i: _top(paths[i]))),
            f"sequence indices up to {max(map(_top, paths))} leave more gaps than any saved tree has "
            f"(more than {MAX_LIST_GAPS} list slots without a leaf)",
        )


def _top(path: Sequence[Sequence[Any]]) -> int:
    return max((key for kind, key in path if kind == "idx"), default=-1)


def _keys(path: Sequence[Sequence[Any]]) -> str:
    text = "/".join(str(key) for _, key in path)
    return text if len(text) <= 200 else text[:200] + "..."


def numpy_bytes(shape: Sequence[int], itemsize: int) -> int:
    """The bytes numpy reckons an array of ``shape`` spans before it makes one: the product of every
    dimension but zeros (np.empty refuses [0, 2**61, 2**61], which holds nothing)."""
    return math.prod(d for d in shape if d) * itemsize


def shape_problem(shape: Any, itemsize: int) -> str | None:
    """Why ``shape`` is no shape a stored array may have (not a list of at most MAX_NDIM sizes, or
    spanning more than MAX_ARRAY_BYTES as numpy_bytes counts them); None when it is one."""
    if (
        not isinstance(shape, (list, tuple))
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        return f"shape {str(shape)[:60]} is not a list of at most {MAX_NDIM} sizes"
    if numpy_bytes(shape, itemsize) > MAX_ARRAY_BYTES:
        return f"shape {str(list(shape))[:60]} spans more than the {MAX_ARRAY_BYTES} bytes any array holds"
    return None
