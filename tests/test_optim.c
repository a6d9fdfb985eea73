/* Optimizers, gradient clipping, QK-Clip and learning-rate schedules
 * (include/longmoe/optim.h) against float64 references written here. */
#include <omp.h>

#include "longmoe/optim.h"
#include "test.h"

static void fill(lm_rng *r, float *x, size_t n, double s) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(s * lm_rng_normal(r));
}

static float *alloc_f(size_t n) {
    float *p = malloc((n ? n : 1) * sizeof(float));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static double *alloc_d(size_t n) {
    double *p = malloc((n ? n : 1) * sizeof(double));
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* ---------------------------------------------------------------------------
 * float64 helpers: symmetric eigenvalues (cyclic Jacobi), singular values,
 * Newton–Schulz
 * ------------------------------------------------------------------------- */

/* Eigenvalues of the symmetric n x n matrix a (destroyed) into ev[n]. */
static void jacobi_eigenvalues(double *a, int n, double *ev) {
    for (int sweep = 0; sweep < 100; sweep++) {
        double off = 0;
        for (int i = 0; i < n; i++)
            for (int j = i + 1; j < n; j++) off += a[i * n + j] * a[i * n + j];
        if (off < 1e-30) break;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) {
                double apq = a[p * n + q];
                if (fabs(apq) < 1e-300) continue;
                double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
                double t = (theta >= 0 ? 1.0 : -1.0) / (fabs(theta) + sqrt(theta * theta + 1));
                double c = 1 / sqrt(t * t + 1), s = t * c;
                for (int k = 0; k < n; k++) { /* columns p, q */
                    double akp = a[k * n + p], akq = a[k * n + q];
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for (int k = 0; k < n; k++) { /* rows p, q */
                    double apk = a[p * n + k], aqk = a[q * n + k];
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
            }
    }
    for (int i = 0; i < n; i++) ev[i] = a[i * n + i];
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The min(rows, cols) singular values of x [rows, cols], ascending. */
static void singular_values(const float *x, int rows, int cols, double *sv) {
    int m = rows < cols ? rows : cols;
    double *g = alloc_d((size_t)m * m);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < m; j++) {
            double s = 0;
            if (rows <= cols)
                for (int k = 0; k < cols; k++) s += (double)x[i * cols + k] * x[j * cols + k];
            else
                for (int k = 0; k < rows; k++) s += (double)x[k * cols + i] * x[k * cols + j];
            g[i * m + j] = s;
        }
    jacobi_eigenvalues(g, m, sv);
    for (int i = 0; i < m; i++) sv[i] = sqrt(sv[i] > 0 ? sv[i] : 0);
    qsort(sv, (size_t)m, sizeof(double), cmp_double);
    free(g);
}

/* The scalar quintic, which Newton–Schulz applies to every singular value. */
static double ns_scalar(double x, int steps) {
    for (int s = 0; s < steps; s++) {
        double x2 = x * x;
        x = 3.4445 * x - 4.7750 * x * x2 + 2.0315 * x * x2 * x2;
    }
    return x;
}

/* float64 Newton–Schulz of g [rows, cols] into o, same definition as the library. */
static void ns_ref(double *o, const double *g, int rows, int cols, int steps, double eps) {
    int tr = rows > cols, m = tr ? cols : rows, n = tr ? rows : cols;
    double *X = alloc_d((size_t)m * n), *Y = alloc_d((size_t)m * n);
    double *A = alloc_d((size_t)m * m), *B = alloc_d((size_t)m * m);
    double ss = 0;
    for (int i = 0; i < rows * cols; i++) ss += g[i] * g[i];
    double inv = 1.0 / (sqrt(ss) + eps);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) X[tr ? c * n + r : r * n + c] = g[r * cols + c] * inv;
    for (int s = 0; s < steps; s++) {
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++) {
                double t = 0;
                for (int k = 0; k < n; k++) t += X[i * n + k] * X[j * n + k];
                A[i * m + j] = t;
            }
        for (int i = 0; i < m; i++)
            for (int j = 0; j < m; j++) {
                double t = 0;
                for (int k = 0; k < m; k++) t += A[i * m + k] * A[k * m + j];
                B[i * m + j] = -4.7750 * A[i * m + j] + 2.0315 * t;
            }
        for (int i = 0; i < m; i++)
            for (int c = 0; c < n; c++) {
                double t = 3.4445 * X[i * n + c];
                for (int k = 0; k < m; k++) t += B[i * m + k] * X[k * n + c];
                Y[i * n + c] = t;
            }
        double *tmp = X;
        X = Y;
        Y = tmp;
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) o[r * cols + c] = X[tr ? c * n + r : r * n + c];
    free(X);
    free(Y);
    free(A);
    free(B);
}

/* ---------------------------------------------------------------------------
 * Parameter split rule and planning
 * ------------------------------------------------------------------------- */

static void test_split_rule_muon_for_hidden_matrices_adamw_for_the_rest(void) {
    float d[64], g[64];
    lm_param mat = lm_param_matrix("w", d, g, 8, 8, LM_PARAM_MATRIX);
    lm_param row = lm_param_matrix("row", d, g, 1, 8, LM_PARAM_MATRIX);
    lm_param emb = lm_param_matrix("emb", d, g, 16, 4, LM_PARAM_EMBEDDING);
    lm_param nrm = lm_param_vector("norm", d, g, 8, LM_PARAM_NORM);
    lm_param vec = lm_param_vector("bias", d, g, 8, LM_PARAM_VECTOR);
    lm_param sca = lm_param_vector("a", d, g, 1, LM_PARAM_SCALAR);
    lm_param heads = lm_param_matrix("wq", d, g, 8, 8, LM_PARAM_MATRIX);
    heads.n_blocks = 8; /* 1-row heads: no longer a matrix per block */
    CHECK(lm_param_optimizer(&mat) == LM_OPT_MUON, "hidden matrix -> Muon");
    CHECK(lm_param_optimizer(&row) == LM_OPT_ADAMW, "1 x n matrix -> AdamW");
    CHECK(lm_param_optimizer(&emb) == LM_OPT_ADAMW, "embedding -> AdamW");
    CHECK(lm_param_optimizer(&nrm) == LM_OPT_ADAMW, "norm -> AdamW");
    CHECK(lm_param_optimizer(&vec) == LM_OPT_ADAMW, "vector -> AdamW");
    CHECK(lm_param_optimizer(&sca) == LM_OPT_ADAMW && sca.ndim == 0, "scalar -> AdamW");
    CHECK(lm_param_optimizer(&heads) == LM_OPT_ADAMW, "1-row blocks -> AdamW");
    emb.optimizer = LM_OPT_MUON;
    CHECK(lm_param_optimizer(&emb) == LM_OPT_MUON, "a forced choice wins");
    CHECK(mat.weight_decay == 1 && emb.weight_decay == 1 && nrm.weight_decay == 0 &&
              vec.weight_decay == 0 && sca.weight_decay == 0,
          "default decay: matrices and embeddings only");

    lm_param ps[3] = {mat, nrm, lm_param_matrix("wide", d, g, 4, 16, LM_PARAM_MATRIX)};
    CHECK(lm_optim_state_floats(ps, 3) == 64 + 2 * 8 + 64, "state: Muon 1x, AdamW 2x numel (%zu)",
          lm_optim_state_floats(ps, 3));
    /* 8x8: 2*64+2*64 = 256; 4x16: 2*64 + 2*16 = 160 */
    CHECK(lm_optim_scratch_floats(ps, 3) == 256, "scratch is the largest NS need (%zu)",
          lm_optim_scratch_floats(ps, 3));
}

static void test_bad_parameters_and_buffers_are_rejected(void) {
    float d[64], g[64], st[256], sc[256];
    lm_optim_config cfg = lm_optim_config_default();
    lm_optimizer opt;
    lm_param p = lm_param_matrix("layers.0.attn.wq", d, g, 6, 8, LM_PARAM_MATRIX);
    p.n_blocks = 4; /* 6 rows do not split into 4 heads */
    CHECK(lm_optimizer_init(&opt, &cfg, &p, 1, st, 256, sc, 256) == LM_ERR_ARG &&
              strstr(lm_last_error(), "layers.0.attn.wq"),
          "indivisible heads rejected by name: %s", lm_last_error());
    lm_param v = lm_param_vector("norm", d, g, 8, LM_PARAM_NORM);
    v.optimizer = LM_OPT_MUON;
    CHECK(lm_optimizer_init(&opt, &cfg, &v, 1, st, 256, sc, 256) == LM_ERR_ARG,
          "Muon forced on a vector rejected");
    lm_param m = lm_param_matrix("w", d, g, 8, 8, LM_PARAM_MATRIX);
    CHECK(lm_optimizer_init(&opt, &cfg, &m, 1, st, 63, sc, 256) == LM_ERR_ARG &&
              strstr(lm_last_error(), "needs 64"),
          "short state buffer rejected: %s", lm_last_error());
    CHECK(lm_optimizer_init(&opt, &cfg, &m, 1, st, 64, sc, 255) == LM_ERR_ARG,
          "short scratch buffer rejected");
    lm_param same = lm_param_matrix("w", d, d, 8, 8, LM_PARAM_MATRIX);
    CHECK(lm_optimizer_init(&opt, &cfg, &same, 1, st, 256, sc, 256) == LM_ERR_ARG,
          "data aliasing grad rejected");
    lm_optim_config bad = cfg;
    bad.adam_beta2 = 1.0f;
    CHECK(lm_optimizer_init(&opt, &bad, &m, 1, st, 64, sc, 256) == LM_ERR_ARG &&
              strstr(lm_last_error(), "adam_beta2"),
          "beta2 = 1 rejected by name: %s", lm_last_error());
    CHECK(lm_optimizer_init(&opt, &cfg, &m, 1, st, 64, sc, 256) == LM_OK, "valid init");
    CHECK(lm_optimizer_step(&opt, NAN) == LM_ERR_ARG, "NaN learning rate rejected");
}

/* ---------------------------------------------------------------------------
 * AdamW
 * ------------------------------------------------------------------------- */

static void test_adamw_matches_float64_over_steps(void) {
    lm_rng r;
    lm_rng_seed(&r, 101);
    enum { NE = 37 * 11, NN = 29, STEPS = 7 };
    float emb[NE], gemb[NE], nrm[NN], gnrm[NN];
    double emb_ref[NE], nrm_ref[NN], m_ref[NE + NN], v_ref[NE + NN];
    fill(&r, emb, NE, 0.5);
    fill(&r, nrm, NN, 1.0);
    for (int i = 0; i < NE; i++) emb_ref[i] = emb[i];
    for (int i = 0; i < NN; i++) nrm_ref[i] = nrm[i];
    memset(m_ref, 0, sizeof m_ref);
    memset(v_ref, 0, sizeof v_ref);
    lm_param ps[2] = {lm_param_matrix("emb", emb, gemb, 37, 11, LM_PARAM_EMBEDDING),
                      lm_param_vector("norm", nrm, gnrm, NN, LM_PARAM_NORM)};
    lm_optim_config cfg = lm_optim_config_default();
    float state[2 * (NE + NN)];
    lm_optimizer opt;
    CHECK(lm_optimizer_init(&opt, &cfg, ps, 2, state, 2 * (NE + NN), NULL, 0) == LM_OK, "%s",
          lm_last_error());
    double b1 = cfg.adam_beta1, b2 = cfg.adam_beta2, eps = cfg.adam_eps, wd = cfg.weight_decay;
    for (int t = 1; t <= STEPS; t++) {
        double lr = 0.01 * (1.0 + 0.3 * t); /* a varying learning rate */
        fill(&r, gemb, NE, 1.0 / t);
        fill(&r, gnrm, NN, 2.0);
        CHECK(lm_optimizer_step(&opt, (float)lr) == LM_OK, "%s", lm_last_error());
        for (int i = 0; i < NE + NN; i++) {
            int is_emb = i < NE;
            double g = is_emb ? gemb[i] : gnrm[i - NE];
            double *w = is_emb ? &emb_ref[i] : &nrm_ref[i - NE];
            double decay = is_emb ? wd : 0.0; /* norms do not decay by default */
            m_ref[i] = b1 * m_ref[i] + (1 - b1) * g;
            v_ref[i] = b2 * v_ref[i] + (1 - b2) * g * g;
            double mh = m_ref[i] / (1 - pow(b1, t)), vh = v_ref[i] / (1 - pow(b2, t));
            *w -= lr * (mh / (sqrt(vh) + eps) + decay * *w);
        }
    }
    CHECK(opt.step == STEPS, "step count %lld", (long long)opt.step);
    for (int i = 0; i < NE; i++) CHECK_CLOSE(emb[i], emb_ref[i], 1e-6, 1e-5, "embedding weight");
    for (int i = 0; i < NN; i++) CHECK_CLOSE(nrm[i], nrm_ref[i], 1e-6, 1e-5, "norm weight");
    /* state layout: param 0's m then v, then param 1's m then v */
    for (int i = 0; i < NE; i++) {
        CHECK_CLOSE(state[i], m_ref[i], 1e-7, 1e-5, "emb m");
        CHECK_CLOSE(state[NE + i], v_ref[i], 1e-9, 1e-5, "emb v");
    }
    for (int i = 0; i < NN; i++) {
        CHECK_CLOSE(state[2 * NE + i], m_ref[NE + i], 1e-7, 1e-5, "norm m");
        CHECK_CLOSE(state[2 * NE + NN + i], v_ref[NE + i], 1e-9, 1e-5, "norm v");
    }
}

/* ---------------------------------------------------------------------------
 * Newton–Schulz and Muon
 * ------------------------------------------------------------------------- */

/* Newton–Schulz acts on singular values as the scalar quintic
 * x -> 3.4445x - 4.7750x^3 + 2.0315x^5 applied 5 times to sigma/||G||_F. For
 * x0 >= 0.002 the fifth iterate lies in [0.68, 1.21] (scan of the scalar map; the
 * quintic oscillates around 1 instead of converging — its coefficients buy speed
 * near 0). The test checks both: the predicted values and the band. */
static void test_newton_schulz_gives_singular_values_in_band(void) {
    lm_rng r;
    lm_rng_seed(&r, 202);
    const int shapes[3][2] = {{24, 96}, {96, 24}, {40, 64}};
    double smin = 1e9, smax = 0;
    for (int si = 0; si < 3; si++) {
        int rows = shapes[si][0], cols = shapes[si][1], m = rows < cols ? rows : cols;
        float *g = alloc_f((size_t)rows * cols), *o = alloc_f((size_t)rows * cols);
        float *scr = alloc_f(lm_newton_schulz_scratch_floats(rows, cols));
        double *sg = alloc_d(m), *so = alloc_d(m), *pred = alloc_d(m);
        fill(&r, g, (size_t)rows * cols, 1.0);
        CHECK(lm_newton_schulz(o, g, rows, cols, 5, 1e-7f, scr) == LM_OK, "%s", lm_last_error());
        singular_values(g, rows, cols, sg);
        singular_values(o, rows, cols, so);
        double fro = 0;
        for (int i = 0; i < m; i++) fro += sg[i] * sg[i];
        fro = sqrt(fro);
        CHECK(sg[0] / fro >= 0.002, "precondition: sigma_min/||G||_F = %g", sg[0] / fro);
        for (int i = 0; i < m; i++) pred[i] = ns_scalar(sg[i] / fro, 5);
        qsort(pred, (size_t)m, sizeof(double), cmp_double);
        for (int i = 0; i < m; i++) {
            CHECK(so[i] >= 0.68 && so[i] <= 1.21, "%dx%d singular value %d = %g outside band",
                  rows, cols, i, so[i]);
            CHECK_CLOSE(so[i], pred[i], 2e-4, 2e-4, "singular value = scalar quintic prediction");
            if (so[i] < smin) smin = so[i];
            if (so[i] > smax) smax = so[i];
        }
        free(g);
        free(o);
        free(scr);
        free(sg);
        free(so);
        free(pred);
    }
    printf("  NS5 singular values over the test matrices: [%.4f, %.4f]\n", smin, smax);
}

static void test_newton_schulz_of_transpose_is_transpose(void) {
    lm_rng r;
    lm_rng_seed(&r, 203);
    int rows = 20, cols = 36;
    float g[20 * 36], gt[36 * 20], o[20 * 36], ot[36 * 20];
    float *scr = alloc_f(lm_newton_schulz_scratch_floats(rows, cols));
    fill(&r, g, sizeof g / 4, 0.3);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) gt[j * rows + i] = g[i * cols + j];
    lm_newton_schulz(o, g, rows, cols, 5, 1e-7f, scr);
    lm_newton_schulz(ot, gt, cols, rows, 5, 1e-7f, scr);
    int same = 1;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) same &= o[i * cols + j] == ot[j * rows + i];
    CHECK(same, "NS(G^T) must equal NS(G)^T bit for bit (the Gram side is the smaller one)");
    /* and it agrees with the float64 definition */
    double gd[20 * 36], od[20 * 36];
    for (int i = 0; i < rows * cols; i++) gd[i] = g[i];
    ns_ref(od, gd, rows, cols, 5, 1e-7);
    double err = test_rel_error_f(o, od, (size_t)rows * cols);
    CHECK(err < 1e-5, "NS fp32 vs float64 rel error %g", err);
    free(scr);
}

