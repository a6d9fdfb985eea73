/* `longmoe op attention` end to end: the CLI reads q, k, v (and do), runs the
 * attention core and writes o, lse (and dq, dk, dv) equal to the library call;
 * bad inputs give a message naming the tensor and its dims, and no output. */
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/attention.h"
#include "longmoe/safetensors.h"
#include "test.h"

static char dir[128];

static const char *path_in(const char *name) { return test_path(dir, name); }

static int run_cli(const char *args) { return test_run_cli(args, path_in("out.txt"), path_in("err.txt")); }

static int stderr_has(const char *phrase) { return test_file_has(path_in("err.txt"), phrase); }

enum { B = 2, T = 70, H = 4, HKV = 2, DK = 16, DV = 8 };
static float q[B * T * H * DK], k[B * T * HKV * DK], v[B * T * HKV * DV], d_o[B * T * H * DV];
static uint16_t q_bf16[B * T * H * DK];

static void make_inputs(void) {
    lm_rng r;
    lm_rng_seed(&r, 77);
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q[i] = (float)lm_rng_normal(&r);
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) k[i] = (float)lm_rng_normal(&r);
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) v[i] = (float)lm_rng_normal(&r);
    for (size_t i = 0; i < sizeof d_o / sizeof d_o[0]; i++) d_o[i] = (float)lm_rng_normal(&r);
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) q_bf16[i] = lm_f32_to_bf16(q[i]);
}

/* Write q (F32, or BF16 when bf16), k, v and optionally do; `skip` names a
 * tensor to leave out and `v_T` is the T written into v's shape. */
static void write_inputs(const char *skip, int with_do, int bf16, int64_t v_T) {
    lm_st_writer *w = lm_st_writer_new();
    int64_t sq[4] = {B, T, H, DK}, sk[4] = {B, T, HKV, DK}, sv[4] = {B, v_T, HKV, DV}, so[4] = {B, T, H, DV};
    if (strcmp(skip, "q")) lm_st_writer_add(w, "q", bf16 ? LM_DTYPE_BF16 : LM_DTYPE_F32, 4, sq, bf16 ? (void *)q_bf16 : (void *)q);
    if (strcmp(skip, "k")) lm_st_writer_add(w, "k", LM_DTYPE_F32, 4, sk, k);
    if (strcmp(skip, "v")) lm_st_writer_add(w, "v", LM_DTYPE_F32, 4, sv, v);
    if (with_do) lm_st_writer_add(w, "do", LM_DTYPE_F32, 4, so, d_o);
    if (lm_st_writer_save(w, path_in("in.safetensors"))) fprintf(stderr, "%s\n", lm_last_error());
    lm_st_writer_free(w);
}

/* Tensor `name` of the output file equals want[0:n] bit for bit. */
static int output_equals(const lm_safetensors *st, const char *name, const float *want, size_t n) {
    float *got = NULL;
    if (lm_safetensors_read_f32(st, name, -1, &got, NULL)) {
        fprintf(stderr, "  %s\n", lm_last_error());
        return 0;
    }
    int same = !memcmp(got, want, n * sizeof(float));
    free(got);
    return same;
}

static void check_outputs(const float *qin, const float *dout, int with_grads, double scale) {
    static float o[B * T * H * DV], lse[B * H * T], dq[B * T * H * DK], dk[B * T * HKV * DK], dv[B * T * HKV * DV];
    lm_attention_config c = lm_attention_config_default(B, T, H, HKV, DK, DV);
    c.scale = (float)scale;
    CHECK(!lm_attention_forward(&c, qin, k, v, o, lse), "%s", lm_last_error());
    lm_safetensors *st = NULL;
    CHECK(!lm_safetensors_open(path_in("out.safetensors"), &st), "%s", lm_last_error());
    if (!st) return;
    CHECK(output_equals(st, "o", o, sizeof o / 4), "o differs from the library call");
    CHECK(output_equals(st, "lse", lse, sizeof lse / 4), "lse differs from the library call");
    if (with_grads) {
        memset(dq, 0, sizeof dq), memset(dk, 0, sizeof dk), memset(dv, 0, sizeof dv);
        CHECK(!lm_attention_backward(&c, qin, k, v, o, lse, dout, dq, dk, dv), "%s", lm_last_error());
        CHECK(output_equals(st, "dq", dq, sizeof dq / 4), "dq differs from the library call");
        CHECK(output_equals(st, "dk", dk, sizeof dk / 4), "dk differs from the library call");
        CHECK(output_equals(st, "dv", dv, sizeof dv / 4), "dv differs from the library call");
    } else {
        CHECK(!lm_safetensors_find(st, "dq"), "dq written without a backward");
    }
    lm_safetensors_close(st);
}

