/* Block Attention Residuals on the GPU: the state, its memory plan and the
 * call-order checks (include/longmoe/attnres_cuda.h). The host walks the same
 * call sequence as src/model/attnres.c and enqueues the kernels of
 * attnres_kernels.cu on the context's stream.
 *
 * Sources of sublayer l in block k = l / S, position p = l % S (as on the CPU):
 *   completed: hist[0] = v_0, hist[1..k] = b_1..b_k       (C = 1 + k of them)
 *   partial:   hist[1+k] while block k is open, when p > 0 (copied to the
 *              saved partials, slot l - k - 1, for the backward; with
 *              cfg.replay slot p - 1 of one block's, which the backward
 *              refills by replaying the block: attnres_partial_slot)
 *
 * st->step counts the calls exactly as the CPU state does:
 *   -1 nothing yet; 2l, 2l+1 input(l), add_output(l); 2L final; 2L+1 forward
 *   done; 2L+2+2k, +1 output_backward(l), input_backward(l) for l = L-1-k;
 *   4L+2 embedding_backward; 4L+3 backward done. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "cuda/attnres/attnres_internal.cuh"
#include "cuda/common/switch_setting.cuh"
#include "cuda/cuda_check.h"
#include "longmoe/attnres_cuda.h"
#include "model/attnres_plan.h"

#define ALIGN_BYTES 64

static size_t align_up(size_t b) { return (b + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES; }

static cudaStream_t stream_of(const lm_cuda_context *ctx) { return (cudaStream_t)ctx->stream; }

/* ---- geometry: the CPU module's functions (src/model/attnres_plan.h) ---- */

static lm_status check_config(const lm_attnres_config *c) {
    lm_status s = attnres_check_config(c, "attnres cuda");
    if (s) return s;
    if (c->n_tokens > (int64_t)INT32_MAX * LM_CUDA_ATTNRES_TOKEN_BLOCK)
        return lm_error(LM_ERR_ARG, "attnres cuda: n_tokens %lld exceeds the grid", (long long)c->n_tokens);
    return LM_OK;
}

/* the deferred backward's setting (LONGMOE_ATTNRES_BWD; deferred by default) */
static switch_setting defer_setting = {-1, "LONGMOE_ATTNRES_BWD", "attnres cuda deferred backward",
                                       {"direct", "deferred"}, 1};

extern "C" lm_status lm_cuda_attnres_set_deferred(int on) { return switch_set(&defer_setting, on); }
extern "C" int lm_cuda_attnres_deferred(void) { return switch_get(&defer_setting); }

/* whether cfg's backward defers (lm_cuda_attnres_set_deferred): block mode,
 * 2 <= S <= 65 (a position a bit of the mask), a mid-block sublayer after the
 * first block (L >= S + 2: the first block's sublayers have one closed
 * source, which gains nothing) and the fused norm */
static int defers(const lm_attnres_config *c) {
    if (!lm_cuda_attnres_deferred() || c->mode != LM_ATTNRES_BLOCK) return 0;
    const int S = attnres_effective_block(c), L = c->n_sublayers;
    return S >= 2 && S <= 65 && L >= S + 2 && lm_cuda_attnres_norm_fusable(c);
}

