"""The checkpoint formats behind one interface, and the one place a folder's format is decided.

Scope: ``Layout``, what the public functions and the manager need of a format (its snapshot, its
write and commit, opening one of its folders as a restore Source, its commit record), with its
implementations: "native" (flax_ckpt's own layout, native/) and "orbax" (Orbax's, orbax/), which are
written and read, and the read-only files of other libraries (foreign/): "flax_msgpack" (legacy Flax
msgpack files) and "safetensors"; ``detect`` and ``recognize`` (which format a folder or file holds)
and ``step_folders`` (the steps of a run directory: native and Orbax step folders, and for the tools,
legacy Flax ``checkpoint_<step>`` files), which the manager and the flax-ckpt command both use;
``run_format`` (the format a manager writes a run's new steps in: the run's own), ``step_name``
(their folder names) and ``newest_own`` (the newest step of a run's own format). No module outside this
one and the formats' own compares format names: each question that depends on the format is a member
of ``Layout``. The memory tiers keep their own copy format (tiers/store.py) and migrate
native steps through the native layout.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Protocol, overload

from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.commit.recycler import Recycler
from flax_ckpt._src.engine.reader import Source
from flax_ckpt._src.engine.snapshot import Snapshot
from flax_ckpt._src.errors import CheckpointNotFoundError
from flax_ckpt._src.foreign import layout as foreign
from flax_ckpt._src.native.layout import NativeLayout
from flax_ckpt._src.orbax import locate as orbax_locate
from flax_ckpt._src.orbax.layout import OrbaxLayout
from flax_ckpt._src.records import PersistTimes
from flax_ckpt._src.serializers import Serializer
from flax_ckpt._src.storage import Storage

FORMATS = ("native", "orbax")  # the formats flax_ckpt writes; foreign/'s files are read only


class Layout(Protocol):
    """A checkpoint format. ``record``: the file whose presence commits one of its folders. ``manifest``:
    the one file holding all of a checkpoint's records (named when they are damaged), or None where they
    are spread over several files. ``evident``: its folders are recognized by their files before they
    are opened, so that one failing to open is damaged; False where opening is what tells (it may hold
    no committed checkpoint). The tools ask these and the Source, never a format's name."""

    @property
    def name(self) -> str: ...

    @property
    def record(self) -> str: ...

    @property
    def manifest(self) -> str | None: ...

    @property
    def evident(self) -> bool: ...

    @property
    def foreign(self) -> bool:
        """A directory of this format is another library's: a manager writes nothing until it saves."""
        ...

    @property
    def recycles(self) -> bool:
        """A removed step's data files are worth handing to the next save (a run's ``recycler``)."""
        ...

    @property
    def shares(self) -> bool:
        """A step may refer to an earlier step's bytes (native/sharing.py): removing a step that a kept
        step refers to retires it instead (``sharing.remove_step``)."""
        ...

    def snapshot(self, tree: Any, *, copy: bool, reuse: Snapshot | None = None) -> Snapshot:
        """The blocking half of a save (caller's thread); refuses what the format cannot store."""
        ...

    def persist(
        self, snap: Snapshot, parent: Storage, name: str, *, step: int | None, metrics: Any, metadata: Any
    ) -> PersistTimes:
        """Writes and commits ``snap`` as ``parent/name`` (background thread). ``step``: recorded where
        the format has room; a ValueError, before anything is written, where it cannot be."""
        ...

    def open(self, folder: Storage, item: str | None = None) -> Source:
        """A committed folder of this format as a restore Source (with ``info()``, ``step``, ``metrics``);
        ``item``: one named item of an Orbax step (a TargetMismatchError for a format without items)."""
        ...

    def metrics(self, folder: Storage) -> dict[str, Any] | None:
        """The metrics saved with a committed step folder, read cheaply (a manager's scan); raises a
        CheckpointError for a damaged one."""
        ...

    def recycler(self, storage: Storage) -> Recycler | None:
        """The spare files of a run directory this layout writes into (``storage``, read-write): the data
        files of removed steps, handed to the next save's writes (set as ``storage.recycler``); None where
        the format's writes would not take them."""
        ...

    def follow(self, root: Storage, newest: str | None) -> None:
        """A run's new steps follow its newest committed step of this format, folder ``newest`` of
        ``root`` (Orbax: its named items); nothing to follow for a format whose steps are alike."""
        ...

    def check_items(self, tree: Any) -> None:
        """Refuses, before anything is written, a tree that the run's steps cannot hold (Orbax: one that
        does not fit the run's named items)."""
        ...


