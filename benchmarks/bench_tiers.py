"""Tiered checkpoints vs a plain persistent save of the same state: save cost and restore time per tier.

    python benchmarks/bench_tiers.py                       # 256 MiB state, 3 rounds, 2-process peer part
    python benchmarks/bench_tiers.py --size-mb 64 --rounds 2 --peer-mb 16

States of ``--size-mb`` (jax CPU arrays), saved step after step by two CheckpointManagers in one
process, rounds interleaved (order rotated per round), every save waited for before the next:
- fine-tuning: a frozen backbone (``1 - --trained-frac`` of the bytes; the same jax.Array every step,
  as in adapter fine-tuning) and a trained head that changes every step (new random values:
  incompressible, the worst case for the XOR delta);
- fine-tuning, frozen re-created: the same, but the backbone is a new array with equal bytes every
  step (unchanged chunks are then found by crc32c and a byte comparison instead of by identity);
- full change: every leaf changes every step (new random values).
Contenders: ``persistent`` = CheckpointManager(dir) on this machine's disk (raw serializer, fsync,
atomic rename); ``memory`` = CheckpointManager(dir, tiers=Tiers(local_dir=/dev/shm/..., no migration)).
Each contender saves its own, freshly created arrays of equal values (a jax CPU array caches its host
copy on first use, which would make the second contender's snapshot free); the frozen backbone is one
array shared by both and by every step.
Per save: ``blocked`` (time ``save`` held the caller) and ``to tier`` (from the ``save`` call to the
commit: durable on disk, resp. committed in local memory); the memory tier's bytes written. Three
warm-up saves per contender come first (fresh pages); the first memory save, a full base, is reported
apart.

Restore (the fine-tuning state's newest step, into jax CPU arrays): from local memory; from disk cold
(the step's files evicted from the page cache with posix_fadvise(DONTNEED) after fsync) and warm. The
peer part runs a real 2-process jax.distributed job (gloo, 127.0.0.1; ``--peer-mb`` per process):
after two saves process 1 deletes its local memory tier, then both restore; process 1's shards come from
its peer over the collective, process 0's from local memory; the first such restore compiles the
transfer's ppermute, so it is timed twice. Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixtures as F  # noqa: E402
import runner as C  # noqa: E402

F.jax_cpu_env()
import jax  # noqa: E402
import numpy as np  # noqa: E402

import flax_ckpt as fc  # noqa: E402

SHM = Path(os.environ.get("FLAX_CKPT_BENCH_SHM", "/dev/shm/flax_ckpt_bench"))


KINDS = ("fine-tuning", "fine-tuning, frozen re-created", "full change")
WARMUP = 3  # saves per contender before the timed ones: until the memory tier reuses retired files


def base_state(size: int, trained_frac: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    trained = max(1, int(size * trained_frac) // 4 // 1024) * 1024
    frozen = (size // 4 - trained) // 1024 * 1024
    return {
        "backbone": jax.device_put(rng.standard_normal(frozen, dtype=np.float32).reshape(-1, 1024)),
        "head": jax.device_put(rng.standard_normal(trained, dtype=np.float32).reshape(-1, 1024)),
    }


def step_state(kind: str, base: dict, step: int) -> dict:
    """The state saved at ``step``, its arrays ready (jax.device_put returns before the copy is done;
    a save waiting for it would be timing the benchmark's own transfer)."""
    rng = np.random.default_rng(1000 + step)
    new = {k: jax.device_put(rng.standard_normal(v.shape, dtype=np.float32)) for k, v in base.items()}
    if kind == "fine-tuning":
        state = {"backbone": base["backbone"], "head": new["head"], "step": step}
    elif kind == "fine-tuning, frozen re-created":
        state = {"backbone": jax.device_put(np.array(base["backbone"])), "head": new["head"], "step": step}
    else:
        state = {"backbone": new["backbone"], "head": new["head"], "step": step}
    return jax.block_until_ready(state)


def abstract(state: dict) -> dict:
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=cpu) if hasattr(v, "shape") else v
        for k, v in state.items()
    }


