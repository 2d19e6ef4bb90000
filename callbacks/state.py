"""Turning the training state people use into a checkpointable pytree, and restoring back into it.

Scope: the mapping between a user's live state and the pytree handed to ``fc.CheckpointManager``.
Most states are pytrees already (``flax.training.train_state.TrainState`` and its subclasses, dicts of
params plus optax state, PRNG keys, Python ints such as a data position) and pass through unchanged.
Two kinds of leaf are mutable objects that are not stored as themselves:

* ``flax.nnx`` objects (modules, ``nnx.Optimizer``, ``nnx.Rngs``; anything ``nnx.Pytree``, called
  ``nnx.Object`` before flax 0.11) and ``nnx.State``: stored as ``nnx.state(obj)``, each variable's
  array under ``<path>/value``, exactly as ``fc.save(path, nnx.state(model))`` (and Orbax) store a
  State, so ``fc.restore(path, nnx.state(model))`` restores what the callback saved and the callback
  resumes from what ``fc.save`` saved; restored in place (``nnx.update``), so the caller's objects
  hold the restored values. Checkpoints of earlier versions, which stored the pure dict
  (``nnx.to_pure_dict``: no ``/value``), are recognised by their key paths and restore as well. A
  State given as it is (also a filtered one, ``nnx.state(model, nnx.LoRAParam)``) is restored into
  its ``nnx.Variable`` objects themselves, which are the model's own (flax 0.12's ``nnx.state`` gives
  them, not copies), so the model holds the restored values; a State whose leaves are copies (an
  ``nnx.VariableState``, plain arrays) reaches no model: it is restored as a State, and a warning
  names the fix, ``nnx.update(model, state)``. A Variable that several parts reach (flax 0.12's
  ``nnx.ModelAndOptimizer`` holds its model) is stored once and restored shared (``shared_variables``).
* objects with ``get_state()`` / ``set_state(state)`` (the protocol of grain's data iterators): stored as
  ``get_state()``, restored with ``set_state``. A ``bytes`` value in it (grain's ``DataLoader`` iterator
  gives its position as JSON text in bytes) is stored as the uint8 array of those bytes and given back
  to ``set_state`` as the same ``bytes``.
* Python's ``random`` state: a ``random.Random`` instance (or the ``random`` module itself) and the
  tuple ``random.getstate()`` returns. Stored as one uint32 array of 628 words (see ``encode_random``),
  not as the tuple's 627 numbers; an instance is restored in place (``setstate``), the tuple given back
  equal to the one saved, so the run draws the same numbers as one never interrupted. Checkpoints that
  hold the tuple as it is (an earlier version's) restore as well.

``match_saved_scalars`` reconciles one common difference between a fresh state and a saved one:
``TrainState.create`` starts ``step`` as the Python int 0, and after a jitted step it is a weak-typed
int32 array; resuming gives back that weak-typed array, so the next jitted step hits the same compiled
executable as an uninterrupted run (a strong int32 would compile it again).

What does not belong here: scheduling, signals, anything about the manager.
"""

from __future__ import annotations

import logging
import math
import random
import sys
from typing import Any, NoReturn, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

import flax_ckpt as fc

from .data import LARGE_POSITION, compact, encode_bytes, position_size, set_position, warn_large_position
from .shared_variables import holds, once_each

log = logging.getLogger("flax_ckpt.callbacks")

_PY_SCALARS = (bool, int, float, complex)

# flax >= 0.11 names the base of nnx modules, optimizers and Rngs ``nnx.Pytree``; flax 0.10 calls it
# ``nnx.Object``. ``nnx.to_pure_dict`` / ``nnx.replace_by_pure_dict`` are functions from flax 0.10.4 on;
# before that they are only methods of ``nnx.State`` (0.10.4 to 0.10.7 keep both; the methods warn).


def _nnx() -> Any:
    """``flax.nnx`` once the program has imported it, else None: no nnx object or State exists before
    that, and importing it would cost every program that uses none (about a second of CPU)."""
    return sys.modules.get("flax.nnx")


def _to_pure_dict(state: Any) -> Any:
    fn = getattr(_nnx(), "to_pure_dict", None)
    return fn(state) if fn is not None else state.to_pure_dict()


