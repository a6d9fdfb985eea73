/* The rank-order summing kernel of the NCCL engine (rank_order_sum.h).
 *
 * Each thread owns elements i (grid-stride) and adds the R rows in rank
 * order. The library is compiled with --use_fast_math, which would flush F32
 * subnormals to zero; the F32 addition is therefore written as PTX add.rn.f32
 * (IEEE round-to-nearest-even, subnormals kept), so the device sum has the
 * bits of the host loop in comm.c for every input. */
#include <stdint.h>

#include <cuda_runtime.h>

#include "cuda/comm/rank_order_sum.h"
#include "cuda/cuda_check.h"

__device__ __forceinline__ float add_ieee(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ double add_ieee(double a, double b) {
    double r;
    asm("add.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
    return r;
}
__device__ __forceinline__ uint32_t add_ieee(uint32_t a, uint32_t b) { return a + b; } /* wraps */

template <typename T>
__global__ void rank_order_sum_kernel(T *__restrict__ acc, const T *__restrict__ rows, size_t m, int R) {
    // rows is (R, m), acc is (m)
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += stride) {
        T a = rows[i];
        for (int p = 1; p < R; p++) a = add_ieee(a, rows[(size_t)p * m + i]);
        acc[i] = a;
    }
}

extern "C" lm_status lm_cuda_rank_order_sum(void *acc, const void *rows, size_t m, int R, lm_dtype dtype,
                                            void *stream) {
    if (R < 1) return lm_error(LM_ERR_ARG, "rank-order sum: %d ranks", R);
    if (!m) return LM_OK;
    if (!acc || !rows) return lm_error(LM_ERR_ARG, "rank-order sum: NULL buffer");
    const int threads = 256;
    size_t blocks = (m + threads - 1) / threads;
    if (blocks > 8192) blocks = 8192; /* grid-stride beyond: enough to fill any GPU */
    cudaStream_t s = (cudaStream_t)stream;
    if (dtype == LM_DTYPE_F32)
        rank_order_sum_kernel<float><<<(unsigned)blocks, threads, 0, s>>>((float *)acc, (const float *)rows, m, R);
    else if (dtype == LM_DTYPE_F64)
        rank_order_sum_kernel<double><<<(unsigned)blocks, threads, 0, s>>>((double *)acc, (const double *)rows, m, R);
    else if (dtype == LM_DTYPE_I32)
        rank_order_sum_kernel<uint32_t>
            <<<(unsigned)blocks, threads, 0, s>>>((uint32_t *)acc, (const uint32_t *)rows, m, R);
    else
        return lm_error(LM_ERR_ARG, "rank-order sum: dtype must be F32, F64 or I32");
    LM_CUDA_TRY(cudaGetLastError());
    return LM_OK;
}
