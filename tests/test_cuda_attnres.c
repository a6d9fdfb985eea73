/* Block / Full Attention Residuals on the GPU (include/longmoe/attnres_cuda.h)
 * against the CPU module (include/longmoe/attnres.h) with the same config.
 *
 * One whole sequence on both sides: random embedding, random sublayer
 * outputs y_l fed in, random dh for every input and for the final; random
 * non-zero query and key_norm parameters; gradients (dy, dembedding, dquery,
 * dkey_norm) start from random non-zero values, so accumulation is checked
 * (the increments are compared). Every h_l, the final h, every dy_l, the
 * embedding gradient and the parameter gradients must agree to a relative
 * error ||gpu - cpu|| / ||cpu|| <= 1e-5 (all fp32), for BLOCK (S = 1..4 with
 * L = 8: S = 3 leaves an incomplete last block), FULL and STANDARD, n = 1, 37,
 * 1000 tokens, d = 64 and 1024. The GPU's recomputed inputs must equal the
 * CPU's forward inputs to the same bound, and two GPU runs must be
 * bit-identical, and the register forward must give the two-pass forward's
 * bits. Needs a CUDA GPU (ctest label cuda). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "check.h"
#include "longmoe/attnres.h"
#include "longmoe/attnres_cuda.h"
#include "longmoe/cuda_context.h"
#include "longmoe/linear.h"
#include "test.h"
#include "test_cuda.h"

#define TOL 1e-5

static lm_cuda_context ctx;

typedef struct {
    lm_attnres_config cfg;
    size_t nd, pd; /* n*d, (L+1)*d */
    float *emb, *y, *dh, *dh_final; /* y, dh: [L][n,d] */
    float *query, *key_norm;        /* [L+1, d] */
    float *dy0, *demb0, *gq0, *gk0; /* initial gradient values */
} problem;

typedef struct {
    float *h, *h_final, *h_rec; /* h: [L][n,d]; h_rec: [L+1][n,d] (GPU only) */
    float *dy, *demb, *gq, *gk;
} outputs;

static problem make_problem(lm_attnres_mode mode, int S, int L, int64_t n, int d, uint64_t seed) {
    problem p;
    memset(&p, 0, sizeof p);
    p.cfg.mode = mode;
    p.cfg.n_sublayers = L;
    p.cfg.block_size = S;
    p.cfg.d = d;
    p.cfg.n_tokens = n;
    p.cfg.eps = 1e-6f;
    p.cfg.two_phase = 0;
    p.nd = (size_t)n * d;
    p.pd = (size_t)(L + 1) * d;
    lm_rng r;
    lm_rng_seed(&r, seed);
    p.emb = mallocCheck(p.nd * 4);
    p.y = mallocCheck((size_t)L * p.nd * 4);
    p.dh = mallocCheck((size_t)L * p.nd * 4);
    p.dh_final = mallocCheck(p.nd * 4);
    p.dy0 = mallocCheck((size_t)L * p.nd * 4);
    p.demb0 = mallocCheck(p.nd * 4);
    p.query = mallocCheck(p.pd * 4);
    p.key_norm = mallocCheck(p.pd * 4);
    p.gq0 = mallocCheck(p.pd * 4);
    p.gk0 = mallocCheck(p.pd * 4);
    fill_normal(p.emb, p.nd, &r, 1.0, 0.0, 0);
    /* sublayer outputs of different scales, so the sources' rms differ */
    for (int l = 0; l < L; l++) fill_normal(p.y + (size_t)l * p.nd, p.nd, &r, 0.3 + 1.7 * lm_rng_uniform(&r), 0.0, 0);
    fill_normal(p.dh, (size_t)L * p.nd, &r, 1.0, 0.0, 0);
    fill_normal(p.dh_final, p.nd, &r, 1.0, 0.0, 0);
    fill_normal(p.dy0, (size_t)L * p.nd, &r, 0.01, 0.0, 0);
    fill_normal(p.demb0, p.nd, &r, 0.01, 0.0, 0);
    /* scores of order one: |w (.) g| ~ 1, keys of unit rms */
    fill_normal(p.query, p.pd, &r, 1.0 / sqrt((double)d), 0.0, 0);
    for (size_t i = 0; i < p.pd; i++) p.key_norm[i] = (float)(1.0 + 0.3 * lm_rng_normal(&r));
    fill_normal(p.gq0, p.pd, &r, 0.01, 0.0, 0);
    fill_normal(p.gk0, p.pd, &r, 0.01, 0.0, 0);
    return p;
}

static void free_problem(problem *p) {
    free(p->emb);
    free(p->y);
    free(p->dh);
    free(p->dh_final);
    free(p->dy0);
    free(p->demb0);
    free(p->query);
    free(p->key_norm);
    free(p->gq0);
    free(p->gk0);
}

static outputs make_outputs(const problem *p) {
    outputs o;
    const int L = p->cfg.n_sublayers;
    o.h = mallocCheck((size_t)L * p->nd * 4);
    o.h_final = mallocCheck(p->nd * 4);
    o.h_rec = callocCheck((size_t)(L + 1) * p->nd, 4);
    o.dy = mallocCheck((size_t)L * p->nd * 4);
    o.demb = mallocCheck(p->nd * 4);
    o.gq = mallocCheck(p->pd * 4);
    o.gk = mallocCheck(p->pd * 4);
    return o;
}

static void free_outputs(outputs *o) {
    free(o->h);
    free(o->h_final);
    free(o->h_rec);
    free(o->dy);
    free(o->demb);
    free(o->gq);
    free(o->gk);
}

