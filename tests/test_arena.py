"""An async save's snapshot laid out in an arena (engine/arena.py), checksummed as it is copied, and
written from it: behaviour, not speed (benchmarks/bench_every_step.py measures the speed).

- The arena hands out buffers back to back at each dtype's alignment; a save that asks for more than
  it holds copies the rest as without it, and the next save gets an arena of the size asked for.
- The crc32c made during the copy is the crc32c of every block of the copy.
- The raw serializer stores those checksums where its blocks are the same (and computes the others),
  and puts the pieces into files in the order given (the arena's), files of about equal size, so
  that each file is a run of the arena's bytes.
- Saves at every step with a CheckpointManager restore bit-exact, whatever the caller does to its
  arrays after ``save`` returns (numpy arrays overwritten in place, jax arrays donated), the tree growing
  or shrinking between saves, every dtype; the arena is filled again only once the save that used it
  is durable, and it is the only host copy the manager keeps between saves.
"""

from __future__ import annotations

import crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.engine.arena import Arena
from flax_ckpt._src.engine.snapshot import snapshot
from flax_ckpt._src.serializers import raw
from flax_ckpt._src.storage.local import LocalStorage
from helpers import assert_bit_exact

pytestmark = pytest.mark.timeout(120)


def _tree(seed: int, extra: bool = False) -> dict:
    """Leaves of every size class around the checkpoint blocks and copy pieces, and of dtypes whose
    alignments differ (an int8 leaf of odd size before a float64 one leaves a gap)."""
    rng = np.random.default_rng(seed)
    tree = {
        "a_odd_int8": rng.integers(-128, 127, 12345, dtype=np.int8),
        "b_f64": rng.standard_normal(1000),
        "c_block_plus": rng.integers(0, 256, raw.BLOCK + 3, dtype=np.uint8),
        "d_jax_f32": jnp.asarray(rng.standard_normal((512, 300)).astype(np.float32)),
        "e_bf16": rng.standard_normal(777).astype(ml_dtypes.bfloat16),
        "f_bool": rng.integers(0, 2, 33).astype(bool),
        "g_scalar": jnp.int32(seed),
        "h_empty": np.zeros((0, 4), np.float32),
        "i_key": jax.random.key(seed),
        "j_piece_plus": jnp.asarray(rng.integers(0, 1 << 30, (512 << 10) // 4 + 5, dtype=np.int32)),
    }
    if extra:
        tree["k_more"] = rng.standard_normal((300, 300)).astype(np.float32)
    return tree


def _blocks(a: np.ndarray, block: int) -> list[int]:
    b = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return [crc32c.crc32c(b[i : i + block]) for i in range(0, len(b), block)]


def test_snapshot_in_an_arena_is_laid_out_back_to_back_and_checksummed_as_copied():
    tree = _tree(1)
    first = Arena.fit(None)
    snap = snapshot(tree, copy=True, into=first, checksum=raw.BLOCK)
    assert first.capacity == 0 and first.wanted > 0  # the first save copies as without an arena
    arena = Arena.fit(first)
    assert arena is not first and arena.capacity >= first.wanted
    snap = snapshot(tree, copy=True, into=arena, checksum=raw.BLOCK)
    assert snap.arena is arena
    shards = [(lf.path, s.data) for lf in snap.leaves for s in lf.shards if s.data.size]
    assert len(shards) == 9 and all(arena.holds(d) for _, d in shards)
    end = None
    for path, d in shards:  # in leaf order, each right after the previous at its dtype's alignment
        at = d.ctypes.data
        assert at % d.dtype.alignment == 0, path
        if end is not None:
            assert end <= at < end + d.dtype.alignment, path
        end = at + d.nbytes
        assert snap.crcs[id(d)].tolist() == _blocks(d, raw.BLOCK), path
    items = {it.name: it for it in snap.items()}
    assert all(
        s.crc32c is not None and s.crc32c[0] == raw.BLOCK
        for it in items.values()
        for s in it.shards
        if s.data.size
    )
    assert Arena.fit(arena) is arena and arena.used == 0  # held all it was asked for: reused
    grown = _tree(1, extra=True)
    snap = snapshot(grown, copy=True, into=arena, checksum=raw.BLOCK)  # asks for more than it holds
    assert arena.wanted > arena.capacity
    assert not arena.holds(snap.leaves[-1].shards[0].data)  # copied as without an arena
    np.testing.assert_array_equal(snap.leaves[-1].shards[0].data, grown["k_more"])
    assert Arena.fit(arena).capacity >= arena.wanted


def test_raw_serializer_stores_the_copy_checksums_and_writes_files_in_the_arenas_order(tmp_path, monkeypatch):
    """Small BLOCK and SUBCHUNK: leaves split into pieces, some of which start on a block boundary of
    their shard (checksums taken from the copy) and some not (computed). Every stored checksum is the
    crc32c of the bytes in the file; files hold runs of the arena, in its order, about equal in size."""
    monkeypatch.setattr(raw, "BLOCK", 16 << 10)
    monkeypatch.setattr(raw, "SUBCHUNK", 64 << 10)
    rng = np.random.default_rng(3)
    tree = {
        "rows_4096": rng.standard_normal((64, 1024)).astype(np.float32),  # 4 pieces of 4 blocks
        "rows_2000": rng.standard_normal((100, 500)).astype(np.float32),  # pieces at 64000-byte steps
        "small": rng.standard_normal(100).astype(np.float32),
    }
    arena = Arena.fit(Arena(1 << 20))
    snap = snapshot(tree, copy=True, into=arena, checksum=raw.BLOCK)
    computed = []
    real = raw._crcs
    monkeypatch.setattr(raw, "_crcs", lambda mv: computed.append(len(mv)) or real(mv))
    written = raw.RawSerializer().write(LocalStorage(str(tmp_path)), snap.items(), tag="p0")
    # rows_2000's pieces after its first start off a block boundary; "small" is one whole piece: its own
    assert sorted(computed) == sorted([64000, 64000, 64000, 8000])
    assert len(written.files) > 1
    mem = np.frombuffer(arena._map, np.uint8)
    pieces = max(c["nbytes"] for cs in written.chunks.values() for c in cs)
    assert max(written.files.values()) - min(written.files.values()) <= pieces
    start = 0
    for name in sorted(written.files, key=lambda n: int(n.split(".")[1])):  # files follow the arena
        with open(tmp_path / name, "rb") as f:
            data = f.read()
        assert data == mem[start : start + len(data)].tobytes(), name
        start += len(data)
    for leaf, chunks in written.chunks.items():
        for c in chunks:
            with open(tmp_path / c["file"], "rb") as f:
                f.seek(c["offset"])
                assert list(c["crc32c"]) == _blocks(np.frombuffer(f.read(c["nbytes"]), np.uint8), raw.BLOCK)


def test_a_file_of_the_arena_is_handed_to_the_storage_as_one_view_of_it(tmp_path, monkeypatch):
    """Small leaves between large ones (a step counter, biases, kernels: what a training state holds) lie
    back to back in the arena, as in the file: each file goes to the storage as one view of the arena's
    memory (written straight from it, O_DIRECT where the file system allows), not as the small pieces
    copied apart and the large ones after them, which made the storage copy every byte once more into
    its staging buffer. Small pieces that lie apart in memory (no arena) are still copied together."""
    rng = np.random.default_rng(5)
    tree = {
        f"layer{k}": {
            "count": np.int32(k),
            "bias": rng.standard_normal(10).astype(np.float32),
            "kernel": rng.standard_normal((256, 1024)).astype(np.float32),
        }
        for k in range(3)
    }
    arena = Arena.fit(Arena(4 << 20))
    snap = snapshot(tree, copy=True, into=arena, checksum=raw.BLOCK)
    handed = []
    real = LocalStorage.write
    monkeypatch.setattr(
        LocalStorage, "write", lambda self, name, bufs: handed.append(bufs) or real(self, name, bufs)
    )
    written = raw.RawSerializer().write(LocalStorage(str(tmp_path)), snap.items(), tag="p0")
    lo = arena._bytes.ctypes.data
    hi = lo + arena._bytes.nbytes
    assert handed and all(len(bufs) == 1 for bufs in handed), [len(b) for b in handed]
    for bufs in handed:
        at = np.frombuffer(bufs[0], np.uint8).ctypes.data
        assert lo <= at and at + len(bufs[0]) <= hi, "a view of the arena"
    mem = np.frombuffer(arena._map, np.uint8)
    start = 0
    for name in sorted(written.files, key=lambda n: int(n.split(".")[1])):
        data = (tmp_path / name).read_bytes()
        assert data == mem[start : start + len(data)].tobytes(), name
        start += len(data)

    handed.clear()  # the same tree without an arena: its small leaves lie apart and are copied together
    plain = snapshot(tree, copy=True)
    raw.RawSerializer().write(LocalStorage(str(tmp_path / "plain")), plain.items(), tag="p0")
    assert sum(len(b) for b in handed) <= 2 * len(tree) + 1, [len(b) for b in handed]


def test_saves_at_every_step_restore_exactly_whatever_the_caller_does_next(tmp_path):
    """Async saves at every step: numpy leaves overwritten in place and jax arrays donated right after
    ``save`` returns, the tree growing and shrinking; every step restores bit-exact, and the arena is
    the same one from the second save of a structure on (made once the save that sized it is durable;
    filled again, never while a save reads it)."""
    donate = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x * 2, t), donate_argnums=0)
    saved, arenas = {}, []
    with fc.CheckpointManager(tmp_path / "ckpt", max_to_keep=None) as mgr:
        for step in range(8):
            tree = _tree(step, extra=step in (4, 5))
            saved[step] = jax.tree_util.tree_map(
                lambda x: (
                    np.array(x, copy=True)
                    if not isinstance(x, jax.Array) or not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                    else x
                ),
                tree,
            )
            saved[step]["i_key"] = tree["i_key"]
            assert mgr.save(step, tree)
            tree["a_odd_int8"][:] = 0  # the caller reuses its buffers at once
            tree["b_f64"] *= 3
            donate({"d": tree["d_jax_f32"], "j": tree["j_piece_plus"]})
            mgr.wait_until_finished()
            arenas.append(mgr._directory._arena.arena)
            assert (
                not mgr._directory._arena.reuse_buffers()
            )  # the arena is the one host copy kept between saves
        for step in range(8):
            assert_bit_exact(
                mgr.restore(step, target=_tree(0, extra=step in (4, 5))), saved[step], types=False
            )
    # the first save copies as without an arena and sizes the next, made once it is durable
    assert (
        arenas[0].capacity > 0 and arenas[0] is arenas[1] is arenas[2] is arenas[3]
    )  # reused while it holds the tree
    assert (
        arenas[4] is not arenas[3] and arenas[4] is arenas[5] is arenas[6] is arenas[7]
    )  # the tree grew at step 4:
    assert arenas[4].capacity >= arenas[4].wanted  # a bigger arena from step 5, kept when it shrinks again


