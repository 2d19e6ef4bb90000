"""The reliability table: every fault class, N real trials each, and what restore gave.

    python benchmarks/faults.py                                   # 200 SIGKILLs, 20 trials per class
    python benchmarks/faults.py --kills 40 --trials 5 --fuzz 500  # quicker
    python benchmarks/faults.py --only sigkill damaged            # classes whose name contains a word

Fault classes: SIGKILL of a process doing async manager saves with retention (raw and zarr3
alternating), also through a memory tier; SIGTERM during a save in flight, twice, and during a restore; a full tmpfs (mounted here:
root only, else reported as skipped); every byte-range class of a committed checkpoint (data, zarr3
array metadata, manifest body, commit record) truncated, deleted or bit-flipped; crafted checkpoints
(traversal, symlinks, FIFOs, devices, absurd shapes, aliased chunks, deep trees, huge JSON); every
manifest field deleted or mistyped; a hypothesis fuzzer over the manifest parser; a reader restoring
while another process commits and retention deletes; saves from a thread during training; S3 faults
(5xx, dropped/reset connections, truncated bodies, lost replies) during saves and restores.

Columns: trials; restores bit-exact (for damaged or crafted input: refused with a CheckpointError
naming it, and the newest good step restored bit-exact instead); lost (a committed step, or the good
step beside a damaged one, could not be restored); corrupt (a restore returned other bytes, or took
damaged, crafted or temporary data for a checkpoint); other failures (an undocumented exception, an
error not naming the damage, a hang, a broken retention rule). The goal is zero in the last three.
The trial code is harness/reliability_*.py (its child processes: harness/reliability_worker.py),
the same the default test suite runs a few of. The table is printed and written to
bench_out/faults-<time>.md.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "harness"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")
logging.getLogger("flax_ckpt").addHandler(logging.NullHandler())  # fallbacks warn by design; the trials
logging.getLogger("flax_ckpt").propagate = False  # check those warnings themselves, the terminal needs none

import reliability_hostile as RH  # noqa: E402
import reliability_trials as RT  # noqa: E402
from reliability_worker import Zygote  # noqa: E402

Runner = Callable[[argparse.Namespace, str, "Zygote"], list[RT.Tally]]


def sigkill(args: argparse.Namespace, scratch: str, z: Zygote) -> list[RT.Tally]:
    tally, rng = (
        RT.Tally("SIGKILL during async manager saves + retention (raw, zarr3)"),
        random.Random(args.seed),
    )
    run = None
    for i in range(args.kills):
        if i % 20 == 0:  # a fresh directory every 20 kills bounds disk use and re-reads
            run = RT.CrashRun(RT.fresh(scratch, f"crash{i // 20}"))
            os.makedirs(run.directory)
        tally.add(RT.crash_trial(z, run, rng, ("raw", "zarr3")[i % 2]))
        _progress(tally, args.kills)
    tiered = RT.Tally("SIGKILL during async saves through a memory tier + persistent (raw, zarr3)")
    for i in range(args.tier_kills):
        if i % 20 == 0:
            run = RT.CrashRun(RT.fresh(scratch, f"tiered{i // 20}"), tiers=True)
            os.makedirs(run.directory)
        tiered.add(RT.crash_trial(z, run, rng, ("raw", "zarr3")[i % 2]))
        _progress(tiered, args.tier_kills)
    shared = RT.Tally("SIGKILL during async saves whose steps share bytes, + retention (raw)")
    for i in range(args.shared_kills):
        if i % 20 == 0:
            run = RT.CrashRun(RT.fresh(scratch, f"shared{i // 20}"), state="shared")
            os.makedirs(run.directory)
        shared.add(RT.crash_trial(z, run, rng, "raw"))
        _progress(shared, args.shared_kills)
    return [tally, tiered, shared]


def sigterm(args: argparse.Namespace, scratch: str, z: Zygote) -> list[RT.Tally]:
    out, rng = [], random.Random(args.seed)
    for scenario, twice, name in (
        ("save", False, "SIGTERM during a save in flight"),
        ("save", True, "SIGTERM twice during a save in flight"),
        ("restore", False, "SIGTERM during a restore"),
    ):
        tally = RT.Tally(name)
        for i in range(args.signal_trials):
            outcome = RT.sigterm_trial(
                RT.fresh(scratch, f"term-{scenario}-{twice}-{i}"),
                scenario,
                rng,
                twice=twice,
                serializer=("raw", "zarr3")[i % 2],
            )
            tally.add(outcome, outcome.detail if outcome.ok else "")
        out.append(tally)
    return out


def disk_full(args: argparse.Namespace, scratch: str, z: Zygote) -> list[RT.Tally]:
    out, rng = [], random.Random(args.seed)
    for ser in ("raw", "zarr3"):
        tally = RT.Tally(f"disk full (8 MiB tmpfs), {ser}")
        try:
            with RT.tmpfs(os.path.join(scratch, f"mnt-{ser}")) as mount:
                for _ in range(args.trials):
                    tally.add(RT.disk_full_trial(mount, ser, rng))
        except RT.MountRefused as e:
            tally.notes[f"skipped: {e}"] += 1
        out.append(tally)
    return out


def damaged(args: argparse.Namespace, scratch: str, z: Zygote) -> list[RT.Tally]:
    names = {
        "data": "data bytes",
        "array-meta": "zarr3 array metadata",
        "manifest": "manifest body",
        "commit": "commit record (manifest header, its existence)",
    }
    tallies = {
        cls: RT.Tally(f"damaged {label}: truncated, deleted, bit-flipped") for cls, label in names.items()
    }
    rng, k = random.Random(args.seed), 0
    for _ in range(args.trials):
        for ser, classes in RT.DAMAGE_CLASSES.items():
            for cls in classes:
                for mode in RT.DAMAGE_MODES:
                    k += 1
                    folder = RT.fresh(scratch, f"dmg{k}")
                    tallies[cls].add(RT.damage_trial(folder, ser, cls, mode, rng), f"{ser}/{mode}")
                    shutil.rmtree(folder, ignore_errors=True)
    return list(tallies.values())


def hostile(args: argparse.Namespace, scratch: str, z: Zygote) -> list[RT.Tally]:
    crafted = RT.Tally(f"crafted checkpoints ({len(RH.CASES)} kinds: traversal, symlinks, FIFOs, 4 TiB, ...)")
    for case, (sers, _) in RH.CASES.items():
        for ser in sers:
            outcome = RH.hostile_trial(scratch, case, ser)
            if outcome is None:
                crafted.notes[f"skipped: {case}"] += 1
            else:
                crafted.add(outcome)
    typed = RT.Tally("every manifest field deleted or mistyped")
    fuzzed = RT.Tally(f"fuzzed manifests (hypothesis, {args.fuzz} per serializer)")
    for ser in ("raw", "zarr3"):
        RH.wrong_types_trial(scratch, ser, typed)
        RH.fuzz_trial(scratch, ser, args.fuzz, fuzzed, derandomize=False)
    return [crafted, typed, fuzzed]


def concurrency(args: argparse.Namespace, scratch: str, z: Zygote) -> list[RT.Tally]:
    reader = RT.Tally("reader restoring while another process commits and retention deletes")
    RT.reader_trial(z, RT.fresh(scratch, "reader"), args.reader_seconds, reader)
    threads = RT.Tally("saves from a thread while the main thread trains")
    for i in range(max(1, args.trials // 4)):
        threads.add(RT.thread_saves_trial(RT.fresh(scratch, f"threads{i}")))
    return [reader, threads]


def s3(args: argparse.Namespace, scratch: str, z: Zygote) -> list[RT.Tally]:
    try:
        import reliability_s3 as RS
    except ImportError as e:
        skipped = RT.Tally("S3 faults")
        skipped.notes[f"skipped: {e}"] += 1
        return [skipped]
    save, eng, mgr = (
        RT.Tally("S3 faults during save (raw, zarr3)"),
        RT.Tally("S3 faults during fc.restore"),
        RT.Tally("S3 faults during a manager's open + restore"),
    )
    rng = random.Random(args.seed)
    with RS.s3_rig() as rig:
        for i in range(args.trials):
            ser = ("raw", "zarr3")[i % 2]
            save.add(*RS.s3_save_trial(rig, ser, rng))
            eng.add(*RS.s3_restore_trial(rig, ser, rng))
            mgr.add(*RS.s3_restore_trial(rig, ser, rng, via="manager"))
    return [save, eng, mgr]


CLASSES: dict[str, Runner] = {
    "sigkill": sigkill,
    "sigterm": sigterm,
    "disk-full": disk_full,
    "damaged": damaged,
    "hostile": hostile,
    "concurrency": concurrency,
    "s3": s3,
}


def _progress(tally: RT.Tally, total: int) -> None:
    if tally.trials % 20 == 0:
        print(f"  {tally.name}: {tally.trials}/{total}, {dict(tally.counts)}", file=sys.stderr, flush=True)


def table(tallies: list[RT.Tally]) -> str:
    rows = [
        "| fault class | trials | restores bit-exact | lost | corrupt | other failures | notes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for t in tallies:
        notes = "; ".join(f"{n}: {c}" for n, c in sorted(t.notes.items()))
        rows.append(
            f"| {t.name} | {t.trials} | {t.counts['exact']} | {t.counts['lost']} | {t.counts['corrupt']} "
            f"| {t.counts['error']} | {notes} |"
        )
    return "\n".join(rows)


def failures(tallies: list[RT.Tally]) -> str:
    lines = [f"- {t.name}: {f}" for t in tallies for f in t.failures]
    return ("\n\nFirst failures:\n" + "\n".join(lines)) if lines else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=200, help="SIGKILL trials (default 200)")
    p.add_argument(
        "--tier-kills", type=int, default=100, help="SIGKILL trials with a memory tier (default 100)"
    )
    p.add_argument(
        "--shared-kills", type=int, default=100, help="SIGKILL trials of steps that share bytes (default 100)"
    )
    p.add_argument("--trials", type=int, default=20, help="trials per other class (default 20)")
    p.add_argument(
        "--signal-trials", type=int, default=None, help="SIGTERM trials per scenario (default: trials/2)"
    )
    p.add_argument("--fuzz", type=int, default=2000, help="fuzzed manifests per serializer (default 2000)")
    p.add_argument("--reader-seconds", type=float, default=20.0, help="length of the concurrent-reader run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", default=None, help=f"classes to run, of {list(CLASSES)}")
    args = p.parse_args()
    args.signal_trials = args.signal_trials or max(1, args.trials // 2)
    chosen = [c for c in CLASSES if not args.only or any(w in c for w in args.only)]
    scratch = tempfile.mkdtemp(prefix="flax_ckpt_faults-")
    tallies, t0 = [], time.monotonic()
    try:
        with Zygote() as z:
            for name in chosen:
                t = time.monotonic()
                print(f"{name} ...", file=sys.stderr, flush=True)
                tallies += CLASSES[name](args, scratch, z)
                print(f"{name}: {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cmd = "python benchmarks/faults.py " + " ".join(sys.argv[1:])
    report = (
        f"{table(tallies)}\n\n`{cmd.strip()}` on {os.cpu_count()} CPUs, {time.monotonic() - t0:.0f} s, "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}.{failures(tallies)}\n"
    )
    print(report)
    out = REPO / "bench_out"
    out.mkdir(exist_ok=True)
    (out / f"faults-{datetime.datetime.now():%Y%m%d-%H%M%S}.md").write_text(report)
    sys.exit(1 if any(t.counts["lost"] or t.counts["corrupt"] or t.counts["error"] for t in tallies) else 0)


if __name__ == "__main__":
    main()
