"""What tests/ and benchmarks/ share: bit-exact comparison, states, crafted manifests, child processes.

harness/ holds the code that both the test suite and the benchmarks run, so that neither imports the
other's files: this module; ``s3_server.py`` (moto's S3 server and a fault proxy) and
``gcs_server.py`` (fake-gcs-server behind that proxy); the fault trials
(``reliability_trials.py``, ``reliability_hostile.py``, ``reliability_s3.py``), which the tests run a
few of and benchmarks/faults.py runs at scale; and ``reliability_worker.py``, the saver processes
those trials kill. Its modules are imported by their bare names: tests/conftest.py and tests/helpers.py
put harness/ on sys.path, the benchmarks insert it themselves. The library is used through its public
API, except for the manifest codec, imported once below.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np

from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.native import manifest as fmt  # the manifest codec (encode, FORMAT_*)

HARNESS = Path(__file__).resolve().parent
TESTS = HARNESS.parent / "tests"
HOST = "127.0.0.1"
MANIFEST = MANIFEST

PathLike = str | os.PathLike


# --------------------------------------------------------------------------------- bit-exact comparison


def _is_none(x: Any) -> bool:
    return x is None


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def as_bytes(x: Any) -> tuple:
    """One leaf as a comparable tuple: equal tuples mean the same kind and the same bits.

    Arrays (jax or numpy, numpy scalars): (dtype, shape, bytes); typed PRNG keys: ("key", impl, the key
    data as an array); Python floats by their bits (NaN payloads and -0.0 count); anything else (int,
    bool, str, None, ...): (type name, value)."""
    if _is_key(x):
        return ("key", str(jax.random.key_impl(x)), as_bytes(jax.random.key_data(x)))
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        return (a.dtype.name, a.shape, a.tobytes())
    if isinstance(x, float):
        return ("float", np.float64(x).tobytes())
    return (type(x).__name__, x)


def leaf_bytes(tree: Any) -> dict[str, tuple]:
    """Every leaf (None included) as ``as_bytes``, keyed by its key path: equal dicts mean the same
    paths and the same bits, whatever the containers' types."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)[0]
    return {jax.tree_util.keystr(path): as_bytes(leaf) for path, leaf in leaves}


def assert_bit_exact(got: Any, want: Any, shardings: Any = None, *, types: bool = True) -> int:
    """Same structure (containers included), and every leaf the same bits (``as_bytes``); returns the
    number of leaves compared.

    ``types``: leaves must also have the same type (any two jax.Arrays count as one type); False for a
    caller that compares restored jax arrays with numpy ones. ``shardings``: a tree of the expected
    sharding of each leaf of ``got`` (None for a leaf compared whole): that leaf must have it, and each
    addressable shard must hold the bits of ``want`` at its index (what a process of a multi-process
    job can check)."""
    g, gdef = jax.tree_util.tree_flatten_with_path(got, is_leaf=_is_none)
    w, wdef = jax.tree_util.tree_flatten(want, is_leaf=_is_none)
    assert gdef == wdef, f"structure differs:\n{gdef}\n{wdef}"
    shards = [None] * len(w) if shardings is None else jax.tree_util.tree_leaves(shardings, is_leaf=_is_none)
    assert len(shards) == len(w), (len(shards), len(w))
    for (path, x), y, sharding in zip(g, w, shards):
        where = jax.tree_util.keystr(path)
        if types:
            assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (
                where,
                type(x),
                type(y),
            )
        if sharding is None:
            assert as_bytes(x) == as_bytes(y), (where, x, y)
            continue
        y = np.asarray(y)
        assert x.shape == y.shape and np.dtype(x.dtype) == y.dtype, (
            where,
            x.shape,
            x.dtype,
            y.shape,
            y.dtype,
        )
        assert x.sharding == sharding, (where, x.sharding, sharding)
        for shard in x.addressable_shards:
            assert as_bytes(shard.data) == as_bytes(y[shard.index]), (where, shard.index)
    return len(w)


def bit_exact(got: Any, want: Any, **kw: Any) -> bool:
    """Whether ``assert_bit_exact(got, want, **kw)`` holds (for judges that count, not fail)."""
    try:
        assert_bit_exact(got, want, **kw)
    except AssertionError:
        return False
    return True


# ------------------------------------------------------------------------------------------- states


