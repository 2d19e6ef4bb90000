"""Hostile checkpoints: crafted folders and manifests, every field with a wrong type, and a fuzzer.

Scope: building bad input and judging that restore refuses it (a CheckpointError), reads nothing
outside the checkpoint folder (files outside hold valid copies of the data, so reading them would be
seen as a successful restore), writes nothing anywhere, and stays within bounded memory. A crafted
manifest gets a valid checksum (helpers.write_manifest_body), so validation itself is what is tested.
Shared by tests/test_reliability_hostile.py and benchmarks/faults.py.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import shutil
import stat
from typing import Any, Callable, Iterator

import numpy as np
from basics import as_bytes, edit_manifest, encode_manifest, leaf_of, manifest_body, write_manifest_raw
from reliability_trials import EXACT, Outcome, Tally, restore_exact, warnings_of

import flax_ckpt as fc
from flax_ckpt._src.checks import MANIFEST

SKIP = "skip"  # a case this machine cannot build (mknod without privilege)


def hostile_tree(step: int) -> dict:
    """Every leaf kind, plus a 1 MiB leaf that crafted chunks can alias."""
    import jax

    rng = np.random.default_rng(40_000 + step)
    return {
        "a": np.arange(24, dtype=np.float32).reshape(4, 6) + step,
        "big": rng.standard_normal((512, 512)).astype(np.float32),
        "b": {"c": np.full((5,), step, np.int16)},
        "s": step,
        "f": 1.5,
        "t": "text",
        "n": None,
        "e": [],
        "k": jax.random.key(step),
        "l": [np.ones(2, np.float64), 2],
    }


# --------------------------------------------------------------------------------- crafted folders


def _data_file(ck: str) -> str:
    return next(iter(manifest_body(ck)["files"]))


def _retarget(ck: str, name: str) -> None:
    """Points every chunk of the first data file (and its size entry) at ``name``."""

    def change(body: dict) -> None:
        old = next(iter(body["files"]))
        body["files"][name] = body["files"].pop(old)
        for lf in body["leaves"]:
            for ch in lf.get("chunks", []):
                if ch.get("file") == old:
                    ch["file"] = name

    edit_manifest(ck, change)


def _outside_copy(ck: str, name: str, out: str) -> str:
    """A valid copy of ``ck/name`` outside the checkpoint: reading it would restore correctly."""
    dst = os.path.join(out, name.replace("/", "_"))
    src = os.path.join(ck, name)
    (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, dst)
    return dst


def traversal(ck: str, out: str) -> None:
    copy_ = _outside_copy(ck, _data_file(ck), out)
    _retarget(ck, os.path.relpath(copy_, ck))


def absolute(ck: str, out: str) -> None:
    _retarget(ck, _outside_copy(ck, _data_file(ck), out))


def _replace_with_symlink(ck: str, name: str, out: str) -> None:
    copy_ = _outside_copy(ck, name, out)
    path = os.path.join(ck, name)
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    os.symlink(copy_, path)


def symlink_file(ck: str, out: str) -> None:
    _replace_with_symlink(ck, _data_file(ck), out)


def symlink_folder(ck: str, out: str) -> None:
    _replace_with_symlink(ck, "data", out)


def symlink_manifest(ck: str, out: str) -> None:
    _replace_with_symlink(ck, MANIFEST, out)


def symlink_zarr_array(ck: str, out: str) -> None:
    _replace_with_symlink(ck, "z/0", out)


def zarr_key_traversal(ck: str, out: str) -> None:
    name = leaf_of(manifest_body(ck), "a")["chunks"][0]["array"]
    shutil.copytree(os.path.join(ck, name), os.path.join(out, "arr"))
    outside = os.path.relpath(os.path.join(out, "arr"), ck)
    edit_manifest(ck, lambda b: leaf_of(b, "a")["chunks"][0].update(array=outside))


def zarr_narrow_stored_dtype(ck: str, out: str) -> None:
    """Rewrites leaf 'a' (float32[4,6]) as a valid zarr3 array of uint8[4,6], and says so in the
    manifest's stored_dtype: the bytes cannot fill a float32 leaf."""
    import tensorstore as ts

    name = leaf_of(manifest_body(ck), "a")["chunks"][0]["array"]
    shutil.rmtree(os.path.join(ck, name))
    arr = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": os.path.join(ck, name) + "/"},
            "metadata": {
                "shape": [4, 6],
                "data_type": "uint8",
                "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 6]}},
            },
        },
        create=True,
    ).result()
    arr.write(np.arange(24, dtype=np.uint8).reshape(4, 6)).result()
    edit_manifest(ck, lambda b: leaf_of(b, "a")["chunks"][0].update(stored_dtype="uint8"))


