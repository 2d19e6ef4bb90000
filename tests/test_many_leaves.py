"""Memory of a save and a restore of a tree of many one-element leaves (issue 51 item 8).

Such a tree's bytes are nothing; what a save and a restore hold is per leaf: its records, its
manifest entry as text and as parsed JSON. Both must stay within a small multiple of the manifest's
own size (benchmarks/README.md, "Many one-element leaves": 10^6 leaves peaked at 6.7 GiB, ~20 times
the manifest, before). Measured with tracemalloc (what Python allocates, not the process's RSS), as a
multiple of the manifest file's size, so the bound does not depend on the machine or its load.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

import flax_ckpt as fc

N = 4_000
BOUND = 14  # peak traced bytes, as a multiple of the manifest's size (17-20 before; 9.5-12.5 now)


def many(n: int, base: int = 0) -> dict:
    tree: dict = {}
    for i in range(n):
        tree.setdefault(f"block{i // 100:05d}", {})[f"w{i % 100:02d}"] = np.full(1, base + i, np.float32)
    return tree


def traced_peak(call) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """Imports and first-call set-up (jax, serializers) done before anything is measured."""
    folder = tmp_path_factory.mktemp("warm")
    fc.save(folder / "w", many(200))
    fc.restore(folder / "w")
    return folder


def test_a_save_of_many_leaves_holds_a_small_multiple_of_its_manifest(warm, tmp_path):
    tree = many(N)
    peak = traced_peak(lambda: fc.save(tmp_path / "ck", tree))
    manifest = (tmp_path / "ck" / "manifest.json").stat().st_size
    assert peak < BOUND * manifest, f"save peak {peak / manifest:.1f}x the manifest ({manifest} bytes)"
    back = fc.restore(tmp_path / "ck", tree)
    assert all(back[b][w][0] == tree[b][w][0] for b in tree for w in tree[b])


@pytest.mark.parametrize("target", [True, False], ids=["target", "no-target"])
def test_a_restore_of_many_leaves_holds_a_small_multiple_of_its_manifest(warm, tmp_path, target):
    tree = many(N, base=7)
    fc.save(tmp_path / "ck", tree)
    manifest = (tmp_path / "ck" / "manifest.json").stat().st_size
    out = {}
    peak = traced_peak(lambda: out.setdefault("tree", fc.restore(tmp_path / "ck", tree if target else None)))
    assert peak < BOUND * manifest, f"restore peak {peak / manifest:.1f}x the manifest ({manifest} bytes)"
    back = out["tree"]
    assert sorted(back) == sorted(tree)
    assert all(
        back[b][w].dtype == np.float32 and back[b][w][0] == tree[b][w][0] for b in tree for w in tree[b]
    )
