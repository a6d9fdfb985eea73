/* The tiled causal attention core (src/ops/attention/) against its definition:
 * a float64 softmax attention written out in this file. */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/attention.h"
#include "test.h"

/* ---------------------------------------------------------------- helpers */

static float *rand_floats(lm_rng *r, size_t n, double sd) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = (float)(sd * lm_rng_normal(r));
    return x;
}

static double *to_double(const float *x, size_t n) {
    double *y = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}

typedef struct {
    lm_attention_config c;
    size_t nq, nk, nv, no, nl;
} shape;

static shape make_shape(int B, int T, int H, int Hkv, int Dk, int Dv, float scale) {
    shape s;
    s.c = lm_attention_config_default(B, T, H, Hkv, Dk, Dv);
    s.c.scale = scale;
    s.nq = (size_t)B * T * H * Dk;
    s.nk = (size_t)B * T * Hkv * Dk;
    s.nv = (size_t)B * T * Hkv * Dv;
    s.no = (size_t)B * T * H * Dv;
    s.nl = (size_t)B * H * T;
    return s;
}

/* float64 definition: s_ij = scale q_i.k_j (j <= i), softmax, o = P v. */
static void ref_forward(const lm_attention_config *c, const double *q, const double *k,
                        const double *v, double *o, double *lse) {
    const int B = c->B, T = c->T, H = c->H, Hkv = c->Hkv, Dk = c->Dk, Dv = c->Dv, G = H / Hkv;
    const double scale = c->scale > 0 ? c->scale : 1.0 / sqrt((double)Dk);
    double *s = malloc((size_t)T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const double *qi = q + (((size_t)b * T + i) * H + h) * Dk;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= i; j++) {
                    const double *kj = k + (((size_t)b * T + j) * Hkv + h / G) * Dk;
                    double d = 0;
                    for (int x = 0; x < Dk; x++) d += qi[x] * kj[x];
                    s[j] = scale * d;
                    if (s[j] > mx) mx = s[j];
                }
                for (int j = 0; j <= i; j++) sum += exp(s[j] - mx);
                double *oi = o + (((size_t)b * T + i) * H + h) * Dv;
                for (int e = 0; e < Dv; e++) oi[e] = 0;
                for (int j = 0; j <= i; j++) {
                    const double p = exp(s[j] - mx) / sum;
                    const double *vj = v + (((size_t)b * T + j) * Hkv + h / G) * Dv;
                    for (int e = 0; e < Dv; e++) oi[e] += p * vj[e];
                }
                lse[((size_t)b * H + h) * T + i] = mx + log(sum);
            }
    free(s);
}

/* float64 backward of ref_forward (the textbook softmax-attention gradient), += into dq, dk, dv. */
static void ref_backward(const lm_attention_config *c, const double *q, const double *k,
                         const double *v, const double *d_o, double *dq, double *dk, double *dv) {
    const int B = c->B, T = c->T, H = c->H, Hkv = c->Hkv, Dk = c->Dk, Dv = c->Dv, G = H / Hkv;
    const double scale = c->scale > 0 ? c->scale : 1.0 / sqrt((double)Dk);
    double *p = malloc((size_t)T * sizeof(double)), *dp = malloc((size_t)T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                const double *qi = q + (((size_t)b * T + i) * H + h) * Dk;
                const double *doi = d_o + (((size_t)b * T + i) * H + h) * Dv;
                double mx = -INFINITY, sum = 0, pdp = 0;
                for (int j = 0; j <= i; j++) {
                    const double *kj = k + (((size_t)b * T + j) * Hkv + h / G) * Dk;
                    const double *vj = v + (((size_t)b * T + j) * Hkv + h / G) * Dv;
                    double d = 0, e2 = 0;
                    for (int x = 0; x < Dk; x++) d += qi[x] * kj[x];
                    for (int x = 0; x < Dv; x++) e2 += doi[x] * vj[x];
                    p[j] = scale * d, dp[j] = e2;
                    if (p[j] > mx) mx = p[j];
                }
                for (int j = 0; j <= i; j++) sum += (p[j] = exp(p[j] - mx));
                for (int j = 0; j <= i; j++) p[j] /= sum, pdp += p[j] * dp[j];
                for (int j = 0; j <= i; j++) {
                    const double ds = p[j] * (dp[j] - pdp);
                    double *kj = (double *)k + (((size_t)b * T + j) * Hkv + h / G) * Dk;
                    double *dkj = dk + (((size_t)b * T + j) * Hkv + h / G) * Dk;
                    double *dvj = dv + (((size_t)b * T + j) * Hkv + h / G) * Dv;
                    double *dqi = dq + (((size_t)b * T + i) * H + h) * Dk;
                    for (int x = 0; x < Dk; x++) dqi[x] += scale * ds * kj[x], dkj[x] += scale * ds * qi[x];
                    for (int x = 0; x < Dv; x++) dvj[x] += p[j] * doi[x];
                }
            }
    free(p);
    free(dp);
}

