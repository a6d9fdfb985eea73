/* `longmoe sample`: continue a prompt with a trained checkpoint: chunked
 * prefill of the prompt, then one token per step with the KDA recurrent
 * states and the attention caches (docs/sampling.md). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "files.h"
#include "longmoe/model.h"
#include "longmoe/safetensors.h"
#include "longmoe/tokenizer.h"
#include "longmoe/train.h"

static const char *const sample_usage =
    "usage: longmoe sample --checkpoint DIR --prompt TEXT [--max-tokens N] [--temperature X]\n"
    "                      [--top-p P] [--seed S] [--tokenizer TOK.json] [--quiet]\n"
    "\n"
    "Continues TEXT with the model of DIR (a checkpoint-<step> directory, or a run directory:\n"
    "its `latest` checkpoint) and prints the continuation on stdout. The prompt is run once\n"
    "through the chunked forward (prefill); each new token is then one decode step with the\n"
    "KDA recurrent states and the MLA latent (or GQA key/value) cache. Without --tokenizer the\n"
    "tokens are bytes (the checkpoint's vocabulary must be 256).\n"
    "\n"
    "options:\n"
    "  --max-tokens N   tokens to generate (default 64)\n"
    "  --temperature X  0 (default): greedy; otherwise sample from softmax(logits / X)\n"
    "  --top-p P        nucleus sampling: only the most likely tokens of total mass >= P\n"
    "                   (0 < P <= 1, default 1: all)\n"
    "  --seed S         seed of the sampler (default 1); the same seed gives the same text\n"
    "  --tokenizer F    the byte-level BPE tokenizer (`longmoe tokenizer train`) of the model's\n"
    "                   training data; generation stops at its end-of-text token. A tokenizer\n"
    "                   other than the one in the training data's shards directory (when it is\n"
    "                   still there) is refused; ids beyond a smaller tokenizer are never drawn\n"
    "  --quiet          no statistics line on stderr\n";

static int is_file(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* 1 when a and b are the same tokenizer: the same merges in the same order. */
static int same_tokenizer(const lm_tokenizer *a, const lm_tokenizer *b) {
    int V = lm_tokenizer_vocab_size(a);
    if (V != lm_tokenizer_vocab_size(b)) return 0;
    for (int k = 0; k + 257 < V; k++) {
        int32_t al, ar, bl, br;
        if (lm_tokenizer_merge(a, k, &al, &ar) || lm_tokenizer_merge(b, k, &bl, &br) || al != bl || ar != br) return 0;
    }
    return 1;
}

/* The tokenizer the checkpoint's training data was prepared with (tokenizer.json
 * of every shards directory its stages read, where that directory is still
 * there) must be `tok`: a mismatch is refused, naming both files. */
static int check_data_tokenizer(const char *cmd, const lm_config *cfg, const lm_tokenizer *tok, const char *tok_path) {
    lm_stage st[LM_MAX_STAGES];
    int n = lm_config_stages(cfg, st);
    for (int i = 0; i < n; i++) {
        int nd = st[i].n_data ? st[i].n_data : 1;
        for (int j = 0; j < nd; j++) {
            const char *spec = st[i].n_data ? st[i].data[j] : cfg->data;
            const char *dir = !strncmp(spec, "shards:", 7)       ? spec + 7
                              : !strncmp(spec, "shards-val:", 11) ? spec + 11
                                                                  : NULL;
            if (!dir) continue;
            char path[200];
            snprintf(path, sizeof path, "%s/tokenizer.json", dir);
            struct stat sb;
            if (stat(path, &sb) != 0) continue; /* the data is gone: nothing to compare with */
            lm_tokenizer *data_tok = NULL;
            if (lm_tokenizer_load(path, &data_tok)) return cli_fail(cmd, "%s", lm_last_error());
            int same = same_tokenizer(tok, data_tok);
            int dv = lm_tokenizer_vocab_size(data_tok);
            lm_tokenizer_free(data_tok);
            if (!same)
                return cli_fail(cmd, "the tokenizer %s (%d ids) is not the one the checkpoint's training data %s was "
                                "prepared with (%s, %d ids): pass --tokenizer %s",
                                tok_path, lm_tokenizer_vocab_size(tok), spec, path, dv, path);
        }
    }
    return 0;
}