/* The first Muon step from zero momentum moves the weights by exactly
 * lr * 0.2*sqrt(max(rows, cols)) * NS(g) (Nesterov's u = 1.95 g normalises away),
 * so the update RMS is 0.2 * RMS(NS(g)) * sqrt(max) = 0.2 * rms(sigma) * sqrt(min/min)
 * which, with singular values in [0.68, 1.21], lies in 0.2 * [0.68, 1.21]. */
static void test_muon_update_has_documented_rms_scale(void) {
    lm_rng r;
    lm_rng_seed(&r, 303);
    const int shapes[2][2] = {{32, 96}, {80, 24}};
    for (int si = 0; si < 2; si++) {
        int rows = shapes[si][0], cols = shapes[si][1], n = rows * cols;
        float *w = alloc_f(n), *w0 = alloc_f(n), *g = alloc_f(n), *o = alloc_f(n);
        fill(&r, w, n, 0.1);
        fill(&r, g, n, 1.0);
        memcpy(w0, w, (size_t)n * 4);
        lm_param p = lm_param_matrix("w", w, g, rows, cols, LM_PARAM_MATRIX);
        p.weight_decay = 0;
        size_t ns = lm_optim_scratch_floats(&p, 1);
        float *st = alloc_f(n), *scr = alloc_f(ns);
        lm_optim_config cfg = lm_optim_config_default();
        lm_optimizer opt;
        CHECK(lm_optimizer_init(&opt, &cfg, &p, 1, st, n, scr, ns) == LM_OK, "%s",
              lm_last_error());
        double lr = 1e-2;
        lm_optimizer_step(&opt, (float)lr);
        lm_newton_schulz(o, g, rows, cols, 5, 1e-7f, scr);
        double scale = 0.2 * sqrt(rows > cols ? rows : cols), ss = 0, err = 0;
        for (int i = 0; i < n; i++) {
            double d = ((double)w0[i] - w[i]) / lr;
            ss += d * d;
            err = fmax(err, fabs(d - scale * o[i]));
        }
        double rms = sqrt(ss / n);
        CHECK(err < 2e-3 * scale, "update = lr * scale * NS(g): max dev %g", err);
        CHECK(rms >= 0.2 * 0.68 && rms <= 0.2 * 1.21, "%dx%d update RMS/lr %g not in 0.2*[0.68,1.21]",
              rows, cols, rms);
        printf("  Muon %dx%d: update RMS / lr = %.4f (AdamW's is at most ~1; target 0.2)\n", rows,
               cols, rms);
        free(w);
        free(w0);
        free(g);
        free(o);
        free(st);
        free(scr);
    }
}

