"""Hostile folders read by restore, info, verify and convert (issue 24, items 4, 6, 7, 8): chunks that
overlap and leave elements unwritten (native manifests sealed with valid checksums, memory-tier
copies), Orbax folders with symlinks leading out, FIFOs and hard links (real ones), Orbax arrays
declaring more than the folder can hold and zstd chunks expanding past their declared size.

Whatever could hang or allocate without bound runs in a child process with a timeout and an address
space limit, so that a regression fails the test instead of hanging it or exhausting the machine.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import textwrap

import crc32c
import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src import checks as fmt
from flax_ckpt._src import tools
from flax_ckpt._src.tiers import store as tier_store
from helpers import assert_bit_exact, manifest_body, worker_env, write_manifest_body

ocp = pytest.importorskip("orbax.checkpoint")

SECRET = np.full(1000, 7.0, np.float32)  # the outside file's values: never restored


def run_py(code: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """``code`` in a child Python (JAX on CPU, 8 GiB of address space at most), its output captured;
    the test fails (TimeoutExpired) rather than hangs when the child blocks."""
    head = "import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))\n"
    return forkserver.run(
        [sys.executable, "-c", head + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=worker_env(1),
    )


def cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flax_ckpt", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=worker_env(1),
    )


# -------------------------------------------------------------------- item 4: exact chunk coverage


def _craft(path, w: np.ndarray, boxes: list[list[tuple[int, int]]]) -> None:
    """A native checkpoint of ``w`` whose manifest lists ``boxes`` as the chunks of leaf "w": each
    chunk's bytes (the box of ``w``) written to a data file of its own layout, every checksum valid,
    the manifest sealed. Only the coverage can be wrong."""
    fc.save(path, {"w": w})
    body = manifest_body(path)
    chunks, parts, offset = [], [], 0
    for box in boxes:
        raw = np.ascontiguousarray(w[tuple(slice(s, e) for s, e in box)]).tobytes()
        chunks.append(
            {
                "block": 16,
                "crc32c": [crc32c.crc32c(raw[k : k + 16]) for k in range(0, len(raw), 16)]
                or [crc32c.crc32c(b"")],
                "file": "data/crafted.bin",
                "index": [list(b) for b in box],
                "nbytes": len(raw),
                "offset": offset,
            }
        )
        parts.append(raw)
        offset += len(raw)
    with open(os.path.join(path, "data", "crafted.bin"), "wb") as f:
        f.write(b"".join(parts))
    body["files"]["data/crafted.bin"] = offset
    body["leaves"][0]["chunks"] = chunks
    write_manifest_body(path, body)


def _one_d(n: int, boxes: list[tuple[int, int]], path) -> np.ndarray:
    w = np.arange(n, dtype=np.float32) + 1000
    _craft(path, w, [[b] for b in boxes])
    return w


def _overlapping(n: int) -> list[tuple[int, int]]:
    return [(0, 2), (1, 2)] + [(i, i + 1) for i in range(3, n)]  # element 1 twice, element 2 never


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [100, 5000])  # below and above the 4,096 chunks of the old pairwise check
def test_overlapping_chunks_with_valid_checksums_are_refused(tmp_path, n):
    path = tmp_path / "ov"
    _one_d(n, _overlapping(n), path)
    with pytest.raises(
        fc.InvalidManifestError,
        match=r"leaves\[0\]\.chunks \(leaf 'w'\).*element \[1\] is covered "
        r"by 2 chunks",
    ):
        fc.restore(path)
    r = cli("verify", str(path))
    assert r.returncode == 1 and "DAMAGED" in r.stdout and "leaf 'w'" in r.stdout, r.stdout + r.stderr


@pytest.mark.timeout(120)
def test_overlapping_chunks_of_a_two_dimensional_grid_are_refused(tmp_path):
    """70 x 70 one-element chunks; chunk (0, 0) grown to rows 0-1 overlaps chunk (1, 0); (2, 0) missing
    keeps the volume right."""
    shape = (70, 70)
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    path = tmp_path / "grid"
    _craft(
        path,
        w,
        [
            [(i, i + (2 if (i, j) == (0, 0) else 1)), (j, j + 1)]
            for i in range(shape[0])
            for j in range(shape[1])
            if (i, j) != (2, 0)
        ],
    )
    with pytest.raises(fc.InvalidManifestError, match=r"element \[1, 0\] is covered by 2 chunks"):
        fc.restore(path)


@pytest.mark.timeout(120)
def test_many_chunks_that_tile_exactly_restore_bit_exact(tmp_path):
    n = 5000
    w = _one_d(n, [(i, i + 1) for i in range(n)][::-1], tmp_path / "fine")  # any order
    assert_bit_exact(fc.restore(tmp_path / "fine"), {"w": w}, types=False)


def _brute(boxes, shape) -> np.ndarray:
    cov = np.zeros(shape, np.int64)
    for b in boxes:
        cov[tuple(slice(s, e) for s, e in b)] += 1
    return cov


@pytest.mark.parametrize("pairwise_max", [32, -1])  # -1: the numpy grid and corner checks at any size
def test_tiling_problem_agrees_with_counting_every_element(monkeypatch, pairwise_max):
    monkeypatch.setattr(fmt, "_PAIRWISE_MAX", pairwise_max)
    rng = random.Random(pairwise_max)
    for _ in range(600):
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        cuts = [sorted({0, d, *(rng.randint(0, d) for _ in range(rng.randint(0, 3)))}) for d in shape]
        boxes = [
            [[c[i], c[i + 1]] for c, i in zip(cuts, idx)] for idx in np.ndindex(*[len(c) - 1 for c in cuts])
        ]
        r = rng.random()
        if r < 0.25 and boxes:
            boxes.pop(rng.randrange(len(boxes)))
        elif r < 0.45:
            boxes.append(boxes[rng.randrange(len(boxes))])
        elif r < 0.8:
            for _ in range(rng.randint(1, 3)):
                box = []
                for d in shape:
                    s = rng.randint(0, d)
                    box.append([s, rng.randint(s, d)])
                boxes.append(box)
        rng.shuffle(boxes)
        cov = _brute(boxes, shape)
        problem = fmt.tiling_problem(boxes, [(0, d) for d in shape])
        assert (problem is None) == bool(np.all(cov == 1)), (shape, boxes, problem)
        if problem is not None and "is covered by" in problem:  # the element named is covered as said
            at = json.loads(problem.split("element ")[1].split(" is")[0])
            said = problem.split("covered by ")[1]
            assert cov[tuple(at)] == (0 if said.startswith("no") else int(said.split()[0])), (boxes, problem)
        elif problem is not None and "both cover" in problem:
            assert cov[tuple(json.loads(problem.split("element ")[1]))] >= 2, (boxes, problem)


@pytest.mark.timeout(60)
def test_tiling_check_of_a_million_chunks_is_fast():
    n = 1 << 20  # MAX_CHUNKS_PER_LEAF
    boxes = [[[i, i + 1]] for i in range(n)]
    assert fmt.tiling_problem(boxes, [(0, n)]) is None
    boxes[1] = [[0, 2]]
    boxes[2] = [[3, 3]]
    assert fmt.tiling_problem(boxes, [(0, n)]) == "element [0] is covered by 2 chunks"


@pytest.mark.timeout(180)
def test_memory_copy_whose_shards_overlap_falls_back_to_storage(tmp_path, caplog):
    """A sealed memory-tier index whose two shards [0, 4) and [2, 6) add up to the leaf's 8 elements
    but leave 6 and 7 unwritten: the copy is refused (the old volume count accepted it) and the
    manager restores the step from persistent storage."""
    tiers = fc.Tiers(local_dir=str(tmp_path / "shm"), persist_interval_steps=1, cleanup=False)
    w = np.arange(8, dtype=np.float32) + 1000
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        mgr.save(1, {"w": w})
        mgr.wait_until_finished()
        index = os.path.join(mgr.memory_tiers.local_dir, "1", tier_store.INDEX)
    body = json.loads(open(index, "rb").read())["body"]
    data = w.tobytes()
    body["shards"] = [
        {
            "box": [[s, s + 4]],
            "chunks": [["r", crc32c.crc32c(data[4 * s : 4 * s + 16]), 4 * s, 16]],
            "leaf": 0,
            "nbytes": 16,
            "primary": True,
        }
        for s in (0, 2)
    ]
    with open(index, "r+b") as f:
        f.truncate(0)
        f.write(tier_store.encode_index(body))
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers) as mgr:
        assert_bit_exact(mgr.restore(), {"w": w}, types=False)
        assert mgr.restore_stats[-1].tier != "local"
    assert "shards do not tile" in caplog.text and "element [2]" in caplog.text
    with fc.CheckpointManager(tmp_path / "ckpt", tiers=tiers, strict=True) as mgr:
        with pytest.raises(fc.CheckpointError):
            mgr.restore()


# --------------------------------------------------- items 6 and 7: Orbax folders walked before reading


@pytest.fixture(scope="module")
def orbax_folders(tmp_path_factory):
    """{"ocdbt": ..., "plain": ...}: Orbax (zarr3) checkpoints of {"w": arange(1000), "b": ones((3, 4))}
    in OCDBT and one folder per array, and "outside": the same layouts holding SECRET, outside them."""
    base = tmp_path_factory.mktemp("orbax")
    made = {}
    for name, ocdbt in (("ocdbt", True), ("plain", False)):
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=True)
        made[name] = base / name
        ocp.Checkpointer(handler).save(
            made[name],
            args=ocp.args.PyTreeSave(
                {"w": np.arange(1000, dtype=np.float32), "b": np.ones((3, 4), np.int32)}
            ),
        )
        made["outside-" + name] = base / ("outside-" + name)
        ocp.Checkpointer(handler).save(
            made["outside-" + name],
            args=ocp.args.PyTreeSave({"w": SECRET, "b": np.full((3, 4), 7, np.int32)}),
        )
    return made


def _copy(orbax_folders, layout: str, dst) -> str:
    shutil.copytree(orbax_folders[layout], dst)
    return str(dst)


def _ocdbt_data_file(path: str) -> str:
    d = os.path.join(path, "ocdbt.process_0", "d")
    return os.path.join(d, max(os.listdir(d), key=lambda f: os.path.getsize(os.path.join(d, f))))


LINKS = {  # what is replaced by a symlink to the same entry of the outside checkpoint
    "chunk": ("plain", "w/c/0"),
    "array-folder": ("plain", "w"),
    "d-folder": ("ocdbt", "ocdbt.process_0/d"),
    "ocdbt-manifest": ("ocdbt", "manifest.ocdbt"),
    "process-manifest": ("ocdbt", "ocdbt.process_0/manifest.ocdbt"),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", LINKS)
def test_orbax_symlink_out_of_the_folder_is_refused_everywhere(tmp_path, orbax_folders, case):
    layout, rel = LINKS[case]
    path = _copy(orbax_folders, layout, tmp_path / "ck")
    target = os.path.join(orbax_folders["outside-" + layout], rel)
    inside = os.path.join(path, rel)
    shutil.rmtree(inside) if os.path.isdir(inside) else os.remove(inside)
    os.symlink(target, inside)
    match = re.escape(inside) + " resolves to .* outside the checkpoint folder"
    with pytest.raises(fc.CorruptCheckpointError, match=match):
        fc.restore(path)
    r = cli("verify", path)
    assert r.returncode == 1 and "outside the checkpoint folder" in r.stdout, r.stdout + r.stderr
    r = cli("info", path)
    if case == "chunk":  # info reads no array bytes: orbax/folders.py never reaches the link
        assert fc.metadata(path).leaves["w"].shape == (1000,) and r.returncode == 0, r.stdout + r.stderr
    else:
        with pytest.raises(fc.CorruptCheckpointError, match=match):
            fc.metadata(path)
        assert r.returncode == 2 and "CorruptCheckpointError" in r.stderr, r.stdout + r.stderr
    with pytest.raises(fc.CorruptCheckpointError):
        tools.convert(path, tmp_path / "native", to="native")
    assert not os.path.exists(tmp_path / "native")


@pytest.mark.timeout(120)
def test_orbax_symlink_inside_the_folder_is_followed(tmp_path, orbax_folders):
    path = _copy(orbax_folders, "plain", tmp_path / "ck")
    os.rename(os.path.join(path, "w", "c", "0"), os.path.join(path, "w", "chunk-elsewhere"))
    os.symlink(os.path.join("..", "chunk-elsewhere"), os.path.join(path, "w", "c", "0"))
    np.testing.assert_array_equal(fc.restore(path)["w"], np.arange(1000, dtype=np.float32))


@pytest.mark.timeout(120)
def test_orbax_item_name_leading_out_of_the_step_is_refused(tmp_path, orbax_folders):
    """A step's _CHECKPOINT_METADATA naming an item "../evil": a pytree beside the step, never read."""
    _copy(orbax_folders, "ocdbt", tmp_path / "step" / "default")
    _copy(orbax_folders, "outside-ocdbt", tmp_path / "evil")
    handler = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
    (tmp_path / "step" / "_CHECKPOINT_METADATA").write_text(
        json.dumps({"item_handlers": {"default": handler, "../evil": handler}})
    )
    with pytest.raises(fc.CorruptCheckpointError, match="evil: an item of .* outside its folder"):
        fc.restore(tmp_path / "step")
    np.testing.assert_array_equal(
        fc.restore(tmp_path / "step" / "default")["w"], np.arange(1000, dtype=np.float32)
    )


