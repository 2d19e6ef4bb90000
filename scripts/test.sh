#!/usr/bin/env bash
# The whole test suite, from a clean clone: creates .venv, installs flax-ckpt with its test extra
# (versions pinned by constraints.txt), then runs pytest. Extra arguments go to pytest.
# The tests run in FLAX_CKPT_TEST_WORKERS (default 2) pytest-xdist worker processes, one test file to
# a worker (--dist loadfile: a module's fixtures are made once); `-n 0` runs them in this process
# (for -s or --pdb). The install is skipped when .venv already holds it (scripts/install.sh);
# FLAX_CKPT_EXTRAS (default test) names the extras to install (.ci/run adds docs);
# FLAX_CKPT_INSTALL_ONLY=1 stops after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
bash scripts/install.sh .venv constraints.txt -e ".[${FLAX_CKPT_EXTRAS:-test}]"
[ "${FLAX_CKPT_INSTALL_ONLY:-0}" = 1 ] && exit 0
exec .venv/bin/python -m pytest -q -n "${FLAX_CKPT_TEST_WORKERS:-2}" --dist loadfile "$@"
