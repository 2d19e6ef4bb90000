"""Orbax's layout as a layouts.Layout (``OrbaxLayout``), the peer of native/layout.py.

Scope: what the manager and the public functions ask of a format, answered with the rest of this
package: finding checkpoints and steps (locate.py), writing them (write.py) and opening them as a
restore Source (read.py). What each kind of folder restores as, and what a save writes, is in this
package's docstring (orbax/__init__.py).
"""

from __future__ import annotations

import time
from typing import Any

from flax_ckpt._src.engine.pause import gc_paused
from flax_ckpt._src.engine.snapshot import Snapshot, snapshot
from flax_ckpt._src.orbax import locate, write
from flax_ckpt._src.orbax.read import OrbaxSource
from flax_ckpt._src.records import PersistTimes
from flax_ckpt._src.storage import Storage


class OrbaxLayout:
    """Orbax's layout as layouts.Layout: a StandardCheckpointer folder (``fc.save``, ``step=None``) or a
    CheckpointManager step (a manager's saves: item ``default``, or the named items of the run it
    continues (``follow``), plus a ``metrics`` JSON item)."""

    name, record, manifest = (
        "orbax",
        locate.COMMIT_SUCCESS,
        None,
    )  # records: _METADATA per item, zarr per array
    evident = (
        True  # its folders are recognized by their files (locate.is_orbax): failing to open one is damage
    )
    foreign = True  # another library's runs: claimed at a manager's first write, no lock file left behind

    def __init__(self) -> None:
        self.items: dict[str, str] | None = (
            None  # the run's named items {name: handler}; None: one unnamed item
        )
        self.where = "this directory"

    def follow(self, root: Storage, newest: str | None) -> None:
        """New steps get the items of the run's newest committed step, folder ``newest`` of ``root``: a
        step of named items (``args.Composite``) makes every new step a dict keyed by those names, each
        written with the run's handler for it; otherwise new steps are one ``default`` item."""
        self.where = root.url
        self.items = locate.run_items(root.sub(newest)) if newest is not None else None

    def check_items(self, tree: Any) -> None:
        """Refuses, before anything is written, a tree that does not fit the run's named items."""
        if self.items is not None:
            write.check_items(tree, self.items, self.where)

    def snapshot(self, tree: Any, *, copy: bool, reuse: Snapshot | None = None) -> Snapshot:
        write.single_process()
        if self.items is None:
            snap = snapshot(tree, copy=copy, reuse=reuse)
            write.check(snap)
            return snap
        json_items = write.check_items(tree, self.items, self.where)
        trees = {n: tree[n] for n in self.items if n not in json_items}
        snap = snapshot(trees, copy=copy, reuse=reuse)
        write.check(snap)
        write.check_item_roots(snap)
        return write.StepSnapshot(**vars(snap), handlers=dict(self.items), json_items=json_items)

    def persist(
        self, snap: Snapshot, parent: Storage, name: str, *, step: int | None, metrics: Any, metadata: Any
    ) -> PersistTimes:
        """``step`` None: a StandardCheckpointer folder (no step; ``metrics`` in its metadata); else a
        CheckpointManager step, whose step Orbax records only as its folder's name: ``name`` must name
        it (``<step>`` or ``<prefix>_<step>``), else a ValueError before anything is written."""
        if step is not None and locate.step_number(name) != step:
            raise ValueError(
                f"{parent.url}/{name}: Orbax's layout records a checkpoint's step only as the name of a "
                f"CheckpointManager step folder, and {name!r} does not name step {step}; nothing was written. "
                f"Save step {step} as {parent.url}/{step} (or <prefix>_{step}), or use "
                "fc.CheckpointManager(directory, format='orbax'), which names its steps; or save without "
                "step= (a StandardCheckpointer folder), or with format='native', whose manifest records it"
            )
        snap.complete()  # shards still on their devices come to host first (a no-op once they are)
        t0 = time.perf_counter()
        if step is None:
            write.save_item(parent, name, snap, metadata=metadata, metrics=metrics)
        else:
            write.save_step(parent, step, snap, metrics=metrics, metadata=metadata, name=name)
        return PersistTimes(write=time.perf_counter() - t0)

    @gc_paused()  # as the native open: the walk and the metadata of many leaves allocate in bursts
    def open(self, folder: Storage, item: str | None = None) -> OrbaxSource:
        return OrbaxSource(locate.locate(folder, item))

    def metrics(self, folder: Storage) -> dict[str, Any] | None:
        return locate.step_metrics(locate.locate(folder))

    recycles = False  # tensorstore writes its own files
    shares = False  # Orbax must read every step by itself

    def recycler(self, storage: Storage) -> None:
        """None: tensorstore creates its files itself."""