#define STEP_OK(call)                                                                         \
    do {                                                                                      \
        lm_status s_ = (call);                                                                \
        CHECK(s_ == LM_OK, "%s: %s", #call, lm_last_error());                                 \
        if (s_ != LM_OK) ok = 0;                                                              \
    } while (0)

/* the CPU module, direct form (the GPU computes each softmax directly) */
static int run_cpu(const problem *p, outputs *o) {
    int ok = 1;
    const int L = p->cfg.n_sublayers;
    const size_t nd = p->nd;
    lm_attnres_memory_plan plan;
    STEP_OK(lm_attnres_memory(&p->cfg, &plan));
    if (!ok) return 0;
    void *ws = aligned_alloc(64, (plan.total + 63) / 64 * 64);
    lm_attnres_state st;
    STEP_OK(lm_attnres_init(&st, &p->cfg, ws, plan.total));
    lm_attnres_params prm = {p->query, p->key_norm};
    memcpy(o->gq, p->gq0, p->pd * 4);
    memcpy(o->gk, p->gk0, p->pd * 4);
    memcpy(o->dy, p->dy0, (size_t)L * nd * 4);
    memcpy(o->demb, p->demb0, nd * 4);
    lm_attnres_grads g = {o->gq, o->gk};
    STEP_OK(lm_attnres_begin(&st, p->emb));
    for (int l = 0; l < L; l++) {
        STEP_OK(lm_attnres_input(&st, l, &prm, o->h + (size_t)l * nd));
        STEP_OK(lm_attnres_add_output(&st, l, p->y + (size_t)l * nd));
    }
    STEP_OK(lm_attnres_final(&st, &prm, o->h_final));
    STEP_OK(lm_attnres_final_backward(&st, &prm, p->dh_final, &g));
    for (int l = L - 1; l >= 0; l--) {
        STEP_OK(lm_attnres_output_backward(&st, l, o->dy + (size_t)l * nd));
        STEP_OK(lm_attnres_input_backward(&st, l, &prm, p->dh + (size_t)l * nd, &g));
    }
    STEP_OK(lm_attnres_embedding_backward(&st, o->demb));
    free(ws);
    return ok;
}

static float *dev_upload(const float *x, size_t count) {
    void *d = dev_alloc(count * 4);
    if (x && lm_cuda_upload(d, x, count * 4) != LM_OK) dieAt("upload: %s", lm_last_error());
    return (float *)d;
}

static void dev_download(float *x, const float *d, size_t count) {
    if (lm_cuda_download(x, d, count * 4) != LM_OK) dieAt("download: %s", lm_last_error());
}

/* the same sequence on the GPU; recomputes every input after its output backward.
 * gpu_view: dy through lm_cuda_attnres_output_grad (the state's accumulator read
 * back and added on the host, the add the copying call does on the device),
 * and its bf16 copy: view_lp_bad counts the sublayers whose copy is missing,
 * present in standard mode, or not the bits lm_f32_to_bf16 gives */
static int gpu_view, view_lp_bad, view_lp_seen;
/* gpu_note: the forward's adds through lm_cuda_attnres_add_output_note (the
 * deferred non-finite check in the same pass); note_noted = what it noted
 * (~0: nothing, as it must be for finite outputs) */
static int gpu_note;
static unsigned long long note_noted;

static int run_gpu(const problem *p, outputs *o) {
    int ok = 1;
    const int L = p->cfg.n_sublayers;
    const size_t nd = p->nd;
    const int attn = p->cfg.mode != LM_ATTNRES_STANDARD;
    lm_attnres_memory_plan plan;
    STEP_OK(lm_cuda_attnres_memory(&p->cfg, &plan));
    if (!ok) return 0;
    void *ws = NULL;
    STEP_OK(lm_cuda_alloc(&ws, plan.total));
    /* poison the workspace: nothing may depend on it being zero */
    float *junk = mallocCheck(plan.total);
    for (size_t i = 0; i < plan.total / 4; i++) junk[i] = 1e30f;
    STEP_OK(lm_cuda_upload(ws, junk, plan.total / 4 * 4));
    free(junk);
    lm_cuda_attnres_state st;
    STEP_OK(lm_cuda_attnres_init(&st, &p->cfg, ws, plan.total));
    float *emb = dev_upload(p->emb, nd), *y = dev_upload(p->y, (size_t)L * nd), *dh = dev_upload(p->dh, (size_t)L * nd);
    float *dh_final = dev_upload(p->dh_final, nd), *dy = dev_upload(p->dy0, (size_t)L * nd);
    float *demb = dev_upload(p->demb0, nd), *query = dev_upload(p->query, p->pd);
    float *key_norm = dev_upload(p->key_norm, p->pd), *gq = dev_upload(p->gq0, p->pd), *gk = dev_upload(p->gk0, p->pd);
    float *h = dev_upload(NULL, (size_t)L * nd), *h_final = dev_upload(NULL, nd);
    float *h_rec = dev_upload(NULL, (size_t)(L + 1) * nd), *h_rep = dev_upload(NULL, nd);
    lm_attnres_params prm = {query, key_norm};
    lm_attnres_grads g = {gq, gk};
    /* the uploads ran on the legacy stream; the context's stream does not wait for it */
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "uploads");
    unsigned long long *note_slot = NULL, none = ~0ull;
    if (gpu_note) {
        STEP_OK(lm_cuda_alloc((void **)&note_slot, sizeof none));
        STEP_OK(lm_cuda_upload(note_slot, &none, sizeof none));
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "note slot");
    STEP_OK(lm_cuda_attnres_begin(&ctx, &st, emb));
    for (int l = 0; l < L; l++) {
        STEP_OK(lm_cuda_attnres_input(&ctx, &st, l, &prm, h + (size_t)l * nd));
        if (gpu_note) STEP_OK(lm_cuda_attnres_add_output_note(&ctx, &st, l, y + (size_t)l * nd, note_slot));
        else STEP_OK(lm_cuda_attnres_add_output(&ctx, &st, l, y + (size_t)l * nd));
    }
    STEP_OK(lm_cuda_attnres_final(&ctx, &st, &prm, h_final));
    if (attn) STEP_OK(lm_cuda_attnres_recompute_input(&ctx, &st, L, h_rec + (size_t)L * nd));
    STEP_OK(lm_cuda_attnres_final_backward(&ctx, &st, &prm, dh_final, &g));
    const int S = p->cfg.block_size;
    for (int l = L - 1; l >= 0; l--) {
        if (p->cfg.replay && (l % S == S - 1 || l == L - 1)) {
            /* one block's partial sums kept: its forward again before its backward */
            const int k = l / S;
            STEP_OK(lm_cuda_attnres_replay_block(&st, k));
            for (int j = k * S; j <= l; j++) {
                STEP_OK(lm_cuda_attnres_input(&ctx, &st, j, &prm, h_rep));
                STEP_OK(lm_cuda_attnres_add_output(&ctx, &st, j, y + (size_t)j * nd));
            }
        }
        if (gpu_view) {
            const float *G = NULL;
            const void *G_lp = NULL;
            STEP_OK(lm_cuda_attnres_output_grad(&ctx, &st, l, &G, &G_lp));
            if (!ok || !G) return 0;
            STEP_OK(lm_cuda_context_sync(&ctx));
            float *gh = mallocCheck(nd * 4);
            dev_download(gh, G, nd);
            for (size_t i = 0; i < nd; i++) o->dy[(size_t)l * nd + i] = p->dy0[(size_t)l * nd + i] + gh[i];
            if (!attn) {
                view_lp_bad += G_lp != NULL;
            } else if (!G_lp) {
                view_lp_bad++;
            } else {
                uint16_t *lp = mallocCheck(nd * 2);
                if (lm_cuda_download(lp, G_lp, nd * 2) != LM_OK) dieAt("download: %s", lm_last_error());
                size_t wrong = 0;
                for (size_t i = 0; i < nd; i++) wrong += lp[i] != lm_f32_to_bf16(gh[i]);
                view_lp_bad += wrong > 0;
                view_lp_seen++;
                free(lp);
            }
            free(gh);
        } else
            STEP_OK(lm_cuda_attnres_output_backward(&ctx, &st, l, dy + (size_t)l * nd));
        if (attn) STEP_OK(lm_cuda_attnres_recompute_input(&ctx, &st, l, h_rec + (size_t)l * nd));
        STEP_OK(lm_cuda_attnres_input_backward(&ctx, &st, l, &prm, dh + (size_t)l * nd, &g));
    }
    STEP_OK(lm_cuda_attnres_embedding_backward(&ctx, &st, demb));
    STEP_OK(lm_cuda_context_sync(&ctx));
    dev_download(o->h, h, (size_t)L * nd);
    dev_download(o->h_final, h_final, nd);
    dev_download(o->h_rec, h_rec, (size_t)(L + 1) * nd);
    if (!gpu_view) dev_download(o->dy, dy, (size_t)L * nd);
    dev_download(o->demb, demb, nd);
    dev_download(o->gq, gq, p->pd);
    dev_download(o->gk, gk, p->pd);
    if (note_slot) {
        STEP_OK(lm_cuda_download(&note_noted, note_slot, sizeof note_noted));
        lm_cuda_free(note_slot);
    }
    float *bufs[] = {emb, y, dh, dh_final, dy, demb, query, key_norm, gq, gk, h, h_final, h_rec, h_rep};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) lm_cuda_free(bufs[i]);
    lm_cuda_free(ws);
    return ok;
}

