/* The bad input catalogue (docs/RELIABILITY.md): every row is one kind of bad
 * value in one input of the CLI (flags, config JSON, safetensors inputs of
 * `op`, checkpoints, metrics). The test runs each row through the real binary
 * and checks the exit code (2: bad usage, 1: a bad file or value found while
 * running, 0: tolerated) and that stderr holds the row's message fragment.
 * `test_bad_inputs --markdown` prints the table for the document. */
#define _POSIX_C_SOURCE 200809L
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/safetensors.h"
#include "test.h"

static char root[256];

static const char micro_config[] =
    "{\"model\": {\"d_model\": 8, \"n_layers\": 2, \"layout\": \"km\", \"first_k_dense\": 1, \"dense_ffn\": 8},\n"
    " \"kda\": {\"heads\": 1, \"head_dim\": 8, \"chunk\": 16},\n"
    " \"attention\": {\"heads\": 1, \"q_lora_rank\": 4, \"kv_lora_rank\": 4, \"qk_head_dim\": 8, \"v_head_dim\": 8},\n"
    " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 4, \"shared_ffn\": 4, \"balance_bins\": 16},\n"
    " \"train\": {\"seq_len\": 16, \"batch_size\": 2, \"steps\": 2, \"eval_every\": 0, \"log_every\": 1000,\n"
    "           \"ckpt_every\": 1, \"keep_checkpoints\": 2}}\n";

static void spit(const char *path, const char *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(bytes, 1, n, f);
    fclose(f);
}

static void sh(const char *fmt, const char *a, const char *b) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, fmt, a, b);
    if (system(cmd) != 0) fprintf(stderr, "  setup command failed: %s\n", cmd);
}

/* ---- setups: each makes the row's files in its directory d ---- */

static void put_config(const char *d) {
    char p[600];
    snprintf(p, sizeof p, "%s/micro.json", d);
    spit(p, micro_config, strlen(micro_config));
}

/* A finished two-step run in d/run (copied from the one made at start-up). */
static void put_run(const char *d) {
    put_config(d);
    sh("cp -r '%s/base' '%s/run'", root, d);
}

static void run_without_latest(const char *d) {
    put_run(d);
    sh("rm '%s/run/latest'%s", d, "");
}

static void latest_garbage(const char *d) {
    put_run(d);
    sh("echo ../../etc > '%s/run/latest'%s", d, "");
}

static void latest_missing_dir(const char *d) {
    put_run(d);
    sh("echo checkpoint-00000099 > '%s/run/latest'%s", d, "");
}

static void model_truncated(const char *d) {
    put_run(d);
    sh("truncate -s 1000 '%s/run/checkpoint-00000002/model.safetensors'%s", d, "");
}

static void model_not_safetensors(const char *d) {
    put_run(d);
    sh("echo 'not a tensor file' > '%s/run/checkpoint-00000002/model.safetensors'%s", d, "");
}

/* Rewrite d/run/checkpoint-00000002/FILE: drop tensor `drop`, or make the first
 * element of tensor `poison` NaN, or give tensor `shrink` one element less. */
static void rewrite_tensors(const char *d, const char *file, const char *drop, const char *poison,
                            const char *shrink) {
    put_run(d);
    char path[700];
    snprintf(path, sizeof path, "%s/run/checkpoint-00000002/%s", d, file);
    lm_safetensors *st = NULL;
    if (lm_safetensors_open(path, &st)) {
        fprintf(stderr, "  setup: %s\n", lm_last_error());
        return;
    }
    lm_st_writer *w = lm_st_writer_new();
    void *copies[512];
    int n = lm_safetensors_count(st) < 512 ? lm_safetensors_count(st) : 512;
    for (int i = 0; i < n; i++) {
        const lm_st_tensor *t = lm_safetensors_at(st, i);
        copies[i] = malloc(t->nbytes + 8);
        memcpy(copies[i], t->data, t->nbytes);
        if (drop && !strcmp(t->name, drop)) continue;
        int64_t shape[LM_ST_MAX_DIMS];
        memcpy(shape, t->shape, sizeof shape);
        if (poison && !strcmp(t->name, poison)) {
            float nan = NAN;
            memcpy(copies[i], &nan, 4);
        }
        if (shrink && !strcmp(t->name, shrink)) shape[t->ndim - 1]--;
        lm_st_writer_add(w, t->name, t->dtype, t->ndim, shape, copies[i]);
    }
    if (lm_st_writer_save(w, path)) fprintf(stderr, "  setup: %s\n", lm_last_error());
    lm_st_writer_free(w);
    for (int i = 0; i < n; i++) free(copies[i]);
    lm_safetensors_close(st);
}

