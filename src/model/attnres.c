/* Block Attention Residuals (include/longmoe/attnres.h, SPEC §5, docs/attnres.md).
 *
 * Sources of sublayer l in block k = l / S, position p = l % S:
 *   completed: hist[0] = v_0 (embedding), hist[1..k] = b_1..b_k   (C_l = 1 + k of them)
 *   partial:   hist[1+k] while block k is open, when p > 0        (the sum y_{kS} + .. + y_{l-1})
 * The score of source i is s_i = w_l . (g_l (.) v_i r_i) = r_i (u_l . v_i) with
 * u_l = w_l (.) g_l and r_i = 1/rms(v_i); r_i does not depend on l, so it is
 * computed once when a source closes.
 *
 * The call sequence is tracked in st->step:
 *   -1               nothing yet: only begin
 *   2l, 2l+1         forward: input(l), add_output(l)
 *   2L               final
 *   2L+1             forward done: final_backward (or a new begin)
 *   2L+2+2k, +1      backward of sublayer l = L-1-k: output_backward(l), input_backward(l)
 *   4L+2             embedding_backward
 *   4L+3             backward done */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "longmoe/attnres.h"
#include "model/attnres_plan.h"

#define ALIGN_BYTES 64

/* parallel regions only pay off above this many floats of work */
#define PAR_MIN_WORK 32768
#define PARALLEL_IF(work) ((int64_t)(work) >= PAR_MIN_WORK)
/* tokens per partial sum of the parameter gradients */
#define TOKEN_BLOCK 64

