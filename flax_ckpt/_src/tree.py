"""Pytree <-> flat list of (key path, leaf), and the classification of leaves.

Scope: structure only. How a leaf's bytes are stored lives in the serializers; what the manifest says
lives in native/manifest.py. Containers jax knows (dict, list, tuple, namedtuple, flax.struct dataclasses such as
TrainState, optax states, nnx.State) are walked by jax.tree_util; None and empty containers are kept as
leaves so that a restore without a target gives them back.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence, cast

import numpy as np

from flax_ckpt._src.errors import CheckpointError, UnsupportedLeafError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.records import dtype_from_name, keystr

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

# A key path: a tuple of (kind, key) with kind "key" (a dict key), "attr" (an attribute or namedtuple /
# dataclass field) or "idx" (a sequence index).
KeyEntry = tuple[str, Any]
KeyPath = tuple[KeyEntry, ...]


def _is_leaf(x: Any) -> bool:
    if x is None:
        return True
    if isinstance(x, (dict, list, tuple)) and len(x) == 0:
        return True
    return False


def entry(k: Any) -> KeyEntry:
    """A jax key (DictKey, GetAttrKey, SequenceKey, FlattenedIndexKey) as a key-path entry."""
    if isinstance(k, jax.tree_util.DictKey):
        key = k.key
        if isinstance(key, (bool, np.bool_)) or not isinstance(key, (str, int, np.integer)):
            raise UnsupportedLeafError(
                f"dict key {key!r} of type {type(key).__name__} cannot be stored; use str or int keys"
            )
        return ("key", key if isinstance(key, str) else int(key))
    if isinstance(k, jax.tree_util.GetAttrKey):
        return ("attr", k.name)
    if isinstance(k, jax.tree_util.SequenceKey):
        return ("idx", k.idx)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return ("idx", k.key)
    raise UnsupportedLeafError(f"unknown pytree key {k!r}")


def flatten(tree: Any) -> tuple[list[tuple[KeyPath, Any]], Any]:
    """Returns [(key path, leaf)] in jax's canonical order, and the treedef to rebuild ``tree``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    return [(tuple(entry(k) for k in path), leaf) for path, leaf in flat], treedef


@dataclass(eq=False)
class Flat:
    """A flattened tree: its ``leaves`` and, shared by every tree of the same treedef (``flat``), their
    key ``paths``, their ``names`` (keystr) and ``memo``: per leaf, what a snapshot learned of the leaf
    last seen there (engine/snapshot.py; it checks that it still holds)."""

    treedef: Any
    paths: list[KeyPath]
    names: list[str]
    memo: list[Any]
    leaves: list[Any] = field(default_factory=list)


_recent: list[Flat] = []  # the structures last flattened, newest first
_recent_lock = threading.Lock()
_RECENT = 4  # structures kept at most
_RECENT_LEAVES = 1 << 18  # leaves kept at most in all (each keeps ~1 KiB: its path, name, record and
#   record's text); the newest structure is kept whatever its size (a loop saves it again)


