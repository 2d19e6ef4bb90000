"""A user's training program with the callback: the child process of tests/test_compile_cache.py (argv: the
run directory, the steps to reach, the callback's options as JSON); prints what it resumed from, its final
weights' hash and what its compilation cache did, as one JSON line."""

import hashlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from flax_ckpt.callbacks import CheckpointCallback

run, steps, opts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
ckpt = CheckpointCallback(run, every_steps=1, **opts)


@jax.jit
def train_step(state, step):
    w = state["w"]
    for _ in range(4):
        w = jnp.tanh(w @ w.T + step) * 0.5
    return {"w": w, "n": state["n"] + 1}


state = {"w": jnp.linspace(-1.0, 1.0, 32 * 32, dtype=jnp.float32).reshape(32, 32), "n": jnp.int32(0)}
state, start = ckpt.restore_or(state)
for step in range(start, steps):
    state = train_step(state, step)
    ckpt(step + 1, state)
info = ckpt.compile_cache.info() if ckpt.compile_cache is not None else None
ckpt.close()
print(
    json.dumps(
        {
            "start": start,
            "w": hashlib.sha256(np.asarray(state["w"]).tobytes()).hexdigest(),
            "hits": info.hits if info else None,
            "writes": info.writes if info else None,
            "entries": info.entries if info else None,
            "location": info.location if info else None,
        }
    )
)
