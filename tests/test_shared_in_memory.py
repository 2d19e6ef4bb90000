"""An async save finds what did not change by comparing it in memory with the bytes the previous step
was written from (issue 54's time target): no hash, no read of the earlier step.

A manager's arena (engine/arena.py) holds, after a save, the bytes that save wrote, and the next save
of the same structure is given the same buffers; its snapshot compares each large shard with them
before copying, and a shard found equal is shared with the step that wrote them without being hashed
or read back (native/sharing.py). These tests pin that an unchanged state costs neither, that a change
the comparison must see (one byte in the middle of a large leaf, one bfloat16 element, bytes whose
crc32c blocks are all equal) is written, and that bytes are never shared on the strength of memory
that is not certainly the base step's (a failed save, a base other than the step the arena holds).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.engine import equal as equal_mod
from flax_ckpt._src.native import sharing
from test_shared_steps import _forge

MiB = 1 << 20


@pytest.fixture
def looked(monkeypatch) -> list[str]:
    """Every time a save hashes a piece or reads an earlier step's chunk back to compare it."""
    seen: list[str] = []
    real_sha256, real_equal = sharing.hashlib.sha256, sharing.Sharer._equal

    class Hashlib:
        @staticmethod
        def sha256(data):
            seen.append("hash")
            return real_sha256(data)

    def equal(self, *args):
        seen.append("read")
        return real_equal(self, *args)

    monkeypatch.setattr(sharing, "hashlib", Hashlib)
    monkeypatch.setattr(sharing.Sharer, "_equal", equal)
    return seen


def files(step_dir) -> dict[str, str]:
    """Each leaf's first chunk's file in a step's manifest (``../<step>/...``: shared)."""
    body = json.load(open(step_dir / "manifest.json"))["body"]
    return {leaf["path"][0][1]: leaf["chunks"][0]["file"] for leaf in body["leaves"] if "chunks" in leaf}


def _state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "big": rng.integers(0, 255, 12 * MiB, dtype=np.uint8),  # two checkpoint blocks and a half
        "half": rng.standard_normal((512, 1024)).astype(ml_dtypes.bfloat16),
        "x": rng.integers(0, 255, 4 * MiB, dtype=np.uint8),
        "lora": rng.standard_normal(1000).astype(np.float32),  # small: always written
    }


def _save(mgr, step: int, tree: dict) -> dict:
    """Saves ``tree`` (async), waits until it is durable; a copy of what was saved."""
    mgr.save(step, tree)
    mgr.wait_until_finished()
    return {k: v.copy() for k, v in tree.items()}


def _same(a: dict, b: dict) -> None:
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8), k)


@pytest.mark.parametrize("compare", ["memcmp", "numpy"])
def test_an_unchanged_state_is_shared_without_hashing_or_reading_and_every_change_is_written(
    tmp_path, looked, monkeypatch, compare
):
    if compare == "numpy":  # where the C library's memcmp cannot be called
        monkeypatch.setattr(equal_mod, "_memcmp", None)
    tree = _state()
    with fc.CheckpointManager(tmp_path) as mgr:
        saved = [_save(mgr, 0, tree), _save(mgr, 1, tree)]  # the first fills no arena, the second one
        looked.clear()
        saved.append(_save(mgr, 2, tree))  # nothing changed
        assert looked == []
        assert {files(tmp_path / "2")[k] for k in ("big", "half", "x")} == {"../0/data/p0.0.bin"}
        tree["half"][300, 700] = ml_dtypes.bfloat16(float(tree["half"][300, 700]) + 1.0)  # one element
        tree["big"][6 * MiB + 12345] ^= 1  # one bit in the middle
        saved.append(_save(mgr, 3, tree))
        assert looked == []  # their crc32c differ: nothing to hash
        assert not files(tmp_path / "3")["half"].startswith("../")
        assert files(tmp_path / "3")["x"].startswith("../0/")
        tree["x"][:] = _forge(tree["x"], 1000, 2 * MiB)  # every crc32c block as before, bytes not
        saved.append(_save(mgr, 4, tree))
        assert not files(tmp_path / "4")["x"].startswith("../")  # written: found unequal in memory
        assert files(tmp_path / "4")["half"].startswith("../3/")
        for step, expected in enumerate(saved):
            _same(mgr.restore(step), expected)


def _forged_run(tmp_path, between) -> tuple[np.ndarray, np.ndarray]:
    """Steps 0 and 1 hold ``x``; ``between(mgr, forged)`` runs with the arena holding step 2's bytes,
    ``forged``, whose crc32c blocks equal ``x``'s; then step 3 saves ``forged`` against a base holding
    ``x``: it must be written. Returns step 3 restored, and ``forged``."""
    x = np.random.default_rng(5).integers(0, 255, 4 * MiB, dtype=np.uint8)
    forged = _forge(x, 1000, 2 * MiB)
    with fc.CheckpointManager(tmp_path, max_to_keep=None) as mgr:
        _save(mgr, 0, {"x": x})
        _save(mgr, 1, {"x": x})
        between(mgr, forged)
        _save(mgr, 3, {"x": forged})
        return mgr.restore(3)["x"], forged


def test_a_failed_save_s_bytes_in_memory_are_never_shared(tmp_path, monkeypatch):
    def fail_step_2(mgr, forged):
        real = sharing.Sharing.write

        def broken(self, *a, **kw):
            raise OSError("disk full (injected)")

        monkeypatch.setattr(sharing.Sharing, "write", broken)
        mgr.save(2, {"x": forged})  # snapshotted into the arena, never committed
        with pytest.raises(Exception, match="injected"):
            mgr.wait_until_finished()
        monkeypatch.setattr(sharing.Sharing, "write", real)

    got, forged = _forged_run(tmp_path, fail_step_2)
    assert not (tmp_path / "2").exists()
    assert not files(tmp_path / "3")["x"].startswith("../")
    np.testing.assert_array_equal(got, forged)


def test_bytes_in_memory_are_shared_only_with_the_step_that_wrote_them(tmp_path):
    def save_then_restore_step_1(mgr, forged):
        _save(mgr, 2, {"x": forged})  # written (its bytes differ); the arena holds them as step 2's
        mgr.restore(1)  # the next save's base: step 1, which holds x

    got, forged = _forged_run(tmp_path, save_then_restore_step_1)
    assert not files(tmp_path / "3")["x"].startswith(("../0/", "../1/"))
    np.testing.assert_array_equal(got, forged)