static size_t align_up(size_t b) { return (b + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES; }

int lm_attnres_mode_from_name(const char *name, lm_attnres_mode *out) {
    if (!name) return -1;
    if (!strcmp(name, "standard")) *out = LM_ATTNRES_STANDARD;
    else if (!strcmp(name, "block_attnres")) *out = LM_ATTNRES_BLOCK;
    else if (!strcmp(name, "full_attnres")) *out = LM_ATTNRES_FULL;
    else return -1;
    return 0;
}

const char *lm_attnres_mode_name(lm_attnres_mode m) {
    switch (m) {
    case LM_ATTNRES_STANDARD: return "standard";
    case LM_ATTNRES_BLOCK: return "block_attnres";
    case LM_ATTNRES_FULL: return "full_attnres";
    }
    return "?";
}

/* ---- geometry (attnres_plan.h: the GPU state plans with the same functions) ---- */

int attnres_effective_block(const lm_attnres_config *c) {
    if (c->mode == LM_ATTNRES_FULL) return 1;
    if (c->mode == LM_ATTNRES_STANDARD) return c->n_sublayers;
    return c->block_size;
}

int attnres_n_sources_of(int l, int S, int L) {
    if (l == L) return 1 + (L + S - 1) / S;
    return 1 + l / S + (l % S > 0);
}

int attnres_partial_slots(const lm_attnres_config *c) {
    if (c->mode != LM_ATTNRES_BLOCK && c->mode != LM_ATTNRES_FULL) return 0;
    int S = attnres_effective_block(c), L = c->n_sublayers, N = (L + S - 1) / S;
    if (c->replay && c->mode == LM_ATTNRES_BLOCK) return (S < L ? S : L) - 1;
    return L - N;
}

int attnres_partial_slot(const lm_attnres_config *c, int l) {
    int S = attnres_effective_block(c), k = l / S, pos = l % S;
    return c->replay && c->mode == LM_ATTNRES_BLOCK ? pos - 1 : l - k - 1;
}

size_t attnres_logits_offset(int l, int S, int L, int64_t n) {
    size_t o = 0;
    for (int j = 0; j < l; j++) o += (size_t)attnres_n_sources_of(j, S, L);
    return o * (size_t)n;
}

lm_status attnres_check_config(const lm_attnres_config *c, const char *who) {
    if (!c) return lm_error(LM_ERR_ARG, "%s: config is NULL", who);
    if (c->mode != LM_ATTNRES_STANDARD && c->mode != LM_ATTNRES_BLOCK && c->mode != LM_ATTNRES_FULL)
        return lm_error(LM_ERR_ARG, "%s: mode must be standard, block_attnres or full_attnres, got %d", who,
                        (int)c->mode);
    if (c->n_sublayers < 1)
        return lm_error(LM_ERR_ARG, "%s: n_sublayers must be >= 1, got %d", who, c->n_sublayers);
    if (c->d < 1) return lm_error(LM_ERR_ARG, "%s: d must be >= 1, got %d", who, c->d);
    if (c->n_tokens < 1)
        return lm_error(LM_ERR_ARG, "%s: n_tokens must be >= 1, got %lld", who, (long long)c->n_tokens);
    if (c->mode == LM_ATTNRES_BLOCK && c->block_size < 1)
        return lm_error(LM_ERR_ARG, "%s: block_size (in sublayers) must be >= 1, got %d", who, c->block_size);
    if (!(c->eps > 0.0f) || !isfinite(c->eps))
        return lm_error(LM_ERR_ARG, "%s: eps must be finite and > 0, got %g", who, (double)c->eps);
    if (c->two_phase != 0 && c->two_phase != 1)
        return lm_error(LM_ERR_ARG, "%s: two_phase must be 0 or 1, got %d", who, c->two_phase);
    if (c->replay != 0 && c->replay != 1)
        return lm_error(LM_ERR_ARG, "%s: replay must be 0 or 1, got %d", who, c->replay);
    return LM_OK;
}

lm_status lm_attnres_memory(const lm_attnres_config *c, lm_attnres_memory_plan *plan) {
    lm_status s = attnres_check_config(c, "attnres");
    if (s) return s;
    if (!plan) return lm_error(LM_ERR_ARG, "attnres: memory plan pointer is NULL");
    memset(plan, 0, sizeof *plan);
    const size_t n = (size_t)c->n_tokens, d = (size_t)c->d, L = (size_t)c->n_sublayers, f = sizeof(float);
    if (c->mode == LM_ATTNRES_STANDARD) {
        /* the running sum v_0 + y_0 + ... and its gradient */
        plan->n_blocks = 0;
        plan->n_history_sources = 1;
        plan->history = align_up(n * d * f);
        plan->history_grad = align_up(n * d * f);
        plan->history_bytes_per_token = (double)(d * f);
        plan->total_bytes_per_token = (double)(2 * d * f);
    } else {
        int S = attnres_effective_block(c);
        size_t N = (L + (size_t)S - 1) / (size_t)S, H = 1 + N;
        size_t Sq = (size_t)S < L ? (size_t)S : L;
        plan->n_blocks = (int)N;
        plan->n_history_sources = (int)H;
        plan->history = align_up(H * n * d * f) + align_up(H * n * f);
        plan->history_grad = align_up(H * n * d * f);
        const size_t slots = (size_t)attnres_partial_slots(c);
        plan->saved_partials = align_up(slots * n * d * f) + align_up(L * n * f);
        plan->saved_scores = align_up(attnres_logits_offset((int)L + 1, S, (int)L, (int64_t)n) * f) +
                             align_up((L + 1) * n * f);
        plan->phase1 = c->two_phase ? align_up(Sq * n * d * f) + 2 * align_up(Sq * n * f) : 0;
        plan->queries = align_up(Sq * d * f);
        plan->param_grad = align_up((n + TOKEN_BLOCK - 1) / TOKEN_BLOCK * d * f);
        /* per token: every [n, ...] buffer divided by n */
        double scores = (double)attnres_logits_offset((int)L + 1, S, (int)L, 1) + (double)(L + 1);
        plan->history_bytes_per_token = (double)(H * (d + 1) * f);
        plan->total_bytes_per_token = (double)f * ((double)H * (d + 1) + (double)H * d + (double)slots * d +
                                                   (double)L + scores +
                                                   (c->two_phase ? (double)Sq * (d + 2) : 0.0) +
                                                   (double)d / TOKEN_BLOCK);
    }
    plan->total = plan->history + plan->history_grad + plan->saved_partials + plan->saved_scores +
                  plan->phase1 + plan->queries + plan->param_grad;
    return LM_OK;
}

lm_status lm_attnres_init(lm_attnres_state *st, const lm_attnres_config *c, void *workspace,
                          size_t workspace_bytes) {
    lm_attnres_memory_plan plan;
    lm_status s = lm_attnres_memory(c, &plan);
    if (s) return s;
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state pointer is NULL");
    if (!workspace) return lm_error(LM_ERR_ARG, "attnres: workspace is NULL");
    if ((uintptr_t)workspace % sizeof(float))
        return lm_error(LM_ERR_ARG, "attnres: workspace must be aligned to 4 bytes (64 recommended)");
    if (workspace_bytes < plan.total)
        return lm_error(LM_ERR_ARG, "attnres: workspace of %zu bytes is too small, lm_attnres_memory asks %zu",
                        workspace_bytes, plan.total);
    memset(st, 0, sizeof *st);
    st->cfg = *c;
    st->S = attnres_effective_block(c);
    st->n_blocks = plan.n_blocks;
    const size_t n = (size_t)c->n_tokens, d = (size_t)c->d, L = (size_t)c->n_sublayers, f = sizeof(float);
    char *w = (char *)workspace;
#define CARVE(ptr, bytes)          \
    do {                           \
        (ptr) = (float *)(void *)w; \
        w += align_up(bytes);      \
    } while (0)
    if (c->mode == LM_ATTNRES_STANDARD) {
        CARVE(st->hist, n * d * f);
        CARVE(st->dhist, n * d * f);
    } else {
        size_t H = (size_t)plan.n_history_sources;
        size_t Sq = (size_t)st->S < L ? (size_t)st->S : L;
        CARVE(st->hist, H * n * d * f);
        CARVE(st->hist_rstd, H * n * f);
        CARVE(st->dhist, H * n * d * f);
        CARVE(st->partials, (size_t)attnres_partial_slots(c) * n * d * f);
        CARVE(st->partial_rstd, L * n * f);
        CARVE(st->logits, attnres_logits_offset((int)L + 1, st->S, (int)L, (int64_t)n) * f);
        CARVE(st->lse, (L + 1) * n * f);
        if (c->two_phase) {
            CARVE(st->acc, Sq * n * d * f);
            CARVE(st->acc_max, Sq * n * f);
            CARVE(st->acc_sum, Sq * n * f);
        }
        CARVE(st->u, Sq * d * f);
        CARVE(st->qpart, (n + TOKEN_BLOCK - 1) / TOKEN_BLOCK * d * f);
    }
#undef CARVE
    st->step = -1;
    return LM_OK;
}

int lm_attnres_n_sources(const lm_attnres_state *st, int l) {
    if (st->cfg.mode == LM_ATTNRES_STANDARD) return 1 + l;
    return attnres_n_sources_of(l, st->S, st->cfg.n_sublayers);
}

/* ---- call-order checks ---- */

static lm_status expect(const lm_attnres_state *st, int step, const char *call, int l) {
    if (st->step == step) return LM_OK;
    const int L = st->cfg.n_sublayers, cur = st->step;
    char want[96];
    if (cur < 0) snprintf(want, sizeof want, "lm_attnres_begin");
    else if (cur < 2 * L) snprintf(want, sizeof want, "%s(l = %d)", cur % 2 ? "lm_attnres_add_output" : "lm_attnres_input", cur / 2);
    else if (cur == 2 * L) snprintf(want, sizeof want, "lm_attnres_final");
    else if (cur == 2 * L + 1) snprintf(want, sizeof want, "lm_attnres_final_backward or lm_attnres_begin");
    else if (cur < 4 * L + 2) {
        int k = (cur - 2 * L - 2) / 2;
        snprintf(want, sizeof want, "%s(l = %d)", (cur - 2 * L - 2) % 2 ? "lm_attnres_input_backward" : "lm_attnres_output_backward", L - 1 - k);
    } else if (cur == 4 * L + 2) snprintf(want, sizeof want, "lm_attnres_embedding_backward");
    else snprintf(want, sizeof want, "lm_attnres_begin (the backward is complete)");
    if (l >= 0)
        return lm_error(LM_ERR_ARG, "attnres: %s(l = %d) called out of order; the next call must be %s",
                        call, l, want);
    return lm_error(LM_ERR_ARG, "attnres: %s called out of order; the next call must be %s", call, want);
}

static lm_status check_params(const lm_attnres_state *st, const lm_attnres_params *p, const char *call) {
    if (st->cfg.mode == LM_ATTNRES_STANDARD) return LM_OK;
    if (!p || !p->query || !p->key_norm)
        return lm_error(LM_ERR_ARG, "attnres: %s needs params with query and key_norm [L+1 = %d, d = %d]",
                        call, st->cfg.n_sublayers + 1, st->cfg.d);
    return LM_OK;
}

/* ---- small kernels on one token row ---- */

static float rstd_row(const float *x, int d, float eps) {
    /* 1/rms with rms = sqrt(mean(x^2) + eps), the RMSNorm of linear.h */
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int c = 0; c < d; c++) ss += x[c] * x[c];
    return 1.0f / sqrtf(ss / (float)d + eps);
}

