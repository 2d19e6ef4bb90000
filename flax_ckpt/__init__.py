"""flax_ckpt: preemption-safe, asynchronous, sharded, tiered checkpoints for Flax/Optax training.

The public API is what this module re-exports; everything under ``flax_ckpt._src`` is an
implementation detail. Training-loop hooks: ``flax_ckpt.callbacks``.

``import flax_ckpt`` itself is cheap: each public name is imported on its first use (a module
``__getattr__``), so that ``flax-ckpt --help`` and errors in its arguments answer without importing
jax and tensorstore (about a second). Type checkers and IDEs see the names through the
``TYPE_CHECKING`` imports below; ``_SOURCES`` is the same list for the interpreter.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flax_ckpt._src.api import metadata as metadata
    from flax_ckpt._src.api import restore as restore
    from flax_ckpt._src.api import save as save
    from flax_ckpt._src.compile_cache import CompilationCache as CompilationCache
    from flax_ckpt._src.compile_cache import CompilationCacheInfo as CompilationCacheInfo
    from flax_ckpt._src.compile_cache import use_compilation_cache as use_compilation_cache
    from flax_ckpt._src.engine.fit import RestoreReport as RestoreReport
    from flax_ckpt._src.engine.leaves import CheckpointInfo as CheckpointInfo
    from flax_ckpt._src.engine.leaves import LeafInfo as LeafInfo
    from flax_ckpt._src.errors import AbstractTargetLeafError as AbstractTargetLeafError
    from flax_ckpt._src.errors import CastOverflowError as CastOverflowError
    from flax_ckpt._src.errors import CheckpointError as CheckpointError
    from flax_ckpt._src.errors import CheckpointExistsError as CheckpointExistsError
    from flax_ckpt._src.errors import CheckpointLockedError as CheckpointLockedError
    from flax_ckpt._src.errors import CheckpointNotCommittedError as CheckpointNotCommittedError
    from flax_ckpt._src.errors import CheckpointNotFoundError as CheckpointNotFoundError
    from flax_ckpt._src.errors import CorruptCheckpointError as CorruptCheckpointError
    from flax_ckpt._src.errors import DistributedError as DistributedError
    from flax_ckpt._src.errors import InvalidArgumentError as InvalidArgumentError
    from flax_ckpt._src.errors import InvalidManifestError as InvalidManifestError
    from flax_ckpt._src.errors import LeafMismatchError as LeafMismatchError
    from flax_ckpt._src.errors import RenameCollisionError as RenameCollisionError
    from flax_ckpt._src.errors import SaveFailedError as SaveFailedError
    from flax_ckpt._src.errors import StorageError as StorageError
    from flax_ckpt._src.errors import StructureMismatchError as StructureMismatchError
    from flax_ckpt._src.errors import TargetMismatchError as TargetMismatchError
    from flax_ckpt._src.errors import UnsupportedLeafError as UnsupportedLeafError
    from flax_ckpt._src.errors import UnsupportedOrbaxCheckpointError as UnsupportedOrbaxCheckpointError
    from flax_ckpt._src.manager import CheckpointManager as CheckpointManager
    from flax_ckpt._src.manager.plot import plot_timeline as plot_timeline
    from flax_ckpt._src.manager.stats import RestoreStats as RestoreStats
    from flax_ckpt._src.manager.stats import SaveStats as SaveStats
    from flax_ckpt._src.serializers.base import ArrayItem as ArrayItem
    from flax_ckpt._src.serializers.base import Box as Box
    from flax_ckpt._src.serializers.base import Serializer as Serializer
    from flax_ckpt._src.serializers.base import Shard as Shard
    from flax_ckpt._src.serializers.base import StoredArray as StoredArray
    from flax_ckpt._src.serializers.base import Written as Written
    from flax_ckpt._src.storage import ObjectStoreOptions as ObjectStoreOptions
    from flax_ckpt._src.storage.base import Storage as Storage
    from flax_ckpt._src.tiers import Tiers as Tiers

__version__ = "0.1.0"

# Each module of the public API and the names it gives: imported by __getattr__ on first use.
_SOURCES: dict[str, tuple[str, ...]] = {
    "flax_ckpt._src.api": ("metadata", "restore", "save"),
    "flax_ckpt._src.compile_cache": ("CompilationCache", "CompilationCacheInfo", "use_compilation_cache"),
    "flax_ckpt._src.engine.fit": ("RestoreReport",),
    "flax_ckpt._src.engine.leaves": ("CheckpointInfo", "LeafInfo"),
    "flax_ckpt._src.errors": (
        "AbstractTargetLeafError",
        "CastOverflowError",
        "CheckpointError",
        "CheckpointExistsError",
        "CheckpointLockedError",
        "CheckpointNotCommittedError",
        "CheckpointNotFoundError",
        "CorruptCheckpointError",
        "DistributedError",
        "InvalidArgumentError",
        "InvalidManifestError",
        "LeafMismatchError",
        "RenameCollisionError",
        "SaveFailedError",
        "StorageError",
        "StructureMismatchError",
        "TargetMismatchError",
        "UnsupportedLeafError",
        "UnsupportedOrbaxCheckpointError",
    ),
    "flax_ckpt._src.manager": ("CheckpointManager",),
    "flax_ckpt._src.manager.plot": ("plot_timeline",),
    "flax_ckpt._src.serializers.base": ("ArrayItem", "Box", "Serializer", "Shard", "StoredArray", "Written"),
    "flax_ckpt._src.manager.stats": ("RestoreStats", "SaveStats"),
    "flax_ckpt._src.storage": ("ObjectStoreOptions",),
    "flax_ckpt._src.storage.base": ("Storage",),
    "flax_ckpt._src.tiers": ("Tiers",),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """A public name, imported (with jax, tensorstore, ...) on its first use and kept in the module."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__ + ["__version__"])
