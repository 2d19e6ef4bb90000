#!/usr/bin/env bash
# The main demo, from a clean clone: creates .venv, installs flax-ckpt, then trains a small Flax
# classifier on scikit-learn's bundled digits with checkpointing to ./demo_ckpts, on local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[examples]"
DIR=${1:-demo_ckpts}
.venv/bin/python examples/train_linen.py --directory "$DIR"
cat <<EOF

The checkpoints are in $DIR/. Next:
  .venv/bin/flax-ckpt ls $DIR           # the steps saved, their size and loss
  .venv/bin/flax-ckpt verify $DIR       # re-reads every byte against its checksum
  bash scripts/demo.sh                  # again: resumes from the newest step, nothing left to train
  .venv/bin/python examples/preemption_demo.py   # a run stopped by SIGTERM, then resumed
EOF
