"""Orbax's on-disk layout, read and written without importing orbax (numpy, JSON and tensorstore only).

Orbax is a format beside the native one: ``OrbaxLayout`` (layout.py) is its layouts.Layout. Finding
checkpoints and steps is locate.py's, reading arrays read.py's (as a restore Source of the engine), writing
write.py's. Versions: the layout was read in orbax-checkpoint 0.12.8's source, and every feature is
tested against 0.12.8 (tests/test_orbax_compat.py); older releases whose items have a ``_METADATA``
with ``tree_metadata``/``key_metadata`` use the same layout but are not tested. Not covered: Orbax's
emergency / multi-tier checkpoint layouts and ``_ROOT_METADATA`` (ignored), legacy msgpack
checkpoints, handlers other than PyTree/Standard/JSON and grain's (UnsupportedOrbaxCheckpointError).
grain's ``PyGrainCheckpointHandler`` items (a data iterator's state, one ``process_<i>-of-<n>.json`` per
process) are JSON items: read as this process's file (the file's text for a bytes or str target, a
DataLoaderIterator's state) and written as grain writes them.

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
