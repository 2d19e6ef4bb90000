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
from flax_ckpt._src.tree import refuse_traced


def save(
    path: Any,
    tree: Any,
    *,
    metadata: Any = None,
    serializer: "str | Serializer | None" = None,
    step: int | None = None,
    metrics: dict[str, Any] | None = None,
    format: str = "native",
) -> None:
    """Saves ``tree`` to ``path`` synchronously and atomically: the checkpoint is visible only once complete.

    Args:
      path: a folder that must not exist yet (a local path, ``file://``, ``s3://``, ``gs://`` or
        ``memory://`` URL).
      tree: a pytree of arrays (jax, numpy) and Python scalars; other leaves are refused.
      metadata: any JSON value, given back by ``fc.metadata(path).metadata``.
      serializer: "raw" (the default) or "zarr3", or a ``fc.Serializer`` instance; native format only.
      step: the step number recorded with the checkpoint. With ``format="orbax"``, ``path`` must be
        named for it (``.../5`` or ``.../<prefix>_5``) and becomes a step folder of Orbax's
        CheckpointManager (item ``default``, ``metrics`` as its JSON item).
      metrics: JSON scalars recorded with the checkpoint.
      format: "native" (flax_ckpt's layout) or "orbax" (Orbax's StandardCheckpointer layout,
        restorable by orbax-checkpoint).

    Raises:
      CheckpointExistsError: ``path`` holds a committed checkpoint already.
      UnsupportedLeafError: a leaf is not an array or a Python scalar.
      CheckpointError: a leaf is a tracer (``save`` called inside ``jax.jit``, ``grad``, ``vmap`` or
        a ``lax.scan`` body).
      StorageError: the storage refused a write; nothing is committed.
      ValueError: an unknown ``format`` or ``serializer``, ``metadata`` that is not JSON, or a
        ``step`` that ``path``'s name does not carry with ``format="orbax"``.

    Example:
      >>> import numpy as np
      >>> fc.save("ckpt", {"w": np.ones((2, 3), np.float32), "step": 7}, metadata={"lr": 0.1})
      >>> fc.metadata("ckpt").metadata
      {'lr': 0.1}
    """
    refuse_traced(tree, None, f"save to {path}")
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
            "replaces a link or writes through it. Fix: save to the folder it points to, or remove the link."
        )
    if os.path.lexists(where) and not os.path.isdir(where):
        raise CheckpointExistsError(
            f"{where} exists and is not a folder; checkpoints are never written over "
            "other files. Fix: save elsewhere, or remove it first."
        )
    if format == "orbax":
        try:
            where.encode()
        except UnicodeEncodeError:
            raise StorageError(
                f"{where!r} is not valid UTF-8, and Orbax's layout (tensorstore) takes only "
                'UTF-8 paths. Fix: save to a UTF-8 path, or with format="native", which '
                "takes any path."
            ) from None


def _folder(path: Any):
    parent, name = split_location(path)
    return parent.sub(name)


def restore(
    path: Any,
    target: Any = None,
    *,
    shardings: Any = None,
    partial: bool = False,
    rename: RenameArg = None,
    missing: str = "error",
    unexpected: str = "error",
    cast: bool = False,
    report: bool = False,
    item: str | None = None,
    serializer: "str | Serializer | None" = None,
) -> Any:
    """Restores the checkpoint at ``path`` (either format), checked leaf by leaf against ``target``.

    Each leaf keeps the target's type: a Python scalar target leaf gets a Python scalar, a weak-typed
    one a weak-typed array. A target that differs from the checkpoint (fine-tuning, serving) is fitted
    with ``rename``, ``missing``, ``unexpected`` and ``cast``; any of these logs a one-line report.

    Args:
      path: the checkpoint's folder (as for ``fc.save``), native or Orbax.
      target: a pytree of arrays or ``jax.ShapeDtypeStruct`` giving structure, dtypes and placement;
        None restores nested dicts/lists of numpy arrays, Python scalars and strings, except typed
        PRNG keys (``jax.random.key``), which come back as typed key arrays (``jax.Array``: numpy
        refuses them; ``jax.random.key_data(key)`` gives their uint32 words).
      shardings: one sharding, or a tree of them, overriding the target's placement.
      partial: the older name of ``unexpected="ignore"``.
      rename: ordered (regex, replacement) pairs or a dict of them, matched against each checkpoint
        key path as a whole (``{"encoder/(.*)": r"backbone/\1"}``; the first rule that matches wins;
        a replacement None does not restore the leaf; a rule that matches nothing warns), or a
        function of the key path; applied before the structure check.
      missing: "error", or "keep": target leaves the checkpoint lacks keep the target's own values.
      unexpected: "error", or "ignore": checkpoint leaves the target lacks are not read.
      cast: convert each array to the target's dtype as it is read (bool -> integer -> float ->
        complex, never back).
      report: also return a ``fc.RestoreReport`` of what was restored, kept, ignored, renamed, cast.
      item: one named item of an Orbax step saved with ``args.Composite`` (without it, such a step
        restores as ``{item name: value}``).
      serializer: the user serializer (an instance) that wrote the checkpoint, when no installed
        package declares it; used only when the manifest names it.

    Returns:
      The restored tree, or ``(tree, fc.RestoreReport)`` with ``report=True``.

    Raises:
      CheckpointNotFoundError: nothing is committed at ``path``.
      StructureMismatchError: the key paths of target and checkpoint differ (the message lists them).
      LeafMismatchError: shapes or dtypes differ (pass ``cast=True`` for dtypes).
      CastOverflowError: with ``cast=True``, a value the target's dtype cannot hold.
      CorruptCheckpointError: stored bytes do not match their checksum (the message names the file).

    Example:
      >>> import jax
      >>> import numpy as np
      >>> fc.save("ckpt", {"w": np.arange(3, dtype=np.float32)})
      >>> fc.restore("ckpt")
      {'w': array([0., 1., 2.], dtype=float32)}
      >>> target = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
      >>> fc.restore("ckpt", target)["w"]
      Array([0., 1., 2.], dtype=float32)
    """
    fit = Fit.of(
        partial=partial, rename=rename, missing=missing, unexpected=unexpected, cast=cast, report=report
    )
    source = layouts.open_checkpoint(_folder(path), item, _reader(serializer))
    return engine.restore(source, target, shardings=shardings, fit=fit)


def metadata(
    path: Any, *, item: str | None = None, serializer: "str | Serializer | None" = None
) -> CheckpointInfo:
    """What the checkpoint at ``path`` holds, read without any array bytes.

    Args:
      path: the checkpoint's folder (as for ``fc.save``), native or Orbax.
      item: one named item of an Orbax step saved with ``args.Composite``.
      serializer: as for ``fc.restore``.

    Returns:
      A ``fc.CheckpointInfo``: the tree of ``fc.LeafInfo`` (shape, dtype, sharding), step, metrics,
      user metadata, format.

    Raises:
      CheckpointNotFoundError: nothing is committed at ``path``.
      InvalidManifestError: the checkpoint's manifest is damaged or of an unknown version.

    Example:
      >>> import numpy as np
      >>> fc.save("ckpt", {"w": np.zeros((2, 3), np.float32)}, step=10, metrics={"loss": 0.5})
      >>> info = fc.metadata("ckpt")
      >>> info.step, info.metrics, info.leaves["w"].shape
      (10, {'loss': 0.5}, (2, 3))
    """
    with gc_paused():
        return layouts.open_checkpoint(_folder(path), item, _reader(serializer)).info()


def _reader(serializer: "str | Serializer | None") -> "Serializer | None":
    return None if serializer is None else get_serializer(serializer)
