/* Long-context memory: the memory plan (lm_model_plan, lm_model_buffer_at)
 * and train.recompute_chunk (the dense FFN and MoE in token chunks, the
 * sublayer inputs recomputed from the residual state), docs/model.md "Memory". */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/backend.h"
#include "longmoe/kda_layer.h"
#include "longmoe/model.h"
#include "test.h"
#include "test_counting.h"
#include "test_models.h"

/* MoE (latent, shared expert, quantile balancing) + KDA + MLA + Block AttnRes
 * of 3 sublayers, a dense first layer; small enough for the CPU */
static lm_config chunk_config(void) {
    lm_config c = test_micro_config();
    c.d_model = 32;
    c.n_layers = 4;
    strcpy(c.layout, "kmkm");
    c.first_k_dense = 1;
    c.dense_ffn = 40;
    c.kda_heads = 2;
    c.kda_head_dim = 16;
    c.kda_chunk = 16;
    c.attn_heads = 2;
    c.q_lora_rank = 16;
    c.kv_lora_rank = 16;
    c.qk_head_dim = 16;
    c.v_head_dim = 16;
    c.n_routed_experts = 8;
    c.top_k = 2;
    c.n_shared_experts = 1;
    c.expert_ffn = 12;
    c.shared_ffn = 20;
    c.latent_dim = 16;
    c.balance = LM_BALANCE_QUANTILE;
    c.residual = LM_RESIDUAL_BLOCK_ATTNRES;
    c.attnres_block = 3;
    c.recompute = 1;
    return c;
}

static void random_tokens(lm_rng *r, int32_t *t, int n, int V) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)(lm_rng_u64(r) % (uint64_t)V);
}

