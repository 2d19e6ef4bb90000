"""Steps of a run share what did not change (issue 54): a save costs the bytes that changed.

A manager's native steps on a local folder refer to the previous step's chunks that hold the same
bytes instead of writing them again (native/sharing.py; docs/design.md, "Steps that share bytes").
These tests pin what a user relies on: the bytes on disk, that a chunk is shared only when its bytes
are equal (a crc32c collision is written), that retention, prune and damage never lose a kept step's
bytes, and that every tool reads such a step. Real files; the command run through its own main.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import crc32c
import ml_dtypes
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.tools.cli import main

MiB = 1 << 20


def cli(capsys, *args: str) -> tuple[int, str]:
    """``flax-ckpt <args>`` in this process (the command's own main): its exit status and output."""
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


def is_held(name: str) -> bool:
    """A removed step's folder kept for the bytes later steps share: ``<step>.held-<id>``."""
    return re.fullmatch(r"[0-9]+\.held-[0-9a-f]{32}", name) is not None


def du(path) -> int:
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(path) for f in fs)


def frozen_base(seed: int = 0) -> dict:
    """32 MiB that never changes: eight 4 MiB matrices."""
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(8)}


def lora(step: int) -> dict:
    """0.75 MiB that changes at every step (LoRA factors and their adam moments)."""
    rng = np.random.default_rng(1000 + step)
    return {
        k: rng.standard_normal((64 * 1024,), dtype=np.float32)
        for k in ("a", "b", "mu_a", "mu_b", "nu_a", "nu_b")
    }


def state(step: int, base: dict) -> dict:
    return {"frozen": base, "lora": lora(step)}


def assert_tree_equal(a, b) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], dict):
            assert_tree_equal(a[k], b[k])
        else:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def run(d, steps, base, **kw) -> None:
    with fc.CheckpointManager(d, **kw) as mgr:
        for s in steps:
            mgr.save(s, state(s, base))
        mgr.wait_until_finished()


