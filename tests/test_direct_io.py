"""Large files written with O_DIRECT (storage/local.py): the bytes on disk are exactly the buffers,
whatever their sizes and alignment, on a file system that takes O_DIRECT (ext4 on a loop device, and
whatever holds pytest's tmp_path), one that refuses it (tmpfs), and one whose O_DIRECT open or write
is refused (EINVAL) at run time; FLAX_CKPT_DIRECT_IO=0 turns it off; a full ext4 fails a save clearly
and keeps the older steps.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest
from reliability_trials import MountRefused, disk_full_trial, ext4

from flax_ckpt._src.storage import local
from flax_ckpt._src.storage.local import DIRECT_FILE_SYSTEMS, DIRECT_MIN, LocalStorage

STAGE = local._STAGE
SIZES = [  # each a list of buffer sizes written back to back as one file
    [DIRECT_MIN],
    [DIRECT_MIN + 1],
    [STAGE],
    [STAGE - 1, 1],
    [STAGE + 4097, 3],
    [1, 4095, DIRECT_MIN, 7, 2 * STAGE - 5],
    [5 * (1 << 20), 0, 13],
    [3] * 100 + [DIRECT_MIN + 4096 * 3],
]


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    """Each test decides anew which file systems take O_DIRECT (a refusal is remembered per device)."""
    monkeypatch.setattr(local, "_fs_direct", {})


@pytest.fixture
def small_ext4(tmp_path):
    try:
        with ext4(str(tmp_path / "mnt"), 64) as mount:
            yield mount
    except MountRefused as e:
        pytest.skip(f"cannot mount an ext4 loop device (needs root, mkfs.ext4 and loop devices): {e}")


def _buffers(sizes: list[int], seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):  # every kind of buffer the serializers pass, at odd addresses too
        raw = rng.integers(0, 256, n + 1, dtype=np.uint8)
        out.append(raw[1:] if i % 3 == 0 else raw[:n].tobytes() if i % 3 == 1 else memoryview(raw[:n]))
    return out


def _opens(monkeypatch) -> list[tuple[str, int]]:
    """Records (path, flags) of every os.open."""
    seen, real = [], os.open

    def spy(path, flags, *a, **k):
        seen.append((os.fspath(path), flags))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    return seen


def _write_and_check(folder: str, sizes: list[int], seed: int) -> None:
    bufs = _buffers(sizes, seed)
    LocalStorage(folder).write("sub/f.bin", bufs)
    with open(os.path.join(folder, "sub", "f.bin"), "rb") as f:
        got = f.read()
    want = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    assert len(got) == len(want) and got == want, f"sizes {sizes}: the file differs from the buffers"


@pytest.mark.parametrize("mode", ["auto", "0"])
def test_files_hold_exactly_the_buffers_on_ext4(small_ext4, monkeypatch, mode):
    monkeypatch.setenv("FLAX_CKPT_DIRECT_IO", mode)
    opens = _opens(monkeypatch)
    for seed, sizes in enumerate(SIZES):
        _write_and_check(small_ext4, sizes, seed)
    direct = [bool(flags & os.O_DIRECT) for path, flags in opens if path.endswith("f.bin")]
    assert direct == [mode == "auto"] * len(SIZES)


def test_tmp_path_and_tmpfs_round_trip_and_direct_io_follows_the_file_system(tmp_path, monkeypatch):
    """pytest's tmp_path (whatever file system the machine has) and /dev/shm (tmpfs, which refuses
    O_DIRECT): exact bytes; O_DIRECT exactly where findmnt names a file system of DIRECT_FILE_SYSTEMS;
    small files always through the page cache."""
    if not shutil.which("findmnt"):
        pytest.skip("findmnt (util-linux) is needed to name each folder's file system independently")
    folders = [str(tmp_path)]
    if os.path.isdir("/dev/shm"):
        shm = str(tmp_path / "shm")
        os.symlink(tempfile.mkdtemp(dir="/dev/shm"), shm)
        folders.append(shm)
    try:
        for folder in folders:
            fstype = subprocess.run(
                ["findmnt", "-n", "-o", "FSTYPE", "--target", folder],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()[-1]  # the last of stacked mounts is seen
            assert local._fs_type(os.stat(folder).st_dev) == fstype, folder
            opens = _opens(monkeypatch)
            _write_and_check(folder, [DIRECT_MIN + 12345], 1)
            LocalStorage(folder).write("small.json", [b"{}"])
            monkeypatch.undo()
            flags = {os.path.basename(p): f for p, f in opens if p.endswith((".bin", ".json"))}
            assert bool(flags["f.bin"] & os.O_DIRECT) == (fstype in DIRECT_FILE_SYSTEMS), (folder, fstype)
            assert not flags["small.json"] & os.O_DIRECT
    finally:
        if len(folders) > 1:
            shutil.rmtree(os.path.realpath(folders[1]))


def test_a_refused_direct_open_or_write_goes_on_through_the_page_cache(small_ext4, monkeypatch):
    """EINVAL from an O_DIRECT open (e.g. a FUSE mount) or write (a block larger than 4096 bytes): the
    file is written whole through the page cache, and that file system is not tried again."""
    real_open, real_pwrite = os.open, os.pwrite
    refused = []

    def pwrite(fd, data, pos):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and pos >= STAGE:  # the second direct write fails
            refused.append(pos)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    _write_and_check(small_ext4, [3 * STAGE + 17], 2)
    assert refused == [STAGE] and local.direct_io(small_ext4) is False
    monkeypatch.setattr(local, "_fs_direct", {})

    def refuse_direct_open(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refuse_direct_open)
    _write_and_check(small_ext4, [STAGE + 5], 3)
    _write_and_check(small_ext4, [STAGE + 6], 4)
    assert len(refused) == 2, "the refusing file system was tried again"


def test_files_written_at_once_from_several_threads_keep_their_bytes(small_ext4):
    """The staging buffers are shared: eight files written at once (the raw serializer's parallel files)
    each hold exactly their own bytes."""
    errors = []

    def one(i: int) -> None:
        try:
            for seed in range(3):
                sizes = [STAGE + 1000 * i + seed, 4096 * i + 1]
                bufs = _buffers(sizes, 100 * i + seed)
                LocalStorage(os.path.join(small_ext4, f"t{i}")).write("f.bin", bufs)
                with open(os.path.join(small_ext4, f"t{i}", "f.bin"), "rb") as f:
                    assert f.read() == b"".join(bytes(memoryview(b).cast("B")) for b in bufs), i
                os.unlink(os.path.join(small_ext4, f"t{i}", "f.bin"))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.timeout(120)
def test_full_ext4_fails_the_save_clearly_keeps_older_steps_and_recovers(small_ext4):
    """The disk-full trial of test_reliability_disk.py on ext4, where the data files go with O_DIRECT."""
    assert local.direct_io(small_ext4)
    for seed in range(2):
        outcome = disk_full_trial(small_ext4, "raw", random.Random(seed))
        assert outcome.ok, f"{outcome.kind}: {outcome.detail}"


def test_a_forked_child_writing_at_the_same_time_does_not_share_the_staging_buffers(small_ext4, monkeypatch):
    """A process forked after a save (a data-loader worker, a forked evaluation) keeps the parent's
    spare staging buffers: the two processes' writes at the same time must not mix their bytes. (Each
    write waits 2 ms between filling the buffer and writing it, as a busy disk would, so that the two
    processes' writes interleave.)"""
    LocalStorage(small_ext4).write("warm.bin", _buffers([STAGE + 1], 0))  # a staging buffer kept for reuse
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, pos):
        time.sleep(0.002)
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    go_r, go_w = os.pipe()

    def write_files(who: str) -> bool:
        ok = True
        for k in range(8):
            bufs = _buffers([3 * STAGE + 4096 * k + 3], (7 if who == "child" else 11) * 100 + k)
            name = f"{who}{k}.bin"
            LocalStorage(small_ext4).write(name, bufs)
            with open(os.path.join(small_ext4, name), "rb") as f:
                ok &= f.read() == b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
            os.unlink(os.path.join(small_ext4, name))
        return ok

    pid = os.fork()
    if pid == 0:  # the child: only numpy and os calls
        status = 1
        try:
            os.read(go_r, 1)
            status = 0 if write_files("child") else 3
        finally:
            os._exit(status)
    os.write(go_w, b"x")
    parent_ok = write_files("parent")
    _, status = os.waitpid(pid, 0)
    os.close(go_r)
    os.close(go_w)
    assert parent_ok and os.waitstatus_to_exitcode(status) == 0, (parent_ok, status)


