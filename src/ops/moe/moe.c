/* The MoE layer: router, grouped GLU experts, optional LatentMoE projection
 * and shared experts; forward and backward (include/longmoe/moe.h; SPEC §4). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/linear.h"
#include "longmoe/moe.h"
#include "moe_internal.h"

lm_moe_config lm_moe_config_default(int d, int n_experts, int top_k, int d_ff) {
    lm_moe_config c;
    memset(&c, 0, sizeof c);
    c.d = d;
    c.n_experts = n_experts;
    c.top_k = top_k;
    c.d_ff = d_ff;
    c.act = LM_EXPERT_SWIGLU;
    c.route_scale = 1.0f;
    c.norm_eps = 1e-6f;
    return c;
}

lm_status lm_moe_check(const lm_moe_config *c) {
    if (c->d < 1) return lm_error(LM_ERR_ARG, "moe: model width d must be >= 1, got %d", c->d);
    if (c->n_experts < LM_MOE_MIN_EXPERTS || c->n_experts > LM_MOE_MAX_EXPERTS)
        return lm_error(LM_ERR_ARG, "moe: n_experts must lie in [%d, %d], got %d", LM_MOE_MIN_EXPERTS,
                        LM_MOE_MAX_EXPERTS, c->n_experts);
    if (c->top_k < 1 || c->top_k > LM_MOE_MAX_TOPK || c->top_k > c->n_experts)
        return lm_error(LM_ERR_ARG, "moe: top_k must lie in [1, min(%d, n_experts = %d)], got %d",
                        LM_MOE_MAX_TOPK, c->n_experts, c->top_k);
    if (c->d_ff < 1) return lm_error(LM_ERR_ARG, "moe: expert hidden width d_ff must be >= 1, got %d", c->d_ff);
    if (c->d_latent < 0)
        return lm_error(LM_ERR_ARG, "moe: d_latent must be >= 0 (0 = no LatentMoE), got %d", c->d_latent);
    if (c->n_shared < 0) return lm_error(LM_ERR_ARG, "moe: n_shared must be >= 0, got %d", c->n_shared);
    if (c->n_shared > 0 && c->d_ff_shared < 1)
        return lm_error(LM_ERR_ARG, "moe: d_ff_shared must be >= 1 with %d shared experts, got %d",
                        c->n_shared, c->d_ff_shared);
    if (c->act != LM_EXPERT_SWIGLU && c->act != LM_EXPERT_SITU_GLU)
        return lm_error(LM_ERR_ARG, "moe: unknown expert activation %d", (int)c->act);
    if (!isfinite(c->route_scale) || c->route_scale <= 0.0f)
        return lm_error(LM_ERR_ARG, "moe: route_scale must be finite and > 0, got %g", (double)c->route_scale);
    if (c->d_latent > 0 && !(c->norm_eps > 0.0f))
        return lm_error(LM_ERR_ARG, "moe: norm_eps must be > 0, got %g", (double)c->norm_eps);
    if ((int64_t)c->n_experts * c->d_ff * (c->d_latent ? c->d_latent : c->d) > (int64_t)1 << 40)
        return lm_error(LM_ERR_ARG, "moe: expert weights too large (n %d x d_ff %d x width)", c->n_experts,
                        c->d_ff);
    return LM_OK;
}

static int expert_width(const lm_moe_config *c) { return c->d_latent > 0 ? c->d_latent : c->d; }

/* The parameter table: name, size. One place defines the layout. */
static void param_sizes(const lm_moe_config *c, size_t sz[10]) {
    size_t n = (size_t)c->n_experts, d = (size_t)c->d, f = (size_t)c->d_ff, de = (size_t)expert_width(c);
    size_t dl = (size_t)c->d_latent, ns = (size_t)c->n_shared, fs = (size_t)c->d_ff_shared;
    sz[0] = n * d;                         /* router */
    sz[1] = n * f * de;                    /* gate */
    sz[2] = n * f * de;                    /* up */
    sz[3] = n * de * f;                    /* down */
    sz[4] = dl * d;                        /* lat_down */
    sz[5] = dl;                            /* lat_norm */
    sz[6] = d * dl;                        /* lat_up */
    sz[7] = ns * fs * d;                   /* shared_gate */
    sz[8] = ns * fs * d;                   /* shared_up */
    sz[9] = ns * d * fs;                   /* shared_down */
}

