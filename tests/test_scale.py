"""Cost that does not grow per leaf: many small leaves cost a few system calls and device transfers.

Speed is measured in benchmarks/bench_scale.py; these tests count what the engine does per restore and
save of a tree of many small leaves (files opened, reads, writes, jax.device_put calls, collections),
which must not grow with the number of leaves.
"""

from __future__ import annotations

import gc
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ckpt as fc
from flax_ckpt._src.storage import local

N = 3000


def small_leaves(n: int = N) -> dict:
    rng = np.random.default_rng(0)
    return {
        f"block{j}": {f"w{i}": rng.standard_normal(64).astype(np.float32) for i in range(100)}
        for j in range(n // 100)
    }


@pytest.fixture
def saved(tmp_path):
    host = small_leaves()
    state = jax.tree.map(jax.device_put, host)
    fc.save(tmp_path / "ck", state)
    return tmp_path / "ck", host, state


class Counter:
    def __init__(self, monkeypatch, module, name):
        self.calls = []
        real = getattr(module, name)

        def wrapped(*a, **k):
            self.calls.append(a)
            return real(*a, **k)

        monkeypatch.setattr(module, name, wrapped)


def test_restore_reads_each_data_file_in_a_few_calls(saved, monkeypatch):
    path, host, state = saved
    data_files = len(os.listdir(path / "data"))
    opens, preads = Counter(monkeypatch, os, "open"), Counter(monkeypatch, os, "preadv")
    out = fc.restore(path, state)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(host)))
    opened_data = [a for a in opens.calls if "/data/" in str(a[0])]
    assert len(opened_data) <= data_files  # not one open per leaf
    assert len(preads.calls) <= data_files * (
        N // 1024 + 1
    )  # adjacent chunks: one preadv per IOV_MAX buffers


def test_restore_places_leaves_with_batched_device_puts(saved, monkeypatch):
    path, host, state = saved
    puts = Counter(monkeypatch, jax, "device_put")
    out = fc.restore(path, state)
    assert len(puts.calls) <= 2 and jax.tree.leaves(out)[0].sharding == jax.tree.leaves(state)[0].sharding
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    sh = NamedSharding(mesh, P("x"))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), host)
    puts.calls.clear()
    out = fc.restore(path, target)
    assert len(puts.calls) <= 2  # one device_put of many arrays, jax slicing each per device
    leaf = jax.tree.leaves(out)[7]
    assert leaf.sharding == sh and np.array_equal(leaf, jax.tree.leaves(host)[7])


def test_save_writes_each_data_file_in_a_few_calls(tmp_path, monkeypatch):
    state = jax.tree.map(jax.device_put, small_leaves())
    writes, writevs = Counter(monkeypatch, os, "write"), Counter(monkeypatch, os, "writev")
    fc.save(tmp_path / "ck", state)
    data_files = len(os.listdir(tmp_path / "ck" / "data"))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    # one writev per IOV_MAX buffers or per WRITE_STEP bytes, whichever comes first: never one per leaf
    assert len(writevs.calls) <= data_files * (N // 1024 + 1) + nbytes // local.WRITE_STEP + 2
    assert len(writevs.calls) < N // 10
    assert len(writes.calls) <= 4  # none per leaf


def test_the_collector_does_not_run_per_leaf(saved):
    """Without the pause, a restore of N leaves allocates enough for about N / 10 collections, the later
    ones walking the whole heap; with it, at most one runs as each pause ends, whatever N."""
    path, _, state = saved
    collections = []

    def watch(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        for op in (
            lambda: fc.restore(path, state),
            lambda: fc.metadata(path),
            lambda: fc.save(path.parent / "again", state),
        ):
            gc.collect()  # what earlier tests left pending is not this operation's collection
            collections.clear()
            op()
            assert len(collections) <= 2 and 2 not in collections, collections
    finally:
        gc.callbacks.remove(watch)
    assert gc.isenabled()  # the collector is back on afterwards