def test_a_write_that_makes_no_progress_fails_naming_the_file(small_ext4, monkeypatch):
    """A pwrite that returns 0 (a broken driver) must be an error naming the file, never a loop."""
    monkeypatch.setattr(os, "pwrite", lambda fd, data, pos: 0)
    with pytest.raises(OSError) as info:
        LocalStorage(small_ext4).write("stuck.bin", _buffers([STAGE + 1], 5))
    assert info.value.errno == errno.EIO and "stuck.bin" in str(info.value)


def _address(v) -> int:
    return np.frombuffer(memoryview(v).cast("B"), np.uint8).ctypes.data


@pytest.mark.parametrize("case", ["aligned", "tail", "gaps", "unaligned start"])
def test_buffers_back_to_back_in_page_aligned_memory_are_written_from_it(small_ext4, monkeypatch, case):
    """A snapshot's arena (engine/arena.py) hands the raw serializer buffers that lie back to back from a
    page boundary: they are written with O_DIRECT straight from that memory (the disk reads the bytes
    where they are; no staging copy), only what is not a multiple of 4096 at the end of a run, and
    whatever is not such a run, going through a staging buffer. The file holds exactly the buffers."""
    arena = mmap.mmap(-1, 4 * STAGE, flags=mmap.MAP_PRIVATE)
    mem = np.frombuffer(arena, np.uint8)
    mem[:] = np.random.default_rng(7).integers(0, 256, mem.size, dtype=np.uint8)
    base = _address(mem)
    cuts = {
        "aligned": [(0, DIRECT_MIN), (DIRECT_MIN, 4096), (DIRECT_MIN + 4096, STAGE)],
        "tail": [(0, 3), (3, STAGE - 3), (STAGE, 4096 * 5 + 1)],
        "gaps": [(0, STAGE + 7), (STAGE + 16, 4096), (2 * STAGE, 8192)],
        "unaligned start": [(1, STAGE), (STAGE + 1, 100)],
    }[case]
    bufs = [memoryview(mem[o : o + n]) for o, n in cuts]
    if case == "gaps":
        bufs.insert(1, b"not in the arena")
    takes, writes = [], []
    real_take, real_pwrite = local._stages.take, os.pwrite

    def take():
        takes.append(1)
        return real_take()

    def pwrite(fd, data, pos):
        writes.append(
            (_address(data) - base, len(data), pos, bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        )
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(local._stages, "take", take)
    monkeypatch.setattr(os, "pwrite", pwrite)
    LocalStorage(small_ext4).write("f.bin", bufs)
    with open(os.path.join(small_ext4, "f.bin"), "rb") as f:
        assert f.read() == b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    from_memory = [(a, n, pos) for a, n, pos, direct in writes if direct and 0 <= a < 4 * STAGE]
    total = sum(len(memoryview(b).cast("B")) for b in bufs)
    if case == "aligned":  # one run, a multiple of 4096: one write from the arena, nothing staged
        assert from_memory == [(0, total, 0)] and not takes
    elif case == "tail":  # the run's whole pages from the arena, its last 1 byte staged
        assert from_memory == [(0, total - 1, 0)] and len(takes) == 1
    elif case == "gaps":  # the first run's pages from the arena; after it, nothing lines up: staged
        assert from_memory == [(0, STAGE, 0)] and len(takes) == 1
    else:  # a run that does not start on a page: staged, whatever its length
        assert from_memory == [] and len(takes) == 1


def test_page_cache_writes_are_bounded_per_call_and_keep_every_byte(tmp_path, monkeypatch):
    """Through the page cache (tmpfs, or FLAX_CKPT_DIRECT_IO=0), no writev call carries more than
    WRITE_STEP bytes (one long write holds up the process's other threads, a training step's among
    them), and the file still holds exactly the buffers, in order, where the step cuts a buffer or
    spans several."""
    monkeypatch.setenv("FLAX_CKPT_DIRECT_IO", "0")
    monkeypatch.setattr(local, "WRITE_STEP", 1000)
    calls: list[int] = []
    real = os.writev

    def writev(fd, bufs):
        calls.append(sum(len(memoryview(b)) for b in bufs))
        return real(fd, bufs)

    monkeypatch.setattr(os, "writev", writev)
    rng = np.random.default_rng(7)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 999, 1000, 1001, 2500, 7, 0, 3333)]
    LocalStorage(str(tmp_path)).write("f.bin", bufs)
    assert max(calls) <= 1000 and len(calls) >= sum(b.nbytes for b in bufs) // 1000
    assert (tmp_path / "f.bin").read_bytes() == b"".join(b.tobytes() for b in bufs)