def _replace_by_pure_dict(state: Any, pure: Any) -> None:
    fn = getattr(_nnx(), "replace_by_pure_dict", None)
    if fn is not None:
        fn(state, pure)
    else:
        state.replace_by_pure_dict(pure)


@runtime_checkable
class Stateful(Protocol):
    """An object whose position is captured by ``get_state()`` and set by ``set_state()`` (grain's
    ``DatasetIterator`` protocol). ``get_state`` returns a pytree: arrays, Python scalars, strings."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def _is_nnx(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, (getattr(nnx, "Pytree", None) or nnx.Object, nnx.State))


def _is_nnx_state(x: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.State)


# ------------------------------------------------------------------ Python's random state, as one array
# random.getstate() is (3, words, gauss_next): version 3, the Mersenne Twister's 624 words and its position
# (625 Python ints below 2**32), and the value random.gauss() keeps for its next call (None or a float).

_MT_WORDS = 625
RANDOM_WORDS = _MT_WORDS + 3  # the words, whether gauss_next is set, gauss_next's float64 bits


def _is_random_state(x: Any) -> bool:
    """Whether ``x`` is a tuple as ``random.getstate()`` returns it (version 3)."""
    return (
        type(x) is tuple
        and len(x) == 3
        and type(x[1]) is tuple
        and len(x[1]) == _MT_WORDS
        and x[0] == 3
        and (x[2] is None or type(x[2]) is float)
        and all(type(w) is int and 0 <= w < 1 << 32 for w in x[1])
    )


def _is_random(x: Any) -> bool:
    """A ``random.Random`` (its state in getstate()/setstate()) or the ``random`` module itself."""
    return (isinstance(x, random.Random) and not isinstance(x, random.SystemRandom)) or x is random


def encode_random(state: tuple[int, tuple[int, ...], float | None]) -> np.ndarray:
    """``random.getstate()``'s tuple as the uint32 array stored for it: its 625 words, then 1 if
    ``gauss_next`` is a float (else 0), then that float's 64 bits as two little-endian words."""
    gauss = state[2]
    bits = np.array([0.0 if gauss is None else gauss], "<f8").view("<u4")
    return np.concatenate([np.asarray(state[1], np.uint32), np.asarray([gauss is not None], np.uint32), bits])


def decode_random(words: Any, where: str = "") -> tuple[int, tuple[int, ...], float | None]:
    """The ``random.getstate()`` tuple that ``encode_random`` made ``words`` of (bit-exact); a tuple as
    it is (what checkpoints of earlier versions restore) is returned as such, its numbers as Python's.
    ``where``: the key path of the state, named in the error for a state no generator resumes from."""
    if isinstance(words, (tuple, list)):
        state = int(words[0]), tuple(int(w) for w in words[1]), None if words[2] is None else float(words[2])
        return _checked_random(state, where)
    a = np.asarray(words, np.uint32)
    flag = int(a[_MT_WORDS])
    if flag not in (0, 1):
        _refuse_random(f"a gauss_next flag of {flag}, not 0 (None) or 1 (a float)", where)
    gauss = float(a[_MT_WORDS + 1 :].astype("<u4").view("<f8")[0]) if flag else None
    return _checked_random((3, tuple(a[:_MT_WORDS].tolist()), gauss), where)


def _checked_random(
    state: tuple[int, tuple[int, ...], float | None], where: str = ""
) -> tuple[int, tuple[int, ...], float | None]:
    """``state`` when ``random.setstate`` accepts it and it generates: a CorruptCheckpointError for a
    position outside 0..624 (setstate's bare ValueError), a Mersenne Twister with every state bit
    zero (accepted, after which ``random()`` returns 0.0 forever) or a gauss_next that is no finite
    float (accepted, after which ``random.gauss()`` returns it: random.gauss never keeps one)."""
    version, words, gauss = state
    if version != 3 or len(words) != _MT_WORDS or any(not 0 <= w < 1 << 32 for w in words):
        found = f"version {version}, {len(words)} words"
    elif not 0 <= words[-1] <= _MT_WORDS - 1:
        found = f"position {words[-1]}, outside 0..{_MT_WORDS - 1}"
    elif not words[0] >> 31 and not any(words[1:-1]):
        found = "every state bit zero (random() would return 0.0 forever)"
    elif gauss is not None and not math.isfinite(gauss):
        found = f"a gauss_next of {gauss} (random.gauss() would return it)"
    else:
        return state
    _refuse_random(found, where)


