#!/usr/bin/env bash
# The CLI's normal runs under valgrind's memcheck: train (fresh, then resumed),
# plan, op kda and op attention on small inputs, tokenizer train/encode/decode.
# Any memory error or definite/indirect leak fails the script.
# Usage: tools/valgrind.sh [BUILD_DIR] (default build-valgrind: configured here
# without -march=native, which valgrind may not decode, and without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-valgrind}
command -v valgrind >/dev/null 2>&1 || { echo "tools/valgrind.sh: valgrind not found"; exit 3; }
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLONGMOE_NATIVE=OFF -DLONGMOE_CUDA=OFF >/dev/null
fi
cmake --build "$BUILD" -j "$(nproc)" --target longmoe >/dev/null
BIN="$BUILD/longmoe"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
# set, so that the CLI does not start itself again (tools/longmoe.c) outside valgrind
export OMP_WAIT_POLICY=passive
VG=(valgrind --quiet --leak-check=full --show-leak-kinds=definite,indirect --errors-for-leak-kinds=definite,indirect
    --error-exitcode=1)
failed=0
run() { # run NAME ARGS...: the command under memcheck, its log in $work/NAME.log
    local name=$1
    shift
    if "${VG[@]}" --log-file="$work/$name.vg" "$BIN" "$@" > "$work/$name.log" 2>&1; then
        echo "valgrind: $name: clean"
    else
        echo "valgrind: $name: FAILED"
        cat "$work/$name.vg" "$work/$name.log" | head -n 60
        failed=1
    fi
}
cat > "$work/micro.json" <<'JSON'
{"model": {"d_model": 8, "n_layers": 2, "layout": "km", "first_k_dense": 1, "dense_ffn": 8},
 "kda": {"heads": 1, "head_dim": 8, "chunk": 16},
 "attention": {"heads": 1, "q_lora_rank": 4, "kv_lora_rank": 4, "qk_head_dim": 8, "v_head_dim": 8},
 "moe": {"routed_experts": 4, "top_k": 2, "expert_ffn": 4, "shared_ffn": 4, "balance_bins": 16},
 "train": {"seq_len": 16, "batch_size": 2, "steps": 4, "eval_every": 2, "log_every": 1,
           "ckpt_every": 2, "keep_checkpoints": 1}}
JSON
run train "train" --config "$work/micro.json" --out "$work/run" --stop-after 2
run train-resume "train" --out "$work/run" --resume
run plan plan --config configs/k3.json
# small operator inputs, written with the Python standard library
if command -v python3 >/dev/null 2>&1; then
    python3 - "$work" <<'PY'
import json, random, struct, sys
def save(path, tensors):
    hdr, data = {}, b""
    for name, shape, vals in tensors:
        raw = struct.pack("<%df" % len(vals), *vals)
        hdr[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + data)
r = random.Random(3)
n = lambda k, s=1.0: [s * r.gauss(0, 1) for _ in range(k)]
B, T, H, K, V = 1, 37, 2, 16, 8
save(sys.argv[1] + "/kda.safetensors", [("q", [B, T, H, K], n(B*T*H*K, 0.25)), ("k", [B, T, H, K], n(B*T*H*K, 0.25)),
     ("v", [B, T, H, V], n(B*T*H*V)), ("z", [B, T, H, K], n(B*T*H*K)),
     ("beta", [B, T, H], [r.uniform(0.1, 0.9) for _ in range(B*T*H)]), ("A_log", [H], n(H, 0.3)),
     ("dt_bias", [H*K], n(H*K, 0.5)), ("do", [B, T, H, V], n(B*T*H*V))])
save(sys.argv[1] + "/attn.safetensors", [("q", [B, T, H, K], n(B*T*H*K)), ("k", [B, T, 1, K], n(B*T*K)),
     ("v", [B, T, 1, V], n(B*T*V))])
PY
    run op-kda op kda --in "$work/kda.safetensors" --out "$work/kda-out.safetensors"
    run op-attention op attention --in "$work/attn.safetensors" --out "$work/attn-out.safetensors" --backward
else
    echo "valgrind: op kda / op attention skipped (python3 writes their inputs)"
fi
if "$BIN" --help | grep -q '^  tokenizer'; then
    cat docs/*.md > "$work/text.txt"
    run tokenizer-train tokenizer train --input "$work/text.txt" --vocab 300 --out "$work/tok.json"
    run tokenizer-encode tokenizer encode --tokenizer "$work/tok.json" --input README.md
fi
exit $failed
