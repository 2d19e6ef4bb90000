"""Child process for the crash tests: saves deterministic checkpoints in a loop until it is killed.

Usage: python tests/workers/crash_worker.py DIR MODE [START]   (MODE: "save" = fc.save per step,
"manager" = async CheckpointManager with retention). Prints "ready" once, then "committed <step>" after
each durable save. The state of a step is helpers.crash_state(step).
"""

from __future__ import annotations

import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)  # tests/: helpers

import flax_ckpt as fc  # noqa: E402
from helpers import crash_state  # noqa: E402


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    step = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    print("ready", flush=True)
    if mode == "save":
        while True:
            fc.save(os.path.join(directory, str(step)), crash_state(step))
            print(f"committed {step}", flush=True)
            step += 1
    with fc.CheckpointManager(directory, max_to_keep=3, keep_period=5) as mgr:
        step = (mgr.latest_step() or 0) + 1
        while True:
            mgr.save(step, crash_state(step))
            if step > 1:
                print(
                    f"committed {step - 1}", flush=True
                )  # the previous save is durable once this one starts
            step += 1


if __name__ == "__main__":
    main()
