/* Timings of the KDA CUDA kernels (include/longmoe/kda_cuda.h) on the shapes
 * of SPEC §7, both gates: forward, and forward + backward (the backward call
 * reuses what the training forward kept in the workspace); also the forward
 * that returns the final state, which takes the precise state path.
 *
 *   bench_cuda_kda [--out results.json] [--reps N] [--shape B,T,H,D]... [--profile]
 *
 * --profile runs one forward and one backward per gate, untimed, for ncu.
 *
 * Median of N timed repetitions (CUDA events) after 3 warm-ups, on random
 * bf16 data (never zeros). Prints a table; writes JSON to --out. The memory
 * floor counts q, k, v, z (bf16) and beta (fp32) read and o written once
 * (forward), plus d_o read and dq, dk, dv, dz, dbeta written once (backward). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_common.h"
#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/kda_cuda.h"

typedef struct {
    int B, T, H, D;
} shape;

static bench_xorshift rng = {0x9e3779b97f4a7c15ull};
/* uniform in [-a, a) */
static inline float uni(float a) { return bench_uniform(&rng, a); }

static float *device_f32_random(size_t n, float lo, float hi) {
    float *h = mallocCheck(n * 4), *d = NULL;
    for (size_t i = 0; i < n; i++) h[i] = lo + (hi - lo) * (uni(0.5f) + 0.5f);
    cudaCheck(cudaMalloc((void **)&d, n * 4));
    cudaCheck(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

typedef struct {
    const lm_kda_config *cfg;
    const lm_kda_cuda_inputs *in;
    uint16_t *o, *d_o;
    float *ht; /* forward alone: also the final state (the precise path) */
    lm_kda_cuda_grads *g;
    void *ws;
    size_t wsb;
    int backward;
} run_args;

/* Forward alone: the inference workspace (nothing kept for a backward).
 * Forward + backward: the training workspace; the forward keeps what the
 * backward needs and the backward reuses it (forward_saved = 1). */
static void run_once(const run_args *a) {
    size_t wsb = a->backward ? a->wsb : lm_kda_cuda_workspace_bytes(a->cfg, 0);
    lm_status st = lm_kda_cuda_chunk_forward(a->cfg, a->in, a->o, a->backward ? NULL : a->ht,
                                             a->ws, wsb, NULL);
    if (st) dieAt("forward: %s", lm_last_error());
    if (a->backward) {
        st = lm_kda_cuda_chunk_backward(a->cfg, a->in, a->d_o, NULL, a->g, a->ws, a->wsb, 1, NULL);
        if (st) dieAt("backward: %s", lm_last_error());
    }
}

/* Median milliseconds of `reps` runs after 3 warm-ups. */
static float time_median(const run_args *a, int reps) {
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) run_once(a);
    cudaCheck(cudaDeviceSynchronize());
    float *ms = mallocCheck((size_t)reps * sizeof(float));
    for (int i = 0; i < reps; i++) {
        cudaCheck(cudaEventRecord(e0, NULL));
        run_once(a);
        cudaCheck(cudaEventRecord(e1, NULL));
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
    int reps = 20, profile = 0;
    shape shapes[8];
    int nshape = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) {
            out_path = argv[++i];
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
            if (reps < 1) dieAt("--reps must be >= 1 (got %s)", argv[i]);
        } else if (!strcmp(argv[i], "--profile")) {
            profile = 1; /* one forward and one backward per gate, untimed (for ncu) */
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc && nshape < 8) {
            shape s;
            if (sscanf(argv[++i], "%d,%d,%d,%d", &s.B, &s.T, &s.H, &s.D) != 4)
                dieAt("--shape wants B,T,H,D (got %s)", argv[i]);
            shapes[nshape++] = s;
        } else {
            fprintf(stderr, "usage: %s [--out results.json] [--reps N] [--shape B,T,H,D]... "
                            "[--profile]\n",
                    argv[0]);
            return 2;
        }
    }
    if (nshape == 0) {
        shape def[3] = {{1, 8192, 64, 128}, {8, 4096, 16, 128}, {1, 65536, 16, 128}};
        memcpy(shapes, def, sizeof def);
        nshape = 3;
    }
    struct cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20);

    FILE *js = out_path ? fopenCheck(out_path, "w") : NULL;
    if (js) fprintf(js, "{\"device\": \"%s\", \"reps\": %d, \"results\": [\n", prop.name, reps);
    printf("\n%-22s %-9s %10s %12s %10s %12s %10s %12s\n", "shape (B,T,H,D)", "gate", "fwd ms",
           "fwd GB/s", "fwd+bwd ms", "f+b GB/s", "floor ms", "fwd+ht ms");
    int first = 1;
    for (int s = 0; s < nshape; s++) {
        const shape sh = shapes[s];
        const size_t n = (size_t)sh.B * sh.T * sh.H * sh.D, nb = (size_t)sh.B * sh.T * sh.H;
        const float qa = 1.7320508f / sqrtf((float)sh.D); /* |q| about 1 */
        uint16_t *q = bench_device_bf16_random(&rng, n, qa), *k = bench_device_bf16_random(&rng, n, qa);
        uint16_t *v = bench_device_bf16_random(&rng, n, 1.f), *z = bench_device_bf16_random(&rng, n, 2.f);
        uint16_t *d_o = bench_device_bf16_random(&rng, n, 1.f);
        float *beta = device_f32_random(nb, 0.05f, 0.95f);
        float *A_log = device_f32_random((size_t)sh.H, -0.5f, 0.5f);
        float *dt_bias = device_f32_random((size_t)sh.H * sh.D, -0.5f, 0.5f);
        uint16_t *o = NULL;
        float *ht = NULL;
        lm_kda_cuda_grads g;
        memset(&g, 0, sizeof g);
        cudaCheck(cudaMalloc((void **)&o, n * 2));
        cudaCheck(cudaMalloc((void **)&ht, (size_t)sh.B * sh.H * sh.D * sh.D * 4));
        cudaCheck(cudaMalloc((void **)&g.dq, n * 2));
        cudaCheck(cudaMalloc((void **)&g.dk, n * 2));
        cudaCheck(cudaMalloc((void **)&g.dv, n * 2));
        cudaCheck(cudaMalloc((void **)&g.dz, n * 2));
        cudaCheck(cudaMalloc((void **)&g.dbeta, nb * 4));
        cudaCheck(cudaMalloc((void **)&g.dA_log, (size_t)sh.H * 4));
        cudaCheck(cudaMalloc((void **)&g.ddt_bias, (size_t)sh.H * sh.D * 4));
        lm_kda_cuda_inputs in = {q, k, v, z, beta, A_log, dt_bias, NULL};
        lm_kda_config cfg = lm_kda_config_default(sh.B, sh.T, sh.H, sh.D, sh.D);
        size_t wsb = lm_kda_cuda_workspace_bytes(&cfg, 1);
        void *ws = NULL;
        cudaCheck(cudaMalloc(&ws, wsb));
        /* the fewest bytes: inputs read once, outputs written once */
        double floor_f = 4.0 * n * 2 + nb * 4 + n * 2;
        double floor_fb = floor_f + n * 2 + 4.0 * n * 2 + nb * 4;
        float fwd[2], fb[2], fht[2];
        for (int gate = 0; gate < 2; gate++) {
            cfg.gate = gate ? LM_KDA_GATE_SOFTPLUS : LM_KDA_GATE_BOUNDED;
            run_args a = {&cfg, &in, o, d_o, NULL, &g, ws, wsb, 0};
            if (profile) {
                a.backward = 1;
                run_once(&a);
                cudaCheck(cudaDeviceSynchronize());
                continue;
            }
            fwd[gate] = time_median(&a, reps);
            a.ht = ht;
            fht[gate] = time_median(&a, reps);
            a.ht = NULL;
            a.backward = 1;
            fb[gate] = time_median(&a, reps);
            char name[64];
            snprintf(name, sizeof name, "(%d,%d,%d,%d)", sh.B, sh.T, sh.H, sh.D);
            printf("%-22s %-9s %10.3f %12.0f %10.3f %12.0f %10.3f %12.3f\n", name,
                   gate ? "softplus" : "bounded", fwd[gate], floor_f / (fwd[gate] * 1e6),
                   fb[gate], floor_fb / (fb[gate] * 1e6), floor_f / 4.3e9, fht[gate]);
            if (js) {
                fprintf(js,
                        "%s  {\"B\": %d, \"T\": %d, \"H\": %d, \"D\": %d, \"gate\": \"%s\", "
                        "\"fwd_ms\": %.4f, \"fwd_bwd_ms\": %.4f, \"fwd_final_state_ms\": %.4f, "
                        "\"floor_fwd_bytes\": %.0f, \"floor_fwd_bwd_bytes\": %.0f}",
                        first ? "" : ",\n", sh.B, sh.T, sh.H, sh.D, gate ? "softplus" : "bounded",
                        fwd[gate], fb[gate], fht[gate], floor_f, floor_fb);
                first = 0;
            }
        }
        if (!profile)
            printf("%-22s softplus/bounded: fwd %.2fx, fwd+bwd %.2fx\n", "", fwd[1] / fwd[0],
                   fb[1] / fb[0]);
        cudaFree(q);
        cudaFree(k);
        cudaFree(v);
        cudaFree(z);
        cudaFree(d_o);
        cudaFree(beta);
        cudaFree(A_log);
        cudaFree(dt_bias);
        cudaFree(o);
        cudaFree(ht);
        cudaFree(g.dq);
        cudaFree(g.dk);
        cudaFree(g.dv);
        cudaFree(g.dz);
        cudaFree(g.dbeta);
        cudaFree(g.dA_log);
        cudaFree(g.ddt_bias);
        cudaFree(ws);
    }
    if (js) {
        fprintf(js, "\n]}\n");
        fclose(js);
    }
    printf("(GB/s: the memory floor's bytes over the measured time; floor ms at 4.3 TB/s;\n"
           " fwd+ht: the forward that also returns the final state, by the precise state path)\n");
    return 0;
}
