/* AdamW, Muon with Newton–Schulz, gradient clipping and QK-Clip
 * (include/longmoe/optim.h; docs/optim.md; SPEC §6).
 *
 * Determinism: reductions (norms) are split into a fixed number of fixed-size
 * blocks, each summed in order in double, then the block sums added in order;
 * matrix products give each output row to one thread and accumulate it in a
 * fixed order. No result depends on the thread count or scheduling. */
#include "longmoe/optim.h"
#include "longmoe/optim_device.h"

#include <math.h>
#include <omp.h>
#include <string.h>

/* Quintic Newton–Schulz coefficients (Keller Jordan's Muon; docs/optim.md). */
#define LM_NS_A 3.4445f
#define LM_NS_B (-4.7750f)
#define LM_NS_C 2.0315f

/* Number of fixed blocks a sum of squares is split into. */
#define LM_REDUCE_BLOCKS LM_SUM_SQUARES_BLOCKS
/* Below this many elements, loops run on one thread (OpenMP overhead). */
#define LM_PARALLEL_MIN 16384

static const char *param_name(const lm_param *p) { return p->name ? p->name : "(unnamed)"; }

/* ---------------------------------------------------------------------------
 * Parameters
 * ------------------------------------------------------------------------- */

int lm_param_default_weight_decay(lm_param_kind kind) {
    return kind == LM_PARAM_MATRIX || kind == LM_PARAM_EMBEDDING;
}

lm_param lm_param_matrix(const char *name, float *data, float *grad, int64_t rows, int64_t cols,
                         lm_param_kind kind) {
    lm_param p;
    memset(&p, 0, sizeof p);
    p.name = name;
    p.data = data;
    p.grad = grad;
    p.ndim = 2;
    p.rows = rows;
    p.cols = cols;
    p.n_blocks = 1;
    p.kind = kind;
    p.optimizer = LM_OPT_AUTO;
    p.weight_decay = lm_param_default_weight_decay(kind);
    return p;
}

lm_param lm_param_vector(const char *name, float *data, float *grad, int64_t n,
                         lm_param_kind kind) {
    lm_param p = lm_param_matrix(name, data, grad, n, 1, kind);
    p.ndim = n == 1 && kind == LM_PARAM_SCALAR ? 0 : 1;
    return p;
}

int64_t lm_param_numel(const lm_param *p) { return p->rows * p->cols; }

static int param_blocks(const lm_param *p) { return p->n_blocks > 1 ? p->n_blocks : 1; }

lm_optimizer_kind lm_param_optimizer(const lm_param *p) {
    if (p->optimizer != LM_OPT_AUTO) return p->optimizer;
    // the split rule: Muon for hidden 2-D matrices whose blocks are at least 2x2
    if (p->kind == LM_PARAM_MATRIX && p->ndim == 2 && p->rows / param_blocks(p) >= 2 &&
        p->cols >= 2)
        return LM_OPT_MUON;
    return LM_OPT_ADAMW;
}

lm_status lm_param_check(const lm_param *p) {
    if (!p) return lm_error(LM_ERR_ARG, "parameter descriptor is NULL");
    const char *nm = param_name(p);
    if (!p->data || !p->grad)
        return lm_error(LM_ERR_ARG, "parameter %s: data and grad must not be NULL", nm);
    if (p->data == p->grad)
        return lm_error(LM_ERR_ARG, "parameter %s: data and grad are the same buffer", nm);
    if (p->ndim < 0 || p->ndim > 2)
        return lm_error(LM_ERR_ARG, "parameter %s: ndim %d, want 0, 1 or 2", nm, p->ndim);
    if (p->rows < 1 || p->cols < 1)
        return lm_error(LM_ERR_ARG, "parameter %s: shape [%lld, %lld], dims must be >= 1", nm,
                        (long long)p->rows, (long long)p->cols);
    if (p->ndim == 0 && (p->rows != 1 || p->cols != 1))
        return lm_error(LM_ERR_ARG, "parameter %s: scalar with shape [%lld, %lld], want [1, 1]",
                        nm, (long long)p->rows, (long long)p->cols);
    if (p->ndim == 1 && p->cols != 1)
        return lm_error(LM_ERR_ARG, "parameter %s: vector with cols %lld, want 1", nm,
                        (long long)p->cols);
    if ((int)p->kind < 0 || p->kind >= LM_PARAM_KIND_COUNT)
        return lm_error(LM_ERR_ARG, "parameter %s: unknown kind %d", nm, (int)p->kind);
    if ((int)p->optimizer < LM_OPT_AUTO || p->optimizer > LM_OPT_MUON)
        return lm_error(LM_ERR_ARG, "parameter %s: unknown optimizer %d", nm, (int)p->optimizer);
    if (p->weight_decay != 0 && p->weight_decay != 1)
        return lm_error(LM_ERR_ARG, "parameter %s: weight_decay flag %d, want 0 or 1", nm,
                        p->weight_decay);
    if (p->n_blocks < 0)
        return lm_error(LM_ERR_ARG, "parameter %s: n_blocks %d must be >= 0", nm, p->n_blocks);
    if (p->n_blocks > 1) {
        if (p->ndim != 2)
            return lm_error(LM_ERR_ARG, "parameter %s: n_blocks %d needs a 2-D tensor", nm,
                            p->n_blocks);
        if (p->rows % p->n_blocks != 0)
            return lm_error(LM_ERR_ARG,
                            "parameter %s: rows %lld not divisible into n_blocks %d (heads)", nm,
                            (long long)p->rows, p->n_blocks);
    }
    if (p->optimizer == LM_OPT_MUON && p->ndim != 2)
        return lm_error(LM_ERR_ARG, "parameter %s: Muon needs a 2-D matrix, got ndim %d", nm,
                        p->ndim);
    return LM_OK;
}

