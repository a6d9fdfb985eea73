/* Sequence segments (train.seq_segment, docs/model.md "Sequence segments"):
 * the model run S tokens of every row at a time, the KDA layers carrying
 * their state and conv history from segment to segment, the attention layers
 * keeping the keys and values of every earlier token (MLA: its smaller
 * latent, up-projected again for each segment), the backward running
 * the segments in reverse. Against the same model on whole rows:
 *
 * - the loss to 1e-6 relative (the same tokens, each segment's cross-entropy
 *   summed in another order);
 * - every parameter gradient within 1e-5 of its tensor's largest value plus
 *   3e-6 of the model's largest gradient (test_model_cp.c's rule: the
 *   absolute term covers per-head sums with heavy cancellation, e.g. A_log,
 *   whose fp32 value moves with the summation order of the whole sequence);
 * - the QK-Clip maxima to 1e-5, the balancer's token count exactly (each token
 *   observed once: the backward's recomputation does not count), its bias
 *   after the step's update to 1e-3 (the quantile estimate is a step function
 *   of the scores: two near-equal scores that swap order under float rounding
 *   move it by their gap, 1e-4 here; S >= T: the same bits);
 * - S >= T is the unsegmented model, bit for bit.
 *
 * Configs: KDA + MLA (RoPE) or GQA, MoE with quantile balancing, a dense first
 * layer, Block AttnRes; B = 2 rows of T = 37 tokens with S = 8, 16 (neither
 * divides T) and S = 1; with and without recompute, with recompute_chunk. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/backend.h"
#include "longmoe/model.h"
#include "test.h"
#include "test_counting.h"

static lm_config seg_config(lm_attn_kind attn, int recompute, int chunk) {
    lm_config c;
    lm_config_defaults(&c);
    c.vocab_size = 29;
    c.d_model = 16;
    c.n_layers = 4;
    strcpy(c.layout, "kmkm");
    c.first_k_dense = 1;
    c.dense_ffn = 20;
    c.kda_heads = 2;
    c.kda_head_dim = 8;
    c.kda_chunk = 16;
    c.kda_conv_width = 4;
    c.attn_kind = attn;
    c.attn_heads = 4;
    c.attn_kv_heads = 2;
    c.q_lora_rank = 12;
    c.kv_lora_rank = 10;
    c.qk_head_dim = 8;
    c.v_head_dim = 6;
    c.rope_dims = 4;
    c.n_routed_experts = 4;
    c.top_k = 2;
    c.n_shared_experts = 1;
    c.expert_ffn = 8;
    c.shared_ffn = 8;
    c.latent_dim = 8;
    c.balance = LM_BALANCE_QUANTILE;
    c.residual = LM_RESIDUAL_BLOCK_ATTNRES;
    c.attnres_block = 3;
    c.recompute = recompute;
    c.recompute_chunk = chunk;
    return c;
}

static void random_tokens(lm_rng *r, int32_t *t, int n, int V) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)(lm_rng_u64(r) % (uint64_t)V);
}

/* |a - b| <= 1e-5 max |b_tensor| + 3e-6 max |b_all| for every tensor; the worst |a - b| / max |b_tensor| */
static double check_tensors(const lm_model *m, const float *a, const float *b, const char *what) {
    double gmax = 1e-30, worst = 0;
    for (size_t j = 0; j < lm_model_num_params(m); j++) gmax = fabs(b[j]) > gmax ? fabs(b[j]) : gmax;
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(m, i);
        double d = 0, s = 1e-30;
        for (size_t j = t->offset; j < t->offset + t->numel; j++) {
            double e = fabs((double)a[j] - b[j]);
            if (!isfinite(a[j])) e = INFINITY;
            d = e > d ? e : d;
            s = fabs(b[j]) > s ? fabs(b[j]) : s;
        }
        CHECK(d <= 1e-5 * s + 3e-6 * gmax, "%s: gradient of %s off by %.3g (its largest %.3g, the model's %.3g)", what,
              t->name, d, s, gmax);
        worst = d / s > worst ? d / s : worst;
    }
    return worst;
}

