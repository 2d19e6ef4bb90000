"""The manager: a run of checkpoints in one directory (``CheckpointManager``), a composition of parts.

manager.py composes a schedule (schedule.py), the async writer (writer.py) and one store (store.py's
protocol): the run directory (directory.py: the step index of steps.py, the layout, the directory
lock, retention of retention.py, the agreed restore of agreed.py, the statistics of stats.py), or
the memory tiers in front of it (tiers/tierset.py, which hold it). What does not belong here: the
formats (layouts.py), the engine.
"""

from flax_ckpt._src.manager.manager import CheckpointManager as CheckpointManager
from flax_ckpt._src.manager.stats import RestoreStats as RestoreStats
from flax_ckpt._src.manager.stats import SaveStats as SaveStats
from flax_ckpt._src.storage.lock import LOCK_FILE as LOCK_FILE
from flax_ckpt._src.storage.lock import DirectoryLock as DirectoryLock

__all__ = ["CheckpointManager", "DirectoryLock", "LOCK_FILE", "RestoreStats", "SaveStats"]