/* ---------------------------------------------------------------------------
 * Planning
 * ------------------------------------------------------------------------- */

size_t lm_param_state_floats(const lm_param *p) {
    size_t n = (size_t)lm_param_numel(p);
    return lm_param_optimizer(p) == LM_OPT_MUON ? n : 2 * n;
}

size_t lm_optim_state_floats(const lm_param *params, int n_params) {
    size_t s = 0;
    for (int i = 0; i < n_params; i++) s += lm_param_state_floats(&params[i]);
    return s;
}

size_t lm_newton_schulz_scratch_floats(int64_t rows, int64_t cols) {
    size_t m = (size_t)(rows < cols ? rows : cols), n = (size_t)(rows < cols ? cols : rows);
    // X and its next iterate (m x n), A = X X^T and B (m x m)
    return 2 * m * n + 2 * m * m;
}

size_t lm_muon_scratch_floats(int64_t rows, int64_t cols, int n_blocks) {
    if (n_blocks < 1) n_blocks = 1;
    int slots = omp_get_max_threads();
    if (slots > n_blocks) slots = n_blocks;
    if (slots < 1) slots = 1;
    return (size_t)slots * lm_newton_schulz_scratch_floats(rows / n_blocks, cols);
}

size_t lm_optim_scratch_floats(const lm_param *params, int n_params) {
    size_t s = 0;
    for (int i = 0; i < n_params; i++) {
        const lm_param *p = &params[i];
        if (lm_param_optimizer(p) != LM_OPT_MUON) continue;
        size_t need = lm_muon_scratch_floats(p->rows, p->cols, param_blocks(p));
        if (need > s) s = need;
    }
    return s;
}

/* ---------------------------------------------------------------------------
 * Config
 * ------------------------------------------------------------------------- */

lm_optim_config lm_optim_config_default(void) {
    lm_optim_config c;
    c.weight_decay = 0.1f;
    c.adam_beta1 = 0.9f;
    c.adam_beta2 = 0.95f;
    c.adam_eps = 1e-8f;
    c.muon_momentum = 0.95f;
    c.muon_nesterov = 1;
    c.muon_ns_steps = 5;
    c.muon_rms_scale = 0.2f;
    c.muon_ns_eps = 1e-7f;
    c.muon_ns_fp32 = 0;
    return c;
}

lm_status lm_optim_config_check(const lm_optim_config *c) {
    if (!c) return lm_error(LM_ERR_ARG, "optimizer config is NULL");
    if (!(c->weight_decay >= 0.0f) || !isfinite(c->weight_decay))
        return lm_error(LM_ERR_ARG, "weight_decay %g must be finite and >= 0",
                        (double)c->weight_decay);
    if (!(c->adam_beta1 >= 0.0f && c->adam_beta1 < 1.0f))
        return lm_error(LM_ERR_ARG, "adam_beta1 %g must be in [0, 1)", (double)c->adam_beta1);
    if (!(c->adam_beta2 >= 0.0f && c->adam_beta2 < 1.0f))
        return lm_error(LM_ERR_ARG, "adam_beta2 %g must be in [0, 1)", (double)c->adam_beta2);
    if (!(c->adam_eps > 0.0f) || !isfinite(c->adam_eps))
        return lm_error(LM_ERR_ARG, "adam_eps %g must be finite and > 0", (double)c->adam_eps);
    if (!(c->muon_momentum >= 0.0f && c->muon_momentum < 1.0f))
        return lm_error(LM_ERR_ARG, "muon_momentum %g must be in [0, 1)",
                        (double)c->muon_momentum);
    if (c->muon_nesterov != 0 && c->muon_nesterov != 1)
        return lm_error(LM_ERR_ARG, "muon_nesterov %d must be 0 or 1", c->muon_nesterov);
    if (c->muon_ns_steps < 1 || c->muon_ns_steps > 100)
        return lm_error(LM_ERR_ARG, "muon_ns_steps %d must be in [1, 100]", c->muon_ns_steps);
    if (!(c->muon_rms_scale > 0.0f) || !isfinite(c->muon_rms_scale))
        return lm_error(LM_ERR_ARG, "muon_rms_scale %g must be finite and > 0",
                        (double)c->muon_rms_scale);
    if (!(c->muon_ns_eps > 0.0f) || !isfinite(c->muon_ns_eps))
        return lm_error(LM_ERR_ARG, "muon_ns_eps %g must be finite and > 0",
                        (double)c->muon_ns_eps);
    if (c->muon_ns_fp32 != 0 && c->muon_ns_fp32 != 1)
        return lm_error(LM_ERR_ARG, "muon_ns_fp32 %d must be 0 or 1", c->muon_ns_fp32);
    return LM_OK;
}

