/* Causal attention on Hopper (sm_90a): the GPU mirror of the CPU operator in
 * attention.h (same shapes, GQA rule, scale and causal mask; docs/cuda.md,
 * "Attention on the GPU"). Two implementations ("kinds") sit behind one API:
 *
 *   flash       our mma.sync flash kernels (src/cuda/attention/attention_*.cu);
 *   cudnn       cuDNN's fused attention through cudnn-frontend (built when
 *               cuDNN and the frontend headers are found: LONGMOE_HAVE_CUDNN),
 *               deterministic backward;
 *   cudnn-fast  the same forward with cuDNN's faster, NON-deterministic
 *               backward (dq accumulated by atomics): runs are then no longer
 *               bit-identical. Opt-in only (LONGMOE_ATTENTION_BWD=cudnn-fast).
 *
 * lm_cuda_attention_forward / _backward pick one per call (LONGMOE_ATTENTION,
 * below); the _kind variants run the one named.
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
 * The calls only enqueue work on ctx's stream (no synchronisation, no
 * allocation), except the first cuDNN call of a shape, which builds and caches
 * cuDNN's plan and may grow the cuDNN forward scratch (see
 * lm_cuda_attention_cudnn_scratch_bytes). Results of the flash and cudnn kinds
 * are bit-identical from run to run on the same GPU; the flash kernels use no
 * float atomics and sum in a fixed order. */
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

/* Bytes of device workspace the backward needs, for the kind it will run
 * (LONGMOE_ATTENTION): flash, B*H*T floats (D_i = rowsum(dO * O)) rounded up
 * to 256, never a T x T matrix; cudnn, cuDNN's workspace (its deterministic
 * backward keeps a dP buffer of about B*H*T*T*2 bytes on Hopper, hence
 * LONGMOE_CUDNN_WORKSPACE_MB). With less than that the backward runs the
 * flash kernels when their workspace fits. 0 for a bad shape or a bad
 * LONGMOE_ATTENTION* value (the backward then says which). With cuDNN built
 * the first call of a shape builds cuDNN's plan on the current device. */
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

/* ---- offsets: queries of a later part of the sequences ----
 * The CPU meaning of lm_attention_forward_offset (attention.h): the T queries
 * sit at positions q_offset .. q_offset+T-1 of sequences whose keys and values
 * are positions 0 .. q_offset+T-1, so k is [B,q_offset+T,Hkv,Dk] and v
 * [B,q_offset+T,Hkv,Dv]; query i attends keys j <= q_offset + i. q, o, d_o,
 * dq and lse have the T queries' shapes, dk and dv (written, covering all
 * q_offset+T key rows) the keys'. q_offset 0 is the calls above, bit for bit. */
lm_status lm_cuda_attention_forward_offset(const lm_cuda_context *ctx, const lm_attention_config *cfg, int q_offset,
                                           const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *o,
                                           float *lse, float *head_max_logit);
size_t lm_cuda_attention_backward_workspace_bytes_offset(const lm_attention_config *cfg, int q_offset);
lm_status lm_cuda_attention_backward_offset(const lm_cuda_context *ctx, const lm_attention_config *cfg, int q_offset,
                                            const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                            const uint16_t *o, const uint16_t *d_o, const float *lse, uint16_t *dq,
                                            uint16_t *dk, uint16_t *dv, void *workspace, size_t workspace_bytes);

/* ---- implementations ----
 * Selection (read at every call):
 *   LONGMOE_ATTENTION=auto|cudnn|flash (default auto) picks the forward and
 *     the backward; auto takes cuDNN when it is built and supports the shape
 *     (its forward), and for the backward also when the deterministic
 *     backward's cuDNN workspace is at most LONGMOE_CUDNN_WORKSPACE_MB MiB
 *     (default 4096); otherwise the flash kernels.
 *   LONGMOE_ATTENTION_BWD=auto|cudnn|cudnn-fast|cudnn-blocked|flash (default:
 *     as LONGMOE_ATTENTION) overrides the backward's choice; cudnn-fast is the
 *     non-deterministic cuDNN backward, cudnn-blocked the deterministic one in
 *     blocks (long rows; LONGMOE_CUDNN_BLOCK rows a block, a multiple of 64).
 * An unknown value is an error (LM_ERR_ARG) naming the variable. Forward and
 * backward kinds may differ: both share the lse contract. */
typedef enum {
    LM_ATTENTION_AUTO = 0,
    LM_ATTENTION_FLASH = 1,
    LM_ATTENTION_CUDNN = 2,      /* deterministic backward */
    LM_ATTENTION_CUDNN_FAST = 3, /* non-deterministic backward; forward as LM_ATTENTION_CUDNN */
    LM_ATTENTION_CUDNN_BLOCKED = 4 /* deterministic backward in blocks of LONGMOE_CUDNN_BLOCK (default 8192)
                                    * queries and keys: cuDNN's dP buffer B*H*L*L*2 bytes instead of
                                    * B*H*T*Tk*2; forward as LM_ATTENTION_CUDNN */
} lm_attention_kind;

/* "auto", "flash", "cudnn", "cudnn-fast", "cudnn-blocked" */
const char *lm_attention_kind_name(lm_attention_kind kind);
/* 1 when the cuDNN kinds are built into this library (LONGMOE_HAVE_CUDNN). */
int lm_cuda_attention_cudnn_built(void);
/* The kind LONGMOE_ATTENTION / LONGMOE_ATTENTION_BWD ask for (backward != 0:
 * the backward's), not yet resolved against the shape. */
lm_status lm_cuda_attention_env_kind(int backward, lm_attention_kind *kind);
/* What the plain calls run for this shape (never AUTO). Builds and caches the
 * cuDNN plans it needs (current device). */
lm_status lm_cuda_attention_resolve(const lm_attention_config *cfg, int q_offset, int backward,
                                    lm_attention_kind *kind);
/* 1 when `kind` (not AUTO) can run this shape on the current device; 0 with
 * the reason in lm_last_error() otherwise. For the backward a cuDNN kind needs
 * no workspace limit here (the limit is auto's). */
int lm_cuda_attention_kind_supported(const lm_attention_config *cfg, int q_offset, lm_attention_kind kind,
                                     int backward);

lm_status lm_cuda_attention_forward_kind(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                         lm_attention_kind kind, int q_offset, const uint16_t *q, const uint16_t *k,
                                         const uint16_t *v, uint16_t *o, float *lse, float *head_max_logit);
/* Backward workspace of `kind` (AUTO: the env's choice). 0 when the kind
 * cannot run the shape. */
size_t lm_cuda_attention_backward_workspace_bytes_kind(const lm_attention_config *cfg, lm_attention_kind kind,
                                                       int q_offset);
lm_status lm_cuda_attention_backward_kind(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                          lm_attention_kind kind, int q_offset, const uint16_t *q,
                                          const uint16_t *k, const uint16_t *v, const uint16_t *o,
                                          const uint16_t *d_o, const float *lse, uint16_t *dq, uint16_t *dk,
                                          uint16_t *dv, void *workspace, size_t workspace_bytes);

/* Device memory the cuDNN forward holds outside the caller's buffers on the
 * current device: its Max/Sum_exp rows and cuDNN's forward workspace, grown
 * once to the largest shape seen and then kept (0 before any cuDNN call). */
size_t lm_cuda_attention_cudnn_scratch_bytes(void);

#ifdef __cplusplus
}
#endif
#endif
