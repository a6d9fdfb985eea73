/* Evaluation's scoring on the GPU against the CPU (lm_model_score, the
 * score_forward op; docs/eval.md): no logits leave the device, each position's
 * nll and argmax do.
 *   - the op (lm_cuda_score_forward) on random bf16 hn and head, vocabularies
 *     256, 300 (no multiple of 4) and 8192, in one chunk and in chunks of 5,
 *     7 and 16 rows: nll within 1e-4 relative of the CPU's (fp32 logits of
 *     the same bf16 numbers), argmax equal wherever the CPU's two largest
 *     logits differ by more than 1e-3 relative, rows of hn that are zero
 *     (every logit exactly 0: argmax 0, nll = log V), a NaN row giving a
 *     non-finite nll, outputs started from garbage (an unwritten one fails),
 *     two runs bit-identical;
 *   - the model (a small hybrid, head dim 64; the LM head scaled so the
 *     logits spread, about ±8): lm_model_score on the GPU against the CPU,
 *     nll to 2e-2 relative, argmax equal where the CPU's two largest logits
 *     differ by more than 0.5 (bf16 activations move a logit by about 0.1),
 *     and lm_eval_loss's tallies;
 *   - a checkpoint evaluated with lm_eval_run on the GPU (opt.backend) against
 *     the CPU: validation loss to 1e-2 relative; the passkey digits (20 a
 *     cell) and MQAR digits (8 or 16 a cell) of a barely trained model,
 *     whose near-ties may fall either way, within 3 and 2 digits a cell.
 * Needs a GPU (ctest label cuda); skips otherwise. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "longmoe/backend.h"
#include "longmoe/eval.h"
#include "longmoe/linear.h"
#include "longmoe/linear_cuda.h"
#include "longmoe/model.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_cuda.h"
#include "test_models.h"

static lm_cuda_context ctx;
static lm_backend *gpu;

static int same_bits(const void *a, const void *b, size_t bytes) { return !memcmp(a, b, bytes); }

/* the gap between the two largest of z[V] */
static double top_gap(const float *z, int V) {
    double a = -INFINITY, b = -INFINITY;
    for (int v = 0; v < V; v++) {
        if (z[v] > a) b = a, a = z[v];
        else if (z[v] > b) b = z[v];
    }
    return a - b;
}

/* ---- the op ---- */

