"""The device half of a snapshot: copies of jax arrays' shards made on their devices' own streams.

Scope: which jax.Array leaves a snapshot copies on their devices rather than to host at once (``choose``),
within the headroom each device has (``headroom``), the jitted copy itself (``dispatch``), and bringing
the copies to host later, on the writer's thread (``to_host``). Not here: the host copies, the records
and the ``Snapshot`` that holds both (snapshot.py).

A copy dispatched on the device is ordered by XLA after the computation that produces the array and
before any later one that reuses its buffers (a donating step), so ``save`` returns without waiting for
either; the transfer to host, the checksums and the writes run on the writer, overlapping the next steps.
The transfers run a few at a time (``WINDOW`` bytes in flight) while nothing waits for the save: the
training steps that run meanwhile wait for the device's transfers less than when all are queued at once.
The copy uses only memory the device has to spare: ``bytes_limit`` less the peak in use (with our own
earlier copies counted out of that peak, as they are freed once on host) less a margin (a tenth of the
limit). Leaves that do not fit are copied to host before ``save`` returns, as without a device copy.

Settings (environment, read at each save):

- ``FLAX_CKPT_DEVICE_SNAPSHOT``: ``auto`` (the default: on accelerators every jax.Array leaf that fits;
  never on CPU devices), ``always`` (CPU devices too) or ``never`` (copies to host before ``save``
  returns, as older releases did). On a CPU device the device's memory is the host's and its stream
  runs on the cores that compute the step: a copy there is one more full copy of the state on those
  cores, before the host copy the write needs (or the memory tier's copy into its file), and the step
  after it waits for it. So ``auto`` waits for the step computing the state (time reported apart from
  the save's, as the device's) and copies to host once: into the memory tier's pages or the
  persistent manager's arena.
- ``FLAX_CKPT_DEVICE_BUDGET``: bytes each device may give the copies of one save, in place of what its
  ``memory_stats()`` reports (CPU devices report nothing: no limit but this one).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar

import numpy as np

from flax_ckpt._src.errors import CheckpointError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.tree import is_ready

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

log = logging.getLogger("flax_ckpt")
T = TypeVar("T")

MODES = ("auto", "always", "never")
_MARGIN = 0.10  # of a device's bytes_limit, left free beside the copies
WINDOW = 64 << 20  # bytes of device-to-host transfers in flight at once (0: all started at once): the
#   training steps that run meanwhile wait less for a few transfers than for all (benchmarks/README.md)


def mode() -> str:
    """``FLAX_CKPT_DEVICE_SNAPSHOT`` (see the module); a ValueError for another value."""
    m = os.environ.get("FLAX_CKPT_DEVICE_SNAPSHOT", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"FLAX_CKPT_DEVICE_SNAPSHOT={m!r}: use one of {', '.join(MODES)}")
    return m


def _budget_env() -> int | None:
    v = os.environ.get("FLAX_CKPT_DEVICE_BUDGET", "").strip()
    if not v:
        return None
    try:
        n = int(float(v))
    except (ValueError, OverflowError):  # "abc", "nan"; "inf" (no int holds it)
        raise ValueError(
            f"FLAX_CKPT_DEVICE_BUDGET={v!r}: give a finite number of bytes each device may give one "
            "save's copies (e.g. 2e9), 0 to copy to host at once, or unset it to use what the devices "
            "report (FLAX_CKPT_DEVICE_SNAPSHOT=always copies every leaf that fits)"
        ) from None
    return max(0, n)


_ours: dict[int, int] = {}  # device id -> the most bytes our copies have held on it at once


def headroom(device: Any) -> int | None:
    """Bytes ``device`` can give one save's copies (None: no limit known: CPU devices, or a backend
    without memory statistics); ``FLAX_CKPT_DEVICE_BUDGET`` when set."""
    env = _budget_env()
    if env is not None:
        return env
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without memory statistics
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    limit = int(stats["bytes_limit"])
    peak = int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))
    peak = max(peak - _ours.get(device.id, 0), int(stats.get("bytes_in_use", 0)))
    return max(0, limit - peak - int(_MARGIN * limit))


@dataclass
class Pending:
    """One shard copied on its device (``src`` until dispatched, then ``dev``), for ``to_host``: into
    ``dest`` (a buffer of the snapshot's ``into``) when given, else the transfer's own host buffer."""

    leaf: int  # index in the snapshot's leaves
    shard: int  # index in that leaf's shards
    src: Any
    dest: np.ndarray | None
    dev: Any = None
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.nbytes = math.prod(self.src.shape) * np.dtype(self.src.dtype).itemsize


@dataclass(frozen=True)
class Choice:
    """What one snapshot copies where: ``mode`` is "device" (every jax.Array leaf on its device),
    "split" (those that fit; the rest to host before ``save`` returns), "host" (none on the device);
    the bytes each way. Recorded in the manager's statistics."""

    mode: str
    device_bytes: int
    host_bytes: int
    ready: bool = False  # every array was found computed already
    cpu: bool = False  # every array lies on CPU devices ("auto" copies them to host once, never on them)


_CPU_CHOICE = Choice("host", 0, 0, cpu=True)  # ``choose``'s answer for a CPU state (frozen: one for all)


def _jax_parts(x: jax.Array, whole: bool) -> list[tuple[Any, Any]]:
    """(shard data, device) of the shards of ``x`` this process writes."""
    if whole:
        return [(x, next(iter(x.sharding.device_set)))]
    return [(s.data, s.device) for s in x.addressable_shards if s.replica_id == 0]


def choose(arrays: Sequence[tuple[int, jax.Array, bool, bool]]) -> tuple[set[int], Choice]:
    """Which of ``arrays`` (index, array, whole, on CPU) are copied on their devices: per the mode
    (CPU arrays only with "always") and each device's headroom, in order, a leaf taken when all its
    shards fit."""
    m = mode()
    if m == "auto" and arrays and (cpu_process() or all(cpu for *_, cpu in arrays)):  # a CPU state: copied
        return set(), _CPU_CHOICE  # to host once, never on the device (its bytes: the snapshot's, which
        # counts them anyway)
    total = sum(math.prod(x.shape) * x.dtype.itemsize for _, x, _, _ in arrays)  # jax's nbytes: slower
    if m == "never" or not arrays:
        return set(), Choice("host", 0, total, ready=not arrays)
    room: dict[int, int | None] = {}
    chosen: set[int] = set()
    dev_bytes = 0
    for i, x, whole, cpu in arrays:
        if cpu and m == "auto":  # beside accelerators' arrays, a CPU array is copied to host, as above
            continue
        parts = _jax_parts(x, whole)
        need: dict[int, int] = {}
        for a, d in parts:
            if d.id not in room:
                room[d.id] = headroom(d)
            need[d.id] = need.get(d.id, 0) + a.nbytes
        if all((r := room[d]) is None or r >= n for d, n in need.items()):
            for d, n in need.items():
                if (r := room[d]) is not None:
                    room[d] = r - n
            chosen.add(i)
            dev_bytes += sum(need.values())
    host = total - sum(x.nbytes for i, x, _, _ in arrays if i in chosen)
    kind = "device" if len(chosen) == len(arrays) else "split" if chosen else "host"
    return chosen, Choice(kind, dev_bytes, host)


def host_only() -> bool:
    """Whether every snapshot copies the state to host, waiting for it to be computed: the mode is
    "never", or "auto" in a process whose devices are all CPUs (``cpu_process``)."""
    m = mode()
    return m == "never" or (m == "auto" and cpu_process())


def copied_to_host(arrays: Sequence[jax.Array]) -> bool:
    """Whether a snapshot copies ``arrays`` to host, waiting for them to be computed, whatever the
    devices' memory: the mode is "never", or "auto" and they all lie on CPU devices."""
    m = mode()
    return m == "never" or (m == "auto" and (cpu_process() or all(_on_cpu(x) for x in arrays)))


@functools.cache
def cpu_process() -> bool:
    """Whether this process's devices are all CPUs (jax found no accelerator, or was told to use CPUs
    only): then every array lies on a CPU, without asking each. Asked once: a process's backends are
    made once."""
    wanted = {p.strip() for p in (getattr(jax.config, "jax_platforms", None) or "").split(",") if p.strip()}
    return wanted <= {"cpu"} and jax.default_backend() == "cpu"


_HOW: str | None = None  # how the copy is made: a jitted jnp.copy ("jit": accelerators, where it was measured
#   at the device's bandwidth), or jax.device_put(may_alias=False) (None: CPU devices, where a jitted call
#   whose inputs are ready runs on the caller's thread, and this one does not)


def _copy_all(xs: list[jax.Array]) -> list[jax.Array]:
    return [jax.numpy.copy(x) for x in xs]


@functools.cache
def _jitted_copy() -> Callable[[list[jax.Array]], list[jax.Array]]:
    """The jitted copy, made at its first use (so that importing this module imports no jax)."""
    return jax.jit(_copy_all)


def dispatch(pending: Sequence[Pending]) -> None:
    """Dispatches the copies of ``pending``'s shards, one call per device (it returns before the copies,
    or the computations producing their sources, have run); a copy is a new buffer, never an alias."""
    by_dev: dict[Any, list[Pending]] = {}
    for p in pending:
        by_dev.setdefault(next(iter(p.src.sharding.device_set)), []).append(p)
    for d, ps in by_dev.items():
        srcs = [p.src for p in ps]
        how = _HOW or ("device_put" if d.platform == "cpu" else "jit")
        outs = jax.device_put(srcs, may_alias=False) if how == "device_put" else _jitted_copy()(srcs)
        for p, o in zip(ps, outs):
            p.dev, p.src = o, None
        n = sum(o.nbytes for o in outs)
        _ours[d.id] = max(_ours.get(d.id, 0), n)


def to_host(
    pending: Sequence[Pending], hurry: threading.Event | None = None
) -> tuple[list[np.ndarray], float]:
    """The host copies of ``pending``'s device copies (the writer's thread), and when the device copies
    were found done (perf_counter): the transfers started in order, at most ``WINDOW`` bytes in flight
    (at least one transfer) until ``hurry`` is set (something waits for this save: then all that are
    left at once), each waited for in turn. A failure of the computation that produced a copy's source
    (an XLA error of the training step) is raised as a CheckpointError whose cause it is."""
    try:
        jax.block_until_ready([p.dev for p in pending])
        ready = time.perf_counter()
        items = [(p, p.nbytes) for p in pending]
        return [np.asarray(p.dev) for p in paced(items, _start_transfer, WINDOW, hurry)], ready
    except Exception as e:
        raise failed(e) from e


def failed(e: BaseException) -> CheckpointError:
    """The error of a save whose state's computation failed on the device (``e``: an XLA error of the
    training step, raised where the state is waited for or copied), to be raised from ``e``."""
    return CheckpointError(
        f"the computation that produced the saved state failed on the device ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); nothing of this step was written. Earlier steps "
        "are intact; the cause is attached. Fix the training step (a smaller batch for an out-of-memory "
        "error) and save the state it returns"
    )


def _start_transfer(p: Pending) -> None:
    if not _on_cpu(p.dev):
        p.dev.copy_to_host_async()


def paced(
    items: Sequence[tuple[T, int]],
    start: Callable[[T], None],
    window: int,
    hurry: threading.Event | None = None,
) -> Iterator[T]:
    """Starts the (item, bytes) ``items`` in order with ``start`` and yields each item, in order, for the
    caller to wait for before it asks for the next: at most ``window`` bytes started and not yet waited
    for (a larger item alone; 0: no limit), and no limit at all once ``hurry`` is set."""
    flight: deque[tuple[T, int]] = deque()
    held = 0
    for x, n in items:
        while flight and window and held + n > window and not (hurry is not None and hurry.is_set()):
            y, m = flight.popleft()
            held -= m
            yield y
        start(x)
        flight.append((x, n))
        held += n
    while flight:
        yield flight.popleft()[0]


def _on_cpu(x: jax.Array) -> bool:
    """Whether every device of ``x`` is a CPU. Asked per leaf at every save: a jitted step's outputs
    keep their sharding objects from one step to the next, so the answer is kept by the sharding's
    identity (the sharding kept with it, so that its id is not reused); its device set would be a new
    Python set at each ask, and a cache by equality hashes the sharding in Python."""
    s = x.sharding
    hit = _CPU.get(id(s))
    if hit is not None and hit[0] is s:
        return hit[1]
    cpu = all(d.platform == "cpu" for d in s.device_set)
    if len(_CPU) >= 4096:  # a program that makes new shardings without end: start again
        _CPU.clear()
    _CPU[id(s)] = (s, cpu)
    return cpu


_CPU: dict[int, tuple[Any, bool]] = {}  # id(sharding) -> (sharding, whether all its devices are CPUs)


_told: set[str] = set()


def tell(choice: Choice) -> None:
    """Logs the first snapshot of each kind (INFO), saying why a state was not copied on its devices."""
    if choice.mode in _told:
        return
    _told.add(choice.mode)
    mb = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    if choice.mode == "device":
        text = f"saves copy the state ({mb(choice.device_bytes)}) on its devices and return at once"
    elif choice.mode == "split":
        text = (
            f"the devices have room for part of the state: saves copy {mb(choice.device_bytes)} on them "
            f"and {mb(choice.host_bytes)} to host memory before returning"
        )
    elif choice.device_bytes + choice.host_bytes == 0 or choice.ready or choice.cpu:
        log.debug("saves copy the state (%s) to host memory before returning", mb(choice.host_bytes))
        return  # a CPU state: the one host copy is all a save can do, nothing to tell
    else:
        text = (
            f"saves copy the state ({mb(choice.host_bytes)}) to host memory before returning: no device "
            "memory to spare, or FLAX_CKPT_DEVICE_SNAPSHOT=never"
        )
    log.info("%s (the Accelerators guide says why)", text)


__all__ = [
    "Choice",
    "Pending",
    "choose",
    "copied_to_host",
    "cpu_process",
    "host_only",
    "dispatch",
    "headroom",
    "mode",
    "paced",
    "tell",
    "to_host",
]