static void test_op_attention_outputs_equal_the_library_call(void) {
    char args[600];
    write_inputs("", 1, 0, T);
    snprintf(args, sizeof args, "op attention --in %s --out %s", path_in("in.safetensors"), path_in("out.safetensors"));
    CHECK(run_cli(args) == 0, "op attention with do failed");
    check_outputs(q, d_o, 1, 0);
    /* forward only, custom scale */
    write_inputs("", 0, 0, T);
    snprintf(args, sizeof args, "op attention --in %s --out %s --scale 0.125", path_in("in.safetensors"),
             path_in("out.safetensors"));
    CHECK(run_cli(args) == 0, "op attention forward failed");
    check_outputs(q, d_o, 0, 0.125);
    /* --backward without do: the gradient of sum(o) */
    static float ones[B * T * H * DV];
    for (size_t i = 0; i < sizeof ones / 4; i++) ones[i] = 1.0f;
    snprintf(args, sizeof args, "op attention --in %s --out %s --backward", path_in("in.safetensors"),
             path_in("out.safetensors"));
    CHECK(run_cli(args) == 0, "op attention --backward failed");
    check_outputs(q, ones, 1, 0);
    /* BF16 q: the CLI widens it exactly */
    static float q_wide[B * T * H * DK];
    for (size_t i = 0; i < sizeof q_wide / 4; i++) q_wide[i] = lm_bf16_to_f32(q_bf16[i]);
    write_inputs("", 1, 1, T);
    snprintf(args, sizeof args, "op attention --in %s --out %s", path_in("in.safetensors"), path_in("out.safetensors"));
    CHECK(run_cli(args) == 0, "op attention with BF16 q failed");
    check_outputs(q_wide, d_o, 1, 0);
}

static void test_op_attention_naive_path_agrees(void) {
    char args[600];
    write_inputs("", 1, 0, T);
    snprintf(args, sizeof args, "op attention --in %s --out %s --naive", path_in("in.safetensors"), path_in("out.safetensors"));
    CHECK(run_cli(args) == 0, "op attention --naive failed");
    static float o[B * T * H * DV], lse[B * H * T];
    lm_attention_config c = lm_attention_config_default(B, T, H, HKV, DK, DV);
    lm_attention_forward(&c, q, k, v, o, lse);
    lm_safetensors *st = NULL;
    float *got = NULL;
    CHECK(!lm_safetensors_open(path_in("out.safetensors"), &st), "%s", lm_last_error());
    if (st && !lm_safetensors_read_f32(st, "o", 4, &got, NULL)) {
        double num = 0, den = 0;
        for (size_t i = 0; i < sizeof o / 4; i++) num += (got[i] - o[i]) * (got[i] - o[i]), den += o[i] * o[i];
        CHECK(sqrt(num / den) < 1e-5, "naive o differs from tiled by %.3g", sqrt(num / den));
        CHECK(lm_safetensors_metadata(st, "path") && !strcmp(lm_safetensors_metadata(st, "path"), "naive"),
              "metadata path is not 'naive'");
    }
    free(got);
    lm_safetensors_close(st);
}

static void test_bad_inputs_fail_clearly_and_write_nothing(void) {
    char args[600];
    snprintf(args, sizeof args, "op attention --in %s --out %s", path_in("in.safetensors"), path_in("bad.safetensors"));
    write_inputs("k", 1, 0, T);
    CHECK(run_cli(args) == 1 && stderr_has("'k'"), "missing k");
    write_inputs("", 1, 0, T - 1);
    CHECK(run_cli(args) == 1 && stderr_has("tensor 'v' has shape [2,69,2,8], expected [B,T,Hkv,Dv] = [2,70,2,*]"),
          "v with the wrong T");
    CHECK(access(path_in("bad.safetensors"), F_OK) != 0, "an output file was written after an error");
    snprintf(args, sizeof args, "op attention --in %s --out %s --scale -1", path_in("in.safetensors"), path_in("bad.safetensors"));
    CHECK(run_cli(args) == 2 && stderr_has("--scale"), "negative scale");
    CHECK(run_cli("op attention --in x.safetensors") == 2 && stderr_has("--out"), "missing --out");
    CHECK(run_cli("op attention --frob") == 2 && stderr_has("--frob"), "unknown flag");
    CHECK(run_cli("op attention --help") == 0, "--help exits 0");
    /* H = 4 query heads over 3 kv heads */
    lm_st_writer *w = lm_st_writer_new();
    int64_t sq[4] = {1, 3, 4, 2}, sk[4] = {1, 3, 3, 2};
    float buf[64] = {0.5f};
    lm_st_writer_add(w, "q", LM_DTYPE_F32, 4, sq, buf);
    lm_st_writer_add(w, "k", LM_DTYPE_F32, 4, sk, buf);
    lm_st_writer_add(w, "v", LM_DTYPE_F32, 4, sk, buf);
    lm_st_writer_save(w, path_in("in.safetensors"));
    lm_st_writer_free(w);
    snprintf(args, sizeof args, "op attention --in %s --out %s", path_in("in.safetensors"), path_in("bad.safetensors"));
    CHECK(run_cli(args) == 1 && stderr_has("multiple of Hkv"), "H not a multiple of Hkv");
    CHECK(access(path_in("bad.safetensors"), F_OK) != 0, "an output file was written after an error");
}

int main(void) {
    if (test_make_tmpdir(dir, sizeof dir, "op-attention")) return 1;
    make_inputs();
    RUN(test_op_attention_outputs_equal_the_library_call);
    RUN(test_op_attention_naive_path_agrees);
    RUN(test_bad_inputs_fail_clearly_and_write_nothing);
    test_remove_tree(dir);
    return test_summary();
}