static double max_abs_diff_f(const float *a, const double *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (isnan(a[i])) return INFINITY;
        if (d > m) m = d;
    }
    return m;
}

/* The shapes every comparison runs: T = 1, T not a multiple of the tile, GQA, custom scale. */
static const int shapes[][7] = {
    /* B, T, H, Hkv, Dk, Dv, scale*1000 (0 = default) */
    {1, 1, 1, 1, 8, 8, 0},     {2, 1, 4, 2, 16, 8, 0},    {1, 65, 2, 1, 16, 24, 0},
    {2, 130, 3, 3, 32, 16, 0}, {1, 200, 4, 1, 64, 64, 0}, {2, 97, 6, 2, 8, 40, 300},
    {1, 64, 2, 2, 64, 32, 0},
};
#define NSHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static shape shape_at(int i) {
    return make_shape(shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], shapes[i][4],
                      shapes[i][5], shapes[i][6] / 1000.0f);
}

/* ---------------------------------------------------------------- tests */

static void test_tiled_forward_equals_float64_softmax_attention(void) {
    lm_rng r;
    lm_rng_seed(&r, 11);
    for (int si = 0; si < NSHAPES; si++) {
        shape s = shape_at(si);
        float *q = rand_floats(&r, s.nq, 1.0), *k = rand_floats(&r, s.nk, 1.0), *v = rand_floats(&r, s.nv, 1.0);
        float *o = malloc(s.no * sizeof(float)), *lse = malloc(s.nl * sizeof(float));
        double *qd = to_double(q, s.nq), *kd = to_double(k, s.nk), *vd = to_double(v, s.nv);
        double *od = malloc(s.no * sizeof(double)), *lsed = malloc(s.nl * sizeof(double));
        CHECK(lm_attention_forward(&s.c, q, k, v, o, lse) == LM_OK, "%s", lm_last_error());
        ref_forward(&s.c, qd, kd, vd, od, lsed);
        char what[128];
        snprintf(what, sizeof what, "shape %d (T=%d H=%d Hkv=%d Dk=%d Dv=%d) o rel err", si, s.c.T,
                 s.c.H, s.c.Hkv, s.c.Dk, s.c.Dv);
        CHECK_CLOSE(test_rel_error_f(o, od, s.no), 0, 2e-6, 0, what);
        snprintf(what, sizeof what, "shape %d lse max abs err", si);
        CHECK_CLOSE(max_abs_diff_f(lse, lsed, s.nl), 0, 1e-5, 0, what);
        free(q), free(k), free(v), free(o), free(lse), free(qd), free(kd), free(vd), free(od), free(lsed);
    }
}

