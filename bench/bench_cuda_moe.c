/* Speed of the MoE layer on the GPU (include/longmoe/moe_cuda.h): the
 * k3-mini MoE layer (d 1024, 128 experts top-8, expert ffn 512, LatentMoE
 * 512, one shared expert of ffn 1024, SiTU-GLU) at 32768 tokens by default.
 *
 *   bench_cuda_moe [--tokens M] [--reps N] [--gemm batched|grouped|loop|wmma|wgmma] [--no-balance]
 *                  [--ep] [--out results.json]
 *
 * Times each kind of expert product (lm_moe_gemm_kind: cuBLAS batched by
 * padded size, cuBLAS grouped, cuBLAS per-expert loop, the wmma kernel, the
 * wgmma kernel; all five unless --gemm names one) on the same inputs. Prints forward and forward+backward milliseconds
 * (median of N) and the grouped products' TFLOP/s: their FLOPs (routed
 * experts only: 6 m k f d_e forward, twice that backward) over the whole
 * layer's time, so a lower bound of the grouped products' own rate. The
 * JSON holds each kind under "kinds" and, at the top level, the kind with
 * the fastest forward+backward ("kind"). Random weights (never zeros).
 *
 * Balancing, as the model and bench/moe_vs_torch.py's step run it (SPEC §4,
 * the K3 histogram of 1000 bins): the router adds the bias b; after the
 * forward (outside its time) the histogram and the expert loads are counted
 * on the device; after the backward the counts come to the host, which
 * updates b (lm_balance_observe_counts, lm_balance_step_end) and uploads it:
 * forward+backward is timed with all of that, as the peer's
 * forward+backward+balance. --no-balance: no bias and no balancing (the
 * bench before the fourteenth session). With balancing, the histogram pass
 * alone is timed too (CUDA events, 20 launches) for each tokens-a-block
 * setting (lm_cuda_balance_set_hist_tokens).
 *
 * --ep: then the batched kind through the expert-parallel layer
 * (lm_cuda_moe_forward_ep / _backward_ep) on a one-rank NCCL communicator:
 * the exchange is a copy, so the difference to the batched kind's time (run
 * with --no-balance --gemm batched to compare like with like: the EP timing
 * has no balancing) is what the exchange's bookkeeping costs on one GPU: the
 * count exchange, the regrouping and ungrouping copies of the rows. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_common.h"
#include "longmoe/balance.h"
#include "longmoe/comm.h"
#include "longmoe/cuda_context.h"
#include "longmoe/moe.h"
#include "longmoe/moe_cuda.h"

static void ok(lm_status st, const char *what) {
    if (st) {
        fprintf(stderr, "%s: %s\n", what, lm_last_error());
        exit(1);
    }
}

/* out[0], out[1]: the medians of the reps forward and forward+backward times (sorted in place) */
static void medians(double *t_fwd, double *t_all, int reps, double *out) {
    qsort(t_fwd, (size_t)reps, sizeof(double), bench_cmp_double);
    qsort(t_all, (size_t)reps, sizeof(double), bench_cmp_double);
    out[0] = t_fwd[reps / 2];
    out[1] = t_all[reps / 2];
}