static void model_missing_tensor(const char *d) { rewrite_tensors(d, "model.safetensors", "embed", NULL, NULL); }
static void model_nan(const char *d) { rewrite_tensors(d, "model.safetensors", NULL, "embed", NULL); }
static void trainer_state_short(const char *d) {
    rewrite_tensors(d, "trainer.safetensors", NULL, NULL, "optim.adam_state");
}

static void trainer_json_garbage(const char *d) {
    put_run(d);
    sh("echo '{\"step\": 2,' > '%s/run/checkpoint-00000002/trainer.json'%s", d, "");
}

static void trainer_json_no_step(const char *d) {
    put_run(d);
    sh("echo '{\"data_position\": 2}' > '%s/run/checkpoint-00000002/trainer.json'%s", d, "");
}

static void trainer_json_negative_step(const char *d) {
    put_run(d);
    sh("sed -i 's/\"step\": 2,/\"step\": -5,/' '%s/run/checkpoint-00000002/trainer.json'%s", d, "");
}

static void ckpt_config_bad(const char *d) {
    put_run(d);
    sh("echo '{\"model\": {\"d_model\": -1}}' > '%s/run/checkpoint-00000002/config.json'%s", d, "");
}

static void metrics_torn(const char *d) {
    put_run(d);
    sh("printf '{\"type\": \"train\", \"step\": 2, \"lo' >> '%s/run/metrics.jsonl'%s", d, "");
}

/* The resumed run's metrics: train lines for steps 1, 2, 3, and no torn piece. */
static int metrics_repaired(const char *d) {
    char path[600], line[1 << 14];
    snprintf(path, sizeof path, "%s/run/metrics.jsonl", d);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    int train = 0, ok = 1;
    while (fgets(line, sizeof line, f)) {
        long long step = 0;
        const char *p = strstr(line, "\"step\": ");
        if (p) step = atoll(p + 8);
        if (strstr(line, "\"type\": \"train\"")) ok &= step == ++train;
        ok &= strchr(line, '\n') != NULL && strstr(line, "\"lo{") == NULL;
    }
    fclose(f);
    if (!ok || train != 3) fprintf(stderr, "  %s: %d train lines, ok %d\n", path, train, ok);
    return ok && train == 3;
}

static void out_under_file(const char *d) {
    put_config(d);
    sh("touch '%s/file'%s", d, "");
}

/* KDA inputs of `longmoe op kda`: B=1 T=5 H=1 K=V=4, leaving out `skip`,
 * giving beta `beta_t` steps and q the dtype `q_dtype`. */
static void put_kda(const char *d, const char *skip, int64_t beta_t, lm_dtype q_dtype) {
    enum { B = 1, T = 5, H = 1, K = 4 };
    static float x[B * T * H * K], beta[B * 8 * H], a[H], dt[H * K];
    static int32_t xi[B * T * H * K];
    lm_rng r;
    lm_rng_seed(&r, 5);
    for (int i = 0; i < B * T * H * K; i++) x[i] = (float)(0.5 * lm_rng_normal(&r)), xi[i] = i;
    for (int i = 0; i < B * 8 * H; i++) beta[i] = (float)(0.2 + 0.6 * lm_rng_uniform(&r));
    a[0] = 0.1f;
    for (int i = 0; i < H * K; i++) dt[i] = (float)(0.3 * lm_rng_normal(&r));
    int64_t s4[4] = {B, T, H, K}, sb[3] = {B, beta_t, H}, sh1[1] = {H}, shk[1] = {H * K};
    lm_st_writer *w = lm_st_writer_new();
    const char *names[4] = {"q", "k", "v", "z"};
    for (int i = 0; i < 4; i++)
        if (strcmp(skip, names[i]))
            lm_st_writer_add(w, names[i], i == 0 ? q_dtype : LM_DTYPE_F32, 4, s4, i == 0 && q_dtype == LM_DTYPE_I32 ? (void *)xi : (void *)x);
    lm_st_writer_add(w, "beta", LM_DTYPE_F32, 3, sb, beta);
    lm_st_writer_add(w, "A_log", LM_DTYPE_F32, 1, sh1, a);
    lm_st_writer_add(w, "dt_bias", LM_DTYPE_F32, 1, shk, dt);
    char path[600];
    snprintf(path, sizeof path, "%s/in.safetensors", d);
    if (lm_st_writer_save(w, path)) fprintf(stderr, "  setup: %s\n", lm_last_error());
    lm_st_writer_free(w);
}

