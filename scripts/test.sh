#!/usr/bin/env bash
# The whole test suite, from a clean clone: creates .venv, installs flax-ckpt with its test extra
# (versions pinned by constraints.txt), then runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
exec .venv/bin/python -m pytest -q "$@"