static void test_tiled_backward_equals_float64_gradient_and_accumulates(void) {
    lm_rng r;
    lm_rng_seed(&r, 12);
    for (int si = 0; si < NSHAPES; si++) {
        shape s = shape_at(si);
        float *q = rand_floats(&r, s.nq, 1.0), *k = rand_floats(&r, s.nk, 1.0), *v = rand_floats(&r, s.nv, 1.0);
        float *d_o = rand_floats(&r, s.no, 1.0);
        float *o = malloc(s.no * sizeof(float)), *lse = malloc(s.nl * sizeof(float));
        /* gradients start from random values: the backward must add, not overwrite */
        float *dq = rand_floats(&r, s.nq, 1.0), *dk = rand_floats(&r, s.nk, 1.0), *dv = rand_floats(&r, s.nv, 1.0);
        double *qd = to_double(q, s.nq), *kd = to_double(k, s.nk), *vd = to_double(v, s.nv);
        double *dod = to_double(d_o, s.no);
        double *dqd = to_double(dq, s.nq), *dkd = to_double(dk, s.nk), *dvd = to_double(dv, s.nv);
        CHECK(lm_attention_forward(&s.c, q, k, v, o, lse) == LM_OK, "%s", lm_last_error());
        CHECK(lm_attention_backward(&s.c, q, k, v, o, lse, d_o, dq, dk, dv) == LM_OK, "%s",
              lm_last_error());
        ref_backward(&s.c, qd, kd, vd, dod, dqd, dkd, dvd);
        char what[128];
        snprintf(what, sizeof what, "shape %d (T=%d H=%d Hkv=%d) dq rel err", si, s.c.T, s.c.H, s.c.Hkv);
        CHECK_CLOSE(test_rel_error_f(dq, dqd, s.nq), 0, 1e-5, 0, what);
        snprintf(what, sizeof what, "shape %d dk rel err", si);
        CHECK_CLOSE(test_rel_error_f(dk, dkd, s.nk), 0, 1e-5, 0, what);
        snprintf(what, sizeof what, "shape %d dv rel err", si);
        CHECK_CLOSE(test_rel_error_f(dv, dvd, s.nv), 0, 1e-5, 0, what);
        free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv);
        free(qd), free(kd), free(vd), free(dod), free(dqd), free(dkd), free(dvd);
    }
}

/* The float64 oracle's gradient is itself checked: central differences of
 * L = sum(dO * o) in float64 agree with ref_backward. */
static void test_float64_reference_gradient_equals_finite_differences(void) {
    lm_rng r;
    lm_rng_seed(&r, 13);
    shape s = make_shape(1, 7, 4, 2, 5, 3, 0);
    float *qf = rand_floats(&r, s.nq, 1.0), *kf = rand_floats(&r, s.nk, 1.0), *vf = rand_floats(&r, s.nv, 1.0);
    float *dof = rand_floats(&r, s.no, 1.0);
    double *q = to_double(qf, s.nq), *k = to_double(kf, s.nk), *v = to_double(vf, s.nv);
    double *d_o = to_double(dof, s.no);
    double *dq = calloc(s.nq, sizeof(double)), *dk = calloc(s.nk, sizeof(double)), *dv = calloc(s.nv, sizeof(double));
    double *o = malloc(s.no * sizeof(double)), *lse = malloc(s.nl * sizeof(double));
    ref_backward(&s.c, q, k, v, d_o, dq, dk, dv);
    double *xs[3] = {q, k, v}, *gs[3] = {dq, dk, dv};
    size_t ns[3] = {s.nq, s.nk, s.nv};
    const char *names[3] = {"dq", "dk", "dv"};
    const double h = 1e-6;
    for (int t = 0; t < 3; t++)
        for (size_t i = 0; i < ns[t]; i++) {
            double keep = xs[t][i], lp = 0, lm = 0;
            xs[t][i] = keep + h;
            ref_forward(&s.c, q, k, v, o, lse);
            for (size_t e = 0; e < s.no; e++) lp += d_o[e] * o[e];
            xs[t][i] = keep - h;
            ref_forward(&s.c, q, k, v, o, lse);
            for (size_t e = 0; e < s.no; e++) lm += d_o[e] * o[e];
            xs[t][i] = keep;
            CHECK_CLOSE(gs[t][i], (lp - lm) / (2 * h), 1e-7, 1e-6, names[t]);
        }
    free(qf), free(kf), free(vf), free(dof), free(q), free(k), free(v), free(d_o);
    free(dq), free(dk), free(dv), free(o), free(lse);
}

