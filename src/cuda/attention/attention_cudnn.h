// The cuDNN kinds of the causal attention (attention_cudnn.cu), called by the
// dispatch in attention_api.cu. Built only with LONGMOE_HAVE_CUDNN.
#ifndef LONGMOE_ATTENTION_CUDNN_H
#define LONGMOE_ATTENTION_CUDNN_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"
#include "longmoe/cuda_context.h"

namespace lmcudnn {

// One call's problem: T queries at positions Tk-T .. Tk-1 of Tk keys (Tk = T
// without an offset), the scale already resolved (> 0 or the default).
struct Shape {
    int B, T, Tk, H, Hkv, Dk, Dv;
    float scale;
};

// What the forward writes besides o.
enum FwdMode { FWD_O_ONLY = 0, FWD_STATS = 1, FWD_MAX_SUM = 2 };

inline FwdMode fwd_mode(const float *lse, const float *head_max) {
    return head_max ? FWD_MAX_SUM : lse ? FWD_STATS : FWD_O_ONLY;
}

// Build (once, cached) the plan; LM_OK when cuDNN runs it on `device`, else
// an error whose message says why.
lm_status forward_prepare(int device, const Shape &s, FwdMode mode);
lm_status forward(const lm_cuda_context *ctx, const Shape &s, const uint16_t *q, const uint16_t *k,
                  const uint16_t *v, uint16_t *o, float *lse, float *head_max);
// cuDNN's backward workspace (bytes) for the deterministic or the fast plan.
lm_status backward_prepare(int device, const Shape &s, bool deterministic, size_t *workspace_bytes);
lm_status backward(const lm_cuda_context *ctx, const Shape &s, bool deterministic, const uint16_t *q,
                   const uint16_t *k, const uint16_t *v, const uint16_t *o, const uint16_t *d_o,
                   const float *lse, uint16_t *dq, uint16_t *dk, uint16_t *dv, void *workspace,
                   size_t workspace_bytes);
// The blocked deterministic backward (blocks of at most L >= 64 queries and
// keys: cuDNN's dP buffer B*H*L*L*2 bytes instead of B*H*T*Tk*2): its whole
// workspace (cuDNN's and the fp32 sums').
lm_status backward_blocked_prepare(int device, const Shape &s, int L, size_t *workspace_bytes);
lm_status backward_blocked(const lm_cuda_context *ctx, const Shape &s, int L, const uint16_t *q, const uint16_t *k,
                           const uint16_t *v, const uint16_t *o, const uint16_t *d_o, const float *lse, uint16_t *dq,
                           uint16_t *dk, uint16_t *dv, void *workspace, size_t workspace_bytes);
size_t scratch_bytes(int device);

}  // namespace lmcudnn

#endif
