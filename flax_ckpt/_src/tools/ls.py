"""``flax-ckpt ls``: the step folders of a run directory, in either format (and legacy Flax
``checkpoint_<step>`` files), and a host's memory-tier copies.

Scope: listing with state (committed, in-flight, deleting, invalid, uncommitted), format, size and
metrics. Which folders are steps is layouts.step_folders', the same discovery the manager uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from flax_ckpt._src import layouts
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidManifestError,
)
from flax_ckpt._src.native import sharing
from flax_ckpt._src.orbax.locate import step_number
from flax_ckpt._src.storage import LocalStorage, Storage, open_storage
from flax_ckpt._src.tiers import store as tier_store
from flax_ckpt._src.tiers.holdings import folder_key
from flax_ckpt._src.tools.common import identity


@dataclass(frozen=True)
class StepEntry:
    """One entry of a checkpoint directory. ``state``: "committed" (a valid manifest, or an Orbax
    step), "in-flight" (a save in flight or one that crashed), "deleting" (an interrupted deletion),
    "invalid" (a manifest or Orbax metadata that fails validation), "uncommitted" (no manifest) or
    "ambiguous" (one of several folders whose names stand for the same step, ``10`` and ``00010``: never
    read as the step; ``problem`` names them).
    ``format``: "native", "orbax", "flax_msgpack" (a legacy Flax file), "memory (...)" or None when unknown.
    A step of a run whose steps share bytes (docs/design.md): ``nbytes`` counts its own files,
    ``shared`` the bytes of other steps' files it refers to; state "held": a removed step's folder,
    kept for the bytes later steps refer to (``needed_by``; deleted with the last of them)."""

    name: str
    step: int | None
    state: str
    tier: str
    format: str | None
    nbytes: int | None
    metrics: dict[str, Any] | None = None
    created: float | None = None
    problem: str | None = None
    shared: int = 0
    needed_by: tuple[int, ...] = ()  # of a "held" folder: the committed steps that refer to its bytes

    @property
    def committed(self) -> bool:
        return self.state == "committed"


def _disk_size(storage: Storage) -> int | None:
    """Bytes of the files under a local folder, or of a local file (a legacy Flax checkpoint file); None
    on object stores, which report sizes per request."""
    if storage.local_path is None:
        return None
    if os.path.isfile(storage.local_path) and not os.path.islink(storage.local_path):
        return _size(storage.local_path)
    total = 0
    for dirpath, _, names in os.walk(storage.local_path):
        total += sum(_size(os.path.join(dirpath, f)) for f in names)
    return total


def _size(path: str) -> int:
    """A file's size; 0 for one removed meanwhile (a live run deletes and renames folders)."""
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def _step_of(name: str) -> int | None:
    return commit_mod.step_number(commit_mod.base_name(name))


def list_steps(directory: Any, *, tier: str = "persistent") -> list[StepEntry]:
    """Every step folder of a manager's ``directory`` (committed or not), ordered by step."""
    root = open_storage(directory)
    if root.kind() == "file" or (root.supports_rename and root.kind() == "missing"):
        raise CheckpointNotFoundError(f"{root.url} is not a folder of checkpoints")
    folders, temporary = layouts.step_folders(root, files=True)
    entries = [e for e in (_entry(root, f, tier) for f in folders) if e is not None]
    listing = root.list()
    held = [name for name in listing if sharing.is_held(name)]
    if held and not root.supports_rename:  # an object store: a retired step's objects, listed as its hold
        entries = [
            e for e in entries if e.state != "uncommitted" or not sharing.only_held(root, e.name, listing)
        ]
    needs = _needs(root, entries) if held else {}
    entries += [
        StepEntry(
            name,
            int(name.split(".", 1)[0]),
            "held",
            tier,
            "native",
            _disk_size(root.sub(name)),
            needed_by=tuple(sorted(needs.get(name, ()))),
        )
        for name in held
    ]
    for name in temporary:
        step = step_number(commit_mod.base_name(name))  # "<step>" or Orbax's "<prefix>_<step>"
        state = "deleting" if commit_mod.DELETING_MARK in name else "in-flight"
        entries.append(StepEntry(name, step, state, tier, None, _disk_size(root.sub(name))))
    return sorted(entries, key=lambda e: (e.step if e.step is not None else -1, e.name))


