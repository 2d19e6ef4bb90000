"""Save and restore of one ~1 GB pytree: flax_ckpt (raw, zarr3) vs Orbax vs torch DCP vs plain numpy.

    python benchmarks/bench_save_restore.py                    # 1024 MB, 5 rounds
    python benchmarks/bench_save_restore.py --size-mb 64 --rounds 2

Every contender stores the same bytes (benchmarks/fixtures.make_tree): flax_ckpt and Orbax get jax CPU
arrays, torch DCP gets torch tensors sharing the numpy buffers, the baseline writes the numpy arrays.

- raw baseline, the physical limit: every array appended to one file with ``ndarray.tofile``, fsynced;
  read back with ``np.fromfile``. No checksums, no metadata, one thread. Opt-in ``raw-files-8t``: the
  same over 8 files and 8 threads (parallel I/O is what this disk needs; see benchmarks/README.md).
- flax_ckpt: ``fc.save`` / ``fc.restore`` into a target of jax.ShapeDtypeStruct (CPU device), giving
  jax arrays, with serializer="raw" (the default) and "zarr3".
- Orbax: ``StandardCheckpointer().save`` + ``wait_until_finished``; ``restore`` into the same abstract
  target. Defaults otherwise (OCDBT, zarr3).
- torch DCP: ``dcp.save(state_dict, no_dist=True)``; ``dcp.load`` into freshly allocated tensors
  (allocation counted). FileSystemWriter defaults (one thread, fsync on).

Fairness: rounds are interleaved (every round runs every contender once, the order rotated by one per
round). Save time runs until the library returns and then fsyncs every file and folder it wrote (a no-op
for those that already fsync), so each number is "time to durable". Before a cold restore the written
files' pages are dropped from the page cache with posix_fadvise(DONTNEED) (the files are clean after
fsync, so this evicts them); the warm restore that follows reads them from the page cache. Medians over
rounds; ratios are medians of per-round ratios (pairs from the same round, so a slow moment on a shared
machine affects both sides). The first round checks every restore is bit-exact.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402

ALL = ["raw-file", "flax_ckpt-raw", "flax_ckpt-zarr3", "orbax", "torch-dcp"]
EXTRA = ["raw-files-8t"]  # opt-in: the baseline spread over 8 files written and read by 8 threads


class Contender:
    """save(path) writes the state under path; restore(path) returns it as a flat {key: array}."""

    name: str

    def save(self, path: Path) -> None: ...
    def restore(self, path: Path) -> dict[str, Any]: ...


class RawFile(Contender):
    name = "raw-file"

    def __init__(self, flat: dict[str, np.ndarray]):
        self.flat = flat

    def save(self, path: Path) -> None:
        path.mkdir()
        F.write_raw_file(path / "data.bin", self.flat.values())

    def restore(self, path: Path) -> dict[str, Any]:
        with open(path / "data.bin", "rb") as f:
            return {k: np.fromfile(f, a.dtype, a.size).reshape(a.shape) for k, a in self.flat.items()}


def jax_trees(flat: dict[str, np.ndarray]) -> tuple[Any, Any]:
    """The state as jax arrays on the CPU device, and the abstract target to restore it into."""
    import jax

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    return (
        F.nest({k: jax.device_put(a, cpu) for k, a in flat.items()}),
        F.nest({k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu) for k, a in flat.items()}),
    )


class RawFilesParallel(RawFile):
    """The raw baseline over 8 files, one thread each (arrays dealt out by size, as flax_ckpt does):
    what parallel I/O alone buys on this disk."""

    name = "raw-files-8t"

    def __init__(self, flat: dict[str, np.ndarray], n: int = 8):
        super().__init__(flat)
        self.bins: list[list[str]] = [[] for _ in range(n)]
        load = [0] * n
        for k in sorted(flat, key=lambda k: -flat[k].nbytes):
            i = load.index(min(load))
            self.bins[i].append(k)
            load[i] += flat[k].nbytes

    def _each(self, fn: Callable[[int], Any]) -> list[Any]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.bins)) as pool:
            return list(pool.map(fn, range(len(self.bins))))

    def save(self, path: Path) -> None:
        path.mkdir()

        def write(i: int) -> None:
            with open(path / f"{i}.bin", "wb") as f:
                for k in self.bins[i]:
                    self.flat[k].tofile(f)
                f.flush()
                os.fsync(f.fileno())

        self._each(write)

    def restore(self, path: Path) -> dict[str, Any]:
        def read(i: int) -> dict[str, np.ndarray]:
            with open(path / f"{i}.bin", "rb") as f:
                return {
                    k: np.fromfile(f, self.flat[k].dtype, self.flat[k].size).reshape(self.flat[k].shape)
                    for k in self.bins[i]
                }

        return {k: v for part in self._each(read) for k, v in part.items()}


class FlaxCkpt(Contender):
    def __init__(self, trees: tuple[Any, Any], serializer: str):
        import flax_ckpt as fc

        self.fc, self.serializer, self.name = fc, serializer, f"flax_ckpt-{serializer}"
        self.tree, self.target = trees

    def save(self, path: Path) -> None:
        self.fc.save(path, self.tree, serializer=self.serializer)

    def restore(self, path: Path) -> dict[str, Any]:
        import jax

        out = jax.block_until_ready(self.fc.restore(path, self.target))
        return dict(F.flat_items(out))


class Orbax(Contender):
    name = "orbax"

    def __init__(self, tree: Any, target: Any):
        import orbax.checkpoint as ocp

        self.ckptr = ocp.StandardCheckpointer()
        self.tree, self.target = tree, target

    def save(self, path: Path) -> None:
        self.ckptr.save(path, self.tree)
        self.ckptr.wait_until_finished()

    def restore(self, path: Path) -> dict[str, Any]:
        import jax

        out = jax.block_until_ready(self.ckptr.restore(path, self.target))
        return dict(F.flat_items(out))

    def close(self) -> None:
        self.ckptr.close()


def to_torch(a: np.ndarray):
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def from_torch(t, dtype: np.dtype) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


class TorchDCP(Contender):
    name = "torch-dcp"

    def __init__(self, flat: dict[str, np.ndarray]):
        import torch
        import torch.distributed.checkpoint as dcp

        self.torch, self.dcp = torch, dcp
        self.flat = flat
        self.sd = {k: to_torch(a) for k, a in flat.items()}

    def save(self, path: Path) -> None:
        self.dcp.save(self.sd, checkpoint_id=str(path), no_dist=True)

    def restore(self, path: Path) -> dict[str, Any]:
        out = {k: self.torch.empty_like(t) for k, t in self.sd.items()}
        self.dcp.load(out, checkpoint_id=str(path), no_dist=True)
        return {k: from_torch(t, self.flat[k].dtype) for k, t in out.items()}


class SaveRestore(C.Scenario):
    """Each contender saves the state (until durable), restores it with a cold page cache, then with
    a warm one (unless ``warm`` is False); round 0 checks every restore's bytes."""

    name, floors = "save_restore", ["raw-file", "raw-files-8t"]

    def __init__(self, names: list[str], flat: dict[str, np.ndarray], scratch: Path, warm: bool):
        self.contenders, self.flat, self.scratch, self.warm = names, flat, scratch, warm
        self.sizes: dict[str, int] = {}

    def setup(self) -> None:
        kinds = {"raw-file": RawFile, "raw-files-8t": RawFilesParallel, "torch-dcp": TorchDCP}
        trees = (
            jax_trees(self.flat)
            if any(n.startswith(("flax_ckpt", "orbax")) for n in self.contenders)
            else None
        )
        self.objs: dict[str, Contender] = {}
        for n in self.contenders:
            if n in kinds:
                self.objs[n] = kinds[n](self.flat)
            elif n.startswith("flax_ckpt-"):
                self.objs[n] = FlaxCkpt(trees, n.split("-", 1)[1])
            elif n == "orbax":
                self.objs[n] = Orbax(*trees)
            else:
                raise SystemExit(f"unknown contender {n!r}; choose from {ALL + EXTRA}")

    def time(self, name: str, r: int) -> dict[str, float]:
        c, path = self.objs[name], self.scratch / f"{name}-{r}"
        out: dict[str, float] = {}
        out["save"], _ = C.timed(lambda: (c.save(path), F.fsync_tree(path)))
        self.sizes[name] = F.disk_usage(path)
        F.drop_cache(path)
        out["restore_cold"], got = C.timed(lambda: c.restore(path))
        if r == 0:
            F.same_bytes(self.flat, got)
        del got
        gc.collect()
        if self.warm:
            out["restore_warm"], _ = C.timed(lambda: c.restore(path))
            gc.collect()
        shutil.rmtree(path)
        return out

    def teardown(self) -> None:
        for c in getattr(self, "objs", {}).values():
            getattr(c, "close", lambda: None)()
        C.remove_scratch(self.scratch)