def layout(name: str, serializer: "str | Serializer | None" = None) -> Layout:
    """The layout called ``name`` ("native" or "orbax"); ``serializer`` is the native layout's."""
    name = _renamed(name)
    if name == "native":
        return NativeLayout(serializer)
    if name == "orbax":
        if serializer is not None:
            raise ValueError(
                "serializer= applies to format='native'; Orbax's layout is always tensorstore zarr"
            )
        return OrbaxLayout()
    raise ValueError(f"unknown format {name!r}; use 'native' or 'orbax'")


@overload
def _renamed(name: str) -> str: ...
@overload
def _renamed(name: None) -> None: ...
def _renamed(name: str | None) -> str | None:
    if name == "flax_ckpt":
        warnings.warn("format='flax_ckpt' is now called format='native'", DeprecationWarning, stacklevel=4)
        return "native"
    return name


def detect(folder: Storage, serializer: "Serializer | None" = None) -> Layout:
    """The format of the checkpoint in ``folder``: native when it has a manifest, Orbax when it has
    Orbax's metadata files, a foreign file's (foreign.file_layout) when ``folder`` is a local file,
    else native (whose open then says what is missing). One listing or less.
    ``serializer``: a native checkpoint's reader when its manifest names it (a user serializer)."""
    return recognize(folder, serializer) or NativeLayout(serializer)


def recognize(folder: Storage, serializer: "Serializer | None" = None) -> Layout | None:
    """The format whose files ``folder`` holds (a native manifest, Orbax's metadata files), or the
    format of the file ``folder`` is (a legacy Flax msgpack or .safetensors file), or None: no
    checkpoint, maybe a run directory of step folders."""
    if folder.exists(MANIFEST):
        return NativeLayout(serializer)
    return OrbaxLayout() if orbax_locate.is_orbax(folder) else foreign.file_layout(folder)


def open_checkpoint(
    folder: Storage, item: str | None = None, serializer: "Serializer | None" = None
) -> Source:
    """The committed checkpoint in ``folder``, in whichever format it has, as a restore Source
    (``item``: only that named item of an Orbax step; ``serializer``: see detect). A directory of
    legacy Flax ``checkpoint_<step>`` files (and no native step folders) is a CheckpointNotFoundError
    naming its steps, as a native run directory is (native/layout.py)."""
    fmt = recognize(folder, serializer)
    if fmt is None and not any(commit_mod.step_number(e) is not None for e in folder.list()):
        files = foreign.step_files(folder)
        if files:
            shown = ", ".join(str(s) for s, _, _ in files[:10]) + (", ..." if len(files) > 10 else "")
            raise CheckpointNotFoundError(
                f"{folder.url} is a directory of Flax checkpoint files, steps [{shown}], not one checkpoint: pass "
                f"one of them (e.g. {folder.url.rstrip('/')}/{files[-1][1]}); `flax-ckpt ls {folder.url}` lists them"
            )
    return (fmt or NativeLayout(serializer)).open(folder, item)


@dataclass(frozen=True)
class StepFolder:
    """One step folder of a run directory: its step, folder name and format."""

    step: int
    name: str
    layout: Layout
    clash: tuple[
        str, ...
    ] = ()  # every folder whose name stands for this step (``10``, ``00010``), if several

    def ambiguity(self, where: str) -> str | None:
        """Why this step is no step of the run (None when it is one): several folders name its number."""
        if not self.clash:
            return None
        return (
            f"ambiguous step {self.step}: the folders {' and '.join(self.clash)} of {where} all stand for it "
            "and which one holds the step is unknown, so none is restored, kept, pruned or verified as "
            "it. Keep one: move the others out of the run directory (or delete them)"
        )


def step_folders(
    root: Storage, serializer: "Serializer | None" = None, *, files: bool = False
) -> tuple[list[StepFolder], list[str]]:
    """The step folders of a run directory in either format, by step (committed Orbax steps, named
    ``<step>`` or ``<prefix>_<step>``; every other folder named by an integer is a native step, to be
    opened to know whether it is committed, and whose manifest must name that step), and the names of
    the steps' temporary folders (saves in flight or crashed, interrupted deletions: never read).
    ``files``: also legacy Flax ``checkpoint_<step>`` files (foreign.step_files), for the tools that
    list and verify them; a manager, which never continues such a run, leaves them out.
    The directory is listed once: an Orbax step committed meanwhile is never taken for a native one."""
    entries = root.list()
    orbax = orbax_locate.step_dirs(root, entries)
    found = [StepFolder(s, n, OrbaxLayout()) for s, n in orbax.items()]
    temporary = []
    for entry in entries:
        if commit_mod.is_temporary(entry):
            if orbax_locate.step_number(commit_mod.base_name(entry)) is not None:
                temporary.append(entry)  # only a step's: another temporary name there may be a user's
        elif (step := commit_mod.step_number(entry)) is not None and step not in orbax:
            found.append(StepFolder(step, entry, NativeLayout(serializer, step=step)))
    if files:
        names = {f.name for f in found}
        found += [StepFolder(s, n, fmt) for s, n, fmt in foreign.step_files(root) if n not in names]
    clashes = _clashes(entries)
    found = [dataclasses.replace(f, clash=clashes[f.name]) if f.name in clashes else f for f in found]
    return sorted(found, key=lambda f: (f.step, f.name)), temporary


