"""One list of public names per public package.

flax_ckpt/__init__.py keeps its names once, in ``_SOURCES`` (``__all__`` and ``__getattr__`` derive
from it; tests/test_cli_frictions.py checks that its ``TYPE_CHECKING`` imports, which type checkers
read, name the same). flax_ckpt.callbacks re-exports each name with ``import X as X`` and lists it in
``__all__``: the two must agree, so a name added to one and not the other fails here.
"""

from __future__ import annotations

import ast
import pathlib

import flax_ckpt as fc
import flax_ckpt.callbacks

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _reexports(path: pathlib.Path) -> list[str]:
    """The names a module re-exports explicitly (``from m import X as X``), anywhere in it."""
    tree = ast.parse(path.read_text())
    return sorted(
        a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for a in node.names
        if a.asname == a.name
    )


def test_callbacks_all_lists_exactly_its_reexports():
    assert sorted(flax_ckpt.callbacks.__all__) == _reexports(ROOT / "callbacks" / "__init__.py")


def test_flax_ckpt_all_is_derived_from_its_one_table():
    assert fc.__all__ == sorted(n for names in fc._SOURCES.values() for n in names)
    assert _reexports(ROOT / "flax_ckpt" / "__init__.py") == fc.__all__
