// The extern "C" API of the causal attention (include/longmoe/attention_cuda.h):
// argument checks, the choice between the flash kernels (attention_forward.cu,
// attention_backward.cu) and cuDNN (attention_cudnn.cu, when built), the
// workspace plan and the launches.
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_common.cuh"
#ifdef LONGMOE_HAVE_CUDNN
#include "attention_cudnn.h"
#endif
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

// Shapes, scale, offset and grid limits (no context needed).
lm_status check_shape(const lm_attention_config *cfg, int q_offset) {
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
    if (q_offset < 0 || (long long)q_offset + cfg->T > INT_MAX)
        return lm_error(LM_ERR_ARG, "attention (cuda): q_offset must be >= 0 with q_offset + T <= %d (got %d)",
                        INT_MAX, q_offset);
    // grid: (batch x head) in x (limit 2^31 - 1), tiles of >= 16 rows in y (limit 65535)
    if ((long long)cfg->B * cfg->H > INT_MAX)
        return lm_error(LM_ERR_ARG, "attention (cuda): B * H = %lld exceeds %d",
                        (long long)cfg->B * cfg->H, INT_MAX);
    const int smallest_tile = WARP_ROWS * (DQ_WARPS < DKV_WARPS ? DQ_WARPS : DKV_WARPS);
    const int rows = q_offset + cfg->T;  // the keys (>= the queries)
    if ((rows + smallest_tile - 1) / smallest_tile > 65535)
        return lm_error(LM_ERR_ARG, "attention (cuda): %d rows need more than 65535 tiles of %d", rows,
                        smallest_tile);
    return LM_OK;
}

// Shapes, scale, offset and grid limits shared by the forward and the backward.
lm_status check_config(const lm_cuda_context *ctx, const lm_attention_config *cfg, int q_offset) {
    if (!ctx) return lm_error(LM_ERR_ARG, "attention (cuda): ctx is NULL");
    return check_shape(cfg, q_offset);
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
    p.Tk = cfg->T;
    p.qoff = 0;
    return p;
}

}  // namespace