/* Two steps (forward, backward, the balancer's update, a plain gradient step)
 * of the whole-row model and the segmented one from the same weights. */
static void compare(lm_config c, int B, int T, int S, const char *what) {
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create(&c, B, T, &a), "%s", lm_last_error());
    c.seq_segment = S;
    CHECK(!lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    if (!a || !b) {
        lm_model_free(a);
        lm_model_free(b);
        return;
    }
    lm_model_init(a, 91);
    lm_model_init(b, 91);
    lm_rng r;
    lm_rng_seed(&r, 92);
    const int N = B * T, exact = S >= T;
    int32_t *tok = malloc((size_t)N * sizeof *tok), *tgt = malloc((size_t)N * sizeof *tgt);
    double worst = 0, worst_loss = 0;
    for (int step = 0; step < 2; step++) {
        random_tokens(&r, tok, N, c.vocab_size);
        random_tokens(&r, tgt, N, c.vocab_size);
        lm_model_zero_grads(a);
        lm_model_zero_grads(b);
        float la = 0, lb = 0;
        CHECK(!lm_model_forward(a, tok, tgt, 1, &la) && !lm_model_backward(a, 1.0f), "%s", lm_last_error());
        CHECK(!lm_model_forward(b, tok, tgt, 1, &lb) && !lm_model_backward(b, 1.0f), "%s: %s", what,
              lm_last_error());
        const double dl = fabs((double)la - lb) / fabs((double)la);
        worst_loss = dl > worst_loss ? dl : worst_loss;
        CHECK(dl <= 1e-6, "%s step %d: loss %.9g whole vs %.9g segmented", what, step, la, lb);
        const float *ga = lm_model_grads(a), *gb = lm_model_grads(b);
        if (exact) {
            CHECK(la == lb, "%s step %d: S >= T changed the loss (%.9g vs %.9g)", what, step, la, lb);
            CHECK(!memcmp(ga, gb, lm_model_num_params(a) * sizeof(float)), "%s step %d: S >= T changed a gradient",
                  what, step);
        } else {
            double w = check_tensors(a, gb, ga, what);
            worst = w > worst ? w : worst;
        }
        /* QK-Clip's maxima: the largest over the segments is the whole rows' */
        int nq = lm_model_qk_max_count(a);
        float *qa = malloc((size_t)nq * sizeof *qa), *qb = malloc((size_t)nq * sizeof *qb);
        lm_model_qk_max_get(a, qa);
        lm_model_qk_max_get(b, qb);
        for (int h = 0; h < nq; h++)
            CHECK(fabsf(qa[h] - qb[h]) <= 1e-5f * fmaxf(1.0f, fabsf(qa[h])), "%s step %d: QK-Clip maximum %d %.9g vs %.9g",
                  what, step, h, qa[h], qb[h]);
        free(qa);
        free(qb);
        for (int k = 0; k < lm_model_num_moe_layers(a); k++) {
            const lm_balance_state *ba = lm_model_balance(a, k), *bb = lm_model_balance(b, k);
            CHECK(ba->tokens == N && bb->tokens == N, "%s step %d: MoE layer %d observed %lld and %lld tokens, want %d",
                  what, step, k, (long long)ba->tokens, (long long)bb->tokens, N);
        }
        CHECK(!lm_model_balance_step_end(a, 1, NULL) && !lm_model_balance_step_end(b, 1, NULL), "%s", lm_last_error());
        for (int k = 0; k < lm_model_num_moe_layers(a); k++) {
            const lm_balance_state *ba = lm_model_balance(a, k), *bb = lm_model_balance(b, k);
            for (int e = 0; e < ba->cfg.n_experts; e++)
                CHECK(fabsf(ba->bias[e] - bb->bias[e]) <= (exact ? 0.0f : 1e-3f),
                      "%s step %d: balancing bias %d of MoE layer %d: %.9g vs %.9g", what, step, e, k, ba->bias[e],
                      bb->bias[e]);
        }
        float *pa = lm_model_params(a), *pb = lm_model_params(b);
        for (size_t j = 0; j < lm_model_num_params(a); j++) {
            pa[j] -= 0.05f * ga[j];
            pb[j] = pa[j];
        }
        CHECK(!lm_model_upload_params(a) && !lm_model_upload_params(b), "%s", lm_last_error());
        (void)lm_model_qk_clip(a, 0, NULL, NULL); /* resets the maxima */
        (void)lm_model_qk_clip(b, 0, NULL, NULL);
    }
    printf("    %s: B=%d T=%d S=%d: loss %.2e, worst gradient %.2e of its tensor's largest; buffers %zu -> %zu bytes\n",
           what, B, T, S, worst_loss, worst, lm_model_activation_bytes(a), lm_model_activation_bytes(b));
    free(tok);
    free(tgt);
    lm_model_free(a);
    lm_model_free(b);
}

