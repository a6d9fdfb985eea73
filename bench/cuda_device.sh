#!/usr/bin/env bash
# On the GPU machine, from the repository root: build the CUDA targets, check
# the SASS for tensor-core instructions, run the CUDA tests, time our kernels
# and fla-core's chunk_kda, and print the comparison table last.
#
#   bench/cuda_device.sh [build] [sass] [test] [bench] [ncu] [stalls] [srcstalls] [srclines] [fla]
#   (default: build sass test bench fla; NCU_KERNELS: regex of the kernels ncu profiles;
#   FLA_AUTOTUNE_MS=W,R: shorter Triton autotuning for fla, FLA_TIMEOUT: seconds for fla;
#   STALL_KERNELS, STALL_COUNT: the kernels (regex) and launches whose stalls are shown;
#   srcstalls: stall samples per SASS instruction of the first STALL_KERNELS launch, summarised
#   by bench/ncu_source_summary.py; srclines: the same per CUDA source line (a -lineinfo build);
#   FLA_SHAPES="B,T,H,D ...": fla's shapes (default all three); FLA_PRIOR: fla JSON files of an
#   earlier call of this session, merged into the table;
#   NCU_FLAGS: more ncu options, e.g. --cache-control none to keep L2 between kernels;
#   NCU_SHAPE=B,T,H,D: the shape of every ncu step, default 1,8192,64,128)
#
# Logs and JSON go to $OUT (default ./out). fla-core comes from wheels in .whl/
# (pip download --no-deps fla-core; the machine has no network), installed
# into /tmp/site. BUILD (default build-cuda) names the build directory.
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
NCU_SHAPE=${NCU_SHAPE:-1,8192,64,128}
mkdir -p "$OUT"
steps=${*:-build sass test bench fla}
has() { [[ " $steps " == *" $1 "* ]]; }
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv \
    2>&1 | tee "$OUT/gpu.txt"