def _refuse_random(found: str, where: str) -> NoReturn:
    at = f" at '{where}'" if where else ""
    raise fc.CorruptCheckpointError(
        f"the stored state of Python's random generator{at} is not one it can resume from: {found}. "
        "Restore an earlier step, or restore without it (a target without the random state) and "
        "reseed it with random.seed()"
    )


def _random_target(saved: Any) -> Any:
    """The restore target of a Python random state whose checkpoint node is ``saved``: the one array, or
    for a checkpoint that holds the tuple leaf by leaf (an earlier version's) a tuple like the one saved."""
    if not isinstance(saved, (list, tuple)) or len(saved) != 3:
        return np.zeros(RANDOM_WORDS, np.uint32)
    gauss = saved[2]
    return 3, (0,) * _MT_WORDS, 0.0 if isinstance(gauss, fc.LeafInfo) and gauss.kind != "empty" else None


def _stateful_target(obj: Any, saved: Any) -> Any:
    """The restore target of ``obj.get_state()`` where the checkpoint's node is ``saved``: each ``bytes``
    value as a uint8 array as long as the one stored (the position's text may have grown or shrunk),
    or, where the checkpoint has none, of its own bytes (what ``missing="keep"`` keeps)."""

    if isinstance(saved, fc.LeafInfo) and saved.kind == "json":  # an Orbax run's grain item: its file
        return obj.get_state()

    def target(path: tuple[Any, ...], v: Any) -> Any:
        if not isinstance(v, bytes):
            return v
        leaf = saved if not path and isinstance(saved, fc.LeafInfo) else _saved_leaf(saved, path)
        if leaf is None or leaf.shape is None or len(leaf.shape) != 1:
            return np.frombuffer(v, np.uint8)
        return np.zeros(leaf.shape, np.uint8)

    return jax.tree_util.tree_map_with_path(target, obj.get_state())


def _is_stateful(x: Any) -> bool:
    """An object (not a class) with ``get_state()`` / ``set_state()`` that is not an nnx object."""
    return isinstance(x, Stateful) and not isinstance(x, type) and not _is_nnx(x)


def _is_object_leaf(x: Any) -> bool:
    return _is_nnx(x) or _is_stateful(x) or _is_random(x) or _is_random_state(x)


def _pure(x: Any, keep_bytes: bool = False, large: list[Any] | None = None) -> Any:
    if _is_nnx(x):
        return x if _is_nnx_state(x) else _nnx().state(x)
    if _is_random(x):
        return encode_random(x.getstate())
    if _is_random_state(x):
        return encode_random(x)
    if _is_stateful(x):
        position = x.get_state() if keep_bytes else compact(x.get_state())  # Orbax: grain's own file
        if large is not None and position_size(position) >= LARGE_POSITION:
            large.append((x, position))
        return position if keep_bytes else encode_bytes(position)
    return x


def to_tree(state: Any, *, keep_bytes: bool = False) -> Any:
    """The pytree that is saved for ``state``: nnx objects as their ``nnx.State``, stateful iterators
    as their ``get_state()`` (``bytes`` in it as uint8 arrays, unless ``keep_bytes``: an Orbax run
    stores a grain iterator's bytes as grain's own file); everything else as it is. An
    ``nnx.Variable`` that several parts reach (``nnx.ModelAndOptimizer``'s model beside the model) is
    in the first part only (``shared_variables``). Reads, never mutates. A grain ``DataLoader``
    position whose ``repr(data_source)`` is longer than 1 KiB holds that text's SHA-256 instead
    (``from_tree`` puts the live loader's text back when they agree; an Orbax run keeps grain's file
    as it is); a position still 64 KiB of text or more is stored with a warning, once per item,
    naming it and the fix."""
    flat, treedef = jax.tree_util.tree_flatten(state, is_leaf=_is_object_leaf)
    large: list[Any] = []
    parts = once_each([_pure(x, keep_bytes=keep_bytes, large=large) for x in flat])  # a shared Variable: once
    if large:
        items = {
            id(x): _path_str(path)
            for path, x in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_object_leaf)[0]
        }
        for x, position in large:
            warn_large_position(items.get(id(x), ""), x, position)
    return jax.tree_util.tree_unflatten(treedef, parts)


