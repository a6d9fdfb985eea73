/* Flag parsing shared by the subcommands. */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/safetensors.h"

int cli_fail(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "longmoe %s: error: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

int cli_parse_double(const char *cmd, const char *flag, const char *text, double *out) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end || errno || !isfinite(v))
        return cli_fail(cmd, "%s expects a finite number, got '%s'", flag, text);
    *out = v;
    return 0;
}

int cli_parse_int(const char *cmd, const char *flag, const char *text, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (end == text || *end || errno)
        return cli_fail(cmd, "%s expects an integer, got '%s'", flag, text);
    if (v < lo || v > hi) return cli_fail(cmd, "%s must lie in [%ld, %ld], got %ld", flag, lo, hi, v);
    *out = v;
    return 0;
}

const char *cli_value(const char *cmd, int argc, char **argv, int *i) {
    if (*i + 1 >= argc) {
        cli_fail(cmd, "%s needs a value", argv[*i]);
        return NULL;
    }
    return argv[++*i];
}

/* "[2,38,*]" for a shape with free (-1) dimensions */
static void dims_text(char *buf, size_t size, const int64_t *d, int n) {
    size_t len = 0;
    buf[0] = 0;
    for (int i = 0; i < n && len < size; i++) {
        if (d[i] < 0) len += (size_t)snprintf(buf + len, size - len, "%s*", i ? "," : "[");
        else len += (size_t)snprintf(buf + len, size - len, "%s%lld", i ? "," : "[", (long long)d[i]);
    }
    if (len < size) snprintf(buf + len, size - len, "]");
}

int cli_read_tensor(const char *cmd, const struct lm_safetensors *st, const char *name, int ndim, const char *dims,
                    const int64_t *want, float **out, int64_t *shape) {
    int64_t got[LM_ST_MAX_DIMS];
    if (lm_safetensors_read_f32(st, name, ndim, out, got)) {
        if (dims) return cli_fail(cmd, "%s (expected %s)", lm_last_error(), dims);
        return cli_fail(cmd, "%s", lm_last_error());
    }
    for (int d = 0; want && d < ndim; d++)
        if (want[d] >= 0 && got[d] != want[d]) {
            char g[128], w[128];
            dims_text(g, sizeof g, got, ndim);
            dims_text(w, sizeof w, want, ndim);
            free(*out);
            *out = NULL;
            if (dims) return cli_fail(cmd, "tensor '%s' has shape %s, expected %s = %s", name, g, dims, w);
            return cli_fail(cmd, "tensor '%s' has shape %s, expected %s", name, g, w);
        }
    if (shape) memcpy(shape, got, (size_t)ndim * sizeof *shape);
    return 0;
}

int cli_group_help(int argc, char **argv, const char *usage) {
    if (argc < 2) {
        fputs(usage, stderr);
        return 2;
    }
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(usage, stdout);
            return 0;
        }
    return -1;
}