/* Three Muon steps with fresh gradients vs a float64 Muon (Nesterov momentum,
 * NS5 in double, scale, decoupled decay), for a wide and a tall matrix, with and
 * without Nesterov. A plain-momentum implementation differs from step 2 on. */
static void test_muon_matches_float64_nesterov_reference(void) {
    lm_rng r;
    lm_rng_seed(&r, 404);
    const int shapes[2][2] = {{12, 20}, {20, 12}};
    double worst = 0;
    for (int nest = 1; nest >= 0; nest--)
        for (int si = 0; si < 2; si++) {
            int rows = shapes[si][0], cols = shapes[si][1], n = rows * cols;
            float w[240], g[240], st[240];
            double wr[240], buf[240], u[240], o[240];
            float w_init[240];
            fill(&r, w, n, 0.2);
            memcpy(w_init, w, sizeof w);
            for (int i = 0; i < n; i++) wr[i] = w[i], buf[i] = 0;
            lm_param p = lm_param_matrix("w", w, g, rows, cols, LM_PARAM_MATRIX);
            size_t ns = lm_optim_scratch_floats(&p, 1);
            float *scr = alloc_f(ns);
            lm_optim_config cfg = lm_optim_config_default();
            cfg.muon_nesterov = nest;
            lm_optimizer opt;
            CHECK(lm_optimizer_init(&opt, &cfg, &p, 1, st, n, scr, ns) == LM_OK, "%s",
                  lm_last_error());
            double mu = cfg.muon_momentum, wd = cfg.weight_decay;
            double scale = 0.2 * sqrt(rows > cols ? rows : cols);
            for (int t = 1; t <= 3; t++) {
                double lr = 0.02 / t;
                fill(&r, g, n, 1.0);
                lm_optimizer_step(&opt, (float)lr);
                for (int i = 0; i < n; i++) {
                    buf[i] = mu * buf[i] + g[i];
                    u[i] = nest ? g[i] + mu * buf[i] : buf[i];
                }
                ns_ref(o, u, rows, cols, 5, 1e-7);
                for (int i = 0; i < n; i++) wr[i] -= lr * (scale * o[i] + wd * wr[i]);
            }
            /* compare the weight change, not just the weights (the change is ~100x smaller) */
            double dw[240], dr[240];
            for (int i = 0; i < n; i++) dw[i] = (double)w[i] - w_init[i], dr[i] = wr[i] - w_init[i];
            double derr = test_rel_error(dw, dr, n), berr = test_rel_error_f(st, buf, n);
            CHECK(derr < 2e-5, "nesterov %d %dx%d weight change rel error %g", nest, rows, cols, derr);
            CHECK(berr < 1e-6, "nesterov %d %dx%d momentum rel error %g", nest, rows, cols, berr);
            if (derr > worst) worst = derr;
            free(scr);
        }
    printf("  Muon vs float64: worst relative error of the 3-step weight change %.3g\n", worst);
}

