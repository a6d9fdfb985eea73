/* Kimi Delta Attention on the CPU: the chunked form equals the recurrence and a
 * float64 reference, its backward equals finite differences, it is exactly
 * causal, the factored path's reciprocal bound holds where claimed, the gate
 * stays in range, and bad configurations are rejected (docs/kda.md). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

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
    lm_kda_config c = lm_kda_config_default(2, 37, 2, 8, 12);
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

/* ---- 3. causality: outputs before P do not depend on inputs at t >= P ---- */

static void perturb_from(problem *p, int P, uint64_t seed) {
    const lm_kda_config *c = &p->cfg;
    lm_rng r;
    lm_rng_seed(&r, seed);
    for (int b = 0; b < c->B; b++)
        for (int t = P; t < c->T; t++)
            for (int h = 0; h < c->H; h++) {
                const size_t row = ((size_t)b * c->T + t) * c->H + h;
                for (int d = 0; d < c->K; d++) {
                    p->q[row * c->K + d] = (float)lm_rng_normal(&r);
                    p->k[row * c->K + d] = (float)(0.3 * lm_rng_normal(&r));
                    /* extreme gates too: z far in both tails */
                    p->z[row * c->K + d] = (float)(40.0 * lm_rng_normal(&r));
                }
                for (int j = 0; j < c->V; j++) p->v[row * c->V + j] = (float)(10.0 * lm_rng_normal(&r));
                p->beta[row] = (float)lm_rng_uniform(&r);
            }
}

static void test_outputs_before_P_are_bit_identical_when_inputs_from_P_change(void) {
    lm_kda_config base = lm_kda_config_default(2, 100, 2, 16, 16);
    const int Ps[] = {1, 15, 16, 40, 64, 80, 96, 97, 99};
    const int chunks[] = {16, 32, 64};
    /* (gate, diag): bounded factored, bounded pairwise, softplus pairwise; -1 = recurrent */
    const int paths[][2] = {{0, LM_KDA_DIAG_AUTO}, {0, LM_KDA_DIAG_PAIRWISE}, {1, LM_KDA_DIAG_AUTO}, {0, -1},
                            {1, -1}};
    int compared = 0;
    for (size_t pi = 0; pi < sizeof paths / sizeof paths[0]; pi++)
        for (size_t ci = 0; ci < 3; ci++) {
            if (paths[pi][1] < 0 && ci > 0) continue;
            lm_kda_config c = base;
            c.gate = (lm_kda_gate)paths[pi][0];
            c.chunk = chunks[ci];
            if (paths[pi][1] >= 0) c.diag = (lm_kda_diag)paths[pi][1];
            problem p = problem_new(c, 400 + pi * 3 + ci, 1);
            lm_kda_inputs in = problem_inputs(&p);
            float *o0 = falloc(n_v(&c)), *o1 = falloc(n_v(&c));
            fill_nan(o0, n_v(&c));
            lm_status st = paths[pi][1] < 0 ? lm_kda_recurrent_forward(&c, &in, o0, NULL)
                                            : lm_kda_chunk_forward(&c, &in, o0, NULL);
            CHECK(st == LM_OK, "forward: %s", lm_last_error());
            for (size_t k = 0; k < sizeof Ps / sizeof Ps[0]; k++) {
                problem q = problem_new(c, 400 + pi * 3 + ci, 1); /* same inputs ... */
                perturb_from(&q, Ps[k], 900 + k);                 /* ... changed from P on */
                lm_kda_inputs qin = problem_inputs(&q);
                fill_nan(o1, n_v(&c));
                st = paths[pi][1] < 0 ? lm_kda_recurrent_forward(&c, &qin, o1, NULL)
                                      : lm_kda_chunk_forward(&c, &qin, o1, NULL);
                CHECK(st == LM_OK, "forward: %s", lm_last_error());
                for (int b = 0; b < c.B; b++) {
                    const size_t off = (size_t)b * c.T * c.H * c.V, len = (size_t)Ps[k] * c.H * c.V;
                    CHECK(!memcmp(o0 + off, o1 + off, len * sizeof(float)),
                          "outputs before P=%d changed (b=%d gate=%d chunk=%d diag=%d)", Ps[k], b, c.gate,
                          paths[pi][1] < 0 ? 0 : c.chunk, paths[pi][1]);
                    /* and the perturbation did reach the outputs from P on */
                    CHECK(memcmp(o0 + off + len, o1 + off + len, sizeof(float) * c.V),
                          "output at P=%d did not change", Ps[k]);
                    compared++;
                }
                problem_free(&q);
            }
            free(o0);
            free(o1);
            problem_free(&p);
        }
    CHECK(compared == 2 * 9 * 11, "compared %d prefixes", compared);
}

