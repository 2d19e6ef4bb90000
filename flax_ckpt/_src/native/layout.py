"""flax_ckpt's own layout: a step folder with ``manifest.json`` (the commit record) and the serializer's data.

Scope: the native format as a layouts.Layout (``NativeLayout``): writing a snapshot as one
checkpoint folder (``persist``: serializer, manifest, commit; with several processes, the agreement
of distributed.SaveRound), and opening one (``open_native``: the
manifest read, verified and validated before anything it names is read, as a restore ``Source``).
The manifest's schema is native/manifest.py's; the bytes of arrays the serializers'; the target check and
placement engine/restore.py's and engine/reader.py's.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Literal, Sequence, cast

import numpy as np

from flax_ckpt._src import checks
from flax_ckpt._src.checks import MANIFEST
from flax_ckpt._src.commit import atomic as commit_mod
from flax_ckpt._src.commit import distributed
from flax_ckpt._src.commit.recycler import Recycler
from flax_ckpt._src.engine.arena import Arena
from flax_ckpt._src.engine.leaves import CheckpointInfo, checkpoint_info, key_data_shape
from flax_ckpt._src.engine.pause import gc_paused
from flax_ckpt._src.engine.reader import Damage
from flax_ckpt._src.engine.snapshot import Snapshot, jsonable, metrics_json, snapshot
from flax_ckpt._src.engine.transfer import Streamed, streamed, write_streamed
from flax_ckpt._src.errors import (
    CheckpointNotCommittedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidManifestError,
    StorageError,
    TargetMismatchError,
)
from flax_ckpt._src.native import sharing, trust
from flax_ckpt._src.native.manifest import SaveManifests, decode, decode_records
from flax_ckpt._src.records import LeafRecord, PersistTimes
from flax_ckpt._src.serializers import Box, Serializer, Written, get_serializer, raw, serializer_for
from flax_ckpt._src.serializers.base import StoredArray, stored
from flax_ckpt._src.storage import LocalStorage, Storage

_BUDGET_SLACK = 64 << 20  # see NativeSource.budget


# ---------------------------------------------------------------------------------------------- save


def manifest_bytes(
    snap: Snapshot,
    written: list[Written],
    serializer: Serializer,
    *,
    step: int | None,
    metrics: dict | None,
    metadata: Any,
    process_count: int = 1,
    manifests: SaveManifests | None = None,
    shares: "tuple[str, sharing.Base | None] | None" = None,
) -> bytes:
    """The manifest of a save (validated as restore will validate it). ``manifests``: the writer's
    (made faster for a structure it saved before). ``shares``: (this save's id, the step it compared
    with) for a step of a run that shares bytes (native/sharing.py): the manifest records its id and the
    files of other steps its chunks name."""
    if len(written) == 1:  # one process: its records as they are
        chunks = written[0].chunks
    else:
        chunks = {}
        for w in written:
            for i, recs in w.chunks.items():
                chunks.setdefault(i, []).extend(recs)
    files = {name: size for w in written for name, size in w.files.items()}
    head = {
        "step": step,
        "metrics": metrics_json(metrics),
        "metadata": jsonable(metadata, "metadata"),
        "created": time.time(),
        "process_count": process_count,
        "serializer": serializer.name,
        "files": files,
    }
    if shares is not None:
        head["id"] = shares[0]
        shared = sharing.shared_head(chunks, shares[1])
        if shared is not None:
            head["shared"] = shared
    return (manifests or SaveManifests()).encode(
        head,
        [lf.record for lf in snap.leaves],
        [chunks.get(i, []) if lf.record.is_array else None for i, lf in enumerate(snap.leaves)],
    )


class NativeLayout:
    """flax_ckpt's own format as layouts.Layout: ``serializer`` stores the arrays ("raw" by default)."""

    name, record, manifest = "native", MANIFEST, MANIFEST
    evident = False  # a folder is native when its manifest opens: failing that, maybe no committed checkpoint
    foreign = False  # flax_ckpt's own runs: a manager claims the directory (lock, clean-up) when it opens

    def __init__(self, serializer: "str | Serializer | None" = None, *, step: int | None = None):
        """``step``: the step a run's folder name gives (layouts.step_folders); a folder opened through
        this layout must hold that step (open_native's ``step``)."""
        self.serializer, self.step = get_serializer(serializer), step
        self._manifests = SaveManifests()
        self.share = False  # steps share unchanged chunks with the run's previous step (a manager sets it)
        self._base: sharing.Base | None = None  # the step this layout committed last
        self.resumed_from: str | None = None  # the step a manager restored: the next save's base
        self.shared_bytes = 0  # bytes the last save referred to instead of writing them
        self.avoid: set[tuple[str, str | None]] = set()  # (step folder, id): found damaged, never a base
        self.suspect: set[tuple[str, str | None, str]] = set()  # (step folder, id, file) damaged steps name
        self.trust = trust.Trust()  # the chunks this layout's saves may share without reading them

    def snapshot(self, tree: Any, *, copy: bool, reuse: Snapshot | None = None) -> Snapshot:
        """``copy``: every array shard copied into an arena (engine/arena.py), ``reuse``'s when it holds
        them (the previous save's, durable now); with the raw serializer, checksummed as it is copied.
        Without ``copy`` (a synchronous save), arrays on accelerators are streamed with the raw
        serializer: their transfers started, each piece written as it lands (engine/transfer.py)."""
        if not copy:
            stream = isinstance(self.serializer, raw.RawSerializer)
            return streamed(tree) if stream else snapshot(tree, copy=False)
        block = raw.BLOCK if isinstance(self.serializer, raw.RawSerializer) else None
        return snapshot(
            tree,
            copy=True,
            reuse=reuse,
            into=Arena.fit(reuse.arena if reuse is not None else None),
            checksum=block,
        )

    def persist(
        self,
        snap: Snapshot,
        parent: Storage,
        name: str,
        *,
        step: int | None,
        metrics: dict | None,
        metadata: Any,
    ) -> PersistTimes:
        """Writes a snapshot under ``parent/name`` and commits it atomically; on any failure removes what
        it wrote and re-raises. This is the whole path from a snapshot to durable bytes. With several
        processes (jax.distributed), every process calls it with its own snapshot; see _persist_shared."""
        snap.complete()  # shards still on their devices come to host first (a no-op once they are)
        serializer = self.serializer
        if distributed.process_count() > 1:
            return _persist_shared(
                snap, parent, name, serializer, step=step, metrics=metrics, metadata=metadata, layout=self
            )
        times = PersistTimes()
        staging = commit_mod.staging_name(parent, name, record=MANIFEST)
        stage = parent.sub(staging)
        try:
            t0 = time.perf_counter()
            sharer, shares = self._sharer(parent, name, staging, snap)
            writer = serializer if sharer is None else cast(Serializer, sharing.Sharing(serializer, sharer))
            tag = sharing.file_tag("p0", parent, shares)
            written = (
                write_streamed(writer, stage, snap, snap.items(), tag=tag)
                if isinstance(snap, Streamed)
                else writer.write(stage, snap.items(), tag=tag)
            )
            t1 = time.perf_counter()
            data = manifest_bytes(
                snap,
                [written],
                serializer,
                step=step,
                metrics=metrics,
                metadata=metadata,
                manifests=self._manifests,
                shares=shares,
            )
            commit_mod.commit(parent, staging, name, MANIFEST, data)
            self._committed(snap, parent, name, written, shares, sharer)
            times.write, times.commit = t1 - t0, time.perf_counter() - t1
            times.fsync, times.serialize, times.written = written.fsync_s, written.serialize_s, written.nbytes
        except BaseException:
            sharing.abort(parent, staging, MANIFEST)
            raise
        return times

    def _sharer(
        self,
        parent: Storage,
        name: str,
        staging: str,
        snap: Snapshot | None = None,
        ident: str | None = None,
        base: "sharing.Base | None | Literal[False]" = False,
    ) -> "tuple[sharing.Sharer | None, tuple[str, sharing.Base | None] | None]":
        """(the raw serializer's share hook, (this save's id, its base)) of a save of step folder ``name``
        when this layout shares (a manager's native steps, the raw serializer: sharing.enable), else
        (None, None). Without a base step (the run's first save, or an unreadable newest step) the
        hook is None but the save still records its id, so that the next one may refer to it. ``snap``:
        the save's snapshot, whose shards found equal to its arena's bytes are the base's chunks when
        the base is the step that wrote those bytes (``Snapshot.since``). ``ident``: the save's id when
        its processes agreed on one (_persist_shared), else this save's own (``sharing.save_id``).
        ``base``: the base step its processes agreed on (None: none), else (False) the newest one."""
        ident = sharing.save_id(staging, parent) if ident is None else ident
        if not self.share or ident is None or not isinstance(self.serializer, raw.RawSerializer):
            return None, None
        if base is False:
            # one process (several agree on one, _persist_shared): the newest step, or the one it
            # restored; its records as this layout kept them when this layout committed it
            base = sharing.newest_base(parent, name, self._base, self.resumed_from, self.avoid)
        self.resumed_from = None
        # a subclass's own write takes no share hook: it writes all (its steps may still be referred to)
        hook = type(self.serializer).write is raw.RawSerializer.write
        kept = (
            snap.unchanged
            if snap is not None and base is not None and snap.since == (base.name, base.id)
            else None
        )
        sharer = (
            None
            if base is None or not hook
            else sharing.Sharer(base, parent, raw.BLOCK, kept, self.suspect, self.trust)
        )
        return sharer, (ident, base)

    def _committed(
        self,
        snap: Snapshot,
        parent: Storage,
        name: str,
        written: Written,
        shares: "tuple[str, sharing.Base | None] | None",
        sharer: "sharing.Sharer | None",
    ) -> None:
        """Keeps the step just committed as the next save's base (its records as written, no re-read)."""
        self.shared_bytes = 0 if sharer is None else sharer.shared
        if shares is None:  # a manifest without an id, referring to nothing: retention need not read it
            sharing.remember(parent, name, None, {})
            return
        self.trust.wrote(parent, name, shares[0], written.files)  # its own files: shared without a read
        arena = snap.arena
        if arena is not None and arena.fills == snap.fill and snap.checksum == raw.BLOCK:
            arena.saved_as = (name, shares[0])  # what the arena holds is this step's bytes
        base = shares[1]
        # a save that shared nothing names no other step's file
        shared = (sharing.shared_head(written.chunks, base) if self.shared_bytes else None) or {}
        sharing.remember(parent, name, shares[0], {step: held["id"] for step, held in shared.items()})
        self._base = sharing.Base(  # as Base.from_body reads it from the manifest
            name,
            shares[0],
            [lf.record.name if lf.record.is_array else None for lf in snap.leaves],
            written.chunks,
            *sharing.held_files(name, written.files, shared),
        )

    def open(self, folder: Storage, item: str | None = None) -> "NativeSource":
        if item is not None:
            raise TargetMismatchError(
                f"{folder.url} is a native flax_ckpt checkpoint, one tree without items; item={item!r} selects an "
                "item of an Orbax step saved with named items (args.Composite). Restore it without item="
            )
        return open_native(folder, step=self.step, serializer=self.serializer)

    def metrics(self, folder: Storage) -> dict[str, Any] | None:
        return open_native(folder, step=self.step, serializer=self.serializer).metrics

    recycles = True  # a removed step's data files: whole files the raw serializer may write again
    shares = True  # unchanged chunks refer to an earlier step's files (native/sharing.py)

    def recycler(self, storage: Storage) -> Recycler | None:
        """The raw serializer writes whole files, so on a local file system a removed step's data files
        become the next save's (``storage.recycler``, which the folders below it share); None otherwise."""
        if not isinstance(storage, LocalStorage) or not isinstance(self.serializer, raw.RawSerializer):
            return None
        storage.recycler = Recycler(storage.local_path)
        return storage.recycler

    def follow(self, root: Storage, newest: str | None) -> None:
        """Native steps are alike: nothing of an earlier step to follow."""

    def check_items(self, tree: Any) -> None:
        """A native step is one tree: any tree fits (the snapshot refuses what it cannot store)."""