/* Blocks (heads, experts) updated on several threads at once, each in its own scratch
 * area, give the same weights and momentum, bit for bit, as one after the other. */
static void test_muon_blocks_in_parallel_equal_sequential(void) {
    lm_rng r;
    lm_rng_seed(&r, 909);
    enum { NB = 7, RB = 12, COLS = 40, N = NB * RB * COLS };
    static float w1[N], w2[N], m1[N], m2[N], g[N];
    fill(&r, w1, N, 0.1);
    memcpy(w2, w1, sizeof w1);
    memset(m1, 0, sizeof m1);
    memset(m2, 0, sizeof m2);
    const size_t per = lm_newton_schulz_scratch_floats(RB, COLS);
    float *s1 = alloc_f(per), *s2 = alloc_f(NB * per);
    lm_optim_config cfg = lm_optim_config_default();
    int saved = omp_get_max_threads();
    omp_set_num_threads(4);
    CHECK(lm_muon_scratch_floats(NB * RB, COLS, NB) == 4 * per, "one area per thread (%zu)",
          lm_muon_scratch_floats(NB * RB, COLS, NB));
    for (int t = 0; t < 3; t++) {
        fill(&r, g, N, 1.0);
        CHECK(lm_muon_update(w1, g, m1, NB * RB, COLS, NB, 0.02f, 0.1f, &cfg, s1, per) == LM_OK,
              "%s", lm_last_error());
        CHECK(lm_muon_update(w2, g, m2, NB * RB, COLS, NB, 0.02f, 0.1f, &cfg, s2, NB * per) ==
                  LM_OK,
              "%s", lm_last_error());
    }
    omp_set_num_threads(saved);
    CHECK(memcmp(w1, w2, sizeof w1) == 0, "weights differ between 1 and 4 threads");
    CHECK(memcmp(m1, m2, sizeof m1) == 0, "momentum differs between 1 and 4 threads");
    CHECK(lm_muon_update(w1, g, m1, NB * RB, COLS, NB, 0.02f, 0.1f, &cfg, s1, per - 1) ==
              LM_ERR_ARG,
          "a scratch smaller than one block must be refused");
    free(s1);
    free(s2);
}

/* Per-head Muon on a [H*hd, d_in] projection equals Muon run on each head's
 * slice as its own parameter (bit for bit), and differs from whole-matrix Muon. */
static void test_muon_per_head_equals_separate_slices_and_differs_from_whole(void) {
    lm_rng r;
    lm_rng_seed(&r, 505);
    enum { H = 4, HD = 8, DIN = 32, N = H * HD * DIN };
    static float wa[N], wb[N], wc[N], w0[N], g[N], sa[N], sb[N], sc[N];
    fill(&r, wa, N, 0.1);
    memcpy(wb, wa, sizeof wa);
    memcpy(wc, wa, sizeof wa);
    memcpy(w0, wa, sizeof wa);
    lm_param pa = lm_param_matrix("wq", wa, g, H * HD, DIN, LM_PARAM_MATRIX);
    pa.n_blocks = H;
    lm_param pb[H];
    for (int h = 0; h < H; h++)
        pb[h] = lm_param_matrix("wq.head", wb + h * HD * DIN, g + h * HD * DIN, HD, DIN,
                                LM_PARAM_MATRIX);
    lm_param pc = lm_param_matrix("wq", wc, g, H * HD, DIN, LM_PARAM_MATRIX);
    size_t nsa = lm_optim_scratch_floats(&pa, 1), nsb = lm_optim_scratch_floats(pb, H),
           nsc = lm_optim_scratch_floats(&pc, 1);
    CHECK(nsb == lm_newton_schulz_scratch_floats(HD, DIN) &&
              nsa == lm_muon_scratch_floats(H * HD, DIN, H) && nsa >= nsb &&
              nsa % nsb == 0,
          "per-head scratch: one Newton-Schulz area per head that can run at once");
    CHECK(nsc > nsa, "whole-matrix scratch is larger");
    float *scr = alloc_f(nsc);
    lm_optim_config cfg = lm_optim_config_default();
    lm_optimizer oa, ob, oc;
    CHECK(lm_optimizer_init(&oa, &cfg, &pa, 1, sa, N, scr, nsc) == LM_OK, "%s", lm_last_error());
    CHECK(lm_optimizer_init(&ob, &cfg, pb, H, sb, N, scr, nsc) == LM_OK, "%s", lm_last_error());
    CHECK(lm_optimizer_init(&oc, &cfg, &pc, 1, sc, N, scr, nsc) == LM_OK, "%s", lm_last_error());
    for (int t = 0; t < 3; t++) {
        fill(&r, g, N, 1.0);
        for (int i = 0; i < HD * DIN; i++) g[i] *= 10; /* heads with different gradient scales */
        lm_optimizer_step(&oa, 0.01f);
        lm_optimizer_step(&ob, 0.01f);
        lm_optimizer_step(&oc, 0.01f);
    }
    CHECK(memcmp(wa, wb, sizeof wa) == 0, "per-head Muon must equal Muon on each head slice");
    CHECK(memcmp(sa, sb, sizeof sa) == 0, "per-head momentum equals per-slice momentum");
    double num = 0, den = 0;
    for (int i = 0; i < N; i++) {
        double da = (double)wa[i] - w0[i], dc = (double)wc[i] - w0[i];
        num += (da - dc) * (da - dc);
        den += dc * dc;
    }
    CHECK(sqrt(num / den) > 0.1, "per-head update differs from whole-matrix (rel diff %g)",
          sqrt(num / den));
    /* each head's single-step update is (nearly) orthogonal: rows of the head's
     * NS output have singular values in the band, with the per-head scale */
    memcpy(wa, w0, sizeof wa);
    CHECK(lm_optimizer_init(&oa, &cfg, &pa, 1, sa, N, scr, nsc) == LM_OK, "%s", lm_last_error());
    lm_optimizer_step(&oa, 1.0f);
    double scale = 0.2 * sqrt(DIN), sv[HD];
    static float d[HD * DIN];
    for (int h = 0; h < H; h++) {
        for (int i = 0; i < HD * DIN; i++) {
            int k = h * HD * DIN + i;
            /* w1 = w0 - (scale*O + wd*w0) with lr = 1 */
            d[i] = (float)(((double)w0[k] * (1 - cfg.weight_decay) - wa[k]) / scale);
        }
        singular_values(d, HD, DIN, sv);
        CHECK(sv[0] > 0.68 - 1e-3 && sv[HD - 1] < 1.21 + 1e-3,
              "head %d update singular values [%g, %g] outside band", h, sv[0], sv[HD - 1]);
    }
    free(scr);
}

