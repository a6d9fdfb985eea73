/* `longmoe plan --layout` arithmetic (include/longmoe/layout_plan.h; the
 * formulas in docs/scaleout.md) on a small config against numbers worked out
 * by hand in the comments. */
#include "longmoe/config.h"
#include "longmoe/layout_plan.h"
#include "test.h"

/* 4 layers: KDA, MLA, KDA, MLA (mla_every 2); layer 0 a dense FFN, layers
 * 1-3 MoE with 8 experts top-2, expert_ffn 32, no latent (d_in = d = 64);
 * Block AttnRes of 4 sublayers; QB with 100 bins; AdamW (2 moments). */
static const char *small_config =
    "{\"model\": {\"vocab_size\": 256, \"d_model\": 64, \"n_layers\": 4, \"mla_every\": 2, \"last_layer_mla\": true,"
    "  \"first_k_dense\": 1, \"dense_ffn\": 128, \"tie_embeddings\": false},"
    " \"kda\": {\"heads\": 2, \"head_dim\": 32, \"chunk\": 64},"
    " \"attention\": {\"kind\": \"mla\", \"heads\": 2, \"q_lora_rank\": 32, \"kv_lora_rank\": 16,"
    "  \"qk_head_dim\": 32, \"v_head_dim\": 32},"
    " \"moe\": {\"routed_experts\": 8, \"top_k\": 2, \"shared_experts\": 1, \"expert_ffn\": 32, \"shared_ffn\": 64,"
    "  \"balance\": \"quantile\", \"balance_bins\": 100},"
    " \"residual\": {\"kind\": \"block_attnres\", \"block_sublayers\": 4},"
    " \"train\": {\"seq_len\": 128, \"batch_size\": 1, \"optimizer\": \"adamw\", \"recompute\": false}}";

static int load_small(lm_config *c) {
    lm_config_defaults(c);
    return lm_config_parse(small_config, strlen(small_config), "small", c) == LM_OK;
}

