"""The layouts of other libraries' single files, the peers of native/layout.py and orbax/layout.py.

Scope: ``FlaxMsgpackLayout`` and ``SafetensorsLayout`` (read only: their ``snapshot`` and ``persist``
refuse), ``file_layout`` (which of them a local file is) and ``step_files`` (the ``checkpoint_<step>``
files of a run directory). Parsing each file is flax_msgpack.py's and safetensors_file.py's.
"""

from __future__ import annotations

import abc
import os
from typing import Any, NoReturn

from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.engine.snapshot import Snapshot
from flax_ckpt._src.errors import TargetMismatchError
from flax_ckpt._src.foreign.files import CheckpointFile, FileSource, step_of
from flax_ckpt._src.foreign.flax_msgpack import MsgpackSource
from flax_ckpt._src.foreign.safetensors_file import SafetensorsSource, looks_like
from flax_ckpt._src.records import PersistTimes
from flax_ckpt._src.storage import Storage


class _FileLayout(abc.ABC):
    """What the two file layouts share: read-only, one file that is its own record, recognized by
    being a file (``evident``: one that fails to open is damaged), another library's (``foreign``)."""

    name = ""
    record = ""  # the file itself: written whole by its library, no separate commit record
    manifest = None  # the records are inside the file (named by the path in every message)
    evident = True
    foreign = True

    def __init__(self, *, step: int | None = None, follow_links: bool = True):
        """``step``: the step a run directory's listing gave (its name's); ``follow_links``: follow a
        symlink (a file the user names); False for a file found by listing a run directory."""
        self.step, self.follow_links = step, follow_links

    @abc.abstractmethod
    def open(self, folder: Storage, item: str | None = None) -> FileSource:
        """See Layout.open."""

    def snapshot(self, tree: Any, *, copy: bool, reuse: Snapshot | None = None) -> NoReturn:
        raise ValueError(
            f"flax_ckpt reads {self.name} files but never writes them; save with format='native' "
            "(or 'orbax'), or export arrays with `flax-ckpt convert SRC DST.safetensors`"
        )

    def persist(
        self, snap: Snapshot, parent: Storage, name: str, *, step: int | None, metrics: Any, metadata: Any
    ) -> PersistTimes:
        return self.snapshot(None, copy=False)

    def _file(self, folder: Storage, item: str | None) -> CheckpointFile:
        if item is not None:
            raise TargetMismatchError(
                f"{folder.url} is a {self.name} file, one tree without items; item={item!r} "
                "selects an item of an Orbax step. Restore it without item="
            )
        return CheckpointFile(folder.url, follow=self.follow_links)

    def metrics(self, folder: Storage) -> dict[str, Any] | None:
        return self.open(folder).metrics

    recycles = False  # never written
    shares = False

    def recycler(self, storage: Storage) -> None:
        """None: these files are never written."""

    def follow(self, root: Storage, newest: str | None) -> None:
        """Nothing to follow: these files are never written."""

    def check_items(self, tree: Any) -> None:
        self.snapshot(tree, copy=False)  # refused: never written


class FlaxMsgpackLayout(_FileLayout):
    """A legacy Flax msgpack file (flax_msgpack.py); its step is its name's (``checkpoint_<step>``)."""

    name = "flax_msgpack"

    def open(self, folder: Storage, item: str | None = None) -> MsgpackSource:
        file = self._file(folder, item)
        step = self.step if self.step is not None else step_of(os.path.basename(file.path))
        return MsgpackSource(file, step)


class SafetensorsLayout(_FileLayout):
    """A .safetensors file (safetensors_file.py); step and metrics from flax_ckpt's export metadata."""

    name = "safetensors"

    def open(self, folder: Storage, item: str | None = None) -> SafetensorsSource:
        return SafetensorsSource(self._file(folder, item))


def file_layout(folder: Storage) -> FlaxMsgpackLayout | SafetensorsLayout | None:
    """The layout of ``folder`` when it is a local file (symlinks followed) rather than a folder:
    safetensors for a ``.safetensors`` name or header, else Flax msgpack (whose open says so when the
    file is neither); None for anything else. Reads at most 9 bytes."""
    path = folder.local_path
    if path is None or folder.kind() != "file":
        return None
    if path.endswith(".safetensors"):
        return SafetensorsLayout()
    try:
        file = CheckpointFile(path)
        if looks_like(file.head(9), file.size):
            return SafetensorsLayout()
    except Exception:  # a FIFO, an unreadable file: the msgpack layout's open names what is wrong
        pass
    return FlaxMsgpackLayout()


def step_files(root: Storage) -> list[tuple[int, str, FlaxMsgpackLayout]]:
    """(step, file name, layout) of the legacy Flax checkpoint files of a local run directory, by step:
    entries that are neither folders nor symlinks (a link could lead out of the directory), named
    ``<prefix>_<step>`` or ``<step>`` (flax's ``checkpoint_<step>``), whatever they hold (a FIFO or a
    damaged file is listed, and fails to open). flax's in-flight ``checkpoint_tmp`` and flax_ckpt's
    temporary names are not steps."""
    path = root.local_path
    if path is None:
        return []
    found = []
    try:
        with os.scandir(path) as entries:
            for e in entries:
                step = step_of(e.name)
                if (
                    step is not None
                    and not commit_mod.is_temporary(e.name)
                    and not e.is_dir(follow_symlinks=False)
                    and not e.is_symlink()
                ):
                    found.append((step, e.name, FlaxMsgpackLayout(step=step, follow_links=False)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found, key=lambda f: (f[0], f[1]))
