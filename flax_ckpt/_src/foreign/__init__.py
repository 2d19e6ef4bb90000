"""Checkpoint files of other libraries, read (never written) as restore Sources: legacy Flax msgpack
files and .safetensors files.

Scope: the two read-only layouts.Layout of single files (layout.py), ``FlaxMsgpackLayout`` (flax_msgpack.py:
``flax.serialization.to_bytes`` bytes, ``flax.training.checkpoints.save_checkpoint``'s
``checkpoint_<step>`` files) and ``SafetensorsLayout`` (safetensors_file.py); ``file_layout`` (which
of them a file is: a ``.safetensors`` name or header, else Flax msgpack) and ``step_files`` (the
``checkpoint_<step>`` files of a run directory, which ``flax-ckpt ls`` and ``verify`` list and
``fc.restore`` names). A CheckpointManager never continues such a run: it neither lists nor writes
these files. Neither format has checksums, so ``flax-ckpt verify`` reports every leaf as unverified.
Local files only (object stores: not recognized). Opening files safely is files.py's.
"""
