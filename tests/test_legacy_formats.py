"""Other libraries' checkpoint files read as restore Sources (foreign/): legacy Flax msgpack files
(``flax.training.checkpoints.save_checkpoint`` with Orbax off, ``flax.serialization.to_bytes``) and
.safetensors files. Written by flax and safetensors themselves; restored bit-exact against flax's own
restore; listed, shown and converted by the flax-ckpt command; and every truncated or crafted file a
CorruptCheckpointError naming the file (and the key path where there is one), raised fast, with
bounded memory and nothing handed back.
"""

from __future__ import annotations

import inspect
import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
import warnings

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src import layouts
from flax_ckpt._src import tools as fi
from flax_ckpt._src.engine.reader import Source
from flax_ckpt._src.storage import open_storage
from helpers import Within, assert_bit_exact, leaf_bytes
from trees import every_dtype, train_state_tree

flax = pytest.importorskip("flax")
from flax import serialization  # noqa: E402
from flax.training import checkpoints  # noqa: E402


def _state() -> dict:
    """A Linen TrainState (params and adamw state) beside leaves of every kind flax's msgpack stores."""
    rng = np.random.default_rng(0)
    return {
        "train": train_state_tree(),
        "extra": {
            "bf16": jnp.asarray(rng.standard_normal((3, 4)), jnp.bfloat16),
            "c64": (rng.standard_normal(5) + 1j * rng.standard_normal(5)).astype(np.complex64),
            "i8": np.arange(-4, 4, dtype=np.int8),
            "u32": np.arange(6, dtype=np.uint32).reshape(2, 3),
            "b": np.array([True, False]),
            "f64": np.float64(2.5),
            "py_complex": complex(1.5, -2.0),
            "py_int": -(2**40),
            "py_float": -0.0,
            "text": "héllo",
            "none": None,
            "empty": {},
        },
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A directory of flax's checkpoint_<step> files: steps 1..6 with keep=2 and keep_every_n_steps=3."""
    root = tmp_path_factory.mktemp("legacy") / "run"
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flax.config.update("flax_use_orbax_checkpointing", False)
        try:
            for step in range(1, 7):
                checkpoints.save_checkpoint(str(root), state, step=step, keep=2, keep_every_n_steps=3)
        finally:
            flax.config.update("flax_use_orbax_checkpointing", True)
    return root, state


def test_a_save_checkpoint_file_restores_bit_exact_as_flax_restores_it(run):
    root, state = run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = checkpoints.restore_checkpoint(str(root), state, step=6)
    got = fc.restore(root / "checkpoint_6", state)
    assert type(got["train"]) is type(state["train"]) and got["train"].tx is state["train"].tx
    assert_bit_exact(got, want, types=False)
    assert isinstance(got["train"].params["params"]["kernel"], jax.Array)
    assert type(got["extra"]["py_complex"]) is complex and type(got["extra"]["f64"]) is np.float64
    info = fc.metadata(root / "checkpoint_6")
    assert (info.step, info.format, info.metrics, info.metadata) == (6, "flax_msgpack", None, None)
    assert info.leaves["extra/bf16"].dtype == jnp.bfloat16 and info.leaves["extra/c64"].shape == (5,)


def test_without_a_target_a_file_restores_as_flax_msgpack_restore_gives_it(run):
    root, _ = run
    raw = (root / "checkpoint_5").read_bytes()
    want = serialization.msgpack_restore(raw)
    got = fc.restore(root / "checkpoint_5")
    assert leaf_bytes(got) == leaf_bytes(want)


def test_to_bytes_of_every_dtype_round_trips(tmp_path):
    tree = {
        "arrays": every_dtype(),
        "zero_d": np.float32(2.5),
        "empty": np.zeros((0, 4), np.float32),
        "nested": [1, [2.5, "x"], None],
    }
    (tmp_path / "state.msgpack").write_bytes(serialization.to_bytes(tree))
    got = fc.restore(tmp_path / "state.msgpack")
    for name, arr in tree["arrays"].items():
        assert leaf_bytes(got["arrays"][name]) == leaf_bytes(arr), name
    assert got["nested"] == {
        "0": 1,
        "1": {"0": 2.5, "1": "x"},
        "2": None,
    }  # flax's state dicts key lists by str
    assert fc.metadata(tmp_path / "state.msgpack").step is None  # no step in the name


def test_chunked_arrays_restore(tmp_path, monkeypatch):
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)  # flax chunks arrays over 1 GiB; 64 bytes here
    tree = {"big": np.arange(100, dtype=np.float32).reshape(10, 10), "small": np.ones(3, np.int8)}
    raw = serialization.to_bytes(tree)
    assert b"__msgpack_chunked_array__" in raw
    (tmp_path / "checkpoint_1").write_bytes(raw)
    assert leaf_bytes(fc.restore(tmp_path / "checkpoint_1")) == leaf_bytes(tree)
    got = fc.restore(tmp_path / "checkpoint_1", jax.tree.map(jnp.asarray, tree))
    assert_bit_exact(got, tree, types=False)
    source = layouts.open_checkpoint(open_storage(tmp_path / "checkpoint_1"))
    [leaf] = [x for x in source.leaves if x.name == "big"]
    out = np.empty((3, 4), np.float32)
    source.read(leaf, ((2, 5), (3, 7)), out)  # a box of a chunked array (a sharded target's shard)
    np.testing.assert_array_equal(out, tree["big"][2:5, 3:7])