/* relative error of got - base against want - base (the accumulated increments), in double */
static double increment_error(const float *got, const float *want, const float *base, size_t count) {
    double num = 0, den = 0;
    for (size_t i = 0; i < count; i++) {
        const double b = base ? (double)base[i] : 0.0;
        const double e = (double)got[i] - (double)want[i], w = (double)want[i] - b;
        if (isnan(got[i])) return INFINITY;
        num += e * e;
        den += w * w;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static const char *case_name(const lm_attnres_config *c, char *buf, size_t size) {
    snprintf(buf, size, "%s S=%d n=%lld d=%d", lm_attnres_mode_name(c->mode), c->block_size, (long long)c->n_tokens,
             c->d);
    return buf;
}

static double worst_error;

static void check_case(lm_attnres_mode mode, int S, int64_t n, int d, uint64_t seed) {
    const int L = 8;
    problem p = make_problem(mode, S, L, n, d, seed);
    outputs cpu = make_outputs(&p), gpu = make_outputs(&p), again = make_outputs(&p);
    char name[96];
    case_name(&p.cfg, name, sizeof name);
    const size_t nd = p.nd;
    int ran = run_cpu(&p, &cpu) && run_gpu(&p, &gpu);
    /* the second run takes dy as a view of the state (lm_cuda_attnres_output_grad):
     * every output bit-identical to the copying run; its forward adds the
     * outputs with the non-finite check in the same pass, which notes nothing */
    gpu_view = 1;
    gpu_note = 1;
    note_noted = 0;
    view_lp_bad = view_lp_seen = 0;
    ran = ran && run_gpu(&p, &again);
    gpu_view = 0;
    gpu_note = 0;
    CHECK(!ran || note_noted == ~0ull, "%s: finite outputs noted as non-finite at %llu", name, note_noted);
    /* the bf16 copy of every sublayer's output gradient (block and full), the bits of lm_f32_to_bf16 */
    CHECK(view_lp_bad == 0, "%s: %d sublayers' bf16 output gradient missing or not the rounded fp32 one", name,
          view_lp_bad);
    CHECK(view_lp_seen == (mode == LM_ATTNRES_STANDARD ? 0 : L), "%s: %d bf16 output gradients checked of %d", name,
          view_lp_seen, mode == LM_ATTNRES_STANDARD ? 0 : L);
    if (!ran) {
        CHECK(0, "%s: a call failed", name);
        goto done;
    }
    double e, worst = 0;
    for (int l = 0; l < L; l++) {
        e = increment_error(gpu.h + l * nd, cpu.h + l * nd, NULL, nd);
        CHECK(e <= TOL, "%s: h_%d relative error %.3g", name, l, e);
        worst = fmax(worst, e);
        e = increment_error(gpu.dy + l * nd, cpu.dy + l * nd, p.dy0 + l * nd, nd);
        CHECK(e <= TOL, "%s: dy_%d relative error %.3g", name, l, e);
        worst = fmax(worst, e);
        if (mode != LM_ATTNRES_STANDARD) {
            e = increment_error(gpu.h_rec + l * nd, cpu.h + l * nd, NULL, nd);
            CHECK(e <= TOL, "%s: recomputed h_%d relative error %.3g", name, l, e);
            worst = fmax(worst, e);
        }
    }
    e = increment_error(gpu.h_final, cpu.h_final, NULL, nd);
    CHECK(e <= TOL, "%s: final h relative error %.3g", name, e);
    worst = fmax(worst, e);
    if (mode != LM_ATTNRES_STANDARD) {
        e = increment_error(gpu.h_rec + L * nd, cpu.h_final, NULL, nd);
        CHECK(e <= TOL, "%s: recomputed final h relative error %.3g", name, e);
        worst = fmax(worst, e);
    }
    e = increment_error(gpu.demb, cpu.demb, p.demb0, nd);
    CHECK(e <= TOL, "%s: d embedding relative error %.3g", name, e);
    worst = fmax(worst, e);
    e = increment_error(gpu.gq, cpu.gq, p.gq0, p.pd);
    CHECK(e <= TOL, "%s: d query relative error %.3g", name, e);
    worst = fmax(worst, e);
    e = increment_error(gpu.gk, cpu.gk, p.gk0, p.pd);
    CHECK(e <= TOL, "%s: d key_norm relative error %.3g", name, e);
    worst = fmax(worst, e);
    if (mode != LM_ATTNRES_STANDARD) {
        /* the parameter gradients moved: a non-trivial comparison */
        CHECK(increment_error(cpu.gq, p.gq0, NULL, p.pd) > 0, "%s: d query did not change", name);
        CHECK(increment_error(cpu.gk, p.gk0, NULL, p.pd) > 0, "%s: d key_norm did not change", name);
    }
    /* run-to-run bit identity */
    CHECK(!memcmp(gpu.h, again.h, (size_t)L * nd * 4) && !memcmp(gpu.h_final, again.h_final, nd * 4) &&
              !memcmp(gpu.h_rec, again.h_rec, (size_t)(L + 1) * nd * 4),
          "%s: forward differs between two runs", name);
    CHECK(!memcmp(gpu.dy, again.dy, (size_t)L * nd * 4) && !memcmp(gpu.demb, again.demb, nd * 4) &&
              !memcmp(gpu.gq, again.gq, p.pd * 4) && !memcmp(gpu.gk, again.gk, p.pd * 4),
          "%s: backward differs between two runs", name);
    if (worst > worst_error) worst_error = worst;
done:
    free_outputs(&cpu);
    free_outputs(&gpu);
    free_outputs(&again);
    free_problem(&p);
}

static void run_shapes(lm_attnres_mode mode, int S, uint64_t seed) {
    const int64_t ns[] = {1, 37, 1000};
    /* d = 97: one float a thread (no float4); 64, 97, 1024: the forward keeps a
     * row's sources in registers; 2056: two float4 steps a thread (the
     * two-pass forward) */
    const int ds[] = {64, 1024, 97, 2056};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 4; b++) check_case(mode, S, ns[a], ds[b], seed + 10 * a + b);
}

static void test_block_modes_match_cpu_and_repeat_bitwise(void) {
    /* L = 8: S = 3 leaves a last block of 2 sublayers */
    for (int S = 1; S <= 4; S++) run_shapes(LM_ATTNRES_BLOCK, S, 100 + 1000 * (uint64_t)S);
    printf("  worst relative error so far %.3g\n", worst_error);
}

static void test_full_mode_matches_cpu_and_repeats_bitwise(void) {
    run_shapes(LM_ATTNRES_FULL, 1, 7000);
    printf("  worst relative error so far %.3g\n", worst_error);
}

static void test_standard_mode_matches_cpu_and_repeats_bitwise(void) {
    run_shapes(LM_ATTNRES_STANDARD, 1, 9000);
    printf("  worst relative error so far %.3g\n", worst_error);
}

/* replay = 1: one block's partial sums on the device, each block's forward
 * replayed before its backward: the same bits as the state that keeps them
 * all (forward, recomputed inputs, every gradient), in less memory. */
static void test_replayed_blocks_give_the_same_backward(void) {
    const int Ss[] = {3, 4}, ds[] = {64, 97};
    for (int i = 0; i < 2; i++) {
        problem p = make_problem(LM_ATTNRES_BLOCK, Ss[i], 8, 37, ds[i], 8100 + (uint64_t)i);
        outputs a = make_outputs(&p), b = make_outputs(&p);
        const size_t nd = p.nd, L = 8;
        lm_attnres_memory_plan pa, pb;
        CHECK(!lm_cuda_attnres_memory(&p.cfg, &pa), "%s", lm_last_error());
        int ok = run_gpu(&p, &a);
        p.cfg.replay = 1;
        CHECK(!lm_cuda_attnres_memory(&p.cfg, &pb), "%s", lm_last_error());
        CHECK(pb.saved_partials < pa.saved_partials, "replay keeps %zu bytes of partial sums, all %zu",
              pb.saved_partials, pa.saved_partials);
        ok = run_gpu(&p, &b) && ok;
        CHECK(ok, "S=%d: a call failed", Ss[i]);
        CHECK(!memcmp(a.h, b.h, L * nd * 4) && !memcmp(a.h_rec, b.h_rec, (L + 1) * nd * 4), "S=%d: inputs differ",
              Ss[i]);
        CHECK(!memcmp(a.dy, b.dy, L * nd * 4) && !memcmp(a.demb, b.demb, nd * 4) && !memcmp(a.gq, b.gq, p.pd * 4) &&
                  !memcmp(a.gk, b.gk, p.pd * 4),
              "S=%d: the replayed backward differs", Ss[i]);
        free_outputs(&a);
        free_outputs(&b);
        free_problem(&p);
    }
}

/* The register forward (a row's sources held in registers: d <= 1024, at
 * most 16 sources) gives the same bits as the two-pass forward
 * (LONGMOE_ATTNRES=generic), and so the backward that follows does too:
 * BLOCK and FULL, several sources, n not a multiple of the backward's token
 * block, one float a thread (d = 97) and float4 (64, 1024). */
static void test_register_forward_equals_generic_bitwise(void) {
    const struct {
        lm_attnres_mode mode;
        int S;
        int64_t n;
        int d;
    } cs[] = {{LM_ATTNRES_BLOCK, 3, 37, 1024}, {LM_ATTNRES_BLOCK, 2, 1000, 97}, {LM_ATTNRES_FULL, 1, 101, 64},
              {LM_ATTNRES_BLOCK, 4, 70, 64}};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        problem p = make_problem(cs[i].mode, cs[i].S, 8, cs[i].n, cs[i].d, 8300 + (uint64_t)i);
        outputs a = make_outputs(&p), b = make_outputs(&p);
        const size_t nd = p.nd, L = 8;
        int ok = run_gpu(&p, &a);
        setenv("LONGMOE_ATTNRES", "generic", 1);
        ok = run_gpu(&p, &b) && ok;
        unsetenv("LONGMOE_ATTNRES");
        CHECK(ok, "case %zu: a call failed", i);
        CHECK(!memcmp(a.h, b.h, L * nd * 4) && !memcmp(a.h_final, b.h_final, nd * 4) &&
                  !memcmp(a.h_rec, b.h_rec, (L + 1) * nd * 4),
              "case %zu (n=%lld d=%d): the forward differs", i, (long long)cs[i].n, cs[i].d);
        CHECK(!memcmp(a.dy, b.dy, L * nd * 4) && !memcmp(a.demb, b.demb, nd * 4) && !memcmp(a.gq, b.gq, p.pd * 4) &&
                  !memcmp(a.gk, b.gk, p.pd * 4),
              "case %zu (n=%lld d=%d): the backward differs", i, (long long)cs[i].n, cs[i].d);
        free_outputs(&a);
        free_outputs(&b);
        free_problem(&p);
    }
}

