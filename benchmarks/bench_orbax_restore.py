"""Restore one Orbax checkpoint with orbax-checkpoint and with flax_ckpt, side by side.

Orbax writes the checkpoint once (StandardCheckpointer layout: OCDBT + zarr v2 by default); then each
round restores it with ``ocp.StandardCheckpointer().restore(path, abstract_tree)`` and with
``fc.restore(path, abstract_tree)`` into the same shardings, alternating which goes first, and checks
once that both give the same bytes. Reports per-round seconds, medians, throughput and the ratio.
Files are read from the page cache after the first (warm-up) round, for both readers alike. CPU
seconds (all threads of the process) are reported beside wall time: on a shared machine they vary less.

    python benchmarks/bench_orbax_restore.py --size-mb 512 --leaves 64 --rounds 5 --devices 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=512, help="total checkpoint size (default 512)")
    p.add_argument("--leaves", type=int, default=64, help="number of arrays (half float32, half bfloat16)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per reader, after one warm-up")
    p.add_argument("--devices", type=int, default=8, help="CPU devices; arrays are sharded over them")
    p.add_argument("--no-ocdbt", action="store_true", help="one folder per array instead of OCDBT")
    p.add_argument("--zarr3", action="store_true", help="zarr3 instead of zarr v2")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_ckpt as fc

    warnings.filterwarnings("ignore", category=UserWarning)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: args.devices]), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    cols = 1024
    per_leaf = args.size_mb * 2**20 / args.leaves
    tree, rng = {}, np.random.default_rng(0)
    for i in range(args.leaves):
        dtype = jnp.float32 if i % 2 == 0 else jnp.bfloat16
        rows = max(
            args.devices, int(per_leaf / (cols * np.dtype(dtype).itemsize)) // args.devices * args.devices
        )
        host = rng.standard_normal((rows, cols), np.float32).astype(dtype)
        tree[f"layer_{i:03d}"] = {"kernel": jax.device_put(host, sharding)}
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )

    root = args.dir or tempfile.mkdtemp(prefix="bench_orbax_restore_")
    path = os.path.join(os.path.abspath(root), "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=not args.no_ocdbt, use_zarr3=args.zarr3)
    t0 = time.perf_counter()
    ocp.Checkpointer(handler).save(path, args=ocp.args.PyTreeSave(tree))
    save_s = time.perf_counter() - t0
    del tree

    readers = {
        "orbax": lambda: ocp.StandardCheckpointer().restore(path, abstract),
        "flax_ckpt": lambda: fc.restore(path, abstract),
    }

    def timed(name: str):
        t, c = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(readers[name]())
        cpu[name].append(time.process_time() - c)
        return time.perf_counter() - t, out

    cpu: dict[str, list[float]] = {"orbax": [], "flax_ckpt": []}

    _, a = timed("orbax")  # warm-up; also the equality check
    _, b = timed("flax_ckpt")
    same = all(
        np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )
    del a, b
    cpu = {"orbax": [], "flax_ckpt": []}  # drop the warm-up's
    times: dict[str, list[float]] = {"orbax": [], "flax_ckpt": []}
    for r in range(args.rounds):
        for name in ("orbax", "flax_ckpt") if r % 2 == 0 else ("flax_ckpt", "orbax"):
            seconds, out = timed(name)
            times[name].append(seconds)
            del out
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    result = {
        "checkpoint_mb": nbytes / 2**20,
        "leaves": args.leaves,
        "devices": args.devices,
        "layout": f"{'zarr3' if args.zarr3 else 'zarr'}{'' if args.no_ocdbt else '+ocdbt'}",
        "orbax_save_s": save_s,
        "rounds": times,
        "median_s": med,
        "median_cpu_s": cpu_med,
        "mb_per_s": {k: nbytes / 2**20 / v for k, v in med.items()},
        "orbax_over_flax_ckpt": med["orbax"] / med["flax_ckpt"],
        "bit_exact": same,
        "orbax_version": ocp.__version__ if hasattr(ocp, "__version__") else "unknown",
    }
    print(
        f"Orbax checkpoint: {result['checkpoint_mb']:.0f} MB in {args.leaves} arrays, layout "
        f"{result['layout']}, sharded over {args.devices} CPU devices; {args.rounds} interleaved rounds"
    )
    for k in ("orbax", "flax_ckpt"):
        rounds = " ".join(f"{s:.3f}" for s in times[k])
        print(
            f"  {k:<10} median {med[k]:.3f} s  ({result['mb_per_s'][k]:.0f} MB/s), CPU {cpu_med[k]:.3f} s"
            f"   rounds: {rounds}"
        )
    print(f"  ratio orbax / flax_ckpt: {result['orbax_over_flax_ckpt']:.2f}x   bit-exact: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["bit_exact"] else 1)