def step_state(step: int, shape: tuple[int, ...], seed: int) -> dict:
    """A state that is a deterministic function of ``step``: a float32 "w" of ``shape`` drawn from
    ``seed + step``, and the step. Each caller keeps its own seed and shape (its own size)."""
    rng = np.random.default_rng(seed + step)
    return {"w": rng.standard_normal(shape).astype(np.float32), "step": step}


def crash_state(step: int) -> dict:
    """The crash tests' state (4 MB): one big float leaf and small ones (workers/crash_worker.py and
    harness/reliability_worker.py save it, tests restore and compare it)."""
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((1024, 1024)).astype(np.float32),
        "b": {"x": rng.integers(0, 255, (3000,), dtype=np.uint8), "step": step},
    }


_FROZEN: list[np.ndarray] = []


def shared_state(step: int) -> dict:
    """The sharing crash trials' state (a fine-tune's shape, 6.3 MB): a 4 MB leaf frozen for the whole
    run, 2 MB that change every third step, and small leaves that change at every step; so later steps
    share the bytes of earlier ones, some of them removed by retention (docs/design.md)."""
    if not _FROZEN:
        _FROZEN.append(np.random.default_rng(12345).standard_normal((1024, 1024)).astype(np.float32))
    rng = np.random.default_rng(step)
    return {
        "frozen": _FROZEN[0],
        "slow": np.random.default_rng(10_000 + step // 3).standard_normal((512, 1024)).astype(np.float32),
        "w": rng.standard_normal((256, 256)).astype(np.float32),
        "b": {"step": step},
    }


# ----------------------------------------------------------------------------------------- manifests


def manifest_body(ckpt: PathLike) -> dict:
    """The body of a checkpoint's manifest, as stored."""
    return json.loads(Path(ckpt, MANIFEST).read_bytes())["body"]


def write_manifest_raw(ckpt: PathLike, data: bytes) -> None:
    """Replaces a checkpoint's manifest file by ``data``, whatever it is."""
    Path(ckpt, MANIFEST).write_bytes(data)


def write_manifest_body(ckpt: PathLike, body: dict) -> None:
    """Writes a crafted manifest with a valid checksum, so only what was crafted is wrong."""
    write_manifest_raw(ckpt, fmt.encode(body))


def encode_manifest(body: dict) -> bytes:
    """A manifest file for ``body``: with a valid checksum, or where the codec cannot encode it (keys
    json cannot sort: an int beside strings) the same layout with checksum 0."""
    try:
        return fmt.encode(body)
    except (ValueError, TypeError):
        return json.dumps(
            {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "crc32c": 0, "body": body}
        ).encode()


def edit_manifest(ckpt: PathLike, change: Callable[[dict], Any]) -> None:
    """Reads the manifest body, lets ``change`` edit it in place, writes it back with a valid checksum."""
    body = manifest_body(ckpt)
    change(body)
    write_manifest_body(ckpt, body)


def leaf_of(body: dict, name: str) -> dict:
    """The record of the first leaf whose key path ends in ``name``."""
    return next(lf for lf in body["leaves"] if lf["path"] and lf["path"][-1][1] == name)


def leaf_chunks(ckpt: PathLike) -> dict[str, list[dict]]:
    """The stored chunks of every array leaf ("a/b" key -> chunk records: file, offset, nbytes, ...)."""
    return {
        "/".join(str(k) for _, k in leaf["path"]): leaf["chunks"]
        for leaf in manifest_body(ckpt)["leaves"]
        if "chunks" in leaf
    }


# ----------------------------------------------------------------------------------- child processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1, held bound and not listening for the block: a connection to it is
    refused, and no other process can take it meanwhile (a ``free_port()`` is free only when asked: a
    server that another test starts may be given it before it is used)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        yield s.getsockname()[1]


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (or as a Popen ``preexec_fn``): Linux sends it ``sig`` when its parent dies (prctl
    PR_SET_PDEATHSIG), so no child outlives a killed test run. Does nothing where prctl is missing."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)
    except (OSError, AttributeError):
        pass


def worker_env(devices: int | None = None) -> dict[str, str]:
    """The environment of a child process: this one's, with JAX on CPU and tests/ and harness/ first on
    PYTHONPATH (so a child script can import tests/helpers.py and this module). ``devices``: the CPU
    devices JAX gives the child (XLA_FLAGS; 1: one, as a user has); None keeps this process's XLA_FLAGS."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    paths = (str(TESTS), str(HARNESS), os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env
