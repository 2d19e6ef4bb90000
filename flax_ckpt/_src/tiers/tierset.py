"""TierSet: the memory tiers of one manager on this process (the package docstring describes them).

Scope: a manager's store (manager/store.py's protocol) made of named parts: the start (every process's
holdings gathered, the run's session and the peer chosen, what an earlier run left kept only if
restorable), each save into the local tier and its replica into the peer tier, the commit votes and
retention of both. The parts: the full-or-differential decision (policy.py), the peer exchange
(ring.py), the migration to the persistent tier (migration.py), the busy-skip (admission.py). The
persistent tier is a ``Persistent`` (tiers/__init__.py: the manager's run directory), given at start
and held: saves migrate into it, restores read it, and closing the tiers closes it. Not here: what a
process holds (holdings.py), restoring (recover.py), the copy format (store.py) and its encoding
(encode.py), the transfer (sync.py), the choice of a restore plan (plan.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from flax_ckpt._src.engine.fit import Fit, as_fit
from flax_ckpt._src.errors import CheckpointError, DistributedError, SaveFailedError, StorageError
from flax_ckpt._src.tiers import Persistent, TargetOf, Tiers
from flax_ckpt._src.tiers import encode as tier_encode
from flax_ckpt._src.tiers import holdings as holdings_mod
from flax_ckpt._src.tiers import load as load
from flax_ckpt._src.tiers import store as store
from flax_ckpt._src.tiers.admission import Admission
from flax_ckpt._src.tiers.holdings import Holdings
from flax_ckpt._src.tiers.migration import Migration
from flax_ckpt._src.tiers.plan import TIER_NAMES, Plan, choose
from flax_ckpt._src.tiers.policy import CopyPolicy
from flax_ckpt._src.tiers.recover import Recovery
from flax_ckpt._src.tiers.ring import PeerRing
from flax_ckpt._src.tiers.sync import Group
from flax_ckpt._src.window import Window

log = logging.getLogger("flax_ckpt")


@dataclass(frozen=True)
class TierStats:
    """One save into the memory tiers: ``written`` bytes (data + index) into the local tier, of
    ``nbytes`` held by this process, ``reused`` of them unchanged leaves never copied to host;
    ``memory_s`` from the ``save`` call to the local commit; ``skipped``: the scheduled steps skipped
    since the previous save because it was still in flight (``Tiers.on_busy="skip"``); ``delta``:
    bytes of changed chunks that were compressed as XOR deltas (encode.DeltaBudget decides which)."""

    step: int
    nbytes: int
    written: int
    reused: int
    base: bool
    blocked_s: float
    encode_s: float
    write_s: float
    commit_s: float
    memory_s: float
    skipped: int = 0
    delta: int = 0
    waited_for_device_s: float = 0.0  # of the caller's time, waiting for the device (not in blocked_s)


class TierSet:
    """The memory tiers of one manager on this process, in front of ``persistent`` (the run directory,
    which they migrate into and close; see the module docstring). A manager's ``Store``."""

    def __init__(self, cfg: Tiers, persistent: Persistent):
        self.cfg, self.persistent, self.directory = cfg, persistent, persistent.url
        steps = set(persistent.steps())
        digest = hashlib.sha256(self.directory.encode()).hexdigest()[:16]  # the processes' rounds
        self.group = Group(digest)
        folder = holdings_mod.folder_key(persistent.storage)  # this volume's directory: its own folder
        self.holdings = Holdings(cfg.local_dir, folder, self.group.index, self.group.count)
        self.root, self.local_dir = self.holdings.root, self.holdings.local_dir
        try:
            self.holdings.make()  # and locked: one live manager per process folder
            run = (
                holdings_mod.run_id(persistent.storage) if self.group.index == 0 else None
            )  # the directory's
            refused = None
        except CheckpointError as e:  # every process still votes at start, so that none waits for this one
            run, refused = None, e
        self._recovery = Recovery(self.group, self.holdings, persistent, self.directory)
        self._kept: dict[str, dict[int, int | None]] = {"local": {}, "peer": {}}  # step -> its base
        self._mutex = threading.Lock()  # _kept: written by the writer thread, read by the caller's
        self._base: store.Copy | None = None
        self._seen = store.Seen()  # since when each jax.Array leaf has been the same object
        self._layouts = tier_encode.FullLayouts()  # the last full copy's layout, for the next ones
        self.policy = CopyPolicy(cfg.differential, cfg.rebase_interval)
        self.migration = Migration(
            self.directory, cfg.persist_interval_steps, cfg.on_busy, max(steps, default=None)
        )
        caller = Group(digest + "/caller")  # rounds of the caller's thread (admit), apart from the writer's
        self.admission = Admission(
            cfg.on_busy,
            (lambda mine: caller.allgather("admit", mine)) if self.group.count > 1 else None,
            _warn_skipped,
        )
        self.stats: Window[TierStats] = Window()  # the newest copies, with totals
        self.last_plan: Plan | None = None
        try:
            self._start(steps, refused, run)
        except BaseException:
            self.migration.shutdown()
            self.holdings.release()
            raise

    @property
    def skipped(self) -> int:
        return self.admission.skipped

    deferred = property(lambda self: self.migration.deferred)

    @property
    def tier_stats(self) -> list[TierStats]:
        return self.stats

    # ---------------------------------------------------------------------------------- start

    def _start(self, persistent: set[int], refused: CheckpointError | None, run: str | None) -> None:
        if refused is not None:
            self.group.allgather("start", {"refused": str(refused)})
            raise refused
        self.holdings.tidy()
        mine = dict(
            self.holdings.inventory(),
            session=uuid.uuid4().hex[:12],
            owner=self.holdings.owner(),
            domain=f"{socket.gethostname()}:{os.path.realpath(self.cfg.local_dir)}",
            run=run,
        )
        invs = self.group.allgather("start", mine)
        for j, v in enumerate(invs):
            if "refused" in v:
                raise StorageError(f"memory tiers: process {j} refused its folders: {v['refused']}")
        self._disown(invs, invs[0]["run"])
        self.session = invs[0]["session"]
        self.ring = PeerRing(self.group, [v["domain"] for v in invs], self.cfg.peer)
        self._old = self._restorable(invs, persistent)
        self.holdings.claim(invs[0]["run"])  # after the removal of another run's copies

    def _disown(self, invs: list[dict[str, Any]], run: str) -> None:
        """Empties the inventory of every process folder that holds another run's copies (its run id is
        not the directory's ``run``: the directory was deleted or replaced since, or another job used
        its URL): ignored, never restored or migrated, then removed. Every process decides alike."""
        for j, v in enumerate(invs):
            if v["owner"] != run and (v["local"] or v["peer"]):
                if j == self.group.index:
                    log.warning(
                        "memory tiers: %s holds copies of steps %s of another run of %s (its run id "
                        "%s, the directory's %s: the directory was deleted or replaced since, or "
                        "another job used its URL); they are ignored, never restored or migrated, "
                        "and removed",
                        self.root,
                        sorted(
                            {int(s) for s in v["local"]} | {int(s) for p in v["peer"].values() for s in p}
                        ),
                        self.directory,
                        v["owner"],
                        run,
                    )
                v["local"], v["peer"] = {}, {}

    def _restorable(self, invs: list[dict[str, Any]], persistent: set[int]) -> dict[int, str]:
        """Steps of earlier runs restorable from memory; every other copy is deleted (never usable)."""
        good: dict[int, str] = {}
        for s in sorted(
            {int(s) for inv in invs for s in inv["local"]}
            | {int(s) for inv in invs for p in inv["peer"].values() for s in p}
        ):
            plan = choose(invs, persistent, s, set())
            if plan is not None and plan.session is not None:
                good[s] = plan.session
        self.holdings.keep_only(invs[self.group.index], good)
        return good

    def memory_steps(self) -> list[int]:
        """Steps restorable from the memory tiers, as this run knows them."""
        with self._mutex:
            own = set(self._kept["local"]) | set(self._kept["peer"])
        return sorted(own if own else set(self._old))

    def steps(self) -> list[int]:
        """Steps committed in any tier: memory, or the persistent directory."""
        return sorted(set(self.persistent.steps()) | set(self.memory_steps()))

    def local_folder(self, step: int) -> str | None:
        """None: a restore reads the memory tiers' copies first, which a read ahead cannot warm."""
        return None

    def committed(self, tier: str) -> list[int]:
        """Steps committed in ``tier`` ("local" or "peer") by this run and still kept."""
        with self._mutex:
            return sorted(self._kept[tier])

    # ---------------------------------------------------------------------------------- save

    def admit(self, step: int, busy: bool, force: bool) -> bool:
        """Caller's thread, for a step the schedule saves, before anything waits for the writer: whether
        to save it (admission.py: with ``on_busy="skip"``, not while the previous save is in flight on
        any process; the newest state wins at the next call). ``force`` waits."""
        return self.admission.admit(step, busy, force)

    def snapshot(self, step: int, state: Any, *, copy: bool, force: bool) -> store.TierSnapshot:
        """Caller's thread, writer idle: sends the previous step's copy to its peer, then copies
        ``state`` to host (leaves unchanged since the base are not copied: they are views of it),
        straight into the pages of a spare data file where there is one: if the writer stores the copy
        full, that is the copy's data file and its only copy, checksummed as it is made (the writer
        neither copies nor reads those pages again); the arrays are released at once either way, so
        the next step can donate them."""
        self.ring.exchange()
        base = self._base if self.cfg.differential else None
        spares = self.holdings.spare(self.local_dir)
        lent = (
            spares.lend(len(self._base.data)) if copy and self._base is not None else None
        )  # may be stored full
        try:
            ts = store.take_snapshot(
                state, copy=copy, force=force, step=step, seen=self._seen, base=base, into=lent
            )
        except BaseException:
            spares.give_back(lent)
            raise
        ts.skipped = self.admission.take_skipped()
        return ts

    def save(
        self, step: int, snap: store.TierSnapshot, metrics: dict | None, t0: float, blocked: float
    ) -> None:
        """Background (the manager's writer): stores the received replica, then this step's local copy;
        commits both tiers; starts the migration when it is due (migration.py)."""
        self._store_replica()
        self.migration.busy_somewhere = False
        if step in self._kept["local"]:
            snap.complete()
            log.info("step %d is already in the memory tiers; not replaced", step)
        else:
            self._save_local(step, snap, metrics, t0, blocked)
        self.migration.offer(
            step,
            snap.force,
            lambda: (snap.verify_views(), self.persistent.migrate(step, snap.snap, metrics, t0, blocked)),
        )

    def _ident(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "session": self.session,
            "process": self.group.index,
            "process_count": self.group.count,
        }

    def _save_local(
        self, step: int, ts: store.TierSnapshot, metrics: dict | None, t0: float, blocked: float
    ) -> None:
        t1 = time.perf_counter()
        enc, err, budget = None, None, self.policy.budget
        spares = self.holdings.spare(self.local_dir)
        try:
            ts.complete()  # the device copies to host (a step failed on the device: raised after the vote)
            t1 = time.perf_counter()  # encode_s and the delta budget leave the transfer out
            budget.refill(t1)
            base = self.policy.base_for(ts, self._base)
            zipped = budget.zipped
            enc = tier_encode.encode(
                ts,
                dict(self._ident(step), metrics=metrics, created=time.time()),
                base,
                delta=self.cfg.differential,
                budget=budget,
                layouts=self._layouts,
            )
            zipped = budget.zipped - zipped
            t2 = time.perf_counter()
            store.write_copy(self.local_dir, step, enc, spares)
        except Exception as e:  # every process votes, so that none waits for a failed one
            err = e
            spares.give_back(ts.lent)  # a loan no write took (a failed step)
        t3 = time.perf_counter()
        self._commit("local", step, self.local_dir, err, enc.base if enc else None)
        assert enc is not None, "a failed copy (no enc) raised in _commit"
        now = time.perf_counter()
        reused = sum(sh.data.nbytes for sh in ts.shards() if sh.base is not None)
        self.stats.append(
            TierStats(
                step,
                ts.nbytes,
                enc.written,
                reused,
                enc.full,
                blocked,
                t2 - t1,
                t3 - t2,
                now - t3,
                now - t0,
                ts.skipped,
                zipped,
                ts.waited_s,
            )
        )
        self.policy.stored(enc.full, enc.data_nbytes, ts.nbytes)
        if enc.full:  # the new base: the index just written, its data file checked (store.Data)
            folder = os.path.join(self.local_dir, str(step))
            self._base = store.Copy(
                folder, None, store.Data(os.path.join(folder, store.DATA)), None, index=enc.index, _step=step
            )  # its body parsed where needed
            self._base.data.view(0, 0)  # mapped now, while it has one name: a second one given it
            #                             later (a `cp -al` backup) never stops the copies made against it
        self.ring.post(step, enc.index, enc.pieces)
        self._prune("local", self.local_dir)
        self._ready_spare(spares)

    def _ready_spare(self, spares: store.SpareFolder) -> None:
        """After a local commit: the pages of the next snapshot, or the older base's file as the spare."""
        base = self._base
        assert base is not None, "a local commit made or kept a base"
        with self._mutex:  # a base older than this one, still kept: its file is the next spare
            older = any(b is not None and b != base.step for b in self._kept["local"].values())
        if older:
            spares.release()
        else:
            spares.prepare(len(base.data))  # the next snapshot's pages

    def _commit(self, tier: str, step: int, folder: str, err: Exception | None, base: int | None) -> None:
        """Commits ``step`` in ``tier`` once every process voted that it holds its copy there."""
        votes = self.group.allgather(
            f"commit-{tier}",
            {
                "step": step,
                "error": None if err is None else repr(err),
                "migrating": self.migration.running(),
            },
        )
        if tier == "local":  # every process sees the same votes: all put a due migration off, or none
            self.migration.busy_somewhere = any(v.get("migrating") for v in votes)
        if err is not None:
            raise err
        failed = [
            f"process {j}: {v['error']}" for j, v in enumerate(votes) if v["error"] or v["step"] != step
        ]
        if failed:
            raise DistributedError(
                f"step {step} was not committed in the {TIER_NAMES[tier]} tier: " + "; ".join(failed)
            )
        store.mark_committed(os.path.join(folder, str(step)), {"tier": tier, **self._ident(step)})
        with self._mutex:
            self._kept[tier][step] = base
            keep = sorted(self._kept[tier])[-self.cfg.max_to_keep :]
            self._kept[tier] = {s: self._kept[tier][s] for s in keep}

    def _prune(self, tier: str, folder: str) -> None:
        """Retention in ``tier`` after a commit: removes what no kept step needs."""
        with self._mutex:
            keep = set(self._kept[tier])
            needed = keep | {b for b in self._kept[tier].values() if b is not None}
        if tier == "local" and self._base is not None:
            needed.add(self._base.step)
        for s in set(store.steps_in(folder)) - needed:  # older steps, and copies of earlier runs
            store.remove_copy(folder, s, self.holdings.spare(folder))
        for s in needed - keep:  # kept only as a base: no longer a committed step of this tier
            store.unmark(os.path.join(folder, str(s)))

    def _store_replica(self) -> None:
        """Stores and commits, in the peer tier, the replica the last exchange brought (if any)."""
        received = self.ring.received()
        if received is None:
            return
        (step, buf), src = received, self.ring.src
        assert src is not None, "a received replica has its sender"
        folder, err, base = self.holdings.peer(src), None, None
        try:
            parts = self.ring.unframe(step, buf)
            store.write_copy(
                folder, step, store.Encoded.received_from(parts[0], parts[1]), self.holdings.spare(folder)
            )
            body = store.open_copy(os.path.join(folder, str(step))).body
            if (body["step"], body["process"], body["session"]) != (step, src, self.session):
                raise DistributedError(f"process {src} sent a copy of another step or run")
            base = body["base"]
        except Exception as e:
            err = e
        self._commit("peer", step, folder, err, base)
        self._prune("peer", folder)

    # ------------------------------------------------------------------------------- the end

    def flush(self) -> None:
        """Caller's thread, writer idle: replicate the last copy, commit it in the peer tier, and wait
        for the migration in flight (raising its failure)."""
        self.ring.exchange()
        self._store_replica()
        self.migration.wait()

    def close(self, *, at_exit: bool = False) -> None:
        """Caller's thread, writer closed: flush; with ``cleanup``, migrate the newest step if it is only
        in memory, then remove this process's folders; then close the persistent tier. Spare data
        files go in any case. ``at_exit`` with several processes: ``let_go`` (closing is a collective,
        which another process may never join), with a warning."""
        if at_exit and self.group.count > 1:
            self.let_go()
            log.warning(
                "CheckpointManager(%s) was not closed: at interpreter exit its memory tiers were left "
                "in %s, restorable by the next run (closing them is a collective); call close() after "
                "the training loop",
                self.directory,
                self.root,
            )
            return
        try:
            self._close()
        finally:
            self.persistent.close()

    def _close(self) -> None:
        try:
            self.flush()
            if self.cfg.cleanup:
                newest = max(self._kept["local"], default=None)
                if newest is not None and newest not in self.persistent.steps():
                    self._migrate_at_close(newest)
                self._base = None
                self.holdings.remove()
                log.info("removed the memory tiers of %s from %s", self.directory, self.root)
        finally:
            self.migration.shutdown()
            self.holdings.drop_spares()
            self.holdings.release()

    def _migrate_at_close(self, step: int) -> None:
        """Migrates ``step``, held only in memory, before the tiers are removed; a failure (a full disk)
        is a SaveFailedError, and nothing is removed: the next manager restores the step from memory."""
        log.info("migrating step %d to %s before removing the memory tiers", step, self.directory)
        try:
            copy = store.open_copy(os.path.join(self.local_dir, str(step)))
            self.persistent.migrate(
                step, load.to_snapshot(copy), copy.body.get("metrics"), time.perf_counter(), 0.0
            )
        except Exception as e:
            raise SaveFailedError(
                f"close: step {step}, held only in the memory tiers, could not be migrated to "
                f"{self.directory} ({type(e).__name__}: {e}). Nothing was removed: {self.root} still holds "
                "it, and the next CheckpointManager of this directory with the same Tiers restores it from "
                "there. Fix the cause (free space), then open that manager and close it, or save the "
                "restored state"
            ) from e

    def let_go(self) -> None:
        """The end of a manager nobody closed (no collective): waits for the migration in flight (raising
        its failure) and releases the process folder and the persistent tier; the copies stay,
        restorable as after a crash."""
        try:
            self.migration.wait()
        finally:
            try:
                self.holdings.release()
            finally:
                self.persistent.let_go()

    # --------------------------------------------------------------------------------- restore

    def restore(
        self,
        step: int | None,
        target_of: TargetOf,
        shardings: Any,
        fit: "Fit | bool",
        item: str | None = None,
        *,
        strict: bool | None = None,
    ) -> Any:
        """Collective (recover.py): the newest step complete across processes in some combination of
        tiers (or ``step``), each process reading from the fastest tier holding its shards. The plan
        is kept as ``last_plan``. ``fit``: how the target may differ (engine/fit.py; a bool: partial);
        ``strict``: the persistent tier's when None."""
        if item is not None:
            raise ValueError("item= selects an item of an Orbax step; a tiered manager holds native steps")
        t0 = time.perf_counter()
        self.flush()
        strict = self.persistent.strict if strict is None else strict
        out, plan, nbytes = self._recovery.restore(
            step, target_of, shardings=shardings, fit=as_fit(fit), strict=strict
        )
        self.last_plan = plan
        tier = plan.sources[self.group.index][0]
        self.persistent.resumed(plan.step, tier, nbytes, time.perf_counter() - t0)
        return out


def _warn_skipped(step: int) -> None:
    log.warning(
        "memory tiers: step %d not saved: the previous save is still being written, and "
        "Tiers(on_busy='skip') never holds training for it (the newest state is saved once "
        "the writer is free); skipped steps are counted in tier_stats, not logged again. "
        "Tiers(on_busy='wait') waits instead.",
        step,
    )
