/* The whole model's forward and backward on the GPU (CUDA backend): time per
 * step, tokens/s, MFU and the time by layer kind, for a config and shape.
 *
 *   bench_cuda_model [--config configs/k3-mini.json] [--batch B] [--seq T] [--reps N (0: the first step alone)]
 *                    [--no-recompute | --recompute all|none|channel|token] [--recompute-chunk N]
 *                    [--seq-segment S] [--optimizer]
 *                    [--head-in-backward] [--zero-expert-grads] [--digest] [--products]
 *                    [--out FILE.json]
 *
 * As `train` does, the LM head's backward runs inside the forward
 * (lm_model_set_head_backward: each chunk's logits computed once);
 * --head-in-backward runs it in the backward instead, computing them again.
 *
 * MFU = tokens/s x training FLOPs per token / 989e12 (H200 dense bf16), with
 * the training FLOPs 3x the forward's of `longmoe plan` (lm_config_plan at
 * the bench's context: 2 per multiply-add, attention averaged over the causal
 * context; the KDA chunk products counted there). Time by layer kind comes
 * from lm_model_timings: on a GPU the model marks each part's end with a CUDA
 * event and waits for nothing (LONGMOE_PART_TIMING=sync: it waits for the
 * device at each part's end instead, docs/cuda.md). With --optimizer each step also runs the
 * device optimizer (Muon and AdamW, as train --device cuda), timed apart.
 * Memory: the model's own plan (lm_model_buffer_at) and the device memory in
 * use after the last step (cudaMemGetInfo: the model, the optimizer, the
 * backend's arena, the CUDA context and cuBLAS; buffers only grow, so this is
 * the peak). --recompute sets train.recompute (channel: the MoE and dense FFN
 * only, token: the KDA and attention only; the JSON's "recompute" is 0 none,
 * 1 all, 2 channel, 3 token); --recompute-chunk N sets train.recompute_chunk
 * (and recompute, where the channel mixers are not recomputed);
 * --seq-segment S sets train.seq_segment (the layers run S tokens of each row
 * at a time, docs/model.md "Sequence segments"; attention past the first
 * segment needs the CUDA attention with a query offset). --digest prints the
 * last step's loss bits and lm_checksum64 of its gradients' bits: two builds
 * that should compute the same bits (a kernel rewritten for speed) are
 * compared by it, on the same GPU. --products times each cuBLAS product of the
 * last step with CUDA events (lm_cuda_matmul_profile) and prints them by
 * shape with their TFLOP/s; the events may lengthen that step a little, not
 * the median of the others (with --reps 0, the one step). --zero-expert-grads
 * zeroes the routed experts' weight gradients with the rest before each step
 * (lm_model_set_expert_grads_written 0) instead of letting the backward write
 * them: the form before, for an A/B in one binary. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_common.h"
#include "longmoe/backend.h"
#include "longmoe/config.h"
#include "longmoe/linear_cuda.h"
#include "longmoe/model.h"
#include "longmoe/optim_device.h"
#include "longmoe/safetensors.h"

int main(int argc, char **argv) {
    const char *cfg_path = "configs/k3-mini.json", *out = NULL;
    int B = 1, T = 8192, reps = 5, recompute = -1, chunk = -1, segment = -1, with_opt = 0, head_in_fwd = 1,
        digest = 0, products = 0, zero_expert = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc) cfg_path = argv[++i];
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seq") && i + 1 < argc) T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--no-recompute")) recompute = 0;
        else if (!strcmp(argv[i], "--recompute") && i + 1 < argc) {
            if ((recompute = lm_recompute_from_name(argv[++i])) < 0) {
                fprintf(stderr, "bench_cuda_model: --recompute must be true, all, false, none, channel or token, got "
                                "'%s'\n", argv[i]);
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--recompute-chunk") && i + 1 < argc) chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seq-segment") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 0 || v > (1 << 26)) {
                fprintf(stderr, "bench_cuda_model: --seq-segment must be an integer in [0, 2^26] (0: off), got '%s'\n",
                        argv[i]);
                return 2;
            }
            segment = (int)v;
        }
        else if (!strcmp(argv[i], "--optimizer")) with_opt = 1;
        else if (!strcmp(argv[i], "--head-in-backward")) head_in_fwd = 0;
        else if (!strcmp(argv[i], "--zero-expert-grads")) zero_expert = 1;
        else if (!strcmp(argv[i], "--digest")) digest = 1;
        else if (!strcmp(argv[i], "--products")) products = 1;
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else {
            fprintf(stderr, "usage: bench_cuda_model [--config C] [--batch B] [--seq T] [--reps N] [--no-recompute] "
                            "[--recompute all|none|channel|token] "
                            "[--recompute-chunk N] [--seq-segment S] [--optimizer] [--head-in-backward] "
                            "[--zero-expert-grads] [--digest] [--products] [--out FILE.json]\n");
            return 2;
        }
    }
    if (B < 1 || T < 1 || reps < 0) {
        fprintf(stderr, "bench_cuda_model: --batch and --seq must be >= 1, --reps >= 0\n");
        return 2;
    }
    lm_config c;
    if (lm_config_load(cfg_path, &c)) {
        fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
        return 1;
    }
    if (recompute >= 0) c.recompute = recompute;
    if (chunk >= 0) {
        c.recompute_chunk = chunk;
        if (chunk > 0 && !lm_recompute_sublayer(c.recompute, 1)) c.recompute = LM_RECOMPUTE_ALL;
    }
    if (segment >= 0) c.seq_segment = segment;
    if (lm_config_validate(&c)) {
        fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
        return 2;
    }
    lm_backend *gpu = NULL;
    lm_model *m = NULL;
    if (lm_backend_cuda_create(&gpu) || lm_model_create_on(&c, B, T, gpu, &m)) {
        fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
        return 1;
    }
    lm_model_init(m, 1);
    const double plan_bytes = (double)lm_model_plan_bytes(m);
    /* the device optimizer, as train --device cuda: Muon for the hidden matrices, AdamW for the rest */
    lm_device_optimizer *opt_muon = NULL, *opt_adam = NULL;
    if (with_opt) {
        int nt = lm_model_num_tensors(m), nm = 0, na = 0;
        lm_param *all = calloc((size_t)nt, sizeof *all), *mu = calloc((size_t)nt, sizeof *mu),
                 *ad = calloc((size_t)nt, sizeof *ad);
        lm_model_backend_params(m, all, c.optimizer);
        for (int i = 0; i < nt; i++) {
            if (lm_param_optimizer(&all[i]) == LM_OPT_MUON) mu[nm++] = all[i];
            else ad[na++] = all[i];
        }
        lm_optim_config oc = lm_optim_config_default();
        oc.weight_decay = c.weight_decay;
        if (lm_optimizer_create_on(gpu, &oc, mu, nm, &opt_muon) || lm_optimizer_create_on(gpu, &oc, ad, na, &opt_adam)) {
            fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
            return 1;
        }
        free(all);
        free(mu);
        free(ad);
    }
    double opt_s = 0;
    size_t N = (size_t)B * T;
    int32_t *tok = malloc(N * sizeof *tok), *tgt = malloc(N * sizeof *tgt);
    lm_rng r;
    lm_rng_seed(&r, 7);
    for (size_t i = 0; i < N; i++) tok[i] = (int32_t)(lm_rng_u64(&r) % (uint64_t)c.vocab_size);
    for (size_t i = 0; i < N; i++) tgt[i] = tok[(i + 1) % N];
    double *times = malloc((size_t)(reps + 1) * sizeof *times), parts[LM_TIME_COUNT] = {0};
    float loss = 0;
    if (zero_expert && lm_model_set_expert_grads_written(m, 0)) {
        fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
        return 1;
    }
    if (lm_model_set_head_backward(m, head_in_fwd ? 1.0f : 0.0f)) {
        fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
        return 1;
    }
    for (int i = 0; i <= reps; i++) {
        if (i == 1) lm_model_reset_timings(m); /* the first step grows the backend's scratch */
        lm_model_zero_grads(m);
        if (products && i == reps) lm_cuda_matmul_profile(1);
        double t0 = lm_time_seconds();
        if (lm_model_forward(m, tok, tgt, 1, &loss) || lm_model_backward(m, 1.0f) ||
            gpu->sync(gpu)) {
            fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
            return 1;
        }
        times[i] = lm_time_seconds() - t0;
        if (products && i == reps) {
            lm_cuda_matmul_profile(0);
            if (lm_cuda_matmul_profile_print(stdout, 1)) {
                fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
                return 1;
            }
        }
        if (with_opt) {
            /* a small learning rate: the step is timed, the model barely moves */
            double o0 = lm_time_seconds();
            if (lm_device_optimizer_step(opt_muon, 1e-6f) || lm_device_optimizer_step(opt_adam, 1e-6f) ||
                gpu->sync(gpu) || lm_model_params_changed_on_backend(m)) {
                fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
                return 1;
            }
            if (i > 0 || reps == 0) opt_s += lm_time_seconds() - o0;
        }
        if (lm_model_balance_step_end(m, 1, NULL)) {
            fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
            return 1;
        }
    }
    lm_model_timings(m, parts);
    qsort(times + 1, (size_t)reps, sizeof *times, bench_cmp_double);
    /* --reps 0: the first step alone (one step of a very long sequence), scratch growth included */
    const int nrep = reps > 0 ? reps : 1;
    double step = reps > 0 ? times[1 + reps / 2] : times[0], toks = (double)N / step;
    lm_plan plan;
    lm_config_plan(&c, T, &plan);
    double mfu = toks * 3.0 * plan.total_flops / 989e12;
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    double used_gib = (double)(total_b - free_b) / (1u << 30);
    printf("model %s: %.3fB parameters (%.3fB active), B=%d T=%d, recompute %s, recompute_chunk %d, seq_segment %d, "
           "LM head backward in the %s\n",
           cfg_path, plan.total_params / 1e9, plan.total_active / 1e9, B, T,
           c.recompute == LM_RECOMPUTE_ALL ? "on" : c.recompute ? lm_recompute_name(c.recompute) : "off",
           c.recompute_chunk, c.seq_segment, head_in_fwd && !(c.seq_segment > 0 && c.seq_segment < T) ? "forward" : "backward");
    if (c.seq_segment > 0 && c.seq_segment < T)
        printf("note: rows of %d tokens run in segments of %d, whose backward runs each segment's forward again "
               "(--seq-segment 0: off)\n", T, c.seq_segment);
    printf("forward+backward: %.1f ms median of %d (first %.1f ms), %.0f tokens/s, MFU %.1f%%, loss %.4f, "
           "device memory in use %.1f GiB\n",
           step * 1e3, reps, times[0] * 1e3, toks, 100 * mfu, loss, used_gib);
    printf("memory: the model's plan %.2f GiB (%.1f KiB a token), device memory in use after the steps %.2f GiB "
           "(total %.2f GiB)\n", plan_bytes / (1u << 30), plan_bytes / 1024.0 / (double)N, used_gib,
           (double)total_b / (1u << 30));
    if (with_opt) printf("optimizer step (Muon + AdamW on the device): %.1f ms mean of %d\n", opt_s / nrep * 1e3, nrep);
    double sum = 0;
    for (int p = 0; p < LM_TIME_COUNT; p++) sum += parts[p];
    printf("time by part (forward + backward, per step):\n");
    for (int p = 0; p < LM_TIME_COUNT; p++)
        printf("  %-18s %9.2f ms  %5.1f%%\n", lm_time_part_name((lm_time_part)p), parts[p] / nrep * 1e3,
               sum > 0 ? 100 * parts[p] / sum : 0);
    if (digest) {
        if (lm_model_download_grads(m)) {
            fprintf(stderr, "bench_cuda_model: %s\n", lm_last_error());
            return 1;
        }
        const size_t ng = lm_model_num_grads(m);
        const uint64_t hsh = lm_checksum64(lm_model_grads(m), ng * sizeof(float));
        uint32_t lb;
        memcpy(&lb, &loss, sizeof lb);
        printf("digest: loss %.9g (bits 0x%08x), gradients (%zu floats) checksum64 0x%016llx\n", loss, (unsigned)lb,
               ng, (unsigned long long)hsh);
    }
    if (out) {
        FILE *f = fopen(out, "w");
        if (!f) {
            fprintf(stderr, "bench_cuda_model: cannot write %s\n", out);
            return 1;
        }
        fprintf(f, "{\"bench\": \"cuda_model\", \"config\": \"%s\", \"B\": %d, \"T\": %d, \"recompute\": %d, "
                   "\"recompute_chunk\": %d, \"seq_segment\": %d, \"step_ms\": %.3f, \"tokens_per_s\": %.1f, "
                   "\"mfu\": %.4f, \"device_gib\": %.2f, \"plan_gib\": %.3f, \"optimizer_ms\": %.3f, \"parts_ms\": {",
                cfg_path, B, T, c.recompute, c.recompute_chunk, c.seq_segment, step * 1e3, toks, mfu, used_gib,
                plan_bytes / (1u << 30), with_opt ? opt_s / nrep * 1e3 : -1.0);
        for (int p = 0; p < LM_TIME_COUNT; p++)
            fprintf(f, "%s\"%s\": %.3f", p ? ", " : "", lm_time_part_name((lm_time_part)p), parts[p] / nrep * 1e3);
        fprintf(f, "}}\n");
        fclose(f);
    }
    free(times);
    free(tok);
    free(tgt);
    lm_device_optimizer_free(opt_muon);
    lm_device_optimizer_free(opt_adam);
    lm_model_free(m);
    lm_backend_free(gpu);
    return 0;
}