def _persist_shared(
    snap: Snapshot,
    parent: Storage,
    name: str,
    serializer: Serializer,
    *,
    step: int | None,
    metrics: dict | None,
    metadata: Any,
    layout: NativeLayout | None = None,
) -> PersistTimes:
    """persist() across processes: process 0 names the staging folder, each process writes its own
    shards there (files tagged p<i>) and publishes its chunk records, process 0 merges them into the
    manifest and commits; the others return once the commit is announced (distributed.SaveRound).
    Leaves a process holds no shard of are skipped; host values (numpy leaves) are written by process
    0 alone. ``layout``: the run's, when its steps share bytes: each process compares only its own
    shards with the base step (the one process 0 chose and published with the staging folder's name:
    a process that cannot read it writes all its shards), and process 0 lists the
    files of other steps that the merged records name."""
    times, rnd = PersistTimes(), distributed.SaveRound.begin(parent, name)

    chosen: list[sharing.Base | None] = [None]  # process 0's base step, as it read it

    def start() -> dict[str, Any]:
        staging = commit_mod.staging_name(parent, name, record=MANIFEST)
        # one id for every process: the manifest's, and in its data files' names on an object store;
        # one base step for every process: the one process 0 chose (each reads it; none if it cannot)
        if layout is not None and layout.share:
            chosen[0] = sharing.newest_base(parent, name, None, layout.resumed_from, layout.avoid)
        base = chosen[0]
        return {
            "staging": staging,
            "id": sharing.save_id(staging, parent),
            "base": None if base is None else [base.name, base.id],
        }

    agreed = rnd.agree(start)
    staging = agreed["staging"]
    stage, digest = parent.sub(staging), distributed.tree_digest([lf.record for lf in snap.leaves])
    items = [
        it
        for it in snap.items()
        if it.shards and (rnd.index == 0 or snap.leaves[it.leaf].record.sharding is not None)
    ]
    try:
        t0 = time.perf_counter()
        sharer, shares = (
            (None, None)
            if layout is None
            else layout._sharer(
                parent,
                name,
                staging,
                ident=agreed["id"],
                base=chosen[0] if rnd.index == 0 else sharing.base_named(parent, agreed["base"]),
            )
        )
        writer = serializer if sharer is None else cast(Serializer, sharing.Sharing(serializer, sharer))
        tag = f"p{rnd.index}" if shares is None else sharing.file_tag(f"p{rnd.index}", parent, shares)
        written = (
            write_streamed(writer, stage, snap, items, tag=tag)
            if isinstance(snap, Streamed)
            else writer.write(stage, items, tag=tag)
        )
        t1 = time.perf_counter()
        if rnd.index:
            rnd.publish(stage, written, digest)
            rnd.await_commit()
            if shares is not None and layout is not None:  # its own files: shared without a read
                layout.trust.wrote(parent, name, shares[0], written.files)
        else:
            parts = rnd.gather(stage, written, digest)
            data = manifest_bytes(
                snap,
                parts,
                serializer,
                step=step,
                metrics=metrics,
                metadata=metadata,
                process_count=rnd.count,
                shares=shares,
            )
            body = decode(data, f"{stage.url}/{MANIFEST}")  # the merged chunks must tile every array
            commit_mod.commit(parent, staging, name, MANIFEST, data)  # exactly
            # what retention reads of a kept step, from the body just decoded (not read back at each save)
            sharing.remember(parent, name, *sharing.head_of(body))
            if shares is not None and layout is not None:
                layout.trust.wrote(parent, name, shares[0], written.files)
            rnd.announce()
        times.write, times.commit = t1 - t0, time.perf_counter() - t1
        times.fsync, times.serialize, times.written = written.fsync_s, written.serialize_s, written.nbytes
    except BaseException as e:
        rnd.fail(e)
        if rnd.index == 0:
            sharing.abort(parent, staging, MANIFEST)
        raise
    return times


