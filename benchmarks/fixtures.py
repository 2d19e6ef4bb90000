"""What benchmark scenarios set up and measure with: the test pytree, files and the page cache, a
training step, peak memory. Scope: helpers only; runner.py runs the scenarios.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def make_tree(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A model-like flat state of about ``total_bytes``: a few large float32/bfloat16 arrays (~88%) and
    many small ones (biases, norms, optimizer counters; ~12% in ~400 leaves), with random contents.

    Keys are '/'-separated paths; ``nest`` turns them into nested dicts.
    """
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    tree: dict[str, np.ndarray] = {}

    def add(name: str, nbytes: int, dtype: np.dtype, cols: int) -> None:
        n = max(cols, int(nbytes) // dtype.itemsize // cols * cols)
        if dtype == bf16:
            a = rng.standard_normal(n, dtype=np.float32).astype(bf16)
        elif dtype.kind == "f":
            a = rng.standard_normal(n, dtype=np.float32).astype(dtype, copy=False)
        else:
            a = rng.integers(0, 1 << 30, n, dtype=dtype)
        tree[name] = a.reshape(-1, cols) if cols > 1 else a

    f32 = np.dtype(np.float32)
    add("params/embed/embedding", 0.30 * total_bytes, f32, 1024)
    add("params/head/kernel", 0.18 * total_bytes, f32, 1024)
    add("opt/mu/embed/embedding", 0.15 * total_bytes, bf16, 1024)
    add("opt/nu/embed/embedding", 0.10 * total_bytes, bf16, 1024)
    for i in range(6):  # medium: per-layer MLP kernels
        add(f"params/layer_{i}/mlp/kernel", 0.025 * total_bytes, f32, 256)
    small_budget = 0.12 * total_bytes
    sizes = np.exp(rng.uniform(np.log(256), np.log(max(512, small_budget / 50)), 400))
    sizes *= small_budget / sizes.sum()
    for i, s in enumerate(sizes):
        kind = ("bias", "scale", "count")[i % 3]
        dt = np.dtype(np.int32) if kind == "count" and i % 9 == 2 else f32
        add(f"params/block_{i // 8}/{kind}_{i % 8}", s, dt, 1)
    return tree


def many_small_tree(n_leaves: int, leaf_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n_leaves`` float32 vectors of ``leaf_bytes`` each (a worst case for per-leaf overhead)."""
    rng = np.random.default_rng(seed)
    return {
        f"layers/{i // 16}/w_{i % 16}": rng.standard_normal(leaf_bytes // 4, dtype=np.float32)
        for i in range(n_leaves)
    }


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in flat.items():
        d = out
        *head, last = k.split("/")
        for h in head:
            d = d.setdefault(h, {})
        d[last] = v
    return out


def flat_items(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k in sorted(tree) for kv in flat_items(tree[k], f"{prefix}{k}/")]
    return [(prefix[:-1], tree)]


def tree_bytes(flat: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in flat.values())


def same_bytes(expected: dict[str, np.ndarray], got: dict[str, Any]) -> None:
    """Raises AssertionError unless ``got`` (flat, any array type) holds exactly the bytes of ``expected``."""
    assert set(expected) == set(got), (sorted(set(expected) ^ set(got)))[:5]
    for k, a in expected.items():
        b = np.asarray(got[k])
        assert b.shape == a.shape and b.dtype == a.dtype, (k, b.shape, b.dtype, a.shape, a.dtype)
        assert np.array_equal(b.reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8)), k


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [Path(d) / f for d, _, fs in os.walk(path) for f in fs]


def write_raw_file(path: Path, arrays: Any) -> None:
    """The raw baseline's write: every array's bytes appended to one file with ``ndarray.tofile``
    (through the page cache), then fsynced."""
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(path: Path) -> None:
    """fsync every file and folder under ``path`` (cheap where the writer already did)."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = [path.parent] + ([Path(d) for d, _, _ in os.walk(path)] if path.is_dir() else [])
    for d in dirs:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: Path) -> None:
    """Evicts the (clean, fsynced) pages of every file under ``path`` from the page cache:
    posix_fadvise(POSIX_FADV_DONTNEED), applied the same way to every contender's files."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_usage(path: Path) -> int:
    return sum(f.stat().st_size for f in files_under(path))


def jax_cpu_env() -> None:
    """Benchmarks run jax on the host CPU, one device, quietly."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def adam_training(model: Any, xs: Any, ys: Any, lr: float) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """(init, step) of a Flax Linen ``model`` trained with optax adam (learning rate ``lr``) on one batch
    ``xs`` of integer labels ``ys``: ``init()`` gives a fresh TrainState, ``step(state)`` the next one
    (jitted, the state donated, as a training loop runs it)."""
    import jax
    import optax
    from flax.training import train_state

    def init():
        params = jax.jit(model.init)(jax.random.key(0), xs)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(lr))

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, x), y).mean()

    def _step(state, x, y):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, x, y))

    step = jax.jit(_step, donate_argnums=0)
    return init, lambda s: step(s, xs, ys)


class RssPeak:
    """Samples this process's resident memory (/proc/self/statm) on a thread every ``interval``
    seconds from its creation; ``stop()`` gives the peak minus the resident memory at the start."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.page = interval, os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self.rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.rss())
        return self.peak - self.base


def status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM, ...), 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_above(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds, peak RSS above the RSS before the call in bytes, result)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass
    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return seconds, max(0, status_kb("VmHWM") - before) * 1024, out