def flat(tree: Any) -> Flat:
    """``flatten(tree)``, with the key paths and names of the last few treedefs kept: saving the same
    structure again costs one C-level ``tree_flatten`` and a treedef comparison (a training loop saves
    one structure at every step; a 200-leaf tree's paths and names cost about 1 ms each time). Relies on
    what every container jax, flax and optax register satisfies: equal treedefs have equal key paths
    (dicts with int keys excepted: not kept, see below)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_leaf)
    with _recent_lock:
        for k, known in enumerate(_recent):
            try:
                same = bool(known.treedef == treedef)
            except Exception:  # noqa: BLE001 - node data that does not compare (arrays): not kept
                same = False
            if same:
                _recent.insert(0, _recent.pop(k))
                _trim()
                return Flat(known.treedef, known.paths, known.names, known.memo, leaves)
    pairs, treedef = flatten(tree)  # checks every key
    paths = [p for p, _ in pairs]
    known = Flat(treedef, paths, [keystr(p) for p in paths], [None] * len(paths))  # holds no leaf
    try:
        keep = bool(treedef == treedef)
    except Exception:  # noqa: BLE001
        keep = False
    # A dict with int keys is never kept: its treedef equals that of the same dict keyed by True/False
    # or 1.0, which ``entry`` refuses, so such a tree is checked key by key at every save.
    keep = keep and not any(kind == "key" and not isinstance(k, str) for p in paths for kind, k in p)
    if keep:
        with _recent_lock:
            _recent.insert(0, known)
            _trim()
    return Flat(treedef, paths, known.names, known.memo, [x for _, x in pairs])


def _trim() -> None:
    """Drops the oldest of ``_recent`` (its lock held) beyond _RECENT structures or _RECENT_LEAVES
    leaves, the newest always kept."""
    total = 0
    for k, known in enumerate(_recent):
        total += len(known.paths)
        if k and (k >= _RECENT or total > _RECENT_LEAVES):
            del _recent[k:]
            return


def empty_kind(x: Any) -> str | None:
    """For a structure-only leaf (None, {}, [], ()), its kind; else None."""
    if x is None:
        return "none"
    if isinstance(x, dict) and not x:
        return "dict"
    if isinstance(x, list) and not x:
        return "list"
    if isinstance(x, tuple) and not x:
        return "tuple"
    return None


def is_ready(x: jax.Array) -> bool:
    """Whether the computation that produces ``x`` is done (``x.is_ready()`` without waiting)."""
    # jax.Array's type stub lacks ``is_ready``, which every concrete jax array (ArrayImpl) has.
    return cast(Any, x).is_ready()


def is_prng_key(x: Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jax.numpy.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def classify(x: Any) -> str:
    """The manifest kind of a leaf at save time; raises TypeError for unsupported ones."""
    if empty_kind(x) is not None:
        return "empty"
    if isinstance(x, jax.Array):
        return "prng_key" if is_prng_key(x) else "jax"
    if isinstance(x, (np.ndarray, np.generic)):
        try:
            dtype_from_name(x.dtype.name)
        except (TypeError, ValueError):
            raise TypeError(
                f"numpy dtype {x.dtype} (object, string and structured arrays are not stored)"
            ) from None
        return "numpy"
    if isinstance(x, (bool, int, float, complex)):
        return "scalar"
    if isinstance(x, str):
        return "string"
    raise TypeError(type(x).__qualname__)


def classify_all(flat: Sequence[tuple[KeyPath, Any]]) -> list[str]:
    """Classifies every leaf; collects every unsupported one into a single UnsupportedLeafError."""
    kinds, bad, iterators, loaders = [], [], False, False
    for path, leaf in flat:
        try:
            kinds.append(classify(leaf))
        except TypeError as e:
            bad.append(f"{keystr(path)}: {e}")
            iterators = iterators or hasattr(leaf, "__next__")
            loaders = loaders or (hasattr(leaf, "__iter__") and not hasattr(leaf, "__next__"))
    if bad:
        raise UnsupportedLeafError(
            "cannot save these leaves (nothing was written): "
            + "; ".join(bad)
            + ". Store arrays, Python scalars, strings and None; rebuild functions and objects in code "
            "(TrainState's apply_fn and tx are not leaves and need nothing)."
            + (
                " A generator or iterator has no state to save: give its class get_state() (returning its "
                "position as a pytree) and set_state(state) methods (the get_state()/set_state() protocol of "
                "grain's iterators, callbacks.Stateful), and CheckpointCallback saves and restores its "
                "position; or rebuild it in code from a saved step or epoch."
                if iterators
                else ""
            )
            + (
                " A data loader that starts a fresh epoch at each `for batch in loader` (grain's DataLoader) "
                "has no position of its own: wrap it once, data = flax_ckpt.callbacks.EpochLoader(loader), "
                "loop `for batch in data` and give `data` to CheckpointCallback, which saves the epoch and "
                "the place in it (docs/resuming.md)."
                if loaders
                else ""
            )
        )
    return kinds


def nest(items: Iterable[tuple[KeyPath, Any]]) -> Any:
    """Builds plain nested dicts/lists from (key path, value); 'attr' and 'key' entries become dicts."""
    items = list(items)
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    root: Any = {}
    for path, value in items:
        if not isinstance(root, list) and not root and path[0][0] == "idx":
            root = []
        node = root
        for depth, (kind, key) in enumerate(path):
            last = depth == len(path) - 1
            new = value if last else ([] if path[depth + 1][0] == "idx" else {})
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
                if last or node[key] is None:
                    node[key] = new
            elif last or key not in node:
                node[key] = new
            node = node[key]
    return root


def path_to_json(path: KeyPath) -> list[list[Any]]:
    return [[kind, key] for kind, key in path]


def path_from_json(obj: Any) -> KeyPath:
    return tuple((kind, key) for kind, key in obj)


__all__ = [
    "Flat",
    "KeyPath",
    "classify",
    "classify_all",
    "empty_kind",
    "entry",
    "flat",
    "flatten",
    "is_prng_key",
    "keystr",
    "nest",
]


def refuse_traced(tree: Any, leaves: list[Any] | None, what: str) -> None:
    """A CheckpointError when ``tree`` (whose ``leaves`` are given, or None) holds a tracer: a save (``what``,
    e.g. "save of step 5 in DIR") called inside ``jax.jit`` (or ``grad``, ``vmap``, a ``lax.scan``
    body), where the values do not exist yet."""
    core = sys.modules.get("jax.core")  # jax not imported yet: no tracer anywhere
    if core is None:
        return
    leaves = jax.tree_util.tree_leaves(tree) if leaves is None else leaves
    if not any(issubclass(t, core.Tracer) for t in set(map(type, leaves))):  # a few types
        return
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(x, core.Tracer):
            raise CheckpointError(
                f"{what}: leaf {jax.tree_util.keystr(path) or '<root>'} is a tracer ({type(x).__name__}): "
                "save was called inside a traced function (jax.jit, grad, vmap, scan), where the values "
                "are not computed yet. Fix: call save outside it, on the state the jitted step returns "
                "(or use jax.debug.callback / io_callback)"
            )
