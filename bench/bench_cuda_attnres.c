/* Throughput of Block AttnRes on the GPU (include/longmoe/attnres_cuda.h):
 * one whole forward (begin, L x (input, add_output), final) and one whole
 * backward (final_backward, L x (output_backward, input_backward),
 * embedding_backward) over a model of `layers` transformer layers
 * (L = 2 x layers sublayers), block size S sublayers.
 *
 *   bench_cuda_attnres [--out FILE.json] [--reps N] [--n TOKENS] [--d WIDTH]
 *                      [--layers N] [--block S]
 *
 * Default: the k3-mini shape, 16 layers (32 sublayers), block 8, n = 32768,
 * d = 1024. Median of N repetitions (CUDA events) after 2 warm-ups, random
 * data (never zeros). GB/s counts the [n,d] fp32 rows every kernel must read
 * or write once (the compulsory traffic; per-token scalars ignored):
 *   begin 2, input(l) N_l + 1 (+1 for the saved partial sum), add_output 2 or
 *   3, final N+2; final_backward 2(N+1) + 1, output_backward 3,
 *   input_backward 3 N_l + 1, embedding_backward 3.
 * A device-to-device copy of 1 GiB gives the reachable bandwidth for scale. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_common.h"
#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/attnres.h"
#include "longmoe/attnres_cuda.h"
#include "longmoe/cuda_context.h"

#define MUST(call)                                                                    \
    do {                                                                             \
        if ((call) != LM_OK) dieAt("%s failed: %s", #call, lm_last_error());         \
    } while (0)

static float *device_random(size_t count, double mean, double scale, lm_rng *r) {
    float *h = mallocCheck(count * 4), *d = NULL;
    for (size_t i = 0; i < count; i++) h[i] = (float)(mean + scale * lm_rng_normal(r));
    cudaCheck(cudaMalloc((void **)&d, count * 4));
    cudaCheck(cudaMemcpy(d, h, count * 4, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

/* compulsory [n,d] row traffic of the forward and the backward, in rows */
static void traffic_rows(const lm_cuda_attnres_state *st, double *fwd, double *bwd) {
    const int L = st->cfg.n_sublayers, S = st->S, N = st->n_blocks;
    double f = 2, b = 0;
    for (int l = 0; l < L; l++) {
        const int Ns = lm_cuda_attnres_n_sources(st, l), pos = l % S;
        f += Ns + 1 + (pos > 0);
        f += pos == 0 ? 2 : 3;
        b += 3 + 3.0 * Ns + 1;
    }
    f += (N + 1) + 1;
    b += 2.0 * (N + 1) + 1 + 3;
    *fwd = f;
    *bwd = b;
}