size_t lm_moe_param_count(const lm_moe_config *c) {
    size_t sz[10], total = 0;
    param_sizes(c, sz);
    for (int i = 0; i < 10; i++) total += sz[i];
    return total;
}

void lm_moe_params_carve(const lm_moe_config *c, float *memory, lm_moe_params *p) {
    size_t sz[10];
    param_sizes(c, sz);
    float **ptrs[10] = {&p->router, &p->gate, &p->up, &p->down, &p->lat_down, &p->lat_norm, &p->lat_up,
                        &p->shared_gate, &p->shared_up, &p->shared_down};
    for (int i = 0; i < 10; i++) {
        *ptrs[i] = sz[i] ? memory : NULL;
        memory += sz[i];
    }
}

/* The activation table: where each buffer goes and how many bytes it takes
 * (lm_moe_acts_alloc carves it, lm_moe_acts_bytes sums it). */
typedef struct {
    void **ptr;
    size_t bytes;
} acts_slot;
#define ACTS_SLOTS 32

static void acts_table(lm_moe_acts *a, const lm_moe_config *c, int64_t m_max, acts_slot t[ACTS_SLOTS]) {
    size_t m = (size_t)m_max, n = (size_t)c->n_experts, k = (size_t)c->top_k, f = (size_t)c->d_ff;
    size_t d = (size_t)c->d, de = (size_t)expert_width(c), dl = (size_t)c->d_latent;
    size_t ns = (size_t)c->n_shared, fs = (size_t)c->d_ff_shared, mk = m * k;
    acts_slot tt[ACTS_SLOTS] = {
        {(void **)&a->s, m * n * 4},        {(void **)&a->topk, mk * 4},
        {(void **)&a->weights, mk * 4},     {(void **)&a->offsets, (n + 1) * 8},
        {(void **)&a->order, mk * 4},       {(void **)&a->slot_row, mk * 4},
        {(void **)&a->x_lat, m * dl * 4},   {(void **)&a->xg, mk * de * 4},
        {(void **)&a->ga, mk * f * 4},      {(void **)&a->gu, mk * f * 4},
        {(void **)&a->gh, mk * f * 4},      {(void **)&a->gout, mk * de * 4},
        {(void **)&a->z, m * de * 4},       {(void **)&a->rstd, dl ? m * 4 : 0},
        {(void **)&a->zn, m * dl * 4},      {(void **)&a->sa, ns * m * fs * 4},
        {(void **)&a->su, ns * m * fs * 4}, {(void **)&a->sh, ns * m * fs * 4},
        {(void **)&a->ytmp, ns ? m * d * 4 : 0},
        {(void **)&a->dz, m * de * 4},      {(void **)&a->dzn, m * dl * 4},
        {(void **)&a->dgout, mk * de * 4},  {(void **)&a->dh, mk * f * 4},
        {(void **)&a->da, mk * f * 4},      {(void **)&a->du, mk * f * 4},
        {(void **)&a->dxg, mk * de * 4},    {(void **)&a->dx_lat, m * de * 4},
        {(void **)&a->dp, mk * 4},          {(void **)&a->dr, m * n * 4},
        {(void **)&a->dsh, ns ? m * fs * 4 : 0}, {(void **)&a->dsa, ns ? m * fs * 4 : 0},
        {(void **)&a->dsu, ns ? m * fs * 4 : 0},
    };
    memcpy(t, tt, sizeof tt);
}

static lm_status acts_check(const lm_moe_config *c, int64_t m_max) {
    lm_status st = lm_moe_check(c);
    if (st) return st;
    if (m_max < 1 || m_max * c->top_k > INT32_MAX)
        return lm_error(LM_ERR_ARG, "moe: token capacity m_max must lie in [1, 2^31 / top_k], got %lld",
                        (long long)m_max);
    return LM_OK;
}

