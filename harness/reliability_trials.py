"""Fault trials of the reliability suite: inflict one real fault, then judge what a restore gives.

Scope: the faults (SIGKILL, SIGTERM, a full tmpfs, damaged and crafted files, a concurrent reader)
and the judgement, shared by tests/test_reliability_*.py (a few trials each) and benchmarks/faults.py
(many). Processes live in reliability_worker.py; crafted manifests in reliability_hostile.py. Every
trial returns an Outcome:

- "exact": the newest good state restores bit for bit, and the fault was detected or was harmless;
- "lost": a step that was committed (or the good step next to a damaged one) cannot be restored;
- "corrupt": a restore returned wrong bytes, accepted a damaged or crafted checkpoint, or took a
  temporary folder for a checkpoint;
- "error": anything else that is wrong: an exception outside the CheckpointError family, an error
  that does not name what is damaged, a hang, a retention rule broken.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
from basics import bit_exact, step_state
from reliability_worker import (
    CRASH_KEEP,
    STATES,
    Zygote,
    big_state,
    crash_tiers,
    small_state,
    spawn,
    stop,
)

import flax_ckpt as fc
from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.manager import LOCK_FILE
from flax_ckpt._src.native import sharing
from flax_ckpt._src.storage import open_storage
from flax_ckpt._src.tiers.holdings import RUN_FILE

KINDS = ("exact", "lost", "corrupt", "error")


@dataclass(frozen=True)
class Outcome:
    kind: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "exact"


EXACT = Outcome("exact")


@dataclass
class Tally:
    """Outcomes of one fault class: counts per kind, and the details of the first failures."""

    name: str
    counts: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    notes: Counter = field(default_factory=Counter)

    def add(self, outcome: Outcome, note: str = "") -> Outcome:
        self.counts[outcome.kind] += 1
        if note:
            self.notes[note] += 1
        if not outcome.ok and len(self.failures) < 5:
            self.failures.append(f"{outcome.kind}: {outcome.detail}")
        return outcome

    @property
    def trials(self) -> int:
        return sum(self.counts.values())


def restore_exact(restore: Callable[[], Any], expected: Any, what: str) -> Outcome:
    """Runs a restore that must succeed and give ``expected`` bit for bit."""
    try:
        got = restore()
    except fc.CheckpointError as e:
        return Outcome("lost", f"{what}: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 (any other exception is what the suite looks for)
        return Outcome("error", f"{what}: undocumented {type(e).__name__}: {e}")
    return EXACT if bit_exact(got, expected) else Outcome("corrupt", f"{what}: restored bytes differ")


@contextlib.contextmanager
def warnings_of(logger: str = "flax_ckpt") -> Iterator[list[str]]:
    """The warning messages ``logger`` emits inside the block."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    log, handler = logging.getLogger(logger), _Keep()
    level = log.level
    log.addHandler(handler)
    if not log.isEnabledFor(logging.WARNING):
        log.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


# ------------------------------------------------------------------------------------------ crashes


@dataclass
class CrashRun:
    """One directory that crash trials keep killing savers in, and what the savers reported."""

    directory: str
    tiers: bool = False  # savers also write a memory tier (reliability_worker.crash_tiers)
    reported: set[int] = field(default_factory=set)  # steps a saver reported durable
    verified: set[int] = field(default_factory=set)  # steps already restored bit-exact (not re-read)
    state: str = "crash"  # what the savers save (reliability_worker.STATES): "shared" shares bytes
    pace: float = 0.0  # seconds per commit, as the savers of this run measured it (0: not yet measured)

    def manager(self) -> fc.CheckpointManager:
        """The manager a resumed job would open."""
        extra = {"tiers": crash_tiers(self.directory)} if self.tiers else {}
        return fc.CheckpointManager(self.directory, **CRASH_KEEP, **extra)


