"""``flax_ckpt.callbacks``: the training-loop hooks, also importable as the top-level ``callbacks``.

The hooks live in the ``callbacks`` package beside this one (they are built only on flax_ckpt's
public API, the layer above the engine); this module gives them a name inside flax_ckpt. The engine
never imports it. The clu adapter is ``callbacks.clu_adapter`` (clu is an optional extra).
"""

from callbacks import CheckpointCallback as CheckpointCallback
from callbacks import PreemptionGuard as PreemptionGuard
from callbacks import Stateful as Stateful
from callbacks import from_tree as from_tree
from callbacks import to_tree as to_tree

__all__ = ["CheckpointCallback", "PreemptionGuard", "Stateful", "from_tree", "to_tree"]
