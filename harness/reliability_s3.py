"""Object-store faults: saves and restores through harness/s3_server.py's FaultProxy in front of a real
S3-protocol server (moto, on loopback), which answers 503/500, drops or resets connections, truncates
bodies, or loses the reply of a request it did perform.

Scope: the trials and their judgement, shared by tests/test_reliability_s3.py and
benchmarks/faults.py. The fault mix and tensorstore's retry settings are chosen so that some saves
and restores fail outright: what is judged is that a failure is a CheckpointError, commits nothing
that is not whole, and loses nothing older; and that a restore never returns other bytes.
"""

from __future__ import annotations

import contextlib
import os
import random
import uuid
from dataclasses import dataclass
from typing import Iterator

import numpy as np
from basics import bit_exact, step_state
from reliability_trials import EXACT, Outcome, restore_exact
from s3_server import FaultProxy, Faults, MotoS3

import flax_ckpt as fc

RETRY_ENV = {
    "FLAX_CKPT_STORAGE_MAX_ATTEMPTS": "3",
    "FLAX_CKPT_STORAGE_RETRY_DELAY": "0.005",
}  # some fail for good


def s3_state(step: int) -> dict:
    """Two data objects' worth (raw) and a few zarr3 chunks: enough requests to fault."""
    return {**step_state(step, (128, 1024), 50_000), "b": np.full((64,), step, np.int32)}


@dataclass
class S3Rig:
    """A moto server, a fault proxy before it, a bucket, and credentials in the environment."""

    server: MotoS3
    proxy: FaultProxy
    bucket: str

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def faults(self, rate: float, seed: int) -> None:
        self.proxy.faults = Faults(rate=rate, seed=seed)

    def calm(self) -> None:
        self.proxy.faults = Faults()


@contextlib.contextmanager
def s3_rig() -> Iterator[S3Rig]:
    """The rig, with the environment that points s3:// URLs at the proxy (restored afterwards)."""
    with MotoS3() as server, FaultProxy(server.port) as proxy:
        env = dict(
            RETRY_ENV,
            FLAX_CKPT_S3_ENDPOINT=proxy.endpoint,
            AWS_REGION="us-east-1",
            AWS_ACCESS_KEY_ID=server.admin.access_key_id,
            AWS_SECRET_ACCESS_KEY=server.admin.secret_access_key,
        )
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield S3Rig(server, proxy, server.create_bucket())
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def s3_save_trial(
    rig: S3Rig, serializer: str, rng: random.Random, rate: float | None = None
) -> tuple[Outcome, str]:
    """Step 1 is saved calmly, step 2 under faults (``rate``: the share of requests failed; by default
    drawn from 0.3..0.95, so some saves fail for good). A failed save raises SaveFailedError, and once
    the faults stop a new manager lists only whole steps; whatever is listed restores bit-exact."""
    spec = rig.url(f"save-{uuid.uuid4().hex[:8]}")
    rig.calm()
    with fc.CheckpointManager(spec, serializer=serializer) as mgr:
        mgr.save(1, s3_state(1))
        mgr.wait_until_finished()
        rig.faults(rate or rng.uniform(0.3, 0.95), rng.randrange(1 << 30))
        try:
            mgr.save(2, s3_state(2))
            mgr.wait_until_finished()
            failed = None
        except fc.SaveFailedError as e:
            failed = e
        except Exception as e:  # noqa: BLE001
            rig.calm()
            return Outcome("error", f"save under faults: undocumented {type(e).__name__}: {e}"), "failed"
        finally:
            rig.calm()
    note = "saved under faults" if failed is None else f"save failed ({type(failed.__cause__).__name__})"
    with fc.CheckpointManager(spec) as mgr:
        steps = mgr.all_steps()
        if failed is None and steps != [1, 2]:
            return Outcome("lost", f"step 2 was saved, a new manager lists {steps}"), note
        if steps not in ([1], [1, 2]):
            return Outcome("lost", f"a new manager lists {steps}"), note
        for s in steps:
            out = restore_exact(lambda: mgr.restore(s), s3_state(s), f"step {s} after a faulted save")
            if not out.ok:
                return out, note
    return EXACT, note


def s3_restore_trial(
    rig: S3Rig, serializer: str, rng: random.Random, rate: float | None = None, via: str = "engine"
) -> tuple[Outcome, str]:
    """A calmly saved step restored under faults (``via`` "engine": fc.restore of its URL;
    "manager": a manager opened and restoring under faults): bit-exact, or a CheckpointError (never
    other bytes); once the faults stop it restores bit-exact. A manager whose scan hides the committed
    step because of a transient error is an "error": a job resuming through it would start over.
    Returns the outcome and a note."""
    spec = rig.url(f"restore-{uuid.uuid4().hex[:8]}")
    rig.calm()
    with fc.CheckpointManager(spec, serializer=serializer) as mgr:
        mgr.save(1, s3_state(1))
    rig.faults(rate or rng.uniform(0.3, 0.95), rng.randrange(1 << 30))
    note = "restored under faults"
    try:
        if via == "engine":
            got = fc.restore(f"{spec}/1")
        else:
            with fc.CheckpointManager(spec) as mgr:
                if mgr.latest_step() != 1:
                    return Outcome(
                        "error",
                        f"a transient error in the manager's scan hid committed step 1 "
                        f"(latest_step() = {mgr.latest_step()})",
                    ), note
                got = mgr.restore()
        if not bit_exact(got, s3_state(1)):
            return Outcome("corrupt", "a restore under faults returned other bytes"), note
    except fc.CheckpointError as e:
        note = f"refused under faults ({type(e).__name__})"
    except Exception as e:  # noqa: BLE001
        return Outcome("error", f"restore under faults: undocumented {type(e).__name__}: {e}"), note
    finally:
        rig.calm()
    with fc.CheckpointManager(spec) as mgr:
        return restore_exact(lambda: mgr.restore(1), s3_state(1), "step 1 once the faults stopped"), note
