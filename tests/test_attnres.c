/* Block Attention Residuals (SPEC §5): the two-phase form equals the direct
 * form; forward against a float64 reference built from the definition;
 * backward against float64 central differences (free sublayer outputs, and a
 * chain of real sublayers y_l = tanh(M_l h_l)); the special cases (zero
 * queries, standard, full); the memory plan; call order and bad configs. */
#include <omp.h>
#include <stdint.h>

#include "longmoe/attnres.h"
#include "longmoe/linear.h"
#include "test.h"

static void fill(lm_rng *r, float *x, size_t n, double scale, double shift) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(shift + scale * lm_rng_normal(r));
}

static lm_attnres_config make_cfg(lm_attnres_mode mode, int L, int S, int d, int64_t n, int two_phase) {
    lm_attnres_config c = {mode, L, S, d, n, 1e-6f, two_phase, 0};
    return c;
}

/* A state over a malloc'd workspace of exactly the planned size (ASan sees overruns). */
static void *make_state(lm_attnres_state *st, const lm_attnres_config *c) {
    lm_attnres_memory_plan plan;
    CHECK(lm_attnres_memory(c, &plan) == LM_OK, "%s", lm_last_error());
    void *ws = malloc(plan.total);
    CHECK(lm_attnres_init(st, c, ws, plan.total) == LM_OK, "%s", lm_last_error());
    return ws;
}

/* hs [(L+1),n,d]: the input of every sublayer, then the final AttnRes; the
 * sublayer outputs ys [L,n,d] are free inputs. */
static void module_forward(lm_attnres_state *st, const float *emb, const float *ys,
                           const lm_attnres_params *p, float *hs) {
    const int L = st->cfg.n_sublayers;
    const size_t nd = (size_t)st->cfg.n_tokens * st->cfg.d;
    CHECK(lm_attnres_begin(st, emb) == LM_OK, "%s", lm_last_error());
    for (int l = 0; l < L; l++) {
        CHECK(lm_attnres_input(st, l, p, hs + l * nd) == LM_OK, "%s", lm_last_error());
        CHECK(lm_attnres_add_output(st, l, ys + l * nd) == LM_OK, "%s", lm_last_error());
    }
    CHECK(lm_attnres_final(st, p, hs + L * nd) == LM_OK, "%s", lm_last_error());
}

/* dhs [(L+1),n,d] are the upstream gradients; dys, demb, g accumulate. */
static void module_backward(lm_attnres_state *st, const lm_attnres_params *p, const float *dhs,
                            float *dys, float *demb, lm_attnres_grads *g) {
    const int L = st->cfg.n_sublayers;
    const size_t nd = (size_t)st->cfg.n_tokens * st->cfg.d;
    CHECK(lm_attnres_final_backward(st, p, dhs + L * nd, g) == LM_OK, "%s", lm_last_error());
    for (int l = L - 1; l >= 0; l--) {
        CHECK(lm_attnres_output_backward(st, l, dys + l * nd) == LM_OK, "%s", lm_last_error());
        CHECK(lm_attnres_input_backward(st, l, p, dhs + l * nd, g) == LM_OK, "%s", lm_last_error());
    }
    CHECK(lm_attnres_embedding_backward(st, demb) == LM_OK, "%s", lm_last_error());
}

/* ---- float64 reference, straight from the definition ---- */

/* Sources of layer l (l = L: final) for token t into src [*, d]; returns their count. */
static int ref_sources(const lm_attnres_config *c, int l, int64_t t, const double *emb, const double *ys,
                       double *src) {
    const int L = c->n_sublayers, d = c->d;
    const int64_t n = c->n_tokens;
    const int S = c->mode == LM_ATTNRES_FULL ? 1 : c->block_size;
    int ns = 0;
    for (int k = 0; k < d; k++) src[k] = emb[t * d + k];
    ns = 1;
    int full_blocks = l == L ? (L + S - 1) / S : l / S;
    for (int b = 0; b < full_blocks; b++, ns++) {
        double *v = src + (size_t)ns * d;
        for (int k = 0; k < d; k++) v[k] = 0;
        for (int j = b * S; j < (b + 1) * S && j < L; j++)
            for (int k = 0; k < d; k++) v[k] += ys[((size_t)j * n + t) * d + k];
    }
    if (l < L && l % S > 0) {
        double *v = src + (size_t)ns * d;
        for (int k = 0; k < d; k++) v[k] = 0;
        for (int j = (l / S) * S; j < l; j++)
            for (int k = 0; k < d; k++) v[k] += ys[((size_t)j * n + t) * d + k];
        ns++;
    }
    return ns;
}

static void ref_layer(const lm_attnres_config *c, int l, int64_t t, const double *emb, const double *ys,
                      const double *w, const double *g, double *h) {
    const int L = c->n_sublayers, d = c->d;
    const int64_t n = c->n_tokens;
    if (c->mode == LM_ATTNRES_STANDARD) {
        for (int k = 0; k < d; k++) {
            h[k] = emb[t * d + k];
            for (int j = 0; j < l; j++) h[k] += ys[((size_t)j * n + t) * d + k];
        }
        return;
    }
    double *src = malloc(sizeof(double) * (size_t)(L + 2) * d), s[L + 2], m = -INFINITY, Z = 0;
    int ns = ref_sources(c, l, t, emb, ys, src);
    for (int i = 0; i < ns; i++) {
        const double *v = src + (size_t)i * d;
        double ss = 0, dot = 0;
        for (int k = 0; k < d; k++) ss += v[k] * v[k];
        double r = 1.0 / sqrt(ss / d + (double)c->eps);
        for (int k = 0; k < d; k++) dot += w[(size_t)l * d + k] * g[(size_t)l * d + k] * v[k] * r;
        s[i] = dot;
        if (dot > m) m = dot;
    }
    for (int i = 0; i < ns; i++) Z += exp(s[i] - m);
    for (int k = 0; k < d; k++) h[k] = 0;
    for (int i = 0; i < ns; i++)
        for (int k = 0; k < d; k++) h[k] += exp(s[i] - m) / Z * src[(size_t)i * d + k];
    free(src);
}

static void ref_forward(const lm_attnres_config *c, const double *emb, const double *ys, const double *w,
                        const double *g, double *hs) {
    const size_t nd = (size_t)c->n_tokens * c->d;
    for (int l = 0; l <= c->n_sublayers; l++)
        for (int64_t t = 0; t < c->n_tokens; t++) ref_layer(c, l, t, emb, ys, w, g, hs + l * nd + t * c->d);
}

static double *to_double(const float *x, size_t n) {
    double *y = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}

/* Random problem: embedding, sublayer outputs, non-zero queries, key norms near 1. */
typedef struct {
    float *emb, *ys, *w, *g;
} problem;

