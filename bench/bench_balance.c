/* The floor of the quantile-balancing estimators (docs/moe.md).
 *
 * Repeats the quantile update on one fixed batch (as an offline solver would)
 * and prints MaxVio_batch after each update for the exact (sorting), the K3
 * histogram (1000 uniform bins over [min b - 1, max b + 1]) and the zoom
 * estimator (1000 bins around each b_j, window adapted per step), for router
 * scores of several concentrations; then the same on fresh batches of one
 * distribution, the training case. Prints markdown.
 *
 *   bench_balance [--updates N] [--tokens M]
 *
 * Router logits are low rank like a real router's: r_ij = <x_i, w_j> + c_j,
 * x_i ~ N(0, I_64), w_j ~ N(0, sigma^2 / 64 I), c_j ~ N(0, (sigma/2)^2):
 * sigma = 0.02 is the concentration at initialisation (s = 0.5 +- 0.005). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/balance.h"
#include "longmoe/linear.h"
#include "longmoe/moe.h"

#define RANK 64

static void make_router(float *w, float *c, int n, double sigma, uint64_t seed) {
    lm_rng r;
    lm_rng_seed(&r, seed);
    for (int q = 0; q < n * RANK; q++) w[q] = (float)(sigma / sqrt((double)RANK) * lm_rng_normal(&r));
    for (int j = 0; j < n; j++) c[j] = (float)(0.5 * sigma * lm_rng_normal(&r));
}

static void make_scores(float *s, const float *w, const float *c, int64_t m, int n, uint64_t seed) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        lm_rng r;
        lm_rng_seed(&r, seed * 1000003ull + (uint64_t)i);
        float x[RANK];
        for (int e = 0; e < RANK; e++) x[e] = (float)lm_rng_normal(&r);
        for (int j = 0; j < n; j++) {
            float acc = c[j];
            for (int e = 0; e < RANK; e++) acc += x[e] * w[j * RANK + e];
            s[i * n + j] = lm_sigmoidf(acc);
        }
    }
}

/* the columns, in print order */
static const lm_qb_estimator est_order[3] = {LM_QB_EXACT, LM_QB_HISTOGRAM, LM_QB_ZOOM};
static const char *est_name[3] = {"exact", "histogram (K3)", "zoom (ours)"};

/* curve[t] = MaxVio_batch after t updates; *ms = mean milliseconds per update. */
static void run(float *s, int64_t m, int n, int k, lm_qb_estimator est, int updates, int fresh,
                const float *w, const float *c, double *curve, double *ms) {
    lm_balance_config cfg = lm_balance_config_default(LM_BALANCE_QUANTILE, n, k, m);
    cfg.estimator = est;
    lm_balance_state st;
    if (lm_balance_init(&st, &cfg)) dieAt("%s", lm_last_error());
    double spent = 0;
    for (int t = 0; t <= updates; t++) {
        if (fresh) make_scores(s, w, c, m, n, 5000 + (uint64_t)t);
        lm_balance_stats stats;
        double t0 = lm_time_seconds();
        if (lm_balance_observe(&st, s, m, 1) || lm_balance_step_end(&st, 1, &stats)) dieAt("%s", lm_last_error());
        spent += lm_time_seconds() - t0;
        curve[t] = stats.maxvio_batch;
    }
    *ms = 1e3 * spent / (updates + 1);
    lm_balance_free(&st);
}

static double median_tail(const double *v, int from, int to) {
    int len = to - from + 1;
    double tmp[256];
    memcpy(tmp, v + from, (size_t)len * sizeof *tmp);
    for (int a = 1; a < len; a++)
        for (int b = a; b > 0 && tmp[b] < tmp[b - 1]; b--) {
            double x = tmp[b];
            tmp[b] = tmp[b - 1];
            tmp[b - 1] = x;
        }
    return len % 2 ? tmp[len / 2] : 0.5 * (tmp[len / 2 - 1] + tmp[len / 2]);
}

int main(int argc, char **argv) {
    int updates = 20;
    int64_t m = 16384;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--updates")) updates = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tokens")) m = atoll(argv[i + 1]);
    }
    if (updates < 4 || updates > 200 || m < 64) {
        fprintf(stderr, "usage: bench_balance [--updates 4..200] [--tokens M>=64]\n");
        return 2;
    }
    struct { int n, k; double sigma; int fresh; } cases[] = {
        {256, 8, 0.02, 0}, {256, 8, 0.2, 0}, {256, 8, 1.0, 0}, {1024, 16, 0.02, 0}, {256, 8, 0.02, 1},
    };
    int ncases = sizeof cases / sizeof cases[0];
    double (*curves)[3][201] = mallocCheck((size_t)ncases * sizeof *curves);
    double ms[8][3];
    for (int ci = 0; ci < ncases; ci++) {
        int n = cases[ci].n, k = cases[ci].k;
        float *w = mallocCheck((size_t)n * RANK * sizeof *w), *c = mallocCheck((size_t)n * sizeof *c);
        float *s = mallocCheck((size_t)m * n * sizeof *s);
        make_router(w, c, n, cases[ci].sigma, 17 + (uint64_t)ci);
        for (int e = 0; e < 3; e++) {
            if (!cases[ci].fresh) make_scores(s, w, c, m, n, 99);
            run(s, m, n, k, est_order[e], updates, cases[ci].fresh, w, c, curves[ci][e], &ms[ci][e]);
        }
        printf("\n### %s batch, m = %lld, n = %d, k = %d, logit scale sigma = %g\n\n",
               cases[ci].fresh ? "fresh" : "fixed", (long long)m, n, k, cases[ci].sigma);
        printf("| update | exact | histogram (K3) | zoom (ours) |\n|---:|---:|---:|---:|\n");
        for (int t = 0; t <= updates; t++)
            printf("| %d | %.4f | %.4f | %.4f |\n", t, curves[ci][0][t], curves[ci][1][t], curves[ci][2][t]);
        free(w);
        free(c);
        free(s);
        fflush(stdout);
    }
    int from = updates / 2 + 1;
    printf("\n### Summary: MaxVio_batch floor = median over updates %d..%d\n\n", from, updates);
    printf("| batch | m | n | k | sigma | estimator | after 3 | after 10 | floor | ms / update |\n"
           "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|\n");
    for (int ci = 0; ci < ncases; ci++)
        for (int e = 0; e < 3; e++)
            printf("| %s | %lld | %d | %d | %g | %s | %.4f | %.4f | %.4f | %.1f |\n",
                   cases[ci].fresh ? "fresh" : "fixed", (long long)m, cases[ci].n, cases[ci].k, cases[ci].sigma,
                   est_name[e], curves[ci][e][3], curves[ci][e][updates < 10 ? updates : 10],
                   median_tail(curves[ci][e], from, updates), ms[ci][e]);
    free(curves);
    return 0;
}