def target_tree(state: Any, info: "fc.CheckpointInfo | None") -> Any:
    """``to_tree(state)`` as the target of a restore of the checkpoint ``info`` describes: an nnx part
    that the checkpoint holds as a pure dict (an earlier version's, or ``nnx.to_pure_dict``'s: no
    ``/value`` under its variables) as that pure dict; a Python random state that it holds as the tuple
    of ``random.getstate()`` (an earlier version's) as that tuple."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_object_leaf)
    out = []
    for path, x in flat:
        if _is_random(x) or _is_random_state(x):
            out.append(_random_target(None if info is None else _saved_node(info.tree, path)))
            continue
        if _is_stateful(x):
            out.append(_stateful_target(x, None if info is None else _saved_node(info.tree, path)))
            continue
        out.append(_pure(x))
    return jax.tree_util.tree_unflatten(treedef, _nnx_targets(flat, out, info))


def _nnx_targets(
    flat: list[tuple[Any, Any]], parts: list[Any], info: "fc.CheckpointInfo | None"
) -> list[Any]:
    """``parts`` (the targets of ``flat``'s leaves) with each nnx State less the Variables an earlier
    part holds, unless the checkpoint holds them there too (stored twice by an earlier version), and
    as its pure dict where the checkpoint holds that."""
    saved = [None if info is None else _saved_node(info.tree, path) for path, _ in flat]
    parts = once_each(parts, lambda i, path: holds(saved[i], path))
    return [
        _to_pure_dict(part) if _is_nnx(x) and _saved_pure(part, node) else part
        for (_, x), part, node in zip(flat, parts, saved)
    ]


def _leaf_paths(tree: Any) -> set[tuple[str, ...]]:
    """The key paths of ``tree``'s leaves as tuples of strings (dict keys, attribute names, indices)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, fc.LeafInfo))[0]
    return {
        tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        for path, _ in flat
    }


def _saved_pure(st: Any, saved: Any) -> bool:
    """Whether ``saved`` (the checkpoint's sub-tree at an nnx State) holds its pure dict, not the State."""
    if saved is None:
        return False
    have = _leaf_paths(saved)
    return not _leaf_paths(st) <= have and _leaf_paths(_to_pure_dict(st)) <= have


def _variable_kinds() -> tuple[type, ...]:
    """The classes of an nnx State's leaves: ``nnx.Variable`` and, in flax versions that have it,
    ``nnx.VariableState`` (the copies that their ``nnx.state`` gives)."""
    nnx = _nnx()
    return tuple(t for t in (nnx.Variable, getattr(nnx, "VariableState", None)) if isinstance(t, type))


def _flat_variables(tree: Any, kinds: tuple[type, ...]) -> list[tuple[tuple[str, ...], Any]]:
    """``(key path as strings, leaf)`` of an nnx State or pure dict, a Variable counting as one leaf."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kinds))[0]
    return [(tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), x) for path, x in flat]


def _path_str(path: tuple[Any, ...]) -> str:
    """A jax key path as the checkpoint's key paths read: ``0/lora/lora_a``."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _variable_value(x: Any, kinds: tuple[type, ...]) -> Any:
    if not isinstance(x, kinds):
        return x
    return x.get_value() if hasattr(type(x), "get_value") else x.value


def _restore_state(live: Any, restored: Any, where: str) -> None:
    """Puts ``restored`` (an nnx State or its pure dict) into the State ``live``: into its
    ``nnx.Variable`` objects themselves, which ``nnx.state(model, ...)`` shares with the model, so the
    model holds the values; other leaves (copies) are replaced in ``live``, with a warning that no model
    sees them."""
    nnx = _nnx()
    kinds = _variable_kinds()
    values = dict((path, _variable_value(x, kinds)) for path, x in _flat_variables(restored, kinds))
    copies: dict[str, Any] = {}
    for path, x in _flat_variables(live, kinds):
        if path not in values:
            continue
        if not isinstance(x, nnx.Variable):
            node = copies
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = values[path]
        elif hasattr(type(x), "set_value"):
            x.set_value(values[path])
        else:
            x.value = values[path]
    if not copies:
        return
    _replace_by_pure_dict(live, copies)
    log.warning(
        "the nnx.State at '%s' holds copies of its variables (nnx.VariableState or arrays, not a "
        "model's own nnx.Variable objects): the restored values are in that State, and no model holds "
        "them. Put them into the model with nnx.update(model, state), or give the model itself",
        where or "/",
    )


def _put_back(live: Any, restored: Any, where: str = "", source: str | None = None) -> Any:
    if _is_nnx_state(live):
        _restore_state(live, restored, where)
        return live
    if _is_nnx(live):
        if _is_nnx_state(restored):
            restored = _to_pure_dict(restored)
        nnx = _nnx()
        current = nnx.state(live)
        _replace_by_pure_dict(current, restored)
        nnx.update(live, current)
        return live
    if _is_random(live):
        live.setstate(decode_random(restored, where))
        return live
    if _is_random_state(live):
        return decode_random(restored, where)
    if _is_stateful(live):
        set_position(live, restored, where, source)
        return live
    return restored


def from_tree(state: Any, restored: Any, *, source: str | None = None) -> Any:
    """``state`` with the values of ``restored`` (a tree shaped like ``to_tree(state)``): nnx objects,
    stateful iterators and ``random.Random`` objects are updated in place and returned; a
    ``random.getstate()`` tuple is replaced by the restored one; pytree leaves are replaced.

    An ``nnx.State`` is restored into its ``nnx.Variable`` objects, so the model that
    ``nnx.state(model, ...)`` took them from holds the values; a State of copies (``nnx.VariableState``
    or arrays) is restored as a State, with a warning that no model holds the values. A stateful
    iterator's ``set_state`` is called only with a position other than its own, so a position that
    ``missing="keep"`` kept leaves the iterator untouched.

    Raises:
      TargetMismatchError: a ``set_state`` refused its position (not the text or structure it takes,
        another loader's), naming the item and ``source`` (e.g. ``"step 7 of <directory>"``)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_object_leaf)
    parts = treedef.flatten_up_to(restored)
    out = [_put_back(x, part, _path_str(path), source) for (path, x), part in zip(flat, parts)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _saved_node(tree: Any, path: tuple[Any, ...]) -> Any:
    """The node at a jax key path in ``fc.CheckpointInfo.tree`` (nested dicts/lists), or None."""
    node = tree
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _saved_leaf(tree: Any, path: tuple[Any, ...]) -> Any:
    """The LeafInfo at a jax key path in ``fc.CheckpointInfo.tree`` (nested dicts/lists), or None."""
    node = _saved_node(tree, path)
    return node if isinstance(node, fc.LeafInfo) else None


def match_saved_scalars(target: Any, info: fc.CheckpointInfo) -> Any:
    """``target`` with each Python-scalar leaf that the checkpoint stores as a 0-d array replaced by the
    target of what the run had when it saved: for a saved jax array a ``jax.ShapeDtypeStruct`` of the
    saved dtype, weak-typed where jit makes a weak-typed array of that Python scalar (Python ints and
    floats of the default dtypes); for a saved numpy array a numpy scalar of its dtype. Other leaves
    are left alone (a Python scalar target then restores as a Python scalar)."""

    def fix(path: tuple[Any, ...], leaf: Any) -> Any:
        if not isinstance(leaf, _PY_SCALARS):
            return leaf
        saved = _saved_leaf(info.tree, path)
        if saved is None or saved.kind not in ("jax", "numpy") or saved.shape != ():
            return leaf
        if saved.kind == "numpy":
            return np.dtype(saved.dtype).type(0)
        return jax.ShapeDtypeStruct((), saved.dtype, weak_type=_jit_sees_weak(leaf, saved.dtype))

    return jax.tree_util.tree_map_with_path(fix, target)


def _jit_sees_weak(x: Any, dtype: Any) -> bool:
    """Whether jit turns the Python scalar ``x`` into a weak-typed array of ``dtype``."""
    try:
        seen = jax.eval_shape(lambda: jnp.asarray(x))
    except (OverflowError, TypeError):
        return False
    return bool(seen.weak_type) and np.dtype(seen.dtype) == np.dtype(dtype)
