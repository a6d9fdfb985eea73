#!/usr/bin/env bash
# On the GPU machine, from the repository root: build every CUDA target, run
# every CUDA test (ctest -L cuda), the operator benchmarks and their PyTorch
# peers (bench/ops_vs_torch.py). Logs and JSON go to $OUT (default ./out).
#
#   bench/cuda_ops_device.sh [build] [test] [bench] [torch]   (default: all four)
#   TESTS=regex: only those CUDA tests; BENCHES="bench_cuda_linear ...": only those
#
# The cuDNN attention is built when cuDNN and the cudnn-frontend headers are
# found (docs/cuda.md): on a machine without network access bring the
# frontend wheel in .whl/ (pip download --no-deps -d .whl
# nvidia-cudnn-frontend==1.32.0); the build log's "cuDNN attention" line says
# which. bench_cuda_attention times every kind (flash, cudnn, cudnn-fast) and
# the torch step prints them side by side with torch SDPA (cuDNN and flash).
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
steps=${*:-build test bench torch}
has() { [[ " $steps " == *" $1 "* ]]; }
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"

if has build; then
    echo "== build ($BUILD)"
    timeout 500 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
        timeout 500 cmake --build "$BUILD" -j "$JOBS" >>"$OUT/build.log" 2>&1
    rc=$?
    grep -E "longmoe: (CUDA kernels|cuDNN attention)" "$OUT/build.log"
    [ $rc -ne 0 ] && { echo "build failed (rc $rc)"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
fi

if has test; then
    echo "== CUDA tests"
    (cd "$BUILD" && timeout 400 ctest -L cuda ${TESTS:+-R "$TESTS"} -V) >"$OUT/test.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    grep -E "^[0-9]+: (ok|FAIL|skip|  )|passed, .* failed|tests passed|tests failed|\*\*\*|CUDA ERROR" "$OUT/test.log" |
        cut -c1-170 | tail -120
    echo "ctest rc $rc"
fi

if has bench; then
    for b in ${BENCHES:-bench_cuda_linear bench_cuda_attention bench_cuda_moe bench_cuda_attnres bench_cuda_kda_layer}; do
        [ -x "$BUILD/$b" ] || continue
        echo "== $b"
        timeout 300 "$BUILD/$b" --out "$OUT/$b.json" 2>&1 | tail -30
    done
fi

if has torch; then
    echo "== PyTorch peers"
    ours=()
    for f in "$OUT"/bench_cuda_*.json; do [ -f "$f" ] && ours+=(--ours "$f"); done
    PYTHONUNBUFFERED=1 timeout 240 python3 bench/ops_vs_torch.py --out "$OUT/torch.json" "${ours[@]}" 2>&1 | tail -60
fi
exit $status
