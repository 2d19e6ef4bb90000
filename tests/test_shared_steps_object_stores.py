"""Steps of a run share what did not change on s3:// and gs:// too (issue 54), and nothing is lost.

An object store has no rename, so a removed step that a kept step refers to is retired otherwise than
on a local folder: its hold ``<step>.held-<id>`` is written, then its manifest deleted; its data objects
stay where they are until no committed manifest names the step and id (native/sharing.py; docs/design.md,
"Steps that share bytes"). Each test runs on s3:// (moto) and gs:// (fake-gcs-server), reached as a user
would, but the random-kill crash trial (s3:// only: the same code, and its savers take seconds). Pinned
here: the bytes stored, retention, a failed and a repeated save of a held step number never losing a
kept step's bytes, a real SIGKILL between the requests of a retirement and of a release and at random
moments, and the tools on such a step.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import flax_ckpt as fc
import forkserver
from flax_ckpt._src.storage import kv as kv_mod
from flax_ckpt._src.tools.cli import main
from helpers import assert_bit_exact, worker_env
from object_stores import STORES, Store

KiB, MiB = 1 << 10, 1 << 20
HELD = re.compile(r"([0-9]+)\.held-([0-9a-f]{32})")


@pytest.fixture(params=list(STORES))
def store(request: pytest.FixtureRequest) -> Store:
    """A fresh prefix on the s3:// or the gs:// server; the environment points flax_ckpt at it."""
    cls = STORES[request.param]
    return cls(request.getfixturevalue(cls.fixture))


def frozen(seed: int = 0) -> dict:
    """4 MiB that never changes: four 1 MiB matrices."""
    rng = np.random.default_rng(seed)
    return {f"w{i}": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(4)}


def state(step: int, base: dict) -> dict:
    """``base`` and 256 KiB that change at every step."""
    rng = np.random.default_rng(1000 + step)
    return {"frozen": base, "lora": {k: rng.standard_normal(32 * KiB, dtype=np.float32) for k in "ab"}}


FULL, CHANGED = 4 * MiB + 256 * KiB, 256 * KiB


def stored(store: Store) -> int:
    """The bytes of every object under the store's prefix, read from the server."""
    return sum(len(store.server.get(store.bucket, f"{store.prefix}/{k}")) for k in store.keys())


def accounted(store: Store) -> tuple[set[str], set[str]]:
    """(objects no committed manifest and no hold a committed manifest names accounts for, holds that no
    committed manifest names), straight from the server: both empty once nothing is left behind."""
    keys = set(store.keys())

    def doc(key: str) -> dict:
        return json.loads(store.server.get(store.bucket, f"{store.prefix}/{key}"))["body"]

    named, needed = set(), set()
    for key in keys:
        step, _, rest = key.partition("/")
        if rest == "manifest.json":
            body = doc(key)
            named |= {key} | {f"{step}/{f}" for f in body["files"]}
            needed |= {(s, h["id"]) for s, h in (body.get("shared") or {}).items()}
    holds = {k for k in keys if HELD.fullmatch(k)}
    for key in holds:
        step, ident = HELD.fullmatch(key).groups()  # type: ignore[union-attr]
        if (step, ident) in needed:
            named |= {key} | {f"{step}/{f}" for f in doc(key)["files"]}
    return keys - named - holds, {k for k in holds if tuple(HELD.fullmatch(k).groups()) not in needed}  # type: ignore[union-attr]


def cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("keep", [None, 2])
def test_ten_saves_to_an_object_store_cost_one_state_and_what_changed(store: Store, keep):
    base = frozen()
    with fc.CheckpointManager(store.url, max_to_keep=keep, async_save=False) as mgr:
        for s in range(10):
            mgr.save(s, state(s, base))
        kept = mgr.all_steps()
    n = 10 if keep is None else keep
    assert kept == list(range(10 - n, 10))
    want = FULL + (n - 1 if keep is None else n) * CHANGED
    assert stored(store) <= 1.3 * want, (stored(store) / MiB, want / MiB)
    assert accounted(store) == (set(), set())
    with fc.CheckpointManager(store.url, read_only=True) as mgr:
        for s in sorted({kept[0], 9}):  # bit-exact, each step by itself
            assert_bit_exact(mgr.restore(s, state(s, base)), state(s, base))
    assert_bit_exact(fc.restore(f"{store.url}/9"), state(9, base))  # a step folder, no target