/* ---------------------------------------------------------------------------
 * Deterministic reductions and small products
 * ------------------------------------------------------------------------- */

/* sum x[i]^2 in double: LM_REDUCE_BLOCKS fixed blocks, each summed in order,
 * then the block sums in order. Same bits for any thread count. */
double lm_sum_squares_run(double s, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * (double)x[i];
    return s;
}

static double sum_squares_fixed(const float *x, int64_t n) {
    double part[LM_REDUCE_BLOCKS];
    int64_t bs = (n + LM_REDUCE_BLOCKS - 1) / LM_REDUCE_BLOCKS;
#pragma omp parallel for schedule(static) if (n >= LM_PARALLEL_MIN)
    for (int b = 0; b < LM_REDUCE_BLOCKS; b++) {
        int64_t lo = (int64_t)b * bs, hi = lo + bs < n ? lo + bs : n;
        part[b] = lo < hi ? lm_sum_squares_run(0.0, x + lo, hi - lo) : 0.0;
    }
    double s = 0.0;
    for (int b = 0; b < LM_REDUCE_BLOCKS; b++) s += part[b];
    return s;
}

double lm_sum_squares(const float *x, int64_t n) { return n > 0 ? sum_squares_fixed(x, n) : 0.0; }

/* Rows of C per task of rows_gemm_part: they share each loaded row of the right factor. */
#define LM_GEMM_ROWS 4

/* C[r, :] += sum_k L[r, k] * R[k, :] for r < nr: C (nr, nc), L (nr, nk), R (nk, nc),
 * row-major. Each output row belongs to one thread and is accumulated over k in
 * ascending order, so the result does not depend on the thread count.
 * lower = 1 (square C, symmetric result): a task of rows r0.. computes only the
 * columns j < r0 + LM_GEMM_ROWS, then the strict upper triangle is copied from the
 * lower. Each C[i][j] and C[j][i] sum the same products in the same order, so the
 * copy equals what the full product would have computed, bit for bit. */
static void rows_gemm_part(float *C, const float *L, const float *R, int64_t nr, int64_t nk,
                           int64_t nc_all, int par, int lower) {
    int64_t ntask = (nr + LM_GEMM_ROWS - 1) / LM_GEMM_ROWS;
#pragma omp parallel for schedule(static) if (par)
    for (int64_t t = 0; t < ntask; t++) {
        int64_t r0 = t * LM_GEMM_ROWS, nrow = nr - r0 < LM_GEMM_ROWS ? nr - r0 : LM_GEMM_ROWS;
        const int64_t nc = nc_all;
        const int64_t ncol = lower && r0 + nrow < nc ? r0 + nrow : nc; // columns computed
        if (nrow == LM_GEMM_ROWS) {
            float *c0 = C + r0 * nc, *c1 = c0 + nc, *c2 = c1 + nc, *c3 = c2 + nc;
            const float *l0 = L + r0 * nk, *l1 = l0 + nk, *l2 = l1 + nk, *l3 = l2 + nk;
            for (int64_t k = 0; k < nk; k++) {
                const float *rk = R + k * nc;
                float a0 = l0[k], a1 = l1[k], a2 = l2[k], a3 = l3[k];
#pragma omp simd
                for (int64_t j = 0; j < ncol; j++) {
                    float x = rk[j];
                    c0[j] += a0 * x;
                    c1[j] += a1 * x;
                    c2[j] += a2 * x;
                    c3[j] += a3 * x;
                }
            }
        } else {
            for (int64_t r = r0; r < r0 + nrow; r++)
                for (int64_t k = 0; k < nk; k++) {
                    const float *rk = R + k * nc;
                    float a = L[r * nk + k];
                    float *c = C + r * nc;
#pragma omp simd
                    for (int64_t j = 0; j < ncol; j++) c[j] += a * rk[j];
                }
        }
    }
    if (lower)
        for (int64_t i = 0; i < nr; i++)
            for (int64_t j = i + 1; j < nc_all; j++) C[i * nc_all + j] = C[j * nc_all + i];
}

