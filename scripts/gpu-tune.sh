#!/usr/bin/env bash
# On a GPU host: tune MODEL[:DTYPE][+int8|+fp8[+head]] ... (+: the model with quantized linears, +head its LM head
# too) into a fresh user database. Kernel shapes the shipped database
# already holds, usable, for this very GPU are skipped (FRESH=1 tunes everything), so after a kernel
# change this re-tunes just what went stale or is new. The GPU's tuned file, an export of the user
# database and one log (all models) land in $OUT, refreshed after each model so that a call cut short
# keeps what it finished; fold the tuned file into tuning_db/ with `python scripts/ship_tuning.py FILE...`.
#   source .gpu/setup.sh && scripts/gpu-tune.sh gpt2 gpt2:fp16 llama-3.2-1b llama-3.1-8b+int8 llama-3.1-8b+fp8
# TUNE_ARGS adds `tilekit tune` options, e.g. TUNE_ARGS='--devices all' on a host with several GPUs.
# RESUME=FILE: an earlier call's tuned-export.json (a file of the working tree, which travels to the GPU
# host), imported first (`tilekit db import` checks every entry), so a re-tune longer than one call
# goes on where the last one stopped instead of starting over on a fresh machine.
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TILEKIT_CACHE_DIR="${TILEKIT_CACHE_DIR:-/tmp/tilekit-tune}"
if [ -n "${RESUME:-}" ]; then
    python3 -m tilekit db import "$RESUME" || exit 1
fi
[ "${FRESH:-0}" = 1 ] && export TILEKIT_SHIPPED_DB="$(mktemp -d)"     # an empty database: every shape tuned
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_.-')
log="$out/tune-$gpu.txt"
status=0
for spec in "$@"; do
    quant=(); [[ "$spec" == *+head ]] && quant=(--quantize-head) && spec="${spec%+head}"   # llama-3.1-8b+int8+head
    base="${spec%%+*}"; [[ "$spec" == *+* ]] && quant+=(--quantize "${spec##*+}")
    model="${base%%:*}"; dtype="bf16"; [[ "$base" == *:* ]] && dtype="${base##*:}"
    echo "== $spec" >> "$log"
    { time python3 -m tilekit tune --model "$model" --dtype "$dtype" "${quant[@]}" ${TUNE_ARGS:-}; } >> "$log" 2>&1 || status=1
    grep -E "^tuned [0-9]+ of|already tuned" "$log" | tail -1
    cp "$TILEKIT_CACHE_DIR"/tuning/sm_*/*.json "$out/" 2>/dev/null           # after each model: a cut keeps the rest
    python3 -m tilekit db export "$out/tuned-export.json" > /dev/null 2>&1
done
python3 -m tilekit db verify | tail -2
exit $status