FIFOS = {  # a FIFO in place of: (layout, the file)
    "chunk": ("plain", "w/c/0"),
    "zarr-metadata": ("plain", "w/zarr.json"),
    "chunk-folder": ("plain", "w/c"),
    "ocdbt-data": ("ocdbt", None),  # the largest file under ocdbt.process_0/d
    "ocdbt-manifest": ("ocdbt", "ocdbt.process_0/manifest.ocdbt"),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", FIFOS)
def test_orbax_fifo_is_refused_and_nothing_blocks(tmp_path, orbax_folders, case):
    layout, rel = FIFOS[case]
    path = _copy(orbax_folders, layout, tmp_path / "ck")
    fifo = os.path.join(path, rel) if rel else _ocdbt_data_file(path)
    shutil.rmtree(fifo) if os.path.isdir(fifo) else os.remove(fifo)
    os.mkfifo(fifo)
    _refused_and_fifo_never_opened(path, fifo)
    r = cli("info", path, timeout=60)
    if case in (
        "chunk",
        "chunk-folder",
    ):  # info reads no array bytes: orbax/folders.py never reaches the FIFO
        assert r.returncode == 0 and "w" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 2 and "is not a regular file" in r.stderr, r.stdout + r.stderr
    r = cli("verify", path, timeout=60)
    assert r.returncode == 1 and "is not a regular file" in r.stdout, r.stdout + r.stderr


@pytest.mark.timeout(180)
def test_orbax_fifo_behind_a_linked_array_folder_is_never_opened(tmp_path, orbax_folders):
    """The folder of the array opened first is a symlink (inside the checkpoint) to the folder of
    another, where a FIFO waits in place of its zarr.json: the restore is refused before tensorstore
    opens anything, so no thread of it is left blocked on the FIFO (a writer that opens it without
    blocking finds no reader)."""
    path = _copy(orbax_folders, "plain", tmp_path / "ck")
    with open(os.path.join(path, "_METADATA")) as f:
        order = [".".join(ast.literal_eval(k)) for k in json.load(f)["tree_metadata"]]
    first, later = order[0], order[1]
    shutil.rmtree(os.path.join(path, first))
    os.symlink(later, os.path.join(path, first))
    fifo = os.path.join(path, later, "zarr.json")
    os.remove(fifo)
    os.mkfifo(fifo)
    _refused_and_fifo_never_opened(path, fifo)


def _refused_and_fifo_never_opened(path: str, fifo: str) -> None:
    """fc.restore(path) in a child process: a CorruptCheckpointError naming a non-regular file, and
    nothing (no tensorstore thread left behind) holds ``fifo`` open for reading."""
    r = run_py(
        f"""
        import errno, os, time
        import flax_ckpt as fc
        try:
            fc.restore({path!r})
        except fc.CorruptCheckpointError as e:
            print("REFUSED", e)
        time.sleep(0.5)
        try:
            os.close(os.open({fifo!r}, os.O_WRONLY | os.O_NONBLOCK))
            print("A READER OPENED THE FIFO")
        except OSError as e:
            print("NO READER" if e.errno == errno.ENXIO else e)
    """,
        timeout=60,
    )
    assert r.returncode == 0 and "REFUSED" in r.stdout and "is not a regular file" in r.stdout, (
        r.stdout + r.stderr
    )
    assert "NO READER" in r.stdout, r.stdout + r.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["ocdbt", "native"])