/* SIMD reductions: a fixed summation order for a given build, whatever the thread count */
static float dot_row(const float *restrict a, const float *restrict b, int d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < d; c++) s += a[c] * b[c];
    return s;
}

/* y += a x */
static void axpy_row(float *restrict y, float a, const float *restrict x, int d) {
#pragma omp simd
    for (int c = 0; c < d; c++) y[c] += a * x[c];
}

static void effective_query(float *u, const lm_attnres_params *p, int l, int d) {
    /* w . (g (.) k) = (w (.) g) . k: fold the key-norm weight into the query */
    const float *w = p->query + (size_t)l * d, *g = p->key_norm + (size_t)l * d;
    for (int c = 0; c < d; c++) u[c] = w[c] * g[c];
}

/* ---- forward ---- */

lm_status lm_attnres_begin(lm_attnres_state *st, const float *embedding) {
    if (!st || !st->hist) return lm_error(LM_ERR_ARG, "attnres: begin on an uninitialised state");
    if (!embedding) return lm_error(LM_ERR_ARG, "attnres: begin: embedding is NULL");
    // embedding is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d;
    memcpy(st->hist, embedding, (size_t)n * d * sizeof(float));
    if (st->cfg.mode != LM_ATTNRES_STANDARD) {
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
        for (int64_t t = 0; t < n; t++) st->hist_rstd[t] = rstd_row(st->hist + t * d, d, st->cfg.eps);
    }
    st->step = 0;
    st->replaying = 0;
    return LM_OK;
}

