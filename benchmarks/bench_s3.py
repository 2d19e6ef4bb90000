"""Checkpoint throughput to an S3-protocol server on 127.0.0.1 against a local-disk save of the same bytes.

    python benchmarks/bench_s3.py                        # 256 MiB mixed tree, raw serializer, 3 rounds
    python benchmarks/bench_s3.py --size-mb 64 --rounds 2 --serializers raw,zarr3
    python benchmarks/bench_s3.py --large-only          # drop the ~400 small leaves (per-request costs)

The server is moto's standalone S3 server (tests/s3_server.py: a child process on loopback, IAM auth
on, objects kept in its memory and temporary files, no fsync); flax_ckpt reaches it through
tensorstore's s3 driver exactly as it would a remote bucket. Local disk: fc.save to a folder (files and
folders fsynced) and restore with the page cache dropped first (cold) and again (warm). Per round and
contender: save, restore; rounds interleave the contenders, their order rotating. Reported: medians,
MB/s, and the S3/local time ratio as the median of per-round ratios. What this measures on one machine
is the client's cost (tensorstore, HTTP, copies) plus a Python server's; a real object store over a
network adds latency and bandwidth limits that more requests in flight (ObjectStoreOptions.concurrency)
hide. moto answers a ranged GET by reading the whole object (a 1 MiB range of a 64 MiB object costs
as much as the object), so restores of many small leaves packed into large files are slow on moto in
a way they are not on S3; --large-only shows the bulk-transfer rate without them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import _common as C  # noqa: E402

C.jax_cpu_env()
warnings.filterwarnings("ignore")

from s3_server import REGION, MotoS3  # noqa: E402

MEASURES = [("save", "save"), ("restore_cold", "restore (local: page cache dropped)"),
            ("restore_warm", "restore again")]


def point_env_at(server: MotoS3, concurrency: int) -> None:
    assert server.admin is not None
    os.environ.update({"FLAX_CKPT_S3_ENDPOINT": server.endpoint, "AWS_REGION": REGION,
                       "AWS_ACCESS_KEY_ID": server.admin.access_key_id,
                       "AWS_SECRET_ACCESS_KEY": server.admin.secret_access_key,
                       "FLAX_CKPT_STORAGE_CONCURRENCY": str(concurrency)})
    os.environ.pop("AWS_PROFILE", None)


def one_round(flat: dict, tree: Any, where: str, ser: str, loc: str, r: int, res: C.Results, check: bool) -> str:
    import flax_ckpt as fc
    from flax_ckpt._src.storage import open_storage

    key = f"{where}/{ser}"
    path = f"{loc}/{ser}-{r}"
    t, _ = C.timed(lambda: fc.save(path, tree, serializer=ser))
    res.add(key, "save", t)
    if where == "local":
        C.drop_cache(Path(path))
    t_cold, got = C.timed(lambda: fc.restore(path))
    res.add(key, "restore_cold", t_cold)
    if check:
        C.same_bytes(flat, dict(C.flat_items(got)))
    del got
    t_warm, _ = C.timed(lambda: fc.restore(path))
    res.add(key, "restore_warm", t_warm)
    if where == "local":
        shutil.rmtree(path)
    else:
        parent, name = path.rsplit("/", 1)
        open_storage(parent).delete(name)
    return f"round {r} {key:10s} save {t:6.2f}s  restore {t_cold:6.2f}s  again {t_warm:6.2f}s"


def markdown(res: C.Results, sers: list[str], nbytes: int, leaves: int, rounds: int, concurrency: int) -> str:
    mb = nbytes / 1e6
    lines = [f"{rounds} interleaved rounds, {mb:.0f} MB per checkpoint ({leaves} leaves); medians; MB/s = bytes / median "
             f"time; 'S3 / local' = median of per-round time ratios (> 1: S3 slower). S3 requests in "
             f"flight: up to {concurrency}.", "",
             "| serializer | measure | local s | local MB/s | S3 s | S3 MB/s | S3 / local |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for ser in sers:
        a, b = f"local/{ser}", f"s3/{ser}"
        for m, label in MEASURES:
            ta, tb = res.median(a, m), res.median(b, m)
            lines.append(f"| {ser} | {label} | {C.fmt(ta)} | {C.fmt(mb / ta if ta else None)} | {C.fmt(tb)} | "
                         f"{C.fmt(mb / tb if tb else None)} | {C.fmt(res.paired_ratio(a, b, m))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=256, help="checkpoint size in MiB (benchmarks/_common.make_tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serializers", default="raw")
    ap.add_argument("--concurrency", type=int, default=64, help="S3 requests in flight (ObjectStoreOptions.concurrency)")
    ap.add_argument("--large-only", action="store_true", help="keep only the leaves of 1 MiB or more")
    ap.add_argument("--scratch", type=Path, default=C.SCRATCH / "s3")
    args = ap.parse_args(argv)

    flat = C.make_tree(int(args.size_mb * C.MB))
    if args.large_only:
        flat = {k: a for k, a in flat.items() if a.nbytes >= C.MB}
    tree, nbytes, sers = C.nest(flat), C.tree_bytes(flat), args.serializers.split(",")
    scratch = C.fresh_dir(args.scratch)
    info = C.machine_info(scratch)
    res = C.Results()
    try:
        with MotoS3() as server:
            point_env_at(server, args.concurrency)
            places = {"local": str(scratch), "s3": f"s3://{server.create_bucket()}/bench-{uuid.uuid4().hex[:6]}"}
            for r in range(args.rounds):
                for ser in C.rotated(sers, r):
                    for where in C.rotated(list(places), r):
                        print(one_round(flat, tree, where, ser, places[where], r, res, r == 0), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    md = markdown(res, sers, nbytes, len(flat), args.rounds, args.concurrency)
    body = {"benchmark": "s3", "args": {k: str(v) for k, v in vars(args).items()}, "machine": info,
            "nbytes": nbytes, "leaves": len(flat), "seconds": res.times}
    js, mdp = C.write_report("s3", body, md)
    print("\n" + md)
    print(f"wrote {js} and {mdp}")


if __name__ == "__main__":
    main()
