/* How much the gradient directions of a routed model move when only its
 * weights are rounded to bf16, on the CPU (fp32 arithmetic throughout): the
 * yardstick for comparing the GPU (bf16 products) with the CPU
 * (tests/test_cuda_model.c). A token whose top-k experts are within rounding
 * of a tie can switch experts, and its gradient then differs in every layer
 * below; with the routing pinned by the balancing bias no token switches.
 *
 *   bench_routing_sensitivity [T]      (default 257 tokens, the test's reduced k3-mini) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/model.h"
#include "../tests/test_models.h"

static void pin(lm_model *m, int k) {
    for (int i = 0; i < lm_model_num_moe_layers(m); i++) {
        lm_balance_state *b = lm_model_balance(m, i);
        for (int j = 0; j < b->cfg.n_experts; j++) b->bias[j] = j < k ? 10.0f : 0.0f;
    }
}

static int run(int T, int pinned) {
    lm_config c = test_reduced_k3_mini_config();
    lm_model *a = NULL, *b = NULL;
    if (lm_model_create(&c, 1, T, &a) || lm_model_create(&c, 1, T, &b)) {
        fprintf(stderr, "bench_routing_sensitivity: %s\n", lm_last_error());
        return 1;
    }
    lm_model_init(a, 12);
    lm_model_init(b, 12);
    float *pb = lm_model_params(b);
    for (size_t i = 0; i < lm_model_num_params(b); i++) pb[i] = lm_bf16_to_f32(lm_f32_to_bf16(pb[i]));
    if (pinned) {
        pin(a, c.top_k);
        pin(b, c.top_k);
    }
    int32_t *tok = malloc((size_t)T * sizeof *tok), *tgt = malloc((size_t)T * sizeof *tgt);
    lm_rng r;
    lm_rng_seed(&r, 12 ^ 0x5eed);
    for (int i = 0; i < T; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)c.vocab_size);
    for (int i = 0; i < T; i++) tgt[i] = i ? tok[i - 1] : tok[i];
    float la = NAN, lb = NAN;
    if (lm_model_forward(a, tok, tgt, 1, &la) || lm_model_backward(a, 1) || lm_model_forward(b, tok, tgt, 1, &lb) ||
        lm_model_backward(b, 1)) {
        fprintf(stderr, "bench_routing_sensitivity: %s\n", lm_last_error());
        return 1;
    }
    const float *ga = lm_model_grads(a), *gb = lm_model_grads(b);
    double worst = 1;
    const char *worst_name = "";
    int below = 0;
    for (int i = 0; i < lm_model_num_tensors(a); i++) {
        const lm_model_tensor *t = lm_model_tensor_at(a, i);
        double d = 0, x = 0, y = 0;
        for (size_t j = t->offset; j < t->offset + t->numel; j++) {
            d += (double)ga[j] * gb[j];
            x += (double)ga[j] * ga[j];
            y += (double)gb[j] * gb[j];
        }
        double cs = x > 0 && y > 0 ? d / sqrt(x * y) : (x == 0 && y == 0 ? 1 : 0);
        below += cs < 0.999;
        if (cs < worst) worst = cs, worst_name = t->name;
    }
    printf("%s routing, T=%d: loss fp32 weights %.6f, bf16 weights %.6f; worst gradient cosine %.6f (%s), "
           "%d of %d tensors below 0.999\n",
           pinned ? "pinned" : "free", T, la, lb, worst, worst_name, below, lm_model_num_tensors(a));
    free(tok);
    free(tgt);
    lm_model_free(a);
    lm_model_free(b);
    return 0;
}

int main(int argc, char **argv) {
    int T = argc > 1 ? atoi(argv[1]) : 257;
    if (T < 1) {
        fprintf(stderr, "usage: bench_routing_sensitivity [T >= 1]\n");
        return 2;
    }
    return run(T, 0) || run(T, 1);
}