extern "C" lm_status lm_cuda_attnres_memory(const lm_attnres_config *c, lm_attnres_memory_plan *plan) {
    lm_status s = check_config(c);
    if (s) return s;
    if (!plan) return lm_error(LM_ERR_ARG, "attnres cuda: memory plan pointer is NULL");
    memset(plan, 0, sizeof *plan);
    const size_t n = (size_t)c->n_tokens, d = (size_t)c->d, L = (size_t)c->n_sublayers, f = sizeof(float);
    if (c->mode == LM_ATTNRES_STANDARD) {
        /* the running sum and its gradient */
        plan->n_blocks = 0;
        plan->n_history_sources = 1;
        plan->history = align_up(n * d * f);
        plan->history_grad = align_up(n * d * f);
        plan->history_bytes_per_token = (double)(d * f);
        plan->total_bytes_per_token = (double)(2 * d * f);
    } else {
        const int S = attnres_effective_block(c);
        const size_t N = (L + (size_t)S - 1) / (size_t)S, H = 1 + N;
        const size_t n_tb = (n + LM_CUDA_ATTNRES_TOKEN_BLOCK - 1) / LM_CUDA_ATTNRES_TOKEN_BLOCK;
        plan->n_blocks = (int)N;
        plan->n_history_sources = (int)H;
        plan->history = align_up(H * n * d * f) + align_up(H * n * f);
        /* the accumulators and the bf16 copy of the one that is the next output gradient */
        plan->history_grad = align_up(H * n * d * f) + align_up(n * d * sizeof(uint16_t));
        const size_t slots = (size_t)attnres_partial_slots(c);
        plan->saved_partials = align_up(slots * n * d * f) + align_up(L * n * f);
        plan->saved_scores =
            align_up(attnres_logits_offset((int)L + 1, S, (int)L, (int64_t)n) * f) + align_up((L + 1) * n * f);
        plan->phase1 = 0;  /* direct softmax per sublayer: no accumulators */
        plan->queries = 0; /* u = w (.) g is formed inside the kernels */
        /* the query's and key norm's partial sums, and the fused norm's weight gradient's */
        plan->param_grad = 2 * align_up(n_tb * d * f);
        /* the deferred backward: S - 1 dh rows and 3 N coefficients a token each */
        const size_t defer_rows = defers(c) ? (size_t)S - 1 : 0;
        plan->deferred = defer_rows ? align_up(defer_rows * n * d * f) + align_up(defer_rows * n * 3 * N * f) : 0;
        const double scores = (double)attnres_logits_offset((int)L + 1, S, (int)L, 1) + (double)(L + 1);
        plan->history_bytes_per_token = (double)(H * (d + 1) * f);
        plan->total_bytes_per_token = (double)(d * sizeof(uint16_t)) +
                                      (double)f * ((double)H * (d + 1) + (double)H * d + (double)slots * d +
                                                   (double)L + scores + 2.0 * (double)d / LM_CUDA_ATTNRES_TOKEN_BLOCK +
                                                   (double)defer_rows * (double)(d + 3 * N));
    }
    plan->total = plan->history + plan->history_grad + plan->saved_partials + plan->saved_scores + plan->phase1 +
                  plan->queries + plan->param_grad + plan->deferred;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_init(lm_cuda_attnres_state *st, const lm_attnres_config *c,
                                          void *workspace, size_t workspace_bytes) {
    lm_attnres_memory_plan plan;
    lm_status s = lm_cuda_attnres_memory(c, &plan);
    if (s) return s;
    if (!st) return lm_error(LM_ERR_ARG, "attnres cuda: state pointer is NULL");
    if (!workspace) return lm_error(LM_ERR_ARG, "attnres cuda: device_workspace is NULL");
    if ((uintptr_t)workspace % ALIGN_BYTES)
        return lm_error(LM_ERR_ARG, "attnres cuda: device_workspace must be aligned to 64 bytes");
    if (workspace_bytes < plan.total)
        return lm_error(LM_ERR_ARG, "attnres cuda: workspace of %zu bytes is too small, lm_cuda_attnres_memory "
                        "asks %zu", workspace_bytes, plan.total);
    memset(st, 0, sizeof *st);
    st->cfg = *c;
    st->S = attnres_effective_block(c);
    st->n_blocks = plan.n_blocks;
    const size_t n = (size_t)c->n_tokens, d = (size_t)c->d, L = (size_t)c->n_sublayers, f = sizeof(float);
    char *w = (char *)workspace;
#define CARVE(ptr, bytes)           \
    do {                            \
        (ptr) = (float *)(void *)w; \
        w += align_up(bytes);       \
    } while (0)
    if (c->mode == LM_ATTNRES_STANDARD) {
        CARVE(st->hist, n * d * f);
        CARVE(st->dhist, n * d * f);
    } else {
        const size_t H = (size_t)plan.n_history_sources;
        const size_t n_tb = (n + LM_CUDA_ATTNRES_TOKEN_BLOCK - 1) / LM_CUDA_ATTNRES_TOKEN_BLOCK;
        CARVE(st->hist, H * n * d * f);
        CARVE(st->hist_rstd, H * n * f);
        CARVE(st->dhist, H * n * d * f);
        st->dy_lp = (uint16_t *)(void *)w;
        w += align_up(n * d * sizeof(uint16_t));
        CARVE(st->partials, (size_t)attnres_partial_slots(c) * n * d * f);
        CARVE(st->partial_rstd, L * n * f);
        CARVE(st->logits, attnres_logits_offset((int)L + 1, st->S, (int)L, (int64_t)n) * f);
        CARVE(st->lse, (L + 1) * n * f);
        CARVE(st->qpart, n_tb * d * f);
        CARVE(st->npart, n_tb * d * f);
        if (plan.deferred) {
            const size_t rows = (size_t)st->S - 1;
            CARVE(st->defer_dh, rows * n * d * f);
            CARVE(st->defer_coef, rows * n * 3 * (size_t)plan.n_blocks * f);
        }
    }
#undef CARVE
    st->step = -1;
    st->dy_lp_for = -1;
    return LM_OK;
}

extern "C" int lm_cuda_attnres_n_sources(const lm_cuda_attnres_state *st, int l) {
    if (st->cfg.mode == LM_ATTNRES_STANDARD) return 1 + l;
    return attnres_n_sources_of(l, st->S, st->cfg.n_sublayers);
}

/* ---- call-order and argument checks (host) ---- */

static lm_status expect(const lm_cuda_attnres_state *st, int step, const char *call, int l) {
    if (st->step == step) return LM_OK;
    const int L = st->cfg.n_sublayers, cur = st->step;
    char want[112];
    if (cur < 0) snprintf(want, sizeof want, "lm_cuda_attnres_begin");
    else if (cur < 2 * L)
        snprintf(want, sizeof want, "%s(l = %d)", cur % 2 ? "lm_cuda_attnres_add_output" : "lm_cuda_attnres_input",
                 cur / 2);
    else if (cur == 2 * L) snprintf(want, sizeof want, "lm_cuda_attnres_final");
    else if (cur == 2 * L + 1) snprintf(want, sizeof want, "lm_cuda_attnres_final_backward or lm_cuda_attnres_begin");
    else if (cur < 4 * L + 2) {
        const int k = (cur - 2 * L - 2) / 2;
        snprintf(want, sizeof want, "%s(l = %d)",
                 (cur - 2 * L - 2) % 2 ? "lm_cuda_attnres_input_backward" : "lm_cuda_attnres_output_backward",
                 L - 1 - k);
    } else if (cur == 4 * L + 2) snprintf(want, sizeof want, "lm_cuda_attnres_embedding_backward");
    else snprintf(want, sizeof want, "lm_cuda_attnres_begin (the backward is complete)");
    if (l >= 0)
        return lm_error(LM_ERR_ARG, "attnres cuda: %s(l = %d) called out of order; the next call must be %s", call, l,
                        want);
    return lm_error(LM_ERR_ARG, "attnres cuda: %s called out of order; the next call must be %s", call, want);
}

static lm_status check_common(const lm_cuda_context *ctx, const lm_cuda_attnres_state *st, const char *call) {
    if (!ctx) return lm_error(LM_ERR_ARG, "attnres cuda: %s: ctx is NULL", call);
    if (!st || !st->hist) return lm_error(LM_ERR_ARG, "attnres cuda: %s on an uninitialised state", call);
    return LM_OK;
}

static lm_status check_params(const lm_cuda_attnres_state *st, const lm_attnres_params *p, const char *call) {
    if (st->cfg.mode == LM_ATTNRES_STANDARD) return LM_OK;
    if (!p || !p->query || !p->key_norm)
        return lm_error(LM_ERR_ARG, "attnres cuda: %s needs params with device query and key_norm [L+1 = %d, d = %d]",
                        call, st->cfg.n_sublayers + 1, st->cfg.d);
    return LM_OK;
}

static size_t nd_of(const lm_cuda_attnres_state *st) { return (size_t)st->cfg.n_tokens * (size_t)st->cfg.d; }

/* the sources of layer l (L: final); P is the open block's sum in the
 * forward, the saved copy otherwise */
static attnres_sources sources_of(const lm_cuda_attnres_state *st, int l, int saved) {
    const int L = st->cfg.n_sublayers, S = st->S;
    const size_t n = (size_t)st->cfg.n_tokens, nd = nd_of(st);
    attnres_sources src;
    src.hist = st->hist;
    src.hist_rstd = st->hist_rstd;
    src.P = NULL;
    src.P_rstd = NULL;
    if (l == L) {
        src.C = 1 + st->n_blocks;
        src.has_partial = 0;
        return src;
    }
    const int k = l / S, pos = l % S;
    src.C = 1 + k;
    src.has_partial = pos > 0;
    if (pos > 0) {
        src.P = saved ? st->partials + (size_t)attnres_partial_slot(&st->cfg, l) * nd : st->hist + (size_t)(1 + k) * nd;
        src.P_rstd = st->partial_rstd + (size_t)l * n;
    }
    return src;
}

/* ---- forward ---- */

extern "C" lm_status lm_cuda_attnres_begin(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                           const float *embedding) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_begin");
    if (s) return s;
    if (!embedding) return lm_error(LM_ERR_ARG, "attnres cuda: begin: embedding is NULL");
    // embedding is (n,d): v_0 = embedding and its 1/rms in one pass
    const int standard = st->cfg.mode == LM_ATTNRES_STANDARD;
    if ((s = attnres_launch_accumulate_rows(stream_of(ctx), st->hist, embedding, standard ? NULL : st->hist_rstd, 1,
                                            st->cfg.n_tokens, st->cfg.d, st->cfg.eps, NULL)))
        return s;
    st->step = 0;
    st->replaying = 0;
    st->dy_lp_for = -1;
    st->defer_mask = 0;
    return LM_OK;
}

