/* Causal flash attention on Hopper (sm_90a): the GPU mirror of the CPU
 * operator in attention.h (same shapes, GQA rule, scale and causal mask;
 * docs/cuda.md, "Attention on the GPU").
 *
 * Device pointers only. Shapes (row-major):
 *   q    [B,T,H,Dk]    bf16      k   [B,T,Hkv,Dk]  bf16     v [B,T,Hkv,Dv] bf16
 *   o    [B,T,H,Dv]    bf16      lse [B,H,T]       fp32
 * Dk and Dv each in {32, 64, 128} (they may differ); any T >= 1; H a
 * multiple of Hkv (query head h reads key/value head h / (H / Hkv)). The
 * products run on bf16 tensor cores with fp32 accumulation; the softmax
 * statistics (running max, running sum, lse, D_i) stay in fp32. Every
 * bf16 tensor must start on a 16-byte boundary (cudaMalloc gives 256).
 *
 * Both calls only enqueue kernels on ctx's stream (no synchronisation, no
 * allocation). Results are bit-identical from run to run on the same GPU:
 * no float atomics; every sum runs in a fixed order. */
#ifndef LONGMOE_ATTENTION_CUDA_H
#define LONGMOE_ATTENTION_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/attention.h"
#include "longmoe/cuda_context.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Forward: o (bf16) and lse [B,H,T] (fp32, natural log; may be NULL when no
 * backward follows). head_max_logit [H] (fp32, may be NULL): the largest
 * scaled score s_ij = scale * q_i . k_j (j <= i) of each query head over the
 * whole batch, for QK-Clip; each block takes the maximum of its scores and
 * the block maxima are combined by an exact maximum (order-free, so
 * deterministic). cfg->workspace is not used. */
lm_status lm_cuda_attention_forward(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                    const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                    uint16_t *o, float *lse, float *head_max_logit);

/* Bytes of device workspace the backward needs: B*H*T floats (D_i =
 * rowsum(dO * O)), rounded up to 256. Never a T x T matrix. */
size_t lm_cuda_attention_backward_workspace_bytes(const lm_attention_config *cfg);

/* Backward given d_o [B,T,H,Dv] (bf16) and the forward's o and lse. WRITES
 * (does not accumulate) dq [B,T,H,Dk], dk [B,T,Hkv,Dk], dv [B,T,Hkv,Dv], all
 * bf16 and all required. dk and dv of a key/value head sum over the query
 * heads of its group in a fixed order. `workspace` is device memory of at
 * least lm_cuda_attention_backward_workspace_bytes(cfg) bytes. */
lm_status lm_cuda_attention_backward(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                     const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                     const uint16_t *o, const uint16_t *d_o, const float *lse,
                                     uint16_t *dq, uint16_t *dk, uint16_t *dv, void *workspace,
                                     size_t workspace_bytes);

#ifdef __cplusplus
}
#endif
#endif