# ------------------------------------------------------------------------------------------- restore


class NativeSource:
    """One committed native checkpoint folder, its manifest verified and validated: a restore Source."""

    hint = ""

    def __init__(
        self, storage: Storage, body: dict[str, Any], leaves: list[LeafRecord], serializer: Serializer
    ):
        self.storage, self.body, self.leaves, self.serializer = storage, body, leaves, serializer
        self.url, self.where = storage.url, f"{storage.url}/{MANIFEST}"
        self.remote = not storage.supports_rename
        shared = body.get("shared") or {}
        # what the serializer reads through: the folder, or with bytes of other steps (sharing.py) a view
        # that finds those too
        self.files: Storage = (
            cast(Storage, sharing.RunFiles(storage, {s: h["id"] for s, h in shared.items()}))
            if shared
            else storage
        )

    @property
    def budget(self) -> int | None:
        """A restore allocates at most twice the bytes the folder stores (plus _BUDGET_SLACK, so that a
        merely truncated file reaches the serializer, whose error names it). Asking walks the folder
        once, refusing links out of it and special files before anything is read."""
        stored = self.files.stored_bytes()
        return None if stored is None else 2 * stored + _BUDGET_SLACK

    def read(self, leaf: LeafRecord, box: Box, out: np.ndarray) -> None:
        try:
            self.serializer.read(self.files, stored(leaf), box, out, f"{self.where} leaf {leaf.name!r}")
        except CorruptCheckpointError as e:
            if not self.storage.exists(MANIFEST):
                raise CheckpointNotFoundError(
                    f"{self.storage.url} was deleted while it was being read (by the "
                    "retention of a running CheckpointManager?)"
                ) from e
            raise

    def read_many(self, requests: Sequence[tuple[LeafRecord, Box, np.ndarray]]) -> None:
        try:
            # array records, as stored() says
            self.serializer.read_many(
                self.files, cast("Sequence[tuple[StoredArray, Box, np.ndarray]]", requests), self.where
            )
        except CorruptCheckpointError as e:
            if not self.storage.exists(MANIFEST):
                raise CheckpointNotFoundError(
                    f"{self.storage.url} was deleted while it was being read (by the "
                    "retention of a running CheckpointManager?)"
                ) from e
            raise

    def view(self, leaf: LeafRecord, box: Box) -> np.ndarray | None:
        return self.serializer.view(self.files, stored(leaf), box, f"{self.where} leaf {leaf.name!r}")

    def select(self, target: Any) -> tuple["NativeSource", Any]:
        return self, target

    def unchecked(self) -> list[str]:
        return []  # every chunk carries crc32c checksums (the serializers')

    def verify(self, update: Callable[[int], None]) -> list[Damage]:
        """Checks every file's size against the manifest, then reads every chunk of every array leaf by
        itself through the serializer, so that one damaged file or chunk never hides another."""
        found = list(self._check_sizes())
        for leaf in self.leaves:
            if leaf.is_array:
                found += self._verify_leaf(leaf, update)
        return found

    def _check_sizes(self) -> list[Damage]:
        found = []
        for fname, size in sorted(all_files(self.body).items()):
            try:
                self.files.check_size(fname, size)
            except (CorruptCheckpointError, StorageError, OSError) as e:
                found.append(Damage(None, fname, str(e)))
        return found

    def _verify_leaf(self, leaf: LeafRecord, update: Callable[[int], None]) -> list[Damage]:
        """One Damage per damaged file of the leaf (the first failure's message, with the count of
        damaged chunks when there are several)."""
        failures: dict[str | None, list[str]] = {}
        for chunk in leaf.chunks:
            box = tuple(tuple(x) for x in chunk["index"])
            extents = tuple(e - s for s, e in box)
            if math.prod(extents) == 0 and extents:
                continue
            out = np.empty(extents, leaf.dtype)
            try:
                self.serializer.read(
                    self.files,
                    stored(leaf.with_chunks([chunk])),
                    box,
                    out,
                    f"{self.storage.url} leaf {leaf.name!r}",
                )
            except (CorruptCheckpointError, StorageError, OSError) as e:
                failures.setdefault(self.chunk_file(chunk), []).append(str(e))
            update(out.nbytes)
        return [
            Damage(
                leaf.name,
                f,
                msgs[0]
                + (
                    f" (and {len(msgs) - 1} more damaged chunks of this leaf in {f})" if len(msgs) > 1 else ""
                ),
            )
            for f, msgs in failures.items()
        ]

    @staticmethod
    def chunk_file(chunk: dict[str, Any]) -> str | None:
        """The stored object a chunk record names, relative to the folder: the raw serializer's ``file``,
        a zarr3 cell ``<array>/<key>``; None for a record naming neither."""
        if "file" in chunk:
            return chunk["file"]
        return f"{chunk['array']}/{chunk['key']}" if "array" in chunk and "key" in chunk else None

    @property
    def step(self) -> int | None:
        return self.body.get("step")

    @property
    def metrics(self) -> dict[str, Any] | None:
        return self.body.get("metrics")

    def info(self) -> CheckpointInfo:
        b = self.body
        return checkpoint_info(
            self.storage.url,
            self.leaves,
            step=b.get("step"),
            metrics=b.get("metrics"),
            metadata=b.get("metadata"),
            created=b["created"],
            process_count=b["process_count"],
            serializer=b["serializer"],
            format="native",
        )