class Floor:
    """The memcpy floor of a full-change memory checkpoint: every array's bytes copied into buffers
    allocated and touched beforehand, split over the same thread pool the memory tier uses, with no
    checksum, file or commit (what any copy of the state into host memory costs at least)."""

    def __init__(self, state: dict):
        self.bufs = {k: np.ones(v.shape, v.dtype) for k, v in state.items() if hasattr(v, "shape")}

    def run(self, state: dict) -> float:
        from flax_ckpt._src.tiers import files as tier_files

        jobs = []
        for k, dst in self.bufs.items():
            src, d = np.asarray(state[k]).reshape(-1), dst.reshape(-1)
            step = max(1, len(d) // 8)
            jobs += [(d[a : a + step], src[a : a + step]) for a in range(0, len(d), step)]
        pool = tier_files.pool()
        t, _ = C.timed(lambda: [f.result() for f in [pool.submit(np.copyto, a, b) for a, b in jobs]])
        return t


class Saves(C.Scenario):
    """One state kind saved step after step by a persistent and a memory-tiered manager (and, for a
    full change, the memcpy floor): "blocked" and "to tier" per save; WARMUP saves each first."""

    def __init__(self, kind: str, base: dict, extra: dict[str, Any]):
        self.kind, self.base, self.extra = kind, base, extra
        self.contenders = ["persistent", "memory"] + (["memcpy"] if kind == "full change" else [])
        self.floors = self.contenders[2:]

    def setup(self) -> None:
        kind, slug = self.kind, self.kind.replace(",", "").replace(" ", "-")
        self.disk, shm = C.fresh_dir(C.SCRATCH / f"{slug}-disk"), SHM / slug
        shutil.rmtree(shm, ignore_errors=True)
        self.plain = fc.CheckpointManager(self.disk, max_to_keep=2)
        tiers = fc.Tiers(local_dir=str(shm), persist_interval_steps=None, max_to_keep=2, cleanup=True)
        self.tiered = fc.CheckpointManager(C.SCRATCH / f"{slug}-tiered", max_to_keep=2, tiers=tiers)
        for step in range(WARMUP):  # the first saves allocate fresh memory (page cache, tmpfs)
            for mgr in (self.plain, self.tiered):
                mgr.save(step, step_state(kind, self.base, step))
                mgr.wait_until_finished()
        first, self.floor = self.tiered.tier_stats[0], Floor(step_state(kind, self.base, 0))
        self.extra[kind] = {
            "base_save_s": first.memory_s,
            "base_written": first.written,
            "written": [],
            "reused": [],
            "warmup_memory_s": [t.memory_s for t in self.tiered.tier_stats],
            "warmup_persistent_s": [t.durable_s for t in self.plain.stats],
        }

    def time(self, name: str, r: int) -> dict[str, float]:
        self.last = step = WARMUP + r
        state = step_state(self.kind, self.base, step)  # fresh arrays per contender: a jax CPU array
        if name == "memcpy":  # caches its host copy, which would make the second save free
            return {"to tier": self.floor.run(state)}
        mgr = self.plain if name == "persistent" else self.tiered
        mgr.save(step, state)
        mgr.wait_until_finished()
        if name == "persistent":
            return {"blocked": self.plain.stats[-1].blocked_s, "to tier": self.plain.stats[-1].durable_s}
        t = self.tiered.tier_stats[-1]
        self.extra[self.kind]["written"].append(t.written)
        self.extra[self.kind]["reused"].append(t.reused)
        return {"blocked": t.blocked_s, "to tier": t.memory_s}

    def close(self) -> None:
        self.tiered.close()
        self.plain.close()


class Restores(C.Scenario):
    """The fine-tuning state's newest step restored from local memory, from disk cold and warm."""

    contenders = ["local memory", "disk cold", "disk warm"]

    def __init__(self, saves: Saves):
        self.s = saves
        want = step_state("fine-tuning", saves.base, saves.last)
        self.want = {k: np.asarray(v) for k, v in want.items() if k != "step"}
        self.target = abstract(want)

    def time(self, name: str, r: int) -> dict[str, float]:
        if name == "disk cold":
            F.drop_cache(self.s.disk / str(self.s.last))
        mgr = self.s.tiered if name == "local memory" else self.s.plain
        t, got = C.timed(lambda: jax.block_until_ready(mgr.restore(self.s.last, target=self.target)))
        if r == 0:
            F.same_bytes(self.want, {k: v for k, v in got.items() if k != "step"})
        return {"restore": t}


# -------------------------------------------------------------------------------------- peer part


def worker(i: int, port: int, root: str, mb: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", 2, i, coordinator_bind_address=f"127.0.0.1:{port}", initialization_timeout=60
    )
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("p",))
    sh = NamedSharding(mesh, P("p"))
    rows = mb * (1 << 20) // 4 // 1024

    def state(step: int) -> dict:
        host = np.random.default_rng(step).standard_normal((2 * rows, 1024), dtype=np.float32)
        return {"w": jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx]), "step": step}

    local = os.path.join(root, f"host{i}")
    mgr = fc.CheckpointManager(
        os.path.join(root, "ckpt"),
        tiers=fc.Tiers(local_dir=local, persist_interval_steps=None, cleanup=False),
    )
    for step in (1, 2):  # each waited for: the tier's default on_busy="skip" would skip step 2
        mgr.save(step, state(step))
        mgr.wait_until_finished()
    target = {"w": jax.ShapeDtypeStruct((2 * rows, 1024), np.float32, sharding=sh), "step": 0}
    out = {}
    t, _ = C.timed(lambda: jax.block_until_ready(mgr.restore(target=target)))
    out["local"] = t
    if i == 1:
        shutil.rmtree(local)  # host 1 lost its memory tier
    t, got = C.timed(lambda: jax.block_until_ready(mgr.restore(target=target)))
    want = state(2)["w"]
    for a, b in zip(got["w"].addressable_shards, want.addressable_shards):
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()
    out["after_loss"] = t
    out["after_loss_again"], _ = C.timed(lambda: jax.block_until_ready(mgr.restore(target=target)))
    out["sources"] = [list(s) for s in mgr.memory_tiers.last_plan.sources]
    with open(os.path.join(root, f"peer.p{i}.json"), "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()  # a barrier: process 0, the coordinator, leaves last
    os._exit(0)


def bench_peer(mb: int, rounds: int, res: C.Results) -> dict:
    out = []
    for r in range(rounds):
        root = C.fresh_dir(C.SCRATCH / "peer")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(i), str(port), str(root), str(mb)],
                env=env,
                start_new_session=True,
                stdout=open(root / f"p{i}.log", "w"),
                stderr=subprocess.STDOUT,
            )
            for i in range(2)
        ]
        try:
            for i, p in enumerate(procs):
                assert p.wait(timeout=300) == 0, f"peer worker {i} failed:\n" + "\n".join(
                    (root / f"p{j}.log").read_text()[-3000:] for j in range(2)
                )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        p0, p1 = (json.loads((root / f"peer.p{i}.json").read_text()) for i in range(2))
        assert p1["sources"] == [["local", 0], ["peer", 0]], p1["sources"]
        res.add("2 processes: local memory (both)", "restore", p1["local"])
        res.add("2 processes: p1 from peer memory, first", "restore", p1["after_loss"])
        res.add("2 processes: p1 from peer memory, again", "restore", p1["after_loss_again"])
        out.append({"p0": p0, "p1": p1})
    return {"mb_per_process": mb, "runs": out}


