#!/usr/bin/env bash
# On the GPU machine, from the repository root: longmoe (bench_cuda_model) and
# its PyTorch + fla-core peer (bench/model_vs_torch.py) on the same GPU, config
# and shapes, in one run; then the table (docs/peer.md). Logs and JSON go to
# $OUT (default ./out).
#
#   bench/peer_device.sh [build] [check] [bench] [table]   (default: all four)
#   CONFIG=configs/k3-mini.json  SHAPES="8,4096 1,32768"  VARIANTS="eager compile compile-recompute"
#   PEER_STEPS=10 (timed steps after 3 warm-ups), PEER_TIMEOUT=420 (seconds per peer run)
#   PEER_OPTIMIZER=none|adamw, FLA_AUTOTUNE_MS=W,R (shorter Triton autotuning for fla)
#   OURS="recompute no-recompute recompute-channel" (longmoe's variants: the config's recompute
#   and sequence segments, or neither: --no-recompute --seq-segment 0, or the MoE and dense FFN
#   alone recomputed, no segments: --recompute channel --seq-segment 0)
#   BUILD_BG=1: build in the background while the peers run (their Triton autotuning and
#   compilation take minutes); longmoe's runs wait for it and come after the peers, so the
#   two are never timed at once. JOBS=n: its parallel jobs (default: every core; fewer leave
#   cores to the peers' compilation). A peer run stopped by PEER_TIMEOUT says so in its log.
# fla-core (and einops, if the image lacks it) come from wheels in .whl/
# (pip download --no-deps fla-core==0.6.0 einops), installed with --no-index.
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
CONFIG=${CONFIG:-configs/k3-mini.json}
SHAPES=${SHAPES:-8,4096 1,32768}
VARIANTS=${VARIANTS:-eager compile compile-recompute}
mkdir -p "$OUT"
steps=${*:-build check bench table}
has() { [[ " $steps " == *" $1 "* ]]; }
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
# (the cudnn-frontend wheel there is for its C++ headers only: CMake unpacks them; not installed)
wheels=$(ls .whl/*.whl 2>/dev/null | grep -v nvidia_cudnn_frontend)
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $wheels >"$OUT/pip.log" 2>&1 || echo "pip install failed: $OUT/pip.log"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# fla's Triton autotuning compiles every candidate (about 200 s at k3-mini 8x4096 the first time):
# keep compiled kernels and the chosen configs in one cache, so only the first peer run pays it
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/longmoe-triton-cache} TRITON_CACHE_AUTOTUNING=1
python3 -c "import torch, fla; print('torch', torch.__version__, 'fla', fla.__version__)" 2>&1 | tee "$OUT/peer_versions.txt"

build() {
    timeout 500 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
        timeout 500 cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target longmoe bench_checkpoint_loss bench_cuda_model \
            >>"$OUT/build.log" 2>&1
}
build_failed() { echo "build failed"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
build_pid=
if has build; then
    echo "== build ($BUILD)${BUILD_BG:+, in the background}"
    if [ -n "${BUILD_BG:-}" ]; then
        build & build_pid=$!
    else
        build || build_failed
    fi
fi
wait_build() { [ -n "$build_pid" ] && { wait "$build_pid" || build_failed; build_pid=; echo "== build done"; }; }

if has check; then
    wait_build
    # the same weights in both: a short CPU run of longmoe on the tiny preset (KDA head dim 32,
    # chunk 64: fla accepts it), then the peer's loss with fla's chunk_kda on the GPU (fp32 inputs)
    echo "== check: the peer's loss with fla on the GPU = longmoe's (CPU, fp32)"
    python3 - <<'PY'
import json
c = json.load(open("configs/tiny.json"))
c["train"].pop("stages")
c["train"].update(seq_len=128, batch_size=8, steps=30, ckpt_every=30, log_every=10, data="copy")
json.dump(c, open("/tmp/peer-tiny.json", "w"))
PY
    rm -rf /tmp/peer-tiny-run
    "$BUILD/longmoe" train --quiet --config /tmp/peer-tiny.json --out /tmp/peer-tiny-run >"$OUT/peer_train.log" 2>&1
    for kda in naive fla; do
        python3 bench/model_vs_torch.py check --checkpoint /tmp/peer-tiny-run --kda "$kda" --device cuda \
            --batch 2,256 --tol 1e-3 --longmoe "$BUILD/bench_checkpoint_loss" 2>&1 | tee -a "$OUT/peer_check.log"
        [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
    done
fi

if has bench; then
    for shape in $SHAPES; do
        B=${shape%,*}; T=${shape#*,}
        for v in $VARIANTS; do
            flags=()
            [[ $v == compile* ]] && flags+=(--compile)
            [[ $v == *recompute ]] && flags+=(--recompute)
            echo "== peer $v ${B}x${T}"
            PYTHONUNBUFFERED=1 timeout "${PEER_TIMEOUT:-420}" python3 bench/model_vs_torch.py bench --config "$CONFIG" \
                --shape "$shape" --kda fla --experts grouped --optimizer "${PEER_OPTIMIZER:-none}" --steps "${PEER_STEPS:-10}" \
                ${FLA_AUTOTUNE_MS:+--autotune-ms "$FLA_AUTOTUNE_MS"} \
                "${flags[@]}" --out "$OUT/peer_${B}x${T}_$v.json" 2>&1 | tail -20 | tee "$OUT/peer_${B}x${T}_$v.log"
            rc=${PIPESTATUS[0]}
            # a run stopped by its time limit says so (the table then lacks its row)
            [ "$rc" -eq 124 ] && echo "peer $v ${B}x${T}: stopped after PEER_TIMEOUT=${PEER_TIMEOUT:-420} s" |
                tee -a "$OUT/peer_${B}x${T}_$v.log"
            [ "$rc" -ne 0 ] && status=1
        done
        wait_build
        for o in ${OURS:-recompute}; do
            flags=()
            # no checkpointing of any kind, as the peer without it: no recompute and no sequence
            # segments (a segmented backward runs each segment's forward again; docs/model.md)
            [ "$o" = no-recompute ] && flags+=(--no-recompute --seq-segment 0)
            [ "$o" = recompute-channel ] && flags+=(--recompute channel --seq-segment 0)
            echo "== longmoe $CONFIG ${B}x${T} $o"
            timeout 400 "$BUILD/bench_cuda_model" --config "$CONFIG" --batch "$B" --seq "$T" --reps 5 "${flags[@]}" \
                --out "$OUT/ours_${B}x${T}_$o.json" 2>&1 | tee "$OUT/ours_${B}x${T}_$o.log"
        done
    done
fi

if has table; then
    python3 bench/model_vs_torch.py compare --ours "$OUT"/ours_*.json --peer "$OUT"/peer_*.json | tee "$OUT/peer_table.md"
fi
exit $status
