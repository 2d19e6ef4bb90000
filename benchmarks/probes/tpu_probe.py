"""Diagnosis on the device: (1) GIL probes, (2) fc.save timeline and host-only write path."""

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, "benchmarks")
import crc32c
import jax
import numpy as np

import bench_accelerator as B
import flax_ckpt as fc
from flax_ckpt._src.engine import transfer as T
from flax_ckpt._src.serializers import raw as R

OUT = os.environ.get("OUT", "/tmp")
res = {}
init, step, copy = B.make_model(**B.FULL)
state = jax.block_until_ready(step(init()))
leaves = B.leaves_of(state)
print("state MiB", sum(x.nbytes for x in leaves) / 2**20, flush=True)


def probe(fn):
    t = threading.Thread(target=fn)
    gaps = []
    t.start()
    last = time.perf_counter()
    t0 = last
    while t.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    gaps.sort()
    gaps = gaps or [0.0]
    return {
        "dur": round(last - t0, 3),
        "max_gap_ms": round(gaps[-1] * 1e3, 2),
        "stalled_s": round(sum(g for g in gaps if g > 1e-3), 3),
    }


# (1) GIL: np.asarray of fresh device copies in a thread; crc32c; device_get
for r in range(2):
    c = jax.block_until_ready(copy(state))
    res[f"gil_np_asarray_{r}"] = probe(lambda: [np.asarray(x) for x in B.leaves_of(c)])
    c = jax.block_until_ready(copy(state))

    def started():
        xs = B.leaves_of(c)
        for x in xs:
            x.copy_to_host_async()
        for x in xs:
            np.asarray(x)

    res[f"gil_async_then_asarray_{r}"] = probe(started)
    host = [np.asarray(x) for x in leaves]
    res[f"gil_crc32c_{r}"] = probe(lambda: [R._crcs(memoryview(h.reshape(-1).view(np.uint8))) for h in host])
    print(r, {k: v for k, v in res.items() if k.endswith(str(r))}, flush=True)

# (2) fc.save timeline
events = []
orig_host, orig_write = T._host_value, R.RawSerializer.write


def host_value(part):
    a = time.perf_counter()
    out = orig_host(part)
    events.append(("land", a, time.perf_counter(), part.nbytes))
    return out


def write(self, storage, items, *, tag):
    a = time.perf_counter()
    out = orig_write(self, storage, items, tag=tag)
    events.append(("write", a, time.perf_counter(), sum(s.data.nbytes for it in items for s in it.shards)))
    return out


T._host_value = host_value
R.RawSerializer.write = write
scratch = tempfile.mkdtemp(dir="/tmp")
for r in range(3):
    c = jax.block_until_ready(copy(state))
    events.clear()
    p = os.path.join(scratch, f"s{r}")
    t0 = time.perf_counter()
    fc.save(p, c)
    t1 = time.perf_counter()
    lands = [e for e in events if e[0] == "land"]
    writes = [e for e in events if e[0] == "write"]
    rel = lambda t: round((t - t0) * 1e3, 1)
    if not lands:
        lands = [("land", t0, t0, 0)]
    if not writes:
        writes = [("write", t0, t0, 0)]
    res[f"fcsave_{r}"] = {
        "total_ms": rel(t1),
        "n_land_calls": len(lands),
        "first_land_ms": rel(min(e[2] for e in lands)),
        "last_land_ms": rel(max(e[2] for e in lands)),
        "land_ms_deciles": [
            rel(sorted(e[2] for e in lands)[int(q * (len(lands) - 1))]) for q in (0, 0.25, 0.5, 0.75, 1)
        ],
        "first_write_start_ms": rel(min(e[1] for e in writes)),
        "last_write_end_ms": rel(max(e[2] for e in writes)),
        "n_writes": len(writes),
        "sum_write_s": round(sum(e[2] - e[1] for e in writes), 3),
    }
    print(res[f"fcsave_{r}"], flush=True)
    shutil.rmtree(p)
    # host-only: our write path without any transfer
    host = jax.device_get(c)
    events.clear()
    t0 = time.perf_counter()
    fc.save(p, host)
    t1 = time.perf_counter()
    res[f"fcsave_host_{r}"] = {"total_ms": rel(t1), "n_writes": len([e for e in events if e[0] == "write"])}
    shutil.rmtree(p)
    hl = B.leaves_of(host)
    t0 = time.perf_counter()
    B.raw_write(hl, C := B.C.fresh_dir(B.Path(scratch) / "raw"))
    t1 = time.perf_counter()
    res[f"raw_write_{r}"] = rel(t1)
    shutil.rmtree(C)
    print(res[f"fcsave_host_{r}"], "raw", res[f"raw_write_{r}"], flush=True)
shutil.rmtree(scratch, ignore_errors=True)
json.dump(res, open(os.path.join(OUT, "probe.json"), "w"), indent=1)
