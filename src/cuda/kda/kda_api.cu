// The extern "C" API of the KDA CUDA kernels (include/longmoe/kda_cuda.h):
// validation, the workspace plan, the launch sequences and host wrappers.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda_check.h"
#include "kda_common.cuh"
#include "longmoe/kda_cuda.h"

using namespace lmkda;

namespace {

// Diagonal path: factored for the bounded gate with g_min >= the fast-path
// limit unless pairwise is asked for; the same rule as the CPU operator.
bool use_factored(const lm_kda_config *cfg) {
    if (cfg->diag == LM_KDA_DIAG_PAIRWISE) return false;
    return cfg->gate == LM_KDA_GATE_BOUNDED && cfg->g_min >= LM_KDA_G_MIN_FAST_LIMIT;
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

// The workspace plan: one block, pointers carved out of it in this order.
struct Plan {
    size_t w, u, qg, kd, aqk, gexp, w_lo, u_lo, kd_lo, X, h, vn, dh, dvn;
    size_t dW, M, dAqk, dAkk, dAqkDiag, dbeta_part, ddt_part, dA_part, total;
};

Plan make_plan(const lm_kda_config *cfg, int for_backward) {
    const size_t D = (size_t)cfg->K, N = (size_t)(cfg->T + CH - 1) / CH;
    const size_t nc = (size_t)cfg->B * cfg->H * N;
    Plan pl;
    size_t off = 0;
    auto take = [&](size_t bytes) {
        size_t o = off;
        off += align256(bytes);
        return o;
    };
    // w, qg, kd and aqk with the state kernels' padded rows (kda_common.cuh)
    pl.w = take(nc * CH * (D + 8) * 2);
    pl.u = take(nc * CH * D * 2);
    pl.qg = take(nc * CH * (D + 8) * 2);
    pl.kd = take(nc * CH * (D + 8) * 2);
    pl.aqk = take(nc * CH * ALD * 2);
    pl.gexp = take(nc * D * 4);
    pl.X = pl.h = pl.vn = pl.dh = pl.dvn = 0;
    pl.dW = pl.M = pl.dAqk = pl.dAkk = pl.dAqkDiag = pl.dbeta_part = 0;
    pl.ddt_part = pl.dA_part = 0;
    if (!for_backward) {
        // the residues for a precise final state (written only when ht is asked for)
        pl.w_lo = take(nc * CH * D * 2);
        pl.u_lo = take(nc * CH * D * 2);
        pl.kd_lo = take(nc * CH * D * 2);
    }
    if (for_backward) {
        pl.X = take(nc * CH * CH * 4);
        pl.h = take(nc * D * D * 2);
        pl.vn = take(nc * CH * D * 2);
        pl.dh = take(nc * D * D * 2);
        pl.dvn = take(nc * CH * D * 2);
        pl.dW = take(nc * CH * D * 2);
        pl.M = take(nc * CH * CH * 2);
        pl.dAqk = take(nc * CH * CH * 2);
        pl.dAkk = take(nc * CH * CH * 2);
        pl.dAqkDiag = take(nc * CH * 4);
        pl.dbeta_part = take(nc * (1 + bwd_col_blocks((int)D)) * CH * 4);
        // per-chunk terms of ddt_bias and dA_log (kda_backward.cu, kernel B)
        pl.ddt_part = take(nc * BWD_GATE_ROW_GROUPS * D * 4);
        pl.dA_part = take(nc * bwd_gate_dA_terms((int)D) * 4);
        // the forward's residues live where only the backward writes later:
        // w_lo [c][64][D] in dh [c][D][D] for D >= 64, else in M [c][64][64]
        pl.w_lo = D >= CH ? pl.dh : pl.M;
        pl.u_lo = pl.dW;
        pl.kd_lo = pl.dvn;
    }
    pl.total = off;
    return pl;
}

Params make_params(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in) {
    Params p;
    memset(&p, 0, sizeof p);
    p.B = cfg->B;
    p.T = cfg->T;
    p.H = cfg->H;
    p.N = (cfg->T + CH - 1) / CH;
    p.bounded = cfg->gate == LM_KDA_GATE_BOUNDED;
    p.g_min = cfg->g_min;
    p.scale = cfg->scale != 0.f ? cfg->scale : 1.f / sqrtf((float)cfg->K);
    p.q = reinterpret_cast<const bf16 *>(in->q);
    p.k = reinterpret_cast<const bf16 *>(in->k);
    p.v = reinterpret_cast<const bf16 *>(in->v);
    p.z = reinterpret_cast<const bf16 *>(in->z);
    p.beta = in->beta;
    p.A_log = in->A_log;
    p.dt_bias = in->dt_bias;
    p.h0 = in->h0;
    p.dz_ld = cfg->dz_ld ? (size_t)cfg->dz_ld : (size_t)cfg->H * cfg->K;
    return p;
}

// Where the plan's buffers live: those before `split` (the forward's
// intermediates that the backward reads) in `kept`, the rest in `scratch`. One
// workspace is kept = workspace, scratch = workspace + split: the same
// addresses as one block.
struct Bases {
    unsigned char *kept, *scratch;
    size_t split;
    unsigned char *at(size_t off) const { return off < split ? kept + off : scratch + (off - split); }
};

Bases one_block(const Plan &pl, void *workspace, int for_backward) {
    Bases b;
    b.kept = static_cast<unsigned char *>(workspace);
    b.split = for_backward ? pl.dh : pl.total;
    b.scratch = b.kept + b.split;
    return b;
}

void carve(Params *p, const Plan &pl, const Bases &ws, int for_backward, int precise) {
    if (precise) {
        p->w_lo = reinterpret_cast<bf16 *>(ws.at(pl.w_lo));
        p->u_lo = reinterpret_cast<bf16 *>(ws.at(pl.u_lo));
        p->kd_lo = reinterpret_cast<bf16 *>(ws.at(pl.kd_lo));
    }
    p->w = reinterpret_cast<bf16 *>(ws.at(pl.w));
    p->u = reinterpret_cast<bf16 *>(ws.at(pl.u));
    p->qg = reinterpret_cast<bf16 *>(ws.at(pl.qg));
    p->kd = reinterpret_cast<bf16 *>(ws.at(pl.kd));
    p->aqk = reinterpret_cast<bf16 *>(ws.at(pl.aqk));
    p->gexp = reinterpret_cast<float *>(ws.at(pl.gexp));
    if (for_backward) {
        p->X = reinterpret_cast<float *>(ws.at(pl.X));
        p->h = reinterpret_cast<bf16 *>(ws.at(pl.h));
        p->vn = reinterpret_cast<bf16 *>(ws.at(pl.vn));
        p->dh = reinterpret_cast<bf16 *>(ws.at(pl.dh));
        p->dvn = reinterpret_cast<bf16 *>(ws.at(pl.dvn));
        p->dWb = reinterpret_cast<bf16 *>(ws.at(pl.dW));
        p->Mb = reinterpret_cast<bf16 *>(ws.at(pl.M));
        p->dAqkb = reinterpret_cast<bf16 *>(ws.at(pl.dAqk));
        p->dAkkb = reinterpret_cast<bf16 *>(ws.at(pl.dAkk));
        p->dAqkDiag = reinterpret_cast<float *>(ws.at(pl.dAqkDiag));
        p->dbeta_part = reinterpret_cast<float *>(ws.at(pl.dbeta_part));
        p->ddt_part = reinterpret_cast<float *>(ws.at(pl.ddt_part));
        p->dA_part = reinterpret_cast<float *>(ws.at(pl.dA_part));
    }
}

lm_status check_inputs(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in, int need_v) {
    if (!in || !in->q || !in->k || !in->z || !in->beta || !in->A_log || !in->dt_bias ||
        (need_v && !in->v))
        return lm_error(LM_ERR_ARG, "kda cuda: q, k, v, z, beta, A_log and dt_bias are required "
                                    "device pointers (one is NULL)");
    return LM_OK;
}

// The chunked kernels move bf16 rows and workspace tiles in 16-byte pieces.
bool misaligned(const void *ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) != 0; }

lm_status check_aligned(const char *what, const void *const *ptrs, const char *const *names,
                        int n) {
    for (int i = 0; i < n; i++)
        if (ptrs[i] && misaligned(ptrs[i]))
            return lm_error(LM_ERR_ARG, "kda cuda %s: %s must be 16-byte aligned (got %p); "
                                        "cudaMalloc returns such pointers, offsets into a "
                                        "buffer must be multiples of 8 bf16 elements",
                            what, names[i], ptrs[i]);
    return LM_OK;
}

lm_status launched(cudaError_t e, const char *what) {
    if (e != cudaSuccess)
        return lm_error(e == cudaErrorMemoryAllocation ? LM_ERR_MEMORY : LM_ERR_IO,
                        "kda cuda: launching %s failed: %s (%s); hint: %s", what,
                        cudaGetErrorName(e), cudaGetErrorString(e), lm_cuda_hint(e));
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_kda_cuda_check(const lm_kda_config *cfg) {
    if (!cfg) return lm_error(LM_ERR_ARG, "kda cuda: config is NULL");
    if (cfg->B < 1 || cfg->T < 1 || cfg->H < 1)
        return lm_error(LM_ERR_ARG, "kda cuda: B, T, H must be >= 1 (got B=%d T=%d H=%d)", cfg->B,
                        cfg->T, cfg->H);
    if (cfg->K != cfg->V || !kda_dim_supported(cfg->K))
        return lm_error(LM_ERR_ARG, "kda cuda: supports K = V = 32, 64 or 128 (got K=%d V=%d)",
                        cfg->K, cfg->V);
    if ((long long)cfg->B * cfg->H > 65535)
        return lm_error(LM_ERR_ARG, "kda cuda: B*H = %lld exceeds 65535 (the kernels' grid "
                                    "y dimension); split the batch",
                        (long long)cfg->B * cfg->H);
    if (cfg->chunk != 0 && cfg->chunk != CH)
        return lm_error(LM_ERR_ARG, "kda cuda: chunk must be 64 (got %d)", cfg->chunk);
    if (cfg->gate != LM_KDA_GATE_BOUNDED && cfg->gate != LM_KDA_GATE_SOFTPLUS)
        return lm_error(LM_ERR_ARG, "kda cuda: unknown gate %d", (int)cfg->gate);
    if (cfg->gate == LM_KDA_GATE_BOUNDED && !(cfg->g_min < 0.f && isfinite(cfg->g_min)))
        return lm_error(LM_ERR_ARG, "kda cuda: g_min must be finite and < 0 (got %g)",
                        (double)cfg->g_min);
    if (!isfinite(cfg->scale) || cfg->scale < 0.f)
        return lm_error(LM_ERR_ARG, "kda cuda: scale must be >= 0 (0: K^-1/2), got %g",
                        (double)cfg->scale);
    if (cfg->diag == LM_KDA_DIAG_FACTORED && !use_factored(cfg))
        return lm_error(LM_ERR_ARG, "kda cuda: the factored diagonal needs the bounded gate with "
                                    "g_min >= %g (got gate %d, g_min %g)",
                        (double)LM_KDA_G_MIN_FAST_LIMIT, (int)cfg->gate, (double)cfg->g_min);
    if (cfg->dz_ld != 0 && cfg->dz_ld < (int64_t)cfg->H * cfg->K)
        return lm_error(LM_ERR_ARG, "kda cuda: dz_ld = %lld is below H*K = %lld", (long long)cfg->dz_ld,
                        (long long)cfg->H * cfg->K);
    return LM_OK;
}

extern "C" size_t lm_kda_cuda_workspace_bytes(const lm_kda_config *cfg, int for_backward) {
    return make_plan(cfg, for_backward).total;
}

extern "C" size_t lm_kda_cuda_kept_bytes(const lm_kda_config *cfg) { return make_plan(cfg, 1).dh; }

namespace {

// The forward. train: keep the backward's intermediates (X, h, V' besides the
// chunk operands) where ws puts them.
lm_status chunk_forward(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in, uint16_t *o, float *ht,
                        const Plan &pl, const Bases &ws, int train, cudaStream_t s) {
    // asking for the final state selects the precise state path (docs/cuda.md Precision)
    const bool precise = ht != NULL;
    Params p = make_params(cfg, in);
    carve(&p, pl, ws, train, precise);
    p.o = reinterpret_cast<bf16 *>(o);
    p.ht = ht;
    lm_status st;
    if ((st = launched(launch_fwd_intra(p, cfg->K, use_factored(cfg), train, precise, s),
                       "fwd_intra")))
        return st;
    if (!(train && precise))
        return launched(launch_fwd_state(p, cfg->K, train, precise, s), "fwd_state");
    // A training forward that also returns the state: o, h and V' from the
    // saving pass, then ht from a precise pass (the two do not fit one kernel's
    // shared memory).
    Params ps = p;
    ps.ht = NULL;
    if ((st = launched(launch_fwd_state(ps, cfg->K, true, false, s), "fwd_state (save)")))
        return st;
    Params pp = p;
    pp.o = NULL;
    return launched(launch_fwd_state(pp, cfg->K, false, true, s), "fwd_state (precise)");
}

lm_status check_forward(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in, const uint16_t *o,
                        const void *kept, const void *scratch) {
    lm_status st = lm_kda_cuda_check(cfg);
    if (st) return st;
    if ((st = check_inputs(cfg, in, 1))) return st;
    if (!o) return lm_error(LM_ERR_ARG, "kda cuda forward: o is NULL");
    const void *ptrs[] = {in->q, in->k, in->v, in->z, o, kept, scratch};
    const char *names[] = {"q", "k", "v", "z", "o", "the workspace", "the scratch"};
    return check_aligned("forward", ptrs, names, 7);
}

lm_status check_backward(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in, const uint16_t *d_o,
                         const lm_kda_cuda_grads *grads, const void *kept, const void *scratch) {
    lm_status st = lm_kda_cuda_check(cfg);
    if (st) return st;
    if ((st = check_inputs(cfg, in, 1))) return st;
    if (!d_o || !grads || !grads->dq || !grads->dk || !grads->dv || !grads->dz ||
        !grads->dbeta || !grads->dA_log || !grads->ddt_bias)
        return lm_error(LM_ERR_ARG, "kda cuda backward: d_o and every gradient except dh0 are "
                                    "required (one is NULL)");
    const void *ptrs[] = {in->q, in->k, in->v, in->z, d_o, grads->dq, grads->dk, grads->dv, grads->dz,
                          kept, scratch};
    const char *names[] = {"q", "k", "v", "z", "d_o", "dq", "dk", "dv", "dz", "the workspace", "the scratch"};
    return check_aligned("backward", ptrs, names, 11);
}

// The backward; forward_saved = 0: recompute the forward's intermediates first.
lm_status chunk_backward(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in, const uint16_t *d_o,
                         const float *dht, const lm_kda_cuda_grads *grads, const Plan &pl, const Bases &ws,
                         int forward_saved, cudaStream_t s) {
    Params p = make_params(cfg, in);
    carve(&p, pl, ws, 1, 0);
    p.d_o = reinterpret_cast<const bf16 *>(d_o);
    p.dht = dht;
    p.dq = reinterpret_cast<bf16 *>(grads->dq);
    p.dk = reinterpret_cast<bf16 *>(grads->dk);
    p.dv = reinterpret_cast<bf16 *>(grads->dv);
    p.dz = reinterpret_cast<bf16 *>(grads->dz);
    p.dbeta = grads->dbeta;
    p.dA_log = grads->dA_log;
    p.ddt_bias = grads->ddt_bias;
    p.dh0 = grads->dh0;
    const bool fac = use_factored(cfg);
    lm_status st;
    // Recompute the forward intermediates (X, the chunk states h and V')
    // unless the forward kept them, then the reverse state pass, then the
    // per-chunk gradients.
    if (!forward_saved) {
        if ((st = launched(launch_fwd_intra(p, cfg->K, fac, true, false, s), "fwd_intra")))
            return st;
        if ((st = launched(launch_fwd_state(p, cfg->K, true, false, s), "fwd_state (save)")))
            return st;
    }
    if ((st = launched(launch_bwd_state(p, cfg->K, s), "bwd_state"))) return st;
    return launched(launch_bwd_intra(p, cfg->K, fac, s), "bwd_intra");
}

// The kept variants' buffers: kept holds lm_kda_cuda_kept_bytes, scratch the rest of a
// backward-sized workspace.
lm_status kept_bases(const char *what, const lm_kda_config *cfg, void *kept, size_t kept_bytes, void *scratch,
                     size_t scratch_bytes, Plan *pl, Bases *ws) {
    *pl = make_plan(cfg, 1);
    if (!kept || kept_bytes < pl->dh)
        return lm_error(LM_ERR_ARG, "kda cuda %s: kept buffer of %zu bytes, need %zu", what, kept_bytes,
                        pl->dh);
    if (!scratch || scratch_bytes < pl->total - pl->dh)
        return lm_error(LM_ERR_ARG, "kda cuda %s: scratch of %zu bytes, need %zu", what, scratch_bytes,
                        pl->total - pl->dh);
    ws->kept = static_cast<unsigned char *>(kept);
    ws->scratch = static_cast<unsigned char *>(scratch);
    ws->split = pl->dh;
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_kda_cuda_chunk_forward(const lm_kda_config *cfg,
                                               const lm_kda_cuda_inputs *in, uint16_t *o,
                                               float *ht, void *workspace,
                                               size_t workspace_bytes, void *stream) {
    lm_status st = check_forward(cfg, in, o, workspace, NULL);
    if (st) return st;
    Plan pl = make_plan(cfg, 0);
    if (!workspace || workspace_bytes < pl.total)
        return lm_error(LM_ERR_ARG, "kda cuda forward: workspace of %zu bytes, need %zu",
                        workspace_bytes, pl.total);
    // a backward-sized workspace: keep X, h and V' for the backward
    const int train = workspace_bytes >= make_plan(cfg, 1).total;
    if (train) pl = make_plan(cfg, 1);
    return chunk_forward(cfg, in, o, ht, pl, one_block(pl, workspace, train), train,
                         static_cast<cudaStream_t>(stream));
}

extern "C" lm_status lm_kda_cuda_chunk_forward_kept(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in,
                                                    uint16_t *o, float *ht, void *kept, size_t kept_bytes,
                                                    void *scratch, size_t scratch_bytes, void *stream) {
    lm_status st = check_forward(cfg, in, o, kept, scratch);
    if (st) return st;
    Plan pl;
    Bases ws;
    if ((st = kept_bases("forward", cfg, kept, kept_bytes, scratch, scratch_bytes, &pl, &ws))) return st;
    return chunk_forward(cfg, in, o, ht, pl, ws, 1, static_cast<cudaStream_t>(stream));
}

extern "C" lm_status lm_kda_cuda_chunk_backward(const lm_kda_config *cfg,
                                                const lm_kda_cuda_inputs *in,
                                                const uint16_t *d_o, const float *dht,
                                                const lm_kda_cuda_grads *grads, void *workspace,
                                                size_t workspace_bytes, int forward_saved,
                                                void *stream) {
    lm_status st = check_backward(cfg, in, d_o, grads, workspace, NULL);
    if (st) return st;
    Plan pl = make_plan(cfg, 1);
    if (!workspace || workspace_bytes < pl.total)
        return lm_error(LM_ERR_ARG, "kda cuda backward: workspace of %zu bytes, need %zu",
                        workspace_bytes, pl.total);
    return chunk_backward(cfg, in, d_o, dht, grads, pl, one_block(pl, workspace, 1), forward_saved,
                          static_cast<cudaStream_t>(stream));
}

extern "C" lm_status lm_kda_cuda_chunk_backward_kept(const lm_kda_config *cfg, const lm_kda_cuda_inputs *in,
                                                     const uint16_t *d_o, const float *dht,
                                                     const lm_kda_cuda_grads *grads, const void *kept,
                                                     size_t kept_bytes, void *scratch, size_t scratch_bytes,
                                                     void *stream) {
    lm_status st = check_backward(cfg, in, d_o, grads, kept, scratch);
    if (st) return st;
    Plan pl;
    Bases ws;
    if ((st = kept_bases("backward", cfg, const_cast<void *>(kept), kept_bytes, scratch, scratch_bytes, &pl,
                         &ws)))
        return st;
    return chunk_backward(cfg, in, d_o, dht, grads, pl, ws, 1, static_cast<cudaStream_t>(stream));
}

extern "C" lm_status lm_kda_cuda_decode_step(const lm_kda_config *cfg,
                                             const lm_kda_cuda_inputs *in, float *state,
                                             uint16_t *o, void *stream) {
    lm_kda_config c1 = *cfg;
    c1.T = 1;
    lm_status st = lm_kda_cuda_check(&c1);
    if (st) return st;
    if ((st = check_inputs(&c1, in, 1))) return st;
    if (!state || !o) return lm_error(LM_ERR_ARG, "kda cuda decode: state and o are required");
    Params p = make_params(&c1, in);
    p.o = reinterpret_cast<bf16 *>(o);
    return launched(launch_decode(p, cfg->K, state, static_cast<cudaStream_t>(stream)),
                    "decode");
}

// ---- host wrappers ----

namespace {

// A device copy of n floats rounded to bf16 (bits), or of n floats.
lm_status to_device_bf16(const float *x, size_t n, uint16_t **out) {
    uint16_t *tmp = (uint16_t *)malloc(n * 2 + 2);
    if (!tmp) return lm_error(LM_ERR_MEMORY, "kda cuda: out of host memory (%zu bytes)", n * 2);
    for (size_t i = 0; i < n; i++) tmp[i] = lm_f32_to_bf16(x[i]);
    cudaError_t e = cudaMalloc((void **)out, n * 2);
    if (e == cudaSuccess) e = cudaMemcpy(*out, tmp, n * 2, cudaMemcpyHostToDevice);
    free(tmp);
    LM_CUDA_TRY(e);
    return LM_OK;
}

lm_status to_device_f32(const float *x, size_t n, float **out) {
    LM_CUDA_TRY(cudaMalloc((void **)out, n * 4));
    LM_CUDA_TRY(cudaMemcpy(*out, x, n * 4, cudaMemcpyHostToDevice));
    return LM_OK;
}

// Copy n bf16 values back and add (accumulate = 1) or store them as floats.
lm_status bf16_to_host(const uint16_t *dev, size_t n, float *out, int accumulate) {
    uint16_t *tmp = (uint16_t *)malloc(n * 2 + 2);
    if (!tmp) return lm_error(LM_ERR_MEMORY, "kda cuda: out of host memory (%zu bytes)", n * 2);
    cudaError_t e = cudaMemcpy(tmp, dev, n * 2, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess)
        for (size_t i = 0; i < n; i++)
            out[i] = accumulate ? out[i] + lm_bf16_to_f32(tmp[i]) : lm_bf16_to_f32(tmp[i]);
    free(tmp);
    LM_CUDA_TRY(e);
    return LM_OK;
}

lm_status f32_to_host(const float *dev, size_t n, float *out, int accumulate) {
    float *tmp = (float *)malloc(n * 4 + 4);
    if (!tmp) return lm_error(LM_ERR_MEMORY, "kda cuda: out of host memory (%zu bytes)", n * 4);
    cudaError_t e = cudaMemcpy(tmp, dev, n * 4, cudaMemcpyDeviceToHost);
    if (e == cudaSuccess)
        for (size_t i = 0; i < n; i++) out[i] = accumulate ? out[i] + tmp[i] : tmp[i];
    free(tmp);
    LM_CUDA_TRY(e);
    return LM_OK;
}

// Device copies of the inputs; freed by free_inputs.
struct DevInputs {
    uint16_t *q, *k, *v, *z;
    float *beta, *A_log, *dt_bias, *h0;
};

void free_inputs(DevInputs *d) {
    cudaFree(d->q);
    cudaFree(d->k);
    cudaFree(d->v);
    cudaFree(d->z);
    cudaFree(d->beta);
    cudaFree(d->A_log);
    cudaFree(d->dt_bias);
    cudaFree(d->h0);
    memset(d, 0, sizeof *d);
}

lm_status upload_inputs(const lm_kda_config *cfg, const lm_kda_inputs *in, int T, DevInputs *d,
                        lm_kda_cuda_inputs *di) {
    memset(d, 0, sizeof *d);
    if (!in || !in->q || !in->k || !in->v || !in->z || !in->beta || !in->A_log || !in->dt_bias)
        return lm_error(LM_ERR_ARG, "kda cuda: q, k, v, z, beta, A_log, dt_bias are required");
    const size_t nqk = (size_t)cfg->B * T * cfg->H * cfg->K;
    const size_t nv = (size_t)cfg->B * T * cfg->H * cfg->V;
    lm_status st;
    if ((st = to_device_bf16(in->q, nqk, &d->q)) || (st = to_device_bf16(in->k, nqk, &d->k)) ||
        (st = to_device_bf16(in->v, nv, &d->v)) || (st = to_device_bf16(in->z, nqk, &d->z)) ||
        (st = to_device_f32(in->beta, (size_t)cfg->B * T * cfg->H, &d->beta)) ||
        (st = to_device_f32(in->A_log, (size_t)cfg->H, &d->A_log)) ||
        (st = to_device_f32(in->dt_bias, (size_t)cfg->H * cfg->K, &d->dt_bias)) ||
        (in->h0 &&
         (st = to_device_f32(in->h0, (size_t)cfg->B * cfg->H * cfg->K * cfg->V, &d->h0)))) {
        free_inputs(d);
        return st;
    }
    di->q = d->q;
    di->k = d->k;
    di->v = d->v;
    di->z = d->z;
    di->beta = d->beta;
    di->A_log = d->A_log;
    di->dt_bias = d->dt_bias;
    di->h0 = d->h0;
    return LM_OK;
}

} // namespace

extern "C" lm_status lm_kda_cuda_forward_host(const lm_kda_config *cfg, const lm_kda_inputs *in,
                                              float *o, float *ht) {
    lm_status st = lm_kda_cuda_check(cfg);
    if (st) return st;
    if (!o) return lm_error(LM_ERR_ARG, "kda cuda forward: o is NULL");
    DevInputs d;
    lm_kda_cuda_inputs di;
    if ((st = upload_inputs(cfg, in, cfg->T, &d, &di))) return st;
    const size_t no = (size_t)cfg->B * cfg->T * cfg->H * cfg->V;
    const size_t ns = (size_t)cfg->B * cfg->H * cfg->K * cfg->V;
    const size_t wsb = lm_kda_cuda_workspace_bytes(cfg, 0);
    uint16_t *d_out = NULL;
    float *d_ht = NULL;
    void *ws = NULL;
    cudaError_t e = cudaMalloc((void **)&d_out, no * 2);
    if (e == cudaSuccess && ht) e = cudaMalloc((void **)&d_ht, ns * 4);
    if (e == cudaSuccess) e = cudaMalloc(&ws, wsb);
    if (e != cudaSuccess) {
        st = lm_error(LM_ERR_MEMORY, "kda cuda forward: cudaMalloc failed: %s",
                      cudaGetErrorString(e));
    } else {
        st = lm_kda_cuda_chunk_forward(cfg, &di, d_out, d_ht, ws, wsb, NULL);
        if (!st) {
            e = cudaDeviceSynchronize();
            if (e != cudaSuccess)
                st = lm_error(LM_ERR_IO, "kda cuda forward: kernel failed: %s (%s); hint: %s",
                              cudaGetErrorName(e), cudaGetErrorString(e), lm_cuda_hint(e));
        }
        if (!st) st = bf16_to_host(d_out, no, o, 0);
        if (!st && ht) st = f32_to_host(d_ht, ns, ht, 0);
    }
    cudaFree(d_out);
    cudaFree(d_ht);
    cudaFree(ws);
    free_inputs(&d);
    return st;
}

extern "C" lm_status lm_kda_cuda_backward_host(const lm_kda_config *cfg, const lm_kda_inputs *in,
                                               const float *d_o, const float *dht,
                                               lm_kda_grads *grads) {
    lm_status st = lm_kda_cuda_check(cfg);
    if (st) return st;
    if (!d_o || !grads || !grads->dq || !grads->dk || !grads->dv || !grads->dz || !grads->dbeta ||
        !grads->dA_log || !grads->ddt_bias)
        return lm_error(LM_ERR_ARG, "kda cuda backward: d_o and every gradient except dh0 are "
                                    "required (one is NULL)");
    if (cfg->dz_ld != 0 && cfg->dz_ld != (int64_t)cfg->H * cfg->K)
        return lm_error(LM_ERR_ARG, "kda cuda backward (host memory): dz_ld = %lld; host gradients are dense",
                        (long long)cfg->dz_ld);
    DevInputs d;
    lm_kda_cuda_inputs di;
    if ((st = upload_inputs(cfg, in, cfg->T, &d, &di))) return st;
    const size_t nqk = (size_t)cfg->B * cfg->T * cfg->H * cfg->K;
    const size_t nv = (size_t)cfg->B * cfg->T * cfg->H * cfg->V;
    const size_t nb = (size_t)cfg->B * cfg->T * cfg->H;
    const size_t ns = (size_t)cfg->B * cfg->H * cfg->K * cfg->V;
    const size_t wsb = lm_kda_cuda_workspace_bytes(cfg, 1);
    uint16_t *ddo = NULL;
    float *ddht = NULL;
    lm_kda_cuda_grads g;
    memset(&g, 0, sizeof g);
    void *ws = NULL;
    st = to_device_bf16(d_o, nv, &ddo);
    if (!st && dht) st = to_device_f32(dht, ns, &ddht);
    cudaError_t e = cudaSuccess;
    if (!st) {
        e = cudaMalloc((void **)&g.dq, nqk * 2);
        if (e == cudaSuccess) e = cudaMalloc((void **)&g.dk, nqk * 2);
        if (e == cudaSuccess) e = cudaMalloc((void **)&g.dv, nv * 2);
        if (e == cudaSuccess) e = cudaMalloc((void **)&g.dz, nqk * 2);
        if (e == cudaSuccess) e = cudaMalloc((void **)&g.dbeta, nb * 4);
        if (e == cudaSuccess) e = cudaMalloc((void **)&g.dA_log, (size_t)cfg->H * 4);
        if (e == cudaSuccess) e = cudaMalloc((void **)&g.ddt_bias, (size_t)cfg->H * cfg->K * 4);
        if (e == cudaSuccess && grads->dh0) e = cudaMalloc((void **)&g.dh0, ns * 4);
        if (e == cudaSuccess) e = cudaMalloc(&ws, wsb);
        if (e == cudaSuccess) e = cudaMemset(g.dA_log, 0, (size_t)cfg->H * 4);
        if (e == cudaSuccess) e = cudaMemset(g.ddt_bias, 0, (size_t)cfg->H * cfg->K * 4);
        if (e != cudaSuccess)
            st = lm_error(LM_ERR_MEMORY, "kda cuda backward: cudaMalloc failed: %s",
                          cudaGetErrorString(e));
    }
    if (!st) st = lm_kda_cuda_chunk_backward(cfg, &di, ddo, ddht, &g, ws, wsb, 0, NULL);
    if (!st) {
        e = cudaDeviceSynchronize();
        if (e != cudaSuccess)
            st = lm_error(LM_ERR_IO, "kda cuda backward: kernel failed: %s (%s); hint: %s",
                          cudaGetErrorName(e), cudaGetErrorString(e), lm_cuda_hint(e));
    }
    if (!st) st = bf16_to_host(g.dq, nqk, grads->dq, 1);
    if (!st) st = bf16_to_host(g.dk, nqk, grads->dk, 1);
    if (!st) st = bf16_to_host(g.dv, nv, grads->dv, 1);
    if (!st) st = bf16_to_host(g.dz, nqk, grads->dz, 1);
    if (!st) st = f32_to_host(g.dbeta, nb, grads->dbeta, 1);
    if (!st) st = f32_to_host(g.dA_log, (size_t)cfg->H, grads->dA_log, 1);
    if (!st) st = f32_to_host(g.ddt_bias, (size_t)cfg->H * cfg->K, grads->ddt_bias, 1);
    if (!st && grads->dh0) st = f32_to_host(g.dh0, ns, grads->dh0, 1);
    cudaFree(ddo);
    cudaFree(ddht);
    cudaFree(g.dq);
    cudaFree(g.dk);
    cudaFree(g.dv);
    cudaFree(g.dz);
    cudaFree(g.dbeta);
    cudaFree(g.dA_log);
    cudaFree(g.ddt_bias);
    cudaFree(g.dh0);
    cudaFree(ws);
    free_inputs(&d);
    return st;
}

extern "C" lm_status lm_kda_cuda_decode_host(const lm_kda_config *cfg, const lm_kda_inputs *in,
                                             float *state, float *o) {
    lm_kda_config c1 = *cfg;
    c1.T = 1;
    lm_status st = lm_kda_cuda_check(&c1);
    if (st) return st;
    if (!state || !o) return lm_error(LM_ERR_ARG, "kda cuda decode: state and o are required");
    DevInputs d;
    lm_kda_cuda_inputs di;
    if ((st = upload_inputs(&c1, in, 1, &d, &di))) return st;
    const size_t ns = (size_t)cfg->B * cfg->H * cfg->K * cfg->V;
    const size_t no = (size_t)cfg->B * cfg->H * cfg->V;
    float *dstate = NULL;
    uint16_t *dout = NULL;
    st = to_device_f32(state, ns, &dstate);
    if (!st) {
        cudaError_t e = cudaMalloc((void **)&dout, no * 2);
        if (e != cudaSuccess)
            st = lm_error(LM_ERR_MEMORY, "kda cuda decode: cudaMalloc failed: %s",
                          cudaGetErrorString(e));
    }
    if (!st) st = lm_kda_cuda_decode_step(&c1, &di, dstate, dout, NULL);
    if (!st) {
        cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess)
            st = lm_error(LM_ERR_IO, "kda cuda decode: kernel failed: %s (%s)",
                          cudaGetErrorName(e), cudaGetErrorString(e));
    }
    if (!st) st = f32_to_host(dstate, ns, state, 0);
    if (!st) st = bf16_to_host(dout, no, o, 0);
    cudaFree(dstate);
    cudaFree(dout);
    free_inputs(&d);
    return st;
}
