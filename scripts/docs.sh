#!/usr/bin/env bash
# The documentation site, built with warnings as errors: installs flax-ckpt with its docs extra into
# .venv (made as scripts/test.sh makes it when missing; versions pinned by constraints.txt), then runs
# Sphinx on docs/ into docs/_build/html, every page read afresh (-E) so that no warning hides in a
# saved environment. Nothing is fetched while building (no intersphinx; the notebook is rendered as
# stored, not executed), and every reference to a flax_ckpt name must resolve (-n). Then
# tests/test_site.py opens every built page in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
t0=$SECONDS
bash scripts/install.sh .venv constraints.txt -e ".[docs]"  # skipped where .venv holds it already
t1=$SECONDS
.venv/bin/python -m sphinx -W --keep-going -n -E -q -b html docs docs/_build/html
t2=$SECONDS
echo "docs: built docs/_build/html/index.html (install $((t1 - t0)) s, build $((t2 - t1)) s)"
# The built pages in headless Chromium (broken images, missing pages, pages wider than the window):
# skipped, saying so, where Chromium is not installed (apt-get install -y chromium).
FLAX_CKPT_SITE=docs/_build/html .venv/bin/python -m pytest -q -p no:cacheprovider -rs tests/test_site.py
echo "docs: site checked in a browser ($((SECONDS - t2)) s)"
