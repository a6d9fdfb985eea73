/* A minimal test harness. Each test file is one program:
 *
 *   static void test_chunked_equals_recurrent(void) { CHECK(...); CHECK_CLOSE(...); }
 *   int main(void) { RUN(test_chunked_equals_recurrent); return test_summary(); }
 *
 * CHECK records a failure (with file, line and message) and carries on, so one
 * run reports every broken property. SKIP("reason", ...) ends a case that
 * cannot run here (no Chromium, no Python package, no GPU): it is printed as
 * "skip" with its reason and counted apart, never as passed. The summary's
 * last line reads "N passed, N failed, N skipped"; the exit code is 1 when
 * anything failed, TEST_SKIP_CODE when every case skipped (ctest then shows
 * the program as skipped: SKIP_RETURN_CODE in CMakeLists.txt), else 0. */
#ifndef LONGMOE_TEST_H
#define LONGMOE_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "longmoe/core.h"

/* The exit code of a program whose every case skipped (ctest's SKIP_RETURN_CODE). */
#define TEST_SKIP_CODE 77

static int test_passed_count, test_failed_count, test_skipped_count, test_current_failures, test_current_skipped;
static const char *test_current_name;
static char test_current_skip_reason[512];
static const char *test_skip_all_reason; /* set: RUN skips every case with this reason */

/* End the current case as skipped, with a printf-style reason. */
#define SKIP(...)                                                                                  \
    do {                                                                                           \
        test_current_skipped = 1;                                                                  \
        snprintf(test_current_skip_reason, sizeof test_current_skip_reason, __VA_ARGS__);          \
        return;                                                                                    \
    } while (0)

/* Skip every case that RUN runs from now on (a program that needs a device
 * this machine lacks); `reason` must outlive the program's cases. */
static inline void test_skip_all(const char *reason) { test_skip_all_reason = reason; }

#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            test_current_failures++;                                                          \
            fprintf(stderr, "  FAIL %s (%s:%d): %s: ", test_current_name, __FILE__, __LINE__, \
                    #cond);                                                                   \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fputc('\n', stderr);                                                              \
        }                                                                                     \
    } while (0)

/* |got - want| <= atol + rtol * |want| */
#define CHECK_CLOSE(got, want, atol, rtol, what)                                             \
    do {                                                                                     \
        double g_ = (double)(got), w_ = (double)(want);                                      \
        CHECK(fabs(g_ - w_) <= (atol) + (rtol)*fabs(w_) && !isnan(g_),                       \
              "%s: got %.9g want %.9g (diff %.3g)", (what), g_, w_, fabs(g_ - w_));          \
    } while (0)

#define RUN(fn)                                                                               \
    do {                                                                                      \
        test_current_name = #fn;                                                              \
        test_current_failures = 0;                                                            \
        test_current_skipped = 0;                                                             \
        double t0_ = lm_time_seconds();                                                       \
        if (test_skip_all_reason) {                                                           \
            test_current_skipped = 1;                                                         \
            snprintf(test_current_skip_reason, sizeof test_current_skip_reason, "%s",         \
                     test_skip_all_reason);                                                   \
        } else {                                                                              \
            fn();                                                                             \
        }                                                                                     \
        double dt_ = lm_time_seconds() - t0_;                                                 \
        if (test_current_failures) {                                                          \
            test_failed_count++;                                                              \
            printf("FAIL %-60s %7.2fs\n", #fn, dt_);                                          \
        } else if (test_current_skipped) {                                                    \
            test_skipped_count++;                                                             \
            printf("skip %-60s %7.2fs: %s\n", #fn, dt_, test_current_skip_reason);            \
        } else {                                                                              \
            test_passed_count++;                                                              \
            printf("ok   %-60s %7.2fs\n", #fn, dt_);                                          \
        }                                                                                     \
        fflush(stdout);                                                                       \
    } while (0)

static inline int test_summary(void) {
    printf("%d passed, %d failed, %d skipped\n", test_passed_count, test_failed_count, test_skipped_count);
    fflush(stdout);
    if (test_failed_count) return 1;
    return test_skipped_count && !test_passed_count ? TEST_SKIP_CODE : 0;
}

#ifdef LONGMOE_HAVE_CUDA
#include <cuda_runtime_api.h>
/* For tests/test_cuda_*.c: skip every case (test_skip_all) when no CUDA device
 * is visible; any other error of the CUDA runtime is left to fail the cases. */
static inline void test_skip_without_cuda(void) {
    static char why[256];
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || (e == cudaSuccess && n == 0)) {
        snprintf(why, sizeof why, "no CUDA device visible (%s)", e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
        test_skip_all(why);
    }
}
#endif

/* Relative error ||a - b|| / ||b|| of two double arrays. */
static inline double test_rel_error(const double *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Relative error of a float array against a double reference. */
static inline double test_rel_error_f(const float *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
        if (isnan(a[i])) return INFINITY;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The whole file at `path`, NUL-terminated, in a new malloc'd buffer (NULL
 * if it cannot be read); *n (may be NULL) receives its length. */
static inline char *test_slurp(const char *path, size_t *n) {
    if (n) *n = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = len >= 0 ? malloc((size_t)len + 1) : NULL;
    if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) b[len] = 0;
    if (n) *n = b ? (size_t)len : 0;
    return b;
}

/* The step a run directory's `latest` names (-1: none), without checking the
 * checkpoint directory itself. */
static inline long long test_latest_step(const char *run) {
    char path[600];
    snprintf(path, sizeof path, "%s/latest", run);
    char *text = test_slurp(path, NULL);
    long long step = -1;
    if (text && sscanf(text, "checkpoint-%lld", &step) != 1) step = -1;
    free(text);
    return step;
}

/* 1 when both files can be read and hold the same bytes. */
static inline int test_same_file(const char *a, const char *b) {
    size_t na, nb;
    char *x = test_slurp(a, &na), *y = test_slurp(b, &nb);
    int same = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

#ifdef LONGMOE_CLI
/* Run the longmoe CLI with `args`, stdout into out_path and stderr into
 * err_path; returns its exit code (-1 when it did not exit normally). */
static inline int test_run_cli(const char *args, const char *out_path, const char *err_path) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s > %s 2> %s", LONGMOE_CLI, args, out_path, err_path);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
#endif

/* 1 when the file at `path` contains `phrase`; otherwise prints the file. */
static inline int test_file_has(const char *path, const char *phrase) {
    char *text = test_slurp(path, NULL);
    int found = text && strstr(text, phrase) != NULL;
    if (!found) fprintf(stderr, "  %s was: %s\n", path, text ? text : "(unreadable)");
    free(text);
    return found;
}

/* `dir`/`name` in one of 16 rotating buffers (valid for the next 15 calls). */
static inline const char *test_path(const char *dir, const char *name) {
    static char buf[16][512];
    static int slot;
    slot = (slot + 1) % 16;
    snprintf(buf[slot], sizeof buf[slot], "%s/%s", dir, name);
    return buf[slot];
}

/* A new, empty directory $TMPDIR/longmoe-test-<tag>-XXXXXX (/tmp without
 * TMPDIR), its path in dir[n]; 0 on success, else -1 (reason printed). */
static inline int test_make_tmpdir(char *dir, size_t n, const char *tag) {
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, n, "%s/longmoe-test-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", tag);
    if (mkdtemp(dir)) return 0;
    perror("mkdtemp");
    return -1;
}

/* Remove a test's directory and everything in it (a warning if that fails). */
static inline void test_remove_tree(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

#endif
