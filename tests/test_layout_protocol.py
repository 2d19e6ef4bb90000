"""Formats as peers (issue 21): the tools and the public functions ask a checkpoint's Layout and Source
(``unchecked``, ``verify``, ``manifest``, ``evident``, ``foreign``, ``record``), never its type or its
format's name; every Source and Layout implements the whole protocol; and ``fc.save(..., format="orbax",
step=...)`` records the step where Orbax's layout has room for it (a step folder's name) or refuses.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import flax_ckpt as fc
from flax_ckpt._src import layouts
from flax_ckpt._src.engine.reader import Damage, Source
from flax_ckpt._src.foreign.layout import FlaxMsgpackLayout, SafetensorsLayout
from flax_ckpt._src.native.layout import NativeLayout, NativeSource
from flax_ckpt._src.orbax.layout import OrbaxLayout
from flax_ckpt._src.orbax.read import OrbaxSource
from flax_ckpt._src.storage import open_storage
from flax_ckpt._src.tiers.load import CopySource

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "flax_ckpt" / "_src"
SOURCES = {"NativeSource", "OrbaxSource", "CopySource", "Source"}
ASKERS = sorted((SRC / "tools").glob("*.py")) + [SRC / "api.py"]
# the manager and the memory tiers too: whatever depends on the format is a member of layouts.Layout
RUNNERS = sorted((SRC / "manager").glob("*.py")) + sorted((SRC / "tiers").glob("*.py"))
SERIALIZERS = {"raw", "zarr3"}
NAMED = {"name", "format", "fmt"}  # what holds a format's (or a serializer's) name


def _inspections(path: pathlib.Path, *, wide: bool = False) -> list[str]:
    """``isinstance(x, <a Source class>)``, ``<x>.name == "<format>"`` (or ``!=``) and imports of the
    Source classes in one module, as "file:line: code". ``wide`` (the manager and the tiers): also
    ``isinstance(x, LocalStorage)``, a serializer's name, and a format's name held as ``format``,
    ``fmt`` or ``getattr(x, "name")``; the Source protocol itself may be imported."""
    sources = SOURCES - {"Source"} if wide else SOURCES
    named_as = NAMED if wide else {"name"}
    constants = {*layouts.FORMATS, *SERIALIZERS} if wide else set(layouts.FORMATS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        bad = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = (
                {
                    n.id if isinstance(n, ast.Name) else n.attr
                    for n in ast.walk(node.args[1])
                    if isinstance(n, (ast.Name, ast.Attribute))
                }
                if len(node.args) == 2
                else set()
            )
            bad = bool(names & (sources | ({"LocalStorage"} if wide else set())))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(_holds_a_name(s, named_as, wide) for s in sides)
            bad = named and any(isinstance(s, ast.Constant) and s.value in constants for s in sides)
        elif isinstance(node, ast.ImportFrom):
            bad = bool({a.name for a in node.names} & sources)
        if bad:
            found.append(
                f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno}: "
                f"{ast.unparse(node)}"
            )
    return found


def _holds_a_name(node: ast.expr, named_as: set[str], wide: bool) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in named_as
    if isinstance(node, ast.Name):
        return wide and node.id in named_as
    return (
        wide
        and isinstance(node, ast.Call)
        and ast.unparse(node.func) == "getattr"
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "name"
    )


def test_tools_and_api_ask_the_layout_and_source_never_inspect_them():
    found = [hit for path in ASKERS for hit in _inspections(path)]
    assert not found, (
        "a tool or fc.save/restore inspects a source's type or a format's name; add the "
        "question to the Source or Layout protocol instead:\n" + "\n".join(found)
    )


def test_the_manager_and_the_tiers_ask_the_layout_never_a_format_name():
    found = [hit for path in RUNNERS for hit in _inspections(path, wide=True)]
    assert len(RUNNERS) > 10 and not found, (
        "the manager or the tiers compare a format's or serializer's name, or the storage's kind; add the "
        "question to layouts.Layout instead:\n" + "\n".join(found)
    )


def test_the_inspection_check_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from x import OrbaxSource, Source\nif fmt.name == 'native' or isinstance(s, (NativeSource, int)):\n"
        "    pass\nif f.layout.name != \"orbax\":\n    pass\nif e.name == 'native-ish':\n    pass\n"
        "if self.format == 'orbax' and isinstance(st, LocalStorage):\n    pass\n"
        "if getattr(self.layout.serializer, 'name', None) == 'raw' or fmt != 'native':\n    pass\n"
    )
    hits = sorted(hit.split(": ", 1)[1] for hit in _inspections(bad, wide=True))
    assert hits == [
        "f.layout.name != 'orbax'",
        "fmt != 'native'",
        "fmt.name == 'native'",
        "from x import OrbaxSource, Source",
        "getattr(self.layout.serializer, 'name', None) == 'raw'",
        "isinstance(s, (NativeSource, int))",
        "isinstance(st, LocalStorage)",
        "self.format == 'orbax'",
    ]


def _members(protocol: type) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")}
    return names | set(getattr(protocol, "__annotations__", {}))


TREE = {"w": np.arange(64, dtype=np.float32), "s": "text", "k": 3}


def _memory_copy(folder: pathlib.Path) -> CopySource:
    from flax_ckpt._src.tiers import encode as tier_encode
    from flax_ckpt._src.tiers import store as tier_store

    snap = tier_store.take_snapshot(
        {"w": TREE["w"]}, copy=True, force=False, step=2, seen=tier_store.Seen(), base=None
    )
    ident = {"step": 2, "session": "s", "process": 0, "process_count": 1}
    tier_store.write_copy(str(folder), 2, tier_encode.encode(snap, ident, None, delta=False))
    return CopySource(tier_store.open_copy(str(folder / "2")))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Source]:
    root = tmp_path_factory.mktemp("sources")
    fc.save(root / "native", TREE)
    fc.save(root / "orbax", TREE, format="orbax")
    return {
        "native": layouts.open_checkpoint(open_storage(root / "native")),
        "orbax": layouts.open_checkpoint(open_storage(root / "orbax")),
        "memory": _memory_copy(root / "memory"),
    }


@pytest.mark.parametrize(
    "kind,cls", [("native", NativeSource), ("orbax", OrbaxSource), ("memory", CopySource)]
)
def test_every_source_implements_the_whole_source_protocol(sources, kind, cls):
    source = sources[kind]
    assert type(source) is cls
    missing = sorted(m for m in _members(Source) if not hasattr(source, m))
    assert not missing, f"{cls.__name__} lacks {missing} of engine.reader.Source"
    seen: list[int] = []
    assert source.verify(seen.append) == [] and source.unchecked() == []  # flax_ckpt checksums every byte
    assert sum(seen) == sum(leaf.nbytes for leaf in source.leaves if leaf.is_array) >= TREE["w"].nbytes


@pytest.mark.parametrize(
    "layout", [NativeLayout(None), OrbaxLayout(), FlaxMsgpackLayout(), SafetensorsLayout()]
)
def test_every_layout_implements_the_whole_layout_protocol(layout):
    missing = sorted(m for m in _members(layouts.Layout) if not hasattr(layout, m))
    assert not missing, f"{type(layout).__name__} lacks {missing} of layouts.Layout"
    methods = [m for m, v in vars(layouts.Layout).items() if inspect.isfunction(v) and not m.startswith("_")]
    shadowed = sorted(m for m in methods if not callable(getattr(layout, m)))  # an attribute of that name
    assert not shadowed, f"{type(layout).__name__}'s {shadowed} are not the methods of layouts.Layout"


def test_native_verify_names_the_damaged_leaf_and_file(tmp_path):
    fc.save(tmp_path / "n", TREE)
    data = next(p for p in (tmp_path / "n").rglob("*") if p.is_file() and p.name != "manifest.json")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    [d] = layouts.open_checkpoint(open_storage(tmp_path / "n")).verify(lambda n: None)
    assert isinstance(d, Damage) and d.leaf == "w" and d.file == str(data.relative_to(tmp_path / "n"))
    assert "checksum mismatch" in d.message


# ------------------------------------------------------------------- fc.save(format="orbax", step=)


def test_orbax_save_with_a_step_is_a_step_folder_named_for_it(tmp_path):
    tree = {"w": np.arange(6, dtype=np.float32), "b": np.ones(2, np.int32)}
    run = tmp_path / "run"
    fc.save(run / "5", tree, format="orbax", step=5, metrics={"loss": 0.5}, metadata={"lr": 1e-3})
    fc.save(run / "7", tree, format="orbax", step=7)
    info = fc.metadata(run / "5")
    assert (info.step, info.metrics, info.metadata, info.format) == (5, {"loss": 0.5}, {"lr": 1e-3}, "orbax")
    assert fc.metadata(run / "7").step == 7
    np.testing.assert_array_equal(fc.restore(run / "5")["w"], tree["w"])
    with fc.CheckpointManager(run) as mgr:  # a run of Orbax steps, as a manager sees it
        assert mgr.all_steps() == [5, 7] and mgr.latest_step() == 7
    fc.save(tmp_path / "ckpt_000009", tree, format="orbax", step=9)  # Orbax's step_prefix naming
    assert fc.metadata(tmp_path / "ckpt_000009").step == 9
    fc.save(tmp_path / "alone", tree, format="orbax")  # no step: a StandardCheckpointer folder, as before
    assert fc.metadata(tmp_path / "alone").step is None and not (tmp_path / "alone" / "default").exists()


def test_orbax_manager_lists_and_restores_a_step_saved_by_fc_save(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tree = {"w": np.arange(6, dtype=np.float32)}
    fc.save(tmp_path / "3", tree, format="orbax", step=3, metrics={"loss": 0.25})
    with ocp.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [3]
        np.testing.assert_array_equal(mgr.restore(3)["w"], tree["w"])


def test_orbax_save_refuses_a_step_its_folder_name_does_not_carry(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"'final' does not name step 5; nothing was written\. Save step 5 as "
        r".*/5 \(or <prefix>_5\), or use fc\.CheckpointManager\(directory, "
        r"format='orbax'\)",
    ):
        fc.save(tmp_path / "final", {"w": np.ones(3)}, format="orbax", step=5)
    with pytest.raises(ValueError, match="does not name step 5"):
        fc.save(tmp_path / "6", {"w": np.ones(3)}, format="orbax", step=5)
    assert os.listdir(tmp_path) == []
    fc.save(tmp_path / "final", {"w": np.ones(3)}, format="native", step=5)  # the native manifest records it
    assert fc.metadata(tmp_path / "final").step == 5


def test_ls_shows_an_orbax_step_saved_by_fc_save(tmp_path):
    fc.save(tmp_path / "4", {"w": np.ones(3)}, format="orbax", step=4, metrics={"loss": 1.0})
    r = subprocess.run(
        [sys.executable, "-m", "flax_ckpt", "ls", "--json", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    [entry] = json.loads(r.stdout)["steps"]
    assert (entry["step"], entry["state"], entry["format"]) == (4, "committed", "orbax")
    assert entry["metrics"] == {"loss": 1.0}


def test_orbax_save_without_a_step_keeps_its_metrics_where_orbax_does(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    fc.save(tmp_path / "ck", {"w": np.arange(3.0)}, format="orbax", metrics={"loss": 0.5})
    assert fc.metadata(tmp_path / "ck").metrics == {"loss": 0.5}
    meta = json.loads((tmp_path / "ck" / "_CHECKPOINT_METADATA").read_text())
    assert meta["metrics"] == {"loss": 0.5}  # the field Orbax's StepMetadata reads
    np.testing.assert_array_equal(ocp.StandardCheckpointer().restore(tmp_path / "ck")["w"], np.arange(3.0))


# ------------------------------------------------------------------- the manager asks its layout


def test_a_manager_takes_its_spare_files_from_its_layout(tmp_path, monkeypatch):
    """The run's layout decides whether a removed step's data files serve the next save
    (Layout.recycler): native steps written whole by the raw serializer on a local disk do; zarr3,
    Orbax steps and a read-only manager do not. A layout that declines (monkeypatched) gets none, and
    retention then deletes the files, as the manager asks nothing else."""
    from flax_ckpt._src.commit.recycler import Recycler

    tree = {"w": np.arange(1 << 18, dtype=np.float32)}
    with fc.CheckpointManager(tmp_path / "raw", max_to_keep=1) as mgr:
        assert isinstance(mgr.storage.recycler, Recycler)
        for step in (1, 2):  # every byte changed: step 2 shares nothing of step 1's (native/sharing.py)
            mgr.save(step, {"w": tree["w"] + step})
            mgr.wait_until_finished()
        assert mgr.storage.recycler._files  # step 1's data file, kept for the next save
    with fc.CheckpointManager(tmp_path / "raw", read_only=True) as reader:
        assert reader.storage.recycler is None
    with fc.CheckpointManager(tmp_path / "zarr", serializer="zarr3") as mgr:
        assert mgr.storage.recycler is None
    fc.save(tmp_path / "orbax" / "1", tree, format="orbax", step=1)
    with fc.CheckpointManager(tmp_path / "orbax") as mgr:
        assert mgr.storage.recycler is None

    monkeypatch.setattr(NativeLayout, "recycler", lambda self, storage: None)
    with fc.CheckpointManager(tmp_path / "declined", max_to_keep=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": tree["w"] + step})
            mgr.wait_until_finished()
        assert mgr.storage.recycler is None and mgr.all_steps() == [2]
        assert sorted(os.listdir(tmp_path / "declined")) == [".flax_ckpt.lock", "2"]  # no folder of spares


def test_a_tiered_manager_needs_a_native_run(tmp_path):
    """layouts.run_format, the one place a run's format is decided, refuses tiers= for an Orbax run."""
    fc.save(tmp_path / "run" / "1", {"w": np.ones(3)}, format="orbax", step=1)
    with pytest.raises(ValueError, match=r"tiers= needs format='native'"):
        fc.CheckpointManager(tmp_path / "run", tiers=fc.Tiers(local_dir=str(tmp_path / "shm")))
    with fc.CheckpointManager(tmp_path / "run") as mgr:  # the failed open left nothing held
        assert mgr.all_steps() == [1]