/* relative L2 error of tensor i between two gradient blocks */
static double tensor_rel_error(const lm_model *m, const float *a, const float *b, int i) {
    const lm_model_tensor *t = lm_model_tensor_at(m, i);
    double num = 0, den = 0;
    for (size_t j = 0; j < t->numel; j++) {
        double x = a[t->offset + j], y = b[t->offset + j];
        num += (x - y) * (x - y);
        den += y * y;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Two forward+backward steps (with the balancing update between them) of the
 * unchunked and the chunked model from the same weights: the losses are the
 * same bits (the forward computes each token as before), the balancing
 * biases too (the counts add up over chunks), and every gradient agrees to
 * float rounding (weight gradients add chunk by chunk; the sublayer inputs are
 * recomputed from the residual state's saved scores). */
static void compare_chunked(lm_config c, int B, int T, int chunk, const char *what) {
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create(&c, B, T, &a), "%s", lm_last_error());
    c.recompute_chunk = chunk;
    CHECK(!lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    if (!a || !b) {
        lm_model_free(a);
        lm_model_free(b);
        return;
    }
    lm_model_init(a, 71);
    lm_model_init(b, 71);
    lm_rng r;
    lm_rng_seed(&r, 72);
    int N = B * T;
    int32_t *tok = malloc((size_t)N * sizeof *tok), *tgt = malloc((size_t)N * sizeof *tgt);
    double worst = 0;
    for (int step = 0; step < 2; step++) {
        random_tokens(&r, tok, N, c.vocab_size);
        random_tokens(&r, tgt, N, c.vocab_size);
        lm_model_zero_grads(a);
        lm_model_zero_grads(b);
        float la = 0, lb = 0;
        CHECK(!lm_model_forward(a, tok, tgt, 1, &la) && !lm_model_backward(a, 1.0f), "%s", lm_last_error());
        CHECK(!lm_model_forward(b, tok, tgt, 1, &lb) && !lm_model_backward(b, 1.0f), "%s", lm_last_error());
        CHECK(la == lb, "%s step %d: loss %.9g unchunked vs %.9g chunked", what, step, la, lb);
        const float *ga = lm_model_grads(a), *gb = lm_model_grads(b);
        for (int i = 0; i < lm_model_num_tensors(a); i++) {
            double e = tensor_rel_error(a, gb, ga, i);
            worst = e > worst ? e : worst;
            CHECK(e < 2e-5, "%s step %d: %s gradient differs by %.3g (relative L2)", what, step,
                  lm_model_tensor_at(a, i)->name, e);
        }
        for (int k = 0; k < lm_model_num_moe_layers(a); k++) {
            const lm_balance_state *ba = lm_model_balance(a, k), *bb = lm_model_balance(b, k);
            CHECK(!memcmp(ba->bias, bb->bias, (size_t)ba->cfg.n_experts * sizeof(float)),
                  "%s step %d: balancing bias of MoE layer %d differs", what, step, k);
        }
        CHECK(!lm_model_balance_step_end(a, 1, NULL) && !lm_model_balance_step_end(b, 1, NULL), "%s",
              lm_last_error());
        /* one identical optimizer-free update so the second step sees moved weights */
        float *pa = lm_model_params(a), *pb = lm_model_params(b);
        for (size_t j = 0; j < lm_model_num_params(a); j++) {
            pa[j] -= 0.05f * ga[j];
            pb[j] = pa[j];
        }
        CHECK(!lm_model_upload_params(a) && !lm_model_upload_params(b), "%s", lm_last_error());
    }
    for (int k = 0; k < lm_model_num_moe_layers(a); k++) {
        const lm_balance_state *ba = lm_model_balance(a, k), *bb = lm_model_balance(b, k);
        CHECK(!memcmp(ba->bias, bb->bias, (size_t)ba->cfg.n_experts * sizeof(float)),
              "%s: balancing bias of MoE layer %d differs after the update", what, k);
    }
    printf("    %s: B=%d T=%d chunk %d: worst gradient relative error %.2e, activations %zu -> %zu bytes\n", what, B,
           T, chunk, worst, lm_model_activation_bytes(a), lm_model_activation_bytes(b));
    CHECK(lm_model_activation_bytes(b) < lm_model_activation_bytes(a), "%s: chunking did not save memory", what);
    free(tok);
    free(tgt);
    lm_model_free(a);
    lm_model_free(b);
}

static void test_chunked_equals_unchunked(void) {
    /* odd T, a chunk that divides neither T nor B*T, and one larger than a sequence */
    compare_chunked(chunk_config(), 2, 37, 10, "block attnres");
    compare_chunked(chunk_config(), 1, 53, 64, "chunk > N");
    lm_config c = chunk_config();
    c.residual = LM_RESIDUAL_FULL_ATTNRES;
    compare_chunked(c, 2, 29, 7, "full attnres");
    c = chunk_config();
    c.residual = LM_RESIDUAL_STANDARD; /* the inputs are kept: only the chunks change */
    compare_chunked(c, 3, 19, 8, "standard residual");
    c = chunk_config();
    c.latent_dim = 0;
    c.n_shared_experts = 0;
    c.activation = LM_ACT_SITU;
    compare_chunked(c, 2, 31, 9, "plain MoE, SiTU");
}

/* Without recompute_chunk the CPU computes what it computed before: with
 * recompute (one normalised input, recomputed) the gradients are the same
 * bits as without recompute. */
static void test_recompute_without_chunks_is_bit_identical(void) {
    lm_config c = chunk_config();
    c.recompute = 0;
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create(&c, 2, 23, &a), "%s", lm_last_error());
    c.recompute = 1;
    CHECK(!lm_model_create(&c, 2, 23, &b), "%s", lm_last_error());
    if (!a || !b) return;
    lm_model_init(a, 5);
    lm_model_init(b, 5);
    lm_rng r;
    lm_rng_seed(&r, 6);
    int32_t tok[46], tgt[46];
    random_tokens(&r, tok, 46, c.vocab_size);
    random_tokens(&r, tgt, 46, c.vocab_size);
    float la, lb;
    CHECK(!lm_model_forward(a, tok, tgt, 1, &la) && !lm_model_backward(a, 1.0f), "%s", lm_last_error());
    CHECK(!lm_model_forward(b, tok, tgt, 1, &lb) && !lm_model_backward(b, 1.0f), "%s", lm_last_error());
    CHECK(la == lb, "loss %g vs %g", la, lb);
    CHECK(!memcmp(lm_model_grads(a), lm_model_grads(b), lm_model_num_params(a) * sizeof(float)),
          "gradients differ with recompute");
    lm_model_free(a);
    lm_model_free(b);
}

/* train.recompute = "channel" or "token": only the MoE and dense FFN, or only the KDA and
 * attention sublayers, are recomputed. Counted through a CPU backend whose MoE, KDA and attention
 * forwards count their calls: a step runs each kind's forward once, the recomputed kind's twice
 * but for its last layer (the shared set still holds the forward's);
 * the loss and every gradient are the bits of the run without recompute (and of the full
 * recompute) over two steps with the balancing update between them; the plan shares the
 * recomputed kind's activations (one set) and keeps the other's per layer; with recompute_chunk
 * the channel mode equals the full recompute with chunks to the same bits. */
static void selective_steps(int recompute, int chunk, float *loss, float *grads, int counts[3]) {
    lm_config c = chunk_config();
    c.recompute = recompute;
    c.recompute_chunk = chunk;
    lm_ops ops;
    lm_backend cb;
    test_counting_backend(&cb, &ops);
    lm_model *m = NULL;
    CHECK(!lm_model_create_on(&c, 2, 23, &cb, &m), "recompute %s: %s", lm_recompute_name(recompute), lm_last_error());
    if (!m) return;
    lm_model_init(m, 5);
    lm_rng r;
    lm_rng_seed(&r, 6);
    int32_t tok[46], tgt[46];
    const size_t P = lm_model_num_params(m);
    for (int step = 0; step < 2; step++) {
        random_tokens(&r, tok, 46, c.vocab_size);
        random_tokens(&r, tgt, 46, c.vocab_size);
        lm_model_zero_grads(m);
        memset(&test_counts, 0, sizeof test_counts);
        CHECK(!lm_model_forward(m, tok, tgt, 1, &loss[step]) && !lm_model_backward(m, 1.0f), "%s", lm_last_error());
        if (step == 0) counts[0] = test_counts.moe, counts[1] = test_counts.kda, counts[2] = test_counts.attention;
        memcpy(grads + step * P, lm_model_grads(m), P * sizeof(float));
        CHECK(!lm_model_balance_step_end(m, 1, NULL), "%s", lm_last_error());
        float *p = lm_model_params(m);
        for (size_t j = 0; j < P; j++) p[j] -= 0.05f * grads[step * P + j];
        CHECK(!lm_model_upload_params(m), "%s", lm_last_error());
    }
    lm_model_free(m);
}

static void test_selective_recompute_repeats_one_kind_with_the_same_bits(void) {
    lm_config c = chunk_config();
    lm_model *probe = NULL;
    CHECK(!lm_model_create(&c, 2, 23, &probe), "%s", lm_last_error());
    if (!probe) return;
    const size_t P = lm_model_num_params(probe);
    lm_model_free(probe);
    /* 4 layers "kmkm", the first dense: 3 MoE sublayers, 2 KDA layers (the operator's forward each), 2 MLA */
    const int n_moe = 3, n_kda = 2, n_attn = 2;
    const int modes[4] = {LM_RECOMPUTE_NONE, LM_RECOMPUTE_ALL, LM_RECOMPUTE_CHANNEL, LM_RECOMPUTE_TOKEN};
    float loss[4][2], *g[4];
    int counts[4][3];
    for (int i = 0; i < 4; i++) {
        g[i] = calloc(2 * P, sizeof(float));
        selective_steps(modes[i], 0, loss[i], g[i], counts[i]);
    }
    for (int i = 0; i < 4; i++) {
        const int ch = lm_recompute_sublayer(modes[i], 1), tk = lm_recompute_sublayer(modes[i], 0);
        /* the KDA operator also runs its forward inside the layer's backward (intermediates it does not keep on
         * the CPU): the token mode adds the recomputation's, the others do not */
        /* the recomputed kind's last layer keeps the forward's activations (its shared set still holds them) */
        const int want_moe = n_moe * (1 + ch) - ch, want_attn = n_attn;
        CHECK(counts[i][0] == want_moe, "recompute %s: %d MoE forwards a step, want %d", lm_recompute_name(modes[i]),
              counts[i][0], want_moe);
        CHECK(counts[i][2] == want_attn, "recompute %s: %d attention forwards a step, want %d (kept output)",
              lm_recompute_name(modes[i]), counts[i][2], want_attn);
        CHECK(counts[i][1] == counts[0][1] + (tk ? n_kda - 1 : 0), "recompute %s: %d KDA operator forwards, "
              "without recompute %d, want %d more", lm_recompute_name(modes[i]), counts[i][1], counts[0][1],
              tk ? n_kda - 1 : 0);
        CHECK(!memcmp(loss[i], loss[0], sizeof loss[0]) && !memcmp(g[i], g[0], 2 * P * sizeof(float)),
              "recompute %s: the losses or gradients differ from the run without recompute",
              lm_recompute_name(modes[i]));
        printf("    recompute %-7s: MoE %d, KDA operator %d, attention %d forwards a step; the same bits\n",
               lm_recompute_name(modes[i]), counts[i][0], counts[i][1], counts[i][2]);
    }
    /* with recompute_chunk (Block AttnRes replays each block: every sublayer of it runs again, the attention
     * from its kept output): channel and all both agree with the unchunked run to float rounding */
    float lc[2][2], *gc[2];
    int cc[2][3];
    lm_model *tm = NULL;
    CHECK(!lm_model_create(&c, 2, 23, &tm), "%s", lm_last_error());
    for (int i = 0; i < 2; i++) {
        gc[i] = calloc(2 * P, sizeof(float));
        selective_steps(i ? LM_RECOMPUTE_CHANNEL : LM_RECOMPUTE_ALL, 7, lc[i], gc[i], cc[i]);
        double worst = 0;
        for (int step = 0; step < 2 && tm; step++)
            for (int t = 0; t < lm_model_num_tensors(tm); t++) {
                double e = tensor_rel_error(tm, gc[i] + step * P, g[0] + step * P, t);
                worst = e > worst ? e : worst;
            }
        CHECK(!memcmp(lc[i], loss[0], sizeof lc[i]), "chunks, recompute %s: losses %g, %g vs %g, %g",
              i ? "channel" : "true", lc[i][0], lc[i][1], loss[0][0], loss[0][1]);
        CHECK(worst < 2e-5, "chunks, recompute %s: a gradient off the unchunked run's by %.3g (relative L2)",
              i ? "channel" : "true", worst);
        CHECK(cc[i][2] == n_attn, "chunks, recompute %s: %d attention forwards a step", i ? "channel" : "true",
              cc[i][2]);
        printf("    recompute_chunk 7, recompute %-7s: MoE %d, KDA operator %d, attention %d forwards a step; "
               "gradients within %.2e of the unchunked run\n", i ? "channel" : "true", cc[i][0], cc[i][1], cc[i][2],
               worst);
    }
    lm_model_free(tm);
    for (int i = 0; i < 4; i++) free(g[i]);
    for (int i = 0; i < 2; i++) free(gc[i]);
}

/* The plans of the four modes on a GPU (lm_model_plan, no GPU needed), at a shape where the MoE
 * dominates: the recomputed kind's activations are one set, the other kind's one per layer; the
 * normalised inputs one shared slot plus one per sublayer not recomputed (the product-format copies
 * for every sublayer, the fp32 ones for the MoE's router only); channel < none, token < none, all
 * the least. */
static size_t plan_bytes(const lm_model *m, const char *has) {
    size_t n = 0;
    for (int i = 0; i < lm_model_num_buffers(m); i++) {
        const lm_model_buffer *b = lm_model_buffer_at(m, i);
        if (!has || strstr(b->name, has)) n += b->bytes;
    }
    return n;
}

static void selective_plans(lm_device dev) {
    lm_config c = chunk_config();
    c.n_layers = 6;
    strcpy(c.layout, "kkmkkm");
    const int B = 2, T = 256, N = B * T, d = c.d_model, gpu = dev == LM_DEVICE_CUDA;
    size_t total[4], moe_sets[4], kda[4], xn_lp[4], xn32[4];
    const int modes[4] = {LM_RECOMPUTE_NONE, LM_RECOMPUTE_ALL, LM_RECOMPUTE_CHANNEL, LM_RECOMPUTE_TOKEN};
    for (int i = 0; i < 4; i++) {
        c.recompute = modes[i];
        lm_model *m = NULL;
        CHECK(!lm_model_plan(&c, B, T, dev, &m), "%s", lm_last_error());
        if (!m) return;
        total[i] = plan_bytes(m, NULL);
        moe_sets[i] = 0;
        for (int k = 0; k < lm_model_num_buffers(m); k++)
            moe_sets[i] += strstr(lm_model_buffer_at(m, k)->name, "MoE routing and expert activations") != NULL;
        kda[i] = plan_bytes(m, "KDA activations");
        xn_lp[i] = plan_bytes(m, "xn, product format");
        xn32[i] = plan_bytes(m, "xn: ");
        lm_model_free(m);
    }
    const char *on = gpu ? "cuda" : "cpu";
    /* 6 layers, the first dense: 5 MoE layers; 4 KDA layers */
    CHECK(moe_sets[0] == 5 && moe_sets[1] == 1 && moe_sets[2] == 1 && moe_sets[3] == 5, "%s: MoE activation sets: %zu "
          "%zu %zu %zu (none, all, channel, token)", on, moe_sets[0], moe_sets[1], moe_sets[2], moe_sets[3]);
    CHECK(kda[2] == kda[0] && kda[3] == kda[1] && kda[3] * 4 == kda[0], "%s: KDA activations %zu %zu %zu %zu", on,
          kda[0], kda[1], kda[2], kda[3]);
    const size_t row = (size_t)N * d * 2, row32 = (size_t)N * d * 4;
    if (gpu) {
        /* product-format inputs (bf16): 12 sublayers without, 1 with all, 1 + 6 kept with either mode */
        CHECK(xn_lp[0] == 12 * row && xn_lp[1] == row && xn_lp[2] == 7 * row && xn_lp[3] == 7 * row,
              "cuda: product-format xn: %zu %zu %zu %zu bytes, rows of %zu", xn_lp[0], xn_lp[1], xn_lp[2], xn_lp[3],
              row);
        /* fp32 inputs, the MoE router's: 5 without, 1 shared with all and channel, 5 own with token */
        CHECK(xn32[0] >= 5 * row32 && xn32[0] < 6 * row32 && xn32[1] < 2 * row32 && xn32[2] < 2 * row32 &&
                  xn32[3] == xn32[0],
              "cuda: fp32 xn: %zu %zu %zu %zu bytes, rows of %zu", xn32[0], xn32[1], xn32[2], xn32[3], row32);
    } else {
        /* the CPU's product format is the fp32 input itself: 12, 1, 1 + 6, 1 + 6 rows */
        CHECK(xn_lp[0] == 0 && xn32[0] == 12 * row32 && xn32[1] == row32 && xn32[2] == 7 * row32 &&
                  xn32[3] == 7 * row32,
              "cpu: xn: %zu %zu %zu %zu bytes, rows of %zu", xn32[0], xn32[1], xn32[2], xn32[3], row32);
    }
    CHECK(total[1] < total[2] && total[2] < total[0] && total[3] < total[0], "%s: plans %zu %zu %zu %zu bytes (none, "
          "all, channel, token)", on, total[0], total[1], total[2], total[3]);
    printf("    plans on %s, %d x %d: none %.2f, all %.2f, channel %.2f, token %.2f MiB\n", on, B, T,
           total[0] / 1048576.0, total[1] / 1048576.0, total[2] / 1048576.0, total[3] / 1048576.0);
}

static void test_selective_recompute_plans(void) {
    selective_plans(LM_DEVICE_CPU);
    if (lm_backend_cuda_ops()) selective_plans(LM_DEVICE_CUDA);
    else printf("  skipped: the GPU plans (this build has no CUDA kernels)\n");
    lm_config c;
    const int modes[4] = {LM_RECOMPUTE_NONE, LM_RECOMPUTE_ALL, LM_RECOMPUTE_CHANNEL, LM_RECOMPUTE_TOKEN};
    /* the config: the names read and write back; recompute_chunk needs the channel mixers recomputed */
    const char *names[4] = {"false", "true", "\"channel\"", "\"token\""};
    for (int i = 0; i < 4; i++) {
        char json[96];
        snprintf(json, sizeof json, "{\"train\": {\"recompute\": %s}}", names[i]);
        lm_config e;
        lm_config_defaults(&e);
        CHECK(!lm_config_parse(json, strlen(json), "test", &e) && e.recompute == modes[i], "%s: %s", json,
              lm_last_error());
        char *back = lm_config_to_json(&e);
        lm_config f;
        CHECK(back && !lm_config_parse(back, strlen(back), "round trip", &f) && f.recompute == modes[i],
              "recompute %s does not survive config.json", names[i]);
        free(back);
    }
    const char *bad = "{\"train\": {\"recompute\": \"moe\"}}";
    lm_config e;
    lm_config_defaults(&e);
    CHECK(lm_config_parse(bad, strlen(bad), "test", &e) == LM_ERR_ARG && strstr(lm_last_error(), "train.recompute") &&
              strstr(lm_last_error(), "channel"),
          "recompute \"moe\": %s", lm_last_error());
    c = chunk_config();
    c.recompute = LM_RECOMPUTE_TOKEN;
    c.recompute_chunk = 16;
    CHECK(lm_config_validate(&c) == LM_ERR_ARG && strstr(lm_last_error(), "channel"),
          "recompute_chunk with the token mixers alone recomputed: %s", lm_last_error());
    c.recompute = LM_RECOMPUTE_CHANNEL;
    CHECK(lm_config_validate(&c) == LM_OK, "recompute_chunk with channel: %s", lm_last_error());
}

/* lm_model_set_expert_grads_written (on by default on a GPU, here turned on for the CPU): the
 * zeroing leaves the routed experts' weight gradients out, the first backward writes them. With NaN
 * there after the zeroing, over token chunks (several MoE backward calls a layer), sequence
 * segments and two micro-batches (the second adds), with an evaluation forward between the zeroing
 * and the step, the gradients are the bits of the model that zeroes them. */
static void expert_grads_case(lm_config c, int B, int T, const char *what) {
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create(&c, B, T, &a) && !lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    if (!a || !b) {
        lm_model_free(a);
        lm_model_free(b);
        return;
    }
    CHECK(!lm_model_expert_grads_written(a), "%s: on by default on the CPU", what);
    CHECK(!lm_model_set_expert_grads_written(b, 1) && lm_model_expert_grads_written(b), "%s", lm_last_error());
    lm_model_init(a, 31);
    lm_model_init(b, 31);
    lm_rng r;
    lm_rng_seed(&r, 32);
    const int N = B * T;
    int32_t *tok = malloc((size_t)N * sizeof *tok), *tgt = malloc((size_t)N * sizeof *tgt);
    size_t poisoned = 0;
    for (int step = 0; step < 2; step++) {
        lm_model_zero_grads(a);
        lm_model_zero_grads(b);
        /* what a zeroing left out holds anything: NaN */
        for (int i = 0; i < lm_model_num_tensors(b); i++) {
            const lm_model_tensor *t = lm_model_tensor_at(b, i);
            const char *dot = strstr(t->name, ".moe.");
            if (!dot || (strcmp(dot, ".moe.gate") && strcmp(dot, ".moe.up") && strcmp(dot, ".moe.down"))) continue;
            for (size_t j = 0; j < t->numel; j++) lm_model_grads(b)[t->offset + j] = NAN;
            poisoned += t->numel;
        }
        if (step == 1 && !c.seq_segment) {
            /* an evaluation forward between the zeroing and the step */
            random_tokens(&r, tok, N, c.vocab_size);
            float e = 0;
            CHECK(!lm_model_forward(a, tok, tok, 0, &e) && !lm_model_forward(b, tok, tok, 0, &e), "%s",
                  lm_last_error());
        }
        for (int micro = 0; micro < 2; micro++) {
            random_tokens(&r, tok, N, c.vocab_size);
            random_tokens(&r, tgt, N, c.vocab_size);
            float la = 0, lb = 0;
            CHECK(!lm_model_forward(a, tok, tgt, 1, &la) && !lm_model_backward(a, 0.5f), "%s", lm_last_error());
            CHECK(!lm_model_forward(b, tok, tgt, 1, &lb) && !lm_model_backward(b, 0.5f), "%s", lm_last_error());
            CHECK(la == lb, "%s step %d: loss %.9g vs %.9g", what, step, la, lb);
        }
        CHECK(!memcmp(lm_model_grads(a), lm_model_grads(b), lm_model_num_grads(a) * sizeof(float)),
              "%s step %d: the gradients differ from the zeroing model's", what, step);
        CHECK(!lm_model_balance_step_end(a, 1, NULL) && !lm_model_balance_step_end(b, 1, NULL), "%s",
              lm_last_error());
        float *pa = lm_model_params(a), *pb = lm_model_params(b);
        for (size_t j = 0; j < lm_model_num_params(a); j++) pa[j] = pb[j] -= 0.05f * lm_model_grads(b)[j];
        CHECK(!lm_model_upload_params(a) && !lm_model_upload_params(b), "%s", lm_last_error());
    }
    CHECK(poisoned > 0, "%s: no routed expert gradients found", what);
    /* off again: what is still left out is zeroed at once */
    lm_model_zero_grads(b);
    CHECK(!lm_model_set_expert_grads_written(b, 0), "%s", lm_last_error());
    size_t nonzero = 0;
    for (size_t j = 0; j < lm_model_num_grads(b); j++) nonzero += lm_model_grads(b)[j] != 0.0f;
    CHECK(nonzero == 0, "%s: %zu gradients not zero after the zeroing and turning it off", what, nonzero);
    free(tok);
    free(tgt);
    lm_model_free(a);
    lm_model_free(b);
}

static void test_expert_grads_written_by_the_backward_are_the_same_bits(void) {
    lm_config c = chunk_config();
    c.recompute_chunk = 9; /* several MoE backward calls a layer */
    expert_grads_case(c, 2, 23, "chunks");
    c = chunk_config();
    c.recompute = 0;
    c.latent_dim = 0;
    c.n_shared_experts = 0;
    expert_grads_case(c, 1, 31, "plain MoE");
    c = chunk_config();
    c.seq_segment = 16; /* every segment's backward, last to first */
    expert_grads_case(c, 1, 40, "segments");
}

static size_t ledger_total(const lm_model *m) {
    size_t s = 0;
    for (int i = 0; i < lm_model_num_buffers(m); i++) s += lm_model_buffer_at(m, i)->bytes;
    return s;
}

/* bytes of the ledger's entries whose name contains `key` */
static size_t ledger_bytes(const lm_model *m, const char *key) {
    size_t s = 0;
    for (int i = 0; i < lm_model_num_buffers(m); i++)
        if (strstr(lm_model_buffer_at(m, i)->name, key)) s += lm_model_buffer_at(m, i)->bytes;
    return s;
}

/* The plan without memory is the ledger of the model that allocates: the
 * same names and bytes; its activation entries add up to the block the model
 * allocated. */
static void test_plan_is_the_models_ledger(void) {
    for (int chunk = 0; chunk <= 16; chunk += 16) {
        lm_config c = chunk_config();
        c.recompute_chunk = chunk;
        lm_model *m = NULL, *p = NULL;
        CHECK(!lm_model_create(&c, 2, 37, &m), "%s", lm_last_error());
        CHECK(!lm_model_plan(&c, 2, 37, LM_DEVICE_CPU, &p), "%s", lm_last_error());
        if (!m || !p) return;
        CHECK(lm_model_num_buffers(m) == lm_model_num_buffers(p) && lm_model_num_buffers(m) > 10, "%d vs %d buffers",
              lm_model_num_buffers(m), lm_model_num_buffers(p));
        for (int i = 0; i < lm_model_num_buffers(m) && i < lm_model_num_buffers(p); i++) {
            const lm_model_buffer *x = lm_model_buffer_at(m, i), *y = lm_model_buffer_at(p, i);
            CHECK(!strcmp(x->name, y->name) && x->bytes == y->bytes, "buffer %d: %s %zu vs %s %zu", i, x->name,
                  x->bytes, y->name, y->bytes);
        }
        /* the activation block: from hin to the operator workspace */
        size_t act = 0;
        int in = 0;
        for (int i = 0; i < lm_model_num_buffers(m); i++) {
            const lm_model_buffer *b = lm_model_buffer_at(m, i);
            in |= !strncmp(b->name, "hin:", 4);
            if (in) act += b->bytes;
            if (!strcmp(b->name, "KDA / attention operator workspace")) in = 0;
        }
        CHECK(act == lm_model_activation_bytes(m), "chunk %d: ledger's activations %zu, the model's block %zu", chunk,
              act, lm_model_activation_bytes(m));
        CHECK(ledger_bytes(m, "parameters (fp32)") == lm_model_num_params(m) * sizeof(float), "parameters");
        float loss;
        int32_t tok[74] = {0};
        CHECK(lm_model_forward(p, tok, tok, 1, &loss) == LM_ERR_ARG, "a plan ran a forward");
        lm_model_free(m);
        lm_model_free(p);
    }
}

/* What grows with T: with recompute_chunk the MoE and dense FFN buffers stay
 * at the chunk's size and the per-sublayer inputs are gone. */
static void test_chunk_bounds_the_per_token_sublayers(void) {
    lm_config c = chunk_config();
    lm_model *a = NULL, *b = NULL, *b2 = NULL;
    CHECK(!lm_model_plan(&c, 1, 4096, LM_DEVICE_CPU, &a), "%s", lm_last_error());
    c.recompute_chunk = 256;
    CHECK(!lm_model_plan(&c, 1, 4096, LM_DEVICE_CPU, &b), "%s", lm_last_error());
    CHECK(!lm_model_plan(&c, 1, 8192, LM_DEVICE_CPU, &b2), "%s", lm_last_error());
    if (!a || !b || !b2) return;
    CHECK(ledger_bytes(b, "MoE routing") == ledger_bytes(b2, "MoE routing") && ledger_bytes(b, "MoE routing") > 0,
          "MoE buffers grow with T under recompute_chunk: %zu vs %zu", ledger_bytes(b, "MoE routing"),
          ledger_bytes(b2, "MoE routing"));
    CHECK(ledger_bytes(b, "dense FFN") == ledger_bytes(b2, "dense FFN"), "dense FFN buffers grow with T");
    CHECK(ledger_bytes(a, "MoE routing") > 8 * ledger_bytes(b, "MoE routing"), "MoE %zu vs %zu",
          ledger_bytes(a, "MoE routing"), ledger_bytes(b, "MoE routing"));
    CHECK(ledger_bytes(a, "hin:") == (size_t)c.n_layers * 2 * ledger_bytes(b, "hin:"), "hin %zu vs %zu",
          ledger_bytes(a, "hin:"), ledger_bytes(b, "hin:"));
    CHECK(ledger_total(b) < ledger_total(a), "total %zu vs %zu", ledger_total(b), ledger_total(a));
    /* Block AttnRes keeps one block's partial sums (S - 1 = 2 of them) and replays the blocks */
    size_t pa = ledger_bytes(a, "partial block sums, 5 x [N,d]"),
           pb = ledger_bytes(b, "partial block sums, 2 x [N,d] (one block's, replayed)");
    CHECK(pa > 0 && pb > 0 && pb < pa, "saved partial sums: %zu bytes kept for all, %zu with replay", pa, pb);
    lm_model_free(a);
    lm_model_free(b);
    lm_model_free(b2);
    /* the GPU's plan needs no GPU (a build with CUDA) */
    lm_model *g = NULL;
    if (lm_backend_cuda_ops()) {
        CHECK(!lm_model_plan(&c, 1, 4096, LM_DEVICE_CUDA, &g), "%s", lm_last_error());
        if (g) CHECK(ledger_bytes(g, "product format") > 0, "the GPU plan has no product-format buffers");
        /* the KDA operator's intermediates kept for the backward: one buffer a KDA layer (3 in the
         * small hybrid) without recompute, one the layers share with it, none with segments */
        lm_config h = test_small_hybrid_config();
        lm_model *k0 = NULL, *k1 = NULL, *k2 = NULL;
        CHECK(!lm_model_plan(&h, 2, 256, LM_DEVICE_CUDA, &k0), "%s", lm_last_error());
        h.recompute = 1;
        CHECK(!lm_model_plan(&h, 2, 256, LM_DEVICE_CUDA, &k1), "%s", lm_last_error());
        h.recompute = 0;
        h.seq_segment = 128;
        CHECK(!lm_model_plan(&h, 2, 256, LM_DEVICE_CUDA, &k2), "%s", lm_last_error());
        if (k0 && k1 && k2) {
            size_t one = ledger_bytes(k1, "KDA operator intermediates for the backward (shared");
            CHECK(one > 0 && ledger_bytes(k0, "KDA operator intermediates") == 3 * one,
                  "kept KDA intermediates: %zu bytes without recompute, %zu shared with it",
                  ledger_bytes(k0, "KDA operator intermediates"), one);
            CHECK(ledger_bytes(k2, "KDA operator intermediates") == 0, "a segmented plan keeps KDA intermediates");
        }
        lm_model_free(k0);
        lm_model_free(k1);
        lm_model_free(k2);
    } else {
        CHECK(lm_model_plan(&c, 1, 4096, LM_DEVICE_CUDA, &g) == LM_ERR_ARG && strstr(lm_last_error(), "CUDA"),
              "a build without CUDA planned a GPU model");
    }
    lm_model_free(g);
}

/* The KDA layer's activations on a backend of a separate 2-byte product format
 * (the GPU's layout, checked without a GPU): every buffer inside the planned
 * floats, none overlapping the next, the bf16 ones 2 bytes a value and on
 * 64-byte starts. */
static void test_kda_bf16_layout_fits_its_plan(void) {
    lm_backend bf = *lm_backend_cpu();
    bf.lp_bytes = 2;
    const int B = 2, T = 37, H = 2, K = 16, HK = H * K;
    lm_kda_layer_config kc = {32, H, K, 4, 16, LM_KDA_GATE_BOUNDED, -5.0f, 1e-6f, NULL, 0, &bf};
    size_t n = lm_kda_layer_act_floats(&kc, B, T), N = (size_t)B * T;
    lm_kda_layer_config cpu = kc;
    cpu.backend = NULL;
    CHECK(n < lm_kda_layer_act_floats(&cpu, B, T), "bf16 layout %zu floats, fp32 %zu", n,
          lm_kda_layer_act_floats(&cpu, B, T));
    float *base = calloc(n, sizeof(float));
    lm_kda_layer_acts a;
    lm_kda_layer_acts_map(&kc, B, T, base, &a);
    struct {
        const char *name;
        const void *p;
        size_t bytes;
    } bufs[] = {{"qp", a.qp, N * HK * 4},    {"kp", a.kp, N * HK * 4},      {"vp", a.vp, N * HK * 4},
                {"q", a.q, N * HK * 2},      {"k", a.k, N * HK * 2},        {"v", a.v, N * HK * 2},
                {"z", a.z_lp, N * HK * 2},   {"o", a.o, N * HK * 2},        {"gate", a.gate, N * HK * 4},
                {"gated", a.gated, N * HK * 2}, {"beta", a.beta, N * H * 4}, {"o_rstd", a.o_rstd, N * H * 4},
                {"qk_rnorm", a.qk_rnorm, 2 * N * H * 4}};
    const char *lo = (const char *)base, *hi = lo + n * sizeof(float);
    int nb = (int)(sizeof bufs / sizeof bufs[0]);
    for (int i = 0; i < nb; i++) {
        const char *p = bufs[i].p;
        CHECK(p >= lo && p + bufs[i].bytes <= hi, "%s lies outside the planned floats", bufs[i].name);
        if (i + 1 < nb) CHECK(p + bufs[i].bytes <= (const char *)bufs[i + 1].p, "%s overlaps %s", bufs[i].name,
                              bufs[i + 1].name);
        if (bufs[i].bytes % 4 == 0 && i < 10) CHECK((size_t)(p - lo) % 64 == 0, "%s does not start on 64 bytes",
                                                    bufs[i].name);
    }
    free(base);
}

static void test_bad_chunk_configs_are_refused(void) {
    lm_config c = chunk_config();
    c.recompute = 0;
    c.recompute_chunk = 64;
    CHECK(lm_config_validate(&c) == LM_ERR_ARG && strstr(lm_last_error(), "train.recompute"),
          "recompute_chunk without recompute accepted");
    c.recompute = 1;
    c.balance = LM_BALANCE_AUX;
    CHECK(lm_config_validate(&c) == LM_ERR_ARG && strstr(lm_last_error(), "aux"), "recompute_chunk with aux accepted");
    c.balance = LM_BALANCE_QUANTILE;
    CHECK(lm_config_validate(&c) == LM_OK, "%s", lm_last_error());
    char *json = lm_config_to_json(&c);
    lm_config back;
    CHECK(json && !lm_config_parse(json, strlen(json), "round trip", &back) && back.recompute_chunk == 64,
          "train.recompute_chunk does not survive config.json");
    free(json);
}

/* A backend's part timer (lm_backend timer_*), here a host clock in a copy of
 * the CPU backend: the model marks the start of each pass (part -1) and the
 * end of every part instead of timing them itself, and takes the intervals
 * when its timings are read. The bits do not change (the same loss and
 * gradients as the model without a timer); every part the model has gets
 * time; the parts add up to at most the passes' wall time; a second read
 * without passes adds nothing; the timer is freed with the model. */
typedef struct {
    double last, acc[LM_TIME_COUNT], total;
    int marks, starts, takes;
} host_timer;
static int host_timers_live;
static host_timer *host_timer_last;
static lm_status ht_create(lm_backend *be, void **out) {
    (void)be;
    *out = calloc(1, sizeof(host_timer));
    if (*out) host_timers_live++, host_timer_last = *out;
    return *out ? LM_OK : LM_ERR_MEMORY;
}
static lm_status ht_mark(lm_backend *be, void *p, int part) {
    (void)be;
    host_timer *t = p;
    double now = lm_time_seconds();
    if (part >= 0 && part < LM_TIME_COUNT) t->acc[part] += now - t->last, t->total += now - t->last, t->marks++;
    else t->starts++;
    t->last = now;
    return LM_OK;
}
static lm_status ht_take(lm_backend *be, void *p, double *seconds, int n) {
    (void)be;
    host_timer *t = p;
    for (int i = 0; i < n && i < LM_TIME_COUNT; i++) seconds[i] += t->acc[i], t->acc[i] = 0;
    t->takes++;
    return LM_OK;
}
static void ht_free(lm_backend *be, void *p) {
    (void)be;
    host_timers_live--;
    free(p);
}

static void test_part_timer_takes_the_parts(void) {
    lm_config c = chunk_config();
    const int B = 2, T = 24, N = B * T;
    lm_backend tb = *lm_backend_cpu();
    tb.timer_create = ht_create;
    tb.timer_mark = ht_mark;
    tb.timer_take = ht_take;
    tb.timer_free = ht_free;
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create_on(&c, B, T, &tb, &a) && !lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    CHECK(host_timers_live == 1, "%d part timers live after creating one model with it", host_timers_live);
    if (!a || !b) goto done;
    lm_model_init(a, 5);
    lm_model_init(b, 5);
    int32_t tok[48], tgt[48];
    lm_rng r;
    lm_rng_seed(&r, 6);
    random_tokens(&r, tok, N, c.vocab_size);
    random_tokens(&r, tgt, N, c.vocab_size);
    float la = NAN, lb = NAN;
    double t0 = lm_time_seconds();
    CHECK(!lm_model_forward(a, tok, tgt, 1, &la) && !lm_model_backward(a, 1.0f), "%s", lm_last_error());
    double wall = lm_time_seconds() - t0;
    CHECK(!lm_model_forward(b, tok, tgt, 1, &lb) && !lm_model_backward(b, 1.0f), "%s", lm_last_error());
    CHECK(memcmp(&la, &lb, sizeof la) == 0, "loss with the timer %.9g, without %.9g", la, lb);
    CHECK(!memcmp(lm_model_grads(a), lm_model_grads(b), lm_model_num_params(a) * sizeof(float)),
          "the gradients differ with the part timer");
    double s[LM_TIME_COUNT], again[LM_TIME_COUNT], sum = 0;
    lm_model_timings(a, s);
    for (int p = 0; p < LM_TIME_COUNT; p++) {
        CHECK(s[p] > 0, "part %s got no time from the timer", lm_time_part_name((lm_time_part)p));
        sum += s[p];
    }
    CHECK(sum <= wall, "the parts add up to %.6f s, more than the passes' %.6f s", sum, wall);
    /* the time is the timer's: its marked intervals, one start a pass at least */
    const host_timer *ht = host_timer_last;
    CHECK(ht->marks > 0 && ht->starts >= 2 && ht->takes >= 1, "the timer saw %d marks, %d starts, %d takes", ht->marks,
          ht->starts, ht->takes);
    CHECK(fabs(sum - ht->total) <= 1e-9 * (1 + ht->total), "the parts add up to %.9f s, the timer marked %.9f s", sum,
          ht->total);
    lm_model_timings(a, again);
    CHECK(!memcmp(s, again, sizeof s), "a second read without passes changed the timings");
    lm_model_reset_timings(a);
    lm_model_timings(a, again);
    for (int p = 0; p < LM_TIME_COUNT; p++) CHECK(again[p] == 0, "part %d after the reset: %g", p, again[p]);
done:
    lm_model_free(a);
    lm_model_free(b);
    CHECK(host_timers_live == 0, "%d part timers live after freeing the model", host_timers_live);
}

/* Deferred non-finite checks (lm_ops nonfinite_note / nonfinite_take), here
 * in a copy of the CPU backend whose slots are a host array: the model notes
 * every sublayer's output check and takes them once after the layers. A clean
 * step has the bits of the model that checks at once; a NaN in the embedded
 * batch and a NaN weight in layer 2 fail the forward with the same message as
 * the check at once (for the weight, the first failing sublayer's check, though
 * the forward went on and a later op refused the NaN it was handed); the next
 * clean forward passes (the failed forward's slots are dropped). The router scores' check is deferred only
 * with a backend's balance set (the GPU's): not covered here. */
static int64_t host_slots[LM_NONFINITE_SLOTS];
static int host_notes, host_takes;
static lm_status hs_note(lm_backend *be, const float *x, size_t n, int64_t base, int slot) {
    (void)be;
    if (slot < 0 || slot >= LM_NONFINITE_SLOTS) return LM_ERR_ARG;
    host_notes++;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) {
            if (host_slots[slot] < 0 || base + (int64_t)i < host_slots[slot]) host_slots[slot] = base + (int64_t)i;
            break;
        }
    return LM_OK;
}
static lm_status hs_take(lm_backend *be, int64_t *first, int n) {
    (void)be;
    host_takes++;
    for (int i = 0; i < n; i++) first[i] = host_slots[i], host_slots[i] = -1;
    return LM_OK;
}

/* the residual stream's add with the check in it (lm_ops attnres_add_output_note), as the
 * GPU backend has it: here the CPU's add, then the host note of y */
static int host_add_notes;
static size_t host_nd; /* y's n d */
static lm_status hs_add_output_note(lm_backend *be, void *state, int l, const float *y, int slot) {
    lm_status st = lm_backend_cpu()->ops->attnres_add_output(be, state, l, y);
    if (st) return st;
    host_add_notes++;
    return hs_note(be, y, host_nd, 0, slot);
}

static void deferred_checks_case(int in_add) {
    for (int i = 0; i < LM_NONFINITE_SLOTS; i++) host_slots[i] = -1;
    lm_config c = chunk_config();
    const int B = 2, T = 24, N = B * T;
    lm_ops ops = *lm_backend_cpu()->ops;
    ops.nonfinite_note = hs_note;
    ops.nonfinite_take = hs_take;
    if (in_add) ops.attnres_add_output_note = hs_add_output_note;
    const int add_notes0 = host_add_notes;
    lm_backend db = *lm_backend_cpu();
    db.ops = &ops;
    lm_model *a = NULL, *b = NULL;
    CHECK(!lm_model_create_on(&c, B, T, &db, &a) && !lm_model_create(&c, B, T, &b), "%s", lm_last_error());
    if (!a || !b) goto done;
    int32_t tok[48], tgt[48];
    lm_rng r;
    lm_rng_seed(&r, 8);
    random_tokens(&r, tok, N, c.vocab_size);
    random_tokens(&r, tgt, N, c.vocab_size);
    for (int round = 0; round < 3; round++) {
        lm_model_init(a, 9);
        lm_model_init(b, 9);
        if (round == 1) {
            lm_model_inject_fault(a, LM_FAULT_BATCH);
            lm_model_inject_fault(b, LM_FAULT_BATCH);
        }
        if (round == 2) {
            /* a NaN weight in layer 2: the first failing sublayer is 4, every later one fails too */
            for (int i = 0; i < lm_model_num_tensors(a); i++) {
                const lm_model_tensor *t = lm_model_tensor_at(a, i);
                if (strncmp(t->name, "layers.2.", 9) || t->numel < 2 || strstr(t->name, "norm")) continue;
                lm_model_params(a)[t->offset + 1] = NAN;
                lm_model_params(b)[t->offset + 1] = NAN;
                break;
            }
        }
        float la = NAN, lb = NAN;
        int notes0 = host_notes, takes0 = host_takes, add_notes_r = host_add_notes;
        host_nd = (size_t)N * (size_t)c.d_model;
        lm_status sa = lm_model_forward(a, tok, tgt, 1, &la);
        char msg_a[512];
        snprintf(msg_a, sizeof msg_a, "%s", sa ? lm_last_error() : "");
        lm_status sb = lm_model_forward(b, tok, tgt, 1, &lb);
        const char *msg_b = sb ? lm_last_error() : "";
        /* every sublayer's output noted in a clean forward; one take whenever something was noted,
         * after a failure too (the batch's NaN fails inside sublayer 0, before any note) */
        CHECK((round > 0 || host_notes - notes0 == 2 * c.n_layers) && host_takes - takes0 == (host_notes > notes0),
              "round %d: %d notes and %d takes in a forward (a clean one: %d and 1)", round, host_notes - notes0,
              host_takes - takes0, 2 * c.n_layers);
        /* with the note in the residual add, every note of a clean forward comes from it */
        CHECK(round > 0 || host_add_notes - add_notes_r == (in_add ? 2 * c.n_layers : 0),
              "round %d: %d notes in the residual add", round, host_add_notes - add_notes_r);
        if (round == 0) {
            CHECK(!sa && !sb && memcmp(&la, &lb, sizeof la) == 0, "clean: loss %.9g (%d) vs %.9g (%d)", la, (int)sa,
                  lb, (int)sb);
            CHECK(!lm_model_backward(a, 1.0f) && !lm_model_backward(b, 1.0f), "%s", lm_last_error());
            CHECK(!memcmp(lm_model_grads(a), lm_model_grads(b), lm_model_num_params(a) * sizeof(float)),
                  "the gradients differ with deferred checks");
        } else {
            printf("    round %d: deferred \"%s\", at once \"%s\"\n", round, msg_a, msg_b);
            CHECK(sa == LM_ERR_NUMERIC && sb == LM_ERR_NUMERIC, "round %d: status %d deferred, %d at once", round,
                  (int)sa, (int)sb);
            /* the batch's NaN: the first KDA operator refuses its beta (the CPU operator checks its inputs)
             * in both; the weight's: sublayer 4's output check, though the deferred forward went on to a
             * router that refused the NaN scores it was handed */
            CHECK(!strcmp(msg_a, msg_b) && (round == 1 || strstr(msg_a, "output of sublayer 4 ")),
                  "round %d: deferred \"%s\", at once \"%s\"", round, msg_a, msg_b);
        }
    }
    /* the failed forward's slots were dropped: a clean one passes */
    lm_model_init(a, 9);
    float la = NAN;
    CHECK(!lm_model_forward(a, tok, tgt, 1, &la) && isfinite(la), "a clean forward after a failed one: %s",
          lm_last_error());
    CHECK(in_add ? host_add_notes > add_notes0 : host_add_notes == add_notes0, "%d notes in the residual add",
          host_add_notes - add_notes0);
done:
    lm_model_free(a);
    lm_model_free(b);
}

static void test_deferred_checks_name_the_first_failing_sublayer(void) { deferred_checks_case(0); }

/* the same with the check in the residual stream's add (lm_ops attnres_add_output_note) */
static void test_deferred_checks_in_the_residual_add_name_the_same_sublayer(void) { deferred_checks_case(1); }

int main(void) {
    RUN(test_chunked_equals_unchunked);
    RUN(test_recompute_without_chunks_is_bit_identical);
    RUN(test_selective_recompute_repeats_one_kind_with_the_same_bits);
    RUN(test_selective_recompute_plans);
    RUN(test_expert_grads_written_by_the_backward_are_the_same_bits);
    RUN(test_plan_is_the_models_ledger);
    RUN(test_chunk_bounds_the_per_token_sublayers);
    RUN(test_kda_bf16_layout_fits_its_plan);
    RUN(test_bad_chunk_configs_are_refused);
    RUN(test_part_timer_takes_the_parts);
    RUN(test_deferred_checks_name_the_first_failing_sublayer);
    RUN(test_deferred_checks_in_the_residual_add_name_the_same_sublayer);
    return test_summary();
}
