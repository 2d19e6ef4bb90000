"""Scripts that the tests run as child processes (see tests/helpers.py for the layout of tests/).

Each runs as ``python tests/workers/<name>.py ...`` from any directory: it puts tests/ on sys.path itself
and imports the shared pieces from tests/helpers.py. The fault trials' savers are
harness/reliability_worker.py.
"""
