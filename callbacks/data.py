"""Data positions: how the callback stores, checks and sets back the position of a data iterator, and
``EpochLoader``, the position of a loop that takes a fresh iterator from its loader at every epoch.

Scope: objects of the ``get_state()``/``set_state()`` protocol (grain's iterators, ``EpochLoader``,
a user's own) once state.py has found them in the live state: ``bytes`` in a position (grain's
``DataLoader`` gives JSON text) as uint8 arrays and back; a restored position given to ``set_state``
only when it differs from the iterator's own (so ``missing="keep"`` leaves an iterator alone), and a
position ``set_state`` refuses raised as a ``TargetMismatchError`` naming the item and the step; a
warning, once per item, for a position so large that each save stores a dataset with it.

What does not belong here: nnx objects, Python's random state, the manager.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Iterable, Iterator

import jax
import numpy as np

import flax_ckpt as fc

log = logging.getLogger("flax_ckpt.callbacks")

LARGE_POSITION = 64 << 10  # bytes of text in one position from which each save warns, once per item


# ------------------------------------------------------------------ bytes in an iterator's state, as uint8
# grain's DataLoader iterator returns its state as JSON text in bytes; bytes are no array and no JSON value,
# so they are stored as the uint8 array of their bytes (checksummed like any array) and given back as bytes.


def encode_bytes(state: Any) -> Any:
    """``state`` (what a ``get_state()`` returned) with each ``bytes`` value as a uint8 array of its bytes."""
    return jax.tree_util.tree_map(lambda v: np.frombuffer(v, np.uint8) if isinstance(v, bytes) else v, state)


def decode_bytes(like: Any, restored: Any) -> Any:
    """``restored`` (shaped like ``encode_bytes(like)``) with the value at each place where ``like`` holds
    ``bytes`` turned back into ``bytes``: what ``set_state`` takes."""

    def back(was: Any, value: Any) -> Any:
        if not isinstance(was, bytes) or isinstance(value, (bytes, str)):  # str: a grain item's text
            return value
        return np.asarray(value, np.uint8).tobytes()

    return jax.tree_util.tree_map(back, like, restored)


# ------------------------------------------------------------------------------ setting a position back


def set_position(live: Any, restored: Any, item: str, source: str | None) -> None:
    """Gives ``live`` (a Stateful) the position ``restored`` (shaped like ``encode_bytes(live.get_state())``),
    unless it is the position ``live`` has (a ``missing="keep"`` restore gives back the iterator's own
    position: its ``set_state`` is not called, so nothing about it is reset).

    Raises:
      TargetMismatchError: ``set_state`` refuses the position (text that is not JSON, a list where a
        dict belongs, another loader's or data source's position), naming the item and ``source``.
    """
    current = live.get_state()
    try:
        position = expand(current, decode_bytes(current, restored))
        if not same_position(position, current):
            live.set_state(position)
    except Exception as e:
        where = f" in {source}" if source else ""
        detail = str(e) if len(str(e)) <= 600 else f"{str(e)[:600]}..."
        raise fc.TargetMismatchError(
            f"the data position stored for '{item or '/'}'{where} is not one {type(live).__name__} "
            f"takes ({type(e).__name__}: {detail}). Nothing was changed on disk; the step's "
            "other items are intact. Fix: build the iterator as the run that saved it did (the same data "
            "source, sampler, worker count and operations); or restore an earlier step; or start the data "
            f"afresh: leave '{item or '/'}' out of the state given and pass unexpected=\"ignore\""
        ) from e


def same_position(a: Any, b: Any) -> bool:
    """Whether two ``get_state()`` values are equal, leaf by leaf (bytes and strings by value, numbers and
    arrays by shape and value)."""
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    if tree_a != tree_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, (bytes, str)) or isinstance(y, (bytes, str)):
            if type(x) is not type(y) or x != y:
                return False
            continue
        try:
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        except (TypeError, ValueError):  # a value numpy does not hold (a typed PRNG key): set it
            return False
    return True


# --------------------------------------------------------------- grain's data_source text, by its digest
# grain's DataLoader keeps repr(data_source) in its position only to check, at set_state, that the position
# is of the same source; a source whose repr holds its data (a dataclass of records) would be stored whole
# at every save. A long one is stored as its SHA-256 and put back from the live loader's when they agree.

SHORT_SOURCE = 1 << 10  # characters of repr(data_source) stored as they are
_KEY = b'"data_source": '
_DIGEST = "sha256 of repr(data_source), stored by flax_ckpt: "


def compact(position: Any) -> Any:
    """``position`` (a ``get_state()`` value) with each grain DataLoader text whose ``data_source`` is
    longer than ``SHORT_SOURCE`` holding that text's SHA-256 in its place (see ``expand``)."""
    return jax.tree_util.tree_map(_compact_text, position)


