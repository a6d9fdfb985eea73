#!/usr/bin/env bash
# On the GPU machine, from the repository root: the blocked deterministic cuDNN
# attention backward (docs/cuda.md, "The blocked backward"): its parity tests,
# its speed next to the other kinds, and the k3-mini step at one 32K sequence
# and one 256K sequence in segments, where auto now takes it. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
mkdir -p "$OUT"
status=0
timeout 400 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    timeout 400 cmake --build "$BUILD" -j "$(nproc)" \
        --target test_cuda_attention bench_cuda_attention bench_cuda_model >>"$OUT/build.log" 2>&1 ||
    { echo "build failed"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
grep -E "cuDNN attention" "$OUT/build.log" | head -2
echo "== test_cuda_attention"
timeout 200 "$BUILD/test_cuda_attention" >"$OUT/test_attention.log" 2>&1 || status=1
grep -E "^(ok|FAIL|  )|passed|failed|skipped" "$OUT/test_attention.log" | cut -c1-160 | tail -30
echo "== bench_cuda_attention (every kind)"
timeout 150 "$BUILD/bench_cuda_attention" --reps 10 --shape 1,8192,8,128 --shape 1,32768,8,128 \
    --shape 8,4096,8,128 --out "$OUT/attention.json" 2>&1 | tee "$OUT/bench_attention.log" | tail -30
echo "== bench_cuda_attention cudnn-blocked, LONGMOE_CUDNN_BLOCK=16384"
LONGMOE_CUDNN_BLOCK=16384 timeout 60 "$BUILD/bench_cuda_attention" --reps 10 --kind cudnn-blocked \
    --shape 1,32768,8,128 2>&1 | tail -6
for len in ${LENGTHS:-32768 262144}; do
    seg=0
    extra=(--reps 3)
    [ "$len" -gt 32768 ] && { seg=16384; extra=(--optimizer --reps 0); }
    echo "== k3-mini 1x$len, no recompute, seq_segment $seg, attention auto"
    timeout 200 "$BUILD/bench_cuda_model" --config configs/k3-mini.json --batch 1 --seq "$len" --no-recompute \
        --seq-segment "$seg" "${extra[@]}" 2>&1 | tee "$OUT/model_$len.log" | tail -14
done
exit $status
