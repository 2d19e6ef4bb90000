"""Docstrings and comments name modules that exist: a file path (``tiers/store.py``, ``conftest.py``) or a
dotted name of ours (``flax_ckpt._src.engine.restore``, ``layouts.Layout``) in a docstring or comment of
flax_ckpt/, callbacks/, tests/ or benchmarks/ resolves to a file, and a retired module's name is not used.

Static only (nothing is imported): the text is read with ``ast`` (docstrings) and ``tokenize`` (comments).
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCANNED = ("flax_ckpt", "callbacks", "tests", "benchmarks")
# Where a path is looked up, besides the mentioning file's folder and the folders above it.
BASES = (
    "",
    "flax_ckpt/_src",
    "flax_ckpt",
    "callbacks",
    "tests",
    "tests/workers",
    "benchmarks",
    "examples",
    "scripts",
    "notebooks",
)
PACKAGES = {"flax_ckpt": ROOT / "flax_ckpt", "flax_ckpt.callbacks": ROOT / "callbacks"}  # pyproject's mapping

# Files of other projects (or of a user's project), named in our docstrings and comments; never ours.
FOREIGN = {
    "callbacks.py",  # a user's own callbacks.py, which the installed flax_ckpt.callbacks must not shadow
    "script.py",  # the user script tests/test_packaging.py writes to a temporary folder
}
# Modules that moved; their old names mislead (an import alias of the same name in the file is fine).
RETIRED = {
    "checkpoint": "engine/snapshot.py, native/layout.py",
    "format": "checks.py, native/manifest.py",
    "formats": "layouts.py",
    "inspect": "tools/",
    "orbax_compat": "orbax/",
    "tier_store": "tiers/store.py",
    "tier_sync": "tiers/sync.py",
    "tier_files": "tiers/files.py",
    "tier_load": "tiers/load.py",
    "conftest_s3": "s3_fixtures.py",
}

FILE_TYPES = {"py", "sh", "ipynb", "json", "txt", "bin", "md", "rst", "toml", "yaml", "tmp", "npy", "zarr"}
PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_][\w-]*\.(?:py|sh|ipynb))\b")
DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def _files() -> list[pathlib.Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _texts(path: pathlib.Path) -> tuple[list[tuple[int, str]], ast.Module]:
    """(line, text) of every comment and docstring in ``path``, and its syntax tree."""
    src = path.read_text()
    out = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(src).readline)
        if t.type == tokenize.COMMENT
    ]
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out, tree


def _bound(tree: ast.Module, *, local: bool = False) -> set[str]:
    """Names a module binds at any depth by import, and at top level by def, class or assignment;
    ``local``: also every variable and parameter (``storage.write`` in prose names a variable's method)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif local and isinstance(node, ast.Name):
            names.add(node.id)
        elif local and isinstance(node, ast.arg):
            names.add(node.arg)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _path_exists(name: str, where: pathlib.Path) -> bool:
    if name in FOREIGN:
        return True
    if name.startswith("flax_ckpt/callbacks/"):
        name = "callbacks/" + name[len("flax_ckpt/callbacks/") :]
    folders = [where.parent, *where.parent.parents] + [ROOT / b for b in BASES]
    return any((f / name).is_file() for f in folders if f == ROOT or ROOT in f.parents)


def _module_path(dotted: str) -> pathlib.Path | None:
    for package, folder in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        if dotted == package or dotted.startswith(package + "."):
            rest = dotted[len(package) :].lstrip(".").split(".") if dotted != package else []
            base = folder.joinpath(*rest)
            for p in (base / "__init__.py", base.with_suffix(".py")):
                if p.is_file():
                    return p
    return None


def _dotted_problem(dotted: str) -> str | None:
    """Why a dotted name under ``flax_ckpt`` names nothing: its longest module prefix must bind the next name."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        path = _module_path(".".join(parts[:n]))
        if path is not None:
            break
    else:
        return "no such module"
    if n == len(parts) or parts[n] in _bound(ast.parse(path.read_text())):
        return None
    return f"{path.relative_to(ROOT)} has no {parts[n]!r}"


def _ours() -> dict[str, pathlib.Path]:
    """Our modules by their unqualified name, where that name is unique (``layouts``, ``checks``)."""
    seen: dict[str, list[pathlib.Path]] = {}
    for folder in PACKAGES.values():
        for p in folder.rglob("*.py"):
            if "__pycache__" not in p.parts:
                stem = p.parent.name if p.name == "__init__.py" else p.stem
                seen.setdefault(stem, []).append(p)
    return {k: v[0] for k, v in seen.items() if len(v) == 1}


def _retired(name: str) -> re.Pattern:
    """``name`` as a module: ``name.attr``, or for a name that is no English word also ``name`` alone."""
    attr = rf"\.(?!(?:{'|'.join(FILE_TYPES)})\b)[A-Za-z_]\w*"
    return re.compile(
        rf"(?<![\w./-]){name}(?:{attr}|\b(?![./-]\w))" if "_" in name else rf"(?<![\w./-]){name}{attr}"
    )


def _members() -> dict[str, set[str]]:
    """Our classes' member names by the class's name in lower case: ``storage.write`` in prose is a
    ``Storage``'s method, not the storage package's."""
    out: dict[str, set[str]] = {}
    for folder in PACKAGES.values():
        for p in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef):
                    out.setdefault(node.name.lower(), set()).update(
                        n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    )
    return out


def _problems() -> list[str]:
    ours, members = _ours(), _members()
    out = []
    for path in _files():
        texts, tree = _texts(path)
        bound, variables = _bound(tree), _bound(tree, local=True)
        where = path.relative_to(ROOT)
        for line, text in texts:
            for m in PATH.finditer(text):
                if not _path_exists(m.group(1), path):
                    out.append(f"{where}:{line}: {m.group(1)} does not exist")
            for m in DOTTED.finditer(text):
                dotted = m.group(1)
                first, _, rest = dotted.partition(".")
                attr = rest.split(".")[0]
                if attr in FILE_TYPES:
                    continue
                if first == "flax_ckpt":
                    why = _dotted_problem(dotted)
                elif first in ours and first not in variables and attr not in members.get(first, ()):
                    mod = ours[first]
                    sub = mod.parent / attr if mod.name == "__init__.py" else None
                    ok = attr in _bound(ast.parse(mod.read_text())) or (
                        sub is not None
                        and ((sub.with_suffix(".py")).is_file() or (sub / "__init__.py").is_file())
                    )
                    why = None if ok else f"{mod.relative_to(ROOT)} has no {attr!r}"
                else:
                    continue
                if why:
                    out.append(f"{where}:{line}: {dotted}: {why}")
            out += [
                f"{where}:{line}: {name!r} is a retired module (now {now})"
                for name, now in RETIRED.items()
                if name not in bound and _retired(name).search(text)
            ]
    return out


def test_docstrings_and_comments_name_existing_modules():
    problems = _problems()
    assert not problems, "stale module names in docstrings or comments:\n" + "\n".join(problems)
