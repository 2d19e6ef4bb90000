"""Library functions behind the ``flax-ckpt`` command: list, verify, diff, convert and prune checkpoints.

Scope: read-mostly tools over committed checkpoints, native or Orbax (and, for listing, a tiered
manager's memory-tier copies), each a typed function returning plain values (dataclasses) that the
CLI (cli.py) prints as text or JSON. One module per command; what they share is common.py. Byte
layouts belong to the engine, the serializers, orbax/ and tiers/; retention policy to retention.py.
Progress bars (tqdm, on stderr) are off unless ``progress=True``.
"""

from flax_ckpt._src.tools.convert import ConvertResult, Format, convert, detect_format
from flax_ckpt._src.tools.diff import DiffResult, LeafDiff, diff, max_abs_diff
from flax_ckpt._src.tools.ls import StepEntry, list_memory_tiers, list_steps, memory_tier_root
from flax_ckpt._src.tools.prune import PruneResult, prune
from flax_ckpt._src.tools.verify import Problem, Report, check, verify

__all__ = ["ConvertResult", "DiffResult", "Format", "LeafDiff", "Problem", "PruneResult", "Report", "StepEntry",
           "check", "convert", "detect_format", "diff", "list_memory_tiers", "list_steps", "max_abs_diff",
           "memory_tier_root", "prune", "verify"]