static void test_naive_reference_equals_float64(void) {
    lm_rng r;
    lm_rng_seed(&r, 14);
    for (int si = 0; si < NSHAPES; si += 2) {
        shape s = shape_at(si);
        float *q = rand_floats(&r, s.nq, 1.0), *k = rand_floats(&r, s.nk, 1.0), *v = rand_floats(&r, s.nv, 1.0);
        float *d_o = rand_floats(&r, s.no, 1.0);
        float *o = malloc(s.no * sizeof(float)), *lse = malloc(s.nl * sizeof(float));
        float *dq = calloc(s.nq, 4), *dk = calloc(s.nk, 4), *dv = calloc(s.nv, 4);
        double *qd = to_double(q, s.nq), *kd = to_double(k, s.nk), *vd = to_double(v, s.nv);
        double *dod = to_double(d_o, s.no), *od = malloc(s.no * 8), *lsed = malloc(s.nl * 8);
        double *dqd = calloc(s.nq, 8), *dkd = calloc(s.nk, 8), *dvd = calloc(s.nv, 8);
        CHECK(lm_attention_naive_forward(&s.c, q, k, v, o, lse) == LM_OK, "%s", lm_last_error());
        CHECK(lm_attention_naive_backward(&s.c, q, k, v, o, lse, d_o, dq, dk, dv) == LM_OK, "%s",
              lm_last_error());
        ref_forward(&s.c, qd, kd, vd, od, lsed);
        ref_backward(&s.c, qd, kd, vd, dod, dqd, dkd, dvd);
        CHECK_CLOSE(test_rel_error_f(o, od, s.no), 0, 2e-6, 0, "naive o");
        CHECK_CLOSE(max_abs_diff_f(lse, lsed, s.nl), 0, 1e-5, 0, "naive lse");
        CHECK_CLOSE(test_rel_error_f(dq, dqd, s.nq), 0, 1e-5, 0, "naive dq");
        CHECK_CLOSE(test_rel_error_f(dk, dkd, s.nk), 0, 1e-5, 0, "naive dk");
        CHECK_CLOSE(test_rel_error_f(dv, dvd, s.nv), 0, 1e-5, 0, "naive dv");
        free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv);
        free(qd), free(kd), free(vd), free(dod), free(od), free(lsed), free(dqd), free(dkd), free(dvd);
    }
}

/* Changing tokens t >= t0 leaves every output and lse at t < t0 bit-identical. */
static void test_past_outputs_bit_identical_when_future_changes(void) {
    lm_rng r;
    lm_rng_seed(&r, 15);
    shape s = make_shape(2, 150, 4, 2, 16, 16, 0);
    const int t0 = 83;
    float *q = rand_floats(&r, s.nq, 1.0), *k = rand_floats(&r, s.nk, 1.0), *v = rand_floats(&r, s.nv, 1.0);
    float *o1 = malloc(s.no * 4), *o2 = malloc(s.no * 4), *l1 = malloc(s.nl * 4), *l2 = malloc(s.nl * 4);
    CHECK(lm_attention_forward(&s.c, q, k, v, o1, l1) == LM_OK, "%s", lm_last_error());
    const int B = s.c.B, T = s.c.T, H = s.c.H, Hkv = s.c.Hkv, Dk = s.c.Dk, Dv = s.c.Dv;
    for (int b = 0; b < B; b++)
        for (int t = t0; t < T; t++) {
            for (size_t i = 0; i < (size_t)H * Dk; i++) q[((size_t)b * T + t) * H * Dk + i] += 1.5f;
            for (size_t i = 0; i < (size_t)Hkv * Dk; i++) k[((size_t)b * T + t) * Hkv * Dk + i] *= -3.0f;
            for (size_t i = 0; i < (size_t)Hkv * Dv; i++) v[((size_t)b * T + t) * Hkv * Dv + i] += 7.0f;
        }
    CHECK(lm_attention_forward(&s.c, q, k, v, o2, l2) == LM_OK, "%s", lm_last_error());
    int past_same = 1, future_differs = 0;
    for (int b = 0; b < B; b++) {
        const size_t row = (size_t)H * Dv;
        past_same &= !memcmp(o1 + (size_t)b * T * row, o2 + (size_t)b * T * row, t0 * row * 4);
        future_differs |= memcmp(o1 + ((size_t)b * T + t0) * row, o2 + ((size_t)b * T + t0) * row,
                                 (T - t0) * row * 4) != 0;
        for (int h = 0; h < H; h++)
            past_same &= !memcmp(l1 + ((size_t)b * H + h) * T, l2 + ((size_t)b * H + h) * T, t0 * 4);
    }
    CHECK(past_same, "outputs before t0=%d changed when tokens >= t0 changed", t0);
    CHECK(future_differs, "outputs at t >= t0 did not change (the perturbation was not seen)");
    free(q), free(k), free(v), free(o1), free(o2), free(l1), free(l2);
}

