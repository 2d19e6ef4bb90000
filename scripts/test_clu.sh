#!/usr/bin/env bash
# The clu adapter, for real: creates .venv-clu, installs flax-ckpt with its test and clu extras (clu,
# tensorflow-cpu, tensorboard; versions pinned by constraints.txt), checks that clu's periodic_actions
# imports there (so that nothing is skipped for want of it) and runs tests/test_clu.py. Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-clu/bin/python ] || "$PY" -m venv .venv-clu
.venv-clu/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test,clu]"
.venv-clu/bin/python -c "import clu.periodic_actions, tensorflow as tf; print('test_clu: clu with tensorflow', tf.__version__)"
status=0
.venv-clu/bin/python -m pytest -p no:cacheprovider -q tests/test_clu.py "$@" || status=$?
if [ "$status" -eq 5 ]; then echo "test_clu: pytest ran no test"; exit 1; fi
exit "$status"
