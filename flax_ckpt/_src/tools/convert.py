"""``flax-ckpt convert``: native <-> Orbax layout, or an export of the arrays to one .safetensors file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np

from flax_ckpt._src import api, layouts
from flax_ckpt._src import commit as commit_mod
from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.errors import CheckpointError, CheckpointExistsError, format_list
from flax_ckpt._src.storage import LocalStorage
from flax_ckpt._src.tools.common import Leaves, bar, folder_of

Format = Literal["native", "orbax", "safetensors"]


@dataclass(frozen=True)
class ConvertResult:
    dst: str
    to: Format
    leaves: int
    nbytes: int
    skipped: list[str] = field(default_factory=list)  # not exported to safetensors: non-arrays, PRNG keys
    outside: list[str] = field(default_factory=list)  # safetensors: leaves outside the exported sub-tree
    subtree: str = ""  # safetensors: the key path exported ("" for the whole tree)


def detect_format(path: Any) -> Literal["native", "orbax"]:
    """The format of the checkpoint at ``path``."""
    return layouts.detect(folder_of(path)).name


def convert(src: Any, dst: Any, *, to: Format | None = None, serializer: str | None = None,
            subtree: str | None = None, progress: bool = False) -> ConvertResult:
    """Converts the checkpoint ``src`` into ``dst`` (which must not exist).

    ``to``: "native", "orbax" (default: the other layout than ``src``'s) or "safetensors" (the array
    leaves under ``subtree`` as one .safetensors file; ``subtree`` defaults to "params" when the tree has
    it, else the whole tree). Attribute containers (TrainState fields) become dicts, as in a restore
    without a target; step, metrics and user metadata are carried over where the layout has room."""
    to = to or ("native" if detect_format(src) == "orbax" else "orbax")
    if to not in ("native", "orbax", "safetensors"):
        raise ValueError(f"unknown target format {to!r}; use 'native', 'orbax' or 'safetensors'")
    leaves = Leaves(src)
    if to == "safetensors":
        return _export_safetensors(leaves, dst, subtree, progress)
    tree, nbytes = _read_tree(leaves, leaves.keys(), progress)
    info = leaves.info
    if to == "orbax":
        api.save(dst, tree, metadata=info.metadata, format="orbax")
    else:
        api.save(dst, tree, metadata=info.metadata, step=info.step, metrics=info.metrics, serializer=serializer)
    return ConvertResult(os.fspath(dst), to, len(leaves.keys()), nbytes)


def _read_tree(leaves: Leaves, keys: list[str], progress: bool) -> tuple[Any, int]:
    total = sum(leaves.nbytes(k) for k in keys)
    items = []
    with bar(total, "read", progress) as b:
        for k in keys:
            items.append((leaves.records[k].path, _as_saved(leaves.info.leaves[k].kind, leaves.value(k))))
            b.update(leaves.nbytes(k))
    return tree_mod.nest(items), total


def _as_saved(kind: str, value: Any) -> Any:
    """A leaf saved as a jax.Array goes back as one (on the host CPU device), so the converted
    checkpoint records the same kind of leaf; its sharding is not kept (no mesh to rebuild it on)."""
    if kind == "jax" and isinstance(value, np.ndarray):
        return jax.device_put(value, jax.devices("cpu")[0])
    return value


def _select(keys: list[str], subtree: str | None) -> tuple[list[str], str]:
    """The keys under ``subtree`` and the prefix to strip from them."""
    if subtree is None:
        subtree = "params" if any(k.startswith("params/") for k in keys) else ""
    prefix = subtree.strip("/") + "/" if subtree.strip("/") else ""
    chosen = [k for k in keys if k.startswith(prefix)]
    if not chosen:
        raise CheckpointError(f"no leaves under {subtree!r}; the checkpoint's top-level keys are "
                              f"{format_list(sorted({k.split('/')[0] for k in keys}))}")
    return chosen, prefix


def _export_safetensors(leaves: Leaves, dst: Any, subtree: str | None, progress: bool) -> ConvertResult:
    from safetensors.numpy import save_file

    dst = os.fspath(dst)
    if os.path.lexists(dst):
        raise CheckpointExistsError(f"{dst} exists; exports are never overwritten (choose another name)")
    keys, prefix = _select(leaves.keys(), subtree)
    outside = [k for k in leaves.keys() if k not in set(keys)]
    arrays = [k for k in keys if leaves.info.leaves[k].kind in ("jax", "numpy")]
    exported = set(arrays)
    skipped = [k for k in keys if k not in exported]
    names = {k: ".".join(k[len(prefix):].split("/")) or "<root>" for k in arrays}
    _check_exportable(leaves, arrays, names)
    tensors, nbytes = {}, 0
    with bar(sum(leaves.nbytes(k) for k in arrays), "export", progress) as b:
        for k in arrays:
            tensors[names[k]] = np.ascontiguousarray(leaves.value(k))
            nbytes += leaves.nbytes(k)
            b.update(leaves.nbytes(k))
    meta = {"format": "flax_ckpt export", "source": str(leaves.info.path), "subtree": prefix.rstrip("/"),
            "step": json.dumps(leaves.info.step), "metrics": json.dumps(leaves.info.metrics)}
    folder, name = os.path.split(os.path.abspath(dst))
    try:
        commit_mod.commit_file(LocalStorage(folder), name, lambda tmp: save_file(tensors, tmp, metadata=meta),
                               replace=False)
    except CheckpointExistsError:
        raise CheckpointExistsError(f"{dst} appeared while exporting; not overwritten") from None
    return ConvertResult(dst, "safetensors", len(arrays), nbytes, skipped, outside, prefix.rstrip("/"))


_SAFETENSORS_DTYPES = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                       "float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz",
                       "float8_e5m2", "float8_e5m2fnuz", "complex64"}


def _check_exportable(leaves: Leaves, arrays: list[str], names: dict[str, str]) -> None:
    """Collects every leaf safetensors cannot hold (dtype, or a tensor name taken twice) into one error."""
    bad = [f"{k} ({leaves.info.leaves[k].dtype})" for k in arrays
           if getattr(leaves.info.leaves[k].dtype, "name", None) not in _SAFETENSORS_DTYPES]
    seen: dict[str, str] = {}
    for k in arrays:
        if names[k] in seen:
            bad.append(f"{k} and {seen[names[k]]} both map to tensor name {names[k]!r}")
        seen.setdefault(names[k], k)
    if bad:
        raise CheckpointError(f"cannot export to safetensors (nothing was written): {format_list(bad)}. "
                              "Cast those leaves, or export another --subtree.")
