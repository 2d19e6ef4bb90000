"""flax_ckpt: preemption-safe, asynchronous, sharded, tiered checkpoints for Flax/Optax training.

The public API is what this module re-exports; every other module is an implementation detail.
"""

from .checkpoint import CheckpointInfo as CheckpointInfo
from .checkpoint import LeafInfo as LeafInfo
from .checkpoint import metadata as metadata
from .checkpoint import restore as restore
from .checkpoint import save as save
from .errors import CheckpointError as CheckpointError
from .errors import CheckpointExistsError as CheckpointExistsError
from .errors import CheckpointLockedError as CheckpointLockedError
from .errors import CheckpointNotCommittedError as CheckpointNotCommittedError
from .errors import CheckpointNotFoundError as CheckpointNotFoundError
from .errors import CorruptCheckpointError as CorruptCheckpointError
from .errors import DistributedError as DistributedError
from .errors import InvalidManifestError as InvalidManifestError
from .errors import LeafMismatchError as LeafMismatchError
from .errors import SaveFailedError as SaveFailedError
from .errors import StorageError as StorageError
from .errors import StructureMismatchError as StructureMismatchError
from .errors import TargetMismatchError as TargetMismatchError
from .errors import UnsupportedLeafError as UnsupportedLeafError
from .errors import UnsupportedOrbaxCheckpointError as UnsupportedOrbaxCheckpointError
from .manager import CheckpointManager as CheckpointManager
from .manager import RestoreStats as RestoreStats
from .manager import SaveStats as SaveStats
from .serializers import Serializer as Serializer
from .tiers import Tiers as Tiers

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
    "restore",
    "save",
]