static void test_layout_arithmetic_matches_hand_computed_numbers(void) {
    lm_config c;
    CHECK(load_small(&c), "%s", lm_last_error());
    lm_layout L;
    CHECK(lm_layout_parse("4,2,2,2", &L) == LM_OK && L.dp == 4 && L.ep == 2 && L.cp == 2 && L.pp == 2 && L.tp == 1,
          "parse: %s", lm_last_error());
    lm_cluster k = lm_cluster_default();
    lm_layout_plan p;
    /* 4 replicas x 128 tokens x 3 micro-batches */
    CHECK(lm_layout_plan_compute(&c, &L, &k, 128, 1536, &p) == LM_OK, "%s", lm_last_error());
    CHECK(p.n_gpus == 16, "GPUs %d (4 x 2 x 2 x 1)", p.n_gpus);
    CHECK(p.micro_batches == 3, "micro-batches %d (1536 / (4 x 128))", p.micro_batches);
    CHECK(p.tokens_per_gpu == 64, "tokens per GPU %lld (128 / CP 2)", (long long)p.tokens_per_gpu);
    /* stages: layers 0-1 and 2-3; after 2 layers = 4 sublayers = one closed
     * block of 4: the embedding and b_1 cross, no partial sum */
    CHECK(p.stage_first_layer[0] == 0 && p.stage_layers[0] == 2 && p.stage_first_layer[1] == 2 && p.stage_layers[1] == 2,
          "stages");
    CHECK(p.boundary_sources[0] == 2, "sources across the boundary %d, want 2", p.boundary_sources[0]);
    /* parameters by hand (the planner's formulas, docs/scaleout.md):
     *   KDA layer  6 x 64 x 64 + 64 x 2 + 3 x 64 x 4 + 2 + 64 + 32          = 25570
     *   MLA layer  64x32 + 32x2x32 + 64x16 + 16x2x64 + 64x2x32 + 2x32x64 + 32 + 16 = 15408
     *   MoE layer  experts 8 x 3 x 64 x 32 = 49152 (split by EP); router 512 + shared 3 x 64 x 64 = 12800
     *   dense FFN  3 x 64 x 128 = 24576;  norms (8 x 64 + 9 x 2 x 64 + 64) / 4 layers = 432 a layer
     *   embedding and LM head 256 x 64 = 16384 each
     * stage 0: embedding + KDA + MLA + 2 norms + FFN + MoE(12800) = 95602 dense, 49152 / 2 experts
     * stage 1: KDA + MLA + 2 norms + 2 x 12800 + head = 83826 dense, 2 x 49152 / 2 experts
     * Stage 0 holds 2 micro-batches in flight (1F1B: PP - s = 2 of the 3) and is the busiest. */
    CHECK(p.busiest_stage == 0, "busiest stage %d", p.busiest_stage);
    CHECK_CLOSE(p.dense_params, 95602, 0, 0, "dense parameters per GPU");
    CHECK_CLOSE(p.expert_params, 24576, 0, 0, "expert parameters per GPU");
    CHECK_CLOSE(p.weight_bytes, 2 * (95602 + 24576), 0, 1e-12, "bf16 weights");
    CHECK_CLOSE(p.grad_bytes, 4 * (95602 + 24576), 0, 1e-12, "fp32 gradients");
    /* AdamW: fp32 master + 2 moments = 12 bytes, dense over DPxCP = 8, experts over 8 / EP = 4 */
    CHECK_CLOSE(p.optimizer_bytes, 12 * (95602 / 8.0 + 24576 / 4.0), 0, 1e-12, "ZeRO-1 optimizer");
    /* activations, no recompute: a layer's working set 2 (10 x 64 + 2 (64 + 3 x 32)) = 1920 B a token,
     * 2 layers + the AttnRes history (1 + ceil(8/4)) x 64 x 2 = 384 B; 2 micro-batches of 64 tokens:
     * 64 x 2 x (3840 + 384) */
    CHECK_CLOSE(p.activation_bytes, 540672, 0, 0, "activations");
    CHECK_CLOSE(p.total_bytes, p.weight_bytes + p.grad_bytes + p.optimizer_bytes + p.activation_bytes, 0, 1e-12, "total");
    /* train.recompute: a layer keeps its two inputs (2 x 2 x 64 = 256 B a token) and what is not
     * recomputed of its token part 2 x 10 x 64 = 1280 and channel part 2 x 2 (64 + 3 x 32) = 640; one
     * layer's recomputed part is live besides. channel: 64 x (2 (2 x 1536 + 384) + 640); token: 64 x
     * (2 (2 x 896 + 384) + 1280); all: stage 1 is then the busiest (its two MoE layers' experts weigh more
     * than stage 0's activations), one micro-batch in flight: 64 x (2 x 256 + 384 + 1920) */
    const int modes[3] = {LM_RECOMPUTE_ALL, LM_RECOMPUTE_CHANNEL, LM_RECOMPUTE_TOKEN};
    const double want[3] = {180224, 483328, 360448};
    for (int i = 0; i < 3; i++) {
        lm_config r = c;
        r.recompute = modes[i];
        lm_layout_plan q;
        CHECK(lm_layout_plan_compute(&r, &L, &k, 128, 1536, &q) == LM_OK, "%s", lm_last_error());
        CHECK_CLOSE(q.activation_bytes, want[i], 0, 0, lm_recompute_name(modes[i]));
        CHECK(q.busiest_stage == (i == 0), "recompute %s: busiest stage %d", lm_recompute_name(modes[i]),
              q.busiest_stage);
    }
    /* collectives: the largest stage's. Gradients (stage 1): ring reduce-scatter over 8 dense
     * replicas (7/8) and 4 expert replicas (3/4), fp32; the weights back in bf16 */
    CHECK_CLOSE(p.coll_bytes[LM_COLL_GRAD_REDUCE_SCATTER], 4 * (7.0 / 8 * 83826 + 3.0 / 4 * 49152), 0, 1e-12,
                "gradient bytes");
    CHECK_CLOSE(p.coll_bytes[LM_COLL_PARAM_ALL_GATHER], 2 * (7.0 / 8 * 83826 + 3.0 / 4 * 49152), 0, 1e-12,
                "weight bytes");
    /* all-to-all: 3 micro-batches x 2 MoE layers x 4 (dispatch, combine, fwd and bwd) x 64 tokens
     * x top-2 x 64 wide x 2 bytes x 1/2 off-rank = 196608 */
    CHECK_CLOSE(p.coll_bytes[LM_COLL_EP_ALL_TO_ALL], 196608, 0, 0, "all-to-all bytes");
    /* QB: a stage's layers are routed by its DP x CP x TP = 8 ranks: 2 MoE layers x ring
     * all-reduce 2 x 7/8 x 8 experts x 100 bins x 4 B = 11200 */
    CHECK_CLOSE(p.coll_bytes[LM_COLL_QB_HISTOGRAM], 11200, 0, 1e-12, "QB histogram bytes");
    /* KDA maps: 3 x 1 layer x 2 (fwd, bwd) x (CP-1 = 1) x 2 heads x (32x32 + 32x32) x 4 B = 98304 */
    CHECK_CLOSE(p.coll_bytes[LM_COLL_CP_KDA_STATE], 98304, 0, 0, "KDA state bytes");
    /* MLA latents: 3 x 1 layer x 2 x 1 x 64 tokens x 16 x 2 B = 12288 */
    CHECK_CLOSE(p.coll_bytes[LM_COLL_CP_MLA_LATENT], 12288, 0, 0, "MLA latent bytes");
    /* pipeline: 3 x 2 (fwd, bwd) x 2 sources x 64 tokens x 64 x 2 B = 98304 */
    CHECK_CLOSE(p.coll_bytes[LM_COLL_PP_ATTNRES], 98304, 0, 0, "pipeline bytes");
    CHECK(p.coll_bytes[LM_COLL_TP_ALL_REDUCE] == 0, "no TP, no TP traffic");
    /* links: DPxCP = 8 ranks fit a node of 8; the PP pair 8 apart does not */
    CHECK(!p.coll_crosses_nodes[LM_COLL_GRAD_REDUCE_SCATTER] && p.coll_group[LM_COLL_GRAD_REDUCE_SCATTER] == 8, "grad link");
    CHECK(!p.coll_crosses_nodes[LM_COLL_EP_ALL_TO_ALL] && p.coll_group[LM_COLL_EP_ALL_TO_ALL] == 2, "EP link");
    CHECK(!p.coll_crosses_nodes[LM_COLL_QB_HISTOGRAM] && p.coll_group[LM_COLL_QB_HISTOGRAM] == 8, "QB link");
    CHECK(p.coll_crosses_nodes[LM_COLL_PP_ATTNRES], "PP link");
    CHECK_CLOSE(p.coll_s[LM_COLL_QB_HISTOGRAM], 11200 / 900e9, 0, 1e-12, "QB time at 900 GB/s");
    CHECK_CLOSE(p.coll_s[LM_COLL_PP_ATTNRES], 98304 / 50e9, 0, 1e-12, "pipeline time at 400 Gb/s");
    CHECK_CLOSE(p.coll_s[LM_COLL_EP_ALL_TO_ALL], 196608 / 900e9, 0, 1e-12, "all-to-all time at 900 GB/s");
    CHECK_CLOSE(p.bubble_fraction, 1.0 / 3, 0, 1e-12, "bubble (PP-1)/m");
    CHECK_CLOSE(p.compute_s, p.flops_per_gpu / (989e12 * 0.4), 0, 1e-12, "compute time");
    double exposed = 0;
    for (int i = LM_COLL_EP_ALL_TO_ALL; i < LM_COLL_COUNT; i++) exposed += p.coll_s[i];
    double hidden = p.coll_s[LM_COLL_GRAD_REDUCE_SCATTER] + p.coll_s[LM_COLL_PARAM_ALL_GATHER];
    double busy = p.compute_s * (4.0 / 3);
    CHECK_CLOSE(p.step_s, (busy > hidden ? busy : hidden) + exposed, 0, 1e-12, "step time");
    /* the whole model's FLOPs split over 16 GPUs bound the busiest stage's share from below */
    lm_plan mp;
    lm_config_plan(&c, 128, &mp);
    CHECK(p.flops_per_gpu >= 3 * mp.total_flops * 1536 / 16 * (1 - 1e-12) &&
              p.flops_per_gpu <= 3 * mp.total_flops * 1536 / 8,
          "FLOPs per GPU %.6g vs the model's %.6g", p.flops_per_gpu, 3 * mp.total_flops * 1536 / 16);
}