/* ---------------------------------------------------------------------------
 * Gradient clipping
 * ------------------------------------------------------------------------- */

static void test_grad_clip_norm_and_clipped_norm(void) {
    lm_rng r;
    lm_rng_seed(&r, 606);
    static float d1[300], g1[300], d2[50], g2[50], d3[1], g3[1], keep[351];
    fill(&r, g1, 300, 1.0);
    fill(&r, g2, 50, 3.0);
    fill(&r, g3, 1, 2.0);
    lm_param ps[3] = {lm_param_matrix("a", d1, g1, 30, 10, LM_PARAM_MATRIX),
                      lm_param_vector("b", d2, g2, 50, LM_PARAM_VECTOR),
                      lm_param_vector("c", d3, g3, 1, LM_PARAM_SCALAR)};
    double ref = 0;
    for (int i = 0; i < 300; i++) ref += (double)g1[i] * g1[i];
    for (int i = 0; i < 50; i++) ref += (double)g2[i] * g2[i];
    ref += (double)g3[0] * g3[0];
    ref = sqrt(ref);
    double norm = 0;
    memcpy(keep, g1, 300 * 4);
    CHECK(lm_grad_clip(ps, 3, (float)(ref * 2), &norm) == LM_OK, "%s", lm_last_error());
    CHECK_CLOSE(norm, ref, 0, 1e-13, "global norm");
    CHECK(memcmp(keep, g1, 300 * 4) == 0, "norm below max: gradients untouched");
    CHECK(lm_grad_clip(ps, 3, 0.0f, &norm) == LM_OK && memcmp(keep, g1, 300 * 4) == 0,
          "max_norm 0 only measures");
    float mx = (float)(ref / 3);
    CHECK(lm_grad_clip(ps, 3, mx, &norm) == LM_OK, "%s", lm_last_error());
    CHECK_CLOSE(norm, ref, 0, 1e-13, "returned norm is the pre-clip norm");
    CHECK_CLOSE(lm_grad_global_norm(ps, 3), mx, 0, 1e-6, "clipped norm equals max_norm");
    CHECK_CLOSE(g1[7], keep[7] / 3.0, 0, 1e-6, "every gradient scaled by max/norm");
    /* a non-finite gradient: reported, nothing scaled */
    memcpy(keep, g1, 300 * 4);
    g2[3] = NAN;
    CHECK(lm_grad_clip(ps, 3, 1e-3f, &norm) == LM_ERR_NUMERIC && isnan(norm),
          "NaN gradient reported as LM_ERR_NUMERIC");
    CHECK(memcmp(keep, g1, 300 * 4) == 0, "non-finite norm leaves gradients untouched");
    CHECK(lm_grad_clip(ps, 3, -1.0f, &norm) == LM_ERR_ARG, "negative max_norm rejected");
    /* accumulation helpers */
    lm_grads_zero(ps, 2);
    CHECK(g1[0] == 0 && g2[49] == 0 && g3[0] != 0, "lm_grads_zero zeroes exactly the given params");
}

/* ---------------------------------------------------------------------------
 * QK-Clip
 * ------------------------------------------------------------------------- */

static void test_qk_clip_scales_only_heads_above_tau(void) {
    lm_rng r;
    lm_rng_seed(&r, 707);
    enum { H = 4, DQK = 8, QL = 16, KL = 12 };
    static float wq[H * DQK * QL], wk[H * DQK * KL], wq0[H * DQK * QL], wk0[H * DQK * KL];
    float x[QL], c[KL];
    fill(&r, wq, H * DQK * QL, 0.3);
    fill(&r, wk, H * DQK * KL, 0.3);
    fill(&r, x, QL, 1.0);
    fill(&r, c, KL, 1.0);
    memcpy(wq0, wq, sizeof wq);
    memcpy(wk0, wk, sizeof wk);
    const float tau = 100.0f;
    float smax[H] = {50.0f, 100.0f, 250.0f, 1e4f}, scale[H];
    int nclip = -1;
    CHECK(lm_qk_clip_mla(wq, wk, H, DQK, 0, QL, KL, smax, tau, scale, &nclip) == LM_OK, "%s",
          lm_last_error());
    CHECK(nclip == 2, "two heads above tau clipped (got %d)", nclip);
    for (int h = 0; h < H; h++) {
        const float *q1 = wq + h * DQK * QL, *q0 = wq0 + h * DQK * QL;
        const float *k1 = wk + h * DQK * KL, *k0 = wk0 + h * DQK * KL;
        if (smax[h] <= tau) {
            CHECK(memcmp(q1, q0, DQK * QL * 4) == 0 && memcmp(k1, k0, DQK * KL * 4) == 0,
                  "head %d (S_max %g <= tau) must be untouched bit for bit", h, smax[h]);
            CHECK(scale[h] == 1.0f, "untouched head's logit factor is 1");
            continue;
        }
        double f = sqrt((double)tau / smax[h]);
        int exact = 1;
        for (int i = 0; i < DQK * QL; i++) exact &= q1[i] == (float)((double)q0[i] * f);
        for (int i = 0; i < DQK * KL; i++) exact &= k1[i] == (float)((double)k0[i] * f);
        CHECK(exact, "head %d rows must be the old rows times sqrt(tau/S_max), rounded once", h);
        /* the head's q.k logit scales by tau / S_max */
        double l0 = 0, l1 = 0;
        for (int d = 0; d < DQK; d++) {
            double qa = 0, qb = 0, ka = 0, kb = 0;
            for (int j = 0; j < QL; j++) qa += (double)q0[d * QL + j] * x[j], qb += (double)q1[d * QL + j] * x[j];
            for (int j = 0; j < KL; j++) ka += (double)k0[d * KL + j] * c[j], kb += (double)k1[d * KL + j] * c[j];
            l0 += qa * ka;
            l1 += qb * kb;
        }
        CHECK_CLOSE(l1 / l0, tau / smax[h], 0, 1e-5, "logit ratio = tau/S_max");
        CHECK_CLOSE(scale[h], tau / smax[h], 0, 1e-7, "reported logit factor");
    }
    /* shared keys (GQA): query rows take the whole factor */
    float q[6], q0s[6];
    fill(&r, q, 6, 1.0);
    memcpy(q0s, q, sizeof q);
    lm_qk_clip_head gh = {.q_rows = q, .q_nrows = 2, .q_cols = 3};
    float s1 = 400.0f;
    CHECK(lm_qk_clip(&gh, 1, &s1, tau, NULL, NULL) == LM_OK, "%s", lm_last_error());
    for (int i = 0; i < 6; i++) CHECK(q[i] == (float)((double)q0s[i] * 0.25), "GQA: q scaled by tau/S_max");
    /* NaN S_max: rejected, nothing touched */
    memcpy(wq0, wq, sizeof wq);
    float bad[H] = {500.0f, NAN, 1.0f, 1.0f};
    CHECK(lm_qk_clip_mla(wq, wk, H, DQK, 0, QL, KL, bad, tau, NULL, NULL) == LM_ERR_NUMERIC,
          "NaN S_max rejected");
    CHECK(memcmp(wq, wq0, sizeof wq) == 0, "a rejected call leaves every head untouched");
    CHECK(lm_qk_clip_mla(wq, wk, H, DQK, 0, QL, KL, smax, 0.0f, NULL, NULL) == LM_ERR_ARG,
          "tau 0 rejected");
}

