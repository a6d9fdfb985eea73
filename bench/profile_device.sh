#!/usr/bin/env bash
# On the GPU machine, from the repository root: where the time of the MoE layer and of
# the whole k3-mini step goes, kernel by kernel. Builds the benchmarks, then runs each
# program once under `ncu --clock-control none --metrics gpu__time_duration.sum` and
# sums the durations by kernel (bench/ncu_kernel_table.py). Logs go to $OUT.
#
#   bench/profile_device.sh [build] [moe] [step] [sections]   (default: build moe step)
#   MOE_KINDS="batched wgmma"   the MoE product kinds profiled (bench_cuda_moe --gemm K)
#   STEP_ARGS                   bench_cuda_model's arguments (default: k3-mini 8x4096,
#                               no recompute, one step)
#   TOP                         kernels listed per table (default 40)
#   BYTES=1                     also read each kernel's DRAM bytes (dram__bytes_read.sum and
#                               dram__bytes_write.sum; slower): the tables then give GB/s
#   OCC=1                       also read each kernel's achieved occupancy and registers a thread
#                               (sm__warps_active.avg.pct_of_peak_sustained_active,
#                               launch__registers_per_thread): the tables then give both
#   KERNELS="conv_silu_l2_backward_ring kda_bwd_col"   (sections) the kernels whose bound is
#                               wanted: one ncu run of the step (STEP_ARGS) per name pattern (a
#                               regex), each profiling that kernel's first LAUNCHES launches
#                               (default 1) with the SpeedOfLight, Occupancy, SchedulerStats,
#                               WarpStateStats and LaunchStats sections; one run for all of them
#                               with --launch-count would spend its launches on whichever kernel
#                               runs first. Prints DRAM and SM throughput, occupancy and how often
#                               a warp issues; the whole report goes to $OUT/ncu_sections_<i>.txt.
set -uo pipefail
OUT=${OUT:-out}
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
TOP=${TOP:-40}
MOE_KINDS=${MOE_KINDS:-batched wgmma}
STEP_ARGS=${STEP_ARGS:---config configs/k3-mini.json --batch 8 --seq 4096 --reps 0 --no-recompute}
mkdir -p "$OUT"
steps=${*:-build moe step}
KERNELS=${KERNELS:-conv_silu_l2_backward_ring kda_bwd_col}
has() { [[ " $steps " == *" $1 "* ]]; }
METRICS=gpu__time_duration.sum
[ "${BYTES:-0}" = 1 ] && METRICS=$METRICS,dram__bytes_read.sum,dram__bytes_write.sum
[ "${OCC:-0}" = 1 ] && METRICS=$METRICS,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
NCU="ncu --clock-control none --cache-control none --metrics $METRICS --csv"

if has build; then
    echo "== build ($BUILD)"
    timeout 500 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
        timeout 500 cmake --build "$BUILD" -j "$JOBS" --target bench_cuda_moe bench_cuda_model >>"$OUT/build.log" 2>&1 ||
        { echo "build failed"; grep -E "error" "$OUT/build.log" | head -30; exit 1; }
fi

if has moe; then
    for k in $MOE_KINDS; do
        echo "== ncu: MoE layer (k3-mini, 32768 tokens), kind $k: one forward and one forward+backward after the warm-up"
        timeout 240 $NCU "$BUILD/bench_cuda_moe" --gemm "$k" --reps 1 >"$OUT/ncu_moe_$k.csv" 2>&1
        python3 bench/ncu_kernel_table.py "$OUT/ncu_moe_$k.csv" --top "$TOP"
    done
fi

if has step; then
    echo "== ncu: one training step ($STEP_ARGS)"
    timeout 300 $NCU "$BUILD/bench_cuda_model" $STEP_ARGS >"$OUT/ncu_step.csv" 2>&1
    python3 bench/ncu_kernel_table.py "$OUT/ncu_step.csv" --top "$TOP"
fi

if has sections; then
    i=0
    for k in $KERNELS; do
        i=$((i + 1))
        echo "== ncu sections: the first ${LAUNCHES:-1} launch(es) of /$k/ in one step ($STEP_ARGS)"
        timeout 300 ncu --clock-control none -k "regex:$k" --launch-count "${LAUNCHES:-1}" --section SpeedOfLight \
            --section Occupancy --section SchedulerStats --section WarpStateStats --section LaunchStats \
            "$BUILD/bench_cuda_model" $STEP_ARGS >"$OUT/ncu_sections_$i.txt" 2>&1 || echo "ncu failed: $OUT/ncu_sections_$i.txt"
        grep -E '^  [A-Za-z_].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issued Warp Per Scheduler|No Eligible|Eligible Warps Per Scheduler|Theoretical Occupancy|Achieved Occupancy|Registers Per Thread|Block Limit (Registers|Shared Mem)' \
            "$OUT/ncu_sections_$i.txt" | cut -c1-160
    done
fi