int main(int argc, char **argv) {
    const char *out = NULL;
    int reps = 10, layers = 16, S = 8, d = 1024;
    int64_t n = 32768;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--n") && i + 1 < argc) n = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--d") && i + 1 < argc) d = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--block") && i + 1 < argc) S = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--out FILE.json] [--reps N] [--n TOKENS] [--d WIDTH] [--layers N] [--block S]\n",
                    argv[0]);
            return 2;
        }
    }
    if (reps < 1 || layers < 1 || S < 1 || d < 1 || n < 1) {
        fprintf(stderr, "reps, layers, block, d and n must be >= 1\n");
        return 2;
    }
    const int L = 2 * layers;
    lm_cuda_context ctx;
    MUST(lm_cuda_context_create(&ctx));
    cudaStream_t stream = (cudaStream_t)ctx.stream;
    lm_attnres_config cfg = {LM_ATTNRES_BLOCK, L, S, d, n, 1e-6f, 0};
    lm_attnres_memory_plan plan;
    MUST(lm_cuda_attnres_memory(&cfg, &plan));
    void *ws = NULL;
    cudaCheck(cudaMalloc(&ws, plan.total));
    lm_cuda_attnres_state st;
    MUST(lm_cuda_attnres_init(&st, &cfg, ws, plan.total));

    lm_rng r;
    lm_rng_seed(&r, 42);
    const size_t nd = (size_t)n * d, pd = (size_t)(L + 1) * d;
    float *emb = device_random(nd, 0, 1, &r), *y = device_random(nd, 0, 1, &r), *dh = device_random(nd, 0, 1, &r);
    float *dy = device_random(nd, 0, 0.01, &r), *demb = device_random(nd, 0, 0.01, &r);
    float *query = device_random(pd, 0, 1.0 / sqrt((double)d), &r), *key_norm = device_random(pd, 1, 0.3, &r);
    float *gq = device_random(pd, 0, 0.01, &r), *gk = device_random(pd, 0, 0.01, &r);
    float *h = NULL;
    cudaCheck(cudaMalloc((void **)&h, nd * 4));
    /* the uploads ran on the legacy stream; the context's stream does not wait for it */
    cudaCheck(cudaDeviceSynchronize());
    lm_attnres_params prm = {query, key_norm};
    lm_attnres_grads g = {gq, gk};

    cudaEvent_t e0, e1, e2;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    cudaCheck(cudaEventCreate(&e2));
    float *tf = mallocCheck((size_t)reps * 4), *tb = mallocCheck((size_t)reps * 4);
    for (int rep = -2; rep < reps; rep++) {
        cudaCheck(cudaEventRecord(e0, stream));
        MUST(lm_cuda_attnres_begin(&ctx, &st, emb));
        for (int l = 0; l < L; l++) {
            MUST(lm_cuda_attnres_input(&ctx, &st, l, &prm, h));
            MUST(lm_cuda_attnres_add_output(&ctx, &st, l, y));
        }
        MUST(lm_cuda_attnres_final(&ctx, &st, &prm, h));
        cudaCheck(cudaEventRecord(e1, stream));
        MUST(lm_cuda_attnres_final_backward(&ctx, &st, &prm, dh, &g));
        for (int l = L - 1; l >= 0; l--) {
            MUST(lm_cuda_attnres_output_backward(&ctx, &st, l, dy));
            MUST(lm_cuda_attnres_input_backward(&ctx, &st, l, &prm, dh, &g));
        }
        MUST(lm_cuda_attnres_embedding_backward(&ctx, &st, demb));
        cudaCheck(cudaEventRecord(e2, stream));
        MUST(lm_cuda_context_sync(&ctx));
        if (rep >= 0) {
            cudaCheck(cudaEventElapsedTime(&tf[rep], e0, e1));
            cudaCheck(cudaEventElapsedTime(&tb[rep], e1, e2));
        }
    }
    const float fwd_ms = bench_median_f(tf, reps), bwd_ms = bench_median_f(tb, reps);
    double fwd_rows, bwd_rows;
    traffic_rows(&st, &fwd_rows, &bwd_rows);
    const double row_bytes = (double)nd * 4;
    const double fwd_gbs = fwd_rows * row_bytes / (fwd_ms * 1e-3) / 1e9, bwd_gbs = bwd_rows * row_bytes / (bwd_ms * 1e-3) / 1e9;

    /* reference: device-to-device copy of 1 GiB (read + write counted) */
    const size_t copy_bytes = (size_t)1 << 30;
    void *ca = NULL, *cb = NULL;
    cudaCheck(cudaMalloc(&ca, copy_bytes));
    cudaCheck(cudaMalloc(&cb, copy_bytes));
    cudaCheck(cudaMemsetAsync(ca, 1, copy_bytes, stream));
    float tc[5];
    for (int rep = -1; rep < 5; rep++) {
        cudaCheck(cudaEventRecord(e0, stream));
        cudaCheck(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, stream));
        cudaCheck(cudaEventRecord(e1, stream));
        cudaCheck(cudaEventSynchronize(e1));
        if (rep >= 0) cudaCheck(cudaEventElapsedTime(&tc[rep], e0, e1));
    }
    const double copy_gbs = 2.0 * (double)copy_bytes / (bench_median_f(tc, 5) * 1e-3) / 1e9;

    printf("Block AttnRes on the GPU: %d layers (L = %d sublayers), block %d (N = %d), n = %lld, d = %d\n", layers, L,
           S, st.n_blocks, (long long)n, d);
    printf("workspace %.2f GB (%.0f bytes per token)\n", (double)plan.total / 1e9, plan.total_bytes_per_token);
    printf("%-10s %10s %12s %10s\n", "pass", "ms", "GB moved", "GB/s");
    printf("%-10s %10.3f %12.2f %10.0f\n", "forward", fwd_ms, fwd_rows * row_bytes / 1e9, fwd_gbs);
    printf("%-10s %10.3f %12.2f %10.0f\n", "backward", bwd_ms, bwd_rows * row_bytes / 1e9, bwd_gbs);
    printf("device copy (1 GiB, read + write): %.0f GB/s\n", copy_gbs);
    if (out) {
        FILE *f = fopenCheck(out, "w");
        fprintf(f,
                "{\"op\": \"attnres_cuda\", \"mode\": \"block_attnres\", \"layers\": %d, \"sublayers\": %d, "
                "\"block_size\": %d, \"n_blocks\": %d, \"n_tokens\": %lld, \"d\": %d, \"reps\": %d,\n"
                " \"workspace_bytes\": %zu,\n"
                " \"forward\": {\"ms\": %.4f, \"bytes\": %.0f, \"GBps\": %.1f},\n"
                " \"backward\": {\"ms\": %.4f, \"bytes\": %.0f, \"GBps\": %.1f},\n"
                " \"device_copy_GBps\": %.1f}\n",
                layers, L, S, st.n_blocks, (long long)n, d, reps, plan.total, fwd_ms, fwd_rows * row_bytes, fwd_gbs,
                bwd_ms, bwd_rows * row_bytes, bwd_gbs, copy_gbs);
        fclose(f);
    }
    float *bufs[] = {emb, y, dh, dy, demb, query, key_norm, gq, gk, h};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    cudaFree(ws);
    cudaFree(ca);
    cudaFree(cb);
    free(tf);
    free(tb);
    lm_cuda_context_destroy(&ctx);
    return 0;
}
