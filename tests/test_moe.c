/* The MoE layer (router, grouping, GLU experts, LatentMoE, shared experts):
 * forward and backward against a float64 reference and finite differences,
 * with the routing held fixed (SPEC §4; include/longmoe/moe.h). */
#include <math.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/balance.h"
#include "longmoe/moe.h"
#include "longmoe/safetensors.h"
#include "test.h"

static void fill_normal(float *v, size_t len, double scale, lm_rng *r) {
    for (size_t i = 0; i < len; i++) v[i] = (float)(scale * lm_rng_normal(r));
}

/* ---- float64 reference of the layer (parameters in the lm_moe_params layout) ---- */

typedef struct {
    const double *router, *gate, *up, *down, *lat_down, *lat_norm, *lat_up, *sg, *su, *sd;
} ref_params;

static double ref_act(lm_expert_act act, double a, double u) {
    double sg = 1.0 / (1.0 + exp(-a));
    if (act == LM_EXPERT_SITU_GLU) return 4.0 * tanh(a / 4.0) * sg * 25.0 * tanh(u / 25.0);
    return a * sg * u;
}

/* out[dout] = Wd act(Wg v, Wu v) for one vector v[din]. */
static void ref_glu(double *out, const double *v, const double *wg, const double *wu, const double *wd,
                    int din, int f, int dout, lm_expert_act act) {
    double h[64];
    for (int o = 0; o < f; o++) {
        double a = 0, u = 0;
        for (int e = 0; e < din; e++) {
            a += wg[o * din + e] * v[e];
            u += wu[o * din + e] * v[e];
        }
        h[o] = ref_act(act, a, u);
    }
    for (int o = 0; o < dout; o++) {
        double acc = 0;
        for (int e = 0; e < f; e++) acc += wd[o * f + e] * h[e];
        out[o] = acc;
    }
}

/* y[m,d] of the layer in float64. With fixed_topk == NULL the routing is
 * computed here (argtop_k(s + b), ties to the lower index) and written to
 * topk_out; otherwise fixed_topk is used. Returns sum y*dy + sum s*ds_extra
 * when dy (and ds_extra) are given. */
static double ref_forward(double *y, const double *x, const float *b, const ref_params *p,
                          const lm_moe_config *c, int64_t m, const int32_t *fixed_topk, int32_t *topk_out,
                          const float *dy, const float *ds_extra) {
    int n = c->n_experts, k = c->top_k, d = c->d, f = c->d_ff, dl = c->d_latent;
    int de = dl ? dl : d, fs = c->d_ff_shared;
    double loss = 0;
    double *s = malloc((size_t)n * sizeof *s);
    double xe[64], z[64], tmp[64];
    for (int64_t i = 0; i < m; i++) {
        const double *xi = x + i * d;
        for (int j = 0; j < n; j++) {
            double r = 0;
            for (int e = 0; e < d; e++) r += p->router[(int64_t)j * d + e] * xi[e];
            s[j] = 1.0 / (1.0 + exp(-r));
            if (ds_extra) loss += s[j] * ds_extra[i * n + j];
        }
        int32_t T[LM_MOE_MAX_TOPK];
        if (fixed_topk) {
            memcpy(T, fixed_topk + i * k, (size_t)k * sizeof *T);
        } else {
            /* k passes of argmax over the experts not yet taken */
            for (int t = 0; t < k; t++) {
                int best = -1;
                for (int j = 0; j < n; j++) {
                    int taken = 0;
                    for (int u = 0; u < t; u++) taken |= T[u] == j;
                    if (taken) continue;
                    if (best < 0 || s[j] + b[j] > s[best] + b[best]) best = j;
                }
                T[t] = best;
            }
            if (topk_out) memcpy(topk_out + i * k, T, (size_t)k * sizeof *T);
        }
        double S = 0;
        for (int t = 0; t < k; t++) S += s[T[t]];
        if (dl) {
            for (int o = 0; o < dl; o++) {
                double acc = 0;
                for (int e = 0; e < d; e++) acc += p->lat_down[o * d + e] * xi[e];
                xe[o] = acc;
            }
        } else {
            memcpy(xe, xi, (size_t)d * sizeof *xe);
        }
        for (int e = 0; e < de; e++) z[e] = 0;
        for (int t = 0; t < k; t++) {
            size_t wo = (size_t)T[t] * f * de;
            ref_glu(tmp, xe, p->gate + wo, p->up + wo, p->down + wo, de, f, de, c->act);
            double pt = c->route_scale * s[T[t]] / S;
            for (int e = 0; e < de; e++) z[e] += pt * tmp[e];
        }
        double *yi = y + i * d;
        if (dl) {
            double ss = 0;
            for (int e = 0; e < dl; e++) ss += z[e] * z[e];
            double rs = 1.0 / sqrt(ss / dl + c->norm_eps);
            for (int e = 0; e < dl; e++) z[e] *= rs * p->lat_norm[e];
            for (int o = 0; o < d; o++) {
                double acc = 0;
                for (int e = 0; e < dl; e++) acc += p->lat_up[o * dl + e] * z[e];
                yi[o] = acc;
            }
        } else {
            memcpy(yi, z, (size_t)d * sizeof *yi);
        }
        for (int e = 0; e < c->n_shared; e++) {
            size_t wo = (size_t)e * fs * d;
            ref_glu(tmp, xi, p->sg + wo, p->su + wo, p->sd + wo, d, fs, d, c->act);
            for (int o = 0; o < d; o++) yi[o] += tmp[o];
        }
        if (dy)
            for (int o = 0; o < d; o++) loss += yi[o] * dy[i * d + o];
    }
    free(s);
    return loss;
}