def test_retention_keeps_held_bytes_across_a_new_base_and_a_step_number_saved_again(
    store: Store, monkeypatch
):
    a, b = frozen(0), frozen(1)
    with fc.CheckpointManager(store.url, max_to_keep=2, async_save=False) as mgr:
        for s in range(4):
            mgr.save(s, state(s, a))
        holds = [k for k in store.keys() if HELD.fullmatch(k)]
        assert [h.split(".")[0] for h in holds] == ["0"]  # step 0: no longer a step, its bytes kept
        assert mgr.all_steps() == [2, 3]
    held = set(store.keys("0"))

    # a save of step 0 again that fails at its commit: what it wrote goes, the held objects stay
    def refuse_commit(self, name, data):
        raise fc.StorageError(f"{self.url}/{name}: refused (the test)")

    with monkeypatch.context() as patched, pytest.raises(fc.StorageError, match="refused"):
        patched.setattr(kv_mod.KvStorage, "write_if_absent", refuse_commit)  # the commit's one request
        fc.save(f"{store.url}/0", state(0, b), step=0)
    assert set(store.keys("0")) == held
    # a crashed save's object there: removed when a manager next opens the run, the held ones kept
    store.server.put(store.bucket, f"{store.prefix}/0/data/p0-{'5' * 32}.0.bin", b"x" * 100)
    with fc.CheckpointManager(store.url, max_to_keep=2, async_save=False) as mgr:
        assert mgr.all_steps() == [2, 3]
    assert set(store.keys("0")) == held
    # step 0 saved again, by itself: its new objects never take the names of the held ones
    fc.save(f"{store.url}/0", state(0, b), step=0)
    assert_bit_exact(fc.restore(f"{store.url}/3"), state(3, a))
    with fc.CheckpointManager(store.url, max_to_keep=2, async_save=False) as mgr:
        assert mgr.all_steps() == [0, 2, 3]
        mgr.save(4, state(4, a))
        assert_bit_exact(mgr.restore(4), state(4, a))
        for s in (5, 6, 7):  # a new base: nothing refers to step 0's old bytes any more
            mgr.save(s, state(s, b))
        assert_bit_exact(mgr.restore(7), state(7, b))
    # step 0's old bytes freed; step 5 (the first save of the new base) holds what 6 and 7 share
    assert [k.split(".")[0] for k in store.keys() if HELD.fullmatch(k)] == ["5"]
    assert accounted(store) == (set(), set())
    assert stored(store) <= 1.3 * (FULL + 2 * CHANGED)


CHILD = """
import os, re, signal, sys
import numpy as np
import flax_ckpt as fc
from flax_ckpt._src.storage import kv
sys.path.insert(0, {tests!r})
from test_shared_steps_object_stores import frozen, state

url, point, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
held = re.compile(r".*/[0-9]+\\.held-[0-9a-f]{{32}}$")
seen = []
write, delete = kv.KvStorage.write, kv.KvStorage.delete

def on_write(self, name, buffers):
    out = write(self, name, buffers)
    if held.match(f"{{self.url}}/{{name}}"):
        seen.append(name)  # a hold is durable
    return out

def on_delete(self, name=""):
    doomed = f"{{self.url}}/{{name}}"
    if point == "retire" and seen:  # the hold written, the manifest not yet deleted
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "release" and held.match(doomed):  # the held objects deleted, the hold not yet
        os.kill(os.getpid(), signal.SIGKILL)
    return delete(self, name)

kv.KvStorage.write, kv.KvStorage.delete = on_write, on_delete
a, b = frozen(0), frozen(1)
with fc.CheckpointManager(url, max_to_keep=2, async_save=False) as mgr:
    for s in steps:
        mgr.save(s, state(s, a if s < 4 else b))
print("no kill")
"""


