/* Flag parsing shared by the subcommands. */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

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