static void check_op_case(int n, int d, int V, int rows_per_chunk, lm_rng *r) {
    char what[96];
    snprintf(what, sizeof what, "n=%d d=%d V=%d rows=%d", n, d, V, rows_per_chunk);
    float *hn = host_normal((size_t)n * d, 1.0, 0.0, 1, r), *head = host_normal((size_t)V * d, 0.2, 0.0, 1, r);
    int32_t *tg = mallocCheck((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) tg[i] = (int32_t)(lm_rng_u64(r) % (uint64_t)V);
    /* rows 3 and n - 2 are zero: every logit is exactly 0 on both sides */
    memset(hn + 3 * (size_t)d, 0, (size_t)d * sizeof(float));
    memset(hn + (size_t)(n - 2) * d, 0, (size_t)d * sizeof(float));
    /* the CPU: fp32 logits of the same (bf16-held) numbers, lm_score_row per row */
    float *z = mallocCheck((size_t)n * V * sizeof(float));
    lm_matmul_forward(z, hn, head, NULL, n, d, V);
    double *nll_c = mallocCheck((size_t)n * sizeof(double));
    int32_t *arg_c = mallocCheck((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) lm_score_row(z + (size_t)i * V, V, tg[i], &nll_c[i], &arg_c[i]);

    uint16_t *d_hn = dev_upload_bf16(hn, (size_t)n * d), *d_head = dev_upload_bf16(head, (size_t)V * d);
    int32_t *d_tg = dev_alloc((size_t)n * 4);
    CHECK(lm_cuda_upload(d_tg, tg, (size_t)n * 4) == LM_OK, "%s", lm_last_error());
    double *d_nll = dev_alloc((size_t)n * 8);
    int32_t *d_arg = dev_alloc((size_t)n * 4);
    size_t wsb = lm_cuda_cross_entropy_workspace_bytes(n, d, V, rows_per_chunk);
    void *ws = dev_alloc(wsb);
    double *nll[2];
    int32_t *arg[2];
    unsigned char *garbage = mallocCheck((size_t)n * 8);
    memset(garbage, 0x7f, (size_t)n * 8);
    for (int run = 0; run < 2; run++) {
        CHECK(lm_cuda_upload(d_nll, garbage, (size_t)n * 8) == LM_OK &&
                  lm_cuda_upload(d_arg, garbage, (size_t)n * 4) == LM_OK,
              "%s", lm_last_error());
        CHECK(lm_cuda_score_forward(&ctx, d_nll, d_arg, d_hn, d_head, d_tg, n, d, V, ws, wsb) == LM_OK, "%s: %s",
              what, lm_last_error());
        CHECK(lm_cuda_context_sync(&ctx) == LM_OK, "%s", lm_last_error());
        nll[run] = mallocCheck((size_t)n * 8);
        arg[run] = mallocCheck((size_t)n * 4);
        CHECK(lm_cuda_download(nll[run], d_nll, (size_t)n * 8) == LM_OK &&
                  lm_cuda_download(arg[run], d_arg, (size_t)n * 4) == LM_OK,
              "%s", lm_last_error());
    }
    int bad_nll = 0, bad_arg = 0, compared = 0;
    double worst = 0;
    for (int i = 0; i < n; i++) {
        double e = fabs(nll[0][i] - nll_c[i]) / (1e-1 + fabs(nll_c[i]));
        worst = e > worst || isnan(e) ? e : worst;
        bad_nll += !(e <= 1e-4);
        const float *zi = z + (size_t)i * V;
        if (top_gap(zi, V) > 1e-3 * (1.0 + fabs(zi[arg_c[i]]))) {
            compared++;
            bad_arg += arg[0][i] != arg_c[i];
        }
    }
    printf("    %-28s nll worst rel %.2e, argmax compared at %d of %d rows\n", what, worst, compared, n);
    CHECK(bad_nll == 0, "%s: %d nll outside 1e-4 (worst %.3g)", what, bad_nll, worst);
    CHECK(bad_arg == 0 && compared >= n / 2, "%s: %d argmax differ of %d compared", what, bad_arg, compared);
    CHECK(arg[0][3] == 0 && arg[0][n - 2] == 0, "%s: the lowest index wins a tie: %d, %d", what, arg[0][3],
          arg[0][n - 2]);
    CHECK_CLOSE(nll[0][3], log((double)V), 1e-12, 0, "nll of an all-zero row");
    CHECK(same_bits(nll[0], nll[1], (size_t)n * 8) && same_bits(arg[0], arg[1], (size_t)n * 4),
          "%s: two runs differ", what);
    /* a NaN in one row of hn: that row's nll is not finite, the others are */
    hn[(size_t)5 * d + 1] = NAN;
    CHECK(lm_cuda_upload_bf16(d_hn, hn, (size_t)n * d) == LM_OK, "%s", lm_last_error());
    CHECK(lm_cuda_score_forward(&ctx, d_nll, d_arg, d_hn, d_head, d_tg, n, d, V, ws, wsb) == LM_OK, "%s",
          lm_last_error());
    CHECK(lm_cuda_download(nll[1], d_nll, (size_t)n * 8) == LM_OK, "%s", lm_last_error());
    CHECK(!isfinite(nll[1][5]) && isfinite(nll[1][4]) && isfinite(nll[1][6]), "%s: a NaN row gives %g (rows "
          "around: %g, %g)", what, nll[1][5], nll[1][4], nll[1][6]);
    lm_cuda_free(d_hn), lm_cuda_free(d_head), lm_cuda_free(d_tg), lm_cuda_free(d_nll), lm_cuda_free(d_arg);
    lm_cuda_free(ws);
    free(hn), free(head), free(tg), free(z), free(nll_c), free(arg_c), free(garbage);
    for (int run = 0; run < 2; run++) free(nll[run]), free(arg[run]);
}

static void test_score_op_matches_the_cpu_over_chunks_and_ties(void) {
    lm_rng r;
    lm_rng_seed(&r, 0x5c0ecafe);
    check_op_case(150, 64, 300, 150, &r);
    check_op_case(150, 64, 300, 7, &r);
    check_op_case(40, 32, 256, 16, &r);
    check_op_case(33, 128, 8192, 5, &r);
    /* too small a workspace, NULL outputs: refused */
    double *d_nll = dev_alloc(64);
    CHECK(lm_cuda_score_forward(&ctx, d_nll, (int32_t *)d_nll, (uint16_t *)d_nll, (uint16_t *)d_nll,
                                (int32_t *)d_nll, 4, 8, 16, d_nll, 16) == LM_ERR_ARG,
          "a workspace below one row must be refused");
    CHECK(lm_cuda_score_forward(&ctx, NULL, (int32_t *)d_nll, (uint16_t *)d_nll, (uint16_t *)d_nll,
                                (int32_t *)d_nll, 1, 1, 1, d_nll, 64) == LM_ERR_ARG,
          "a NULL nll must be refused");
    lm_cuda_free(d_nll);
}

/* ---- the model ---- */

static void round_to_bf16(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = lm_bf16_to_f32(lm_f32_to_bf16(p[i]));
}

/* The same bf16-exact weights in a CPU and a GPU model; the LM head times 8
 * (exact in bf16), so the logits spread and most argmaxes have a margin. */
static int model_pair(const lm_config *c, int B, int T, lm_model **cpu, lm_model **dev) {
    *cpu = *dev = NULL;
    CHECK(!lm_model_create(c, B, T, cpu), "cpu model: %s", lm_last_error());
    CHECK(!lm_model_create_on(c, B, T, gpu, dev), "gpu model: %s", lm_last_error());
    if (!*cpu || !*dev) return -1;
    lm_model *m[2] = {*cpu, *dev};
    for (int k = 0; k < 2; k++) {
        lm_model_init(m[k], 21);
        round_to_bf16(lm_model_params(m[k]), lm_model_num_params(m[k]));
        const lm_model_tensor *t = lm_model_find(m[k], "lm_head");
        CHECK(t != NULL, "the small hybrid has an lm_head");
        if (!t) return -1;
        for (size_t j = 0; j < t->numel; j++) lm_model_params(m[k])[t->offset + j] *= 8.0f;
    }
    return lm_model_upload_params(*dev) ? -1 : 0;
}

static void test_model_scores_match_the_cpu(void) {
    lm_config c = test_small_hybrid_config();
    enum { B = 2, T = 96, N = B * T };
    lm_model *cpu, *dev;
    if (model_pair(&c, B, T, &cpu, &dev)) goto done;
    const int V = c.vocab_size;
    static int32_t tok[N], tgt[N], arg_c[N], arg_g[N], arg_g2[N];
    static double nll_c[N], nll_g[N], nll_g2[N];
    float *z = mallocCheck((size_t)N * V * sizeof(float));
    lm_rng r;
    lm_rng_seed(&r, 0xe7a1);
    for (int i = 0; i < N; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)V);
    for (int i = 0; i < N; i++) tgt[i] = i % T ? tok[i - 1] : tok[i];
    CHECK(!lm_model_score(cpu, tok, tgt, nll_c, arg_c), "%s", lm_last_error());
    CHECK(!lm_model_logits(cpu, tok, z), "%s", lm_last_error());
    CHECK(!lm_model_score(dev, tok, tgt, nll_g, arg_g), "%s", lm_last_error());
    CHECK(!lm_model_score(dev, tok, tgt, nll_g2, arg_g2), "%s", lm_last_error());
    double num = 0, den = 0;
    int compared = 0, differ = 0;
    for (int i = 0; i < N; i++) {
        num += (nll_g[i] - nll_c[i]) * (nll_g[i] - nll_c[i]);
        den += nll_c[i] * nll_c[i];
        if (top_gap(z + (size_t)i * V, V) > 0.5) compared++, differ += arg_g[i] != arg_c[i];
    }
    double e = sqrt(num / den);
    printf("    nll rel error %.2e; argmax differs at %d of %d positions with a margin > 0.5 (of %d)\n", e, differ,
           compared, N);
    CHECK(e <= 2e-2, "nll rel error %.3g", e);
    CHECK(differ == 0 && compared >= N / 4, "argmax differs at %d of %d compared positions", differ, compared);
    CHECK(same_bits(nll_g, nll_g2, sizeof nll_g) && same_bits(arg_g, arg_g2, sizeof arg_g),
          "two GPU scorings differ");
    /* the evaluation's tallies on held-out data */
    lm_data_source *src = NULL;
    CHECK(!lm_data_open("mix", 77, &src), "%s", lm_last_error());
    lm_eval_tally tc, tg;
    CHECK(!lm_eval_loss(cpu, src, 2, 4, &tc) && !lm_eval_loss(dev, src, 2, 4, &tg), "%s", lm_last_error());
    double lc = lm_eval_tally_loss(&tc), lg = lm_eval_tally_loss(&tg);
    printf("    lm_eval_loss cpu %.6f gpu %.6f; answers right %lld vs %lld of %lld\n", lc, lg,
           (long long)tc.answers_right, (long long)tg.answers_right, (long long)tc.answers);
    CHECK(fabs(lg - lc) <= 1e-2 * fabs(lc), "validation loss cpu %.6f gpu %.6f", lc, lg);
    CHECK(tc.answers == tg.answers && tc.answers > 0, "answer positions %lld vs %lld", (long long)tc.answers,
          (long long)tg.answers);
    CHECK(llabs(tc.answers_right - tg.answers_right) <= 2 + tc.answers / 20, "answers right %lld vs %lld",
          (long long)tc.answers_right, (long long)tg.answers_right);
    lm_data_close(src);
    free(z);
done:
    lm_model_free(cpu);
    lm_model_free(dev);
}

/* ---- a checkpoint ---- */

static void test_checkpoint_evaluates_on_the_gpu_like_the_cpu(void) {
    char root[128], cmd[300];
    snprintf(root, sizeof root, "/tmp/longmoe-test-cuda-score-%ld", (long)getpid());
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd) != 0) return;
    /* a few CPU steps of the small hybrid on mix (head dim 64: the GPU's kernels take it) */
    lm_config c = test_small_hybrid_config();
    c.seq_len = 64;
    c.batch_size = 2;
    c.steps = 6;
    strcpy(c.data, "mix");
    lm_train_options to = lm_train_options_default(root);
    to.progress = NULL;
    to.stage_eval_batches = 0;
    lm_train_result tr;
    CHECK(!lm_train(&c, &to, &tr), "training: %s", lm_last_error());
    lm_eval_options o = lm_eval_options_default();
    o.n_lengths = 2;
    o.lengths[0] = 64, o.lengths[1] = 160;
    o.n_queries = 2;
    o.queries[0] = 2, o.queries[1] = 4;
    o.batches = 2;
    o.batch_size = 2;
    lm_eval_result *rc = calloc(1, sizeof *rc), *rg = calloc(1, sizeof *rg);
    CHECK(!lm_eval_run(root, &o, rc), "cpu: %s", lm_last_error());
    o.backend = gpu;
    CHECK(!lm_eval_run(root, &o, rg), "gpu: %s", lm_last_error());
    printf("    val loss cpu %.6f gpu %.6f\n", rc->val_loss, rg->val_loss);
    CHECK(fabs(rg->val_loss - rc->val_loss) <= 1e-2 * fabs(rc->val_loss), "val loss cpu %.6f gpu %.6f",
          rc->val_loss, rg->val_loss);
    for (int i = 0; i < o.n_lengths; i++) {
        for (int j = 0; j < o.n_depths; j++)
            CHECK(fabs(rg->passkey_digit_accuracy[i][j] - rc->passkey_digit_accuracy[i][j]) <= 0.151,
                  "passkey digits at length %d depth %g: cpu %.3f gpu %.3f", o.lengths[i], o.depths[j],
                  rc->passkey_digit_accuracy[i][j], rg->passkey_digit_accuracy[i][j]);
        for (int j = 0; j < o.n_queries; j++)
            CHECK(fabs(rg->mqar_accuracy[i][j] - rc->mqar_accuracy[i][j]) <= 0.251,
                  "mqar at length %d q=%d: cpu %.3f gpu %.3f", o.lengths[i], o.queries[j], rc->mqar_accuracy[i][j],
                  rg->mqar_accuracy[i][j]);
    }
    free(rc);
    free(rg);
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", root);
}

int main(void) {
    test_skip_without_cuda();
    if (!test_skip_all_reason && (lm_cuda_context_create(&ctx) || lm_backend_cuda_create(&gpu))) {
        fprintf(stderr, "no usable CUDA device: %s\n", lm_last_error());
        return 1;
    }
    RUN(test_score_op_matches_the_cpu_over_chunks_and_ties);
    RUN(test_model_scores_match_the_cpu);
    RUN(test_checkpoint_evaluates_on_the_gpu_like_the_cpu);
    lm_backend_free(gpu);
    if (!test_skip_all_reason) lm_cuda_context_destroy(&ctx);
    return test_summary();
}