static void test_tensor_parallel_adds_its_all_reduce_and_splits_the_tokens(void) {
    lm_config c;
    CHECK(load_small(&c), "%s", lm_last_error());
    lm_layout L;
    CHECK(lm_layout_parse("2,1,1,1,2", &L) == LM_OK && L.tp == 2, "parse with TP");
    lm_cluster k = lm_cluster_default();
    lm_layout_plan p;
    CHECK(lm_layout_plan_compute(&c, &L, &k, 128, 256, &p) == LM_OK, "%s", lm_last_error());
    CHECK(p.tokens_per_gpu == 64, "tokens per GPU %lld (128 / TP 2)", (long long)p.tokens_per_gpu);
    /* 1 micro-batch x 4 layers x 4 all-reduces x ring 2 x 1/2 x 128 tokens x 64 x 2 B = 262144 */
    CHECK_CLOSE(p.coll_bytes[LM_COLL_TP_ALL_REDUCE], 262144, 0, 0, "TP bytes");
    CHECK(p.coll_bytes[LM_COLL_CP_KDA_STATE] == 0 && p.coll_bytes[LM_COLL_EP_ALL_TO_ALL] == 0 &&
              p.coll_bytes[LM_COLL_PP_ATTNRES] == 0,
          "no CP, EP or PP traffic");
}