/* Direct form: softmax over all sources of one AttnRes layer at once.
 * Sources: hist[0..C-1] (closed) and, when P != NULL, the partial sum P with
 * its rstd Pr. Writes h, the logits row [n, C + (P != NULL)] and lse [n]. */
static void direct_forward(lm_attnres_state *st, const float *u, int C, const float *P, const float *Pr,
                           float *logits, float *lse, float *h) {
    // hist is (1+N,n,d), P is (n,d), logits is (n,Ns), lse is (n), h is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, Ns = C + (P != NULL);
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
    for (int64_t t = 0; t < n; t++) {
        float *s = logits + t * Ns;
        /* s_i = r_i (u . v_i)  (SPEC §5) */
        for (int i = 0; i < C; i++)
            s[i] = st->hist_rstd[i * n + t] * dot_row(u, st->hist + ((size_t)i * n + t) * d, d);
        if (P) s[C] = Pr[t] * dot_row(u, P + t * d, d);
        float m = s[0];
        for (int i = 1; i < Ns; i++) m = fmaxf(m, s[i]);
        float Z = 0.0f;
        for (int i = 0; i < Ns; i++) Z += expf(s[i] - m);
        float *ht = h + t * d;
        for (int c = 0; c < d; c++) ht[c] = 0.0f;
        for (int i = 0; i < Ns; i++) {
            float a = expf(s[i] - m) / Z;
            axpy_row(ht, a, i < C ? st->hist + ((size_t)i * n + t) * d : P + t * d, d);
        }
        lse[t] = m + logf(Z);
    }
}

/* Phase 1 [AR]: the Q queries of sublayers l0..l0+Q-1 (one block) against the
 * C closed sources in one pass; keeps per query the softmax statistics
 * (max, sum of exp) and the unnormalised value accumulator, and writes the
 * closed-source logits into each sublayer's saved logits row. */
static void phase1_forward(lm_attnres_state *st, int l0, int Q, int C) {
    // hist is (1+N,n,d); acc is (S,n,d); acc_max, acc_sum are (S,n); u is (S,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, S = st->S, L = st->cfg.n_sublayers;
    size_t off[Q > 0 ? Q : 1];
    int Ns[Q > 0 ? Q : 1];
    for (int q = 0; q < Q; q++) {
        off[q] = attnres_logits_offset(l0 + q, S, L, n);
        Ns[q] = attnres_n_sources_of(l0 + q, S, L);
    }
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
    for (int64_t t = 0; t < n; t++) {
        /* scores of every (query, source) pair, each source row read once */
        for (int i = 0; i < C; i++) {
            const float *v = st->hist + ((size_t)i * n + t) * d;
            const float r = st->hist_rstd[i * n + t];
            for (int q = 0; q < Q; q++)
                st->logits[off[q] + t * Ns[q] + i] = r * dot_row(st->u + (size_t)q * d, v, d);
        }
        for (int q = 0; q < Q; q++) {
            const float *s = st->logits + off[q] + t * Ns[q];
            float m = s[0];
            for (int i = 1; i < C; i++) m = fmaxf(m, s[i]);
            st->acc_max[q * n + t] = m;
            st->acc_sum[q * n + t] = 0.0f;
            float *a = st->acc + ((size_t)q * n + t) * d;
            for (int c = 0; c < d; c++) a[c] = 0.0f;
        }
        /* A_q = sum_i exp(s_qi - m_q) v_i, Z_q = sum_i exp(s_qi - m_q) */
        for (int i = 0; i < C; i++) {
            const float *v = st->hist + ((size_t)i * n + t) * d;
            for (int q = 0; q < Q; q++) {
                float e = expf(st->logits[off[q] + t * Ns[q] + i] - st->acc_max[q * n + t]);
                st->acc_sum[q * n + t] += e;
                axpy_row(st->acc + ((size_t)q * n + t) * d, e, v, d);
            }
        }
    }
}

