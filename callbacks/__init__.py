"""flax_ckpt.callbacks: training-loop hooks for flax_ckpt, built only on its public API (``import flax_ckpt as fc``).

``CheckpointCallback`` gives a Flax/Optax loop periodic checkpoints, automatic resume and preemption
safety with three lines of code. ``PreemptionGuard`` is its signal handling, usable alone; ``to_tree`` /
``from_tree`` map live state (nnx objects, stateful data iterators, Python's ``random`` state) to the
saved pytree and back; ``EpochLoader`` gives a loader that starts afresh each epoch (``for batch in
loader``) a position that checkpoints. The clu adapter lives in ``flax_ckpt.callbacks.clu_adapter`` and is not imported
here (clu is an optional extra).
"""

from .checkpoint_callback import CheckpointCallback as CheckpointCallback
from .checkpoint_callback import Preempted as Preempted
from .data import EpochLoader as EpochLoader
from .preemption import PreemptionGuard as PreemptionGuard
from .state import Stateful as Stateful
from .state import from_tree as from_tree
from .state import to_tree as to_tree

__all__ = [
    "CheckpointCallback",
    "EpochLoader",
    "Preempted",
    "PreemptionGuard",
    "Stateful",
    "from_tree",
    "to_tree",
]


def __dir__() -> list[str]:
    return sorted(__all__)
