"""Heavy imports on first use: ``jax = lazy("jax", globals())`` in place of ``import jax``.

Scope: one small proxy, so that what only lists or verifies a local native checkpoint (the
``flax-ckpt`` command's ``ls``, ``verify`` and ``info``) imports neither jax nor tensorstore nor
ml_dtypes (seconds on a loaded machine) unless a step needs them. A module's first use of the name
imports the real module and puts it in that module's globals in the proxy's place, so every later
use is a plain global lookup (no cost in hot loops). Only for modules whose import-time code never
touches the name (a module-level use imports it right away, which stays correct, only slower).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _Lazy:
    """Stands for module ``name`` in the namespace ``into`` until its first attribute is asked for."""

    def __init__(self, name: str, into: dict[str, Any], alias: str):
        self._name, self._into, self._alias = name, into, alias

    def _load(self) -> ModuleType:
        module = importlib.import_module(self._name)
        if self._into.get(self._alias) is self:
            self._into[self._alias] = module
        return module

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_name", "_into", "_alias"):  # asked before __init__ set them (copy, pickle): none
            raise AttributeError(attr)
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy(name: str, into: dict[str, Any], alias: str | None = None) -> Any:
    """Module ``name`` (bound in ``into`` as ``alias``, default its last dotted part), imported on first
    use; the module itself when it is imported already."""
    import sys

    if name in sys.modules:
        return sys.modules[name]
    return _Lazy(name, into, alias or name.rsplit(".", 1)[-1])
