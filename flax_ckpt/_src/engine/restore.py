"""The one restore of every layout: saved leaves -> the target's structure, placed on its devices.

Scope: ``restore`` of one opened checkpoint (a ``Source``: engine/reader.py) checks the target leaf by
leaf (engine/leaves.py), reads what each leaf needs through a ``Reader`` (engine/reader.py: only the
boxes this process's devices hold) and places it: into the target's sharding, onto a device, or as
numpy arrays without a target. The small leaves are read in one batch and placed with one
jax.device_put per sharding, the large ones on a pool meanwhile (``read_all``). A restore that
renames, keeps, ignores or casts (engine/fit.py) reads only the leaves it restores
(``restored_nbytes``: their bytes), and a cast converts a leaf slab by slab as it is read (the
Reader's), so no second copy of the state is held. How a leaf is read and the Source protocol belong
to engine/reader.py; opening, validation and the byte layout to the sources.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import jax
import numpy as np

from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.engine.fit import Fit, RestoreReport, nestable, renamed
from flax_ckpt._src.engine.leaves import fit_target
from flax_ckpt._src.engine.pause import gc_paused
from flax_ckpt._src.engine.reader import Pending, Reader, Source, placements
from flax_ckpt._src.errors import InvalidArgumentError
from flax_ckpt._src.records import LeafRecord

_IO_THREADS = 8
_REMOTE_THREADS = 32  # object stores: reads in flight at once
_BIG_LEAF = 1 << 20  # restore reads leaves of at least this many bytes on a pool

log = logging.getLogger("flax_ckpt")


def flat_shardings(shardings: Any, names: Sequence[str]) -> dict[str, Any]:
    """``shardings`` (one Sharding for every array, or a tree of them by key path) by leaf name."""
    if shardings is None:
        return {}
    if isinstance(shardings, jax.sharding.Sharding):
        return {k: shardings for k in names}
    flat, _ = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding)
    )
    return {tree_mod.keystr(tuple(tree_mod.entry(k) for k in p)): s for p, s in flat}


@gc_paused()
def restore(source: Source, target: Any = None, *, shardings: Any = None, fit: Fit | None = None) -> Any:
    """Restores ``source`` into ``target``'s structure (checked leaf by leaf), or without a target into
    nested dicts/lists of numpy arrays, Python scalars and strings (PRNG keys as key arrays).
    ``fit``: how the checkpoint may differ from the target (engine/fit.py: rename, missing, unexpected,
    cast, report); None: an exact restore. With Fit.report, returns (tree, RestoreReport).
    Every check comes before any read; a failed read or cast hands nothing back."""
    fit = Fit.of() if fit is None else fit
    source, target = source.select(target)
    if target is None:
        if fit.cast:
            raise InvalidArgumentError("cast=True converts each leaf to the target's dtype: pass a target")
        tree, report = _restore_untargeted(source, fit, shardings)
    else:
        flat, treedef = tree_mod.flatten(target)
        fitted = fit_target(source.leaves, flat, fit, what=source.url, where=source.where, hint=source.hint)
        names = [tree_mod.keystr(p) for p, _ in flat]
        smap = flat_shardings(shardings, names)
        places = placements(source.url, names, [t for _, t in flat], smap)
        jobs = [(leaf, t, p) for leaf, (_, t), p in zip(fitted.chosen, flat, places) if leaf is not None]
        values = iter(read_all(Reader(source, fitted.casts), jobs))
        tree = jax.tree_util.tree_unflatten(
            treedef,
            [
                next(values) if leaf is not None else kept(t, p if n in smap else None)
                for n, leaf, (_, t), p in zip(names, fitted.chosen, flat, places)
            ],
        )
        report = fitted.report
    if fit.relaxed:
        log.info("restore of %s: %s", source.url, report.summary())
    return (tree, report) if fit.report else tree


def _restore_untargeted(source: Source, fit: Fit, shardings: Any) -> tuple[Any, RestoreReport]:
    """Every leaf (after a rename; a renamed leaf nests as dicts keyed by its new path's parts)."""
    ren = renamed(source.leaves, fit, source.url)
    names = list(ren.by_name)
    places = placements(source.url, names, [None] * len(names), flat_shardings(shardings, names))
    values = read_all(Reader(source), [(leaf, None, p) for leaf, p in zip(ren.by_name.values(), places)])
    paths = [_path_of(n) if n in ren.origin else leaf.path for n, leaf in ren.by_name.items()]
    paths = nestable(paths) if ren.origin else paths  # a renamed key may sit beside a list's entries
    tree = tree_mod.nest(zip(paths, values))
    return tree, RestoreReport(
        restored=tuple(ren.by_name),
        ignored=tuple(ren.dropped),
        dropped=tuple(ren.dropped),
        renamed=tuple((o, n) for n, o in ren.origin.items()),
    )


def _path_of(name: str) -> tree_mod.KeyPath:
    """A key path string as dict keys ('a/b%2Fc' -> a, b/c)."""
    return tuple(("key", part.replace("%2F", "/").replace("%25", "%")) for part in name.split("/"))


def kept(t: Any, sharding: Any) -> Any:
    """missing="keep": the target's own value (never a copy), placed by ``shardings`` if it names one."""
    if sharding is not None and isinstance(t, (jax.Array, np.ndarray)):
        return jax.device_put(t, sharding)
    return t


def restored_nbytes(source: Source, target: Any, fit: Fit | None = None) -> int:
    """Array bytes a restore of ``source`` into ``target`` reads (``fit``: as restore's)."""
    fit = Fit.of() if fit is None else fit
    source, target = source.select(target)
    if target is None:
        return sum(
            leaf.nbytes for leaf in renamed(source.leaves, fit, source.url, warn=False).by_name.values()
        )
    fitted = fit_target(
        source.leaves, tree_mod.flatten(target)[0], fit, what=source.url, where=source.where, warn=False
    )
    return sum(leaf.nbytes for leaf in fitted.chosen if leaf is not None)


def read_all(reader: Reader, jobs: list[tuple[LeafRecord, Any, Any]]) -> list[Any]:
    """Reads every leaf: the small ones in one batch (Source.read_many) and placed with one
    jax.device_put per sharding, the large ones on a pool meanwhile. Where every read is a request
    round trip (object stores, tensorstore drivers), all leaves go to a wide pool."""
    if reader.source.remote:
        with ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            return list(pool.map(lambda j: reader.value(*j), jobs))
    big = [i for i, (leaf, _, _) in enumerate(jobs) if leaf.nbytes >= _BIG_LEAF]
    small = [i for i, (leaf, _, _) in enumerate(jobs) if leaf.is_array and leaf.nbytes < _BIG_LEAF]
    wanted = [(jobs[i][0], reader.host_box(*jobs[i])) for i in small]
    reader.prefetch([(leaf, box) for leaf, box in wanted if box is not None])
    values: list[Any] = [None] * len(jobs)
    puts: list[tuple[np.ndarray, Any]] = []
    pool = ThreadPoolExecutor(min(_IO_THREADS, len(big))) if len(big) > 1 else None
    try:
        futures = {i: pool.submit(reader.value, *jobs[i]) for i in big} if pool is not None else {}
        for i, j in enumerate(jobs):
            if i not in futures:
                values[i] = reader.value(*j, puts=puts)
        placed = _place(puts)
        for i, v in enumerate(values):
            if isinstance(v, Pending):
                values[i] = placed[v.k]
        for i, f in futures.items():
            values[i] = f.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return values


def _place(puts: list[tuple[np.ndarray, Any]]) -> list[Any]:
    """jax.device_put of many host arrays: one call per distinct sharding (None: the default device)."""
    groups: dict[Any, list[int]] = {}
    for k, (_, sharding) in enumerate(puts):
        groups.setdefault(sharding, []).append(k)
    out: list[Any] = [None] * len(puts)
    for sharding, ks in groups.items():
        placed = jax.device_put([puts[k][0] for k in ks], sharding)  # None: the default device
        for k, arr in zip(ks, placed):
            out[k] = arr
    return out


__all__ = ["flat_shardings", "kept", "read_all", "restore", "restored_nbytes"]
