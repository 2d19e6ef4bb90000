"""A casting restore (float32 checkpoint into a bfloat16 model) against a plain one and against Orbax's.

    python benchmarks/bench_cast.py                         # 256 MiB of float32 in 32 leaves, 5 rounds
    python benchmarks/bench_cast.py --size-mb 64 --rounds 3

The state is float32 arrays on the CPU device, saved once by flax_ckpt (native layout, raw serializer)
and once by Orbax (``StandardCheckpointer``). Each round restores, in rotated order, from the page
cache (the first round warms it and checks the bytes):

- ``fc plain``: ``fc.restore(path, abstract_f32)``, the baseline;
- ``fc cast``: ``fc.restore(path, abstract_bf16, cast=True)``: each leaf converted slab by slab as it
  is read (no float32 copy of the leaf is held);
- ``fc then astype``: what users wrote before ``cast=``: a float32 restore, then ``astype(bfloat16)``;
- ``orbax plain`` and ``orbax cast``: Orbax's restore with ``ArrayRestoreArgs(dtype=...)`` built by
  ``construct_restore_args`` from the same abstract trees.

Reported: per-contender medians, and medians of per-round ratios (casting restore over plain, and
flax_ckpt's cast over Orbax's). Round 0 checks that every cast leaf equals numpy's ``astype`` bit for
bit. Then each contender runs once more in a child process of its own, which reports its peak RSS
growth during the restore (sampled every millisecond), the result included. Reports go to bench_out/cast-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runner as C  # noqa: E402

C.jax_cpu_env()

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import flax_ckpt as fc  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def state(total_bytes: int, leaves: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = total_bytes // leaves // 4
    return {f"w{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(leaves)}


def abstract(tree: dict[str, np.ndarray], dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, dtype) for k, v in tree.items()}


def contenders(fc_dir: Path, ob_dir: Path, tree: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    import orbax.checkpoint as ocp

    f32, bf16 = abstract(tree, np.float32), abstract(tree, BF16)
    ckptr = ocp.PyTreeCheckpointer()

    def orbax(target: dict[str, jax.ShapeDtypeStruct]) -> Any:
        args = ocp.checkpoint_utils.construct_restore_args(target)  # ArrayRestoreArgs(dtype=...) per leaf
        return ckptr.restore(ob_dir, args=ocp.args.PyTreeRestore(target, restore_args=args))

    return {
        "fc plain": lambda: fc.restore(fc_dir, f32),
        "fc cast": lambda: fc.restore(fc_dir, bf16, cast=True),
        "fc then astype": lambda: jax.tree.map(lambda x: x.astype(BF16), fc.restore(fc_dir, f32)),
        "orbax plain": lambda: orbax(f32),
        "orbax cast": lambda: orbax(bf16),
    }


def check(name: str, got: dict[str, Any], tree: dict[str, np.ndarray]) -> None:
    for k, v in tree.items():
        want = v if name.endswith("plain") else v.astype(BF16)
        a = np.asarray(jax.block_until_ready(got[k]))
        assert a.dtype == want.dtype and a.tobytes() == want.tobytes(), (name, k)


def peak_growth(fc_dir: Path, ob_dir: Path, tree: dict[str, np.ndarray], name: str) -> int:
    """In this (child) process: the peak RSS growth, in bytes, of one run of contender ``name``: the
    resident size sampled every millisecond (/proc/self/statm) during the run, minus the size before."""
    import threading

    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    run = contenders(fc_dir, ob_dir, tree)[name]
    before, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out = jax.block_until_ready(run())
    done.set()
    sampler.join()
    del out
    return max(peak[0], rss()) - before


def child(argv: list[str]) -> None:
    fc_dir, ob_dir, size_mb, leaves, name = argv
    n = (int(size_mb) << 20) // int(leaves) // 4
    shapes = {f"w{i:02d}": np.empty(n, np.float32) for i in range(int(leaves))}  # pages never touched
    print(peak_growth(Path(fc_dir), Path(ob_dir), shapes, name))


def peaks(scratch: Path, args: argparse.Namespace, names: list[str]) -> dict[str, int]:
    import subprocess

    out = {}
    for name in names:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(scratch / "fc"),
            str(scratch / "orbax"),
            str(args.size_mb),
            str(args.leaves),
            name,
        ]
        out[name] = int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--leaves", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scratch", default="bench_out/scratch_cast")
    args = p.parse_args(argv)
    import orbax.checkpoint as ocp

    scratch = C.fresh_dir(Path(args.scratch).resolve())  # Orbax wants absolute paths
    tree = state(args.size_mb << 20, args.leaves)
    fc.save(scratch / "fc", tree)
    with ocp.StandardCheckpointer() as c:
        c.save(scratch / "orbax", {k: jax.numpy.asarray(v) for k, v in tree.items()})
    runs = contenders(scratch / "fc", scratch / "orbax", tree)
    times: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(args.rounds + 1):
        for name in C.rotated(list(runs), r):
            t, got = C.timed(lambda: jax.block_until_ready(runs[name]()))
            if r == 0:
                check(name, got, tree)  # round 0 warms the page cache and checks; it is not counted
            else:
                times[name].append(t)
            del got
    med = {n: statistics.median(v) for n, v in times.items()}
    peak = peaks(scratch, args, list(runs))

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    ratios = {
        "fc cast / fc plain": ratio("fc cast", "fc plain"),
        "fc then astype / fc cast": ratio("fc then astype", "fc cast"),
        "orbax cast / orbax plain": ratio("orbax cast", "orbax plain"),
        "orbax cast / fc cast": ratio("orbax cast", "fc cast"),
    }
    lines = [
        f"# A casting restore, {args.size_mb} MiB float32 -> bfloat16, {args.leaves} leaves, "
        f"{args.rounds} rounds (page cache warm)",
        "",
        "| contender | median s | peak RSS growth MiB |",
        "|---|---:|---:|",
    ]
    lines += [f"| {n} | {med[n]:.3f} | {peak[n] / 2**20:.0f} |" for n in runs]
    lines += ["", "| ratio (medians of per-round ratios) | x |", "|---|---:|"]
    lines += [f"| {n} | {v:.2f} |" for n, v in ratios.items()]
    md = "\n".join(lines) + "\n"
    print(md)
    C.remove_scratch(scratch)
    C.write_report(
        "cast",
        {"args": vars(args), "times": times, "medians": med, "ratios": ratios, "peak_rss_growth": peak},
        md,
    )


if __name__ == "__main__":
    main()