MEASURES = ["save", "restore_cold", "restore_warm"]


def markdown(res: C.Results, names: list[str], sizes: dict[str, int], nbytes: int, rounds: int) -> str:
    disk = ", ".join(f"{n} {sizes.get(n, 0) / C.MB:.0f}" for n in names)
    return (
        f"State: {nbytes / C.MB:.0f} MiB, {rounds} interleaved rounds; on disk (MiB): {disk}. "
        "Ratios: medians of per-round ratios t / t_B (< 1: faster than B).\n\n"
        + C.table(res, names, MEASURES, vs=["raw-file", "raw-files-8t", "orbax", "torch-dcp"])
    )


def _inv(x: float | None) -> float | None:
    return 1 / x if x else None


def targets(res: C.Results) -> dict[str, Any]:
    """Issue 2's targets for the default serializer."""
    n = "flax_ckpt-raw"
    r = {
        "save_vs_orbax": res.paired_ratio(n, "orbax", "save"),
        "save_vs_raw": _inv(res.paired_ratio(n, "raw-file", "save")),
        "restore_vs_orbax": res.paired_ratio(n, "orbax", "restore_cold"),
        "restore_vs_torch": res.paired_ratio(n, "torch-dcp", "restore_cold"),
    }
    ok = {
        "save >= 1.3x faster than orbax": r["save_vs_orbax"] is not None and r["save_vs_orbax"] >= 1.3,
        "save within 1.15x of raw-file": r["save_vs_raw"] is not None and r["save_vs_raw"] <= 1.15,
        "restore >= 1.5x faster than orbax": r["restore_vs_orbax"] is not None
        and r["restore_vs_orbax"] >= 1.5,
        "restore no slower than torch-dcp": r["restore_vs_torch"] is not None
        and r["restore_vs_torch"] >= 1.0,
    }
    return {"ratios": r, "met": ok}