static void test_segments_equal_whole_rows(void) {
    const int rc[3][2] = {{0, 0}, {1, 0}, {1, 5}}; /* recompute, recompute_chunk */
    for (int i = 0; i < 3; i++) {
        char what[96];
        snprintf(what, sizeof what, "MLA, recompute %d, chunk %d", rc[i][0], rc[i][1]);
        compare(seg_config(LM_ATTN_MLA, rc[i][0], rc[i][1]), 2, 37, 8, what);
        compare(seg_config(LM_ATTN_MLA, rc[i][0], rc[i][1]), 2, 37, 16, what);
        snprintf(what, sizeof what, "GQA, recompute %d, chunk %d", rc[i][0], rc[i][1]);
        compare(seg_config(LM_ATTN_GQA, rc[i][0], rc[i][1]), 2, 37, 8, what);
    }
    /* one kind recomputed (train.recompute "channel" with chunks, "token") */
    lm_config ch = seg_config(LM_ATTN_MLA, LM_RECOMPUTE_CHANNEL, 5);
    compare(ch, 2, 37, 8, "MLA, recompute channel, chunk 5");
    lm_config tk = seg_config(LM_ATTN_GQA, LM_RECOMPUTE_TOKEN, 0);
    compare(tk, 2, 37, 16, "GQA, recompute token");
    /* NoPE, the recipe's (and the GPU's) MLA: the keys up-projected straight into the product format */
    lm_config np = seg_config(LM_ATTN_MLA, 1, 0);
    np.rope_dims = 0;
    compare(np, 2, 37, 8, "MLA NoPE, recompute 1");
    /* one token a segment: shorter than the convolution's history */
    compare(seg_config(LM_ATTN_MLA, 1, 0), 2, 11, 1, "MLA, S = 1");
    compare(seg_config(LM_ATTN_GQA, 0, 0), 1, 9, 1, "GQA, S = 1");
    /* standard residual and full AttnRes run inside the segments too */
    lm_config c = seg_config(LM_ATTN_GQA, 1, 0);
    c.residual = LM_RESIDUAL_STANDARD;
    compare(c, 2, 23, 7, "standard residual");
    c = seg_config(LM_ATTN_MLA, 1, 0);
    c.residual = LM_RESIDUAL_FULL_ATTNRES;
    compare(c, 1, 30, 10, "full attnres, S divides T");
}

static void test_segment_at_least_t_is_off(void) {
    compare(seg_config(LM_ATTN_MLA, 1, 0), 2, 37, 37, "S = T");
    compare(seg_config(LM_ATTN_GQA, 0, 0), 2, 37, 64, "S > T");
}

