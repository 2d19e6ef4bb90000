"""The architecture as the code shows it: public faces, layers, no import circle, a short save path."""

from __future__ import annotations

import ast
import pathlib
import threading
import traceback

import numpy as np

import flax_ckpt as fc
import flax_ckpt.callbacks
from flax_ckpt._src.storage.local import LocalStorage

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Lower layers never import higher ones (a module may import its own rank and below).
RANKS = {
    "flax_ckpt._src.errors": 0,
    "flax_ckpt._src.lazy": 0,  # heavy imports (jax, tensorstore) on first use
    "flax_ckpt._src.records": 1,
    "flax_ckpt._src.checks": 1,
    "flax_ckpt._src.tree": 1,
    "flax_ckpt._src.window": 1,  # a bounded list of the newest records, with totals
    "flax_ckpt._src.storage": 1,
    "flax_ckpt._src.serializers": 2,
    "flax_ckpt._src.commit": 3,  # the commit and the multi-process agreement (commit/distributed.py)
    "flax_ckpt._src.engine": 4,
    "flax_ckpt._src.native": 5,
    "flax_ckpt._src.orbax": 5,
    "flax_ckpt._src.tiers": 5,  # the layouts, peers
    "flax_ckpt._src.foreign": 5,  # other libraries' files, read only: legacy Flax msgpack, safetensors
    "flax_ckpt._src.layouts": 6,
    "flax_ckpt._src.api": 6,
    "flax_ckpt._src.compile_cache": 6,  # a run's JAX compilation cache (over storage)
    "flax_ckpt._src.cache_folder": 6,  # the compilation cache's folder: its marker, names and owner
    "flax_ckpt._src.retention": 6,
    "flax_ckpt._src.manager": 7,
    "flax_ckpt._src.tools": 8,
    "flax_ckpt._src.tools.cli": 9,
    "flax_ckpt": 10,
    "flax_ckpt.__main__": 10,
    "flax_ckpt.callbacks": 11,  # the repository's callbacks/ folder (pyproject maps it into the package)
}
PACKAGES = {"flax_ckpt": ROOT / "flax_ckpt", "flax_ckpt.callbacks": ROOT / "callbacks"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = package.split(".") + list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(path: pathlib.Path, name: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """Every module of ours that ``path`` imports, at any depth (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules}


def _rank(module: str) -> int:
    best = max((k for k in RANKS if module == k or module.startswith(k + ".")), key=len)
    return RANKS[best]


def test_public_faces_list_only_the_api():
    assert dir(fc) == sorted(fc.__all__ + ["__version__"])
    assert not any(name.startswith("_") and name != "__version__" for name in dir(fc))
    assert dir(flax_ckpt.callbacks) == sorted(flax_ckpt.callbacks.__all__)
    assert pathlib.Path(flax_ckpt.callbacks.__file__).resolve() == ROOT / "callbacks" / "__init__.py"


def test_layers_and_no_import_circle():
    modules = _modules()
    graph = {m: _imports(p, m, modules) - {m} for m, p in modules.items()}
    upward = [
        f"{m} (layer {_rank(m)}) imports {d} (layer {_rank(d)})"
        for m, deps in graph.items()
        for d in deps
        if _rank(d) > _rank(m)
    ]
    assert not upward, upward
    private = [
        m
        for m, deps in graph.items()
        if m.startswith("flax_ckpt.callbacks")
        for d in deps
        if d.startswith("flax_ckpt._src")
    ]
    assert not private, f"callbacks must use flax_ckpt's public API only: {private}"
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if d.startswith(m + "."):  # a package importing its own submodules is not a circle
                continue
            assert state.get(d) != 1, "import circle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_jax_private_api_is_touched_in_one_function_a_module():
    # commit/distributed.py: the coordination service's client; compile_cache.py: installing a cache
    hits = [
        (p.relative_to(ROOT), i)
        for p in (ROOT / "flax_ckpt").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "jax._src" in line and not line.lstrip().startswith(("#", '"', "this", "JAX", "has"))
    ]
    assert sorted(str(p) for p, _ in hits) == [
        str(pathlib.Path("flax_ckpt/_src/commit/distributed.py")),
        str(pathlib.Path("flax_ckpt/_src/compile_cache.py")),
    ], hits


def test_save_path_from_manager_to_file_write_is_six_calls(tmp_path, monkeypatch):
    stacks = []
    real = LocalStorage.write

    def write(self, name, buffers):
        if name.startswith("data/"):
            stacks.append((threading.current_thread().name, traceback.extract_stack()))
        return real(self, name, buffers)

    monkeypatch.setattr(LocalStorage, "write", write)
    with fc.CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        mgr.save(1, {"w": np.ones(4, np.float32)})
    ((_, stack),) = stacks
    ours = [f.name for f in stack if "flax_ckpt" in f.filename and "/tests/" not in f.filename]
    # on the background writer: Directory.save (the manager's store) -> NativeLayout.persist ->
    # RawSerializer.write -> its per-file write -> LocalStorage.write; CheckpointManager.save and
    # AsyncWriter.submit ran on the caller's thread
    assert ours == ["save", "persist", "write", "write_file"], ours


def test_the_tiers_import_nothing_of_the_manager():
    """The memory tiers hold the run directory through tiers.Persistent; the manager composes them."""
    modules = _modules()
    tiers = {m: _imports(p, m, modules) for m, p in modules.items() if m.startswith("flax_ckpt._src.tiers")}
    assert len(tiers) > 5
    upward = sorted(
        f"{m} imports {d}"
        for m, deps in tiers.items()
        for d in deps
        if d.startswith("flax_ckpt._src.manager")
    )
    assert not upward, upward


def test_the_manager_has_one_path_through_one_store():
    """CheckpointManager asks its store (manager/store.py), never which store it is: no branch on the
    tiers, no back-call adapter, thread-local or weak reference for them, no thread started at its end."""
    path = ROOT / "flax_ckpt" / "_src" / "manager" / "manager.py"
    tree = ast.parse(path.read_text())
    manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager")
    branches = [
        ast.unparse(n.test)
        for n in ast.walk(manager)
        if isinstance(n, (ast.If, ast.IfExp))
        if any(
            isinstance(x, ast.Attribute) and "tier" in x.attr and ast.unparse(x.value) == "self"
            for x in ast.walk(n.test)
        )
    ]
    assert branches == [], f"the manager branches on its tiers: {branches}"
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }
    assert not names & {"local", "Thread", "_Directory", "ref"}, names & {
        "local",
        "Thread",
        "_Directory",
        "ref",
    }
    private = sorted(
        {
            f"{ast.unparse(n.value)}.{n.attr}"
            for n in ast.walk(manager)
            if isinstance(n, ast.Attribute)
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
            and isinstance(n.value, ast.Attribute)
        }
    )
    assert private == [], f"the manager reaches into its parts' private members: {private}"


def test_both_stores_implement_the_whole_store_protocol():
    """The run directory and the memory tiers are a manager's two stores: each has every member of
    manager/store.Store; the directory is also all that the tiers ask of it (tiers.Persistent)."""
    from flax_ckpt._src.manager.directory import Directory
    from flax_ckpt._src.manager.store import Store
    from flax_ckpt._src.tiers import Persistent
    from flax_ckpt._src.tiers.tierset import TierSet

    def members(protocol: type) -> set[str]:
        return {n for n in vars(protocol) if not n.startswith("_")} | set(
            getattr(protocol, "__annotations__", {})
        )

    assert {"admit", "snapshot", "save", "flush", "restore", "steps", "close"} <= members(Store)
    for cls, protocol in ((Directory, Store), (TierSet, Store), (Directory, Persistent)):
        missing = sorted(m for m in members(protocol) if not hasattr(cls, m) and m not in _assigned(cls))
        assert not missing, f"{cls.__name__} lacks {missing} of {protocol.__name__}"


def _assigned(cls: type) -> set[str]:
    """The attributes ``cls``'s methods assign on ``self``."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    }