/* Run `steps` quintic Newton–Schulz iterations on X = scratch[0, m*n) (m <= n),
 * which holds the already normalised input. Returns the buffer holding the result
 * (scratch or scratch + m*n). */
static const float *ns_iterate(float *scratch, int64_t m, int64_t n, int steps) {
    float *X = scratch, *Y = scratch + m * n, *A = Y + m * n, *B = A + m * m;
    int par = m * n >= LM_PARALLEL_MIN;
    for (int s = 0; s < steps; s++) {
        // A = X X^T (m x m): Y holds X^T (n x m) for the row-times-matrix form
#pragma omp parallel for schedule(static) if (par)
        for (int64_t c = 0; c < n; c++)
            for (int64_t i = 0; i < m; i++) Y[c * m + i] = X[i * n + c];
        // (A and A A are symmetric: their lower triangles are computed, then copied)
        memset(A, 0, (size_t)(m * m) * sizeof(float));
        rows_gemm_part(A, X, Y, m, n, m, par, 1);
        // B = b A + c A A
        memset(B, 0, (size_t)(m * m) * sizeof(float));
        rows_gemm_part(B, A, A, m, m, m, par, 1);
        for (int64_t i = 0; i < m * m; i++) B[i] = LM_NS_B * A[i] + LM_NS_C * B[i];
        // Y = a X + B X
        for (int64_t i = 0; i < m * n; i++) Y[i] = LM_NS_A * X[i];
        rows_gemm_part(Y, B, X, m, m, n, par, 0);
        float *t = X;
        X = Y;
        Y = t;
    }
    return X;
}

/* X = X / (||X||_F + eps) in place on count floats. */
static void ns_normalise(float *X, int64_t count, float eps) {
    double norm = sqrt(sum_squares_fixed(X, count));
    float inv = (float)(1.0 / (norm + (double)eps));
#pragma omp parallel for schedule(static) if (count >= LM_PARALLEL_MIN)
    for (int64_t i = 0; i < count; i++) X[i] *= inv;
}

lm_status lm_newton_schulz(float *out, const float *g, int64_t rows, int64_t cols, int steps,
                           float eps, float *scratch) {
    // g, out are (rows, cols); scratch holds lm_newton_schulz_scratch_floats(rows, cols)
    if (!out || !g || !scratch)
        return lm_error(LM_ERR_ARG, "newton_schulz: out, g and scratch must not be NULL");
    if (rows < 1 || cols < 1)
        return lm_error(LM_ERR_ARG, "newton_schulz: shape [%lld, %lld], dims must be >= 1",
                        (long long)rows, (long long)cols);
    if (steps < 1) return lm_error(LM_ERR_ARG, "newton_schulz: steps %d must be >= 1", steps);
    if (!(eps > 0.0f)) return lm_error(LM_ERR_ARG, "newton_schulz: eps %g must be > 0", (double)eps);
    int tr = rows > cols;
    int64_t m = tr ? cols : rows, n = tr ? rows : cols;
    float *X = scratch;
    // work on the wide orientation so the Gram matrix X X^T is the smaller side
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) X[tr ? c * n + r : r * n + c] = g[r * cols + c];
    ns_normalise(X, m * n, eps);
    const float *R = ns_iterate(scratch, m, n, steps);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) out[r * cols + c] = R[tr ? c * n + r : r * n + c];
    return LM_OK;
}

/* ---------------------------------------------------------------------------
 * AdamW
 * ------------------------------------------------------------------------- */

void lm_adamw_update(float *w, const float *g, float *m, float *v, int64_t n, float lr,
                     float beta1, float beta2, float eps, float wd, int64_t t) {
    // w, g, m, v are (n); t >= 1 is the step count after increment
    float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
    float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
    float omb1 = 1.0f - beta1, omb2 = 1.0f - beta2;
#pragma omp parallel for schedule(static) if (n >= LM_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        float mi = beta1 * m[i] + omb1 * gi;
        float vi = beta2 * v[i] + omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float mhat = mi / bc1, vhat = vi / bc2;
        // decoupled weight decay: the decay term uses the weight before the step
        w[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * w[i]);
    }
}

/* ---------------------------------------------------------------------------
 * Muon
 * ------------------------------------------------------------------------- */

