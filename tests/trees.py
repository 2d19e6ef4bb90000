"""Pytree builders used by several test modules (compare them with helpers.assert_bit_exact)."""

from __future__ import annotations

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import struct
from flax.training import train_state

Point = collections.namedtuple("Point", ["x", "y"])


@struct.dataclass
class Extra:
    a: jax.Array
    b: int
    name: str = struct.field(pytree_node=False, default="static")


def every_dtype() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for dt in [
        "float32",
        "float64",
        "float16",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
    ]:
        kind = np.dtype(dt).kind
        out[dt] = (
            rng.integers(0 if kind in "ub" else -100, 2 if kind == "b" else 100, (3, 5)).astype(dt)
            if kind in "iub"
            else (rng.standard_normal((3, 5)) * 100).astype(dt)
        )
    for name in ["bfloat16", "float8_e4m3fn", "float8_e5m2"]:
        out[name] = (rng.standard_normal((4, 2)) * 3).astype(np.dtype(getattr(ml_dtypes, name)))
    out["int4"] = rng.integers(-8, 8, (4, 2)).astype(np.dtype(ml_dtypes.int4))
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45], np.float32)
    special[0] = np.frombuffer(np.uint32(0x7FC0_1234).tobytes(), np.float32)[0]  # NaN with a payload
    out["special"] = special
    return out


def train_state_tree() -> train_state.TrainState:
    model = nn.Dense(4)
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def mixed_tree() -> dict:
    return {
        "arrays": every_dtype(),
        "jax": {"w": jnp.arange(12.0).reshape(3, 4), "bf": jnp.ones((2, 3), jnp.bfloat16)},
        "zero_d": np.float32(2.5),
        "zero_d_jax": jnp.array(7, jnp.int32),
        "empty": np.zeros((0, 4), np.float32),
        "scalars": [1, -(2**70), 3.25, -0.0, float("nan"), True, complex(1, -2)],
        "text": "héllo",
        "none": None,
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
        "point": Point(np.int16(3), [np.ones(2)]),
        "extra": Extra(jnp.zeros(3), 4),
        "typed_key": jax.random.key(42),
        "raw_key": jax.random.PRNGKey(7),
        "keys": jax.random.split(jax.random.key(1), 3),
        "opt": optax.adam(1e-3).init({"a": jnp.ones(3)}),
        "masked": optax.masked(optax.sgd(0.1), {"a": True, "b": False}).init(
            {"a": jnp.ones(2), "b": jnp.ones(2)}
        ),
        "int_keys": {3: "three", 10: np.ones(1)},
    }
