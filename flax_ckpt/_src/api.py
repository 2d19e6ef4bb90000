"""The public one-checkpoint functions: ``fc.save``, ``fc.restore``, ``fc.metadata``.

Scope: turning a user's location into a folder, picking the format (layouts.py decides, once) and
calling the engine. Runs of many steps are the manager's (manager/).
"""

from __future__ import annotations

import os
from typing import Any

from flax_ckpt._src import layouts
from flax_ckpt._src.engine import restore as engine
from flax_ckpt._src.engine.fit import Fit, RenameArg
from flax_ckpt._src.engine.leaves import CheckpointInfo
from flax_ckpt._src.engine.pause import gc_paused
from flax_ckpt._src.engine.snapshot import jsonable
from flax_ckpt._src.errors import CheckpointExistsError, StorageError
from flax_ckpt._src.serializers import Serializer, get_serializer
from flax_ckpt._src.storage import split_location


def save(path: Any, tree: Any, *, metadata: Any = None, serializer: "str | Serializer | None" = None,
         step: int | None = None, metrics: dict | None = None, format: str = "native") -> None:
    """Synchronous, atomic save of ``tree`` to ``path`` (which must not exist: CheckpointExistsError).

    ``format``: "native" (flax_ckpt's layout, with ``serializer`` "raw" (default) or "zarr3") or
    "orbax" (Orbax's StandardCheckpointer layout, restorable by orbax-checkpoint). ``metadata``: any
    JSON, given back by ``fc.metadata``; ``step`` and ``metrics`` are recorded with it. Orbax's layout
    records a step only as a CheckpointManager step folder's name: with ``format="orbax"`` and
    ``step``, ``path`` is named for the step (``.../5`` or ``.../<prefix>_5``; else a ValueError) and
    becomes such a step (item ``default``, ``metrics`` as its JSON item), which Orbax's
    CheckpointManager lists."""
    fmt = layouts.layout(format, serializer)
    parent, name = split_location(path)
    jsonable(metadata, "metadata")
    _check_destination(parent, name, format)
    with gc_paused():  # the caller's thread, as a snapshot's (see engine/pause.py)
        snap = fmt.snapshot(tree, copy=False)
        fmt.persist(snap, parent, name, step=step, metrics=metrics, metadata=metadata)


def _check_destination(parent: Any, name: str, format: str) -> None:
    """A save writes a new folder at ``parent/name``: on a local file system nothing but an empty folder
    may be there (a committed checkpoint or a folder with files: the commit refuses it), never a file
    or a symbolic link, which the commit's rename cannot replace; Orbax's layout (tensorstore) takes
    only paths that are valid UTF-8."""
    local = getattr(parent, "local_path", None)
    if local is None:
        return
    where = os.path.join(local, name)
    if os.path.islink(where):
        raise CheckpointExistsError(
            f"{where} is a symbolic link (to {os.readlink(where)}); a save writes a new folder and never "
            "replaces a link or writes through it. Fix: save to the folder it points to, or remove the link.")
    if os.path.lexists(where) and not os.path.isdir(where):
        raise CheckpointExistsError(f"{where} exists and is not a folder; checkpoints are never written over "
                                    "other files. Fix: save elsewhere, or remove it first.")
    if format == "orbax":
        try:
            where.encode()
        except UnicodeEncodeError:
            raise StorageError(f"{where!r} is not valid UTF-8, and Orbax's layout (tensorstore) takes only "
                               "UTF-8 paths. Fix: save to a UTF-8 path, or with format=\"native\", which "
                               "takes any path.") from None


def _folder(path: Any):
    parent, name = split_location(path)
    return parent.sub(name)


def restore(path: Any, target: Any = None, *, shardings: Any = None, partial: bool = False,
            rename: RenameArg = None, missing: str = "error", unexpected: str = "error", cast: bool = False,
            report: bool = False, item: str | None = None, serializer: "str | Serializer | None" = None) -> Any:
    """Restores the checkpoint at ``path`` (either format) into ``target``'s structure, checked leaf by
    leaf (a pytree of arrays or jax.ShapeDtypeStruct giving structure, dtypes and placement), or without
    a target into nested dicts/lists of numpy arrays. Each leaf keeps the target's type: a Python
    scalar target leaf gets a Python scalar, a weak-typed one a weak-typed array. ``shardings`` (one,
    or a tree) overrides the target's placement.

    A target that differs from the checkpoint (fine-tuning, serving; README: Fine-tuning and serving):
    ``rename``: ordered (regex, replacement) pairs or a dict of them, matched against each checkpoint
    key path as a whole (``{"encoder/(.*)": r"backbone/\1"}``; the first rule that matches wins; a
    replacement ``None`` does not restore the leaf; a rule that matches nothing warns), or a function of
    the key path; applied before the structure check. ``missing="keep"``: target leaves the checkpoint
    lacks keep the target's own values (concrete arrays, never a ShapeDtypeStruct).
    ``unexpected="ignore"``: checkpoint leaves the target lacks are not read (``partial=True`` is its
    older name). ``cast=True``: each array is converted to the target's dtype as it is read, slab by
    slab (bool -> integer -> float -> complex, never back; a value the target's dtype cannot hold is a
    CastOverflowError naming the leaf). ``report=True``: returns ``(tree, fc.RestoreReport)``; any of
    these options logs the report's one-line summary.

    An Orbax step saved with named items (``args.Composite``) restores as ``{item name: value}``
    (JSON items as their JSON) and takes a target keyed by item names; ``item="state"`` restores
    one item by itself (see the orbax package's docstring). ``serializer``: the user serializer (an
    instance) that wrote the checkpoint, when no installed package declares it (README: Writing a
    serializer); used only when the manifest names it."""
    fit = Fit.of(partial=partial, rename=rename, missing=missing, unexpected=unexpected, cast=cast,
                 report=report)
    source = layouts.open_checkpoint(_folder(path), item, _reader(serializer))
    return engine.restore(source, target, shardings=shardings, partial=fit)


def metadata(path: Any, *, item: str | None = None, serializer: "str | Serializer | None" = None) -> CheckpointInfo:
    """What the checkpoint at ``path`` holds (tree of shapes, dtypes, shardings; step, metrics, user
    metadata), read without any array bytes; ``item``: one named item of an Orbax step; ``serializer``:
    as for restore."""
    with gc_paused():
        return layouts.open_checkpoint(_folder(path), item, _reader(serializer)).info()


def _reader(serializer: "str | Serializer | None") -> "Serializer | None":
    return None if serializer is None else get_serializer(serializer)
