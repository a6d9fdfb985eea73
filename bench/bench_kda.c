/* KDA CPU operator timing: chunked form with the bounded gate (factored
 * diagonal sub-chunk) against the softplus gate (pairwise diagonal), the
 * bounded gate forced onto the pairwise path, and the recurrent form.
 * Forward and forward+backward, median of several runs; prints a markdown
 * table and the ratios. Usage: bench_kda [runs] (default 5). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <omp.h>

#include "bench_common.h"
#include "check.h"
#include "longmoe/kda.h"

typedef struct {
    const char *name;
    lm_kda_gate gate;
    lm_kda_diag diag;
    int recurrent;
} variant;

/* CPU seconds of the whole process (all threads): stable on a shared machine
 * where wall time includes waiting for a core. */
static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void fill_normal(lm_rng *r, float *x, size_t n, double s) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(s * lm_rng_normal(r));
}

static void l2norm_rows(float *x, size_t rows, int K) {
    for (size_t i = 0; i < rows; i++) {
        double n = 0;
        for (int d = 0; d < K; d++) n += (double)x[i * K + d] * x[i * K + d];
        for (int d = 0; d < K; d++) x[i * K + d] = (float)(x[i * K + d] / sqrt(n));
    }
}

static void bench_shape(int B, int T, int H, int K, int V, int runs) {
    const size_t nqk = (size_t)B * T * H * K, nv = (size_t)B * T * H * V, nbt = (size_t)B * T * H;
    const size_t ns = (size_t)B * H * K * V;
    lm_rng r;
    lm_rng_seed(&r, 42);
    float *q = mallocCheck(nqk * sizeof(float)), *k = mallocCheck(nqk * sizeof(float));
    float *z = mallocCheck(nqk * sizeof(float)), *v = mallocCheck(nv * sizeof(float));
    float *beta = mallocCheck(nbt * sizeof(float)), *A_log = mallocCheck(H * sizeof(float));
    float *dt_bias = mallocCheck((size_t)H * K * sizeof(float)), *h0 = mallocCheck(ns * sizeof(float));
    float *o = mallocCheck(nv * sizeof(float)), *ht = mallocCheck(ns * sizeof(float));
    float *d_o = mallocCheck(nv * sizeof(float)), *dht = mallocCheck(ns * sizeof(float));
    float *gq = callocCheck(nqk, sizeof(float)), *gk = callocCheck(nqk, sizeof(float));
    float *gz = callocCheck(nqk, sizeof(float)), *gv = callocCheck(nv, sizeof(float));
    float *gb = callocCheck(nbt, sizeof(float)), *gA = callocCheck(H, sizeof(float));
    float *gdt = callocCheck((size_t)H * K, sizeof(float)), *gh0 = callocCheck(ns, sizeof(float));
    fill_normal(&r, q, nqk, 1);
    fill_normal(&r, k, nqk, 1);
    l2norm_rows(q, nbt, K);
    l2norm_rows(k, nbt, K);
    fill_normal(&r, z, nqk, 1);
    fill_normal(&r, v, nv, 1);
    for (size_t i = 0; i < nbt; i++) beta[i] = (float)(1 / (1 + exp(-lm_rng_normal(&r))));
    fill_normal(&r, A_log, H, 0.3);
    fill_normal(&r, dt_bias, (size_t)H * K, 0.5);
    fill_normal(&r, h0, ns, 0.5);
    fill_normal(&r, d_o, nv, 1);
    fill_normal(&r, dht, ns, 1);
    lm_kda_inputs in = {q, k, v, z, beta, A_log, dt_bias, h0};
    lm_kda_grads g = {gq, gk, gv, gz, gb, gA, gdt, gh0};

    const variant vs[] = {
        {"chunked, bounded gate (factored diag)", LM_KDA_GATE_BOUNDED, LM_KDA_DIAG_AUTO, 0},
        {"chunked, softplus gate (pairwise diag)", LM_KDA_GATE_SOFTPLUS, LM_KDA_DIAG_AUTO, 0},
        {"chunked, bounded gate forced pairwise", LM_KDA_GATE_BOUNDED, LM_KDA_DIAG_PAIRWISE, 0},
        {"recurrent, bounded gate", LM_KDA_GATE_BOUNDED, LM_KDA_DIAG_AUTO, 1},
    };
    const int nvar = sizeof vs / sizeof vs[0];
    double fwd[4], fb[4], fwdc[4], fbc[4];
    double *t = mallocCheck(runs * sizeof(double)), *tc = mallocCheck(runs * sizeof(double));
    printf("\nbuild: %s\n", lm_build_cpu_target());
    printf("B=%d T=%d H=%d K=%d V=%d, chunk 64, %d threads, median of %d runs\n\n", B, T, H, K, V,
           omp_get_max_threads(), runs);
    printf("| variant | forward ms | fwd+bwd ms | forward CPU ms | fwd+bwd CPU ms |\n"
           "|---|---:|---:|---:|---:|\n");
    for (int vi = 0; vi < nvar; vi++) {
        lm_kda_config c = lm_kda_config_default(B, T, H, K, V);
        c.gate = vs[vi].gate;
        c.diag = vs[vi].diag;
        for (int rep = -1; rep < runs; rep++) { /* rep -1: warm-up */
            double t0 = lm_time_seconds(), c0 = cpu_seconds();
            lm_status st = vs[vi].recurrent ? lm_kda_recurrent_forward(&c, &in, o, ht)
                                            : lm_kda_chunk_forward(&c, &in, o, ht);
            if (st) dieAt("kda forward: %s", lm_last_error());
            if (rep >= 0) t[rep] = lm_time_seconds() - t0, tc[rep] = cpu_seconds() - c0;
        }
        fwd[vi] = bench_median(t, runs);
        fwdc[vi] = bench_median(tc, runs);
        fb[vi] = fbc[vi] = NAN;
        if (!vs[vi].recurrent) {
            for (int rep = -1; rep < runs; rep++) {
                double t0 = lm_time_seconds(), c0 = cpu_seconds();
                lm_status st = lm_kda_chunk_forward(&c, &in, o, ht);
                if (!st) st = lm_kda_chunk_backward(&c, &in, d_o, dht, &g);
                if (st) dieAt("kda forward+backward: %s", lm_last_error());
                if (rep >= 0) t[rep] = lm_time_seconds() - t0, tc[rep] = cpu_seconds() - c0;
            }
            fb[vi] = bench_median(t, runs);
            fbc[vi] = bench_median(tc, runs);
        }
        char fbs[32], fbcs[32];
        if (isnan(fb[vi])) snprintf(fbs, sizeof fbs, "n/a"), snprintf(fbcs, sizeof fbcs, "n/a");
        else snprintf(fbs, sizeof fbs, "%.1f", 1e3 * fb[vi]), snprintf(fbcs, sizeof fbcs, "%.1f", 1e3 * fbc[vi]);
        printf("| %s | %.1f | %s | %.1f | %s |\n", vs[vi].name, 1e3 * fwd[vi], fbs, 1e3 * fwdc[vi], fbcs);
    }
    printf("\nratios of CPU time: softplus(pairwise)/bounded(factored) forward %.2fx, fwd+bwd %.2fx; "
           "bounded forced pairwise/factored forward %.2fx, fwd+bwd %.2fx; recurrent/chunked-bounded "
           "forward %.2fx\n",
           fwdc[1] / fwdc[0], fbc[1] / fbc[0], fwdc[2] / fwdc[0], fbc[2] / fbc[0], fwdc[3] / fwdc[0]);
    free(t);
    free(tc);
    free(q); free(k); free(z); free(v); free(beta); free(A_log); free(dt_bias); free(h0);
    free(o); free(ht); free(d_o); free(dht);
    free(gq); free(gk); free(gz); free(gv); free(gb); free(gA); free(gdt); free(gh0);
}

int main(int argc, char **argv) {
    int runs = argc > 1 ? atoi(argv[1]) : 5;
    if (runs < 1 || runs > 1000) {
        fprintf(stderr, "usage: bench_kda [runs (1..1000, default 5)]\n");
        return 2;
    }
    bench_shape(1, 4096, 4, 64, 64, runs);
    bench_shape(1, 2048, 2, 128, 128, runs);
    return 0;
}
