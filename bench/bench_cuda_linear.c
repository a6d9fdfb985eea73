/* Speed of the dense CUDA operators (include/longmoe/linear_cuda.h) at the
 * shapes of configs/k3-mini.json: N tokens (default 32768) through the
 * model's products, d_model 1024 -> 1024 (attention projections), 1024 ->
 * 4096 and 4096 -> 1024 (the dense FFN), 1024 -> 32768 (the LM head), 512 ->
 * 1024 (the latent MoE's up-projection); RMSNorm and the embedding at
 * d = 1024; the chunked cross-entropy with the LM head.
 *
 *   bench_cuda_linear [--out results.json] [--reps N] [--tokens N]
 *
 * Median of N timed repetitions (CUDA events on the context's stream) after
 * 3 warm-ups, on random data (never zeros). TFLOP/s count 2*N*ic*oc per
 * forward product and 4*N*ic*oc per backward (dinp and dweight). GB/s count
 * each tensor read or written once: RMSNorm forward reads x and the weight,
 * writes the fp32 and bf16 outputs and rstd; its backward reads dout, x, rstd,
 * the weight and dinp and writes dinp and dweight (dweight's partials are not
 * counted); the embedding forward
 * reads and writes N rows; its backward reads N gradient rows and reads and
 * writes each distinct token's row once (the backward is also timed with each
 * accumulation kernel, chain and gather, and on skewed tokens, with that
 * draw's distinct rows). Each memory-bound kernel is also
 * put beside a device-to-device cudaMemcpy moving as many bytes, timed in the
 * same run (bench_common.h: MB moved, GB/s, copy GB/s, % of copy; the JSON's
 * "memory_bound" list). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_common.h"
#include "check.h"
#include "cuda/cuda_check.h"
#include "longmoe/linear_cuda.h"

static lm_cuda_context ctx;
static bench_xorshift rng = {0x2545f4914f6cdd1dull};
/* uniform in [-a, a) */
static inline float uni(float a) { return bench_uniform(&rng, a); }

static void *dev_alloc(size_t bytes) {
    void *p = NULL;
    if (lm_cuda_alloc(&p, bytes)) dieAt("device allocation of %zu bytes: %s", bytes, lm_last_error());
    return p;
}

