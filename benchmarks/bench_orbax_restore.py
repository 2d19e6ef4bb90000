"""Restore one Orbax checkpoint with orbax-checkpoint and with flax_ckpt, side by side.

Orbax writes the checkpoint once (StandardCheckpointer layout: OCDBT + zarr v2 by default); then each
round restores it with ``ocp.StandardCheckpointer().restore(path, abstract_tree)`` and with
``fc.restore(path, abstract_tree)`` into the same shardings, alternating which goes first; the warm-up
round checks that both give the same bytes. Reports per-round seconds, medians, throughput and the ratio.
Files are read from the page cache after the warm-up round, for both readers alike. CPU seconds (all
threads of the process) are reported beside wall time: on a shared machine they vary less.

    python benchmarks/bench_orbax_restore.py --size-mb 512 --leaves 64 --rounds 5 --devices 8
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402


class OrbaxRestore(C.Scenario):
    """Each reader restores the Orbax checkpoint at ``path`` into ``abstract``: wall and CPU seconds."""

    name, contenders, warmup = "orbax_restore", ["orbax", "flax_ckpt"], 1

    def __init__(self, path: str, abstract: Any):
        self.path, self.abstract, self.warm = path, abstract, {}

    def time(self, name: str, r: int) -> dict[str, float]:
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        import flax_ckpt as fc

        read = ocp.StandardCheckpointer().restore if name == "orbax" else fc.restore
        t, c = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(read(self.path, self.abstract))
        got = {"wall": time.perf_counter() - t, "cpu": time.process_time() - c}
        if r < 0:
            self.warm[name] = [np.asarray(x).view(np.uint8) for x in jax.tree_util.tree_leaves(out)]
        return got

    def bit_exact(self) -> bool:
        import numpy as np

        return all(np.array_equal(x, y) for x, y in zip(self.warm["orbax"], self.warm["flax_ckpt"]))


def main(argv: list[str] | None = None) -> dict:
    p = C.cli(__doc__.splitlines()[0], size_mb=512.0, rounds=5)
    p.add_argument("--leaves", type=int, default=64, help="number of arrays (half float32, half bfloat16)")
    p.add_argument("--devices", type=int, default=8, help="CPU devices; arrays are sharded over them")
    p.add_argument("--no-ocdbt", action="store_true", help="one folder per array instead of OCDBT")
    p.add_argument("--zarr3", action="store_true", help="zarr3 instead of zarr v2")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    F.jax_cpu_env()
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    warnings.filterwarnings("ignore", category=UserWarning)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: args.devices]), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    cols, per_leaf = 1024, args.size_mb * 2**20 / args.leaves
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
    info = C.machine_info(Path(root))
    sc = OrbaxRestore(path, abstract)
    res = C.run(sc, args.rounds)
    names = sc.contenders
    med = {k: res.median(k, "wall") for k in names}
    result = {
        "checkpoint_mb": nbytes / 2**20,
        "leaves": args.leaves,
        "devices": args.devices,
        "layout": f"{'zarr3' if args.zarr3 else 'zarr'}{'' if args.no_ocdbt else '+ocdbt'}",
        "orbax_save_s": save_s,
        "rounds": {k: res.times[k]["wall"] for k in names},
        "median_s": med,
        "median_cpu_s": {k: res.median(k, "cpu") for k in names},
        "mb_per_s": {k: nbytes / 2**20 / v for k, v in med.items()},
        "orbax_over_flax_ckpt": med["orbax"] / med["flax_ckpt"],
        "bit_exact": sc.bit_exact(),
        "orbax_version": getattr(ocp, "__version__", "unknown"),
    }
    md = (
        f"Orbax checkpoint: {result['checkpoint_mb']:.0f} MB in {args.leaves} arrays, layout "
        f"{result['layout']}, sharded over {args.devices} CPU devices; {args.rounds} interleaved rounds; "
        f"orbax / flax_ckpt {result['orbax_over_flax_ckpt']:.2f}x, bit-exact: {result['bit_exact']}\n\n"
        + C.table(res, names, ["wall", "cpu"], vs=["flax_ckpt"])
    )
    C.report("orbax_restore", args, info, result, md)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["bit_exact"] else 1)