def crash_trial(
    z: Zygote, run: CrashRun, rng: random.Random, serializer: str, max_commits: int = 3
) -> Outcome:
    """Forks a saver (async manager, retention) and SIGKILLs it at a random moment, then judges the folder.

    The moment is counted in the saver's progress, not in seconds, so that a busy machine moves it
    with the saver: after 0 to ``max_commits`` commits (0: while its manager opens, scans and cleans
    up, or saves its first step), plus a random fraction of one commit's time as measured in this run."""
    pid, seen = z.fork("crash", run.directory, serializer, run.state, "tiers" if run.tiers else "none")
    commits, t0 = rng.randint(0, max_commits), time.monotonic()
    for _ in range(commits):
        if not _next_commit(z, pid, seen):
            rc = z.kill(pid, seen)
            return Outcome("error", f"the saver stopped committing (exit {rc}); output: {seen[-3:]}")
    if commits:
        run.pace = (time.monotonic() - t0) / commits
    time.sleep(rng.uniform(0.0, run.pace))
    rc = z.kill(pid, seen)
    if rc != -signal.SIGKILL:
        return Outcome("error", f"the saver exited with {rc} before it was killed; output: {seen[-3:]}")
    run.reported.update(int(s.split()[1]) for s in seen if s.startswith("committed "))
    return judge_crash(run)


def _next_commit(z: Zygote, pid: int, seen: list[str], hang_s: float = 300) -> bool:
    """Waits for the saver's next "committed" line: False if it exited first, or wrote none for ``hang_s``
    (a hang, not slowness: a commit takes well under a second on an idle machine)."""
    deadline = time.monotonic() + hang_s
    while time.monotonic() < deadline:
        try:
            z.lines.until(lambda s: s.startswith("committed "), 1.0, seen)
            return True
        except TimeoutError:
            try:  # the zygote reaps its children only when asked: an exited one is a zombie until then
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return False
            except FileNotFoundError:
                return False
    return False


def judge_crash(run: CrashRun) -> Outcome:
    """After a kill: temporary folders are refused, every step folder restores bit-exact, reported
    steps and keep_period steps survive, retention holds, and a resumed manager restores the newest."""
    d = run.directory
    entries = os.listdir(d) if os.path.isdir(d) else []  # killed before its manager made the folder
    steps = sorted(int(e) for e in entries if e.isdigit())
    made = STATES[run.state]
    held = [e for e in entries if sharing.is_held(e)]
    if held:  # removed steps' folders kept for bytes later steps share: never read, at most one stale
        refs = sharing.referenced(open_storage(d))
        stale = [e for e in held if refs is not None and tuple(e.split(".held-")) not in refs]
        if len(stale) > 1:
            return Outcome("error", f"retired folders {stale} are referred to by no step")
    for e in entries:
        if e.isdigit() or e in (LOCK_FILE, RUN_FILE):  # RUN_FILE: the run's id, tied to its memory tiers
            continue
        if e in held:
            try:
                fc.restore(os.path.join(d, e))
                return Outcome("corrupt", f"the retired folder {e} was restored as a checkpoint")
            except fc.CheckpointNotCommittedError:
                continue
        if not commit_mod.is_temporary(e):
            return Outcome("error", f"unexpected entry {e!r} in {d}")
        try:
            fc.restore(os.path.join(d, e))
            return Outcome("corrupt", f"the temporary folder {e} was restored as a checkpoint")
        except fc.CheckpointNotCommittedError:
            pass
        except Exception as ex:  # noqa: BLE001
            return Outcome(
                "error", f"temporary folder {e}: {type(ex).__name__} instead of CheckpointNotCommittedError"
            )
    newest = max(run.reported, default=0)
    if newest and not run.tiers and (not steps or steps[-1] < newest):
        return Outcome("lost", f"step {newest} was reported committed; newest on disk: {steps[-1:]}")
    gone = sorted(s for s in run.reported if s % CRASH_KEEP["keep_period"] == 0 and s not in steps)
    if gone and not run.tiers:  # with tiers only migrated steps reach the directory
        return Outcome("lost", f"keep_period steps {gone} were deleted")
    recent = [s for s in steps if s % CRASH_KEEP["keep_period"]]
    if len(recent) > CRASH_KEEP["max_to_keep"] + 1:  # + one whose deletion a kill interrupted
        return Outcome("error", f"retention kept {recent} (max_to_keep={CRASH_KEEP['max_to_keep']})")
    for s in steps:
        if s in run.verified and s != steps[-1]:
            continue
        out = restore_exact(lambda: fc.restore(os.path.join(d, str(s))), made(s), f"step {s}")
        if not out.ok:
            return out if out.kind != "lost" else Outcome("corrupt", f"visible step folder {s}: {out.detail}")
        run.verified.add(s)
    with run.manager() as mgr:  # the resumed job; removes temporary folders
        latest = mgr.latest_step()
        if run.tiers and newest and (latest or 0) < newest:
            return Outcome(
                "lost", f"step {newest} was reported committed; a new manager's latest is {latest}"
            )
        if not run.tiers and latest != (steps[-1] if steps else None):
            return Outcome("error", f"a new manager sees latest {latest}, the folder {steps[-1:]}")
        if latest is not None:
            return restore_exact(mgr.restore, made(latest), f"manager restore of step {latest}")
    return EXACT