/* input(l) into h, or (norm) with the norm after it and h not written;
 * `call` names the public function in messages. */
static lm_status input_impl(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l, const lm_attnres_params *p,
                            float *h, const lm_cuda_attnres_norm *norm, const char *call) {
    lm_status s = check_common(ctx, st, call);
    if (s) return s;
    if ((s = expect(st, 2 * l, call, l))) return s;
    if ((s = check_params(st, p, call))) return s;
    if (norm && st->cfg.mode == LM_ATTNRES_STANDARD)
        return lm_error(LM_ERR_ARG, "attnres cuda: %s: standard residual mode has no scores", call);
    if (norm && (!norm->rstd || (!norm->out && !norm->out_bf16)))
        return lm_error(LM_ERR_ARG, "attnres cuda: %s(l = %d): rstd and an output are required", call, l);
    if (!norm && !h) return lm_error(LM_ERR_ARG, "attnres cuda: %s(l = %d): h is NULL", call, l);
    // h is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, L = st->cfg.n_sublayers;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        /* h_l = v_0 + sum_{j<l} y_j */
        LM_CUDA_TRY(cudaMemcpyAsync(h, st->hist, nd_of(st) * sizeof(float), cudaMemcpyDeviceToDevice, stream_of(ctx)));
    } else {
        const int S = st->S, pos = l % S;
        const attnres_sources src = sources_of(st, l, 0);
        float *P_save = pos > 0 ? st->partials + (size_t)attnres_partial_slot(&st->cfg, l) * nd_of(st) : NULL;
        const float *w = p->query + (size_t)l * d, *g = p->key_norm + (size_t)l * d;
        float *logits = st->logits + attnres_logits_offset(l, S, L, n), *lse = st->lse + (size_t)l * n;
        if (norm)
            s = attnres_launch_forward_norm(stream_of(ctx), &src, P_save, w, g, logits, lse, 0, norm->weight,
                                            norm->out, norm->out_bf16, norm->rstd, n, d, st->cfg.eps, norm->eps);
        else
            s = attnres_launch_forward(stream_of(ctx), &src, P_save, w, g, logits, lse, h, 0, n, d, st->cfg.eps);
        if (s) return s;
    }
    st->step++;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_input(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                           const lm_attnres_params *p, float *h) {
    return input_impl(ctx, st, l, p, h, NULL, "lm_cuda_attnres_input");
}

