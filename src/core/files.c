/* Whole-file reading and growable text (src/core/files.h). */
#define _POSIX_C_SOURCE 200809L
#include "files.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

lm_status lm_read_file(const char *path, size_t max_bytes, char **bytes, size_t *len) {
    *bytes = NULL;
    if (len) *len = 0;
    int is_stdin = !strcmp(path, "-");
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) return lm_error(LM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
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
