/* Matrix products and RMSNorm against float64 references and finite differences. */
#include "longmoe/linear.h"
#include "test.h"

static void fill(lm_rng *r, float *x, size_t n, double s) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(s * lm_rng_normal(r));
}

static void test_matmul_forward_matches_float64(void) {
    lm_rng r;
    lm_rng_seed(&r, 11);
    int n = 7, ic = 13, oc = 5;
    float x[7 * 13], w[5 * 13], b[5], y[7 * 5];
    fill(&r, x, sizeof x / 4, 1);
    fill(&r, w, sizeof w / 4, 1);
    fill(&r, b, 5, 1);
    lm_matmul_forward(y, x, w, b, n, ic, oc);
    for (int i = 0; i < n; i++)
        for (int o = 0; o < oc; o++) {
            double s = b[o];
            for (int k = 0; k < ic; k++) s += (double)x[i * ic + k] * w[o * ic + k];
            CHECK_CLOSE(y[i * oc + o], s, 1e-5, 1e-5, "matmul out");
        }
}

/* loss = sum(y * g); the backward must equal central differences of it. */
static double matmul_loss(const float *x, const float *w, const float *b, const float *g, int n,
                          int ic, int oc) {
    double L = 0;
    for (int i = 0; i < n; i++)
        for (int o = 0; o < oc; o++) {
            double s = b[o];
            for (int k = 0; k < ic; k++) s += (double)x[i * ic + k] * w[o * ic + k];
            L += s * g[i * oc + o];
        }
    return L;
}

static void test_matmul_backward_matches_finite_differences(void) {
    lm_rng r;
    lm_rng_seed(&r, 12);
    enum { n = 4, ic = 6, oc = 3 };
    float x[n * ic], w[oc * ic], b[oc], g[n * oc];
    float dx[n * ic] = {0}, dw[oc * ic] = {0}, db[oc] = {0};
    fill(&r, x, n * ic, 1);
    fill(&r, w, oc * ic, 1);
    fill(&r, b, oc, 1);
    fill(&r, g, n * oc, 1);
    lm_matmul_backward(dx, dw, db, g, x, w, n, ic, oc);
    float *params[3] = {x, w, b};
    float *grads[3] = {dx, dw, db};
    int sizes[3] = {n * ic, oc * ic, oc};
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < sizes[p]; i++) {
            float keep = params[p][i], h = 1e-2f;
            params[p][i] = keep + h;
            double lp = matmul_loss(x, w, b, g, n, ic, oc);
            params[p][i] = keep - h;
            double lm = matmul_loss(x, w, b, g, n, ic, oc);
            params[p][i] = keep;
            CHECK_CLOSE(grads[p][i], (lp - lm) / (2 * h), 1e-3, 1e-3, "matmul grad");
        }
}

static double rmsnorm_loss(const float *x, const float *w, const float *g, int n, int d) {
    double L = 0;
    for (int i = 0; i < n; i++) {
        double ss = 0;
        for (int k = 0; k < d; k++) ss += (double)x[i * d + k] * x[i * d + k];
        double s = 1.0 / sqrt(ss / d + 1e-6);
        for (int k = 0; k < d; k++) L += x[i * d + k] * s * w[k] * g[i * d + k];
    }
    return L;
}

static void test_rmsnorm_forward_and_backward(void) {
    lm_rng r;
    lm_rng_seed(&r, 13);
    enum { n = 3, d = 8 };
    float x[n * d], w[d], g[n * d], y[n * d], rstd[n];
    float dx[n * d] = {0}, dw[d] = {0}, dx2[n * d] = {0};
    fill(&r, x, n * d, 1);
    fill(&r, w, d, 1);
    fill(&r, g, n * d, 1);
    lm_rmsnorm_forward(y, rstd, x, w, n, d, 1e-6f);
    for (int i = 0; i < n; i++) {
        double ss = 0;
        for (int k = 0; k < d; k++) ss += (double)x[i * d + k] * x[i * d + k];
        double s = 1.0 / sqrt(ss / d + 1e-6);
        for (int k = 0; k < d; k++) CHECK_CLOSE(y[i * d + k], x[i * d + k] * s * w[k], 1e-6, 1e-5, "rmsnorm out");
    }
    lm_rmsnorm_backward(dx, dw, g, x, w, rstd, n, d, 1e-6f);
    lm_rmsnorm_backward(dx2, NULL, g, x, w, NULL, n, d, 1e-6f);
    float *params[2] = {x, w};
    float *grads[2] = {dx, dw};
    int sizes[2] = {n * d, d};
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < sizes[p]; i++) {
            float keep = params[p][i], h = 1e-2f;
            params[p][i] = keep + h;
            double lp = rmsnorm_loss(x, w, g, n, d);
            params[p][i] = keep - h;
            double lm = rmsnorm_loss(x, w, g, n, d);
            params[p][i] = keep;
            CHECK_CLOSE(grads[p][i], (lp - lm) / (2 * h), 2e-3, 2e-3, "rmsnorm grad");
        }
    for (int i = 0; i < n * d; i++) CHECK_CLOSE(dx2[i], dx[i], 1e-6, 1e-5, "rstd recomputed");
}

static void test_backward_accumulates(void) {
    lm_rng r;
    lm_rng_seed(&r, 14);
    enum { n = 2, ic = 3, oc = 2 };
    float x[n * ic], w[oc * ic], g[n * oc], dx1[n * ic] = {0}, dx2[n * ic] = {0};
    fill(&r, x, n * ic, 1);
    fill(&r, w, oc * ic, 1);
    fill(&r, g, n * oc, 1);
    lm_matmul_backward(dx1, NULL, NULL, g, x, w, n, ic, oc);
    lm_matmul_backward(dx2, NULL, NULL, g, x, w, n, ic, oc);
    lm_matmul_backward(dx2, NULL, NULL, g, x, w, n, ic, oc);
    for (int i = 0; i < n * ic; i++) CHECK_CLOSE(dx2[i], 2 * dx1[i], 1e-6, 1e-6, "twice = double");
}

static void test_sigmoid_is_stable_at_extremes(void) {
    CHECK(lm_sigmoidf(1e30f) == 1.0f, "sigmoid(+huge) = %g", lm_sigmoidf(1e30f));
    CHECK(lm_sigmoidf(-1e30f) == 0.0f, "sigmoid(-huge) = %g", lm_sigmoidf(-1e30f));
    CHECK_CLOSE(lm_sigmoidf(0.3f), 1 / (1 + exp(-0.3)), 1e-7, 1e-6, "sigmoid(0.3)");
    CHECK_CLOSE(lm_siluf(-2.0f), -2 / (1 + exp(2.0)), 1e-7, 1e-6, "silu(-2)");
}

int main(void) {
    RUN(test_matmul_forward_matches_float64);
    RUN(test_matmul_backward_matches_finite_differences);
    RUN(test_rmsnorm_forward_and_backward);
    RUN(test_backward_accumulates);
    RUN(test_sigmoid_is_stable_at_extremes);
    return test_summary();
}
