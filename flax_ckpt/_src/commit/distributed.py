"""Multi-process agreement for saves, over the jax.distributed key-value store.

Scope: process index and count, and the small key-value protocol by which the N processes of one
job agree on a save: process 0 names the staging folder, every process writes its own shards there
and publishes its chunk records (``parts/p<i>.json`` in the staging folder, announced with its crc32c
through the key-value store), process 0 waits for all of them, merges them into the one manifest's
inputs, commits and announces the commit; the other processes' saves finish when they see it. Also
``allgather``, ``lead`` and ``vote``, the rounds by which processes agree on anything else (the
manager's view of committed steps, the step a restore gives, an automatic interval; the tiers' votes):
each goes through process 0 (``_round``), so a round costs O(N) key-value operations in a job of N
processes, not N^2, and the merge of every process's chunk records (``dedupe``) is linear too
(benchmarks/README.md, "At a thousand hosts").

Every wait runs on the caller's thread (for the manager: the background writer, never the training
thread) and has a timeout (``set_timeout``): a dead or hung peer gives a DistributedError naming the
missing processes instead of a hang. No collectives are used, only the coordinator's key-value store.

Not here: which shards a process owns (engine/snapshot.py keeps each process's addressable shards
with replica_id == 0, so a replicated shard has exactly one writer), the byte layout (serializers),
the commit itself (commit/atomic.py), and the orchestration of one save (native/layout.py's persist).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import crc32c

from flax_ckpt._src import checks
from flax_ckpt._src.errors import DistributedError
from flax_ckpt._src.lazy import lazy
from flax_ckpt._src.serializers import Written, intersect
from flax_ckpt._src.storage import Storage

if TYPE_CHECKING:  # the real modules for the type checker; at run time the lazy proxies
    import jax
else:
    jax = lazy("jax", globals())  # imported on first use (lazy.py)

PARTS = "parts"
_ROOT = "flax_ckpt"
_timeout_s = 300.0
_lock = threading.Lock()
_rounds: dict[str, int] = {}  # key prefix -> how many rounds this process has run under it
_unacked: list[str] = []  # process 0: rounds whose keys are deleted once every peer has acked


def process_index() -> int:
    """This process's index; 0 unless jax.distributed is initialized (asking jax would otherwise
    initialize its backends, which a later jax.distributed.initialize refuses)."""
    return jax.process_index() if jax.distributed.is_initialized() else 0


def process_count() -> int:
    return jax.process_count() if jax.distributed.is_initialized() else 1


def set_timeout(seconds: float) -> None:
    """How long any process waits for another at one point of a save (default 300 s).

    A peer's wait for the commit allows twice this, since process 0 may itself wait this long."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds!r}")
    _timeout_s = float(seconds)


def timeout_s() -> float:
    return _timeout_s


def _client() -> Any:
    """The jax.distributed key-value client. jax has no public accessor for it (multihost_utils uses
    this same private attribute); this function is the only place flax_ckpt touches ``jax._src``."""
    from jax._src.distributed import global_state  # no public accessor (jax 0.10)

    if global_state.client is None:
        raise DistributedError(
            f"{process_count()} processes but jax.distributed is not initialized; call "
            "jax.distributed.initialize() in every process before saving"
        )
    return global_state.client


