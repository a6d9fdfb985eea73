#!/usr/bin/env bash
# Build GPU programs on this machine and pack them for a GPU machine with the same CUDA toolkit,
# which then runs them without building (a fresh GPU machine's build takes minutes of its lease).
#
#   bench/carry_build.sh pack [TARGET ...]   here, from the repository root: a Release build of
#                                            the targets in $BUILD, packed into $ARCHIVE
#   bench/carry_build.sh unpack              there, from the repository root: the programs back
#                                            into $BUILD (created), whose path it prints
#
#   BUILD=/tmp/longmoe-carry   the build folder, the same absolute path on both machines: the
#                              test programs name the CLI by its absolute path (LONGMOE_CLI)
#   ARCHIVE=build-carry/bins.tar.xz   (an ignored folder; carry it with the tree)
#   default targets: longmoe bench_cuda_model bench_checkpoint_loss
#
# A binary built so gave the digest of one built on the GPU machine (bench/RESULTS.md,
# thirty-third session). Run the test programs from the repository root (they read configs/);
# ctest does not apply there (its files name this machine's source folder).
# Example, on the GPU machine:
#   BUILD=$(bench/carry_build.sh unpack) && SHAPES=8,4096 BUILD=$BUILD bench/peer_device.sh bench table
set -euo pipefail
BUILD=${BUILD:-/tmp/longmoe-carry}
ARCHIVE=${ARCHIVE:-build-carry/bins.tar.xz}
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
pack)
    targets=("$@")
    [ ${#targets[@]} -eq 0 ] && targets=(longmoe bench_cuda_model bench_checkpoint_loss)
    command -v nvcc >/dev/null || { echo "carry_build.sh pack: nvcc not found (the GPU programs need the CUDA toolkit)" >&2; exit 1; }
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target "${targets[@]}" >/dev/null
    mkdir -p "$(dirname "$ARCHIVE")"
    tmp="$ARCHIVE.tmp.$$"
    trap 'rm -f "$tmp"' EXIT # no partial archive is left behind
    tar -C "$BUILD" -cf - "${targets[@]}" | xz -T0 -6 >"$tmp"
    mv "$tmp" "$ARCHIVE"
    echo "$ARCHIVE: ${targets[*]} ($(du -h "$ARCHIVE" | cut -f1), from $BUILD, $(nvcc --version | grep -o 'release [0-9.]*'))"
    ;;
unpack)
    [ -f "$ARCHIVE" ] || { echo "carry_build.sh unpack: $ARCHIVE is missing (carry_build.sh pack makes it)" >&2; exit 1; }
    mkdir -p "$BUILD"
    tar -xJf "$ARCHIVE" -C "$BUILD"
    echo "$BUILD"
    ;;
*)
    echo "usage: bench/carry_build.sh pack [TARGET ...] | unpack   (BUILD, ARCHIVE: see the script's head)" >&2
    exit 2
    ;;
esac