/* Each output element is written by one work item: 1 and 2 threads agree bit for bit. */
static void test_result_independent_of_thread_count(void) {
    lm_rng r;
    lm_rng_seed(&r, 16);
    shape s = make_shape(1, 300, 4, 2, 32, 16, 0);
    float *q = rand_floats(&r, s.nq, 1.0), *k = rand_floats(&r, s.nk, 1.0), *v = rand_floats(&r, s.nv, 1.0);
    float *d_o = rand_floats(&r, s.no, 1.0);
    float *o[2], *lse[2], *dq[2], *dk[2], *dv[2];
    const int saved = omp_get_max_threads();
    for (int n = 0; n < 2; n++) {
        omp_set_num_threads(n + 1);
        o[n] = malloc(s.no * 4), lse[n] = malloc(s.nl * 4);
        dq[n] = calloc(s.nq, 4), dk[n] = calloc(s.nk, 4), dv[n] = calloc(s.nv, 4);
        CHECK(lm_attention_forward(&s.c, q, k, v, o[n], lse[n]) == LM_OK, "%s", lm_last_error());
        CHECK(lm_attention_backward(&s.c, q, k, v, o[n], lse[n], d_o, dq[n], dk[n], dv[n]) == LM_OK,
              "%s", lm_last_error());
    }
    omp_set_num_threads(saved);
    CHECK(!memcmp(o[0], o[1], s.no * 4), "o differs between 1 and 2 threads");
    CHECK(!memcmp(lse[0], lse[1], s.nl * 4), "lse differs between 1 and 2 threads");
    CHECK(!memcmp(dq[0], dq[1], s.nq * 4), "dq differs between 1 and 2 threads");
    CHECK(!memcmp(dk[0], dk[1], s.nk * 4), "dk differs between 1 and 2 threads");
    CHECK(!memcmp(dv[0], dv[1], s.nv * 4), "dv differs between 1 and 2 threads");
    for (int n = 0; n < 2; n++) free(o[n]), free(lse[n]), free(dq[n]), free(dk[n]), free(dv[n]);
    free(q), free(k), free(v), free(d_o);
}

static void test_bad_shapes_are_rejected_with_clear_errors(void) {
    float x[4] = {1, 2, 3, 4};
    lm_attention_config c = lm_attention_config_default(1, 1, 3, 2, 1, 1);
    CHECK(lm_attention_forward(&c, x, x, x, x, x) == LM_ERR_ARG, "H=3, Hkv=2 accepted");
    CHECK(strstr(lm_last_error(), "multiple") != NULL, "message: %s", lm_last_error());
    c = lm_attention_config_default(1, 0, 1, 1, 1, 1);
    CHECK(lm_attention_forward(&c, x, x, x, x, x) == LM_ERR_ARG, "T=0 accepted");
    CHECK(strstr(lm_last_error(), "T=0") != NULL, "message: %s", lm_last_error());
    c = lm_attention_config_default(1, 1, 1, 1, 1, 1);
    c.scale = -1;
    CHECK(lm_attention_backward(&c, x, x, x, x, x, x, x, x, x) == LM_ERR_ARG, "negative scale accepted");
}

/* ---- memory: peak resident memory of one call, measured in a child process ---- */

static long status_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, n)) v = strtol(line + n, NULL, 10);
    fclose(f);
    return v;
}

/* Peak RSS growth (bytes) of allocating the inputs and running the core: the
 * tiled forward + backward (naive = 0) or the naive forward (naive = 1).
 * -1 when /proc is unavailable. */
static long long measure_peak_bytes(int naive, int T, int H, int D) {
    int fd[2];
    if (pipe(fd)) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        close(fd[0]);
        long long result = -1;
        /* start the thread pool first so its stacks are part of the baseline */
#pragma omp parallel
        { volatile int sink = omp_get_thread_num(); (void)sink; }
        FILE *cr = fopen("/proc/self/clear_refs", "w"); /* reset the high-water mark */
        if (cr) fputs("5", cr), fclose(cr);
        long base = status_kb("VmRSS:");
        if (base >= 0) {
            shape s = make_shape(1, T, H, H, D, D, 0);
            lm_rng r;
            lm_rng_seed(&r, 17);
            float *q = rand_floats(&r, s.nq, 1.0), *k = rand_floats(&r, s.nk, 1.0), *v = rand_floats(&r, s.nv, 1.0);
            float *o = malloc(s.no * 4), *lse = malloc(s.nl * 4);
            if (naive) {
                lm_attention_naive_forward(&s.c, q, k, v, o, lse);
            } else {
                float *d_o = rand_floats(&r, s.no, 1.0);
                float *dq = calloc(s.nq, 4), *dk = calloc(s.nk, 4), *dv = calloc(s.nv, 4);
                lm_attention_forward(&s.c, q, k, v, o, lse);
                lm_attention_backward(&s.c, q, k, v, o, lse, d_o, dq, dk, dv);
                free(d_o), free(dq), free(dk), free(dv);
            }
            long peak = status_kb("VmHWM:");
            if (peak >= 0) result = (long long)(peak - base) * 1024;
            free(q), free(k), free(v), free(o), free(lse);
        }
        if (write(fd[1], &result, sizeof result) != sizeof result) _exit(1);
        _exit(0);
    }
    close(fd[1]);
    long long result = -1;
    if (read(fd[0], &result, sizeof result) != sizeof result) result = -1;
    close(fd[0]);
    waitpid(pid, NULL, 0);
    return result;
}