/* ---- 4. the reciprocal bound of the factored diagonal path ---- */

static int f32_finite_normal(float x) { return isfinite(x) && isnormal(x); }

static void test_factored_path_is_safe_exactly_when_reciprocals_fit_the_format(void) {
    /* with every g = g_min = -5 the diagonal sub-chunk multiplies factors e^{+-75} */
    const float up = expf(75.0f), down = expf(-75.0f);
    CHECK(f32_finite_normal(up) && f32_finite_normal(down), "e^{+-75} in F32: %g %g", up, down);
    float ub = lm_bf16_to_f32(lm_f32_to_bf16(up)), db = lm_bf16_to_f32(lm_f32_to_bf16(down));
    CHECK(f32_finite_normal(ub) && f32_finite_normal(db), "e^{+-75} in BF16: %g %g", ub, db);
    float uh = lm_f16_to_f32(lm_f32_to_f16(up)), dh = lm_f16_to_f32(lm_f32_to_f16(down));
    CHECK(!isfinite(uh) && !(dh >= 6.103515625e-05f), "e^{+-75} fit F16: %g %g", uh, dh);
    const int chunks[] = {16, 32, 64};
    for (int ci = 0; ci < 3; ci++) {
        /* the bound does not depend on the chunk: the diagonal block is always 16 rows */
        CHECK(lm_kda_factored_safe(-5.0f, LM_DTYPE_F32), "F32 at g_min -5 (chunk %d)", chunks[ci]);
        CHECK(lm_kda_factored_safe(-5.0f, LM_DTYPE_BF16), "BF16 at g_min -5 (chunk %d)", chunks[ci]);
        CHECK(!lm_kda_factored_safe(-5.0f, LM_DTYPE_F16), "F16 at g_min -5 (chunk %d)", chunks[ci]);
    }
    /* the edges of the table in docs/kda.md: span = 15 |g_min| against ln(min normal) */
    CHECK(lm_kda_factored_safe(-5.8f, LM_DTYPE_F32) && !lm_kda_factored_safe(-5.9f, LM_DTYPE_F32),
          "F32 edge is g_min ~ -5.82");
    CHECK(lm_kda_factored_safe(-0.6f, LM_DTYPE_F16) && !lm_kda_factored_safe(-0.7f, LM_DTYPE_F16),
          "F16 edge is g_min ~ -0.647");
    CHECK(!lm_kda_factored_safe(-8.0f, LM_DTYPE_F32) && !lm_kda_factored_safe(-8.0f, LM_DTYPE_BF16),
          "a step of -8 (span 120) must leave the fp32 range");

    /* bounded gate saturated at g_min: the factored operator is finite and exact */
    lm_kda_config c = lm_kda_config_default(1, 70, 2, 16, 16);
    CHECK(lm_kda_diag_path(&c) == LM_KDA_DIAG_FACTORED, "AUTO with the bounded gate is factored");
    problem p = problem_new(c, 500, 1);
    for (size_t i = 0; i < n_qk(&c); i++) p.z[i] = 1e30f; /* sigmoid = 1: g = g_min */
    dproblem d = dproblem_from(&p);
    double *ro = dalloc(n_v(&c)), *rht = dalloc(n_s(&c));
    ref_forward(&c, &d, ro, rht);
    for (int ci = 0; ci < 3; ci++) {
        double e = forward_error(&p, ro, rht, chunks[ci], LM_KDA_DIAG_FACTORED, 0);
        CHECK(e < 2e-5, "factored at g = g_min everywhere: rel err %.3g (chunk %d)", e, chunks[ci]);
    }
    free(ro); free(rht); dproblem_free(&d); problem_free(&p);

    /* the unbounded gate at -8 per step: AUTO is pairwise and exact, forced factored is not */
    c.gate = LM_KDA_GATE_SOFTPLUS;
    CHECK(lm_kda_diag_path(&c) == LM_KDA_DIAG_PAIRWISE, "AUTO with the softplus gate is pairwise");
    c.diag = LM_KDA_DIAG_FACTORED;
    CHECK(lm_kda_diag_path(&c) == LM_KDA_DIAG_FACTORED, "an explicit factored path is honoured");
    c.diag = LM_KDA_DIAG_AUTO;
    p = problem_new(c, 501, 1);
    for (int h = 0; h < c.H; h++) p.A_log[h] = 0.0f;
    for (int i = 0; i < c.H * c.K; i++) p.dt_bias[i] = 0.0f;
    for (size_t i = 0; i < n_qk(&c); i++) p.z[i] = (float)log(expm1(8.0)); /* softplus = 8 */
    d = dproblem_from(&p);
    ro = dalloc(n_v(&c));
    rht = dalloc(n_s(&c));
    ref_forward(&c, &d, ro, rht);
    for (int ci = 0; ci < 3; ci++) {
        double e = forward_error(&p, ro, rht, chunks[ci], LM_KDA_DIAG_AUTO, 0);
        CHECK(e < 2e-5, "softplus at -8 per step, pairwise: rel err %.3g (chunk %d)", e, chunks[ci]);
        e = forward_error(&p, ro, rht, chunks[ci], LM_KDA_DIAG_FACTORED, 0);
        CHECK(!(e < 1e-2), "softplus at -8 per step, forced factored should break: rel err %.3g", e);
        if (ci == 0) printf("     forced factored with span 120: relative error %g\n", e);
    }
    free(ro); free(rht); dproblem_free(&d); problem_free(&p);
}

/* ---- 5. the bounded gate stays in [g_min, 0] and finite ---- */

static void test_bounded_gate_lies_in_gmin_0_for_any_finite_input(void) {
    const float zs[] = {0.0f, 1e-30f, -1e-30f, 1.0f, -1.0f, 10.0f, -10.0f, 88.0f, -88.0f, 1e4f, -1e4f,
                        1e30f, -1e30f, 3e38f, -3e38f};
    const float As[] = {-80.0f, -20.0f, 0.0f, 3.0f, 20.0f, 80.0f};
    const float bs[] = {0.0f, 0.5f, -2.0f};
    const float gmins[] = {-5.0f, -1.0f, -1e-3f};
    const int nz = 15, nA = 6, nb = 3;
    lm_kda_config c = lm_kda_config_default(1, nz, nA, nb, 4);
    float z[15 * 6 * 3], A[6], bias[6 * 3], g[15 * 6 * 3];
    for (int t = 0; t < nz; t++)
        for (int h = 0; h < nA; h++)
            for (int d = 0; d < nb; d++) z[(t * nA + h) * nb + d] = zs[t];
    for (int h = 0; h < nA; h++) {
        A[h] = As[h];
        for (int d = 0; d < nb; d++) bias[h * nb + d] = bs[d];
    }
    int zeros = 0;
    for (int gi = 0; gi < 3; gi++)
        for (int gate = 0; gate < 2; gate++) {
            c.gate = (lm_kda_gate)gate;
            c.g_min = gmins[gi];
            fill_nan(g, 15 * 6 * 3);
            lm_status st = lm_kda_gate_forward(&c, z, A, bias, g);
            CHECK(st == LM_OK, "gate: %s", lm_last_error());
            for (int i = 0; i < nz * nA * nb; i++) {
                const int t = i / (nA * nb), h = (i / nb) % nA, d = i % nb;
                CHECK(isfinite(g[i]), "g not finite at z=%g A_log=%g b=%g: %g", zs[t], As[h], bs[d], g[i]);
                if (gate == LM_KDA_GATE_BOUNDED) {
                    CHECK(g[i] >= c.g_min && g[i] <= 0.0f, "g=%g outside [%g, 0] at z=%g A_log=%g b=%g",
                          g[i], c.g_min, zs[t], As[h], bs[d]);
                    zeros += g[i] == 0.0f;
                    double want = ref_gate(&c, As[h], (double)(zs[t] + bs[d]));
                    CHECK_CLOSE(g[i], want, 1e-6 * fabs(c.g_min), 1e-5, "bounded gate vs float64");
                } else {
                    /* softplus: g <= 0, clamped at -1e4 where e^g underflows anyway */
                    CHECK(g[i] <= 0.0f && g[i] >= -1.0e4f, "softplus g=%g at z=%g A_log=%g", g[i], zs[t],
                          As[h]);
                }
            }
        }
    /* g = 0 exactly (no decay) happens only where the sigmoid underflows: the
     * documented closed end of [g_min, 0] */
    CHECK(zeros > 0, "the extreme inputs should reach the sigmoid's underflow (g = 0)");

    /* the operator with such gates stays finite and exact */
    lm_kda_config oc = lm_kda_config_default(1, 40, 2, 16, 16);
    problem p = problem_new(oc, 600, 1);
    lm_rng r;
    lm_rng_seed(&r, 601);
    for (size_t i = 0; i < n_qk(&oc); i++) p.z[i] = zs[lm_rng_u64(&r) % 15];
    p.A_log[0] = 80.0f;
    p.A_log[1] = -80.0f;
    dproblem d = dproblem_from(&p);
    double *ro = dalloc(n_v(&oc)), *rht = dalloc(n_s(&oc));
    ref_forward(&oc, &d, ro, rht);
    double e = forward_error(&p, ro, rht, 16, LM_KDA_DIAG_AUTO, 0);
    CHECK(e < 2e-5, "operator with extreme gate inputs: rel err %.3g", e);
    free(ro); free(rht); dproblem_free(&d); problem_free(&p);
}

