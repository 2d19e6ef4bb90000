"""Tiered checkpoints: local memory, peer memory and persistent storage, with differential copies.

Scope: the ``Tiers`` configuration and ``TierSet``, which a CheckpointManager created with ``tiers=``
drives: every save goes to the memory tiers, every ``persist_interval_steps``-th is migrated to the
manager's directory in the background; restore picks the newest step complete across all processes in
any combination of tiers. The copy format is tier_store.py's, agreement and transfer tier_sync.py's;
persistent writes and reads are the engine's (the manager's layout, engine/restore.py).

Per process, under ``<local_dir>/<digest of the manager's directory>/p<i>/``:
  local/<step>/          this process's shards of a step (the local-memory tier)
  peer-p<k>/<step>/      a replica of process k's shards (the peer-memory tier, held for k)
``local_dir`` defaults to ``/dev/shm/flax_ckpt-<uid>``, one per user. Every folder is created with mode
0700 and checked (lstat, no link followed) at start, as is every copy and file when it is read: one
owned by another user or writable by group or others is refused (tier_files.py), so another user of a
shared host cannot plant a copy that a restore would read (the job folder's name is computable).
Each copy has its own commit record (``commit.json``), written once every process holds the step in
that tier (a key-value vote); a tier's commit never waits for another tier. Copies carry the run's
session id, so a restore never mixes copies of one step number written by different runs.

Placement: process i replicates to (i + k) % n, k the smallest shift such that no process's replica
lands in its own failure domain (host name + local_dir); with one domain, or one process, the peer
tier is off (logged). The replica of step s travels over a JAX collective at the next ``save`` (or
``wait_until_finished``/``close``), on the caller's thread, so the peer tier trails the local one by
one save. Memory per process and tier is at most max_to_keep copies plus two bases, each at most the
size of the process's shards (a differential copy above half that size makes the next rebase_interval
copies full ones), plus one data file more: the copy being written, which reuses the pages of the
last removed copy, kept between saves as a spare (tier_files.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from flax_ckpt._src.engine.snapshot import Snapshot
from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src.tiers import load as load
from flax_ckpt._src.tiers import store as store
from flax_ckpt._src.tiers import files as tier_files
from flax_ckpt._src.tiers import sync as tier_sync
from flax_ckpt._src.errors import (CheckpointError, CheckpointNotFoundError, DistributedError, SaveFailedError,
                                   StorageError)
from flax_ckpt._src.storage import LocalStorage
from flax_ckpt._src.tiers.plan import TIER_NAMES, Plan, choose, peer_shift
from flax_ckpt._src.tiers.sync import Group

log = logging.getLogger("flax_ckpt")


def default_local_dir() -> str:
    """This user's folder of the memory tiers in the host's tmpfs (created with mode 0700)."""
    return f"/dev/shm/flax_ckpt-{os.geteuid()}"


@dataclass(frozen=True)
class Tiers:
    """Where a CheckpointManager's checkpoints live besides its directory.

    ``local_dir``: host tmpfs folder of the memory tiers (one per host; processes whose local_dir or
    host differ count as different failure domains); by default ``/dev/shm/flax_ckpt-<uid>``. It must
    be this user's own folder (created with mode 0700 when missing) or root's sticky one (like
    /dev/shm); every folder and file the tiers use in it must be this user's, writable by nobody
    else (tier_files.py). ``peer``: replicate each process's copy to another domain.
    ``persist_interval_steps``: the first saved step at or after each multiple of it is migrated to
    the manager's directory (None: never; ``save(force=True)`` always is).
    ``differential``: store only chunks changed since the tier's base. ``max_to_keep``: committed
    steps kept per memory tier. ``rebase_interval``: a new full base after this many differential
    copies. ``cleanup``: at ``close``, migrate the newest step if it is only in memory, then delete
    this job's memory tiers.
    """

    local_dir: str = field(default_factory=default_local_dir)
    peer: bool = True
    persist_interval_steps: int | None = 10
    differential: bool = True
    max_to_keep: int = 2
    rebase_interval: int = 8
    cleanup: bool = True

    def __post_init__(self):
        for name in ("persist_interval_steps", "max_to_keep", "rebase_interval"):
            v = getattr(self, name)
            if (v is not None or name != "persist_interval_steps") and (
                    isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Tiers.{name} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class TierStats:
    """One save into the memory tiers: ``written`` bytes (data + index) into the local tier, of
    ``nbytes`` held by this process, ``reused`` of them unchanged leaves never copied to host;
    ``memory_s`` from the ``save`` call to the local commit."""

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


class TierSet:
    """The memory tiers of one manager on this process (see the module docstring)."""

    def __init__(self, cfg: Tiers, directory: str, persistent: set[int]):
        self.cfg, self.directory = cfg, directory
        digest = hashlib.sha256(directory.encode()).hexdigest()[:16]
        self.group = Group(digest)
        self.i, self.n = self.group.index, self.group.count
        self.root = os.path.join(os.path.abspath(cfg.local_dir), digest, f"p{self.i}")
        self.local_dir = os.path.join(self.root, "local")
        try:
            self._make_folders()
            refused = None
        except CheckpointError as e:  # every process still votes at start, so that none waits for this one
            refused = e
        self._spares: dict[str, store.Spares] = {}  # tier folder -> its retired data files
        self._kept: dict[str, dict[int, int | None]] = {"local": {}, "peer": {}}  # step -> its base
        self._mutex = threading.Lock()  # _kept: written by the writer thread, read by the caller's
        self._base: store.Copy | None = None
        self._seen: store.Seen = {}  # since when each jax.Array leaf has been the same object
        self._since_base, self._poor = 0, 0  # _poor: copies still to store in full (see _save_local)
        self._outbox: tuple[int, list[memoryview]] | None = None
        self._inbox: tuple[int, Any] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flax_ckpt-migrate")
        self._migration: tuple[int, Future] | None = None
        self._last_migrated = max(persistent, default=None)
        self.stats: list[TierStats] = []
        self.last_plan: Plan | None = None
        self._start(persistent, refused)

    # ---------------------------------------------------------------------------------- start

    def _make_folders(self) -> None:
        """Creates (mode 0700) and checks local_dir, the job's folder, this process's and its tier
        folders: each must be this user's, writable by nobody else, and not a symlink."""
        top, job = os.path.dirname(os.path.dirname(self.root)), os.path.dirname(self.root)
        try:
            os.makedirs(os.path.dirname(top), exist_ok=True)
            tier_files.private_folder(top, "local_dir", system_ok=True)
            tier_files.private_folder(job, "job folder")
            tier_files.private_folder(self.root, "process folder")
            tier_files.private_folder(self.local_dir, "tier folder")
            for name in os.listdir(self.root):
                if name.startswith("peer-p"):
                    tier_files.check_folder(os.path.join(self.root, name), "tier folder")
        except OSError as e:
            raise StorageError(f"memory tiers: cannot create or read {e.filename or self.root}: {e.strerror}. "
                               "Fix: set Tiers(local_dir=...) to a folder this user can write") from e

    def _peer_dir(self, k: int) -> str:
        return os.path.join(self.root, f"peer-p{k}")

    def _spare(self, folder: str) -> store.Spares:
        if folder not in self._spares:
            self._spares[folder] = store.Spares(os.path.join(self.root, "spare-" + os.path.basename(folder)))
        return self._spares[folder]

    def _folders(self) -> dict[str, str]:
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        return {"local": self.local_dir, **{n[6:]: os.path.join(self.root, n) for n in names if n.startswith("peer-p") and commit_mod.step_number(n[6:]) is not None}}

    def _inventory(self) -> dict[str, Any]:
        """Copies this process holds that this job can use: {"local": {step: session}, "peer": {k: ...}}."""
        inv: dict[str, Any] = {"local": {}, "peer": {}}
        for key, folder in self._folders().items():
            for s in store.steps_in(folder):
                try:
                    b = store.open_copy(os.path.join(folder, str(s))).body
                except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("ignoring memory copy %s/%d: %s", folder, s, e)
                    continue
                owner = self.i if key == "local" else int(key)
                if b["process"] == owner and b["process_count"] == self.n and b["step"] == s:
                    entry = [b["session"], os.path.exists(os.path.join(folder, str(s), store.COMMIT))]
                    (inv["local"] if key == "local" else inv["peer"].setdefault(str(owner), {}))[str(s)] = entry
        return inv

    def _start(self, persistent: set[int], refused: CheckpointError | None) -> None:
        if refused is not None:
            self.group.allgather("start", {"refused": str(refused)})
            raise refused
        for name in os.listdir(self.root) if os.path.isdir(self.root) else []:
            if name.startswith("spare-"):  # an earlier run's retired files: memory nobody will reuse soon
                try:
                    LocalStorage(self.root).delete(name)  # a link is removed, never followed
                except OSError:
                    pass
        for folder in self._folders().values():
            for e in os.listdir(folder) if os.path.isdir(folder) else []:
                if commit_mod.is_temporary(e):
                    shutil.rmtree(os.path.join(folder, e), ignore_errors=True)
        mine = dict(self._inventory(), session=uuid.uuid4().hex[:12],
                    domain=f"{socket.gethostname()}:{os.path.realpath(self.cfg.local_dir)}")
        invs = self.group.allgather("start", mine)
        for j, v in enumerate(invs):
            if "refused" in v:
                raise StorageError(f"memory tiers: process {j} refused its folders: {v['refused']}")
        self.session = invs[0]["session"]
        k = peer_shift([v["domain"] for v in invs]) if self.cfg.peer else None
        self.peer_dst = (self.i + k) % self.n if k else None
        self.peer_src = (self.i - k) % self.n if k else None
        if self.peer_dst is None:
            why = ("peer=False" if not self.cfg.peer else "a single process: no other host to hold a replica"
                   if self.n == 1 else "every process shares one host and local_dir")
            log.info("peer-memory tier disabled (%s); tiers: local memory, persistent", why)
        self._old = self._restorable(invs, persistent)

    def _restorable(self, invs: list[dict[str, Any]], persistent: set[int]) -> dict[int, str]:
        """Steps of earlier runs restorable from memory; every other copy is deleted (never usable)."""
        good: dict[int, str] = {}
        for s in sorted({int(s) for inv in invs for s in inv["local"]} | {int(s) for inv in invs
                                                                         for p in inv["peer"].values() for s in p}):
            plan = choose(invs, persistent, s, set())
            if plan is not None and plan.session is not None:
                good[s] = plan.session
        for key, folder in self._folders().items():
            listed = invs[self.i]["local"] if key == "local" else invs[self.i]["peer"].get(key, {})
            keep = {int(s) for s, (x, _) in listed.items() if good.get(int(s)) == x}
            keep |= {self._base_step(folder, s) for s in keep} - {None}
            for s in set(store.steps_in(folder)) - keep:
                commit_mod.remove(LocalStorage(folder), str(s), store.INDEX)
        return good

    @staticmethod
    def _base_step(folder: str, step: int) -> int | None:
        try:
            return store.open_copy(os.path.join(folder, str(step)), with_base=False).body["base"]
        except (CheckpointError, OSError):
            return None

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

    def snapshot(self, step: int, state: Any, *, copy: bool, force: bool) -> store.TierSnapshot:
        """Caller's thread: sends the previous step's copy to its peer, then copies ``state`` to host
        (leaves unchanged since the base are not copied: they are views of it)."""
        self._exchange()
        base = self._base if self.cfg.differential else None
        return store.take_snapshot(state, copy=copy, force=force, step=step, seen=self._seen, base=base)

    def save(self, step: int, ts: store.TierSnapshot, metrics: dict | None,
             migrate: Callable[[Snapshot], None], t0: float, blocked: float) -> None:
        """Background: stores the received replica, then this step's local copy; commits both tiers;
        starts the migration when it is due (after the previous one: its failure is raised there, a
        point every process reaches, as are wait_until_finished and close)."""
        if self._inbox is not None:
            self._store_replica()
        if step in self._kept["local"]:
            log.info("step %d is already in the memory tiers; not replaced", step)
        else:
            self._save_local(step, ts, metrics, t0, blocked)
        if ts.force or (self.cfg.persist_interval_steps is not None and step // self.cfg.persist_interval_steps
                        > (self._last_migrated or 0) // self.cfg.persist_interval_steps):
            self._migrate(step, lambda: (ts.verify_views(), migrate(ts.snap)))

    def _ident(self, step: int) -> dict[str, Any]:
        return {"step": step, "session": self.session, "process": self.i, "process_count": self.n}

    def _save_local(self, step: int, ts: store.TierSnapshot, metrics: dict | None, t0: float,
                    blocked: float) -> None:
        t1 = time.perf_counter()
        enc, err = None, None
        try:
            base = None if self._next_full() else self._base
            enc = store.encode(ts, dict(self._ident(step), metrics=metrics, created=time.time()), base,
                               delta=self.cfg.differential)
            t2 = time.perf_counter()
            store.write_copy(self.local_dir, step, enc, self._spare(self.local_dir))
        except Exception as e:  # every process votes, so that none waits for a failed one
            err = e
        t3 = time.perf_counter()
        self._commit("local", step, self.local_dir, err, enc.body["base"] if enc else None)
        now = time.perf_counter()
        reused = sum(sh.data.nbytes for sh in ts.shards() if sh.base is not None)
        self.stats.append(TierStats(step, ts.nbytes, enc.written, reused, enc.full, blocked, t2 - t1, t3 - t2,
                                    now - t3, now - t0))
        if enc.full:
            self._base, self._since_base = store.open_copy(os.path.join(self.local_dir, str(step))), 0
            self._poor = max(0, self._poor - 1)
        else:
            self._since_base += 1
            if enc.data_nbytes > ts.nbytes / 2:  # most of the state changes: comparing costs more than
                self._poor = self.cfg.rebase_interval  # it saves, so the next copies are full ones
        if self.peer_dst is not None:
            self._outbox = (step, tier_sync.frame([[enc.index], enc.pieces]))
        self._prune("local", self.local_dir)
        self._spare(self.local_dir).prepare(len(self._base.data) if self._next_full() else enc.data_nbytes)

    def _next_full(self) -> bool:
        """Whether the next local copy is stored in full (a new base) rather than against the base."""
        return (not self.cfg.differential or self._base is None or self._poor > 0
                or self._since_base >= self.cfg.rebase_interval)

    def _commit(self, tier: str, step: int, folder: str, err: Exception | None, base: int | None) -> None:
        """Commits ``step`` in ``tier`` once every process voted that it holds its copy there."""
        votes = self.group.allgather(f"commit-{tier}", {"step": step, "error": None if err is None else repr(err)})
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
            store.remove_copy(folder, s, self._spare(folder))
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
        folder, err, base = self._peer_dir(self.peer_src), None, None
        try:
            parts = tier_sync.unframe(buf, f"step {step} from process {self.peer_src}")
            store.write_copy(folder, step, store.Encoded.received(parts[0], parts[1]), self._spare(folder))
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

    def close(self, persistent: Callable[[], set[int]],
              migrate: Callable[[int, Snapshot, dict | None], None]) -> None:
        try:
            self.flush()
            if self.cfg.cleanup:
                newest = max(self._kept["local"], default=None)
                if newest is not None and newest not in persistent():
                    log.info("migrating step %d to %s before removing the memory tiers", newest,
                             self.directory)
                    copy = store.open_copy(os.path.join(self.local_dir, str(newest)))
                    migrate(newest, load.to_snapshot(copy), copy.body.get("metrics"))
                self._base = None
                shutil.rmtree(self.root, ignore_errors=True)
                try:  # the job's folder, once the last process on this host has removed its own
                    os.rmdir(os.path.dirname(self.root))
                except OSError:
                    pass
                log.info("removed the memory tiers of %s from %s", self.directory, self.root)
        finally:
            self._pool.shutdown(wait=True)
            self._drop_spares()

    def _drop_spares(self) -> None:
        """Spare data files are memory kept for the next save, not checkpoints: with no next save they
        go, whatever ``cleanup`` says (their pages are freed once unmapped)."""
        for spares in self._spares.values():
            spares.close()
            shutil.rmtree(spares.folder, ignore_errors=True)
        self._spares.clear()

    # --------------------------------------------------------------------------------- restore

    def restore(self, step: int | None, target_of: Callable[[Any], Any], *, shardings: Any, partial: bool,
                persistent: set[int], restore_persistent: Callable[[int], Any], strict: bool) -> tuple[Any, Plan, int]:
        """Collective: agrees on a plan, moves replicas to processes that lost their local copy, and
        restores; a copy that fails (damaged, layout not held) is excluded and the plan re-made.
        ``target_of``: the target for an opened copy (the manager's restore target, or one made from the
        copy's records)."""
        invs = self.group.allgather("inventory", self._inventory())
        bad: set[tuple[int, str, int]] = set()
        done: tuple[tuple[int, str], Any] | None = None
        while True:
            plan = choose(invs, persistent, step, bad)
            if plan is None:
                raise CheckpointNotFoundError(f"no step {'' if step is None else step} complete across the "
                                              f"{self.n} processes in any tier of {self.directory}")
            mine = (plan.step, plan.sources[self.i][0])
            if done is None or done[0] != mine:
                done = None
                value, err = self._execute(plan, target_of, shardings, partial, restore_persistent)
                if err is None:
                    done = (mine, value)
            else:
                self._execute_transfers(plan)
                err = None
            votes = self.group.allgather("restored", {"error": err})
            failed = [(j, v["error"]) for j, v in enumerate(votes) if v["error"]]
            if not failed:
                self.last_plan = plan
                log.info("restored step %d of %s: %s", plan.step, self.directory, plan.describe())
                return done[1][0], plan, done[1][1]
            for j, e in failed:
                log.warning("step %d: process %d could not restore from %s (%s)", plan.step, j,
                            TIER_NAMES[plan.sources[j][0]], e)
                bad.add((j, plan.sources[j][0], plan.step))
            if strict:
                raise CheckpointError(f"restore of step {plan.step} failed (strict): {failed}")

    def _execute_transfers(self, plan: Plan) -> Any:
        perm = [(h, j) for j, (t, h) in enumerate(plan.sources) if t == "peer"]
        if not perm:
            return None
        serve = next((j for h, j in perm if h == self.i), None)
        parts: list[memoryview] = []
        if serve is not None:
            try:
                parts = tier_sync.frame(store.copy_parts(os.path.join(self._peer_dir(serve), str(plan.step))))
            except (CheckpointError, OSError) as e:  # the receiver then fails and the plan changes
                log.warning("cannot send process %d its replica of step %d: %s", serve, plan.step, e)
        sizes = self.group.allgather("serve", {"n": sum(len(p) for p in parts)})
        return self.group.transfer(perm, parts, [v["n"] for v in sizes])

    def _execute(self, plan: Plan, target_of: Callable[[Any], Any], shardings: Any, partial: bool,
                 restore_persistent: Callable[[int], Any]) -> tuple[tuple[Any, int] | None, str | None]:
        received = self._execute_transfers(plan)
        tier, holder = plan.sources[self.i]
        try:
            if tier == "persistent":
                return (restore_persistent(plan.step), 0), None
            if tier == "local":
                copy = store.open_copy(os.path.join(self.local_dir, str(plan.step)))
            else:
                where = f"process {holder}'s replica of process {self.i}, step {plan.step}"
                copy = store.copy_from_parts(tier_sync.unframe(received, where), where)
            if (copy.step, copy.body["session"], copy.body["process"]) != (plan.step, plan.session, self.i):
                raise CheckpointError(f"{copy.where} is not the planned copy")
            return load.restore_copy(copy, target_of, shardings=shardings, partial=partial), None
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            return None, f"{type(e).__name__}: {e}"
