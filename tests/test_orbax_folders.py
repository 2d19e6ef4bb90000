"""Orbax items of one folder per array (``use_ocdbt=False``) read without tensorstore (orbax/folders.py):
bit-exact against what Orbax wrote (every dtype, zarr v2 and zarr3, arrays of many chunks), any box of
arrays of many chunks and inner chunks, damage named, and what it does not read handed to tensorstore
(which then reads it, after the walk)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
import forkserver
from flax_ckpt._src import tools
from flax_ckpt._src.orbax import folders
from flax_ckpt._src.orbax import read as orbax_read
from helpers import assert_bit_exact
from trees import every_dtype


def _orbax_save(path, tree, zarr3: bool) -> str:
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=zarr3)).save(
        path, args=ocp.args.PyTreeSave(tree)
    )
    return str(path)


@pytest.fixture
def opens(monkeypatch):
    """The tensorstore arrays orbax/read.py opens (a list of their kvstore paths), counted."""
    seen = []

    class Counted:
        def __getattr__(self, name):
            return getattr(ts, name)

        @staticmethod
        def open(spec, *args, **kwargs):
            seen.append(spec["kvstore"]["path"])
            return ts.open(spec, *args, **kwargs)

    monkeypatch.setattr(orbax_read, "ts", Counted())
    return seen


def _tree() -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    big = np.arange(600 * 520, dtype=np.float32).reshape(600, 520) / 7
    return {
        "dtypes": every_dtype(),
        "sharded": jax.device_put(big, NamedSharding(mesh, P("a", "b"))),  # Orbax: a chunk per shard
        "rows": jax.device_put(np.arange(64 * 3, dtype=np.int32).reshape(64, 3), NamedSharding(mesh, P("a"))),
        "zero_d": np.array(7, np.int64),
    }


@pytest.mark.parametrize("zarr3", [True, False], ids=["zarr3", "zarr2"])
def test_orbax_folders_restore_bit_exact_without_tensorstore(tmp_path, opens, zarr3):
    tree = _tree()
    if not zarr3:  # tensorstore's zarr v2 has no 4-bit integers
        tree["dtypes"].pop("int4")
    path = _orbax_save(tmp_path / "o", tree, zarr3)
    assert len(os.listdir(os.path.join(path, "sharded", "c" if zarr3 else ""))) >= 4  # many chunk files
    assert_bit_exact(fc.restore(path, tree), tree, types=False)
    assert_bit_exact(fc.restore(path), jax.tree.map(np.asarray, tree), types=False)
    info = fc.metadata(path)
    assert (
        info.leaves["sharded"].shape == (600, 520) and str(info.leaves["dtypes/bfloat16"].dtype) == "bfloat16"
    )
    assert opens == []
    with pytest.MonkeyPatch.context() as m:  # the same step through tensorstore gives the same leaves
        m.setattr(orbax_read, "_open_folders", lambda arrays: None)
        assert_bit_exact(fc.restore(path, tree), tree, types=False)
    assert len(opens) == len(jax.tree.leaves(tree))


def _folder(tmp_path, name, data, metadata, driver):
    """An array folder written by tensorstore with the given zarr metadata."""
    path = str(tmp_path / name)
    store = ts.open(
        {"driver": driver, "kvstore": {"driver": "file", "path": path}, "metadata": metadata},
        create=True,
        dtype=data.dtype.name,
    ).result()
    store.write(data).result()
    return path


SHARDED = {
    "shape": [10, 13],
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 6]}},
    "codecs": [
        {
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": [2, 3],
                "codecs": [
                    {"name": "bytes", "configuration": {"endian": "little"}},
                    {"name": "zstd"},
                    {"name": "crc32c"},
                ],
                "index_codecs": [
                    {"name": "bytes", "configuration": {"endian": "little"}},
                    {"name": "crc32c"},
                ],
            },
        }
    ],
}
LAYOUTS = {  # name: (driver, metadata)
    "zarr3-sharded": ("zarr3", SHARDED),
    "zarr3-index-first": (
        "zarr3",
        {
            **SHARDED,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {**SHARDED["codecs"][0]["configuration"], "index_location": "start"},
                }
            ],
        },
    ),
    "zarr3-big-endian": (
        "zarr3",
        {
            "shape": [10, 13],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [3, 5]}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}],
        },
    ),
    "zarr3-v2-keys": (
        "zarr3",
        {
            "shape": [10, 13],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
            "chunk_key_encoding": {"name": "v2"},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
        },
    ),
    "zarr2-slash": (
        "zarr",
        {
            "shape": [10, 13],
            "chunks": [3, 4],
            "dimension_separator": "/",
            "compressor": {"id": "zstd", "level": 1},
        },
    ),
    "zarr2-fortran": ("zarr", {"shape": [10, 13], "chunks": [4, 5], "order": "F", "compressor": None}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_any_box_of_an_array_of_many_chunks(tmp_path, layout):
    driver, metadata = LAYOUTS[layout]
    data = np.arange(130, dtype=np.float32).reshape(10, 13) * 1.5 - 40
    if layout == "zarr3-big-endian":
        data = data.astype(np.int16)
    _folder(tmp_path, "a", data, metadata, driver)
    array = folders.FolderArray(str(tmp_path), "a", driver == "zarr3")
    assert array.shape == (10, 13) and array.dtype == data.dtype and array.stored_bytes() > 0
    rng = np.random.default_rng(0)
    boxes = [
        ((0, 10), (0, 13)),
        ((3, 4), (5, 6)),
        ((0, 0), (0, 13)),  # chunk-aligned boxes: decoded in place
        ((2, 4), (3, 6)),
        ((3, 6), (4, 8)),
        ((0, 3), (0, 5)),
        ((4, 8), (0, 13)),
        ((0, 4), (0, 4)),
    ]
    for _ in range(40):
        lo = rng.integers(0, [10, 13])
        boxes.append(tuple((int(a), int(rng.integers(a + 1, d + 1))) for a, d in zip(lo, (10, 13))))
    for box in boxes:
        out = np.full(tuple(e - s for s, e in box), -1, data.dtype)
        array.read(box, out)
        np.testing.assert_array_equal(out, data[tuple(slice(s, e) for s, e in box)], err_msg=str(box))


@pytest.fixture
def per_array(tmp_path):
    """An Orbax step of one folder per array (zarr3): w (1000 float32, one shard of one chunk)."""
    return _orbax_save(
        tmp_path / "o", {"w": np.arange(1000, dtype=np.float32), "b": np.ones(3, np.int8)}, True
    )


def _rewrite(path: str, change) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(change(data))


def _flip(at: int):
    def change(data):
        data[at] ^= 1
        return data

    return change


DAMAGE = {  # what is done to w/c/0 (a shard: one zstd chunk, then 16 bytes of index and its crc32c)
    "index-byte": (_flip(-10), "checksum mismatch"),
    "never-written": (lambda d: d[:-20] + b"\xff" * 16 + _crc(b"\xff" * 16), "was never written"),
    "past-the-end": (
        lambda d: (
            d[:-20]
            + (10**6).to_bytes(8, "little")
            + d[-12:-4]
            + _crc((10**6).to_bytes(8, "little") + d[-12:-4])
        ),
        "lies past",
    ),
    "truncated": (lambda d: d[:10], "too short for its shard index"),
    "zstd-byte": (_flip(8), "zstd"),
}


def _crc(b: bytes) -> bytes:
    return crc32c.crc32c(b).to_bytes(4, "little")


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_shard_is_named_and_nothing_returned(per_array, case):
    change, message = DAMAGE[case]
    _rewrite(os.path.join(per_array, "w", "c", "0"), change)
    with pytest.raises(fc.CorruptCheckpointError, match=f"reading 'w'.*{message}"):
        fc.restore(per_array)
    problems = tools.verify(per_array)
    assert [p.leaf for p in problems] == ["w"], problems
    np.testing.assert_array_equal(fc.restore(per_array, {"b": np.zeros(3, np.int8)}, partial=True)["b"], 1)


def test_zstd_chunk_with_bytes_past_its_frame_is_refused(tmp_path):
    path = _orbax_save(tmp_path / "o", {"w": np.arange(1000, dtype=np.float32)}, False)
    _rewrite(os.path.join(path, "w", "0"), lambda d: d + b"appended")
    with pytest.raises(fc.CorruptCheckpointError, match="bytes past its frame"):
        fc.restore(path)


def test_missing_chunk_is_damage_not_fill(per_array):
    os.remove(os.path.join(per_array, "w", "c", "0"))
    assert fc.metadata(per_array).leaves["w"].shape == (1000,)  # opening reads no array bytes
    with pytest.raises(fc.CorruptCheckpointError, match="reading 'w'.* is missing"):
        fc.restore(per_array)


def test_file_in_place_of_the_chunk_folder_is_refused(per_array):
    shutil.rmtree(os.path.join(per_array, "w", "c"))
    open(os.path.join(per_array, "w", "c"), "wb").close()
    with pytest.raises(fc.CorruptCheckpointError, match="is a file where a folder was expected"):
        fc.restore(per_array)


def test_what_folders_does_not_read_goes_to_tensorstore(tmp_path, opens):
    """An array with a codec orbax/folders.py does not read (zarr v2 zlib, written by tensorstore in place
    of Orbax's): the whole step is read through tensorstore, after the walk, bit-exact."""
    tree = {"w": np.arange(1000, dtype=np.float32), "b": np.ones((3, 4), np.int32)}
    path = _orbax_save(tmp_path / "o", tree, False)
    zarray = os.path.join(path, "w", ".zarray")
    meta = json.loads(open(zarray).read())
    shutil.rmtree(os.path.join(path, "w"))
    _folder(
        tmp_path / "o",
        "w",
        tree["w"],
        {"shape": meta["shape"], "chunks": meta["chunks"], "compressor": {"id": "zlib", "level": 1}},
        "zarr",
    )
    with pytest.raises(folders.Unsupported, match="compressor"):
        folders.FolderArray(path, "w", False)
    assert_bit_exact(fc.restore(path, tree), tree, types=False)
    assert sorted(os.path.basename(p.rstrip("/")) for p in opens) == ["b", "w"]


def test_chunk_symlink_inside_is_followed_through_tensorstore(tmp_path, opens):
    """A chunk file that is a symlink inside the checkpoint (found only when its array is read, or its
    size asked for the memory bound: 68 MiB declared) sends that array to tensorstore after the walk;
    the others stay with orbax/folders.py. Bit-exact."""
    tree = {"z": np.zeros(17 << 20, np.float32), "w": np.arange(1000, dtype=np.float32)}
    path = _orbax_save(tmp_path / "o", tree, True)
    os.rename(os.path.join(path, "z", "c", "0"), os.path.join(path, "z", "chunk"))
    os.symlink(os.path.join("..", "chunk"), os.path.join(path, "z", "c", "0"))
    assert_bit_exact(fc.restore(path), tree, types=False)
    assert [os.path.basename(p.rstrip("/")) for p in opens] == ["z"]


def test_restore_with_few_file_descriptors(tmp_path):
    """orbax/folders.py holds at most three fds per reading thread: 300 arrays (8 of them large,
    read on a pool of threads) restore bit-exact with RLIMIT_NOFILE at 24."""
    tree = {f"a{i}": np.full(40, i, np.float32) for i in range(300)}
    tree.update({f"big{i}": np.arange(1 << 19, dtype=np.float32) + i for i in range(8)})
    path = _orbax_save(tmp_path / "o", tree, True)
    code = textwrap.dedent(f"""
        import resource, numpy as np, flax_ckpt as fc
        resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))
        out = fc.restore({path!r})
        assert all(float(out[f"a{{i}}"][0]) == i for i in range(300))
        assert all(np.array_equal(out[f"big{{i}}"], np.arange(1 << 19, dtype=np.float32) + i) for i in range(8))
        print("RESTORED")
    """)
    r = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "RESTORED" in r.stdout, r.stdout + r.stderr
