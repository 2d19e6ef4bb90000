#!/usr/bin/env bash
# The suite's timing-sensitive test files on a busy machine: FLAX_CKPT_BUSY_BURNERS (default 4) CPU-bound
# processes run beside them, as other work does on a shared CI runner or a laptop. These tests wait for
# progress (commits made, a file appearing) and judge time only as a ratio to a calibration measured in
# the same run, so they must pass here as on an idle machine. Uses .venv (made by scripts/test.sh); extra
# arguments go to pytest. CI runs it after the main suite (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "test_busy.sh: no .venv: run bash scripts/test.sh first" >&2; exit 2; }
# The files whose tests kill savers at moments counted in commits, wait for a writer's progress, or
# compare a time with a same-run calibration (tests/helpers.py stretch and cpu_unit).
FILES=(
  tests/test_reliability_crash.py
  tests/test_cli_light.py
  tests/test_cli_live.py
  tests/test_read_only.py
  tests/test_legacy_formats.py
  tests/test_s3_unreachable.py
)
burners=()
stop_burners() { for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_burners EXIT
for _ in $(seq "${FLAX_CKPT_BUSY_BURNERS:-4}"); do
  .venv/bin/python -c 'while True: pass' &
  burners+=("$!")
done
echo "test_busy.sh: ${#burners[@]} CPU-bound processes beside the tests (pids ${burners[*]})"
.venv/bin/python -m pytest -q -n "${FLAX_CKPT_TEST_WORKERS:-2}" --dist loadfile "${FILES[@]}" "$@"
