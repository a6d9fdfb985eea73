/* Kernels of the MoE layer on the GPU shared by its .cu files (not public). */
#ifndef LONGMOE_CUDA_MOE_INTERNAL_CUH
#define LONGMOE_CUDA_MOE_INTERNAL_CUH

#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "longmoe/core.h"

typedef __nv_bfloat16 bf16;

/* One bf16 product C (+)= A B with fp32 accumulation, in one of three layouts:
 *   NT: A(i,kk) = a[i lda + kk],  B(kk,c) = b[c ldb + kk]   (x W^T)
 *   NN: A(i,kk) = a[i lda + kk],  B(kk,c) = b[kk ldb + c]   (dy W)
 *   TN: A(i,kk) = a[kk lda + i],  B(kk,c) = b[kk ldb + c]   (dy^T x: weight gradients)
 * Grouping (group_offsets != NULL, groups experts, offsets multiples of the
 * row tile):
 *   NT, NN: rows are grouped rows; the tile of rows starting at r uses the
 *           weight b + j b_group_stride of the expert j owning r; tiles at or
 *           past group_offsets[groups] do nothing. K is the contraction.
 *   TN:     one grid layer per expert j: the contraction runs over the rows
 *           group_offsets[j] .. group_offsets[j+1]-1 and C is c + j c_group_stride.
 * Without grouping the contraction of TN runs over 0 .. K-1.
 * Output: fp32 c or bf16 cb (accumulate: +=, the sum rounded to bf16 for cb).
 * Each output element is written by one thread: deterministic. */
typedef enum { LM_GEMM_NT = 0, LM_GEMM_NN = 1, LM_GEMM_TN = 2 } lm_gemm_layout;

typedef struct {
    lm_gemm_layout layout;
    const bf16 *a;
    int64_t lda;
    const bf16 *b;
    int64_t ldb, b_group_stride;
    float *c;
    bf16 *cb;
    int64_t ldc, c_group_stride;
    int accumulate;
    int64_t M, N, K;
    const int32_t *group_offsets;
    int groups;
} lm_gemm_bf16_args;

lm_status lm_moe_gemm_bf16(cudaStream_t stream, const lm_gemm_bf16_args *g);

/* fp32 product of the router: C (+)= A B in the same three layouts, no grouping. */
lm_status lm_moe_gemm_f32(cudaStream_t stream, lm_gemm_layout layout, const float *a, int64_t lda,
                          const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate, int64_t M,
                          int64_t N, int64_t K);

/* The expert owning grouped row r: the last j with offsets[j] <= r (experts
 * without rows own none), from the padded (or unpadded) offsets [groups + 1]. */
