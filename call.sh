#!/usr/bin/env bash
# session-21 device call: tests, then stale re-tune, then a study part (args: TESTS_S TUNE_S STUDY_S STUDY_ARGS...)
source .gpu/setup.sh
export PYTHONUNBUFFERED=1 TILEKIT_CACHE_DIR=/tmp/tk
t_tests=$1 t_tune=$2 t_study=$3; shift 3
mkdir -p $OUT/t
if [ "$t_tests" -gt 0 ]; then
  OUT=$OUT/t WORKERS=${WORKERS:-10} timeout $t_tests scripts/gpu-tests.sh ${TESTS:-tests} | tail -30
fi
if [ "$t_tune" -gt 0 ]; then
  timeout $t_tune python3 -m tilekit tune --stale shipped > $OUT/tune.txt 2>&1; echo "tune rc $?"
  grep -E "^tuned|rejected|already" $OUT/tune.txt | tail -5
  cp $TILEKIT_CACHE_DIR/tuning/sm_*/*.json $OUT/ 2>/dev/null
  python3 -m tilekit db verify | tail -1
fi
if [ -n "${CHECK_KERNEL:-}" ]; then
  timeout 120 python3 -m tilekit db check --kernel $CHECK_KERNEL --retune > $OUT/check.txt 2>&1; echo "check rc $?"
  tail -3 $OUT/check.txt; cp $TILEKIT_CACHE_DIR/tuning/sm_*/*.json $OUT/ 2>/dev/null
fi
if [ "$t_study" -gt 0 ]; then
  timeout $t_study python3 -m "$@" --out $OUT > $OUT/study.txt 2>&1; echo "study rc $?"
  tail -40 $OUT/study.txt
fi
