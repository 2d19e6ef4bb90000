"""Which background work makes a training step on the accelerator wait (the probes behind
benchmarks/README.md's "Where a training step waits").

    python benchmarks/probes/tpu_step_stalls.py work     # transfer, device_get, a host copy, writes
    python benchmarks/probes/tpu_step_stalls.py writes   # writes by bytes per os.write and threads

bench_accelerator.py's model (1 GiB with adam; PROBE_SMALL=1: the tiny one, to try it on a CPU) trains
with a sync per step; after a few steps a thread starts one piece of background work. Reported per
piece: the steps' time lost against their median (excess_s), the longest step, and how long the work
took. Two rounds; JSON in $OUT (default /tmp).
"""

import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax
import numpy as np
from _stalls import steps_lost

import bench_accelerator as B

init, step, copy = B.make_model(**(B.SMALL if os.environ.get("PROBE_SMALL") else B.FULL))  # SMALL: a CPU try
state = jax.block_until_ready(step(init()))
host = [np.array(x) for x in B.leaves_of(state)]
res: dict = {}


def run(name, job, make=None, n=50, start=3):
    """n steps, ``job`` started on a thread before step ``start`` (_stalls.steps_lost)."""
    global state
    state, excess, longest, took = steps_lost(step, state, job, make, n, start)
    res[name] = {"excess_s": excess, "max_ms": longest, "work_s": took}
    print(name, res[name], flush=True)


def device_copy(s):
    return B.leaves_of(copy(s))


def transfer(xs):
    for x in xs:
        x.copy_to_host_async()
    for x in xs:
        np.asarray(x)


def writer(root, threads=8, chunk=None):
    """The host copy as ``threads`` files, fsynced, ``chunk`` bytes per os.write (None: whole arrays)."""

    def job():
        d = tempfile.mkdtemp(dir=root)

        def one(k, idx):
            fd = os.open(f"{d}/{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for i in idx:
                mv = memoryview(host[i].reshape(-1).view(np.uint8))
                while len(mv):
                    mv = mv[os.write(fd, mv[:chunk] if chunk else mv) :]
            os.fsync(fd)
            os.close(fd)

        B._on_threads([lambda k=k, idx=idx: one(k, idx) for k, idx in enumerate(B._shares(host, threads))])
        shutil.rmtree(d)

    return job


def host_copy():
    for h in host:
        np.copyto(np.empty_like(h), h)


part = sys.argv[1] if len(sys.argv) > 1 else "work"
for r in range(2):
    if part == "work":
        run(f"nothing_{r}", lambda: None)
        run(f"transfer_{r}", transfer, device_copy)
        run(f"device_get_{r}", jax.device_get, device_copy)
        run(f"host_copy_{r}", host_copy)
        run(f"write_tmp_{r}", writer("/tmp"))
        run(f"write_shm_{r}", writer("/dev/shm"))
    else:
        for root in ("/dev/shm", "/tmp"):
            for threads, chunk in ((8, None), (8, 8 << 20), (8, 1 << 20), (2, 8 << 20)):
                tag = f"{chunk >> 20}MiB" if chunk else "whole"
                run(f"{root}_threads{threads}_{tag}_{r}", writer(root, threads, chunk))
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"step_stalls_{part}.json"), "w") as f:
    json.dump(res, f, indent=1)