lm_status lm_muon_update(float *w, const float *g, float *momentum, int64_t rows, int64_t cols,
                         int n_blocks, float lr, float wd, const lm_optim_config *cfg,
                         float *scratch, size_t scratch_floats) {
    // w, g, momentum are (rows, cols), split into n_blocks slices of (rows/n_blocks, cols)
    if (!w || !g || !momentum || !scratch || !cfg)
        return lm_error(LM_ERR_ARG, "muon: w, g, momentum, scratch and cfg must not be NULL");
    if (n_blocks < 1) n_blocks = 1;
    if (rows < 1 || cols < 1 || rows % n_blocks != 0)
        return lm_error(LM_ERR_ARG, "muon: shape [%lld, %lld] with %d blocks is invalid",
                        (long long)rows, (long long)cols, n_blocks);
    int64_t rb = rows / n_blocks;
    const size_t per = lm_newton_schulz_scratch_floats(rb, cols);
    if (scratch_floats < per)
        return lm_error(LM_ERR_ARG, "muon: scratch has %zu floats, a [%lld, %lld] block needs %zu",
                        scratch_floats, (long long)rb, (long long)cols, per);
    // Blocks (heads, experts) are independent: with room for several scratch areas they
    // run on separate threads, one area each. Every block computes the same thing
    // whichever thread takes it, so the result does not depend on the thread count.
    int slots = (int)(scratch_floats / per < (size_t)n_blocks ? scratch_floats / per
                                                                : (size_t)n_blocks);
    if (slots > omp_get_max_threads()) slots = omp_get_max_threads();
    if (slots < 1) slots = 1;
    int tr = rb > cols;
    int64_t m = tr ? cols : rb, n = tr ? rb : cols;
    float mu = cfg->muon_momentum;
    // update RMS matched to AdamW [MUON]: 0.2 * sqrt(max(rows, cols)) of the block
    float scale = (float)((double)cfg->muon_rms_scale * sqrt((double)(rb > cols ? rb : cols)));
    int par = m * n >= LM_PARALLEL_MIN;
#pragma omp parallel for schedule(static) num_threads(slots) if (slots > 1)
    for (int b = 0; b < n_blocks; b++) {
        float *wb = w + (size_t)b * rb * cols, *mb = momentum + (size_t)b * rb * cols;
        const float *gb = g + (size_t)b * rb * cols;
        float *X = scratch + (size_t)omp_get_thread_num() * per;
        // momentum buf = mu buf + g; Nesterov look-ahead u = g + mu buf (docs/optim.md)
#pragma omp parallel for schedule(static) if (par)
        for (int64_t r = 0; r < rb; r++)
            for (int64_t c = 0; c < cols; c++) {
                int64_t i = r * cols + c;
                float buf = mu * mb[i] + gb[i];
                mb[i] = buf;
                X[tr ? c * n + r : r * n + c] = cfg->muon_nesterov ? gb[i] + mu * buf : buf;
            }
        ns_normalise(X, m * n, cfg->muon_ns_eps);
        const float *O = ns_iterate(X, m, n, cfg->muon_ns_steps);
        // w -= lr * (scale * O + wd * w)   (decoupled weight decay)
#pragma omp parallel for schedule(static) if (par)
        for (int64_t r = 0; r < rb; r++)
            for (int64_t c = 0; c < cols; c++) {
                float o = O[tr ? c * n + r : r * n + c];
                float *wi = wb + r * cols + c;
                *wi -= lr * (scale * o + wd * *wi);
            }
    }
    return LM_OK;
}

/* ---------------------------------------------------------------------------
 * The optimizer
 * ------------------------------------------------------------------------- */

lm_status lm_optimizer_init(lm_optimizer *opt, const lm_optim_config *cfg, lm_param *params,
                            int n_params, float *state, size_t state_floats, float *scratch,
                            size_t scratch_floats) {
    if (!opt) return lm_error(LM_ERR_ARG, "optimizer is NULL");
    lm_status st = lm_optim_config_check(cfg);
    if (st) return st;
    if (n_params < 0 || (n_params > 0 && !params))
        return lm_error(LM_ERR_ARG, "optimizer: %d parameters with params %s", n_params,
                        params ? "set" : "NULL");
    for (int i = 0; i < n_params; i++) {
        st = lm_param_check(&params[i]);
        if (st) return st;
    }
    size_t need_state = lm_optim_state_floats(params, n_params);
    size_t need_scratch = lm_optim_scratch_floats(params, n_params);
    if (state_floats < need_state || (need_state && !state))
        return lm_error(LM_ERR_ARG, "optimizer state buffer has %zu floats, needs %zu",
                        state ? state_floats : (size_t)0, need_state);
    if (scratch_floats < need_scratch || (need_scratch && !scratch))
        return lm_error(LM_ERR_ARG, "optimizer scratch buffer has %zu floats, needs %zu",
                        scratch ? scratch_floats : (size_t)0, need_scratch);
    opt->cfg = *cfg;
    opt->params = params;
    opt->n_params = n_params;
    opt->state = state;
    opt->scratch = scratch;
    opt->scratch_floats = scratch ? scratch_floats : 0;
    opt->step = 0;
    if (need_state) memset(state, 0, need_state * sizeof(float));
    return LM_OK;
}

