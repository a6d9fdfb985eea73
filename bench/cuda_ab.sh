#!/usr/bin/env bash
# A/B timing of versions of the KDA CUDA sources, on the GPU machine, in one run:
#
#   bench/cuda_ab.sh DIR...      (the first DIR is the base)
#
# Each DIR holds replacement files for src/cuda/kda (any of kda_common.cuh,
# kda_forward.cu, kda_state.cu, kda_backward.cu, kda_api.cu); a file it does not
# hold is taken from the tree. Each version is built in its own directory
# ($BUILD_PREFIX-<name>, default build-ab-<name>), then `bench_cuda_kda --reps 20`
# times them alternately (ROUNDS rounds, default 2) on SHAPES (default the first
# two shapes of SPEC §7). TEST=1 runs the CUDA tests (ctest -L cuda) of every
# version; NCU=1 adds ncu's duration of every kernel (NCU_KERNELS: a regex, default
# kda_) at NCU_SHAPE (default 1,8192,64,128). The tree's own sources are restored at
# the end, also on failure. Output in $OUT (ab.log: the test counts, the timed lines,
# the mean of the rounds with the softplus/bounded ratios (also ab_mean.txt), ncu).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bench/cuda_ab.sh DIR... (the first is the base)" >&2; exit 2; }
OUT=${OUT:-out}
JOBS=${JOBS:-$(nproc)}
SHAPES=${SHAPES:-"1,8192,64,128 8,4096,16,128"}
ROUNDS=${ROUNDS:-2}
SRC=src/cuda/kda
mkdir -p "$OUT"
: >"$OUT/ab.log"
for d in "$@"; do
    [ -d "$d" ] || { echo "cuda_ab: $d is not a directory" >&2; exit 2; }
    for f in "$d"/*; do
        [ -f "$SRC/$(basename "$f")" ] ||
            { echo "cuda_ab: $f replaces no file of $SRC" >&2; exit 2; }
    done
done
keep=$(mktemp -d)
cp "$SRC"/* "$keep"/
restore() { cp "$keep"/* "$SRC"/; rm -rf "$keep"; }
trap restore EXIT

names=()
shape_args=()
for s in $SHAPES; do shape_args+=(--shape "$s"); done
for d in "$@"; do
    name=$(basename "$d")
    names+=("$name")
    cp "$keep"/* "$SRC"/
    cp "$d"/* "$SRC"/
    b="${BUILD_PREFIX:-build-ab}-$name"
    echo "== build $name ($b)"
    if ! { cmake -S . -B "$b" -DCMAKE_BUILD_TYPE=Release >"$OUT/build-$name.log" 2>&1 &&
        cmake --build "$b" -j "$JOBS" --target bench_cuda_kda test_cuda_kda test_cuda_op_kda longmoe \
            >>"$OUT/build-$name.log" 2>&1; }; then
        echo "build of $name failed: $OUT/build-$name.log"; tail -20 "$OUT/build-$name.log"; exit 1
    fi
    if [ "${TEST:-0}" = 1 ]; then
        (cd "$b" && timeout 300 ctest -L cuda -V) >"$OUT/test-$name.log" 2>&1
        echo "tests of $name: rc $? ($(grep -cE '^[0-9]+: ok ' "$OUT/test-$name.log") ok," \
            "$(grep -cE '^[0-9]+: +FAIL' "$OUT/test-$name.log") failed)" | tee -a "$OUT/ab.log"
    fi
done
echo "== fwd / fwd+bwd ms (b: bounded, s: softplus), $ROUNDS rounds"
for r in $(seq "$ROUNDS"); do
    for name in "${names[@]}"; do
        b="${BUILD_PREFIX:-build-ab}-$name"
        line=$(timeout 120 "$b/bench_cuda_kda" --reps 20 "${shape_args[@]}" | grep -E '^\([0-9]' |
            awk '{printf "%s %s %s/%s  ", $1, substr($2, 1, 1), $3, $5}')
        echo "$name: $line" | tee -a "$OUT/ab.log"
    done
done
# The mean of the rounds per version and shape, and softplus/bounded (the
# fwd and fwd+bwd ratios), from the timed lines above.
echo "== mean of $ROUNDS rounds: bounded fwd/fwd+bwd, softplus fwd/fwd+bwd, softplus/bounded fwd, fwd+bwd" |
    tee -a "$OUT/ab.log"
awk '/^[^ ]+: \(/ {
        name = substr($1, 1, length($1) - 1)
        if (!(name in seen)) { seen[name] = 1; order[++nv] = name }
        for (i = 2; i + 2 <= NF; i += 3) {
            split($(i + 2), t, "/"); k = name SUBSEP $i SUBSEP $(i + 1)
            if (!(k in n)) { if (!((name SUBSEP $i) in shseen)) { shseen[name SUBSEP $i] = 1; shapes[name, ++ns[name]] = $i } }
            f[k] += t[1]; fb[k] += t[2]; n[k]++
        }
    }
    END {
        for (v = 1; v <= nv; v++) {
            name = order[v]
            for (j = 1; j <= ns[name]; j++) {
                sh = shapes[name, j]; kb = name SUBSEP sh SUBSEP "b"; ks = name SUBSEP sh SUBSEP "s"
                if (!(kb in n) || !(ks in n)) continue
                bf = f[kb] / n[kb]; bfb = fb[kb] / n[kb]; sf = f[ks] / n[ks]; sfb = fb[ks] / n[ks]
                printf "%s: %s b %.3f/%.3f s %.3f/%.3f  ratio %.3f, %.3f\n", name, sh, bf, bfb, sf, sfb,
                    sf / bf, sfb / bfb
            }
        }
    }' "$OUT/ab.log" | tee "$OUT/ab_mean.txt"
cat "$OUT/ab_mean.txt" >>"$OUT/ab.log"
if [ "${NCU:-0}" = 1 ]; then
    for name in "${names[@]}"; do
        b="${BUILD_PREFIX:-build-ab}-$name"
        echo "== ncu $name" | tee -a "$OUT/ab.log"
        timeout 200 ncu --clock-control none -k "regex:${NCU_KERNELS:-kda_}" "$b/bench_cuda_kda" --profile \
            --shape "${NCU_SHAPE:-1,8192,64,128}" 2>&1 | grep -E "^  [a-z_ ]*kda_|Duration" |
            sed -E 's/\(lmkda::Params.*//; s/ +/ /g' | paste - - | tee -a "$OUT/ab.log"
    done
fi