/* DIR itself when it holds model.safetensors, else DIR/<the name in DIR/latest>. */
static int resolve_checkpoint(const char *cmd, const char *dir, char *out, size_t n) {
    char path[4400];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (is_file(path)) {
        snprintf(out, n, "%s", dir);
        return 0;
    }
    snprintf(path, sizeof path, "%s/latest", dir);
    char name[256] = {0}, *text = NULL;
    int ok = !lm_read_file(path, LM_TEXT_FILE_MAX, &text, NULL) && sscanf(text, "%255s", name) == 1;
    free(text);
    if (!ok)
        return cli_fail(cmd, "no checkpoint at '%s': neither %s/model.safetensors nor %s/latest exists (pass a "
                        "checkpoint-<step> directory or a run directory)", dir, dir, dir);
    snprintf(out, n, "%s/%s", dir, name);
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    if (!is_file(path)) return cli_fail(cmd, "'%s/latest' names '%s', which has no model.safetensors", dir, name);
    return 0;
}

/* The balancing biases of the MoE layers (trainer.safetensors); they take part
 * in routing. Without the file the biases stay zero (with a warning). */

int cmd_sample(int argc, char **argv) {
    const char *cmd = "sample", *dir = NULL, *prompt = NULL, *tok_path = NULL, *v;
    long max_tokens = 64, seed = 1;
    double temperature = 0, top_p = 1;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(sample_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint")) {
            if (!(dir = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--prompt")) {
            if (!(prompt = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--max-tokens")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 1L << 20, &max_tokens)) return 2;
        } else if (!strcmp(a, "--temperature")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &temperature)) return 2;
            if (temperature < 0) return cli_fail(cmd, "--temperature must be >= 0, got %g", temperature) + 1;
        } else if (!strcmp(a, "--top-p")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &top_p)) return 2;
            if (!(top_p > 0 && top_p <= 1)) return cli_fail(cmd, "--top-p must lie in (0, 1], got %g", top_p) + 1;
        } else if (!strcmp(a, "--seed")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 0, 0x7fffffffL, &seed)) return 2;
        } else if (!strcmp(a, "--tokenizer")) {
            if (!(tok_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--quiet")) {
            quiet = 1;
        } else {
            cli_fail(cmd, "unknown option '%s' (see --help)", a);
            return 2;
        }
    }
    if (!dir || !prompt) {
        cli_fail(cmd, "--checkpoint and --prompt are required (see --help)");
        return 2;
    }
    size_t n_prompt = strlen(prompt);
    if (n_prompt == 0) {
        cli_fail(cmd, "--prompt is empty: the model needs at least one token to continue");
        return 2;
    }
    char ckpt[4200], path[4300];
    if (resolve_checkpoint(cmd, dir, ckpt, sizeof ckpt)) return 1;
    lm_config cfg;
    lm_config_defaults(&cfg);
    snprintf(path, sizeof path, "%s/config.json", ckpt);
    if (lm_config_load(path, &cfg)) return cli_fail(cmd, "%s", lm_last_error());
    if (!tok_path && cfg.vocab_size != 256)
        return cli_fail(cmd, "the checkpoint's vocabulary has %d tokens, not the 256 bytes this command encodes "
                        "without a tokenizer: pass --tokenizer TOK.json, the tokenizer of its training data",
                        cfg.vocab_size);
    /* the prompt's ids: its bytes, or its BPE encoding */
    lm_tokenizer *tok = NULL;
    int32_t *ids = NULL;
    int tok_vocab = 256, eot = -1;
    if (tok_path) {
        if (lm_tokenizer_load(tok_path, &tok)) return cli_fail(cmd, "%s", lm_last_error());
        tok_vocab = lm_tokenizer_vocab_size(tok);
        eot = lm_tokenizer_eot_id(tok);
        if (tok_vocab > cfg.vocab_size) {
            lm_tokenizer_free(tok);
            return cli_fail(cmd, "the tokenizer %s has %d ids but the checkpoint's vocabulary has only %d", tok_path,
                            tok_vocab, cfg.vocab_size);
        }
        if (check_data_tokenizer(cmd, &cfg, tok, tok_path)) {
            lm_tokenizer_free(tok);
            return 1;
        }
        if (tok_vocab < cfg.vocab_size)
            fprintf(stderr,
                    "longmoe %s: note: the tokenizer %s has %d ids and the checkpoint's vocabulary %d: ids %d..%d have no "
                    "bytes and are never drawn\n",
                    cmd, tok_path, tok_vocab, cfg.vocab_size, tok_vocab, cfg.vocab_size - 1);
        if (lm_tokenizer_encode(tok, prompt, n_prompt, &ids, &n_prompt)) {
            lm_tokenizer_free(tok);
            return cli_fail(cmd, "%s", lm_last_error());
        }
    } else {
        ids = malloc(n_prompt * sizeof(int32_t));
        for (size_t i = 0; ids && i < n_prompt; i++) ids[i] = (unsigned char)prompt[i];
    }
    const int64_t max_T = (int64_t)n_prompt + max_tokens;
    if (max_T > (1 << 26)) {
        lm_tokenizer_free(tok);
        free(ids);
        return cli_fail(cmd, "prompt (%zu tokens) + --max-tokens is too long", n_prompt);
    }

    /* the model for one token (the decoder plans its own buffers), its biases, the decoder */
    lm_model *m = NULL;
    int rc = 0;
    if (lm_checkpoint_load_model(ckpt, 1, 1, &cfg, &m)) rc = cli_fail(cmd, "%s", lm_last_error());
    lm_decoder *dec = NULL;
    float *logits = malloc((size_t)cfg.vocab_size * sizeof(float));
    void *work = malloc(lm_sample_work_bytes(cfg.vocab_size));
    if (!rc && (!logits || !work || !ids)) rc = cli_fail(cmd, "out of memory");
    if (!rc && lm_decoder_create(m, 1, (int)max_T, &dec)) rc = cli_fail(cmd, "%s", lm_last_error());
    if (rc) goto done;

    lm_rng rng;
    lm_rng_seed(&rng, (uint64_t)seed);
    double t0 = lm_time_seconds();
    if (lm_decoder_prefill(dec, ids, (int)n_prompt, logits)) {
        rc = cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    double t1 = lm_time_seconds();
    long produced = 0;
    for (; produced < max_tokens; produced++) {
        int32_t id;
        /* ids the tokenizer cannot decode (a vocabulary padded beyond it) are never drawn */
        for (int j = tok_vocab; j < cfg.vocab_size; j++) logits[j] = -INFINITY;
        if (lm_sample_token(logits, cfg.vocab_size, (float)temperature, (float)top_p, &rng, work, &id)) {
            rc = cli_fail(cmd, "%s", lm_last_error());
            break;
        }
        if (id == eot) break;
        if (tok) {
            size_t len;
            const uint8_t *bytes = lm_tokenizer_token(tok, id, &len);
            if (bytes) fwrite(bytes, 1, len, stdout);
        } else {
            putchar((unsigned char)id);
        }
        fflush(stdout);
        if (produced + 1 < max_tokens && lm_decoder_step(dec, &id, logits)) {
            rc = cli_fail(cmd, "%s", lm_last_error());
            break;
        }
    }
    putchar('\n');
    double t2 = lm_time_seconds();
    if (!quiet && !rc) {
        size_t fixed, per_token;
        lm_decoder_cache_bytes(dec, &fixed, &per_token);
        fprintf(stderr,
                "longmoe sample: %zu prompt tokens (prefill %.1f ms), %ld generated (%.1f tokens/s); cache %.1f KiB "
                "fixed + %zu bytes per token\n",
                n_prompt, 1e3 * (t1 - t0), produced, produced > 1 ? (produced - 1) / (t2 - t1) : 0.0,
                fixed / 1024.0, per_token);
    }
done:
    lm_decoder_free(dec);
    lm_model_free(m);
    free(logits);
    free(work);
    free(ids);
    lm_tokenizer_free(tok);
    return rc;
}