lm_status lm_optimizer_step(lm_optimizer *opt, float lr) {
    if (!opt) return lm_error(LM_ERR_ARG, "optimizer is NULL");
    if (!(lr >= 0.0f) || !isfinite(lr))
        return lm_error(LM_ERR_ARG, "learning rate %g must be finite and >= 0", (double)lr);
    const lm_optim_config *c = &opt->cfg;
    opt->step++;
    size_t off = 0;
    for (int i = 0; i < opt->n_params; i++) {
        lm_param *p = &opt->params[i];
        int64_t n = lm_param_numel(p);
        float wd = p->weight_decay ? c->weight_decay : 0.0f;
        if (lm_param_optimizer(p) == LM_OPT_MUON) {
            lm_status st = lm_muon_update(p->data, p->grad, opt->state + off, p->rows, p->cols,
                                          param_blocks(p), lr, wd, c, opt->scratch,
                                          opt->scratch_floats);
            if (st) return st;
        } else {
            lm_adamw_update(p->data, p->grad, opt->state + off, opt->state + off + n, n, lr,
                            c->adam_beta1, c->adam_beta2, c->adam_eps, wd, opt->step);
        }
        off += lm_param_state_floats(p);
    }
    return LM_OK;
}

/* ---------------------------------------------------------------------------
 * Gradients
 * ------------------------------------------------------------------------- */

double lm_grad_global_norm(const lm_param *params, int n_params) {
    double s = 0.0;
    for (int i = 0; i < n_params; i++)
        s += sum_squares_fixed(params[i].grad, lm_param_numel(&params[i]));
    return sqrt(s);
}

lm_status lm_grad_clip(lm_param *params, int n_params, float max_norm, double *norm_out) {
    if (n_params < 0 || (n_params > 0 && !params))
        return lm_error(LM_ERR_ARG, "grad_clip: %d parameters with params NULL", n_params);
    if (!(max_norm >= 0.0f) || !isfinite(max_norm))
        return lm_error(LM_ERR_ARG, "grad_clip: max_norm %g must be finite and >= 0 (0: off)",
                        (double)max_norm);
    double norm = lm_grad_global_norm(params, n_params);
    if (norm_out) *norm_out = norm;
    if (!isfinite(norm))
        return lm_error(LM_ERR_NUMERIC, "gradient global norm is %g (non-finite gradients)",
                        norm);
    if (max_norm > 0.0f && norm > (double)max_norm) lm_grads_scale(params, n_params, (float)(max_norm / norm));
    return LM_OK;
}

void lm_grads_zero(lm_param *params, int n_params) {
    for (int i = 0; i < n_params; i++)
        memset(params[i].grad, 0, (size_t)lm_param_numel(&params[i]) * sizeof(float));
}

void lm_grads_scale(lm_param *params, int n_params, float s) {
    for (int i = 0; i < n_params; i++) {
        float *g = params[i].grad;
        int64_t n = lm_param_numel(&params[i]);
#pragma omp parallel for schedule(static) if (n >= LM_PARALLEL_MIN)
        for (int64_t j = 0; j < n; j++) g[j] *= s;
    }
}

/* ---------------------------------------------------------------------------
 * QK-Clip
 * ------------------------------------------------------------------------- */

static void scale_rows(float *x, int64_t count, double f) {
    for (int64_t i = 0; i < count; i++) x[i] = (float)((double)x[i] * f);
}

static lm_status check_tau(const char *fn, float tau) {
    if (!(tau > 0.0f) || !isfinite(tau))
        return lm_error(LM_ERR_ARG, "%s: tau %g must be finite and > 0", fn, (double)tau);
    return LM_OK;
}

static lm_status check_s_max(const char *fn, const float *s_max, int n_heads) {
    for (int h = 0; h < n_heads; h++)
        if (!isfinite(s_max[h]))
            return lm_error(LM_ERR_NUMERIC, "%s: head %d has S_max %g (non-finite)", fn, h,
                            (double)s_max[h]);
    return LM_OK;
}

/* Scale count floats of x by f (exact product, one rounding): on the host
 * (be NULL) or in a backend's memory through its scale_exact op. */
static lm_status scale_rows_on(lm_backend *be, float *x, int64_t count, double f) {
    if (!be) {
        scale_rows(x, count, f);
        return LM_OK;
    }
    return be->ops->scale_exact(be, x, (size_t)count, f);
}

