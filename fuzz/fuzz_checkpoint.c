/* libFuzzer harness of the checkpoint readers: the fuzz input replaces one
 * file of a valid checkpoint (byte 0 picks which: trainer.json,
 * trainer.safetensors, model.safetensors or `latest`; the rest is the file),
 * then the run is resumed through the public lm_train (or the model loaded by
 * lm_checkpoint_load_model). Either it resumes or it fails with a message;
 * never a crash, a leak or undefined behaviour.
 *
 * The valid checkpoint is made once at start-up by training a micro model for
 * one step in a temporary directory ($TMPDIR, else /dev/shm, else /tmp). */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/train.h"

#define CKPT "checkpoint-00000001"

/* The micro model: every mixer and a MoE layer, a few KB of parameters. */
static const char micro_config[] =
    "{\"model\": {\"d_model\": 8, \"n_layers\": 2, \"layout\": \"km\", \"first_k_dense\": 1, \"dense_ffn\": 8},"
    " \"kda\": {\"heads\": 1, \"head_dim\": 8, \"chunk\": 16},"
    " \"attention\": {\"heads\": 1, \"q_lora_rank\": 4, \"kv_lora_rank\": 4, \"qk_head_dim\": 8, \"v_head_dim\": 8},"
    " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 4, \"shared_ffn\": 4, \"balance_bins\": 16},"
    " \"train\": {\"seq_len\": 8, \"batch_size\": 1, \"steps\": 1, \"eval_every\": 0, \"log_every\": 1000,"
    " \"keep_checkpoints\": 1}}";

static const char *const files[] = {"trainer.json", "trainer.safetensors", "model.safetensors", "config.json"};
enum { N_FILES = 4 };
static char *file_bytes[N_FILES];
static size_t file_size[N_FILES];
static char base[256], work[300];
static lm_config cfg;

static void remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) {
        unlink(dir);
        return;
    }
    struct dirent *e;
    char path[1024];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) remove_tree(path);
        else unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

static void write_file(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n) abort();
    fclose(f);
}

static char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) abort();
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)len + 1);
    if (!b || fread(b, 1, (size_t)len, f) != (size_t)len) abort();
    fclose(f);
    *n = (size_t)len;
    return b;
}

static void cleanup(void) {
    remove_tree(base);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *tmp = getenv("TMPDIR");
    struct stat sb;
    if (!tmp || !*tmp) tmp = stat("/dev/shm", &sb) == 0 ? "/dev/shm" : "/tmp";
    snprintf(base, sizeof base, "%s/longmoe-fuzz-ckpt-XXXXXX", tmp);
    if (!mkdtemp(base)) abort();
    atexit(cleanup);
    lm_config_defaults(&cfg);
    if (lm_config_parse(micro_config, strlen(micro_config), "micro config", &cfg)) {
        fprintf(stderr, "%s\n", lm_last_error());
        abort();
    }
    char run[300], path[400];
    snprintf(run, sizeof run, "%s/template", base);
    lm_train_options opt = lm_train_options_default(run);
    opt.progress = NULL;
    opt.val_batches = 1;
    if (lm_train(&cfg, &opt, NULL)) {
        fprintf(stderr, "making the template checkpoint: %s\n", lm_last_error());
        abort();
    }
    for (int i = 0; i < N_FILES; i++) {
        snprintf(path, sizeof path, "%s/" CKPT "/%s", run, files[i]);
        file_bytes[i] = read_file(path, &file_size[i]);
    }
    snprintf(work, sizeof work, "%s/work", base);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int which = data[0] % 5; /* 0..2: files[which]; 3: latest; 4: metrics.jsonl */
    data++;
    size--;
    char dir[400], path[500];
    remove_tree(work);
    snprintf(dir, sizeof dir, "%s/" CKPT, work);
    if (mkdir(work, 0755) || mkdir(dir, 0755)) abort();
    for (int i = 0; i < N_FILES; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        if (i == which) write_file(path, data, size);
        else write_file(path, file_bytes[i], file_size[i]);
    }
    snprintf(path, sizeof path, "%s/latest", work);
    if (which == 3) write_file(path, data, size);
    else write_file(path, CKPT "\n", strlen(CKPT) + 1);
    if (which == 4) {
        snprintf(path, sizeof path, "%s/metrics.jsonl", work);
        write_file(path, data, size);
    }

    if (which == 2) {
        /* the model alone, as `longmoe` commands that read a checkpoint do */
        lm_config c;
        lm_model *m = NULL;
        if (lm_checkpoint_load_model(dir, 1, 8, &c, &m) == LM_OK) lm_model_free(m);
        else if (m) abort();
        return 0;
    }
    lm_train_options opt = lm_train_options_default(work);
    opt.resume = 1;
    opt.progress = NULL;
    opt.val_batches = 1;
    lm_train_result r;
    (void)lm_train(&cfg, &opt, &r);
    return 0;
}