__device__ __forceinline__ int group_of_row(const int32_t *offsets, int groups, int64_t r) {
    int lo = 0, hi = groups - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if ((int64_t)offsets[mid] <= r) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Slots a block of the counting sort handles. */
#define LM_MOE_SORT_BLOCK 256

#include "longmoe/moe_cuda.h"

/* cuBLAS products (moe_blas.cu), same arguments and layouts as above.
 * Dense (group_offsets ignored): one cublasGemmEx. */
lm_status lm_moe_blas_dense(const lm_cuda_context *ctx, const lm_gemm_bf16_args *g);
/* The router's fp32 product through cuBLAS (fp32 operands and compute, no TF32). */
lm_status lm_moe_blas_f32(const lm_cuda_context *ctx, lm_gemm_layout layout, const float *a, int64_t lda,
                          const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate, int64_t M, int64_t N,
                          int64_t K);

/* Grouped over the experts with rows, from the host counts of acts (filled
 * by lm_moe_blas_fetch_counts): kind LM_MOE_GEMM_GROUPED (one grouped call)
 * or LM_MOE_GEMM_LOOP (one call per expert). NT, NN: expert j's product has
 * the real rows of j (M of g is ignored); TN: contraction over those rows (K
 * of g is ignored). dw_tmp: bf16 [groups, M, N] scratch for a grouped TN
 * product into fp32 (cuBLAS groups one type for C): the product goes there
 * and is then added into c. A TN product without accumulate sets the
 * gradients of every group, the experts without rows to zero. */
lm_status lm_moe_blas_grouped(const lm_cuda_context *ctx, int kind, const lm_gemm_bf16_args *g,
                              const lm_cuda_moe_acts *acts, bf16 *dw_tmp);

/* Zero the TN outputs of g's groups: group j's [M, N] at c (or cb) + j
 * c_group_stride, rows ldc apart; all groups, or with host_offsets [groups +
 * 1] only those without rows. */
lm_status lm_moe_zero_weight_groups(cudaStream_t st, const lm_gemm_bf16_args *g, const int32_t *host_offsets);

/* Entries of each of the three device pointer arrays in acts.blas_ptrs (a,
 * b, c): one an expert, or one a 128-row tile of the grouped rows (the
 * batched kind's tile entries), whichever is more. The layer's acts hold two
 * such sets (the stream's, then the side stream's), an expert-parallel
 * owner's one. */
static inline int64_t lm_moe_blas_ptr_capacity(int64_t n, int64_t rows_max) {
    const int64_t tiles = rows_max / LM_MOE_CUDA_ROW_TILE;
    return tiles > n ? tiles : n;
}

/* Copy offsets and padded_offsets of the last routing to acts' host arrays
 * (pinned staging in ctx, one stream synchronisation). */
lm_status lm_moe_blas_fetch_counts(const lm_cuda_context *ctx, lm_cuda_moe_acts *acts, int n);


/* The wgmma kind's grouped products (moe_wgmma.cu), rows mode (NT, NN) over
 * all M = rows_max grouped rows with group_offsets = padded_offsets (the row
 * counts stay on the device). takes: whether this kernel runs g (layout,
 * sizes and alignment); the caller sends anything else to cuBLAS. NN writes
 * the transposed weights into wt_tmp (bf16, groups N K) first. */
bool lm_moe_wgmma_takes(const lm_gemm_bf16_args *g);
/* The tile's columns: 256 (128 x 256 tiles, four stages), or 128 with
 * LONGMOE_MOE_WGMMA_TILE=128x128 (three stages, two blocks a multiprocessor);
 * the environment is read once. */
int lm_moe_wgmma_tile_n(void);
lm_status lm_moe_wgmma_grouped(cudaStream_t stream, const lm_gemm_bf16_args *g, bf16 *wt_tmp);

/* How one layer call runs its bf16 products: the kind (lm_moe_gemm_kind),
 * the rows' acts (padded offsets on the device; for the cuBLAS kinds the host
 * counts and the operand pointer arrays) and its n experts. */
typedef struct {
    const lm_cuda_context *ctx;
    cudaStream_t st;
    int kind;
    const lm_cuda_moe_acts *acts;
    int n;
    bf16 *dw_tmp; /* backward only: bf16 [n, f, d_e] for the grouped weight gradients */
    int dw_set;   /* backward only: the routed experts' weight gradients are set, not added to */
    int side;     /* part of the call runs on the context's side stream (acts hold the second
                     pointer set): the forward's products of x alone, the backward's weight
                     gradients; the layer call makes the stream wait for it (ctx->side_join) */
} lm_moe_runner;

/* The backward's grouped buffers of the routed experts: dgout in, the rest out. */
typedef struct {
    bf16 *dgout, *dh, *da, *du, *dxg;
} lm_moe_expert_grads;

/* The routed experts' products over the grouped rows of a (moe.cu): the
 * forward's from a->xg into a->ga, gu, gh, gout; the backward's from e->dgout,
 * the weight gradients of g's gate, up, down (each may be NULL) accumulated,
 * or with r->dw_set written (every expert's, zero for those without rows). */
lm_status lm_moe_experts_forward(const lm_moe_runner *r, const lm_moe_config *c, const lm_moe_params_bf16 *pb,
                                 lm_cuda_moe_acts *a);
lm_status lm_moe_experts_backward(const lm_moe_runner *r, const lm_moe_config *c, const lm_moe_params_bf16 *pb,
                                  const lm_moe_params *g, const lm_cuda_moe_acts *a, const lm_moe_expert_grads *e);

/* Expert parallelism (moe_ep.cu): the same stage with the grouped rows sent
 * to their owners, who run their experts (pb's and g's gate, up, down: this
 * rank's slice) on what they received, and the results sent back into a's
 * gout (forward) or s's dxg (backward). Collective over ep's ranks. */
lm_status lm_moe_ep_check_config(const lm_cuda_moe_ep *ep, const lm_moe_config *c);
lm_status lm_moe_ep_experts_forward_cuda(const lm_moe_runner *r, const lm_moe_config *c, const lm_moe_params_bf16 *pb,
                                         lm_cuda_moe_acts *a, lm_cuda_moe_ep *ep);
lm_status lm_moe_ep_experts_backward_cuda(const lm_moe_runner *r, const lm_moe_config *c,
                                          const lm_moe_params_bf16 *pb, const lm_moe_params *g,
                                          const lm_cuda_moe_acts *a, lm_cuda_moe_scratch *s, lm_cuda_moe_ep *ep);

/* The by-token kernels' chunks of 8 elements a lane for rows of `width`
 * (one warp a row): 1, 2 or 4; 0 where they do not apply (width not a
 * multiple of 8, or over 1024). */
static inline int lm_moe_token_chunks(int width) {
    if (width % 8 != 0) return 0;
    const int per_lane = (width / 8 + 31) / 32;
    return per_lane <= 1 ? 1 : per_lane <= 2 ? 2 : per_lane <= 4 ? 4 : 0;
}

/* z = sum_t p_it gout[slot_row(i,t)] over the 8 elements of chunk e8 of
 * token i's row, in slot order (fp32): the by-row combination's and the
 * fused combination-with-norm's arithmetic. */
__device__ __forceinline__ void lm_moe_combine_chunk(float (&z)[8], const __nv_bfloat16 *gout, const float *weights,
                                                     const int32_t *slot_row, int64_t i, int k, int width, int e8) {
#pragma unroll
    for (int e = 0; e < 8; e++) z[e] = 0.0f;
    for (int t = 0; t < k; t++) {
        const float w = weights[i * k + t];
        const uint4 v = ((const uint4 *)(gout + (int64_t)slot_row[i * k + t] * width))[e8];
        const __nv_bfloat16 *vp = (const __nv_bfloat16 *)&v;
#pragma unroll
        for (int e = 0; e < 8; e++) z[e] += w * __bfloat162float(vp[e]);
    }
}

/* Routing (moe_route.cu): top-k of s + b, weights, stable counting sort into
 * the padded grouped layout (acts: s holds the logits W_r x on entry). */
lm_status lm_moe_route(cudaStream_t st, lm_cuda_moe_acts *a, const float *bias, int64_t m, int n, int k,
                       float route_scale);
/* xg[P, width] bf16 <- the token rows of src (one of src_f32, src_bf16). */
lm_status lm_moe_gather(cudaStream_t st, bf16 *xg, const float *src_f32, const bf16 *src_bf16,
                        const lm_cuda_moe_acts *a, int n, int k, int width);
/* out[m, width] = sum_t p_it gout[row(i,t)] */
lm_status lm_moe_combine(cudaStream_t st, float *out, const lm_cuda_moe_acts *a, int64_t m, int k, int width);
/* dgout = p dz (bf16, grouped), dp = <dz, gout> (gout bf16) */
lm_status lm_moe_combine_backward(cudaStream_t st, bf16 *dgout, float *dp, const float *dz,
                                  const lm_cuda_moe_acts *a, int n, int k, int width);
/* dx_f32 += or dx_bf16 = sum_t dxg[row(i,t)], rows of dx ld (>= width) elements apart */
lm_status lm_moe_scatter(cudaStream_t st, float *dx_f32, bf16 *dx_bf16, const bf16 *dxg, const lm_cuda_moe_acts *a,
                         int64_t m, int k, int width, int64_t ld);
/* dr[m, n] = extra s (1 - s) (or 0) + the chosen experts' ds s (1 - s) */
lm_status lm_moe_router_grad(cudaStream_t st, float *dr, const float *dp, const float *extra,
                             const lm_cuda_moe_acts *a, int64_t m, int n, int k, float route_scale);
/* dx[m, d] += dr W_r over each token's k chosen experts only (slot order, fp32;
 * valid when dr is zero off them: lm_moe_router_grad without extra) */
lm_status lm_moe_router_dx_sparse(cudaStream_t st, float *dx, const float *dr, const float *router,
                                  const lm_cuda_moe_acts *a, int64_t m, int n, int k, int d);

#endif