@pytest.mark.parametrize("keep", [None, 2])
def test_ten_saves_of_a_frozen_base_cost_one_base_and_what_changed(tmp_path, keep):
    base = frozen_base()
    full, changed = 32 * MiB + 0.75 * MiB, 0.75 * MiB
    run(tmp_path, range(10), base, max_to_keep=keep)
    kept = 10 if keep is None else keep
    assert du(tmp_path) <= 1.3 * (full + (kept - 1 if keep is None else kept) * changed), du(tmp_path) / MiB
    with fc.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == list(range(10 - kept, 10))
        for s in sorted({10 - kept, 9 - kept // 2, 9}):  # kept steps restore bit-exact, each by itself
            assert_tree_equal(mgr.restore(s), state(s, base))
    assert_tree_equal(fc.restore(tmp_path / "9"), state(9, base))  # a step folder, no target


def test_one_changed_byte_in_a_large_leaf_and_one_bfloat16_element_are_saved(tmp_path):
    """96 MiB (a 64 MiB piece and a 32 MiB one) rather than 1 GiB: the same code path (a leaf is stored
    in pieces of at most 64 MiB), seconds instead of a minute on a shared 2-core machine."""
    big = np.random.default_rng(0).integers(0, 255, 96 * MiB, dtype=np.uint8)
    half = np.random.default_rng(1).standard_normal((512, 1024)).astype(ml_dtypes.bfloat16)
    with fc.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(0, {"big": big, "half": half})
        big2, half2 = big.copy(), half.copy()
        big2[len(big) // 2 + 12345] ^= 1  # one bit of one byte in the middle
        half2[300, 700] = ml_dtypes.bfloat16(float(half2[300, 700]) + 1.0)
        mgr.save(1, {"big": big2, "half": half2})
        out = mgr.restore(1)
    np.testing.assert_array_equal(out["big"], big2)
    assert out["half"].dtype == half2.dtype
    np.testing.assert_array_equal(out["half"].view(np.uint16), half2.view(np.uint16))
    # the unchanged 32 MiB piece was shared, the changed one (and the bfloat16 leaf) written
    assert du(tmp_path / "1") < 64 * MiB + 2 * MiB
    assert_tree_equal(fc.restore(tmp_path / "0"), {"big": big, "half": half})


def _forge(data: np.ndarray, at: int, patch_at: int) -> np.ndarray:
    """``data`` with byte ``at`` changed and 4 bytes at ``patch_at`` set so that its crc32c is unchanged
    (crc32c is affine over GF(2): solve for the 32 patch bits that cancel the change)."""
    n, zero = len(data), crc32c.crc32c(bytes(len(data)))

    def lin(delta: np.ndarray) -> int:
        return crc32c.crc32c(delta.tobytes()) ^ zero

    delta = np.zeros(n, np.uint8)
    delta[at] = 0x5A
    target = lin(delta)
    cols = []
    for bit in range(32):
        e = np.zeros(n, np.uint8)
        e[patch_at + bit // 8] = 1 << (bit % 8)
        cols.append(lin(e))
    # Gaussian elimination over GF(2): find x with XOR of cols[i] for x_i = 1 equal to target
    rows = [(c, 1 << i) for i, c in enumerate(cols)]
    basis: dict[int, tuple[int, int]] = {}
    for c, m in rows:
        for b in sorted(basis, reverse=True):
            if c >> b & 1:
                c, m = c ^ basis[b][0], m ^ basis[b][1]
        if c:
            basis[c.bit_length() - 1] = (c, m)
    t, x = target, 0
    for b in sorted(basis, reverse=True):
        if t >> b & 1:
            t, x = t ^ basis[b][0], x ^ basis[b][1]
    assert t == 0, "the patch bits span every crc32c"
    for bit in range(32):
        if x >> bit & 1:
            delta[patch_at + bit // 8] ^= 1 << (bit % 8)
    return data ^ delta


def test_equal_crc32c_is_not_equal_bytes(tmp_path):
    """A chunk whose every crc32c block equals the earlier chunk's but whose bytes differ is written:
    sharing is decided by the bytes (step 1, against a chunk step 0 wrote: read back and compared) or
    by their SHA-256 (step 3, against a chunk step 2 shared), never by crc32c alone."""
    data = np.random.default_rng(3).integers(0, 255, 4 * MiB, dtype=np.uint8)
    forged = _forge(data, 1000, 2 * MiB)
    assert crc32c.crc32c(forged.tobytes()) == crc32c.crc32c(data.tobytes())
    assert not np.array_equal(forged, data)
    same = np.random.default_rng(4).integers(0, 255, 4 * MiB, dtype=np.uint8)
    with fc.CheckpointManager(tmp_path, async_save=False) as mgr:
        for step, x in enumerate([data, forged, forged, data]):
            mgr.save(step, {"x": x, "same": same})
            np.testing.assert_array_equal(mgr.restore(step)["x"], x)

    def files(step: int) -> dict[str, str]:
        body = json.load(open(tmp_path / str(step) / "manifest.json"))["body"]
        return {leaf["path"][0][1]: leaf["chunks"][0]["file"] for leaf in body["leaves"]}

    assert files(1) == {"x": "data/p0.0.bin", "same": "../0/data/p0.0.bin"}  # bytes compared
    assert files(2) == {"x": "../1/data/p0.0.bin", "same": "../0/data/p0.0.bin"}  # shared, with its hash
    assert files(3) == {"x": "data/p0.0.bin", "same": "../0/data/p0.0.bin"}  # hashes compared


def test_retention_keeps_the_bytes_kept_steps_share_and_frees_them_with_the_last(tmp_path):
    base, other = frozen_base(0), frozen_base(9)
    with fc.CheckpointManager(tmp_path, max_to_keep=2, async_save=False) as mgr:
        for s in range(4):
            mgr.save(s, state(s, base))
        held = [n for n in os.listdir(tmp_path) if is_held(n)]
        assert [n.split(".")[0] for n in held] == ["0"]  # step 0 removed as a step, its bytes kept
        assert mgr.all_steps() == [2, 3]
        assert_tree_equal(mgr.restore(2), state(2, base))
        for s in range(4, 7):  # the base changes: the old bytes are no longer referred to
            mgr.save(s, state(s, other))
        assert_tree_equal(mgr.restore(6), state(6, other))
    assert not [n for n in os.listdir(tmp_path) if is_held(n) and n.startswith("0.")]
    assert du(tmp_path) <= 1.3 * (32.75 * MiB + 2 * 0.75 * MiB)


def test_prune_retires_what_kept_steps_share(tmp_path, capsys):
    base = frozen_base()
    run(tmp_path, range(5), base, async_save=False)
    rc, out = cli(capsys, "prune", str(tmp_path), "--keep", "1")
    assert rc == 0, out
    left = {n for n in os.listdir(tmp_path) if not n.startswith(".")}
    assert left == {"4", next(n for n in left if is_held(n) and n.startswith("0."))}
    assert_tree_equal(fc.restore(tmp_path / "4"), state(4, base))
    rc, out = cli(capsys, "verify", str(tmp_path / "4"))
    assert rc == 0, out
    rc, out = cli(capsys, "ls", str(tmp_path), "--json")
    doc = json.loads(out)
    (step,) = [e for e in doc["steps"] if e["state"] == "committed"]
    assert step["nbytes"] < 2 * MiB and step["shared_nbytes"] >= 32 * MiB
    assert [e["state"] for e in doc["steps"]].count("held") == 1


def test_damaged_shared_bytes_make_every_step_naming_them_damaged_and_restore_falls_back(
    tmp_path, capsys, caplog
):
    a, b = frozen_base(0), frozen_base(1)
    with fc.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(0, state(0, a))
        mgr.save(1, state(1, a))  # shares step 0's frozen bytes
        mgr.save(2, state(2, b))  # b: written in full
        mgr.save(3, state(3, b))  # shares step 2's
    path = tmp_path / "2" / "data" / "p0.0.bin"
    with open(path, "r+b") as f:  # a bit flips in a frozen matrix of step 2
        f.seek(5 * MiB)
        byte = f.read(1)
        f.seek(5 * MiB)
        f.write(bytes([byte[0] ^ 1]))
    rc, out = cli(capsys, "verify", str(tmp_path / "3"))
    assert rc != 0 and "../2/data/p0.0.bin" in out
    with fc.CheckpointManager(tmp_path, async_save=False) as mgr:
        out = mgr.restore()  # 3 and 2 are damaged: the newest good step is 1
        assert_tree_equal(out, state(1, a))
        assert mgr.restore_stats[-1].step == 1
        assert "step 3" in caplog.text and "damaged" in caplog.text
        mgr.save(4, state(4, b))  # the damaged bytes are never referred to again: written afresh
        assert_tree_equal(mgr.restore(4), state(4, b))


def test_a_step_copied_out_of_its_run_says_so_and_convert_makes_it_self_contained(tmp_path, capsys):
    base = frozen_base()
    run(tmp_path / "run", range(2), base, async_save=False)
    src = tmp_path / "run" / "1"
    shutil.copytree(src, tmp_path / "alone")
    with pytest.raises(fc.CheckpointError, match="convert"):
        fc.restore(tmp_path / "alone")
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "copy"), "--to", "native")
    assert rc == 0, out
    shutil.rmtree(tmp_path / "run")
    assert_tree_equal(fc.restore(tmp_path / "copy"), state(1, base))
    assert "shared" not in json.load(open(tmp_path / "copy" / "manifest.json"))["body"]


def test_tools_read_a_shared_step(tmp_path, capsys):
    base = frozen_base()
    run(tmp_path, range(2), base, async_save=False)
    info = fc.metadata(tmp_path / "1")
    assert info.step == 1 and info.nbytes >= 32 * MiB
    for args in (["info", str(tmp_path / "1")], ["diff", str(tmp_path / "0"), str(tmp_path / "1")]):
        rc, out = cli(capsys, *args)
        assert rc in (0, 1), out
    rc, out = cli(capsys, "ls", str(tmp_path))
    assert "shared" in out and "held" not in out
    # restore into another layout of the arrays: a box across chunks of a shared leaf
    import jax

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state(1, base))
    assert_tree_equal(fc.restore(tmp_path / "1", target), state(1, base))


def test_nothing_is_freed_while_a_step_s_manifest_cannot_be_read(tmp_path, capsys):
    """A step whose manifest is damaged may refer to any earlier step: prune then retires the steps it
    removes instead of deleting them, and sweeps nothing, until that step is repaired or removed."""
    base = frozen_base()
    run(tmp_path, range(4), base, async_save=False)
    manifest = tmp_path / "3" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-40])  # step 3: unreadable, what it names unknown
    rc, out = cli(capsys, "prune", str(tmp_path), "--keep", "1")
    assert rc == 0, out
    left = {n.split(".")[0] for n in os.listdir(tmp_path) if is_held(n)}
    assert left == {"0", "1"}  # 0: named by step 2; 1: named by nothing readable, kept all the same
    assert_tree_equal(fc.restore(tmp_path / "2"), state(2, base))
    shutil.rmtree(tmp_path / "3")  # the damaged step removed: the next prune frees what nothing names
    rc, out = cli(capsys, "prune", str(tmp_path), "--keep", "1")
    assert rc == 0, out
    assert {n.split(".")[0] for n in os.listdir(tmp_path) if is_held(n)} == {"0"}
    assert_tree_equal(fc.restore(tmp_path / "2"), state(2, base))