/* Phase 2 [AR]: merge the partial sum P (score s_P) into the phase-1
 * statistics of query q by online softmax; P == NULL at a block's start. */
static void phase2_forward(lm_attnres_state *st, int q, const float *u, int C, const float *P,
                           const float *Pr, float *logits, float *lse, float *h) {
    // acc is (S,n,d); P is (n,d); logits is (n,C+1); h is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, Ns = C + (P != NULL);
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
    for (int64_t t = 0; t < n; t++) {
        const float *A = st->acc + ((size_t)q * n + t) * d;
        float m = st->acc_max[q * n + t], Z = st->acc_sum[q * n + t];
        float *ht = h + t * d;
        if (!P) {
            for (int c = 0; c < d; c++) ht[c] = A[c] / Z;
            lse[t] = m + logf(Z);
            continue;
        }
        float sp = Pr[t] * dot_row(u, P + t * d, d);
        logits[t * Ns + C] = sp;
        /* m' = max(m, s_P); Z' = Z e^{m-m'} + e^{s_P-m'}; h = (A e^{m-m'} + P e^{s_P-m'}) / Z' */
        float m2 = fmaxf(m, sp), ea = expf(m - m2), eb = expf(sp - m2);
        float Z2 = Z * ea + eb;
        const float *pt = P + t * d;
        for (int c = 0; c < d; c++) ht[c] = (A[c] * ea + pt[c] * eb) / Z2;
        lse[t] = m2 + logf(Z2);
    }
}

lm_status lm_attnres_input(lm_attnres_state *st, int l, const lm_attnres_params *p, float *h) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    lm_status s = expect(st, 2 * l, "lm_attnres_input", l);
    if (s) return s;
    if ((s = check_params(st, p, "lm_attnres_input"))) return s;
    if (!h) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_input(l = %d): h is NULL", l);
    // h is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, L = st->cfg.n_sublayers;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        /* h_l = v_0 + sum_{j<l} y_j */
        memcpy(h, st->hist, (size_t)n * d * sizeof(float));
        st->step++;
        return LM_OK;
    }
    const int S = st->S, k = l / S, pos = l % S, C = 1 + k;
    float *logits = st->logits + attnres_logits_offset(l, S, L, n), *lse = st->lse + (size_t)l * n;
    const float *P = NULL;
    const float *Pr = NULL;
    if (pos > 0) {
        /* the open block's partial sum is a source: save it and its rms for the backward */
        float *saved = st->partials + (size_t)attnres_partial_slot(&st->cfg, l) * n * d,
              *r = st->partial_rstd + (size_t)l * n;
        const float *open = st->hist + (size_t)(1 + k) * n * d;
        memcpy(saved, open, (size_t)n * d * sizeof(float));
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
        for (int64_t t = 0; t < n; t++) r[t] = rstd_row(saved + t * d, d, st->cfg.eps);
        P = saved;
        Pr = r;
    }
    if (st->cfg.two_phase) {
        if (pos == 0) {
            int Q = S < L - l ? S : L - l;
            for (int q = 0; q < Q; q++) effective_query(st->u + (size_t)q * d, p, l + q, d);
            phase1_forward(st, l, Q, C);
        }
        effective_query(st->u + (size_t)pos * d, p, l, d);
        phase2_forward(st, pos, st->u + (size_t)pos * d, C, P, Pr, logits, lse, h);
    } else {
        effective_query(st->u, p, l, d);
        direct_forward(st, st->u, C, P, Pr, logits, lse, h);
    }
    st->step++;
    return LM_OK;
}

