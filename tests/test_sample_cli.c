/* `longmoe sample` end to end on a checkpoint of a micro model trained a few
 * steps: greedy output equals the library's greedy decode (with the
 * checkpoint's balancing biases), a run directory resolves to its latest
 * checkpoint, sampling is reproducible by seed, a BPE tokenizer encodes the
 * prompt and decodes the output, and bad flags, a missing checkpoint and a
 * non-byte vocabulary without a tokenizer give clear errors. */
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/model.h"
#include "longmoe/safetensors.h"
#include "longmoe/shards.h"
#include "longmoe/tokenizer.h"
#include "longmoe/train.h"
#include "test.h"
#include "test_models.h"

static char root[256];

static const char *path_in(const char *name) { return test_path(root, name); }

/* Run the CLI with `args`; stdout into *out (NUL-terminated), stderr into err.txt. */
static int run_cli(const char *args, char *out, size_t cap) {
    int rc = test_run_cli(args, path_in("out.txt"), path_in("err.txt"));
    if (out) {
        char *text = test_slurp(path_in("out.txt"), NULL);
        snprintf(out, cap, "%s", text ? text : "");
        free(text);
    }
    return rc;
}

static int stderr_has(const char *phrase) { return test_file_has(path_in("err.txt"), phrase); }

static lm_config micro(int vocab) {
    lm_config c = test_micro_config();
    c.vocab_size = vocab;
    c.first_k_dense = 0;
    c.seq_len = 32;
    c.sign_rate = 0.05f; /* biases visibly away from zero after a few steps */
    return c;
}

static int train(const lm_config *c, const char *run) {
    lm_train_options o = lm_train_options_default(run);
    o.progress = NULL;
    o.steps = 4;
    lm_train_result r;
    lm_status s = lm_train(c, &o, &r);
    CHECK(!s, "train: %s", lm_last_error());
    return s == LM_OK;
}

/* The library's greedy continuation of `prompt` (the checkpoint's biases
 * loaded): n tokens as bytes, or with a tokenizer (may be NULL) its decoded
 * ids, never an id beyond the tokenizer, stopping at end-of-text. */
static void greedy_reference(const char *ckpt, const char *prompt, int n, const lm_tokenizer *tk, char *out) {
    lm_config cfg;
    lm_model *m = NULL;
    out[0] = 0;
    CHECK(!lm_checkpoint_load_model(ckpt, 1, 1, &cfg, &m), "%s", lm_last_error());
    if (!m) return;
    char path[700];
    snprintf(path, sizeof path, "%s/trainer.safetensors", ckpt);
    lm_safetensors *st = NULL;
    CHECK(!lm_safetensors_open(path, &st), "%s", lm_last_error());
    double bias_size = 0;
    for (int i = 0; st && i < lm_model_num_moe_layers(m); i++) {
        char name[96];
        snprintf(name, sizeof name, "layers.%d.moe.bias", lm_model_moe_layer_index(m, i));
        const lm_st_tensor *t = lm_safetensors_find(st, name);
        lm_balance_state *bal = lm_model_balance(m, i);
        CHECK(t && t->numel == bal->cfg.n_experts, "%s present", name);
        if (t) memcpy(bal->bias, t->data, (size_t)t->numel * 4);
        for (int j = 0; j < bal->cfg.n_experts; j++) bias_size += fabs(bal->bias[j]);
    }
    CHECK(bias_size > 0, "the trained biases are not all zero");
    lm_safetensors_close(st);
    int P = (int)strlen(prompt), V = cfg.vocab_size, tv = tk ? lm_tokenizer_vocab_size(tk) : 256;
    int32_t ids[256], *enc = NULL;
    size_t n_enc = 0;
    for (int i = 0; i < P; i++) ids[i] = (unsigned char)prompt[i];
    if (tk) {
        CHECK(!lm_tokenizer_encode(tk, prompt, (size_t)P, &enc, &n_enc), "%s", lm_last_error());
        P = (int)n_enc;
        memcpy(ids, enc, n_enc * sizeof(int32_t));
        free(enc);
    }
    lm_decoder *dec = NULL;
    CHECK(!lm_decoder_create(m, 1, P + n, &dec), "%s", lm_last_error());
    float logits[512];
    CHECK(!lm_decoder_prefill(dec, ids, P, logits), "%s", lm_last_error());
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        int32_t tok;
        for (int j = tv; j < V; j++) logits[j] = -INFINITY;
        lm_sample_token(logits, V, 0.0f, 1.0f, NULL, NULL, &tok);
        if (tk && tok == lm_tokenizer_eot_id(tk)) break;
        if (tk) {
            size_t k;
            const uint8_t *b = lm_tokenizer_token(tk, tok, &k);
            memcpy(out + len, b, k);
            len += k;
        } else {
            out[len++] = (char)tok;
        }
        if (i + 1 < n) CHECK(!lm_decoder_step(dec, &tok, logits), "%s", lm_last_error());
    }
    out[len] = 0;
    lm_decoder_free(dec);
    lm_model_free(m);
}

