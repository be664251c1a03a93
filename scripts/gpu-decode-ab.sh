#!/usr/bin/env bash
# On a GPU host: a same-run A/B of the decode step. The per-kernel breakdown (batch 1) of the checkout in
# .baseline/ (tilekit, benchmarks and tuning_db of the tree to compare against), then of this one, back to back;
# the step-time lines of both print last. Tune what this tree's kernel change made stale first (into the same
# TILEKIT_CACHE_DIR), or the comparison runs its default configs.
#   mkdir .baseline && git archive main tilekit benchmarks tuning_db | tar -x -C .baseline
#   source .gpu/setup.sh && python3 -m tilekit tune --stale shipped && scripts/gpu-decode-ab.sh gpt2 gpt2-xl
# (.baseline/ is not tracked: name it in the device tool's carry.)
# Caution: the two trees run in separate processes, and the dependent-launch step time has moved 10% between
# processes with no kernel or config change (docs/results/gemv-decode-h100.txt); confirm a small difference by
# comparing the variants inside one process.
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"; out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1
[ -d .baseline/tilekit ] || { echo "gpu-decode-ab: .baseline/ holds no tilekit checkout" >&2; exit 2; }
models=()
for m in "${@:-gpt2}"; do models+=(--model "$m"); done
status=0
# from inside .baseline/: `python -m` puts the current directory first on sys.path, so its tilekit is the one imported
(cd .baseline && python3 -m benchmarks.breakdown "${models[@]}" --batch 1 --out "$out/ab-baseline" \
    > "$out/ab-baseline.txt" 2>&1) || status=1
python3 -m benchmarks.breakdown "${models[@]}" --batch 1 --out "$out/ab-this" > "$out/ab-this.txt" 2>&1 || status=1
grep -H -E "^\[breakdown|^kernels" "$out/ab-baseline.txt" "$out/ab-this.txt"
exit $status