def all_files(body: dict[str, Any]) -> dict[str, int]:
    """The files a manifest's chunks may name, with their sizes: its own, and those of the steps it shares
    bytes with as ``../<step>/<file>`` (native/sharing.py)."""
    shared = body.get("shared")
    if not shared:
        return body["files"]
    out = dict(body["files"])
    for step, held in shared.items():
        out.update({f"../{step}/{f}": n for f, n in held["files"].items()})
    return out


def open_native(
    storage: Storage, *, step: int | None = None, serializer: Serializer | None = None
) -> NativeSource:
    """The committed native checkpoint in folder ``storage``: CheckpointNotFoundError when there is none,
    CheckpointNotCommittedError for a folder without a manifest (a save in flight, or one that
    crashed), InvalidManifestError for a manifest that fails verification or validation. ``step``: a
    run's step folder, named by its step: a manifest recording another step is InvalidManifestError (a
    step folder copied or renamed to another step's name). A manifest without a step (``fc.save``
    without ``step=``) is accepted under any name, and a checkpoint opened alone is never checked.
    ``serializer``: the instance to read with when the manifest names it (a user serializer passed to
    fc.restore or a manager); other names are looked up (serializers.get_serializer)."""
    source = _open_native(storage, serializer)
    found = source.body.get("step")
    if step is not None and found is not None and found != step:
        raise InvalidManifestError(
            f"the folder name says step {step} but its manifest says step {found}: {source.where} (a step folder "
            f"copied or renamed to another step's name?) is not restored as step {step}. Move it out of the run "
            f"directory (or rename it {found} if that step is missing); fc.restore reads it alone"
        )
    return source


