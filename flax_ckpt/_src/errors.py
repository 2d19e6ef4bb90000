"""The exception hierarchy of flax_ckpt.

Every error the library raises on purpose is a `CheckpointError`. Each subclass's docstring says what
causes it and what to do. Messages name the checkpoint path and, where one applies, the leaf's key path.
Nothing here has behaviour beyond formatting; it is imported by every other module.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error raised by flax_ckpt."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path. Check the path (and the step, for a manager)."""


class CheckpointNotCommittedError(CheckpointError):
    """The folder exists but holds no committed checkpoint (a save still in flight, or one that crashed).

    It is never read. A manager removes leftovers of crashed saves when it starts.
    """


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint (or another folder) already exists where a save was asked to write.

    Checkpoints are never overwritten: save to a new path, or delete the old one first.
    """


class InvalidManifestError(CheckpointError):
    """The manifest is not valid JSON, has an unknown format version, or fails validation
    (locations outside the checkpoint, impossible shapes, wrong field types). The checkpoint is
    damaged or was not written by flax_ckpt; nothing outside its folder is read."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match their checksum, or a data file is missing or truncated.

    The message names the file and the leaf. Restore an older step; a manager does so itself
    (with a warning) unless it was created with strict=True.
    """


class TargetMismatchError(CheckpointError):
    """The restore target does not match what the checkpoint holds."""


class StructureMismatchError(TargetMismatchError):
    """The target's tree structure differs from the checkpoint's: the message lists the key paths
    missing from the checkpoint and those in the checkpoint but not in the target. Pass
    ``unexpected="ignore"`` to restore a sub-tree of what was saved, ``missing="keep"`` to keep the
    target's own values where the checkpoint lacks a leaf, or ``rename=`` to map key paths."""


class LeafMismatchError(TargetMismatchError):
    """Some leaves' shape, dtype or kind differ between target and checkpoint; the message lists
    every one with both values. Fix the target (for example the model config), or pass ``cast=True``
    to convert each array to the target's dtype as it is read."""


class AbstractTargetLeafError(StructureMismatchError):
    """``missing="keep"`` would keep the target's own value for a leaf the checkpoint lacks, but the
    target holds no value there: an abstract ``jax.ShapeDtypeStruct`` (or a deleted, donated array).
    The message names every such leaf. Build those leaves concretely (an initialized model, not
    ``jax.eval_shape``), or ``rename=`` checkpoint keys onto them."""


class RenameCollisionError(TargetMismatchError):
    """``rename=`` maps two checkpoint keys to one target key, or puts a leaf at a key path that another
    leaf's path passes through (``p`` and ``p/q``); the message names both. Make the rules map each
    checkpoint key to its own target key, or drop one (replacement ``None``)."""


class CastOverflowError(LeafMismatchError):
    """``cast=True`` met values the target's dtype cannot hold (an integer outside its range, a value
    beyond its largest after rounding, NaN or inf where it has none, a value it turns into NaN); the
    message names the leaf, the dtypes and a value. Nothing is handed back. Restore into a wider dtype,
    or without ``cast`` and convert yourself."""


class UnsupportedLeafError(CheckpointError, TypeError):
    """A leaf of a type that cannot be stored (a function, an arbitrary object). Nothing was written.

    Store only arrays, Python scalars, strings and None; rebuild other objects in code."""


class CheckpointLockedError(CheckpointError):
    """Another CheckpointManager (in this or another live process) holds the directory's lock.

    Close the other manager. A lock held by a process that died is released by the operating system."""


class SaveFailedError(CheckpointError):
    """A background save failed; its cause is the original exception (with its traceback).

    The failed step was not committed and older checkpoints are untouched."""


class UnsupportedOrbaxCheckpointError(CheckpointError, ValueError):
    """The Orbax checkpoint uses a feature flax_ckpt does not read or write (see the orbax package's
    docstring): a handler type other than PyTree/Standard/JSON, a legacy msgpack checkpoint, a custom
    value type. The message names the path and the feature; restore it with orbax-checkpoint, or
    re-save it with a StandardCheckpointer."""


class StorageError(CheckpointError):
    """A storage backend failed permanently (permission denied, missing bucket, ...). Names the URL."""


class DistributedError(CheckpointError):
    """Processes of a multi-process job did not agree in time (a peer died or hangs)."""


class InvalidArgumentError(CheckpointError, ValueError, TypeError):
    """An argument of a flax_ckpt call is invalid (an unknown option value, a ``rename=`` rule that is
    not a regular expression or whose replacement fails, ``cast=True`` without a target); nothing was
    read or written. It is also a ValueError and a TypeError, as Python's own argument errors are."""


def format_list(items: list[str], limit: int = 20) -> str:
    """Formats a list of names for an error message, eliding past ``limit`` entries."""
    shown = ", ".join(repr(i) for i in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def error_class(name: str) -> type[CheckpointError]:
    """The CheckpointError subclass called ``name`` (another process's error, re-raised here under its
    own class); CorruptCheckpointError for a missing file, CheckpointError for anything else."""
    found = globals().get(name)
    if isinstance(found, type) and issubclass(found, CheckpointError):
        return found
    return CorruptCheckpointError if name in ("FileNotFoundError", "NotADirectoryError") else CheckpointError
