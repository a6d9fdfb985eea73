#!/usr/bin/env bash
# On the GPU machine, from the repository root: everything a training step runs,
# in one call. Builds every target, runs every CUDA test, then the benchmarks of
# the step's parts at k3-mini shapes (MoE layer with each kind of expert product,
# the optimizer, the memory-bound kernels, the whole forward+backward) and the
# torch._grouped_mm peer of the MoE layer. Logs and JSON go to $OUT (default ./out).
#
#   bench/step_device.sh [build] [test] [bench] [peer]   (default: all four)
#   TARGETS="a b"     build only these targets (default: all)
#   TESTS=regex       only those CUDA tests (default: all, ctest -L cuda)
#   TEST_JOBS=n       CUDA test programs at once on the GPU (default 1); TEST_LIMIT=seconds (400)
#   BENCHES="..."     which benchmarks (default: moe optim model kda_layer linear attnres; also
#                     attnws: k3-mini 1x32768 under three attention backward workspace settings;
#                     moeep: the MoE layer, batched, without balancing, and through the
#                     expert-parallel layer on one NCCL rank; kdacp: what the KDA layer's
#                     context parallelism runs on a rank after the first, both forms)
#   MODEL_SHAPES="8,4096 1,32768"   the whole-model shapes (bench_cuda_model)
#   LIMIT=seconds     per program (default 240)
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
LIMIT=${LIMIT:-240}
BENCHES=${BENCHES:-moe optim model kda_layer linear attnres}
MODEL_SHAPES=${MODEL_SHAPES:-8,4096}
mkdir -p "$OUT"
steps=${*:-build test bench peer}
has() { [[ " $steps " == *" $1 "* ]]; }
status=0
t_all=$(date +%s)
stamp() { echo "   ($(( $(date +%s) - t_all )) s since the start)"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"

if has build; then
    echo "== build ($BUILD)"
    timeout 500 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
        timeout 500 cmake --build "$BUILD" -j "$JOBS" ${TARGETS:+--target $TARGETS} >>"$OUT/build.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && { echo "build failed (rc $rc)"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
    stamp
fi

if has test; then
    echo "== CUDA tests (mpirun for the staged GPU-rank cases: $(command -v mpirun || echo none))"
    (cd "$BUILD" && timeout "${TEST_LIMIT:-400}" ctest -L cuda ${TESTS:+-R "$TESTS"} -j "${TEST_JOBS:-1}" -V) \
        >"$OUT/test.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    grep -E "^[0-9]+: (ok|FAIL|skip|  )|passed, .* failed|tests passed|tests failed|\*\*\*|CUDA ERROR|Test +#" \
        "$OUT/test.log" | cut -c1-200 | tail -150
    echo "ctest rc $rc"
    stamp
fi

run_bench() { # name, args...
    local name=$1
    shift
    [ -x "$BUILD/$name" ] || { echo "$name: not built"; return; }
    echo "== $name $*"
    timeout "$LIMIT" "$BUILD/$name" "$@" 2>&1 | tail -40
    stamp
}

if has bench; then
    for b in $BENCHES; do
        case $b in
        moe) run_bench bench_cuda_moe --tokens 32768 --out "$OUT/moe_32768.json" ;;
        kdacp) run_bench bench_cuda_kda_cp --tokens 32768 --reps 10 --out "$OUT/kda_cp.json" ;;
        optim) run_bench bench_cuda_optim --config configs/k3-mini.json --reps 5 --host-reps 0 --out "$OUT/optim.json" ;;
        model)
            for shape in $MODEL_SHAPES; do
                run_bench bench_cuda_model --config configs/k3-mini.json --batch "${shape%,*}" --seq "${shape#*,}" \
                    --reps 5 --out "$OUT/model_${shape/,/x}.json"
            done
            ;;
        attnws)
            # 1x32768 without recompute holds 117-132 GiB: an H200's memory, not an H100's
            mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
            if [ "${mem:-0}" -lt 120000 ]; then echo "attnws: skipped (${mem} MiB of GPU memory; it needs an H200)"; continue; fi
            # k3-mini 1x32768 (no recompute, no segments) under each attention backward setting:
            # the default (blocked, blocks of 8192), blocks of 16384 with a 6 GiB limit, the whole
            # deterministic backward (a 20 GiB limit); LONGMOE_CUDNN_BLOCK:LONGMOE_CUDNN_WORKSPACE_MB
            for ws in default 16384:6144 8192:20480; do
                echo "== 1x32768, attention backward setting $ws"
                if [ "$ws" = default ]; then
                    run_bench bench_cuda_model --config configs/k3-mini.json --batch 1 --seq 32768 --reps 3 \
                        --no-recompute --seq-segment 0 --out "$OUT/model_1x32768_ws_default.json"
                else
                    LONGMOE_CUDNN_BLOCK=${ws%:*} LONGMOE_CUDNN_WORKSPACE_MB=${ws#*:} run_bench bench_cuda_model \
                        --config configs/k3-mini.json --batch 1 --seq 32768 --reps 3 --no-recompute \
                        --seq-segment 0 --out "$OUT/model_1x32768_ws_${ws/:/_}.json"
                fi
            done
            ;;
        moeep) run_bench bench_cuda_moe --gemm batched --no-balance --reps 10 --ep --out "$OUT/bench_cuda_moe_ep.json" ;;
        *) run_bench "bench_cuda_$b" --out "$OUT/bench_cuda_$b.json" ;;
        esac
    done
fi

if has peer; then
    echo "== the torch._grouped_mm MoE layer (bench/moe_vs_torch.py)"
    ours=()
    for f in "$OUT"/moe_*.json; do [ -f "$f" ] && ours+=(--ours "$f"); done
    PYTHONUNBUFFERED=1 timeout "$LIMIT" python3 bench/moe_vs_torch.py --tokens 32768 --out "$OUT/moe_torch.json" \
        "${ours[@]}" 2>&1 | tail -30
    stamp
fi
exit $status
