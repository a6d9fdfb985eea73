/* Throughput of Block AttnRes on the GPU (include/longmoe/attnres_cuda.h):
 * one whole forward (begin, L x (input, add_output), final) and one whole
 * backward (final_backward, L x (output_backward, input_backward),
 * embedding_backward) over a model of `layers` transformer layers
 * (L = 2 x layers sublayers), block size S sublayers.
 *
 *   bench_cuda_attnres [--out FILE.json] [--reps N] [--n TOKENS] [--d WIDTH]
 *                      [--layers N] [--block S] [--norm]
 *
 * --norm: each sublayer's input with its RMSNorm, as the model runs it on the
 * GPU (lm_cuda_attnres_input_norm writing the bf16 xn and 1/rms, and
 * lm_cuda_attnres_input_norm_backward from a random dxn) in place of input
 * and input_backward; their rows: input N_l (+1 for the saved partial sum)
 * + 1/2 (the bf16 xn), input_backward 3 N_l + 1 (dxn).
 *
 * Default: the k3-mini shape, 16 layers (32 sublayers), block 8, n = 32768,
 * d = 1024. Median of N repetitions (CUDA events) after 2 warm-ups, random
 * data (never zeros). GB/s counts the [n,d] fp32 rows every kernel must read
 * or write once (the compulsory traffic; per-token scalars ignored):
 *   begin 2, input(l) N_l + 1 (+1 for the saved partial sum), add_output 2 or
 *   3, final N+2; final_backward 2(N+1) + 1, output_backward 3,
 *   input_backward 3 N_l + 1, embedding_backward 3.
 * A device-to-device copy of 1 GiB gives the reachable bandwidth for scale.
 * Each kind of call is also timed on its own (events around every call,
 * summed over the pass) and put beside a device-to-device cudaMemcpy moving
 * as many bytes (at most 2 GiB), timed in the same run (bench_common.h):
 * MB moved, GB/s, copy GB/s and % of copy, printed and in the JSON's
 * "memory_bound" list. */
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

/* compulsory [n,d] row traffic of the forward and the backward, in rows (norm: --norm's calls) */
static void traffic_rows(const lm_cuda_attnres_state *st, int norm, double *fwd, double *bwd) {
    const int L = st->cfg.n_sublayers, S = st->S, N = st->n_blocks;
    double f = 2, b = 0;
    for (int l = 0; l < L; l++) {
        const int Ns = lm_cuda_attnres_n_sources(st, l), pos = l % S;
        f += Ns + (norm ? 0.5 : 1) + (pos > 0);
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
    int reps = 10, layers = 16, S = 8, d = 1024, norm = 0;
    int64_t n = 32768;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--n") && i + 1 < argc) n = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--d") && i + 1 < argc) d = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--block") && i + 1 < argc) S = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--norm")) norm = 1;
        else {
            fprintf(stderr, "usage: %s [--out FILE.json] [--reps N] [--n TOKENS] [--d WIDTH] [--layers N] [--block S] [--norm]\n",
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
    lm_attnres_config cfg = {LM_ATTNRES_BLOCK, L, S, d, n, 1e-6f, 0, 0};
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
    float *h = NULL, *nw = device_random(pd, 1, 0.3, &r), *dnw = device_random(pd, 0, 0.01, &r);
    float *dxn = device_random(nd, 0, 1, &r), *nrstd = NULL;
    uint16_t *xb = NULL;
    cudaCheck(cudaMalloc((void **)&h, nd * 4));
    cudaCheck(cudaMalloc((void **)&nrstd, (size_t)L * n * 4));
    cudaCheck(cudaMalloc((void **)&xb, nd * 2));
    if (norm && !lm_cuda_attnres_norm_fusable(&cfg)) dieAt("--norm: this shape does not take the input with its norm");
    /* the uploads ran on the legacy stream; the context's stream does not wait for it */
    cudaCheck(cudaDeviceSynchronize());
    lm_attnres_params prm = {query, key_norm};
    lm_attnres_grads g = {gq, gk};

    /* every call timed by events around it; per kind of call the sum over a
     * pass, median over repetitions */
    enum { K_BEGIN, K_INPUT, K_ADD, K_FINAL, K_FINAL_BWD, K_OUT_BWD, K_IN_BWD, K_EMB_BWD, K_COUNT };
    static const char *kind_name[K_COUNT] = {"attnres begin",          "attnres input (all layers)",
                                             "attnres add_output (all)", "attnres final",
                                             "attnres final_backward", "attnres output_backward (all)",
                                             "attnres input_backward (all)", "attnres embedding_backward"};
    const int calls = 2 * L + 2 + 2 * L + 2;
    cudaEvent_t *ev = mallocCheck((size_t)(calls + 1) * sizeof(cudaEvent_t));
    int *call_kind = mallocCheck((size_t)calls * sizeof(int));
    for (int i = 0; i <= calls; i++) cudaCheck(cudaEventCreate(&ev[i]));
    float *tf = mallocCheck((size_t)reps * 4), *tb = mallocCheck((size_t)reps * 4);
    float *tk = callocCheck((size_t)reps * K_COUNT, 4);
    const int fwd_calls = 2 * L + 2;
    for (int rep = -2; rep < reps; rep++) {
        int c = 0;
#define TIMED(kind, call)                                                                                         \
    do {                                                                                                          \
        call_kind[c] = (kind);                                                                                    \
        cudaCheck(cudaEventRecord(ev[c], stream));                                                                \
        MUST(call);                                                                                               \
        c++;                                                                                                      \
    } while (0)
        TIMED(K_BEGIN, lm_cuda_attnres_begin(&ctx, &st, emb));
        for (int l = 0; l < L; l++) {
            lm_cuda_attnres_norm nm = {nw + (size_t)l * d, 1e-5f, NULL, xb, nrstd + (size_t)l * n};
            if (norm) TIMED(K_INPUT, lm_cuda_attnres_input_norm(&ctx, &st, l, &prm, &nm));
            else TIMED(K_INPUT, lm_cuda_attnres_input(&ctx, &st, l, &prm, h));
            TIMED(K_ADD, lm_cuda_attnres_add_output(&ctx, &st, l, y));
        }
        TIMED(K_FINAL, lm_cuda_attnres_final(&ctx, &st, &prm, h));
        TIMED(K_FINAL_BWD, lm_cuda_attnres_final_backward(&ctx, &st, &prm, dh, &g));
        for (int l = L - 1; l >= 0; l--) {
            TIMED(K_OUT_BWD, lm_cuda_attnres_output_backward(&ctx, &st, l, dy));
            lm_cuda_attnres_norm_grad ng = {nw + (size_t)l * d, nrstd + (size_t)l * n, dxn, dnw + (size_t)l * d};
            if (norm) TIMED(K_IN_BWD, lm_cuda_attnres_input_norm_backward(&ctx, &st, l, &prm, &ng, &g));
            else TIMED(K_IN_BWD, lm_cuda_attnres_input_backward(&ctx, &st, l, &prm, dh, &g));
        }
        TIMED(K_EMB_BWD, lm_cuda_attnres_embedding_backward(&ctx, &st, demb));
#undef TIMED
        cudaCheck(cudaEventRecord(ev[c], stream));
        MUST(lm_cuda_context_sync(&ctx));
        if (rep >= 0) {
            cudaCheck(cudaEventElapsedTime(&tf[rep], ev[0], ev[fwd_calls]));
            cudaCheck(cudaEventElapsedTime(&tb[rep], ev[fwd_calls], ev[calls]));
            for (int k = 0; k < calls; k++) {
                float ms;
                cudaCheck(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
                tk[(size_t)call_kind[k] * reps + rep] += ms;
            }
        }
    }
    const float fwd_ms = bench_median_f(tf, reps), bwd_ms = bench_median_f(tb, reps);
    double fwd_rows, bwd_rows;
    traffic_rows(&st, norm, &fwd_rows, &bwd_rows);
    const double row_bytes = (double)nd * 4;
    const double fwd_gbs = fwd_rows * row_bytes / (fwd_ms * 1e-3) / 1e9, bwd_gbs = bwd_rows * row_bytes / (bwd_ms * 1e-3) / 1e9;
    /* compulsory rows per kind of call (as traffic_rows) */
    double kind_rows[K_COUNT] = {2, 0, 0, (st.n_blocks + 1) + 1, 2.0 * (st.n_blocks + 1) + 1, 0, 0, 3};
    for (int l = 0; l < L; l++) {
        const int Ns = lm_cuda_attnres_n_sources(&st, l), pos = l % S;
        kind_rows[K_INPUT] += Ns + (norm ? 0.5 : 1) + (pos > 0);
        kind_rows[K_ADD] += pos == 0 ? 2 : 3;
        kind_rows[K_OUT_BWD] += 3;
        kind_rows[K_IN_BWD] += 3.0 * Ns + 1;
    }
    bench_bw bw[K_COUNT + 2];
    for (int k = 0; k < K_COUNT; k++)
        bw[k] = bench_bw_measure(kind_name[k], kind_rows[k] * row_bytes, bench_median_f(tk + (size_t)k * reps, reps),
                                 reps, stream);
    bw[K_COUNT] = bench_bw_measure("attnres forward pass", fwd_rows * row_bytes, fwd_ms, reps, stream);
    bw[K_COUNT + 1] = bench_bw_measure("attnres backward pass", bwd_rows * row_bytes, bwd_ms, reps, stream);

    /* reference: device-to-device copy of 1 GiB (read + write counted) */
    const double copy_gbs = bench_copy_gbs(2.0 * (double)((size_t)1 << 30), 5, stream);

    printf("Block AttnRes on the GPU: %d layers (L = %d sublayers), block %d (N = %d), n = %lld, d = %d%s\n", layers,
           L, S, st.n_blocks, (long long)n, d, norm ? ", each input with its norm" : "");
    printf("workspace %.2f GB (%.0f bytes per token)\n", (double)plan.total / 1e9, plan.total_bytes_per_token);
    printf("%-10s %10s %12s %10s\n", "pass", "ms", "GB moved", "GB/s");
    printf("%-10s %10.3f %12.2f %10.0f\n", "forward", fwd_ms, fwd_rows * row_bytes / 1e9, fwd_gbs);
    printf("%-10s %10.3f %12.2f %10.0f\n", "backward", bwd_ms, bwd_rows * row_bytes / 1e9, bwd_gbs);
    printf("device copy (1 GiB, read + write): %.0f GB/s\n", copy_gbs);
    bench_bw_header();
    for (int k = 0; k < K_COUNT + 2; k++) bench_bw_print(&bw[k]);
    if (out) {
        FILE *f = fopenCheck(out, "w");
        fprintf(f,
                "{\"op\": \"attnres_cuda\", \"mode\": \"block_attnres\", \"input_with_norm\": %d, \"layers\": %d, \"sublayers\": %d, "
                "\"block_size\": %d, \"n_blocks\": %d, \"n_tokens\": %lld, \"d\": %d, \"reps\": %d,\n"
                " \"workspace_bytes\": %zu,\n"
                " \"forward\": {\"ms\": %.4f, \"bytes\": %.0f, \"GBps\": %.1f},\n"
                " \"backward\": {\"ms\": %.4f, \"bytes\": %.0f, \"GBps\": %.1f},\n"
                " \"device_copy_GBps\": %.1f,\n \"memory_bound\": [",
                norm, layers, L, S, st.n_blocks, (long long)n, d, reps, plan.total, fwd_ms, fwd_rows * row_bytes, fwd_gbs,
                bwd_ms, bwd_rows * row_bytes, bwd_gbs, copy_gbs);
        for (int k = 0; k < K_COUNT + 2; k++) {
            fprintf(f, "%s\n  ", k ? "," : "");
            bench_bw_json(f, &bw[k]);
        }
        fprintf(f, "]}\n");
        fclose(f);
    }
    for (int i = 0; i <= calls; i++) cudaCheck(cudaEventDestroy(ev[i]));
    free(ev), free(call_kind), free(tk);
    float *bufs[] = {emb, y, dh, dy, demb, query, key_norm, gq, gk, h, nw, dnw, dxn, nrstd, (float *)xb};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    cudaFree(ws);
    free(tf);
    free(tb);
    lm_cuda_context_destroy(&ctx);
    return 0;
}
