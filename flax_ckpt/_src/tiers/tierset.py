"""TierSet: the memory tiers of one manager on this process (the package docstring describes them).

Scope: the start (every process's holdings gathered, the run's session and the peer chosen, what an
earlier run left kept only if restorable), each save into the local tier and its replica into the peer
tier, the commit votes and retention of both, and the migration to persistent storage. The persistent
tier is the manager's: the tiers reach it through ``Persistent`` (tiers/__init__.py), given once at
start. Not here: what a process holds (holdings.py), restoring (recover.py), the copy format
(store.py) and its encoding (encode.py), the transfer (sync.py), the choice of a restore plan
(plan.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from flax_ckpt._src.engine.fit import Fit, as_fit
from flax_ckpt._src.errors import CheckpointError, DistributedError, SaveFailedError, StorageError
from flax_ckpt._src.tiers import Persistent, TargetOf, Tiers
from flax_ckpt._src.tiers import encode as tier_encode
from flax_ckpt._src.tiers import holdings as holdings_mod
from flax_ckpt._src.tiers import load as load
from flax_ckpt._src.tiers import store as store
from flax_ckpt._src.tiers import sync as tier_sync
from flax_ckpt._src.tiers.holdings import Holdings
from flax_ckpt._src.tiers.plan import TIER_NAMES, Plan, choose, peer_shift
from flax_ckpt._src.tiers.recover import Recovery
from flax_ckpt._src.tiers.sync import Group

log = logging.getLogger("flax_ckpt")
_MAX_BACKOFF = 6  # full copies in a row after a poor differential one: at most rebase_interval * 2**6


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
    """The memory tiers of one manager on this process (see the module docstring). ``persistent``: the
    manager's directory (the persistent tier), the one way the tiers reach the manager."""

    def __init__(self, cfg: Tiers, directory: str, persistent: Persistent):
        self.cfg, self.directory, self.persistent = cfg, directory, persistent
        steps = persistent.steps()
        digest = hashlib.sha256(directory.encode()).hexdigest()[:16]
        self.group = Group(digest)
        self.i, self.n = self.group.index, self.group.count
        self.holdings = Holdings(cfg.local_dir, digest, self.i, self.n)
        self.root, self.local_dir = self.holdings.root, self.holdings.local_dir
        try:
            self.holdings.make()  # and locked: one live manager per process folder
            run = holdings_mod.run_id(persistent.storage) if self.i == 0 else None  # the directory's identity
            refused = None
        except CheckpointError as e:  # every process still votes at start, so that none waits for this one
            run, refused = None, e
        self._recovery = Recovery(self.group, self.holdings, persistent, directory)
        self._kept: dict[str, dict[int, int | None]] = {"local": {}, "peer": {}}  # step -> its base
        self._mutex = threading.Lock()  # _kept: written by the writer thread, read by the caller's
        self._base: store.Copy | None = None
        self._seen = store.Seen()  # since when each jax.Array leaf has been the same object
        self._since_base, self._poor = 0, 0  # _poor: copies still to store in full (see _save_local)
        self._misses = 0  # differential copies in a row that saved less than half
        self._unpaid = self._unsampled = 0  # samples in a row that said a differential copy would not pay;
        #                                     would-be differential copies still to store full unsampled
        self._outbox: tuple[int, list[memoryview]] | None = None
        self._inbox: tuple[int, Any] | None = None
        self._budget = tier_encode.DeltaBudget()  # when a changed chunk is worth a delta (measured)
        self._layouts = tier_encode.FullLayouts()  # the last full copy's layout, for the next ones
        self._caller = Group(digest + "/caller")  # rounds of the caller's thread (admit), apart from the writer's
        self.skipped, self._skipped, self._told = 0, 0, False  # steps skipped (on_busy="skip"): all, since the last save
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flax_ckpt-migrate")
        self._migration: tuple[int, Future] | None = None
        self._migrating = False  # agreed at the last local commit: some process's migration was in flight
        self.deferred = 0  # migrations put off to a later step because the previous one was still running
        self._last_migrated = max(steps, default=None)
        self.stats: list[TierStats] = []
        self.last_plan: Plan | None = None
        try:
            self._start(steps, refused, run)
        except BaseException:
            self.holdings.release()
            raise

    # ---------------------------------------------------------------------------------- start

    def _start(self, persistent: set[int], refused: CheckpointError | None, run: str | None) -> None:
        if refused is not None:
            self.group.allgather("start", {"refused": str(refused)})
            raise refused
        self.holdings.tidy()
        mine = dict(self.holdings.inventory(), session=uuid.uuid4().hex[:12], owner=self.holdings.owner(),
                    domain=f"{socket.gethostname()}:{os.path.realpath(self.cfg.local_dir)}", run=run)
        invs = self.group.allgather("start", mine)
        for j, v in enumerate(invs):
            if "refused" in v:
                raise StorageError(f"memory tiers: process {j} refused its folders: {v['refused']}")
        self._disown(invs, invs[0]["run"])
        self.session = invs[0]["session"]
        k = peer_shift([v["domain"] for v in invs]) if self.cfg.peer else None
        self.peer_dst = (self.i + k) % self.n if k else None
        self.peer_src = (self.i - k) % self.n if k else None
        if self.peer_dst is None:
            why = ("peer=False" if not self.cfg.peer else "a single process: no other host to hold a replica"
                   if self.n == 1 else "every process shares one host and local_dir")
            log.info("peer-memory tier disabled (%s); tiers: local memory, persistent", why)
        self._old = self._restorable(invs, persistent)
        self.holdings.claim(invs[0]["run"])  # after the removal of another run's copies

    def _disown(self, invs: list[dict[str, Any]], run: str) -> None:
        """Empties the inventory of every process folder that holds another run's copies (its run id is
        not the directory's ``run``: the directory was deleted or replaced since, or another job used
        its URL): ignored, never restored or migrated, then removed. Every process decides alike."""
        for j, v in enumerate(invs):
            if v["owner"] != run and (v["local"] or v["peer"]):
                if j == self.i:
                    log.warning("memory tiers: %s holds copies of steps %s of another run of %s (its run id "
                                "%s, the directory's %s: the directory was deleted or replaced since, or "
                                "another job used its URL); they are ignored, never restored or migrated, "
                                "and removed",
                                self.root, sorted({int(s) for s in v["local"]}
                                                  | {int(s) for p in v["peer"].values() for s in p}),
                                self.directory, v["owner"], run)
                v["local"], v["peer"] = {}, {}

    def _restorable(self, invs: list[dict[str, Any]], persistent: set[int]) -> dict[int, str]:
        """Steps of earlier runs restorable from memory; every other copy is deleted (never usable)."""
        good: dict[int, str] = {}
        for s in sorted({int(s) for inv in invs for s in inv["local"]} | {int(s) for inv in invs
                                                                         for p in inv["peer"].values() for s in p}):
            plan = choose(invs, persistent, s, set())
            if plan is not None and plan.session is not None:
                good[s] = plan.session
        self.holdings.keep_only(invs[self.i], good)
        return good

    def steps(self) -> list[int]:
        """Steps restorable from the memory tiers, as this run knows them."""
        with self._mutex:
            own = set(self._kept["local"]) | set(self._kept["peer"])
        return sorted(own if own else set(self._old))

    def committed(self, tier: str) -> list[int]:
        """Steps committed in ``tier`` ("local" or "peer") by this run and still kept."""
        with self._mutex:
            return sorted(self._kept[tier])

    # ---------------------------------------------------------------------------------- save

    def admit(self, step: int, busy: bool, force: bool) -> bool:
        """Caller's thread, for a step the schedule saves, before anything waits for the writer: whether
        to save it. With ``on_busy="skip"`` a step that finds the previous save still in flight (``busy``;
        with several processes, on any of them: one key-value round per call, every process decides
        alike) is skipped instead of held: the newest state wins at the next call. ``force`` waits."""
        if self.cfg.on_busy == "wait" or force:
            return True
        if self.n > 1:
            votes = self._caller.allgather("admit", {"step": step, "busy": busy})
            if any(v["step"] != step for v in votes):
                raise DistributedError(f"memory tiers: processes save different steps ({[v['step'] for v in votes]})")
            busy = any(v["busy"] for v in votes)
        if not busy:
            return True
        self.skipped += 1
        self._skipped += 1
        if not self._told:
            self._told = True
            log.warning("memory tiers: step %d not saved: the previous save is still being written, and "
                        "Tiers(on_busy='skip') never holds training for it (the newest state is saved once "
                        "the writer is free); skipped steps are counted in tier_stats, not logged again. "
                        "Tiers(on_busy='wait') waits instead.", step)
        return False

    def snapshot(self, step: int, state: Any, *, copy: bool, force: bool) -> store.TierSnapshot:
        """Caller's thread, writer idle: sends the previous step's copy to its peer, then copies
        ``state`` to host (leaves unchanged since the base are not copied: they are views of it),
        straight into the pages of a spare data file where there is one: if the writer stores the copy
        full, that is the copy's data file and its only copy, checksummed as it is made (the writer
        neither copies nor reads those pages again); the arrays are released at once either way, so
        the next step can donate them."""
        self._exchange()
        base = self._base if self.cfg.differential else None
        lent = None
        if copy and self._base is not None:  # a differential copy too: the writer may store it full
            lent = self.holdings.spare(self.local_dir).lend(len(self._base.data))
        try:
            ts = store.take_snapshot(state, copy=copy, force=force, step=step, seen=self._seen, base=base,
                                     into=lent)
        except BaseException:
            self.holdings.spare(self.local_dir).give_back(lent)
            raise
        ts.skipped, self._skipped = self._skipped, 0
        return ts

    def save(self, step: int, ts: store.TierSnapshot, metrics: dict | None, t0: float, blocked: float) -> None:
        """Background (the manager's writer): stores the received replica, then this step's local copy;
        commits both tiers; starts the migration when it is due (after the previous one: its failure
        is raised there, a point every process reaches, as are wait_until_finished and close)."""
        if self._inbox is not None:
            self._store_replica()
        self._migrating = False
        if step in self._kept["local"]:
            ts.complete()
            log.info("step %d is already in the memory tiers; not replaced", step)
        else:
            self._save_local(step, ts, metrics, t0, blocked)
        if ts.force or (self.cfg.persist_interval_steps is not None and step // self.cfg.persist_interval_steps
                        > (self._last_migrated or 0) // self.cfg.persist_interval_steps):
            if self._migrating and not ts.force and self.cfg.on_busy == "skip":  # throttled: a later step goes
                # once the writer is free; on_busy="wait" waits for the previous migration instead
                self.deferred += 1
                log.debug("migration of step %d put off: the previous one is still running", step)
                return
            self._migrate(step, lambda: (ts.verify_views(),
                                         self.persistent.write(step, ts.snap, metrics, t0, blocked)))

    def _ident(self, step: int) -> dict[str, Any]:
        return {"step": step, "session": self.session, "process": self.i, "process_count": self.n}

    def _save_local(self, step: int, ts: store.TierSnapshot, metrics: dict | None, t0: float,
                    blocked: float) -> None:
        t1 = time.perf_counter()
        enc, err = None, None
        try:
            ts.complete()  # the device copies to host (a step failed on the device: raised after the vote)
            t1 = time.perf_counter()  # encode_s and the delta budget leave the transfer out
            self._budget.refill(t1)
            base = None if self._next_full() or not self._pays(ts) else self._base
            zipped = self._budget.zipped
            enc = tier_encode.encode(ts, dict(self._ident(step), metrics=metrics, created=time.time()), base,
                                     delta=self.cfg.differential, budget=self._budget, layouts=self._layouts)
            zipped = self._budget.zipped - zipped
            t2 = time.perf_counter()
            store.write_copy(self.local_dir, step, enc, self.holdings.spare(self.local_dir))
        except Exception as e:  # every process votes, so that none waits for a failed one
            err = e
            self.holdings.spare(self.local_dir).give_back(ts.lent)  # a loan no write took (a failed step)
        t3 = time.perf_counter()
        self._commit("local", step, self.local_dir, err, enc.base if enc else None)
        now = time.perf_counter()
        reused = sum(sh.data.nbytes for sh in ts.shards() if sh.base is not None)
        self.stats.append(TierStats(step, ts.nbytes, enc.written, reused, enc.full, blocked, t2 - t1, t3 - t2,
                                    now - t3, now - t0, ts.skipped, zipped, ts.waited_s))
        if enc.full:  # the new base: the index just written, its data file checked (store.Data)
            folder = os.path.join(self.local_dir, str(step))
            self._base = store.Copy(folder, None, store.Data(os.path.join(folder, store.DATA)), None,
                                    index=enc.index, _step=step)  # its body parsed where needed
            self._base.data.view(0, 0)  # mapped now, while it has one name: a second one given it
            #                             later (a `cp -al` backup) never stops the copies made against it
            self._since_base = 0
            self._poor = max(0, self._poor - 1)
        else:
            self._since_base += 1
            if enc.data_nbytes > ts.nbytes / 2:  # most of the state changes: comparing costs more than it
                # saves, so the next copies are full ones; twice as many after each such copy in a row
                self._poor = self.cfg.rebase_interval << min(self._misses, _MAX_BACKOFF)
                self._misses += 1
            else:
                self._misses = 0
        if self.peer_dst is not None:
            self._outbox = (step, tier_sync.frame([[enc.index], enc.pieces]))
        self._prune("local", self.local_dir)
        with self._mutex:  # a base older than this one, still kept: its file is the next spare
            older = any(b is not None and b != self._base.step for b in self._kept["local"].values())
        if older:
            self.holdings.spare(self.local_dir).release()
        else:
            self.holdings.spare(self.local_dir).prepare(len(self._base.data))  # the next snapshot's pages

    def _pays(self, ts: store.TierSnapshot) -> bool:
        """Whether ``ts``, which may be a differential copy, is worth one: sampled against the base
        (encode.changed_share); where more than half would be stored, it is stored full, as the
        snapshot lies, and sampled again only after 1, 3, 7, ... 63 more such copies."""
        if self._unsampled > 0:
            self._unsampled -= 1
            return False
        if tier_encode.changed_share(ts, self._base, self._budget) > 0.5:
            self._unpaid = min(self._unpaid + 1, _MAX_BACKOFF)
            self._unsampled = (1 << self._unpaid) - 1
            return False
        self._unpaid = 0
        return True

    def _next_full(self) -> bool:
        """Whether the next local copy is stored in full (a new base) rather than against the base."""
        return (not self.cfg.differential or self._base is None or self._poor > 0
                or self._since_base >= self.cfg.rebase_interval)

    def _commit(self, tier: str, step: int, folder: str, err: Exception | None, base: int | None) -> None:
        """Commits ``step`` in ``tier`` once every process voted that it holds its copy there."""
        busy = self._migration is not None and not self._migration[1].done()
        votes = self.group.allgather(f"commit-{tier}", {"step": step, "error": None if err is None else repr(err),
                                                        "migrating": busy})
        if tier == "local":  # every process sees the same votes: all put a due migration off, or none
            self._migrating = any(v.get("migrating") for v in votes)
        if err is not None:
            raise err
        failed = [f"process {j}: {v['error']}" for j, v in enumerate(votes) if v["error"] or v["step"] != step]
        if failed:
            raise DistributedError(f"step {step} was not committed in the {TIER_NAMES[tier]} tier: "
                                   + "; ".join(failed))
        store.mark_committed(os.path.join(folder, str(step)), {"tier": tier, **self._ident(step)})
        with self._mutex:
            self._kept[tier][step] = base
            keep = sorted(self._kept[tier])[-self.cfg.max_to_keep:]
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

    def _exchange(self) -> None:
        """Caller's thread: the ring transfer of the copies made by the last save (a collective)."""
        if self._outbox is None:
            return
        (step, parts), self._outbox = self._outbox, None
        sizes = self.group.allgather("exchange", {"step": step, "n": sum(len(p) for p in parts)})
        if any(v["step"] != step for v in sizes):
            raise DistributedError(f"peer tier: processes sent different steps ({[v['step'] for v in sizes]})")
        perm = [(j, (j + self.peer_dst - self.i) % self.n) for j in range(self.n)]
        self._inbox = (step, self.group.transfer(perm, parts, [v["n"] for v in sizes]))

    def _store_replica(self) -> None:
        (step, buf), self._inbox = self._inbox, None
        folder, err, base = self.holdings.peer(self.peer_src), None, None
        try:
            parts = tier_sync.unframe(buf, f"step {step} from process {self.peer_src}")
            store.write_copy(folder, step, store.Encoded.received_from(parts[0], parts[1]), self.holdings.spare(folder))
            body = store.open_copy(os.path.join(folder, str(step))).body
            if (body["step"], body["process"], body["session"]) != (step, self.peer_src, self.session):
                raise DistributedError(f"process {self.peer_src} sent a copy of another step or run")
            base = body["base"]
        except Exception as e:
            err = e
        self._commit("peer", step, folder, err, base)
        self._prune("peer", folder)

    # ------------------------------------------------------------------------------- migration

    def _migrate(self, step: int, job: Callable[[], None]) -> None:
        self._check_migration()  # at most one migration in flight (back-pressure in the writer)
        self._last_migrated = step
        self._migration = (step, self._pool.submit(job))

    def _check_migration(self) -> None:
        """Waits for the migration in flight; raises its failure."""
        if self._migration is None:
            return
        (step, fut), self._migration = self._migration, None
        if fut.exception() is not None:
            raise SaveFailedError(f"migration of step {step} to {self.directory} failed: "
                                  f"{type(fut.exception()).__name__}: {fut.exception()}") from fut.exception()

    def flush(self) -> None:
        """Caller's thread, writer idle: replicate the last copy, commit it in the peer tier, and wait
        for the migration in flight (raising its failure)."""
        self._exchange()
        if self._inbox is not None:
            self._store_replica()
        self._check_migration()

    def close(self) -> None:
        """Caller's thread, writer closed: flush; with ``cleanup``, migrate the newest step if it is only
        in memory, then remove this process's folders. Spare data files go in any case."""
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
            self._pool.shutdown(wait=True)
            self.holdings.drop_spares()
            self.holdings.release()

    def _migrate_at_close(self, step: int) -> None:
        """Migrates ``step``, held only in memory, before the tiers are removed; a failure (a full disk)
        is a SaveFailedError, and nothing is removed: the next manager restores the step from memory."""
        log.info("migrating step %d to %s before removing the memory tiers", step, self.directory)
        try:
            copy = store.open_copy(os.path.join(self.local_dir, str(step)))
            self.persistent.write(step, load.to_snapshot(copy), copy.body.get("metrics"), time.perf_counter(),
                                  0.0)
        except Exception as e:
            raise SaveFailedError(
                f"close: step {step}, held only in the memory tiers, could not be migrated to "
                f"{self.directory} ({type(e).__name__}: {e}). Nothing was removed: {self.root} still holds "
                "it, and the next CheckpointManager of this directory with the same Tiers restores it from "
                "there. Fix the cause (free space), then open that manager and close it, or save the "
                "restored state") from e

    def let_go(self) -> None:
        """The end of a manager nobody closed (no collective): waits for the migration in flight (raising
        its failure) and releases the process folder; the copies stay, restorable as after a crash."""
        try:
            self._check_migration()
        finally:
            self.holdings.release()

    # --------------------------------------------------------------------------------- restore

    def restore(self, step: int | None, target_of: TargetOf, *, shardings: Any, fit: "Fit | bool",
                strict: bool) -> tuple[Any, Plan, int]:
        """Collective (recover.py): what was restored, the plan (also kept as ``last_plan``), and the
        bytes read from memory. ``fit``: how the target may differ (engine/fit.py; a bool: partial)."""
        out, plan, nbytes = self._recovery.restore(step, target_of, shardings=shardings, fit=as_fit(fit),
                                                   strict=strict)
        self.last_plan = plan
        return out, plan, nbytes
