"""The engine: one snapshot, one target check and one restore, shared by every layout.

Scope: what a save and a restore do to a tree whatever the format it is stored in. Saving:
snapshot.py (the blocking copy that later mutation or donation cannot change), device.py (its copies
made on the devices' own streams), arena.py (the page-aligned host memory those copies land in),
transfer.py (a synchronous save's pieces written as their transfers land). Restoring: reader.py (the
``Source`` protocol every layout opens, and the ``Reader`` over it), leaves.py (a target checked leaf
by leaf against the saved records; ``fc.CheckpointInfo``), fit.py (``Fit``: rename, missing,
unexpected, cast; ``fc.RestoreReport``), diagnose.py (the likely cause of a mismatch), restore.py (the
restore itself, placed on the target's devices). pause.py pauses the garbage collector around the
per-leaf loops. What does not belong here: where bytes go (storage/), how arrays become chunks
(serializers/), what a folder looks like on disk (native/, orbax/, foreign/, tiers/), when to save
(manager/).
"""