namespace {

size_t flash_backward_bytes(const lm_attention_config *cfg) {
    const size_t bytes = (size_t)cfg->B * cfg->H * cfg->T * sizeof(float);
    return (bytes + 255) & ~(size_t)255;
}

lm_status check_forward_ptrs(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *o) {
    const void *bf16_ptrs[4] = {q, k, v, o};
    const char *names[4] = {"q", "k", "v", "o"};
    for (int i = 0; i < 4; i++) {
        if (!bf16_ptrs[i]) return lm_error(LM_ERR_ARG, "attention forward (cuda): %s is NULL", names[i]);
        if (!aligned16(bf16_ptrs[i]))
            return lm_error(LM_ERR_ARG, "attention forward (cuda): %s is not 16-byte aligned", names[i]);
    }
    return LM_OK;
}

lm_status check_backward_ptrs(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *o,
                              const uint16_t *d_o, const float *lse, const uint16_t *dq, const uint16_t *dk,
                              const uint16_t *dv) {
    const void *bf16_ptrs[8] = {q, k, v, o, d_o, dq, dk, dv};
    const char *names[8] = {"q", "k", "v", "o", "d_o", "dq", "dk", "dv"};
    for (int i = 0; i < 8; i++) {
        if (!bf16_ptrs[i])
            return lm_error(LM_ERR_ARG, "attention backward (cuda): %s is NULL", names[i]);
        if (!aligned16(bf16_ptrs[i]))
            return lm_error(LM_ERR_ARG, "attention backward (cuda): %s is not 16-byte aligned", names[i]);
    }
    if (!lse) return lm_error(LM_ERR_ARG, "attention backward (cuda): lse is NULL");
    return LM_OK;
}

lm_status flash_forward(const lm_cuda_context *ctx, const lm_attention_config *cfg, int q_offset,
                        const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *o, float *lse,
                        float *head_max_logit) {
    Params p = make_params(cfg);
    p.Tk = q_offset + cfg->T;
    p.qoff = q_offset;
    p.q = q;
    p.k = k;
    p.v = v;
    p.o_out = o;
    p.lse = lse;
    p.head_max = head_max_logit;
    LM_CUDA_TRY(forward_dispatch(p, cfg->Dk, cfg->Dv, (cudaStream_t)ctx->stream));
    return LM_OK;
}

lm_status flash_backward(const lm_cuda_context *ctx, const lm_attention_config *cfg, int q_offset,
                         const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *o,
                         const uint16_t *d_o, const float *lse, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                         void *workspace, size_t workspace_bytes) {
    const size_t need = flash_backward_bytes(cfg);
    if (!workspace || workspace_bytes < need)
        return lm_error(LM_ERR_ARG,
                        "attention backward (flash): workspace of %zu bytes at %p, need %zu "
                        "(lm_cuda_attention_backward_workspace_bytes)",
                        workspace_bytes, workspace, need);
    if (((uintptr_t)workspace & 3) != 0)
        return lm_error(LM_ERR_ARG, "attention backward (flash): workspace is not 4-byte aligned");
    if ((long long)cfg->B * cfg->T * cfg->H / 8 + 1 > INT_MAX)
        return lm_error(LM_ERR_ARG, "attention backward (flash): B * T * H too large for one grid");
    Params p = make_params(cfg);
    p.Tk = q_offset + cfg->T;
    p.qoff = q_offset;
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

// "auto|cudnn|flash" (and "cudnn-fast" where allowed); NULL or "" is auto
lm_status parse_kind(const char *var, const char *val, bool allow_fast, lm_attention_kind *out) {
    if (!val || !*val || !strcmp(val, "auto")) {
        *out = LM_ATTENTION_AUTO;
    } else if (!strcmp(val, "flash")) {
        *out = LM_ATTENTION_FLASH;
    } else if (!strcmp(val, "cudnn")) {
        *out = LM_ATTENTION_CUDNN;
    } else if (allow_fast && !strcmp(val, "cudnn-fast")) {
        *out = LM_ATTENTION_CUDNN_FAST;
    } else if (allow_fast && !strcmp(val, "cudnn-blocked")) {
        *out = LM_ATTENTION_CUDNN_BLOCKED;
    } else {
        return lm_error(LM_ERR_ARG, "%s=%s: expected auto, cudnn%s or flash", var, val,
                        allow_fast ? ", cudnn-fast, cudnn-blocked" : "");
    }
    return LM_OK;
}

// LONGMOE_CUDNN_WORKSPACE_MB (default 4096) in bytes
__attribute__((unused)) lm_status workspace_limit(size_t *bytes) {
    const char *val = getenv("LONGMOE_CUDNN_WORKSPACE_MB");
    unsigned long long mb = 4096;
    if (val && *val) {
        char *end = NULL;
        mb = strtoull(val, &end, 10);
        if (!end || *end || val[0] == '-' || mb > (1ull << 40))
            return lm_error(LM_ERR_ARG, "LONGMOE_CUDNN_WORKSPACE_MB=%s: expected a number of MiB", val);
    }
    *bytes = (size_t)mb << 20;
    return LM_OK;
}

// LONGMOE_CUDNN_BLOCK (default 8192): rows of a block of the blocked backward
__attribute__((unused)) lm_status block_rows(int *L) {
    const char *val = getenv("LONGMOE_CUDNN_BLOCK");
    long n = 8192;
    if (val && *val) {
        char *end = NULL;
        n = strtol(val, &end, 10);
        if (!end || *end || n < 64 || n > (1L << 24) || n % 64)
            return lm_error(LM_ERR_ARG, "LONGMOE_CUDNN_BLOCK=%s: expected a multiple of 64 from 64 to 2^24", val);
    }
    *L = (int)n;
    return LM_OK;
}

__attribute__((unused)) lm_status not_built() {
    return lm_error(LM_ERR_ARG,
                    "attention (cuda): the cuDNN attention is not built into this library (cuDNN or the "
                    "cudnn-frontend headers were not found at configure time; docs/cuda.md): use "
                    "LONGMOE_ATTENTION=flash or rebuild with them");
}

#ifdef LONGMOE_HAVE_CUDNN
lmcudnn::Shape cudnn_shape(const lm_attention_config *cfg, int q_offset) {
    lmcudnn::Shape s;
    s.B = cfg->B;
    s.T = cfg->T;
    s.Tk = q_offset + cfg->T;
    s.H = cfg->H;
    s.Hkv = cfg->Hkv;
    s.Dk = cfg->Dk;
    s.Dv = cfg->Dv;
    s.scale = cfg->scale > 0.f ? cfg->scale : 1.f / sqrtf((float)cfg->Dk);
    return s;
}

lm_status device_of(int *device) {
    cudaError_t e = cudaGetDevice(device);
    if (e != cudaSuccess) return lm_error(LM_ERR_IO, "attention (cuda): cudaGetDevice: %s", cudaGetErrorString(e));
    return LM_OK;
}

lm_status cudnn_forward_ok(const lm_attention_config *cfg, int q_offset, lmcudnn::FwdMode mode) {
    int device;
    lm_status st = device_of(&device);
    if (st) return st;
    return lmcudnn::forward_prepare(device, cudnn_shape(cfg, q_offset), mode);
}

lm_status cudnn_backward_ws(const lm_attention_config *cfg, int q_offset, bool deterministic, size_t *bytes) {
    int device;
    lm_status st = device_of(&device);
    if (st) return st;
    return lmcudnn::backward_prepare(device, cudnn_shape(cfg, q_offset), deterministic, bytes);
}

lm_status cudnn_blocked_ws(const lm_attention_config *cfg, int q_offset, size_t *bytes) {
    int device, L = 0;
    lm_status st = device_of(&device);
    if (st || (st = block_rows(&L))) return st;
    return lmcudnn::backward_blocked_prepare(device, cudnn_shape(cfg, q_offset), L, bytes);
}
#endif

// The forward's kind for `want` (AUTO: the env's, then the shape's).
// cuDNN wants 16-byte aligned tensors: auto takes flash for an lse that is not.
lm_status resolve_forward(const lm_attention_config *cfg, int q_offset, lm_attention_kind want, const float *lse,
                          bool head_max, lm_attention_kind *out) {
    lm_status st;
    if (want == LM_ATTENTION_AUTO && (st = lm_cuda_attention_env_kind(0, &want))) return st;
    if (want == LM_ATTENTION_CUDNN_FAST || want == LM_ATTENTION_CUDNN_BLOCKED)
        want = LM_ATTENTION_CUDNN;  // one forward for the three
    if (want != LM_ATTENTION_AUTO) {
        *out = want;
        return LM_OK;
    }
    *out = LM_ATTENTION_FLASH;
#ifdef LONGMOE_HAVE_CUDNN
    const lmcudnn::FwdMode mode = head_max ? lmcudnn::FWD_MAX_SUM : lse ? lmcudnn::FWD_STATS : lmcudnn::FWD_O_ONLY;
    if (aligned16(lse) && cudnn_forward_ok(cfg, q_offset, mode) == LM_OK) *out = LM_ATTENTION_CUDNN;
#else
    (void)cfg;
    (void)q_offset;
    (void)lse;
    (void)head_max;
#endif
    return LM_OK;
}

// The backward's kind for `want` (AUTO: the env's, then the shape's and the
// limit's) and its workspace bytes; `have` (SIZE_MAX: any) is the workspace
// the caller holds, auto falls back to flash when cuDNN's does not fit.
lm_status resolve_backward(const lm_attention_config *cfg, int q_offset, lm_attention_kind want, size_t have,
                           const float *lse, lm_attention_kind *out, size_t *bytes) {
    lm_status st;
    if (want == LM_ATTENTION_AUTO && (st = lm_cuda_attention_env_kind(1, &want))) return st;
    *out = LM_ATTENTION_FLASH;
    *bytes = flash_backward_bytes(cfg);
    if (want == LM_ATTENTION_FLASH) return LM_OK;
#ifdef LONGMOE_HAVE_CUDNN
    size_t ws = 0;
    if (want == LM_ATTENTION_CUDNN || want == LM_ATTENTION_CUDNN_FAST) {
        if ((st = cudnn_backward_ws(cfg, q_offset, want == LM_ATTENTION_CUDNN, &ws))) return st;
        *out = want;
        *bytes = ws;
        return LM_OK;
    }
    if (want == LM_ATTENTION_CUDNN_BLOCKED) {
        if ((st = cudnn_blocked_ws(cfg, q_offset, &ws))) return st;
        *out = want;
        *bytes = ws;
        return LM_OK;
    }
    size_t limit = 0;
    if ((st = workspace_limit(&limit))) return st;
    if (!aligned16(lse)) return LM_OK;
    if (cudnn_backward_ws(cfg, q_offset, true, &ws) == LM_OK && ws <= limit && ws <= have) {
        *out = LM_ATTENTION_CUDNN;
        *bytes = ws;
        return LM_OK;
    }
    /* the whole deterministic backward's dP buffer does not fit: the same backward in blocks */
    if (cudnn_blocked_ws(cfg, q_offset, &ws) == LM_OK && ws <= limit && ws <= have) {
        *out = LM_ATTENTION_CUDNN_BLOCKED;
        *bytes = ws;
    }
    return LM_OK;
#else
    (void)q_offset;
    (void)have;
    (void)lse;
    if (want != LM_ATTENTION_AUTO) return not_built();
    return LM_OK;
#endif
}

}  // namespace

extern "C" const char *lm_attention_kind_name(lm_attention_kind kind) {
    switch (kind) {
    case LM_ATTENTION_AUTO: return "auto";
    case LM_ATTENTION_FLASH: return "flash";
    case LM_ATTENTION_CUDNN: return "cudnn";
    case LM_ATTENTION_CUDNN_FAST: return "cudnn-fast";
    case LM_ATTENTION_CUDNN_BLOCKED: return "cudnn-blocked";
    }
    return "unknown";
}

extern "C" int lm_cuda_attention_cudnn_built(void) {
#ifdef LONGMOE_HAVE_CUDNN
    return 1;
#else
    return 0;
#endif
}

extern "C" lm_status lm_cuda_attention_env_kind(int backward, lm_attention_kind *kind) {
    if (!kind) return lm_error(LM_ERR_ARG, "attention (cuda): kind is NULL");
    lm_status st = parse_kind("LONGMOE_ATTENTION", getenv("LONGMOE_ATTENTION"), false, kind);
    if (st || !backward) return st;
    const char *bwd = getenv("LONGMOE_ATTENTION_BWD");
    if (bwd && *bwd) return parse_kind("LONGMOE_ATTENTION_BWD", bwd, true, kind);
    return LM_OK;
}

extern "C" lm_status lm_cuda_attention_resolve(const lm_attention_config *cfg, int q_offset, int backward,
                                               lm_attention_kind *kind) {
    lm_status st = check_shape(cfg, q_offset);
    if (st) return st;
    if (!kind) return lm_error(LM_ERR_ARG, "attention (cuda): kind is NULL");
    if (!backward) return resolve_forward(cfg, q_offset, LM_ATTENTION_AUTO, NULL, true, kind);
    size_t bytes;
    return resolve_backward(cfg, q_offset, LM_ATTENTION_AUTO, SIZE_MAX, NULL, kind, &bytes);
}

extern "C" int lm_cuda_attention_kind_supported(const lm_attention_config *cfg, int q_offset,
                                                lm_attention_kind kind, int backward) {
    if (check_shape(cfg, q_offset)) return 0;
    if (kind == LM_ATTENTION_FLASH) return 1;
    if (kind != LM_ATTENTION_CUDNN && kind != LM_ATTENTION_CUDNN_FAST && kind != LM_ATTENTION_CUDNN_BLOCKED) {
        lm_error(LM_ERR_ARG, "attention (cuda): kind %d is not one implementation", (int)kind);
        return 0;
    }
#ifdef LONGMOE_HAVE_CUDNN
    if (!backward)
        return cudnn_forward_ok(cfg, q_offset, lmcudnn::FWD_STATS) == LM_OK &&
               cudnn_forward_ok(cfg, q_offset, lmcudnn::FWD_MAX_SUM) == LM_OK;
    size_t ws;
    if (kind == LM_ATTENTION_CUDNN_BLOCKED) return cudnn_blocked_ws(cfg, q_offset, &ws) == LM_OK;
    return cudnn_backward_ws(cfg, q_offset, kind == LM_ATTENTION_CUDNN, &ws) == LM_OK;
#else
    (void)backward;
    not_built();
    return 0;
#endif
}

extern "C" lm_status lm_cuda_attention_forward_kind(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                                    lm_attention_kind kind, int q_offset, const uint16_t *q,
                                                    const uint16_t *k, const uint16_t *v, uint16_t *o, float *lse,
                                                    float *head_max_logit) {
    lm_status st = check_config(ctx, cfg, q_offset);
    if (st || (st = check_forward_ptrs(q, k, v, o))) return st;
    if ((st = resolve_forward(cfg, q_offset, kind, lse, head_max_logit != NULL, &kind))) return st;
    if (kind == LM_ATTENTION_FLASH) return flash_forward(ctx, cfg, q_offset, q, k, v, o, lse, head_max_logit);
#ifdef LONGMOE_HAVE_CUDNN
    if (!aligned16(lse))
        return lm_error(LM_ERR_ARG, "attention forward (cudnn): lse is not 16-byte aligned");
    return lmcudnn::forward(ctx, cudnn_shape(cfg, q_offset), q, k, v, o, lse, head_max_logit);
#else
    return not_built();
#endif
}

extern "C" size_t lm_cuda_attention_backward_workspace_bytes_kind(const lm_attention_config *cfg,
                                                                  lm_attention_kind kind, int q_offset) {
    if (check_shape(cfg, q_offset)) return 0;
    lm_attention_kind got;
    size_t bytes;
    if (resolve_backward(cfg, q_offset, kind, SIZE_MAX, NULL, &got, &bytes)) return 0;
    return bytes;
}

extern "C" lm_status lm_cuda_attention_backward_kind(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                                     lm_attention_kind kind, int q_offset, const uint16_t *q,
                                                     const uint16_t *k, const uint16_t *v, const uint16_t *o,
                                                     const uint16_t *d_o, const float *lse, uint16_t *dq,
                                                     uint16_t *dk, uint16_t *dv, void *workspace,
                                                     size_t workspace_bytes) {
    lm_status st = check_config(ctx, cfg, q_offset);
    if (st || (st = check_backward_ptrs(q, k, v, o, d_o, lse, dq, dk, dv))) return st;
    size_t need;
    if ((st = resolve_backward(cfg, q_offset, kind, workspace ? workspace_bytes : 0, lse, &kind, &need))) return st;
    if (kind == LM_ATTENTION_FLASH)
        return flash_backward(ctx, cfg, q_offset, q, k, v, o, d_o, lse, dq, dk, dv, workspace, workspace_bytes);
#ifdef LONGMOE_HAVE_CUDNN
    if (!aligned16(lse)) return lm_error(LM_ERR_ARG, "attention backward (cudnn): lse is not 16-byte aligned");
    if (need > 0 && (!workspace || workspace_bytes < need))
        return lm_error(LM_ERR_ARG,
                        "attention backward (%s): workspace of %zu bytes at %p, need %zu "
                        "(lm_cuda_attention_backward_workspace_bytes)",
                        lm_attention_kind_name(kind), workspace_bytes, workspace, need);
    if (kind == LM_ATTENTION_CUDNN_BLOCKED) {
        int L = 0;
        if ((st = block_rows(&L))) return st;
        return lmcudnn::backward_blocked(ctx, cudnn_shape(cfg, q_offset), L, q, k, v, o, d_o, lse, dq, dk, dv,
                                         workspace, workspace_bytes);
    }
    return lmcudnn::backward(ctx, cudnn_shape(cfg, q_offset), kind == LM_ATTENTION_CUDNN, q, k, v, o, d_o, lse,
                             dq, dk, dv, workspace, workspace_bytes);
#else
    return not_built();
#endif
}

extern "C" size_t lm_cuda_attention_cudnn_scratch_bytes(void) {
#ifdef LONGMOE_HAVE_CUDNN
    int device;
    if (cudaGetDevice(&device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return lmcudnn::scratch_bytes(device);
#else
    return 0;
#endif
}

/* ---- the plain calls: the kind LONGMOE_ATTENTION asks for ---- */

extern "C" lm_status lm_cuda_attention_forward(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                               const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *o,
                                               float *lse, float *head_max_logit) {
    return lm_cuda_attention_forward_kind(ctx, cfg, LM_ATTENTION_AUTO, 0, q, k, v, o, lse, head_max_logit);
}

extern "C" size_t lm_cuda_attention_backward_workspace_bytes(const lm_attention_config *cfg) {
    return lm_cuda_attention_backward_workspace_bytes_kind(cfg, LM_ATTENTION_AUTO, 0);
}

extern "C" lm_status lm_cuda_attention_backward(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                                const uint16_t *q, const uint16_t *k, const uint16_t *v,
                                                const uint16_t *o, const uint16_t *d_o, const float *lse,
                                                uint16_t *dq, uint16_t *dk, uint16_t *dv, void *workspace,
                                                size_t workspace_bytes) {
    return lm_cuda_attention_backward_kind(ctx, cfg, LM_ATTENTION_AUTO, 0, q, k, v, o, d_o, lse, dq, dk, dv,
                                           workspace, workspace_bytes);
}

extern "C" lm_status lm_cuda_attention_forward_offset(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                                      int q_offset, const uint16_t *q, const uint16_t *k,
                                                      const uint16_t *v, uint16_t *o, float *lse,
                                                      float *head_max_logit) {
    return lm_cuda_attention_forward_kind(ctx, cfg, LM_ATTENTION_AUTO, q_offset, q, k, v, o, lse, head_max_logit);
}

extern "C" size_t lm_cuda_attention_backward_workspace_bytes_offset(const lm_attention_config *cfg, int q_offset) {
    return lm_cuda_attention_backward_workspace_bytes_kind(cfg, LM_ATTENTION_AUTO, q_offset);
}

extern "C" lm_status lm_cuda_attention_backward_offset(const lm_cuda_context *ctx, const lm_attention_config *cfg,
                                                       int q_offset, const uint16_t *q, const uint16_t *k,
                                                       const uint16_t *v, const uint16_t *o, const uint16_t *d_o,
                                                       const float *lse, uint16_t *dq, uint16_t *dk, uint16_t *dv,
                                                       void *workspace, size_t workspace_bytes) {
    return lm_cuda_attention_backward_kind(ctx, cfg, LM_ATTENTION_AUTO, q_offset, q, k, v, o, d_o, lse, dq, dk, dv,
                                           workspace, workspace_bytes);
}
