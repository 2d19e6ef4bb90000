"""Counts the suite's Python processes (tests/timing.py, with FLAX_CKPT_TEST_PROCS=1): at exit, each
process that a test started appends one JSON line to $FLAX_CKPT_TEST_PROCS_LOG: the test that started
it, whether it imported JAX, and its CPU seconds. A process killed by a signal writes nothing."""

import os

_log = os.environ.get("FLAX_CKPT_TEST_PROCS_LOG")
_test = os.environ.get("PYTEST_CURRENT_TEST")
if _log and _test:
    import atexit

    def _report() -> None:
        import json
        import resource
        import sys

        r = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        rec = {
            "test": _test.rsplit(" ", 1)[0],
            "jax": "jax" in sys.modules,
            "cpu": r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime,
            "argv": sys.argv[:2],
        }
        with open(_log, "a") as f:
            f.write(json.dumps(rec) + "\n")

    atexit.register(_report)
