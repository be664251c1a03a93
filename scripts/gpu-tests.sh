#!/usr/bin/env bash
# On a GPU host (the device tool's machine): every op's self-check, then the GPU tests and the
# benchmark suite's GPU smoke tests, in parallel processes (kernel compiles dominate). Logs go to $OUT.
#   source .gpu/setup.sh && scripts/gpu-tests.sh [pytest args...]
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
status=0
for op in layernorm gelu linear attention decode_attention kv_cache embedding sampling; do
    python3 -W ignore -m "tilekit.kernels.$op" 2>&1 | tee -a "$out/self-checks.log" || status=1
done
python3 -m pytest -q -n "${WORKERS:-6}" -p no:cacheprovider tests \
    "$@" 2>&1 | tee "$out/gpu-tests.log" | tail -40
exit $(( status | ${PIPESTATUS[0]} ))