static void test_greedy_equals_library_and_run_dir_resolves(void) {
    lm_config c = micro(256);
    if (!train(&c, path_in("run"))) return;
    char latest[64] = {0}, ckpt[600], args[1200], out[512], want[64];
    FILE *f = fopen(path_in("run/latest"), "r");
    CHECK(f && fscanf(f, "%63s", latest) == 1, "latest");
    if (f) fclose(f);
    snprintf(ckpt, sizeof ckpt, "%s/%s", path_in("run"), latest);
    greedy_reference(ckpt, "ab", 20, NULL, want);
    /* greedy bytes can be anything; compare those that survive the shell: all of them via the file */
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt ab --max-tokens 20 --quiet", ckpt);
    CHECK(run_cli(args, out, sizeof out) == 0, "exit code");
    CHECK(strlen(out) >= 1 && out[strlen(out) - 1] == '\n', "ends with a newline");
    CHECK(!memcmp(out, want, 20) && out[20] == '\n', "CLI greedy output differs from the library's");
    /* the run directory gives the same (its latest checkpoint) */
    char out2[512];
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt ab --max-tokens 20", path_in("run"));
    CHECK(run_cli(args, out2, sizeof out2) == 0, "exit code");
    CHECK(!strcmp(out, out2), "run directory vs checkpoint directory");
    CHECK(stderr_has("2 prompt tokens") && stderr_has("20 generated"), "statistics line");
    /* sampling: the same seed gives the same bytes; 40 bytes of another seed differ */
    char s1[512], s2[512], s3[512];
    const char *flags = "--prompt xyz --max-tokens 40 --temperature 1.5 --top-p 0.95 --quiet";
    snprintf(args, sizeof args, "sample --checkpoint %s %s --seed 3", ckpt, flags);
    CHECK(run_cli(args, s1, sizeof s1) == 0, "exit code");
    CHECK(run_cli(args, s2, sizeof s2) == 0, "exit code");
    CHECK(!memcmp(s1, s2, 41), "same seed, different bytes");
    snprintf(args, sizeof args, "sample --checkpoint %s %s --seed 4", ckpt, flags);
    CHECK(run_cli(args, s3, sizeof s3) == 0, "exit code");
    CHECK(memcmp(s1, s3, 40) != 0, "seeds 3 and 4 gave the same 40 bytes");
}

static void test_errors_are_clear(void) {
    char args[1200];
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi", path_in("nowhere"));
    CHECK(run_cli(args, NULL, 0) == 1 && stderr_has("no checkpoint at"), "missing checkpoint");
    CHECK(run_cli("sample --prompt hi", NULL, 0) == 2 && stderr_has("--checkpoint and --prompt are required"),
          "no --checkpoint");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi --top-p 0", path_in("run"));
    CHECK(run_cli(args, NULL, 0) != 0 && stderr_has("--top-p must lie in (0, 1]"), "top-p 0");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi --temperature -1", path_in("run"));
    CHECK(run_cli(args, NULL, 0) != 0 && stderr_has("--temperature must be >= 0"), "negative temperature");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi --max-tokens 0", path_in("run"));
    CHECK(run_cli(args, NULL, 0) == 2 && stderr_has("--max-tokens must lie in"), "max-tokens 0");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi --max-tokens 5x", path_in("run"));
    CHECK(run_cli(args, NULL, 0) == 2 && stderr_has("expects an integer"), "max-tokens 5x");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt ''", path_in("run"));
    CHECK(run_cli(args, NULL, 0) == 2 && stderr_has("--prompt is empty"), "empty prompt");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi --bogus", path_in("run"));
    CHECK(run_cli(args, NULL, 0) == 2 && stderr_has("unknown option '--bogus'"), "unknown flag");
    /* a vocabulary other than bytes */
    lm_config c = micro(300);
    if (!train(&c, path_in("run300"))) return;
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi", path_in("run300"));
    CHECK(run_cli(args, NULL, 0) == 1 && stderr_has("has 300 tokens, not the 256 bytes") &&
          stderr_has("pass --tokenizer"), "vocab 300");
}

/* With --tokenizer: the prompt is encoded, ids beyond the tokenizer are never
 * drawn, tokens are printed as their bytes: equal to the library's greedy
 * decode; a tokenizer larger than the model's vocabulary is refused. */
