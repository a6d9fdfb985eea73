#!/usr/bin/env bash
# On the GPU machine, from the repository root: one sequence of 64K, 256K and 1M tokens of
# configs/k3-mini.json (B = 1) through forward, backward and the device optimizer's step
# (bench_cuda_model --optimizer), with train.recompute_chunk; for each length first the
# memory plan (longmoe plan --memory --device cuda: every buffer by name, no GPU needed),
# then the run when the plan fits the GPU's free memory. Prints tokens/s and the device
# memory in use after the steps (the peak: buffers only grow) beside the plan's total.
#
#   bench/long_device.sh [build] [test] [long]   (default: build test long)
#
#   test         test_cuda_model (the chunked and the segmented model against the CPU and
#                against itself whole, among the rest) and the CPU's test_model_chunk and
#                test_model_seg
#   long         the lengths in LENGTHS (default "65536 262144 1048576"), REPS timed steps each
#                after one warm-up step (default 1), CHUNK tokens per chunk (default 16384),
#                SEGMENT tokens per sequence segment (train.seq_segment; default 0: off);
#                RECOMPUTE=0 turns train.recompute off (and CHUNK to 0): with segments the
#                activations are one segment's, and the forward then runs twice a step, not
#                three times; RECOMPUTE=channel recomputes the MoE and dense FFN alone,
#                RECOMPUTE=token the KDA and attention alone (CHUNK 0); REPS=0 times the
#                first step alone;
#                FORCE=1 runs a length even when its plan exceeds the free memory (to see
#                where it fails). The attention's backward follows LONGMOE_ATTENTION_BWD
#                (docs/cuda.md: auto, cudnn, cudnn-fast, cudnn-blocked, flash), e.g.
#                RECOMPUTE=0 SEGMENT=16384 REPS=0 LENGTHS=1048576 \
#                LONGMOE_ATTENTION_BWD=cudnn-blocked bench/long_device.sh build long
#
# Writes $OUT (default ./out): build.log, test.log, plan_<T>.txt and .json (the tables),
# long_<T>.json (bench_cuda_model's results) and long.json (one record a length: planned GiB,
# measured GiB, tokens/s, or why it was not run). BUILD (default build-cuda) names the build
# directory. A 1M-token step takes on the order of a minute or two (four full-attention
# layers are quadratic); the whole script stays within about 5 minutes on an H200 when a
# length does not fit and is skipped.
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
CONFIG=${CONFIG:-configs/k3-mini.json}
LENGTHS=${LENGTHS:-65536 262144 1048576}
REPS=${REPS:-1}
CHUNK=${CHUNK:-16384}
SEGMENT=${SEGMENT:-0}
RECOMPUTE=${RECOMPUTE:-1}
FORCE=${FORCE:-0}
mkdir -p "$OUT"
steps=${*:-build test long}
has() { [[ " $steps " == *" $1 "* ]]; }
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee "$OUT/gpu.txt"

if has build; then
    echo "== build ($BUILD)"
    timeout 500 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
        timeout 500 cmake --build "$BUILD" -j "$JOBS" --target longmoe bench_cuda_model test_cuda_model \
            test_model_chunk test_model_seg >>"$OUT/build.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && { echo "build failed (rc $rc): see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
fi

if has test; then
    echo "== test_model_chunk, test_model_seg, test_cuda_model"
    { timeout 300 "$BUILD/test_model_chunk" && timeout 300 "$BUILD/test_model_seg" &&
        timeout 600 "$BUILD/test_cuda_model"; } >"$OUT/test.log" 2>&1
    rc=$?
    grep -E "^(ok|FAIL|skip)|passed|unchunked|chunked|segment" "$OUT/test.log"
    [ $rc -ne 0 ] && { echo "tests failed (rc $rc): see $OUT/test.log"; status=1; }
fi

if has long; then
    # train.recompute of the runs (plan and bench alike): 0/false, 1/true, channel or token; the chunk needs
    # the channel mixers recomputed
    case "$RECOMPUTE" in
    0 | false | none) rmode=false CHUNK=0 ;;
    1 | true | all) rmode=true ;;
    channel) rmode=channel ;;
    token) rmode=token CHUNK=0 ;;
    *) echo "RECOMPUTE must be 0, 1, channel or token, got '$RECOMPUTE'" >&2; exit 2 ;;
    esac
    # free device memory now, in GiB (the plan must fit it, with 2 GiB for the context and cuBLAS)
    free_gib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1 | awk '{print $1/1024}')
    echo "== long sequences of $CONFIG, B = 1, recompute $rmode, recompute_chunk $CHUNK, seq_segment $SEGMENT," \
         "attention backward ${LONGMOE_ATTENTION_BWD:-auto} (free device memory ${free_gib} GiB)"
    records=()
    for T in $LENGTHS; do
        "$BUILD/longmoe" plan --memory --config "$CONFIG" --batch 1 --seq "$T" --device cuda \
            --recompute "$rmode" --recompute-chunk "$CHUNK" --seq-segment "$SEGMENT" --json "$OUT/plan_$T.json" \
            >"$OUT/plan_$T.txt" 2>&1 ||
            { echo "T=$T: plan failed"; cat "$OUT/plan_$T.txt"; status=1; continue; }
        plan_gib=$(awk '/^total /{print $2}' "$OUT/plan_$T.txt")
        echo "-- T=$T: the plan asks ${plan_gib} GiB (largest buffers:)"
        awk 'NR > 3 && !/^total/ && !/^\(/ && NF > 2 {g = $(NF - 1); n = $0; sub(/ +[0-9.]+ +[0-9.]+%$/, "", n);
             printf "%s\t%s\n", g, n}' "$OUT/plan_$T.txt" | sort -g -r | head -6 |
            awk -F'\t' '{printf "     %8.2f GiB  %s\n", $1, $2}'
        if [ "$FORCE" != 1 ] && awk -v p="$plan_gib" -v f="$free_gib" 'BEGIN{exit !(p + 2 > f)}'; then
            echo "   does not fit: ${plan_gib} GiB planned, ${free_gib} GiB free; not run"
            records+=("{\"T\": $T, \"plan_gib\": $plan_gib, \"run\": false, \"why\": \"plan exceeds free memory\"}")
            continue
        fi
        timeout 570 "$BUILD/bench_cuda_model" --config "$CONFIG" --batch 1 --seq "$T" --reps "$REPS" \
            --recompute "$rmode" --recompute-chunk "$CHUNK" --seq-segment "$SEGMENT" --optimizer --out "$OUT/long_$T.json" \
            >"$OUT/long_$T.txt" 2>&1
        rc=$?
        cat "$OUT/long_$T.txt"
        if [ $rc -ne 0 ]; then
            echo "   T=$T failed (rc $rc)"
            status=1
            records+=("{\"T\": $T, \"plan_gib\": $plan_gib, \"run\": false, \"why\": \"bench_cuda_model rc $rc\"}")
        else
            records+=("{\"T\": $T, \"plan_gib\": $plan_gib, \"run\": true, \"result\": $(cat "$OUT/long_$T.json")}")
        fi
    done
    { echo "{\"config\": \"$CONFIG\", \"recompute_chunk\": $CHUNK, \"seq_segment\": $SEGMENT, \"free_gib\": $free_gib, \"lengths\": ["
      (IFS=,; echo "${records[*]}")
      echo "]}"; } >"$OUT/long.json"
    echo "results: $OUT/long.json"
fi
exit $status
