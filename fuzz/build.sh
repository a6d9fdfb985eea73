#!/usr/bin/env bash
# Build the libFuzzer harnesses fuzz/fuzz_*.c with clang against the library
# sources (src/**/*.c except the CUDA tree), under AddressSanitizer and
# UndefinedBehaviorSanitizer. Usage: fuzz/build.sh [OUT_DIR] (default build-fuzz).
# Exits 3 when clang or its libFuzzer runtime is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build-fuzz}
CC=${CC_FUZZ:-clang}
command -v "$CC" >/dev/null 2>&1 || { echo "fuzz/build.sh: $CC not found"; exit 3; }
mkdir -p "$OUT/obj"
probe="$OUT/probe.c"
printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' > "$probe"
"$CC" -fsanitize=fuzzer "$probe" -o "$OUT/probe" >/dev/null 2>&1 ||
    { echo "fuzz/build.sh: $CC cannot link -fsanitize=fuzzer (no libFuzzer runtime)"; exit 3; }
FLAGS=(-std=c11 -g -O1 -fno-omit-frame-pointer -fopenmp -D_POSIX_C_SOURCE=200809L
       -Iinclude -Isrc -Isrc/core -Wno-unused-command-line-argument)
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=all)
# library objects, $(nproc) compiles at a time; a source that fails is reported
# and the harnesses that do not need it are still built
pids=()
srcs=()
while IFS= read -r src; do
    obj="$OUT/obj/$(echo "${src%.c}" | tr '/' '_').o"
    if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ] || [ -n "$(find include src -name '*.h' -newer "$obj" -print -quit)" ]; then
        rm -f "$obj"
        "$CC" "${FLAGS[@]}" "${SAN[@]}" -w -fsanitize=fuzzer-no-link -c "$src" -o "$obj" &
        pids+=($!)
        srcs+=("$src")
        while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do sleep 0.1; done
    fi
done < <(find src -name '*.c' -not -path 'src/cuda/*' | sort)
failed=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { echo "fuzz/build.sh: compiling ${srcs[$i]} failed"; failed=1; }
done
rm -f "$OUT/liblongmoe_fuzz.a"
ar rcs "$OUT/liblongmoe_fuzz.a" "$OUT"/obj/*.o
for h in fuzz/fuzz_*.c; do
    name=$(basename "${h%.c}")
    if "$CC" "${FLAGS[@]}" "${SAN[@]}" -fsanitize=fuzzer "$h" "$OUT/liblongmoe_fuzz.a" -lm -o "$OUT/$name"; then
        echo "built $OUT/$name"
    else
        echo "fuzz/build.sh: $name did not build"
        rm -f "$OUT/$name"
        failed=1
    fi
done
exit $failed
