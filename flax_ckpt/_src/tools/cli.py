"""The ``flax-ckpt`` command: ls, info, verify, diff, convert and prune, each with --help and --json.

Scope: argument parsing, printing (text tables for people, one JSON document on stdout for scripts)
and exit statuses. The work itself lives in the tools beside it and the engine; nothing here reads bytes.
Exit status: 0 success; 1 verify found damage or diff found differences; 2 usage errors and errors
(no such checkpoint, a damaged manifest for info, a lock held by a live manager); 3 verify --strict
found leaves that carry no checksum (unverified). Progress bars go to stderr (never into --json
stdout), only when stderr is a terminal or with --progress; --quiet silences them.
Imports: only the standard library at module level (and ``flax_ckpt``'s own __init__ imports its API on
first use), so --help and errors in the arguments answer without jax or tensorstore; each command
imports its tools.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from typing import Any, Callable, Sequence

EXIT_OK, EXIT_FOUND, EXIT_ERROR, EXIT_UNVERIFIED = 0, 1, 2, 3


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (for scripts)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars on stderr")
    p.add_argument(
        "--progress",
        action="store_true",
        help="progress bars on stderr even when it is not a terminal (default: only on a terminal)",
    )
    return p


def _progress(args: argparse.Namespace) -> bool:
    """tqdm bars: on a terminal, or asked for with --progress; never with --quiet."""
    return not args.quiet and (args.progress or sys.stderr.isatty())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flax-ckpt",
        description="Inspect, verify, compare, convert and prune flax_ckpt checkpoints.",
        epilog="Exit status: 0 ok; 1 damage (verify) or differences (diff) found; 2 error; 3 leaves without "
        "checksums (verify --strict).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = [_common()]
    p = sub.add_parser(
        "ls",
        parents=common,
        help="list the steps of a checkpoint directory",
        description="List step folders: step, state (committed, in-flight, ...), tier, size, "
        "metrics. A step is committed iff it has a valid manifest.json (or is an "
        "Orbax step); *.tmp-* folders are saves in flight or crashed.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument(
        "--local-dir",
        metavar="LOCAL_DIR",
        help="also list the memory-tier copies a tiered manager of DIR keeps on this host under "
        "Tiers(local_dir=LOCAL_DIR), e.g. /dev/shm/flax_ckpt-1000 (the default is /dev/shm/flax_ckpt-<uid>)",
    )
    p = sub.add_parser(
        "info",
        parents=common,
        help="show the tree of one checkpoint",
        description="Show every leaf (key path, kind, dtype, shape, bytes, sharding), totals, "
        "step, metrics and user metadata. Reads no array bytes.",
    )
    p.add_argument("path", metavar="PATH")
    p = sub.add_parser(
        "verify",
        parents=common,
        help="re-read every byte and check every checksum",
        description="Re-read every stored byte of a checkpoint, or of every step of a run "
        "directory, and check its checksum; name each damaged leaf and file. "
        "Leaves stored without a checksum (Orbax's layout) are reported as "
        "UNVERIFIED. Exit status 1 on damage; 3 with --strict when leaves are "
        "unverified.",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 3 when some leaves carry no checksum, so that damage to them cannot be seen",
    )
    p = sub.add_parser(
        "diff",
        parents=common,
        help="compare two checkpoints leaf by leaf",
        description="List leaves only in one checkpoint and leaves whose dtype, shape or values "
        "differ (with the max absolute difference; PRNG keys: whether their key data "
        "differ). Exit status 1 if they differ.",
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p = sub.add_parser(
        "convert",
        parents=common,
        help="convert between native, Orbax and safetensors",
        description="Convert SRC into DST (never overwritten): native <-> Orbax layout, or an "
        "export of the params to one .safetensors file. Step, metrics and metadata "
        "go along; Orbax's layout keeps a step only as a step folder's name (DST "
        "named like .../3). What DST cannot hold is reported as left out.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument(
        "--to",
        choices=["orbax", "native", "safetensors"],
        help="target format (default: safetensors for a *.safetensors DST, else the other layout)",
    )
    p.add_argument("--serializer", choices=["raw", "zarr3"], help="serializer of a native DST (default: raw)")
    p.add_argument(
        "--subtree",
        metavar="KEY",
        help="safetensors: key path of the sub-tree to export (default: 'params' if present, else all)",
    )
    p = sub.add_parser(
        "prune",
        parents=common,
        help="delete old steps with the manager's retention rules",
        description="Delete committed steps that CheckpointManager(max_to_keep=N, ...) would "
        "delete: each format's steps apart, native and Orbax steps by default "
        "(the steps a manager resumes from). Every deletion is checked before the "
        "first; --dry-run lists the same steps. Takes the directory lock; never "
        "touches in-flight folders or damaged steps. Other libraries' files (legacy "
        "Flax checkpoint_<step> files, .safetensors files) are listed, never "
        "deleted, unless --format names theirs.",
    )
    p.add_argument("directory", metavar="DIR")
    p.add_argument(
        "--keep", type=_positive, required=True, metavar="N", help="keep the newest N steps (of each format)"
    )
    p.add_argument("--keep-period", type=_positive, metavar="P", help="also keep every step divisible by P")
    p.add_argument("--best-metric", metavar="NAME", help="metric to rank steps by for --keep-best")
    p.add_argument("--best-mode", choices=["min", "max"], default="min")
    p.add_argument(
        "--keep-best", type=_positive, metavar="K", help="also keep the K best steps by --best-metric"
    )
    p.add_argument(
        "--format",
        choices=["native", "orbax", "flax_msgpack"],
        help="act on this format's steps only (flax_msgpack: legacy Flax checkpoint_<step> files, "
        "pruned only when named here); default: native and Orbax steps, each format apart",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    return parser


# ------------------------------------------------------------------------------------------ helpers


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a usage error, exit status 2, otherwise)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 leaf", "3 leaves", "1 step", "0 steps"."""
    return f"{n} {noun if n == 1 else PLURALS.get(noun, noun + 's')}"