/* The sublayer input with its RMSNorm in one pass each way (lm_cuda_attnres_input_norm,
 * _recompute_input_norm, _input_norm_backward) against the CPU's AttnRes followed by the
 * CPU's RMSNorm (linear.h), forward and backward, from random norm weights and random norm
 * output gradients: xn (fp32 and bf16), 1/rms, every output gradient, the embedding's, the
 * query's, key norm's and norm weights' gradients; and bit-identical on a second run. */
/* variant 0: two runs, the direct backward; 1: the second run defers the closed sources' terms
 * (lm_cuda_attnres_set_deferred) and must give the first's bits, the bf16 output gradients too;
 * 2: as 1, with each block's first sublayer and (S >= 3) its position S - 2 through the input's
 * backward without the norm (dh: the CPU's), which defers nothing and adds what waits in the
 * generic kernel; the CPU comparison is left out there (its norm weight's gradient lacks those
 * sublayers) */
static void norm_case_variant(lm_attnres_mode mode, int S, int L, int64_t n, int d, uint64_t seed, int variant) {
    problem p = make_problem(mode, S, L, n, d, seed);
    char name[112];
    case_name(&p.cfg, name, sizeof name);
    if (variant) snprintf(name + strlen(name), sizeof name - strlen(name), variant == 1 ? ", deferred" : ", deferred, mixed");
    CHECK(lm_cuda_attnres_norm_fusable(&p.cfg), "%s: not fusable", name);
    const size_t nd = p.nd, ld = (size_t)L * d;
    lm_rng r;
    lm_rng_seed(&r, seed + 99);
    float *nw = mallocCheck(ld * 4), *dxn = mallocCheck((size_t)L * nd * 4), *dnw0 = mallocCheck(ld * 4);
    for (size_t i = 0; i < ld; i++) nw[i] = (float)(1.0 + 0.3 * lm_rng_normal(&r));
    fill_normal(dxn, (size_t)L * nd, &r, 1.0, 0.0, 0);
    fill_normal(dnw0, ld, &r, 0.01, 0.0, 0);
    /* the CPU: input, norm; norm backward into dh, input backward */
    float *xn_c = mallocCheck((size_t)L * nd * 4), *rs_c = mallocCheck((size_t)L * n * 4);
    float *dnw_c = mallocCheck(ld * 4), *dy_c = mallocCheck((size_t)L * nd * 4), *dh = mallocCheck(nd * 4);
    float *hs = mallocCheck((size_t)L * nd * 4), *hf = mallocCheck(nd * 4);
    float *gq_c = mallocCheck(p.pd * 4), *gk_c = mallocCheck(p.pd * 4), *demb_c = mallocCheck(nd * 4);
    float *dh_all = mallocCheck((size_t)L * nd * 4);
    memcpy(dnw_c, dnw0, ld * 4);
    memcpy(gq_c, p.gq0, p.pd * 4);
    memcpy(gk_c, p.gk0, p.pd * 4);
    memcpy(demb_c, p.demb0, nd * 4);
    memset(dy_c, 0, (size_t)L * nd * 4);
    int ok = 1;
    {
        lm_attnres_memory_plan plan;
        STEP_OK(lm_attnres_memory(&p.cfg, &plan));
        void *ws = aligned_alloc(64, (plan.total + 63) / 64 * 64);
        lm_attnres_state st;
        STEP_OK(lm_attnres_init(&st, &p.cfg, ws, plan.total));
        lm_attnres_params prm = {p.query, p.key_norm};
        lm_attnres_grads g = {gq_c, gk_c};
        STEP_OK(lm_attnres_begin(&st, p.emb));
        for (int l = 0; l < L; l++) {
            STEP_OK(lm_attnres_input(&st, l, &prm, hs + (size_t)l * nd));
            lm_rmsnorm_forward(xn_c + (size_t)l * nd, rs_c + (size_t)l * n, hs + (size_t)l * nd, nw + (size_t)l * d, n,
                               d, 1e-5f);
            STEP_OK(lm_attnres_add_output(&st, l, p.y + (size_t)l * nd));
        }
        STEP_OK(lm_attnres_final(&st, &prm, hf));
        STEP_OK(lm_attnres_final_backward(&st, &prm, p.dh_final, &g));
        for (int l = L - 1; l >= 0; l--) {
            STEP_OK(lm_attnres_output_backward(&st, l, dy_c + (size_t)l * nd));
            memset(dh, 0, nd * 4);
            lm_rmsnorm_backward(dh, dnw_c + (size_t)l * d, dxn + (size_t)l * nd, hs + (size_t)l * nd,
                                nw + (size_t)l * d, rs_c + (size_t)l * n, n, d, 1e-5f);
            STEP_OK(lm_attnres_input_backward(&st, l, &prm, dh, &g));
            memcpy(dh_all + (size_t)l * nd, dh, nd * 4);
        }
        STEP_OK(lm_attnres_embedding_backward(&st, demb_c));
        free(ws);
    }
    /* the GPU, twice */
    float *xn_g[2] = {0}, *rs_g[2] = {0}, *rec_g[2] = {0}, *dnw_g[2] = {0}, *dy_g[2] = {0}, *gq_g[2] = {0};
    float *gk_g[2] = {0}, *demb_g[2] = {0};
    uint16_t *xb_g[2] = {0}, *lp_g[2] = {0};
    for (int run = 0; run < 2 && ok; run++) {
        const int defer = variant && run == 1;
        STEP_OK(lm_cuda_attnres_set_deferred(defer));
        CHECK(lm_cuda_attnres_deferred() == defer, "%s: the deferred setting reads back %d", name,
              lm_cuda_attnres_deferred());
        lm_attnres_memory_plan plan;
        STEP_OK(lm_cuda_attnres_memory(&p.cfg, &plan));
        CHECK((plan.deferred > 0) == defer, "%s, run %d: %zu bytes planned for the deferred terms", name, run,
              plan.deferred);
        void *ws = NULL;
        STEP_OK(lm_cuda_alloc(&ws, plan.total));
        lm_cuda_attnres_state st;
        STEP_OK(lm_cuda_attnres_init(&st, &p.cfg, ws, plan.total));
        float *emb = dev_upload(p.emb, nd), *y = dev_upload(p.y, (size_t)L * nd), *dhf = dev_upload(p.dh_final, nd);
        float *q = dev_upload(p.query, p.pd), *k = dev_upload(p.key_norm, p.pd), *gq = dev_upload(p.gq0, p.pd);
        float *gk = dev_upload(p.gk0, p.pd), *dnw = dev_upload(dnw0, ld), *nwd = dev_upload(nw, ld);
        float *dxd = dev_upload(dxn, (size_t)L * nd), *demb = dev_upload(p.demb0, nd), *hfd = dev_upload(NULL, nd);
        float *xn = dev_upload(NULL, (size_t)L * nd), *rs = dev_upload(NULL, (size_t)L * n);
        float *dhd = dev_upload(dh_all, (size_t)L * nd);
        float *rec = dev_upload(NULL, (size_t)L * nd), *rrs = dev_upload(NULL, n);
        uint16_t *xb = (uint16_t *)dev_alloc((size_t)L * nd * 2);
        lm_attnres_params prm = {q, k};
        lm_attnres_grads g = {gq, gk};
        CHECK(cudaDeviceSynchronize() == cudaSuccess, "uploads");
        STEP_OK(lm_cuda_attnres_begin(&ctx, &st, emb));
        for (int l = 0; l < L; l++) {
            lm_cuda_attnres_norm nm = {nwd + (size_t)l * d, 1e-5f, xn + (size_t)l * nd, xb + (size_t)l * nd,
                                       rs + (size_t)l * n};
            STEP_OK(lm_cuda_attnres_input_norm(&ctx, &st, l, &prm, &nm));
            STEP_OK(lm_cuda_attnres_add_output(&ctx, &st, l, y + (size_t)l * nd));
        }
        STEP_OK(lm_cuda_attnres_final(&ctx, &st, &prm, hfd));
        STEP_OK(lm_cuda_attnres_final_backward(&ctx, &st, &prm, dhf, &g));
        dy_g[run] = mallocCheck((size_t)L * nd * 4);
        lp_g[run] = mallocCheck((size_t)L * nd * 2);
        memset(lp_g[run], 0, (size_t)L * nd * 2);
        int expect_mask = 0;
        for (int l = L - 1; l >= 0 && ok; l--) {
            const float *G = NULL;
            const void *G_lp = NULL;
            STEP_OK(lm_cuda_attnres_output_grad(&ctx, &st, l, &G, &G_lp));
            STEP_OK(lm_cuda_context_sync(&ctx));
            if (!ok) break;
            dev_download(dy_g[run] + (size_t)l * nd, G, nd);
            CHECK(G_lp != NULL, "%s: no bf16 output gradient for sublayer %d", name, l);
            if (G_lp && lm_cuda_download(lp_g[run] + (size_t)l * nd, G_lp, nd * 2) != LM_OK)
                dieAt("download: %s", lm_last_error());
            /* the backward's recomputation of the normalised input (fp32 only) */
            lm_cuda_attnres_norm rn = {nwd + (size_t)l * d, 1e-5f, rec + (size_t)l * nd, NULL, rrs};
            STEP_OK(lm_cuda_attnres_recompute_input_norm(&ctx, &st, l, &rn));
            lm_cuda_attnres_norm_grad ng = {nwd + (size_t)l * d, rs + (size_t)l * n, dxd + (size_t)l * nd,
                                            dnw + (size_t)l * d};
            const int plain = variant == 2 && (l % S == 0 || (S >= 3 && l % S == S - 2));
            if (plain)
                STEP_OK(lm_cuda_attnres_input_backward(&ctx, &st, l, &prm, dhd + (size_t)l * nd, &g));
            else
                STEP_OK(lm_cuda_attnres_input_norm_backward(&ctx, &st, l, &prm, &ng, &g));
            /* a mid-block sublayer of a block after the first keeps its terms (with the norm); a
             * call that does not defer adds what waits */
            if (plain || l % S == 0) expect_mask = 0;
            else if (defer && l / S > 0) expect_mask = 1;
            CHECK((st.defer_mask != 0) == expect_mask, "%s: sublayer %d leaves the deferred mask %#llx", name, l,
                  (unsigned long long)st.defer_mask);
        }
        STEP_OK(lm_cuda_attnres_embedding_backward(&ctx, &st, demb));
        STEP_OK(lm_cuda_context_sync(&ctx));
        xn_g[run] = mallocCheck((size_t)L * nd * 4);
        rs_g[run] = mallocCheck((size_t)L * n * 4);
        rec_g[run] = mallocCheck((size_t)L * nd * 4);
        dnw_g[run] = mallocCheck(ld * 4);
        gq_g[run] = mallocCheck(p.pd * 4);
        gk_g[run] = mallocCheck(p.pd * 4);
        demb_g[run] = mallocCheck(nd * 4);
        xb_g[run] = mallocCheck((size_t)L * nd * 2);
        dev_download(xn_g[run], xn, (size_t)L * nd);
        dev_download(rs_g[run], rs, (size_t)L * n);
        dev_download(rec_g[run], rec, (size_t)L * nd);
        dev_download(dnw_g[run], dnw, ld);
        dev_download(gq_g[run], gq, p.pd);
        dev_download(gk_g[run], gk, p.pd);
        dev_download(demb_g[run], demb, nd);
        if (lm_cuda_download(xb_g[run], xb, (size_t)L * nd * 2) != LM_OK) dieAt("download: %s", lm_last_error());
        float *bufs[] = {emb, y, dhf, q, k, gq, gk, dnw, nwd, dxd, demb, hfd, xn, rs, rec, rrs, (float *)xb, dhd};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) lm_cuda_free(bufs[i]);
        lm_cuda_free(ws);
    }
    if (ok) {
        const double tol = 2e-5;
        double e, worst = 0;
        const double es[] = {increment_error(xn_g[0], xn_c, NULL, (size_t)L * nd),
                             increment_error(rs_g[0], rs_c, NULL, (size_t)L * n),
                             increment_error(rec_g[0], xn_c, NULL, (size_t)L * nd),
                             increment_error(dy_g[0], dy_c, NULL, (size_t)L * nd),
                             increment_error(demb_g[0], demb_c, p.demb0, nd),
                             increment_error(gq_g[0], gq_c, p.gq0, p.pd),
                             increment_error(gk_g[0], gk_c, p.gk0, p.pd),
                             increment_error(dnw_g[0], dnw_c, dnw0, ld)};
        static const char *const what[] = {"xn", "1/rms", "recomputed xn", "output gradients", "d embedding",
                                           "d query", "d key_norm", "d norm weight"};
        for (int i = 0; i < 8 && variant != 2; i++) {
            e = es[i];
            CHECK(e <= tol, "%s: %s relative error %.3g (bound %.0e)", name, what[i], e, tol);
            worst = fmax(worst, e);
        }
        size_t bad = 0;
        for (size_t i = 0; i < (size_t)L * nd; i++) bad += xb_g[0][i] != lm_f32_to_bf16(xn_g[0][i]);
        CHECK(bad == 0, "%s: %zu bf16 xn values are not the fp32 xn rounded", name, bad);
        CHECK(increment_error(dnw_c, dnw0, NULL, ld) > 0, "%s: the norm weights' gradient did not change", name);
        CHECK(!memcmp(xn_g[0], xn_g[1], (size_t)L * nd * 4) && !memcmp(rs_g[0], rs_g[1], (size_t)L * n * 4) &&
                  !memcmp(dy_g[0], dy_g[1], (size_t)L * nd * 4) && !memcmp(dnw_g[0], dnw_g[1], ld * 4) &&
                  !memcmp(gq_g[0], gq_g[1], p.pd * 4) && !memcmp(gk_g[0], gk_g[1], p.pd * 4) &&
                  !memcmp(demb_g[0], demb_g[1], nd * 4) && !memcmp(lp_g[0], lp_g[1], (size_t)L * nd * 2),
              "%s: the input with its norm differs between two runs", name);
        if (variant == 2)
            printf("  %s, input with its norm: the direct run's bits\n", name);
        else
            printf("  %s, input with its norm: worst relative error %.3g%s\n", name, worst,
                   variant ? "; the direct run's bits" : "");
    } else {
        CHECK(0, "%s: a call failed", name);
    }
    for (int run = 0; run < 2; run++) {
        free(xn_g[run]), free(rs_g[run]), free(rec_g[run]), free(dnw_g[run]), free(dy_g[run]);
        free(gq_g[run]), free(gk_g[run]), free(demb_g[run]), free(xb_g[run]), free(lp_g[run]);
    }
    free(nw), free(dxn), free(dnw0), free(xn_c), free(rs_c), free(dnw_c), free(dy_c), free(dh), free(hs);
    free(hf), free(gq_c), free(gk_c), free(demb_c), free(dh_all);
    free_problem(&p);
    lm_cuda_attnres_set_deferred(0);
}