/* MLA with a rotary part (rope_dims r > 0): head h's query is W_uq rows
 * [h*Dk, (h+1)*Dk) = [nope (Dn) ; rope (r)], its key [W_uk,h c ; kr] with kr shared
 * by all heads. After the clip every logit q.k of a clipped head is eta times the
 * old one, the shared kr is untouched and unclipped heads keep their bits. */
static void test_qk_clip_mla_with_rope_scales_logits_by_eta(void) {
    lm_rng r;
    lm_rng_seed(&r, 708);
    enum { H = 3, DK = 10, RD = 4, DN = DK - RD, QL = 9, KL = 7 };
    static float wq[H * DK * QL], wk[H * DN * KL], wq0[H * DK * QL], wk0[H * DN * KL];
    float x[QL], c[KL], kr[RD];
    fill(&r, wq, H * DK * QL, 0.4);
    fill(&r, wk, H * DN * KL, 0.4);
    fill(&r, x, QL, 1.0);
    fill(&r, c, KL, 1.0);
    fill(&r, kr, RD, 1.0);
    memcpy(wq0, wq, sizeof wq);
    memcpy(wk0, wk, sizeof wk);
    const float tau = 100.0f;
    float smax[H] = {120.0f, 99.5f, 400.0f};
    CHECK(lm_qk_clip_mla(wq, wk, H, DK, RD, QL, KL, smax, tau, NULL, NULL) == LM_OK, "%s",
          lm_last_error());
    for (int h = 0; h < H; h++) {
        double l[2];
        for (int pass = 0; pass < 2; pass++) {
            const float *q = (pass ? wq : wq0) + h * DK * QL, *k = (pass ? wk : wk0) + h * DN * KL;
            double s = 0;
            for (int d = 0; d < DK; d++) {
                double qd = 0, kd = 0;
                for (int j = 0; j < QL; j++) qd += (double)q[d * QL + j] * x[j];
                if (d < DN)
                    for (int j = 0; j < KL; j++) kd += (double)k[d * KL + j] * c[j];
                else
                    kd = kr[d - DN];
                s += qd * kd;
            }
            l[pass] = s;
        }
        double want = smax[h] > tau ? (double)tau / smax[h] : 1.0;
        CHECK_CLOSE(l[1] / l[0], want, 0, 1e-5, "MLA+RoPE logit ratio");
        if (smax[h] <= tau)
            CHECK(memcmp(wq + h * DK * QL, wq0 + h * DK * QL, DK * QL * 4) == 0 &&
                      memcmp(wk + h * DN * KL, wk0 + h * DN * KL, DN * KL * 4) == 0,
                  "unclipped head untouched");
        else {
            double eta = (double)tau / smax[h];
            int ok = 1;
            for (int i = 0; i < DK * QL; i++) {
                int rope_row = (i / QL) >= DN;
                double f = rope_row ? eta : sqrt(eta);
                ok &= wq[h * DK * QL + i] == (float)((double)wq0[h * DK * QL + i] * f);
            }
            CHECK(ok, "head %d: nope rows x sqrt(eta), rope rows x eta", h);
        }
    }
}

/* GQA: with one key head per query head both sides take sqrt(eta); with shared
 * key heads only the query rows change (by eta) and W_k keeps its bits. */
static void test_qk_clip_gqa_shared_keys_untouched(void) {
    lm_rng r;
    lm_rng_seed(&r, 709);
    enum { H = 4, DK = 5, D = 6 };
    static float wq[H * DK * D], wk[H * DK * D], wq0[H * DK * D], wk0[H * DK * D];
    float smax[H] = {10.0f, 200.0f, 100.0f, 300.0f};
    const float tau = 100.0f;
    for (int hkv = H; hkv >= 2; hkv /= 2) {
        fill(&r, wq, H * DK * D, 0.5);
        fill(&r, wk, hkv * DK * D, 0.5);
        memcpy(wq0, wq, sizeof wq);
        memcpy(wk0, wk, sizeof wk);
        int n = 0;
        CHECK(lm_qk_clip_gqa(wq, wk, H, hkv, DK, D, smax, tau, NULL, &n) == LM_OK, "%s",
              lm_last_error());
        CHECK(n == 2, "two heads clipped");
        for (int h = 0; h < H; h++) {
            double eta = smax[h] > tau ? (double)tau / smax[h] : 1.0;
            double fq = hkv == H ? sqrt(eta) : eta;
            int ok = 1;
            for (int i = 0; i < DK * D; i++)
                ok &= wq[h * DK * D + i] == (float)((double)wq0[h * DK * D + i] * fq);
            CHECK(ok, "Hkv %d head %d query rows x %g", hkv, h, fq);
            if (hkv == H) {
                for (int i = 0; i < DK * D; i++)
                    ok &= wk[h * DK * D + i] == (float)((double)wk0[h * DK * D + i] * sqrt(eta));
                CHECK(ok, "own key rows x sqrt(eta)");
            }
        }
        if (hkv < H) CHECK(memcmp(wk, wk0, hkv * DK * D * 4) == 0, "shared keys untouched");
    }
    CHECK(lm_qk_clip_gqa(wq, wk, H, 3, DK, D, smax, tau, NULL, NULL) == LM_ERR_ARG,
          "H not a multiple of Hkv rejected");
}

/* ---------------------------------------------------------------------------
 * Schedules
 * ------------------------------------------------------------------------- */

