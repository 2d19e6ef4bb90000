"""``restore_or(make_state)``: a resumed run builds only the shapes of the state it is about to overwrite.

Scope: telling a function that builds the state from a state, and evaluating that function abstractly
(no compile, no computation, no device memory) into the restore's target: array leaves as
``jax.ShapeDtypeStruct`` with the placement the function gives them, nnx objects as ``nnx.eval_shape``
makes them (abstract ``nnx.Variable`` objects, restored in place), and the Python objects the function
returns (a data iterator, a ``random.Random``, a Python number, a numpy array) as the function built
them. What does not belong here: which step is restored, the nnx and iterator mapping (state.py).

What the function may contain. It is traced once, as ``jax.jit`` would trace it: jax code that builds
arrays (``TrainState.create``, ``model.init``, ``tx.init``, nnx constructors, ``jax.jit(init,
out_shardings=...)``, ``jax.device_put(x, sharding)``) costs only its tracing; Python objects built
from Python values (a grain iterator over a dataset, ``random.Random(0)``, a step counter) are built
for real and kept. Code that needs an array's value (``float(x)``, ``np.asarray(x)``, ``if x > 0``)
cannot run abstractly: then the function is called for real, with a warning that says why, and its
state is the target, as a state given to ``restore_or`` is.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

import jax
from jax.core import Tracer

import flax_ckpt as fc

from .state import _is_nnx, _is_object_leaf

log = logging.getLogger("flax_ckpt.callbacks")

# jax's errors for code that needs an array's value: the function then runs for real
_NEEDS_VALUES = tuple(
    getattr(jax.errors, name)
    for name in (
        "ConcretizationTypeError",
        "TracerArrayConversionError",
        "TracerBoolConversionError",
        "TracerIntegerConversionError",
    )
    if hasattr(jax.errors, name)
)


def is_builder(x: Any) -> bool:
    """Whether ``restore_or`` was given a function that builds the state rather than a state: a callable
    that is a single pytree leaf (a function, a ``functools.partial``, a jitted function), not an nnx
    object (a module is callable, and is state)."""
    if not callable(x) or isinstance(x, type) or _is_nnx(x):
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def state_for(state: Any, resumes: bool) -> tuple[Any, Callable[[], Any] | None]:
    """``(the state restore_or restores into, the function that built it abstractly or None)``:
    ``state`` itself; or for a function, its state evaluated abstractly where a step will be restored
    (``resumes``), else the state it builds. Raises InvalidArgumentError for traced values (restore_or
    called inside ``jax.jit``)."""
    if not is_builder(state):
        _refuse_traced(state, "the state given")
        return state, None
    if isinstance(jax.numpy.asarray(0), Tracer):
        _refuse_traced({"": jax.numpy.asarray(0)}, f"restore_or({_name(state)}), traced itself,")
    if not resumes:
        built = state()
        _refuse_traced(built, f"the state {_name(state)} built")
        return built, None
    target, abstract = abstract_state(state)
    return target, state if abstract else None


def _refuse_traced(tree: Any, what: str) -> None:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    traced = [jax.tree_util.keystr(p) for p, x in flat if isinstance(x, Tracer)]
    if traced:
        raise fc.InvalidArgumentError(
            f"restore_or: {what} holds traced values ({', '.join(traced[:10])}): it runs inside a "
            "jax transformation (jax.jit, nnx.jit, a scan), where no file can be read and no concrete "
            "array made. Nothing was read. Fix: call restore_or outside it, before the training step"
        )


def _is_python_leaf(x: Any) -> bool:
    """A leaf the function builds for real: anything that is not an array jax traces or an nnx object."""
    return not _is_nnx(x) and not isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def abstract_state(make_state: Callable[[], Any]) -> tuple[Any, bool]:
    """``(target, abstract)``: the state ``make_state()`` would build, evaluated abstractly
    (``abstract=True``), or ``make_state()`` itself where its code needs an array's value (with a
    warning). An error ``make_state`` raises is raised as it is."""
    kept: list[Any] = []

    def arrays() -> tuple[list[Any], Any]:
        flat, treedef = jax.tree_util.tree_flatten(make_state(), is_leaf=_is_object_leaf)
        objects = tuple(x for x in flat if _is_nnx(x))
        graph, variables = sys.modules["flax.nnx"].split(objects) if objects else (None, None)
        kept[:] = [flat, treedef, graph]  # nnx objects: split, merged again over the shapes (graph kept)
        return [None if _is_python_leaf(x) or _is_nnx(x) else x for x in flat], variables

    try:
        traced = jax.jit(arrays).trace()
    except _NEEDS_VALUES as e:
        log.warning(
            "restore_or: %s needs the value of an array (%s), so it cannot be evaluated abstractly: it "
            "is called, building a state the restore then overwrites. To resume without building it, "
            "keep code that reads array values (float(x), np.asarray(x), `if x > 0`) out of the function",
            _name(make_state),
            type(e).__name__,
        )
        return make_state(), False
    shapes, variables = _placed(traced.out_info, traced.jaxpr)
    flat, treedef, graph = kept
    objects = iter(sys.modules["flax.nnx"].merge(graph, variables) if graph is not None else ())
    leaves = [next(objects) if _is_nnx(x) else x if _is_python_leaf(x) else s for x, s in zip(flat, shapes)]
    return jax.tree_util.tree_unflatten(treedef, leaves), True


def _placed(shapes: Any, jaxpr: Any) -> Any:
    """``shapes`` (jit's ``out_info``) with each output's sharding as the traced program sets it: the
    ``out_shardings`` of a ``jax.jit`` call or the sharding of a ``jax.device_put`` that makes it
    or a ``jax.lax.with_sharding_constraint`` (``out_info`` has none for the first, and an abstract
    mesh's for the others)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's own jaxpr (jax < 0.7 forwards no outvars)
    made: dict[int, Any] = {}
    for eqn in jaxpr.eqns:
        given = eqn.params.get("out_shardings", eqn.params.get("devices", eqn.params.get("sharding", ())))
        given = (given,) if isinstance(given, jax.sharding.Sharding) else given
        for var, sharding in zip(eqn.outvars, given if isinstance(given, (tuple, list)) else ()):
            if isinstance(sharding, jax.sharding.Sharding):
                made[id(var)] = sharding
    flat, treedef = jax.tree_util.tree_flatten(shapes)
    out = []
    for s, var in zip(flat, jaxpr.outvars, strict=True):
        sharding = made.get(id(var))
        weak = getattr(s, "weak_type", False)  # jax < 0.7's OutInfo has shape, dtype, sharding only
        if sharding is not None:
            s = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding, weak_type=weak)
        elif not isinstance(s, jax.ShapeDtypeStruct):
            s = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=getattr(s, "sharding", None), weak_type=weak)
        out.append(s)
    return jax.tree_util.tree_unflatten(treedef, out)


def check_restored(restored: Any, make_state: Callable[[], Any]) -> None:
    """Raises a CheckpointError naming every leaf of ``restored`` still abstract (a leaf the restore did
    not fill), so no ShapeDtypeStruct reaches the training step."""
    flat = jax.tree_util.tree_flatten_with_path(restored)[0]
    left = [jax.tree_util.keystr(p) for p, x in flat if isinstance(x, jax.ShapeDtypeStruct)]
    if left:
        raise fc.CheckpointError(
            f"restore_or({_name(make_state)}): the checkpoint gave no value for {len(left)} leaves of the "
            f"state the function builds: {', '.join(left[:10])}{' ...' if len(left) > 10 else ''}. Fix: "
            "pass missing='keep' (the function is then called, and these leaves keep its values)"
        )


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
