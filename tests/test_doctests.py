"""The public API's docstrings are documentation a user can run.

Every example (``>>>``) in the docstrings of the public modules runs as a doctest, each docstring in a
fresh temporary folder that is the current directory (so ``fc.save("ckpt", ...)`` writes there), with
``fc`` (``import flax_ckpt as fc``) given; everything else an example uses it imports itself. And every
public callable of the contract (README's API, DESIGN.md) has Args (when it takes any), Returns (when it
returns something), Raises (when it can raise) and an example.
"""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

import flax_ckpt as fc
from flax_ckpt.callbacks import CheckpointCallback

MODULES = (
    "flax_ckpt._src.api",
    "flax_ckpt._src.manager.manager",
    "flax_ckpt._src.tiers",
    "flax_ckpt._src.serializers.base",
    "flax_ckpt.callbacks.checkpoint_callback",
    "flax_ckpt.callbacks.data",
)

# The public callables of the contract; methods by their class. Those that raise nothing of their own
# (a read of what the manager already knows) need no Raises section.
CALLABLES = [
    fc.save,
    fc.restore,
    fc.metadata,
    fc.CheckpointManager,
    fc.CheckpointManager.save,
    fc.CheckpointManager.restore,
    fc.CheckpointManager.wait_until_finished,
    fc.CheckpointManager.close,
    fc.CheckpointManager.all_steps,
    fc.CheckpointManager.latest_step,
    fc.CheckpointManager.best_step,
    fc.CheckpointManager.metrics,
    fc.CheckpointManager.should_save,
    fc.CheckpointManager.item_metadata,
    fc.Tiers,
    CheckpointCallback,
    CheckpointCallback.restore_or,
    CheckpointCallback.__call__,
    CheckpointCallback.finish,
    CheckpointCallback.close,
    fc.Serializer,
    fc.Serializer.write,
    fc.Serializer.read,
    fc.Serializer.read_many,
    fc.Serializer.view,
    fc.Serializer.validate,
]
RAISE_NOTHING = {
    fc.CheckpointManager.all_steps,
    fc.CheckpointManager.latest_step,
    fc.CheckpointManager.best_step,
    fc.CheckpointManager.metrics,
    fc.CheckpointManager.should_save,
    fc.Serializer,  # a protocol: its methods, which a user implements, say what they raise
}
# Methods a user implements rather than calls: the protocol's own example implements them all.
EXAMPLE_ON_CLASS = {
    fc.Serializer.write,
    fc.Serializer.read,
    fc.Serializer.read_many,
    fc.Serializer.view,
    fc.Serializer.validate,
}


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    out = []
    for name in MODULES:
        out += [t for t in finder.find(importlib.import_module(name), name) if t.examples]
    return sorted(out, key=lambda t: t.name)


DOCTESTS = _doctests()


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name.removeprefix("flax_ckpt.") for t in DOCTESTS])
def test_docstring_examples_run(test, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    test.globs = {"fc": fc}
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    try:
        result = runner.run(test, out=report.append, clear_globs=False)
    finally:
        for value in list(test.globs.values()):  # a manager or callback an example left open
            if isinstance(value, (fc.CheckpointManager, CheckpointCallback)):
                value.close()
        test.globs.clear()
    assert result.failed == 0, "".join(report)


def _name(f) -> str:
    return getattr(f, "__qualname__", repr(f))


@pytest.mark.parametrize("f", CALLABLES, ids=_name)
def test_public_callables_document_args_returns_raises_and_an_example(f):
    doc = inspect.getdoc(f) or ""
    target = f.__init__ if inspect.isclass(f) else f
    sig = inspect.signature(target)
    params = [p for p in sig.parameters if p != "self"]
    if inspect.isclass(f) and dataclass_fields(f):
        params = list(dataclass_fields(f))
    if getattr(f, "_is_protocol", False):  # constructed by its implementations, not by a user
        params = []
    missing = [
        section
        for section, needed in (
            ("Args:", bool(params)),
            ("Returns:", not inspect.isclass(f) and sig.return_annotation not in ("None", None, sig.empty)),
            ("Raises:", f not in RAISE_NOTHING),
            (">>>", f not in EXAMPLE_ON_CLASS),
        )
        if needed and section not in doc
    ]
    assert not missing, f"{_name(f)}'s docstring lacks {missing}"


def dataclass_fields(cls) -> tuple[str, ...]:
    return tuple(getattr(cls, "__dataclass_fields__", {}))


def test_every_documented_module_has_examples():
    """A module of MODULES whose examples vanished (say, a docstring's object renamed) fails here."""
    names = [t.name for t in DOCTESTS]
    assert [m for m in MODULES if not any(n.startswith(m + ".") for n in names)] == []
