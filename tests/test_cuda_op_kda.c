/* `longmoe op kda --device cuda` (needs an NVIDIA GPU): the same tensors give
 * the CPU operator's outputs and gradients within bf16 tolerance. */
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/safetensors.h"
#include "test.h"

enum { B = 1, T = 150, H = 2, K = 64, V = 64 };
static char dir[256];

static const char *at(const char *name) { return test_path(dir, name); }

static double rel(const lm_st_tensor *a, const lm_st_tensor *b) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < a->numel; i++) {
        float x, y;
        memcpy(&x, (const char *)a->data + 4 * i, 4);
        memcpy(&y, (const char *)b->data + 4 * i, 4);
        num += ((double)x - y) * ((double)x - y);
        den += (double)y * y;
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void test_cuda_device_matches_the_cpu(void) {
    static float q[B * T * H * K], k[B * T * H * K], z[B * T * H * K], v[B * T * H * V], d_o[B * T * H * V];
    static float beta[B * T * H], A[H], dt[H * K];
    lm_rng r;
    lm_rng_seed(&r, 515);
    for (int i = 0; i < B * T * H; i++) {
        float sq = 0, sk = 0;
        for (int d = 0; d < K; d++) {
            q[i * K + d] = (float)lm_rng_normal(&r);
            k[i * K + d] = (float)lm_rng_normal(&r);
            z[i * K + d] = (float)lm_rng_normal(&r);
            sq += q[i * K + d] * q[i * K + d];
            sk += k[i * K + d] * k[i * K + d];
        }
        for (int d = 0; d < K; d++) {
            /* bf16-representable inputs: both devices see the same numbers */
            q[i * K + d] = lm_bf16_to_f32(lm_f32_to_bf16(q[i * K + d] / sqrtf(sq)));
            k[i * K + d] = lm_bf16_to_f32(lm_f32_to_bf16(k[i * K + d] / sqrtf(sk)));
            z[i * K + d] = lm_bf16_to_f32(lm_f32_to_bf16(z[i * K + d]));
        }
        beta[i] = (float)(0.1 + 0.8 * lm_rng_uniform(&r));
    }
    for (int i = 0; i < B * T * H * V; i++) {
        v[i] = lm_bf16_to_f32(lm_f32_to_bf16((float)lm_rng_normal(&r)));
        d_o[i] = lm_bf16_to_f32(lm_f32_to_bf16((float)lm_rng_normal(&r)));
    }
    for (int i = 0; i < H; i++) A[i] = (float)(0.3 * lm_rng_normal(&r));
    for (int i = 0; i < H * K; i++) dt[i] = (float)(0.5 * lm_rng_normal(&r));
    lm_st_writer *w = lm_st_writer_new();
    int64_t sk4[4] = {B, T, H, K}, sv4[4] = {B, T, H, V}, sb[3] = {B, T, H}, sh[1] = {H}, sd[1] = {H * K};
    lm_st_writer_add(w, "q", LM_DTYPE_F32, 4, sk4, q);
    lm_st_writer_add(w, "k", LM_DTYPE_F32, 4, sk4, k);
    lm_st_writer_add(w, "v", LM_DTYPE_F32, 4, sv4, v);
    lm_st_writer_add(w, "z", LM_DTYPE_F32, 4, sk4, z);
    lm_st_writer_add(w, "beta", LM_DTYPE_F32, 3, sb, beta);
    lm_st_writer_add(w, "A_log", LM_DTYPE_F32, 1, sh, A);
    lm_st_writer_add(w, "dt_bias", LM_DTYPE_F32, 1, sd, dt);
    lm_st_writer_add(w, "do", LM_DTYPE_F32, 4, sv4, d_o);
    CHECK(!lm_st_writer_save(w, at("in.safetensors")), "%s", lm_last_error());
    lm_st_writer_free(w);
    char cmd[2048];
    for (int dev = 0; dev < 2; dev++) {
        snprintf(cmd, sizeof cmd, "%s op kda --in %s --out %s --device %s", LONGMOE_CLI, at("in.safetensors"),
                 at(dev ? "gpu.safetensors" : "cpu.safetensors"), dev ? "cuda" : "cpu");
        int st = system(cmd);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s failed", cmd);
    }
    lm_safetensors *a = NULL, *b = NULL;
    CHECK(!lm_safetensors_open(at("gpu.safetensors"), &a) && !lm_safetensors_open(at("cpu.safetensors"), &b),
          "%s", lm_last_error());
    const char *names[] = {"o", "ht", "dq", "dk", "dv", "dbeta"};
    for (int i = 0; a && b && i < 6; i++) {
        const lm_st_tensor *x = lm_safetensors_find(a, names[i]), *y = lm_safetensors_find(b, names[i]);
        CHECK(x && y && x->numel == y->numel, "%s present", names[i]);
        if (x && y) CHECK(rel(x, y) < 1e-2, "%s: relative error %.3g", names[i], rel(x, y));
    }
    lm_safetensors_close(a);
    lm_safetensors_close(b);
}

int main(void) {
    test_skip_without_cuda();
    if (test_make_tmpdir(dir, sizeof dir, "cuda-op")) return 1;
    RUN(test_cuda_device_matches_the_cpu);
    test_remove_tree(dir);
    return test_summary();
}
