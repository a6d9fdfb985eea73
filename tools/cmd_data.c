/* `longmoe data prepare`: tokenize text files into llm.c-format shards. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "files.h"
#include "longmoe/shards.h"

static const char *const data_usage =
    "usage: longmoe data prepare --input FILE... --tokenizer TOK.json --out DIR\n"
    "                            [--shard-tokens N] [--val-fraction F]\n"
    "\n"
    "Tokenizes each FILE as one document (the <|endoftext|> id, then its tokens), concatenates\n"
    "them, and writes DIR/val_000000.bin ... (the first F of the tokens) and DIR/train_000000.bin\n"
    "... (the rest), at most N tokens per shard, plus DIR/tokenizer.json. Shards are in llm.c's\n"
    "format (docs/data.md): a 256 x int32 header (magic 20240520 with uint16 tokens when the\n"
    "vocabulary has at most 65536 entries, else 20240801 with uint32), then the tokens; each is\n"
    "written atomically. DIR is created when missing; a DIR that holds shards is refused.\n"
    "Training reads DIR with --data shards:DIR (validation: shards-val:DIR).\n"
    "\n"
    "options:\n"
    "  --shard-tokens N  tokens per shard (default 100000000)\n"
    "  --val-fraction F  share of the tokens for validation, in [0, 1) (default 0.01)\n";

static int data_prepare(int argc, char **argv) {
    const char *cmd = "data prepare", *tok_path = NULL, *out = NULL;
    long shard_tokens = 100000000;
    double val_fraction = 0.01;
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    int n_inputs = 0, rc = 2;
    if (!inputs) return cli_fail(cmd, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--input")) {
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2)) inputs[n_inputs++] = argv[++i];
        } else if (!strcmp(a, "--tokenizer")) {
            if (!(tok_path = cli_value(cmd, argc, argv, &i))) goto done;
        } else if (!strcmp(a, "--out")) {
            if (!(out = cli_value(cmd, argc, argv, &i))) goto done;
        } else if (!strcmp(a, "--shard-tokens")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 2, 2147483647L, &shard_tokens))
                goto done;
        } else if (!strcmp(a, "--val-fraction")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &val_fraction)) goto done;
            if (val_fraction < 0 || val_fraction >= 1) {
                cli_fail(cmd, "--val-fraction must lie in [0, 1), got %g", val_fraction);
                goto done;
            }
        } else {
            cli_fail(cmd, "unknown option '%s' (see longmoe data --help)", a);
            goto done;
        }
    }
    if (!n_inputs || !tok_path || !out) {
        cli_fail(cmd, "--input FILE..., --tokenizer TOK.json and --out DIR are required");
        goto done;
    }
    char tok_out[4200];
    snprintf(tok_out, sizeof tok_out, "%s/tokenizer.json", out);
    for (int k = 0; k < n_inputs; k++)
        if (lm_same_file(inputs[k], tok_out)) {
            cli_fail(cmd, "--input '%s' is the DIR/tokenizer.json that data prepare writes (choose another --out)",
                     inputs[k]);
            goto done;
        }
    rc = 1;
    lm_tokenizer *tok = NULL;
    lm_prepare_stats st;
    lm_status s = lm_tokenizer_load(tok_path, &tok);
    if (!s) s = lm_shards_prepare(inputs, n_inputs, tok, out, shard_tokens, val_fraction, &st);
    if (s) {
        cli_fail(cmd, "%s", lm_last_error());
    } else {
        printf("%d file(s), %lld bytes -> %lld tokens (%.2f bytes/token) in %.2f s: %lld val tokens in %d shard(s), "
               "%lld train tokens in %d shard(s); vocab %d (%s tokens); wrote %s\n",
               n_inputs, (long long)st.bytes, (long long)st.tokens,
               st.tokens ? (double)st.bytes / (double)st.tokens : 0.0, st.seconds, (long long)st.val_tokens,
               st.val_shards, (long long)st.train_tokens, st.train_shards, lm_tokenizer_vocab_size(tok),
               lm_tokenizer_vocab_size(tok) > LM_SHARD_U16_MAX_VOCAB ? "uint32" : "uint16", out);
        rc = 0;
    }
    lm_tokenizer_free(tok);
done:
    free(inputs);
    return rc;
}

int cmd_data(int argc, char **argv) {
    int rc = cli_group_help(argc, argv, data_usage);
    if (rc >= 0) return rc;
    if (!strcmp(argv[1], "prepare")) return data_prepare(argc - 1, argv + 1);
    cli_fail("data", "unknown subcommand '%s' (prepare)", argv[1]);
    return 2;
}