def _digest(text: str) -> str:
    """A short name for ``text`` (a run's location) in key-value keys. Any str: a path that is not valid
    UTF-8 (os.fsdecode keeps its bytes as lone surrogates) is hashed by the bytes it names."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _next_round(prefix: str) -> str:
    """A fresh key prefix for the next round under ``prefix``: every process runs the same rounds in
    the same order (SPMD), so the n-th round of each process meets the n-th round of the others."""
    with _lock:
        n = _rounds.get(prefix, 0)
        _rounds[prefix] = n + 1
    return f"{prefix}/{n}"


def _get(key: str, seconds: float, what: str) -> dict[str, Any]:
    try:
        raw = _client().blocking_key_value_get(key, max(1, int(seconds * 1000)))
    except Exception as e:  # jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED, or the coordinator is gone
        if "DEADLINE_EXCEEDED" in str(e):
            raise TimeoutError(key) from None
        raise DistributedError(f"{what}: lost contact with the jax.distributed coordinator ({e})") from e
    return json.loads(raw)


def _set(key: str, value: dict[str, Any], what: str) -> None:
    try:
        _client().key_value_set(key, json.dumps(value))
    except Exception as e:
        raise DistributedError(f"{what}: cannot publish to the jax.distributed coordinator ({e})") from e


def _present(prefix: str) -> set[str]:
    try:
        return {k.rsplit("/", 1)[-1] for k, _ in _client().key_value_dir_get(prefix + "/")}
    except Exception:
        return set()


def _round(prefix: str, what: str, value: Any, reduce: Callable[[list[Any]], Any]) -> Any:
    """One key-value round under the next key of ``prefix``, through process 0: every process publishes
    ``value`` (JSON); process 0 reads them all, checks that every process is at the same point of the
    protocol (``what``), reduces them to one result (``reduce``, which may raise DistributedError) and
    publishes it (or the error); every process returns that result (or raises that error).

    What grows with the number of processes N stays linear: N + 1 sets and 2N - 1 gets in all, N gets on
    process 0 and one on any other (a round in which each process read every other's key cost N^2 gets
    at the coordinator). A process that does not answer within the timeout is named by process 0 to all;
    the others wait twice the timeout for process 0 itself, which may be waiting that long for a peer."""
    count, index = process_count(), process_index()
    key = _next_round(prefix)
    n = int(key.rsplit("/", 1)[-1])
    where = f"{prefix} ({what}, round {n})"
    _set(f"{key}/p{index}", {"what": what, "value": value}, where)
    if index:
        try:
            msg = _get(f"{key}/all", 2 * _timeout_s, where)
        except TimeoutError:
            raise DistributedError(
                f"{where}: process 0 of {count} did not answer within {2 * _timeout_s:g} s "
                "(dead, hung, or not running the same saves and restores?)"
            ) from None
        if "error" in msg:
            raise DistributedError(msg["error"])
        return msg["result"]
    try:
        result: dict[str, Any] = {"result": reduce(_collect(key, where, what, count))}
    except DistributedError as e:
        result = {"error": str(e)}
    _set(f"{key}/all", result, where)
    if n > 0:  # every process has published round n, so all have read round n-1's result
        try:
            _client().key_value_delete(f"{prefix}/{n - 1}/")
        except Exception:
            pass
    if "error" in result:
        raise DistributedError(result["error"])
    return result["result"]


def _collect(key: str, where: str, what: str, count: int) -> list[Any]:
    """Process 0: every process's value of round ``key``, in process order."""
    deadline = time.monotonic() + _timeout_s
    out = []
    for j in range(count):
        try:
            msg = _get(f"{key}/p{j}", deadline - time.monotonic(), where)
        except TimeoutError:
            have = _present(key)
            missing = [p for p in range(count) if f"p{p}" not in have]
            raise DistributedError(
                f"{where}: process(es) {missing} of {count} did not answer within "
                f"{_timeout_s:g} s (dead, hung, or not running the same saves and "
                "restores?)"
            ) from None
        if msg["what"] != what:
            raise DistributedError(
                f"{where}: process {j} is at {msg['what']!r}, process 0 at {what!r}; every "
                "process must save and restore the same steps"
            )
        out.append(msg["value"])
    return out


def allgather(prefix: str, what: str, value: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process's ``value`` (JSON), in process order, for the next round under ``prefix``; every
    process must call it for the same rounds in the same order. DistributedError naming the process
    that did not answer within the timeout, or that is at another point (``what``) of the protocol.
    Through process 0 (``_round``): O(N) key-value operations; the bytes every process reads are all N
    values, so a round whose result is smaller (``lead``, ``vote``) should say so."""
    if process_count() == 1:
        return [value]
    return _round(prefix, what, value, lambda values: values)


def lead(prefix: str, what: str, value: Any) -> Any:
    """Process 0's ``value`` on every process (a round like ``allgather``; the others' ``value`` is not
    sent): what every process adopts when process 0's view is the one that counts."""
    if process_count() == 1:
        return value
    return _round(prefix, what, value if process_index() == 0 else None, lambda values: values[0])


def vote(prefix: str, what: str, key: int, err: BaseException | None) -> dict[int, tuple[str, str]]:
    """The outcome of one step everyone tried (``key``): {process: (error type, message)} of every process
    whose ``err`` was not None, the same on every process. DistributedError if processes tried different
    keys. Process 0 counts the votes; every process reads only the outcome."""
    mine = {"key": key, "error": None if err is None else [type(err).__name__, str(err)]}
    if process_count() == 1:
        return {} if err is None else {0: tuple(mine["error"])}

    def count(votes: list[dict[str, Any]]) -> dict[str, Any]:
        if any(v["key"] != key for v in votes):
            raise DistributedError(
                f"{what}: processes tried different steps ({[v['key'] for v in votes]}); "
                "every process must restore the same step"
            )
        return {str(j): v["error"] for j, v in enumerate(votes) if v["error"] is not None}

    return {int(j): tuple(e) for j, e in _round(prefix, "vote", mine, count).items()}


# ------------------------------------------------------------------------------------------- saves