/* ---- 6. bad configurations are rejected with a message naming the problem ---- */

static void expect_error(lm_status got, lm_status want, const char *needle, const char *what) {
    CHECK(got == want, "%s: status %d, want %d (%s)", what, (int)got, (int)want, lm_last_error());
    CHECK(strstr(lm_last_error(), needle) != NULL, "%s: message '%s' lacks '%s'", what, lm_last_error(),
          needle);
}

static void test_bad_configs_are_rejected_with_clear_messages(void) {
    lm_kda_config good = lm_kda_config_default(1, 20, 2, 8, 8);
    problem p = problem_new(good, 700, 1);
    lm_kda_inputs in = problem_inputs(&p);
    float *o = falloc(n_v(&good)), *d_o = falloc(n_v(&good)), *gbuf = falloc(4 * n_v(&good) + 64);
    for (size_t i = 0; i < n_v(&good); i++) d_o[i] = 1.0f;
    memset(gbuf, 0, (4 * n_v(&good) + 64) * sizeof(float));
    lm_kda_grads gr = {gbuf, gbuf + n_v(&good), gbuf + 2 * n_v(&good), gbuf + 3 * n_v(&good),
                       gbuf + 4 * n_v(&good), gbuf + 4 * n_v(&good) + 40, gbuf + 4 * n_v(&good) + 42, NULL};
    CHECK(lm_kda_check(&good, &in) == LM_OK, "good config rejected: %s", lm_last_error());
    CHECK(lm_kda_workspace_bytes(&good) > 0, "workspace bytes of a good config");
    CHECK(lm_kda_chunk_backward(&good, &in, d_o, NULL, &gr) == LM_OK, "good backward: %s", lm_last_error());

    lm_kda_config c;
    c = good; c.B = 0;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "B = 0", "B = 0");
    CHECK(lm_kda_workspace_bytes(&c) == 0, "workspace bytes of a bad config");
    c = good; c.T = -3;
    expect_error(lm_kda_chunk_forward(&c, &in, o, NULL), LM_ERR_ARG, "T = -3", "T < 0");
    c = good; c.H = 0;
    expect_error(lm_kda_recurrent_forward(&c, &in, o, NULL), LM_ERR_ARG, "H = 0", "H = 0");
    c = good; c.K = 1 << 20;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "K = 1048576 is absurdly large", "huge K");
    c = good; c.V = -1;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "V = -1", "V < 0");
    c = good; c.B = 1 << 20; c.T = 1 << 27;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "absurdly large", "huge B*T");
    c = good; c.chunk = 48;
    expect_error(lm_kda_chunk_forward(&c, &in, o, NULL), LM_ERR_ARG, "chunk = 48 must be 16, 32 or 64",
                 "chunk 48");
    c = good; c.chunk = 128;
    expect_error(lm_kda_chunk_backward(&c, &in, d_o, NULL, &gr), LM_ERR_ARG, "chunk = 128", "chunk 128");
    c = good; c.g_min = -6.0f;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "g_min = -6 must lie in [-5, 0)", "g_min -6");
    c = good; c.g_min = 0.0f;
    expect_error(lm_kda_gate_forward(&c, p.z, p.A_log, p.dt_bias, o), LM_ERR_ARG, "g_min = 0", "g_min 0");
    c = good; c.g_min = NAN;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "g_min = nan", "g_min nan");
    c = good; c.g_min = -9.0f; c.gate = LM_KDA_GATE_SOFTPLUS; /* g_min unused by softplus */
    CHECK(lm_kda_check(&c, &in) == LM_OK, "softplus ignores g_min: %s", lm_last_error());
    c = good; c.gate = (lm_kda_gate)7;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "gate = 7", "gate 7");
    c = good; c.diag = (lm_kda_diag)5;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "diag = 5", "diag 5");
    c = good; c.scale = INFINITY;
    expect_error(lm_kda_check(&c, &in), LM_ERR_ARG, "scale = inf", "scale inf");

    float keep = p.A_log[1];
    p.A_log[1] = NAN;
    expect_error(lm_kda_chunk_forward(&good, &in, o, NULL), LM_ERR_NUMERIC, "A_log[1] = nan", "A_log nan");
    p.A_log[1] = keep;
    keep = p.dt_bias[5];
    p.dt_bias[5] = -INFINITY;
    expect_error(lm_kda_recurrent_forward(&good, &in, o, NULL), LM_ERR_NUMERIC, "dt_bias[5] = -inf",
                 "dt_bias inf");
    expect_error(lm_kda_gate_forward(&good, p.z, p.A_log, p.dt_bias, o), LM_ERR_NUMERIC, "dt_bias[5]",
                 "gate dt_bias inf");
    p.dt_bias[5] = keep;

    lm_kda_inputs bad = in;
    bad.k = NULL;
    expect_error(lm_kda_chunk_forward(&good, &bad, o, NULL), LM_ERR_ARG, "input k is NULL", "k NULL");
    bad = in;
    bad.beta = NULL;
    expect_error(lm_kda_recurrent_forward(&good, &bad, o, NULL), LM_ERR_ARG, "input beta is NULL", "beta NULL");
    expect_error(lm_kda_chunk_forward(&good, &in, NULL, NULL), LM_ERR_ARG, "output o is NULL", "o NULL");
    expect_error(lm_kda_chunk_forward(NULL, &in, o, NULL), LM_ERR_ARG, "config is NULL", "cfg NULL");
    expect_error(lm_kda_check(&good, NULL), LM_ERR_ARG, "inputs struct is NULL", "inputs NULL");
    expect_error(lm_kda_chunk_backward(&good, &in, NULL, NULL, &gr), LM_ERR_ARG, "d_o is NULL", "d_o NULL");
    lm_kda_grads gbad = gr;
    gbad.dA_log = NULL;
    expect_error(lm_kda_chunk_backward(&good, &in, d_o, NULL, &gbad), LM_ERR_ARG, "gradient dA_log is NULL",
                 "dA_log NULL");
    expect_error(lm_kda_gate_forward(&good, p.z, p.A_log, p.dt_bias, NULL), LM_ERR_ARG, "g is NULL", "g NULL");
    free(o); free(d_o); free(gbuf);
    problem_free(&p);
}