/* lm_qk_clip on the host (be NULL) or on backend memory. */
static lm_status qk_clip_on(lm_backend *be, const lm_qk_clip_head *heads, int n_heads, const float *s_max,
                            float tau, float *scale_out, int *n_clipped) {
    if (n_heads < 0 || (n_heads > 0 && (!heads || !s_max)))
        return lm_error(LM_ERR_ARG, "qk_clip: %d heads with heads or s_max NULL", n_heads);
    lm_status st = check_tau("qk_clip", tau);
    if (st) return st;
    // validate everything first so a bad head leaves all weights untouched
    st = check_s_max("qk_clip", s_max, n_heads);
    if (st) return st;
    for (int h = 0; h < n_heads; h++) {
        const lm_qk_clip_head *hd = &heads[h];
        if (!hd->q_rows || hd->q_nrows < 1 || hd->q_cols < 1)
            return lm_error(LM_ERR_ARG, "qk_clip: head %d query rows NULL or shape [%lld, %lld]",
                            h, (long long)hd->q_nrows, (long long)hd->q_cols);
        if (hd->k_rows && (hd->k_nrows < 1 || hd->k_cols < 1))
            return lm_error(LM_ERR_ARG, "qk_clip: head %d key rows shape [%lld, %lld]", h,
                            (long long)hd->k_nrows, (long long)hd->k_cols);
        if (hd->q_rope_rows && hd->q_rope_nrows < 1)
            return lm_error(LM_ERR_ARG, "qk_clip: head %d rotary query rows %lld", h,
                            (long long)hd->q_rope_nrows);
    }
    int clipped = 0;
    for (int h = 0; h < n_heads; h++) {
        const lm_qk_clip_head *hd = &heads[h];
        double eta = 1.0;
        if (s_max[h] > tau) {
            // QK-Clip [K2]: eta = tau / S_max; q and k rows each scaled by sqrt(eta), so
            // q.k scales by eta; rows meeting a shared key (GQA group, rotary key) take eta
            eta = (double)tau / (double)s_max[h];
            double f = sqrt(eta);
            st = scale_rows_on(be, hd->q_rows, hd->q_nrows * hd->q_cols, hd->k_rows ? f : eta);
            if (!st && hd->k_rows) st = scale_rows_on(be, hd->k_rows, hd->k_nrows * hd->k_cols, f);
            if (!st && hd->q_rope_rows) st = scale_rows_on(be, hd->q_rope_rows, hd->q_rope_nrows * hd->q_cols, eta);
            if (st) return st;
            clipped++;
        }
        if (scale_out) scale_out[h] = (float)eta;
    }
    if (n_clipped) *n_clipped = clipped;
    return LM_OK;
}

lm_status lm_qk_clip(const lm_qk_clip_head *heads, int n_heads, const float *s_max, float tau,
                     float *scale_out, int *n_clipped) {
    return qk_clip_on(NULL, heads, n_heads, s_max, tau, scale_out, n_clipped);
}

/* Heads described on the stack per lm_qk_clip call (more go in batches). */
#define LM_QK_CLIP_BATCH 64

static lm_status qk_clip_mla_on(lm_backend *be, float *w_uq, float *w_uk, int n_heads, int head_dim_qk,
                                int rope_dims, int q_lora, int kv_lora, const float *s_max, float tau,
                                float *scale_out, int *n_clipped) {
    // w_uq is (H*Dk, q_lora), w_uk is (H*Dn, kv_lora), Dn = Dk - rope_dims
    if (!w_uq || !w_uk || !s_max)
        return lm_error(LM_ERR_ARG, "qk_clip_mla: w_uq, w_uk and s_max must not be NULL");
    if (n_heads < 1 || head_dim_qk < 1 || q_lora < 1 || kv_lora < 1)
        return lm_error(LM_ERR_ARG,
                        "qk_clip_mla: n_heads %d, head_dim_qk %d, q_lora %d, kv_lora %d must "
                        "be >= 1",
                        n_heads, head_dim_qk, q_lora, kv_lora);
    if (rope_dims < 0 || rope_dims >= head_dim_qk)
        return lm_error(LM_ERR_ARG, "qk_clip_mla: rope_dims %d must be in [0, head_dim_qk %d)",
                        rope_dims, head_dim_qk);
    lm_status st = check_tau("qk_clip_mla", tau);
    if (st) return st;
    st = check_s_max("qk_clip_mla", s_max, n_heads);
    if (st) return st;
    int64_t dk = head_dim_qk, dn = head_dim_qk - rope_dims;
    int total = 0;
    for (int h0 = 0; h0 < n_heads; h0 += LM_QK_CLIP_BATCH) {
        int nb = n_heads - h0 < LM_QK_CLIP_BATCH ? n_heads - h0 : LM_QK_CLIP_BATCH;
        lm_qk_clip_head hs[LM_QK_CLIP_BATCH];
        for (int i = 0; i < nb; i++) {
            int64_t h = h0 + i;
            hs[i].q_rows = w_uq + h * dk * q_lora;
            hs[i].q_nrows = dn;
            hs[i].q_cols = q_lora;
            hs[i].k_rows = w_uk + h * dn * kv_lora;
            hs[i].k_nrows = dn;
            hs[i].k_cols = kv_lora;
            hs[i].q_rope_rows = rope_dims ? w_uq + (h * dk + dn) * q_lora : NULL;
            hs[i].q_rope_nrows = rope_dims;
        }
        int c = 0;
        st = qk_clip_on(be, hs, nb, s_max + h0, tau, scale_out ? scale_out + h0 : NULL, &c);
        if (st) return st;
        total += c;
    }
    if (n_clipped) *n_clipped = total;
    return LM_OK;
}

