"""The serializers: shards of arrays -> stored chunks, and back; and how one is found by its name.

The protocol and its record types are base.py's (public: ``fc.Serializer``, ``fc.ArrayItem``, ...).
Beside it: ``raw`` (numpy only: packed raw bytes with crc32c per block; the default, chosen by
benchmarks/bench_serializers.py), ``zarr3`` (one tensorstore zarr3 array per leaf, crc32c codec) and
``checked`` (any other serializer, with the library's checksums around it). Here: the box arithmetic
serializers share, and ``get_serializer``, the one place a name becomes a serializer: built-in names,
then installed packages' entry points in the group ENTRY_POINTS (explicit: a package
declares its serializer in its metadata, so every process finds it, ``flax-ckpt verify`` included).
There is no registry to mutate at run time.
"""

from __future__ import annotations

import re
from importlib import metadata as importlib_metadata
from types import EllipsisType
from typing import cast

from flax_ckpt._src.serializers.base import ArrayItem, Box, Serializer, Shard, StoredArray, Written

ENTRY_POINTS = "flax_ckpt.serializers"  # the entry-point group of installed serializers
BUILT_IN = ("raw", "zarr3")
_RESERVED = (*BUILT_IN, "tensorstore")  # no serializer may take these names
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A jax shard index (slices, possibly open-ended) as a box in an array of ``shape``."""
    return tuple(sl.indices(d)[:2] for sl, d in zip(index, shape))


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(s < e for s, e in out) or not out else None


def local(box: Box, origin: Box) -> tuple[slice | EllipsisType, ...]:
    """``box`` as slices relative to ``origin``'s start (an Ellipsis for 0-d, so indexing gives a view)."""
    if not box:
        return (Ellipsis,)
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(box, origin))


def for_each_overlap(leaf: StoredArray, box: Box):
    """Yields (chunk record, chunk box, overlap box) for every chunk of ``leaf`` that intersects ``box``."""
    for chunk in leaf.chunks:
        cbox = tuple(tuple(b) for b in chunk["index"])
        ov = intersect(cbox, box)
        if ov is not None:
            yield chunk, cbox, ov


def get_serializer(spec: "str | Serializer | None") -> Serializer:
    """The serializer ``spec`` names or is: None or "raw" (the default), "zarr3", the
    name of an installed one (an entry point of the group ENTRY_POINTS), or an instance. Any serializer
    that is not built in comes wrapped in the library's checksums (checked.Checked). A name found
    nowhere is a ValueError that says how to make it known."""
    from flax_ckpt._src.serializers.checked import Checked
    from flax_ckpt._src.serializers.raw import RawSerializer
    from flax_ckpt._src.serializers.zarr3 import Zarr3Serializer

    if spec is None or spec == "raw":
        return RawSerializer()
    if spec == "zarr3":
        # It takes a TensorstoreStorage, which every storage flax_ckpt makes is (local, kvstore).
        return cast(Serializer, Zarr3Serializer())
    if spec == "tensorstore":
        raise ValueError(
            "unknown serializer 'tensorstore': the serializer built on tensorstore is called 'zarr3' "
            "(pass serializer='zarr3')"
        )
    if isinstance(spec, str):
        return Checked(_installed(spec))
    if isinstance(spec, (RawSerializer, Zarr3Serializer, Checked)):
        return spec
    return Checked(spec)


def serializer_for(name: str, given: Serializer | None = None) -> Serializer:
    """The serializer a manifest's ``name`` calls for: ``given`` (the instance a caller passed, such as
    a manager's ``serializer=``, already through get_serializer) when it bears that name, else the one
    get_serializer finds by the name."""
    return given if given is not None and getattr(given, "name", None) == name else get_serializer(name)


def check_name(serializer: object) -> str:
    """The serializer's ``name``, refused (ValueError) unless it can name it in a manifest: a short
    word of letters, digits, '_', '.', '-', not one of the built-in names."""
    name = getattr(serializer, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED:
        raise ValueError(
            f"{type(serializer).__name__}.name = {name!r}: a serializer's name must be a short word "
            f"(letters, digits, '_', '.', '-'; a letter first) other than {', '.join(BUILT_IN)}"
        )
    return name


def _installed(name: str) -> Serializer:
    """The serializer an installed package declares as entry point ``name`` of ENTRY_POINTS, built
    with no arguments."""
    found = importlib_metadata.entry_points(group=ENTRY_POINTS, name=name) if isinstance(name, str) else ()
    if not found:
        raise ValueError(
            f"unknown serializer {name!r:.80}: neither built in (raw, zarr3) nor declared by an installed package "
            f"(entry-point group {ENTRY_POINTS!r}). Install the package whose serializer wrote it; that package "
            f'declares it in its pyproject.toml as [project.entry-points."{ENTRY_POINTS}"] {name:.80} = '
            '"your_module:YourSerializer"; or pass the instance: fc.restore(path, serializer=YourSerializer()), '
            "fc.CheckpointManager(directory, serializer=YourSerializer()) (README: Writing a serializer)"
        )
    eps = sorted({(ep.value, ep) for ep in found}, key=lambda p: p[0])
    if len(eps) > 1:
        raise ValueError(
            f"serializer {name!r} is declared by several installed packages "
            f"({', '.join(v for v, _ in eps)}); uninstall all but one"
        )
    ep = eps[0][1]
    try:
        made = ep.load()()
    except Exception as e:  # noqa: BLE001 - a plugin's import or constructor failing, whatever the cause
        raise ValueError(
            f"serializer {name!r}: loading entry point {ep.value!r} failed: {type(e).__name__}: {e}"
        ) from e
    if getattr(made, "name", None) != name:
        raise ValueError(
            f"serializer {name!r}: entry point {ep.value!r} built a serializer named "
            f"{getattr(made, 'name', None)!r}; the two names must agree"
        )
    return made


__all__ = [
    "ArrayItem",
    "BUILT_IN",
    "Box",
    "ENTRY_POINTS",
    "Serializer",
    "Shard",
    "StoredArray",
    "Written",
    "box_of",
    "check_name",
    "for_each_overlap",
    "get_serializer",
    "intersect",
    "local",
    "serializer_for",
]
