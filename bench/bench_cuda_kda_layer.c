/* Speed of the KDA layer's memory-bound kernels on the GPU
 * (include/longmoe/kda_layer_cuda.h) at the shapes of configs/k3-mini.json:
 * N tokens (default 32768, one sequence of T = N), 8 heads of 128 (C = 1024
 * channels of q, k or v), a short convolution of width 4:
 *   the short conv + SiLU + per-head L2 norm (q, k) forward and backward,
 *   the sigmoid of beta (N x heads) forward and backward,
 *   the output stage gate (.) RMSNorm(o) forward and backward.
 *
 *   bench_cuda_kda_layer [--out results.json] [--reps N] [--tokens N]
 *
 * Median of N timed repetitions (CUDA events on the context's stream) after
 * 3 warm-ups, on random data (never zeros). Bytes are the least traffic
 * (every input read once, every output written once; fp32 = 4 bytes, bf16 =
 * 2), each kernel beside a device-to-device cudaMemcpy moving as many bytes,
 * timed in the same run (bench_common.h):
 *   conv forward:  in, conv_out, out_bf16, rnorm (+ w)
 *   conv backward: dout_bf16, conv_out, rnorm, in, din (+ w, dw)
 * (the conv lines come as the default call and then once per kernel:
 * forward row, window, ring; backward fused, ring; the same bytes for each:
 * neither the halo rows read twice nor dw's partials are counted) 
 *   sigmoid:       forward in, out; backward dout, out, din
 *   output forward:  o bf16, gate_logits, gated bf16, gate, o_rstd (+ o_norm)
 *   output backward: d_gated, o bf16, o_rstd, gate, d_o bf16, dgate_logits
 *                    (+ o_norm, do_norm) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_common.h"
#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/kda_layer_cuda.h"

static lm_cuda_context ctx;
static bench_xorshift rng = {0x9e3779b97f4a7c15ull};

static void *dev_alloc(size_t bytes) {
    void *p = NULL;
    if (lm_cuda_alloc(&p, bytes)) dieAt("device allocation of %zu bytes: %s", bytes, lm_last_error());
    return p;
}

static float *dev_f32_random(size_t n, float a) {
    float *h = mallocCheck(n * 4), *d = dev_alloc(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = bench_uniform(&rng, a);
    cudaCheck(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

typedef struct {
    int B, T, C, W, hd, H, K;
    int64_t N;
    float *in, *w, *conv_out, *rnorm, *din, *dw;
    uint16_t *y16, *dy16;
    void *conv_scratch;
    float *beta_logit, *beta, *dbeta, *dbeta_logit;
    uint16_t *o16, *gated16, *d_o16;
    float *gate_logits, *gate, *o_rstd, *o_norm, *d_gated, *dgate_logits, *do_norm;
    void *out_scratch;
} kl_args;


static lm_status conv_fwd(void *arg) {
    kl_args *a = arg;
    return lm_cuda_short_conv_silu_forward(&ctx, a->conv_out, a->y16, a->rnorm, a->in, a->w, a->B, a->T, a->C, a->W,
                                           a->hd);
}
static lm_status conv_bwd(void *arg) {
    kl_args *a = arg;
    return lm_cuda_short_conv_silu_backward(&ctx, a->din, a->dw, a->dy16, a->conv_out, a->rnorm, a->in, a->w, a->B,
                                            a->T, a->C, a->W, a->hd, a->conv_scratch);
}
/* the same calls with each conv kernel chosen (LONGMOE_CONV_FORWARD / _BACKWARD, read at every call):
 * the old kernels beside the new defaults in one run */