def expand(current: Any, position: Any) -> Any:
    """``position`` (restored, shaped like ``current``) with each ``data_source`` that ``compact`` stored
    as a digest given back as the text of the live loader's (``current``'s) when their digests agree;
    otherwise left as the digest, so that grain's own check names the other source."""
    return jax.tree_util.tree_map(_expand_text, current, position)


def _digest(source: str) -> str:
    return _DIGEST + hashlib.sha256(source.encode()).hexdigest()


def _compact_text(text: Any) -> Any:
    if not isinstance(text, bytes) or len(text) <= SHORT_SOURCE:
        return text
    source = _grain_source_repr(text)
    if source is None or len(source) <= SHORT_SOURCE:
        return text
    whole = _KEY + json.dumps(source).encode()
    return (
        text.replace(whole, _KEY + json.dumps(_digest(source)).encode()) if text.count(whole) == 1 else text
    )


def _expand_text(live: Any, text: Any) -> Any:
    if not isinstance(text, bytes) or _DIGEST.encode() not in text or not isinstance(live, bytes):
        return text
    source = _grain_source_repr(live)
    digest = _KEY + json.dumps(_digest(source)).encode() if source is not None else b""
    return text.replace(digest, _KEY + json.dumps(source).encode()) if digest and digest in text else text


# ------------------------------------------------------------------------------ a position that is large

_WARNED: set[str] = set()


def position_size(state: Any) -> int:
    """The bytes of text (``bytes`` and ``str`` values) in a ``get_state()`` value."""
    return sum(len(v) for v in jax.tree_util.tree_leaves(state) if isinstance(v, (bytes, str)))


def warn_large_position(item: str, live: Any, state: Any) -> None:
    """Warns, once per item and process, that each save stores ``state``, a position of
    ``position_size(state)`` bytes; for grain's DataLoader, how much of it is ``repr(data_source)`` and
    the fix, a short ``__repr__``."""
    if item in _WARNED:
        return
    _WARNED.add(item)
    size = position_size(state)
    source = _grain_source_repr(state)
    if source is not None and len(source) * 2 > size:
        log.warning(
            "the data position of '%s' (%s.get_state()) is %d KiB, stored at every save: %d KiB of it is "
            "repr(data_source), which grain's DataLoader keeps in its state to check the source on restore "
            "(%s...). Fix: give the data source class a short __repr__ that names the data without holding "
            "it (its path or name and its length) and is the same from run to run",
            item or "/",
            type(live).__name__,
            size >> 10,
            len(source) >> 10,
            source[:60],
        )
        return
    log.warning(
        "the data position of '%s' (%s.get_state()) is %d KiB of text, stored at every save: keep in it "
        "what a resume needs (indices, counters, seeds), not the data",
        item or "/",
        type(live).__name__,
        size >> 10,
    )


