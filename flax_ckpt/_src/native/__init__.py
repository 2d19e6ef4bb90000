"""flax_ckpt's own layout, the peer of orbax/: ``layout.py`` (``NativeLayout``: a step folder written,
committed and opened as a restore Source) and ``manifest.py`` (the manifest's schema and validation)."""
