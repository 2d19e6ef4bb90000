"""Scripts that the tests run as child processes (see tests/helpers.py for the layout of tests/).

Each runs as ``python tests/workers/<name>.py ...`` from any directory: it puts tests/ on sys.path itself
and imports the shared pieces from tests/helpers.py. reliability_worker is also imported in-process, as
``workers.reliability_worker``, for its process handles (Zygote, spawn).
"""
