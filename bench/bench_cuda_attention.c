/* Timings of the causal attention on the GPU (include/longmoe/attention_cuda.h),
 * each implementation ("kind": flash, cudnn, cudnn-fast, cudnn-blocked; auto = what the plain
 * calls choose): forward, and forward + backward, at (B,T,H,D) with Hkv = H
 * and Dk = Dv = D. Default shapes: (1,8192,8,128), (1,32768,8,128), (8,4096,8,128).
 *
 *   bench_cuda_attention [--out results.json] [--reps N] [--shape B,T,H,D]...
 *                        [--kind flash|cudnn|cudnn-fast|cudnn-blocked|auto|all]   (default all)
 *
 * "all" runs flash, cudnn, cudnn-fast and cudnn-blocked (the cuDNN kinds when built and the
 * shape is supported; otherwise the row says why it is skipped). The forward
 * writes o and lse (no head max, as in the backward's peers).
 *
 * Median of N timed repetitions (CUDA events on the context's stream) after 3
 * warm-ups, on random bf16 data (never zeros). Causal FLOPs, as flash
 * attention reports them: the forward's two products over the lower triangle,
 * 4 * B * H * (T^2 / 2) * D; the backward 2.5 times that (five products; the
 * score recomputation is not counted). forward + backward TFLOP/s divide 3.5x
 * the forward's FLOPs by the combined time. Prints a table; writes JSON to --out. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_common.h"
#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/attention_cuda.h"

typedef struct {
    int B, T, H, D;
} shape;

static bench_xorshift rng = {0x9e3779b97f4a7c15ull};

typedef struct {
    const lm_cuda_context *ctx;
    const lm_attention_config *cfg;
    lm_attention_kind kind;
    const uint16_t *q, *k, *v, *d_o;
    uint16_t *o, *dq, *dk, *dv;
    float *lse;
    void *ws;
    size_t wsb;
    int backward;
} run_args;

static void run_once(const run_args *a) {
    lm_status st = lm_cuda_attention_forward_kind(a->ctx, a->cfg, a->kind, 0, a->q, a->k, a->v, a->o, a->lse, NULL);
    if (st) dieAt("forward (%s): %s", lm_attention_kind_name(a->kind), lm_last_error());
    if (a->backward) {
        st = lm_cuda_attention_backward_kind(a->ctx, a->cfg, a->kind, 0, a->q, a->k, a->v, a->o, a->d_o, a->lse,
                                             a->dq, a->dk, a->dv, a->ws, a->wsb);
        if (st) dieAt("backward (%s): %s", lm_attention_kind_name(a->kind), lm_last_error());
    }
}

/* Median milliseconds of `reps` runs after 3 warm-ups. */
static float time_median(const run_args *a, int reps) {
    cudaStream_t stream = (cudaStream_t)a->ctx->stream;
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) run_once(a);
    cudaCheck(cudaStreamSynchronize(stream));
    float *ms = mallocCheck((size_t)reps * sizeof(float));
    for (int i = 0; i < reps; i++) {
        cudaCheck(cudaEventRecord(e0, stream));
        run_once(a);
        cudaCheck(cudaEventRecord(e1, stream));
        cudaCheck(cudaEventSynchronize(e1));
        cudaCheck(cudaGetLastError());
        cudaCheck(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    qsort(ms, (size_t)reps, sizeof(float), bench_cmp_float);
    float med = ms[reps / 2];
    free(ms);
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    return med;
}

int main(int argc, char **argv) {
    const char *out_path = NULL;
    int reps = 20;
    shape shapes[8];
    int nshape = 0;
    lm_attention_kind kinds[4] = {LM_ATTENTION_FLASH, LM_ATTENTION_CUDNN, LM_ATTENTION_CUDNN_FAST,
                                  LM_ATTENTION_CUDNN_BLOCKED};
    int nkind = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) {
            out_path = argv[++i];
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
            if (reps < 1) dieAt("--reps must be >= 1 (got %s)", argv[i]);
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc && nshape < 8) {
            shape s;
            if (sscanf(argv[++i], "%d,%d,%d,%d", &s.B, &s.T, &s.H, &s.D) != 4)
                dieAt("--shape wants B,T,H,D (got %s)", argv[i]);
            shapes[nshape++] = s;
        } else if (!strcmp(argv[i], "--kind") && i + 1 < argc) {
            const char *k = argv[++i];
            nkind = 1;
            if (!strcmp(k, "all")) nkind = 4;
            else if (!strcmp(k, "flash")) kinds[0] = LM_ATTENTION_FLASH;
            else if (!strcmp(k, "cudnn")) kinds[0] = LM_ATTENTION_CUDNN;
            else if (!strcmp(k, "cudnn-fast")) kinds[0] = LM_ATTENTION_CUDNN_FAST;
            else if (!strcmp(k, "cudnn-blocked")) kinds[0] = LM_ATTENTION_CUDNN_BLOCKED;
            else if (!strcmp(k, "auto")) kinds[0] = LM_ATTENTION_AUTO;
            else dieAt("--kind wants flash, cudnn, cudnn-fast, cudnn-blocked, auto or all (got %s)", k);
        } else {
            fprintf(stderr,
                    "usage: %s [--out results.json] [--reps N] [--shape B,T,H,D]... "
                    "[--kind flash|cudnn|cudnn-fast|cudnn-blocked|auto|all]\n",
                    argv[0]);
            return 2;
        }
    }
    if (nshape == 0) {
        shape def[3] = {{1, 8192, 8, 128}, {1, 32768, 8, 128}, {8, 4096, 8, 128}};
        memcpy(shapes, def, sizeof def);
        nshape = 3;
    }
    lm_cuda_context ctx;
    if (lm_cuda_context_create(&ctx)) dieAt("%s", lm_last_error());
    struct cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, ctx.device));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

    FILE *js = out_path ? fopenCheck(out_path, "w") : NULL;
    if (js) fprintf(js, "{\"device\": \"%s\", \"reps\": %d, \"results\": [\n", prop.name, reps);
    printf("cuDNN attention built: %s\n", lm_cuda_attention_cudnn_built() ? "yes" : "no");
    printf("\n%-22s %-10s %10s %10s %12s %12s %10s %10s\n", "shape (B,T,H,D)", "kind", "fwd ms", "fwd TF/s",
           "fwd+bwd ms", "f+b TF/s", "bwd ms", "bwd ws MB");
    int nrow = 0;
    for (int s = 0; s < nshape; s++) {
        const shape sh = shapes[s];
        const size_t n = (size_t)sh.B * sh.T * sh.H * sh.D, nl = (size_t)sh.B * sh.H * sh.T;
        const float qa = 1.7320508f; /* uniform in [-a, a): unit variance */
        uint16_t *q = bench_device_bf16_random(&rng, n, qa), *k = bench_device_bf16_random(&rng, n, qa);
        uint16_t *v = bench_device_bf16_random(&rng, n, qa), *d_o = bench_device_bf16_random(&rng, n, qa);
        uint16_t *o = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
        float *lse = NULL;
        cudaCheck(cudaMalloc((void **)&o, n * 2));
        cudaCheck(cudaMalloc((void **)&dq, n * 2));
        cudaCheck(cudaMalloc((void **)&dk, n * 2));
        cudaCheck(cudaMalloc((void **)&dv, n * 2));
        cudaCheck(cudaMalloc((void **)&lse, nl * 4));
        lm_attention_config cfg = lm_attention_config_default(sh.B, sh.T, sh.H, sh.H, sh.D, sh.D);
        char name[64];
        snprintf(name, sizeof name, "(%d,%d,%d,%d)", sh.B, sh.T, sh.H, sh.D);
        for (int ki = 0; ki < nkind; ki++) {
            lm_attention_kind kind = kinds[ki];
            const char *kname = lm_attention_kind_name(kind);
            if (kind == LM_ATTENTION_AUTO) {
                lm_attention_kind f, b;
                if (lm_cuda_attention_resolve(&cfg, 0, 0, &f) || lm_cuda_attention_resolve(&cfg, 0, 1, &b))
                    dieAt("auto: %s", lm_last_error());
                printf("%-22s auto = forward %s, backward %s\n", name, lm_attention_kind_name(f),
                       lm_attention_kind_name(b));
            } else if (kind != LM_ATTENTION_FLASH &&
                       (!lm_cuda_attention_kind_supported(&cfg, 0, kind, 0) ||
                        !lm_cuda_attention_kind_supported(&cfg, 0, kind, 1))) {
                printf("%-22s %-10s skipped: %s\n", name, kname, lm_last_error());
                continue;
            }
            size_t wsb = lm_cuda_attention_backward_workspace_bytes_kind(&cfg, kind, 0);
            if (wsb == 0) dieAt("%s %s: no backward workspace size: %s", name, kname, lm_last_error());
            void *ws = NULL;
            if (cudaMalloc(&ws, wsb) != cudaSuccess) {
                (void)cudaGetLastError();
                printf("%-22s %-10s skipped: no %.0f MB for the backward workspace\n", name, kname, wsb / 1e6);
                continue;
            }
            cudaCheck(cudaDeviceSynchronize()); /* the context's stream is non-blocking */
            run_args a = {&ctx, &cfg, kind, q, k, v, d_o, o, dq, dk, dv, lse, ws, wsb, 0};
            const float fwd = time_median(&a, reps);
            a.backward = 1;
            const float fb = time_median(&a, reps);
            const double flop_f = 4.0 * sh.B * sh.H * ((double)sh.T * sh.T / 2) * sh.D;
            const double flop_fb = flop_f * 3.5; /* forward + 2.5x for the backward */
            const double tf_f = flop_f / (fwd * 1e-3) / 1e12, tf_fb = flop_fb / (fb * 1e-3) / 1e12;
            printf("%-22s %-10s %10.3f %10.1f %12.3f %12.1f %10.3f %10.1f\n", name, kname, fwd, tf_f, fb, tf_fb,
                   fb - fwd, wsb / 1048576.0);
            if (js)
                fprintf(js,
                        "%s  {\"B\": %d, \"T\": %d, \"H\": %d, \"D\": %d, \"kind\": \"%s\", "
                        "\"forward_ms\": %.4f, \"forward_tflops\": %.2f, \"forward_backward_ms\": %.4f, "
                        "\"forward_backward_tflops\": %.2f, \"backward_workspace_bytes\": %zu}",
                        nrow ? ",\n" : "", sh.B, sh.T, sh.H, sh.D, kname, fwd, tf_f, fb, tf_fb, wsb);
            nrow++;
            cudaFree(ws);
        }
        cudaFree(q);
        cudaFree(k);
        cudaFree(v);
        cudaFree(d_o);
        cudaFree(o);
        cudaFree(dq);
        cudaFree(dk);
        cudaFree(dv);
        cudaFree(lse);
    }
    if (js) {
        fprintf(js, "\n]}\n");
        fclose(js);
    }
    lm_cuda_context_destroy(&ctx);
    return 0;
}
