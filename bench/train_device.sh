#!/usr/bin/env bash
# On the GPU machine, from the repository root: build longmoe and test_cuda_train, run the
# test (GPU against CPU training, two GPU runs bit-identical, SIGKILL and resume, checkpoints
# moving between the devices), then train a preset with `longmoe train --device cuda` for
# STEPS steps and print its progress lines (loss, tokens/s, MFU, ETA, MaxVio) and the mean
# tokens/s and MFU of its steps from metrics.jsonl.
#
#   bench/train_device.sh [build] [test] [train] [ranks] [curve] [text] [long]   (default: build test train)
#
#   ranks        the same cut config on 2 GPU ranks over MPI sharing this GPU (the staged engine,
#                `mpirun -np 2 longmoe train --device cuda --comm mpi`), replicated and with
#                --zero 1: the ZeRO-1 start line (optimizer state a rank), tokens/s of each run,
#                the staged run's losses against the one-GPU run's, ZeRO-1's against replicated
#                (bit-identical, else the step fails); RANK_VARIANTS="mpi2 mpi2_zero1 mpi2_ep" adds
#                --ep (expert parallelism on the 2 ranks, owner-only expert state; its losses against
#                the one-GPU run's); mpi2_eprep: --ep --ep-replicated-state (against --ep's);
#                mpi2_cp: --cp 2 (one sequence over the 2 ranks; its losses against the one-GPU run's).
#                Each run's largest device memory a process (nvidia-smi, sampled every 0.5 s) is printed
#   train        the timed run below (PRESET, STEPS, ...)
#   curve        configs/tiny.json's first stage cut to CURVE_STEPS (default 200) steps, on the
#                CPU (in the background, half the cores) and on the GPU: both loss curves,
#                averaged over windows of 25 steps, side by side ($OUT/curve_{cpu,gpu}.jsonl)
#   text         configs/text-gpu.json on real text (bench/text_corpus.sh data/text, carried to
#                the machine) for TEXT_SECONDS (default 240), then SIGINT: the run stops at a step
#                boundary; its evaluations every 100 steps show the validation loss
#                ($OUT/text_metrics.jsonl, $OUT/text.log)
#   long         LONG_CONFIG (default configs/long-gpu.json: staged 1K -> 4K -> 16K -> 64K on passkey,
#                MQAR and copy rows), each stage's steps times LONG_SCALE (default 1), stopped by SIGINT at
#                LONG_SECONDS (default 560; a stage cut short has no grids). Prints the steps'
#                time per stage and the passkey and MQAR grids after each stage at every length so
#                far ($OUT/long.log, $OUT/long_metrics.jsonl, $OUT/long.json: the config run)
#
#   STEPS        steps of the timed run (default 100)
#   PRESET       the config trained (default configs/small.json); its first stage only
#                (or its train.steps when it has no stages), cut to STEPS steps. A KDA head
#                dimension the CUDA kernels do not take (other than 32, 64, 128) becomes 64
#                with the same width, and the script says so
#   BATCH_TOKENS tokens per micro-batch (default: the preset's for an unstaged one; for a
#                staged one its first stage's sequence length, one sequence per step:
#                k3-mini's own 1M tokens would not fit one GPU's activations). With
#                PRESET=configs/k3-mini.json expect the host optimizer (Muon on 1.75B
#                parameters) to take most of each step
#   DATA         data of the run (default copy, a built-in task: the machine need not hold
#                token shards; empty: the preset's own)
#   LOG_EVERY    steps between progress lines (default 5)
#
# Logs go to $OUT (default ./out): build.log, test.log, train.log, the run directory run/
# (metrics.jsonl; its checkpoints are removed at the end, they are large) and train.json
# (the config trained). BUILD (default build-cuda) names the build directory.
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
STEPS=${STEPS:-100}
PRESET=${PRESET:-configs/small.json}
BATCH_TOKENS=${BATCH_TOKENS:-}
DATA=${DATA-copy}
LOG_EVERY=${LOG_EVERY:-5}
mkdir -p "$OUT"
steps=${*:-build test train}
CURVE_STEPS=${CURVE_STEPS:-200}
TEXT_SECONDS=${TEXT_SECONDS:-240}
LONG_SCALE=${LONG_SCALE:-1}
LONG_SECONDS=${LONG_SECONDS:-560}
LONG_CONFIG=${LONG_CONFIG:-configs/long-gpu.json}
has() { [[ " $steps " == *" $1 "* ]]; }
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"