extern "C" int lm_cuda_attnres_norm_fusable(const lm_attnres_config *c) {
    if (!c || check_config(c) != LM_OK || c->mode == LM_ATTNRES_STANDARD) return 0;
    const char *e = getenv("LONGMOE_ATTNRES_NORM");
    if (e && !strcmp(e, "separate")) return 0;
    if (e && *e && strcmp(e, "fused")) {
        static int warned = 0;
        if (!warned) fprintf(stderr, "longmoe: LONGMOE_ATTNRES_NORM=%s ignored: use fused or separate\n", e);
        warned = 1;
    }
    const int S = attnres_effective_block(c), L = c->n_sublayers;
    int most = 0;
    for (int l = 0; l < L; l++) {
        const int ns = attnres_n_sources_of(l, S, L);
        most = ns > most ? ns : most;
    }
    return attnres_norm_fusable(c->d, most);
}

extern "C" lm_status lm_cuda_attnres_input_norm(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                                const lm_attnres_params *p, const lm_cuda_attnres_norm *norm) {
    if (!norm) return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_input_norm(l = %d): norm is NULL", l);
    return input_impl(ctx, st, l, p, NULL, norm, "lm_cuda_attnres_input_norm");
}

static lm_status add_output(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l, const float *y,
                            unsigned long long *first_nonfinite, const char *call) {
    lm_status s = check_common(ctx, st, call);
    if (s) return s;
    if ((s = expect(st, 2 * l + 1, call, l))) return s;
    if (!y) return lm_error(LM_ERR_ARG, "attnres cuda: %s(l = %d): y is NULL", call, l);
    // y is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, L = st->cfg.n_sublayers;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        if ((s = attnres_launch_accumulate_rows(stream_of(ctx), st->hist, y, NULL, 0, n, d, st->cfg.eps,
                                                    first_nonfinite))) return s;
    } else {
        const int S = st->S, k = l / S, pos = l % S;
        float *open = st->hist + (size_t)(1 + k) * nd_of(st);
        /* the block closes at its last sublayer (or the model's): b_{k+1}'s 1/rms, same pass */
        float *rstd = (pos == S - 1 || l == L - 1) ? st->hist_rstd + (size_t)(1 + k) * n : NULL;
        if ((s = attnres_launch_accumulate_rows(stream_of(ctx), open, y, rstd, pos == 0, n, d, st->cfg.eps,
                                                  first_nonfinite)))
            return s;
    }
    if (st->replaying && l == st->replay_last) {
        /* the replayed block is whole again: back to its backward */
        st->step = st->replay_step;
        st->replaying = 0;
        return LM_OK;
    }
    st->step++;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_add_output(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                                const float *y) {
    return add_output(ctx, st, l, y, NULL, "lm_cuda_attnres_add_output");
}

