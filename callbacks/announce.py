"""The lines a user of the callback must see: a resume ("resumed from step N of DIR"), a fresh start, a
final save at close. Without them a resume cannot be told from a fresh start.

Scope: deciding where such a line goes, whatever other libraries did to logging. Importing grain or
orbax gives the root logger a handler and leaves it at WARNING (absl's verbosity at its default
WARNING too), so an INFO line logged through ``flax_ckpt.callbacks`` would reach no one. The line is
logged when logging shows it, else written to stderr: once either way. Only the user's own choice
silences it: the ``flax_ckpt`` (or ``flax_ckpt.callbacks``) logger set above INFO, absl's verbosity
set above INFO (``--verbosity=-1``, ``absl.logging.set_verbosity``), or ``logging.disable(INFO)``.
Warnings (a preemption) need none of this: Python shows WARNING lines even with no logging set up.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("flax_ckpt.callbacks")


def announce(message: str, *args: Any) -> None:
    """Shows ``message % args`` once: logged through ``flax_ckpt.callbacks`` when logging shows INFO
    lines (the user's handlers, or absl's under ``absl.app.run``), else on stderr; silent only where
    the user asked for less than INFO (see the module's docstring)."""
    if _logging_shows(log):
        log.info(message, *args)
    elif not _quieted_by_user(log):
        print(message % args, file=sys.stderr, flush=True)


def _logging_shows(logger: logging.Logger) -> bool:
    """Whether an INFO line of ``logger`` reaches a handler that takes INFO lines (Python's last-resort
    handler, used when there is none, takes WARNING and above)."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    node: logging.Logger | None = logger
    while node is not None:
        if any(h.level <= logging.INFO for h in node.handlers):
            return True
        node = node.parent if node.propagate else None
    return False


def _quieted_by_user(logger: logging.Logger) -> bool:
    """Whether the user set INFO lines off: ``logging.disable``, a level above INFO on ``logger`` or a
    parent below the root (the root's level is every library's, grain's and orbax's included), or
    absl's verbosity set above INFO (not its default)."""
    if logging.root.manager.disable >= logging.INFO:
        return True
    node: Any = logger
    while node is not None and node is not logging.root:
        if node.level != logging.NOTSET:
            return node.level > logging.INFO
        node = node.parent
    return _absl_quiet()


def _absl_quiet() -> bool:
    """Whether absl's verbosity was set (a ``--verbosity`` flag, ``set_verbosity``) above INFO."""
    flags = sys.modules.get("absl.flags")
    if flags is None or "absl.logging" not in sys.modules or "verbosity" not in flags.FLAGS:
        return False
    verbosity = flags.FLAGS["verbosity"]
    return not verbosity.using_default_value and verbosity.value is not None and verbosity.value < 0
