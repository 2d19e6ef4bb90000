"""A target-less restore of 2000 small leaves: its median time over 15 restores, or its Python calls.

    PYTHONPATH=<a checkout> python benchmarks/probes/restore_no_target.py time|calls [folder]

Run it alternately with two checkouts (``PYTHONPATH`` chooses the flax_ckpt package) to compare their
per-leaf restore paths: the call count is exact where timings on a shared machine differ by a few
percent from run to run. The checkpoint is written once, into ``folder`` (default /tmp/fc-probe-rnt).
"""

import cProfile
import os
import pstats
import sys
import time

import numpy as np

import flax_ckpt as fc

mode = sys.argv[1] if len(sys.argv) > 1 else "time"
path = sys.argv[2] if len(sys.argv) > 2 else "/tmp/fc-probe-rnt"
if not os.path.exists(path):
    fc.save(path, {f"l{i}": np.full((4, 4), i, np.float32) for i in range(2000)})
fc.restore(path)  # warm: imports, the page cache
print(fc.__file__)
if mode == "calls":
    pr = cProfile.Profile()
    pr.enable()
    fc.restore(path)
    pr.disable()
    print("calls", pstats.Stats(pr).total_calls)
else:
    ts = []
    for _ in range(15):
        a = time.perf_counter()
        fc.restore(path)
        ts.append(time.perf_counter() - a)
    print(f"median {sorted(ts)[len(ts) // 2] * 1e3:.2f} ms")
