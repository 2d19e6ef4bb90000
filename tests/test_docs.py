"""The documentation site's sources keep up with the code and the README, without building it.

scripts/docs.sh builds the site (Sphinx, warnings as errors) and renders it in a browser
(tests/test_site.py); tests/test_guides.py runs the pages' examples. These checks are the cheap part that
the default suite runs: every public name (``flax_ckpt.__all__``, ``flax_ckpt.callbacks.__all__``) has an
entry in the API reference (docs/api.rst) and nothing private has one; every code block of README.md and
the guides fits 100 columns; every guide is a page of its own (not only an include) listed in the site's
index; relative links and images resolve; README.md is a landing page and CHANGELOG.md one release list;
the rendered notebook is the repository's own notebooks/finetune.ipynb, through a link, not a copy.
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
DIRECTIVE = re.compile(
    r"^\.\. (?:auto(?:function|class|exception|data)|py:data|(current)?(module)):: (\S+)\s*$", re.MULTILINE
)


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


GUIDES = sorted(p for p in DOCS.glob("*.md"))
PAGES = [README, *GUIDES]
FENCED = re.compile(r"^(`{3,})([^\n`]*)\n(.*?)^\1\s*$", re.MULTILINE | re.DOTALL)
DIRECTIVE_BLOCK = re.compile(r"^```\{(include|toctree|literalinclude)\}.*?^```\s*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
WIDTH = 100


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced code block (MyST directives included)."""
    return [(m.group(2).strip(), m.group(3)) for m in FENCED.finditer(text)]


def test_every_code_block_fits_100_columns():
    """A wider line is cut off behind a horizontal scroll bar on the site (and on GitHub)."""
    wide = [
        f"{page.relative_to(ROOT)}: {len(line)} columns: {line[:60]}..."
        for page in PAGES
        for info, body in code_blocks(page.read_text())
        if not info.startswith("{")
        for line in body.splitlines()
        if len(line) > WIDTH
    ]
    assert wide == [], "code lines wider than 100 columns"


def test_no_page_is_only_an_include():
    """A guide is a page of its own: prose outside any include, toctree and heading."""
    for page in GUIDES:
        rest = DIRECTIVE_BLOCK.sub("", page.read_text())
        prose = [line for line in rest.splitlines() if line.strip() and not line.startswith("#")]
        assert prose, f"docs/{page.name} is only an include (or empty): write the page itself"


def test_every_guide_is_in_the_site_index():
    index = (DOCS / "index.md").read_text()
    listed = set(re.findall(r"^([\w/-]+)$", index, re.MULTILINE))
    missing = [p.stem for p in GUIDES if p.stem != "index" and p.stem not in listed]
    assert missing == [], "docs pages missing from a toctree in docs/index.md"


def test_relative_links_and_images_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_readme_is_a_landing_page():
    """About 150 lines; the two set-up commands first; no issue numbers or dated history; one chart
    that benchmarks/plots.py draws; a link to every guide."""
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= 170, f"README.md has {lines} lines: move text to a guide"
    first = code_blocks(text)[0][1].splitlines()
    assert first[0].startswith("bash scripts/demo.sh") and first[1].startswith("bash scripts/test.sh"), first
    assert not re.search(r"\bissues? \d+", text, re.IGNORECASE), "README.md mentions issue numbers"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "README.md holds dated history"
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images == ["docs/_static/save_restore.png"], images
    assert "save_restore.png" in (ROOT / "benchmarks" / "plots.py").read_text()
    linked = {pathlib.Path(t).name for t in LINK.findall(text)}
    guides = {p.name for p in GUIDES} - {"index.md", "changelog.md", "license.md", "api.md"}
    assert guides - linked == set(), "guides the README does not link"


def test_changelog_is_one_release_list():
    """What a user gets, not the project's diary: one heading per release, its changes under
    Added/Changed/Fixed/Security, no measurement history."""
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert releases and releases[0].startswith("0.1.0"), releases
    sections = re.findall(r"^### (.+)$", text, re.MULTILINE)
    assert len(sections) == len(set(sections)), f"a heading twice in one release: {sections}"
    assert set(sections) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections
    assert not re.search(r"\bissues? \d+|\d+ -> \d+", text), "CHANGELOG.md holds measurement history"