int main(int argc, char **argv) {
    int64_t m = 32768;
    int reps = 10;
    const char *out_path = NULL;
    int only = -1, balance = 1, ep_too = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) m = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out_path = argv[++i];
        else if (!strcmp(argv[i], "--no-balance")) balance = 0;
        else if (!strcmp(argv[i], "--ep")) ep_too = 1;
        else if (!strcmp(argv[i], "--gemm") && i + 1 < argc) {
            only = lm_cuda_moe_gemm_parse(argv[++i]);
            if (only < 0) {
                fprintf(stderr, "--gemm %s: expected batched, grouped, loop, wmma or wgmma\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr,
                    "usage: %s [--tokens M] [--reps N] [--gemm batched|grouped|loop|wmma|wgmma] [--no-balance] "
                    "[--ep] [--out results.json]\n",
                    argv[0]);
            return 2;
        }
    }
    if (m < 1 || reps < 1 || reps > 1000) {
        fprintf(stderr, "--tokens must be >= 1 and --reps in [1, 1000]\n");
        return 2;
    }
    lm_moe_config c = lm_moe_config_default(1024, 128, 8, 512);
    c.d_latent = 512;
    c.n_shared = 1;
    c.d_ff_shared = 1024;
    c.act = LM_EXPERT_SITU_GLU;
    ok(lm_moe_check(&c), "config");

    lm_cuda_context ctx;
    ok(lm_cuda_context_create(&ctx), "cuda context");
    size_t count = lm_moe_param_count(&c);
    float *hp = malloc(count * sizeof(float));
    float *hx = malloc((size_t)m * c.d * sizeof(float));
    if (!hp || !hx) {
        fprintf(stderr, "out of host memory\n");
        return 1;
    }
    lm_rng r;
    lm_rng_seed(&r, 1);
    for (size_t i = 0; i < count; i++) hp[i] = (float)(0.03 * lm_rng_normal(&r));
    lm_moe_params host;
    lm_moe_params_carve(&c, hp, &host);
    for (int i = 0; i < c.d_latent; i++) host.lat_norm[i] = 1.0f;
    for (int64_t i = 0; i < m * c.d; i++) hx[i] = (float)lm_rng_normal(&r);

    void *pf_block, *pb_block, *g_block, *x, *y, *dy, *dx, *acts_block, *scratch_block;
    size_t ab = lm_cuda_moe_acts_bytes(&c, m), sb = lm_cuda_moe_scratch_bytes(&c, m);
    if (!ab || !sb) ok(LM_ERR_ARG, "planning (tokens too many?)");
    ok(lm_cuda_alloc(&pf_block, count * 4), "alloc params");
    ok(lm_cuda_alloc(&pb_block, count * 2), "alloc bf16 params");
    ok(lm_cuda_alloc(&g_block, count * 4), "alloc grads");
    ok(lm_cuda_alloc(&x, (size_t)m * c.d * 4), "alloc x");
    ok(lm_cuda_alloc(&y, (size_t)m * c.d * 4), "alloc y");
    ok(lm_cuda_alloc(&dy, (size_t)m * c.d * 4), "alloc dy");
    ok(lm_cuda_alloc(&dx, (size_t)m * c.d * 4), "alloc dx");
    ok(lm_cuda_alloc(&acts_block, ab), "alloc acts");
    ok(lm_cuda_alloc(&scratch_block, sb), "alloc scratch");
    ok(lm_cuda_upload(pf_block, hp, count * 4), "upload params");
    ok(lm_cuda_upload_bf16(pb_block, hp, count), "upload bf16 params");
    ok(lm_cuda_upload(x, hx, (size_t)m * c.d * 4), "upload x");
    ok(lm_cuda_upload(dy, hx, (size_t)m * c.d * 4), "upload dy");

    lm_moe_params pf, grads;
    lm_moe_params_bf16 pb;
    lm_moe_params_carve(&c, (float *)pf_block, &pf);
    lm_moe_params_carve(&c, (float *)g_block, &grads);
    float *const *src = &host.router;
    uint16_t **dst = &pb.router;
    for (int i = 0; i < 10; i++) dst[i] = src[i] ? (uint16_t *)pb_block + (src[i] - hp) : NULL;
    lm_cuda_moe_acts acts;
    lm_cuda_moe_scratch scratch;
    ok(lm_cuda_moe_acts_carve(&acts, &c, m, acts_block, ab), "carve acts");
    ok(lm_cuda_moe_scratch_carve(&scratch, &c, m, scratch_block, sb), "carve scratch");

    /* the balancer: host state, device bias, bin geometry, counts and loads */
    const int n = c.n_experts, bins = LM_QB_BINS_DEFAULT;
    lm_balance_config bcfg = lm_balance_config_default(LM_BALANCE_QUANTILE, n, c.top_k, m);
    lm_balance_state bal;
    ok(lm_balance_init(&bal, &bcfg), "balance state");
    void *bias_d, *lo_d, *width_d, *counts_d, *load_d;
    ok(lm_cuda_alloc(&bias_d, (size_t)n * 4), "alloc bias");
    ok(lm_cuda_alloc(&lo_d, (size_t)n * 4), "alloc lo");
    ok(lm_cuda_alloc(&width_d, (size_t)n * 4), "alloc width");
    ok(lm_cuda_alloc(&counts_d, (size_t)n * bins * 4), "alloc counts");
    ok(lm_cuda_alloc(&load_d, (size_t)n * 4), "alloc load");
    float *lo_h = malloc((size_t)n * 4), *width_h = malloc((size_t)n * 4);
    int32_t *counts_h = malloc((size_t)n * bins * 4), *load_h = malloc((size_t)n * 4);
    if (!lo_h || !width_h || !counts_h || !load_h) {
        fprintf(stderr, "out of host memory\n");
        return 1;
    }
    cudaStream_t st = (cudaStream_t)ctx.stream;

    double *t_fwd = malloc((size_t)reps * sizeof(double)), *t_all = malloc((size_t)reps * sizeof(double));
    double grouped_fwd = 6.0 * (double)m * c.top_k * c.d_ff * c.d_latent;
    double res[LM_MOE_GEMM_KINDS][4]; /* per kind: forward ms, forward+backward ms, TFLOP/s of each */
    int ran[LM_MOE_GEMM_KINDS] = {0}, best = -1;
    for (int kind = 0; kind < LM_MOE_GEMM_KINDS; kind++) {
        if (only >= 0 && kind != only) continue;
        ok(lm_cuda_moe_set_gemm((lm_moe_gemm_kind)kind), "gemm kind");
        for (int rep = -2; rep < reps; rep++) {
            double t0 = lm_time_seconds();
            ok(lm_cuda_moe_forward(&ctx, y, x, NULL, balance ? (const float *)bias_d : NULL, &c, &pf, &pb, &acts, m),
               "forward");
            ok(lm_cuda_context_sync(&ctx), "forward sync");
            double t1 = lm_time_seconds();
            if (balance) {
                /* this step's bins (fixed by b), the counts of the forward's scores */
                ok(lm_balance_bin_geometry(&bal, lo_h, width_h), "bin geometry");
                ok(lm_cuda_upload(lo_d, lo_h, (size_t)n * 4), "upload lo");
                ok(lm_cuda_upload(width_d, width_h, (size_t)n * 4), "upload width");
                if (cudaMemsetAsync(counts_d, 0, (size_t)n * bins * 4, st) != cudaSuccess ||
                    cudaMemsetAsync(load_d, 0, (size_t)n * 4, st) != cudaSuccess) {
                    fprintf(stderr, "zero the counts: %s\n", cudaGetErrorString(cudaGetLastError()));
                    return 1;
                }
                ok(lm_cuda_balance_histogram(&ctx, (int32_t *)counts_d, acts.s, (const float *)bias_d,
                                             (const float *)lo_d, (const float *)width_d, m, n, c.top_k, bins, 0),
                   "balance histogram");
                ok(lm_cuda_expert_load(&ctx, (int32_t *)load_d, acts.topk, m, n, c.top_k), "expert load");
            }
            ok(lm_cuda_moe_backward(&ctx, dx, &grads, dy, NULL, x, NULL, &c, &pf, &pb, &acts, &scratch, 0), "backward");
            if (balance) {
                /* the step's end: the counts to the host, b updated there and uploaded */
                ok(lm_cuda_context_sync(&ctx), "backward sync");
                ok(lm_cuda_download(counts_h, counts_d, (size_t)n * bins * 4), "download counts");
                ok(lm_cuda_download(load_h, load_d, (size_t)n * 4), "download load");
                ok(lm_balance_observe_counts(&bal, counts_h, load_h, m, 1, 0.0), "observe counts");
                ok(lm_balance_step_end(&bal, 1, NULL), "balance step");
                ok(lm_cuda_upload(bias_d, bal.bias, (size_t)n * 4), "upload bias");
            }
            ok(lm_cuda_context_sync(&ctx), "backward sync");
            double t2 = lm_time_seconds();
            if (rep >= 0) {
                t_fwd[rep] = (t1 - t0) * 1e3;
                t_all[rep] = (t2 - t0) * 1e3;
            }
        }
        medians(t_fwd, t_all, reps, res[kind]);
        res[kind][2] = grouped_fwd / (res[kind][0] * 1e-3) / 1e12;
        res[kind][3] = 3.0 * grouped_fwd / (res[kind][1] * 1e-3) / 1e12;
        ran[kind] = 1;
        if (best < 0 || res[kind][1] < res[best][1]) best = kind;
    }
    int32_t *load = calloc((size_t)c.n_experts + 1, sizeof(int32_t));
    ok(lm_cuda_download(load, acts.offsets, (size_t)(c.n_experts + 1) * 4), "download offsets");
    int32_t maxload = 0;
    for (int j = 0; j < c.n_experts; j++)
        maxload = load[j + 1] - load[j] > maxload ? load[j + 1] - load[j] : maxload;
    printf("moe layer d %d, %d experts top-%d, ffn %d, latent %d, %d shared ffn %d, %s, %lld tokens\n", c.d,
           c.n_experts, c.top_k, c.d_ff, c.d_latent, c.n_shared, c.d_ff_shared,
           c.act == LM_EXPERT_SITU_GLU ? "SiTU-GLU" : "SwiGLU", (long long)m);
    printf("  busiest expert %d rows (mean %lld)%s\n", maxload, (long long)(m * c.top_k / c.n_experts),
           balance ? "; forward+backward includes the balancing (histogram, loads, b updated on the host)"
                   : "; no balancing (--no-balance)");
    for (int kind = 0; kind < LM_MOE_GEMM_KINDS; kind++) {
        if (!ran[kind]) continue;
        const char *name = lm_cuda_moe_gemm_name((lm_moe_gemm_kind)kind);
        printf("  %-8s forward          %9.3f ms   grouped GEMM %6.1f TFLOP/s (over the layer's time)\n", name,
               res[kind][0], res[kind][2]);
        printf("  %-8s forward+backward %9.3f ms   grouped GEMM %6.1f TFLOP/s (over the layer's time)\n", name,
               res[kind][1], res[kind][3]);
    }
    printf("  fastest forward+backward: %s\n", lm_cuda_moe_gemm_name((lm_moe_gemm_kind)best));
    /* the balance histogram alone (the last forward's scores and b), by tokens a block */
    const int hist_tok[5] = {8, 16, 32, 64, 128};
    double hist_us[5] = {0};
    if (balance) {
        cudaEvent_t e0, e1;
        if (cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
            fprintf(stderr, "events: %s\n", cudaGetErrorString(cudaGetLastError()));
            return 1;
        }
        for (int q = 0; q < 5; q++) {
            ok(lm_cuda_balance_set_hist_tokens(hist_tok[q]), "histogram tokens");
            const int launches = 20;
            for (int rep = -2; rep < launches; rep++) {
                if (rep == 0) cudaEventRecord(e0, st);
                ok(lm_cuda_balance_histogram(&ctx, (int32_t *)counts_d, acts.s, (const float *)bias_d,
                                             (const float *)lo_d, (const float *)width_d, m, n, c.top_k, bins, 0),
                   "balance histogram");
            }
            cudaEventRecord(e1, st);
            ok(lm_cuda_context_sync(&ctx), "histogram sync");
            float ms = 0;
            cudaEventElapsedTime(&ms, e0, e1);
            hist_us[q] = ms * 1e3 / launches;
            printf("  balance histogram, %3d tokens a block: %8.1f us a launch\n", hist_tok[q], hist_us[q]);
        }
        ok(lm_cuda_balance_set_hist_tokens(16), "histogram tokens");
        cudaEventDestroy(e0), cudaEventDestroy(e1);
    }
    double ep_ms[2] = {0, 0};
    if (ep_too) {
        /* the expert-parallel layer on one NCCL rank, the batched kind, no balancing */
        lm_comm *comm = NULL;
        lm_cuda_moe_ep *ep = NULL;
        if (!lm_comm_engine_available(LM_COMM_NCCL)) ok(LM_ERR_ARG, "--ep needs the NCCL engine (built without it)");
        ok(lm_comm_open(LM_COMM_NCCL, &comm), "one-rank NCCL communicator");
        lm_comm_set_stream(comm, ctx.stream);
        ok(lm_cuda_moe_ep_create(&ctx, comm, &c, &ep), "ep handle");
        ok(lm_cuda_moe_set_gemm(LM_MOE_GEMM_BATCHED), "gemm kind");
        for (int rep = -2; rep < reps; rep++) {
            double t0 = lm_time_seconds();
            ok(lm_cuda_moe_forward_ep(&ctx, y, x, NULL, NULL, &c, &pf, &pb, &acts, m, ep), "forward ep");
            ok(lm_cuda_context_sync(&ctx), "forward sync");
            double t1 = lm_time_seconds();
            ok(lm_cuda_moe_backward_ep(&ctx, dx, &grads, dy, NULL, x, NULL, &c, &pf, &pb, &acts, &scratch, ep),
               "backward ep");
            ok(lm_cuda_context_sync(&ctx), "backward sync");
            double t2 = lm_time_seconds();
            if (rep >= 0) {
                t_fwd[rep] = (t1 - t0) * 1e3;
                t_all[rep] = (t2 - t0) * 1e3;
            }
        }
        medians(t_fwd, t_all, reps, ep_ms);
        printf("  ep (one NCCL rank, batched, no balancing) forward %9.3f ms, forward+backward %9.3f ms; the owner's "
               "buffers %.1f MiB\n", ep_ms[0], ep_ms[1], (lm_cuda_moe_ep_bytes(ep, 0) + lm_cuda_moe_ep_bytes(ep, 1)) / 1048576.0);
        lm_cuda_moe_ep_free(ep);
        lm_comm_close(comm);
    }
    long refused = lm_cuda_moe_grouped_refused();
    if (refused) printf("  note: cuBLAS refused %ld grouped calls; the grouped kind ran them per expert\n", refused);
    if (out_path) {
        FILE *f = fopen(out_path, "w");
        if (!f) {
            fprintf(stderr, "cannot write %s\n", out_path);
            return 1;
        }
        fprintf(f,
                "{\"bench\": \"cuda_moe\", \"tokens\": %lld, \"d\": %d, \"experts\": %d, \"top_k\": %d, "
                "\"d_ff\": %d, \"d_latent\": %d, \"n_shared\": %d, \"d_ff_shared\": %d, \"act\": \"%s\", "
                "\"reps\": %d, \"kind\": \"%s\", \"forward_ms\": %.4f, \"forward_backward_ms\": %.4f, "
                "\"grouped_gemm_tflops_forward\": %.2f, \"grouped_gemm_tflops_forward_backward\": %.2f, "
                "\"busiest_expert_rows\": %d, \"grouped_calls_refused\": %ld, \"balance\": %s, \"kinds\": {",
                (long long)m, c.d, c.n_experts, c.top_k, c.d_ff, c.d_latent, c.n_shared, c.d_ff_shared,
                c.act == LM_EXPERT_SITU_GLU ? "situ_glu" : "swiglu", reps,
                lm_cuda_moe_gemm_name((lm_moe_gemm_kind)best), res[best][0], res[best][1], res[best][2],
                res[best][3], maxload, refused, balance ? "true" : "false");
        int first = 1;
        for (int kind = 0; kind < LM_MOE_GEMM_KINDS; kind++) {
            if (!ran[kind]) continue;
            fprintf(f,
                    "%s\"%s\": {\"forward_ms\": %.4f, \"forward_backward_ms\": %.4f, "
                    "\"grouped_gemm_tflops_forward\": %.2f, \"grouped_gemm_tflops_forward_backward\": %.2f}",
                    first ? "" : ", ", lm_cuda_moe_gemm_name((lm_moe_gemm_kind)kind), res[kind][0], res[kind][1],
                    res[kind][2], res[kind][3]);
            first = 0;
        }
        fprintf(f, "}");
        if (ep_too) fprintf(f, ", \"ep_forward_ms\": %.4f, \"ep_forward_backward_ms\": %.4f", ep_ms[0], ep_ms[1]);
        if (balance)
            fprintf(f, ", \"histogram_us\": {\"8\": %.2f, \"16\": %.2f, \"32\": %.2f, \"64\": %.2f, \"128\": %.2f}",
                    hist_us[0], hist_us[1], hist_us[2], hist_us[3], hist_us[4]);
        fprintf(f, "}\n");
        fclose(f);
    }
    free(load), free(t_fwd), free(t_all), free(hp), free(hx);
    free(lo_h), free(width_h), free(counts_h), free(load_h);
    lm_balance_free(&bal);
    lm_cuda_free(bias_d), lm_cuda_free(lo_d), lm_cuda_free(width_d), lm_cuda_free(counts_d), lm_cuda_free(load_d);
    lm_cuda_free(pf_block), lm_cuda_free(pb_block), lm_cuda_free(g_block), lm_cuda_free(x), lm_cuda_free(y);
    lm_cuda_free(dy), lm_cuda_free(dx), lm_cuda_free(acts_block), lm_cuda_free(scratch_block);
    lm_cuda_context_destroy(&ctx);
    return 0;
}
