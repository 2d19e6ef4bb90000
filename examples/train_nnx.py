"""Train a small flax.nnx MLP on scikit-learn's bundled digits, with preemption-safe checkpoints.

    python examples/train_nnx.py --directory /tmp/digits_nnx [--steps 300] [--every 100]

The same run as train_linen.py, written with flax.nnx: the checkpointed state is the model (its
parameters and its dropout ``nnx.Rngs``), the ``nnx.Optimizer``, and the data iterator's position. The
callback restores nnx objects in place (``nnx.state`` / ``nnx.update``) and iterators through their
``get_state`` / ``set_state``, so a resumed run computes exactly what an uninterrupted one would. The
five lines marked ``# ckpt`` are all that checkpointing adds to the script (the last,
``ckpt.close()``, saves the final step when the run's length is not a multiple of ``--every``).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flax_ckpt.callbacks import CheckpointCallback  # ckpt
from train_linen import Data, load_data  # the same digits split (examples/ is on sys.path when run)


class MLP(nnx.Module):
    """64 pixels -> hidden -> dropout -> hidden -> 10 classes."""

    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(64, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.dense2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.dropout(nnx.relu(self.dense1(x)))
        return self.head(nnx.relu(self.dense2(x)))


class Batches:
    """Shuffled minibatches, epoch after epoch; ``get_state`` / ``set_state`` give its position."""

    def __init__(self, data: Data, batch_size: int = 64, seed: int = 0):
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.data[0]))

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> Data:
        if (self.index + 1) * self.batch_size > len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return self.data[0][idx], self.data[1][idx]

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._shuffle()


def create(seed: int = 0, learning_rate: float = 3e-3) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(64, nnx.Rngs(params=seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)


def make_state(seed: int, train: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """The model, its optimizer and the data iterator: everything a step changes."""
    model, optimizer = create(seed)
    return {"model": model, "optimizer": optimizer, "data": Batches(train, seed=seed)}


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def accuracy(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(model(x), -1) == y)


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
    # without ckpt: state, start = make_state(args.seed, train), 0
    state, start = ckpt.restore_or(lambda: make_state(args.seed, train))  # ckpt
    model, optimizer, batches = state["model"], state["optimizer"], state["data"]
    for step in range(start, args.steps):
        loss = train_step(model, optimizer, *next(batches))
        ckpt(step + 1, state, {"loss": loss})  # ckpt
        if (step + 1) % args.log_every == 0:
            print(f"step {step + 1} loss {float(loss):.4f}", flush=True)
    ckpt.close()  # ckpt
    model.eval()
    acc = float(accuracy(model, *test))
    print(f"final accuracy {acc:.4f} after {args.steps} steps", flush=True)
    return acc


if __name__ == "__main__":
    main()