static problem make_problem(lm_rng *r, const lm_attnres_config *c, double qscale) {
    const size_t nd = (size_t)c->n_tokens * c->d, L = (size_t)c->n_sublayers, d = (size_t)c->d;
    problem p = {malloc(nd * 4), malloc(L * nd * 4), malloc((L + 1) * d * 4), malloc((L + 1) * d * 4)};
    fill(r, p.emb, nd, 1, 0);
    /* outputs of different scales, like sublayers of a real model */
    for (size_t l = 0; l < L; l++) fill(r, p.ys + l * nd, nd, 0.3 + 0.4 * (double)(l % 3), 0);
    fill(r, p.w, (L + 1) * d, qscale, 0);
    fill(r, p.g, (L + 1) * d, 0.3, 1.0);
    return p;
}

static void free_problem(problem *p) {
    free(p->emb);
    free(p->ys);
    free(p->w);
    free(p->g);
}

/* ---- tests ---- */

static void test_two_phase_equals_direct(void) {
    lm_rng r;
    lm_rng_seed(&r, 101);
    /* complete and incomplete last blocks, a block larger than the model, full */
    const int Ls[] = {8, 8, 7, 5, 6}, Ss[] = {4, 3, 3, 9, 1};
    for (int cse = 0; cse < 5; cse++) {
        const int L = Ls[cse], S = Ss[cse], d = 24;
        const int64_t n = 9;
        lm_attnres_config c1 = make_cfg(LM_ATTNRES_BLOCK, L, S, d, n, 0), c2 = c1;
        c2.two_phase = 1;
        problem pr = make_problem(&r, &c1, 1.0);
        lm_attnres_params p = {pr.w, pr.g};
        const size_t nd = (size_t)n * d;
        float *h1 = malloc((L + 1) * nd * 4), *h2 = malloc((L + 1) * nd * 4);
        lm_attnres_state s1, s2;
        void *w1 = make_state(&s1, &c1), *w2 = make_state(&s2, &c2);
        module_forward(&s1, pr.emb, pr.ys, &p, h1);
        module_forward(&s2, pr.emb, pr.ys, &p, h2);
        double *h1d = to_double(h1, (L + 1) * nd);
        for (int l = 0; l <= L; l++) {
            double e = test_rel_error_f(h2 + l * nd, h1d + l * nd, nd);
            CHECK(e < 2e-6, "L=%d S=%d layer %d: two-phase vs direct rel error %.3g", L, S, l, e);
        }
        /* and the weights each form reports agree */
        int ns = lm_attnres_n_sources(&s1, L - 1);
        float *a1 = malloc(n * ns * 4), *a2 = malloc(n * ns * 4);
        CHECK(lm_attnres_weights(&s1, L - 1, a1) == LM_OK && lm_attnres_weights(&s2, L - 1, a2) == LM_OK,
              "%s", lm_last_error());
        for (int64_t i = 0; i < n * ns; i++) CHECK_CLOSE(a2[i], a1[i], 1e-6, 1e-5, "softmax weight");
        free(a1), free(a2), free(h1d), free(h1), free(h2), free(w1), free(w2);
        free_problem(&pr);
    }
}

static void test_forward_matches_float64_reference(void) {
    lm_rng r;
    lm_rng_seed(&r, 102);
    struct { lm_attnres_mode m; int L, S; } cases[] = {
        {LM_ATTNRES_BLOCK, 9, 4}, {LM_ATTNRES_BLOCK, 8, 2}, {LM_ATTNRES_BLOCK, 6, 6},
        {LM_ATTNRES_BLOCK, 5, 7}, {LM_ATTNRES_FULL, 7, 0}, {LM_ATTNRES_STANDARD, 7, 0}};
    for (int cse = 0; cse < 6; cse++)
        for (int tp = 0; tp < 2; tp++) {
            const int d = 16;
            const int64_t n = 7;
            lm_attnres_config c = make_cfg(cases[cse].m, cases[cse].L, cases[cse].S, d, n, tp);
            const int L = c.n_sublayers;
            const size_t nd = (size_t)n * d;
            problem pr = make_problem(&r, &c, 1.5);
            lm_attnres_params p = {pr.w, pr.g};
            float *h = malloc((L + 1) * nd * 4);
            double *hr = malloc((L + 1) * nd * 8);
            lm_attnres_state st;
            void *ws = make_state(&st, &c);
            module_forward(&st, pr.emb, pr.ys, &p, h);
            double *emb = to_double(pr.emb, nd), *ys = to_double(pr.ys, L * nd);
            double *w = to_double(pr.w, (L + 1) * d), *g = to_double(pr.g, (L + 1) * d);
            ref_forward(&c, emb, ys, w, g, hr);
            for (int l = 0; l <= L; l++) {
                double e = test_rel_error_f(h + l * nd, hr + l * nd, nd);
                CHECK(e < 3e-6, "%s L=%d S=%d two_phase=%d layer %d: rel error %.3g vs float64",
                      lm_attnres_mode_name(c.mode), L, c.block_size, tp, l, e);
            }
            free(emb), free(ys), free(w), free(g), free(h), free(hr), free(ws);
            free_problem(&pr);
        }
}

/* Central differences of loss = sum_l <h_l, G_l> (final included) on the
 * float64 reference, against the module's fp32 backward, for every input. */
static void check_backward(lm_attnres_config c, uint64_t seed) {
    lm_rng r;
    lm_rng_seed(&r, seed);
    const int L = c.n_sublayers, d = c.d;
    const int64_t n = c.n_tokens;
    const size_t nd = (size_t)n * d;
    problem pr = make_problem(&r, &c, 1.0);
    lm_attnres_params p = {pr.w, pr.g};
    float *G = malloc((L + 1) * nd * 4), *h = malloc((L + 1) * nd * 4);
    fill(&r, G, (L + 1) * nd, 1, 0);
    /* gradients start non-zero: the backward must accumulate, not overwrite */
    const size_t sizes[4] = {nd, L * nd, (L + 1) * (size_t)d, (L + 1) * (size_t)d};
    float *grad[4], *base[4];
    for (int k = 0; k < 4; k++) {
        grad[k] = malloc(sizes[k] * 4);
        base[k] = malloc(sizes[k] * 4);
        fill(&r, base[k], sizes[k], 1, 0);
        memcpy(grad[k], base[k], sizes[k] * 4);
    }
    lm_attnres_state st;
    void *ws = make_state(&st, &c);
    module_forward(&st, pr.emb, pr.ys, &p, h);
    lm_attnres_grads gr = {grad[2], grad[3]};
    module_backward(&st, &p, G, grad[1], grad[0], &gr);

    double *x[4] = {to_double(pr.emb, sizes[0]), to_double(pr.ys, sizes[1]), to_double(pr.w, sizes[2]),
                    to_double(pr.g, sizes[3])};
    double *hr = malloc((L + 1) * nd * 8);
    const char *names[4] = {"d embedding", "d sublayer output", "d query", "d key-norm weight"};
    int checked = 0;
    for (int k = 0; k < 4; k++) {
        if (c.mode == LM_ATTNRES_STANDARD && k >= 2) continue; /* no parameters */
        for (size_t i = 0; i < sizes[k]; i++) {
            const double keep = x[k][i], eps = 1e-5;
            double lp = 0, lm = 0;
            x[k][i] = keep + eps;
            ref_forward(&c, x[0], x[1], x[2], x[3], hr);
            for (size_t j = 0; j < (L + 1) * nd; j++) lp += hr[j] * G[j];
            x[k][i] = keep - eps;
            ref_forward(&c, x[0], x[1], x[2], x[3], hr);
            for (size_t j = 0; j < (L + 1) * nd; j++) lm += hr[j] * G[j];
            x[k][i] = keep;
            double fd = (lp - lm) / (2 * eps);
            double got = (double)grad[k][i] - base[k][i];
            CHECK(fabs(got - fd) <= 2e-4 + 1e-3 * fabs(fd), "%s L=%d S=%d two_phase=%d: %s[%zu] = %.7g, "
                  "finite differences %.7g", lm_attnres_mode_name(c.mode), L, c.block_size, c.two_phase,
                  names[k], i, got, fd);
            checked++;
        }
    }
    CHECK(checked > 0, "nothing checked");
    for (int k = 0; k < 4; k++) free(grad[k]), free(base[k]), free(x[k]);
    free(G), free(h), free(hr), free(ws);
    free_problem(&pr);
}

static void test_backward_matches_finite_differences(void) {
    check_backward(make_cfg(LM_ATTNRES_BLOCK, 7, 3, 6, 3, 0), 201);
    check_backward(make_cfg(LM_ATTNRES_BLOCK, 7, 3, 6, 3, 1), 202);
    check_backward(make_cfg(LM_ATTNRES_BLOCK, 8, 2, 5, 2, 1), 203);
    check_backward(make_cfg(LM_ATTNRES_BLOCK, 4, 6, 5, 2, 0), 204);
    check_backward(make_cfg(LM_ATTNRES_FULL, 5, 0, 5, 2, 1), 205);
    check_backward(make_cfg(LM_ATTNRES_STANDARD, 5, 0, 5, 2, 0), 206);
}

/* A chain of real sublayers y_l = tanh(M_l h_l): the model's use of the API,
 * where dy_l depends on the backward of every later sublayer. */
static void chain_ref(const lm_attnres_config *c, const double *emb, const double *M, const double *w,
                      const double *g, double *hs, double *ys) {
    const int L = c->n_sublayers, d = c->d;
    const int64_t n = c->n_tokens;
    const size_t nd = (size_t)n * d;
    for (int l = 0; l <= L; l++)
        for (int64_t t = 0; t < n; t++) {
            double *h = hs + l * nd + t * d;
            ref_layer(c, l, t, emb, ys, w, g, h);
            if (l == L) continue;
            for (int o = 0; o < d; o++) {
                double s = 0;
                for (int k = 0; k < d; k++) s += M[((size_t)l * d + o) * d + k] * h[k];
                ys[l * nd + t * d + o] = tanh(s);
            }
        }
}

static void test_chained_sublayers_gradient_matches_finite_differences(void) {
    lm_rng r;
    lm_rng_seed(&r, 301);
    for (int tp = 0; tp < 2; tp++) {
        lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 6, 4, 5, 3, tp);
        const int L = c.n_sublayers, d = c.d;
        const int64_t n = c.n_tokens;
        const size_t nd = (size_t)n * d, nM = (size_t)L * d * d;
        problem pr = make_problem(&r, &c, 1.0);
        float *M = malloc(nM * 4), *G = malloc((L + 1) * nd * 4);
        fill(&r, M, nM, 0.6, 0);
        fill(&r, G, (L + 1) * nd, 1, 0);
        lm_attnres_params p = {pr.w, pr.g};
        lm_attnres_state st;
        void *ws = make_state(&st, &c);
        /* forward: h = input(l); y = tanh(M h); add_output(y) */
        float *hs = malloc((L + 1) * nd * 4), *ys = malloc(L * nd * 4);
        CHECK(lm_attnres_begin(&st, pr.emb) == LM_OK, "%s", lm_last_error());
        for (int l = 0; l < L; l++) {
            CHECK(lm_attnres_input(&st, l, &p, hs + l * nd) == LM_OK, "%s", lm_last_error());
            for (int64_t t = 0; t < n; t++)
                for (int o = 0; o < d; o++) {
                    float s = 0;
                    for (int k = 0; k < d; k++) s += M[((size_t)l * d + o) * d + k] * hs[l * nd + t * d + k];
                    ys[l * nd + t * d + o] = tanhf(s);
                }
            CHECK(lm_attnres_add_output(&st, l, ys + l * nd) == LM_OK, "%s", lm_last_error());
        }
        CHECK(lm_attnres_final(&st, &p, hs + L * nd) == LM_OK, "%s", lm_last_error());
        /* backward: dy = output_backward(l); dh = M^T (dy (1 - y^2)); input_backward(dh) */
        float *demb = calloc(nd, 4), *dM = calloc(nM, 4), *dw = calloc((L + 1) * d, 4),
              *dg = calloc((L + 1) * d, 4), *dy = malloc(nd * 4), *dh = malloc(nd * 4);
        lm_attnres_grads gr = {dw, dg};
        CHECK(lm_attnres_final_backward(&st, &p, G + L * nd, &gr) == LM_OK, "%s", lm_last_error());
        for (int l = L - 1; l >= 0; l--) {
            memset(dy, 0, nd * 4);
            CHECK(lm_attnres_output_backward(&st, l, dy) == LM_OK, "%s", lm_last_error());
            for (size_t i = 0; i < nd; i++) dh[i] = G[l * nd + i]; /* the loss reads h_l too */
            for (int64_t t = 0; t < n; t++)
                for (int o = 0; o < d; o++) {
                    float y = ys[l * nd + t * d + o], dz = dy[t * d + o] * (1 - y * y);
                    for (int k = 0; k < d; k++) {
                        dh[t * d + k] += M[((size_t)l * d + o) * d + k] * dz;
                        dM[((size_t)l * d + o) * d + k] += dz * hs[l * nd + t * d + k];
                    }
                }
            CHECK(lm_attnres_input_backward(&st, l, &p, dh, &gr) == LM_OK, "%s", lm_last_error());
        }
        CHECK(lm_attnres_embedding_backward(&st, demb) == LM_OK, "%s", lm_last_error());

        const size_t sizes[4] = {nd, nM, (L + 1) * (size_t)d, (L + 1) * (size_t)d};
        double *x[4] = {to_double(pr.emb, nd), to_double(M, nM), to_double(pr.w, sizes[2]),
                        to_double(pr.g, sizes[3])};
        const float *got[4] = {demb, dM, dw, dg};
        const char *names[4] = {"d embedding", "d M", "d query", "d key-norm weight"};
        double *hr = malloc((L + 1) * nd * 8), *yr = malloc(L * nd * 8);
        for (int k = 0; k < 4; k++)
            for (size_t i = 0; i < sizes[k]; i++) {
                const double keep = x[k][i], e = 1e-5;
                double lp = 0, lm = 0;
                x[k][i] = keep + e;
                chain_ref(&c, x[0], x[1], x[2], x[3], hr, yr);
                for (size_t j = 0; j < (L + 1) * nd; j++) lp += hr[j] * G[j];
                x[k][i] = keep - e;
                chain_ref(&c, x[0], x[1], x[2], x[3], hr, yr);
                for (size_t j = 0; j < (L + 1) * nd; j++) lm += hr[j] * G[j];
                x[k][i] = keep;
                double fd = (lp - lm) / (2 * e);
                CHECK(fabs(got[k][i] - fd) <= 3e-4 + 1e-3 * fabs(fd),
                      "two_phase=%d: %s[%zu] = %.7g, finite differences %.7g", tp, names[k], i, got[k][i], fd);
            }
        for (int k = 0; k < 4; k++) free(x[k]);
        free(hr), free(yr), free(demb), free(dM), free(dw), free(dg), free(dy), free(dh);
        free(M), free(G), free(hs), free(ys), free(ws);
        free_problem(&pr);
    }
}

static void test_zero_queries_give_uniform_average_of_sources(void) {
    lm_rng r;
    lm_rng_seed(&r, 401);
    lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 7, 3, 12, 5, 1);
    const int L = c.n_sublayers, d = c.d;
    const int64_t n = c.n_tokens;
    const size_t nd = (size_t)n * d;
    problem pr = make_problem(&r, &c, 1.0);
    memset(pr.w, 0, (L + 1) * d * 4); /* the initialisation of SPEC §5; key norms stay random */
    lm_attnres_params p = {pr.w, pr.g};
    float *h = malloc((L + 1) * nd * 4);
    lm_attnres_state st;
    void *ws = make_state(&st, &c);
    module_forward(&st, pr.emb, pr.ys, &p, h);
    double *emb = to_double(pr.emb, nd), *ys = to_double(pr.ys, L * nd);
    double *src = malloc(sizeof(double) * (L + 2) * d);
    for (int l = 0; l <= L; l++) {
        int ns_mod = lm_attnres_n_sources(&st, l);
        float *a = malloc(n * ns_mod * 4);
        CHECK(lm_attnres_weights(&st, l, a) == LM_OK, "%s", lm_last_error());
        for (int64_t t = 0; t < n; t++) {
            int ns = ref_sources(&c, l, t, emb, ys, src);
            CHECK(ns == ns_mod, "layer %d: %d sources, the definition has %d", l, ns_mod, ns);
            for (int i = 0; i < ns_mod; i++) CHECK_CLOSE(a[t * ns_mod + i], 1.0 / ns, 1e-7, 1e-6, "weight");
            for (int k = 0; k < d; k++) {
                double mean = 0;
                for (int i = 0; i < ns; i++) mean += src[(size_t)i * d + k] / ns;
                CHECK_CLOSE(h[l * nd + t * d + k], mean, 1e-6, 1e-5, "uniform average");
            }
        }
        free(a);
    }
    free(src), free(emb), free(ys), free(h), free(ws);
    free_problem(&pr);
}

static void test_standard_mode_is_the_plain_residual_sum(void) {
    lm_rng r;
    lm_rng_seed(&r, 501);
    lm_attnres_config c = make_cfg(LM_ATTNRES_STANDARD, 6, 0, 10, 4, 0);
    const int L = c.n_sublayers;
    const size_t nd = (size_t)c.n_tokens * c.d;
    problem pr = make_problem(&r, &c, 1.0);
    float *h = malloc((L + 1) * nd * 4), *G = malloc((L + 1) * nd * 4);
    float *dys = calloc(L * nd, 4), *demb = calloc(nd, 4);
    fill(&r, G, (L + 1) * nd, 1, 0);
    lm_attnres_state st;
    void *ws = make_state(&st, &c);
    module_forward(&st, pr.emb, pr.ys, NULL, h); /* no parameters needed */
    module_backward(&st, NULL, G, dys, demb, NULL);
    for (size_t i = 0; i < nd; i++) {
        /* h_l = v_0 + y_0 + ... + y_{l-1}, summed in order: bit-identical */
        float run = pr.emb[i];
        for (int l = 0; l <= L; l++) {
            CHECK(h[l * nd + i] == run, "h_%d[%zu] = %.9g, plain sum %.9g", l, i, h[l * nd + i], run);
            if (l < L) run += pr.ys[l * nd + i];
        }
        /* dy_l = dh_{l+1} + ... + dh_L;  dv_0 = dh_0 + ... + dh_L */
        double acc = G[L * nd + i];
        for (int l = L - 1; l >= 0; l--) {
            CHECK_CLOSE(dys[l * nd + i], acc, 1e-6, 1e-6, "dy_l of the plain residual");
            acc += G[l * nd + i];
        }
        CHECK_CLOSE(demb[i], acc, 1e-6, 1e-6, "d embedding of the plain residual");
    }
    free(h), free(G), free(dys), free(demb), free(ws);
    free_problem(&pr);
}

static void test_full_equals_block_size_one(void) {
    lm_rng r;
    lm_rng_seed(&r, 601);
    for (int tp = 0; tp < 2; tp++) {
        lm_attnres_config cf = make_cfg(LM_ATTNRES_FULL, 6, 0, 8, 5, tp);
        lm_attnres_config cb = make_cfg(LM_ATTNRES_BLOCK, 6, 1, 8, 5, tp);
        const int L = cf.n_sublayers, d = cf.d;
        const size_t nd = (size_t)cf.n_tokens * d, np = (size_t)(L + 1) * d;
        problem pr = make_problem(&r, &cf, 1.0);
        lm_attnres_params p = {pr.w, pr.g};
        float *G = malloc((L + 1) * nd * 4);
        fill(&r, G, (L + 1) * nd, 1, 0);
        float *h[2], *dy[2], *de[2], *dw[2], *dg[2];
        lm_attnres_state st[2];
        void *ws[2];
        for (int k = 0; k < 2; k++) {
            h[k] = malloc((L + 1) * nd * 4);
            dy[k] = calloc(L * nd, 4), de[k] = calloc(nd, 4), dw[k] = calloc(np, 4), dg[k] = calloc(np, 4);
            ws[k] = make_state(&st[k], k ? &cb : &cf);
            lm_attnres_grads g = {dw[k], dg[k]};
            module_forward(&st[k], pr.emb, pr.ys, &p, h[k]);
            module_backward(&st[k], &p, G, dy[k], de[k], &g);
        }
        CHECK(lm_attnres_n_sources(&st[0], L) == L + 1, "full: the final reads %d sources, want L + 1 = %d",
              lm_attnres_n_sources(&st[0], L), L + 1);
        CHECK(!memcmp(h[0], h[1], (L + 1) * nd * 4), "full vs block size 1: outputs differ");
        CHECK(!memcmp(dy[0], dy[1], L * nd * 4), "full vs block size 1: d outputs differ");
        CHECK(!memcmp(de[0], de[1], nd * 4), "full vs block size 1: d embedding differs");
        CHECK(!memcmp(dw[0], dw[1], np * 4) && !memcmp(dg[0], dg[1], np * 4),
              "full vs block size 1: parameter gradients differ");
        for (int k = 0; k < 2; k++) free(h[k]), free(dy[k]), free(de[k]), free(dw[k]), free(dg[k]), free(ws[k]);
        free(G);
        free_problem(&pr);
    }
}

static void test_history_grows_with_blocks_not_layers(void) {
    const int d = 64;
    const int64_t n = 128; /* rows of 64-byte multiples: the plan adds no padding */
    /* N = 4 blocks whatever the depth: the history is 5 sources of [n,d] (+ their rms) */
    lm_attnres_memory_plan first = {0};
    for (int S = 1; S <= 6; S++) {
        lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 4 * S, S, d, n, 1);
        lm_attnres_memory_plan m;
        CHECK(lm_attnres_memory(&c, &m) == LM_OK, "%s", lm_last_error());
        CHECK(m.n_blocks == 4 && m.n_history_sources == 5, "L=%d S=%d: %d blocks", 4 * S, S, m.n_blocks);
        CHECK(m.history == (size_t)5 * n * d * 4 + (size_t)5 * n * 4, "L=%d: history %zu bytes, want %zu",
              4 * S, m.history, (size_t)5 * n * d * 4 + (size_t)5 * n * 4);
        if (S == 1) first = m;
        CHECK(m.history == first.history && m.history_grad == first.history_grad,
              "history of L=%d (%zu) differs from L=4 (%zu) at the same block count", 4 * S, m.history,
              first.history);
        /* the saved partial sums are the per-sublayer cost, L - N of them */
        CHECK(m.saved_partials >= (size_t)(4 * S - 4) * n * d * 4, "saved partials %zu", m.saved_partials);
        CHECK(m.total == m.history + m.history_grad + m.saved_partials + m.saved_scores + m.phase1 + m.queries +
                                 m.param_grad,
              "total is not the sum of the parts");
    }
    /* the per-token figures are the plan for n tokens divided by n, without padding */
    {
        lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 10, 4, 64, 128, 1);
        lm_attnres_memory_plan m1, m2;
        CHECK(lm_attnres_memory(&c, &m1) == LM_OK, "%s", lm_last_error());
        c.n_tokens = 256;
        CHECK(lm_attnres_memory(&c, &m2) == LM_OK, "%s", lm_last_error());
        double slope = (double)(m2.total - m1.total) / 128.0;
        CHECK(fabs(slope - m1.total_bytes_per_token) < 1e-9 * slope, "per token %.1f, plan slope %.1f",
              m1.total_bytes_per_token, slope);
        CHECK(m1.history_bytes_per_token == 4.0 * 4 * 65, "history per token %.1f, want 4 sources x 65 floats",
              m1.history_bytes_per_token);
    }
    /* Full AttnRes keeps every output: the history grows with L */
    size_t prev = 0;
    for (int L = 2; L <= 24; L += 11) {
        lm_attnres_config c = make_cfg(LM_ATTNRES_FULL, L, 0, d, n, 0);
        lm_attnres_memory_plan m;
        CHECK(lm_attnres_memory(&c, &m) == LM_OK, "%s", lm_last_error());
        CHECK(m.n_history_sources == L + 1, "full L=%d: %d history sources", L, m.n_history_sources);
        CHECK(m.history > prev, "full: history does not grow with L");
        prev = m.history;
    }
    /* K3's shape under both readings of "block size 12": 186 sublayers */
    lm_attnres_config k3 = make_cfg(LM_ATTNRES_BLOCK, 186, 24, 16, 1, 1);
    lm_attnres_memory_plan m;
    CHECK(lm_attnres_memory(&k3, &m) == LM_OK && m.n_blocks == 8, "12 layers = 24 sublayers: %d blocks", m.n_blocks);
    k3.block_size = 12;
    CHECK(lm_attnres_memory(&k3, &m) == LM_OK && m.n_blocks == 16, "12 sublayers: %d blocks", m.n_blocks);
    /* a workspace one byte short is refused */
    lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 5, 2, 8, 3, 1);
    lm_attnres_state st;
    CHECK(lm_attnres_memory(&c, &m) == LM_OK, "%s", lm_last_error());
    void *ws = malloc(m.total);
    CHECK(lm_attnres_init(&st, &c, ws, m.total - 1) == LM_ERR_ARG, "a short workspace was accepted");
    CHECK(strstr(lm_last_error(), "too small") != NULL, "message: %s", lm_last_error());
    free(ws);
}