/* Evaluation's scores in segments equal the whole rows' (to float rounding). */
static void test_segmented_scores(void) {
    lm_config c = seg_config(LM_ATTN_MLA, 1, 0);
    const int B = 2, T = 29, N = B * T;
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create(&c, B, T, &a), "%s", lm_last_error());
    c.seq_segment = 6;
    CHECK(!lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    if (!a || !b) {
        lm_model_free(a);
        lm_model_free(b);
        return;
    }
    lm_model_init(a, 5);
    lm_model_init(b, 5);
    lm_rng r;
    lm_rng_seed(&r, 6);
    int32_t tok[58], tgt[58], arga[58], argb[58];
    double na[58], nb[58];
    random_tokens(&r, tok, N, c.vocab_size);
    random_tokens(&r, tgt, N, c.vocab_size);
    CHECK(!lm_model_score(a, tok, tgt, na, arga) && !lm_model_score(b, tok, tgt, nb, argb), "%s", lm_last_error());
    int same_arg = 0;
    for (int i = 0; i < N; i++) {
        CHECK(fabs(na[i] - nb[i]) <= 1e-5 * fmax(1.0, fabs(na[i])), "score %d: %.9g whole vs %.9g segmented", i, na[i],
              nb[i]);
        same_arg += arga[i] == argb[i];
    }
    CHECK(same_arg >= N - 1, "argmax differs at %d of %d positions", N - same_arg, N);
    /* what a segmented model refuses, with a message */
    float logp[58];
    CHECK(lm_model_logits(b, tok, NULL) != LM_OK, "lm_model_logits ran with train.seq_segment");
    CHECK(lm_model_forward(b, tok, NULL, 0, NULL) != LM_OK, "a forward without targets ran with train.seq_segment");
    CHECK(lm_model_token_logprobs(b, logp) != LM_OK, "token log-probabilities with train.seq_segment");
    lm_model_free(a);
    lm_model_free(b);
}

/* The memory plan (lm_model_plan): with segments of S tokens nothing but the
 * carries and the attention's whole-row keys, values and their gradient sums
 * grows with T; the segment's buffers are those of a model of S tokens a row. */
static size_t ledger(const lm_model *m, const char *prefix, int segments) {
    size_t n = 0;
    for (int i = 0; i < lm_model_num_buffers(m); i++) {
        const lm_model_buffer *b = lm_model_buffer_at(m, i);
        const int seg = !strncmp(b->name, "segments:", 9);
        if ((!prefix || strstr(b->name, prefix)) && seg == segments) n += b->bytes;
    }
    return n;
}

