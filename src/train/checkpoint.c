/* Checkpoints: write a complete directory atomically, find the latest, load
 * it back (include/longmoe/train.h). */
#define _POSIX_C_SOURCE 200809L
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "files.h"
#include "json.h"
#include "longmoe/safetensors.h"

lm_status lm_write_text_atomic(const char *path, const char *text) {
    const void *parts[1] = {text};
    size_t sizes[1] = {strlen(text)};
    return lm_write_file_atomic(path, parts, sizes, 1);
}

static void fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* Remove directory `dir` of a run and the files directly in it. Symbolic
 * links are removed, never followed (a link to another run's checkpoint
 * loses the link, not the other run's files); a real subdirectory is left
 * (rmdir then fails): deleting never leaves `dir`. `dir` itself a link: the
 * link is removed. */
static int remove_tree(const char *dir) {
    struct stat sb;
    if (lstat(dir, &sb) != 0) return errno == ENOENT ? 0 : -1;
    if (!S_ISDIR(sb.st_mode)) return unlink(dir);
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *e;
    char path[4400];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (lstat(path, &sb) == 0 && !S_ISDIR(sb.st_mode)) unlink(path);
    }
    closedir(d);
    return rmdir(dir);
}

/* mkdir -p */
lm_status lm_ensure_dir(const char *dir) {
    struct stat sb;
    if (stat(dir, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode)) return lm_error(LM_ERR_IO, "'%s' exists and is not a directory", dir);
        return LM_OK;
    }
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    if (slash && slash != parent) {
        *slash = 0;
        lm_status s = lm_ensure_dir(parent);
        if (s) return s;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return lm_error(LM_ERR_IO, "cannot create directory '%s': %s", dir, strerror(errno));
    return LM_OK;
}

void lm_checkpoint_abort(const char *tmp_dir) { remove_tree(tmp_dir); }

lm_status lm_checkpoint_begin(const char *run_dir, int64_t step, char *tmp_dir, size_t n) {
    snprintf(tmp_dir, n, "%s/checkpoint-%08lld.tmp", run_dir, (long long)step);
    remove_tree(tmp_dir); /* a torn attempt from a crash */
    if (mkdir(tmp_dir, 0755) != 0)
        return lm_error(LM_ERR_IO, "cannot create '%s': %s", tmp_dir, strerror(errno));
    return LM_OK;
}

lm_status lm_checkpoint_commit(const char *run_dir, int64_t step, const char *tmp_dir, int keep) {
    char final_dir[4096], latest[4096], name[64];
    snprintf(name, sizeof name, "checkpoint-%08lld", (long long)step);
    snprintf(final_dir, sizeof final_dir, "%s/%s", run_dir, name);
    fsync_dir(tmp_dir);
    /* A checkpoint of this step may exist already (a resumed run saving the step
     * it resumed at) and `latest` may name it: move it aside rather than delete
     * it, so that a crash at any moment leaves a complete copy under the name
     * or, between the two renames, under <name>.old (lm_checkpoint_latest
     * moves it back). */
    char old[4200];
    snprintf(old, sizeof old, "%s.old", final_dir);
    struct stat sb;
    if (stat(final_dir, &sb) == 0) {
        remove_tree(old);
        if (rename(final_dir, old) != 0)
            return lm_error(LM_ERR_IO, "cannot rename '%s' to '%s': %s", final_dir, old, strerror(errno));
    }
    if (rename(tmp_dir, final_dir) != 0)
        return lm_error(LM_ERR_IO, "cannot rename '%s' to '%s': %s", tmp_dir, final_dir, strerror(errno));
    fsync_dir(run_dir);
    snprintf(latest, sizeof latest, "%s/latest", run_dir);
    char text[80];
    snprintf(text, sizeof text, "%s\n", name);
    lm_status s = lm_write_text_atomic(latest, text);
    if (s) return s;
    remove_tree(old);
    return lm_checkpoint_prune(run_dir, step, keep);
}

lm_status lm_checkpoint_prune(const char *run_dir, int64_t step, int keep) {
    /* keep `step` and the newest keep - 1 checkpoints before it. Only real
     * directories named exactly checkpoint-<8+ digits> are candidates; a
     * checkpoint newer than `step` is never removed (it is not older than
     * what was just written), nor is a link followed. */
    DIR *d = opendir(run_dir);
    if (!d) return LM_OK;
    enum { MAX_SEEN = 4096 };
    long long *steps = malloc(MAX_SEEN * sizeof *steps);
    if (!steps) {
        closedir(d);
        return LM_OK; /* pruning is housekeeping: nothing is lost by skipping it */
    }
    int count = 0;
    struct dirent *e;
    char path[4400];
    while ((e = readdir(d)) && count < MAX_SEEN) {
        long long st;
        int end = 0;
        if (sscanf(e->d_name, "checkpoint-%lld%n", &st, &end) != 1 || e->d_name[end] || end < 19) continue;
        if (st >= step) continue;
        snprintf(path, sizeof path, "%s/%s", run_dir, e->d_name);
        struct stat sb;
        if (lstat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) continue;
        steps[count++] = st;
    }
    closedir(d);
    for (int i = 0; i < count; i++) {
        int newer = 1; /* the checkpoint at `step` */
        for (int j = 0; j < count; j++) newer += steps[j] > steps[i];
        if (newer >= keep) {
            snprintf(path, sizeof path, "%s/checkpoint-%08lld", run_dir, steps[i]);
            remove_tree(path);
        }
    }
    free(steps);
    return LM_OK;
}

lm_status lm_run_lock(const char *run_dir, int *fd_out) {
    *fd_out = -1;
    char path[4200];
    snprintf(path, sizeof path, "%s/lock", run_dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return lm_error(LM_ERR_IO, "cannot create the lock file '%s': %s", path, strerror(errno));
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(fd, F_SETLK, &fl) != 0) {
        int e = errno;
        struct flock who = fl;
        long pid = fcntl(fd, F_GETLK, &who) == 0 && who.l_type != F_UNLCK ? (long)who.l_pid : 0;
        close(fd);
        if (e == EACCES || e == EAGAIN) {
            if (pid > 0)
                return lm_error(LM_ERR_IO, "'%s' is in use by another trainer (process %ld); wait for it or stop "
                                "it first: two trainers on one run directory would overwrite each other", run_dir,
                                pid);
            return lm_error(LM_ERR_IO, "'%s' is in use by another trainer; wait for it or stop it first", run_dir);
        }
        return lm_error(LM_ERR_IO, "cannot lock '%s': %s", path, strerror(e));
    }
    *fd_out = fd;
    return LM_OK;
}

void lm_run_unlock(int fd) {
    if (fd >= 0) close(fd);
}

lm_status lm_run_check_fresh(const char *run_dir) {
    DIR *d = opendir(run_dir);
    if (!d) return LM_OK;
    struct dirent *e;
    char found[300] = {0};
    while ((e = readdir(d)) && !found[0]) {
        const char *n = e->d_name;
        if (!strcmp(n, "latest") || !strcmp(n, "metrics.jsonl") || !strcmp(n, "config.json") ||
            !strncmp(n, "checkpoint-", 11))
            snprintf(found, sizeof found, "%s", n);
    }
    closedir(d);
    if (found[0])
        return lm_error(LM_ERR_ARG, "'%s' already holds a run ('%s' exists): continue it with --resume, or give "
                        "another --out (a fresh run never overwrites one)", run_dir, found);
    return LM_OK;
}

lm_status lm_checkpoint_latest(const char *run_dir, char *dir, size_t n) {
    char latest[4096], *text = NULL;
    snprintf(latest, sizeof latest, "%s/latest", run_dir);
    lm_status s = lm_read_file(latest, LM_TEXT_FILE_MAX, &text, NULL);
    if (s) {
        char msg[1024]; /* lm_error writes the buffer lm_last_error reads: copy first */
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        return lm_error(LM_ERR_IO, "no checkpoint to resume from in '%s' (%s)", run_dir, msg);
    }
    char *nl = strchr(text, '\n');
    if (nl) *nl = 0;
    long long step;
    char tail[8];
    if (sscanf(text, "checkpoint-%lld%7s", &step, tail) != 1) {
        free(text);
        return lm_error(LM_ERR_FORMAT, "'%s' does not name a checkpoint directory", latest);
    }
    snprintf(dir, n, "%s/%s", run_dir, text);
    free(text);
    /* a crash while a checkpoint of the same step was replaced (lm_checkpoint_commit)
     * leaves the complete previous copy as <name>.old: move it back */
    char old[4200];
    struct stat sb;
    snprintf(old, sizeof old, "%s.old", dir);
    if (stat(dir, &sb) != 0 && stat(old, &sb) == 0 && rename(old, dir) != 0)
        return lm_error(LM_ERR_IO, "cannot move '%s' back to '%s': %s", old, dir, strerror(errno));
    return LM_OK;
}

lm_status lm_checkpoint_model_begin(lm_model *m, const char *dir, lm_st_stream **out) {
    *out = NULL;
    char path[4300];
    lm_status s = LM_OK;
    lm_st_writer *w = lm_st_writer_new();
    if (!w) return lm_error(LM_ERR_MEMORY, "out of memory (checkpoint)");
    /* the header only: the data comes from the caller, tensor by tensor */
    for (int i = 0; i < lm_model_num_tensors(m) && !s; i++) {
        const lm_model_tensor *mt = lm_model_tensor_at(m, i);
        s = lm_st_writer_add(w, mt->name, LM_DTYPE_F32, mt->ndim, mt->shape, NULL);
    }
    if (!s) s = lm_st_writer_set_metadata(w, "format", "longmoe");
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (!s) s = lm_st_writer_begin(w, path, out);
    lm_st_writer_free(w);
    return s;
}