extern "C" lm_status lm_cuda_attnres_add_output_note(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                                     const float *y, unsigned long long *first_nonfinite) {
    if (!first_nonfinite)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_add_output_note(l = %d): first_nonfinite is NULL", l);
    return add_output(ctx, st, l, y, first_nonfinite, "lm_cuda_attnres_add_output_note");
}

extern "C" lm_status lm_cuda_attnres_replay_block(lm_cuda_attnres_state *st, int k) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres cuda: state is NULL");
    if (!st->cfg.replay || st->cfg.mode != LM_ATTNRES_BLOCK)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_replay_block needs block_attnres with replay = 1");
    const int L = st->cfg.n_sublayers, S = st->S;
    if (k < 0 || k * S >= L)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_replay_block: block %d outside [0, %d)", k,
                        (L + S - 1) / S);
    const int last = (k + 1) * S - 1 < L - 1 ? (k + 1) * S - 1 : L - 1;
    lm_status s = expect(st, 2 * L + 2 + 2 * (L - 1 - last), "lm_cuda_attnres_replay_block", k);
    if (s) return s;
    st->replay_step = st->step;
    st->replay_last = last;
    st->replaying = 1;
    st->step = 2 * k * S;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_final(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                           const lm_attnres_params *p, float *h) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_final");
    if (s) return s;
    const int L = st->cfg.n_sublayers;
    if ((s = expect(st, 2 * L, "lm_cuda_attnres_final", -1))) return s;
    if ((s = check_params(st, p, "lm_cuda_attnres_final"))) return s;
    if (!h) return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_final: h is NULL");
    // h is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        LM_CUDA_TRY(cudaMemcpyAsync(h, st->hist, nd_of(st) * sizeof(float), cudaMemcpyDeviceToDevice, stream_of(ctx)));
    } else {
        /* every block is closed: one softmax over v_0, b_1..b_N with query row L */
        const attnres_sources src = sources_of(st, L, 0);
        if ((s = attnres_launch_forward(stream_of(ctx), &src, NULL, p->query + (size_t)L * d,
                                        p->key_norm + (size_t)L * d, st->logits + attnres_logits_offset(L, st->S, L, n),
                                        st->lse + (size_t)L * n, h, 0, n, d, st->cfg.eps)))
            return s;
    }
    st->step++;
    return LM_OK;
}

