#!/usr/bin/env bash
# On a GPU host: decode-step variants of this tree compared inside one process (benchmarks.studies.decode_ab: the
# fixed-point residual against the model-dtype residual), replays interleaved.
# Tune first into the same TILEKIT_CACHE_DIR (scripts/gpu-tune.sh), or the new ops run their default configs.
#   source .gpu/setup.sh && scripts/gpu-tune.sh gpt2 gpt2-xl && scripts/gpu-decode-ab.sh gpt2 gpt2-xl
# (A tree against another tree needs two processes, and the dependent-launch step time has moved 10% between
# processes with no kernel or config change: docs/results/gemv-decode-h100.txt.)
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 TILEKIT_CACHE_DIR="${TILEKIT_CACHE_DIR:-/tmp/tilekit-tune}"
models=()
for m in "${@:-gpt2}"; do models+=(--model "$m"); done
batches=()
for b in ${BATCHES:-1 8}; do batches+=(--batch "$b"); done
python3 -m benchmarks.studies.decode_ab "${models[@]}" "${batches[@]}" --out "$out" 2>&1 | grep -v -i warn | tee "$out/decode-ab.txt"