derive_config() { # the preset cut to STEPS steps, as $OUT/train.json
    python3 - "$PRESET" "$OUT/train.json" "$STEPS" "$LOG_EVERY" "$DATA" "$BATCH_TOKENS" <<'EOF'
import json, sys
src, dst, steps, log_every, data, batch_tokens = sys.argv[1:7]
c = json.load(open(src))
k = c.setdefault("kda", {})
hd, heads = k.get("head_dim", 32), k.get("heads", 2)
if hd not in (32, 64, 128):
    k["head_dim"], k["heads"] = 64, max(1, heads * hd // 64)
    print("kda: %d heads of %d -> %d heads of 64 (the CUDA KDA kernels take 32, 64 and 128)" % (heads, hd, k["heads"]))
t = c.setdefault("train", {})
stages = t.get("stages")
if stages:
    s = stages[0]
    s["steps"] = int(steps)
    s["batch_tokens"] = int(batch_tokens) if batch_tokens else s["seq_len"]
    if data:
        s["data"] = {data: 1}
        t["data"] = data
    t["stages"] = [s]
else:
    t["steps"] = int(steps)
    if batch_tokens:
        t["batch_size"] = max(1, int(batch_tokens) // t.get("seq_len", 512))
    if data:
        t["data"] = data
t["log_every"] = int(log_every)
t["eval_every"] = 0
t["ckpt_every"] = 0
c["comment"] = "bench/train_device.sh: %s cut to %s steps" % (src, steps)
print("training %s: %s" % (dst, json.dumps(t)))
json.dump(c, open(dst, "w"), indent=1)
EOF
}

if has build; then
    echo "== build ($BUILD)"
    timeout 500 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
        timeout 500 cmake --build "$BUILD" -j "$JOBS" --target longmoe test_cuda_train >>"$OUT/build.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && { echo "build failed (rc $rc): see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
fi

if has test; then
    echo "== test_cuda_train"
    (cd "$BUILD" && timeout 500 ctest -R '^test_cuda_train$' -V) >"$OUT/test.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    grep -E "^[0-9]+: (ok|FAIL|skip|  )|tests passed|tests failed|\*\*\*" "$OUT/test.log" | cut -c1-200 | tail -40
    echo "ctest rc $rc"
fi

if has train; then
    echo "== train $PRESET on the GPU: $STEPS steps"
    derive_config
    [ $? -ne 0 ] && { echo "cannot derive the config from $PRESET"; exit 1; }
    rm -rf "$OUT/run"
    timeout 560 "$BUILD/longmoe" train --config "$OUT/train.json" --out "$OUT/run" --device cuda 2>&1 |
        tee "$OUT/train.log"
    rc=${PIPESTATUS[0]}
    [ $rc -ne 0 ] && { echo "train rc $rc"; status=1; }
    # the mean over the steps after the first (which grows the backend's scratch)
    python3 - "$OUT/run/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"type": "train"')]
rest = rows[1:] or rows
if rest:
    secs = sum(r["step_seconds"] for r in rest)
    toks = sum(r["tokens_per_s"] * r["step_seconds"] for r in rest)
    mfu = sum(r.get("mfu", 0) * r["step_seconds"] for r in rest)
    print("steps 2..%d: %.0f tokens/s, MFU %.2f%%, %.3f s per step, last loss %.4f (first %.4f)"
          % (len(rows), toks / secs, 100 * mfu / secs, secs / len(rest), rows[-1]["loss"], rows[0]["loss"]))
    # where a step's time goes (the trainer's "phases": each ends where the host waits for its result)
    names = list(rest[0].get("phases", {}))
    if names:
        print("per step: " + ", ".join("%s %.1f ms" % (k, 1e3 * sum(r["phases"][k] for r in rest) / len(rest))
                                       for k in names))
EOF
    rm -rf "$OUT"/run/checkpoint-*
fi

if has ranks; then
    # two GPU ranks over MPI on this GPU (the staged engine), replicated and with ZeRO-1, against
    # one GPU, on the train step's config with an even number of sequences a micro-batch
    echo "== $PRESET cut to $STEPS steps: 1 GPU, 2 staged ranks, 2 staged ranks with --zero 1"
    [ -f "$OUT/train.json" ] || derive_config >/dev/null
    # an even number of sequences a micro-batch (each rank takes half)
    python3 - "$OUT/train.json" "$OUT/ranks.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
t = c["train"]
for s in t.get("stages") or []:
    if (s["batch_tokens"] // s["seq_len"]) % 2:
        s["batch_tokens"] *= 2
if not t.get("stages") and t.get("batch_size", 1) % 2:
    t["batch_size"] = 2 * t.get("batch_size", 1)
json.dump(c, open(sys.argv[2], "w"), indent=1)
EOF
    rm -rf "$OUT/run_1"
    # the largest memory of each process on the GPU while a run lasts (nvidia-smi's per-process numbers)
    mem_start() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 500 \
                      >"$OUT/mem_$1.csv" 2>/dev/null & MEMPID=$!; }
    mem_stop() {
        kill "$MEMPID" 2>/dev/null; wait "$MEMPID" 2>/dev/null
        awk -F', *' -v run="$1" '$2 + 0 > m[$1] { m[$1] = $2 + 0 }
            END { s = ""; for (p in m) s = s sprintf(" %.2f GiB", m[p] / 1024); print "device memory a process, " run ":" s }' \
            "$OUT/mem_$1.csv"
    }
    mem_start 1
    timeout 300 "$BUILD/longmoe" train --config "$OUT/ranks.json" --out "$OUT/run_1" --device cuda \
        >"$OUT/train_1.log" 2>&1 || { echo "the one-GPU run failed: $OUT/train_1.log"; status=1; }
    mem_stop 1
    rm -rf "$OUT/run_1"/checkpoint-*
    for v in ${RANK_VARIANTS:-mpi2 mpi2_zero1}; do
        extra=()
        [ "$v" = mpi2_zero1 ] && extra=(--zero 1)
        [ "$v" = mpi2_ep ] && extra=(--ep)
        [ "$v" = mpi2_eprep ] && extra=(--ep --ep-replicated-state)
        [ "$v" = mpi2_cp ] && extra=(--cp 2)
        rm -rf "$OUT/run_$v"
        mem_start "$v"
        # half the machine's cores a rank (mpirun would bind each of 2 processes to one core)
        OMP_NUM_THREADS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 )) OMPI_MCA_btl_vader_single_copy_mechanism=none \
            timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 \
            "$BUILD/longmoe" train --config "$OUT/ranks.json" \
            --out "$OUT/run_$v" --device cuda --comm mpi "${extra[@]}" >"$OUT/train_$v.log" 2>&1 ||
            { echo "$v failed: $OUT/train_$v.log"; tail -5 "$OUT/train_$v.log"; status=1; }
        mem_stop "$v"
        grep -E "ZeRO-1|optimizer state|expert parallel|context parallel" "$OUT/train_$v.log" | head -5
        rm -rf "$OUT/run_$v"/checkpoint-*
    done
    python3 - "$OUT" <<'EOF'
