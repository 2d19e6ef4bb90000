"""Which background work stalls a training step on the TPU: transfer only, write to /tmp, write to /dev/shm."""

import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, "benchmarks")
import jax
import numpy as np

import bench_accelerator as B

OUT = os.environ.get("OUT", "/tmp")
init, step, copy = B.make_model(**B.FULL)
state = jax.block_until_ready(step(init()))
host = [np.array(x) for x in B.leaves_of(state)]
res = {}


def run(name, job, n=60):
    global state
    for _ in range(3):
        state = jax.block_until_ready(step(state))
    times, th = [], None
    for i in range(n):
        if i == 5:
            th = threading.Thread(target=job)
            th.start()
        a = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append(time.perf_counter() - a)
    th.join()
    med = sorted(times)[len(times) // 2]
    res[name] = {
        "excess_s": round(sum(times) - med * len(times), 3),
        "max_ms": round(max(times) * 1e3, 1),
        "slow": [(k - 5, round(t * 1e3)) for k, t in enumerate(times) if t > 1.5 * med][:8],
    }
    print(name, res[name], flush=True)


def transfer():
    c = copy(state)
    xs = B.leaves_of(c)
    for x in xs:
        x.copy_to_host_async()
    for x in xs:
        np.asarray(x)


def device_get():
    jax.device_get(copy(state))


def writer(root):
    def job():
        d = tempfile.mkdtemp(dir=root)
        B.raw_write(host, B.Path(d))
        shutil.rmtree(d)

    return job


def alloc():
    bufs = [np.empty_like(h) for h in host]
    for b, h in zip(bufs, host):
        np.copyto(b, h)


for r in range(2):
    run(f"nothing_{r}", lambda: None)
    run(f"transfer_{r}", transfer)
    run(f"device_get_{r}", device_get)
    run(f"alloc_copy_{r}", alloc)
    run(f"write_tmp_{r}", writer("/tmp"))
    run(f"write_shm_{r}", writer("/dev/shm"))
json.dump(res, open(os.path.join(OUT, "probe2.json"), "w"), indent=1)