/* layer l's saved scores are intact: its forward ran, its backward not yet
 * (the CPU state's rule; the GPU does not overwrite them, but keeps the rule) */
static int scores_intact(const lm_cuda_attnres_state *st, int l) {
    const int L = st->cfg.n_sublayers;
    if (l == L) return st->step == 2 * L + 1;
    return st->step > 2 * l && st->step <= 2 * L + 3 + 2 * (L - 1 - l);
}

extern "C" lm_status lm_cuda_attnres_recompute_input(const lm_cuda_context *ctx, const lm_cuda_attnres_state *st,
                                                     int l, float *h) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_recompute_input");
    if (s) return s;
    if (!h) return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input: h is NULL");
    const int L = st->cfg.n_sublayers;
    if (st->cfg.mode == LM_ATTNRES_STANDARD)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input: standard residual mode keeps no "
                        "per-sublayer state");
    if (l < 0 || l > L)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input: layer %d outside [0, L = %d]", l,
                        L);
    if (!scores_intact(st, l))
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input(l = %d) is available from that "
                        "layer's forward until its backward", l);
    // h is (n,d): h_l = sum_i exp(s_i - lse) v_i from the saved scores
    const int64_t n = st->cfg.n_tokens;
    const attnres_sources src = sources_of(st, l, 1);
    return attnres_launch_forward(stream_of(ctx), &src, NULL, NULL, NULL,
                                  st->logits + attnres_logits_offset(l, st->S, L, n), st->lse + (size_t)l * n, h, 1, n,
                                  st->cfg.d, st->cfg.eps);
}

extern "C" lm_status lm_cuda_attnres_recompute_input_norm(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                                          int l, const lm_cuda_attnres_norm *norm) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_recompute_input_norm");
    if (s) return s;
    const int L = st->cfg.n_sublayers;
    if (st->cfg.mode == LM_ATTNRES_STANDARD)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input_norm: standard residual mode "
                        "keeps no per-sublayer state");
    if (l < 0 || l >= L)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input_norm: layer %d outside [0, L = %d)",
                        l, L);
    if (!scores_intact(st, l))
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input_norm(l = %d) is available from "
                        "that layer's forward until its backward", l);
    if (!norm || !norm->rstd || (!norm->out && !norm->out_bf16))
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_recompute_input_norm(l = %d): rstd and an output "
                        "are required", l);
    const int64_t n = st->cfg.n_tokens;
    const attnres_sources src = sources_of(st, l, 1);
    return attnres_launch_forward_norm(stream_of(ctx), &src, NULL, NULL, NULL,
                                       st->logits + attnres_logits_offset(l, st->S, L, n), st->lse + (size_t)l * n, 1,
                                       norm->weight, norm->out, norm->out_bf16, norm->rstd, n, st->cfg.d,
                                       st->cfg.eps, norm->eps);
}

/* ---- backward ---- */

