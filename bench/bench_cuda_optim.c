/* One optimizer step for a config's whole parameter table on the GPU
 * (include/longmoe/optim_device.h) and, for reference, on the host.
 *
 *   bench_cuda_optim [--config configs/k3-mini.json] [--reps N] [--host-reps N]
 *                    [--fp32] [--out FILE.json]
 *
 * The parameter table is the model's (lm_model_optimizer_params with the
 * config's optimizer: Muon per head / per expert on the matrices, AdamW on the
 * rest), split into a Muon and an AdamW group as the trainer splits it. One
 * step on the device = global gradient norm and clip (max norm 1, so the
 * gradients are scaled), the Muon group's step, the AdamW group's step, then
 * a device synchronisation; the median of --reps steps after one warm-up step
 * is reported, and each part on its own. --fp32 runs Newton–Schulz with full
 * fp32 products instead of TF32.
 *
 * The host path (lm_grad_clip, lm_optimizer_step on the CPU's OpenMP threads,
 * plus the gradient download and parameter upload a host optimizer needs with
 * a device model) is timed --host-reps times (default 1; 0 skips it): a
 * reference for what the device path replaces, not a tuned CPU result. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_common.h"
#include "longmoe/backend.h"
#include "longmoe/config.h"
#include "longmoe/model.h"
#include "longmoe/optim.h"
#include "longmoe/optim_device.h"

#define DIE(...)                                  \
    do {                                          \
        fprintf(stderr, "bench_cuda_optim: ");    \
        fprintf(stderr, __VA_ARGS__);             \
        fprintf(stderr, "\n");                    \
        exit(1);                                  \
    } while (0)
#define TRY_OR_DIE(call) \
    do {                 \
        if ((call) != LM_OK) DIE("%s: %s", #call, lm_last_error()); \
    } while (0)

#define MAX_REPS 1000

int main(int argc, char **argv) {
    const char *cfg_path = "configs/k3-mini.json", *out = NULL;
    int reps = 10, host_reps = 1, fp32 = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc) cfg_path = argv[++i];
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--host-reps") && i + 1 < argc) host_reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--fp32")) fp32 = 1;
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else {
            fprintf(stderr, "usage: bench_cuda_optim [--config C] [--reps N] [--host-reps N] [--fp32] "
                            "[--out FILE.json]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > MAX_REPS || host_reps < 0 || host_reps > MAX_REPS)
        DIE("--reps must be in [1, %d] and --host-reps in [0, %d]", MAX_REPS, MAX_REPS);
    lm_config c;
    if (lm_config_load(cfg_path, &c)) DIE("%s", lm_last_error());
    lm_backend *gpu = NULL;
    if (lm_backend_cuda_create(&gpu)) DIE("%s", lm_last_error());

    /* the parameter table: a host model planned for a tiny batch (its blocks
     * hold the host path's parameters and gradients) */
    lm_model *m = NULL;
    TRY_OR_DIE(lm_model_create(&c, 1, 64, &m));
    lm_model_init(m, 1);
    int np = lm_model_num_tensors(m);
    size_t n = lm_model_num_params(m);
    lm_param *all = calloc((size_t)np, sizeof *all), *mu = calloc((size_t)np, sizeof *mu),
             *ad = calloc((size_t)np, sizeof *ad), *dmu = calloc((size_t)np, sizeof *dmu),
             *dad = calloc((size_t)np, sizeof *dad), *dall = calloc((size_t)np, sizeof *dall);
    if (!all || !mu || !ad || !dmu || !dad || !dall) DIE("out of memory");
    lm_model_optimizer_params(m, all, c.optimizer);
    float *hp = lm_model_params(m), *hg = lm_model_grads(m);
    bench_xorshift xr = {0x9e3779b97f4a7c15ull};
    for (size_t i = 0; i < n; i++) hg[i] = bench_uniform(&xr, 1e-3f);

    /* the same table on the device */
    float *dp = NULL, *dg = NULL;
    TRY_OR_DIE(gpu->alloc(gpu, n * sizeof(float), (void **)&dp));
    TRY_OR_DIE(gpu->alloc(gpu, n * sizeof(float), (void **)&dg));
    TRY_OR_DIE(gpu->upload(gpu, dp, hp, n * sizeof(float)));
    TRY_OR_DIE(gpu->upload(gpu, dg, hg, n * sizeof(float)));
    int n_mu = 0, n_ad = 0;
    size_t mu_floats = 0, ad_floats = 0, ns_flops = 0;
    for (int i = 0; i < np; i++) {
        dall[i] = all[i];
        dall[i].data = dp + (all[i].data - hp);
        dall[i].grad = dg + (all[i].grad - hg);
        if (lm_param_optimizer(&all[i]) == LM_OPT_MUON) {
            mu[n_mu] = all[i];
            dmu[n_mu++] = dall[i];
            mu_floats += (size_t)lm_param_numel(&all[i]);
            /* Newton–Schulz multiply-adds per iteration: m*m*n + m*m*m + m*m*n per block */
            int nb = all[i].n_blocks > 1 ? all[i].n_blocks : 1;
            size_t rb = (size_t)(all[i].rows / nb), cc = (size_t)all[i].cols;
            size_t a = rb < cc ? rb : cc, b = rb < cc ? cc : rb;
            ns_flops += (size_t)nb * 2 * (2 * a * a * b + a * a * a);
        } else {
            ad[n_ad] = all[i];
            dad[n_ad++] = dall[i];
            ad_floats += (size_t)lm_param_numel(&all[i]);
        }
    }
    lm_optim_config oc = lm_optim_config_default();
    oc.weight_decay = c.weight_decay;
    oc.muon_ns_fp32 = fp32;
    ns_flops *= (size_t)oc.muon_ns_steps;
    lm_device_optimizer *om = NULL, *oa = NULL;
    TRY_OR_DIE(lm_optimizer_create_on(gpu, &oc, dmu, n_mu, &om));
    TRY_OR_DIE(lm_optimizer_create_on(gpu, &oc, dad, n_ad, &oa));
    void *work = NULL;
    TRY_OR_DIE(gpu->alloc(gpu, lm_grad_norm_work_bytes(np), &work));
    printf("bench_cuda_optim: %s, %zu parameters in %d tensors (Muon %d tensors, %zu; AdamW %d tensors, %zu), "
           "Newton-Schulz %s\n",
           cfg_path, n, np, n_mu, mu_floats, n_ad, ad_floats, fp32 ? "fp32" : "TF32");

    /* device: warm-up, then the whole step and its parts */
    static double t_step[MAX_REPS], t_clip[MAX_REPS], t_mu[MAX_REPS], t_ad[MAX_REPS];
    double norm = 0;
    for (int rep = -1; rep < reps; rep++) {
        TRY_OR_DIE(gpu->upload(gpu, dg, hg, n * sizeof(float))); /* the same gradients every step */
        TRY_OR_DIE(gpu->sync(gpu));
        double t0 = lm_time_seconds();
        TRY_OR_DIE(lm_grad_clip_on(gpu, dall, np, 1.0f, work, &norm));
        double t1 = lm_time_seconds();
        TRY_OR_DIE(lm_device_optimizer_step(om, c.lr));
        TRY_OR_DIE(gpu->sync(gpu));
        double t2 = lm_time_seconds();
        TRY_OR_DIE(lm_device_optimizer_step(oa, c.adam_lr));
        TRY_OR_DIE(gpu->sync(gpu));
        double t3 = lm_time_seconds();
        if (rep >= 0) {
            t_clip[rep] = t1 - t0;
            t_mu[rep] = t2 - t1;
            t_ad[rep] = t3 - t2;
        }
    }
    /* the whole step without the synchronisations between the parts */
    for (int rep = 0; rep < reps; rep++) {
        TRY_OR_DIE(gpu->upload(gpu, dg, hg, n * sizeof(float)));
        TRY_OR_DIE(gpu->sync(gpu));
        double t0 = lm_time_seconds();
        TRY_OR_DIE(lm_grad_clip_on(gpu, dall, np, 1.0f, work, &norm));
        TRY_OR_DIE(lm_device_optimizer_step(om, c.lr));
        TRY_OR_DIE(lm_device_optimizer_step(oa, c.adam_lr));
        TRY_OR_DIE(gpu->sync(gpu));
        t_step[rep] = lm_time_seconds() - t0;
    }
    double d_step = bench_median(t_step, reps) * 1e3, d_clip = bench_median(t_clip, reps) * 1e3,
           d_mu = bench_median(t_mu, reps) * 1e3, d_ad = bench_median(t_ad, reps) * 1e3;
    printf("device: step %.3f ms (norm + clip %.3f, Muon %.3f, AdamW %.3f; Newton-Schulz %.1f TFLOP/s over the "
           "Muon part), gradient norm %.6g\n",
           d_step, d_clip, d_mu, d_ad, d_mu > 0 ? (double)ns_flops / (d_mu * 1e-3) / 1e12 : 0.0, norm);

    /* host reference */
    double h_step = -1, h_xfer = -1;
    if (host_reps > 0) {
        size_t sm = lm_optim_state_floats(mu, n_mu), sa = lm_optim_state_floats(ad, n_ad);
        size_t sc = lm_optim_scratch_floats(mu, n_mu);
        float *stm = malloc((sm + 1) * sizeof(float)), *sta = malloc((sa + 1) * sizeof(float)),
              *scr = malloc((sc + 1) * sizeof(float));
        if (!stm || !sta || !scr) DIE("out of memory (host path)");
        lm_optimizer hm, ha;
        TRY_OR_DIE(lm_optimizer_init(&hm, &oc, mu, n_mu, stm, sm, scr, sc));
        TRY_OR_DIE(lm_optimizer_init(&ha, &oc, ad, n_ad, sta, sa, scr, sc));
        static double th[MAX_REPS], tx[MAX_REPS];
        for (int rep = 0; rep < host_reps; rep++) {
            double t0 = lm_time_seconds();
            TRY_OR_DIE(gpu->download(gpu, hg, dg, n * sizeof(float)));
            double t1 = lm_time_seconds();
            double hn = 0;
            TRY_OR_DIE(lm_grad_clip(all, np, 1.0f, &hn));
            TRY_OR_DIE(lm_optimizer_step(&hm, c.lr));
            TRY_OR_DIE(lm_optimizer_step(&ha, c.adam_lr));
            double t2 = lm_time_seconds();
            TRY_OR_DIE(gpu->upload(gpu, dp, hp, n * sizeof(float)));
            double t3 = lm_time_seconds();
            th[rep] = t2 - t1;
            tx[rep] = (t1 - t0) + (t3 - t2);
        }
        h_step = bench_median(th, host_reps) * 1e3;
        h_xfer = bench_median(tx, host_reps) * 1e3;
        printf("host (reference, %d OpenMP threads): step %.1f ms + gradient download and parameter upload %.1f ms\n",
               omp_get_max_threads(), h_step, h_xfer);
        free(stm);
        free(sta);
        free(scr);
    }

    if (out) {
        FILE *f = fopen(out, "w");
        if (!f) DIE("cannot write %s", out);
        fprintf(f,
                "{\"bench\": \"cuda_optim\", \"config\": \"%s\", \"params\": %zu, \"tensors\": %d, "
                "\"muon_tensors\": %d, \"muon_params\": %zu, \"adamw_tensors\": %d, \"adamw_params\": %zu, "
                "\"ns_products\": \"%s\", \"ns_flops\": %zu, \"reps\": %d,\n"
                " \"device\": {\"step_ms\": %.4f, \"clip_ms\": %.4f, \"muon_ms\": %.4f, \"adamw_ms\": %.4f},\n"
                " \"host_reference\": {\"reps\": %d, \"threads\": %d, \"step_ms\": %.2f, \"transfer_ms\": %.2f}}\n",
                cfg_path, n, np, n_mu, mu_floats, n_ad, ad_floats, fp32 ? "fp32" : "tf32", ns_flops, reps, d_step,
                d_clip, d_mu, d_ad, host_reps, omp_get_max_threads(), h_step, h_xfer);
        fclose(f);
        printf("wrote %s\n", out);
    }
    lm_device_optimizer_free(om);
    lm_device_optimizer_free(oa);
    gpu->release(gpu, work);
    gpu->release(gpu, dp);
    gpu->release(gpu, dg);
    free(all);
    free(mu);
    free(ad);
    free(dmu);
    free(dad);
    free(dall);
    lm_model_free(m);
    lm_backend_free(gpu);
    return 0;
}