def _grain_source_repr(state: Any) -> str | None:
    """The ``data_source`` text of a grain DataLoader position (JSON text in bytes), or None."""
    if not isinstance(state, bytes):
        return None
    try:
        value = json.loads(state)
    except ValueError:
        return None
    source = value.get("data_source") if isinstance(value, dict) else None
    return source if isinstance(source, str) else None


# --------------------------------------------------------------------------- a fresh iterator per epoch


class EpochLoader:
    """A loader whose ``for batch in loader`` starts a fresh epoch (grain's ``DataLoader``, a
    ``MapDataset``), with a position that checkpoints: the epoch and the place in it.

    ``for batch in data`` goes on with the epoch in progress (after a restore, from the batch an
    uninterrupted run reads next) and ends with it; the next ``for`` starts the next epoch with a
    fresh iterator of the loader, as ``for batch in loader`` does. Its ``epoch`` property is the
    epoch in progress (the number of epochs ended). Its ``get_state()`` is ``{"epoch": ..., "position": the
    iterator's get_state()}``; give the loader's iterators ``get_state()``/``set_state()`` (grain's
    have them).

    Args:
      loader: an iterable whose ``iter(loader)`` is a fresh epoch's iterator with ``get_state()`` and
        ``set_state()``.

    Example:
      >>> import numpy as np
      >>> from flax_ckpt.callbacks import CheckpointCallback, EpochLoader
      >>> class Loader:  # three batches an epoch; grain's DataLoader is one
      ...     def __iter__(self):
      ...         return Batches()
      >>> class Batches:
      ...     def __init__(self):
      ...         self.i = 0
      ...     def __next__(self):
      ...         if self.i == 3:
      ...             raise StopIteration
      ...         self.i += 1
      ...         return np.full(2, self.i, np.float32)
      ...     def get_state(self):
      ...         return {"i": self.i}
      ...     def set_state(self, state):
      ...         self.i = int(state["i"])
      >>> batches = EpochLoader(Loader())
      >>> with CheckpointCallback("epochs", every_steps=4) as ckpt:
      ...     restored, step = ckpt.restore_or({"w": np.zeros(2, np.float32), "data": batches})
      ...     w = restored["w"]
      ...     for epoch in range(batches.epoch, 2):
      ...         for batch in batches:
      ...             w, step = w + batch, step + 1
      ...             _ = ckpt(step, {"w": w, "data": batches})
      >>> step, w, batches.epoch
      (6, array([12., 12.], dtype=float32), 2)
    """

    def __init__(self, loader: Iterable[Any]):
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"EpochLoader takes an iterable (a data loader), not {type(loader).__name__}")
        self.loader = loader
        self.epoch = 0
        self._iterator: Iterator[Any] | None = None  # the epoch in progress, made when first needed

    def _current(self) -> Any:
        if self._iterator is None:
            self._iterator = self._fresh()
        return self._iterator

    def _fresh(self) -> Any:
        it = iter(self.loader)
        if not (hasattr(it, "get_state") and hasattr(it, "set_state")):
            raise TypeError(
                f"EpochLoader: iter({type(self.loader).__name__}) gives a {type(it).__name__}, which has no "
                "get_state()/set_state(), so its place in an epoch cannot be saved. Give the loader's "
                "iterator those methods (grain's have them), or make the batch a function of the step"
            )
        return it

    def __iter__(self) -> "EpochLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self._current())
        except StopIteration:
            self.epoch, self._iterator = self.epoch + 1, None
            raise

    def get_state(self) -> dict[str, Any]:
        """``{"epoch": the epoch in progress, "position": its iterator's get_state()}``."""
        return {"epoch": self.epoch, "position": self._current().get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Starts ``state["epoch"]`` with a fresh iterator of the loader, set to ``state["position"]``."""
        epoch, it = int(state["epoch"]), self._fresh()
        it.set_state(state["position"])
        self.epoch, self._iterator = epoch, it

    def __repr__(self) -> str:
        return f"EpochLoader({self.loader!r}, epoch={self.epoch})"
