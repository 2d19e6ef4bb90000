"""The public serializer protocol, from a user's side: examples/npy_serializer.py, written from ``fc``
names alone, saves and restores bit-exactly (through fc.save and a CheckpointManager, into another
sharding), is found by name through an installed package's entry point (in this process and in
``flax-ckpt verify``), and has every stored byte checked by the library: a damaged .npy is reported
naming its leaf and file. An unknown serializer name says how to make it known."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from helpers import assert_bit_exact, leaf_chunks, manifest_body, worker_env
from trees import mixed_tree

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
from npy_serializer import NpySerializer  # noqa: E402


def _install(site: Path) -> None:
    """A package's metadata declaring the example's entry point, as pip would install it."""
    info = site / "npy_serializer_example-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: npy-serializer-example\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[flax_ckpt.serializers]\nnpy = npy_serializer:NpySerializer\n")


@pytest.fixture
def installed(tmp_path, monkeypatch) -> dict[str, str]:
    """The example installed as a package (its entry point visible in this process); returns the
    environment of a child process that sees it too."""
    site = tmp_path / "site"
    _install(site)
    monkeypatch.syspath_prepend(str(site))
    env = worker_env()
    env["PYTHONPATH"] = f"{site}:{EXAMPLES}:{env['PYTHONPATH']}"
    return env


def _verify(path: Path, env: dict[str, str]) -> tuple[int, dict]:
    p = subprocess.run(
        [sys.executable, "-m", "flax_ckpt", "verify", "--json", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, json.loads(p.stdout)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_every_leaf_round_trips_bit_exactly(tmp_path, installed, where):
    tree = mixed_tree()
    path = str(tmp_path / "ck") if where == "local" else f"memory://npy-{uuid.uuid4().hex}/ck"
    fc.save(path, tree, serializer=NpySerializer())
    assert_bit_exact(fc.restore(path, tree), tree)
    assert fc.metadata(path).serializer == "npy"


def test_files_are_plain_npy_with_the_librarys_checksums_beside(tmp_path):
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    fc.save(tmp_path / "ck", {"x": x, "b": jnp.ones(3, jnp.bfloat16)}, serializer=NpySerializer())
    body = manifest_body(tmp_path / "ck")
    (chunk,) = leaf_chunks(tmp_path / "ck")["x"]
    np.testing.assert_array_equal(np.load(tmp_path / "ck" / chunk["file"]), x)
    assert body["serializer"] == "npy" and chunk["file"] + ".crc32c" in body["files"]
    assert all((tmp_path / "ck" / f).stat().st_size == n for f, n in body["files"].items())


def test_manager_saves_and_restores_with_the_serializer(tmp_path, installed):
    state = {"w": np.arange(1000, dtype=np.float64), "step": 3}
    with fc.CheckpointManager(tmp_path / "run", serializer=NpySerializer(), max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, dict(state, step=step))
        mgr.wait_until_finished()
        stats = mgr.stats[-1]
    assert (
        stats.written_bytes > 8000 and stats.serialize_s > 0 and stats.fsync_s > 0
    )  # from Written, not a clock
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.all_steps() == [2, 3]
        assert_bit_exact(mgr.restore(), dict(state, step=3), types=False)


def test_restore_into_another_sharding(tmp_path, installed):
    x = jax.device_put(
        jnp.arange(8 * 12, dtype=jnp.float32).reshape(8, 12),
        NamedSharding(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b")), P("a", "b")),
    )
    fc.save(tmp_path / "ck", {"x": x}, serializer=NpySerializer())
    assert len(leaf_chunks(tmp_path / "ck")["x"]) == 4
    for sharding in (
        NamedSharding(Mesh(np.array(jax.devices()[:8]), ("d",)), P(None, None)),
        NamedSharding(Mesh(np.array(jax.devices()[:3]), ("d",)), P(None, "d")),
        NamedSharding(Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b")), P("b", "a")),
    ):
        out = fc.restore(tmp_path / "ck", {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)})
        assert out["x"].sharding == sharding
        assert_bit_exact(out, {"x": x}, {"x": sharding})


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "delete checksums"])
def test_damaged_chunk_is_named_by_verify_and_restore(tmp_path, installed, damage):
    tree = {"params": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8), "bias": np.zeros(8)}}
    path = tmp_path / "ck"
    fc.save(path, tree, serializer=NpySerializer())
    rc, doc = _verify(path, installed)
    assert rc == 0 and doc["ok"] and doc["verified"], doc
    victim = path / leaf_chunks(path)["params/kernel"][0]["file"]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-7] ^= 0x10  # an element, past the .npy header: np.load alone would not notice
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-4]))
    elif damage == "delete":
        victim.unlink()
    else:
        Path(f"{victim}.crc32c").unlink()
    with pytest.raises(fc.CorruptCheckpointError, match="params/kernel") as e:
        fc.restore(path)
    assert victim.name in str(e.value)
    rc, doc = _verify(path, installed)
    assert rc == 1 and not doc["ok"]
    leaf_problems = [p for p in doc["problems"] if p["leaf"]]
    assert [p["leaf"] for p in leaf_problems] == ["params/kernel"], doc["problems"]
    assert leaf_problems[0]["file"].endswith(victim.name) and victim.name in leaf_problems[0]["message"]
    bias = {"params": {"bias": tree["params"]["bias"]}}
    assert_bit_exact(fc.restore(path, bias, partial=True), bias)  # the undamaged leaf still restores


def test_unknown_serializer_name_says_how_to_make_it_known(tmp_path):
    path = tmp_path / "ck"
    fc.save(path, {"w": np.ones(3)}, serializer=NpySerializer())  # saving needs no installation
    with pytest.raises(fc.InvalidManifestError) as e:
        fc.restore(path)
    msg = str(e.value)
    assert "unknown serializer 'npy'" in msg and str(path) in msg
    assert '[project.entry-points."flax_ckpt.serializers"] npy = ' in msg
    p = subprocess.run(
        [sys.executable, "-m", "flax_ckpt", "verify", str(path)],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "unknown serializer 'npy'" in p.stdout and "entry-points" in p.stdout


def test_an_instance_passed_to_restore_reads_what_it_wrote_without_installation(tmp_path):
    tree = mixed_tree()
    fc.save(tmp_path / "ck", tree, serializer=NpySerializer())
    assert fc.metadata(tmp_path / "ck", serializer=NpySerializer()).serializer == "npy"
    assert_bit_exact(fc.restore(tmp_path / "ck", tree, serializer=NpySerializer()), tree)
    fc.save(tmp_path / "raw", tree)  # a checkpoint of another serializer ignores the instance
    assert_bit_exact(fc.restore(tmp_path / "raw", tree, serializer=NpySerializer()), tree)
    with fc.CheckpointManager(tmp_path / "run", serializer=NpySerializer()) as mgr:
        mgr.save(1, tree)
    with fc.CheckpointManager(tmp_path / "run", serializer=NpySerializer()) as mgr:  # a new process's manager
        assert mgr.latest_step() == 1
        assert_bit_exact(mgr.restore(target=tree), tree)


def test_tensorstore_is_no_serializer_name(tmp_path):
    with pytest.raises(ValueError, match="the serializer built on tensorstore is called 'zarr3'"):
        fc.save(tmp_path / "ck", {"w": np.ones(3)}, serializer="tensorstore")
    assert not (tmp_path / "ck").exists()


def test_installed_serializer_is_found_by_its_name_when_saving(tmp_path, installed):
    fc.save(tmp_path / "ck", {"w": np.arange(5)}, serializer="npy")
    assert manifest_body(tmp_path / "ck")["serializer"] == "npy"
    np.testing.assert_array_equal(fc.restore(tmp_path / "ck")["w"], np.arange(5))


class _Bad(NpySerializer):
    def __init__(self, name="bad", file=None, record_file=True):
        self.name, self.file, self.record_file = name, file, record_file

    def write(self, storage, items, *, tag):
        chunks = {}
        for item in items:
            name = self.file or f"{tag}.{item.leaf}"
            storage.write(name, [item.shards[0].data])
            chunks[item.leaf] = [
                {"index": [list(b) for b in item.shards[0].box]}
                | ({"file": name} if self.record_file else {})
            ]
        return fc.Written(chunks)


@pytest.mark.parametrize(
    "bad, message",
    [
        (_Bad(name="raw"), "name must be a short word"),
        (_Bad(name="a b"), "name must be a short word"),
        (_Bad(file="shared.bin"), "start with the tag 'p0'"),
        (_Bad(file="p0.x.crc32c"), "the library's checksum files"),
        (_Bad(file="../p0.x"), "not a relative path inside"),
        (_Bad(record_file=False), "every chunk record names the object"),
    ],
)
def test_a_serializer_breaking_the_contract_is_refused_and_nothing_is_committed(tmp_path, bad, message):
    with pytest.raises((ValueError, fc.SaveFailedError), match=message):
        fc.save(tmp_path / "ck", {"w": np.ones(4)}, serializer=bad)
    assert not (tmp_path / "ck").exists()


def test_readme_section_shows_the_examples_code():
    """The "Writing a serializer" guide's code (docs/serializer.md) is the example's (its lines, comments
    aside), so it cannot drift from the code this file runs."""
    guide = (EXAMPLES.parent / "docs" / "serializer.md").read_text()
    block = guide.split("```python\n", 1)[1].split("```", 1)[0]
    source = {
        line.split("  #")[0].strip() for line in (EXAMPLES / "npy_serializer.py").read_text().splitlines()
    }
    shown = [line.split("  #")[0].strip() for line in block.splitlines()]
    missing = [
        line
        for line in shown
        if line and line != "..." and not line.startswith(("fc.", "def ")) and line not in source
    ]
    assert not missing, missing


def test_a_subclass_without_read_is_refused_before_anything_is_written(tmp_path):
    class WriteOnly(fc.Serializer):
        name = "write-only"

        def write(self, storage, items, *, tag):
            return fc.Written({})

    with pytest.raises(TypeError, match="WriteOnly is not a Serializer: it has no read method"):
        fc.save(tmp_path / "ck", {"w": np.ones(2)}, serializer=WriteOnly())
    assert not (tmp_path / "ck").exists()