import json, sys, os
out = sys.argv[1]
def rows(run):
    p = os.path.join(out, run, "metrics.jsonl")
    return [json.loads(l) for l in open(p) if l.startswith('{"type": "train"')] if os.path.exists(p) else []
one, two, zero, ep = rows("run_1"), rows("run_mpi2"), rows("run_mpi2_zero1"), rows("run_mpi2_ep")
cp, eprep = rows("run_mpi2_cp"), rows("run_mpi2_eprep")
def speed(r):
    rest = r[1:] or r
    s = sum(x["step_seconds"] for x in rest)
    return sum(x["tokens_per_s"] * x["step_seconds"] for x in rest) / s if s else 0
for name, r in (("1 GPU", one), ("2 staged ranks", two), ("2 staged ranks, ZeRO-1", zero), ("2 staged ranks, --ep", ep),
                ("2 staged ranks, --ep, replicated", eprep), ("2 staged ranks, --cp 2", cp)):
    if r:
        print("%-24s %3d steps, last loss %.6f, %.0f tokens/s (steps 2..)" % (name, len(r), r[-1]["loss"], speed(r)))
if one and two:
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(two, one))
    print("2 staged ranks against 1 GPU: losses within %.3g relative" % worst)
if one and ep:
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ep, one))
    print("2 staged ranks with --ep against 1 GPU: losses within %.3g relative" % worst)