static void test_tokenizer(void) {
    const char *text = "the cat sat on the mat. the dog sat on the log. a cat and a dog met on the mat. ";
    const void *texts[1] = {text};
    size_t lens[1] = {strlen(text)};
    lm_tokenizer *tk = NULL;
    CHECK(!lm_tokenizer_train(texts, lens, 1, 280, 1, &tk), "%s", lm_last_error());
    if (!tk) return;
    CHECK(lm_tokenizer_vocab_size(tk) > 257 && lm_tokenizer_vocab_size(tk) <= 280, "vocab %d",
          lm_tokenizer_vocab_size(tk));
    CHECK(!lm_tokenizer_save(tk, path_in("tok.json")), "%s", lm_last_error());
    char args[1200], out[1024], want[1024], ckpt[600], latest[64] = {0};
    FILE *f = fopen(path_in("run300/latest"), "r");
    CHECK(f && fscanf(f, "%63s", latest) == 1, "latest");
    if (f) fclose(f);
    snprintf(ckpt, sizeof ckpt, "%s/%s", path_in("run300"), latest);
    greedy_reference(ckpt, "the cat sat", 12, tk, want);
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt 'the cat sat' --max-tokens 12 --tokenizer %s --quiet",
             ckpt, path_in("tok.json"));
    CHECK(run_cli(args, out, sizeof out) == 0, "exit code");
    size_t n = strlen(want);
    CHECK(n > 0, "the greedy continuation is empty");
    CHECK(strlen(out) == n + 1 && !memcmp(out, want, n) && out[n] == '\n', "CLI '%s' vs library '%s'", out, want);
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi --tokenizer %s", path_in("run"),
             path_in("tok.json"));
    CHECK(run_cli(args, NULL, 0) == 1 && stderr_has("only 256"), "tokenizer larger than the model");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt hi --tokenizer %s", path_in("run300"),
             path_in("missing.json"));
    CHECK(run_cli(args, NULL, 0) == 1 && stderr_has("missing.json"), "missing tokenizer");
    lm_tokenizer_free(tk);
}

/* A tokenizer other than the one the training data was prepared with is
 * refused, naming both; the right one is accepted, and a vocabulary smaller
 * than the model's is stated (its extra ids are never drawn). */
static void test_tokenizer_of_the_training_data(void) {
    char text[2][4096];
    const char *base[2] = {"the cat sat on the mat and the dog sat on the log. ", "seven quick zebras jump over lazy wolves. "};
    for (int d = 0; d < 2; d++) {
        text[d][0] = 0;
        while (strlen(text[d]) + strlen(base[d]) < sizeof text[d]) strcat(text[d], base[d]);
    }
    lm_tokenizer *tk[2] = {NULL, NULL};
    for (int d = 0; d < 2; d++) {
        const void *texts[1] = {text[d]};
        size_t lens[1] = {strlen(text[d])};
        CHECK(!lm_tokenizer_train(texts, lens, 1, 270, 1, &tk[d]), "%s", lm_last_error());
    }
    if (!tk[0] || !tk[1]) return;
    CHECK(!lm_tokenizer_save(tk[0], path_in("data_tok.json")) && !lm_tokenizer_save(tk[1], path_in("other_tok.json")),
          "%s", lm_last_error());
    FILE *f = fopen(path_in("doc.txt"), "w");
    CHECK(f != NULL, "doc.txt");
    if (!f) return;
    fputs(text[0], f);
    fclose(f);
    const char *inputs[1] = {path_in("doc.txt")};
    lm_prepare_stats st;
    CHECK(!lm_shards_prepare(inputs, 1, tk[0], path_in("shards"), 4000, 0.1, &st), "%s", lm_last_error());
    lm_config c = micro(300);
    snprintf(c.data, sizeof c.data, "shards:%s", path_in("shards"));
    CHECK(strlen(path_in("shards")) + 7 < sizeof c.data, "the temporary path is too long for a data spec");
    if (!train(&c, path_in("runshards"))) return;
    char args[1200];
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt 'the cat' --max-tokens 4 --tokenizer %s",
             path_in("runshards"), path_in("other_tok.json"));
    CHECK(run_cli(args, NULL, 0) == 1 && stderr_has("is not the one the checkpoint's training data") &&
              stderr_has("other_tok.json") && stderr_has("shards/tokenizer.json"),
          "another tokenizer was accepted");
    snprintf(args, sizeof args, "sample --checkpoint %s --prompt 'the cat' --max-tokens 4 --tokenizer %s",
             path_in("runshards"), path_in("data_tok.json"));
    CHECK(run_cli(args, NULL, 0) == 0 && stderr_has("are never drawn"), "the data's tokenizer: exit or note");
    lm_tokenizer_free(tk[0]);
    lm_tokenizer_free(tk[1]);
}

int main(void) {
    if (test_make_tmpdir(root, sizeof root, "sample")) return 1;
    RUN(test_greedy_equals_library_and_run_dir_resolves);
    RUN(test_errors_are_clear);
    RUN(test_tokenizer);
    RUN(test_tokenizer_of_the_training_data);
    test_remove_tree(root);
    return test_summary();
}
