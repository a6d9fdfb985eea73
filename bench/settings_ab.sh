#!/usr/bin/env bash
# On the GPU machine, from the repository root: the whole training step of this tree under
# several environment settings side by side, from one build. Builds bench_cuda_model (Release,
# $BUILD), then runs it ROUNDS times through every setting in turn (round 1: each setting
# once, round 2: again, ...), so that a drift of the machine shows in every setting alike.
# Stops starting runs once GUARD seconds have passed since the script began (a device call
# has a time limit; what ran is in the log). Logs go to $OUT/settings_ab.log.
#
#   SETTINGS="default: by-row:LONGMOE_MOE_ROWS=by-row direct:LONGMOE_ATTNRES_BWD=direct" \
#       bench/settings_ab.sh
#   SETTINGS  space-separated name:VAR=value[,VAR=value...] (an empty list after the colon:
#             no setting); default: the line above
#   ARGS      bench_cuda_model's arguments (default: k3-mini, batch 8 on a GPU of at least
#             120000 MiB, else 4, 4096-token rows, 3 reps, no recompute)
#   ROUNDS    rounds (default 2); GUARD seconds (default 400); BUILD (default build-ab-new);
#             BUILT=1: the binary is built already
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-ab-new}
ROUNDS=${ROUNDS:-2}
GUARD=${GUARD:-400}
JOBS=${JOBS:-$(nproc)}
SETTINGS=${SETTINGS:-default: by-row:LONGMOE_MOE_ROWS=by-row direct:LONGMOE_ATTNRES_BWD=direct}
mkdir -p "$OUT"
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
if [ -z "${ARGS:-}" ]; then
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
    batch=8
    [ "${mem:-0}" -lt 120000 ] && batch=4
    ARGS="--config configs/k3-mini.json --batch $batch --seq 4096 --reps 3 --no-recompute"
fi
for s in $SETTINGS; do
    case $s in
    *:*) ;;
    *) echo "settings_ab: '$s' is not name:VAR=value[,VAR=value...]" >&2; exit 2 ;;
    esac
done
if [ "${BUILT:-0}" != 1 ]; then
    (timeout 500 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/settings_build.log" 2>&1 &&
        timeout 500 cmake --build "$BUILD" -j "$JOBS" --target bench_cuda_model >>"$OUT/settings_build.log" 2>&1) ||
        { echo "settings_ab: build failed"; grep -E "error" "$OUT/settings_build.log" | head -20; exit 1; }
fi
[ -x "$BUILD/bench_cuda_model" ] || { echo "settings_ab: $BUILD/bench_cuda_model is missing" >&2; exit 1; }
echo "settings_ab: $ARGS (build done at $(elapsed) s)" | tee "$OUT/settings_ab.log"
for r in $(seq 1 "$ROUNDS"); do
    for s in $SETTINGS; do
        if [ "$(elapsed)" -gt "$GUARD" ]; then
            echo "settings_ab: stopped at $(elapsed) s (GUARD $GUARD)" | tee -a "$OUT/settings_ab.log"
            exit 0
        fi
        name=${s%%:*}
        vars=${s#*:}
        echo "== round $r: $name (${vars:-no setting}) at $(elapsed) s" | tee -a "$OUT/settings_ab.log"
        env ${vars//,/ } timeout 150 "$BUILD/bench_cuda_model" $ARGS 2>&1 | grep -vE "^ *$" | tail -12 |
            tee -a "$OUT/settings_ab.log"
    done
done