static void test_cosine_schedule_key_points(void) {
    const float peak = 3e-3f, ratio = 0.1f;
    const int64_t T = 111; /* warmup 10% -> ceil(11.1) = 12 steps; decay span 98 */
    CHECK(lm_lr_warmup_steps(T, 0.1f) == 12, "warmup steps %lld", (long long)lm_lr_warmup_steps(T, 0.1f));
    CHECK(lm_lr_warmup_steps(10, 0.3f) == 3, "0.3f*10 means 3 steps, not 4");
    CHECK(lm_lr_warmup_steps(1000, 0.01f) == 10, "1%% of 1000 is 10");
    CHECK(lm_lr_warmup_steps(1000, 0.0f) == 0, "no warmup");
    CHECK_CLOSE(lm_lr_cosine(0, T, peak, 0.1f, ratio), peak / 12.0, 0, 1e-6, "start: peak/W");
    CHECK_CLOSE(lm_lr_cosine(5, T, peak, 0.1f, ratio), peak * 6 / 12.0, 0, 1e-6, "warmup linear");
    CHECK_CLOSE(lm_lr_cosine(11, T, peak, 0.1f, ratio), peak, 0, 1e-6, "end of warmup: peak");
    CHECK_CLOSE(lm_lr_cosine(12, T, peak, 0.1f, ratio), peak, 0, 1e-6, "decay starts at peak");
    CHECK_CLOSE(lm_lr_cosine(12 + 49, T, peak, 0.1f, ratio), peak * (1 + ratio) / 2, 0, 1e-6,
                "middle of decay: (peak+min)/2");
    CHECK_CLOSE(lm_lr_cosine(12 + 49 / 2, T, peak, 0.1f, ratio),
                peak * (ratio + (1 - ratio) * 0.5 * (1 + cos(3.14159265358979 * 24.0 / 98))), 0,
                1e-6, "cosine shape");
    CHECK_CLOSE(lm_lr_cosine(T - 1, T, peak, 0.1f, ratio), peak * ratio, 0, 1e-6, "end: min");
    CHECK_CLOSE(lm_lr_cosine(T + 50, T, peak, 0.1f, ratio), peak * ratio, 0, 1e-6, "past end: min");
    int mono = 1;
    for (int64_t s = 1; s < T; s++) {
        float a = lm_lr_cosine(s - 1, T, peak, 0.1f, ratio), b = lm_lr_cosine(s, T, peak, 0.1f, ratio);
        mono &= s < 12 ? b > a : b <= a;
    }
    CHECK(mono, "rises during warmup, never rises after");
    lm_lr_schedule sch = lm_lr_schedule_default(peak);
    CHECK(sch.kind == LM_LR_COSINE && lm_lr_schedule_check(&sch) == LM_OK, "default is cosine");
    CHECK(lm_lr_at(&sch, 500, 1000) == lm_lr_cosine(500, 1000, peak, 0.01f, 0.1f), "lm_lr_at");
}

static void test_wsd_schedule_shape(void) {
    const float peak = 1e-3f, ratio = 0.0f;
    const int64_t T = 100; /* warmup 10, stable 10..79, linear decay 80..99 */
    CHECK_CLOSE(lm_lr_wsd(0, T, peak, 0.1f, 0.2f, ratio), peak / 10, 0, 1e-6, "start");
    CHECK_CLOSE(lm_lr_wsd(9, T, peak, 0.1f, 0.2f, ratio), peak, 0, 1e-6, "end of warmup");
    int stable = 1;
    for (int64_t s = 10; s <= 80; s++) stable &= lm_lr_wsd(s, T, peak, 0.1f, 0.2f, ratio) == peak;
    CHECK(stable, "stable phase holds the peak exactly");
    double d0 = lm_lr_wsd(80, T, peak, 0.1f, 0.2f, ratio) - lm_lr_wsd(81, T, peak, 0.1f, 0.2f, ratio);
    int linear = 1;
    for (int64_t s = 81; s < 99; s++) {
        double d = lm_lr_wsd(s, T, peak, 0.1f, 0.2f, ratio) - lm_lr_wsd(s + 1, T, peak, 0.1f, 0.2f, ratio);
        linear &= fabs(d - d0) < 1e-9 && d > 0;
    }
    CHECK(linear, "decay is linear and strictly decreasing");
    CHECK_CLOSE(d0, peak / 19.0, 0, 1e-5, "decay slope");
    CHECK(lm_lr_wsd(99, T, peak, 0.1f, 0.2f, ratio) == 0.0f, "end: min (0)");
    CHECK_CLOSE(lm_lr_wsd(99, T, peak, 0.1f, 0.2f, 0.1f), peak * 0.1, 0, 1e-6, "end: min ratio");
    lm_lr_schedule s = lm_lr_schedule_default(peak);
    s.kind = LM_LR_WSD;
    s.warmup_frac = 0.5f;
    s.decay_frac = 0.6f;
    CHECK(lm_lr_schedule_check(&s) == LM_ERR_ARG, "warmup + decay > 1 rejected");
    s = lm_lr_schedule_default(peak);
    s.min_lr_ratio = 1.5f;
    CHECK(lm_lr_schedule_check(&s) == LM_ERR_ARG && strstr(lm_last_error(), "min lr ratio"),
          "min ratio 1.5 rejected by name");
    s = lm_lr_schedule_default(0.0f);
    CHECK(lm_lr_schedule_check(&s) == LM_ERR_ARG, "peak 0 rejected");
    lm_lr_schedule_kind k;
    CHECK(lm_lr_schedule_from_name("wsd", &k) == 0 && k == LM_LR_WSD &&
              lm_lr_schedule_from_name("linear", &k) != 0,
          "names");
}

/* ---------------------------------------------------------------------------
 * End to end: least squares, determinism
 * ------------------------------------------------------------------------- */

/* loss = 0.5/N ||X W^T - Y||^2 with Y = X W*^T; grad = (1/N) (X W^T - Y)^T X. */
enum { LS_N = 96, LS_IN = 24, LS_OUT = 12 };

static double ls_loss_grad(const float *w, float *gw, const float *x, const float *y) {
    double loss = 0;
    static double e[LS_N * LS_OUT];
    for (int i = 0; i < LS_N; i++)
        for (int o = 0; o < LS_OUT; o++) {
            double s = 0;
            for (int k = 0; k < LS_IN; k++) s += (double)x[i * LS_IN + k] * w[o * LS_IN + k];
            e[i * LS_OUT + o] = s - y[i * LS_OUT + o];
            loss += 0.5 * e[i * LS_OUT + o] * e[i * LS_OUT + o] / LS_N;
        }
    for (int o = 0; o < LS_OUT; o++)
        for (int k = 0; k < LS_IN; k++) {
            double s = 0;
            for (int i = 0; i < LS_N; i++) s += e[i * LS_OUT + o] * x[i * LS_IN + k];
            gw[o * LS_IN + k] = (float)(s / LS_N);
        }
    return loss;
}

