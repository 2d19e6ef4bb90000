"""Implementation of flax_ckpt; import ``flax_ckpt`` for the public API."""