/* A layer instance: float parameters, their float64 copy, gradients. */
typedef struct {
    lm_moe_config cfg;
    size_t count;
    float *mem, *gmem;
    double *dmem;
    lm_moe_params p, g;
    ref_params rp;
} layer;

static void layer_init(layer *L, const lm_moe_config *c, uint64_t seed) {
    L->cfg = *c;
    L->count = lm_moe_param_count(c);
    L->mem = mallocCheck(L->count * sizeof(float));
    L->gmem = callocCheck(L->count, sizeof(float));
    L->dmem = mallocCheck(L->count * sizeof(double));
    lm_moe_params_carve(c, L->mem, &L->p);
    lm_moe_params_carve(c, L->gmem, &L->g);
    lm_rng r;
    lm_rng_seed(&r, seed);
    fill_normal(L->mem, L->count, 0.4, &r);
    if (L->p.lat_norm)
        for (int e = 0; e < c->d_latent; e++) L->p.lat_norm[e] = 1.0f + 0.2f * (float)lm_rng_normal(&r);
    for (size_t q = 0; q < L->count; q++) L->dmem[q] = L->mem[q];
#define DPTR(field) (L->p.field ? L->dmem + (L->p.field - L->mem) : NULL)
    L->rp = (ref_params){DPTR(router), DPTR(gate), DPTR(up), DPTR(down), DPTR(lat_down), DPTR(lat_norm),
                         DPTR(lat_up), DPTR(shared_gate), DPTR(shared_up), DPTR(shared_down)};
#undef DPTR
}

static void layer_free(layer *L) {
    free(L->mem);
    free(L->gmem);
    free(L->dmem);
}

static lm_moe_config small_config(lm_expert_act act, int latent, int shared) {
    lm_moe_config c = lm_moe_config_default(12, 8, 3, 6);
    c.act = act;
    c.d_latent = latent ? 8 : 0;
    c.n_shared = shared;
    c.d_ff_shared = shared ? 5 : 0;
    c.route_scale = 2.5f;
    return c;
}

static void test_router_picks_k_distinct_experts_by_score_plus_bias(void) {
    lm_rng r;
    lm_rng_seed(&r, 1);
    const int ns[4] = {4, 17, 256, 1024}, ks[3] = {1, 4, 16};
    for (int a = 0; a < 4; a++)
        for (int bk = 0; bk < 3; bk++) {
            int n = ns[a], k = ks[bk] < n ? ks[bk] : n;
            int64_t m = 64;
            float *s = mallocCheck((size_t)(m * n) * sizeof *s), *b = mallocCheck((size_t)n * sizeof *b);
            for (int64_t q = 0; q < m * n; q++) s[q] = (float)lm_rng_uniform(&r) * 0.98f + 0.01f;
            fill_normal(b, (size_t)n, 0.1, &r);
            int32_t *topk = mallocCheck((size_t)(m * k) * sizeof *topk);
            float *w = mallocCheck((size_t)(m * k) * sizeof *w);
            CHECK(lm_router_select(topk, w, s, b, m, n, k, 1.5f) == LM_OK, "%s", lm_last_error());
            int bad_distinct = 0, bad_order = 0, bad_dominance = 0;
            double worst_w = 0;
            for (int64_t i = 0; i < m; i++) {
                const int32_t *t = topk + i * k;
                const float *si = s + i * n;
                double sum = 0, kth = INFINITY;
                for (int u = 0; u < k; u++) {
                    for (int v = 0; v < u; v++) bad_distinct += t[u] == t[v];
                    if (u) bad_order += si[t[u]] + b[t[u]] > si[t[u - 1]] + b[t[u - 1]];
                    sum += si[t[u]];
                    kth = fmin(kth, (double)(si[t[u]] + b[t[u]]));
                }
                for (int j = 0; j < n; j++) {
                    int chosen = 0;
                    for (int u = 0; u < k; u++) chosen |= t[u] == j;
                    if (!chosen) bad_dominance += (double)(si[j] + b[j]) > kth;
                }
                /* weights: route_scale * s / sum over the chosen set; b never enters */
                for (int u = 0; u < k; u++)
                    worst_w = fmax(worst_w, fabs(w[i * k + u] - 1.5 * si[t[u]] / sum));
            }
            CHECK(!bad_distinct && !bad_order && !bad_dominance,
                  "n %d k %d: %d repeated, %d out of order, %d beaten by an unchosen expert", n, k, bad_distinct,
                  bad_order, bad_dominance);
            CHECK(worst_w < 1e-6, "n %d k %d: weights off by %.3g", n, k, worst_w);
            free(s);
            free(b);
            free(topk);
            free(w);
        }
    /* ties go to the lower index */
    float s[4] = {0.5f, 0.7f, 0.5f, 0.7f};
    int32_t t[2];
    lm_router_select(t, NULL, s, NULL, 1, 4, 2, 1.0f);
    CHECK(t[0] == 1 && t[1] == 3, "ties: got %d %d", t[0], t[1]);
    lm_router_select(t, NULL, s, NULL, 1, 4, 1, 1.0f);
    CHECK(t[0] == 1, "tie for the top: got %d", t[0]);
}