extern "C" lm_status lm_cuda_attnres_final_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                                    const lm_attnres_params *p, const float *dh,
                                                    lm_attnres_grads *g) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_final_backward");
    if (s) return s;
    const int L = st->cfg.n_sublayers;
    if ((s = expect(st, 2 * L + 1, "lm_cuda_attnres_final_backward", -1))) return s;
    if ((s = check_params(st, p, "lm_cuda_attnres_final_backward"))) return s;
    if (!dh) return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_final_backward: dh is NULL");
    // dh is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        LM_CUDA_TRY(cudaMemcpyAsync(st->dhist, dh, nd_of(st) * sizeof(float), cudaMemcpyDeviceToDevice,
                                    stream_of(ctx)));
    } else {
        /* the final reads every source: its dv initialise G_0..G_N (assign) */
        const attnres_sources src = sources_of(st, L, 1);
        /* G_{1 + (L-1)/S}, the last block's, is complete: dLoss/dy_{L-1}, also in bf16 */
        if ((s = attnres_launch_backward(stream_of(ctx), &src, st->dhist, NULL, 1, p->query + (size_t)L * d,
                                         p->key_norm + (size_t)L * d,
                                         st->logits + attnres_logits_offset(L, st->S, L, n),
                                         st->lse + (size_t)L * n, dh, st->qpart,
                                         g && g->query ? g->query + (size_t)L * d : NULL,
                                         g && g->key_norm ? g->key_norm + (size_t)L * d : NULL, st->dy_lp,
                                         1 + (L - 1) / st->S, NULL, n, d)))
            return s;
        st->dy_lp_for = L - 1;
    }
    st->step++;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_output_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                                     float *dy) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_output_backward");
    if (s) return s;
    const int L = st->cfg.n_sublayers;
    if ((s = expect(st, 2 * L + 2 + 2 * (L - 1 - l), "lm_cuda_attnres_output_backward", l))) return s;
    if (!dy) return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_output_backward(l = %d): dy is NULL", l);
    // dy is (n,d): y_l enters its block's sum and the later partial sums of the
    // block, whose gradients the open block's accumulator holds now
    const size_t nd = nd_of(st);
    const float *G = st->cfg.mode == LM_ATTNRES_STANDARD ? st->dhist : st->dhist + (size_t)(1 + l / st->S) * nd;
    if ((s = attnres_launch_add(stream_of(ctx), dy, G, nd))) return s;
    st->step++;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_output_grad(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                                 const float **dy, const void **dy_lp) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_output_grad");
    if (s) return s;
    const int L = st->cfg.n_sublayers;
    if ((s = expect(st, 2 * L + 2 + 2 * (L - 1 - l), "lm_cuda_attnres_output_grad", l))) return s;
    if (!dy) return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_output_grad(l = %d): dy is NULL", l);
    /* the accumulator lm_cuda_attnres_output_backward would add to dy */
    const size_t nd = nd_of(st);
    *dy = st->cfg.mode == LM_ATTNRES_STANDARD ? st->dhist : st->dhist + (size_t)(1 + l / st->S) * nd;
    if (dy_lp) *dy_lp = st->cfg.mode != LM_ATTNRES_STANDARD && st->dy_lp_for == l ? st->dy_lp : NULL;
    st->step++;
    return LM_OK;
}

/* input_backward(l), from dh or (ng: the input with its norm) from the norm's
 * output gradient; `call` names the public function in messages. */
