/* Errors, dtypes, random numbers and time: the small services every module uses. */
#define _POSIX_C_SOURCE 200809L
#include "longmoe/core.h"
#include "check.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <time.h>

/* ---- errors ---- */

static _Thread_local char lm_error_buffer[1024];

lm_status lm_error(lm_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(lm_error_buffer, sizeof lm_error_buffer, fmt, ap);
    va_end(ap);
    return code;
}

const char *lm_last_error(void) { return lm_error_buffer[0] ? lm_error_buffer : "unknown error"; }
void lm_clear_error(void) { lm_error_buffer[0] = 0; }

void lm_die_at(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "error (%s:%d): ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(EXIT_FAILURE);
}

void *lm_malloc_check(size_t size, const char *file, int line) {
    void *p = malloc(size ? size : 1);
    if (!p)
        lm_die_at(file, line, "out of memory allocating %zu bytes; hint: reduce batch, "
                  "sequence length or model size", size);
    return p;
}

void *lm_calloc_check(size_t n, size_t size, const char *file, int line) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        lm_die_at(file, line, "out of memory allocating %zu x %zu bytes; hint: reduce batch, "
                  "sequence length or model size", n, size);
    return p;
}

FILE *lm_fopen_check(const char *path, const char *mode, const char *file, int line) {
    FILE *f = fopen(path, mode);
    if (!f)
        lm_die_at(file, line, "cannot open '%s' (mode %s): %s; hint: check the path exists "
                  "and is %s", path, mode, strerror(errno),
                  mode[0] == 'r' ? "readable" : "writable");
    return f;
}

/* ---- dtypes ---- */

static const char *const lm_dtype_names[LM_DTYPE_COUNT] = {"F32", "BF16", "F16", "F64",
                                                            "I32", "I64", "U8"};
static const size_t lm_dtype_sizes[LM_DTYPE_COUNT] = {4, 2, 2, 8, 4, 8, 1};

const char *lm_dtype_name(lm_dtype t) {
    return (unsigned)t < LM_DTYPE_COUNT ? lm_dtype_names[t] : "?";
}

int lm_dtype_from_name(const char *name, lm_dtype *out) {
    for (int i = 0; i < LM_DTYPE_COUNT; i++)
        if (strcmp(name, lm_dtype_names[i]) == 0) {
            *out = (lm_dtype)i;
            return 0;
        }
    return -1;
}

size_t lm_dtype_size(lm_dtype t) { return (unsigned)t < LM_DTYPE_COUNT ? lm_dtype_sizes[t] : 0; }

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float lm_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t lm_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float lm_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        float v = ldexpf((float)mant, -24);
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t lm_f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    float a = fabsf(f);
    if (isnan(f)) return (uint16_t)(sign | 0x7e00u);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00u);
    if (a < 6.103515625e-05f) { /* subnormal: multiples of 2^-24, round to nearest even */
        float q = a * 16777216.0f;
        return (uint16_t)(sign | (uint16_t)lrintf(q));
    }
    uint32_t au = f32_bits(a);
    uint32_t exp = (au >> 23) - 112u, mant = au & 0x7fffffu;
    uint32_t h = (exp << 10) | (mant >> 13);
    uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* ---- random numbers ---- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void lm_rng_seed(lm_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t lm_rng_u64(lm_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double lm_rng_uniform(lm_rng *r) { return (double)(lm_rng_u64(r) >> 11) * 0x1.0p-53; }

double lm_rng_normal_of(uint64_t a, uint64_t b) {
    double u1 = (double)(a >> 11) * 0x1.0p-53, u2 = (double)(b >> 11) * 0x1.0p-53;
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

double lm_rng_normal(lm_rng *r) {
    uint64_t a = lm_rng_u64(r);
    return lm_rng_normal_of(a, lm_rng_u64(r));
}

uint64_t lm_mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

double lm_time_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const char *lm_build_cpu_target(void) {
#ifdef LONGMOE_MARCH_NATIVE
    return "native (-march=native)";
#else
    return "portable (no -march)";
#endif
}