static lm_status conv_fwd_kind(void *arg, const char *kind) {
    setenv("LONGMOE_CONV_FORWARD", kind, 1);
    lm_status st = conv_fwd(arg);
    unsetenv("LONGMOE_CONV_FORWARD");
    return st;
}
static lm_status conv_fwd_row(void *arg) { return conv_fwd_kind(arg, "row"); }
static lm_status conv_fwd_window(void *arg) { return conv_fwd_kind(arg, "window"); }
static lm_status conv_fwd_ring(void *arg) { return conv_fwd_kind(arg, "ring"); }
static lm_status conv_bwd_kind(void *arg, const char *kind) {
    setenv("LONGMOE_CONV_BACKWARD", kind, 1);
    lm_status st = conv_bwd(arg);
    unsetenv("LONGMOE_CONV_BACKWARD");
    return st;
}
static lm_status conv_bwd_fused(void *arg) { return conv_bwd_kind(arg, "fused"); }
static lm_status conv_bwd_ring(void *arg) { return conv_bwd_kind(arg, "ring"); }
static lm_status sig_fwd(void *arg) {
    kl_args *a = arg;
    return lm_cuda_sigmoid_forward(&ctx, a->beta, a->beta_logit, (size_t)a->N * a->H);
}
static lm_status sig_bwd(void *arg) {
    kl_args *a = arg;
    return lm_cuda_sigmoid_backward(&ctx, a->dbeta_logit, a->dbeta, a->beta, (size_t)a->N * a->H);
}
static lm_status out_fwd(void *arg) {
    kl_args *a = arg;
    return lm_cuda_kda_output_forward(&ctx, a->gated16, a->o_rstd, a->gate, a->o16, a->gate_logits, a->o_norm, a->N,
                                      a->H, a->K, 1e-6f);
}
static lm_status out_bwd(void *arg) {
    kl_args *a = arg;
    return lm_cuda_kda_output_backward(&ctx, a->d_o16, NULL, a->dgate_logits, NULL, 0, a->do_norm, a->d_gated, a->o16,
                                       a->o_rstd, a->gate, a->o_norm, a->N, a->H, a->K, 1e-6f, a->out_scratch);
}

static float time_ms(bench_fn fn, kl_args *arg, int reps) {
    return bench_time_ms((cudaStream_t)ctx.stream, fn, arg, reps);
}

