/* Check macros in the spirit of llm.c: a failed allocation, file operation or
 * (later) CUDA call prints file, line, what failed and a hint, then exits.
 * Used by the CLI and tests, where there is nothing to unwind; library code
 * returns lm_status instead. */
#ifndef LONGMOE_CHECK_H
#define LONGMOE_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "longmoe/core.h"

#ifdef __cplusplus
extern "C" {
#endif

void *lm_malloc_check(size_t size, const char *file, int line);
void *lm_calloc_check(size_t n, size_t size, const char *file, int line);
FILE *lm_fopen_check(const char *path, const char *mode, const char *file, int line);
void lm_die_at(const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4), noreturn))
#endif
    ;

#define mallocCheck(size) lm_malloc_check((size), __FILE__, __LINE__)
#define callocCheck(n, size) lm_calloc_check((n), (size), __FILE__, __LINE__)
#define fopenCheck(path, mode) lm_fopen_check((path), (mode), __FILE__, __LINE__)
#define dieAt(...) lm_die_at(__FILE__, __LINE__, __VA_ARGS__)

/* For library code: return the lm_status of x when it is an error. */
#define TRY(x)                 \
    do {                       \
        lm_status s_ = (x);    \
        if (s_) return s_;     \
    } while (0)

/* For library code: allocate or return LM_ERR_MEMORY with a message. */
#define LM_TRY_ALLOC(ptr, size)                                                        \
    do {                                                                               \
        (ptr) = malloc((size) ? (size) : 1);                                           \
        if (!(ptr))                                                                    \
            return lm_error(LM_ERR_MEMORY, "%s:%d: out of memory allocating %zu bytes " \
                            "(reduce B, T or the model size)", __FILE__, __LINE__,     \
                            (size_t)(size));                                           \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif
