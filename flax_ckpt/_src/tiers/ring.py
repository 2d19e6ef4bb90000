"""PeerRing: the peer-memory tier's exchange: each process's copy to the next failure domain's host.

Scope: the placement (process i sends to (i + k) % n, k the smallest shift that leaves every
process's failure domain; none with one domain), and the transfer of the copies the last save made,
on the caller's thread (a collective), held until the writer stores them. Not here: storing and
committing a replica (tierset.py), the transfer itself (sync.py).
"""

from __future__ import annotations

import logging
from typing import Any

from flax_ckpt._src.errors import DistributedError
from flax_ckpt._src.tiers import sync as tier_sync
from flax_ckpt._src.tiers.plan import peer_shift
from flax_ckpt._src.tiers.sync import Group

log = logging.getLogger("flax_ckpt")


class PeerRing:
    """``group``: the tiers' processes; ``domains``: each process's failure domain (host and
    local_dir); ``enabled``: Tiers.peer."""

    def __init__(self, group: Group, domains: list[str], enabled: bool):
        self.group = group
        me, count = group.index, group.count
        k = peer_shift(domains) if enabled else None
        self.dst = (me + k) % count if k else None  # the process that holds this one's replicas
        self.src = (me - k) % count if k else None  # the process whose replicas this one holds
        self._outbox: tuple[int, list[memoryview]] | None = None
        self._inbox: tuple[int, Any] | None = None
        if self.dst is None:
            why = (
                "peer=False"
                if not enabled
                else "a single process: no other host to hold a replica"
                if count == 1
                else "every process shares one host and local_dir"
            )
            log.info("peer-memory tier disabled (%s); tiers: local memory, persistent", why)

    def post(self, step: int, index: bytes, pieces: list[Any]) -> None:
        """The writer's copy of ``step`` (its index and data pieces), sent at the next exchange."""
        if self.dst is not None:
            self._outbox = (step, tier_sync.frame([[index], pieces]))

    def exchange(self) -> None:
        """Caller's thread: the ring transfer of the copies posted by the last save (a collective)."""
        if self._outbox is None:
            return
        (step, parts), self._outbox = self._outbox, None
        sizes = self.group.allgather("exchange", {"step": step, "n": sum(len(p) for p in parts)})
        if any(v["step"] != step for v in sizes):
            raise DistributedError(
                f"peer tier: processes sent different steps ({[v['step'] for v in sizes]})"
            )
        shift, count = (self.dst or 0) - self.group.index, self.group.count  # posted only with a peer
        perm = [(j, (j + shift) % count) for j in range(count)]
        self._inbox = (step, self.group.transfer(perm, parts, [v["n"] for v in sizes]))

    def received(self) -> tuple[int, Any] | None:
        """The replica the last exchange brought (step, its frame: ``unframe`` it), once; None if none."""
        if self._inbox is None:
            return None
        (step, buf), self._inbox = self._inbox, None
        return step, buf

    def unframe(self, step: int, buf: Any) -> list[memoryview]:
        """The parts of a received frame (its index, its pieces); a DistributedError if damaged."""
        return tier_sync.unframe(buf, f"step {step} from process {self.src}")