@pytest.mark.parametrize(
    "point, steps, then",
    [
        ("retire", "0,1,2", "save"),  # step 2's retention retires step 0: killed between its two writes
        ("release", "0,1,2,3,4,5", "prune"),  # step 5's frees step 0's bytes: killed before the hold goes
    ],
)
def test_a_kill_between_the_steps_of_a_retirement_loses_nothing_and_is_cleaned_up(
    store: Store, tmp_path, capsys, point, steps, then
):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(tests=str(__import__("helpers").TESTS))))
    child = forkserver.run(
        [sys.executable, str(script), store.url, point, steps],
        env=worker_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    a, b = frozen(0), frozen(1)
    last = int(steps.split(",")[-1])
    with fc.CheckpointManager(store.url, read_only=True) as mgr:
        kept = mgr.all_steps()
        assert last in kept
        for s in kept:  # every step still committed restores bit-exactly
            assert_bit_exact(mgr.restore(s, state(s, a if s < 4 else b)), state(s, a if s < 4 else b))
    rc, out = cli(capsys, "verify", store.url)
    assert rc == 0, out
    if then == "save":
        with fc.CheckpointManager(store.url, max_to_keep=2, async_save=False) as mgr:
            mgr.save(last + 1, state(last + 1, a if last + 1 < 4 else b))
            assert mgr.all_steps() == [last, last + 1]
    else:
        rc, out = cli(capsys, "prune", store.url, "--keep", "2")
        assert rc == 0, out
    assert accounted(store) == (set(), set())
    for s in fc.CheckpointManager(store.url, read_only=True).all_steps():
        assert_bit_exact(fc.restore(f"{store.url}/{s}"), state(s, a if s < 4 else b))


def test_tools_on_a_step_whose_bytes_are_held(store: Store, tmp_path, capsys):
    base = frozen()
    with fc.CheckpointManager(store.url, max_to_keep=2, async_save=False) as mgr:
        for s in range(4):
            mgr.save(s, state(s, base))
    step = f"{store.url}/3"
    info = fc.metadata(step)
    assert info.step == 3 and info.nbytes >= 4 * MiB
    for args in (["verify", step], ["info", step]):
        rc, out = cli(capsys, *args)
        assert rc == 0, (args, out)
    rc, out = cli(capsys, "verify", store.url, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["skipped"] == [], out  # step 0's held objects are no uncommitted step
    rc, out = cli(capsys, "ls", store.url, "--json")
    assert rc == 0, out
    doc = json.loads(out)
    committed = [e for e in doc["steps"] if e["state"] == "committed"]
    assert [e["step"] for e in committed] == [2, 3]
    assert all(e["shared_nbytes"] >= 4 * MiB for e in committed)
    assert [e["state"] for e in doc["steps"] if e["step"] == 0] == ["held"]  # no half step 0 besides
    rc, out = cli(capsys, "convert", step, str(tmp_path / "copy"), "--to", "native")
    assert rc == 0, out
    assert "shared" not in json.load(open(tmp_path / "copy" / "manifest.json"))["body"]
    for k in store.keys():  # the run deleted: the copy stands alone
        store.delete(k)
    assert_bit_exact(fc.restore(tmp_path / "copy"), state(3, base))


SAVER = """
import sys
sys.path.insert(0, {tests!r})
import flax_ckpt as fc
from test_shared_steps_object_stores import frozen, state

base = frozen(0)
with fc.CheckpointManager(sys.argv[1], max_to_keep=2) as mgr:  # async saves, retention
    first = (mgr.latest_step() if mgr.latest_step() is not None else -1) + 1
    for s in range(first, first + 100_000):  # until killed: the kill never comes after the last save
        mgr.save(s, state(s, base))
        mgr.wait_until_finished()
        print("committed", s, flush=True)
"""


def test_sigkill_at_random_moments_of_saves_that_share_loses_nothing(s3, tmp_path):
    """A crash trial on s3:// (gs:// runs the same code): savers, which save until they are killed,
    killed after 2-4 commits plus a random part of one (the moment in the saver's progress, timed
    from its first commit, so a busy machine moves it too); after each kill every step restores
    bit-exactly and the newest step reported durable is there; a resumed manager's next save leaves
    nothing that no committed step names."""
    store, base, rng = STORES["s3"](s3), frozen(0), np.random.default_rng(7)
    script = tmp_path / "saver.py"
    script.write_text(textwrap.dedent(SAVER.format(tests=str(__import__("helpers").TESTS))))
    reported: set[int] = set()
    for _ in range(2):
        child = forkserver.Popen(
            [sys.executable, str(script), store.url], env=worker_env(1), stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        try:
            line = child.stdout.readline()  # the first commit (after jax's import and compile)
            assert line.startswith("committed "), line
            reported.add(int(line.split()[1]))
            commits, t0 = int(rng.integers(1, 4)), time.monotonic()
            for _ in range(commits):
                line = child.stdout.readline()
                assert line.startswith("committed "), line
                reported.add(int(line.split()[1]))
            time.sleep(float(rng.uniform(0, (time.monotonic() - t0) / commits)))  # within a save or so
        finally:
            child.send_signal(signal.SIGKILL)
        reported.update(
            int(x.split()[1]) for x in child.stdout.read().splitlines() if x.startswith("committed ")
        )
        assert child.wait() == -signal.SIGKILL
        with fc.CheckpointManager(store.url, read_only=True) as mgr:
            kept = mgr.all_steps()
            assert max(reported) in kept, (reported, kept)
            for s in kept:
                assert_bit_exact(mgr.restore(s, state(s, base)), state(s, base))
    with fc.CheckpointManager(store.url, max_to_keep=2, async_save=False) as mgr:
        nxt = mgr.latest_step() + 1
        mgr.save(nxt, state(nxt, base))
    assert accounted(store) == (set(), set())
    assert_bit_exact(fc.restore(f"{store.url}/{nxt}"), state(nxt, base))
    body = json.loads(store.server.get(store.bucket, f"{store.prefix}/{nxt}/manifest.json"))["body"]
    assert body.get("shared"), "the steps shared no bytes: nothing was tested"
