"""The manager: a run of checkpoints in one directory (``CheckpointManager``), a composition of parts.

manager.py composes them: the step index (steps.py), the schedule (schedule.py), retention
(retention.py, shared with the flax-ckpt command's prune), the memory tiers (tiers/tierset.py), the
async writer (writer.py), the statistics (stats.py), the directory lock (storage/lock.py) and the
agreed restore (agreed.py). What does not belong here: the formats (layouts.py), the engine.
"""

from flax_ckpt._src.manager.manager import CheckpointManager as CheckpointManager
from flax_ckpt._src.manager.stats import RestoreStats as RestoreStats
from flax_ckpt._src.manager.stats import SaveStats as SaveStats
from flax_ckpt._src.storage.lock import LOCK_FILE as LOCK_FILE
from flax_ckpt._src.storage.lock import DirectoryLock as DirectoryLock

__all__ = ["CheckpointManager", "DirectoryLock", "LOCK_FILE", "RestoreStats", "SaveStats"]