def test_a_run_directory_of_files_is_listed_and_named(run):
    root, _ = run
    steps = sorted(int(p.name.split("_")[1]) for p in root.iterdir())
    assert steps == [1, 4, 5, 6]  # what flax kept: keep=2, and steps 1 and 4 by keep_every_n_steps=3
    entries = fi.list_steps(root)
    assert [(e.step, e.state, e.format) for e in entries] == [(s, "committed", "flax_msgpack") for s in steps]
    assert entries[0].nbytes == (root / "checkpoint_1").stat().st_size
    for call in (lambda: fc.restore(root), lambda: fc.metadata(root)):
        with pytest.raises(
            fc.CheckpointNotFoundError,
            match=r"directory of Flax checkpoint files, steps \[1, 4, 5, 6\]"
            r".*checkpoint_6",
        ):
            call()
    report = fi.check(root)
    assert report.steps == steps and not report.problems and report.unverified and not report.sound
    with fc.CheckpointManager(root) as mgr:  # a manager never continues (or lists) another library's files
        assert mgr.all_steps() == []


_CLI = """
import contextlib, io, json, sys
from flax_ckpt._src.tools.cli import main
results = []
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(args)
    results.append({"rc": rc, "out": out.getvalue()})
print(json.dumps(results))
"""


def test_the_command_lists_shows_verifies_and_converts_them(run, tmp_path):
    root, state = run
    calls = [
        ["ls", "--json", str(root)],
        ["info", "--json", str(root / "checkpoint_5")],
        ["verify", "--strict", "-q", str(root / "checkpoint_5")],
        ["convert", "--json", "-q", str(root / "checkpoint_5"), str(tmp_path / "native")],
    ]
    r = subprocess.run(
        [sys.executable, "-c", _CLI, json.dumps(calls)], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stderr
    ls, info, verify, convert = json.loads(r.stdout.splitlines()[-1])
    assert [x["rc"] for x in (ls, info, verify, convert)] == [0, 0, 3, 0], (r.stdout, r.stderr)
    assert [(s["step"], s["format"], s["state"]) for s in json.loads(ls["out"])["steps"]] == [
        (s, "flax_msgpack", "committed") for s in (1, 4, 5, 6)
    ]
    doc = json.loads(info["out"])
    assert doc["format"] == "flax_msgpack" and doc["step"] == 5
    assert {
        "key": "extra/bf16",
        "kind": "numpy",
        "dtype": "bfloat16",
        "shape": [3, 4],
        "nbytes": 24,
        "sharding": None,
    } in doc["leaves"]
    assert verify["out"].startswith("UNVERIFIED") and "legacy Flax msgpack" in verify["out"]
    assert json.loads(convert["out"])["to"] == "native"  # the default for a foreign file
    assert fc.metadata(tmp_path / "native").step == 5
    assert_bit_exact(fc.restore(tmp_path / "native", state), fc.restore(root / "checkpoint_5", state))


# ------------------------------------------------------------------------------ hostile msgpack files


def _refused(path, match: str, error: type = fc.CorruptCheckpointError, *, seconds: float = 3.0) -> None:
    """fc.restore of ``path`` raises ``error`` matching ``match`` within ``seconds`` (as on an idle
    machine: helpers.Within), allocating little."""
    with Within(seconds, f"the refusal of {os.path.basename(path)}"):  # its load probe runs untraced
        tracemalloc.start()
        try:
            with pytest.raises(error, match=match):
                fc.restore(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < max(64 << 20, 4 * os.path.getsize(path)), peak


def _ext_array(shape, dtype: str, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb((shape, dtype, data), use_bin_type=True))


def test_a_truncated_file_is_corrupt(run, tmp_path):
    raw = (run[0] / "checkpoint_6").read_bytes()
    for cut in (1, len(raw) // 2, len(raw) - 1):
        (tmp_path / "checkpoint_6").write_bytes(raw[:cut])
        _refused(tmp_path / "checkpoint_6", r"checkpoint_6: not a readable Flax msgpack file.*truncated")
    (tmp_path / "checkpoint_7").write_bytes(b"")
    _refused(tmp_path / "checkpoint_7", "is empty")
    (tmp_path / "checkpoint_8").write_bytes(raw + raw)
    _refused(tmp_path / "checkpoint_8", "bytes after the end")


@pytest.mark.parametrize(
    "name,data",
    [
        ("huge bin", b"\x81\xa1a\xc6\x7f\xff\xff\xff" + b"x" * 100),
        ("huge map", b"\xdf\xff\xff\xff\xff" + b"\xc0" * 100),
        ("huge array", b"\x81\xa1a\xdd\xff\xff\xff\xff" + b"\xc0" * 100),
        ("huge ext", b"\x81\xa1a\xc9\x7f\xff\xff\xff\x01" + b"x" * 100),
        ("huge str", b"\x81\xa1a\xdb\x7f\xff\xff\xff" + b"x" * 100),
        ("deep maps", b"\x81\xa1a" * 100_000 + b"\xc0"),
        ("deep lists", b"\x91" * 100_000 + b"\xc0"),
    ],
)
def test_huge_declared_sizes_and_deep_nesting_are_corrupt_fast(tmp_path, name, data):
    path = tmp_path / "checkpoint_1"
    path.write_bytes(data)
    _refused(path, "checkpoint_1")


def test_nesting_deeper_than_any_model_is_refused_by_its_depth(tmp_path):
    (tmp_path / "f").write_bytes(b"\x81\xa1a" * 600 + b"\xc0")  # msgpack reads it; flax_ckpt refuses it
    _refused(tmp_path / "f", "nested more than 512 deep")


@pytest.mark.parametrize(
    "value,match",
    [
        (_ext_array([2], "object", b"x" * 16), r"'params/w': its dtype object is not a numeric dtype"),
        (_ext_array([2], "U4", b"x" * 32), r"'params/w': its dtype U4 is not a numeric dtype"),
        (_ext_array([2], "V8", b"x" * 16), r"'params/w': its dtype V8"),
        (
            _ext_array([2, 3], "float32", b"x" * 20),
            r"'params/w': float32\[2,3\] needs 24 bytes but 20 are stored",
        ),
        (
            _ext_array([2**40, 2**40], "float32", b"x" * 8),
            r"'params/w': its array shape \[1099511627776, .* spans more",
        ),
        (_ext_array([-1], "float32", b""), r"'params/w': its array shape \[-1\]"),
        (msgpack.ExtType(1, b"\xc1garbage"), r"'params/w': its array record does not decode"),
        (msgpack.ExtType(9, b"abc"), r"'params/w': msgpack extension type 9 is none of Flax's"),
        (msgpack.ExtType(2, msgpack.packb(["a", "b"])), r"'params/w': its complex number is not"),
        (
            {
                "__msgpack_chunked_array__": True,
                "shape": {"0": 5},
                "chunks": {"0": _ext_array([2], "int8", b"ab")},
            },
            r"'params/w': a chunked array of shape \[5\] whose chunks hold 2 elements",
        ),
    ],
)
def test_a_crafted_array_is_corrupt_and_names_its_key_path(tmp_path, value, match):
    path = tmp_path / "checkpoint_3"
    path.write_bytes(msgpack.packb({"params": {"w": value, "ok": _ext_array([1], "float32", b"abcd")}}))
    _refused(path, match)


def test_every_damaged_leaf_is_named_in_one_error(tmp_path):
    bad = _ext_array([3], "float32", b"x")
    (tmp_path / "f").write_bytes(msgpack.packb({"a": bad, "b": {"c": bad}, "d": msgpack.ExtType(7, b"")}))
    _refused(tmp_path / "f", r"'a': .*'b/c': .*'d': msgpack extension type 7")


def test_leaves_flax_ckpt_has_no_kind_for_are_unsupported(tmp_path):
    (tmp_path / "f").write_bytes(
        msgpack.packb({"w": "//GDAPlaceholder:w", "b": b"raw bytes"}, use_bin_type=True)
    )
    _refused(
        tmp_path / "f",
        r"'w' \(an array saved by flax's save_checkpoint_multiprocess.*'b' \(a bytes value",
        fc.UnsupportedLeafError,
    )


def test_files_that_are_no_checkpoint_are_refused_by_name(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    _refused(
        tmp_path / "notes.txt",
        "is a file, not a checkpoint folder, and no checkpoint file flax_ckpt reads",
        fc.CheckpointNotFoundError,
    )
    os.mkfifo(tmp_path / "checkpoint_9")
    _refused(tmp_path / "checkpoint_9", "not a regular file")
    assert [(e.step, e.state) for e in fi.list_steps(tmp_path) if e.step == 9] == [(9, "invalid")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "checkpoint_4").write_bytes(serialization.to_bytes({"w": np.ones(2)}))
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(elsewhere / "checkpoint_4", run / "checkpoint_4")  # a link out of a run directory: no step
    assert fi.list_steps(run) == []
    np.testing.assert_array_equal(
        fc.restore(run / "checkpoint_4")["w"], np.ones(2)
    )  # named by the user: followed


# ------------------------------------------------------------------------------------- safetensors


def _safetensors(path, header: dict, data: bytes, *, length: int | None = None) -> None:
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head) if length is None else length) + head + data)


def test_an_export_round_trips_with_its_step_metrics_and_metadata(tmp_path):
    params = {
        "dense": {
            "kernel": jnp.asarray(np.arange(12.0).reshape(3, 4), jnp.bfloat16),
            "bias": np.arange(4, dtype=np.float32),
        },
        "emb": np.arange(6, dtype=np.int32).reshape(2, 3),
    }
    fc.save(
        tmp_path / "ck", {"params": params, "step": 7}, step=7, metrics={"loss": 0.5}, metadata={"lr": 0.1}
    )
    fi.convert(tmp_path / "ck", tmp_path / "model.safetensors", to="safetensors")
    got = fc.restore(tmp_path / "model.safetensors", params)
    assert_bit_exact(got, params, types=False)
    info = fc.metadata(tmp_path / "model.safetensors")
    assert (info.step, info.metrics, info.metadata, info.format) == (
        7,
        {"loss": 0.5},
        {"lr": 0.1},
        "safetensors",
    )
    fi.convert(tmp_path / "model.safetensors", tmp_path / "back")  # into the native layout by default
    assert fc.metadata(tmp_path / "back").step == 7
    assert_bit_exact(fc.restore(tmp_path / "back", params), params, types=False)


def test_names_with_dots_or_slashes_are_key_paths(tmp_path):
    from safetensors.numpy import save_file

    a, b = np.arange(6, dtype=np.float16).reshape(2, 3), np.ones(2, np.uint8)
    save_file(
        {"encoder.layer.0.w": a, "encoder.layer.0.b": b},
        str(tmp_path / "dots.safetensors"),
        metadata={"source": "elsewhere"},
    )
    save_file({"encoder/layer.0/w": a}, str(tmp_path / "slashes.safetensors"))
    got = fc.restore(tmp_path / "dots.safetensors")
    assert leaf_bytes(got) == leaf_bytes({"encoder": {"layer": {"0": {"w": a, "b": b}}}})
    assert fc.metadata(tmp_path / "dots.safetensors").metadata == {"source": "elsewhere"}
    assert leaf_bytes(fc.restore(tmp_path / "slashes.safetensors")) == leaf_bytes(
        {"encoder": {"layer.0": {"w": a}}}
    )
    target = {
        "encoder": {"layer": {"0": {"w": jnp.zeros((2, 3), jnp.float16), "b": jnp.zeros(2, jnp.uint8)}}}
    }
    assert_bit_exact(
        fc.restore(tmp_path / "dots.safetensors", target),
        {"encoder": {"layer": {"0": {"w": a, "b": b}}}},
        types=False,
    )
    src = layouts.open_checkpoint(open_storage(tmp_path / "dots.safetensors"))
    [leaf] = [x for x in src.leaves if x.name == "encoder/layer/0/w"]
    out = np.empty((1, 2), np.float16)
    src.read(leaf, ((1, 2), (0, 2)), out)
    np.testing.assert_array_equal(out, a[1:2, 0:2])


def test_rename_maps_safetensors_names_onto_a_target(tmp_path):
    if "rename" not in inspect.signature(fc.restore).parameters:
        pytest.skip("fc.restore has no rename= yet")
    from safetensors.numpy import save_file

    w = np.arange(4, dtype=np.float32)
    save_file({"model.encoder.w": w}, str(tmp_path / "m.safetensors"))
    got = fc.restore(
        tmp_path / "m.safetensors",
        {"backbone": {"w": jnp.zeros(4)}},
        rename={r"model/encoder/(.*)": r"backbone/\1"},
    )
    np.testing.assert_array_equal(got["backbone"]["w"], w)


def _good_header(n: int = 2) -> dict:
    return {
        "a": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
        "b": {"dtype": "I8", "shape": [4], "data_offsets": [4 * n, 4 * n + 4]},
    }


@pytest.mark.parametrize(
    "header,data,length,match",
    [
        (_good_header(), b"x" * 12, 2**62, r"its header claims \d+ bytes, more than the"),
        (_good_header(), b"x" * 12, 2**40, r"its header claims"),
        (_good_header(), b"x" * 12, 5, r"its header is not valid JSON"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "I8", "shape": [4], "data_offsets": [4, 8]},
            },
            b"x" * 8,
            None,
            r"tensors 'a' and 'b' overlap",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            b"x" * 12,
            None,
            r"bytes 0 to 4 of the data",
        ),
        (_good_header(), b"x" * 13, None, r"1 bytes after the last tensor"),
        (_good_header(), b"x" * 11, None, r"'b': data_offsets \[8, 12\] are not within the 11 bytes"),
        (
            {"a": {"dtype": "OBJ", "shape": [1], "data_offsets": [0, 8]}},
            b"x" * 8,
            None,
            r"'a': dtype 'OBJ' is none of",
        ),
        (
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"x" * 8,
            None,
            r"'a': float32\[3\] needs 12 bytes, its offsets span 8",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2**61, 2**61], "data_offsets": [0, 8]}},
            b"x" * 8,
            None,
            r"'a': shape \[2305843009213693952, .* spans more",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "a.b": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
            },
            b"x" * 8,
            None,
            r"'a\.b': its key path passes through the leaf 'a'",
        ),
        ({"__metadata__": {"step": 3}}, b"", None, r"__metadata__ is not a map of strings"),
    ],
)
def test_a_crafted_safetensors_header_is_corrupt_fast(tmp_path, header, data, length, match):
    path = tmp_path / "m.safetensors"
    _safetensors(path, header, data, length=length)
    _refused(path, match)


