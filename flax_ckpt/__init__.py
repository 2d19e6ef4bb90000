"""flax_ckpt: preemption-safe, asynchronous, sharded, tiered checkpoints for Flax/Optax training.

The public API is what this module re-exports; every other module is an implementation detail.
"""

from flax_ckpt._src.engine.checkpoint import CheckpointInfo as CheckpointInfo
from flax_ckpt._src.engine.checkpoint import LeafInfo as LeafInfo
from flax_ckpt._src.engine.checkpoint import metadata as metadata
from flax_ckpt._src.engine.checkpoint import restore as restore
from flax_ckpt._src.engine.checkpoint import save as save
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
from flax_ckpt._src.manager import RestoreStats as RestoreStats
from flax_ckpt._src.manager import SaveStats as SaveStats
from flax_ckpt._src.plot import plot_timeline as plot_timeline
from flax_ckpt._src.serializers import Serializer as Serializer
from flax_ckpt._src.tiers import Tiers as Tiers

__version__ = "0.1.0"

__all__ = [
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
    "RestoreStats",
    "SaveFailedError",
    "SaveStats",
    "Serializer",
    "StorageError",
    "StructureMismatchError",
    "TargetMismatchError",
    "Tiers",
    "UnsupportedLeafError",
    "UnsupportedOrbaxCheckpointError",
    "metadata",
    "plot_timeline",
    "restore",
    "save",
]
