"""What each save and restore cost: the records a CheckpointManager keeps (``mgr.stats``,
``mgr.restore_stats``), and ``publish``, which logs a save's and writes it to a metric writer. Values
and their reporting only; plot.py draws them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("flax_ckpt")


@dataclass(frozen=True)
class SaveStats:
    """One save's costs. ``blocked_s``: time ``save`` held the caller (waiting for the previous save +
    snapshot), not counting ``waited_for_device_s``: time it waited for the device to compute the state
    (a loop that dispatches steps ahead of the device would wait for that at its next sync anyway);
    ``durable_s``: from the ``save`` call to the commit being durable. ``snapshot_mode``: "device" (the
    arrays copied on their devices, brought to host by the writer), "split" (those that fit in the
    devices' free memory; the rest to host before ``save`` returned) or "host"; ``device_bytes``: the
    bytes copied on devices."""

    step: int
    nbytes: int
    blocked_s: float
    snapshot_s: float
    write_s: float  # serialization (checksums), writes and fsyncs of the data, wall time
    commit_s: float  # manifest, folder fsyncs, rename
    durable_s: float
    fsync_s: float = 0.0  # part of write_s: seconds in fsync, summed over writer threads
    migrate_s: float = 0.0  # tiers: migration of this step to persistent storage
    start_s: float = 0.0  # when save was called, seconds since the manager was created
    serialize_s: float = 0.0  # part of write_s: checksums of the data, summed over writer threads
    written_bytes: int = 0  # bytes of data files written (local file systems)
    waited_for_device_s: float = 0.0
    snapshot_mode: str = ""
    device_bytes: int = 0

    @property
    def throughput_gbps(self) -> float:
        return self.nbytes / max(self.write_s + self.commit_s, 1e-9) / 1e9


@dataclass(frozen=True)
class RestoreStats:
    """One restore: which step, from which tier, how many array bytes, how long (reading, checking
    checksums and placing on devices)."""

    step: int
    tier: str
    nbytes: int
    seconds: float


def publish(stats: SaveStats, directory: str, metric_writer: Any = None) -> None:
    """Logs one save's costs (INFO: a line; DEBUG: every field) and writes them to ``metric_writer``
    (anything with ``write_scalars(step, dict)``, e.g. a clu MetricWriter) as ``checkpoint/<field>``."""
    log.info(
        "saved step %d to %s (%.1f MB): training waited %.1f ms, on disk %.2f s later",
        stats.step,
        directory,
        stats.nbytes / 1e6,
        stats.blocked_s * 1e3,
        stats.durable_s,
    )
    if log.isEnabledFor(logging.DEBUG):  # asdict walks every field: not at each save for nothing
        log.debug("save statistics: %s", asdict(stats))
    if metric_writer is not None:
        metric_writer.write_scalars(
            stats.step,
            {
                f"checkpoint/{k}": v
                for k, v in asdict(stats).items()
                if k != "step" and not isinstance(v, str)
            },
        )