int main(int argc, char **argv) {
    const char *out_path = NULL;
    int reps = 20;
    int64_t N = 32768;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) N = atoll(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--out results.json] [--reps N] [--tokens N]\n", argv[0]);
            return 2;
        }
    }
    if (reps < 1 || N < 1 || N > (1 << 30)) dieAt("--reps must be >= 1 and --tokens in [1, 2^30]");
    if (lm_cuda_context_create(&ctx)) dieAt("%s", lm_last_error());
    kl_args a;
    memset(&a, 0, sizeof a);
    a.B = 1, a.T = (int)N, a.N = N, a.H = 8, a.K = 128, a.hd = 128, a.C = a.H * a.K, a.W = 4;
    size_t nc = (size_t)N * a.C, nh = (size_t)N * a.H;
    a.in = dev_f32_random(nc, 1.0f);
    a.w = dev_f32_random((size_t)a.C * a.W, 0.5f);
    a.conv_out = dev_alloc(nc * 4);
    a.rnorm = dev_alloc(nh * 4);
    a.y16 = dev_alloc(nc * 2);
    a.din = dev_alloc(nc * 4);
    a.dw = dev_f32_random((size_t)a.C * a.W, 0.1f);
    a.dy16 = bench_device_bf16_random(&rng, nc, 1.0f);
    a.conv_scratch = dev_alloc(lm_cuda_short_conv_silu_backward_scratch_bytes(a.B, a.T, a.C, a.W));
    a.beta_logit = dev_f32_random(nh, 2.0f);
    a.beta = dev_alloc(nh * 4);
    a.dbeta = dev_f32_random(nh, 1.0f);
    a.dbeta_logit = dev_alloc(nh * 4);
    a.o16 = bench_device_bf16_random(&rng, nc, 1.0f);
    a.gated16 = dev_alloc(nc * 2);
    a.d_o16 = dev_alloc(nc * 2);
    a.gate_logits = dev_f32_random(nc, 2.0f);
    a.gate = dev_alloc(nc * 4);
    a.o_rstd = dev_alloc(nh * 4);
    a.o_norm = dev_f32_random((size_t)a.K, 1.0f);
    a.d_gated = dev_f32_random(nc, 1.0f);
    a.dgate_logits = dev_alloc(nc * 4);
    a.do_norm = dev_f32_random((size_t)a.K, 0.1f);
    a.out_scratch = dev_alloc(lm_cuda_kda_output_backward_scratch_bytes(N, a.H, a.K));
    cudaCheck(cudaDeviceSynchronize());
    /* the backward kernels read what the forward ones wrote */
    if (conv_fwd(&a) || sig_fwd(&a) || out_fwd(&a)) dieAt("%s", lm_last_error());
    if (lm_cuda_context_sync(&ctx)) dieAt("%s", lm_last_error());

    struct cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, ctx.device));
    printf("KDA layer kernels on %s: %lld tokens, %d heads of %d, conv width %d, median of %d\n", prop.name,
           (long long)N, a.H, a.K, a.W, reps);
    const double e = (double)nc, r = (double)nh, cw = (double)a.C * a.W * 4;
    struct {
        const char *name;
        bench_fn fn;
        double bytes;
    } cases[] = {
        {"short conv+SiLU+L2 forward", conv_fwd, e * (4 + 4 + 2) + r * 4 + cw},
        {"  conv forward, row kernel", conv_fwd_row, e * (4 + 4 + 2) + r * 4 + cw},
        {"  conv forward, window kernel", conv_fwd_window, e * (4 + 4 + 2) + r * 4 + cw},
        {"  conv forward, ring kernel", conv_fwd_ring, e * (4 + 4 + 2) + r * 4 + cw},
        {"short conv+SiLU+L2 backward", conv_bwd, e * (2 + 4 + 4 + 4) + r * 4 + 3 * cw},
        {"  conv backward, fused kernel", conv_bwd_fused, e * (2 + 4 + 4 + 4) + r * 4 + 3 * cw},
        {"  conv backward, ring kernel", conv_bwd_ring, e * (2 + 4 + 4 + 4) + r * 4 + 3 * cw},
        {"sigmoid forward (beta)", sig_fwd, r * 8},
        {"sigmoid backward (beta)", sig_bwd, r * 12},
        {"output gate+RMSNorm forward", out_fwd, e * (2 + 4 + 2 + 4) + r * 4 + a.K * 4.0},
        {"output gate+RMSNorm backward", out_bwd, e * (4 + 2 + 4 + 2 + 4) + r * 4 + a.K * 12.0},
    };
    const int nk = (int)(sizeof cases / sizeof cases[0]);
    bench_bw bw[sizeof cases / sizeof cases[0]];
    cudaStream_t st = (cudaStream_t)ctx.stream;
    for (int k = 0; k < nk; k++) bw[k] = bench_bw_measure(cases[k].name, cases[k].bytes, time_ms(cases[k].fn, &a, reps),
                                                          reps, st);
    bench_bw_header();
    for (int k = 0; k < nk; k++) bench_bw_print(&bw[k]);
    if (out_path) {
        FILE *js = fopenCheck(out_path, "w");
        fprintf(js, "{\"device\": \"%s\", \"tokens\": %lld, \"heads\": %d, \"head_dim\": %d, \"conv_width\": %d, "
                    "\"reps\": %d,\n \"memory_bound\": [",
                prop.name, (long long)N, a.H, a.K, a.W, reps);
        for (int k = 0; k < nk; k++) {
            fprintf(js, "%s\n  ", k ? "," : "");
            bench_bw_json(js, &bw[k]);
        }
        fprintf(js, "]}\n");
        fclose(js);
    }
    void *bufs[] = {a.in, a.w, a.conv_out, a.rnorm, a.din, a.dw, a.y16, a.dy16, a.conv_scratch, a.beta_logit,
                    a.beta, a.dbeta, a.dbeta_logit, a.o16, a.gated16, a.d_o16, a.gate_logits, a.gate, a.o_rstd,
                    a.o_norm, a.d_gated, a.dgate_logits, a.do_norm, a.out_scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) lm_cuda_free(bufs[i]);
    lm_cuda_context_destroy(&ctx);
    return 0;
}
