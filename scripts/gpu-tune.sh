#!/usr/bin/env bash
# On a GPU host: tune MODEL[:DTYPE] ... from scratch into a fresh database (the shipped layer ignored),
# the way tuning_db/ is built; the GPU's file and one log per model land in $OUT.
#   source .gpu/setup.sh && scripts/gpu-tune.sh gpt2 gpt2:fp16 gpt2-xl
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TILEKIT_CACHE_DIR="${TILEKIT_CACHE_DIR:-/tmp/tilekit-tune}" TILEKIT_SHIPPED_DB=/nonexistent
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_.-')
status=0
for spec in "$@"; do
    model="${spec%%:*}"; dtype="bf16"; [[ "$spec" == *:* ]] && dtype="${spec##*:}"
    log="$out/tune-$model-$dtype-$gpu.txt"
    { time python3 -m tilekit tune --model "$model" --dtype "$dtype"; } > "$log" 2>&1 || status=1
    tail -3 "$log"
done
cp "$TILEKIT_CACHE_DIR"/tuning/sm_*/*.json "$out/" 2>/dev/null
python3 -m tilekit db verify | tail -2
exit $status