static void test_calls_out_of_order_are_refused(void) {
    lm_rng r;
    lm_rng_seed(&r, 701);
    lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 4, 2, 8, 3, 1);
    const size_t nd = 24;
    problem pr = make_problem(&r, &c, 1.0);
    lm_attnres_params p = {pr.w, pr.g};
    float h[24], dy[24] = {0};
    lm_attnres_state st;
    void *ws = make_state(&st, &c);
    CHECK(lm_attnres_input(&st, 0, &p, h) == LM_ERR_ARG, "input before begin accepted");
    CHECK(strstr(lm_last_error(), "lm_attnres_begin") != NULL, "message: %s", lm_last_error());
    CHECK(lm_attnres_begin(&st, pr.emb) == LM_OK, "%s", lm_last_error());
    CHECK(lm_attnres_input(&st, 1, &p, h) == LM_ERR_ARG, "input(1) before input(0) accepted");
    CHECK(strstr(lm_last_error(), "lm_attnres_input(l = 0)") != NULL, "message: %s", lm_last_error());
    CHECK(lm_attnres_add_output(&st, 0, pr.ys) == LM_ERR_ARG, "add_output before input accepted");
    lm_attnres_params nop = {NULL, NULL};
    CHECK(lm_attnres_input(&st, 0, &nop, h) == LM_ERR_ARG, "missing parameters accepted");
    CHECK(lm_attnres_input(&st, 0, &p, h) == LM_OK, "%s", lm_last_error());
    CHECK(lm_attnres_final(&st, &p, h) == LM_ERR_ARG, "final before the last sublayer accepted");
    CHECK(lm_attnres_final_backward(&st, &p, h, NULL) == LM_ERR_ARG, "backward during the forward accepted");
    CHECK(lm_attnres_add_output(&st, 0, pr.ys) == LM_OK, "%s", lm_last_error());
    for (int l = 1; l < 4; l++) {
        CHECK(lm_attnres_input(&st, l, &p, h) == LM_OK, "%s", lm_last_error());
        CHECK(lm_attnres_add_output(&st, l, pr.ys + l * nd) == LM_OK, "%s", lm_last_error());
    }
    CHECK(lm_attnres_final(&st, &p, h) == LM_OK, "%s", lm_last_error());
    CHECK(lm_attnres_output_backward(&st, 3, dy) == LM_ERR_ARG, "output_backward before final_backward accepted");
    CHECK(lm_attnres_final_backward(&st, &p, h, NULL) == LM_OK, "%s", lm_last_error());
    CHECK(lm_attnres_output_backward(&st, 0, dy) == LM_ERR_ARG, "output_backward(0) before (3) accepted");
    CHECK(strstr(lm_last_error(), "lm_attnres_output_backward(l = 3)") != NULL, "message: %s", lm_last_error());
    CHECK(lm_attnres_embedding_backward(&st, dy) == LM_ERR_ARG, "embedding_backward too early accepted");
    free(ws);
    free_problem(&pr);
}

static void test_bad_configs_are_refused_by_name(void) {
    lm_attnres_memory_plan m;
    struct { lm_attnres_config c; const char *word; } bad[] = {
        {make_cfg(LM_ATTNRES_BLOCK, 4, 0, 8, 3, 1), "block_size"},
        {make_cfg((lm_attnres_mode)7, 4, 2, 8, 3, 1), "mode"},
        {make_cfg(LM_ATTNRES_BLOCK, 0, 2, 8, 3, 1), "n_sublayers"},
        {make_cfg(LM_ATTNRES_BLOCK, 4, 2, 0, 3, 1), "d must"},
        {make_cfg(LM_ATTNRES_BLOCK, 4, 2, 8, 0, 1), "n_tokens"},
        {make_cfg(LM_ATTNRES_BLOCK, 4, 2, 8, 3, 2), "two_phase"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(lm_attnres_memory(&bad[i].c, &m) == LM_ERR_ARG, "bad config %zu accepted", i);
        CHECK(strstr(lm_last_error(), bad[i].word) != NULL, "message '%s' does not name %s", lm_last_error(),
              bad[i].word);
    }
    lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 4, 2, 8, 3, 1);
    c.eps = 0;
    CHECK(lm_attnres_memory(&c, &m) == LM_ERR_ARG && strstr(lm_last_error(), "eps"), "eps 0 accepted");
    lm_attnres_mode mode;
    CHECK(lm_attnres_mode_from_name("block_attnres", &mode) == 0 && mode == LM_ATTNRES_BLOCK, "block_attnres");
    CHECK(lm_attnres_mode_from_name("full_attnres", &mode) == 0 && mode == LM_ATTNRES_FULL, "full_attnres");
    CHECK(lm_attnres_mode_from_name("standard", &mode) == 0 && mode == LM_ATTNRES_STANDARD, "standard");
    CHECK(lm_attnres_mode_from_name("block", &mode) != 0, "unknown name 'block' accepted");
}

/* Large enough for the parallel paths (n d >= 32768): matches float64, and
 * every output and gradient is bit-identical with 1 and 2 threads. */
static void test_parallel_paths_match_reference_and_thread_count(void) {
    lm_rng r;
    lm_rng_seed(&r, 801);
    lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 6, 4, 64, 640, 1);
    const int L = c.n_sublayers, d = c.d;
    const size_t nd = (size_t)c.n_tokens * d, np = (size_t)(L + 1) * d;
    problem pr = make_problem(&r, &c, 1.0);
    lm_attnres_params p = {pr.w, pr.g};
    float *G = malloc((L + 1) * nd * 4);
    fill(&r, G, (L + 1) * nd, 1, 0);
    float *h[2], *dy[2], *de[2], *dw[2], *dg[2];
    lm_attnres_state st;
    void *ws = make_state(&st, &c);
    const int threads_before = omp_get_max_threads();
    for (int k = 0; k < 2; k++) {
        omp_set_num_threads(k + 1);
        h[k] = malloc((L + 1) * nd * 4);
        dy[k] = calloc(L * nd, 4), de[k] = calloc(nd, 4), dw[k] = calloc(np, 4), dg[k] = calloc(np, 4);
        lm_attnres_grads g = {dw[k], dg[k]};
        module_forward(&st, pr.emb, pr.ys, &p, h[k]);
        module_backward(&st, &p, G, dy[k], de[k], &g);
    }
    omp_set_num_threads(threads_before);
    double *emb = to_double(pr.emb, nd), *ys = to_double(pr.ys, L * nd);
    double *w = to_double(pr.w, np), *g = to_double(pr.g, np), *hr = malloc((L + 1) * nd * 8);
    ref_forward(&c, emb, ys, w, g, hr);
    double e = test_rel_error_f(h[1], hr, (L + 1) * nd);
    CHECK(e < 3e-6, "2 threads: rel error %.3g vs float64", e);
    CHECK(!memcmp(h[0], h[1], (L + 1) * nd * 4), "outputs depend on the thread count");
    CHECK(!memcmp(dy[0], dy[1], L * nd * 4) && !memcmp(de[0], de[1], nd * 4),
          "input gradients depend on the thread count");
    CHECK(!memcmp(dw[0], dw[1], np * 4) && !memcmp(dg[0], dg[1], np * 4),
          "parameter gradients depend on the thread count");
    /* parameter gradients sum over many token blocks: spot-check against central differences */
    for (int trial = 0; trial < 8; trial++) {
        double *x = trial % 2 ? g : w;
        size_t i = (size_t)(lm_rng_uniform(&r) * (double)np);
        const double keep = x[i], eps = 1e-4;
        double lp = 0, lm = 0;
        x[i] = keep + eps;
        ref_forward(&c, emb, ys, w, g, hr);
        for (size_t j = 0; j < (L + 1) * nd; j++) lp += hr[j] * G[j];
        x[i] = keep - eps;
        ref_forward(&c, emb, ys, w, g, hr);
        for (size_t j = 0; j < (L + 1) * nd; j++) lm += hr[j] * G[j];
        x[i] = keep;
        double fd = (lp - lm) / (2 * eps), got = trial % 2 ? dg[1][i] : dw[1][i];
        CHECK(fabs(got - fd) <= 2e-3 + 2e-3 * fabs(fd), "%s[%zu] = %.7g, finite differences %.7g",
              trial % 2 ? "d key-norm weight" : "d query", i, got, fd);
    }
    for (int k = 0; k < 2; k++) free(h[k]), free(dy[k]), free(de[k]), free(dw[k]), free(dg[k]);
    free(emb), free(ys), free(w), free(g), free(hr), free(G), free(ws);
    free_problem(&pr);
}