static void norm_case(lm_attnres_mode mode, int S, int L, int64_t n, int d, uint64_t seed) {
    norm_case_variant(mode, S, L, n, d, seed, 0);
}

static void test_deferred_backward_gives_the_direct_bits(void) {
    /* one to seven deferred positions a block, two to four blocks, 1 to 5 sources; rows of 24 to
     * 256 floats a thread group; a last block of 8 tokens short */
    norm_case_variant(LM_ATTNRES_BLOCK, 3, 8, 37, 96, 51, 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 4, 10, 70, 1024, 52, 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 8, 32, 45, 1024, 53, 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 2, 5, 2051, 1024, 54, 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 3, 7, 4099, 256, 55, 1);
    /* six blocks: a block's first sublayer adds the terms of 5 and 6 closed sources */
    norm_case_variant(LM_ATTNRES_BLOCK, 2, 11, 37, 64, 58, 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 3, 16, 21, 1024, 59, 1);
    /* the block's first sublayer stages the deferred dh rows in shared memory: at most two (the
     * rest read directly: both paths in one sum) and none give the same bits */
    setenv("LONGMOE_ATTNRES_DEFER_STAGE", "2", 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 4, 10, 70, 1024, 60, 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 8, 24, 45, 256, 61, 1);
    setenv("LONGMOE_ATTNRES_DEFER_STAGE", "0", 1);
    norm_case_variant(LM_ATTNRES_BLOCK, 4, 10, 70, 1024, 62, 1);
    unsetenv("LONGMOE_ATTNRES_DEFER_STAGE");
    /* the block's first sublayer without the norm: the generic kernel adds the deferred terms */
    norm_case_variant(LM_ATTNRES_BLOCK, 4, 10, 70, 128, 56, 2);
    norm_case_variant(LM_ATTNRES_BLOCK, 3, 8, 37, 100, 57, 2);
    /* where it does not apply, nothing is planned: one block, a second block of one sublayer,
     * Full AttnRes, a block of one */
    const lm_attnres_config none[] = {{LM_ATTNRES_BLOCK, 8, 8, 64, 10, 1e-6f, 0, 0},
                                      {LM_ATTNRES_BLOCK, 9, 8, 64, 10, 1e-6f, 0, 0},
                                      {LM_ATTNRES_FULL, 6, 1, 64, 10, 1e-6f, 0, 0},
                                      {LM_ATTNRES_BLOCK, 6, 1, 64, 10, 1e-6f, 0, 0}};
    CHECK(lm_cuda_attnres_set_deferred(1) == LM_OK, "set");
    for (int i = 0; i < 4; i++) {
        lm_attnres_memory_plan pl;
        CHECK(lm_cuda_attnres_memory(&none[i], &pl) == LM_OK && pl.deferred == 0,
              "case %d: deferred terms planned where they do not apply", i);
    }
    /* the plan: S - 1 rows of [n, d] and of 3N coefficients, each rounded up to 64 bytes, and nothing else */
    {
        const lm_attnres_config c = {LM_ATTNRES_BLOCK, 12, 4, 96, 333, 1e-6f, 0, 0};
        lm_attnres_memory_plan on, off;
        CHECK(lm_cuda_attnres_memory(&c, &on) == LM_OK, "plan");
        CHECK(lm_cuda_attnres_set_deferred(0) == LM_OK && lm_cuda_attnres_memory(&c, &off) == LM_OK, "plan");
        const size_t want = (3 * 333 * 96 * 4 + 63) / 64 * 64 + (3 * 333 * 3 * 3 * 4 + 63) / 64 * 64;
        CHECK(on.deferred == want && off.deferred == 0 && on.total == off.total + want,
              "deferred terms planned %zu bytes (want %zu), totals %zu and %zu", on.deferred, want, on.total,
              off.total);
        CHECK(on.total_bytes_per_token - off.total_bytes_per_token == 3.0 * (96 + 3 * 3) * 4,
              "per token: %.1f bytes more", on.total_bytes_per_token - off.total_bytes_per_token);
        CHECK(lm_cuda_attnres_set_deferred(1) == LM_OK, "set");
    }
    CHECK(lm_cuda_attnres_set_deferred(2) == LM_ERR_ARG && lm_cuda_attnres_deferred() == 1, "2 accepted");
    CHECK(strstr(lm_last_error(), "deferred") != NULL, "message: %s", lm_last_error());
    lm_cuda_attnres_set_deferred(0);
}

