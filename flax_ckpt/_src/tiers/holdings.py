"""What one process holds in the memory tiers of one manager: its folders and the copies in them.

Scope: the folders under ``<local_dir>/<digest>/p<i>/`` (created and checked at start: each this
user's, writable by nobody else, no symlink; files.py does the checks), the inventory of the copies
they hold (which step, of which run's session, committed in its tier or not), the removal of what an
earlier run left that no one can use, the spare data files kept for the next copy, and the removal of
it all at close. Not here: the copy format (store.py), the agreement (tierset.py, sync.py).

Whose copies they are: the folder's name is a digest of the directory's URL and, for a local
directory, the device it lies on (``folder_key``: one path on two volumes names two folders), which a
new run at the same URL on the same volume shares (after ``rm -rf`` of the old one, or another job on
one ``memory://`` URL). So each
process folder is held by one live manager (an flock on ``<p<i>>/.flax_ckpt.lock``, released by the
OS when its holder dies; a second manager is refused with CheckpointLockedError), and belongs to one
run directory: the run's id is stored in the directory (``.flax_ckpt.run``, made with the first
tiered manager of the run) and in the process folder (``run.json``, written once the start decided).
Copies in a folder of another run id are that run's: ignored, never restored or migrated, and removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
import weakref
from typing import Any

from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.errors import CheckpointError, CheckpointLockedError, StorageError
from flax_ckpt._src.storage import LocalStorage, Storage
from flax_ckpt._src.storage.lock import DirectoryLock
from flax_ckpt._src.tiers import files as tier_files
from flax_ckpt._src.tiers import store as store

log = logging.getLogger("flax_ckpt")
RUN_FILE = ".flax_ckpt.run"  # in the run directory: {"run": its id}, made by the first tiered manager
OWNER_FILE = "run.json"  # in each process folder: {"run": the id of the run whose copies it holds}
_MAX_ID = 4096


def folder_key(storage: Storage) -> str:
    """The name of the folder under ``Tiers.local_dir`` that holds the memory copies of the run in
    ``storage``: a digest (16 hex) of the directory's URL and, for a local directory, of the device
    (file system) it lies on. Two jobs whose directories have one path on different volumes (two
    containers sharing one host tmpfs, each with its own volume mounted at that path) get folders of
    their own: neither takes the other's copies for another run's and deletes them. A new run at a
    deleted run's path on the same volume gets the deleted run's folder, whose copies it removes
    (their run id is not its own); the directory's inode is left out for that reason."""
    text = storage.url
    if storage.local_path is not None:
        try:
            text += f"\0{os.stat(storage.local_path).st_dev}"  # the directory's, where a link leads
        except OSError:
            pass  # not made yet: its path alone, as for an object store
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def run_id(storage: Storage) -> str:
    """The id of the run directory ``storage`` (process 0, at start): the one stored there, or a new one
    stored first when there is none. Raises StorageError when it cannot be read or made."""
    try:
        try:
            raw = storage.read(RUN_FILE, _MAX_ID)
        except FileNotFoundError:
            storage.write_if_absent(RUN_FILE, json.dumps({"run": uuid.uuid4().hex}).encode())
            raw = storage.read(RUN_FILE, _MAX_ID)
        found = json.loads(raw)
        if not isinstance(found, dict) or not isinstance(found.get("run"), str) or not found["run"]:
            raise ValueError(f"no run id in {raw[:100]!r}")
        return found["run"]
    except (CheckpointError, OSError, ValueError) as e:
        raise StorageError(
            f"memory tiers: cannot read or make {storage.url}/{RUN_FILE}, the run's "
            f"identity that ties memory copies to this directory ({type(e).__name__}: {e}). "
            f"Fix: make the directory writable, or remove a damaged {RUN_FILE} (the copies "
            "in memory are then ignored once)"
        ) from None


