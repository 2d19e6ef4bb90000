"""A fine-tune's saves to an S3-protocol server on 127.0.0.1, steps sharing unchanged chunks or not.

    python benchmarks/bench_shared_s3.py                   # 32 MiB frozen + 0.75 MiB changing, 3 rounds
    python benchmarks/bench_shared_s3.py --frozen-mb 128 --rounds 2

One process, one moto S3 server (harness/s3_server.py). The state is bench_shared.py's: ``--frozen-mb``
MiB of frozen matrices plus ``--changing-mb`` MiB that change at every save. Per round, for sharing off
(the manager's layout told not to share: every save writes all, as on main) and on (the default), each
in rotated order, and for ``max_to_keep`` None and 2: a fresh prefix, 10 saves by a
``CheckpointManager`` (asynchronous, as by default; each timed until durable, retention included).
Reported: the bytes the server holds after the 10 saves (exact), and the median over rounds of the
median time of saves 2..10 (the first, which writes all either way, apart), with the on/off ratio as
the median of per-round ratios; and the same for a state of the same size that changes whole at every
save ("full", ``max_to_keep=2``), whose saves must cost what they cost without sharing.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "harness"))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402
from bench_s3 import point_env_at  # noqa: E402
from bench_shared import makers  # noqa: E402

F.jax_cpu_env()
warnings.filterwarnings("ignore")

from s3_server import MotoS3  # noqa: E402

import flax_ckpt as fc  # noqa: E402


def run(server: MotoS3, bucket: str, make, keep: int | None, share: bool) -> tuple[int, list[float]]:
    """(bytes stored, seconds of each save) of 10 saves of ``make(step)`` to a fresh prefix."""
    prefix = f"shared-{uuid.uuid4().hex[:8]}"
    times = []
    with fc.CheckpointManager(f"s3://{bucket}/{prefix}", max_to_keep=keep) as mgr:
        mgr._directory.layout.share = share  # type: ignore[attr-defined]  (the benchmark's switch)
        for step in range(10):
            t0 = time.perf_counter()
            mgr.save(step, make(step))
            mgr.wait_until_finished()
            times.append(time.perf_counter() - t0)
    pages = server.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(o["Size"] for page in pages for o in page.get("Contents", [])), times


class SharedS3(C.Scenario):
    """Contenders ``off_<case>`` and ``on_<case>`` (sharing off or on; cases keep_None, keep_2 and
    full): 10 saves to a fresh prefix, the median seconds of saves 2..10, the bytes stored kept."""

    name = "bench_shared_s3"
    cases = ("keep_None", "keep_2", "full")

    def __init__(self, args: Any):
        lora, whole = makers(args.frozen_mb, args.changing_mb)
        self.make = {"keep_None": (lora, None), "keep_2": (lora, 2), "full": (whole, 2)}
        self.contenders = [f"{mode}_{c}" for c in self.cases for mode in ("off", "on")]
        self.bytes: dict[str, int] = {}

    def setup(self) -> None:
        self.server = MotoS3().__enter__()
        point_env_at(self.server, 64)
        self.bucket = self.server.create_bucket()

    def time(self, name: str, r: int) -> dict[str, float]:
        mode, case = name.split("_", 1)
        self.bytes[name], times = run(self.server, self.bucket, *self.make[case], mode == "on")
        return {"later_save": statistics.median(times[1:])}

    def teardown(self) -> None:
        if hasattr(self, "server"):
            self.server.__exit__(None, None, None)


def main() -> None:
    ap = C.cli(__doc__.splitlines()[0], rounds=3)
    ap.add_argument("--frozen-mb", type=int, default=32)
    ap.add_argument("--changing-mb", type=float, default=0.75)
    args = ap.parse_args()
    sc = SharedS3(args)
    res = C.run(sc, args.rounds)
    body: dict = {
        "args": vars(args),
        "bytes": sc.bytes,
        "later_save_s": {n: res.median(n, "later_save") for n in sc.contenders},
        "on_over_off": {c: res.paired_ratio(f"off_{c}", f"on_{c}", "later_save") for c in sc.cases},
    }
    b, t = body["bytes"], body["later_save_s"]
    md = "".join(
        f"{name}: {b[f'off_{name}'] / C.MB:.1f} MiB -> {b[f'on_{name}'] / C.MB:.1f} MiB stored; a later "
        f"save {t[f'off_{name}'] * 1e3:.0f} ms -> {t[f'on_{name}'] * 1e3:.0f} ms (on/off "
        f"{body['on_over_off'][name]:.2f})\n"
        for name in ("keep_None", "keep_2", "full")
    )
    js, _ = C.write_report("bench_shared_s3", body, md)
    print(md + f"report: {js}")


if __name__ == "__main__":
    main()
