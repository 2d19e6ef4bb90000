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

import json
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()

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


class Cast(C.Scenario):
    """Each contender restores the state from the page cache; the warm-up round warms the cache and
    checks every leaf against numpy's astype."""

    name, floors, warmup = "cast", ["fc plain"], 1

    def __init__(self, tree: dict[str, np.ndarray], scratch: Path):
        self.tree, self.scratch = tree, scratch

    def setup(self) -> None:
        import orbax.checkpoint as ocp

        fc.save(self.scratch / "fc", self.tree)
        with ocp.StandardCheckpointer() as c:
            c.save(self.scratch / "orbax", {k: jax.numpy.asarray(v) for k, v in self.tree.items()})
        self.runs = contenders(self.scratch / "fc", self.scratch / "orbax", self.tree)
        self.contenders = list(self.runs)

    def time(self, name: str, r: int) -> dict[str, float]:
        t, got = C.timed(lambda: jax.block_until_ready(self.runs[name]()))
        if r < 0:
            check(name, got, self.tree)
        return {"restore": t}


def child(argv: list[str]) -> None:
    """In this process: the peak RSS growth, in bytes, of one run of a contender (sampled every ms)."""
    fc_dir, ob_dir, size_mb, leaves, name = argv
    n = (int(size_mb) << 20) // int(leaves) // 4
    shapes = {f"w{i:02d}": np.empty(n, np.float32) for i in range(int(leaves))}  # pages never touched
    run = contenders(Path(fc_dir), Path(ob_dir), shapes)[name]
    rss = F.RssPeak(0.001)
    out = jax.block_until_ready(run())
    print(json.dumps({"growth": rss.stop(), "leaves": len(out)}))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1:])
    p = C.cli(__doc__.splitlines()[0], size_mb=256, rounds=5)
    p.add_argument("--leaves", type=int, default=32)
    p.add_argument("--scratch", default="bench_out/scratch_cast")
    args = p.parse_args(argv)

    scratch = C.fresh_dir(Path(args.scratch).resolve())  # Orbax wants absolute paths
    tree = state(args.size_mb << 20, args.leaves)
    sc = Cast(tree, scratch)
    res = C.run(sc, args.rounds)
    times = {n: res.times[n]["restore"] for n in sc.contenders}
    med = {n: res.median(n, "restore") for n in sc.contenders}
    argv0 = [
        __file__,
        "--child",
        str(scratch / "fc"),
        str(scratch / "orbax"),
        str(args.size_mb),
        str(args.leaves),
    ]
    peak = {n: C.child([*argv0, n])["growth"] for n in sc.contenders}
    ratios = {
        f"{a} / {b}": res.paired_ratio(b, a, "restore")
        for a, b in [
            ("fc cast", "fc plain"),
            ("fc then astype", "fc cast"),
            ("orbax cast", "orbax plain"),
            ("orbax cast", "fc cast"),
        ]
    }
    lines = [
        f"# A casting restore, {args.size_mb} MiB float32 -> bfloat16, {args.leaves} leaves, "
        f"{args.rounds} rounds (page cache warm)",
        "",
        "Peak RSS growth (MiB): " + ", ".join(f"{n} {v / 2**20:.0f}" for n, v in peak.items()),
        "",
        C.table(res, sc.contenders, ["restore"], vs=["fc plain", "fc cast", "orbax plain"]),
    ]
    lines += ["| ratio (medians of per-round ratios) | x |", "|---|---:|"]
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
