/* The CLI end to end: `longmoe op kda` reads named tensors, runs the operator
 * and writes its outputs; bad files and flags give a clear message and a
 * non-zero exit code, and leave no output file behind. `longmoe train
 * --device` refuses a bad value, a config the GPU kernels do not run and a
 * machine without a GPU (or a build without CUDA) clearly, before writing a
 * run. */
#include <sys/wait.h>
#include <unistd.h>

#include "longmoe/backend.h"
#include "longmoe/config.h"
#include "longmoe/kda.h"
#include "longmoe/safetensors.h"
#include "test.h"

static char dir[256];

static const char *path_in(const char *name) { return test_path(dir, name); }

/* Run the CLI with `args`; return its exit code and leave stderr in err.txt. */
static int run_cli(const char *args) { return test_run_cli(args, path_in("out.txt"), path_in("err.txt")); }

static int stderr_has(const char *phrase) { return test_file_has(path_in("err.txt"), phrase); }

enum { B = 2, T = 37, H = 2, K = 16, V = 8 };
static float q[B * T * H * K], k[B * T * H * K], v[B * T * H * V], z[B * T * H * K];
static float beta[B * (T + 1) * H], A_log[H], dt_bias[H * K], d_o[B * T * H * V];

static void make_inputs(void) {
    lm_rng r;
    lm_rng_seed(&r, 99);
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
            q[i * K + d] /= sqrtf(sq);
            k[i * K + d] /= sqrtf(sk);
        }
        beta[i] = (float)(0.1 + 0.8 * lm_rng_uniform(&r));
    }
    for (int i = 0; i < B * T * H * V; i++) {
        v[i] = (float)lm_rng_normal(&r);
        d_o[i] = (float)lm_rng_normal(&r);
    }
    for (int i = 0; i < H; i++) A_log[i] = (float)(0.3 * lm_rng_normal(&r));
    for (int i = 0; i < H * K; i++) dt_bias[i] = (float)(0.5 * lm_rng_normal(&r));
}

/* Write the inputs, leaving out tensor `skip` and giving `beta` the shape `beta_t`. */
static void write_inputs(const char *name, const char *skip, int with_do, int64_t beta_t) {
    lm_st_writer *w = lm_st_writer_new();
    int64_t sk[4] = {B, T, H, K}, sv[4] = {B, T, H, V}, sb[3] = {B, beta_t, H}, sh[1] = {H}, sd[1] = {H * K};
    if (strcmp(skip, "q")) lm_st_writer_add(w, "q", LM_DTYPE_F32, 4, sk, q);
    if (strcmp(skip, "k")) lm_st_writer_add(w, "k", LM_DTYPE_F32, 4, sk, k);
    if (strcmp(skip, "v")) lm_st_writer_add(w, "v", LM_DTYPE_F32, 4, sv, v);
    if (strcmp(skip, "z")) lm_st_writer_add(w, "z", LM_DTYPE_F32, 4, sk, z);
    if (strcmp(skip, "beta")) lm_st_writer_add(w, "beta", LM_DTYPE_F32, 3, sb, beta);
    if (strcmp(skip, "A_log")) lm_st_writer_add(w, "A_log", LM_DTYPE_F32, 1, sh, A_log);
    if (strcmp(skip, "dt_bias")) lm_st_writer_add(w, "dt_bias", LM_DTYPE_F32, 1, sd, dt_bias);
    if (with_do) lm_st_writer_add(w, "do", LM_DTYPE_F32, 4, sv, d_o);
    if (lm_st_writer_save(w, path_in(name))) fprintf(stderr, "%s\n", lm_last_error());
    lm_st_writer_free(w);
}

