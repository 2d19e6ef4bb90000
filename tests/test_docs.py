"""The documentation site's sources keep up with the code and the README, without building it.

scripts/docs.sh builds the site (Sphinx, warnings as errors); these checks are the cheap part that the
default suite runs: every public name (``flax_ckpt.__all__``, ``flax_ckpt.callbacks.__all__``) has an
entry in the API reference (docs/api.rst) and nothing private has one; every section of README.md is
the start of a guide page, whose include markers each occur once in the README; the rendered notebook
is the repository's own notebooks/finetune.ipynb, through a link, not a copy.
"""

from __future__ import annotations

import pathlib
import re

import flax_ckpt
import flax_ckpt.callbacks

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"

# ".. autoclass:: Name", ".. py:data:: Name", ".. currentmodule:: flax_ckpt.callbacks", ...
DIRECTIVE = re.compile(r"^\.\. (?:auto(?:function|class|exception|data)|py:data|(current)?(module)):: (\S+)\s*$",
                       re.MULTILINE)
MARKER = re.compile(r'^:(start-after|end-before): "(.*)"$', re.MULTILINE)
HEADING = re.compile(r"^#{2,6} .+$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)  # a code block's "## " lines are no headings


def _documented() -> set[str]:
    """The fully qualified names the API reference documents, following its module directives."""
    names, module = set(), None
    for m in DIRECTIVE.finditer((DOCS / "api.rst").read_text()):
        current, is_module, name = m.groups()
        if current or is_module:
            module = name
        elif name.startswith("flax_ckpt."):
            names.add(name)
        else:
            assert module is not None, f"docs/api.rst documents {name} before naming its module"
            names.add(f"{module}.{name}")
    return names


def test_every_public_name_is_in_the_api_reference_and_nothing_else():
    public = {f"flax_ckpt.{n}" for n in flax_ckpt.__all__}
    public |= {f"flax_ckpt.callbacks.{n}" for n in flax_ckpt.callbacks.__all__}
    optional = {"flax_ckpt.callbacks.clu_adapter.CheckpointAction"}  # the clu extra's module
    documented = _documented()
    assert public - documented == set(), "public names missing from docs/api.rst"
    assert documented - public - optional == set(), "docs/api.rst documents names that are not public"


def _markers() -> dict[str, list[tuple[str, str]]]:
    """Per docs page, the (option, text) of each README include marker it uses."""
    out = {}
    for page in sorted(DOCS.glob("*.md")):
        found = [(opt, text) for opt, text in MARKER.findall(page.read_text())]
        if "../README.md" in page.read_text():
            out[page.name] = found
    return out


def test_guide_markers_occur_once_in_the_readme():
    readme = README.read_text()
    markers = _markers()
    assert markers, "no docs page includes README.md"
    for page, found in markers.items():
        for option, text in found:
            assert readme.count(text) == 1, (
                f"docs/{page}: {option} {text!r} occurs {readme.count(text)} times in README.md; an include"
                " cuts at its first occurrence, so it must be there exactly once")


def test_every_readme_section_starts_a_guide_page():
    """A section added to the README gets a page (docs/*.md including it from its heading); else it
    would run on inside the page before it, under a heading level that page does not have."""
    starts = {text for found in _markers().values() for option, text in found if option == "start-after"}
    headings = HEADING.findall(FENCE.sub("", README.read_text()))
    assert headings
    assert [h for h in headings if h not in starts] == [], "README sections without a docs page"


def test_the_notebook_page_is_the_repository_notebook():
    page = DOCS / "notebooks" / "finetune.ipynb"
    assert page.is_symlink(), "docs/notebooks/finetune.ipynb must link to notebooks/finetune.ipynb, not copy it"
    assert page.resolve() == (ROOT / "notebooks" / "finetune.ipynb").resolve()