lm_status lm_attnres_add_output(lm_attnres_state *st, int l, const float *y) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    lm_status s = expect(st, 2 * l + 1, "lm_attnres_add_output", l);
    if (s) return s;
    if (!y) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_add_output(l = %d): y is NULL", l);
    // y is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, L = st->cfg.n_sublayers;
    const size_t nd = (size_t)n * d;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        for (size_t i = 0; i < nd; i++) st->hist[i] += y[i];
        st->step++;
        return LM_OK;
    }
    const int S = st->S, k = l / S, pos = l % S;
    float *open = st->hist + (size_t)(1 + k) * nd;
    if (pos == 0) memcpy(open, y, nd * sizeof(float));
    else
        for (size_t i = 0; i < nd; i++) open[i] += y[i];
    if (pos == S - 1 || l == L - 1) {
        /* the block closes: b_{k+1} becomes a source of every later layer */
        float *r = st->hist_rstd + (size_t)(1 + k) * n;
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
        for (int64_t t = 0; t < n; t++) r[t] = rstd_row(open + t * d, d, st->cfg.eps);
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

lm_status lm_attnres_replay_block(lm_attnres_state *st, int k) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    if (!st->cfg.replay || st->cfg.mode != LM_ATTNRES_BLOCK)
        return lm_error(LM_ERR_ARG, "attnres: lm_attnres_replay_block needs block_attnres with replay = 1");
    const int L = st->cfg.n_sublayers, S = st->S;
    if (k < 0 || k * S >= L) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_replay_block: block %d outside [0, %d)", k,
                                             (L + S - 1) / S);
    const int last = (k + 1) * S - 1 < L - 1 ? (k + 1) * S - 1 : L - 1;
    lm_status s = expect(st, 2 * L + 2 + 2 * (L - 1 - last), "lm_attnres_replay_block", k);
    if (s) return s;
    st->replay_step = st->step;
    st->replay_last = last;
    st->replaying = 1;
    st->step = 2 * k * S;
    return LM_OK;
}

lm_status lm_attnres_final(lm_attnres_state *st, const lm_attnres_params *p, float *h) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    const int L = st->cfg.n_sublayers;
    lm_status s = expect(st, 2 * L, "lm_attnres_final", -1);
    if (s) return s;
    if ((s = check_params(st, p, "lm_attnres_final"))) return s;
    if (!h) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_final: h is NULL");
    // h is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        memcpy(h, st->hist, (size_t)n * d * sizeof(float));
    } else {
        /* every block is closed: one softmax over v_0, b_1..b_N with query row L */
        effective_query(st->u, p, L, d);
        direct_forward(st, st->u, 1 + st->n_blocks, NULL, NULL, st->logits + attnres_logits_offset(L, st->S, L, n),
                       st->lse + (size_t)L * n, h);
    }
    st->step++;
    return LM_OK;
}

/* The saved logits of layer l (L: final) are intact: its forward ran and its
 * backward (which overwrites them with ds) has not. */
static int scores_intact(const lm_attnres_state *st, int l) {
    const int L = st->cfg.n_sublayers;
    if (l == L) return st->step == 2 * L + 1;
    return st->step > 2 * l && st->step <= 2 * L + 3 + 2 * (L - 1 - l);
}

static lm_status check_saved_layer(const lm_attnres_state *st, int l, const char *call) {
    const int L = st->cfg.n_sublayers;
    if (st->cfg.mode == LM_ATTNRES_STANDARD)
        return lm_error(LM_ERR_ARG, "attnres: %s: standard residual mode keeps no per-sublayer state", call);
    if (l < 0 || l > L) return lm_error(LM_ERR_ARG, "attnres: %s: layer %d outside [0, L = %d]", call, l, L);
    if (!scores_intact(st, l))
        return lm_error(LM_ERR_ARG, "attnres: %s(l = %d) is available from that layer's forward until its backward",
                        call, l);
    return LM_OK;
}

lm_status lm_attnres_weights(const lm_attnres_state *st, int l, float *weights) {
    if (!st || !weights) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_weights: NULL argument");
    lm_status s = check_saved_layer(st, l, "lm_attnres_weights");
    if (s) return s;
    // weights is (n,Ns)
    const int L = st->cfg.n_sublayers;
    const int64_t n = st->cfg.n_tokens;
    const int Ns = attnres_n_sources_of(l, st->S, L);
    const float *sc = st->logits + attnres_logits_offset(l, st->S, L, n), *lse = st->lse + (size_t)l * n;
    for (int64_t t = 0; t < n; t++)
        for (int i = 0; i < Ns; i++) weights[t * Ns + i] = expf(sc[t * Ns + i] - lse[t]);
    return LM_OK;
}

