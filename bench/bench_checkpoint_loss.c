/* The loss of a checkpoint on a given batch: the longmoe side of the check of
 * the PyTorch peer (bench/model_vs_torch.py check, docs/peer.md).
 *
 * Usage: bench_checkpoint_loss CHECKPOINT_DIR TOKENS_FILE B T [LOGPROBS_OUT]
 *
 * CHECKPOINT_DIR is a checkpoint (config.json, model.safetensors and
 * trainer.safetensors, whose balancing biases route, frozen); TOKENS_FILE
 * holds 2*B*T little-endian int32: the inputs [B,T], then the targets [B,T].
 * Prints one line of JSON: the mean cross-entropy of an evaluation forward on
 * the CPU (fp32) and its shape; LOGPROBS_OUT (optional) receives the B*T
 * float32 log-probabilities of the targets. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "longmoe/model.h"
#include "longmoe/train.h"

static int fail(const char *what) {
    fprintf(stderr, "bench_checkpoint_loss: %s\n", what);
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6)
        return fail("usage: bench_checkpoint_loss CHECKPOINT_DIR TOKENS_FILE B T [LOGPROBS_OUT]");
    int B = atoi(argv[3]), T = atoi(argv[4]);
    if (B < 1 || T < 1 || (int64_t)B * T > (1 << 24)) return fail("B and T must be >= 1 (B*T <= 2^24)");
    size_t n = (size_t)B * T;
    int32_t *tok = malloc(2 * n * sizeof *tok);
    float *logp = malloc(n * sizeof *logp);
    if (!tok || !logp) return fail("out of memory");
    FILE *f = fopen(argv[2], "rb");
    if (!f) return fail("cannot open the tokens file");
    size_t got = fread(tok, sizeof *tok, 2 * n, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    if (got != 2 * n || extra) {
        fprintf(stderr, "bench_checkpoint_loss: %s holds %s than 2*B*T = %zu int32\n", argv[2],
                got != 2 * n ? "fewer" : "more", 2 * n);
        return 1;
    }
    lm_config cfg;
    lm_model *m;
    if (lm_checkpoint_load_model(argv[1], B, T, &cfg, &m)) return fail(lm_last_error());
    float loss;
    if (lm_model_forward(m, tok, tok + n, 0, &loss) || lm_model_token_logprobs(m, logp)) {
        fprintf(stderr, "bench_checkpoint_loss: %s\n", lm_last_error());
        lm_model_free(m);
        return 1;
    }
    if (argc == 6) {
        FILE *o = fopen(argv[5], "wb");
        if (!o || fwrite(logp, sizeof *logp, n, o) != n || fclose(o)) return fail("cannot write the log-probabilities");
    }
    printf("{\"loss\": %.9g, \"B\": %d, \"T\": %d, \"params\": %zu}\n", (double)loss, B, T, lm_model_num_params(m));
    lm_model_free(m);
    free(tok);
    free(logp);
    return 0;
}
