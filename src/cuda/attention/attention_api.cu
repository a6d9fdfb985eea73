// The extern "C" API of the flash attention kernels
// (include/longmoe/attention_cuda.h): argument checks, the workspace plan and
// the launches (attention_forward.cu, attention_backward.cu).
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention_common.cuh"
#include "cuda/cuda_check.h"
#include "longmoe/attention_cuda.h"

namespace lmattn {
cudaError_t forward_dispatch(const Params &p, int Dk, int Dv, cudaStream_t stream);
cudaError_t backward_dispatch(const Params &p, int Dk, int Dv, cudaStream_t stream);
}  // namespace lmattn

using namespace lmattn;

namespace {

bool head_dim_ok(int d) { return d == 32 || d == 64 || d == 128; }

bool aligned16(const void *ptr) { return ((uintptr_t)ptr & 15) == 0; }

// Shapes, scale and grid limits shared by the forward and the backward.
lm_status check_config(const lm_cuda_context *ctx, const lm_attention_config *cfg) {
    if (!ctx) return lm_error(LM_ERR_ARG, "attention (cuda): ctx is NULL");
    if (!cfg) return lm_error(LM_ERR_ARG, "attention (cuda): cfg is NULL");
    if (cfg->B < 1 || cfg->T < 1 || cfg->H < 1 || cfg->Hkv < 1)
        return lm_error(LM_ERR_ARG, "attention (cuda): B, T, H, Hkv must be >= 1 (got %d, %d, %d, %d)",
                        cfg->B, cfg->T, cfg->H, cfg->Hkv);
    if (cfg->H % cfg->Hkv != 0)
        return lm_error(LM_ERR_ARG, "attention (cuda): H (%d) must be a multiple of Hkv (%d)", cfg->H,
                        cfg->Hkv);
    if (!head_dim_ok(cfg->Dk))
        return lm_error(LM_ERR_ARG, "attention (cuda): Dk must be 32, 64 or 128 (got %d)", cfg->Dk);
    if (!head_dim_ok(cfg->Dv))
        return lm_error(LM_ERR_ARG, "attention (cuda): Dv must be 32, 64 or 128 (got %d)", cfg->Dv);
    if (!isfinite(cfg->scale) || cfg->scale < 0.f)
        return lm_error(LM_ERR_ARG, "attention (cuda): scale must be finite and >= 0 (got %g)",
                        (double)cfg->scale);
    // grid: (batch x head) in x (limit 2^31 - 1), tiles of >= 16 rows in y (limit 65535)
    if ((long long)cfg->B * cfg->H > INT_MAX)
        return lm_error(LM_ERR_ARG, "attention (cuda): B * H = %lld exceeds %d",
                        (long long)cfg->B * cfg->H, INT_MAX);
    const int smallest_tile = WARP_ROWS * (DQ_WARPS < DKV_WARPS ? DQ_WARPS : DKV_WARPS);
    if ((cfg->T + smallest_tile - 1) / smallest_tile > 65535)
        return lm_error(LM_ERR_ARG, "attention (cuda): T = %d needs more than 65535 tiles of %d",
                        cfg->T, smallest_tile);
    return LM_OK;
}

Params make_params(const lm_attention_config *cfg) {
    Params p;
    memset(&p, 0, sizeof p);
    p.B = cfg->B;
    p.T = cfg->T;
    p.H = cfg->H;
    p.Hkv = cfg->Hkv;
    p.group = cfg->H / cfg->Hkv;
    p.scale = cfg->scale > 0.f ? cfg->scale : 1.f / sqrtf((float)cfg->Dk);
    p.scale_log2 = p.scale * LOG2E;
    return p;
}

}  // namespace

extern "C" lm_status lm_cuda_attention_forward(const lm_cuda_context *ctx,
                                               const lm_attention_config *cfg, const uint16_t *q,
                                               const uint16_t *k, const uint16_t *v, uint16_t *o,
                                               float *lse, float *head_max_logit) {
    lm_status st = check_config(ctx, cfg);
    if (st) return st;
    const void *bf16_ptrs[4] = {q, k, v, o};
    const char *names[4] = {"q", "k", "v", "o"};
    for (int i = 0; i < 4; i++) {
        if (!bf16_ptrs[i]) return lm_error(LM_ERR_ARG, "attention forward (cuda): %s is NULL", names[i]);
        if (!aligned16(bf16_ptrs[i]))
            return lm_error(LM_ERR_ARG, "attention forward (cuda): %s is not 16-byte aligned", names[i]);
    }
    Params p = make_params(cfg);
    p.q = q;
    p.k = k;
    p.v = v;
    p.o_out = o;
    p.lse = lse;
    p.head_max = head_max_logit;
    LM_CUDA_TRY(forward_dispatch(p, cfg->Dk, cfg->Dv, (cudaStream_t)ctx->stream));
    return LM_OK;
}

extern "C" size_t lm_cuda_attention_backward_workspace_bytes(const lm_attention_config *cfg) {
    if (!cfg || cfg->B < 1 || cfg->T < 1 || cfg->H < 1) return 0;
    const size_t bytes = (size_t)cfg->B * cfg->H * cfg->T * sizeof(float);
    return (bytes + 255) & ~(size_t)255;
}

extern "C" lm_status lm_cuda_attention_backward(const lm_cuda_context *ctx,
                                                const lm_attention_config *cfg, const uint16_t *q,
                                                const uint16_t *k, const uint16_t *v,
                                                const uint16_t *o, const uint16_t *d_o,
                                                const float *lse, uint16_t *dq, uint16_t *dk,
                                                uint16_t *dv, void *workspace,
                                                size_t workspace_bytes) {
    lm_status st = check_config(ctx, cfg);
    if (st) return st;
    const void *bf16_ptrs[8] = {q, k, v, o, d_o, dq, dk, dv};
    const char *names[8] = {"q", "k", "v", "o", "d_o", "dq", "dk", "dv"};
    for (int i = 0; i < 8; i++) {
        if (!bf16_ptrs[i])
            return lm_error(LM_ERR_ARG, "attention backward (cuda): %s is NULL", names[i]);
        if (!aligned16(bf16_ptrs[i]))
            return lm_error(LM_ERR_ARG, "attention backward (cuda): %s is not 16-byte aligned",
                            names[i]);
    }
    if (!lse) return lm_error(LM_ERR_ARG, "attention backward (cuda): lse is NULL");
    const size_t need = lm_cuda_attention_backward_workspace_bytes(cfg);
    if (!workspace || workspace_bytes < need)
        return lm_error(LM_ERR_ARG,
                        "attention backward (cuda): workspace of %zu bytes at %p, need %zu "
                        "(lm_cuda_attention_backward_workspace_bytes)",
                        workspace_bytes, workspace, need);
    if (((uintptr_t)workspace & 3) != 0)
        return lm_error(LM_ERR_ARG, "attention backward (cuda): workspace is not 4-byte aligned");
    if ((long long)cfg->B * cfg->T * cfg->H / 8 + 1 > INT_MAX)
        return lm_error(LM_ERR_ARG, "attention backward (cuda): B * T * H too large for one grid");
    Params p = make_params(cfg);
    p.q = q;
    p.k = k;
    p.v = v;
    p.o = o;
    p.d_o = d_o;
    p.lse_in = lse;
    p.dq = dq;
    p.dk = dk;
    p.dv = dv;
    p.delta = static_cast<float *>(workspace);
    LM_CUDA_TRY(backward_dispatch(p, cfg->Dk, cfg->Dv, (cudaStream_t)ctx->stream));
    return LM_OK;
}
