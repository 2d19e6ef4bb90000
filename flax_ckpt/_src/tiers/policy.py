"""CopyPolicy: whether the next local copy is stored full (a new base) or against the base.

Scope: the decision and what it learns from each copy stored: a differential copy is made only while
the base is recent (``rebase_interval``) and it pays; a poor one (storing more than half the state)
makes the next copies full ones, twice as many after each such copy in a row; a copy that sampling
says would not pay is stored full, and sampling pauses 1, 3, 7, ... 63 copies after each such verdict
in a row. Not here: the sampling itself and the encoding (encode.py), the base (tierset.py).
"""

from __future__ import annotations

from flax_ckpt._src.tiers import encode as tier_encode
from flax_ckpt._src.tiers import store

MAX_BACKOFF = 6  # doublings of a back-off at most: 2**6 times the first


class CopyPolicy:
    """``differential``: Tiers.differential; ``rebase_interval``: Tiers.rebase_interval."""

    def __init__(self, differential: bool, rebase_interval: int):
        self.differential, self.rebase_interval = differential, rebase_interval
        self.budget = tier_encode.DeltaBudget()  # when a changed chunk is worth a delta (measured)
        self.since_base = 0  # differential copies stored since the base
        self.full_ahead = 0  # copies still to store in full after a poor differential one
        self.poor_in_a_row = 0
        self.unpaid_in_a_row = 0  # samples in a row that said a differential copy would not pay
        self.unsampled_ahead = 0  # would-be differential copies still to store full without a sample

    def base_for(self, ts: store.TierSnapshot, base: store.Copy | None) -> store.Copy | None:
        """The base to store ``ts`` against, or None: store it full."""
        if (
            not self.differential
            or base is None
            or self.full_ahead > 0
            or self.since_base >= self.rebase_interval
        ):
            return None
        return base if self._pays(ts, base) else None

    def _pays(self, ts: store.TierSnapshot, base: store.Copy) -> bool:
        """Whether ``ts`` is worth a differential copy: sampled against the base (encode.changed_share);
        where more than half would be stored, it is stored full, as the snapshot lies."""
        if self.unsampled_ahead > 0:
            self.unsampled_ahead -= 1
            return False
        if tier_encode.changed_share(ts, base, self.budget) > 0.5:
            self.unpaid_in_a_row = min(self.unpaid_in_a_row + 1, MAX_BACKOFF)
            self.unsampled_ahead = (1 << self.unpaid_in_a_row) - 1
            return False
        self.unpaid_in_a_row = 0
        return True

    def stored(self, full: bool, data_nbytes: int, nbytes: int) -> None:
        """A copy was stored: ``full`` (a new base) or differential, ``data_nbytes`` of its ``nbytes``."""
        if full:
            self.since_base = 0
            self.full_ahead = max(0, self.full_ahead - 1)
            return
        self.since_base += 1
        if data_nbytes > nbytes / 2:  # most of the state changes: comparing costs more than it saves
            self.full_ahead = self.rebase_interval << min(self.poor_in_a_row, MAX_BACKOFF)
            self.poor_in_a_row += 1
        else:
            self.poor_in_a_row = 0
