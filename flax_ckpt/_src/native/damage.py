"""A step a restore found damaged, for the run's later saves: never a base, and set aside when saved again.

Scope: ``damaged``: a step a restore found damaged (every process alike: the agreed restore's vote)
is never the base of a save again, no file it names is shared, and what its layout verified of the
run is forgotten (native/trust.py). ``set_aside``: a damaged step whose number is saved again, retired
where kept steps refer to it (``<step>.held-<id>``), moved aside or removed otherwise. ``own_id``: the
id of a step folder whose manifest is damaged, when its bytes still say it. Not here: the comparison
of a piece with its base's chunk (sharing.Sharer), deletion by reference (sharing.remove_step, sweep).
"""

from __future__ import annotations

import uuid
from typing import Any

from flax_ckpt._src.checks import MANIFEST, MAX_MANIFEST_BYTES
from flax_ckpt._src.commit.atomic import step_number
from flax_ckpt._src.errors import CheckpointError, StorageError
from flax_ckpt._src.native import sharing
from flax_ckpt._src.storage import Storage


def damaged(layout: Any, run: Storage, name: str) -> None:
    """A restore (agreed by every process) found step folder ``name`` of ``run`` damaged: it is never
    the base of a save of ``layout`` again, no file it names is shared, and nothing of the run is
    vouched for (the next save reads back each chunk it shares)."""
    if not getattr(layout, "share", False):
        return
    layout.trust.forget(run)
    try:
        body = sharing.committed_body(run, name)
    except (OSError, StorageError):
        body = None
    if not body:  # no manifest, or one that cannot be read: never a base (newest_base decodes it)
        return
    ident = body.get("id") if sharing.is_id(body.get("id")) else None
    layout.avoid.add((name, ident))
    layout.suspect.update((name, ident, f) for f in body["files"])
    for step, held in (body.get("shared") or {}).items():
        if isinstance(held, dict) and isinstance(held.get("files"), dict):
            layout.suspect.update((step, held.get("id"), f) for f in held["files"])


# ------------------------------------------------------------------------------------ set aside


def set_aside(run: Storage, name: str, record: str) -> str | None:
    """Makes way for a new save of step folder ``name``, damaged: retired (``<name>.held-<id>``; on an
    object store its hold written, its manifest deleted) when a committed step refers to its bytes, so
    that those steps stay readable and it is freed with the last of them. Otherwise a local folder is
    moved aside, and on an object store a step whose id is known is retired all the same (a restore's
    damage may have been a transient read: its objects are freed by a sweep, after the new save
    committed, never before), one whose id is not is removed (sparing what a hold keeps). Returns where
    it went: the retired name, None (removed), or the ``<name>.damaged-<hex>`` a local folder is to be
    moved to."""
    refs = sharing.referenced(run, gone=[name])
    wanted = None if refs is None else {i for s, i in refs if s == name}
    ident = own_id(run, name, wanted)
    needed = wanted is None or ident in wanted or not run.supports_rename
    if ident is not None and needed:
        if run.supports_rename:
            run.rename(name, sharing.held_name(name, ident))
            run.sync(tree=False)
        else:
            sharing.retire(run, name, record, ident, _files(run, name, ident))
        return sharing.held_name(name, ident)
    if not run.supports_rename:
        sharing.remove_folder(run, name, record)
        return None
    return f"{name}.damaged-{uuid.uuid4().hex[:8]}"  # the caller renames it


def own_id(run: Storage, name: str, wanted: set[str] | None) -> str | None:
    """The id of step folder ``name``: its manifest's; for a manifest that cannot be read, the one id
    of ``wanted`` (those kept steps record for it) that its manifest's bytes give before its leaves
    (where a manifest's own id stands: its fields are sorted, ``shared`` comes after ``leaves``) and
    whose retired folder does not exist already; on an object store, the one whose data objects (their
    names carry it) the kept steps name. None when it cannot be told."""
    ident = sharing.own_id(run, name)
    if ident is not None or not wanted:
        return ident
    if not run.supports_rename:
        found = [i for i in wanted if _files(run, name, i)]
        return found[0] if len(found) == 1 else None
    try:
        raw = run.sub(name).read(MANIFEST, MAX_MANIFEST_BYTES)
    except (OSError, CheckpointError):
        return None
    head = raw.split(b'"leaves":', 1)[0]
    found = [
        i
        for i in wanted
        if f'"id":"{i}"'.encode() in head and run.sub(sharing.held_name(name, i)).kind() == "missing"
    ]
    return found[0] if len(found) == 1 else None


def _files(run: Storage, name: str, ident: str) -> dict[str, int]:
    """The data files of step folder ``name``'s save ``ident``: its manifest's, else (a manifest that
    cannot be read, on an object store, where they carry the id) those the kept steps name."""
    body = sharing.committed_body(run, name)
    if body and body.get("id") == ident:
        return body["files"]
    out: dict[str, int] = {}
    for entry in run.list():
        if step_number(entry) is None or entry == name:
            continue
        held = (sharing.committed_body(run, entry) or {}).get("shared") or {}
        if isinstance(held.get(name), dict) and held[name].get("id") == ident:
            out.update({f: n for f, n in held[name]["files"].items() if ident in f})
    return out
