#!/usr/bin/env bash
# The main demo, from a clean clone: creates .venv, installs flax-ckpt, then trains a small Flax
# classifier on scikit-learn's bundled digits with checkpointing to ./demo_ckpts, on local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[examples]"
exec .venv/bin/python examples/train_linen.py --directory "${1:-demo_ckpts}"
