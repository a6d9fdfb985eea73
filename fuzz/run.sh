#!/usr/bin/env bash
# Run each libFuzzer harness for SECONDS on its corpus (fuzz/corpus/<name>/,
# the seeds and every regression input; new inputs the fuzzer finds go to a
# scratch copy, not the repository). Usage: fuzz/run.sh [SECONDS] [BUILD_DIR] [NAMES...]
# (default 30 s each, build-fuzz, every harness built there). Crashing inputs are
# kept in BUILD_DIR/crashes/<name>/. FUZZ_SEED fixes libFuzzer's random seed (the
# same inputs are tried in the same order on the same code; default: a new seed
# each run). Exit status: non-zero if any harness failed.
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-30}
OUT=${2:-build-fuzz}
shift 2 2>/dev/null || shift $#
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for b in "$OUT"/fuzz_*; do [ -x "$b" ] && names+=("$(basename "$b" | sed 's/^fuzz_//')"); done
fi
export OMP_NUM_THREADS=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
failed=0
for name in "${names[@]}"; do
    bin="$OUT/fuzz_$name"
    [ -x "$bin" ] || { echo "fuzz/run.sh: $bin not built (fuzz/build.sh $OUT)"; failed=1; continue; }
    scratch="$OUT/corpus-work/$name"
    mkdir -p "$scratch" "$OUT/crashes/$name"
    log="$OUT/fuzz_$name.log"
    # replay the committed corpus (seeds and regression inputs), then explore
    "$bin" ${FUZZ_SEED:+-seed="$FUZZ_SEED"} -max_total_time="$SECONDS_EACH" -timeout=25 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
        -artifact_prefix="$OUT/crashes/$name/" "$scratch" "fuzz/corpus/$name" > "$log" 2>&1
    rc=$?
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -n 1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
    if [ $rc -eq 0 ]; then
        echo "fuzz_$name: ${SECONDS_EACH}s, ${execs:-?} executions, $cov, no crash"
    else
        echo "fuzz_$name: FAILED (exit $rc) after ${execs:-?} executions; log $log, input in $OUT/crashes/$name/"
        grep -E 'ERROR|SUMMARY|runtime error' "$log" | head -n 5
        failed=1
    fi
done
exit $failed
