#!/usr/bin/env bash
# On a GPU host: eager host overhead of this tilekit and of the checkout in .baseline/ (the same run),
# the per-kernel decode breakdown, then the quick benchmark suite; the summary table prints last.
#   source .gpu/setup.sh && scripts/gpu-bench.sh
set -uo pipefail
out="${OUT:-/tmp/tilekit-gpu}"; mkdir -p "$out"; out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1
if [ -d .baseline/tilekit ]; then    # run from inside it: `python -m` puts the current directory first on sys.path
    (cd .baseline && python3 -m benchmarks --only overhead --no-plots \
        --out "$out/overhead-baseline" > "$out/overhead-baseline.txt" 2>&1)
fi
python3 -m benchmarks --only overhead --no-plots --out "$out/overhead" > "$out/overhead.txt" 2>&1
python3 -m benchmarks.studies.breakdown --out "$out" > "$out/breakdown.txt" 2>&1
# The kernel suite's cases tuned first (its plain matmuls are keys no model tunes), into the user database it reads.
python3 -m benchmarks.studies.space_ab --axis linear:PERSISTENT --axis attention:LONGEST_FIRST > "$out/space-ab.txt" 2>&1
python3 -m benchmarks --quick --out "$out/bench" 2> "$out/bench.log"
status=$?
tail -n 25 "$out/breakdown.txt"; tail -n 30 "$out/overhead.txt"; tail -n 30 "$out/overhead-baseline.txt" 2>/dev/null
exit $status