def main(argv: list[str] | None = None) -> None:
    ap = C.cli(__doc__.split("\n")[0], size_mb=1024.0, rounds=5, contenders=ALL, scratch="save_restore")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-cache restore")
    args = ap.parse_args(argv)

    names = [n for n in args.contenders.split(",") if n]
    flat = F.make_tree(int(args.size_mb * C.MB))
    nbytes = F.tree_bytes(flat)
    print(f"state: {len(flat)} leaves, {nbytes / C.MB:.0f} MiB; contenders {names}; scratch {args.scratch}")
    info = C.machine_info(C.fresh_dir(args.scratch))
    sc = SaveRestore(names, flat, args.scratch, not args.no_warm)
    res = C.run(sc, args.rounds)
    md = markdown(res, names, sc.sizes, nbytes, args.rounds)
    tg = targets(res) if "flax_ckpt-raw" in names else {}
    if tg:
        md += (
            "\nIssue 2 targets (flax_ckpt-raw): "
            + "; ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in tg["met"].items())
            + "\n"
        )
    body = {
        "benchmark": "save_restore",
        "leaves": len(flat),
        "nbytes": nbytes,
        "disk_bytes": sc.sizes,
        "seconds": res.times,
        "medians": {n: {k: res.median(n, k) for k in MEASURES} for n in names},
        "targets": tg,
    }
    C.report("save_restore", args, info, body, md)


if __name__ == "__main__":
    main()