def test_a_leaf_that_changes_at_every_save_is_not_compared_and_shared_again_once_it_stops(
    tmp_path, monkeypatch
):
    """A snapshot compares each large chunk with the bytes the last save left in its arena, to share it
    from memory when equal; a chunk that changed at each of the last two saves is copied without that
    comparison (a state that changes everywhere pays for no comparison that fails). Once it stops
    changing, the first save still shares it (by its crc32c and SHA-256 against the base's chunk) and
    the next compares it in memory again. Frozen leaves are compared at every save throughout."""
    from flax_ckpt._src.engine import snapshot as snapshot_mod

    compared: list[int] = []
    real = snapshot_mod.same_bytes
    monkeypatch.setattr(snapshot_mod, "same_bytes", lambda d, a: compared.append(d.nbytes) or real(d, a))
    base = frozen_base()  # eight 4 MiB leaves
    rng = np.random.default_rng(7)
    moving = [rng.standard_normal(512 * 1024, dtype=np.float32) for _ in range(6)]  # 2 MiB each
    states = [{"frozen": base, "moving": moving[min(s, 5)]} for s in range(9)]  # constant from step 5
    counts: list[tuple[int, int]] = []  # per save: (compares of the moving leaf, of frozen leaves)
    with fc.CheckpointManager(tmp_path) as mgr:
        for s, st in enumerate(states):
            compared.clear()
            mgr.save(s, st)
            mgr.wait_until_finished()
            counts.append((compared.count(2 * MiB), compared.count(4 * MiB)))
        for s, st in enumerate(states):
            assert_tree_equal(mgr.restore(s), st)
    warm = next(s for s, (_, f) in enumerate(counts) if f)  # the first save with an arena to compare with
    assert all(f == 8 for _, f in counts[warm:]), counts
    assert sum(m for m, _ in counts[:6]) <= 2, counts  # two failed comparisons in a row, then none
    assert counts[6][0] == 0 and counts[7][0] == 1, counts  # skipped once more, then compared again
    for s in (6, 7, 8):  # unchanged: shared (not written), whether compared in memory or not
        assert du(tmp_path / str(s)) < 1 * MiB, (s, du(tmp_path / str(s)))
    assert du(tmp_path / "5") > 2 * MiB  # the last change was written