def test_the_arena_asks_for_transparent_huge_pages_where_the_host_has_them():
    """The arena's map is advised MADV_HUGEPAGE (its VmFlags in /proc/self/smaps carry "hg"): 2 MiB
    pages for the copy and for the O_DIRECT write from it (engine/arena.py). Skipped on a host without
    transparent huge pages."""
    import mmap
    import os
    import re

    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("no transparent huge pages on this host")
    arena = Arena(8 << 20)
    buf = arena((1 << 20,), np.float32)
    buf[:] = 1.5
    at = buf.ctypes.data
    flags, inside = None, False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= at < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None and "hg" in flags, flags
    assert np.all(arena((4,), np.float32) == 0) and np.all(buf == 1.5)


def _resident(at: int) -> int:
    """Resident bytes of the mapping of /proc/self/smaps that holds address ``at``."""
    import re

    inside = False
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= at < int(m.group(2), 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no mapping holds {at:#x}")


def test_the_next_saves_arena_is_made_and_faulted_once_the_save_before_it_is_durable(tmp_path):
    """An async manager's first save has no arena (it sizes one); the arena the next save copies into
    is made when the first is durable, on the writer's thread, every page of it already resident, so
    the next save's copy on the caller's thread faults none. Later saves of that size keep it; a state
    that outgrows it gets a larger one the same way. Every step restores bit-exact."""

    def state(step: int, n: int = 3 << 20) -> dict:
        return {"w": np.arange(n, dtype=np.float32) + step, "b": np.full((1000,), step, np.int64)}

    with fc.CheckpointManager(tmp_path / "run", max_to_keep=None) as mgr:
        mgr.save(0, state(0))
        mgr.wait_until_finished()
        arena = mgr._directory._arena.arena
        size = sum(a.nbytes for a in state(0).values())
        assert arena.capacity >= size and _resident(arena._bytes.ctypes.data) >= size
        for step in (1, 2):
            mgr.save(step, state(step))
            mgr.wait_until_finished()
            assert mgr._directory._arena.arena is arena
        mgr.save(3, state(3, 5 << 20))  # grown: no buffer for all of it in this arena
        mgr.wait_until_finished()
        bigger = mgr._directory._arena.arena
        assert bigger is not arena and bigger.capacity >= sum(a.nbytes for a in state(3, 5 << 20).values())
        assert _resident(bigger._bytes.ctypes.data) >= bigger.capacity - (1 << 20)
        for step in range(4):
            assert_bit_exact(mgr.restore(step), state(step) if step < 3 else state(3, 5 << 20), types=False)