lm_status lm_attnres_recompute_input(const lm_attnres_state *st, int l, float *h) {
    if (!st || !h) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_recompute_input: NULL argument");
    lm_status s = check_saved_layer(st, l, "lm_attnres_recompute_input");
    if (s) return s;
    // h is (n,d)
    const int L = st->cfg.n_sublayers, S = st->S, d = st->cfg.d;
    const int64_t n = st->cfg.n_tokens;
    const int C = l == L ? 1 + st->n_blocks : 1 + l / S, has_P = l < L && l % S > 0;
    const int Ns = C + has_P;
    const float *P = has_P ? st->partials + (size_t)attnres_partial_slot(&st->cfg, l) * n * d : NULL;
    const float *sc = st->logits + attnres_logits_offset(l, S, L, n), *lse = st->lse + (size_t)l * n;
    /* h_l = sum_i exp(s_i - lse) v_i from the saved scores: no dot products */
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
    for (int64_t t = 0; t < n; t++) {
        float *ht = h + t * d;
        for (int c = 0; c < d; c++) ht[c] = 0.0f;
        for (int i = 0; i < Ns; i++)
            axpy_row(ht, expf(sc[t * Ns + i] - lse[t]), i < C ? st->hist + ((size_t)i * n + t) * d : P + t * d, d);
    }
    return LM_OK;
}

/* ---- backward ---- */

/* Backward of one AttnRes layer over closed sources hist[0..C-1] and, when
 * P != NULL, the partial sum P whose gradient goes to dP. With
 * a = softmax(s), s_i = r_i (u . v_i), h = sum_i a_i v_i:
 *   ds_i = a_i (dh.v_i - sum_j a_j dh.v_j)
 *   dv_i += a_i dh + ds_i r_i (u - xhat_i s_i / d),   xhat_i = r_i v_i
 *   dw += g (.) q,  dg += w (.) q,   q = sum_{t,i} ds_i xhat_i
 * The logits rows are overwritten with ds (their last use). */
static void layer_backward(lm_attnres_state *st, const lm_attnres_params *p, lm_attnres_grads *g, int l,
                           int C, const float *P, const float *Pr, float *dP, float *logits,
                           const float *lse, const float *dh) {
    // hist, dhist are (1+N,n,d); P, dP, dh are (n,d); logits is (n,Ns); lse is (n)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d, Ns = C + (P != NULL);
    float *u = st->u;
    effective_query(u, p, l, d);
    const int want_q = g && (g->query || g->key_norm);
    /* token blocks of fixed size: each keeps its own q partial sum, so the
     * result does not depend on how blocks are spread over threads */
    const int64_t n_tb = (n + TOKEN_BLOCK - 1) / TOKEN_BLOCK;
#pragma omp parallel for schedule(static) if (PARALLEL_IF((int64_t)n * d))
    for (int64_t b = 0; b < n_tb; b++) {
        float *qb = st->qpart + b * d;
        if (want_q)
            for (int c = 0; c < d; c++) qb[c] = 0.0f;
        const int64_t t1 = (b + 1) * TOKEN_BLOCK < n ? (b + 1) * TOKEN_BLOCK : n;
        for (int64_t t = b * TOKEN_BLOCK; t < t1; t++) {
            float *s = logits + t * Ns;
            const float *dht = dh + t * d;
            float a[Ns], da[Ns];
            float c0 = 0.0f;
            for (int i = 0; i < Ns; i++) {
                const float *v = i < C ? st->hist + ((size_t)i * n + t) * d : P + t * d;
                a[i] = expf(s[i] - lse[t]);
                da[i] = dot_row(dht, v, d);
                c0 += a[i] * da[i];
            }
            for (int i = 0; i < Ns; i++) {
                const float *v = i < C ? st->hist + ((size_t)i * n + t) * d : P + t * d;
                float *dv = i < C ? st->dhist + ((size_t)i * n + t) * d : dP + t * d;
                float r = i < C ? st->hist_rstd[i * n + t] : Pr[t];
                float ds = a[i] * (da[i] - c0);
                float k1 = ds * r, k2 = ds * r * r * s[i] / (float)d;
                const float ai = a[i];
#pragma omp simd
                for (int c = 0; c < d; c++) dv[c] += ai * dht[c] + k1 * u[c] - k2 * v[c];
                /* q += ds_i xhat_i, while the row is in cache */
                if (want_q) axpy_row(qb, k1, v, d);
                s[i] = ds;
            }
        }
    }
    if (!want_q) return;
    const float *w = p->query + (size_t)l * d, *kg = p->key_norm + (size_t)l * d;
    float *dw = g->query ? g->query + (size_t)l * d : NULL, *dg = g->key_norm ? g->key_norm + (size_t)l * d : NULL;
    /* q = sum of the block partial sums in block order; dw += g (.) q, dg += w (.) q */
#pragma omp parallel for schedule(static) if (PARALLEL_IF(n_tb * d))
    for (int c = 0; c < d; c++) {
        float q = 0.0f;
        for (int64_t b = 0; b < n_tb; b++) q += st->qpart[b * d + c];
        if (dw) dw[c] += kg[c] * q;
        if (dg) dg[c] += w[c] * q;
    }
}

