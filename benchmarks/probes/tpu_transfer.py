"""How to bring a device copy of the state to host: throughput, the GIL held, and training steps lost.

    python benchmarks/probes/tpu_transfer.py          # bench_accelerator.py's 1 GiB model (PROBE_SMALL=1: tiny)

Ways compared, each from a fresh on-device copy of the state:

- ``asis``: ``copy_to_host_async`` of every leaf, then ``np.asarray`` of each (what engine/device.py did);
- ``flat``: the copy made as flat uint32 vectors on the device (a bitcast, then a reshape), transferred
  the same way and viewed back as the leaves' dtypes and shapes on host (no host copy);
- ``flat_pinned``: the flat vectors moved by ``device_put`` to the ``pinned_host`` memory kind first;
- ``flat_cat``: all the flat vectors as one (a single transfer);
- ``one_by_one``: the per-leaf copy, each leaf's transfer started after the last one landed;
- ``device_get``: ``jax.device_get`` of the per-leaf copy;
- ``windowN``: the per-leaf copy's transfers started in order, at most N MiB in flight.

``PROBE_WAYS=asis,window64m``: only those.

Reported per way (3 rounds, interleaved): seconds to host, GB/s, the longest pause of a thread that only
sleeps 0.5 ms at a time (the GIL held by the transfer), and, with the model training (a sync per step),
the steps' time lost against their median while the way runs on a thread. Checks every way bit-exact.
JSON in $OUT (default /tmp).
"""

import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax
import jax.numpy as jnp
import numpy as np
from _stalls import steps_lost

import bench_accelerator as B

OUT = os.environ.get("OUT", "/tmp")
init, step, copy = B.make_model(**(B.SMALL if os.environ.get("PROBE_SMALL") else B.FULL))
state = jax.block_until_ready(step(init()))
res: dict = {"devices": str(jax.devices()), "jax": jax.__version__}


def _flat_one(x):
    size = x.dtype.itemsize
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    k = 4 // size
    if x.size % k:
        return jnp.copy(x)
    return jax.lax.bitcast_convert_type(x.reshape(-1, k), jnp.uint32)


def _padded(x):
    v = _flat_one(x)
    if v.dtype != jnp.uint32:  # a size that does not fill whole words: bytes, padded to a word
        b = jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(-1) if v.dtype.itemsize > 1 else v.reshape(-1)
        b = jnp.pad(b.astype(jnp.uint8), (0, -b.size % 4))
        v = jax.lax.bitcast_convert_type(b.reshape(-1, 4), jnp.uint32)
    return v


flat_copy = jax.jit(lambda xs: [_flat_one(x) for x in xs])
flat_cat = jax.jit(lambda xs: [jnp.concatenate([_padded(x) for x in xs])])
leaves = B.leaves_of(state)
want = [np.asarray(x) for x in leaves]
total = sum(a.nbytes for a in want)
res["bytes"], res["leaves"] = total, len(want)


def back(h, like):
    if h.dtype == like.dtype and h.shape == like.shape:
        return h
    return h.view(np.uint8)[: like.nbytes].view(like.dtype).reshape(like.shape)


# A way: (make, move). ``make`` dispatches the device copy on the caller's thread (as ``save`` does:
# before the next step can donate the state), ``move`` brings it to host, on a thread of its own.


def per_leaf(xs):
    return B.leaves_of(copy(xs))


def all_at_once(xs):
    for x in xs:
        x.copy_to_host_async()
    return [np.asarray(x) for x in xs]


def flat_back(xs):
    for x in xs:
        x.copy_to_host_async()
    return [back(np.asarray(x), w) for x, w in zip(xs, want)]


def pinned_back(xs):
    ys = [jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in xs]
    return [back(np.asarray(y), w) for y, w in zip(ys, want)]


def cat_back(xs):
    (x,) = xs
    x.copy_to_host_async()
    h, out, at = np.asarray(x), [], 0
    for w in want:
        n = -(-w.nbytes // 4)
        out.append(back(h[at : at + n], w))
        at += n
    return out


def windowed(limit):
    """Transfers started in order, at most ``limit`` bytes in flight (0: one at a time)."""

    def move(xs):
        out, started, held = [], 0, 0
        for x in xs:
            while started < len(xs) and (started == len(out) or held + xs[started].nbytes <= limit):
                xs[started].copy_to_host_async()
                held += xs[started].nbytes
                started += 1
            out.append(np.asarray(x))
            held -= x.nbytes
        return out

    return move


WAYS = {
    "asis": (per_leaf, all_at_once),
    "flat": (flat_copy, flat_back),
    "flat_pinned": (flat_copy, pinned_back),
    "flat_cat": (flat_cat, cat_back),
    "one_by_one": (per_leaf, windowed(0)),
    "device_get": (per_leaf, jax.device_get),
    "window16m": (per_leaf, windowed(16 << 20)),
    "window64m": (per_leaf, windowed(64 << 20)),
    "window256m": (per_leaf, windowed(256 << 20)),
}
if os.environ.get("PROBE_WAYS"):
    WAYS = {k: WAYS[k] for k in os.environ["PROBE_WAYS"].split(",")}


def ticking(way):
    """The way's result on the state, seconds, and the longest pause of a sleeping thread meanwhile
    (ms)."""
    stop, gaps = threading.Event(), []

    def tick():
        t = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0005)
            u = time.perf_counter()
            gaps.append(u - t)
            t = u

    th = threading.Thread(target=tick)
    th.start()
    a = time.perf_counter()
    make, move = way
    out = move(make(B.leaves_of(state)))
    s = time.perf_counter() - a
    stop.set()
    th.join()
    return out, s, max(gaps or [0]) * 1e3, sum(g for g in gaps if g > 0.005) * 1e3


def stalls(way):
    """Steps' time lost, the longest step (ms), and the move's seconds, when before a step the caller
    makes the device copy and a thread moves it to host (_stalls.steps_lost)."""
    global state
    make, move = way
    state, *figures = steps_lost(step, state, move, lambda s: make(B.leaves_of(s)))
    return figures


for name, way in WAYS.items():  # warm-up (compiles) and the bit-exact check
    try:
        got = ticking(way)[0]
        res[f"{name}_exact"] = all(
            g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()
            for g, w in zip(got, want)
        )
    except Exception as e:  # noqa: BLE001
        res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    print(name, res.get(f"{name}_exact"), res.get(f"{name}_error"), flush=True)
    want = [np.asarray(x) for x in B.leaves_of(state)]

for r in range(int(os.environ.get("PROBE_ROUNDS", "3"))):
    for name, way in WAYS.items():
        if f"{name}_error" in res:
            continue
        want = [np.asarray(x) for x in B.leaves_of(state)]
        jax.block_until_ready(state)
        _, s, gap, held = ticking(way)
        res.setdefault(f"{name}_s", []).append(round(s, 3))
        res.setdefault(f"{name}_gbps", []).append(round(total / s / 1e9, 2))
        res.setdefault(f"{name}_maxgap_ms", []).append(round(gap, 1))
        res.setdefault(f"{name}_gaps_ms", []).append(round(held, 1))
        ex, mx, took = stalls(way)
        res.setdefault(f"{name}_step_excess_s", []).append(ex)
        res.setdefault(f"{name}_step_max_ms", []).append(mx)
        res.setdefault(f"{name}_in_loop_s", []).append(took)
        print(r, name, s, gap, held, ex, mx, took, flush=True)

json.dump(res, open(os.path.join(OUT, "transfer.json"), "w"), indent=1)
print(json.dumps(res))