class Holdings:
    """Process ``i`` of ``n``'s folders of the memory tiers of one manager directory (``digest``) in
    ``local_dir``: ``root``, ``local_dir`` (the local tier), ``peer(k)`` (replicas held for process k)."""

    def __init__(self, local_dir: str, digest: str, i: int, n: int):
        self.i, self.n = i, n
        self.root = os.path.join(os.path.abspath(local_dir), digest, f"p{i}")
        self.local_dir = os.path.join(self.root, "local")
        self._spares: dict[str, store.SpareFolder] = {}  # tier folder -> its retired data files
        self._release: weakref.finalize | None = None  # the process folder's lock, released once

    def make(self) -> None:
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
            raise StorageError(
                f"memory tiers: cannot create or read {e.filename or self.root}: {e.strerror}. "
                "Fix: set Tiers(local_dir=...) to a folder this user can write"
            ) from e
        self._lock()

    def _lock(self) -> None:
        """Takes the process folder's lock: one live manager per folder, in this process or another."""
        try:
            lock = DirectoryLock(self.root)
        except CheckpointLockedError as e:
            raise CheckpointLockedError(
                f"memory tiers: {self.root} is in use by another live CheckpointManager of the same "
                f"directory URL ({e}). Two managers there would write over each other's copies (two jobs "
                "on one memory:// URL do). Fix: close the other manager, or give this run a directory of "
                "its own (another URL) or another Tiers(local_dir=...)"
            ) from None
        self._release = weakref.finalize(self, lock.release)  # also when a manager is dropped unclosed

    def release(self) -> None:
        """Lets go of the process folder (its lock): another manager may take it then."""
        if self._release is not None:
            self._release()

    def owner(self) -> str | None:
        """The id of the run whose copies this process folder holds (None: none recorded, or unreadable)."""
        try:
            fd, _ = tier_files.open_own(os.path.join(self.root, OWNER_FILE), "run record")
            with os.fdopen(fd, "rb") as f:
                found = json.loads(f.read(_MAX_ID))
            return found["run"] if isinstance(found, dict) and isinstance(found.get("run"), str) else None
        except (CheckpointError, OSError, ValueError):
            return None

    def claim(self, run: str) -> None:
        """Records that this process folder holds the copies of run ``run`` (atomically: a new file
        renamed over the old record)."""
        tmp = os.path.join(self.root, f"{OWNER_FILE}.tmp-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps({"run": run}).encode())
            os.rename(tmp, os.path.join(self.root, OWNER_FILE))
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise

    def peer(self, k: int) -> str:
        """The folder of the replicas this process holds for process ``k``."""
        return os.path.join(self.root, f"peer-p{k}")

    def spare(self, folder: str) -> store.SpareFolder:
        """The retired data files of tier folder ``folder``, whose pages the next copy reuses."""
        if folder not in self._spares:
            self._spares[folder] = store.SpareFolder(
                os.path.join(self.root, "spare-" + os.path.basename(folder))
            )
        return self._spares[folder]

    def folders(self) -> dict[str, str]:
        """{"local": the local tier's folder, "<k>": the folder of process k's replicas, ...}."""
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        peers = {
            n[6:]: os.path.join(self.root, n)
            for n in names
            if n.startswith("peer-p") and commit_mod.step_number(n[6:]) is not None
        }
        return {"local": self.local_dir, **peers}

    def inventory(self) -> dict[str, Any]:
        """Copies this process holds that this job can use: {"local": {step: [session, committed]},
        "peer": {k: {step: [session, committed]}}} (JSON keys)."""
        inv: dict[str, Any] = {"local": {}, "peer": {}}
        for key, folder in self.folders().items():
            for s in store.steps_in(folder):
                try:
                    b = store.open_copy(os.path.join(folder, str(s))).body
                except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("ignoring memory copy %s/%d: %s", folder, s, e)
                    continue
                owner = self.i if key == "local" else int(key)
                if b["process"] == owner and b["process_count"] == self.n and b["step"] == s:
                    entry = [b["session"], os.path.exists(os.path.join(folder, str(s), store.COMMIT))]
                    (inv["local"] if key == "local" else inv["peer"].setdefault(str(owner), {}))[str(s)] = (
                        entry
                    )
        return inv

    def tidy(self) -> None:
        """At start: removes an earlier run's spare files (memory nobody will reuse soon) and its copies
        that were never finished (temporary folders)."""
        for name in os.listdir(self.root) if os.path.isdir(self.root) else []:
            if name.startswith(f"{OWNER_FILE}.tmp-"):  # a record never finished
                os.unlink(os.path.join(self.root, name))
            elif name.startswith("spare-"):
                try:
                    LocalStorage(self.root).delete(name)  # a link is removed, never followed
                except OSError:
                    pass
        for folder in self.folders().values():
            for e in os.listdir(folder) if os.path.isdir(folder) else []:
                if commit_mod.is_temporary(e):
                    shutil.rmtree(os.path.join(folder, e), ignore_errors=True)

    def keep_only(self, mine: dict[str, Any], good: dict[int, str]) -> None:
        """Deletes every copy in ``mine`` (this process's inventory) but those of ``good`` ({step: the
        session restorable}) and the bases they need."""
        for key, folder in self.folders().items():
            listed = mine["local"] if key == "local" else mine["peer"].get(key, {})
            keep = {int(s) for s, (x, _) in listed.items() if good.get(int(s)) == x}
            keep |= {_base_step(folder, s) for s in keep} - {None}
            for s in set(store.steps_in(folder)) - keep:
                commit_mod.remove(LocalStorage(folder), str(s), store.INDEX)

    def remove(self) -> None:
        """Removes this process's folders, and the job's folder once the last process on this host did.
        The lock is released after (a manager waiting for it then finds the folders gone)."""
        shutil.rmtree(self.root, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.root))
        except OSError:
            pass
        self.release()

    def drop_spares(self) -> None:
        """Spare data files are memory kept for the next save, not checkpoints: with no next save they
        go, whatever ``cleanup`` says (their pages are freed once unmapped)."""
        for spares in self._spares.values():
            spares.close()
            shutil.rmtree(spares.folder, ignore_errors=True)
        self._spares.clear()


def _base_step(folder: str, step: int) -> int | None:
    try:
        return store.open_copy(os.path.join(folder, str(step)), with_base=False).body["base"]
    except (CheckpointError, OSError):
        return None
