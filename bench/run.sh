#!/usr/bin/env bash
# Run every CPU benchmark that has been built; each prints a markdown table.
set -euo pipefail
BUILD=${1:-build}
found=0
for b in "$BUILD"/bench_*; do
    [ -x "$b" ] || continue
    case "$(basename "$b")" in bench_cuda_*) continue ;; esac
    found=1
    echo "== $(basename "$b")"
    "$b"
done
[ "$found" = 1 ] || { echo "no benchmarks built in $BUILD"; exit 1; }