/* beta lies in the closed [0, 1]: 0 and 1 (a saturated fp32 sigmoid) are
 * accepted; anything outside, or not finite, is refused by every entry point
 * naming the element. */
static void test_beta_outside_0_1_or_not_finite_is_refused_naming_the_element(void) {
    lm_kda_config good = lm_kda_config_default(1, 20, 2, 8, 8);
    problem p = problem_new(good, 701, 1);
    lm_kda_inputs in = problem_inputs(&p);
    float *o = falloc(n_v(&good)), *d_o = falloc(n_v(&good)), *gbuf = falloc(4 * n_v(&good) + 64);
    for (size_t i = 0; i < n_v(&good); i++) d_o[i] = 1.0f;
    memset(gbuf, 0, (4 * n_v(&good) + 64) * sizeof(float));
    lm_kda_grads gr = {gbuf, gbuf + n_v(&good), gbuf + 2 * n_v(&good), gbuf + 3 * n_v(&good),
                       gbuf + 4 * n_v(&good), gbuf + 4 * n_v(&good) + 40, gbuf + 4 * n_v(&good) + 42, NULL};
    float keep0 = p.beta[0], keep7 = p.beta[7], keep9 = p.beta[9];
    p.beta[0] = 0.0f;
    p.beta[9] = 1.0f;
    CHECK(lm_kda_chunk_forward(&good, &in, o, NULL) == LM_OK, "beta 0 and 1 refused: %s", lm_last_error());
    for (size_t i = 0; i < n_v(&good); i++) CHECK(isfinite(o[i]), "o[%zu] not finite at beta 0 and 1", i);
    p.beta[7] = 1.5f; /* B=1, T=20, H=2: flat 7 is t 3, h 1 */
    expect_error(lm_kda_chunk_forward(&good, &in, o, NULL), LM_ERR_ARG,
                 "beta[0,3,1] (flat index 7) = 1.5 lies outside [0, 1]", "beta 1.5");
    p.beta[7] = -0.25f;
    expect_error(lm_kda_recurrent_forward(&good, &in, o, NULL), LM_ERR_ARG, "= -0.25 lies outside [0, 1]",
                 "beta -0.25");
    p.beta[7] = nextafterf(1.0f, 2.0f);
    expect_error(lm_kda_check(&good, &in), LM_ERR_ARG, "lies outside [0, 1]", "beta just above 1");
    p.beta[7] = NAN;
    expect_error(lm_kda_chunk_backward(&good, &in, d_o, NULL, &gr), LM_ERR_NUMERIC,
                 "beta[0,3,1] (flat index 7) = nan is not finite", "beta nan");
    p.beta[7] = INFINITY;
    expect_error(lm_kda_chunk_forward(&good, &in, o, NULL), LM_ERR_NUMERIC, "is not finite", "beta inf");
    p.beta[0] = keep0, p.beta[7] = keep7, p.beta[9] = keep9;
    free(o); free(d_o); free(gbuf);
    problem_free(&p);
}

