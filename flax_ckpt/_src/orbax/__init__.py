"""Orbax's on-disk layout, read and written without importing orbax (numpy, JSON and tensorstore only).

Orbax is a format beside the native one: ``OrbaxLayout`` is its layouts.Layout. Finding checkpoints
and steps is locate.py's, reading arrays read.py's (as a restore Source of the engine), writing
write.py's. Versions: the layout was read in orbax-checkpoint 0.12.8's source, and every feature is
tested against 0.12.8 (tests/test_orbax_compat.py); older releases whose items have a ``_METADATA``
with ``tree_metadata``/``key_metadata`` use the same layout but are not tested. Not covered: Orbax's
emergency / multi-tier checkpoint layouts and ``_ROOT_METADATA`` (ignored), legacy msgpack
checkpoints, handlers other than PyTree/Standard/JSON (UnsupportedOrbaxCheckpointError).

What a restore gives (one stable shape per kind of folder):

* one unnamed item (``ocp.StandardCheckpointer``/``PyTreeCheckpointer`` folders, a CheckpointManager
  step of its single ``default`` item, an item folder inside a step): that item's tree;
* a step saved with named items (``args.Composite(state=..., metadata=...)``, even with one item):
  ``{item name: value}`` for every item, pytree items as trees and JSON items as their parsed JSON. A
  target is a dict keyed by item names; only the items it names are read (pytree items checked leaf
  by leaf, JSON items given back as stored, whatever their target). ``item="state"`` (fc.restore,
  fc.metadata, CheckpointManager.restore) restores one item by itself;
* a JSON item's folder (``<step>/metadata``): its JSON.

The ``metrics`` JSON item of a manager step is the step's metrics (``fc.metadata(...).metrics``), not
an item.

What ``fc.save(path, tree, format="orbax")`` writes: a StandardCheckpointer folder; with ``step=``, a
CheckpointManager step of one ``default`` item (and a ``metrics`` item), whose folder must be named for
the step (``5``, ``ckpt_5``): Orbax records a step nowhere but in that name (else a ValueError).

What a manager writes into an Orbax run: steps of the items of the run's newest step, so that Orbax's
own CheckpointManager restores them as its steps (``restore(step, args=Composite(...))``, best_fn over
the ``metrics`` item): one ``default`` item, or for a run of named items a dict keyed by exactly those
names, each item written with the handler the run records for it (pytree items as Standard/PyTree
items, JSON items as Json items); any other tree is refused before anything is written. Array chunks
carry a zarr3 ``crc32c`` codec and JSON data files a ``<file>.crc32c`` (Orbax reads past both), so
``flax-ckpt verify`` checks every byte flax_ckpt wrote.
"""

from __future__ import annotations

import time
from typing import Any

from flax_ckpt._src.engine.pause import gc_paused
from flax_ckpt._src.records import PersistTimes
from flax_ckpt._src.engine.snapshot import Snapshot, snapshot
from flax_ckpt._src.orbax import locate, write
from flax_ckpt._src.orbax.read import OrbaxSource
from flax_ckpt._src.storage import Storage


class OrbaxLayout:
    """Orbax's layout as layouts.Layout: a StandardCheckpointer folder (``fc.save``, ``step=None``) or a
    CheckpointManager step (a manager's saves: item ``default``, or the named items of the run it
    continues (``follow``), plus a ``metrics`` JSON item)."""

    name, record, manifest = "orbax", locate.COMMIT_SUCCESS, None  # records: _METADATA per item, zarr per array
    evident = True  # its folders are recognized by their files (locate.is_orbax): failing to open one is damage
    foreign = True  # another library's runs: claimed at a manager's first write, no lock file left behind

    def __init__(self) -> None:
        self.items: dict[str, str] | None = None  # the run's named items {name: handler}; None: one unnamed item
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

    def persist(self, snap: Snapshot, parent: Storage, name: str, *, step: int | None, metrics: Any,
                metadata: Any) -> PersistTimes:
        """``step`` None: a StandardCheckpointer folder (no step; ``metrics`` in its metadata); else a
        CheckpointManager step, whose step Orbax records only as its folder's name: ``name`` must name
        it (``<step>`` or ``<prefix>_<step>``), else a ValueError before anything is written."""
        if step is not None and locate.step_number(name) != step:
            raise ValueError(
                f"{parent.url}/{name}: Orbax's layout records a checkpoint's step only as the name of a "
                f"CheckpointManager step folder, and {name!r} does not name step {step}; nothing was written. "
                f"Save step {step} as {parent.url}/{step} (or <prefix>_{step}), or use "
                "fc.CheckpointManager(directory, format='orbax'), which names its steps; or save without "
                "step= (a StandardCheckpointer folder), or with format='native', whose manifest records it")
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

    def recycler(self, storage: Storage) -> None:
        """None: tensorstore creates its files itself."""


__all__ = ["OrbaxLayout"]