def _clashes(entries: list[str]) -> dict[str, tuple[str, ...]]:
    """{name: every name of its step} of the step folder names of ``entries`` that stand for one step
    number with one prefix (``10`` and ``00010``; Orbax's ``ckpt_10`` and ``ckpt_010``), by name alone."""
    groups: dict[tuple[str | None, int], list[str]] = {}
    for entry in entries:
        m = orbax_locate.step_parts(entry)
        if m is not None and not commit_mod.is_temporary(entry):
            groups.setdefault(m, []).append(entry)
    return {n: tuple(sorted(names)) for names in groups.values() if len(names) > 1 for n in names}


def run_format(
    storage: Storage, requested: str | None, serializer: Any = None, *, tiers: bool = False
) -> tuple[str, str | None]:
    """The format a manager writes new steps of the run in ``storage`` in, and a warning (or None).

    A run stays in one format: with ``requested`` None it follows the directory (the newest committed
    step's format; "native" for an empty directory); an explicit ``requested`` that contradicts it is
    a ValueError naming the ``format=`` to pass. A directory holding both formats (written by an older
    flax_ckpt, which continued Orbax runs natively) follows its newest step, with a warning. A
    ValueError too for ``serializer=`` or ``tiers`` (memory tiers) that the format has not."""
    requested = _renamed(requested)
    if requested is not None and requested not in FORMATS:
        raise ValueError(
            f"unknown format {requested!r}; use 'native', 'orbax' or None (follow the directory)"
        )
    folders, _ = step_folders(storage)
    committed = [
        f
        for f in folders
        if f.layout.name == "orbax" or commit_mod.is_committed(storage, f.name, f.layout.record)
    ]
    fmt, warning = _followed(requested, committed, storage.url)
    followed = f"{storage.url} holds Orbax steps, so this run's new steps are Orbax's too, and "
    if fmt == "orbax" and requested is None and serializer is not None:
        raise ValueError(
            followed + "serializer= applies to native steps only; drop serializer= (or give a "
            "native run a directory of its own)"
        )
    if tiers and fmt != "native":
        raise ValueError(
            (followed if requested is None else "") + "tiers= needs format='native' (the memory "
            "tiers migrate native checkpoints)"
        )
    return fmt, warning


def _followed(requested: str | None, committed: list[StepFolder], directory: str) -> tuple[str, str | None]:
    if not committed:
        return requested or "native", None
    newest = committed[-1].layout.name
    by_format = {name: [f.step for f in committed if f.layout.name == name] for name in FORMATS}
    if requested is not None and requested != newest:
        raise ValueError(
            f"{directory} holds {newest} steps ({_steps_text(by_format[newest])}); a run stays in one format, so "
            f"open it with format={newest!r} (or format=None, which follows the directory), or give the "
            f"{requested} run a directory of its own"
        )
    mixed = all(by_format[name] for name in FORMATS)
    warning = (
        None
        if not mixed
        else (
            f"{directory} holds both native steps ({_steps_text(by_format['native'])}) and Orbax steps "
            f"({_steps_text(by_format['orbax'])}); new steps follow the newest, in the {newest} format"
        )
    )
    return newest, warning


def named(name: str, serializer: "str | Serializer | None" = None) -> Layout:
    """The layout called ``name`` (a step folder's, as another process reported it), with ``serializer``
    where the format takes one (native)."""
    return layout(name, serializer if name == "native" else None)


def newest_own(layout: Layout, folders: "list[StepFolder]") -> str | None:
    """The folder name of the newest of ``folders`` in ``layout``'s format (what ``Layout.follow``
    follows), or None."""
    own = [f for f in folders if f.layout.name == layout.name]
    return max(own, key=lambda f: f.step).name if own else None


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (f", ... ({len(steps)} in all)" if len(steps) > 8 else "")


def step_name(layout: Layout, step: int, committed: list[StepFolder]) -> str:
    """The folder name of a new step in ``layout``: ``<step>`` for native steps; for Orbax steps the
    naming of the run's Orbax steps (``step_prefix``, fixed length), so that Orbax's CheckpointManager
    lists it."""
    if layout.name != "orbax":
        return str(step)
    return orbax_locate.step_name(step, [f.name for f in committed if f.layout.name == "orbax"])
