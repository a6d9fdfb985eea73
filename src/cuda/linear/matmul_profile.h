/* The products' profile (lm_cuda_matmul_profile in include/longmoe/linear_cuda.h): each call that
 * runs a cuBLAS or cuBLASLt product brackets it with lm_cuda_prof_begin / lm_cuda_prof_end, which do
 * nothing while the profile is off. Shapes are cuBLAS's column-major arguments. */
#ifndef LONGMOE_CUDA_MATMUL_PROFILE_H
#define LONGMOE_CUDA_MATMUL_PROFILE_H

#include <stdint.h>

#include <cuda_runtime.h>

typedef struct {
    const char *kind;        /* a string literal: "lt", "dense", "f32", "batched" */
    uint64_t m, n, k, batch; /* batch: the products of one batched call */
    int ta, tb, d_bf16;      /* A, B transposed; D in bf16 (else fp32) */
    float beta;
} lm_cuda_prof_shape;

/* The first event (recorded on the stream), or NULL while the profile is off */
cudaEvent_t lm_cuda_prof_begin(cudaStream_t stream);
/* The second event and the record; frees e0 if the record cannot be made; e0 NULL: nothing */
void lm_cuda_prof_end(cudaStream_t stream, cudaEvent_t e0, const lm_cuda_prof_shape *shape);

#endif