static void test_input_with_its_norm_matches_the_cpu(void) {
    norm_case(LM_ATTNRES_BLOCK, 3, 8, 37, 96, 41);
    norm_case(LM_ATTNRES_BLOCK, 4, 10, 70, 1024, 42);
    norm_case(LM_ATTNRES_FULL, 1, 6, 29, 100, 43);
    norm_case(LM_ATTNRES_BLOCK, 8, 12, 50, 256, 44);
    /* more rows than the device holds blocks at once, and the backward's last block of 8 tokens
     * short */
    norm_case(LM_ATTNRES_BLOCK, 2, 5, 2051, 1024, 45);
    norm_case(LM_ATTNRES_BLOCK, 3, 7, 4099, 256, 46);
    /* what cannot take it is said so */
    lm_attnres_config wide = {LM_ATTNRES_BLOCK, 8, 4, 2048, 10, 1e-6f, 0, 0};
    lm_attnres_config many = {LM_ATTNRES_FULL, 12, 1, 64, 10, 1e-6f, 0, 0};
    lm_attnres_config standard = {LM_ATTNRES_STANDARD, 8, 4, 64, 10, 1e-6f, 0, 0};
    CHECK(!lm_cuda_attnres_norm_fusable(&wide) && !lm_cuda_attnres_norm_fusable(&many) &&
              !lm_cuda_attnres_norm_fusable(&standard),
          "a width over 1024, more than 8 sources or the standard residual taken as fusable");
}

