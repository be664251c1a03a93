#!/usr/bin/env bash
# On a GPU host (the device tool's machine): the whole test suite, GPU tests and every op's
# self-check included, in parallel processes (kernel compiles dominate). Logs go to $OUT.
#   source .gpu/setup.sh && scripts/gpu-tests.sh [pytest args...]
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q -n "${WORKERS:-6}" -p no:cacheprovider tests \
    "$@" 2>&1 | tee "$out/gpu-tests.log" | tail -40
exit "${PIPESTATUS[0]}"