static lm_status qk_clip_gqa_on(lm_backend *be, float *w_q, float *w_k, int n_heads, int n_kv_heads,
                                int head_dim_qk, int d_model, const float *s_max, float tau,
                                float *scale_out, int *n_clipped) {
    // w_q is (H*Dk, d_model), w_k is (Hkv*Dk, d_model)
    if (!w_q || !w_k || !s_max)
        return lm_error(LM_ERR_ARG, "qk_clip_gqa: w_q, w_k and s_max must not be NULL");
    if (n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads != 0 || head_dim_qk < 1 ||
        d_model < 1)
        return lm_error(LM_ERR_ARG,
                        "qk_clip_gqa: n_heads %d (a multiple of n_kv_heads %d), head_dim_qk %d, "
                        "d_model %d must be >= 1",
                        n_heads, n_kv_heads, head_dim_qk, d_model);
    lm_status st = check_tau("qk_clip_gqa", tau);
    if (st) return st;
    st = check_s_max("qk_clip_gqa", s_max, n_heads);
    if (st) return st;
    int64_t dk = head_dim_qk;
    int own_keys = n_kv_heads == n_heads;
    int total = 0;
    for (int h0 = 0; h0 < n_heads; h0 += LM_QK_CLIP_BATCH) {
        int nb = n_heads - h0 < LM_QK_CLIP_BATCH ? n_heads - h0 : LM_QK_CLIP_BATCH;
        lm_qk_clip_head hs[LM_QK_CLIP_BATCH];
        for (int i = 0; i < nb; i++) {
            int64_t h = h0 + i;
            hs[i].q_rows = w_q + h * dk * d_model;
            hs[i].q_nrows = dk;
            hs[i].q_cols = d_model;
            hs[i].k_rows = own_keys ? w_k + h * dk * d_model : NULL;
            hs[i].k_nrows = dk;
            hs[i].k_cols = d_model;
            hs[i].q_rope_rows = NULL;
            hs[i].q_rope_nrows = 0;
        }
        int c = 0;
        st = qk_clip_on(be, hs, nb, s_max + h0, tau, scale_out ? scale_out + h0 : NULL, &c);
        if (st) return st;
        total += c;
    }
    if (n_clipped) *n_clipped = total;
    return LM_OK;
}

lm_status lm_qk_clip_mla(float *w_uq, float *w_uk, int n_heads, int head_dim_qk, int rope_dims,
                         int q_lora, int kv_lora, const float *s_max, float tau, float *scale_out,
                         int *n_clipped) {
    return qk_clip_mla_on(NULL, w_uq, w_uk, n_heads, head_dim_qk, rope_dims, q_lora, kv_lora, s_max, tau,
                          scale_out, n_clipped);
}

lm_status lm_qk_clip_gqa(float *w_q, float *w_k, int n_heads, int n_kv_heads, int head_dim_qk,
                         int d_model, const float *s_max, float tau, float *scale_out,
                         int *n_clipped) {
    return qk_clip_gqa_on(NULL, w_q, w_k, n_heads, n_kv_heads, head_dim_qk, d_model, s_max, tau, scale_out,
                          n_clipped);
}

lm_status lm_qk_clip_mla_on(lm_backend *be, float *w_uq, float *w_uk, int n_heads, int head_dim_qk, int rope_dims,
                            int q_lora, int kv_lora, const float *s_max, float tau, float *scale_out, int *n_clipped) {
    if (!be) be = lm_backend_cpu();
    return qk_clip_mla_on(be, w_uq, w_uk, n_heads, head_dim_qk, rope_dims, q_lora, kv_lora, s_max, tau,
                          scale_out, n_clipped);
}

lm_status lm_qk_clip_gqa_on(lm_backend *be, float *w_q, float *w_k, int n_heads, int n_kv_heads, int head_dim_qk,
                            int d_model, const float *s_max, float tau, float *scale_out, int *n_clipped) {
    if (!be) be = lm_backend_cpu();
    return qk_clip_gqa_on(be, w_q, w_k, n_heads, n_kv_heads, head_dim_qk, d_model, s_max, tau, scale_out,
                          n_clipped);
}