/* Activation recomputation: the input of every layer rebuilt from the saved
 * scores during the backward equals the forward's, and is refused once that
 * layer's backward has consumed the scores. */
static void test_recomputed_input_equals_forward_input(void) {
    lm_rng r;
    lm_rng_seed(&r, 901);
    for (int tp = 0; tp < 2; tp++) {
        lm_attnres_config c = make_cfg(tp ? LM_ATTNRES_BLOCK : LM_ATTNRES_FULL, 7, 3, 16, 6, tp);
        const int L = c.n_sublayers;
        const size_t nd = (size_t)c.n_tokens * c.d;
        problem pr = make_problem(&r, &c, 1.5);
        lm_attnres_params p = {pr.w, pr.g};
        float *h = malloc((L + 1) * nd * 4), *G = malloc((L + 1) * nd * 4), *hr = malloc(nd * 4);
        float *dy = calloc(nd, 4), *de = calloc(nd, 4);
        fill(&r, G, (L + 1) * nd, 1, 0);
        lm_attnres_state st;
        void *ws = make_state(&st, &c);
        module_forward(&st, pr.emb, pr.ys, &p, h);
        double *hd = to_double(h, (L + 1) * nd);
        CHECK(lm_attnres_recompute_input(&st, L, hr) == LM_OK, "%s", lm_last_error());
        CHECK(test_rel_error_f(hr, hd + L * nd, nd) < 1e-6, "final: recomputed input differs");
        CHECK(lm_attnres_final_backward(&st, &p, G + L * nd, NULL) == LM_OK, "%s", lm_last_error());
        CHECK(lm_attnres_recompute_input(&st, L, hr) == LM_ERR_ARG, "final recomputed after its backward");
        for (int l = L - 1; l >= 0; l--) {
            CHECK(lm_attnres_output_backward(&st, l, dy) == LM_OK, "%s", lm_last_error());
            CHECK(lm_attnres_recompute_input(&st, l, hr) == LM_OK, "%s", lm_last_error());
            double e = test_rel_error_f(hr, hd + l * nd, nd);
            CHECK(e < 1e-6, "%s layer %d: recomputed input rel error %.3g", lm_attnres_mode_name(c.mode), l, e);
            CHECK(lm_attnres_input_backward(&st, l, &p, G + l * nd, NULL) == LM_OK, "%s", lm_last_error());
            CHECK(lm_attnres_recompute_input(&st, l, hr) == LM_ERR_ARG, "layer %d recomputed after its backward", l);
            if (l > 0) CHECK(lm_attnres_recompute_input(&st, l - 1, hr) == LM_OK, "%s", lm_last_error());
        }
        CHECK(lm_attnres_embedding_backward(&st, de) == LM_OK, "%s", lm_last_error());
        free(hd), free(h), free(G), free(hr), free(dy), free(de), free(ws);
        free_problem(&pr);
    }
    /* the standard residual keeps only the running sum: nothing to recompute from */
    lm_attnres_config c = make_cfg(LM_ATTNRES_STANDARD, 3, 0, 4, 2, 0);
    lm_attnres_state st;
    void *ws = make_state(&st, &c);
    float emb[8] = {1, 2, 3, 4, 5, 6, 7, 8}, h[8];
    CHECK(lm_attnres_begin(&st, emb) == LM_OK && lm_attnres_input(&st, 0, NULL, h) == LM_OK, "%s", lm_last_error());
    CHECK(lm_attnres_recompute_input(&st, 0, h) == LM_ERR_ARG, "standard mode recomputed an input");
    free(ws);
}

/* The keys are linear.h's RMSNorm with weight g_l: softmax(w_l . lm_rmsnorm(v_i))
 * computed through lm_rmsnorm_forward gives the weights the module reports. */
/* replay = 1 keeps one block's partial sums: a backward that replays each
 * block's forward (the same outputs) before its backward gives the same bits
 * as the backward of a state that kept them all, in less memory; replaying
 * elsewhere than before a block's backward is refused. */