PLURALS = {"leaf": "leaves"}


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(lines)


def _metrics_text(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    return " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _time_text(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def sharding_text(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    if s.get("type") == "NamedSharding":
        mesh = ",".join(f"{a}={n}" for a, n in zip(s["axis_names"], s["mesh_shape"]))
        spec = ",".join(
            "None" if p is None else p if isinstance(p, str) else "(" + ",".join(p) + ")" for p in s["spec"]
        )
        return f"NamedSharding(mesh=({mesh}),spec=({spec}))"
    n = s.get("num_devices")
    return f"{s.get('type')}({count(n, 'device') if isinstance(n, int) else '? devices'})"


def _strict(obj: Any) -> Any:
    """NaN and infinities as strings, so --json output is strict JSON (jq and JSON.parse refuse NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def _emit(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    if args.json:
        json.dump(_strict(doc), sys.stdout, indent=2, default=str, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print(text)


# ---------------------------------------------------------------------------------------- commands


def _ls_note(e: Any) -> str:
    """Metrics of a committed step; otherwise its folder name and, for an invalid one, why."""
    if e.committed:
        return _metrics_text(e.metrics)
    if e.state == "held":
        if not e.needed_by:
            return f"{e.name}: a removed step's bytes no step needs now (the next save or prune deletes it)"
        steps = ", ".join(map(str, e.needed_by))
        return f"{e.name}: needed by step{'s' if len(e.needed_by) > 1 else ''} {steps} (bytes they share; keep it)"
    note = e.name if e.name != str(e.step) else "-"
    return note + (
        f" ({e.problem.splitlines()[0][:80]})" if e.problem and e.state in ("invalid", "ambiguous") else ""
    )


def cmd_ls(args: argparse.Namespace) -> int:
    from flax_ckpt._src import compile_cache
    from flax_ckpt._src import tools as fi
    from flax_ckpt._src.storage import open_storage

    entries = fi.list_steps(args.directory)
    if args.local_dir:
        entries = sorted(
            entries + fi.list_memory_tiers(args.directory, args.local_dir),
            key=lambda e: (e.step, e.tier != "persistent", e.tier),
        )
    steps = [e for e in entries if e.state not in _LEFTOVERS]
    leftovers = [e for e in entries if e.state in _LEFTOVERS]
    rows = [
        [
            str(e.step),
            e.state,
            e.tier,
            e.format or "-",
            human_bytes(e.nbytes) + (f" +{human_bytes(e.shared)} shared" if e.shared else ""),
            _time_text(e.created),
            _ls_note(e),
        ]
        for e in steps
    ]
    doc = {
        "directory": os.fspath(args.directory),
        "steps": [
            {
                "step": e.step,
                "name": e.name,
                "state": e.state,
                "committed": e.committed,
                "tier": e.tier,
                "format": e.format,
                "nbytes": e.nbytes,
                "shared_nbytes": e.shared,
                "metrics": e.metrics,
                "created": e.created,
                "problem": e.problem,
                **({"needed_by": list(e.needed_by)} if e.state == "held" else {}),
            }
            for e in steps
        ],
        "leftovers": [
            {"name": e.name, "step": e.step, "state": e.state, "tier": e.tier, "nbytes": e.nbytes}
            for e in leftovers
        ],
    }
    text = (
        _table(rows, ["STEP", "STATE", "TIER", "FORMAT", "SIZE", "CREATED", "METRICS / NOTE"])
        if steps
        else f"no steps in {args.directory}"
    )
    cache = compile_cache.summary(open_storage(args.directory))
    if cache is not None:
        doc["compile_cache"] = {"programs": cache[0], "nbytes": cache[1], "for": cache[2]}
    _emit(args, doc, text + _leftovers_line(leftovers) + _cache_line(cache))
    return EXIT_OK


def _cache_line(cache: tuple[int, int, list[str]] | None) -> str:
    """The line of a run's compilation cache (compile_cache/), or nothing."""
    if cache is None:
        return ""
    n, nbytes, kinds = cache
    made = f" ({', '.join(kinds)})" if kinds else ""
    return (
        f"\ncompile_cache/: {n} compiled {'program' if n == 1 else 'programs'}, {human_bytes(nbytes)}{made}"
    )


_LEFTOVERS = {
    "in-flight": ("save in flight", "saves in flight"),
    "deleting": ("deletion in progress", "deletions in progress"),
}


def _leftovers_line(leftovers: list[Any]) -> str:
    """One line for the temporary folders beside the steps: how many of each kind, their size and names."""
    if not leftovers:
        return ""
    counts = {state: sum(e.state == state for e in leftovers) for state in _LEFTOVERS}
    kinds = ", ".join(f"{n} {_LEFTOVERS[state][n > 1]}" for state, n in counts.items() if n)
    names = ", ".join(e.name for e in leftovers[:3]) + (", ..." if len(leftovers) > 3 else "")
    return (
        f"\nleftovers: {kinds} (or interrupted: the next manager to open the directory removes them), "
        f"{human_bytes(sum(e.nbytes or 0 for e in leftovers))}: {names}"
    )


def cmd_info(args: argparse.Namespace) -> int:
    from flax_ckpt._src.tools.common import read_info

    info, values = read_info(args.path)
    leaves = [
        {
            "key": k,
            "kind": v.kind,
            "dtype": None if v.dtype is None else v.dtype.name,
            "shape": None if v.shape is None else list(v.shape),
            "nbytes": v.nbytes,
            "sharding": v.sharding,
            **({"value": _jsonable(values[k])} if k in values else {}),
        }
        for k, v in info.leaves.items()
    ]
    arrays = sum(1 for v in info.leaves.values() if v.dtype is not None)
    doc = {
        "path": info.path,
        "format": info.format,
        "step": info.step,
        "metrics": info.metrics,
        "metadata": info.metadata,
        "created": info.created,
        "serializer": info.serializer,
        "process_count": info.process_count,
        "leaves": leaves,
        "total": {"leaves": len(leaves), "arrays": arrays, "nbytes": info.nbytes},
    }
    rows = [
        [
            k,
            v.kind,
            _dtype_text(v, values.get(k)),
            "-" if v.shape is None else str(list(v.shape)).replace(" ", ""),
            str(v.nbytes),
            sharding_text(v.sharding) if k not in values else _value_text(values[k]),
        ]
        for k, v in info.leaves.items()
    ]
    head = (
        f"{info.path}\nformat {info.format}  step {info.step}  serializer {info.serializer}  processes "
        f"{info.process_count}  created {_time_text(info.created)}\nmetrics: {_metrics_text(info.metrics)}"
        + ("" if info.metadata is None else f"\nmetadata: {json.dumps(info.metadata, default=str)}")
    )
    total = (
        f"total: {count(len(leaves), 'leaf')} ({count(arrays, 'array')}), "
        f"{count(info.nbytes, 'byte')} ({human_bytes(info.nbytes)})"
    )
    _emit(
        args,
        doc,
        "\n".join(
            [head, _table(rows, ["KEY PATH", "KIND", "DTYPE", "SHAPE", "BYTES", "SHARDING / VALUE"]), total]
        ),
    )
    return EXIT_OK


def _dtype_text(v: Any, value: Any) -> str:
    """An array's dtype; a Python scalar's type (int, float, ...)."""
    if v.dtype is not None:
        return v.dtype.name
    return type(value).__name__ if v.kind == "scalar" else "-"


def _value_text(value: Any, width: int = 60) -> str:
    """A leaf's value as the table shows it: a number or None as Python writes it, a text quoted and cut."""
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _jsonable(value: Any) -> Any:
    """A leaf's value in --json: numbers and text as they are, complex numbers as their text."""
    return str(value) if isinstance(value, complex) else value


def cmd_verify(args: argparse.Namespace) -> int:
    from flax_ckpt._src import tools as fi

    r = fi.check(args.path, progress=_progress(args))
    problems = r.problems
    doc = {
        "path": os.fspath(args.path),
        "ok": not problems,
        "problems": [
            {"leaf": p.leaf, "file": p.file, "message": p.message, "step": p.step} for p in problems
        ],
        "verified": r.sound,
        "leaves": r.leaves,
        "unverified": len(r.unverified),
        "unverified_leaves": r.unverified,
        "steps": r.steps,
        "skipped": r.skipped,
        "linked": r.linked,
        "gone": r.gone,
    }
    damaged = sorted({(p.step, p.leaf) for p in problems if p.leaf})
    run = (
        ""
        if r.steps is None
        else f" ({count(len(r.steps), 'step')}" + "".join(f"; {what}" for what in _run_notes(r)) + ")"
    )
    if r.steps == [] and not problems:
        text = f"no steps in {args.path}: nothing to verify" + ("" if run == " (0 steps)" else run)
    elif problems:
        bad_steps = sorted({p.step for p in problems if p.step is not None})
        head = (
            f"DAMAGED {args.path}: {count(len(problems), 'problem')}"
            + (f" in {count(len(damaged), 'leaf')}" if damaged else "")
            + (f" of step{'s' * (len(bad_steps) > 1)} {', '.join(map(str, bad_steps))}" if bad_steps else "")
            + run
        )
        text = "\n".join(
            [head]
            + [
                f"  {'' if p.step is None else f'step {p.step}  '}leaf {p.leaf or '-'}  "
                f"file {p.file or '-'}: {p.message}"
                for p in problems
            ]
        )
    elif r.unverified:
        text = (
            f"UNVERIFIED {args.path}: every leaf reads back, but {len(r.unverified)} of {count(r.leaves, 'leaf')} carry "
            f"no checksum (their format stores none: Orbax's layout, legacy Flax msgpack and safetensors "
            f"files), so damage to their bytes cannot be detected"
            + run
            + ("" if args.strict else "; --strict makes this an error")
        )
    else:
        text = f"OK {args.path}: every checksum matches{run}"
    if r.linked:
        text += (
            f"\nNOTE {len(r.linked)} files have other hard links (another folder shares their bytes, so "
            f"writing there changes this checkpoint): "
            + ", ".join(r.linked[:5])
            + (", ..." if len(r.linked) > 5 else "")
        )
    _emit(args, doc, text)
    if problems:
        return EXIT_FOUND
    return EXIT_UNVERIFIED if r.unverified and args.strict else EXIT_OK


def _run_notes(r: Any) -> list[str]:
    """What a run's verification passed over: steps not committed, steps deleted while read."""
    notes = [f"skipped {', '.join(r.skipped)}: not committed"] if r.skipped else []
    if r.gone:
        notes.append(
            f"{len(r.gone)} deleted while being read (a live manager's retention), not damaged: step"
            f"{'s' if len(r.gone) > 1 else ''} {', '.join(map(str, r.gone))}"
        )
    return notes


def cmd_diff(args: argparse.Namespace) -> int:
    from flax_ckpt._src import tools as fi

    r = fi.diff(args.a, args.b, progress=_progress(args))
    doc = {
        "a": args.a,
        "b": args.b,
        "identical": r.identical,
        "only_in_a": r.only_in_a,
        "only_in_b": r.only_in_b,
        "differing": [
            {"key": d.key, "a": d.a, "b": d.b, "max_abs_diff": d.max_abs_diff} for d in r.differing
        ],
        "same": r.same,
    }
    lines = [f"only in A: {k}" for k in r.only_in_a] + [f"only in B: {k}" for k in r.only_in_b]
    lines += [f"differs: {d.key}  {d.a} vs {d.b}" + _diff_detail(d) for d in r.differing]
    lines.append(
        f"{count(r.same, 'leaf')} identical"
        + (
            ""
            if r.identical
            else f", {len(r.differing)} differ, {len(r.only_in_a)} only in A, {len(r.only_in_b)} only in B"
        )
    )
    _emit(args, doc, "\n".join(lines))
    return EXIT_OK if r.identical else EXIT_FOUND


def _diff_detail(d: Any) -> str:
    """How a leaf of the same type on both sides differs: by how much, or (PRNG keys) that it does."""
    if d.max_abs_diff is not None:
        return f"  max |a-b| = {d.max_abs_diff:.6g}"
    if d.a == d.b:
        return "  key data differ" if d.a.startswith("key<") else "  values differ"
    return ""


def cmd_convert(args: argparse.Namespace) -> int:
    from flax_ckpt._src import tools as fi

    to: fi.Format | None = args.to or ("safetensors" if str(args.dst).endswith(".safetensors") else None)
    r = fi.convert(
        args.src, args.dst, to=to, serializer=args.serializer, subtree=args.subtree, progress=_progress(args)
    )
    doc = {
        "src": args.src,
        "dst": r.dst,
        "to": r.to,
        "leaves": r.leaves,
        "nbytes": r.nbytes,
        "skipped": r.skipped,
        "outside": r.outside,
        "fields_left_out": r.fields_left_out,
        "left_out": r.left_out,
    }
    left = [f"{len(r.outside)} outside --subtree {r.subtree!r}"] if r.outside else []
    left += [f"{len(r.skipped)} that are not plain arrays ({', '.join(r.skipped)})"] if r.skipped else []
    text = (
        f"wrote {r.dst} ({r.to}): {count(r.leaves, 'leaf')}, {human_bytes(r.nbytes)}"
        + (f"; left out {count(len(r.skipped) + len(r.outside), 'leaf')}: {'; '.join(left)}" if left else "")
        + "".join(f"\nleft out {why}" for why in r.fields_left_out.values())
    )
    _emit(args, doc, text)
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    from flax_ckpt._src import tools as fi

    r = fi.prune(
        args.directory,
        keep=args.keep,
        keep_period=args.keep_period,
        best_metric=args.best_metric,
        best_mode=args.best_mode,
        keep_best=args.keep_best,
        dry_run=args.dry_run,
        format=args.format,
    )
    doc = {
        "directory": args.directory,
        "dry_run": r.dry_run,
        "would_delete" if r.dry_run else "deleted": r.deleted,
        "kept": r.kept,
        "formats": list(r.formats),
        "left_alone": r.left_alone,
    }  # a dry run: would_delete
    verb = "would delete" if r.dry_run else "deleted"
    text = f"{verb}: {', '.join(map(str, r.deleted)) or 'nothing'}\nkept: {', '.join(map(str, r.kept)) or 'nothing'}"
    if r.left_alone:
        more = f", ... ({len(r.left_alone)} in all)" if len(r.left_alone) > 10 else ""
        text += (
            f"\nleft alone (not {' or '.join(r.formats)} steps; --format names the format to prune): "
            + ", ".join(r.left_alone[:10])
            + more
        )
    _emit(args, doc, text)
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": cmd_ls,
    "info": cmd_info,
    "verify": cmd_verify,
    "diff": cmd_diff,
    "convert": cmd_convert,
    "prune": cmd_prune,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _cpu_only()
    from flax_ckpt._src.errors import CheckpointError

    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `flax-ckpt info ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (CheckpointError, OSError, ValueError) as e:
        return _error(args, e, str(e) + _hint(args))
    except Exception as e:  # noqa: BLE001 - a bug of ours: one line that says so, never a traceback
        return _error(
            args,
            e,
            f"{e} (an unexpected error, at {_where(e)}: a bug in flax_ckpt; please report it with this line)",
        )


def _cpu_only() -> None:
    """Inspecting a checkpoint must not take a training job's accelerators: jax (imported only by the
    steps that need it) runs on the CPU, unless JAX_PLATFORMS says otherwise."""
    if "JAX_PLATFORMS" in os.environ:
        return
    if "jax" in sys.modules:  # main() called in a process that already uses jax
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"


def _error(args: argparse.Namespace, e: Exception, message: str) -> int:
    if args.json:
        json.dump({"error": {"type": type(e).__name__, "message": message}}, sys.stdout)
        sys.stdout.write("\n")
    print(f"flax-ckpt {args.command}: error: {type(e).__name__}: {message}", file=sys.stderr)
    return EXIT_ERROR


def _where(e: BaseException) -> str:
    """file:line where ``e`` was raised (the innermost frame), for a bug report."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    code = tb.tb_frame.f_code
    name = code.co_filename
    name = name[name.rfind("flax_ckpt/") :] if "flax_ckpt/" in name else name
    return f"{name}:{tb.tb_lineno} in {code.co_name}"


def _hint(args: argparse.Namespace) -> str:
    """For a checkpoint command given a manager's directory instead of one step: say so."""
    from flax_ckpt._src import tools as fi

    path = getattr(args, "path", None) or getattr(args, "src", None)
    if path is None or not os.path.isdir(path) or os.path.exists(os.path.join(path, "manifest.json")):
        return ""
    try:
        committed = [e for e in fi.list_steps(path) if e.committed]
    except Exception:  # a hint must never hide the error it is added to
        return ""
    steps = [e.step for e in committed]
    return (
        (
            f" ({path} is a directory of steps {steps}: pass one of them, e.g. "
            f"{os.path.join(path, committed[-1].name)}, or list them with `flax-ckpt ls`)"
        )
        if steps
        else ""
    )


if __name__ == "__main__":
    sys.exit(main())
