"""Where a persistent manager's CPU goes when it saves every step: the writer's job per save, by phase.

    PYTHONPATH=<a checkout> python benchmarks/probes/writer_phases.py [saves] [--tiers] [--every-sync]

The MLP of bench_every_step.py (39 MiB of state with adam), a loop that runs ahead of the device (no
sync per step), a ``CheckpointManager(max_to_keep=2)`` saving every step (``--tiers``: a memory tier in
/dev/shm instead) in FLAX_CKPT_BENCH_DIR (default /tmp). Every task of a thread pool (the writer, the
copy threads, the fsync threads) and every ``save`` call on the loop's thread is profiled with
cProfile on that thread's CPU clock (``time.thread_time``), so the figures are CPU, not wall, time.
Printed per save, in ms of CPU: each thread group's total, and by phase:

- transfer: bringing device copies to host (``Snapshot.complete``; nothing on a CPU state);
- copy + checksum: the snapshot's copies with their crc32c (``copy_all``; the caller's and its pool's);
- checksum: crc32c computed anywhere (a crc32c over bytes the copy did not checksum);
- encode: the manifest and the serializer's records (``manifest_bytes``, ``json``);
- write syscalls: ``os.write``/``writev``/``pwritev``, ``fsync``, ``open``/``rename``/``unlink`` and the
  rest of the ``posix`` module, per call kind;
- wait for the device: ``block_until_ready`` on the loop's thread (passive: little CPU).

Run it alternately with two checkouts (``PYTHONPATH`` chooses the flax_ckpt package): cProfile's own
cost is in every figure alike, so compare the two, not the absolute numbers.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import thread as _cf_thread
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

import flax_ckpt as fc  # noqa: E402
from bench_every_step import make_model  # noqa: E402

_profiles: dict[str, list[cProfile.Profile]] = {}
_lock = threading.Lock()
_on = {"yes": False}


def _group(name: str) -> str:
    name = name.split("_")[0] if name.startswith("ThreadPoolExecutor") else name.rstrip("0123456789_-")
    return name or "pool"


_real_run = _cf_thread._WorkItem.run


def _profiled_run(self):  # every pool task, on its own thread's CPU clock
    if not _on["yes"]:
        return _real_run(self)
    pr = cProfile.Profile(time.thread_time)
    pr.enable()
    try:
        return _real_run(self)
    finally:
        pr.disable()
        with _lock:
            _profiles.setdefault(_group(threading.current_thread().name), []).append(pr)


_cf_thread._WorkItem.run = _profiled_run

PHASES = {
    "transfer": ("complete", "to_host"),
    "copy + checksum": ("copy_all",),
    "encode": ("manifest_bytes", "dumps", "encode"),
}
SYSCALLS = (
    "write",
    "writev",
    "pwrite",
    "pwritev",
    "fsync",
    "fdatasync",
    "open",
    "close",
    "rename",
    "replace",
)


def phases(stats: pstats.Stats) -> dict[str, float]:
    """Seconds by phase (cumulative for Python functions, own time for builtins) and per syscall kind."""
    out: dict[str, float] = {}
    for (file, _, func), (_, _, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        for phase, names in PHASES.items():
            if (
                func in names
                and "flax_ckpt" in file
                or (phase == "encode" and func == "dumps" and "json" in file)
            ):
                out[phase] = out.get(phase, 0.0) + ct
        if "crc32c" in func:
            out["checksum (crc32c)"] = out.get("checksum (crc32c)", 0.0) + tt
        if file == "~" and func.startswith("<built-in method posix."):
            call = func[len("<built-in method posix.") : -1]
            key = f"syscall {call}" if call in SYSCALLS else "syscall (other)"
            out[key] = out.get(key, 0.0) + tt
        if file == "~" and "block_until_ready" in func:
            out["wait for the device"] = out.get("wait for the device", 0.0) + tt
        if (
            file == "~"
            and func == "<built-in method numpy.core.multiarray.copyto>"
            or func.endswith("copyto>")
        ):
            out["np.copyto"] = out.get("np.copyto", 0.0) + tt
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    saves = int(args[0]) if args else 30
    tiers = "--tiers" in sys.argv
    init, step = make_model("mlp")
    root = Path(tempfile.mkdtemp(prefix="fc-phases-", dir=os.environ.get("FLAX_CKPT_BENCH_DIR", "/tmp")))
    shm = Path(tempfile.mkdtemp(prefix="fc-phases-", dir="/dev/shm")) if tiers else None
    kw = {"tiers": fc.Tiers(local_dir=str(shm), peer=False, persist_interval_steps=None)} if shm else {}
    state = jax.block_until_ready(step(init()))
    main_pr = cProfile.Profile(time.thread_time)
    try:
        with fc.CheckpointManager(root / "run", max_to_keep=2, **kw) as mgr:
            for i in range(3):
                state = jax.block_until_ready(step(state))
                mgr.save(i, state, force=True)
                mgr.wait_until_finished()
            _on["yes"] = True
            c0, t0 = time.process_time(), time.perf_counter()
            made = 0
            for i in range(3, 3 + saves):
                state = step(state)
                main_pr.enable()
                made += bool(mgr.save(i, state))
                main_pr.disable()
            jax.block_until_ready(state)
            main_pr.enable()
            mgr.wait_until_finished()
            main_pr.disable()
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            _on["yes"] = False
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
    print(
        f"package {os.path.dirname(fc.__file__)}; {made}/{saves} saves made; process CPU {cpu / saves * 1e3:.1f} "
        f"ms per step, wall {wall / saves * 1e3:.1f} ms"
    )
    groups = {"caller (save)": [main_pr], **_profiles}
    for g, prs in groups.items():
        st = pstats.Stats(prs[0])
        for p in prs[1:]:
            st.add(p)
        total = st.total_tt  # type: ignore[attr-defined]
        print(f"\n{g}: {total / made * 1e3:.2f} ms CPU per save ({len(prs)} tasks)")
        for k, v in sorted(phases(st).items(), key=lambda kv: -kv[1]):
            print(f"  {k:24s} {v / made * 1e3:8.2f}")
    if "--top" in sys.argv:
        for g, prs in groups.items():
            print(f"\n== {g}")
            st = pstats.Stats(prs[0])
            for p in prs[1:]:
                st.add(p)
            st.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
