/* Small models for the tests that train: the same micro config everywhere,
 * each test changing what it studies. */
#ifndef LONGMOE_TEST_MODELS_H
#define LONGMOE_TEST_MODELS_H

#include <stdio.h>
#include <string.h>

#include "longmoe/config.h"

/* d = 16, two layers (KDA then gated MLA), a dense FFN then a MoE of 4 experts
 * top-2, Block AttnRes; 2 sequences of 40 tokens; no evaluation or checkpoint
 * inside the run. */
static inline lm_config test_micro_config(void) {
    lm_config c;
    lm_config_defaults(&c);
    c.d_model = 16;
    c.n_layers = 2;
    strcpy(c.layout, "km");
    c.first_k_dense = 1;
    c.dense_ffn = 24;
    c.kda_heads = 2;
    c.kda_head_dim = 8;
    c.kda_chunk = 16;
    c.attn_heads = 2;
    c.q_lora_rank = 8;
    c.kv_lora_rank = 8;
    c.qk_head_dim = 8;
    c.v_head_dim = 8;
    c.n_routed_experts = 4;
    c.top_k = 2;
    c.expert_ffn = 8;
    c.shared_ffn = 8;
    c.seq_len = 40;
    c.batch_size = 2;
    c.eval_every = 0;
    c.ckpt_every = 0;
    c.log_every = 1000;
    return c;
}

/* A small hybrid: d = 128, four layers (three KDA, one gated MLA), a dense FFN
 * then MoE of 8 experts top-2 with a shared expert, quantile balancing, Block
 * AttnRes of 4 sublayers. */
static inline lm_config test_small_hybrid_config(void) {
    lm_config c;
    lm_config_defaults(&c);
    c.vocab_size = 256;
    c.d_model = 128;
    c.n_layers = 4;
    strcpy(c.layout, "kkkm");
    c.first_k_dense = 1;
    c.dense_ffn = 256;
    c.kda_heads = 2;
    c.kda_head_dim = 64;
    c.kda_chunk = 64;
    c.attn_heads = 2;
    c.q_lora_rank = 64;
    c.kv_lora_rank = 32;
    c.qk_head_dim = 64;
    c.v_head_dim = 64;
    c.n_routed_experts = 8;
    c.top_k = 2;
    c.n_shared_experts = 1;
    c.expert_ffn = 64;
    c.shared_ffn = 128;
    c.balance = LM_BALANCE_QUANTILE;
    c.residual = LM_RESIDUAL_BLOCK_ATTNRES;
    c.attnres_block = 4;
    return c;
}

/* k3-mini reduced to test size: its head dimensions (128), latent MoE and
 * SiTU activation, recompute, d = 256 over eight layers (kkkm twice), 16
 * experts top-4, Block AttnRes of 8 sublayers. Shared by the whole-model GPU
 * test and the routing-sensitivity bench. */
static inline lm_config test_reduced_k3_mini_config(void) {
    lm_config c = test_small_hybrid_config();
    c.d_model = 256;
    c.n_layers = 8;
    strcpy(c.layout, "kkkmkkkm");
    c.dense_ffn = 512;
    c.kda_heads = 2;
    c.kda_head_dim = 128;
    c.attn_heads = 2;
    c.q_lora_rank = 96;
    c.kv_lora_rank = 64;
    c.qk_head_dim = 128;
    c.v_head_dim = 128;
    c.n_routed_experts = 16;
    c.top_k = 4;
    c.expert_ffn = 64;
    c.shared_ffn = 128;
    c.latent_dim = 128;
    c.activation = LM_ACT_SITU;
    c.attnres_block = 8;
    c.recompute = 1;
    return c;
}

/* How long the rank tests (test_dp, test_zero, test_ep_state, test_ep_group,
 * test_cp_train) train test_dp_config: DP_STEPS steps, a checkpoint every 5,
 * an evaluation at the middle and the end. The Release suite (make test) runs
 * 20. A sanitizer build (make test-asan: CMake defines LONGMOE_TEST_REDUCED
 * when LONGMOE_SANITIZE is on) runs 10: a step costs about five Release steps
 * there, and these programs, each run at 2 and 4 ranks and comparing runs of
 * every layout with one process, took 270 of the ASan suite's 350 s on 2 cores
 * (the last 10 steps run the first 10's code again). Every case makes the same
 * runs and the same comparisons, bit for bit where they were and within the
 * same tolerances, over the 10 steps: checkpoints 5 and 10 instead of 5 to 20,
 * resumes from step 4 (DP_STOP, between checkpoints) instead of 8, from 5
 * (DP_HALF) instead of 10, and a 2-rank leg to 7 (DP_LATE) instead of 15. In 10
 * steps the loss still falls by more than 0.5, QK-Clip and gradient clipping
 * still act (steps 5 to 7) and the balancing bias still moves, so the checks
 * that the runs see training hold as they are. test_dp_steps_note() prints the
 * reduction. */
#ifdef LONGMOE_TEST_REDUCED
#define DP_STEPS 10
#else
#define DP_STEPS 20
#endif
#define DP_HALF (DP_STEPS / 2)     /* the checkpoint resumed on another layout (10 of 20) */
#define DP_STOP (DP_STEPS * 2 / 5) /* a stop between checkpoints, resumed on the same layout (8 of 20) */
#define DP_LATE (DP_STEPS * 3 / 4) /* a leg from DP_HALF on another number of ranks (to 15 of 20) */

/* One line on rank 0's output when the runs are the sanitizer build's shorter ones. */
static inline void test_dp_steps_note(void) {
#ifdef LONGMOE_TEST_REDUCED
    printf("sanitizer build: runs of %d steps, not the Release suite's 20 (DP_STEPS, tests/test_models.h)\n",
           DP_STEPS);
#endif
}

/* Four layers (KDA, MLA, KDA, MLA), a dense FFN then MoE layers of 8 experts
 * top-2 with a shared expert and quantile balancing, Block AttnRes; 4
 * sequences of 32 tokens a micro-batch, 2 micro-batches a step (so 2 or 4
 * ranks take 2 or 1 sequences each); QK-Clip acting; DP_STEPS steps (above).
 * The data-parallel tests (tests/test_dp.c, tests/test_zero.c) train it. */
static inline lm_config test_dp_config(lm_qb_estimator estimator) {
    lm_config c;
    lm_config_defaults(&c);
    c.vocab_size = 256;
    c.d_model = 32;
    c.n_layers = 4;
    strcpy(c.layout, "kmkm");
    c.first_k_dense = 1;
    c.dense_ffn = 64;
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
    c.expert_ffn = 16;
    c.shared_ffn = 32;
    c.balance = LM_BALANCE_QUANTILE;
    c.balance_estimator = estimator;
    c.residual = LM_RESIDUAL_BLOCK_ATTNRES;
    c.attnres_block = 4;
    c.seq_len = 32;
    c.batch_size = 4;
    c.grad_accum = 2;
    c.steps = DP_STEPS;
    c.lr = 0.03f;
    c.adam_lr = 0.005f;
    c.eval_every = DP_HALF;
    c.ckpt_every = 5;
    c.keep_checkpoints = 10;
    c.log_every = 1000;
    c.qk_clip_tau = 4.0f; /* QK-Clip acts in these steps (largest logits 3 to 5) */
    return c;
}

#endif
