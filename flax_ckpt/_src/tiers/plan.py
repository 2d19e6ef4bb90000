"""Which copies a restore reads: the plan, chosen from every process's inventory (pure functions).

Scope: given what each process holds (its local copies, the replicas it holds for others, each with
its run's session and whether it carries its tier's commit record) and the persistent steps, choose
the newest step complete across all processes, each process reading from its fastest tier; and the
placement of replicas (which process holds whose). No I/O, no communication: tierset.py gathers the
inventories and carries out the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIER_NAMES = {"local": "local memory", "peer": "peer memory", "persistent": "persistent storage"}


@dataclass(frozen=True)
class Plan:
    """A restore: the step, the session of its memory copies, and per process (tier, holder)."""

    step: int
    session: str | None
    sources: tuple[tuple[str, int | None], ...]

    def describe(self) -> str:
        return ", ".join(
            f"process {i} from {TIER_NAMES[t]}" + (f" (held by process {h})" if t == "peer" else "")
            for i, (t, h) in enumerate(self.sources)
        )


def choose(invs: list[dict[str, Any]], persistent: set[int], want: int | None, bad: set) -> Plan | None:
    """The newest step (``want`` only, if given) every process can read from some tier, each from its
    fastest: its local copy, else its replica's holder, else persistent storage. A memory copy counts
    once its step is committed in that tier: some process holds the tier's commit record for it (the
    vote that precedes every record proves every copy was complete)."""
    peer = [
        (int(k), int(s), x, m, h)
        for h, inv in enumerate(invs)
        for k, steps in inv["peer"].items()
        for s, (x, m) in steps.items()
    ]
    local = {(int(s), x) for inv in invs for s, (x, m) in inv["local"].items() if m}
    marked = {(s, x) for _, s, x, m, _ in peer if m}
    holders = {(k, s, x): h for k, s, x, _, h in peer if (s, x) in marked}
    cands = local | {(s, x) for _, s, x in holders} | {(s, None) for s in persistent}
    for s, x in sorted(cands, key=lambda c: (c[0], c[1] is not None, c[1] or ""), reverse=True):
        if want is not None and s != want:
            continue
        sources = []
        for i, inv in enumerate(invs):
            h = holders.get((i, s, x))
            if (s, x) in local and inv["local"].get(str(s), [None])[0] == x and (i, "local", s) not in bad:
                sources.append(("local", i))
            elif x is not None and h is not None and (i, "peer", s) not in bad:
                sources.append(("peer", h))
            elif s in persistent and (i, "persistent", s) not in bad:
                sources.append(("persistent", None))
            else:
                break
        else:
            return Plan(s, x, tuple(sources))
    return None


def peer_shift(domains: list[str]) -> int | None:
    """The smallest k such that process i's replica, held by (i + k) % n, is never in i's own failure
    domain; None when there is none (one process, or one domain)."""
    n = len(domains)
    return next((k for k in range(1, n) if all(domains[i] != domains[(i + k) % n] for i in range(n))), None)