static void test_memory_plan_matches_cpu_buffers(void) {
    /* the GPU keeps the CPU's history, gradients, partials and scores; no two-phase buffers */
    const lm_attnres_mode modes[] = {LM_ATTNRES_STANDARD, LM_ATTNRES_BLOCK, LM_ATTNRES_FULL};
    for (int m = 0; m < 3; m++)
        for (int S = 1; S <= 5; S++) {
            lm_attnres_config c = {modes[m], 12, S, 96, 333, 1e-6f, 1, 0};
            lm_attnres_memory_plan a, b;
            CHECK(lm_attnres_memory(&c, &a) == LM_OK && lm_cuda_attnres_memory(&c, &b) == LM_OK, "plans");
            /* the GPU's gradient part also holds the bf16 copy of the next output gradient [n,d] */
            const size_t lp = modes[m] == LM_ATTNRES_STANDARD ? 0 : ((size_t)333 * 96 * 2 + 63) / 64 * 64;
            CHECK(a.history == b.history && a.history_grad + lp == b.history_grad &&
                      a.saved_partials == b.saved_partials && a.saved_scores == b.saved_scores &&
                      a.n_blocks == b.n_blocks && a.n_history_sources == b.n_history_sources,
                  "mode %d S %d: shared buffers differ", (int)modes[m], S);
            CHECK(b.phase1 == 0 && b.queries == 0, "mode %d S %d: two-phase buffers planned", (int)modes[m], S);
        }
    lm_attnres_config bad = {LM_ATTNRES_BLOCK, 8, 0, 64, 10, 1e-6f, 0, 0};
    lm_attnres_memory_plan pl;
    CHECK(lm_cuda_attnres_memory(&bad, &pl) == LM_ERR_ARG, "block_size 0 accepted");
    CHECK(strstr(lm_last_error(), "block_size") != NULL, "message: %s", lm_last_error());
}

/* lm_cuda_attnres_add_output_note finds the first non-finite value of each
 * output: NaN, +Inf and -Inf planted at random places (several in one output,
 * two in one group of four, at the start, in the middle, the last element
 * alone), in the block's
 * first sublayer (the open sum assigned) and later ones (added), float4 rows
 * and one float a thread (d = 98), block and standard residuals; nothing noted
 * for a finite output, the slot's smaller value kept, and a NULL slot refused. */
