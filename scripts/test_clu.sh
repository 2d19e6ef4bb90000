#!/usr/bin/env bash
# The clu adapter, for real: creates .venv-clu (on top of .venv where scripts/test.sh made one),
# installs flax-ckpt with its test and clu extras (clu, tensorflow-cpu, tensorboard; versions pinned by
# constraints.txt), checks that clu's periodic_actions imports there (so that nothing is skipped for
# want of it) and runs tests/test_clu.py. Extra arguments go to pytest. FLAX_CKPT_INSTALL_ONLY=1 stops
# after the install (skipped when .venv-clu already holds it: scripts/install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
if [ ! -x .venv-clu/bin/python ]; then
  "$PY" -m venv .venv-clu
  # Where scripts/test.sh made .venv with the same Python, .venv-clu sits on top of it (a .pth file
  # puts .venv's packages after its own): pip then installs only clu, tensorflow-cpu, tensorboard and
  # what they add, not jax and the rest a second time (about 40 s against 180 s).
  if [ -x .venv/bin/python ] && [ "$(.venv/bin/python -V)" = "$(.venv-clu/bin/python -V)" ]; then
    purelib .venv/bin/python > "$(purelib .venv-clu/bin/python)/_flax_ckpt_base_venv.pth"
    echo "test_clu: .venv-clu on top of .venv"
  fi
fi
bash scripts/install.sh .venv-clu constraints.txt -e ".[test,clu]"
[ "${FLAX_CKPT_INSTALL_ONLY:-0}" = 1 ] && exit 0
.venv-clu/bin/python -c "import clu.periodic_actions, tensorflow as tf; print('test_clu: clu with tensorflow', tf.__version__)"
status=0
.venv-clu/bin/python -m pytest -p no:cacheprovider -q tests/test_clu.py "$@" || status=$?
if [ "$status" -eq 5 ]; then echo "test_clu: pytest ran no test"; exit 1; fi
exit "$status"
