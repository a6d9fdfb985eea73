/* Decoding speed of a preset (random initialisation; speed does not depend on
 * the weights): prefill tokens/s for a prompt, then decode tokens/s measured
 * at growing context lengths, and the cache memory (fixed + per token).
 * Usage: bench_decode [preset] [prompt_tokens] [decode_tokens] */
#include <stdio.h>
#include <stdlib.h>

#include "longmoe/model.h"

int main(int argc, char **argv) {
    const char *preset = argc > 1 ? argv[1] : "configs/tiny.json";
    int P = argc > 2 ? atoi(argv[2]) : 1024, n = argc > 3 ? atoi(argv[3]) : 1024;
    lm_config c;
    lm_model *m = NULL;
    lm_decoder *dec = NULL;
    if (lm_config_load(preset, &c) || lm_model_create(&c, 1, 1, &m) || lm_decoder_create(m, 1, P + n, &dec)) {
        fprintf(stderr, "%s\n", lm_last_error());
        return 1;
    }
    lm_model_init(m, 1);
    const int V = c.vocab_size;
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)P);
    float *logits = malloc(sizeof(float) * (size_t)V);
    lm_rng rng;
    lm_rng_seed(&rng, 2);
    for (int i = 0; i < P; i++) tokens[i] = (int32_t)(lm_rng_u64(&rng) % (uint64_t)V);
    double t0 = lm_time_seconds();
    if (lm_decoder_prefill(dec, tokens, P, logits)) {
        fprintf(stderr, "%s\n", lm_last_error());
        return 1;
    }
    double t1 = lm_time_seconds();
    size_t fixed, per_token;
    lm_decoder_cache_bytes(dec, &fixed, &per_token);
    printf("%s: prefill %d tokens in %.1f ms (%.0f tokens/s); cache %zu bytes fixed + %zu bytes per token\n",
           preset, P, 1e3 * (t1 - t0), P / (t1 - t0), fixed, per_token);
    printf("| context | decode tokens/s |\n|---|---|\n");
    int32_t tok = 0;
    int done = 0, window = n / 8 > 0 ? n / 8 : 1;
    while (done < n) {
        int k = n - done < window ? n - done : window;
        double s0 = lm_time_seconds();
        for (int i = 0; i < k; i++) {
            lm_sample_token(logits, V, 0.0f, 1.0f, NULL, NULL, &tok);
            if (lm_decoder_step(dec, &tok, logits)) {
                fprintf(stderr, "%s\n", lm_last_error());
                return 1;
            }
        }
        done += k;
        printf("| %d | %.0f |\n", P + done, k / (lm_time_seconds() - s0));
    }
    lm_decoder_free(dec);
    lm_model_free(m);
    free(tokens);
    free(logits);
    return 0;
}
