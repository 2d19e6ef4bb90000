"""The compilation cache against a careless or hostile folder: it deletes nothing it did not write, runs
nothing from a folder another user could write, and leaves nothing behind when a write fails.

In the test process, on the cache itself (``fc.use_compilation_cache`` installs this object as JAX's
cache; ``get`` and ``put`` are what JAX calls while it compiles): a run directory or a folder of a user's
files given as the cache, files that the cache did not write in its folder, other owners, modes and links,
a FIFO, a write that fails on a real OS error (RLIMIT_FSIZE) and the temporaries of a dead writer."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src.compile_cache import CompilationCache
from flax_ckpt._src.storage import open_storage

KEYS = {"jit_f-" + "a" * 64: b"program f " * 100, "jit_g-" + "b" * 64: b"program g " * 100}
MARKER = "flax_ckpt_compile_cache.json"


def _cache(location: Path, max_bytes: int = 1 << 20) -> CompilationCache:
    return CompilationCache(open_storage(location), max_bytes)


def _filled(location: Path, max_bytes: int = 1 << 20) -> tuple[CompilationCache, Path]:
    """A cache holding KEYS's programs, and its folder for this JAX."""
    cache = _cache(location, max_bytes)
    for key, value in KEYS.items():
        cache.put(key, value)
    assert cache.info().writes == 2 and all(cache.get(k) == v for k, v in KEYS.items())
    return cache, Path(cache.info().location)