static void test_replayed_blocks_give_the_same_backward(void) {
    lm_rng r;
    lm_rng_seed(&r, 955);
    const int Ls[] = {8, 7, 12}, Ss[] = {3, 4, 5};
    for (int cse = 0; cse < 3; cse++)
        for (int tp = 0; tp < 2; tp++) {
            lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, Ls[cse], Ss[cse], 16, 9, tp), cr = c;
            cr.replay = 1;
            const int L = c.n_sublayers, S = c.block_size;
            const size_t nd = (size_t)c.n_tokens * c.d;
            lm_attnres_memory_plan pa, pb;
            CHECK(!lm_attnres_memory(&c, &pa) && !lm_attnres_memory(&cr, &pb), "%s", lm_last_error());
            CHECK(pb.saved_partials < pa.saved_partials, "replay keeps %zu bytes of partial sums, all %zu",
                  pb.saved_partials, pa.saved_partials);
            problem pr = make_problem(&r, &c, 1.0);
            lm_attnres_params p = {pr.w, pr.g};
            float *h = malloc((L + 1) * nd * 4), *hr = malloc((L + 1) * nd * 4), *dhs = malloc((L + 1) * nd * 4);
            float *dya = calloc(L * nd, 4), *dyb = calloc(L * nd, 4), *dea = calloc(nd, 4), *deb = calloc(nd, 4);
            float *gq = calloc(2 * (L + 1) * (size_t)c.d, 4), *gqr = calloc(2 * (L + 1) * (size_t)c.d, 4);
            fill(&r, dhs, (L + 1) * nd, 1, 0);
            lm_attnres_grads ga = {gq, gq + (L + 1) * c.d}, gb = {gqr, gqr + (L + 1) * c.d};
            lm_attnres_state sa, sb;
            void *wa = make_state(&sa, &c), *wb = make_state(&sb, &cr);
            module_forward(&sa, pr.emb, pr.ys, &p, h);
            module_forward(&sb, pr.emb, pr.ys, &p, hr);
            CHECK(!memcmp(h, hr, (L + 1) * nd * 4), "replay state: forward differs");
            module_backward(&sa, &p, dhs, dya, dea, &ga);
            CHECK(lm_attnres_final_backward(&sb, &p, dhs + L * nd, &gb) == LM_OK, "%s", lm_last_error());
            CHECK(lm_attnres_replay_block(&sb, 0) == LM_ERR_ARG || (L - 1) / S == 0,
                  "replayed block 0 before the backward reached it");
            for (int l = L - 1; l >= 0; l--) {
                if (l % S == S - 1 || l == L - 1) {
                    const int k = l / S;
                    CHECK(lm_attnres_replay_block(&sb, k) == LM_OK, "%s", lm_last_error());
                    for (int j = k * S; j <= l; j++) {
                        CHECK(lm_attnres_input(&sb, j, &p, hr) == LM_OK, "%s", lm_last_error());
                        CHECK(!memcmp(hr, h + j * nd, nd * 4), "replayed input %d differs", j);
                        CHECK(lm_attnres_add_output(&sb, j, pr.ys + j * nd) == LM_OK, "%s", lm_last_error());
                    }
                }
                CHECK(lm_attnres_output_backward(&sb, l, dyb + l * nd) == LM_OK, "%s", lm_last_error());
                CHECK(lm_attnres_recompute_input(&sb, l, hr) == LM_OK, "%s", lm_last_error());
                double num = 0, den = 0;
                for (size_t i = 0; i < nd; i++) {
                    num += (double)(hr[i] - h[l * nd + i]) * (hr[i] - h[l * nd + i]);
                    den += (double)h[l * nd + i] * h[l * nd + i];
                }
                CHECK(sqrt(num) <= 1e-6 * sqrt(den), "recomputed input %d after a replay", l);
                CHECK(lm_attnres_input_backward(&sb, l, &p, dhs + l * nd, &gb) == LM_OK, "%s", lm_last_error());
            }
            CHECK(lm_attnres_embedding_backward(&sb, deb) == LM_OK, "%s", lm_last_error());
            CHECK(!memcmp(dya, dyb, L * nd * 4) && !memcmp(dea, deb, nd * 4) &&
                      !memcmp(gq, gqr, 2 * (L + 1) * (size_t)c.d * 4),
                  "L=%d S=%d two_phase %d: the replayed backward differs", L, S, tp);
            lm_attnres_config bad = c;
            bad.mode = LM_ATTNRES_FULL;
            bad.replay = 1;
            lm_attnres_state sf;
            void *wf = make_state(&sf, &bad);
            CHECK(lm_attnres_replay_block(&sf, 0) == LM_ERR_ARG, "full attnres replayed a block");
            free(wf), free(wa), free(wb), free(h), free(hr), free(dhs), free(dya), free(dyb), free(dea), free(deb);
            free(gq), free(gqr);
            free_problem(&pr);
        }
}

static void test_keys_are_the_rmsnorm_of_linear_h(void) {
    lm_rng r;
    lm_rng_seed(&r, 1001);
    lm_attnres_config c = make_cfg(LM_ATTNRES_BLOCK, 5, 2, 20, 4, 1);
    c.eps = 1e-2f; /* large enough that its placement matters */
    const int L = c.n_sublayers, d = c.d;
    const int64_t n = c.n_tokens;
    const size_t nd = (size_t)n * d;
    problem pr = make_problem(&r, &c, 1.0);
    for (size_t i = 0; i < nd; i++) pr.emb[i] *= 0.05f; /* rms comparable to sqrt(eps) */
    lm_attnres_params p = {pr.w, pr.g};
    float *h = malloc((L + 1) * nd * 4);
    lm_attnres_state st;
    void *ws = make_state(&st, &c);
    module_forward(&st, pr.emb, pr.ys, &p, h);
    double *emb = to_double(pr.emb, nd), *ys = to_double(pr.ys, L * nd), *src = malloc(sizeof(double) * (L + 2) * d);
    float *v = malloc((size_t)n * (L + 2) * d * 4), *key = malloc((size_t)n * (L + 2) * d * 4);
    for (int l = 0; l <= L; l++) {
        int ns = lm_attnres_n_sources(&st, l);
        float *a = malloc(n * ns * 4);
        CHECK(lm_attnres_weights(&st, l, a) == LM_OK, "%s", lm_last_error());
        /* every (token, source) row through one lm_rmsnorm_forward call */
        for (int64_t t = 0; t < n; t++) {
            CHECK(ref_sources(&c, l, t, emb, ys, src) == ns, "source count");
            for (size_t k = 0; k < (size_t)ns * d; k++) v[(size_t)t * ns * d + k] = (float)src[k];
        }
        lm_rmsnorm_forward(key, NULL, v, pr.g + (size_t)l * d, n * ns, d, c.eps);
        for (int64_t t = 0; t < n; t++) {
            double s[16], m = -INFINITY, Z = 0;
            for (int i = 0; i < ns; i++) {
                s[i] = 0;
                for (int k = 0; k < d; k++) s[i] += (double)pr.w[(size_t)l * d + k] * key[((size_t)t * ns + i) * d + k];
                m = fmax(m, s[i]);
            }
            for (int i = 0; i < ns; i++) Z += exp(s[i] - m);
            for (int i = 0; i < ns; i++) CHECK_CLOSE(a[t * ns + i], exp(s[i] - m) / Z, 1e-6, 1e-5, "weight");
        }
        free(a);
    }
    free(emb), free(ys), free(src), free(v), free(key), free(h), free(ws);
    free_problem(&pr);
}

int main(void) {
    RUN(test_two_phase_equals_direct);
    RUN(test_forward_matches_float64_reference);
    RUN(test_backward_matches_finite_differences);
    RUN(test_chained_sublayers_gradient_matches_finite_differences);
    RUN(test_zero_queries_give_uniform_average_of_sources);
    RUN(test_keys_are_the_rmsnorm_of_linear_h);
    RUN(test_recomputed_input_equals_forward_input);
    RUN(test_replayed_blocks_give_the_same_backward);
    RUN(test_standard_mode_is_the_plain_residual_sum);
    RUN(test_full_equals_block_size_one);
    RUN(test_parallel_paths_match_reference_and_thread_count);
    RUN(test_history_grows_with_blocks_not_layers);
    RUN(test_calls_out_of_order_are_refused);
    RUN(test_bad_configs_are_refused_by_name);
    return test_summary();
}
