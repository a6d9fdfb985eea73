/* Small models for the tests that train: the same micro config everywhere,
 * each test changing what it studies. */
#ifndef LONGMOE_TEST_MODELS_H
#define LONGMOE_TEST_MODELS_H

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

#endif
