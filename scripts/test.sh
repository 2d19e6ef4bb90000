#!/usr/bin/env bash
# The whole test suite, from a clean clone: creates .venv, installs flax-ckpt with its test extra
# (versions pinned by constraints.txt), then runs pytest. Extra arguments go to pytest.
# The tests run in FLAX_CKPT_TEST_WORKERS (default 2) pytest-xdist worker processes, one test file to
# a worker (--dist loadfile: a module's fixtures are made once); `-n 0` runs them in this process
# (for -s or --pdb).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
exec .venv/bin/python -m pytest -q -n "${FLAX_CKPT_TEST_WORKERS:-2}" --dist loadfile "$@"