def test_the_notebook_page_is_the_repository_notebook():
    page = DOCS / "notebooks" / "finetune.ipynb"
    assert page.is_symlink(), (
        "docs/notebooks/finetune.ipynb must link to notebooks/finetune.ipynb, not copy it"
    )
    assert page.resolve() == (ROOT / "notebooks" / "finetune.ipynb").resolve()


# The project's history, which user pages never carry: rounds of review, issue numbers, the test files
# of a round, and "as before" (before what, a user cannot know). Code (fenced or inline) is not prose.
HISTORY = re.compile(
    r"\brounds? (?:one|two|three|four|five|six|seven|eight|nine|ten|\d+)\b|\bred team|\bissues? #?\d+"
    r"|\bas before\b|\btest_round_\w+|\bitem \d+ of\b",
    re.IGNORECASE,
)
ROLE = re.compile(r"\{(?:doc|ref|numref|download|term)\}`")  # MyST roles: raw markup on GitHub
INLINE_CODE = re.compile(r"(`+)[^`]*?\1")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code."""
    return INLINE_CODE.sub("", FENCED.sub("", text))


def _user_pages() -> dict[str, str]:
    """{name: text} of every page a user reads: README.md, the guides, CHANGELOG.md (the site's
    changelog page includes it) and the notebook's markdown cells."""
    import nbformat

    pages = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [*PAGES, ROOT / "CHANGELOG.md"]}
    nb = nbformat.read(ROOT / "notebooks" / "finetune.ipynb", as_version=4)
    pages["notebooks/finetune.ipynb"] = "\n\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    return pages


def test_user_pages_carry_no_project_history_and_no_myst_roles():
    found = [
        f"{name}: {m.group(0)!r}"
        for name, text in _user_pages().items()
        for pattern in (HISTORY, ROLE)
        for m in pattern.finditer(_prose(text) if pattern is HISTORY else text)
    ]
    assert found == [], "project history or MyST roles in user pages (plain words, Markdown links)"


def test_the_history_check_sees_each_kind_of_history():
    for words in (
        "Round three: links",
        "rounds one and two",
        "(issue 51)",
        "the red team",
        "as before.",
        "see test_round_three.py",
        "{doc}`notebook <notebooks/finetune>`",
    ):
        assert HISTORY.search(_prose(words)) or ROLE.search(words), words
    for words in ("medians of interleaved rounds", "each round runs every contender", "`--rounds 5`"):
        assert not HISTORY.search(_prose(words)), words


def _table_versions(page: str, column: int) -> dict[str, str]:
    """{package: version} of a versions table's ``column`` (1: minimum, 2: pinned), one version for
    each package a row names ("jax, jaxlib | 0.6.0": both)."""
    out = {}
    for row in re.findall(r"^\| ([^|]+?) \| ([^|]+?) \| ([^|]+?) \|$", page, re.MULTILINE):
        names = [re.sub(r"\s*\(.*\)", "", n).strip() for n in row[0].split(",")]
        versions = [v.strip() for v in row[column].split(",")]
        if len(versions) == 1:
            versions *= len(names)
        out.update(zip(names, versions))
    return out


def _pins(path: pathlib.Path) -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", path.read_text(), re.MULTILINE)
    return {name.lower().replace("-", "_"): version for name, version in pins}


def test_the_tested_versions_table_is_the_constraints_files():
    text = (DOCS / "getting-started.md").read_text()
    page = text[text.index("## Tested versions") :].split("\n## ")[0]
    for column, constraints in ((1, "constraints-min.txt"), (2, "constraints.txt")):
        table = _table_versions(page, column)
        pins = _pins(ROOT / constraints)
        assert "ml_dtypes" in table and "jaxlib" in table, table
        for name, version in table.items():
            if name in ("Python", "---"):  # no pin; the header's rule
                continue
            assert pins.get(name.lower()) == version, (
                f"docs/getting-started.md says {name} {version}; {constraints} pins {pins.get(name.lower())}"
            )