static void kda_good(const char *d) { put_kda(d, "", 5, LM_DTYPE_F32); }
static void kda_missing_k(const char *d) { put_kda(d, "k", 5, LM_DTYPE_F32); }
static void kda_short_beta(const char *d) { put_kda(d, "", 4, LM_DTYPE_F32); }
static void kda_int_q(const char *d) { put_kda(d, "", 5, LM_DTYPE_I32); }

/* Raw bytes as in.safetensors. */
static void st_bytes(const char *d, const char *bytes, size_t n) {
    char path[600];
    snprintf(path, sizeof path, "%s/in.safetensors", d);
    spit(path, bytes, n);
}
static void st_empty(const char *d) { st_bytes(d, "", 0); }
static void st_huge_header(const char *d) { st_bytes(d, "\xff\xff\xff\xff\x00\x00\x00\x00{}", 10); }
static void st_bad_json(const char *d) { st_bytes(d, "\x08\x00\x00\x00\x00\x00\x00\x00{\"q\":1} ", 16); }
static void st_gap(const char *d) {
    const char h[] = "{\"q\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}  ";
    char buf[128];
    size_t n = strlen(h);
    memset(buf, 0, sizeof buf);
    buf[0] = (char)n;
    memcpy(buf + 8, h, n);
    st_bytes(d, buf, 8 + n + 8);
}
static void st_bad_dtype(const char *d) {
    const char h[] = "{\"q\":{\"dtype\":\"F8\",\"shape\":[1],\"data_offsets\":[0,1]}}   ";
    char buf[128];
    size_t n = strlen(h);
    memset(buf, 0, sizeof buf);
    buf[0] = (char)n;
    memcpy(buf + 8, h, n);
    st_bytes(d, buf, 8 + n + 1);
}
static void st_size_mismatch(const char *d) {
    const char h[] = "{\"q\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}  ";
    char buf[128];
    size_t n = strlen(h);
    memset(buf, 0, sizeof buf);
    buf[0] = (char)n;
    memcpy(buf + 8, h, n);
    st_bytes(d, buf, 8 + n + 8);
}

/* A shard directory @/shards holding one train shard: `magic`, 4 uint16 tokens of which the
 * third is `token`, header vocabulary 256; `truncate` keeps only 4 bytes of it. */
static void put_shard(const char *d, int32_t magic, uint16_t token, int truncate) {
    char path[600];
    snprintf(path, sizeof path, "%s/shards", d);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/shards/train_000000.bin", d);
    int32_t header[256] = {magic, 1, 4, 256};
    uint16_t tokens[4] = {1, 2, token, 4};
    char bytes[sizeof header + sizeof tokens];
    memcpy(bytes, header, sizeof header); /* little-endian machines, as the format */
    memcpy(bytes + sizeof header, tokens, sizeof tokens);
    spit(path, bytes, truncate ? 4 : sizeof bytes);
}
static void shard_short(const char *d) { put_config(d), put_shard(d, 20240520, 3, 1); }
static void shard_magic(const char *d) { put_config(d), put_shard(d, 12345, 3, 0); }
static void shard_token(const char *d) { put_config(d), put_shard(d, 20240520, 300, 0); }

/* ---- the catalogue ---- */

typedef struct {
    const char *input;    /* what the program reads */
    const char *bad;      /* the kind of bad value */
    const char *config;   /* written to @/cfg.json when not NULL */
    void (*setup)(const char *d);
    const char *args;     /* `longmoe` arguments; @ is the row's directory */
    int exit_code;
    const char *message;  /* fragment of stderr ("" when nothing is required) */
} bad_input;