static lm_status input_backward_impl(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                     const lm_attnres_params *p, const float *dh, const lm_cuda_attnres_norm_grad *ng,
                                     lm_attnres_grads *g, const char *call) {
    lm_status s = check_common(ctx, st, call);
    if (s) return s;
    const int L = st->cfg.n_sublayers;
    if ((s = expect(st, 2 * L + 3 + 2 * (L - 1 - l), call, l))) return s;
    if ((s = check_params(st, p, call))) return s;
    if (ng && st->cfg.mode == LM_ATTNRES_STANDARD)
        return lm_error(LM_ERR_ARG, "attnres cuda: %s: standard residual mode has no scores", call);
    if (ng && (!ng->dout || !ng->rstd))
        return lm_error(LM_ERR_ARG, "attnres cuda: %s(l = %d): dout and rstd are required", call, l);
    if (!ng && !dh) return lm_error(LM_ERR_ARG, "attnres cuda: %s(l = %d): dh is NULL", call, l);
    // dh is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d;
    const size_t nd = nd_of(st);
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        if ((s = attnres_launch_add(stream_of(ctx), st->dhist, dh, nd))) return s;
    } else {
        const int S = st->S, k = l / S;
        const attnres_sources src = sources_of(st, l, 1);
        /* dP goes to G_{k+1}, the accumulator of the open block. This call
         * completes dLoss/dy_{l-1} = G_{1 + (l-1)/S}: the partial's (source C
         * = 1 + k) inside a block, at a block's first sublayer the last closed
         * source's (k = C - 1); its bf16 copy comes with it */
        const int next = l > 0 ? 1 + (l - 1) / S : -1;
        const float *w = p->query + (size_t)l * d, *gk = p->key_norm + (size_t)l * d;
        const float *logits = st->logits + attnres_logits_offset(l, S, L, n), *lse = st->lse + (size_t)l * n;
        float *dw = g && g->query ? g->query + (size_t)l * d : NULL;
        float *dg = g && g->key_norm ? g->key_norm + (size_t)l * d : NULL;
        uint16_t *lp = next >= 0 ? st->dy_lp : NULL;
        float *dP = st->dhist + (size_t)(1 + k) * nd;
        /* the deferred backward: a mid-block sublayer with more than one closed source keeps
         * its closed sources' terms (slot pos - 1); the block's first adds them all */
        const int pos = l % S;
        attnres_deferred df;
        memset(&df, 0, sizeof df);
        df.slot = -1;
        df.dh = st->defer_dh;
        df.coef = st->defer_coef;
        df.cmax = st->n_blocks;
        df.w = p->query + (size_t)(l - pos) * d;
        df.g = p->key_norm + (size_t)(l - pos) * d;
        if (st->defer_dh && ng && pos > 0 && src.C >= 2) df.slot = pos - 1;
        /* a call that does not defer adds what waits first (a block's first sublayer, or a
         * mid-block one through the call without the norm): each gradient takes its terms in
         * the direct backward's order */
        if (df.slot < 0) df.apply = st->defer_mask;
        if (ng)
            s = attnres_launch_backward_norm(stream_of(ctx), &src, st->dhist, dP, w, gk, logits, lse, ng->dout,
                                             ng->weight, ng->rstd, st->qpart, st->npart, dw, dg, ng->dweight, lp, next,
                                             &df, n, d);
        else
            s = attnres_launch_backward(stream_of(ctx), &src, st->dhist, dP, 0, w, gk, logits, lse, dh, st->qpart, dw,
                                        dg, lp, next, &df, n, d);
        if (s) return s;
        if (df.slot >= 0) st->defer_mask |= 1ull << df.slot;
        else st->defer_mask = 0;
        st->dy_lp_for = l - 1;
    }
    st->step++;
    return LM_OK;
}

extern "C" lm_status lm_cuda_attnres_input_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st, int l,
                                                    const lm_attnres_params *p, const float *dh,
                                                    lm_attnres_grads *g) {
    return input_backward_impl(ctx, st, l, p, dh, NULL, g, "lm_cuda_attnres_input_backward");
}

extern "C" lm_status lm_cuda_attnres_input_norm_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                                         int l, const lm_attnres_params *p,
                                                         const lm_cuda_attnres_norm_grad *ng, lm_attnres_grads *g) {
    if (!ng)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_input_norm_backward(l = %d): ng is NULL", l);
    return input_backward_impl(ctx, st, l, p, NULL, ng, g, "lm_cuda_attnres_input_norm_backward");
}

extern "C" lm_status lm_cuda_attnres_embedding_backward(const lm_cuda_context *ctx, lm_cuda_attnres_state *st,
                                                        float *dembedding) {
    lm_status s = check_common(ctx, st, "lm_cuda_attnres_embedding_backward");
    if (s) return s;
    const int L = st->cfg.n_sublayers;
    if ((s = expect(st, 4 * L + 2, "lm_cuda_attnres_embedding_backward", -1))) return s;
    if (!dembedding)
        return lm_error(LM_ERR_ARG, "attnres cuda: lm_cuda_attnres_embedding_backward: dembedding is NULL");
    // dembedding is (n,d)
    if ((s = attnres_launch_add(stream_of(ctx), dembedding, st->dhist, nd_of(st)))) return s;
    st->step++;
    return LM_OK;
}