if ep and eprep:
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(ep, eprep))
    print("--ep owner-only against replicated expert state: losses within %.3g relative" % worst)
if one and cp:
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(cp, one))
    print("2 staged ranks with --cp 2 against 1 GPU: losses within %.3g relative" % worst)
if two and zero:
    same = len(two) == len(zero) and all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
                                         for a, b in zip(two, zero))
    print("ZeRO-1 against replicated, 2 staged ranks: losses and gradient norms %s"
          % ("bit-identical" if same else "DIFFER"))
    if not same:
        sys.exit(1)
EOF
    [ $? -ne 0 ] && status=1
fi

if has curve; then
    echo "== tiny, first stage cut to $CURVE_STEPS steps: CPU and GPU"
    python3 - "$CURVE_STEPS" <<'EOF'
import json, sys
c = json.load(open("configs/tiny.json"))
s = c["train"]["stages"][0]
s["steps"] = int(sys.argv[1])
c["train"]["stages"] = [s]
c["train"]["log_every"] = 50
json.dump(c, open("/tmp/longmoe-curve.json", "w"), indent=1)
EOF
    rm -rf /tmp/longmoe-curve-cpu /tmp/longmoe-curve-gpu
    OMP_NUM_THREADS=$(( $(nproc) / 2 )) "$BUILD/longmoe" train --config /tmp/longmoe-curve.json \
        --out /tmp/longmoe-curve-cpu >"$OUT/curve_cpu.log" 2>&1 &
    cpu_pid=$!
    timeout 300 "$BUILD/longmoe" train --config /tmp/longmoe-curve.json --out /tmp/longmoe-curve-gpu --device cuda \
        >"$OUT/curve_gpu.log" 2>&1 || { echo "GPU run failed"; tail -5 "$OUT/curve_gpu.log"; status=1; }
    wait $cpu_pid || { echo "CPU run failed"; tail -5 "$OUT/curve_cpu.log"; status=1; }
    cp /tmp/longmoe-curve-cpu/metrics.jsonl "$OUT/curve_cpu.jsonl" 2>/dev/null
    cp /tmp/longmoe-curve-gpu/metrics.jsonl "$OUT/curve_gpu.jsonl" 2>/dev/null
    python3 - "$OUT/curve_cpu.jsonl" "$OUT/curve_gpu.jsonl" <<'EOF'
import json, sys
def train(p):
    return [json.loads(l) for l in open(p) if l.startswith('{"type": "train"')]
cpu, gpu = train(sys.argv[1]), train(sys.argv[2])
print("steps     CPU loss   GPU loss   GPU/CPU   (means over 25 steps)")
for a in range(0, min(len(cpu), len(gpu)), 25):
    mc = sum(r["loss"] for r in cpu[a:a + 25]) / len(cpu[a:a + 25])
    mg = sum(r["loss"] for r in gpu[a:a + 25]) / len(gpu[a:a + 25])
    print("%4d-%-4d %9.4f  %9.4f   %7.4f" % (a + 1, a + 25, mc, mg, mg / mc))
