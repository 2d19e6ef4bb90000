"""The built documentation site, rendered in headless Chromium as a reader's browser would show it.

scripts/docs.sh builds the site into docs/_build/html and then runs this file against it. Each page a
docs source makes (docs/*.md, api.rst, the notebook) must exist, and every page of the site is opened
at a desktop width (1280 pixels) and a phone's (500, Chromium's narrowest window): no image may be
broken, no page wider than the window, no link lead to a missing local page, and at the desktop width
no code block of a guide or the API reference may need a horizontal scroll bar (the notebook's cells
are the notebook's own lines). A script added to a copy of each page measures this
once the page has loaded and writes it into the DOM, which ``chromium --dump-dom`` prints.

Skipped, saying why, when Chromium is not installed (``apt-get install -y chromium``; .ci/run installs
it) or when the site is not built or older than its sources (``bash scripts/docs.sh``).
"""

from __future__ import annotations

import concurrent.futures
import html
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SITE = pathlib.Path(os.environ.get("FLAX_CKPT_SITE", DOCS / "_build" / "html"))
WIDTHS = (1280, 500)
PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var images = Array.from(document.images), de = document.documentElement;
  var result = {
    broken: images.filter(function (i) { return !(i.complete && i.naturalWidth > 0); })
                  .map(function (i) { return i.getAttribute("src"); }),
    scrollWidth: de.scrollWidth, innerWidth: window.innerWidth,
    widePre: Array.from(document.querySelectorAll(".bd-article pre"))
                  .filter(function (p) { return p.scrollWidth > p.clientWidth + 1; })
                  .map(function (p) { return p.textContent.split("\\n")[0].slice(0, 60); })};
  var out = document.createElement("div");
  out.id = "flax-ckpt-site-check";
  out.textContent = JSON.stringify(result);
  document.body.appendChild(out);
}, 100); });
</script>"""
RESULT = re.compile(r'<div id="flax-ckpt-site-check">([^<]*)</div>')


def _chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome")
    return next((shutil.which(n) for n in names if shutil.which(n)), None)


def _sources() -> list[pathlib.Path]:
    return [p for p in DOCS.rglob("*") if p.is_file() and "_build" not in p.parts] + [ROOT / "CHANGELOG.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    if _chromium() is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium); .ci/run installs it")
    index = SITE / "index.html"
    if not index.exists():
        pytest.skip(f"the site is not built ({index} is missing): bash scripts/docs.sh builds it")
    stale = [p for p in _sources() if p.stat().st_mtime > index.stat().st_mtime]
    if stale and "FLAX_CKPT_SITE" not in os.environ:
        pytest.skip(f"the site is older than {stale[0].relative_to(ROOT)}: bash scripts/docs.sh rebuilds it")
    copy = tmp_path_factory.mktemp("site") / "html"
    shutil.copytree(SITE, copy)
    for page in copy.rglob("*.html"):
        page.write_text(page.read_text().replace("</body>", PROBE + "</body>", 1))
    return copy


def _expected_pages() -> list[str]:
    sources = [*DOCS.glob("*.md"), *DOCS.glob("*.rst"), *(DOCS / "notebooks").glob("*.ipynb")]
    return sorted(p.relative_to(DOCS).with_suffix(".html").as_posix() for p in sources)


def _render(page: pathlib.Path, width: int) -> dict:
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--window-size={width},900",
        "--virtual-time-budget=5000",
        "--dump-dom",
        page.as_uri(),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    m = RESULT.search(out)
    assert m, f"{page.name} at {width} px: the page did not load or its check did not run"
    return json.loads(html.unescape(m.group(1)))


def test_every_docs_source_has_a_page(site):
    missing = [p for p in _expected_pages() if not (site / p).exists()]
    assert missing == [], "docs sources without a built page"


def test_local_links_lead_to_pages_that_exist(site):
    broken = []
    for page in site.rglob("*.html"):
        for href in re.findall(r'href="([^"#?]+\.html)(?:[#?][^"]*)?"', page.read_text()):
            if "://" not in href and not (page.parent / href).resolve().exists():
                broken.append(f"{page.relative_to(site)} -> {href}")
    assert broken == []


def test_pages_render_without_broken_images_or_overflow(site):
    pages = sorted(set(_expected_pages()) | {"index.html", "genindex.html", "search.html"})
    jobs = [(p, w) for p in pages for w in WIDTHS if (site / p).exists()]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = dict(zip(jobs, pool.map(lambda job: _render(site / job[0], job[1]), jobs)))
    problems = []
    for (page, width), r in results.items():
        if r["broken"]:
            problems.append(f"{page} at {width} px: broken images {r['broken']}")
        if r["scrollWidth"] > r["innerWidth"]:
            problems.append(f"{page} at {width} px: {r['scrollWidth']} px wide, wider than the window")
        notebook = page.startswith("notebooks/")  # its cells are the notebook's own lines
        if width == WIDTHS[0] and r["widePre"] and not notebook:
            problems.append(f"{page} at {width} px: code blocks with a scroll bar: {r['widePre']}")
    assert problems == [], "\n".join(problems)
    images = sum(1 for (page, _), r in results.items() if page == "performance.html")
    assert images, "performance.html was not rendered"
