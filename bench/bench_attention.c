/* Attention CPU core timing: the tiled online-softmax core against the naive
 * O(T^2)-memory version, forward and forward+backward, median of several runs
 * (B=1, H=4, D=64); then one long forward of the tiled core (default
 * T=65536, H=1, D=64) with its time and peak memory. Prints markdown tables.
 * Usage: bench_attention [runs] [long_T] (default 3 65536; runs 0 runs only the
 * long forward, long_T 0 skips it). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "bench_common.h"
#include "check.h"
#include "longmoe/attention.h"

static void fill_normal(lm_rng *r, float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = (float)lm_rng_normal(r);
}

/* kB value of a /proc/self/status line ("VmHWM:", "VmRSS:"), -1 if unavailable. */
static long status_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, n)) v = strtol(line + n, NULL, 10);
    fclose(f);
    return v;
}

typedef struct {
    float *q, *k, *v, *o, *lse, *d_o, *dq, *dk, *dv;
    size_t nq, no;
} buffers;

static buffers alloc_buffers(const lm_attention_config *c, int with_grads) {
    buffers b;
    memset(&b, 0, sizeof b);
    b.nq = (size_t)c->B * c->T * c->H * c->Dk;
    b.no = (size_t)c->B * c->T * c->H * c->Dv;
    const size_t nk = (size_t)c->B * c->T * c->Hkv * c->Dk, nv = (size_t)c->B * c->T * c->Hkv * c->Dv;
    lm_rng r;
    lm_rng_seed(&r, 42);
    b.q = mallocCheck(b.nq * 4), b.k = mallocCheck(nk * 4), b.v = mallocCheck(nv * 4);
    b.o = mallocCheck(b.no * 4), b.lse = mallocCheck((size_t)c->B * c->H * c->T * 4);
    fill_normal(&r, b.q, b.nq), fill_normal(&r, b.k, nk), fill_normal(&r, b.v, nv);
    if (with_grads) {
        b.d_o = mallocCheck(b.no * 4);
        fill_normal(&r, b.d_o, b.no);
        b.dq = callocCheck(b.nq, 4), b.dk = callocCheck(nk, 4), b.dv = callocCheck(nv, 4);
    }
    return b;
}

static void free_buffers(buffers *b) {
    free(b->q), free(b->k), free(b->v), free(b->o), free(b->lse);
    free(b->d_o), free(b->dq), free(b->dk), free(b->dv);
}

/* Median seconds of forward (and backward when bwd) of the tiled or naive path. */
static double time_path(const lm_attention_config *c, buffers *b, int naive, int bwd, int runs) {
    double t[16];
    for (int i = 0; i < runs; i++) {
        double t0 = lm_time_seconds();
        lm_status s = naive ? lm_attention_naive_forward(c, b->q, b->k, b->v, b->o, b->lse)
                            : lm_attention_forward(c, b->q, b->k, b->v, b->o, b->lse);
        if (!s && bwd)
            s = naive ? lm_attention_naive_backward(c, b->q, b->k, b->v, b->o, b->lse, b->d_o, b->dq, b->dk, b->dv)
                      : lm_attention_backward(c, b->q, b->k, b->v, b->o, b->lse, b->d_o, b->dq, b->dk, b->dv);
        if (s) dieAt("%s", lm_last_error());
        t[i] = lm_time_seconds() - t0;
    }
    return bench_median(t, runs);
}

/* The table: tiled and naive, forward and forward+backward, at a few lengths. */
static void bench_table(int runs) {
    const int B = 1, H = 4, D = 64;
    const int lengths[] = {512, 1024, 2048, 4096};
    printf("Causal attention, B=%d H=%d Dk=Dv=%d, fp32, %d threads, median of %d runs (seconds)\n\n",
           B, H, D, omp_get_max_threads(), runs);
    printf("| T | tiled fwd | naive fwd | naive/tiled | tiled fwd+bwd | naive fwd+bwd | naive/tiled "
           "| tiled fwd GFLOP/s | naive T*T matrix |\n|---|---|---|---|---|---|---|---|---|\n");
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
        const int T = lengths[li];
        lm_attention_config c = lm_attention_config_default(B, T, H, H, D, D);
        buffers b = alloc_buffers(&c, 1);
        double tf = time_path(&c, &b, 0, 0, runs), nf = time_path(&c, &b, 1, 0, runs);
        double tfb = time_path(&c, &b, 0, 1, runs), nfb = time_path(&c, &b, 1, 1, runs);
        /* causal: about T^2/2 score pairs, 2 products of D multiply-adds each */
        const double flops = 2.0 * 2.0 * D * ((double)T * (T + 1) / 2) * B * H;
        printf("| %d | %.4f | %.4f | %.2fx | %.4f | %.4f | %.2fx | %.2f | %.0f MB |\n", T, tf, nf,
               nf / tf, tfb, nfb, nfb / tfb, flops / tf / 1e9, (double)T * T * 4 / 1e6);
        fflush(stdout);
        free_buffers(&b);
    }
}

int main(int argc, char **argv) {
    int runs = argc > 1 ? atoi(argv[1]) : 3;
    long long_T = argc > 2 ? atol(argv[2]) : 65536;
    if (runs < 0 || runs > 16) runs = 3; /* 0: only the long forward */
    const int D = 64;
    if (runs > 0) bench_table(runs);
    if (long_T > 0) {
        lm_attention_config c = lm_attention_config_default(1, (int)long_T, 1, 1, D, D);
        /* reset the peak-RSS mark so the naive runs above do not count */
        FILE *cr = fopen("/proc/self/clear_refs", "w");
        int reset = cr && fputs("5", cr) >= 0;
        if (cr) reset &= fclose(cr) == 0;
        long before = status_kb("VmRSS:");
        buffers b = alloc_buffers(&c, 0);
        double t = time_path(&c, &b, 0, 0, 1);
        long hwm = status_kb("VmHWM:");
        const double io = (3.0 + 1.0) * long_T * D * 4 + long_T * 4.0;
        printf("\nLong forward, tiled core: B=1 T=%ld H=1 Dk=Dv=%d: %.2f s (%.2f GFLOP/s); "
               "inputs+outputs %.1f MB, core workspace %.1f KB, process peak RSS %.1f MB "
               "(%.1f MB before allocating%s); a T x T fp32 matrix would be %.1f GB\n",
               long_T, D, t, 2.0 * 2.0 * D * ((double)long_T * (long_T + 1) / 2) / t / 1e9, io / 1e6,
               lm_attention_forward_workspace_bytes(&c, 0) / 1e3, hwm / 1e3, before / 1e3,
               reset ? "" : "; peak mark NOT reset, includes the runs above",
               (double)long_T * long_T * 4 / 1e9);
        free_buffers(&b);
    }
    return 0;
}
