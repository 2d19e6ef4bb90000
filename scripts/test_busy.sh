#!/usr/bin/env bash
# The suite's timing-sensitive test files on a busy machine: FLAX_CKPT_BUSY_BURNERS (default 4) CPU-bound
# processes run beside them, as other work does on a shared CI runner or a laptop. These tests wait for
# progress (commits made, a file appearing) and judge time only as a ratio to a calibration measured in
# the same run, so they must pass here as on an idle machine. Uses .venv (made by scripts/test.sh); extra
# arguments go to pytest. CI runs it after the main suite (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "test_busy.sh: no .venv: run bash scripts/test.sh first" >&2; exit 2; }
# The tests that kill savers at moments counted in commits, wait for a writer's progress, or judge a
# time as a ratio to a calibration measured in the same run (tests/helpers.py stretch and Within,
# test_cli_light's numpy start, the step time of test_device_snapshot): one of each kind, so that this
# stays a few minutes. Fewer SIGKILL trials than the main suite runs (4, not 8).
export FLAX_CKPT_RELIABILITY_KILLS=${FLAX_CKPT_RELIABILITY_KILLS:-4}
TESTS=(
  tests/test_reliability_crash.py::test_sigkill_at_random_moments_of_async_saves_loses_nothing
  tests/test_reliability_crash.py::test_sigkill_of_saves_through_a_memory_tier_loses_nothing
  tests/test_cli_light.py::test_ls_verify_and_info_of_a_local_native_run_import_no_jax_and_cost_a_few_numpy_imports
  tests/test_device_snapshot.py::test_a_save_of_a_state_still_computing_returns_before_the_step_ends
  tests/test_manager.py::test_an_async_write_waits_a_grace_for_the_callers_next_step_unless_something_waits_for_it
  tests/test_observability.py::test_auto_interval_keeps_measured_overhead_within_budget
  tests/test_many_processes.py::test_merge_of_chunk_records_is_linear_and_keeps_what_it_kept
  "tests/test_s3_unreachable.py::test_unreachable_endpoint_fails_fast_and_quietly_in_a_real_process[refused]"
  tests/test_reliability_concurrency.py::test_reader_during_commits_and_retention_sees_only_whole_steps
  tests/test_tiers.py::test_small_changes_are_stored_as_compressed_xor_deltas
  tests/test_tier_every_step.py::test_encoder_stores_unchanged_as_references_small_changes_as_deltas_and_adam_updates_raw
)
burners=()
stop_burners() { for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_burners EXIT
for _ in $(seq "${FLAX_CKPT_BUSY_BURNERS:-4}"); do
  .venv/bin/python -c 'while True: pass' &
  burners+=("$!")
done
echo "test_busy.sh: ${#burners[@]} CPU-bound processes beside the tests (pids ${burners[*]})"
.venv/bin/python -m pytest -q -n "${FLAX_CKPT_TEST_WORKERS:-2}" --dist loadfile "${TESTS[@]}" "$@"
