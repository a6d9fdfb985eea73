#!/usr/bin/env bash
# On the GPU machine, from the repository root: the whole training step of this tree
# against another version of it, side by side in one run. BASE is a directory holding the
# other version's sources (for example `git archive OLD | tar -x -C DIR`); both are built
# (Release, their own build directories), then bench_cuda_model runs ROUNDS times
# alternately, new then base, and the MoE layer bench once each. Logs go to $OUT.
#
#   BASE=dir bench/step_ab.sh
#   ARGS     bench_cuda_model's arguments (default: k3-mini 8x4096, no recompute, 3 reps)
#   ROUNDS   alternations (default 2)
#   NEW_ENV  environment settings for the new side only, e.g. "LONGMOE_PART_TIMING=events";
#            with BASE=. both sides run this tree's build, so the settings are all that differs
#   NEW      the directory of the new version's sources (default: this tree)
#   DIGEST=1 both sides print the last step's loss bits and a hash of every gradient's bits
#            (bench_cuda_model --digest, which the base must know in the same form: lm_checksum64
#            since the thirty-third session, an FNV-1a over bytes before), and the script says
#            whether every run gave the same (a change meant to keep the bits)
#   PREBUILT=1 build nothing: build-ab-new (and build-ab-base unless BASE=.) already hold
#            bench_cuda_model (and bench_cuda_moe, else the MoE layer bench is left out), built
#            beforehand with the same toolkit (a Release build of this tree: `cmake -S . -B
#            build-ab-new -DCMAKE_BUILD_TYPE=Release && cmake --build build-ab-new --target
#            bench_cuda_model`), so a machine without the build's time runs the comparison at once
set -uo pipefail
OUT=${OUT:-out}
BASE=${BASE:?BASE: the directory of the other version}
ROUNDS=${ROUNDS:-2}
ARGS=${ARGS:---config configs/k3-mini.json --batch 8 --seq 4096 --reps 3 --no-recompute}
[ "${DIGEST:-0}" = 1 ] && ARGS="$ARGS --digest"
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
build() { # src dir, build dir, log
    (timeout 500 cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release >"$3" 2>&1 &&
        timeout 500 cmake --build "$2" -j "$JOBS" --target bench_cuda_model bench_cuda_moe >>"$3" 2>&1) ||
        { echo "build of $1 failed"; grep -E "error" "$3" | head -20; return 1; }
}
[ -d .whl ] && [ ! -e "$BASE/.whl" ] && cp -r .whl "$BASE/"
NEW_ENV=${NEW_ENV:-}
NEW=${NEW:-.}
[ -d .whl ] && [ ! -e "$NEW/.whl" ] && cp -r .whl "$NEW/"
bin_base=build-ab-base
[ "$BASE" = . ] && bin_base=build-ab-new
bin_of() { [ "$1" = new ] && echo build-ab-new || echo "$bin_base"; } # new | base
if [ "${PREBUILT:-0}" = 1 ]; then
    for d in build-ab-new "$bin_base"; do
        [ -x "$d/bench_cuda_model" ] || { echo "PREBUILT=1: $d/bench_cuda_model is missing"; exit 1; }
    done
else
    build "$NEW" build-ab-new "$OUT/build_new.log" || exit 1
    [ "$BASE" = . ] || build "$BASE" build-ab-base "$OUT/build_base.log" || exit 1
    grep -E "longmoe: (CUDA kernels|cuDNN attention)" "$OUT"/build_*.log
fi
for r in $(seq 1 "$ROUNDS"); do
    for v in new base; do
        echo "== round $r: $v${NEW_ENV:+$([ $v = new ] && echo " ($NEW_ENV)")}"
        (cd "$([ $v = new ] && echo "$NEW" || echo "$BASE")" &&
            env $([ $v = new ] && echo "$NEW_ENV") timeout 300 \
                "$OLDPWD/$(bin_of $v)/bench_cuda_model" $ARGS) 2>&1 |
            grep -vE "^ *$" | tail -15 | tee "$OUT/ab_${r}_$v.log"
    done
done
if [ "${DIGEST:-0}" = 1 ]; then
    n=$(cat "$OUT"/ab_*_*.log | grep -c "^digest:")
    u=$(cat "$OUT"/ab_*_*.log | grep "^digest:" | sort -u | wc -l)
    if [ "$n" -ne $((2 * ROUNDS)) ]; then echo "digest: $n of $((2 * ROUNDS)) runs printed one"
    elif [ "$u" -eq 1 ]; then echo "digest: the same loss and gradient bits in all $n runs"
    else echo "digest: the runs differ ($u different digests)"; fi
fi
for v in new base; do
    [ -x "$(bin_of $v)/bench_cuda_moe" ] || continue
    echo "== MoE layer, $v"
    env $([ $v = new ] && echo "$NEW_ENV") timeout 200 \
        "$(bin_of $v)/bench_cuda_moe" --tokens 32768 --gemm batched 2>&1 |
        tail -4
done
