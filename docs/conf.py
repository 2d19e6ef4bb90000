"""Sphinx configuration of flax_ckpt's documentation site (built by scripts/docs.sh).

The guides are pages of their own (docs/*.md; tests/test_guides.py runs their examples); the API reference
is generated from the public docstrings (api.rst); the notebook is notebooks/finetune.ipynb (docs/notebooks/
holds a link to it), rendered by myst-nb without executing it. The charts and tables under _static/ are
drawn by benchmarks/plots.py. Nothing is fetched at build time (no intersphinx).
"""

import os
import re
from pathlib import Path

import flax_ckpt

project = "flax_ckpt"
author = "The flax_ckpt authors"
copyright = "The flax_ckpt authors"  # noqa: A001 (Sphinx's name)
release = version = flax_ckpt.__version__

extensions = [
    "myst_nb",  # MyST Markdown pages and notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the Google-style "Args:" sections of the callbacks' docstrings
]

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "_static/*.md"]  # _static/*.md: included tables
root_doc = "index"

# MyST and notebooks: the notebook's stored cells are shown as they are; nothing is executed.
nb_execution_mode = "off"
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The API reference: members in source order, type hints in the signature, our names shown short.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_class_signature = "mixed"
autodoc_mock_imports = ["clu"]  # flax_ckpt.callbacks.clu_adapter subclasses clu's PeriodicAction
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Every reference to a name of ours must resolve (nitpicky); the names of other projects (jax, numpy,
# the standard library) are left unlinked, since no inventory of theirs is fetched (no intersphinx).
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!flax_ckpt\b).*")]

html_theme = "sphinx_book_theme"
html_title = f"flax_ckpt {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False


# The pages link the notebook as GitHub shows it, [text](notebooks/finetune.ipynb). MyST resolves a
# link's file through symbolic links, and docs/notebooks/finetune.ipynb links to notebooks/, outside
# docs/, where it finds no page; so for the site such a link becomes the {doc} role of the page it names.
_DOCS = Path(__file__).resolve().parent
_FILE_LINK = re.compile(r"\[([^\]\n]+)\]\(([^)\s#:]+\.(?:md|ipynb))\)")


def _links_through_symlinks(app, docname, source):
    page = Path(app.env.doc2path(docname))
    if page.suffix != ".md":
        return

    def to_role(m):
        target = page.parent / m.group(2)
        if not target.is_symlink():
            return m.group(0)
        doc = Path(os.path.relpath(target.with_suffix(""), _DOCS)).as_posix()
        return f"{{doc}}`{m.group(1)} </{doc}>`"

    source[0] = _FILE_LINK.sub(to_role, source[0])


def setup(app):
    app.connect("source-read", _links_through_symlinks)