static void test_grouping_is_a_stable_permutation_by_expert(void) {
    lm_rng r;
    lm_rng_seed(&r, 2);
    int64_t m = 300;
    int n = 37, k = 5;
    float *s = mallocCheck((size_t)(m * n) * sizeof *s);
    for (int64_t q = 0; q < m * n; q++) s[q] = (float)lm_rng_uniform(&r);
    int32_t *topk = mallocCheck((size_t)(m * k) * sizeof *topk), *order = mallocCheck((size_t)(m * k) * 4),
            *slot_row = mallocCheck((size_t)(m * k) * 4);
    int64_t off[38];
    lm_router_select(topk, NULL, s, NULL, m, n, k, 1.0f);
    lm_moe_group_by_expert(off, order, slot_row, topk, m, n, k);
    CHECK(off[0] == 0 && off[n] == m * k, "offsets span all rows: %lld..%lld", (long long)off[0],
          (long long)off[n]);
    int bad = 0;
    for (int j = 0; j < n; j++)
        for (int64_t row = off[j]; row < off[j + 1]; row++) {
            bad += topk[order[row]] != j;                                 /* the row belongs to expert j */
            bad += slot_row[order[row]] != row;                           /* inverse */
            bad += row > off[j] && order[row] <= order[row - 1];          /* stable: token order */
        }
    CHECK(!bad, "%d grouping violations", bad);
    free(s);
    free(topk);
    free(order);
    free(slot_row);
}

/* Forward vs the float64 reference (with its own routing), for one config. */
static void check_forward(const lm_moe_config *c, int64_t m, uint64_t seed, double tol) {
    layer L;
    layer_init(&L, c, seed);
    lm_rng r;
    lm_rng_seed(&r, seed + 100);
    int d = c->d, n = c->n_experts, k = c->top_k;
    float *x = mallocCheck((size_t)(m * d) * sizeof *x), *b = mallocCheck((size_t)n * sizeof *b);
    float *y = mallocCheck((size_t)(m * d) * sizeof *y);
    fill_normal(x, (size_t)(m * d), 1.0, &r);
    fill_normal(b, (size_t)n, 0.05, &r);
    double *xd = mallocCheck((size_t)(m * d) * sizeof *xd), *yd = mallocCheck((size_t)(m * d) * sizeof *yd);
    for (int64_t q = 0; q < m * d; q++) xd[q] = x[q];
    int32_t *ref_topk = mallocCheck((size_t)(m * k) * sizeof *ref_topk);
    lm_moe_acts acts;
    CHECK(lm_moe_acts_alloc(&acts, c, m) == LM_OK, "%s", lm_last_error());
    CHECK(lm_moe_forward(y, x, b, c, &L.p, &acts, m) == LM_OK, "%s", lm_last_error());
    ref_forward(yd, xd, b, &L.rp, c, m, NULL, ref_topk, NULL, NULL);
    CHECK(!memcmp(ref_topk, acts.topk, (size_t)(m * k) * sizeof *ref_topk),
          "n %d k %d: routing equals the float64 routing", n, k);
    double err = test_rel_error_f(y, yd, (size_t)(m * d));
    CHECK(err < tol, "n %d k %d act %d latent %d shared %d: forward rel error %.3g", n, k, (int)c->act,
          c->d_latent, c->n_shared, err);
    lm_moe_acts_free(&acts);
    layer_free(&L);
    free(x);
    free(b);
    free(y);
    free(xd);
    free(yd);
    free(ref_topk);
}

static void test_forward_matches_float64_reference(void) {
    for (int act = 0; act < 2; act++)
        for (int latent = 0; latent < 2; latent++)
            for (int shared = 0; shared < 3; shared += 2) {
                lm_moe_config c = small_config((lm_expert_act)act, latent, shared);
                check_forward(&c, 40, 10 + (uint64_t)(act * 4 + latent * 2 + shared), 1e-5);
            }
    /* the ends of the supported range: 4 experts top-1 and 1024 experts top-16 */
    lm_moe_config c4 = lm_moe_config_default(8, 4, 1, 4);
    check_forward(&c4, 64, 31, 1e-5);
    lm_moe_config c1024 = lm_moe_config_default(8, 1024, 16, 4);
    c1024.act = LM_EXPERT_SITU_GLU;
    c1024.n_shared = 1;
    c1024.d_ff_shared = 6;
    check_forward(&c1024, 96, 32, 1e-5);
}

/* Backward vs central finite differences of the float64 reference with the
 * routing held fixed, for every parameter and input entry. dscores_extra
 * (optional) adds sum s * E to the loss. */
static void check_backward(const lm_moe_config *c, int64_t m, uint64_t seed, int with_extra) {
    layer L;
    layer_init(&L, c, seed);
    lm_rng r;
    lm_rng_seed(&r, seed + 200);
    int d = c->d, n = c->n_experts, k = c->top_k;
    size_t md = (size_t)(m * d), mn = (size_t)(m * n);
    float *x = mallocCheck(md * sizeof *x), *b = mallocCheck((size_t)n * sizeof *b);
    float *y = mallocCheck(md * sizeof *y), *dy = mallocCheck(md * sizeof *dy);
    float *dx = mallocCheck(md * sizeof *dx), *extra = mallocCheck(mn * sizeof *extra);
    fill_normal(dx, md, 10.0, &r); /* dx is written: what it held must not matter */
    fill_normal(x, md, 1.0, &r);
    fill_normal(b, (size_t)n, 0.05, &r);
    fill_normal(dy, md, 1.0, &r);
    fill_normal(extra, mn, 1.0, &r);
    lm_moe_acts acts;
    lm_moe_acts_alloc(&acts, c, m);
    CHECK(lm_moe_forward(y, x, b, c, &L.p, &acts, m) == LM_OK, "%s", lm_last_error());
    /* twice: the backward accumulates into the parameter gradients and writes dx */
    for (int rep = 0; rep < 2; rep++)
        CHECK(lm_moe_backward(dx, &L.g, dy, x, with_extra ? extra : NULL, c, &L.p, &acts) == LM_OK, "%s",
              lm_last_error());
    int32_t *topk = mallocCheck((size_t)(m * k) * sizeof *topk);
    memcpy(topk, acts.topk, (size_t)(m * k) * sizeof *topk);
    double *xd = mallocCheck(md * sizeof *xd), *yd = mallocCheck(md * sizeof *yd);
    for (size_t q = 0; q < md; q++) xd[q] = x[q];
    const double h = 1e-5;
    /* finite differences over every parameter, then every input entry */
    double *fd = mallocCheck((L.count + md) * sizeof *fd);
    for (size_t q = 0; q < L.count + md; q++) {
        double *v = q < L.count ? &L.dmem[q] : &xd[q - L.count], keep = *v, lp, lm;
        *v = keep + h;
        lp = ref_forward(yd, xd, b, &L.rp, c, m, topk, NULL, dy, with_extra ? extra : NULL);
        *v = keep - h;
        lm = ref_forward(yd, xd, b, &L.rp, c, m, topk, NULL, dy, with_extra ? extra : NULL);
        *v = keep;
        fd[q] = 2.0 * (lp - lm) / (2 * h); /* the backward ran twice */
    }
    /* per parameter tensor, so a failure names the broken gradient */
    struct { const char *name; const float *g; } parts[] = {
        {"router", L.g.router}, {"gate", L.g.gate}, {"up", L.g.up}, {"down", L.g.down},
        {"lat_down", L.g.lat_down}, {"lat_norm", L.g.lat_norm}, {"lat_up", L.g.lat_up},
        {"shared_gate", L.g.shared_gate}, {"shared_up", L.g.shared_up}, {"shared_down", L.g.shared_down},
    };
    for (size_t a = 0; a < sizeof parts / sizeof parts[0]; a++) {
        if (!parts[a].g) continue;
        size_t off = (size_t)(parts[a].g - L.gmem);
        /* the tensor runs to the next non-NULL part (or the end) */
        size_t end = L.count;
        for (size_t z = a + 1; z < sizeof parts / sizeof parts[0]; z++)
            if (parts[z].g) {
                end = (size_t)(parts[z].g - L.gmem);
                break;
            }
        double err = test_rel_error_f(parts[a].g, fd + off, end - off);
        CHECK(err < 2e-4, "act %d latent %d shared %d extra %d: d%s rel error %.3g", (int)c->act, c->d_latent,
              c->n_shared, with_extra, parts[a].name, err);
    }
    for (size_t q = 0; q < md; q++) fd[L.count + q] *= 0.5; /* dx once: written, not added to */
    double errx = test_rel_error_f(dx, fd + L.count, md);
    CHECK(errx < 2e-4, "act %d latent %d shared %d extra %d: dx rel error %.3g", (int)c->act, c->d_latent,
          c->n_shared, with_extra, errx);
    lm_moe_acts_free(&acts);
    layer_free(&L);
    free(x);
    free(b);
    free(y);
    free(dy);
    free(dx);
    free(extra);
    free(topk);
    free(xd);
    free(yd);
    free(fd);
}

static void test_backward_matches_finite_differences_routing_fixed(void) {
    for (int act = 0; act < 2; act++)
        for (int latent = 0; latent < 2; latent++) {
            lm_moe_config c = small_config((lm_expert_act)act, latent, latent ? 2 : 0);
            check_backward(&c, 10, 50 + (uint64_t)(act * 2 + latent), 0);
        }
}

static void test_router_gradient_with_extra_score_gradient(void) {
    /* an auxiliary-loss style gradient on all n scores reaches W_r and x */
    lm_moe_config c = small_config(LM_EXPERT_SWIGLU, 1, 1);
    check_backward(&c, 10, 60, 1);
}

static void test_without_extra_router_gradient_flows_only_through_weights(void) {
    /* b selects but never weights: with k = 1 the weight is the constant
     * route_scale, so p does not depend on s and W_r gets no gradient at all */
    lm_moe_config c = lm_moe_config_default(6, 5, 1, 4);
    layer L;
    layer_init(&L, &c, 70);
    lm_rng r;
    lm_rng_seed(&r, 71);
    int64_t m = 16;
    float x[16 * 6], y[16 * 6], dy[16 * 6], dx[16 * 6] = {0}, b[5] = {0.3f, -0.1f, 0.0f, 0.2f, -0.4f};
    fill_normal(x, 96, 1.0, &r);
    fill_normal(dy, 96, 1.0, &r);
    lm_moe_acts acts;
    lm_moe_acts_alloc(&acts, &c, m);
    lm_moe_forward(y, x, b, &c, &L.p, &acts, m);
    lm_moe_backward(dx, &L.g, dy, x, NULL, &c, &L.p, &acts);
    double gr = 0, gx = 0;
    for (int q = 0; q < 5 * 6; q++) gr += fabs(L.g.router[q]);
    for (int q = 0; q < 96; q++) gx += fabs(dx[q]);
    /* zero up to fp32 rounding of c * dp - dp * p with p = c */
    CHECK(gr < 1e-6 * gx, "k = 1: the router gets no gradient (|dW_r| = %.3g vs |dx| = %.3g)", gr, gx);
    CHECK(gx > 0.0, "the experts still pass a gradient to x");
    lm_moe_acts_free(&acts);
    layer_free(&L);
}

static void test_situ_glu_is_bounded_and_its_derivative_is_right(void) {
    float worst = 0;
    for (int ia = -40; ia <= 40; ia++)
        for (int iu = -40; iu <= 40; iu++) {
            float a = (float)ia * 25.0f, u = (float)iu * 25.0f;
            float h = lm_expert_act_forward(LM_EXPERT_SITU_GLU, a, u);
            worst = fabsf(h) > worst ? fabsf(h) : worst;
        }
    CHECK(worst <= 100.0f && worst > 90.0f, "|SiTU-GLU| <= 100 and approaches it: max %.3f", worst);
    lm_rng r;
    lm_rng_seed(&r, 80);
    double bad = 0;
    for (int t = 0; t < 200; t++) {
        for (int act = 0; act < 2; act++) {
            double a = 6 * lm_rng_normal(&r), u = 30 * lm_rng_normal(&r), h = 1e-5;
            float da, du;
            lm_expert_act_backward((lm_expert_act)act, (float)a, (float)u, &da, &du);
            double fa = (ref_act((lm_expert_act)act, a + h, u) - ref_act((lm_expert_act)act, a - h, u)) / (2 * h);
            double fu = (ref_act((lm_expert_act)act, a, u + h) - ref_act((lm_expert_act)act, a, u - h)) / (2 * h);
            bad = fmax(bad, fabs(da - fa) / (fabs(fa) + 1e-3));
            bad = fmax(bad, fabs(du - fu) / (fabs(fu) + 1e-3));
        }
    }
    CHECK(bad < 1e-4, "activation derivatives vs finite differences: worst %.3g", bad);
}

static void test_layer_routes_every_token_to_k_experts_at_1024(void) {
    /* the layer's grouping holds exactly m*k rows, k distinct experts per token */
    lm_moe_config c = lm_moe_config_default(8, 1024, 16, 2);
    layer L;
    layer_init(&L, &c, 90);
    lm_rng r;
    lm_rng_seed(&r, 91);
    int64_t m = 256;
    float *x = mallocCheck((size_t)(m * 8) * 4), *y = mallocCheck((size_t)(m * 8) * 4);
    fill_normal(x, (size_t)(m * 8), 1.0, &r);
    lm_moe_acts acts;
    lm_moe_acts_alloc(&acts, &c, m);
    CHECK(lm_moe_forward(y, x, NULL, &c, &L.p, &acts, m) == LM_OK, "%s", lm_last_error());
    CHECK(acts.offsets[1024] == m * 16, "grouped rows %lld", (long long)acts.offsets[1024]);
    int repeats = 0;
    for (int64_t i = 0; i < m; i++)
        for (int u = 0; u < 16; u++)
            for (int v = 0; v < u; v++) repeats += acts.topk[i * 16 + u] == acts.topk[i * 16 + v];
    CHECK(!repeats, "%d repeated experts", repeats);
    lm_moe_acts_free(&acts);
    layer_free(&L);
    free(x);
    free(y);
}

static void test_config_errors_name_the_bad_value(void) {
    lm_moe_config c = lm_moe_config_default(8, 3, 1, 4);
    CHECK(lm_moe_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "n_experts"), "n = 3");
    c = lm_moe_config_default(8, 1025, 1, 4);
    CHECK(lm_moe_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "1025"), "n = 1025");
    c = lm_moe_config_default(8, 64, 17, 4);
    CHECK(lm_moe_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "top_k"), "k = 17");
    c = lm_moe_config_default(8, 4, 5, 4);
    CHECK(lm_moe_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "top_k"), "k > n");
    c = lm_moe_config_default(8, 8, 2, 4);
    c.n_shared = 1;
    CHECK(lm_moe_check(&c) == LM_ERR_ARG && strstr(lm_last_error(), "d_ff_shared"), "shared width 0");
    float s[8] = {0.1f, 0.2f, NAN, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f};
    int32_t t[2 * 2];
    CHECK(lm_router_select(t, NULL, s, NULL, 2, 4, 2, 1.0f) == LM_ERR_NUMERIC && strstr(lm_last_error(), "token 0"),
          "NaN score named");
}

/* ---- the CLI round trip: `longmoe op moe` and `longmoe op route` ---- */

static char tmpdir[256];

static const char *tmp_path(const char *name) { return test_path(tmpdir, name); }

static int run_cli(const char *args) { return test_run_cli(args, tmp_path("out.txt"), tmp_path("err.txt")); }

static int file_has(const char *name, const char *phrase) {
    FILE *f = fopen(tmp_path(name), "rb");
    if (!f) return 0;
    char buf[4096] = {0};
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    buf[got] = 0;
    fclose(f);
    return strstr(buf, phrase) != NULL;
}

/* max |a - b| of a float tensor in a file against a buffer (INFINITY if absent or misshapen) */
static double tensor_diff(const lm_safetensors *st, const char *name, const float *want, size_t len) {
    const lm_st_tensor *t = lm_safetensors_find(st, name);
    if (!t || t->dtype != LM_DTYPE_F32 || (size_t)t->numel != len) return INFINITY;
    double worst = 0;
    for (size_t i = 0; i < len; i++) {
        float v;
        memcpy(&v, (const char *)t->data + i * 4, 4);
        worst = fmax(worst, fabs((double)v - want[i]));
        if (isnan(v)) return INFINITY;
    }
    return worst;
}

static int tensor_equal_i32(const lm_safetensors *st, const char *name, const int32_t *want, size_t len) {
    const lm_st_tensor *t = lm_safetensors_find(st, name);
    return t && t->dtype == LM_DTYPE_I32 && (size_t)t->numel == len && !memcmp(t->data, want, len * 4);
}

static void test_op_moe_cli_equals_the_library_call(void) {
    lm_moe_config c = small_config(LM_EXPERT_SITU_GLU, 1, 2);
    layer L;
    layer_init(&L, &c, 300);
    lm_rng r;
    lm_rng_seed(&r, 301);
    int64_t m = 20;
    int d = c.d, n = c.n_experts, k = c.top_k, f = c.d_ff, dl = c.d_latent, fs = c.d_ff_shared;
    float x[20 * 12], dy[20 * 12], y[20 * 12], dx[20 * 12] = {0}, b[8];
    fill_normal(x, sizeof x / 4, 1.0, &r);
    fill_normal(dy, sizeof dy / 4, 1.0, &r);
    fill_normal(b, 8, 0.05, &r);
    lm_moe_acts acts;
    lm_moe_acts_alloc(&acts, &c, m);
    lm_moe_forward(y, x, b, &c, &L.p, &acts, m);
    lm_moe_backward(dx, &L.g, dy, x, NULL, &c, &L.p, &acts);

    lm_st_writer *w = lm_st_writer_new();
    int64_t sx[2] = {m, d}, sr[2] = {n, d}, sg[3] = {n, f, dl}, sd[3] = {n, dl, f}, sld[2] = {dl, d};
    int64_t sln[1] = {dl}, slu[2] = {d, dl}, ssg[3] = {2, fs, d}, ssd[3] = {2, d, fs}, sb[1] = {n};
    lm_st_writer_add(w, "x", LM_DTYPE_F32, 2, sx, x);
    lm_st_writer_add(w, "dy", LM_DTYPE_F32, 2, sx, dy);
    lm_st_writer_add(w, "b", LM_DTYPE_F32, 1, sb, b);
    lm_st_writer_add(w, "router", LM_DTYPE_F32, 2, sr, L.p.router);
    lm_st_writer_add(w, "gate", LM_DTYPE_F32, 3, sg, L.p.gate);
    lm_st_writer_add(w, "up", LM_DTYPE_F32, 3, sg, L.p.up);
    lm_st_writer_add(w, "down", LM_DTYPE_F32, 3, sd, L.p.down);
    lm_st_writer_add(w, "lat_down", LM_DTYPE_F32, 2, sld, L.p.lat_down);
    lm_st_writer_add(w, "lat_norm", LM_DTYPE_F32, 1, sln, L.p.lat_norm);
    lm_st_writer_add(w, "lat_up", LM_DTYPE_F32, 2, slu, L.p.lat_up);
    lm_st_writer_add(w, "shared_gate", LM_DTYPE_F32, 3, ssg, L.p.shared_gate);
    lm_st_writer_add(w, "shared_up", LM_DTYPE_F32, 3, ssg, L.p.shared_up);
    lm_st_writer_add(w, "shared_down", LM_DTYPE_F32, 3, ssd, L.p.shared_down);
    lm_st_writer_set_metadata(w, "top_k", "3");
    lm_st_writer_set_metadata(w, "act", "situ");
    CHECK(lm_st_writer_save(w, tmp_path("moe_in.safetensors")) == LM_OK, "%s", lm_last_error());
    lm_st_writer_free(w);

    char args[1024];
    snprintf(args, sizeof args, "op moe --in %s --out %s --backward --route-scale 2.5",
             tmp_path("moe_in.safetensors"), tmp_path("moe_out.safetensors"));
    CHECK(run_cli(args) == 0, "op moe exit code");
    lm_safetensors *st = NULL;
    CHECK(lm_safetensors_open(tmp_path("moe_out.safetensors"), &st) == LM_OK, "%s", lm_last_error());
    if (st) {
        CHECK(tensor_diff(st, "y", y, (size_t)(m * d)) <= 1e-6, "y differs");
        CHECK(tensor_diff(st, "weights", acts.weights, (size_t)(m * k)) <= 1e-6, "weights differ");
        CHECK(tensor_equal_i32(st, "topk", acts.topk, (size_t)(m * k)), "topk differs");
        CHECK(tensor_diff(st, "dx", dx, (size_t)(m * d)) <= 1e-5, "dx differs");
        CHECK(tensor_diff(st, "drouter", L.g.router, (size_t)(n * d)) <= 1e-5, "drouter differs");
        CHECK(tensor_diff(st, "dgate", L.g.gate, (size_t)(n * f * dl)) <= 1e-5, "dgate differs");
        CHECK(tensor_diff(st, "dlat_norm", L.g.lat_norm, (size_t)dl) <= 1e-5, "dlat_norm differs");
        CHECK(tensor_diff(st, "dshared_down", L.g.shared_down, (size_t)(2 * d * fs)) <= 1e-5,
              "dshared_down differs");
        lm_safetensors_close(st);
    }
    /* a missing dy with --backward, and a bad activation, fail with a clear message */
    lm_st_writer *w2 = lm_st_writer_new();
    lm_st_writer_add(w2, "x", LM_DTYPE_F32, 2, sx, x);
    lm_st_writer_add(w2, "router", LM_DTYPE_F32, 2, sr, L.p.router);
    int64_t sg2[3] = {n, f, d}, sd2[3] = {n, d, f};
    lm_st_writer_add(w2, "gate", LM_DTYPE_F32, 3, sg2, L.p.gate);
    lm_st_writer_add(w2, "up", LM_DTYPE_F32, 3, sg2, L.p.up);
    lm_st_writer_add(w2, "down", LM_DTYPE_F32, 3, sd2, L.p.down);
    lm_st_writer_save(w2, tmp_path("moe_plain.safetensors"));
    lm_st_writer_free(w2);
    snprintf(args, sizeof args, "op moe --in %s --out %s --k 2 --backward", tmp_path("moe_plain.safetensors"),
             tmp_path("bad.safetensors"));
    CHECK(run_cli(args) == 1 && file_has("err.txt", "'dy'"), "missing dy named");
    snprintf(args, sizeof args, "op moe --in %s --out %s --k 2 --act relu", tmp_path("moe_plain.safetensors"),
             tmp_path("bad.safetensors"));
    CHECK(run_cli(args) == 1 && file_has("err.txt", "relu"), "bad activation named");
    snprintf(args, sizeof args, "op moe --in %s --out %s", tmp_path("moe_plain.safetensors"),
             tmp_path("bad.safetensors"));
    CHECK(run_cli(args) == 1 && file_has("err.txt", "--k"), "missing k named");
    CHECK(access(tmp_path("bad.safetensors"), F_OK) != 0, "a failed run wrote no output");
    lm_moe_acts_free(&acts);
    layer_free(&L);
}

static void test_op_route_cli_equals_the_library_update(void) {
    lm_rng r;
    lm_rng_seed(&r, 310);
    int64_t m = 500;
    int n = 16, k = 3;
    float *s = mallocCheck((size_t)(m * n) * 4), b[16];
    for (int64_t q = 0; q < m * n; q++) s[q] = (float)(1.0 / (1.0 + exp(-(lm_rng_normal(&r) + (q % n == 5)))));
    fill_normal(b, 16, 0.05, &r);
    lm_st_writer *w = lm_st_writer_new();
    int64_t ss[2] = {m, n}, sb[1] = {n};
    lm_st_writer_add(w, "s", LM_DTYPE_F32, 2, ss, s);
    lm_st_writer_add(w, "b", LM_DTYPE_F32, 1, sb, b);
    lm_st_writer_save(w, tmp_path("route_in.safetensors"));
    lm_st_writer_free(w);
    const char *variants[3] = {"--bias-update quantile", "--bias-update quantile --exact --bins 64",
                               "--bias-update sign"};
    for (int v = 0; v < 3; v++) {
        lm_balance_config bc = lm_balance_config_default(v == 2 ? LM_BALANCE_SIGN : LM_BALANCE_QUANTILE, n, k, m);
        if (v == 1) bc.estimator = LM_QB_EXACT;
        lm_balance_state bal;
        lm_balance_init(&bal, &bc);
        memcpy(bal.bias, b, sizeof b);
        int32_t *topk = mallocCheck((size_t)(m * k) * 4);
        float *wts = mallocCheck((size_t)(m * k) * 4);
        lm_router_select(topk, wts, s, bal.bias, m, n, k, 1.0f);
        lm_balance_stats stats;
        lm_balance_observe(&bal, s, m, 1);
        lm_balance_step_end(&bal, 1, &stats);
        char args[1024];
        snprintf(args, sizeof args, "op route --in %s --out %s --k 3 %s", tmp_path("route_in.safetensors"),
                 tmp_path("route_out.safetensors"), variants[v]);
        CHECK(run_cli(args) == 0, "op route %s: exit code", variants[v]);
        CHECK(file_has("out.txt", "maxvio_batch"), "summary line printed");
        lm_safetensors *st = NULL;
        CHECK(lm_safetensors_open(tmp_path("route_out.safetensors"), &st) == LM_OK, "%s", lm_last_error());
        if (st) {
            CHECK(tensor_equal_i32(st, "topk", topk, (size_t)(m * k)), "%s: topk", variants[v]);
            CHECK(tensor_diff(st, "weights", wts, (size_t)(m * k)) == 0.0, "%s: weights", variants[v]);
            CHECK(tensor_equal_i32(st, "load", stats.load, (size_t)n), "%s: load", variants[v]);
            CHECK(tensor_diff(st, "b", bal.bias, (size_t)n) == 0.0, "%s: updated b", variants[v]);
            CHECK(tensor_diff(st, "b", b, (size_t)n) > 0.0, "%s: b moved", variants[v]);
            lm_safetensors_close(st);
        }
        lm_balance_free(&bal);
        free(topk);
        free(wts);
    }
    char args[1024];
    snprintf(args, sizeof args, "op route --in %s --out %s --k 0", tmp_path("route_in.safetensors"),
             tmp_path("bad.safetensors"));
    CHECK(run_cli(args) == 2 && file_has("err.txt", "--k"), "k = 0 rejected");
    snprintf(args, sizeof args, "op route --in %s --out %s --k 16 --bias-update quantile",
             tmp_path("route_in.safetensors"), tmp_path("bad.safetensors"));
    CHECK(run_cli(args) == 1 && file_has("err.txt", "top_k"), "k = n rejected for quantile");
    snprintf(args, sizeof args, "op route --in %s --out %s --k 2 --bias-update median",
             tmp_path("route_in.safetensors"), tmp_path("bad.safetensors"));
    CHECK(run_cli(args) == 2 && file_has("err.txt", "median"), "unknown update rule named");
    CHECK(access(tmp_path("bad.safetensors"), F_OK) != 0, "a failed run wrote no output");
    /* without --out: the summary only */
    snprintf(args, sizeof args, "op route --in %s --k 2 --bias-update sign", tmp_path("route_in.safetensors"));
    CHECK(run_cli(args) == 0 && file_has("out.txt", "maxvio_batch"), "summary without --out");
    free(s);
}

int main(void) {
    RUN(test_router_picks_k_distinct_experts_by_score_plus_bias);
    RUN(test_grouping_is_a_stable_permutation_by_expert);
    RUN(test_forward_matches_float64_reference);
    RUN(test_backward_matches_finite_differences_routing_fixed);
    RUN(test_router_gradient_with_extra_score_gradient);
    RUN(test_without_extra_router_gradient_flows_only_through_weights);
    RUN(test_situ_glu_is_bounded_and_its_derivative_is_right);
    RUN(test_layer_routes_every_token_to_k_experts_at_1024);
    RUN(test_config_errors_name_the_bad_value);
    if (test_make_tmpdir(tmpdir, sizeof tmpdir, "moe")) return 1;
    RUN(test_op_moe_cli_equals_the_library_call);
    RUN(test_op_route_cli_equals_the_library_update);
    test_remove_tree(tmpdir);
    return test_summary();
}