static void test_bad_layouts_are_rejected_with_a_message(void) {
    lm_config c;
    CHECK(load_small(&c), "%s", lm_last_error());
    lm_layout L;
    CHECK(lm_layout_parse("4,2,2", &L) == LM_ERR_ARG, "three numbers accepted");
    CHECK(lm_layout_parse("4,x,2,2", &L) == LM_ERR_ARG, "a letter accepted");
    CHECK(lm_layout_parse("4,0,2,2", &L) == LM_ERR_ARG, "zero accepted");
    lm_cluster k = lm_cluster_default();
    lm_layout_plan p;
    lm_layout bad_ep = {3, 3, 1, 1, 1};
    CHECK(lm_layout_plan_compute(&c, &bad_ep, &k, 128, 384, &p) == LM_ERR_ARG && strstr(lm_last_error(), "EP"),
          "EP 3 with 8 experts: %s", lm_last_error());
    lm_layout bad_pp = {1, 1, 1, 5, 1};
    CHECK(lm_layout_plan_compute(&c, &bad_pp, &k, 128, 128, &p) == LM_ERR_ARG && strstr(lm_last_error(), "PP"),
          "PP 5 with 4 layers: %s", lm_last_error());
    lm_layout ok = {2, 1, 3, 1, 1};
    CHECK(lm_layout_plan_compute(&c, &ok, &k, 128, 256, &p) == LM_ERR_ARG && strstr(lm_last_error(), "seq_len"),
          "CP 3 of 128 tokens: %s", lm_last_error());
    ok.cp = 2;
    CHECK(lm_layout_plan_compute(&c, &ok, &k, 128, 300, &p) == LM_ERR_ARG && strstr(lm_last_error(), "global"),
          "300 tokens: %s", lm_last_error());
}

#ifdef LONGMOE_CLI
static void test_cli_prints_the_layout_of_the_k3_preset(void) {
    char dir[512];
    CHECK(test_make_tmpdir(dir, sizeof dir, "plan") == 0, "tmpdir");
    const char *out = test_path(dir, "out.txt"), *err = test_path(dir, "err.txt");
    int rc = test_run_cli("plan --config configs/k3.json --layout 256,64,4,8 --context 65536", out, err);
    CHECK(rc == 0, "exit %d", rc);
    CHECK(test_file_has(out, "8192 GPUs"), "GPU count");
    CHECK(test_file_has(out, "QB histogram all-reduce"), "collective table");
    CHECK(test_file_has(out, "sources x d_model per token cross to stage 1"), "pipeline boundaries");
    rc = test_run_cli("plan --config configs/k3.json --layout 3,7,1,1", out, err);
    CHECK(rc == 1 && test_file_has(err, "EP"), "a bad layout exits 1 naming EP (exit %d)", rc);
    test_remove_tree(dir);
}
#endif

int main(void) {
    RUN(test_layout_arithmetic_matches_hand_computed_numbers);
    RUN(test_tensor_parallel_adds_its_all_reduce_and_splits_the_tokens);
    RUN(test_bad_layouts_are_rejected_with_a_message);
#ifdef LONGMOE_CLI
    RUN(test_cli_prints_the_layout_of_the_k3_preset);
#endif
    return test_summary();
}
