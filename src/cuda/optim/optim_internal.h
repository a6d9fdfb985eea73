/* The optimizer kernels of the CUDA backend (src/cuda/optim; the lm_ops
 * optimizer entries of include/longmoe/backend.h; docs/optim.md, "On a
 * backend"). Device pointers; each call enqueues on ctx->stream and returns
 * without waiting. Included by .cu files only. */
#ifndef LONGMOE_CUDA_OPTIM_INTERNAL_H
#define LONGMOE_CUDA_OPTIM_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/cuda_context.h"
#include "longmoe/optim.h"

/* Partial sums lm_cuda_sum_squares uses (doubles of `partials`). */
#define LM_CUDA_SUMSQ_PARTS 512

/* *out (device double) = sum x[i]^2 in double: LM_CUDA_SUMSQ_PARTS fixed
 * blocks with a fixed thread stride and a fixed tree each, then one block
 * adds the parts in a fixed tree. The order depends on n only: the same bits
 * on every run. partials: LM_CUDA_SUMSQ_PARTS device doubles. */
lm_status lm_cuda_sum_squares(const lm_cuda_context *ctx, const float *x, size_t n, double *partials, double *out);
/* x[i] *= s (IEEE fp32 product). */
lm_status lm_cuda_scale(const lm_cuda_context *ctx, float *x, size_t n, float s);
/* x[i] = (float)((double)x[i] * f). */
lm_status lm_cuda_scale_exact(const lm_cuda_context *ctx, float *x, size_t n, double f);
/* lm_adamw_update with IEEE fp32 operations (no contraction, exact division
 * and square root), bias corrections computed on the host as on the CPU. */
lm_status lm_cuda_adamw_update(const lm_cuda_context *ctx, float *w, const float *g, float *m, float *v, int64_t n,
                               float lr, float beta1, float beta2, float eps, float wd, int64_t t);
/* Bytes of scratch lm_cuda_muon_update needs. */
size_t lm_cuda_muon_scratch_bytes(int64_t rows, int64_t cols, int n_blocks);
/* lm_muon_update: all n_blocks blocks at once (strided-batched cuBLASLt
 * products), TF32 products with fp32 accumulation unless cfg->muon_ns_fp32. */
lm_status lm_cuda_muon_update(const lm_cuda_context *ctx, float *w, const float *g, float *momentum, int64_t rows,
                              int64_t cols, int n_blocks, float lr, float wd, const lm_optim_config *cfg,
                              void *scratch, size_t scratch_bytes);

#endif
