"""``flax-ckpt convert``: native <-> Orbax layout, or an export of the arrays to one .safetensors file;
legacy Flax msgpack and .safetensors files convert into either layout.

Scope: reading every leaf of a checkpoint and writing it in another format, with the checkpoint's step,
metrics and user metadata wherever the target can hold them; what it cannot hold is named in the
result (``skipped``, ``outside``: leaves; ``fields_left_out``: step). Writing the formats is api.py's
(native, Orbax) and safetensors'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np

from flax_ckpt._src import api, layouts
from flax_ckpt._src import tree as tree_mod
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.errors import CheckpointError, CheckpointExistsError, format_list
from flax_ckpt._src.orbax import locate as orbax_locate
from flax_ckpt._src.storage import LocalStorage, split_location
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
    fields_left_out: dict[str, str] = field(default_factory=dict)  # {"step": why}: not carried over

    @property
    def left_out(self) -> int:
        """How many things of ``src`` are not in ``dst``: leaves (skipped, outside) and fields."""
        return len(self.skipped) + len(self.outside) + len(self.fields_left_out)


def detect_format(path: Any) -> str:
    """The format of the checkpoint at ``path`` (layouts.detect's name: "native", "orbax", "flax_msgpack",
    "safetensors")."""
    return layouts.detect(folder_of(path)).name


def convert(
    src: Any,
    dst: Any,
    *,
    to: Format | None = None,
    serializer: str | None = None,
    subtree: str | None = None,
    progress: bool = False,
) -> ConvertResult:
    """Converts the checkpoint ``src`` into ``dst`` (which must not exist).

    ``to``: "native", "orbax" (default: the other layout than ``src``'s; "native" for a legacy Flax
    msgpack or a .safetensors ``src``) or "safetensors" (the array
    leaves under ``subtree`` as one .safetensors file; ``subtree`` defaults to "params" when the tree has
    it, else the whole tree). Attribute containers (TrainState fields) become dicts, as in a restore
    without a target. Step, metrics and user metadata are carried over: into Orbax's layout the step
    only when ``dst``'s name is that step's (``.../3``, ``.../ckpt_3``: then ``dst`` is a
    CheckpointManager step; else a StandardCheckpointer folder, and the step is in
    ``fields_left_out``); into safetensors as JSON strings in the file's metadata."""
    to = to or ("orbax" if detect_format(src) == "native" else "native")
    if to not in ("native", "orbax", "safetensors"):
        raise ValueError(f"unknown target format {to!r}; use 'native', 'orbax' or 'safetensors'")
    leaves = Leaves(src)
    if to == "safetensors":
        return _export_safetensors(leaves, dst, subtree, progress)
    info = leaves.info
    step, left_out = _orbax_step(src, dst, info.step) if to == "orbax" else (info.step, {})
    tree, nbytes = _read_tree(leaves, leaves.keys(), progress)
    if to == "orbax":
        api.save(dst, tree, metadata=info.metadata, step=step, metrics=info.metrics, format="orbax")
    else:
        api.save(
            dst, tree, metadata=info.metadata, step=info.step, metrics=info.metrics, serializer=serializer
        )
    return ConvertResult(os.fspath(dst), to, len(leaves.keys()), nbytes, fields_left_out=left_out)


def _orbax_step(src: Any, dst: Any, step: int | None) -> tuple[int | None, dict[str, str]]:
    """The step an Orbax ``dst`` records, and the step left out: Orbax's layout records a step only as
    the name of a CheckpointManager step folder. A ``dst`` named for another step is refused (it
    would list as that step), before anything is read."""
    if step is None:
        return None, {}
    parent, name = split_location(dst)
    named = orbax_locate.step_number(name)
    if named == step:
        return step, {}
    if named is not None:
        raise CheckpointError(
            f"{dst}: its name is that of an Orbax step folder of step {named}, but {src} is step {step}, and "
            f"Orbax's layout records a step only as its folder's name; nothing was written. Convert into "
            f"{parent.url}/{step} (or <prefix>_{step}) to keep the step, or into a name that is no step number"
        )
    return None, {
        "step": f"step {step}: Orbax's layout records a step only as the name of a step folder, and "
        f"{name!r} names none; convert into {parent.url}/{step} to keep it"
    }


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
        raise CheckpointError(
            f"no leaves under {subtree!r}; the checkpoint's top-level keys are "
            f"{format_list(sorted({k.split('/')[0] for k in keys}))}"
        )
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
    names = {k: ".".join(k[len(prefix) :].split("/")) or "<root>" for k in arrays}
    _check_exportable(leaves, arrays, names)
    tensors, nbytes = {}, 0
    with bar(sum(leaves.nbytes(k) for k in arrays), "export", progress) as b:
        for k in arrays:
            tensors[names[k]] = np.ascontiguousarray(leaves.value(k))
            nbytes += leaves.nbytes(k)
            b.update(leaves.nbytes(k))
    meta = {
        "format": "flax_ckpt export",
        "source": str(leaves.info.path),
        "subtree": prefix.rstrip("/"),
        "step": json.dumps(leaves.info.step),
        "metrics": json.dumps(leaves.info.metrics),
        "metadata": json.dumps(leaves.info.metadata),
    }
    folder, name = os.path.split(os.path.abspath(dst))
    try:
        commit_mod.commit_file(
            LocalStorage(folder), name, lambda tmp: _save_file(save_file, tensors, tmp, meta), replace=False
        )
    except CheckpointExistsError:
        raise CheckpointExistsError(f"{dst} appeared while exporting; not overwritten") from None
    return ConvertResult(dst, "safetensors", len(arrays), nbytes, skipped, outside, prefix.rstrip("/"))


def _save_file(save_file: Any, tensors: dict[str, np.ndarray], tmp: str, meta: dict[str, str]) -> None:
    """safetensors' save_file, with the mode every file of a checkpoint gets (0o644 less the umask:
    storage/local.py's): safetensors creates its file 0o600 whatever the umask. The mode is that of
    ``tmp`` created first by os.open, so the umask is read without changing it (os.umask would, for
    every thread)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
    save_file(tensors, tmp, metadata=meta)
    os.chmod(tmp, mode)


_SAFETENSORS_DTYPES = {
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "complex64",
}


def _check_exportable(leaves: Leaves, arrays: list[str], names: dict[str, str]) -> None:
    """Collects every leaf safetensors cannot hold (dtype, or a tensor name taken twice) into one error."""
    bad = [
        f"{k} ({leaves.info.leaves[k].dtype})"
        for k in arrays
        if getattr(leaves.info.leaves[k].dtype, "name", None) not in _SAFETENSORS_DTYPES
    ]
    seen: dict[str, str] = {}
    for k in arrays:
        if names[k] in seen:
            bad.append(f"{k} and {seen[names[k]]} both map to tensor name {names[k]!r}")
        seen.setdefault(names[k], k)
    if bad:
        raise CheckpointError(
            f"cannot export to safetensors (nothing was written): {format_list(bad)}. "
            "Cast those leaves, or export another --subtree."
        )
