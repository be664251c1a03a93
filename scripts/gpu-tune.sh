#!/usr/bin/env bash
# On a GPU host: tune MODEL[:DTYPE] ... into a fresh user database. Kernel shapes the shipped database
# already holds, usable, for this very GPU are skipped (FRESH=1 tunes everything), so after a kernel
# change this re-tunes just what went stale or is new. The GPU's tuned file and one log per model land
# in $OUT; fold them into tuning_db/ with `python scripts/ship_tuning.py FILE...`.
#   source .gpu/setup.sh && scripts/gpu-tune.sh gpt2 gpt2:fp16 llama-3.2-1b
# TUNE_ARGS adds `tilekit tune` options, e.g. TUNE_ARGS='--devices all' on a host with several GPUs.
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TILEKIT_CACHE_DIR="${TILEKIT_CACHE_DIR:-/tmp/tilekit-tune}"
[ "${FRESH:-0}" = 1 ] && export TILEKIT_SHIPPED_DB=/nonexistent
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_.-')
status=0
for spec in "$@"; do
    model="${spec%%:*}"; dtype="bf16"; [[ "$spec" == *:* ]] && dtype="${spec##*:}"
    log="$out/tune-$model-$dtype-$gpu.txt"
    { time python3 -m tilekit tune --model "$model" --dtype "$dtype" ${TUNE_ARGS:-}; } > "$log" 2>&1 || status=1
    tail -3 "$log"
    cp "$TILEKIT_CACHE_DIR"/tuning/sm_*/*.json "$out/" 2>/dev/null   # after each model: a timeout keeps the rest
done
python3 -m tilekit db verify | tail -2
exit $status