def tree_digest(leaves: list[Any]) -> str:
    """Structure of a snapshot (key paths, kinds, dtypes, shapes of its LeafRecords): every process must
    save the same tree."""
    rows = [
        [
            [list(e) for e in r.path],
            r.kind,
            r.dtype.name if r.dtype is not None else None,
            list(r.shape) if r.shape is not None else None,
        ]
        for r in leaves
    ]
    return f"{crc32c.crc32c(json.dumps(rows).encode()):08x}"


@dataclass(frozen=True)
class SaveRound:
    """One distributed save of ``<parent>/<name>``: the key prefix its processes meet under."""

    prefix: str
    where: str
    index: int
    count: int

    @staticmethod
    def begin(parent: Storage, name: str) -> "SaveRound":
        where = f"{parent.url}/{name}"
        return SaveRound(
            _next_round(f"{_ROOT}/save/{_digest(where)}"), where, process_index(), process_count()
        )

    def agree(self, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The start of the save: process 0 calls ``make`` and publishes what it returns (a JSON
        object: the staging folder's name, the save's id); the others receive the same. A failure of
        ``make`` on process 0 is raised there and reported to the others. Called once per round."""
        key = f"{self.prefix}/staging"
        if self.index == 0:
            _cleanup_acked(self.count)
            try:
                value = make()
            except Exception as e:
                _set(key, {"error": f"{type(e).__name__}: {e}"}, self.where)
                raise
            _set(key, {"value": value}, self.where)
            return value
        try:
            msg = _get(key, _timeout_s, self.where)
        except TimeoutError:
            raise DistributedError(
                f"save of {self.where}: process 0 did not start this save within "
                f"{_timeout_s:g} s (dead, hung, or not saving this step?); nothing was "
                "written"
            ) from None
        if "error" in msg:
            raise DistributedError(f"save of {self.where}: process 0 could not start it: {msg['error']}")
        return msg["value"]

    def publish(self, stage: Storage, written: Written, digest: str) -> None:
        """A peer: stores its chunk records durably in the staging folder and announces them."""
        name = f"{PARTS}/p{self.index}.json"
        body = json.dumps(
            {
                "process": self.index,
                "tree": digest,
                "files": written.files,
                "chunks": {str(k): v for k, v in written.chunks.items()},
            }
        ).encode()
        stage.write(name, [body])
        _set(
            f"{self.prefix}/written/p{self.index}",
            {"part": name, "nbytes": len(body), "crc32c": crc32c.crc32c(body)},
            self.where,
        )

    def fail(self, exc: BaseException) -> None:
        """Reports this process's failure to the others (best effort: the coordinator may be gone)."""
        key = f"{self.prefix}/written/p{self.index}" if self.index else f"{self.prefix}/result"
        try:
            _client().key_value_set(key, json.dumps({"error": self._reason(exc)}))
        except Exception:
            pass

    def _reason(self, exc: BaseException) -> str:
        text = str(exc).removeprefix(f"save of {self.where}: ")
        return text if isinstance(exc, DistributedError) else f"{type(exc).__name__}: {text}"

    def gather(self, stage: Storage, own: Written, digest: str) -> list[Written]:
        """Process 0: waits for every peer's chunk records and returns all, in process order, with
        copies of process-local leaves (written by several processes) kept only from the lowest."""
        msgs = self._wait_written()
        failed = {j: m["error"] for j, m in msgs.items() if "error" in m}
        if failed:
            raise DistributedError(
                f"save of {self.where}: "
                + "; ".join(f"process {j} failed: {err}" for j, err in sorted(failed.items()))
                + "; the step was not committed"
            )
        parts = [own] + [self._read_part(stage, j, msgs[j], digest) for j in range(1, self.count)]
        stage.delete(PARTS)
        return dedupe(parts)

    def _wait_written(self) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + _timeout_s
        msgs: dict[int, dict[str, Any]] = {}
        for j in range(1, self.count):
            try:
                msgs[j] = _get(f"{self.prefix}/written/p{j}", deadline - time.monotonic(), self.where)
            except TimeoutError:
                have = _present(f"{self.prefix}/written")
                missing = [p for p in range(1, self.count) if f"p{p}" not in have]
                raise DistributedError(
                    f"save of {self.where}: process(es) {missing} of {self.count} did not report their shards "
                    f"as written within {_timeout_s:g} s (dead, hung, or not saving this step?); the step "
                    "was not committed"
                ) from None
        return msgs

    def _read_part(self, stage: Storage, j: int, msg: dict[str, Any], digest: str) -> Written:
        raw = stage.read(msg["part"], checks.MAX_MANIFEST_BYTES)
        if len(raw) != msg["nbytes"] or crc32c.crc32c(raw) != msg["crc32c"]:
            raise DistributedError(
                f"save of {self.where}: process {j}'s chunk records "
                f"{stage.url}/{msg['part']} are damaged (size or crc32c mismatch)"
            )
        body = json.loads(raw)
        if body["tree"] != digest:
            raise DistributedError(
                f"save of {self.where}: process {j} saved a different tree than process 0 "
                "(other key paths, shapes or dtypes); every process must save the same "
                "state"
            )
        return Written({int(k): v for k, v in body["chunks"].items()}, body["files"])

    def announce(self) -> None:
        """Process 0, after the commit: the peers' saves may finish."""
        _set(f"{self.prefix}/result", {"committed": True}, self.where)
        with _lock:
            _unacked.append(self.prefix)

    def await_commit(self) -> None:
        """A peer: waits until process 0 has committed (or failed) this save."""
        try:
            msg = _get(f"{self.prefix}/result", 2 * _timeout_s, self.where)
        except TimeoutError:
            raise DistributedError(
                f"save of {self.where}: process 0 did not announce the commit within "
                f"{2 * _timeout_s:g} s (dead or hung); the step may or may not be "
                "committed: a manager's next start shows which"
            ) from None
        if "error" in msg:
            raise DistributedError(f"save of {self.where} failed on process 0: {msg['error']}")
        try:
            _client().key_value_set(f"{self.prefix}/ack/p{self.index}", "1")
        except Exception:
            pass


def dedupe(parts: list[Written]) -> list[Written]:
    """Drops a process's chunks of a leaf that overlap chunks of a lower process: only process-local
    values (numpy arrays, arrays on one process's devices) are written by several processes, and the
    checkpoint keeps process 0's. Shards of global arrays never overlap (one replica_id 0 each).

    Linear in the number of chunks for any layout a save writes: the boundaries of all chunks of a leaf
    cut it into cells, a chunk covers whole cells, and two chunks overlap exactly when they share a
    cell, so each chunk is checked against a set of taken cells rather than every earlier chunk (which
    cost N^2/2 box comparisons per leaf on process 0: half a minute a leaf at 2,048 processes). A chunk
    that would cover more than _CELLS_MAX cells (layouts a save never writes) is compared box by box."""
    grids: dict[int, list[set[int]]] = {}
    for w in parts:
        for leaf, recs in w.chunks.items():
            dims = grids.setdefault(leaf, [])
            for r in recs:
                box = _box(r)
                dims.extend(set() for _ in range(len(box) - len(dims)))
                for d, (s, e) in enumerate(box):
                    dims[d].update((s, e))
    edges = {leaf: [sorted(d) for d in dims] for leaf, dims in grids.items()}
    taken: dict[int, set[tuple[int, ...]]] = {}
    kept: dict[int, list[tuple[tuple[int, int], ...]]] = {}
    pairwise: set[int] = set()  # leaves with a chunk too irregular for cells: compared box by box
    out = []
    for w in parts:
        chunks = {}
        for leaf, recs in w.chunks.items():
            boxes, cells = [_box(r) for r in recs], []
            for box in boxes if leaf not in pairwise else ():
                ranges = [
                    range(bisect.bisect_left(g, s), bisect.bisect_left(g, e))
                    for (s, e), g in zip(box, edges[leaf])
                ]
                if math.prod(len(r) for r in ranges) > _CELLS_MAX:
                    pairwise.add(leaf)
                    break
                cells.extend(itertools.product(*ranges))
            if leaf in pairwise:
                if any(intersect(a, b) is not None for a in boxes for b in kept.get(leaf, [])):
                    continue
            elif any(c in taken.get(leaf, ()) for c in cells):
                continue
            chunks[leaf] = recs
            kept.setdefault(leaf, []).extend(boxes)
            taken.setdefault(leaf, set()).update(cells)
        out.append(Written(chunks, w.files))
    return out


_CELLS_MAX = 1 << 12  # cells one chunk may cover before dedupe compares it box by box


def _box(rec: Any) -> tuple[tuple[int, int], ...]:
    index = rec["index"] if isinstance(rec, dict) else rec
    return tuple((int(a), int(b)) for a, b in index)


def _cleanup_acked(count: int) -> None:
    """Process 0: deletes the keys of finished rounds every peer has acknowledged."""
    with _lock:
        pending = list(_unacked)
    for prefix in pending:
        if len(_present(f"{prefix}/ack")) >= count - 1:
            try:
                _client().key_value_delete(prefix + "/")
            except Exception:
                continue
            with _lock:
                _unacked.remove(prefix)


# ----------------------------------------------------------------------------------------- manager


def job_prefix(kind: str, where: str) -> str:
    """The key prefix of one manager's (or tier set's) agreement rounds: ``kind`` and a digest of its
    directory, so that managers of different directories in one job never meet."""
    return f"{_ROOT}/{kind}/{_digest(where)}"