def test_a_file_deleted_while_it_is_read_is_not_found_not_rewritten(tmp_path, monkeypatch):
    """Retention deleting a step while a reader reads its manifest: unlinking the file moves its ctime,
    which read as "rewritten" (a CorruptCheckpointError: damage) once in about 2,000 reads of a reader
    beside a live run; it is a FileNotFoundError, which readers report as a step gone."""
    (tmp_path / "manifest.json").write_bytes(b"{}" * 100)
    real = os.fdopen

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        os.unlink(tmp_path / "manifest.json")  # after the open, before the read
        return f

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(FileNotFoundError, match="deleted while it was being read"):
        LocalStorage(str(tmp_path)).read("manifest.json", 1 << 20)


def test_write_if_absent_stages_under_a_temporary_name(tmp_path, monkeypatch):
    """A process killed inside write_if_absent (the commit record, the run's id file) leaves at most
    its staging file, named as every temporary of the library is (never read as a checkpoint, recognised
    by the crash checks): it was ``<name>.tmp-<pid>-<ns>``, which a SIGKILL trial found as an unknown
    entry of the run directory."""
    from flax_ckpt._src.commit import atomic

    staged = []
    real = os.link
    monkeypatch.setattr(
        os, "link", lambda src, dst: (staged.append(os.path.basename(src)), real(src, dst))[1]
    )
    assert LocalStorage(str(tmp_path)).write_if_absent(".flax_ckpt.run", b"{}")
    assert len(staged) == 1 and atomic.is_temporary(staged[0]), staged
    assert atomic.base_name(staged[0]) == ".flax_ckpt.run"
    assert sorted(os.listdir(tmp_path)) == [".flax_ckpt.run"]