/* Quadrupling T quadruples the tiled core's peak memory (inputs, outputs and
 * the O(T) backward statistics), never 16x; the naive version, measured the
 * same way, shows the quadratic growth the measurement is able to see. */
static void test_peak_memory_grows_linearly_in_T(void) {
    const int T1 = 1024, T2 = 4096, H = 2, D = 32;
    /* the forward workspace does not depend on T at all */
    lm_attention_config c1 = lm_attention_config_default(1, T1, H, H, D, D);
    lm_attention_config c2 = lm_attention_config_default(1, T2, H, H, D, D);
    CHECK(lm_attention_forward_workspace_bytes(&c1, 2) == lm_attention_forward_workspace_bytes(&c2, 2),
          "forward workspace depends on T: %zu vs %zu", lm_attention_forward_workspace_bytes(&c1, 2),
          lm_attention_forward_workspace_bytes(&c2, 2));
    long long t1 = measure_peak_bytes(0, T1, H, D), t2 = measure_peak_bytes(0, T2, H, D);
    long long n1 = measure_peak_bytes(1, T1, 1, D), n2 = measure_peak_bytes(1, T2, 1, D);
    if (t1 <= 0 || t2 <= 0 || n1 <= 0 || n2 <= 0) {
        CHECK(0, "could not measure peak RSS (/proc/self/status): %lld %lld %lld %lld", t1, t2, n1, n2);
        return;
    }
    printf("     peak RSS growth: tiled fwd+bwd T=%d %.2f MB, T=%d %.2f MB (x%.2f); "
           "naive fwd T=%d %.2f MB, T=%d %.2f MB (x%.2f)\n",
           T1, t1 / 1e6, T2, t2 / 1e6, (double)t2 / t1, T1, n1 / 1e6, T2, n2 / 1e6, (double)n2 / n1);
    /* what the tiled call must hold at T2: 9 tensors of T*H*D floats, lse and D, workspace */
    const double io2 = 9.0 * T2 * H * D * 4 + 2.0 * H * T2 * 4 + lm_attention_backward_workspace_bytes(&c2, 0);
    CHECK((double)t2 / t1 < 5.0, "tiled peak grew x%.2f for x4 T (linear would be ~4)", (double)t2 / t1);
    CHECK(t2 < io2 + 4e6, "tiled peak %.2f MB exceeds its inputs, outputs and workspace %.2f MB + 4 MB",
          t2 / 1e6, io2 / 1e6);
    CHECK(t2 < (double)T2 * T2 * 4 / 4, "tiled peak %.2f MB is of the order of a T x T matrix", t2 / 1e6);
    CHECK((double)n2 / n1 > 7.0, "naive peak grew only x%.2f for x4 T: the measurement misses T^2",
          (double)n2 / n1);
}

int main(void) {
    /* first: the memory measurement forks while this process is still small */
    RUN(test_peak_memory_grows_linearly_in_T);
    RUN(test_tiled_forward_equals_float64_softmax_attention);
    RUN(test_tiled_backward_equals_float64_gradient_and_accumulates);
    RUN(test_float64_reference_gradient_equals_finite_differences);
    RUN(test_naive_reference_equals_float64);
    RUN(test_past_outputs_bit_identical_when_future_changes);
    RUN(test_result_independent_of_thread_count);
    RUN(test_bad_shapes_are_rejected_with_clear_errors);
    return test_summary();
}
