#!/usr/bin/env bash
# The minimum supported versions, tested: creates .venv-min with the lowest Python that pyproject's
# requires-python admits (3.11) where this machine has it, installs flax-ckpt there with the declared
# floors of its dependencies (constraints-min.txt: jax/jaxlib 0.6.0, flax 0.10.0, optax 0.2.0,
# numpy 1.26.0, tensorstore 0.1.81, ml_dtypes 0.5.0, crc32c 2.4,
# zstandard 0.23.0) and runs the engine, error, manager,
# callbacks and multi-host tests (in 2 pytest-xdist workers, one file to a worker). Extra arguments
# replace the default test files and options. FLAX_CKPT_INSTALL_ONLY=1 stops after the install
# (skipped when .venv-min already holds it: scripts/install.sh).
# PYTHON_MIN=/path/to/python picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
LOWEST=3.11
is_lowest() { [ -n "$1" ] && "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$LOWEST'.split('.'))))" 2>/dev/null; }
PY=${PYTHON_MIN:-}
if [ -z "$PY" ]; then
  for cand in "$(command -v python$LOWEST || true)" \
              $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/$LOWEST.*/bin/python 2>/dev/null | sort -V | tail -1); do
    if is_lowest "$cand"; then PY=$cand; break; fi
  done
  if [ -z "$PY" ]; then
    PY=python3
    echo "test_min: Python $LOWEST (the lowest supported) is not on this machine; using $("$PY" --version 2>&1) instead"
  fi
elif ! is_lowest "$PY"; then
  echo "test_min: PYTHON_MIN is $("$PY" --version 2>&1), not $LOWEST (the lowest supported)"
fi
version() { "$1" -c "import sys; print(*sys.version_info[:2], sep='.')"; }
if [ -x .venv-min/bin/python ] && [ "$(version .venv-min/bin/python)" != "$(version "$PY")" ]; then
  rm -rf .venv-min  # made with another Python before
fi
[ -x .venv-min/bin/python ] || "$PY" -m venv .venv-min
echo "test_min: $(.venv-min/bin/python --version) with the minimum versions of constraints-min.txt"
bash scripts/install.sh .venv-min constraints-min.txt -e . pytest pytest-timeout pytest-xdist hypothesis psutil
[ "${FLAX_CKPT_INSTALL_ONLY:-0}" = 1 ] && exit 0
.venv-min/bin/python - <<'PY'
import importlib.metadata as md
print("test_min:", ", ".join(f"{n} {md.version(n)}" for n in
      ("jax", "jaxlib", "flax", "optax", "numpy", "tensorstore", "ml_dtypes", "crc32c", "tqdm")))
PY
if [ $# -eq 0 ]; then
  set -- tests/test_roundtrip.py tests/test_errors.py tests/test_manager.py tests/test_callbacks.py \
         tests/test_multihost.py tests/test_distributed.py -q -n 2 --dist loadfile
fi
status=0
.venv-min/bin/python -m pytest -p no:cacheprovider "$@" || status=$?
if [ "$status" -eq 5 ]; then echo "test_min: pytest ran no test"; exit 1; fi
exit "$status"