lm_status lm_checkpoint_write_config(const lm_config *cfg, const char *dir) {
    char path[4300];
    char *json = lm_config_to_json(cfg);
    if (!json) return lm_error(LM_ERR_MEMORY, "out of memory writing the config");
    snprintf(path, sizeof path, "%s/config.json", dir);
    lm_status s = lm_write_text_atomic(path, json);
    free(json);
    return s;
}

lm_status lm_checkpoint_write_model(lm_model *m, const lm_config *cfg, const char *dir) {
    for (int i = 0; i < lm_model_num_tensors(m); i++)
        if (!lm_model_tensor_data(m, i))
            return lm_error(LM_ERR_ARG, "checkpoint: %s is cut to this rank's experts (lm_model_gather_experts "
                            "first)", lm_model_tensor_at(m, i)->name);
    lm_st_stream *st;
    TRY(lm_checkpoint_model_begin(m, dir, &st));
    for (int i = 0; i < lm_model_num_tensors(m); i++) {
        lm_status s = lm_st_stream_write(st, lm_model_tensor_data(m, i),
                                         (size_t)lm_model_tensor_at(m, i)->numel * sizeof(float));
        if (s) {
            lm_st_stream_abort(st);
            return s;
        }
    }
    TRY(lm_st_stream_commit(st));
    return lm_checkpoint_write_config(cfg, dir);
}

/* Tensor k of the balancing state (4 a MoE layer, in file order): its name,
 * dtype, element count and data. */
static void balance_tensor(lm_model *m, int k, char name[96], lm_dtype *dtype, int64_t *n, const void **data) {
    lm_balance_state *b = lm_model_balance(m, k / 4);
    static const char *const what[4] = {"bias", "halfwidth", "last_load", "interval_load"};
    static const lm_dtype types[4] = {LM_DTYPE_F32, LM_DTYPE_F32, LM_DTYPE_I32, LM_DTYPE_I64};
    const void *const ptr[4] = {b->bias, b->halfwidth, b->last_load, b->interval_load};
    snprintf(name, 96, "layers.%d.moe.%s", lm_model_moe_layer_index(m, k / 4), what[k % 4]);
    *dtype = types[k % 4];
    *n = b->cfg.n_experts;
    *data = ptr[k % 4];
}

lm_status lm_checkpoint_add_balance(lm_st_writer *w, lm_model *m) {
    for (int k = 0; k < 4 * lm_model_num_moe_layers(m); k++) {
        char name[96];
        lm_dtype dt;
        int64_t n[1];
        const void *data;
        balance_tensor(m, k, name, &dt, n, &data);
        TRY(lm_st_writer_add(w, name, dt, 1, n, data));
    }
    return LM_OK;
}

lm_status lm_checkpoint_trainer_begin(lm_model *m, size_t muon_floats, size_t adam_floats, const char *dir,
                                      lm_st_stream **out) {
    *out = NULL;
    char path[4300];
    lm_st_writer *w = lm_st_writer_new();
    if (!w) return lm_error(LM_ERR_MEMORY, "out of memory (checkpoint)");
    int64_t n_m[1] = {(int64_t)muon_floats}, n_a[1] = {(int64_t)adam_floats};
    lm_status s = lm_st_writer_add(w, "optim.muon_state", LM_DTYPE_F32, 1, n_m, NULL);
    if (!s) s = lm_st_writer_add(w, "optim.adam_state", LM_DTYPE_F32, 1, n_a, NULL);
    if (!s) s = lm_checkpoint_add_balance(w, m);
    snprintf(path, sizeof path, "%s/trainer.safetensors", dir);
    if (!s) s = lm_st_writer_begin(w, path, out);
    lm_st_writer_free(w);
    return s;
}

lm_status lm_checkpoint_trainer_finish(lm_st_stream *st, lm_model *m) {
    for (int k = 0; k < 4 * lm_model_num_moe_layers(m); k++) {
        char name[96];
        lm_dtype dt;
        int64_t n;
        const void *data;
        balance_tensor(m, k, name, &dt, &n, &data);
        lm_status s = lm_st_stream_write(st, data, (size_t)n * lm_dtype_size(dt));
        if (s) {
            lm_st_stream_abort(st);
            return s;
        }
    }
    return lm_st_stream_commit(st);
}
