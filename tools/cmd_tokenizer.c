/* `longmoe tokenizer train|encode|decode`: the byte-level BPE tokenizer. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "files.h"
#include "longmoe/tokenizer.h"

static const char *const tokenizer_usage =
    "usage: longmoe tokenizer train --input FILE... --vocab N --out TOK.json [--min-frequency F]\n"
    "       longmoe tokenizer encode --tokenizer TOK.json [--input FILE]\n"
    "       longmoe tokenizer decode --tokenizer TOK.json [--input FILE]\n"
    "\n"
    "Byte-level BPE (docs/data.md). Ids 0..255 are bytes, 256.. are merges, the last id is\n"
    "<|endoftext|>. Any bytes round-trip. TOK.json is in the Hugging Face `tokenizers` format:\n"
    "tokenizers.Tokenizer.from_file(\"TOK.json\") gives the same ids for any UTF-8 text.\n"
    "\n"
    "train    learn merges from the files (each read whole) until the vocabulary has N entries\n"
    "         (257 = bytes only) or no pair occurs F times (default 2); prints the size reached\n"
    "encode   bytes of FILE (default: standard input) -> ids, space-separated, on one line\n"
    "decode   whitespace-separated ids from FILE (default: standard input) -> bytes on standard output\n";

static int tokenizer_train(int argc, char **argv) {
    const char *cmd = "tokenizer train", *out = NULL;
    long vocab = 0, min_freq = 2;
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    int n_inputs = 0, rc = 2;
    if (!inputs) return cli_fail(cmd, "out of memory");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--input")) {
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2)) inputs[n_inputs++] = argv[++i];
        } else if (!strcmp(a, "--vocab")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) ||
                cli_parse_int(cmd, a, v, LM_TOKENIZER_MIN_VOCAB, LM_TOKENIZER_MAX_VOCAB, &vocab))
                goto done;
        } else if (!strcmp(a, "--min-frequency")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 1L << 40, &min_freq)) goto done;
        } else if (!strcmp(a, "--out")) {
            if (!(out = cli_value(cmd, argc, argv, &i))) goto done;
        } else {
            cli_fail(cmd, "unknown option '%s' (see longmoe tokenizer --help)", a);
            goto done;
        }
    }
    if (n_inputs <= 0 || !vocab || !out) {
        cli_fail(cmd, "--input FILE..., --vocab N and --out TOK.json are required");
        goto done;
    }
    for (int k = 0; k < n_inputs; k++)
        if (lm_same_file(inputs[k], out)) {
            cli_fail(cmd, "--out '%s' is also an --input: writing it would destroy the input (choose another --out)",
                     out);
            goto done;
        }
    rc = 1;
    char **texts = calloc((size_t)n_inputs, sizeof *texts);
    size_t *lens = calloc((size_t)n_inputs, sizeof *lens), total = 0;
    lm_status st = texts && lens ? LM_OK : lm_error(LM_ERR_MEMORY, "out of memory");
    for (int k = 0; k < n_inputs && !st; k++) {
        st = lm_read_file(inputs[k], 0, &texts[k], &lens[k]);
        total += lens[k];
    }
    lm_tokenizer *tok = NULL;
    double t0 = lm_time_seconds();
    if (!st) st = lm_tokenizer_train((const void *const *)texts, lens, n_inputs, (int)vocab, min_freq, &tok);
    double dt = lm_time_seconds() - t0;
    if (!st) st = lm_tokenizer_save(tok, out);
    if (st) {
        cli_fail(cmd, "%s", lm_last_error());
    } else {
        int V = lm_tokenizer_vocab_size(tok);
        printf("trained on %zu bytes of %d file(s) in %.2f s: vocab %d (%d merges)%s; wrote %s\n", total, n_inputs,
               dt, V, V - 257, V < vocab ? ", fewer than asked: no more pairs reach --min-frequency" : "", out);
        rc = 0;
    }
    lm_tokenizer_free(tok);
    for (int k = 0; texts && k < n_inputs; k++) free(texts[k]);
    free(texts);
    free(lens);
done:
    free(inputs);
    return rc;
}

static int tokenizer_encode_decode(int argc, char **argv, int encode) {
    const char *cmd = encode ? "tokenizer encode" : "tokenizer decode", *path = NULL, *input = "-";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--tokenizer")) {
            if (!(path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--input")) {
            if (!(input = cli_value(cmd, argc, argv, &i))) return 2;
        } else {
            cli_fail(cmd, "unknown option '%s' (see longmoe tokenizer --help)", a);
            return 2;
        }
    }
    if (!path) {
        cli_fail(cmd, "--tokenizer TOK.json is required");
        return 2;
    }
    lm_tokenizer *tok = NULL;
    char *text = NULL, *bytes = NULL;
    size_t len = 0, n = 0, cap = 0;
    int32_t *ids = NULL;
    lm_status st = lm_tokenizer_load(path, &tok);
    if (!st) st = lm_read_file(input, 0, &text, &len);
    if (!st && encode) {
        st = lm_tokenizer_encode(tok, text, len, &ids, &n);
        for (size_t i = 0; !st && i < n; i++) printf(i ? " %d" : "%d", (int)ids[i]);
        if (!st) putchar('\n');
    } else if (!st) {
        const char *p = text;
        while (!st) {
            while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
            if (!*p) break;
            char *end;
            errno = 0;
            long v = strtol(p, &end, 10);
            if (end == p || errno || v < 0 || v > 0x7fffffff) {
                st = lm_error(LM_ERR_ARG, "%s: expected a non-negative integer id at byte %zu", input,
                              (size_t)(p - text));
                break;
            }
            if (n == cap) {
                cap = cap ? 2 * cap : 1024;
                int32_t *q = realloc(ids, cap * sizeof *ids);
                if (!q) {
                    st = lm_error(LM_ERR_MEMORY, "out of memory");
                    break;
                }
                ids = q;
            }
            ids[n++] = (int32_t)v;
            p = end;
        }
        if (!st) st = lm_tokenizer_decode(tok, ids, n, &bytes, &len);
        if (!st && fwrite(bytes, 1, len, stdout) != len) st = lm_error(LM_ERR_IO, "writing standard output failed");
    }
    if (st) cli_fail(cmd, "%s", lm_last_error());
    free(text);
    free(bytes);
    free(ids);
    lm_tokenizer_free(tok);
    return st ? 1 : 0;
}

int cmd_tokenizer(int argc, char **argv) {
    int rc = cli_group_help(argc, argv, tokenizer_usage);
    if (rc >= 0) return rc;
    if (!strcmp(argv[1], "train")) return tokenizer_train(argc - 1, argv + 1);
    if (!strcmp(argv[1], "encode")) return tokenizer_encode_decode(argc - 1, argv + 1, 1);
    if (!strcmp(argv[1], "decode")) return tokenizer_encode_decode(argc - 1, argv + 1, 0);
    cli_fail("tokenizer", "unknown subcommand '%s' (train, encode or decode)", argv[1]);
    return 2;
}
