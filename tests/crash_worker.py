"""Child process for the crash tests: saves deterministic checkpoints in a loop until it is killed.

Usage: python crash_worker.py DIR MODE [START]   (MODE: "save" = fc.save per step, "manager" = async
CheckpointManager with retention). Prints "ready" once, then "committed <step>" after each durable save.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import flax_ckpt as fc


def state_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((1024, 1024)).astype(np.float32),
            "b": {"x": rng.integers(0, 255, (3000,), dtype=np.uint8), "step": step}}


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    step = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    print("ready", flush=True)
    if mode == "save":
        while True:
            fc.save(os.path.join(directory, str(step)), state_for(step))
            print(f"committed {step}", flush=True)
            step += 1
    with fc.CheckpointManager(directory, max_to_keep=3, keep_period=5) as mgr:
        step = (mgr.latest_step() or 0) + 1
        while True:
            mgr.save(step, state_for(step))
            if step > 1:
                print(f"committed {step - 1}", flush=True)  # the previous save is durable once this one starts
            step += 1


if __name__ == "__main__":
    main()