sc = sorted(r["step_seconds"] for r in cpu[1:]) or [0]
sg = sorted(r["step_seconds"] for r in gpu[1:]) or [0]
print("median step: CPU %.4f s, GPU %.4f s" % (sc[len(sc) // 2], sg[len(sg) // 2]))
EOF
    rm -rf /tmp/longmoe-curve-cpu /tmp/longmoe-curve-gpu
fi

if has text; then
    echo "== configs/text-gpu.json on real text for $TEXT_SECONDS s"
    [ -f data/text/shards/train_000000.bin ] ||
        { echo "no data/text/shards: run bench/text_corpus.sh data/text and carry data/text/shards"; exit 1; }
    rm -rf /tmp/longmoe-text
    timeout --foreground -s INT "$TEXT_SECONDS" "$BUILD/longmoe" train --config configs/text-gpu.json --out /tmp/longmoe-text \
        --device cuda >"$OUT/text.log" 2>&1
    rc=$?
    grep -E "^(training|stage|step|eval|interrupted|done)" "$OUT/text.log" | tail -40
    echo "text run rc $rc (124: stopped by SIGINT at the time limit, at a step boundary with a checkpoint)"
    cp /tmp/longmoe-text/metrics.jsonl "$OUT/text_metrics.jsonl" 2>/dev/null
    rm -rf /tmp/longmoe-text
fi
if has long; then
    echo "== $LONG_CONFIG on the GPU: its stages, steps x $LONG_SCALE, at most $LONG_SECONDS s"
    python3 - "$LONG_SCALE" "$OUT/long.json" "$LONG_CONFIG" <<'EOF'
import json, sys
scale, dst, src = float(sys.argv[1]), sys.argv[2], sys.argv[3]
c = json.load(open(src))
for s in c["train"]["stages"]:
    s["steps"] = max(1, int(round(s["steps"] * scale)))
c["comment"] = "bench/train_device.sh long: %s, steps x %g" % (src, scale)
print("stages: " + ", ".join("%s %d steps of %d x %d" % (s["name"], s["steps"], s["batch_tokens"] // s["seq_len"],
                                                       s["seq_len"]) for s in c["train"]["stages"]))
json.dump(c, open(dst, "w"), indent=1)
EOF
    [ $? -ne 0 ] && { echo "cannot derive the config from $LONG_CONFIG"; exit 1; }
    long_dir=$(mktemp -d /tmp/longmoe-long.XXXXXX)
    start=$(date +%s)
    timeout --foreground -s INT -k 60 "$LONG_SECONDS" "$BUILD/longmoe" train --config "$OUT/long.json" \
        --out "$long_dir/run" --device cuda >"$OUT/long.log" 2>&1
    rc=$?
    echo "long run rc $rc in $(( $(date +%s) - start )) s (124 or 130: stopped at the time limit)"
    [ $rc -ne 0 ] && { status=1; tail -20 "$OUT/long.log"; }
    cp "$long_dir/run/metrics.jsonl" "$OUT/long_metrics.jsonl" 2>/dev/null
    python3 - "$OUT/long_metrics.jsonl" <<'EOF'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except (OSError, ValueError) as e:
    sys.exit("no metrics: %s" % e)
stages = [r for r in rows if r["type"] == "stage"]
train = [r for r in rows if r["type"] == "train"]
for i, st in enumerate(stages):
    end = stages[i + 1]["step"] if i + 1 < len(stages) else float("inf")
    mine = [r for r in train if st["step"] < r["step"] <= end][1:]  # the stage's first step grows scratch
    if mine:
        secs = sum(r["step_seconds"] for r in mine)
        print("stage %-4s seq %6d x %3d: %d steps, %.1f ms/step, %.0f tokens/s, loss %.4f -> %.4f"
              % (st["name"], st["seq_len"], st["batch_size"], len(mine) + 1, 1000 * secs / len(mine),
                 sum(r["tokens_per_s"] * r["step_seconds"] for r in mine) / secs, mine[0]["loss"], mine[-1]["loss"]))
for r in rows:
    if r["type"] == "eval":
        print("step %5d  val loss %.4f, answer accuracy %s at length %d" % (r["step"], r["val_loss"],
              "-" if r["answer_accuracy"] is None else "%.1f%%" % (100 * r["answer_accuracy"]), r["seq_len"]))
    elif r["type"] == "passkey":
        print("step %5d  passkey %% all five digits (digits right) by length x depth %s, %s rows a cell"
              % (r["step"], r["depths"], r.get("rows", "?")))
        for L, acc, dig in zip(r["lengths"], r["accuracy"], r["digit_accuracy"]):
            print("      %6d  " % L + "  ".join("%5.1f (%5.1f)" % (100 * a, 100 * d) if a is not None else "    -"
                                                for a, d in zip(acc, dig)))
    elif r["type"] == "mqar":
        print("step %5d  mqar %% value digits by length x queries %s (chance about 10%%), %s rows a cell"
              % (r["step"], r["queries"], r.get("rows", "?")))
        for L, acc in zip(r["lengths"], r["accuracy"]):
            print("      %6d  " % L + "  ".join("%5.1f" % (100 * a) if a is not None else "    -" for a in acc))
EOF
    rm -rf "$long_dir"
fi
exit $status
