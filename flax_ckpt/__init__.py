"""flax_ckpt: preemption-safe, asynchronous, sharded, tiered checkpoints for Flax/Optax training.

The public API is what this module re-exports; everything under ``flax_ckpt._src`` is an
implementation detail. Training-loop hooks: ``flax_ckpt.callbacks`` (also importable as ``callbacks``).
"""

from flax_ckpt._src.api import metadata as metadata
from flax_ckpt._src.api import restore as restore
from flax_ckpt._src.api import save as save
from flax_ckpt._src.engine.leaves import CheckpointInfo as CheckpointInfo
from flax_ckpt._src.engine.leaves import LeafInfo as LeafInfo
from flax_ckpt._src.errors import CheckpointError as CheckpointError
from flax_ckpt._src.errors import CheckpointExistsError as CheckpointExistsError
from flax_ckpt._src.errors import CheckpointLockedError as CheckpointLockedError
from flax_ckpt._src.errors import CheckpointNotCommittedError as CheckpointNotCommittedError
from flax_ckpt._src.errors import CheckpointNotFoundError as CheckpointNotFoundError
from flax_ckpt._src.errors import CorruptCheckpointError as CorruptCheckpointError
from flax_ckpt._src.errors import DistributedError as DistributedError
from flax_ckpt._src.errors import InvalidManifestError as InvalidManifestError
from flax_ckpt._src.errors import LeafMismatchError as LeafMismatchError
from flax_ckpt._src.errors import SaveFailedError as SaveFailedError
from flax_ckpt._src.errors import StorageError as StorageError
from flax_ckpt._src.errors import StructureMismatchError as StructureMismatchError
from flax_ckpt._src.errors import TargetMismatchError as TargetMismatchError
from flax_ckpt._src.errors import UnsupportedLeafError as UnsupportedLeafError
from flax_ckpt._src.errors import UnsupportedOrbaxCheckpointError as UnsupportedOrbaxCheckpointError
from flax_ckpt._src.manager import CheckpointManager as CheckpointManager
from flax_ckpt._src.plot import plot_timeline as plot_timeline
from flax_ckpt._src.serializers.base import ArrayItem as ArrayItem
from flax_ckpt._src.serializers.base import Box as Box
from flax_ckpt._src.serializers.base import Serializer as Serializer
from flax_ckpt._src.serializers.base import Shard as Shard
from flax_ckpt._src.serializers.base import StoredArray as StoredArray
from flax_ckpt._src.serializers.base import Written as Written
from flax_ckpt._src.stats import RestoreStats as RestoreStats
from flax_ckpt._src.stats import SaveStats as SaveStats
from flax_ckpt._src.storage import ObjectStoreOptions as ObjectStoreOptions
from flax_ckpt._src.storage.base import Storage as Storage
from flax_ckpt._src.tiers import Tiers as Tiers

__version__ = "0.1.0"

__all__ = [
    "ArrayItem",
    "Box",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotCommittedError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedError",
    "InvalidManifestError",
    "LeafInfo",
    "LeafMismatchError",
    "ObjectStoreOptions",
    "RestoreStats",
    "SaveFailedError",
    "SaveStats",
    "Serializer",
    "Shard",
    "Storage",
    "StorageError",
    "StoredArray",
    "StructureMismatchError",
    "TargetMismatchError",
    "Tiers",
    "UnsupportedLeafError",
    "UnsupportedOrbaxCheckpointError",
    "Written",
    "metadata",
    "plot_timeline",
    "restore",
    "save",
]


def __dir__() -> list[str]:
    return sorted(__all__ + ["__version__"])
