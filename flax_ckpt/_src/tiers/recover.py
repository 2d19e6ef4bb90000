"""Recovery: the collective restore of a step from any combination of tiers.

Scope: every process's inventory gathered, a plan chosen (plan.py: the newest step complete across
processes, each process reading from its fastest tier), replicas sent to the processes that lost their
local copy (sync.py), each process's copy restored (load.py; the persistent tier is the manager's,
through ``Persistent.read``), and a vote: a copy that failed anywhere is excluded and the plan re-made.
Not here: saving (tierset.py), what a process holds (holdings.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flax_ckpt._src.engine.fit import Fit
from flax_ckpt._src.errors import CheckpointError, CheckpointNotFoundError
from flax_ckpt._src.tiers import Persistent, TargetOf
from flax_ckpt._src.tiers import load as load
from flax_ckpt._src.tiers import store as store
from flax_ckpt._src.tiers import sync as tier_sync
from flax_ckpt._src.tiers.holdings import Holdings
from flax_ckpt._src.tiers.plan import TIER_NAMES, Plan, choose
from flax_ckpt._src.tiers.sync import Group

log = logging.getLogger("flax_ckpt")


class Recovery:
    """The restores of one manager's tiers on this process: ``group`` (the job's processes),
    ``holdings`` (this process's copies), ``persistent`` (the manager's directory)."""

    def __init__(self, group: Group, holdings: Holdings, persistent: Persistent, directory: str):
        self.group, self.holdings, self.persistent, self.directory = group, holdings, persistent, directory
        self.i, self.n = group.index, group.count

    def restore(
        self, step: int | None, target_of: TargetOf, *, shardings: Any, fit: Fit, strict: bool
    ) -> tuple[Any, Plan, int]:
        """Collective: agrees on a plan, moves replicas to processes that lost their local copy, and
        restores; a copy that fails (damaged, layout not held) is excluded and the plan re-made.
        ``target_of``: the target for an opened copy (the manager's restore target, or one made from the
        copy's records). Returns what was restored, the plan, and the bytes read from memory."""
        persistent = set(self.persistent.steps())
        invs = self.group.allgather("inventory", self.holdings.inventory())
        bad: set[tuple[int, str, int]] = set()
        done: tuple[tuple[int, str], Any] | None = None
        while True:
            plan = choose(invs, persistent, step, bad)
            if plan is None:
                raise CheckpointNotFoundError(
                    f"no step {'' if step is None else step} complete across the "
                    f"{self.n} processes in any tier of {self.directory}"
                )
            mine = (plan.step, plan.sources[self.i][0])
            if done is None or done[0] != mine:
                done = None
                value, err = self._execute(plan, target_of, shardings, fit)
                if err is None:
                    done = (mine, value)
            else:
                self._transfers(plan)
                err = None
            votes = self.group.allgather("restored", {"error": err})
            failed = [(j, v["error"]) for j, v in enumerate(votes) if v["error"]]
            if not failed:
                assert done is not None, "this process voted no error: it restored the plan's step"
                log.info("restored step %d of %s: %s", plan.step, self.directory, plan.describe())
                return done[1][0], plan, done[1][1]
            for j, e in failed:
                log.warning(
                    "step %d: process %d could not restore from %s (%s)",
                    plan.step,
                    j,
                    TIER_NAMES[plan.sources[j][0]],
                    e,
                )
                bad.add((j, plan.sources[j][0], plan.step))
            if strict:
                raise CheckpointError(f"restore of step {plan.step} failed (strict): {failed}")

    def _transfers(self, plan: Plan) -> Any:
        """The plan's replicas, each from its holder to its owner (a collective); what this process got."""
        perm = [
            (h, j) for j, (t, h) in enumerate(plan.sources) if t == "peer" and h is not None
        ]  # a peer's: h
        if not perm:
            return None
        serve = next((j for h, j in perm if h == self.i), None)
        parts: list[memoryview] = []
        if serve is not None:
            try:
                parts = tier_sync.frame(
                    store.copy_parts(os.path.join(self.holdings.peer(serve), str(plan.step)))
                )
            except (CheckpointError, OSError) as e:  # the receiver then fails and the plan changes
                log.warning("cannot send process %d its replica of step %d: %s", serve, plan.step, e)
        sizes = self.group.allgather("serve", {"n": sum(len(p) for p in parts)})
        return self.group.transfer(perm, parts, [v["n"] for v in sizes])

    def _execute(
        self, plan: Plan, target_of: TargetOf, shardings: Any, fit: Fit
    ) -> tuple[tuple[Any, int] | None, str | None]:
        """This process's part of ``plan``: ((restored, bytes read from memory), None), or (None, why not)."""
        received = self._transfers(plan)
        tier, holder = plan.sources[self.i]
        try:
            if tier == "persistent":
                return (self.persistent.read(plan.step, target_of, shardings, fit), 0), None
            if tier == "local":
                copy = store.open_copy(os.path.join(self.holdings.local_dir, str(plan.step)))
            else:
                where = f"process {holder}'s replica of process {self.i}, step {plan.step}"
                copy = store.copy_from_parts(tier_sync.unframe(received, where), where)
            if (copy.step, copy.body["session"], copy.body["process"]) != (plan.step, plan.session, self.i):
                raise CheckpointError(f"{copy.where} is not the planned copy")
            return load.restore_copy(copy, target_of, shardings=shardings, fit=fit), None
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            return None, f"{type(e).__name__}: {e}"