#define CFG_ROW(bad, text, msg) {"config JSON (--config)", bad, text, NULL, "plan --config @/cfg.json", 1, msg}

static const bad_input rows[] = {
    /* command line */
    {"command", "none given", NULL, NULL, "", 2, "usage: longmoe <command>"},
    {"command", "unknown", NULL, NULL, "frobnicate", 2, "unknown command 'frobnicate'"},
    {"flags (every command)", "unknown option", NULL, NULL, "train --bogus", 2, "unknown option '--bogus'"},
    {"flags (every command)", "value missing at the end", NULL, NULL, "plan --config", 2, "--config needs a value"},
    {"train flags", "--out or --config missing", NULL, NULL, "train --out @/run", 2,
     "--out and --config are required"},
    {"train flags", "--steps not an integer", NULL, put_config, "train --config @/micro.json --out @/r --steps 1e3", 2,
     "--steps expects an integer, got '1e3'"},
    {"train flags", "--steps out of range", NULL, put_config, "train --config @/micro.json --out @/r --steps 0", 2,
     "--steps must lie in [1, 1099511627776], got 0"},
    {"train flags", "--stop-after out of range", NULL, put_config,
     "train --config @/micro.json --out @/r --stop-after -3", 2, "--stop-after must lie in"},
    {"train flags", "--seed negative or fractional", NULL, put_config,
     "train --config @/micro.json --out @/r --seed 1.5", 2, "--seed must be a non-negative integer"},
    {"train flags", "--seed not a number", NULL, put_config, "train --config @/micro.json --out @/r --seed x", 2,
     "--seed expects a finite number, got 'x'"},
    {"train flags", "--data unknown", NULL, put_config, "train --config @/micro.json --out @/r --data nosuch", 2,
     "--data"},
    {"train flags", "--config with --resume", NULL, put_run, "train --config @/micro.json --out @/run --resume", 2,
     "--config cannot be given with --resume"},
    {"train flags", "--seed with --resume", NULL, put_run, "train --out @/run --resume --seed 3", 2,
     "--seed cannot be given with --resume"},
    {"train --out", "already holds a run (no --resume)", NULL, put_run, "train --config @/micro.json --out @/run", 1,
     "already holds a run ('"},
    {"op kda --out", "the --in file", NULL, kda_good, "op kda --in @/in.safetensors --out @/in.safetensors", 2,
     "is the --in file"},
    {"tokenizer train --out", "one of the --input files", NULL, put_config,
     "tokenizer train --input @/micro.json --vocab 300 --out @/micro.json", 2, "is also an --input"},
    {"train --out", "parent is a regular file", NULL, out_under_file, "train --config @/micro.json --out @/file/run",
     1, "exists and is not a directory"},
    {"plan flags", "--context out of range", NULL, put_config, "plan --config @/micro.json --context 0", 2,
     "--context must lie in [1, 1073741824], got 0"},
    {"op", "no operator", NULL, NULL, "op", 2, "usage: longmoe op <operator>"},
    {"op", "unknown operator", NULL, NULL, "op nosuch", 2, "unknown operator 'nosuch'"},
    {"op kda flags", "--in or --out missing", NULL, NULL, "op kda --in x.safetensors", 2,
     "--in and --out are required"},
    {"op kda flags", "--mode unknown", NULL, NULL, "op kda --mode fast", 2, "--mode must be chunk or recurrent"},
    {"op kda flags", "--gate unknown", NULL, NULL, "op kda --gate relu", 2, "--gate must be bounded or softplus"},
    {"op kda flags", "--chunk out of range", NULL, NULL, "op kda --chunk 8", 2, "--chunk must lie in [16, 64], got 8"},
    {"op kda flags", "--g-min not a number", NULL, NULL, "op kda --g-min inf", 2, "--g-min expects a finite number"},
    {"op attention flags", "--scale not positive", NULL, NULL, "op attention --scale -1", 2,
     "--scale must be > 0, got -1"},
    {"op moe flags", "--k out of range", NULL, NULL, "op moe --k 17", 2, "--k must lie in [1, 16], got 17"},
    {"op route flags", "--k out of range", NULL, NULL, "op route --k 0", 2, "--k must lie in [1, 16], got 0"},
    {"demo flags", "unknown option", NULL, NULL, "demo --fast", 2, "unknown option '--fast'"},
    /* config JSON */
    {"config JSON (--config)", "file missing", NULL, NULL, "plan --config @/none.json", 1, "cannot open config"},
    {"config JSON (--config)", "a directory", NULL, NULL, "plan --config @", 1, "a directory, not a regular file"},
    CFG_ROW("empty file", "", "unexpected end of input"),
    CFG_ROW("not JSON", "{\"model\": {\"d_model\": 64,}}", "invalid JSON at byte 25"),
    CFG_ROW("trailing characters", "{} {}", "trailing characters after the document"),
    CFG_ROW("duplicate key", "{\"model\": {\"d_model\": 64, \"d_model\": 32}}", "duplicate object key"),
    CFG_ROW("not an object", "[1, 2]", "the config must be a JSON object of sections"),
    CFG_ROW("unknown section", "{\"optimizer\": {}}", "unknown section 'optimizer'"),
    CFG_ROW("section not an object", "{\"model\": 3}", "section 'model' must be an object"),
    CFG_ROW("unknown key", "{\"model\": {\"dmodel\": 64}}", "unknown key 'model.dmodel'"),
    CFG_ROW("number out of range", "{\"moe\": {\"top_k\": 20}}", "moe.top_k must lie in [1, 16], got 20"),
    CFG_ROW("fraction for an integer", "{\"model\": {\"n_layers\": 2.5}}", "model.n_layers must be an integer"),
    CFG_ROW("string for a number", "{\"train\": {\"lr\": \"0.1\"}}", "train.lr must be a number"),
    CFG_ROW("number for a boolean", "{\"model\": {\"tie_embeddings\": 1}}", "model.tie_embeddings must be true or false"),
    CFG_ROW("unknown enum name", "{\"moe\": {\"balance\": \"loss\"}}", "moe.balance must be one of none|quantile|sign|aux"),
    CFG_ROW("bad layout letter", "{\"model\": {\"n_layers\": 2, \"layout\": \"kx\"}}", "model.layout has 'x' at layer 2"),
    CFG_ROW("inconsistent keys", "{\"moe\": {\"routed_experts\": 4, \"top_k\": 4}}",
            "moe.top_k (4) must be smaller than moe.routed_experts (4)"),
    CFG_ROW("integer beyond 64 bits", "{\"train\": {\"seed\": 99999999999999999999}}", "integer out of range"),
    CFG_ROW("invalid UTF-8", "{\"comment\": \"\xff\"}", "invalid UTF-8 in string"),
    CFG_ROW("nesting deeper than 64", "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
            "nesting deeper than 64 levels"),
    /* safetensors inputs of `op` */
    {"safetensors (op --in)", "file missing", NULL, NULL, "op kda --in @/none.safetensors --out @/o.safetensors", 1,
     "cannot open"},
    {"safetensors (op --in)", "empty file", NULL, st_empty, "op kda --in @/in.safetensors --out @/o.safetensors", 1,
     "too short for a safetensors file"},
    {"safetensors (op --in)", "header length past the end", NULL, st_huge_header,
     "op attention --in @/in.safetensors --out @/o.safetensors", 1, "does not fit the file"},
    {"safetensors (op --in)", "header not a tensor table", NULL, st_bad_json,
     "op moe --in @/in.safetensors --out @/o.safetensors --k 2", 1, "entry is not an object"},
    {"safetensors (op --in)", "unknown dtype", NULL, st_bad_dtype,
     "op route --in @/in.safetensors --k 2", 1, "unsupported dtype 'F8'"},
    {"safetensors (op --in)", "shape disagrees with byte range", NULL, st_size_mismatch,
     "op kda --in @/in.safetensors --out @/o.safetensors", 1, "shape x dtype size = 12 bytes but data_offsets span 8"},
    {"safetensors (op --in)", "unreferenced bytes", NULL, st_gap, "op kda --in @/in.safetensors --out @/o.safetensors",
     1, "unreferenced data bytes before tensor 'q'"},
    {"safetensors (op --in)", "tensor missing", NULL, kda_missing_k,
     "op kda --in @/in.safetensors --out @/o.safetensors", 1, "tensor 'k' is missing"},
    {"safetensors (op --in)", "wrong shape", NULL, kda_short_beta, "op kda --in @/in.safetensors --out @/o.safetensors",
     1, "tensor 'beta' has shape [1,4,1], expected [B,T,H] = [1,5,1]"},
    {"safetensors (op --in)", "integer dtype for a float tensor", NULL, kda_int_q,
     "op kda --in @/in.safetensors --out @/o.safetensors", 1, "has dtype I32; expected F32, BF16, F16 or F64"},
    {"safetensors (op --out)", "directory not writable (parent is a file)", NULL, kda_good,
     "op kda --in @/in.safetensors --out @/in.safetensors/o.safetensors", 1, "cannot create"},
    /* tokenizer JSON */
    {"tokenizer JSON (--tokenizer)", "file missing", NULL, NULL, "tokenizer encode --tokenizer @/none.json", 1,
     "cannot open"},
    {"tokenizer JSON (--tokenizer)", "not a tokenizer file", "{\"model\": 1}", NULL,
     "tokenizer encode --tokenizer @/cfg.json --input @/cfg.json", 1, "pre_tokenizer must be an object"},
    {"tokenizer train flags", "--vocab below 257", NULL, NULL, "tokenizer train --input @ --vocab 100 --out @/t.json",
     2, "--vocab must lie in [257,"},
    /* token shards (train --data shards:DIR) */
    {"token shard (--data shards:DIR)", "shorter than its header", NULL, shard_short,
     "train --config @/micro.json --out @/r --data shards:@/shards", 2, "shorter than the 1024-byte shard header"},
    {"token shard (--data shards:DIR)", "wrong magic", NULL, shard_magic,
     "train --config @/micro.json --out @/r --data shards:@/shards", 2, "magic 12345 is not a token shard's"},
    {"token shard (--data shards:DIR)", "token outside the header's vocabulary", NULL, shard_token,
     "train --config @/micro.json --out @/r --data shards:@/shards", 2,
     "token 300 at position 2 is outside the vocabulary [0, 256)"},
    /* checkpoints (train --resume) */
    {"checkpoint (train --resume)", "no `latest`", NULL, run_without_latest, "train --out @/run --resume", 1,
     "no checkpoint to resume from"},
    {"checkpoint (train --resume)", "`latest` names no checkpoint", NULL, latest_garbage, "train --out @/run --resume",
     1, "does not name a checkpoint directory"},
    {"checkpoint (train --resume)", "`latest` names a missing directory", NULL, latest_missing_dir,
     "train --out @/run --resume", 1, "cannot open config"},
    {"checkpoint (train --resume)", "config.json out of range", NULL, ckpt_config_bad, "train --out @/run --resume", 1,
     "model.d_model must lie in"},
    {"checkpoint (train --resume)", "model.safetensors truncated", NULL, model_truncated, "train --out @/run --resume",
     1, "does not fit the file"},
    {"checkpoint (train --resume)", "model.safetensors not a tensor file", NULL, model_not_safetensors,
     "train --out @/run --resume", 1, "model.safetensors: header length"},
    {"checkpoint (train --resume)", "model tensor missing", NULL, model_missing_tensor, "train --out @/run --resume",
     1, "tensor 'embed' is missing"},
    {"checkpoint (train --resume)", "model tensor holds NaN", NULL, model_nan, "train --out @/run --resume", 1,
     "tensor 'embed' holds a non-finite value"},
    {"checkpoint (train --resume)", "optimizer state of the wrong size", NULL, trainer_state_short,
     "train --out @/run --resume", 1, "tensor 'optim.adam_state' is F32 with"},
    {"checkpoint (train --resume)", "trainer.json not JSON", NULL, trainer_json_garbage, "train --out @/run --resume",
     1, "trainer.json: invalid JSON"},
    {"checkpoint (train --resume)", "trainer.json counter missing", NULL, trainer_json_no_step,
     "train --out @/run --resume", 1, "missing or bad counters"},
    {"checkpoint (train --resume)", "trainer.json counter negative", NULL, trainer_json_negative_step,
     "train --out @/run --resume", 1, "missing or bad counters"},
    /* metrics */
    {"metrics.jsonl (train --resume)", "torn last line (a crash while appending): dropped", NULL, metrics_torn,
     "train --out @/run --resume --steps 3", 0, ""},
};
static const int n_rows = (int)(sizeof rows / sizeof rows[0]);