# -------------------------------------------------------------------------------------- damaged data

DAMAGE_CLASSES = {
    "raw": ("data", "manifest", "commit"),
    "zarr3": ("data", "array-meta", "manifest", "commit"),
}
DAMAGE_MODES = ("truncate", "delete", "flip")


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)


def _victim(folder: str, cls: str, rng: random.Random) -> tuple[str, int, int]:
    """A file of the byte-range class ``cls`` and the range [lo, hi) of it that the class covers.

    data: array bytes (raw files, zarr3 chunks); array-meta: zarr3's zarr.json; manifest: the
    manifest's body; commit: the manifest's header (format, version, checksum) and its existence."""
    files = _files(folder)
    if cls in ("manifest", "commit"):
        raw = open(os.path.join(folder, MANIFEST), "rb").read()
        start = raw.index(b'"body": ') + len(b'"body": ')
        lo, hi = (start, len(raw) - 2) if cls == "manifest" else (0, start)
        return MANIFEST, lo, hi
    if cls == "array-meta":
        name = rng.choice([f for f in files if f.endswith("zarr.json")])
    else:
        name = rng.choice(
            [
                f
                for f in files
                if f != MANIFEST and not f.endswith("zarr.json") and os.path.getsize(os.path.join(folder, f))
            ]
        )
    return name, 0, os.path.getsize(os.path.join(folder, name))


def damage(folder: str, cls: str, mode: str, rng: random.Random) -> str:
    """Damages one byte range of class ``cls`` in ``folder``: truncates the file inside the range,
    deletes it (for the manifest body: cuts a span out of it), or flips one bit in the range.
    Returns the damaged file's path relative to ``folder``."""
    name, lo, hi = _victim(folder, cls, rng)
    path = os.path.join(folder, name)
    data = bytearray(open(path, "rb").read())
    if mode == "delete" and cls != "manifest":
        os.unlink(path)
        return name
    if mode == "truncate":
        data = data[: rng.randrange(lo, hi)]
    elif mode == "delete":
        a = rng.randrange(lo, hi)
        data = data[:a] + data[rng.randrange(a + 1, hi + 1) :]
    else:
        data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    with open(path, "wb") as f:
        f.write(data)
    return name


def names_damage(message: str, name: str) -> bool:
    """Whether an error message points at the damaged file (or its zarr3 array folder)."""
    parts = name.split("/")
    candidates = {name} | ({"/".join(parts[:2])} if parts[0] == "z" else set())
    return any(c in message for c in candidates)