def _special(ck: str, name: str, make: Callable[[str], None]) -> str | None:
    path = os.path.join(ck, name)
    os.unlink(path)
    try:
        make(path)
    except PermissionError:
        return SKIP
    return None


def fifo_data(ck: str, out: str) -> None:
    _special(ck, _data_file(ck), os.mkfifo)


def fifo_manifest(ck: str, out: str) -> None:
    _special(ck, MANIFEST, os.mkfifo)


def device_data(ck: str, out: str) -> str | None:
    return _special(
        ck, _data_file(ck), lambda p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    )  # /dev/zero


def symlink_loop(ck: str, out: str) -> None:
    _special(ck, _data_file(ck), lambda p: os.symlink(os.path.basename(p), p))


def data_is_folder(ck: str, out: str) -> None:
    _special(ck, _data_file(ck), os.mkdir)


def overflowing_shape(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: leaf_of(b, "a").update(shape=[2**40, 2**40]))


def beyond_memory(ck: str, out: str) -> None:
    """A consistent manifest (sizes, chunk, checksum count) claiming a 4 TiB leaf."""

    def change(body: dict) -> None:
        lf, n = leaf_of(body, "a"), 4 << 40
        name = lf["chunks"][0]["file"]
        body["files"][name] = n
        lf.update(
            shape=[1 << 20, 1 << 20],
            chunks=[
                {
                    "index": [[0, 1 << 20], [0, 1 << 20]],
                    "file": name,
                    "offset": 0,
                    "nbytes": n,
                    "block": n,
                    "crc32c": [0],
                }
            ],
        )

    edit_manifest(ck, change)


def aliased_chunks(ck: str, out: str) -> None:
    """100 chunk records that all point at the same valid 1 MiB (checksums right): a 100 MiB leaf."""

    def change(body: dict) -> None:
        lf = leaf_of(body, "big")
        (ch,) = lf["chunks"]
        lf["shape"] = [512 * 100, 512]
        lf["chunks"] = [dict(ch, index=[[512 * i, 512 * (i + 1)], [0, 512]]) for i in range(100)]

    edit_manifest(ck, change)


def deep_path(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: leaf_of(b, "s").update(path=[["key", "d"]] * 10_000))


def deep_metadata(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: b.update(metadata=json.loads("[" * 100 + "]" * 100)))


def deeper_than_json(ck: str, out: str) -> None:
    raw = open(os.path.join(ck, MANIFEST), "rb").read()
    write_manifest_raw(ck, raw.replace(b'"metadata":null', b'"metadata":' + b"[" * 200_000 + b"]" * 200_000))


def huge_manifest(ck: str, out: str) -> None:
    """1 GiB (sparse): refused by its size, without reading it."""
    with open(os.path.join(ck, MANIFEST), "r+b") as f:
        f.truncate(1 << 30)


def version_true(ck: str, out: str) -> None:
    raw = open(os.path.join(ck, MANIFEST), "rb").read()
    write_manifest_raw(ck, raw.replace(b'"version": 1', b'"version": true'))


def leaf_in_leaf(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: b["leaves"].append(dict(leaf_of(b, "t"), path=[["key", "s"], ["key", "x"]])))


def duplicate_key(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: b["leaves"].append(dict(leaf_of(b, "t"), path=[["attr", "t"]])))


def mixed_node(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: leaf_of(b, "t").update(path=[["idx", 0]]))


def list_gap(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: leaf_of(b, "t").update(path=[["key", "g"], ["idx", 2**31 - 1]]))