/* Run `steps` of optimizer `kind` on the least-squares problem; losses[steps+1]. */
static void ls_run(lm_optimizer_kind kind, int steps, float lr, double *losses, float *w_out) {
    lm_rng r;
    lm_rng_seed(&r, 808);
    static float x[LS_N * LS_IN], y[LS_N * LS_OUT], wstar[LS_OUT * LS_IN], w[LS_OUT * LS_IN],
        g[LS_OUT * LS_IN], st[2 * LS_OUT * LS_IN];
    fill(&r, x, LS_N * LS_IN, 1.0);
    fill(&r, wstar, LS_OUT * LS_IN, 0.3);
    fill(&r, w, LS_OUT * LS_IN, 0.05);
    for (int i = 0; i < LS_N; i++)
        for (int o = 0; o < LS_OUT; o++) {
            double s = 0;
            for (int k = 0; k < LS_IN; k++) s += (double)x[i * LS_IN + k] * wstar[o * LS_IN + k];
            y[i * LS_OUT + o] = (float)s;
        }
    lm_param p = lm_param_matrix("w", w, g, LS_OUT, LS_IN, LM_PARAM_MATRIX);
    p.optimizer = kind;
    p.weight_decay = 0;
    size_t ns = lm_optim_scratch_floats(&p, 1);
    float *scr = alloc_f(ns);
    lm_optim_config cfg = lm_optim_config_default();
    lm_optimizer opt;
    CHECK(lm_optimizer_init(&opt, &cfg, &p, 1, st, sizeof st / 4, scr, ns) == LM_OK, "%s",
          lm_last_error());
    for (int t = 0; t < steps; t++) {
        losses[t] = ls_loss_grad(w, g, x, y);
        lm_optimizer_step(&opt, lm_lr_cosine(t, steps, lr, 0.05f, 0.1f));
    }
    losses[steps] = ls_loss_grad(w, g, x, y);
    if (w_out) memcpy(w_out, w, sizeof w);
    free(scr);
}

static void test_adamw_and_muon_both_reduce_least_squares_loss(void) {
    enum { STEPS = 150 };
    double la[STEPS + 1], lmu[STEPS + 1];
    ls_run(LM_OPT_ADAMW, STEPS, 0.05f, la, NULL);
    ls_run(LM_OPT_MUON, STEPS, 0.05f, lmu, NULL);
    printf("  least squares loss: AdamW %.4g -> %.4g, Muon %.4g -> %.4g (%d steps)\n", la[0],
           la[STEPS], lmu[0], lmu[STEPS], STEPS);
    CHECK(la[STEPS] < 0.02 * la[0], "AdamW reduces the loss 50x: %g -> %g", la[0], la[STEPS]);
    CHECK(lmu[STEPS] < 0.02 * lmu[0], "Muon reduces the loss 50x: %g -> %g", lmu[0], lmu[STEPS]);
}

static void test_runs_are_bit_identical(void) {
    enum { STEPS = 20 };
    double l1[STEPS + 1], l2[STEPS + 1];
    static float w1[LS_OUT * LS_IN], w2[LS_OUT * LS_IN];
    ls_run(LM_OPT_MUON, STEPS, 0.02f, l1, w1);
    ls_run(LM_OPT_MUON, STEPS, 0.02f, l2, w2);
    CHECK(memcmp(l1, l2, sizeof l1) == 0 && memcmp(w1, w2, sizeof w1) == 0,
          "two Muon runs give the same bits");
    ls_run(LM_OPT_ADAMW, STEPS, 0.02f, l1, w1);
    ls_run(LM_OPT_ADAMW, STEPS, 0.02f, l2, w2);
    CHECK(memcmp(l1, l2, sizeof l1) == 0 && memcmp(w1, w2, sizeof w1) == 0,
          "two AdamW runs give the same bits");
}

/* Parameters large enough to take the OpenMP paths: one thread and several
 * threads must give the same bits (weights, state, grad norm). */
static void run_big(int threads, float *w_out, float *state_out, double *norm_out) {
    enum { R = 128, C = 160, E = 200, D = 100 };
    lm_rng r;
    lm_rng_seed(&r, 909);
    float *wm = alloc_f(R * C), *gm = alloc_f(R * C), *wh = alloc_f(R * C), *gh = alloc_f(R * C);
    float *we = alloc_f(E * D), *ge = alloc_f(E * D);
    fill(&r, wm, R * C, 0.1);
    fill(&r, wh, R * C, 0.1);
    fill(&r, we, E * D, 0.1);
    lm_param ps[3] = {lm_param_matrix("w", wm, gm, R, C, LM_PARAM_MATRIX),
                      lm_param_matrix("wq", wh, gh, R, C, LM_PARAM_MATRIX),
                      lm_param_matrix("emb", we, ge, E, D, LM_PARAM_EMBEDDING)};
    ps[1].n_blocks = 2;
    size_t nst = lm_optim_state_floats(ps, 3), ns = lm_optim_scratch_floats(ps, 3);
    float *st = alloc_f(nst), *scr = alloc_f(ns);
    lm_optim_config cfg = lm_optim_config_default();
    lm_optimizer opt;
    CHECK(lm_optimizer_init(&opt, &cfg, ps, 3, st, nst, scr, ns) == LM_OK, "%s", lm_last_error());
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    for (int t = 0; t < 2; t++) {
        fill(&r, gm, R * C, 1.0);
        fill(&r, gh, R * C, 1.0);
        fill(&r, ge, E * D, 1.0);
        CHECK(lm_grad_clip(ps, 3, 50.0f, &norm_out[t]) == LM_OK, "%s", lm_last_error());
        lm_optimizer_step(&opt, 0.01f);
    }
    omp_set_num_threads(saved);
    memcpy(w_out, wm, R * C * 4);
    memcpy(w_out + R * C, wh, R * C * 4);
    memcpy(w_out + 2 * R * C, we, E * D * 4);
    memcpy(state_out, st, nst * 4);
    free(wm), free(gm), free(wh), free(gh), free(we), free(ge), free(st), free(scr);
}

static void test_results_do_not_depend_on_thread_count(void) {
    size_t nw = 2 * 128 * 160 + 200 * 100, nst = 2 * 128 * 160 + 2 * 200 * 100;
    float *w1 = alloc_f(nw), *w4 = alloc_f(nw), *s1 = alloc_f(nst), *s4 = alloc_f(nst);
    double n1[2], n4[2];
    run_big(1, w1, s1, n1);
    run_big(4, w4, s4, n4);
    CHECK(memcmp(w1, w4, nw * 4) == 0, "weights: 1 thread vs 4 threads differ");
    CHECK(memcmp(s1, s4, nst * 4) == 0, "state: 1 thread vs 4 threads differ");
    CHECK(memcmp(n1, n4, sizeof n1) == 0, "grad norm: 1 thread vs 4 threads differ");
    free(w1), free(w4), free(s1), free(s4);
}

int main(void) {
    RUN(test_split_rule_muon_for_hidden_matrices_adamw_for_the_rest);
    RUN(test_bad_parameters_and_buffers_are_rejected);
    RUN(test_adamw_matches_float64_over_steps);
    RUN(test_newton_schulz_gives_singular_values_in_band);
    RUN(test_newton_schulz_of_transpose_is_transpose);
    RUN(test_muon_update_has_documented_rms_scale);
    RUN(test_muon_matches_float64_nesterov_reference);
    RUN(test_muon_per_head_equals_separate_slices_and_differs_from_whole);
    RUN(test_muon_blocks_in_parallel_equal_sequential);
    RUN(test_grad_clip_norm_and_clipped_norm);
    RUN(test_qk_clip_scales_only_heads_above_tau);
    RUN(test_qk_clip_mla_with_rope_scales_logits_by_eta);
    RUN(test_qk_clip_gqa_shared_keys_untouched);
    RUN(test_cosine_schedule_key_points);
    RUN(test_wsd_schedule_shape);
    RUN(test_adamw_and_muon_both_reduce_least_squares_loss);
    RUN(test_runs_are_bit_identical);
    RUN(test_results_do_not_depend_on_thread_count);
    return test_summary();
}