/* `args` with each @ replaced by dir. */
static void expand(const char *args, const char *dir, char *out, size_t n) {
    size_t k = 0;
    for (const char *p = args; *p && k + strlen(dir) + 2 < n; p++) {
        if (*p == '@') {
            memcpy(out + k, dir, strlen(dir));
            k += strlen(dir);
        } else {
            out[k++] = *p;
        }
    }
    out[k] = 0;
}

static void test_every_bad_input_gives_its_message_and_exit_code(void) {
    /* the checkpoint the checkpoint rows corrupt: two steps of the micro model */
    char base[400], cfg[400], cmd[2400];
    snprintf(base, sizeof base, "%s/base", root);
    snprintf(cfg, sizeof cfg, "%s/micro.json", root);
    spit(cfg, micro_config, strlen(micro_config));
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 %s train --config %s --out %s --quiet", LONGMOE_CLI, cfg, base);
    CHECK(system(cmd) == 0, "the base run failed");
    for (int i = 0; i < n_rows; i++) {
        const bad_input *r = &rows[i];
        char d[400], args[1200], err[500], path[500];
        snprintf(d, sizeof d, "%s/row%02d", root, i);
        mkdir(d, 0755);
        if (r->config) {
            snprintf(path, sizeof path, "%s/cfg.json", d);
            spit(path, r->config, strlen(r->config));
        }
        if (r->setup) r->setup(d);
        expand(r->args, d, args, sizeof args);
        snprintf(err, sizeof err, "%s/stderr.txt", d);
        snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 %s %s > %s/stdout.txt 2> %s", LONGMOE_CLI, args, d, err);
        int st = system(cmd);
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        FILE *f = fopen(err, "rb");
        char text[8192] = {0};
        if (f) {
            size_t n = fread(text, 1, sizeof text - 1, f);
            text[n] = 0;
            fclose(f);
        }
        CHECK(code == r->exit_code, "row %d (%s: %s): exit code %d, want %d; stderr: %s", i, r->input, r->bad, code,
              r->exit_code, text);
        CHECK(strstr(text, r->message) != NULL, "row %d (%s: %s): stderr lacks '%s'; it was: %s", i, r->input, r->bad,
              r->message, text);
        if (r->setup == metrics_torn) CHECK(metrics_repaired(d), "row %d: the resumed run's metrics are wrong", i);
        /* one line that names the command, not a crash dump */
        if (r->exit_code == 1)
            CHECK(!strncmp(text, "longmoe ", 8) && strstr(text, "error: "), "row %d: message is not 'longmoe <cmd>: "
                  "error: ...': %s", i, text);
    }
}

static void print_markdown(void) {
    printf("| input | bad value | command | exit | message (fragment) |\n|---|---|---|---|---|\n");
    for (int i = 0; i < n_rows; i++) {
        const bad_input *r = &rows[i];
        char args[1200], msg[600];
        expand(r->args, "D", args, sizeof args);
        size_t k = 0;
        for (const char *p = r->message; *p && k + 2 < sizeof msg; p++) {
            if (*p == '|') msg[k++] = '\\';
            msg[k++] = *p;
        }
        msg[k] = 0;
        printf("| %s | %s | `longmoe %s` | %d | %s%s%s |\n", r->input, r->bad, args, r->exit_code, *msg ? "`" : "",
               *msg ? msg : "(none: tolerated)", *msg ? "`" : "");
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--markdown")) {
        print_markdown();
        return 0;
    }
    if (test_make_tmpdir(root, sizeof root, "bad")) return 1;
    RUN(test_every_bad_input_gives_its_message_and_exit_code);
    int rc = test_summary();
    if (rc == 0) test_remove_tree(root);
    else fprintf(stderr, "files kept in %s\n", root);
    return rc;
}