static void test_op_kda_outputs_equal_the_library_call(void) {
    write_inputs("in.safetensors", "", 1, T);
    char args[1024];
    snprintf(args, sizeof args, "op kda --in %s --out %s --chunk 16", path_in("in.safetensors"),
             path_in("o.safetensors"));
    CHECK(run_cli(args) == 0, "exit code");
    lm_safetensors *st = NULL;
    CHECK(!lm_safetensors_open(path_in("o.safetensors"), &st), "%s", lm_last_error());
    if (!st) return;
    lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
    cfg.chunk = 16;
    lm_kda_inputs in = {q, k, v, z, beta, A_log, dt_bias, NULL};
    static float o[B * T * H * V], ht[B * H * K * V], dq[B * T * H * K];
    CHECK(!lm_kda_chunk_forward(&cfg, &in, o, ht), "%s", lm_last_error());
    lm_kda_grads g = {0};
    static float dk[B * T * H * K], dv[B * T * H * V], dz[B * T * H * K], db[B * T * H], dA[H], ddt[H * K];
    g.dq = dq; g.dk = dk; g.dv = dv; g.dz = dz; g.dbeta = db; g.dA_log = dA; g.ddt_bias = ddt;
    CHECK(!lm_kda_chunk_backward(&cfg, &in, d_o, NULL, &g), "%s", lm_last_error());
    const lm_st_tensor *to = lm_safetensors_find(st, "o"), *tq = lm_safetensors_find(st, "dq");
    const lm_st_tensor *tA = lm_safetensors_find(st, "dA_log");
    CHECK(to && to->ndim == 4 && to->shape[3] == V && !memcmp(to->data, o, sizeof o), "o identical");
    CHECK(tq && !memcmp(tq->data, dq, sizeof dq), "dq identical");
    CHECK(tA && tA->ndim == 1 && tA->shape[0] == H && !memcmp(tA->data, dA, sizeof dA), "dA_log identical");
    const char *names[] = {"ht", "dk", "dv", "dz", "dbeta", "ddt_bias", "dh0"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        CHECK(lm_safetensors_find(st, names[i]) != NULL, "output %s missing", names[i]);
    lm_safetensors_close(st);

    /* the recurrent mode computes the same function */
    snprintf(args, sizeof args, "op kda --in %s --out %s --mode recurrent", path_in("in.safetensors"),
             path_in("r.safetensors"));
    CHECK(run_cli(args) == 0, "exit code (recurrent)");
    CHECK(!lm_safetensors_open(path_in("r.safetensors"), &st), "%s", lm_last_error());
    if (!st) return;
    to = lm_safetensors_find(st, "o");
    double num = 0, den = 0;
    for (int i = 0; to && i < B * T * H * V; i++) {
        float x;
        memcpy(&x, (const char *)to->data + 4 * i, 4);
        num += (x - o[i]) * (x - o[i]);
        den += o[i] * o[i];
    }
    CHECK(to && sqrt(num / den) < 1e-4, "recurrent vs chunked rel %g", sqrt(num / den));
    lm_safetensors_close(st);
}

static void test_bad_inputs_and_flags_fail_clearly_and_write_nothing(void) {
    char args[1024];
    write_inputs("nobeta.safetensors", "beta", 0, T);
    write_inputs("badbeta.safetensors", "", 0, T + 1);
    FILE *f = fopen(path_in("garbage.safetensors"), "wb");
    if (f) {
        fputs("this is not a safetensors file at all", f);
        fclose(f);
    }
    struct { const char *file, *flags, *phrase; int code; } cases[] = {
        {"nobeta.safetensors", "", "'beta' is missing", 1},
        {"badbeta.safetensors", "", "tensor 'beta' has shape [2,38,2]", 1},
        {"in.safetensors", "--chunk 48", "chunk", 1},
        {"in.safetensors", "--g-min 0.5", "g_min", 1},
        {"in.safetensors", "--g-min -6", "g_min", 1},
        {"in.safetensors", "--gate tanh", "--gate must be bounded or softplus", 2},
        {"in.safetensors", "--scale abc", "--scale expects a finite number", 2},
        {"in.safetensors", "--frobnicate", "unknown option '--frobnicate'", 2},
        {"missing.safetensors", "", "cannot open", 1},
        {"garbage.safetensors", "", "does not fit the file", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        unlink(path_in("bad_out.safetensors"));
        snprintf(args, sizeof args, "op kda --in %s --out %s %s", path_in(cases[i].file),
                 path_in("bad_out.safetensors"), cases[i].flags);
        int rc = run_cli(args);
        CHECK(rc == cases[i].code, "case %zu (%s): exit %d, want %d", i, cases[i].phrase, rc, cases[i].code);
        CHECK(stderr_has(cases[i].phrase), "case %zu: message lacks '%s'", i, cases[i].phrase);
        CHECK(access(path_in("bad_out.safetensors"), F_OK) != 0, "case %zu left an output file", i);
    }
    CHECK(run_cli("frobnicate") == 2 && stderr_has("unknown command"), "unknown command");
#ifndef LONGMOE_HAVE_CUDA
    snprintf(args, sizeof args, "op kda --in %s --out %s --device cuda", path_in("in.safetensors"),
             path_in("bad_out.safetensors"));
    CHECK(run_cli(args) == 1 && stderr_has("this build has no CUDA kernels"), "--device cuda without CUDA");
#endif
    snprintf(args, sizeof args, "op kda --in %s --out %s --device tpu", path_in("in.safetensors"),
             path_in("bad_out.safetensors"));
    CHECK(run_cli(args) == 2 && stderr_has("--device must be cpu or cuda"), "--device tpu");
    CHECK(run_cli("op kda --help") == 0, "--help exits 0");
}

/* A small model the CUDA kernels run (KDA head dimension 64), two steps. */
static const char h64_config[] =
    "{\"model\": {\"vocab_size\": 256, \"d_model\": 64, \"n_layers\": 2, \"layout\": \"km\", \"first_k_dense\": 1,\n"
    "           \"dense_ffn\": 64},\n"
    " \"kda\": {\"heads\": 1, \"head_dim\": 64, \"chunk\": 64},\n"
    " \"attention\": {\"heads\": 1, \"q_lora_rank\": 32, \"kv_lora_rank\": 16, \"qk_head_dim\": 64, \"v_head_dim\": 64},\n"
    " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 16, \"shared_ffn\": 16},\n"
    " \"train\": {\"seq_len\": 32, \"batch_size\": 2, \"steps\": 2, \"eval_every\": 0, \"data\": \"copy\"}}\n";

static void write_h64_config(void) {
    FILE *f = fopen(path_in("h64.json"), "wb");
    CHECK(f != NULL, "cannot write h64.json");
    if (!f) return;
    fputs(h64_config, f);
    fclose(f);
}

/* 1 when a run directory holds no run: no config.json, metrics.jsonl or latest. */
static int no_run_in(const char *run) {
    char p[600];
    const char *files[3] = {"config.json", "metrics.jsonl", "latest"};
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%s", run, files[i]);
        if (access(p, F_OK) == 0) return 0;
    }
    return 1;
}

static void test_train_device_flag_is_checked(void) {
    char args[1024];
    write_h64_config();
    snprintf(args, sizeof args, "train --config %s --out %s --device tpu", path_in("h64.json"), path_in("run_tpu"));
    CHECK(run_cli(args) == 2 && stderr_has("--device must be cpu or cuda, got 'tpu'"), "--device tpu");
    CHECK(access(path_in("run_tpu"), F_OK) != 0, "--device tpu made the run directory");
    snprintf(args, sizeof args, "train --config %s --out %s --device", path_in("h64.json"), path_in("run_tpu"));
    CHECK(run_cli(args) == 2, "--device without a value");
    /* a KDA head dimension the CUDA kernels do not run is refused on every
     * machine, before a GPU is looked for */
    FILE *f = fopen(path_in("h48.json"), "w");
    CHECK(f != NULL, "h48.json");
    if (f) {
        fputs("{\"model\": {\"vocab_size\": 256, \"d_model\": 96, \"n_layers\": 2, \"layout\": \"km\"},\n"
              " \"kda\": {\"heads\": 2, \"head_dim\": 48}}\n", f);
        fclose(f);
    }
    snprintf(args, sizeof args, "train --config %s --out %s --device cuda", path_in("h48.json"), path_in("run_h48"));
    CHECK(run_cli(args) == 1 && stderr_has("kda.head_dim is 48") && stderr_has("32, 64 and 128"),
          "head_dim 48 on --device cuda");
    CHECK(no_run_in(path_in("run_h48")), "the refused run wrote a run");
    snprintf(args, sizeof args, "train --config %s --out %s --host-optimizer", path_in("h64.json"), path_in("run_tpu"));
    CHECK(run_cli(args) == 2 && stderr_has("give it with --device cuda"), "--host-optimizer on the CPU");
    CHECK(access(path_in("run_tpu"), F_OK) != 0, "--host-optimizer on the CPU made the run directory");
    CHECK(run_cli("train --help") == 0 && test_file_has(path_in("out.txt"), "--device D") &&
              test_file_has(path_in("out.txt"), "--host-optimizer"),
          "train --help names --device and --host-optimizer");
}

static void test_train_on_cuda_without_a_gpu_fails_clearly(void) {
    char args[1024];
#ifdef LONGMOE_HAVE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) SKIP("a GPU is visible (test_cuda_train trains on it)");
#endif
    write_h64_config();
    snprintf(args, sizeof args, "train --config %s --out %s --device cuda", path_in("h64.json"), path_in("run_gpu"));
    int rc = run_cli(args);
    CHECK(rc == 1, "exit %d, want 1", rc);
    char *err = test_slurp(path_in("err.txt"), NULL);
    CHECK(err && strstr(err, "--device cuda: ") &&
              (strstr(err, "no GPU can be used") || strstr(err, "this build has no CUDA backend")),
          "the message names the missing GPU or CUDA build: %s", err ? err : "(no stderr)");
    free(err);
    CHECK(no_run_in(path_in("run_gpu")), "the refused run wrote a run");
    /* the directory is free for the same run on the CPU */
    snprintf(args, sizeof args, "train --config %s --out %s --device cpu --quiet", path_in("h64.json"),
             path_in("run_gpu"));
    CHECK(run_cli(args) == 0, "the CPU run in the refused run's directory failed");
    CHECK(!no_run_in(path_in("run_gpu")), "the CPU run wrote no run");
}

/* plan's ceiling: at --peak-tflops X, X / (3 x the forward FLOPs a token of
 * lm_config_plan) tokens/s, printed to the token; a longer context (more
 * attention FLOPs a token) lowers it, and a non-positive peak is refused. */
static void test_plan_prints_the_tokens_per_second_ceiling(void) {
    lm_config c;
    CHECK(lm_config_load("configs/k3-mini.json", &c) == LM_OK, "%s", lm_last_error());
    const long ctx[2] = {8192, 1048576};
    lm_plan p[2];
    for (int i = 0; i < 2; i++) {
        lm_config_plan(&c, ctx[i], &p[i]);
        char args[160], want[160];
        snprintf(args, sizeof args, "plan --config configs/k3-mini.json --context %ld --peak-tflops 500", ctx[i]);
        snprintf(want, sizeof want, "at 500 TFLOP/s (--peak-tflops) that allows at most %.0f tokens/s a GPU",
                 500e12 / (3 * p[i].total_flops));
        CHECK(run_cli(args) == 0 && test_file_has(path_in("out.txt"), want), "'%s' does not print '%s'", args, want);
    }
    CHECK(p[1].total_flops > 5 * p[0].total_flops, "the 1M context's FLOPs a token (%.3g) not well above 8K's (%.3g)",
          p[1].total_flops, p[0].total_flops);
    CHECK(run_cli("plan --config configs/k3-mini.json --peak-tflops 0") != 0 && stderr_has("--peak-tflops"),
          "--peak-tflops 0 accepted");
}

/* plan --memory --ep G: one rank's weights, gradients and optimizer state of
 * its n/G experts (the lines name the share), the one MoE layer's experts an
 * evaluation forward gathers and the exchange's buffers; with --device cuda
 * (a CUDA build) the same share, the bf16 copy too, nothing gathered (the
 * evaluation runs the exchange) and the CUDA handles' exchange buffers
 * (larger: padded rows and bf16 intermediates); a G that does not
 * divide the experts and --ep without --memory are refused. */
static void test_plan_memory_of_an_expert_parallel_rank(void) {
    CHECK(run_cli("plan --memory --config configs/tiny.json --ep 2") == 0 &&
              test_file_has(path_in("out.txt"), "a rank keeps the weights, gradients and optimizer state of 4 of the 8 "
                                                "routed experts of a layer") &&
              test_file_has(path_in("out.txt"), "parameters (fp32; of the routed experts only 4 of 8 a layer") &&
              test_file_has(path_in("out.txt"), "gradients (fp32; of the routed experts only 4 of 8 a layer") &&
              test_file_has(path_in("out.txt"), "one MoE layer's routed experts, gathered by an evaluation forward") &&
              test_file_has(path_in("out.txt"), "the exchange's rows of the MoE layers at a balanced load"),
          "plan --memory --ep 2 does not show a rank's share of the experts (and an evaluation's layer, the exchange)");
    CHECK(run_cli("plan --memory --config configs/tiny.json --ep 3") != 0 && stderr_has("8 routed experts") &&
              stderr_has("3 ranks"),
          "plan --memory --ep 3 with 8 experts accepted");
    if (lm_backend_cuda_ops())
        CHECK(run_cli("plan --memory --config configs/tiny.json --ep 2 --device cuda") == 0 &&
                  test_file_has(path_in("out.txt"), "of 4 of the 8 routed experts of a layer (an evaluation runs them "
                                                    "through the exchange") &&
                  test_file_has(path_in("out.txt"), "parameters (fp32; of the routed experts only 4 of 8 a layer") &&
                  test_file_has(path_in("out.txt"), "parameters (product format copy; the kept part)") &&
                  test_file_has(path_in("out.txt"), "the exchange's rows of the MoE layers at a balanced load") &&
                  !test_file_has(path_in("out.txt"), "gathered by an evaluation forward"),
              "plan --memory --ep 2 --device cuda does not show a rank's share of the experts (bf16 copy included) "
              "and the exchange's buffers");
    CHECK(run_cli("plan --config configs/tiny.json --ep 2") != 0 && stderr_has("--ep"), "--ep without --memory accepted");
}

/* plan --memory on the GPU (a CUDA build; no GPU needed): the AttnRes input
 * and its norm run as one kernel each way, so no sublayer inputs are planned,
 * and the fp32 normalised inputs only for the MoE sublayers (their router);
 * with LONGMOE_ATTNRES_NORM=separate the inputs again; the CPU plans both
 * whole (docs/attnres.md, "The input with its norm"). */
static void test_plan_memory_on_the_gpu_keeps_no_sublayer_inputs(void) {
    const char *xn_moe = "xn: normalised MoE sublayer inputs, fp32 for the router";
    CHECK(run_cli("plan --memory --config configs/tiny.json --batch 2 --seq 256") == 0 &&
              test_file_has(path_in("out.txt"), "hin: sublayer inputs [2L,N,d]") &&
              test_file_has(path_in("out.txt"), "xn: normalised sublayer inputs [2L,N,d]"),
          "the CPU plan lacks the sublayer inputs or the normalised ones");
    if (!lm_backend_cuda_ops()) {
        printf("  skipped: the GPU plan (this build has no CUDA kernels)\n");
        return;
    }
    CHECK(run_cli("plan --memory --config configs/tiny.json --batch 2 --seq 256 --device cuda") == 0 &&
              !test_file_has(path_in("out.txt"), "hin: sublayer inputs") &&
              test_file_has(path_in("out.txt"), xn_moe),
          "the GPU plan keeps sublayer inputs, or fp32 normalised inputs of every sublayer");
    setenv("LONGMOE_ATTNRES_NORM", "separate", 1);
    CHECK(run_cli("plan --memory --config configs/tiny.json --batch 2 --seq 256 --device cuda") == 0 &&
              test_file_has(path_in("out.txt"), "hin: sublayer inputs [2L,N,d]") &&
              test_file_has(path_in("out.txt"), xn_moe),
          "LONGMOE_ATTNRES_NORM=separate: the GPU plan lacks the sublayer inputs");
    unsetenv("LONGMOE_ATTNRES_NORM");
}

/* plan --memory --seq-segment S: the segmented layout; a bad S is refused. A
 * config with train.seq_segment trains (its loss after the first step equals
 * the unsegmented run's to float rounding: docs/model.md "Sequence segments"). */
static void test_sequence_segments_in_plan_and_train(void) {
    char args[1024];
    CHECK(run_cli("plan --memory --config configs/tiny.json --batch 2 --seq 1000 --seq-segment 300") == 0 &&
              test_file_has(path_in("out.txt"), "seq_segment 300") &&
              test_file_has(path_in("out.txt"), "segments: KDA states at 3 segment starts") &&
              test_file_has(path_in("out.txt"), "residual stream of the last segment (100 tokens a row)"),
          "plan --seq-segment 300 does not show the segments' buffers");
    CHECK(run_cli("plan --memory --config configs/tiny.json --seq-segment -3") == 2 && stderr_has("--seq-segment"),
          "plan --seq-segment -3 accepted");
    const char *cfgs[2] = {"seg0.json", "seg48.json"};
    float first[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(path_in(cfgs[i]), "w");
        CHECK(f != NULL, "%s", cfgs[i]);
        if (!f) return;
        fprintf(f, "{\"model\": {\"vocab_size\": 256, \"d_model\": 32, \"n_layers\": 2, \"layout\": \"km\","
                   " \"first_k_dense\": 1, \"dense_ffn\": 48},\n"
                   " \"kda\": {\"heads\": 2, \"head_dim\": 16, \"chunk\": 16},\n"
                   " \"attention\": {\"heads\": 2, \"q_lora_rank\": 16, \"kv_lora_rank\": 8, \"qk_head_dim\": 16,"
                   " \"v_head_dim\": 16},\n"
                   " \"train\": {\"seq_len\": 100, \"batch_size\": 2, \"steps\": 2, \"eval_every\": 0, \"ckpt_every\": 0,"
                   " \"data\": \"copy\", \"seq_segment\": %d}}\n",
                i ? 48 : 0);
        fclose(f);
        char run[64];
        snprintf(run, sizeof run, "run_seg%d", i);
        snprintf(args, sizeof args, "train --config %s --out %s --quiet", path_in(cfgs[i]), path_in(run));
        CHECK(run_cli(args) == 0, "train with train.seq_segment = %d failed", i ? 48 : 0);
        char metrics[600];
        snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", path_in(run));
        char *text = test_slurp(metrics, NULL);
        const char *l = text ? strstr(text, "\"loss\": ") : NULL;
        CHECK(l != NULL, "no loss in %s", metrics);
        if (l) first[i] = strtof(l + 8, NULL);
        free(text);
    }
    CHECK(first[0] > 0 && fabsf(first[0] - first[1]) <= 1e-5f * first[0], "first loss %.7g whole rows, %.7g in segments",
          first[0], first[1]);
}

/* train.recompute = "channel" (the MoE and dense FFN recomputed, the token mixers kept):
 * plan --recompute shows it, a bad mode is refused, and a run trains with the first loss of the
 * run without recompute (the same bits: docs/model.md "Recomputation") and writes the mode back
 * into its checkpoint's config.json. */
static void test_selective_recompute_in_plan_and_train(void) {
    CHECK(run_cli("plan --memory --config configs/tiny.json --recompute channel") == 0 &&
              test_file_has(path_in("out.txt"), "recompute channel") &&
              test_file_has(path_in("out.txt"), "MoE routing and expert activations") &&
              test_file_has(path_in("out.txt"), "(shared by"),
          "plan --recompute channel does not share the MoE activations");
    CHECK(run_cli("plan --memory --config configs/tiny.json --recompute moe") == 2 && stderr_has("--recompute"),
          "plan --recompute moe accepted");
    /* without recompute the plan names the settings that keep less */
    CHECK(run_cli("plan --memory --config configs/tiny.json --recompute false") == 0 &&
              test_file_has(path_in("out.txt"), "with train.recompute = \"channel\": ") &&
              test_file_has(path_in("out.txt"), ", train.recompute = true: "),
          "plan --recompute false does not name the settings that keep less");
    const char *modes[2] = {"false", "\"channel\""};
    char text_first[2][32] = {"", ""};
    for (int i = 0; i < 2; i++) {
        char cfg[64], run[64], args[1024];
        snprintf(cfg, sizeof cfg, "rc%d.json", i);
        snprintf(run, sizeof run, "run_rc%d", i);
        FILE *f = fopen(path_in(cfg), "w");
        CHECK(f != NULL, "%s", cfg);
        if (!f) return;
        fprintf(f, "{\"model\": {\"vocab_size\": 256, \"d_model\": 32, \"n_layers\": 2, \"layout\": \"km\","
                   " \"first_k_dense\": 0},\n"
                   " \"kda\": {\"heads\": 2, \"head_dim\": 16, \"chunk\": 16},\n"
                   " \"moe\": {\"routed_experts\": 4, \"top_k\": 2, \"expert_ffn\": 16},\n"
                   " \"attention\": {\"heads\": 2, \"q_lora_rank\": 16, \"kv_lora_rank\": 8, \"qk_head_dim\": 16,"
                   " \"v_head_dim\": 16},\n"
                   " \"train\": {\"seq_len\": 64, \"batch_size\": 2, \"steps\": 2, \"eval_every\": 0, \"ckpt_every\": 2,"
                   " \"data\": \"copy\", \"recompute\": %s}}\n",
                modes[i]);
        fclose(f);
        snprintf(args, sizeof args, "train --config %s --out %s%s", path_in(cfg), path_in(run), i ? "" : " --quiet");
        CHECK(run_cli(args) == 0, "train with train.recompute = %s failed", modes[i]);
        /* the header names the setting and the model's plan */
        CHECK(!i || test_file_has(path_in("out.txt"), "memory: train.recompute = \"channel\", recompute_chunk 0, "
                                                       "seq_segment 0; the model's plan "),
              "the progress header does not name train.recompute = \"channel\"");
        char metrics[600];
        snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", path_in(run));
        char *text = test_slurp(metrics, NULL);
        const char *l = text ? strstr(text, "\"loss\": ") : NULL;
        CHECK(l != NULL, "no loss in %s", metrics);
        if (l) snprintf(text_first[i], sizeof text_first[i], "%.12s", l + 8);
        free(text);
        if (i == 1) {
            char saved[600];
            snprintf(saved, sizeof saved, "%s/checkpoint-00000002/config.json", path_in(run));
            CHECK(test_file_has(saved, "\"recompute\": \"channel\""), "%s does not keep train.recompute = \"channel\"",
                  saved);
        }
    }
    CHECK(text_first[0][0] && !strcmp(text_first[0], text_first[1]), "first loss %s without recompute, %s with "
          "recompute \"channel\"", text_first[0], text_first[1]);
}

int main(void) {
    if (test_make_tmpdir(dir, sizeof dir, "cli")) return 1;
    make_inputs();
    RUN(test_op_kda_outputs_equal_the_library_call);
    RUN(test_bad_inputs_and_flags_fail_clearly_and_write_nothing);
    RUN(test_train_device_flag_is_checked);
    RUN(test_train_on_cuda_without_a_gpu_fails_clearly);
    RUN(test_plan_prints_the_tokens_per_second_ceiling);
    RUN(test_plan_memory_of_an_expert_parallel_rank);
    RUN(test_plan_memory_on_the_gpu_keeps_no_sublayer_inputs);
    RUN(test_sequence_segments_in_plan_and_train);
    RUN(test_selective_recompute_in_plan_and_train);
    test_remove_tree(dir);
    return test_summary();
}
