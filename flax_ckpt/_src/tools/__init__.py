"""The ``flax-ckpt`` command and the library functions behind it: list, verify, diff, convert, prune.

Scope: the command itself (cli.py: parsing, printing, exit statuses) and read-mostly tools over
committed checkpoints, native or Orbax (and, for listing, a tiered manager's memory-tier copies), each a
typed function returning plain values (dataclasses) that cli.py prints as text or JSON. One module per
command; what they share is common.py. Byte layouts belong to the engine, the serializers, orbax/ and
tiers/; retention policy to retention.py. Progress bars (tqdm, on stderr) are off unless
``progress=True``. Each name is imported from its module on first use (``__getattr__``), so that
``flax-ckpt ls`` imports neither ``convert`` nor ``diff`` (nor jax, which they need).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flax_ckpt._src.tools.convert import ConvertResult, Format, convert, detect_format
    from flax_ckpt._src.tools.diff import DiffResult, LeafDiff, diff, max_abs_diff
    from flax_ckpt._src.tools.ls import StepEntry, list_memory_tiers, list_steps, memory_tier_root
    from flax_ckpt._src.tools.prune import PruneResult, prune
    from flax_ckpt._src.tools.verify import Problem, Report, check, verify

_SOURCES: dict[str, tuple[str, ...]] = {
    "convert": ("ConvertResult", "Format", "convert", "detect_format"),
    "diff": ("DiffResult", "LeafDiff", "diff", "max_abs_diff"),
    "ls": ("StepEntry", "list_memory_tiers", "list_steps", "memory_tier_root"),
    "prune": ("PruneResult", "prune"),
    "verify": ("Problem", "Report", "check", "verify"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


class _Tools(types.ModuleType):
    """This package, which keeps each command's function (not the module of the same name) under the
    command's name: importing ``tools.verify`` directly (``from flax_ckpt._src.tools.verify import ...``,
    as the CLI does) makes Python bind the submodule on its package, over the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and value.__name__ == f"{self.__name__}.{name}"
            and _MODULE_OF.get(name) == name
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Tools


__all__ = [
    "ConvertResult",
    "DiffResult",
    "Format",
    "LeafDiff",
    "Problem",
    "PruneResult",
    "Report",
    "StepEntry",
    "check",
    "convert",
    "detect_format",
    "diff",
    "list_memory_tiers",
    "list_steps",
    "max_abs_diff",
    "memory_tier_root",
    "prune",
    "verify",
]
