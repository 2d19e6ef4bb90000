"""Implementation of flax_ckpt; import ``flax_ckpt`` for the public API (everything here is private).

One package per part, lower layers never importing higher ones (tests/test_layout.py checks it):
``tools/`` (the ``flax-ckpt`` command and its functions), ``manager/`` (a run of checkpoints: the
schedule, the writer, retention, statistics), ``native/``, ``orbax/``, ``foreign/`` and ``tiers/``
(the layouts, peers over one engine), ``engine/`` (one snapshot, one target check, one restore),
``commit/`` (the atomic commit and multi-process agreement), ``serializers/`` (arrays <-> stored
chunks) and ``storage/`` (where bytes go).

Loose at this level, by design, are only the modules that no single package owns:

- the dispatch over the layouts, used by the manager, the tools and the public functions:
  ``layouts.py`` (the ``Layout`` protocol; which layout a folder or file has) and ``api.py``
  (``fc.save``, ``fc.restore``, ``fc.metadata``);
- ``retention.py``: the one retention policy, shared by the manager and ``flax-ckpt prune`` (which
  must not import the manager: the command lists, verifies and prunes without jax);
- the foundations every layer shares (rank 0-1 in tests/test_layout.py): ``errors.py`` (the
  ``CheckpointError`` hierarchy), ``lazy.py`` (jax and tensorstore imported on first use),
  ``checks.py`` (sealed JSON documents, stored locations, tilings), ``records.py`` (``LeafRecord``,
  the typed record of one saved leaf) and ``tree.py`` (pytree <-> key paths, leaf kinds).

A new module goes into the package it serves; one lands here only when several layers need it.
"""