def chunk_past_file(ck: str, out: str) -> None:
    edit_manifest(ck, lambda b: leaf_of(b, "a")["chunks"][0].update(offset=10**9))


CASES: dict[str, tuple[tuple[str, ...], Callable[[str, str], Any]]] = {
    "path traversal (../)": (("raw",), traversal),
    "absolute path": (("raw",), absolute),
    "symlinked data file to outside": (("raw",), symlink_file),
    "symlinked data folder to outside": (("raw",), symlink_folder),
    "symlinked manifest to outside": (("raw", "zarr3"), symlink_manifest),
    "symlinked zarr3 array to outside": (("zarr3",), symlink_zarr_array),
    "zarr3 array path outside": (("zarr3",), zarr_key_traversal),
    "zarr3 stored dtype narrower than the leaf": (("zarr3",), zarr_narrow_stored_dtype),
    "FIFO as data file": (("raw",), fifo_data),
    "FIFO as manifest": (("raw",), fifo_manifest),
    "device node as data file": (("raw",), device_data),
    "symlink loop": (("raw",), symlink_loop),
    "folder as data file": (("raw",), data_is_folder),
    "shape whose byte count overflows": (("raw", "zarr3"), overflowing_shape),
    "4 TiB leaf, consistent manifest": (("raw",), beyond_memory),
    "aliased chunks (100x amplification)": (("raw",), aliased_chunks),
    "key path 10000 deep": (("raw", "zarr3"), deep_path),
    "metadata 100 deep": (("raw",), deep_metadata),
    "JSON 200000 deep": (("raw",), deeper_than_json),
    "1 GiB manifest": (("raw",), huge_manifest),
    "version true": (("raw",), version_true),
    "leaf inside a leaf": (("raw",), leaf_in_leaf),
    "duplicate key path": (("raw",), duplicate_key),
    "list and dict in one node": (("raw",), mixed_node),
    "list index 2^31": (("raw",), list_gap),
    "chunk past the end of its file": (("raw",), chunk_past_file),
    "unknown serializer": (
        ("raw",),
        lambda ck, out: edit_manifest(ck, lambda b: b.update(serializer="pickle")),
    ),
    "object dtype": (
        ("raw", "zarr3"),
        lambda ck, out: edit_manifest(ck, lambda b: leaf_of(b, "a").update(dtype="finfo")),
    ),
    "unknown PRNG impl": (
        ("raw",),
        lambda ck, out: edit_manifest(ck, lambda b: leaf_of(b, "k").update(key_impl="nope")),
    ),
}