def _tree(path: Path) -> dict[str, object]:
    """Every name below ``path`` with what it is: a file's bytes, a link's target, a folder's owner."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(dirpath, name)
            st = p.lstat()
            out[str(p.relative_to(path))] = (
                ("link", os.readlink(p))
                if p.is_symlink()
                else ("folder", st.st_uid, st.st_mode)
                if p.is_dir()
                else p.read_bytes()
                if p.is_file()
                else ("special", st.st_mode)
            )
    return out


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flax_ckpt" and r.levelno >= logging.WARNING]


def _not_used(location: Path, caplog) -> str:
    """Opens a cache at ``location`` as a restarted program would, and checks it is not used: nothing
    loaded, nothing stored, nothing changed below ``location``; returns its one warning."""
    before = _tree(location)
    caplog.clear()
    cache = _cache(location)
    assert all(cache.get(key) is None for key in KEYS)
    cache.put("jit_h-" + "c" * 64, b"program h")
    assert (cache.info().hits, cache.info().writes) == (0, 0)
    assert _tree(location) == before
    (line,) = _warnings(caplog)
    assert "is not used" in line
    return line


def test_a_run_directory_given_as_the_cache_keeps_every_step(tmp_path, caplog):
    run, state = tmp_path / "run", {"w": np.arange(1000, dtype=np.float32), "n": np.int64(7)}
    with fc.CheckpointManager(run) as mgr:
        mgr.save(1, state)
        mgr.save(2, {**state, "n": np.int64(8)})
    line = _not_used(run, caplog)  # fc.use_compilation_cache(run): a slip for f"{run}/compile_cache"
    assert "'1', '2'" in line and "Fix: give the cache a folder of its own" in line
    with fc.CheckpointManager(run, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2]
        got = mgr.restore(2)
    np.testing.assert_array_equal(got["w"], state["w"])
    assert int(got["n"]) == 8


def test_a_folder_of_a_users_files_is_refused_and_kept(tmp_path, caplog):
    shared = tmp_path / "shared"  # compile_cache="/path/shared", a folder the user keeps other files in
    (shared / "data").mkdir(parents=True)
    (shared / "data" / "train.bin").write_bytes(b"\x01" * 100)
    (shared / "notes.txt").write_text("mine")
    (shared / "jax-notes").mkdir()  # named like the cache's folders
    (shared / "jax-notes" / "todo.txt").write_text("mine too")
    assert "'data', 'jax-notes', 'notes.txt'" in _not_used(shared, caplog)


def test_a_cache_made_in_an_empty_folder_is_marked_private_and_used_again(tmp_path, caplog):
    location = tmp_path / "cache"
    _, folder = _filled(location)
    assert os.stat(location).st_mode & 0o777 == os.stat(folder).st_mode & 0o777 == 0o700
    assert json.loads((location / MARKER).read_text())["format"] == "flax_ckpt compilation cache"
    again = _cache(location)
    assert all(again.get(k) == v for k, v in KEYS.items()) and again.info().hits == 2
    assert _warnings(caplog) == []


def _intrude(case: str, location: Path, folder: Path, outside: Path) -> str:
    """Puts what ``case`` names into a cache; returns what the warning says of it."""
    entry = sorted(folder.iterdir())[0]
    old = location / "jax0.0.1-jaxlib0.0.1-cpu"  # another JAX's folder: the writer removes its entries
    if case == "a user's file beside the cache":
        (location / "notes.txt").write_text("mine")
        return "'notes.txt'"
    if case == "a user's file in another version's folder":
        old.mkdir(mode=0o700)
        (old / "notes.txt").write_text("mine")
        return "notes.txt"
    if case == "another cache's entry":
        old.mkdir(mode=0o700)
        cache_id = json.loads((location / MARKER).read_text())["id"]
        (old / entry.name.replace(cache_id, "0123456789abcdef")).write_bytes(entry.read_bytes())
        return "another cache's, of id 0123456789abcdef"
    if case == "a FIFO in place of an entry":
        entry.unlink()
        os.mkfifo(entry)
        return "a FIFO"
    if case == "a link out of the folder in place of an entry":
        os.rename(entry, outside / entry.name)
        entry.symlink_to(outside / entry.name)
        return "a symbolic link"
    if case == "a root others can write":
        location.chmod(0o777)
        return "is writable by group or others (mode 0o777"
    if case == "a version folder of another user":
        os.chown(folder, 4242, 4242)  # the tests run as root, who can give it away
        return "is owned by uid 4242"
    if case == "a version folder that is a link":
        os.rename(folder, outside / folder.name)
        folder.symlink_to(outside / folder.name)
        return "a symbolic link in place of one of its folders"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "a user's file beside the cache",
        "a user's file in another version's folder",
        "another cache's entry",
        "a FIFO in place of an entry",
        "a link out of the folder in place of an entry",
        "a root others can write",
        "a version folder of another user",
        "a version folder that is a link",
    ],
)
def test_a_cache_holding_what_it_did_not_write_or_others_can_write_is_not_used(tmp_path, case, caplog):
    if os.geteuid() != 0 and case == "a version folder of another user":
        pytest.skip("giving a folder to another user takes root")
    location, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    _, folder = _filled(location)
    said = _intrude(case, location, folder, outside)
    kept = _tree(outside)
    assert said in _not_used(location, caplog)
    assert _tree(outside) == kept


def test_a_failed_write_leaves_no_temporary(tmp_path, caplog):
    cache, folder = _filled(tmp_path / "cache", max_bytes=8 << 20)
    before = sorted(os.listdir(folder))
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # no file of this process past 1 MiB
    try:
        cache.put("jit_big-" + "d" * 64, os.urandom(2 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, xfsz)
    assert sorted(os.listdir(folder)) == before
    assert cache.info().writes == 2 and cache.info().nbytes == sum(f.stat().st_size for f in folder.iterdir())
    (line,) = _warnings(caplog)
    assert "cannot be written" in line and "File too large" in line


def test_temporaries_of_a_dead_writer_are_removed_when_the_cache_opens(tmp_path, caplog):
    location = tmp_path / "cache"
    _, folder = _filled(location)
    cache_id = json.loads((location / MARKER).read_text())["id"]
    dead, live = folder / f".{cache_id}-{'0' * 16}.tmp", folder / f".{cache_id}-{'1' * 16}.tmp"
    dead.write_bytes(b"half a program")  # a writer killed an hour ago
    an_hour_ago = time.time() - 3600
    os.utime(dead, (an_hour_ago, an_hour_ago))
    live.write_bytes(b"half a program")  # another job's write in flight
    again = _cache(location)
    assert all(again.get(k) == v for k, v in KEYS.items())
    assert not dead.exists() and live.exists()
    assert _warnings(caplog) == []


def test_on_s3_a_run_given_as_the_cache_keeps_every_object_and_a_cache_of_its_own_works(s3, caplog):
    with fc.CheckpointManager(s3.url) as mgr:
        mgr.save(1, {"w": np.arange(100, dtype=np.float32)})
        mgr.save(2, {"w": np.arange(100, dtype=np.float32) + 1})
    before = s3.keys()
    slip = CompilationCache(open_storage(s3.url), 1 << 20)  # fc.use_compilation_cache(run)
    slip.put("jit_h-" + "c" * 64, b"program h")
    assert slip.get("jit_h-" + "c" * 64) is None and slip.info().writes == 0
    assert s3.keys() == before
    (line,) = _warnings(caplog)
    assert "is not used" in line and "'1', '2'" in line
    own = CompilationCache(open_storage(f"{s3.url}/compile_cache"), 1 << 20)
    for key, value in KEYS.items():
        own.put(key, value)
    again = CompilationCache(open_storage(f"{s3.url}/compile_cache"), 1 << 20)
    assert all(again.get(k) == v for k, v in KEYS.items()) and again.info().hits == 2
    assert len(_warnings(caplog)) == 1
    with fc.CheckpointManager(s3.url, read_only=True) as mgr:
        assert mgr.all_steps() == [1, 2]