def test_the_base_a_run_keeps_is_the_one_its_manifest_gives_and_stays_one_step_s_files(tmp_path):
    """The next save compares with the step just committed, kept in memory as written (no re-read):
    what it keeps (the files its chunks name, and the steps holding them) is what reading that step's
    manifest gives, at every save of a run, so that it does not grow with the run (a step's files
    more at each save)."""
    from flax_ckpt._src.native import sharing
    from flax_ckpt._src.native.manifest import decode

    base = frozen_base()
    with fc.CheckpointManager(tmp_path, max_to_keep=3) as mgr:
        layout = mgr._directory.layout
        for s in range(8):
            mgr.save(s, state(s, base))
            mgr.wait_until_finished()
            kept = layout._base
            assert kept is not None and kept.name == str(s)
            body = decode((tmp_path / str(s) / "manifest.json").read_bytes(), str(s))
            read = sharing.Base.from_body(str(s), body)
            assert read is not None
            assert (kept.id, kept.sizes, kept.ids) == (read.id, read.sizes, read.ids), s
            # the frozen matrices' bytes are step 0's (its folder or its retired one), the rest its own
            assert {step for step, _ in kept.sizes} == ({"0", str(s)} if s else {"0"})


@pytest.mark.parametrize("serializer", ["raw", "zarr3"])
def test_a_run_s_saves_and_retention_read_no_manifest_back(tmp_path, monkeypatch, serializer):
    """What retention must know of a step it keeps (its id, the steps it refers to) is kept when the
    step is committed, for a run whose steps share bytes (raw) and one whose steps do not (zarr3): a
    long run reads no manifest back at each save (that read was about 0.4 ms of the writer's CPU a save
    of a 39 MiB MLP without sharing)."""
    from flax_ckpt._src.storage.local import LocalStorage

    reads: list[str] = []
    real = LocalStorage.read

    def read(self, name, max_bytes):
        reads.append(f"{self.root}/{name}")
        return real(self, name, max_bytes)

    base = frozen_base()
    with fc.CheckpointManager(tmp_path, max_to_keep=2, serializer=serializer) as mgr:
        mgr.save(0, state(0, base))
        mgr.wait_until_finished()
        monkeypatch.setattr(LocalStorage, "read", read)
        for s in range(1, 7):
            mgr.save(s, state(s, base))
            mgr.wait_until_finished()
        monkeypatch.undo()
        assert mgr.all_steps() == [5, 6]
    assert [r for r in reads if r.endswith("manifest.json")] == []
    with fc.CheckpointManager(tmp_path) as mgr:
        assert_tree_equal(mgr.restore(6), state(6, base))
