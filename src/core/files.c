/* Whole-file reading and growable text (src/core/files.h). */
#define _POSIX_C_SOURCE 200809L
#include "check.h"
#include "files.h"


#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *file_kind(mode_t m) {
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO (named pipe)";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    return "not a plain file";
}

lm_status lm_open_regular(const char *path, int *fd_out, int64_t *size) {
    *fd_out = -1;
    /* O_NONBLOCK: opening a FIFO without a writer (or some devices) would block */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return lm_error(LM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return lm_error(LM_ERR_IO, "cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return lm_error(LM_ERR_IO, "'%s' is %s, not a regular file", path, file_kind(sb.st_mode));
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    if (size) *size = (int64_t)sb.st_size;
    *fd_out = fd;
    return LM_OK;
}

int lm_same_file(const char *a, const char *b) {
    struct stat sa, sb;
    if (stat(a, &sa) != 0 || stat(b, &sb) != 0) return 0;
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

lm_status lm_read_file(const char *path, size_t max_bytes, char **bytes, size_t *len) {
    *bytes = NULL;
    if (len) *len = 0;
    int is_stdin = !strcmp(path, "-");
    FILE *f = stdin;
    if (!is_stdin) {
        int fd;
        TRY(lm_open_regular(path, &fd, NULL));
        f = fdopen(fd, "rb");
        if (!f) {
            close(fd);
            return lm_error(LM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
        }
    }
    /* read in doubling pieces: works for pipes and files whose size changes */
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap + 1);
    lm_status s = b ? LM_OK : lm_error(LM_ERR_MEMORY, "out of memory reading '%s'", path);
    while (!s) {
        n += fread(b + n, 1, cap - n, f);
        if (max_bytes && n > max_bytes) {
            s = lm_error(LM_ERR_IO, "'%s' is larger than %zu bytes", path, max_bytes);
            break;
        }
        if (n < cap) break;
        char *q = realloc(b, 2 * cap + 1);
        if (!q) {
            s = lm_error(LM_ERR_MEMORY, "out of memory reading '%s' (%zu bytes so far)", path, n);
            break;
        }
        b = q;
        cap *= 2;
    }
    if (!s && ferror(f)) s = lm_error(LM_ERR_IO, "'%s' is not a readable file: %s", path, strerror(errno));
    if (!is_stdin) fclose(f);
    if (s) {
        free(b);
        return s;
    }
    b[n] = 0;
    *bytes = b;
    if (len) *len = n;
    return LM_OK;
}

int lm_text_reserve(lm_text *t, size_t extra) {
    if (t->failed) return 0;
    if (t->n + extra + 1 <= t->cap) return 1;
    size_t cap = t->cap ? t->cap : 256;
    while (cap < t->n + extra + 1) cap *= 2;
    char *p = realloc(t->s, cap);
    if (!p) {
        t->failed = 1;
        return 0;
    }
    t->s = p;
    t->cap = cap;
    return 1;
}

void lm_text_put(lm_text *t, const char *s, size_t n) {
    if (!lm_text_reserve(t, n)) return;
    memcpy(t->s + t->n, s, n);
    t->n += n;
    t->s[t->n] = 0;
}

void lm_text_puts(lm_text *t, const char *s) { lm_text_put(t, s, strlen(s)); }

void lm_text_printf(lm_text *t, const char *fmt, ...) {
    if (t->failed) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0) {
        t->failed = 1;
        return;
    }
    if (!lm_text_reserve(t, (size_t)k)) return;
    va_start(ap, fmt);
    vsnprintf(t->s + t->n, (size_t)k + 1, fmt, ap);
    va_end(ap);
    t->n += (size_t)k;
}

void lm_text_free(lm_text *t) {
    free(t->s);
    memset(t, 0, sizeof *t);
}