/* ---- results do not depend on the number of threads ---- */

static void test_outputs_and_gradients_are_identical_for_1_and_3_threads(void) {
    lm_kda_config c = lm_kda_config_default(2, 50, 3, 16, 8);
    c.chunk = 32;
    problem p = problem_new(c, 800, 1);
    lm_kda_inputs in = problem_inputs(&p);
    float *d_o = falloc(n_v(&c));
    lm_rng r;
    lm_rng_seed(&r, 801);
    for (size_t i = 0; i < n_v(&c); i++) d_o[i] = (float)lm_rng_normal(&r);
    const size_t sizes[8] = {n_qk(&c), n_qk(&c), n_v(&c), n_qk(&c), n_bt(&c), (size_t)c.H,
                             (size_t)c.H * c.K, n_s(&c)};
    float *o[2], *g[2][8];
    const int threads[2] = {1, 3};
    const int saved = omp_get_max_threads();
    for (int run = 0; run < 2; run++) {
        omp_set_num_threads(threads[run]);
        o[run] = falloc(n_v(&c));
        for (int m = 0; m < 8; m++) {
            g[run][m] = falloc(sizes[m]);
            memset(g[run][m], 0, sizes[m] * sizeof(float));
        }
        lm_kda_grads gr = {g[run][0], g[run][1], g[run][2], g[run][3], g[run][4], g[run][5], g[run][6],
                           g[run][7]};
        CHECK(lm_kda_chunk_forward(&c, &in, o[run], NULL) == LM_OK, "forward: %s", lm_last_error());
        CHECK(lm_kda_chunk_backward(&c, &in, d_o, NULL, &gr) == LM_OK, "backward: %s", lm_last_error());
    }
    omp_set_num_threads(saved);
    CHECK(!memcmp(o[0], o[1], n_v(&c) * sizeof(float)), "outputs differ between 1 and 3 threads");
    for (int m = 0; m < 8; m++)
        CHECK(!memcmp(g[0][m], g[1][m], sizes[m] * sizeof(float)), "gradient %d differs between 1 and 3 threads", m);
    for (int run = 0; run < 2; run++) {
        free(o[run]);
        for (int m = 0; m < 8; m++) free(g[run][m]);
    }
    free(d_o);
    problem_free(&p);
}

int main(void) {
    RUN(test_chunked_equals_recurrent_equals_float64_reference);
    RUN(test_backward_equals_finite_differences_bounded_gate);
    RUN(test_backward_equals_finite_differences_softplus_gate);
    RUN(test_outputs_before_P_are_bit_identical_when_inputs_from_P_change);
    RUN(test_factored_path_is_safe_exactly_when_reciprocals_fit_the_format);
    RUN(test_bounded_gate_lies_in_gmin_0_for_any_finite_input);
    RUN(test_bad_configs_are_rejected_with_clear_messages);
    RUN(test_beta_outside_0_1_or_not_finite_is_refused_naming_the_element);
    RUN(test_outputs_and_gradients_are_identical_for_1_and_3_threads);
    return test_summary();
}
