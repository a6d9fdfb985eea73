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

static int remove_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return unlink(dir) == 0 || errno == ENOENT ? 0 : -1;
    struct dirent *e;
    char path[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
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
    /* keep the newest `keep` complete checkpoints */
    DIR *d = opendir(run_dir);
    if (!d) return LM_OK;
    long long steps[4096];
    int count = 0;
    struct dirent *e;
    while ((e = readdir(d)) && count < 4096) {
        long long st;
        char tail[8];
        if (sscanf(e->d_name, "checkpoint-%lld%7s", &st, tail) == 1) steps[count++] = st;
    }
    closedir(d);
    for (int i = 0; i < count; i++) {
        int newer = 0;
        for (int j = 0; j < count; j++) newer += steps[j] > steps[i];
        if (newer >= keep) {
            char old[4096];
            snprintf(old, sizeof old, "%s/checkpoint-%08lld", run_dir, steps[i]);
            remove_tree(old);
        }
    }
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