if has build; then
    echo "== build ($BUILD)"
    timeout 400 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
        timeout 400 cmake --build "$BUILD" -j "$JOBS" --target test_cuda_kda test_cuda_op_kda \
            bench_cuda_kda longmoe >>"$OUT/build.log" 2>&1
    rc=$?
    grep -E "registers|spill|error" "$OUT/build.log" | grep -B1 -E "spill|error" | head -40
    [ $rc -ne 0 ] && { echo "build failed (rc $rc): see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
fi

if has sass; then
    echo "== SASS: tensor-core instructions per kernel"
    cuobjdump --dump-sass "$BUILD/test_cuda_kda" >"$OUT/sass_full.txt" 2>&1
    awk '/Function :/ {f=$3} /HMMA/ {h[f]++} /HGMMA/ {g[f]++}
         END {for (k in h) printf "%-70s HMMA %5d HGMMA %d\n", k, h[k], g[k]}' \
        "$OUT/sass_full.txt" | sort | tee "$OUT/sass_summary.txt"
    rm -f "$OUT/sass_full.txt"
fi

if has test; then
    echo "== CUDA tests (make test-cuda: every test labelled cuda)"
    # -V keeps the per-case errors that the tests print
    (cd "$BUILD" && timeout 300 ctest -L cuda -V) >"$OUT/test.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    grep -E "^[0-9]+: (ok|FAIL|  )|tests passed|tests failed|\*\*\*" "$OUT/test.log" | cut -c1-150 | tail -70
    echo "ctest rc $rc"
fi

if has bench; then
    echo "== our kernels"
    timeout 300 "$BUILD/bench_cuda_kda" --out "$OUT/ours.json" --reps 20 2>&1 | tee "$OUT/bench_ours.log"
fi

if has ncu; then
    echo "== ncu: time, throughput and occupancy per kernel, shape ($NCU_SHAPE), bounded then softplus"
    timeout 240 ncu --clock-control none ${NCU_FLAGS:-} --section SpeedOfLight --section Occupancy \
        -k "regex:${NCU_KERNELS:-kda_}" "$BUILD/bench_cuda_kda" --profile --shape "$NCU_SHAPE" \
        >"$OUT/ncu.log" 2>&1
    grep -E "kda_[a-z_]+kernel|Duration|Memory Throughput|Compute \(SM\) Throughput|Theoretical Occ|Achieved Occ|Block Limit (Shared|Reg)" \
        "$OUT/ncu.log" | sed -E 's/\(Params.*//; s/ +/ /g' | head -90
fi

if has stalls; then
    echo "== ncu: warp stall reasons of ${STALL_KERNELS:-kda_bwd_col} (bounded)"
    timeout 240 ncu --clock-control none --section WarpStateStats --section SchedulerStats \
        -k "regex:${STALL_KERNELS:-kda_bwd_col}" --launch-count "${STALL_COUNT:-1}" \
        "$BUILD/bench_cuda_kda" --profile --shape "$NCU_SHAPE" >"$OUT/ncu_stalls.log" 2>&1
    grep -vE "^==PROF==|^ *$|----" "$OUT/ncu_stalls.log" | tail -"${STALL_LINES:-40}"
fi

if has srcstalls; then
    echo "== ncu: stall samples per SASS instruction of ${STALL_KERNELS:-kda_bwd_col} (first launch: bounded)"
    timeout 240 ncu --clock-control none --section SourceCounters --section WarpStateStats \
        -k "regex:${STALL_KERNELS:-kda_bwd_col}" --launch-count 1 --page source --csv \
        --print-source sass "$BUILD/bench_cuda_kda" --profile --shape "$NCU_SHAPE" \
        >"$OUT/ncu_source.csv" 2>"$OUT/ncu_source.err"
    python3 bench/ncu_source_summary.py "$OUT/ncu_source.csv" --top "${STALL_LINES:-20}" ||
        { status=1; tail -5 "$OUT/ncu_source.err"; }
fi

if has srclines; then
    # the same samples per CUDA source line: a second build with -lineinfo in $BUILD-lineinfo
    echo "== ncu: stall samples per source line of ${STALL_KERNELS:-kda_bwd_col} (first launch: bounded)"
    LB="$BUILD-lineinfo"
    if timeout 400 cmake -S . -B "$LB" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS=-lineinfo \
            >"$OUT/build_lineinfo.log" 2>&1 &&
        timeout 400 cmake --build "$LB" -j "$JOBS" --target bench_cuda_kda \
            >>"$OUT/build_lineinfo.log" 2>&1; then
        timeout 240 ncu --clock-control none --section SourceCounters --section WarpStateStats \
            -k "regex:${STALL_KERNELS:-kda_bwd_col}" --launch-count 1 --page source --csv \
            --print-source cuda,sass "$LB/bench_cuda_kda" --profile --shape "$NCU_SHAPE" \
            >"$OUT/ncu_lines.csv" 2>"$OUT/ncu_lines.err"
        python3 bench/ncu_source_summary.py "$OUT/ncu_lines.csv" --top "${STALL_LINES:-20}" ||
            { status=1; tail -5 "$OUT/ncu_lines.err"; }
    else
        echo "lineinfo build failed: $OUT/build_lineinfo.log"
        status=1
    fi
fi

if has fla; then
    echo "== fla-core chunk_kda"
    wheels=$(ls .whl/*.whl 2>/dev/null | grep -v nvidia_cudnn_frontend) # that one: C++ headers for CMake
    if [ -n "$wheels" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site $wheels >"$OUT/pip.log" 2>&1 || echo "pip install failed: $OUT/pip.log"
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    ours=()
    [ -f "$OUT/ours.json" ] && ours=(--ours "$OUT/ours.json")
    extra=()
    for sh in ${FLA_SHAPES:-}; do extra+=(--shape "$sh"); done
    for f in ${FLA_PRIOR:-}; do extra+=(--prior "$f"); done
    PYTHONUNBUFFERED=1 timeout "${FLA_TIMEOUT:-420}" python3 bench/kda_vs_fla.py "${ours[@]}" --out "$OUT/fla.json" \
        ${FLA_AUTOTUNE_MS:+--autotune-ms "$FLA_AUTOTUNE_MS"} "${extra[@]}" \
        --reps 20 2>&1 | tee "$OUT/bench_fla.log"
fi
exit $status