static void test_plan_grows_only_by_the_carries(void) {
    lm_config c = seg_config(LM_ATTN_MLA, 1, 64);
    lm_model *whole = NULL, *a = NULL, *b = NULL, *one = NULL;
    CHECK(!lm_model_plan(&c, 1, 4096, LM_DEVICE_CPU, &whole), "%s", lm_last_error());
    CHECK(!lm_model_plan(&c, 1, 256, LM_DEVICE_CPU, &one), "%s", lm_last_error());
    c.seq_segment = 256;
    CHECK(!lm_model_plan(&c, 1, 4096, LM_DEVICE_CPU, &a), "%s", lm_last_error());
    CHECK(!lm_model_plan(&c, 1, 8192, LM_DEVICE_CPU, &b), "%s", lm_last_error());
    if (whole && one && a && b) {
        /* everything but the segments' lines and the KDA activations (W-1 history rows a row, a copy of
         * the operator's q, k, v: 23% more here): a model of 256 tokens */
        const char *same[] = {"hin:", "residual stream", "MoE routing", "attention activations", "dense FFN"};
        for (int i = 0; i < 5; i++)
            CHECK(ledger(a, same[i], 0) == ledger(one, same[i], 0) && ledger(b, same[i], 0) == ledger(a, same[i], 0),
                  "%s: %zu bytes at T = 4096 in segments, %zu at 8192, %zu for a model of 256 tokens", same[i],
                  ledger(a, same[i], 0), ledger(b, same[i], 0), ledger(one, same[i], 0));
        CHECK(ledger(a, "KDA activations", 0) > ledger(one, "KDA activations", 0) &&
                  ledger(a, "KDA activations", 0) < ledger(one, "KDA activations", 0) * 13 / 10,
              "KDA activations %zu in segments, %zu for 256 tokens (the conv history adds W-1 rows, the "
              "operator's q, k, v a copy)",
              ledger(a, "KDA activations", 0), ledger(one, "KDA activations", 0));
        /* the carries: 2x the tokens, 2x the MLA latent stores and sums (the latent, 10 + 4 values a token,
         * is smaller than the keys and values, 4 x (8 + 6)), about 2x the segment starts */
        CHECK(ledger(b, "MLA latent", 1) == 2 * ledger(a, "MLA latent", 1) && ledger(a, "MLA latent", 1) > 0,
              "latent stores %zu at 4096, %zu at 8192", ledger(a, "MLA latent", 1), ledger(b, "MLA latent", 1));
        CHECK(ledger(a, "attention K, V of the whole rows", 1) == 0, "MLA keeps its keys and values, not its latent");
        CHECK(ledger(a, "KDA states at 15 segment starts", 1) > 0 && ledger(b, "KDA states at 31 segment starts", 1) > 0,
              "the KDA states at the segment starts are not in the plan");
        size_t ta = ledger(a, NULL, 0) + ledger(a, NULL, 1), tw = ledger(whole, NULL, 0);
        CHECK(ta < tw / 2, "segmented plan %zu bytes, whole rows %zu", ta, tw);
        printf("    T = 4096: whole rows %.1f MiB, segments of 256 %.1f MiB (of which carries %.1f MiB)\n",
               tw / 1048576.0, ta / 1048576.0, ledger(a, NULL, 1) / 1048576.0);
    }
    lm_model_free(whole);
    lm_model_free(one);
    lm_model_free(a);
    lm_model_free(b);
    /* GQA has no latent: its keys and values */
    c = seg_config(LM_ATTN_GQA, 1, 64);
    c.seq_segment = 256;
    CHECK(!lm_model_plan(&c, 1, 4096, LM_DEVICE_CPU, &a), "%s", lm_last_error());
    if (a)
        CHECK(ledger(a, "attention K, V of the whole rows", 1) > 0 && ledger(a, "MLA latent", 1) == 0,
              "GQA's whole-row keys and values are not in the plan");
    lm_model_free(a);
}

/* The attention runs once a step: the forward keeps its output and
 * log-sum-exp (lm_mla_keep), and the backward's forwards (the segment's again,
 * and with recompute each layer's recomputation) reuse them. The backward
 * starts at the last segment without its forward again (the forward left its
 * activations in the buffers): the MoE forwards counted too. Counted through
 * a CPU backend whose attention forwards count their calls. (That the reused
 * rows are the right ones, test_segments_equal_whole_rows and, with recompute
 * on whole rows, test_model_chunk's bit-identical recompute show.) */
static void kept_case(lm_attn_kind attn, int recompute, int S) {
    lm_config c = seg_config(attn, recompute, 0);
    c.seq_segment = S;
    const int B = 2, T = 37, N = B * T, n_attn = 2, n_seg = S > 0 && S < T ? (T + S - 1) / S : 1;
    lm_ops ops;
    lm_backend cb;
    test_counting_backend(&cb, &ops);
    lm_model *m = NULL;
    CHECK(!lm_model_create_on(&c, B, T, &cb, &m), "%s", lm_last_error());
    if (!m) return;
    lm_model_init(m, 17);
    lm_rng r;
    lm_rng_seed(&r, 18);
    int32_t tok[74], tgt[74];
    random_tokens(&r, tok, N, c.vocab_size);
    random_tokens(&r, tgt, N, c.vocab_size);
    float l1 = 0;
    /* a segment's queries attend per row: B calls a layer and segment (whole rows: one a layer) */
    const int per_forward = n_attn * (n_seg > 1 ? n_seg * B : 1);
    lm_model_zero_grads(m);
    memset(&test_counts, 0, sizeof test_counts);
    CHECK(!lm_model_forward(m, tok, tgt, 1, &l1), "%s", lm_last_error());
    const int fwd = test_counts.attention, moe_fwd = test_counts.moe;
    CHECK(!lm_model_backward(m, 1.0f), "%s", lm_last_error());
    CHECK(fwd == per_forward && test_counts.attention == fwd, "S=%d recompute %d: %d attention calls in the forward, %d in the "
          "backward (want %d and none)", S, recompute, fwd, test_counts.attention - fwd, per_forward);
    /* the MoE layers (1, 2 and 3; layer 0 is dense): the backward runs every segment's forward again but the last's, which
     * the forward left in the buffers, and with recompute each segment's layers once more but the last MoE layer
     * (the shared set still holds its activations) */
    const int n_moe = 3, moe_bwd = n_moe * (n_seg > 1 ? n_seg - 1 : 0) + (recompute ? n_seg * (n_moe - 1) : 0);
    CHECK(moe_fwd == n_moe * n_seg && test_counts.moe - moe_fwd == moe_bwd, "S=%d recompute %d: %d MoE forwards in "
          "the forward, %d in the backward (want %d and %d)", S, recompute, moe_fwd, test_counts.moe - moe_fwd, n_moe * n_seg,
          moe_bwd);
    printf("    S=%d recompute %d: %d segments, attention %d calls, MoE forwards %d + %d in the backward\n", S,
           recompute, n_seg, fwd, moe_fwd, test_counts.moe - moe_fwd);
    lm_model_free(m);
}

static void test_attention_runs_once_a_step(void) {
    kept_case(LM_ATTN_MLA, 1, 8);  /* latent stores, recompute: three forwards a segment, one attention */
    kept_case(LM_ATTN_MLA, 0, 16);
    kept_case(LM_ATTN_GQA, 1, 8);  /* key and value stores */
    kept_case(LM_ATTN_MLA, 1, 0);  /* whole rows with recompute: the recomputation reuses it */
    kept_case(LM_ATTN_GQA, 0, 0);  /* whole rows without recompute: one forward, nothing kept */
}

/* Bad settings: a clear error. */
static void test_bad_settings(void) {
    lm_config c = seg_config(LM_ATTN_MLA, 1, 0);
    c.seq_segment = -4;
    CHECK(lm_config_validate(&c) != LM_OK && strstr(lm_last_error(), "seq_segment"), "negative seq_segment accepted");
    c = seg_config(LM_ATTN_MLA, 1, 0);
    c.seq_segment = 8;
    c.balance = LM_BALANCE_AUX;
    CHECK(lm_config_validate(&c) != LM_OK && strstr(lm_last_error(), "seq_segment"),
          "seq_segment with the auxiliary balance loss accepted");
    const char *json = "{\"train\": {\"seq_segment\": -1}}";
    lm_config e;
    lm_config_defaults(&e);
    CHECK(lm_config_parse(json, strlen(json), "test", &e) != LM_OK, "train.seq_segment = -1 parsed");
    const char *ok = "{\"train\": {\"seq_segment\": 4096}}";
    lm_config_defaults(&e);
    CHECK(lm_config_parse(ok, strlen(ok), "test", &e) == LM_OK && e.seq_segment == 4096, "train.seq_segment = 4096: %s",
          lm_last_error());
}

int main(void) {
    RUN(test_segments_equal_whole_rows);
    RUN(test_segment_at_least_t_is_off);
    RUN(test_segmented_scores);
    RUN(test_attention_runs_once_a_step);
    RUN(test_plan_grows_only_by_the_carries);
    RUN(test_bad_settings);
    return test_summary();
}
