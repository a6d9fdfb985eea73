/* A two-way setting of the CUDA code (a process-wide switch with a setter and
 * an environment variable), shared by the modules that have one. */
#ifndef LONGMOE_CUDA_SWITCH_SETTING_CUH
#define LONGMOE_CUDA_SWITCH_SETTING_CUH

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/core.h"

/* 0 or 1 once set (lm_error naming `what` otherwise), else read once from the
 * environment variable `env`: `names[1]` gives 1, `names[0]` 0, unset gives
 * `dflt`, anything else `dflt` with a message. */
typedef struct {
    int value; /* -1: not read yet */
    const char *env, *what, *names[2];
    int dflt;
} switch_setting;

static inline lm_status switch_set(switch_setting *s, int v) {
    if (v != 0 && v != 1)
        return lm_error(LM_ERR_ARG, "%s: %d (expected 0: %s or 1: %s)", s->what, v, s->names[0], s->names[1]);
    s->value = v;
    return LM_OK;
}

static inline int switch_get(switch_setting *s) {
    if (s->value < 0) {
        const char *e = getenv(s->env);
        s->value = e && !strcmp(e, s->names[1]) ? 1 : e && !strcmp(e, s->names[0]) ? 0 : s->dflt;
        if (e && *e && strcmp(e, s->names[0]) && strcmp(e, s->names[1]))
            fprintf(stderr, "longmoe: %s=%s ignored: use %s or %s\n", s->env, e, s->names[0], s->names[1]);
    }
    return s->value;
}

#endif