lm_status lm_attnres_final_backward(lm_attnres_state *st, const lm_attnres_params *p, const float *dh,
                                    lm_attnres_grads *g) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    const int L = st->cfg.n_sublayers;
    lm_status s = expect(st, 2 * L + 1, "lm_attnres_final_backward", -1);
    if (s) return s;
    if ((s = check_params(st, p, "lm_attnres_final_backward"))) return s;
    if (!dh) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_final_backward: dh is NULL");
    // dh is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d;
    const size_t nd = (size_t)n * d;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        memcpy(st->dhist, dh, nd * sizeof(float));
    } else {
        memset(st->dhist, 0, (size_t)(1 + st->n_blocks) * nd * sizeof(float));
        layer_backward(st, p, g, L, 1 + st->n_blocks, NULL, NULL, NULL,
                       st->logits + attnres_logits_offset(L, st->S, L, n), st->lse + (size_t)L * n, dh);
    }
    st->step++;
    return LM_OK;
}

lm_status lm_attnres_output_backward(lm_attnres_state *st, int l, float *dy) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    const int L = st->cfg.n_sublayers;
    lm_status s = expect(st, 2 * L + 2 + 2 * (L - 1 - l), "lm_attnres_output_backward", l);
    if (s) return s;
    if (!dy) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_output_backward(l = %d): dy is NULL", l);
    // dy is (n,d)
    const size_t nd = (size_t)st->cfg.n_tokens * st->cfg.d;
    /* y_l enters its block's sum and every later partial sum of the block:
     * the open block's accumulator holds exactly those gradients now */
    const float *G = st->cfg.mode == LM_ATTNRES_STANDARD ? st->dhist : st->dhist + (size_t)(1 + l / st->S) * nd;
    for (size_t i = 0; i < nd; i++) dy[i] += G[i];
    st->step++;
    return LM_OK;
}

lm_status lm_attnres_input_backward(lm_attnres_state *st, int l, const lm_attnres_params *p, const float *dh,
                                    lm_attnres_grads *g) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    const int L = st->cfg.n_sublayers;
    lm_status s = expect(st, 2 * L + 3 + 2 * (L - 1 - l), "lm_attnres_input_backward", l);
    if (s) return s;
    if ((s = check_params(st, p, "lm_attnres_input_backward"))) return s;
    if (!dh) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_input_backward(l = %d): dh is NULL", l);
    // dh is (n,d)
    const int64_t n = st->cfg.n_tokens;
    const int d = st->cfg.d;
    const size_t nd = (size_t)n * d;
    if (st->cfg.mode == LM_ATTNRES_STANDARD) {
        for (size_t i = 0; i < nd; i++) st->dhist[i] += dh[i];
    } else {
        const int S = st->S, k = l / S, pos = l % S;
        const float *P = pos > 0 ? st->partials + (size_t)attnres_partial_slot(&st->cfg, l) * nd : NULL;
        const float *Pr = pos > 0 ? st->partial_rstd + (size_t)l * n : NULL;
        layer_backward(st, p, g, l, 1 + k, P, Pr, st->dhist + (size_t)(1 + k) * nd,
                       st->logits + attnres_logits_offset(l, S, L, n), st->lse + (size_t)l * n, dh);
    }
    st->step++;
    return LM_OK;
}

lm_status lm_attnres_embedding_backward(lm_attnres_state *st, float *dembedding) {
    if (!st) return lm_error(LM_ERR_ARG, "attnres: state is NULL");
    const int L = st->cfg.n_sublayers;
    lm_status s = expect(st, 4 * L + 2, "lm_attnres_embedding_backward", -1);
    if (s) return s;
    if (!dembedding) return lm_error(LM_ERR_ARG, "attnres: lm_attnres_embedding_backward: dembedding is NULL");
    // dembedding is (n,d)
    const size_t nd = (size_t)st->cfg.n_tokens * st->cfg.d;
    for (size_t i = 0; i < nd; i++) dembedding[i] += st->dhist[i];
    st->step++;
    return LM_OK;
}