static void note_case(lm_attnres_mode mode, int d, int64_t n, uint64_t seed) {
    const int L = 7;
    lm_attnres_config c = {mode, L, 2, d, n, 1e-6f, 0, 0};
    lm_attnres_memory_plan plan;
    CHECK(lm_cuda_attnres_memory(&c, &plan) == LM_OK, "plan: %s", lm_last_error());
    const size_t nd = (size_t)n * d, pd = (size_t)(L + 1) * d;
    void *ws = NULL;
    float *y = NULL, *h = NULL, *prm = NULL;
    unsigned long long *slot = NULL;
    CHECK(lm_cuda_alloc(&ws, plan.total) == LM_OK && lm_cuda_alloc((void **)&y, nd * 4) == LM_OK &&
              lm_cuda_alloc((void **)&h, nd * 4) == LM_OK && lm_cuda_alloc((void **)&prm, 2 * pd * 4) == LM_OK &&
              lm_cuda_alloc((void **)&slot, 8) == LM_OK,
          "alloc");
    lm_cuda_attnres_state st;
    CHECK(lm_cuda_attnres_init(&st, &c, ws, plan.total) == LM_OK, "init: %s", lm_last_error());
    lm_rng r;
    lm_rng_seed(&r, seed);
    float *hy = mallocCheck(nd * 4), *hp = mallocCheck(2 * pd * 4);
    fill_normal(hp, 2 * pd, &r, 0.1, 1.0, 0);
    fill_normal(hy, nd, &r, 1.0, 0.0, 0);
    lm_attnres_params p = {prm, prm + pd};
    CHECK(lm_cuda_upload(prm, hp, 2 * pd * 4) == LM_OK && lm_cuda_upload(y, hy, nd * 4) == LM_OK, "upload");
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "uploads");
    CHECK(lm_cuda_attnres_begin(&ctx, &st, y) == LM_OK && lm_cuda_context_sync(&ctx) == LM_OK, "begin: %s",
          lm_last_error());
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int l = 0; l < L; l++) {
        CHECK(lm_cuda_attnres_input(&ctx, &st, l, &p, h) == LM_OK, "input %d: %s", l, lm_last_error());
        fill_normal(hy, nd, &r, 1.0, 0.0, 0);
        /* l = 0: finite; 1: one at element 0; 2: three at random places; 3: the last element
         * alone; 4: one in the middle, the slot holding a larger value; 5: the same, the slot
         * holding a smaller one (kept); 6: two in one group of four, at 4q + 3 and 4q + 1 (the
         * lower one wins inside a thread's float4 too) */
        unsigned long long want = ~0ull, start = ~0ull;
        size_t at[3];
        const int k = l == 0 ? 0 : l == 2 ? 3 : l == 6 ? 2 : 1;
        for (int i = 0; i < k; i++) at[i] = (size_t)(lm_rng_u64(&r) % nd);
        if (l == 1) at[0] = 0;
        if (l == 3) at[0] = nd - 1;
        if (l == 4) at[0] = nd / 2, start = nd / 2 + 1;
        if (l == 5) at[0] = nd / 2, start = nd / 3;
        if (l == 6) {
            const size_t q = (size_t)(lm_rng_u64(&r) % (nd / 4));
            at[0] = 4 * q + 3, at[1] = 4 * q + 1;
        }
        for (int i = 0; i < k; i++) {
            hy[at[i]] = bad[(l + i) % 3];
            if (at[i] < want) want = at[i];
        }
        if (start < want) want = start;
        CHECK(lm_cuda_upload(y, hy, nd * 4) == LM_OK && lm_cuda_upload(slot, &start, 8) == LM_OK, "upload");
        CHECK(cudaDeviceSynchronize() == cudaSuccess, "uploads");
        if (l == 0) {
            CHECK(lm_cuda_attnres_add_output_note(&ctx, &st, 0, y, NULL) == LM_ERR_ARG, "NULL slot accepted");
            CHECK(strstr(lm_last_error(), "first_nonfinite") != NULL, "message: %s", lm_last_error());
        }
        CHECK(lm_cuda_attnres_add_output_note(&ctx, &st, l, y, slot) == LM_OK, "add %d: %s", l, lm_last_error());
        unsigned long long got = 0;
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK && lm_cuda_download(&got, slot, 8) == LM_OK, "download");
        CHECK(got == want, "%s d=%d n=%lld output %d: noted %llu, want %llu", lm_attnres_mode_name(mode), d,
              (long long)n, l, got, want);
    }
    free(hy);
    free(hp);
    lm_cuda_free(ws);
    lm_cuda_free(y);
    lm_cuda_free(h);
    lm_cuda_free(prm);
    lm_cuda_free(slot);
}

static void test_add_output_note_finds_the_first_nonfinite_value(void) {
    note_case(LM_ATTNRES_BLOCK, 64, 37, 8800);
    note_case(LM_ATTNRES_BLOCK, 1024, 300, 8801);
    note_case(LM_ATTNRES_BLOCK, 98, 41, 8802);
    note_case(LM_ATTNRES_STANDARD, 256, 53, 8803);
}

static void test_calls_out_of_order_are_refused(void) {
    lm_attnres_config c = {LM_ATTNRES_BLOCK, 4, 2, 64, 5, 1e-6f, 0, 0};
    lm_attnres_memory_plan plan;
    CHECK(lm_cuda_attnres_memory(&c, &plan) == LM_OK, "plan");
    void *ws = NULL, *buf = NULL, *prm = NULL;
    CHECK(lm_cuda_alloc(&ws, plan.total) == LM_OK && lm_cuda_alloc(&buf, 5 * 64 * 4) == LM_OK &&
              lm_cuda_alloc(&prm, 2 * 5 * 64 * 4) == LM_OK,
          "alloc");
    lm_cuda_attnres_state st;
    CHECK(lm_cuda_attnres_init(&st, &c, ws, plan.total - 64) == LM_ERR_ARG, "short workspace accepted");
    CHECK(lm_cuda_attnres_init(&st, &c, ws, plan.total) == LM_OK, "init: %s", lm_last_error());
    CHECK(cudaDeviceSynchronize() == cudaSuccess, "allocations");
    float *x = (float *)buf;
    lm_attnres_params p = {(float *)prm, (float *)prm + 5 * 64}, none = {NULL, NULL};
    CHECK(lm_cuda_attnres_input(&ctx, &st, 0, &p, x) == LM_ERR_ARG, "input before begin");
    CHECK(strstr(lm_last_error(), "lm_cuda_attnres_begin") != NULL, "message: %s", lm_last_error());
    CHECK(lm_cuda_attnres_begin(&ctx, &st, x) == LM_OK, "begin");
    CHECK(lm_cuda_attnres_add_output(&ctx, &st, 0, x) == LM_ERR_ARG, "add_output before input");
    CHECK(strstr(lm_last_error(), "lm_cuda_attnres_input(l = 0)") != NULL, "message: %s", lm_last_error());
    CHECK(lm_cuda_attnres_input(&ctx, &st, 0, &none, x) == LM_ERR_ARG, "NULL params");
    CHECK(lm_cuda_attnres_input(&ctx, &st, 0, &p, x) == LM_OK, "input 0");
    CHECK(lm_cuda_attnres_final(&ctx, &st, &p, x) == LM_ERR_ARG, "final too early");
    CHECK(lm_cuda_attnres_final_backward(&ctx, &st, &p, x, NULL) == LM_ERR_ARG, "backward too early");
    CHECK(lm_cuda_attnres_recompute_input(&ctx, &st, 1, x) == LM_ERR_ARG, "recompute of a layer not run yet");
    CHECK(lm_cuda_attnres_recompute_input(&ctx, &st, 0, x) == LM_OK, "recompute of layer 0");
    CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "sync: %s", lm_last_error());
    lm_cuda_free(ws);
    lm_cuda_free(buf);
    lm_cuda_free(prm);
}

int main(void) {
    test_skip_without_cuda();
    if (!test_skip_all_reason && lm_cuda_context_create(&ctx) != LM_OK) {
        fprintf(stderr, "no usable CUDA device: %s\n", lm_last_error());
        return 1;
    }
    RUN(test_memory_plan_matches_cpu_buffers);
    RUN(test_calls_out_of_order_are_refused);
    RUN(test_replayed_blocks_give_the_same_backward);
    RUN(test_register_forward_equals_generic_bitwise);
    RUN(test_block_modes_match_cpu_and_repeat_bitwise);
    RUN(test_full_mode_matches_cpu_and_repeats_bitwise);
    RUN(test_standard_mode_matches_cpu_and_repeats_bitwise);
    RUN(test_input_with_its_norm_matches_the_cpu);
    RUN(test_deferred_backward_gives_the_direct_bits);
    RUN(test_add_output_note_finds_the_first_nonfinite_value);
    printf("worst relative error over all cases: %.3g (bound %.0e)\n", worst_error, TOL);
    lm_cuda_context_destroy(&ctx);
    return test_summary();
}