def _snapshot(folder: str) -> dict[str, tuple]:
    """Every entry under ``folder`` with what a write would change (lstat: links are not followed)."""
    out = {}
    for r, ds, fs in os.walk(folder):
        for name in ds + fs:
            st = os.lstat(os.path.join(r, name))
            out[os.path.join(r, name)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pair(base: str, name: str, serializer: str) -> tuple[str, str]:
    """``base/name`` with two good steps (1 and 2), and an empty folder beside it for outside files."""
    d, out = os.path.join(base, name), os.path.join(base, name + "-outside")
    for p in (d, out):
        shutil.rmtree(p, ignore_errors=True)
    os.makedirs(out)
    for s in (1, 2):
        fc.save(os.path.join(d, str(s)), hostile_tree(s), serializer=serializer)
    return d, out


def hostile_trial(base: str, case: str, serializer: str, memory_limit: int = 200 << 20) -> Outcome | None:
    """Crafts step 2 by ``case``; a restore of it must be refused with a CheckpointError, change no
    file, stay under ``memory_limit`` more peak memory, and a manager must restore step 1 instead."""
    d, out = pair(base, "hostile", serializer)
    try:
        if CASES[case][1](os.path.join(d, "2"), out) == SKIP:
            return None
        before, rss = _snapshot(base), _peak_rss()
        try:
            fc.restore(os.path.join(d, "2"))
            return Outcome("corrupt", f"{case} ({serializer}): the crafted checkpoint was accepted")
        except fc.CheckpointError:
            pass
        except Exception as e:  # noqa: BLE001
            return Outcome("error", f"{case} ({serializer}): undocumented {type(e).__name__}: {e}")
        if _snapshot(base) != before:
            return Outcome("corrupt", f"{case} ({serializer}): files changed during a refused restore")
        if _peak_rss() - rss > memory_limit:
            return Outcome(
                "error", f"{case} ({serializer}): peak memory grew by {(_peak_rss() - rss) >> 20} MiB"
            )
        with warnings_of(), fc.CheckpointManager(d) as mgr:
            return restore_exact(mgr.restore, hostile_tree(1), f"{case} ({serializer}): manager fallback")
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


# ------------------------------------------------------------------------------ wrong types, fuzzing

MISSING = object()  # a mutation that deletes the field
WRONG_VALUES: tuple[Any, ...] = (
    MISSING,
    None,
    True,
    -1,
    2**70,
    0.5,
    float("nan"),
    "",
    "../x",
    "/etc/passwd",
    [],
    [0, 0],
    {},
    {"k": 1},
)


def positions(obj: Any, at: tuple = ()) -> Iterator[tuple]:
    """The path (keys and indices) of every value inside ``obj``, itself excluded."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield at + (k,)
        yield from positions(v, at + (k,))


def mutate(body: dict, pos: tuple, value: Any) -> dict | None:
    """A deep copy of ``body`` with the value at ``pos`` replaced (or deleted, for MISSING); None when
    ``pos`` no longer exists in it."""
    out = copy.deepcopy(body)
    node = out
    try:
        for k in pos[:-1]:
            node = node[k]
        if value is MISSING:
            del node[pos[-1]]
        else:
            node[pos[-1]] = value
    except (KeyError, IndexError, TypeError):
        return None
    return out


def same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


def wrong_type_mutants(body: dict) -> Iterator[tuple[str, dict]]:
    """Every field of ``body`` deleted, and replaced by each of WRONG_VALUES that differs from it."""
    for pos in positions(body):
        node = _at(body, pos)
        for v in WRONG_VALUES:
            if v is MISSING or not same(node, v):
                m = mutate(body, pos, v)
                if m is not None:
                    yield f"{'/'.join(map(str, pos))} = {'<missing>' if v is MISSING else repr(v)}", m


def consistent(got: Any, original: Any) -> bool:
    """A restore of a crafted manifest may rename or drop leaves; it must never return other bytes
    for a leaf it keeps with the same key path, dtype and shape."""
    flat_o = dict(_walk(original))
    for key, x in _walk(got):
        o, g = flat_o.get(key), x
        if o is not None and len(o) == 3 and len(g) == 3 and o[:2] == g[:2] and o != g:
            return False
    return True


def _walk(tree: Any, at: str = "") -> Iterator[tuple[str, tuple]]:
    """(key string, as_bytes(leaf)) of nested dicts and lists (whatever their keys)."""
    if isinstance(tree, (dict, list)) and tree:
        for k, v in tree.items() if isinstance(tree, dict) else enumerate(tree):
            yield from _walk(v, f"{at}/{k}")
    else:
        yield at, as_bytes(tree)


def judge_manifest(ck: str, data: bytes, original: Any, what: str) -> Outcome:
    """Writes manifest bytes into ``ck``: restore must refuse them with a CheckpointError, or return
    a tree consistent with what is stored."""
    write_manifest_raw(ck, data)
    try:
        fc.metadata(ck)
    except fc.CheckpointError:
        pass
    except Exception as e:  # noqa: BLE001
        return Outcome("error", f"{what}: fc.metadata: undocumented {type(e).__name__}: {e}")
    try:
        got = fc.restore(ck)
    except fc.CheckpointError:
        return EXACT
    except RecursionError as e:
        return Outcome("error", f"{what}: RecursionError: {e}")
    except Exception as e:  # noqa: BLE001
        return Outcome("error", f"{what}: undocumented {type(e).__name__}: {e}")
    return EXACT if consistent(got, original) else Outcome("corrupt", f"{what}: restored other bytes")


def wrong_types_trial(base: str, serializer: str, tally: Tally) -> None:
    d, out = pair(base, "wrong-types", serializer)
    ck, original = os.path.join(d, "2"), hostile_tree(2)
    try:
        for what, body in wrong_type_mutants(manifest_body(ck)):
            tally.add(judge_manifest(ck, encode_manifest(body), original, f"{serializer}: {what}"))
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def fuzz_trial(base: str, serializer: str, examples: int, tally: Tally, *, derandomize: bool = True) -> None:
    """Hypothesis over manifests: up to 4 random edits (a field replaced by any JSON value, deleted,
    or a new field added, then a valid checksum), or raw byte edits of the file. Every example must be
    refused with a CheckpointError or restore consistently (judge_manifest)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    d, out = pair(base, "fuzz", serializer)
    ck, original = os.path.join(d, "2"), hostile_tree(2)
    body0 = manifest_body(ck)
    raw0 = open(os.path.join(ck, MANIFEST), "rb").read()
    spots = list(positions(body0))
    folders = [()] + [p for p in spots if isinstance(_at(body0, p), dict)]  # where "add" puts a field
    names = st.sampled_from(
        [
            "path",
            "kind",
            "dtype",
            "shape",
            "chunks",
            "value",
            "py_type",
            "empty",
            "key_impl",
            "key_shape",
            "index",
            "file",
            "offset",
            "nbytes",
            "block",
            "crc32c",
            "array",
            "key",
            "stored_dtype",
            "sharding",
            "files",
            "leaves",
            "serializer",
            "step",
            "metrics",
        ]
    )
    words = st.sampled_from(
        [
            "../x",
            "/etc/passwd",
            "data/../../x",
            MANIFEST,
            "finfo",
            "object",
            "bfloat16",
            "int4",
            "uint2",
            "float32",
            "threefry2x32",
            "rbg",
            "zarr3",
            "raw",
            "idx",
            "key",
            "attr",
            "jax",
            "numpy",
            "prng_key",
            "scalar",
            "string",
            "empty",
            "none",
            "complex",
        ]
    )
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-3, 70)
        | st.integers(-(2**70), 2**70)
        | st.floats()
        | st.text(max_size=12)
        | words
    )
    values = st.recursive(
        scalars,
        lambda c: st.lists(c, max_size=4) | st.dictionaries(names | st.text(max_size=4), c, max_size=4),
        max_leaves=10,
    )
    edit_ = st.one_of(
        st.tuples(st.just("set"), st.sampled_from(spots), values),
        st.tuples(st.just("del"), st.sampled_from(spots), st.none()),
        st.tuples(st.just("add"), st.sampled_from(folders), st.tuples(names, values)),
    )
    byte_edit = st.tuples(st.integers(0, len(raw0) - 1), st.integers(0, 255))

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.one_of(
            st.tuples(st.just("body"), st.lists(edit_, min_size=1, max_size=4)),
            st.tuples(st.just("bytes"), st.lists(byte_edit, min_size=1, max_size=4)),
        )
    )
    def example(case: tuple) -> None:
        kind, edits = case
        if kind == "bytes":
            data = bytearray(raw0)
            for i, b in edits:
                data[i] = b
            outcome = judge_manifest(ck, bytes(data), original, f"byte edits {edits}")
        else:
            body = body0
            for op, pos, arg in edits:
                body = _apply(body, op, pos, arg) or body
            outcome = judge_manifest(ck, encode_manifest(body), original, f"body edits {edits}"[:2000])
        tally.add(outcome)
        assert outcome.ok, outcome.detail

    try:
        example()
    except AssertionError:
        pass  # counted in the tally, with its (shrunk) detail
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def _at(obj: Any, pos: tuple) -> Any:
    for k in pos:
        obj = obj[k]
    return obj


def _apply(body: dict, op: str, pos: tuple, arg: Any) -> dict | None:
    if op == "set":
        return mutate(body, pos, arg)
    if op == "del":
        return mutate(body, pos, MISSING)
    out = copy.deepcopy(body)
    try:
        node = _at(out, pos)
    except (KeyError, IndexError, TypeError):
        return None
    if isinstance(node, dict):
        node[arg[0]] = arg[1]
    elif isinstance(node, list):
        node.append(arg[1])
    else:
        return None
    return out