def damage_trial(directory: str, serializer: str, cls: str, mode: str, rng: random.Random) -> Outcome:
    """Two committed steps; the newest is damaged. A direct restore must refuse it naming the damaged
    file (or, for harmless damage, restore it bit-exact); a manager must restore the newest good step,
    warning when it skips the damaged one; a strict manager must raise for damaged data."""
    os.makedirs(directory)
    with fc.CheckpointManager(directory, serializer=serializer) as mgr:
        mgr.save(1, small_state(1))
        mgr.save(2, small_state(2))
    step2 = os.path.join(directory, "2")
    name = damage(step2, cls, mode, rng)
    harmless = False
    try:
        harmless = bit_exact(fc.restore(step2), small_state(2))
        if not harmless:
            return Outcome("corrupt", f"{cls}/{mode} of {name} went undetected: restore returned other bytes")
    except fc.CheckpointError as e:
        if not names_damage(str(e), name):
            return Outcome("error", f"{cls}/{mode}: the error does not name {name}: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001
        return Outcome("error", f"{cls}/{mode} of {name}: undocumented {type(e).__name__}: {e}")
    with warnings_of() as warned, fc.CheckpointManager(directory) as mgr:
        out = restore_exact(
            mgr.restore, small_state(2 if harmless else 1), f"manager restore after {cls}/{mode}"
        )
    if not out.ok:
        return out
    if not harmless and not any("step 2" in w for w in warned):
        return Outcome("error", f"{cls}/{mode}: the manager skipped step 2 without a warning ({warned})")
    if not harmless and cls in ("data", "array-meta"):
        with fc.CheckpointManager(directory, strict=True) as mgr:
            try:
                mgr.restore()
                return Outcome("error", f"{cls}/{mode}: a strict manager fell back silently")
            except fc.CheckpointError:
                pass
    return EXACT


# ----------------------------------------------------------------------------------------- disk full


class MountRefused(RuntimeError):
    """This machine does not let the suite mount a tmpfs (not root, or in a container without it)."""


@contextlib.contextmanager
def _mounted(path: str, commands: list[list[str]], image: str | None = None) -> Iterator[str]:
    """Runs ``commands`` (the last mounts a file system at ``path``), yields ``path``, then unmounts it
    and removes ``path`` (and ``image``). A command that fails or is missing is a MountRefused."""
    os.makedirs(path, exist_ok=True)
    for cmd in commands:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            r = subprocess.CompletedProcess(cmd, 127, "", str(e))
        if r.returncode:
            os.rmdir(path)
            if image:
                os.unlink(image)
            raise MountRefused(
                f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}"
            )
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True).returncode:
            subprocess.run(["umount", "-l", path], capture_output=True)
        os.rmdir(path)
        if image:
            os.unlink(image)


