"""Old and new code side by side: any benchmark of this folder run alternately with the flax_ckpt
package of this checkout and with the one in ``--baseline`` (a folder holding an earlier package, e.g.
a ``git worktree`` of an earlier commit, or a commit, checked out for the run and removed after), its
JSON reports compared figure by figure (runner.ab).

    python benchmarks/ab.py --baseline main --rounds 3 -- bench_async.py --size-mb 64
    git worktree add --detach /tmp/flax_ckpt-base <commit>
    python benchmarks/ab.py --baseline /tmp/flax_ckpt-base --rounds 3 --keys 'per_leaf' -- \
        bench_scale.py --leaves 1000 --sizes-gb --peers

Each round runs the benchmark twice, new and base in an order that alternates by round, each in a
fresh process whose ``PYTHONPATH`` puts the chosen package first (the process is asked which package
it imported; a mismatch stops the run) and whose report goes to a folder of its own
(``FLAX_CKPT_BENCH_OUT``). Every number in the reports (a list of numbers counts as its median) is
compared: the median over rounds for base and new, and new / base. ``--keys`` keeps the figures whose
key path matches a regular expression. (bench_every_step.py has its own ``--baseline``, which
interleaves inside one run, and ``--side``, both codes in one process.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import runner  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--baseline", required=True, help="a folder holding the old flax_ckpt package, or a commit"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", default=None, help="keep the figures whose key path matches this regex")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- BENCHMARK.py [its arguments]")
    args = ap.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        ap.error("name a benchmark after --")
    print(runner.ab(args.baseline, args.rounds, bench, args.keys))
