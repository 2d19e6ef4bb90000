"""Steps that share bytes, attacked where the bytes are damaged or gone (hostile tests).

A run's steps refer to unchanged chunks of earlier steps (native/sharing.py; docs/design.md, "Steps that
share bytes"). Pinned here: damaged shared bytes are never referred to again (a new process reads a
base chunk against its checksum before its first share of it; a step a restore found damaged is never
a base); a save never refers to a file that is not there, and the error for a step whose shared folder
was deleted names that folder; saving a damaged step's number again leaves the steps that refer to it
readable (a reference resolves only to the folder of its recorded id); a damaged newest step is saved
again when the run gets there, through the manager and the callback. Local folders and s3:// (moto).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.tools.cli import main
from flax_ckpt.callbacks import CheckpointCallback
from helpers import assert_bit_exact
from object_stores import STORES, Store

MiB = 1 << 20
HELD = re.compile(r"([0-9]+)\.held-([0-9a-f]{32})")
FROZEN = np.random.default_rng(0).standard_normal(MiB // 4, dtype=np.float32)  # 1 MiB that never changes


def state(step: int) -> dict:
    return {"frozen": FROZEN, "head": np.full(16, step, np.float32)}


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def flip_file(path, at: int | None = None) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(flip(data, len(data) // 2 if at is None else at))


def held(names) -> list[str]:
    return [n for n in names if HELD.fullmatch(n)]


def shared_files(manifest: dict) -> dict:
    return (manifest["body"].get("shared") or {}) if "body" in manifest else (manifest.get("shared") or {})


def saves(d, steps, **kw) -> None:
    with fc.CheckpointManager(d, async_save=False, **kw) as mgr:
        for s in steps:
            assert mgr.save(s, state(s))


def restores_all_damaged(d) -> None:
    with fc.CheckpointManager(d) as mgr:
        with pytest.raises(fc.CorruptCheckpointError):
            mgr.restore()


# ------------------------------------------------------------------- 1. damaged shared bytes


def test_damaged_shared_bytes_are_never_referred_to_again(tmp_path, caplog):
    caplog.set_level(logging.ERROR, "flax_ckpt")
    saves(tmp_path, range(1, 6), max_to_keep=3)
    (base,) = held(os.listdir(tmp_path))
    assert base.startswith("1.")
    flip_file(tmp_path / base / "data" / "p0.0.bin", 1000)  # one bit of the frozen leaf's bytes
    with fc.CheckpointManager(tmp_path, async_save=False, max_to_keep=3) as mgr:
        with pytest.raises(fc.CorruptCheckpointError):
            mgr.restore()  # 5, 4 and 3 share the damaged bytes: every one is damaged
        for s in range(6, 10):
            assert mgr.save(s, state(s))
    with fc.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [7, 8, 9]
        for s in (7, 8, 9):
            assert_bit_exact(mgr.restore(s), state(s))
    # the damaged base is freed with the last step naming it (6's bytes are held for 7-9)
    assert [h.split(".")[0] for h in held(os.listdir(tmp_path))] == ["6"]


def test_a_new_process_reads_a_base_chunk_before_its_first_share(tmp_path):
    """Nothing restored, nothing known damaged: the first save of a new manager (in a new process, or
    in this one) reads back the chunk it would refer to, finds it differs, and writes it."""
    saves(tmp_path, (1, 2))
    flip_file(tmp_path / "1" / "data" / "p0.0.bin", 1000)
    saves(tmp_path, (3, 4))
    assert "../1/" not in (tmp_path / "3" / "manifest.json").read_text()
    assert_bit_exact(fc.restore(tmp_path / "4"), state(4))


@pytest.fixture
def s3_store(s3) -> Store:
    return STORES["s3"](s3)


def test_damaged_shared_bytes_on_s3_are_never_referred_to_again(s3_store: Store):
    store = s3_store
    saves(store.url, range(1, 6), max_to_keep=3)
    keys = store.keys()
    assert held(keys) and not any(k.startswith("2/") for k in keys)
    (data,) = [k for k in keys if k.startswith("1/data/")]
    key = f"{store.prefix}/{data}"
    store.server.put(store.bucket, key, flip(store.server.get(store.bucket, key), 1000))
    with fc.CheckpointManager(store.url, async_save=False, max_to_keep=3) as mgr:
        with pytest.raises(fc.CorruptCheckpointError):
            mgr.restore()
        for s in range(6, 10):
            assert mgr.save(s, state(s))
    with fc.CheckpointManager(store.url) as mgr:
        assert mgr.all_steps() == [7, 8, 9]
        for s in (7, 8, 9):
            assert_bit_exact(mgr.restore(s), state(s))


# ------------------------------------------------------------------- 2. a referenced file deleted


@pytest.mark.parametrize("which", ["held", "step"])
def test_a_save_never_refers_to_a_folder_that_is_gone(tmp_path, which):
    if which == "held":
        saves(tmp_path, range(1, 6), max_to_keep=3)
        (gone,) = held(os.listdir(tmp_path))
    else:
        saves(tmp_path, range(1, 6))
        gone = "1"
    shutil.rmtree(tmp_path / gone)  # a user tidies up what looks like a leftover
    with fc.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(fc.CorruptCheckpointError) as e:
            mgr.restore(5)
    assert gone in str(e.value) and "missing" in str(e.value) and "convert" not in str(e.value)
    saves(tmp_path, range(6, 9), **({"max_to_keep": 3} if which == "held" else {}))
    for s in range(6, 9):
        assert_bit_exact(fc.restore(tmp_path / str(s)), state(s))


def test_a_folder_deleted_while_the_run_saves_is_not_referred_to(tmp_path):
    with fc.CheckpointManager(tmp_path, async_save=False) as mgr:
        for s in range(1, 4):
            mgr.save(s, state(s))
        shutil.rmtree(tmp_path / "1")  # by hand, while the manager that wrote it runs on
        for s in (4, 5):
            assert mgr.save(s, state(s))
            assert_bit_exact(mgr.restore(s), state(s))


# ------------------------------------------------------------------- 3. a damaged step saved again


class Place:
    """A run on a local folder or on the s3:// server: its URL, its top-level names, a file's bytes."""

    def __init__(self, tmp_path, store: Store | None):
        self.store, self.tmp = store, tmp_path
        self.url = str(tmp_path) if store is None else store.url

    def names(self) -> set[str]:
        if self.store is None:
            return set(os.listdir(self.tmp))
        return {k.split("/")[0] for k in self.store.keys()}

    def get(self, key: str) -> bytes:
        if self.store is None:
            return (self.tmp / key).read_bytes()
        return self.store.server.get(self.store.bucket, f"{self.store.prefix}/{key}")

    def put(self, key: str, data: bytes) -> None:
        if self.store is None:
            (self.tmp / key).write_bytes(data)
        else:
            self.store.server.put(self.store.bucket, f"{self.store.prefix}/{key}", data)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_saving_a_damaged_step_again_keeps_the_steps_that_refer_to_it(tmp_path, request, where):
    place = Place(tmp_path, None if where == "local" else STORES["s3"](request.getfixturevalue("s3")))
    other = np.random.default_rng(1).standard_normal(MiB // 4, dtype=np.float32)

    def st(step):
        return {"frozen": FROZEN if step == 1 else other, "head": np.full(16, step, np.float32)}

    with fc.CheckpointManager(place.url, async_save=False) as mgr:
        for s in range(1, 5):
            mgr.save(s, st(s))
    for s in (3, 4):
        assert "2" in json.loads(place.get(f"{s}/manifest.json"))["body"]["shared"]
    place.put("2/manifest.json", place.get("2/manifest.json")[:-40])  # step 2: damaged
    with fc.CheckpointManager(place.url, async_save=False) as mgr:
        assert mgr.all_steps() == [1, 3, 4]
        assert mgr.save(2, st(2))
        for s in (2, 3, 4):
            assert_bit_exact(mgr.restore(s), st(s))
    assert len(held(place.names())) == 1
    with fc.CheckpointManager(place.url, async_save=False) as mgr:
        assert_bit_exact(mgr.restore(3), st(3))  # read again by a new manager
    fresh = {"frozen": np.zeros(MiB // 4, np.float32), "head": np.full(16, 5, np.float32)}
    with fc.CheckpointManager(place.url, max_to_keep=1, async_save=False) as mgr:  # frees it with 3, 4
        assert mgr.save(5, fresh)
        assert_bit_exact(mgr.restore(5), fresh)
    assert held(place.names()) == []


# ------------------------------------------------------------------- 6. a damaged newest step


def big(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(MiB // 4, dtype=np.float32)}


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_damaged_newest_step_is_saved_again_by_the_manager(tmp_path, request, caplog, where):
    place = Place(tmp_path, None if where == "local" else STORES["s3"](request.getfixturevalue("s3")))
    with fc.CheckpointManager(place.url, async_save=False) as mgr:
        for s in (100, 200):
            mgr.save(s, big(s))
    (data,) = [f for f in json.loads(place.get("200/manifest.json"))["body"]["files"]]
    place.put(f"200/{data}", flip(place.get(f"200/{data}"), MiB // 2))
    with fc.CheckpointManager(place.url, save_interval_steps=100) as mgr:
        assert_bit_exact(mgr.restore(), big(100))
        assert "step 200" in caplog.text and "damaged" in caplog.text
        assert mgr.latest_step() == 100
        assert mgr.save(200, big(200), force=True)
    # set aside, not deleted: moved on a local folder, retired (freed by a later sweep) on s3://
    mark = ".damaged-" if where == "local" else ".held-"
    assert [n for n in place.names() if n.startswith("200" + mark)]
    with fc.CheckpointManager(place.url) as mgr:
        assert mgr.all_steps() == [100, 200]
        assert_bit_exact(mgr.restore(), big(200))


def test_a_damaged_newest_step_is_saved_again_by_the_callback(tmp_path, caplog):
    with fc.CheckpointManager(tmp_path, async_save=False) as mgr:
        for s in (100, 200):
            mgr.save(s, big(s))
    flip_file(tmp_path / "200" / "data" / "p0.0.bin")
    ckpt = CheckpointCallback(tmp_path, every_steps=100)
    restored, start = ckpt.restore_or(big(0))
    assert start == 100
    assert_bit_exact(restored, big(100))
    for step in range(start + 1, 201):
        ckpt(step, big(step) if step == 200 else restored)
    ckpt.close()
    assert_bit_exact(fc.restore(tmp_path / "200"), big(200))


def test_ls_says_which_steps_need_a_retired_folder(tmp_path, capsys):
    saves(tmp_path, range(1, 6), max_to_keep=3)
    (name,) = held(os.listdir(tmp_path))
    capsys.readouterr()
    assert main(["ls", str(tmp_path)]) == 0
    line = next(li for li in capsys.readouterr().out.splitlines() if name in li)
    assert "needed by steps 3, 4, 5" in line
    assert main(["ls", "--json", str(tmp_path)]) == 0
    (entry,) = [e for e in json.loads(capsys.readouterr().out)["steps"] if e["name"] == name]
    assert entry["state"] == "held" and entry["needed_by"] == [3, 4, 5]