# ----------------------------------------------------------------------------------------- report


def report(args: argparse.Namespace, res: C.Results, extra: dict[str, Any], info: dict[str, Any]) -> str:
    size = args.size_mb
    lines = [
        f"State: {size} MiB (fine-tuning: trained head {args.trained_frac:.1%} of it, the rest frozen), "
        f"{args.rounds} interleaved rounds after {WARMUP} warm-up saves; medians. Machine: {info['cpus']} CPUs, "
        f"load {info['loadavg_start'][0]:.1f}; disk: {info['filesystem']}; memory tier: {SHM} (tmpfs).",
        "",
        "| state | contender | blocked (s) | to tier (s) | bytes written per save |",
        "|---|---|---:|---:|---:|",
    ]
    for kind in KINDS:
        w = statistics.median(extra[kind]["written"])
        for name in ("persistent", "memory"):
            nb = f"{w / C.MB:.1f} MiB" if name == "memory" else f"{size} MiB"
            lines.append(
                f"| {kind} | {name} | {C.fmt(res.median(f'{kind}/{name}', 'blocked'))} | "
                f"{C.fmt(res.median(f'{kind}/{name}', 'to tier'))} | {nb} |"
            )
        lines.append(
            f"| {kind} | memory, first save (full base) | - | {C.fmt(extra[kind]['base_save_s'])} | "
            f"{extra[kind]['base_written'] / C.MB:.1f} MiB |"
        )
        if res.median(f"{kind}/memcpy", "to tier") is not None:
            lines.append(
                f"| {kind} | memcpy floor (no checksum, no file) | - | "
                f"{C.fmt(res.median(f'{kind}/memcpy', 'to tier'))} | - |"
            )
    lines += ["", "| restore from | seconds |", "|---|---:|"]
    for name in ("local memory", "disk cold", "disk warm"):
        lines.append(f"| {name} | {C.fmt(res.median(name, 'restore'))} |")
    if "peer" in extra:
        lines += [
            "",
            f"2-process job, {args.peer_mb} MiB per process (the restore call of process 1; it is a "
            "collective, process 0 takes as long):",
            "",
            "| restore | seconds |",
            "|---|---:|",
        ]
        for name in ("local memory (both)", "p1 from peer memory, first", "p1 from peer memory, again"):
            lines.append(f"| {name} | {C.fmt(res.median('2 processes: ' + name, 'restore'))} |")
        lines.append("")
        lines.append(
            "'first' includes compiling the ppermute for that transfer (once per job and placement)."
        )
    ratios = {k: res.paired_ratio(f"{k}/memory", f"{k}/persistent", "to tier") for k in KINDS}
    cold = res.paired_ratio("local memory", "disk cold", "restore")
    warm = res.paired_ratio("local memory", "disk warm", "restore")
    lines += [
        "",
        "Ratios (median of per-round ratios, persistent / memory):",
        "- checkpoint into memory vs persistent save: "
        + ", ".join(f"{k} {C.fmt(v)}x ({'met' if v and v >= 5 else 'MISSED'})" for k, v in ratios.items())
        + " (target >= 5x)",
        "- full change, memory tier / memcpy floor: "
        f"{C.fmt(res.paired_ratio('full change/memcpy', 'full change/memory', 'to tier'))}x (a full copy "
        "cannot be faster than the floor; persistent / floor: "
        f"{C.fmt(res.paired_ratio('full change/memcpy', 'full change/persistent', 'to tier'))}x)",
        f"- restore from local memory vs disk: cold {C.fmt(cold)}x (target >= 3x: "
        f"{'met' if cold and cold >= 3 else 'MISSED'}), warm page cache {C.fmt(warm)}x",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    ap = C.cli(__doc__.split("\n")[0], size_mb=256, rounds=3)
    ap.add_argument("--trained-frac", type=float, default=1 / 16)
    ap.add_argument("--peer-mb", type=int, default=32, help="per process; 0 skips the 2-process part")
    args = ap.parse_args()
    info = C.machine_info(C.SCRATCH)
    res, extra = C.Results(), {}
    try:
        base = base_state(args.size_mb * C.MB, args.trained_frac, 0)
        for kind in KINDS:
            saves = Saves(kind, base, extra)
            kres = C.run(saves, args.rounds)
            for name, measures in kres.times.items():
                res.times[f"{kind}/{name}"] = measures
            if kind == "fine-tuning":
                C.run(Restores(saves), args.rounds, res=res)
            saves.close()
        if args.peer_mb:
            extra["peer"] = bench_peer(args.peer_mb, args.rounds, res)
        md = report(args, res, extra, info)
        js, mdp = C.write_report(
            "tiers", {"args": vars(args), "machine": info, "times": res.times, "extra": extra}, md
        )
        print(md)
        print(f"wrote {js} and {mdp}")
    finally:
        shutil.rmtree(C.SCRATCH, ignore_errors=True)
        shutil.rmtree(SHM, ignore_errors=True)


if __name__ == "__main__":
    main()
