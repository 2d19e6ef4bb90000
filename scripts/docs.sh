#!/usr/bin/env bash
# The documentation site, built with warnings as errors: installs flax-ckpt with its docs extra into
# .venv (made as scripts/test.sh makes it when missing; versions pinned by constraints.txt), then runs
# Sphinx on docs/ into docs/_build/html, every page read afresh (-E) so that no warning hides in a
# saved environment. Nothing is fetched while building (no intersphinx; the notebook is rendered as
# stored, not executed), and every reference to a flax_ckpt name must resolve (-n).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
t0=$SECONDS
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[docs]"
t1=$SECONDS
.venv/bin/python -m sphinx -W --keep-going -n -E -q -b html docs docs/_build/html
echo "docs: built docs/_build/html/index.html (install $((t1 - t0)) s, build $((SECONDS - t1)) s)"
