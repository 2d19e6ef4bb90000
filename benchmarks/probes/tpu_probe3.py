"""Training-step stall caused by a background 1 GiB write: syscall size and thread count."""

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


def run(name, job, n=50):
    global state
    for _ in range(2):
        state = jax.block_until_ready(step(state))
    times, th, dur = [], None, [0.0]

    def timed():
        a = time.perf_counter()
        job()
        dur[0] = time.perf_counter() - a

    for i in range(n):
        if i == 3:
            th = threading.Thread(target=timed)
            th.start()
        a = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append(time.perf_counter() - a)
    th.join()
    med = sorted(times)[len(times) // 2]
    res[name] = {
        "excess_s": round(sum(times) - med * len(times), 3),
        "max_ms": round(max(times) * 1e3, 1),
        "write_s": round(dur[0], 3),
    }
    print(name, res[name], flush=True)


def writer(root, threads, chunk):
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


for r in range(2):
    for root in ("/dev/shm", "/tmp"):
        for threads, chunk in ((8, None), (8, 8 << 20), (8, 1 << 20), (2, 8 << 20)):
            run(f"{root}_t{threads}_c{chunk >> 20 if chunk else 'all'}_{r}", writer(root, threads, chunk))
json.dump(res, open(os.path.join(OUT, "probe3.json"), "w"), indent=1)