static uint16_t *dev_bf16_random(size_t n, float a) {
    uint16_t *h = mallocCheck(n * 2), *d = dev_alloc(n * 2);
    for (size_t i = 0; i < n; i++) h[i] = lm_f32_to_bf16(uni(a));
    cudaCheck(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

static float *dev_f32_random(size_t n, float a) {
    float *h = mallocCheck(n * 4), *d = dev_alloc(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = uni(a);
    cudaCheck(cudaMemcpy(d, h, n * 4, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

static float time_ms(bench_fn fn, void *arg, int reps) {
    return bench_time_ms((cudaStream_t)ctx.stream, fn, arg, reps);
}

typedef struct {
    int64_t n;
    int ic, oc;
    uint16_t *x, *w, *g, *y16;
    float *y, *dx, *dw;
} mm_args;

static lm_status mm_forward(void *p) {
    mm_args *a = p;
    return lm_cuda_matmul_forward(&ctx, a->y, a->x, a->w, a->n, a->ic, a->oc, 0);
}
static lm_status mm_forward_bf16(void *p) {
    mm_args *a = p;
    return lm_cuda_matmul_forward_bf16(&ctx, a->y16, a->x, a->w, a->n, a->ic, a->oc);
}
static lm_status mm_backward(void *p) {
    mm_args *a = p;
    return lm_cuda_matmul_backward(&ctx, a->dx, a->dw, a->g, a->x, a->w, a->n, a->ic, a->oc);
}

typedef struct {
    int64_t n;
    int d, vocab;
    float *x, *w, *y, *r, *g, *dx, *dw, *scratch, *table, *dtable;
    uint16_t *y16;
    int32_t *tokens;
    void *emb_scratch;
} row_args;

static lm_status rms_forward(void *p) {
    row_args *a = p;
    return lm_cuda_rmsnorm_forward(&ctx, a->y, a->y16, a->r, a->x, a->w, a->n, a->d, 1e-6f);
}
static lm_status rms_backward(void *p) {
    row_args *a = p;
    return lm_cuda_rmsnorm_backward(&ctx, a->dx, a->dw, a->g, a->x, a->w, a->r, a->n, a->d, 1e-6f, a->scratch);
}
static lm_status emb_forward(void *p) {
    row_args *a = p;
    return lm_cuda_embedding_forward(&ctx, a->y, a->table, a->tokens, a->n, a->d);
}
static lm_status emb_backward(void *p) {
    row_args *a = p;
    return lm_cuda_embedding_backward(&ctx, a->dtable, a->g, a->tokens, a->n, a->d, a->vocab, a->emb_scratch);
}
/* the accumulation kernel chosen (LONGMOE_EMBEDDING_BACKWARD, read at every call): old beside new */
static lm_status emb_backward_kind(void *p, const char *kind) {
    setenv("LONGMOE_EMBEDDING_BACKWARD", kind, 1);
    lm_status st = emb_backward(p);
    unsetenv("LONGMOE_EMBEDDING_BACKWARD");
    return st;
}
static lm_status emb_backward_chain(void *p) { return emb_backward_kind(p, "chain"); }
static lm_status emb_backward_gather(void *p) { return emb_backward_kind(p, "gather"); }

typedef struct {
    int64_t n;
    int d, vocab;
    uint16_t *hn, *head;
    int32_t *targets;
    float *lse, *loss, *dhn, *dhead;
    void *ws;
    size_t wsb;
} ce_args;

static lm_status ce_forward_backward(void *p) {
    ce_args *a = p;
    lm_status st = lm_cuda_cross_entropy_forward(&ctx, a->lse, a->loss, a->hn, a->head, a->targets, a->n, a->d,
                                                 a->vocab, a->ws, a->wsb);
    if (st) return st;
    return lm_cuda_cross_entropy_backward(&ctx, a->dhn, a->dhead, a->hn, a->head, a->targets, a->lse, NULL,
                                          1.0f / (float)a->n, a->n, a->d, a->vocab, a->ws, a->wsb);
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
    if (reps < 1 || N < 1) dieAt("--reps and --tokens must be >= 1");
    if (lm_cuda_context_create(&ctx)) dieAt("%s", lm_last_error());
    FILE *js = out_path ? fopenCheck(out_path, "w") : NULL;
    struct cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, ctx.device));
    printf("dense operators on %s, %lld tokens, median of %d\n", prop.name, (long long)N, reps);
    if (js) fprintf(js, "{\"device\": \"%s\", \"tokens\": %lld, \"reps\": %d,\n \"matmul\": [", prop.name,
                    (long long)N, reps);

    static const int shapes[][2] = {{1024, 1024}, {1024, 4096}, {4096, 1024}, {1024, 32768}, {512, 1024}};
    printf("%-16s %10s %10s %10s %10s %10s %10s\n", "matmul ic->oc", "fwd ms", "TFLOP/s", "fwd16 ms", "TFLOP/s",
           "bwd ms", "TFLOP/s");
    for (int s = 0; s < 5; s++) {
        mm_args a;
        a.n = N;
        a.ic = shapes[s][0];
        a.oc = shapes[s][1];
        size_t ni = (size_t)N * a.ic, no = (size_t)N * a.oc, nw = (size_t)a.ic * a.oc;
        a.x = dev_bf16_random(ni, 1.0f);
        a.w = dev_bf16_random(nw, 0.05f);
        a.g = dev_bf16_random(no, 1.0f);
        a.y = dev_alloc(no * 4);
        a.y16 = dev_alloc(no * 2);
        a.dx = dev_alloc(ni * 4);
        a.dw = dev_alloc(nw * 4);
        double flop = 2.0 * (double)N * a.ic * a.oc;
        float f = time_ms(mm_forward, &a, reps), f16 = time_ms(mm_forward_bf16, &a, reps);
        float b = time_ms(mm_backward, &a, reps);
        double tf = flop / (f * 1e9), tf16 = flop / (f16 * 1e9), tb = 2 * flop / (b * 1e9);
        char name[32];
        snprintf(name, sizeof name, "%d->%d", a.ic, a.oc);
        printf("%-16s %10.3f %10.1f %10.3f %10.1f %10.3f %10.1f\n", name, f, tf, f16, tf16, b, tb);
        if (js)
            fprintf(js, "%s\n  {\"ic\": %d, \"oc\": %d, \"forward_ms\": %.4f, \"forward_tflops\": %.2f, "
                        "\"forward_bf16_ms\": %.4f, \"forward_bf16_tflops\": %.2f, \"backward_ms\": %.4f, "
                        "\"backward_tflops\": %.2f}",
                    s ? "," : "", a.ic, a.oc, f, tf, f16, tf16, b, tb);
        lm_cuda_free(a.x), lm_cuda_free(a.w), lm_cuda_free(a.g), lm_cuda_free(a.y), lm_cuda_free(a.y16);
        lm_cuda_free(a.dx), lm_cuda_free(a.dw);
    }

    /* RMSNorm and embedding at d_model */
    row_args r;
    memset(&r, 0, sizeof r);
    r.n = N;
    r.d = 1024;
    r.vocab = 32768;
    size_t nx = (size_t)N * r.d, nt = (size_t)r.vocab * r.d;
    r.x = dev_f32_random(nx, 2.0f);
    r.w = dev_f32_random((size_t)r.d, 1.0f);
    r.g = dev_f32_random(nx, 1.0f);
    r.y = dev_alloc(nx * 4);
    r.y16 = dev_alloc(nx * 2);
    r.r = dev_alloc((size_t)N * 4);
    r.dx = dev_alloc(nx * 4);
    r.dw = dev_alloc((size_t)r.d * 4);
    r.scratch = dev_alloc(lm_cuda_rmsnorm_scratch_floats(N, r.d) * 4);
    r.table = dev_f32_random(nt, 1.0f);
    r.dtable = dev_alloc(nt * 4);
    r.emb_scratch = dev_alloc(lm_cuda_embedding_scratch_bytes(N, r.vocab));
    int32_t *tok = mallocCheck((size_t)N * 4);
    char *seen = callocCheck((size_t)r.vocab, 1);
    int64_t distinct = 0;
    for (int64_t i = 0; i < N; i++) {
        tok[i] = (int32_t)(bench_next_u32(&rng) % (uint32_t)r.vocab);
        distinct += !seen[tok[i]];
        seen[tok[i]] = 1;
    }
    r.tokens = dev_alloc((size_t)N * 4);
    cudaCheck(cudaMemcpy(r.tokens, tok, (size_t)N * 4, cudaMemcpyHostToDevice));
    /* the same with skewed tokens, closer to text than uniform ones: token = floor(vocab^u) - 1, u
     * uniform (log-uniform, a Zipf-like law: token 0 about 7% of positions): long runs, each added
     * in position order */
    row_args rz = r;
    int32_t *tokz = mallocCheck((size_t)N * 4);
    memset(seen, 0, (size_t)r.vocab);
    int64_t distinct_z = 0;
    for (int64_t i = 0; i < N; i++) {
        double u = (double)(bench_next_u32(&rng) & 0xffffff) / 16777216.0;
        int32_t t = (int32_t)floor(pow((double)r.vocab, u)) - 1;
        tokz[i] = t < 0 ? 0 : (t >= r.vocab ? r.vocab - 1 : t);
        distinct_z += !seen[tokz[i]];
        seen[tokz[i]] = 1;
    }
    rz.tokens = dev_alloc((size_t)N * 4);
    cudaCheck(cudaMemcpy(rz.tokens, tokz, (size_t)N * 4, cudaMemcpyHostToDevice));
    /* least traffic: every input read once, every output written once */
    double row_bytes = (double)r.d * 4;
    double rf_bytes = (double)nx * (4 + 4 + 2) + N * 4.0 + row_bytes;
    double rb_bytes = (double)nx * 4 * 4 + N * 4.0 + 3 * row_bytes; /* dout, x, dinp in and out; rstd; w, dw */
    double ef_bytes = 2.0 * N * row_bytes + N * 4.0;
    double eb_bytes = N * row_bytes + 2.0 * distinct * row_bytes + N * 4.0;
    double ebz_bytes = N * row_bytes + 2.0 * distinct_z * row_bytes + N * 4.0;
    float rf = time_ms(rms_forward, &r, reps), rb = time_ms(rms_backward, &r, reps);
    float ef = time_ms(emb_forward, &r, reps), eb = time_ms(emb_backward, &r, reps);
    float ebc = time_ms(emb_backward_chain, &r, reps), ebg = time_ms(emb_backward_gather, &r, reps);
    float ebzc = time_ms(emb_backward_chain, &rz, reps), ebzg = time_ms(emb_backward_gather, &rz, reps);
    cudaStream_t st = (cudaStream_t)ctx.stream;
    /* the first four as before (the backward: the default kernel); then the backward with each
     * accumulation kernel, on the uniform tokens and on the skewed ones */
    bench_bw bw[8] = {bench_bw_measure("rmsnorm forward (d=1024)", rf_bytes, rf, reps, st),
                      bench_bw_measure("rmsnorm backward (d=1024)", rb_bytes, rb, reps, st),
                      bench_bw_measure("embedding forward (d=1024)", ef_bytes, ef, reps, st),
                      bench_bw_measure("embedding backward (d=1024)", eb_bytes, eb, reps, st),
                      bench_bw_measure("  emb backward, chain kernel", eb_bytes, ebc, reps, st),
                      bench_bw_measure("  emb backward, gather kernel", eb_bytes, ebg, reps, st),
                      bench_bw_measure("  emb bwd skewed tok, chain", ebz_bytes, ebzc, reps, st),
                      bench_bw_measure("  emb bwd skewed tok, gather", ebz_bytes, ebzg, reps, st)};
    const int nbw = (int)(sizeof bw / sizeof bw[0]);
    bench_bw_header();
    for (int i = 0; i < nbw; i++) bench_bw_print(&bw[i]);
    if (js) {
        fprintf(js, "],\n \"rmsnorm\": {\"d\": %d, \"forward_ms\": %.4f, \"forward_gbs\": %.1f, "
                    "\"backward_ms\": %.4f, \"backward_gbs\": %.1f},\n \"embedding\": {\"d\": %d, \"vocab\": %d, "
                    "\"forward_ms\": %.4f, \"forward_gbs\": %.1f, \"backward_ms\": %.4f, \"backward_gbs\": %.1f},\n",
                r.d, rf, bw[0].gbs, rb, bw[1].gbs, r.d, r.vocab, ef, bw[2].gbs, eb, bw[3].gbs);
        fprintf(js, " \"memory_bound\": [");
        for (int i = 0; i < nbw; i++) {
            fprintf(js, "%s\n  ", i ? "," : "");
            bench_bw_json(js, &bw[i]);
        }
        fprintf(js, "],\n");
    }
    free(tok), free(tokz), free(seen);
    lm_cuda_free(rz.tokens);
    lm_cuda_free(r.x), lm_cuda_free(r.w), lm_cuda_free(r.g), lm_cuda_free(r.y), lm_cuda_free(r.y16);
    lm_cuda_free(r.r), lm_cuda_free(r.dx), lm_cuda_free(r.dw), lm_cuda_free(r.scratch), lm_cuda_free(r.table);
    lm_cuda_free(r.dtable), lm_cuda_free(r.emb_scratch), lm_cuda_free(r.tokens);

    /* cross-entropy with the LM head: 4096-row chunks */
    ce_args c;
    c.n = N;
    c.d = 1024;
    c.vocab = 32768;
    int64_t rows = N < 4096 ? N : 4096;
    c.hn = dev_bf16_random((size_t)N * c.d, 1.0f);
    c.head = dev_bf16_random((size_t)c.vocab * c.d, 0.05f);
    int32_t *tg = mallocCheck((size_t)N * 4);
    for (int64_t i = 0; i < N; i++) tg[i] = (int32_t)(bench_next_u32(&rng) % (uint32_t)c.vocab);
    c.targets = dev_alloc((size_t)N * 4);
    cudaCheck(cudaMemcpy(c.targets, tg, (size_t)N * 4, cudaMemcpyHostToDevice));
    free(tg);
    c.lse = dev_alloc((size_t)N * 4);
    c.loss = dev_alloc(4);
    c.dhn = dev_alloc((size_t)N * c.d * 4);
    c.dhead = dev_alloc((size_t)c.vocab * c.d * 4);
    c.wsb = lm_cuda_cross_entropy_workspace_bytes(N, c.d, c.vocab, rows);
    c.ws = dev_alloc(c.wsb);
    float ce = time_ms(ce_forward_backward, &c, reps);
    /* forward product, recomputed product, two backward products */
    double ce_flop = 8.0 * (double)N * c.d * c.vocab;
    printf("%-24s %10.3f ms %8.1f TFLOP/s (chunks of %lld rows)\n", "cross-entropy fwd+bwd", ce,
           ce_flop / (ce * 1e9), (long long)rows);
    if (js) {
        fprintf(js, " \"cross_entropy\": {\"d\": %d, \"vocab\": %d, \"rows_per_chunk\": %lld, "
                    "\"forward_backward_ms\": %.4f, \"tflops\": %.2f}}\n",
                c.d, c.vocab, (long long)rows, ce, ce_flop / (ce * 1e9));
        fclose(js);
    }
    lm_cuda_free(c.hn), lm_cuda_free(c.head), lm_cuda_free(c.targets), lm_cuda_free(c.lse), lm_cuda_free(c.loss);
    lm_cuda_free(c.dhn), lm_cuda_free(c.dhead), lm_cuda_free(c.ws);
    lm_cuda_context_destroy(&ctx);
    return 0;
}
