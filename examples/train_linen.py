"""Train a small Flax Linen MLP on scikit-learn's bundled digits, with preemption-safe checkpoints.

    python examples/train_linen.py --directory /tmp/digits_linen [--steps 300] [--every 100]

Run it again with the same --directory and it resumes where it stopped (a finished run does no more
steps). SIGTERM or Ctrl-C lets the step finish, saves it, and exits with status 143 / 130; run it
again to resume. The five lines marked ``# ckpt`` are all that checkpointing adds to the script (the
last, ``ckpt.close()``, saves the final step when the run's length is not a multiple of ``--every``).

The state is a ``TrainState`` subclass that also carries the dropout PRNG key, and each step's batch
is a pure function of the step, so a resumed run computes exactly what an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from sklearn.datasets import load_digits

from flax_ckpt.callbacks import CheckpointCallback  # ckpt

Data = tuple[np.ndarray, np.ndarray]


class MLP(nn.Module):
    """64 pixels -> hidden -> dropout -> hidden -> 10 classes."""

    hidden: int = 64

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
    rng: jax.Array  # the dropout key, split every step


def load_data(seed: int = 0) -> tuple[Data, Data]:
    """(train, test) digits: 8x8 images as 64 floats in [0, 1], labels 0-9; 1500 / 297 examples."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def batch_at(data: Data, step: int, batch_size: int = 64, seed: int = 0) -> Data:
    """The batch of ``step``: each epoch's order is a function of (seed, epoch), so no iterator state."""
    x, y = data
    per_epoch = len(x) // batch_size
    epoch, i = divmod(step, per_epoch)
    idx = np.random.default_rng([seed, epoch]).permutation(len(x))[i * batch_size : (i + 1) * batch_size]
    return x[idx], y[idx]


def create_state(seed: int = 0, learning_rate: float = 3e-3) -> TrainState:
    model = MLP()
    params = model.init(jax.random.key(seed), jnp.zeros((1, 64)), train=False)["params"]
    return TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(learning_rate), rng=jax.random.key(seed + 1)
    )


@jax.jit
def train_step(state: TrainState, x: jax.Array, y: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    rng, dropout_rng = jax.random.split(state.rng)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": dropout_rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads).replace(rng=rng), {"loss": loss}


@jax.jit
def accuracy(state: TrainState, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = state.apply_fn({"params": state.params}, x, train=False)
    return jnp.mean(jnp.argmax(logits, -1) == y)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--directory", required=True, help="checkpoint directory (resumes from it)")
    p.add_argument("--steps", type=int, default=300, help="total training steps")
    p.add_argument("--every", type=int, default=100, help="save every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> float:
    args = parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # WARNING and up from everyone,
    logging.getLogger("flax_ckpt").setLevel(logging.INFO)  # and the checkpoint library's INFO lines
    train, test = load_data(args.seed)
    ckpt = CheckpointCallback(args.directory, every_steps=args.every)  # ckpt
    # without ckpt: state, start = create_state(args.seed), 0
    state, start = ckpt.restore_or(lambda: create_state(args.seed))  # ckpt
    for step in range(start, args.steps):
        state, metrics = train_step(state, *batch_at(train, step, seed=args.seed))
        ckpt(step + 1, state, metrics)  # ckpt
        if (step + 1) % args.log_every == 0:
            print(f"step {step + 1} loss {float(metrics['loss']):.4f}", flush=True)
    ckpt.close()  # ckpt
    acc = float(accuracy(state, *test))
    print(f"final accuracy {acc:.4f} after {args.steps} steps", flush=True)
    return acc


if __name__ == "__main__":
    main()