def tmpfs(path: str, size: str = "8m") -> contextlib.AbstractContextManager[str]:
    """A tmpfs of ``size`` mounted at ``path`` for the block; unmounted (and removed) after it."""
    return _mounted(path, [["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path]])


def ext4(path: str, size_mb: int = 16) -> contextlib.AbstractContextManager[str]:
    """An ext4 file system of ``size_mb`` MiB on a loop device mounted at ``path`` for the block (a
    block-device file system, where large files are written with O_DIRECT); unmounted and removed after."""
    image = path + ".img"
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    return _mounted(path, [["mkfs.ext4", "-q", "-F", image], ["mount", "-o", "loop", image, path]], image)


LAST_DISK_ERROR: dict[str, str] = {}  # the message of the latest ENOSPC failure per serializer (for reports)


def disk_state(step: int) -> dict:
    """1 MiB and change: an 8 MiB tmpfs holds a few."""
    return step_state(step, (256, 1024), 30_000)


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: str, nbytes: int) -> None:
    with open(path, "wb") as f:
        try:
            f.write(b"\xa5" * max(0, nbytes))
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def is_enospc(e: BaseException) -> bool:
    """Whether an error (or its cause chain) is the file system being full, said plainly."""
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e) or "ENOSPC" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full_trial(mount: str, serializer: str, rng: random.Random) -> Outcome:
    """On a small file system (tmpfs, or ext4 on a loop device) left with less room than a state (a random amount, or for raw exactly its data
    file, so that the manifest write fails): a save fails with ENOSPC named in its error, commits
    nothing and leaves no temporary folder; every older step restores bit-exact; once space returns
    the same manager saves again. A plain fc.save fails the same way."""
    d, filler = os.path.join(mount, "ckpts"), os.path.join(mount, "filler")
    try:
        return _disk_full(d, filler, mount, serializer, rng)
    finally:
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(filler)


def _disk_full(d: str, filler: str, mount: str, serializer: str, rng: random.Random) -> Outcome:
    with fc.CheckpointManager(d, serializer=serializer) as mgr:
        mgr.save(1, disk_state(1))
        mgr.wait_until_finished()
        exact = serializer == "raw" and rng.random() < 0.4  # room for the data file alone: the manifest fails
        _fill(filler, _free(mount) - ((1 << 20) if exact else rng.randrange(0, 3 << 20)))
        saved, failure = [1], None
        for step in range(2, 12):
            try:
                mgr.save(step, disk_state(step))
                mgr.wait_until_finished()
                saved.append(step)
            except fc.SaveFailedError as e:
                failure = e
                break
        if failure is None:
            return Outcome("error", "the full file system never failed a save")
        if not is_enospc(failure):
            return Outcome(
                "error", f"the failure does not say the disk is full: {failure!r} <- {failure.__cause__!r}"
            )
        LAST_DISK_ERROR[serializer] = f"{failure} <- {failure.__cause__!r}"
        left = [e for e in os.listdir(d) if commit_mod.is_temporary(e)]
        if left or mgr.all_steps() != saved:
            return Outcome(
                "error", f"after the failure: temporary folders {left}, steps {mgr.all_steps()} != {saved}"
            )
        for s in saved:
            out = restore_exact(lambda: mgr.restore(s), disk_state(s), f"step {s} after ENOSPC")
            if not out.ok:
                return out
        try:
            fc.save(os.path.join(mount, "plain"), disk_state(0), serializer=serializer)
            return Outcome("error", "fc.save succeeded on a full file system")
        except Exception as e:  # noqa: BLE001
            if (
                not is_enospc(e)
                or os.path.exists(os.path.join(mount, "plain"))
                or any(".tmp-" in x for x in os.listdir(mount))
            ):
                return Outcome("error", f"fc.save on a full disk: {e!r}, leftovers {os.listdir(mount)}")
        os.unlink(filler)
        step = saved[-1] + 1
        mgr.save(step, disk_state(step))
        mgr.wait_until_finished()
        return restore_exact(mgr.restore, disk_state(step), f"step {step} once space returned")


# ------------------------------------------------------------------------------- concurrent reading


def reader_trial(
    z: Zygote, directory: str, seconds: float, tally: Tally, *, restores: int = 0, hang_s: float = 300
) -> None:
    """A forked writer commits small steps as fast as it can with max_to_keep=2 (so retention deletes
    one step per commit) while this process lists the folder and restores every step it sees, for
    ``seconds`` and then until ``restores`` restores have succeeded (progress, not time: a busy machine
    takes longer; ``hang_s`` in all is a hang). Each restore is a trial: bit-exact, or refused with
    CheckpointNotFoundError/CheckpointNotCommittedError because the step was deleted meanwhile (a note,
    not a failure). A second manager is refused."""
    pid, seen = z.fork("crash", directory, "raw", "small", timeout=hang_s)
    try:
        z.lines.until(lambda s: s.startswith("committed "), hang_s, seen)  # its manager holds the lock now
        start = time.monotonic()
        deadline = start + seconds
        try:
            fc.CheckpointManager(directory).close()
            tally.add(Outcome("error", "a second manager opened a directory that a live writer holds"))
        except fc.CheckpointLockedError as e:
            tally.add(
                EXACT if f"pid {pid}" in str(e) else Outcome("error", f"lock error names no pid: {e}"),
                "second manager refused",
            )
        while time.monotonic() < deadline or (
            tally.notes["restored while committing"] < restores and time.monotonic() < start + hang_s
        ):
            for e in os.listdir(directory):
                if e.isdigit():
                    _read_while_churning(os.path.join(directory, e), int(e), tally)
    finally:
        z.kill(pid, seen)


def _read_while_churning(path: str, step: int, tally: Tally) -> None:
    try:
        got = fc.restore(path)
    except (fc.CheckpointNotFoundError, fc.CheckpointNotCommittedError):
        tally.add(EXACT, "deleted while being read (refused as not found)")
        return
    except fc.CheckpointError as e:
        tally.add(Outcome("corrupt", f"{path}: a concurrent deletion read as {type(e).__name__}: {e}"))
        return
    except Exception as e:  # noqa: BLE001
        tally.add(Outcome("error", f"{path}: undocumented {type(e).__name__}: {e}"))
        return
    tally.add(
        EXACT if bit_exact(got, small_state(step)) else Outcome("corrupt", f"{path}: wrong bytes"),
        "restored while committing",
    )


def thread_saves_trial(directory: str, steps: int = 12) -> Outcome:
    """A training loop (jitted steps, donated buffers) on the main thread hands each new state to a
    saver thread that calls mgr.save; every kept step restores to the host copy taken at its step."""
    import queue
    import threading

    import jax
    import jax.numpy as jnp

    update = jax.jit(lambda w: w * 1.0001 + 1.0, donate_argnums=0)
    handoff: queue.Queue = queue.Queue(maxsize=2)
    expected: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    with fc.CheckpointManager(directory, max_to_keep=3) as mgr:

        def saver() -> None:
            try:
                while (item := handoff.get()) is not None:
                    mgr.save(*item)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        t = threading.Thread(target=saver)
        t.start()
        w = jnp.zeros((512, 512), jnp.float32)
        for step in range(1, steps + 1):
            w = update(w)
            snap = {"w": w + 0.0, "step": step}  # a fresh array: the next donation cannot touch it
            expected[step] = np.asarray(snap["w"]).copy()
            handoff.put((step, snap))
        handoff.put(None)
        t.join(timeout=120)
        mgr.wait_until_finished()
        if errors or t.is_alive():
            return Outcome("error", f"saver thread: {errors or 'hung'}")
        if mgr.all_steps() != list(range(steps - 2, steps + 1)):
            return Outcome("error", f"kept steps {mgr.all_steps()}")
        for s in mgr.all_steps():
            got = mgr.restore(s)
            if got["step"] != s or not bit_exact(got["w"], expected[s]):
                return Outcome("corrupt", f"step {s} differs from the state handed over at that step")
    return EXACT


# ------------------------------------------------------------------------------------------- signals


def _tree_stat(folder: str) -> dict[str, tuple[int, int]]:
    out = {}
    for r, _, fs in os.walk(folder):
        for f in fs:
            st = os.stat(os.path.join(r, f))
            out[os.path.relpath(os.path.join(r, f), folder)] = (st.st_size, st.st_mtime_ns)
    return out


SIGTERM_HANG_S = 240  # detects a hang, judges no speed: a busy machine may take tens of seconds per save


def sigterm_trial(
    directory: str, scenario: str, rng: random.Random, *, twice: bool = False, serializer: str = "raw"
) -> Outcome:
    """A fresh process with a SIGTERM handler (wait for the save in flight, close, exit 0) is sent
    SIGTERM (``twice``: two, a few ms apart) while a save is in flight, or while it restores. It must
    exit 0 (waiting up to SIGTERM_HANG_S: a hang, not slowness); every step it had in flight is
    committed and bit-exact; no temporary folder is left; a restore changes nothing on disk. One
    exception to exit 0: a second SIGTERM that arrives after the handler finished, while the
    interpreter is exiting (Python has restored the default action by then), kills the process with
    -15; everything was durable already (the exact Outcome's detail says so)."""
    proc, lines = spawn("sigterm", directory, scenario, serializer)
    seen: list[str] = []
    try:
        if scenario == "restore":
            lines.until(lambda s: s == "restoring", 120, seen)
            before = _tree_stat(directory)
            time.sleep(rng.uniform(0.0, 0.4))
        else:
            lines.until(lambda s: s.startswith("inflight "), 120, seen)
            time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGTERM)
        if twice:
            time.sleep(rng.uniform(0.0, 0.02))
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=SIGTERM_HANG_S)
        except subprocess.TimeoutExpired:
            return Outcome(
                "error", f"{scenario}: no exit {SIGTERM_HANG_S} s after SIGTERM (a hang); output {seen[-3:]}"
            )
        while (line := lines.next(10)) is not None:
            seen.append(line)
    finally:
        stop(proc)
    late = twice and rc == -signal.SIGTERM and "handled" in seen  # see below
    if (rc != 0 and not late) or "handled" not in seen:
        return Outcome("error", f"{scenario}: exit code {rc}, output {seen[-3:]}")
    left = [e for e in os.listdir(directory) if commit_mod.is_temporary(e)]
    if left:
        return Outcome("error", f"{scenario}: temporary folders left after a clean exit: {left}")
    if scenario == "restore":
        if _tree_stat(directory) != before:
            return Outcome("corrupt", "a restore interrupted by SIGTERM changed files on disk")
        return restore_exact(lambda: fc.restore(os.path.join(directory, "1")), big_state(1), "step 1")
    inflight = [int(s.split()[1]) for s in seen if s.startswith("inflight ")]
    for s in inflight:
        out = restore_exact(
            lambda: fc.restore(os.path.join(directory, str(s))),
            big_state(s),
            f"step {s}, in flight at SIGTERM",
        )
        if not out.ok:
            return out
    return (
        Outcome("exact", "exit -15: the second SIGTERM came during interpreter exit, after the handler")
        if late
        else EXACT
    )


def fresh(base: str, name: str) -> str:
    """An empty folder ``base/name`` (removed first if it exists)."""
    path = os.path.join(base, name)
    shutil.rmtree(path, ignore_errors=True)
    return path