def test_a_truncated_or_deeply_nested_safetensors_file_is_corrupt(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones((64, 64), np.float32)}, str(tmp_path / "m.safetensors"))
    raw = (tmp_path / "m.safetensors").read_bytes()
    for cut in (4, 20, len(raw) - 1):
        (tmp_path / "t.safetensors").write_bytes(raw[:cut])
        _refused(tmp_path / "t.safetensors", "t.safetensors")
    head = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / "deep.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
    _refused(tmp_path / "deep.safetensors", "not valid JSON|not a JSON object")


def test_a_file_changed_while_open_is_never_read_as_a_mix(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(8, np.float32)}, str(tmp_path / "m.safetensors"))
    source = layouts.open_checkpoint(open_storage(tmp_path / "m.safetensors"))
    save_file({"w": np.zeros(16, np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(fc.CorruptCheckpointError, match="changed while it was being read"):
        source.read(source.leaves[0], ((0, 8),), np.empty(8, np.float32))


# ------------------------------------------------------------------------------------- the protocol


def test_the_file_sources_and_layouts_implement_the_whole_protocol(run, tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "m.safetensors"))
    for path, name in (
        (run[0] / "checkpoint_6", "flax_msgpack"),
        (tmp_path / "m.safetensors", "safetensors"),
    ):
        folder = open_storage(path)
        fmt = layouts.recognize(folder)
        assert fmt.name == name and fmt.evident and fmt.foreign
        missing = sorted(
            m
            for m in set(vars(layouts.Layout)) | set(layouts.Layout.__annotations__)
            if not m.startswith("_") and not hasattr(fmt, m)
        )
        assert not missing, missing
        source = fmt.open(folder)
        members = set(vars(Source)) | set(Source.__annotations__)
        assert not sorted(m for m in members if not m.startswith("_") and not hasattr(source, m))
        seen: list[int] = []
        assert source.verify(seen.append) == []
        assert sum(seen) == sum(leaf.nbytes for leaf in source.leaves if leaf.is_array)
        assert source.unchecked() == [leaf.name for leaf in source.leaves if leaf.kind != "empty"]
        with pytest.raises(ValueError, match="never writes them"):
            fmt.snapshot({"w": np.ones(2)}, copy=False)
        with pytest.raises(fc.TargetMismatchError, match="without item="):
            fmt.open(folder, "state")