def test_hard_links_are_reported_by_verify(tmp_path, orbax_folders, layout):
    if layout == "native":
        path = str(tmp_path / "ck")
        fc.save(path, {"w": np.arange(1000, dtype=np.float32)})
        data = os.path.join(path, manifest_body(path)["leaves"][0]["chunks"][0]["file"])
    else:
        path = _copy(orbax_folders, layout, tmp_path / "ck")
        data = _ocdbt_data_file(path)
    os.link(data, tmp_path / "another-name")
    report = tools.check(path)
    assert report.linked == [os.path.relpath(data, path)] and not report.problems
    if layout == "native":  # the command says so too, in text and JSON, and still exits 0
        r = cli("verify", path, timeout=60)
        assert r.returncode == 0 and "have other hard links" in r.stdout, r.stdout + r.stderr
        r = cli("verify", "--json", path, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["linked"] == report.linked, r.stdout + r.stderr
    np.testing.assert_array_equal(fc.restore(path)["w"], np.arange(1000, dtype=np.float32))


# ------------------------------------------------------------------ item 8: Orbax memory is bounded


def _rle_zstd(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes made of RLE blocks (4 bytes per 128 KiB), no content size."""
    out = bytearray(struct.pack("<I", 0xFD2FB528)) + bytes([0x00, 0x38])  # no size; a 128 KiB window
    while n:
        k = min(n, 128 << 10)
        n -= k
        out += (int(n == 0) | 1 << 1 | k << 3).to_bytes(3, "little") + b"\0"
    return bytes(out)


def _shard(chunk: bytes) -> bytes:
    """A zarr3 shard of one inner chunk: the chunk, its index entry and the index's crc32c."""
    index = struct.pack("<QQ", 0, len(chunk))
    return chunk + index + struct.pack("<I", crc32c.crc32c(index))


RESTORE_RSS = """
    import resource, time, flax_ckpt as fc
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    try:
        fc.restore({path!r})
        print("RESTORED")
    except fc.CheckpointError as e:
        print("REFUSED", type(e).__name__, e)
    print("RSS_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0) / 1024, "S", time.perf_counter() - t0)
"""


def _rss(stdout: str) -> float:
    return float(stdout.split("RSS_MB ")[1].split()[0])


@pytest.mark.timeout(180)
def test_orbax_array_declaring_64_gib_is_refused_without_allocating(tmp_path, orbax_folders):
    path = _copy(orbax_folders, "plain", tmp_path / "ck")
    meta = os.path.join(path, "w", "zarr.json")
    doc = json.loads(open(meta).read())
    doc["shape"] = [1 << 34]  # float32: 64 GiB, from a folder of a few KB
    with open(meta, "w") as f:
        json.dump(doc, f)
    r = run_py(RESTORE_RSS.format(path=path))
    assert "REFUSED CorruptCheckpointError" in r.stdout and "68719476736 bytes" in r.stdout, (
        r.stdout + r.stderr
    )
    assert _rss(r.stdout) < 200, r.stdout
    assert fc.metadata(path).leaves["w"].shape == (1 << 34,)  # info reads no array bytes: it still answers
    r = cli("verify", path)
    assert r.returncode == 1 and "more than the checkpoint folder can hold" in r.stdout, r.stdout + r.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("reader", ["folders", "tensorstore"])
def test_orbax_chunk_declared_larger_than_its_array_is_refused_without_allocating(
    tmp_path, orbax_folders, reader
):
    """w (1000 float32) declares chunks of 1 TiB: tensorstore would abort the process (std::bad_alloc)
    decoding one. Refused by orbax/folders.py, and before tensorstore reads (a symlinked array folder
    inside the checkpoint sends the step to tensorstore)."""
    path = _copy(orbax_folders, "plain", tmp_path / "ck")
    meta = os.path.join(path, "w", "zarr.json")
    doc = json.loads(open(meta).read())
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 38]
    doc["codecs"][0]["configuration"]["chunk_shape"] = [1 << 38]
    with open(meta, "w") as f:
        json.dump(doc, f)
    if reader == "tensorstore":  # b's folder a symlink (inside the checkpoint): the step goes to tensorstore
        os.rename(os.path.join(path, "b"), os.path.join(path, "b-folder"))
        os.symlink("b-folder", os.path.join(path, "b"))
    r = run_py(RESTORE_RSS.format(path=path))
    assert "REFUSED CorruptCheckpointError" in r.stdout and "refusing to decode them" in r.stdout, (
        r.stdout + r.stderr
    )
    assert ("zarr.json: not zarr metadata" in r.stdout) == (reader == "folders"), (
        r.stdout
    )  # which reader refused
    assert _rss(r.stdout) < 200, r.stdout


@pytest.mark.timeout(180)
def test_orbax_zstd_chunk_expanding_past_its_size_is_refused_in_bounded_memory(tmp_path, orbax_folders):
    """w declares 1000 float32 (4,000 bytes); its chunk is replaced by a 32 KB zstd frame of 1 GiB."""
    path = _copy(orbax_folders, "plain", tmp_path / "ck")
    with open(os.path.join(path, "w", "c", "0"), "wb") as f:
        f.write(_shard(_rle_zstd(1 << 30)))
    r = run_py(RESTORE_RSS.format(path=path))
    assert "REFUSED CorruptCheckpointError" in r.stdout and "reading 'w'" in r.stdout, r.stdout + r.stderr
    assert _rss(r.stdout) < 200, r.stdout
    with open(os.path.join(path, "w", "c", "0"), "wb") as f:  # the same frame at the declared size is data
        f.write(_shard(_rle_zstd(4000)))
    np.testing.assert_array_equal(fc.restore(path)["w"], np.zeros(1000, np.float32))


@pytest.mark.timeout(180)
def test_orbax_zeros_compressed_near_zstds_limit_still_restore(tmp_path):
    """128 MiB of zeros store in ~4 KB: the bound (the most a zstd byte can decode to) never refuses
    what Orbax writes."""
    path = tmp_path / "zeros"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)).save(
        path, args=ocp.args.PyTreeSave({"z": np.zeros(32 << 20, np.float32)})
    )
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    assert stored * 2 + (64 << 20) < (128 << 20)  # the native layout's bound would refuse it
    r = run_py(RESTORE_RSS.format(path=str(path)))
    assert "RESTORED" in r.stdout, r.stdout + r.stderr