def _needs(root: Storage, entries: list[StepEntry]) -> dict[str, list[int]]:
    """{retired folder (``<step>.held-<id>``): the committed native steps that refer to its bytes}."""
    out: dict[str, list[int]] = {}
    for e in entries:
        if e.committed and e.format == "native" and e.step is not None:
            for step, ident in (sharing.refers_to(root, e.name) or {}).items():
                out.setdefault(sharing.held_name(step, ident), []).append(e.step)
    return out


def _entry(root: Storage, f: layouts.StepFolder, tier: str, tries: int = 3) -> StepEntry | None:
    """Step folder ``f``'s entry; None when it is gone, deleted while it was read (a live manager's
    retention): a failure to open it counts only if the step was there, unchanged, before and after."""
    folder = root.sub(f.name)
    before = identity(folder, f.layout.record)
    if before is None:
        return None
    ambiguous = f.ambiguity(root.url)
    if ambiguous is not None:  # several folders name this step: none of them is it
        return StepEntry(f.name, f.step, "ambiguous", tier, None, _disk_size(folder), problem=ambiguous)
    try:
        source = f.layout.open(folder)
        info = source.info()
    except (CheckpointError, OSError, ValueError) as e:
        if identity(folder, f.layout.record) != before:
            return _entry(root, f, tier, tries - 1) if tries > 1 else None
        return _failed(folder, f, tier, e)
    size = _disk_size(folder) if folder.local_path is not None else info.nbytes
    held = (getattr(source, "body", None) or {}).get("shared") or {}
    shared = sum(n for h in held.values() for n in h["files"].values())
    return StepEntry(
        f.name, f.step, "committed", tier, f.layout.name, size, info.metrics, info.created, shared=shared
    )


def _failed(folder: Storage, f: layouts.StepFolder, tier: str, e: Exception) -> StepEntry:
    """The entry of a step folder that fails to open with ``e`` (and stays as it was)."""
    fmt = f.layout.name if f.layout.evident else None
    if isinstance(e, (InvalidManifestError, CorruptCheckpointError)) or f.layout.evident:
        # a damaged manifest, or files that say it is a checkpoint of this format: failing to open, damaged
        return StepEntry(f.name, f.step, "invalid", tier, fmt, _disk_size(folder), problem=str(e))
    return StepEntry(f.name, f.step, "uncommitted", tier, None, _disk_size(folder), problem=str(e))


def memory_tier_root(directory: Any, local_dir: str) -> str:
    """Where a tiered CheckpointManager of ``directory`` keeps its memory tiers under ``Tiers.local_dir``
    (the scheme of tierset.TierSet: ``<local_dir>/<tiers.holdings.folder_key of the directory>/``)."""
    return os.path.join(os.path.abspath(local_dir), folder_key(open_storage(directory)))


def list_memory_tiers(directory: Any, local_dir: str) -> list[StepEntry]:
    """The memory-tier copies (tier_store format) this host holds for the manager of ``directory``: one
    entry per process, tier and step; tier "local-memory p<i>" or "peer-memory p<i> (of p<k>)". A copy
    is committed in its tier iff it has a valid index and its commit record."""
    root = memory_tier_root(directory, local_dir)
    entries = []
    for proc in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        subs = sorted(os.listdir(os.path.join(root, proc))) if os.path.isdir(os.path.join(root, proc)) else []
        for sub in subs:
            if sub != "local" and not sub.startswith("peer-p"):
                continue
            label = (
                f"local-memory {proc}"
                if sub == "local"
                else f"peer-memory {proc} (of p{sub[len('peer-p') :]})"
            )
            folder = os.path.join(root, proc, sub)
            entries += [
                _memory_entry(folder, n, label) for n in os.listdir(folder) if _step_of(n) is not None
            ]
    return sorted(entries, key=lambda e: (e.step, e.tier, e.name))


def _memory_entry(folder: str, name: str, tier: str) -> StepEntry:
    path, step = os.path.join(folder, name), _step_of(name)
    size = _disk_size(LocalStorage(path))
    if commit_mod.is_temporary(name):
        return StepEntry(name, step, "in-flight", tier, None, size)
    try:
        body = tier_store.open_copy(path).body
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        return StepEntry(name, step, "invalid", tier, "memory", size, problem=str(e))
    fmt = "memory (full)" if body.get("base") is None else f"memory (diff of {body['base']})"
    record = os.path.join(path, tier_store.COMMIT)
    if not os.path.exists(record):
        return StepEntry(name, step, "uncommitted", tier, fmt, size)
    return StepEntry(name, step, "committed", tier, fmt, size, created=os.stat(record).st_mtime)
