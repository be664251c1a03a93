#!/usr/bin/env bash
# On a GPU host (the device tool's machine): every test marked `gpu` (the kernels against their references,
# every op's self-check, the models, tuning, patched HF models, the benchmark smoke tests), in parallel
# processes (kernel compiles dominate; a fresh H100 runs them in about 5 minutes with 12), spread over the
# host's GPUs where it has several. Logs go to $OUT.
#   source .gpu/setup.sh && scripts/gpu-tests.sh [test paths and pytest args; default: tests]   (WORKERS=N, default 12)
# TEST_TIMEOUT=S fails any one test running longer than S seconds (pytest-timeout), so that a run fitting a call's
# time limit ends with pytest's summary, each failure's message in it, instead of being cut before it. The
# tensor-parallel tests' ranks have their own watchdog, TILEKIT_TEST_RANK_TIMEOUT (default 240 s): a low value stops
# ranks that are still compiling kernels on a cold cache.
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
gpus=$(nvidia-smi -L | grep -c "^GPU")
[ "$gpus" -gt 1 ] && export TESTS_SPREAD_OVER_GPUS="$gpus"    # xdist workers take the GPUs in turn
# -v logs each test's outcome as it finishes, and failures.txt each failure's report, so a run cut short by a time
# limit still names its failures and says why.
export TESTS_FAILURES_FILE="$out/failures.txt"
python3 -m pytest -v -n "${WORKERS:-12}" -m gpu -p no:cacheprovider ${TEST_TIMEOUT:+--timeout="$TEST_TIMEOUT"} \
    "${@:-tests}" > "$out/gpu-tests.log" 2>&1
status=$?
grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR) " "$out/gpu-tests.log" | sort -u | head -40
tail -1 "$out/gpu-tests.log"
exit "$status"