size_t lm_moe_acts_bytes(const lm_moe_config *c, int64_t m_max) {
    if (acts_check(c, m_max)) return 0;
    lm_moe_acts a;
    acts_slot t[ACTS_SLOTS];
    acts_table(&a, c, m_max, t);
    size_t total = 0;
    for (int i = 0; i < ACTS_SLOTS; i++) total += (t[i].bytes + 63) / 64 * 64;
    return total;
}

lm_status lm_moe_acts_alloc(lm_moe_acts *a, const lm_moe_config *c, int64_t m_max) {
    memset(a, 0, sizeof *a);
    lm_status st = acts_check(c, m_max);
    if (st) return st;
    acts_slot t[ACTS_SLOTS];
    acts_table(a, c, m_max, t);
    size_t total = lm_moe_acts_bytes(c, m_max);
    char *block;
    LM_TRY_ALLOC(block, total);
    size_t off = 0;
    for (int i = 0; i < ACTS_SLOTS; i++) {
        *t[i].ptr = t[i].bytes ? block + off : NULL;
        off += (t[i].bytes + 63) / 64 * 64;
    }
    a->block = block;
    a->m_max = m_max;
    a->m = 0;
    return LM_OK;
}

void lm_moe_acts_free(lm_moe_acts *a) {
    free(a->block);
    memset(a, 0, sizeof *a);
}

float lm_expert_act_forward(lm_expert_act act, float a, float u) {
    if (act == LM_EXPERT_SITU_GLU)
        /* SiTU-GLU [K3]: 4 tanh(a/4) sigmoid(a) * 25 tanh(u/25) */
        return 4.0f * tanhf(0.25f * a) * lm_sigmoidf(a) * 25.0f * tanhf(u / 25.0f);
    return lm_siluf(a) * u;
}

void lm_expert_act_backward(lm_expert_act act, float a, float u, float *dh_da, float *dh_du) {
    float sg = lm_sigmoidf(a);
    if (act == LM_EXPERT_SITU_GLU) {
        float ta = tanhf(0.25f * a), tu = tanhf(u / 25.0f);
        float fa = 4.0f * ta * sg, gu = 25.0f * tu;
        /* d/da [4 tanh(a/4) sigma(a)] = (1 - tanh^2) sigma + 4 tanh sigma (1 - sigma) */
        *dh_da = ((1.0f - ta * ta) * sg + fa * (1.0f - sg)) * gu;
        *dh_du = fa * (1.0f - tu * tu);
        return;
    }
    *dh_da = u * sg * (1.0f + a * (1.0f - sg));
    *dh_du = a * sg;
}

/* One GLU expert on n rows: a = x Wg^T, u = x Wu^T, h = act(a,u), out = h Wd^T. */
void lm_moe_glu_forward(float *out, float *a, float *u, float *h, const float *x, const float *wg,
                        const float *wu, const float *wd, int64_t rows, int din, int f, int dout,
                        lm_expert_act act) {
    // x is (rows,din); a, u, h are (rows,f); out is (rows,dout)
    lm_matmul_forward(a, x, wg, NULL, rows, din, f);
    lm_matmul_forward(u, x, wu, NULL, rows, din, f);
    int64_t total = rows * f;
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < total; e++) h[e] = lm_expert_act_forward(act, a[e], u[e]);
    lm_matmul_forward(out, h, wd, NULL, rows, f, dout);
}

/* Backward of glu_forward. dx (+=), dwg, dwu, dwd (+=, may be NULL); dh, da, du scratch. */
void lm_moe_glu_backward(float *dx, float *dwg, float *dwu, float *dwd, float *dh, float *da, float *du,
                         const float *dout, const float *x, const float *a, const float *u,
                         const float *h, const float *wg, const float *wu, const float *wd, int64_t rows,
                         int din, int f, int dim_out, lm_expert_act act) {
    // dout is (rows,dim_out); x, dx (rows,din); a, u, h, dh, da, du (rows,f)
    int64_t total = rows * f;
    memset(dh, 0, (size_t)total * sizeof *dh);
    lm_matmul_backward(dh, dwd, NULL, dout, h, wd, rows, f, dim_out);
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < total; e++) {
        float ga, gu;
        lm_expert_act_backward(act, a[e], u[e], &ga, &gu);
        da[e] = dh[e] * ga;
        du[e] = dh[e] * gu;
    }
    lm_matmul_backward(dx, dwg, NULL, da, x, wg, rows, din, f);
    lm_matmul_backward(dx, dwu, NULL, du, x, wu, rows, din, f);
}

lm_status lm_moe_forward(float *y, const float *x, const float *b, const lm_moe_config *c,
                         const lm_moe_params *p, lm_moe_acts *a, int64_t m) {
    return lm_moe_forward_ep(y, x, b, c, p, a, m, NULL);
}

lm_status lm_moe_backward(float *dx, lm_moe_params *g, const float *dy, const float *x,
                          const float *dscores_extra, const lm_moe_config *c, const lm_moe_params *p,
                          lm_moe_acts *a) {
    return lm_moe_backward_ep(dx, g, dy, x, dscores_extra, c, p, a, NULL);
}

lm_status lm_moe_forward_ep(float *y, const float *x, const float *b, const lm_moe_config *c,
                            const lm_moe_params *p, lm_moe_acts *a, int64_t m, lm_moe_ep *ep) {
    // x, y are (m,d); b is (n); everything the backward needs goes to acts
    lm_status st = lm_moe_check(c);
    if (st) return st;
    if (m < 0 || m > a->m_max)
        return lm_error(LM_ERR_ARG, "moe: token count m = %lld exceeds the activation capacity %lld",
                        (long long)m, (long long)a->m_max);
    int n = c->n_experts, k = c->top_k, d = c->d, f = c->d_ff, de = expert_width(c), dl = c->d_latent;
    int fs = c->d_ff_shared;
    a->m = m;

    /* router in fp32: s = sigmoid(W_r x) */
    lm_matmul_forward(a->s, x, p->router, NULL, m, d, n);
    int64_t mn = m * n;
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < mn; e++) a->s[e] = lm_sigmoidf(a->s[e]);
    /* T_i = argtop_k(s_i + b); p = scale * s / sum over T_i (SPEC §4) */
    st = lm_router_select(a->topk, a->weights, a->s, b, m, n, k, c->route_scale);
    if (ep) st = lm_moe_ep_agree(ep, st); /* a rank that fails stops every rank before the exchange */
    if (st) return st;
    lm_moe_group_by_expert(a->offsets, a->order, a->slot_row, a->topk, m, n, k);

    /* LatentMoE: routed experts work on W_down_lat x */
    const float *xe = x;
    if (dl > 0) {
        lm_matmul_forward(a->x_lat, x, p->lat_down, NULL, m, d, dl);
        xe = a->x_lat;
    }
    int64_t mk = m * k;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < mk; g++)
        memcpy(a->xg + g * de, xe + (int64_t)(a->order[g] / k) * de, (size_t)de * sizeof(float));

    /* each expert is one dense product over its contiguous rows (under expert
     * parallelism, on the rank that owns it) */
    if (ep) {
        st = lm_moe_ep_experts_forward(ep, a, c, p);
        if (st) return st;
    }
    for (int j = 0; j < (ep ? 0 : n); j++) {
        int64_t o = a->offsets[j], rows = a->offsets[j + 1] - o;
        if (!rows) continue;
        size_t wo = (size_t)j * f * de;
        lm_moe_glu_forward(a->gout + o * de, a->ga + o * f, a->gu + o * f, a->gh + o * f, a->xg + o * de,
                    p->gate + wo, p->up + wo, p->down + wo, rows, de, f, de, c->act);
    }

    /* weighted sum in token order: z_i = sum_t p_it E_{T_it}(x_i) */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        float *zi = a->z + i * de;
        memset(zi, 0, (size_t)de * sizeof *zi);
        for (int t = 0; t < k; t++) {
            float w = a->weights[i * k + t];
            const float *go = a->gout + (int64_t)a->slot_row[i * k + t] * de;
            for (int e = 0; e < de; e++) zi[e] += w * go[e];
        }
    }

    if (dl > 0) {
        /* LatentMoE: y = W_up_lat RMSNorm(z) */
        lm_rmsnorm_forward(a->zn, a->rstd, a->z, p->lat_norm, m, dl, c->norm_eps);
        lm_matmul_forward(y, a->zn, p->lat_up, NULL, m, dl, d);
    } else {
        memcpy(y, a->z, (size_t)(m * d) * sizeof *y);
    }

    /* shared experts at full width, added to every token */
    for (int e = 0; e < c->n_shared; e++) {
        size_t wo = (size_t)e * fs * d, ao = (size_t)e * m * fs;
        lm_moe_glu_forward(a->ytmp, a->sa + ao, a->su + ao, a->sh + ao, x, p->shared_gate + wo,
                    p->shared_up + wo, p->shared_down + wo, m, d, fs, d, c->act);
        int64_t md = m * d;
#pragma omp parallel for schedule(static)
        for (int64_t q = 0; q < md; q++) y[q] += a->ytmp[q];
    }
    return LM_OK;
}

lm_status lm_moe_backward_ep(float *dx, lm_moe_params *g, const float *dy, const float *x,
                             const float *dscores_extra, const lm_moe_config *c, const lm_moe_params *p,
                             lm_moe_acts *a, lm_moe_ep *ep) {
    // dy, x, dx are (m,d); dscores_extra is (m,n); gradients have the parameters' shapes
    lm_status st = lm_moe_check(c);
    if (st) return st;
    int64_t m = a->m;
    int n = c->n_experts, k = c->top_k, d = c->d, f = c->d_ff, de = expert_width(c), dl = c->d_latent;
    int fs = c->d_ff_shared;
    int64_t mk = m * k;
    /* dx is written: its contributions below add to zero */
    if (dx && m > 0) memset(dx, 0, (size_t)(m * d) * sizeof *dx);

    /* shared experts */
    for (int e = 0; e < c->n_shared; e++) {
        size_t wo = (size_t)e * fs * d, ao = (size_t)e * m * fs;
        lm_moe_glu_backward(dx, g->shared_gate ? g->shared_gate + wo : NULL, g->shared_up ? g->shared_up + wo : NULL,
                     g->shared_down ? g->shared_down + wo : NULL, a->dsh, a->dsa, a->dsu, dy, x, a->sa + ao,
                     a->su + ao, a->sh + ao, p->shared_gate + wo, p->shared_up + wo, p->shared_down + wo, m, d,
                     fs, d, c->act);
    }

    /* gradient of z, the weighted sum of routed outputs */
    const float *dz = dy;
    if (dl > 0) {
        memset(a->dzn, 0, (size_t)(m * dl) * sizeof(float));
        lm_matmul_backward(a->dzn, g->lat_up, NULL, dy, a->zn, p->lat_up, m, dl, d);
        memset(a->dz, 0, (size_t)(m * dl) * sizeof(float));
        lm_rmsnorm_backward(a->dz, g->lat_norm, a->dzn, a->z, p->lat_norm, a->rstd, m, dl, c->norm_eps);
        dz = a->dz;
    }

    /* per slot: d E-output = p * dz_i, and dp_it = <dz_i, E_{T_it}(x_i)> */
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < mk; row++) {
        int64_t slot = a->order[row], i = slot / k;
        const float *dzi = dz + i * de, *go = a->gout + row * de;
        float w = a->weights[slot], dot = 0.0f;
        float *dgo = a->dgout + row * de;
        for (int e = 0; e < de; e++) {
            dgo[e] = w * dzi[e];
            dot += dzi[e] * go[e];
        }
        a->dp[slot] = dot;
    }

    /* experts, one dense backward each (on their owners) */
    memset(a->dxg, 0, (size_t)(mk * de) * sizeof(float));
    if (ep) {
        st = lm_moe_ep_experts_backward(ep, a, c, p, g);
        if (st) return st;
    }
    for (int j = 0; j < (ep ? 0 : n); j++) {
        int64_t o = a->offsets[j], rows = a->offsets[j + 1] - o;
        if (!rows) continue;
        size_t wo = (size_t)j * f * de;
        lm_moe_glu_backward(a->dxg + o * de, g->gate ? g->gate + wo : NULL, g->up ? g->up + wo : NULL,
                     g->down ? g->down + wo : NULL, a->dh + o * f, a->da + o * f, a->du + o * f,
                     a->dgout + o * de, a->xg + o * de, a->ga + o * f, a->gu + o * f, a->gh + o * f,
                     p->gate + wo, p->up + wo, p->down + wo, rows, de, f, de, c->act);
    }

    /* scatter the grouped input gradients back to tokens (token order: deterministic) */
    float *dxe = a->dx_lat;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        float *di = dxe + i * de;
        memset(di, 0, (size_t)de * sizeof *di);
        for (int t = 0; t < k; t++) {
            const float *src = a->dxg + (int64_t)a->slot_row[i * k + t] * de;
            for (int e = 0; e < de; e++) di[e] += src[e];
        }
    }
    if (dl > 0) {
        lm_matmul_backward(dx, g->lat_down, NULL, dxe, x, p->lat_down, m, d, dl);
    } else if (dx) {
        int64_t md = m * d;
#pragma omp parallel for schedule(static)
        for (int64_t q = 0; q < md; q++) dx[q] += dxe[q];
    }

    /* router: p_t = c s_t / S with S = sum over the chosen set, so
     * ds_t = (c / S) dp_t - (1 / S) sum_u dp_u p_u, then dr = ds s (1 - s) */
    float cs = c->route_scale;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        const float *si = a->s + i * n;
        const int32_t *ti = a->topk + i * k;
        float *dpi = a->dp + i * k;
        const float *pi = a->weights + i * k;
        float sum = 0.0f, dot = 0.0f;
        for (int t = 0; t < k; t++) {
            sum += si[ti[t]];
            dot += dpi[t] * pi[t];
        }
        for (int t = 0; t < k; t++) {
            float sv = si[ti[t]];
            float ds = sum > 0.0f ? (cs * dpi[t] - dot) / sum : 0.0f;
            dpi[t] = ds * sv * (1.0f - sv); /* dp now holds dr of the chosen experts */
        }
    }
    if (dscores_extra) {
        /* dense path: dr = (extra + sparse) * s (1 - s) over all n experts */
        int64_t mn = m * n;
#pragma omp parallel for schedule(static)
        for (int64_t q = 0; q < mn; q++) a->dr[q] = dscores_extra[q] * a->s[q] * (1.0f - a->s[q]);
        for (int64_t slot = 0; slot < mk; slot++) a->dr[(slot / k) * n + a->topk[slot]] += a->dp[slot];
        lm_matmul_backward(dx, g->router, NULL, a->dr, x, p->router, m, d, n);
        return LM_OK;
    }
    /* sparse path: only the k chosen logits of each token have a gradient */
    if (dx) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            float *di = dx + i * d;
            for (int t = 0; t < k; t++) {
                float gr = a->dp[i * k + t];
                const float *w = p->router + (int64_t)a->topk[i * k + t] * d;
                for (int e = 0; e < d; e++) di[e] += gr * w[e];
            }
        }
    }
    if (g->router) {
        /* per expert over its grouped rows: each thread owns whole rows of dW_r */
#pragma omp parallel for schedule(dynamic, 4)
        for (int j = 0; j < n; j++) {
            float *dw = g->router + (int64_t)j * d;
            for (int64_t row = a->offsets[j]; row < a->offsets[j + 1]; row++) {
                int64_t slot = a->order[row];
                float gr = a->dp[slot];
                const float *xi = x + (slot / k) * d;
                for (int e = 0; e < d; e++) dw[e] += gr * xi[e];
            }
        }
    }
    return LM_OK;
}