@gc_paused()
def _open_native(storage: Storage, given: Serializer | None = None) -> NativeSource:
    if commit_mod.is_temporary(storage.url.rstrip("/").rsplit("/", 1)[-1]):
        raise CheckpointNotCommittedError(
            f"{storage.url} is the folder of a save in flight or one that crashed; it is never read"
        )
    if sharing.is_held(storage.url.rstrip("/").rsplit("/", 1)[-1]):
        raise CheckpointNotCommittedError(
            f"{storage.url} is a removed step's folder, kept for the bytes later steps of its run share "
            "(docs/design.md); it is never read as a checkpoint"
        )
    where = f"{storage.url}/{MANIFEST}"
    try:
        raw = storage.read(MANIFEST, checks.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        kind = storage.kind()
        if kind == "missing":
            raise CheckpointNotFoundError(
                f"no checkpoint at {storage.url}"
                + (" (the path does not exist)" if storage.supports_rename else "")
            ) from None
        if kind == "file":
            raise CheckpointNotFoundError(f"{storage.url} is a file, not a checkpoint folder") from None
        steps = sorted(n for n in map(commit_mod.step_number, storage.list()) if n is not None)
        if steps:
            shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
            raise CheckpointNotFoundError(
                f"{storage.url} is a directory of steps [{shown}], not one checkpoint: pass one of them (e.g. "
                f"{storage.url.rstrip('/')}/{steps[-1]}), or restore the newest with "
                f"fc.CheckpointManager({storage.url!r}).restore(target)"
            ) from None
        raise CheckpointNotCommittedError(
            f"{storage.url} holds no committed checkpoint (no {MANIFEST}: a save in flight or one that "
            "crashed); it is never read"
        ) from None
    body, leaves = decode_records(raw, where)  # the body without its leaves: their records
    del raw
    try:
        serializer = serializer_for(body["serializer"], given)
    except ValueError as e:
        raise InvalidManifestError(f"{where}: field body.serializer: {e}") from None
    files = all_files(body)
    for i, leaf in enumerate(leaves):
        if leaf.is_array:
            serializer.validate(stored(leaf), files, f"{where}: leaves[{i}] ({leaf.name})")
        if leaf.kind == "prng_key":
            shape = key_data_shape(leaf.key_impl)
            if shape is None:
                raise InvalidManifestError(
                    f"{where}: field leaves[{i}].key_impl: unknown PRNG implementation {leaf.key_impl!r}"
                )
            if leaf.key_shape != shape:
                raise InvalidManifestError(
                    f"{where}: field leaves[{i}].key_shape: {list(leaf.key_shape or ())} is not "
                    f"the key data shape of {leaf.key_impl!r}"
                )
    return NativeSource(storage, body, leaves, serializer)


__all__ = ["NativeLayout", "NativeSource", "manifest_bytes", "open_native"]
