/* `longmoe demo`: what `make demo` shows. First the KDA operator on random
 * inputs (the chunked form equals the recurrent definition; the bounded gate's
 * factored diagonal path timed against the softplus fallback), then the tiny
 * preset trained on the built-in copy task, ending with a checkpoint and the
 * model copying a string it never saw. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check.h"
#include "cli.h"
#include "longmoe/kda.h"
#include "longmoe/model.h"
#include "longmoe/report.h"
#include "longmoe/train.h"

static void fill_normal(lm_rng *r, float *x, size_t n, float s) {
    for (size_t i = 0; i < n; i++) x[i] = s * (float)lm_rng_normal(r);
}

/* L2-normalise each K-vector, as the KDA layer does for q and k. */
static void l2_normalise(float *x, size_t rows, int K) {
    for (size_t r = 0; r < rows; r++) {
        float *v = x + r * (size_t)K, ss = 0;
        for (int d = 0; d < K; d++) ss += v[d] * v[d];
        float inv = 1.0f / sqrtf(ss + 1e-6f);
        for (int d = 0; d < K; d++) v[d] *= inv;
    }
}

static double rel_diff(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static double median3(double a, double b, double c) {
    double lo = a < b ? a : b, hi = a < b ? b : a;
    return c < lo ? lo : (c > hi ? hi : c);
}

static int die_status(const char *what) {
    return cli_fail("demo", "%s: %s", what, lm_last_error());
}

static int demo_kda(void) {
    const int B = 1, T = 2048, H = 4, K = 64, V = 64;
    size_t nk = (size_t)B * T * H * K, nv = (size_t)B * T * H * V, ns = (size_t)B * H * K * V;
    lm_rng rng;
    lm_rng_seed(&rng, 2026);
    float *q = mallocCheck(nk * 4), *k = mallocCheck(nk * 4), *v = mallocCheck(nv * 4);
    float *z = mallocCheck(nk * 4), *beta = mallocCheck((size_t)B * T * H * 4);
    float *A_log = mallocCheck((size_t)H * 4), *dt_bias = mallocCheck((size_t)H * K * 4);
    float *h0 = mallocCheck(ns * 4), *d_o = mallocCheck(nv * 4);
    float *o_rec = mallocCheck(nv * 4), *o_chunk = mallocCheck(nv * 4);
    float *ht_rec = mallocCheck(ns * 4), *ht_chunk = mallocCheck(ns * 4);
    fill_normal(&rng, q, nk, 1);
    fill_normal(&rng, k, nk, 1);
    l2_normalise(q, nk / K, K);
    l2_normalise(k, nk / K, K);
    fill_normal(&rng, v, nv, 1);
    fill_normal(&rng, z, nk, 1);
    for (int i = 0; i < B * T * H; i++) beta[i] = (float)(0.1 + 0.8 * lm_rng_uniform(&rng));
    fill_normal(&rng, A_log, H, 0.3f);
    fill_normal(&rng, dt_bias, (size_t)H * K, 0.5f);
    fill_normal(&rng, h0, ns, 0.1f);
    fill_normal(&rng, d_o, nv, 1);
    lm_kda_inputs in = {q, k, v, z, beta, A_log, dt_bias, h0};

    printf("longmoe demo: Kimi Delta Attention on the CPU (B=%d T=%d H=%d K=%d V=%d, random inputs)\n\n",
           B, T, H, K, V);
    printf("%-9s %-6s %-10s %14s %14s\n", "gate", "chunk", "diag path", "|o| rel diff", "|ht| rel diff");
    lm_kda_gate gates[2] = {LM_KDA_GATE_BOUNDED, LM_KDA_GATE_SOFTPLUS};
    int worst_ok = 1;
    for (int gi = 0; gi < 2; gi++) {
        lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
        cfg.gate = gates[gi];
        if (lm_kda_recurrent_forward(&cfg, &in, o_rec, ht_rec)) return die_status("recurrent");
        for (int c = 16; c <= 64; c *= 2) {
            cfg.chunk = c;
            if (lm_kda_chunk_forward(&cfg, &in, o_chunk, ht_chunk)) return die_status("chunked");
            double eo = rel_diff(o_chunk, o_rec, nv), es = rel_diff(ht_chunk, ht_rec, ns);
            worst_ok &= eo < 1e-4 && es < 1e-4;
            printf("%-9s %-6d %-10s %14.2e %14.2e\n", gi ? "softplus" : "bounded", c,
                   lm_kda_diag_path(&cfg) == LM_KDA_DIAG_FACTORED ? "factored" : "pairwise", eo, es);
        }
    }
    printf("\nchunked = recurrent (fp32 rounding, relative error < 1e-4): %s\n\n", worst_ok ? "yes" : "NO");

    /* timings: median of 3 runs each */
    lm_kda_grads g = {callocCheck(nk, 4), callocCheck(nk, 4), callocCheck(nv, 4), callocCheck(nk, 4),
                      callocCheck((size_t)B * T * H, 4), callocCheck(H, 4), callocCheck((size_t)H * K, 4),
                      callocCheck(ns, 4)};
    double fwd[3][3], bwd[3][3];
    const char *names[3] = {"chunked, bounded gate (factored diagonal)",
                            "chunked, softplus gate (per-pair diagonal)", "recurrent (definition)"};
    for (int variant = 0; variant < 3; variant++) {
        lm_kda_config cfg = lm_kda_config_default(B, T, H, K, V);
        cfg.gate = variant == 1 ? LM_KDA_GATE_SOFTPLUS : LM_KDA_GATE_BOUNDED;
        for (int rep = 0; rep < 3; rep++) {
            double t0 = lm_time_seconds();
            lm_status s = variant == 2 ? lm_kda_recurrent_forward(&cfg, &in, o_rec, NULL)
                                       : lm_kda_chunk_forward(&cfg, &in, o_chunk, NULL);
            double t1 = lm_time_seconds();
            if (s) return die_status("timing");
            fwd[variant][rep] = t1 - t0;
            bwd[variant][rep] = 0;
            if (variant < 2) {
                if (lm_kda_chunk_backward(&cfg, &in, d_o, NULL, &g)) return die_status("backward");
                bwd[variant][rep] = lm_time_seconds() - t1;
            }
        }
    }
    printf("%-44s %12s %14s\n", "time on this CPU (median of 3)", "forward ms", "fwd+bwd ms");
    double f[3], fb[3];
    for (int variant = 0; variant < 3; variant++) {
        f[variant] = 1e3 * median3(fwd[variant][0], fwd[variant][1], fwd[variant][2]);
        fb[variant] = f[variant] + 1e3 * median3(bwd[variant][0], bwd[variant][1], bwd[variant][2]);
        if (variant < 2) printf("%-44s %12.1f %14.1f\n", names[variant], f[variant], fb[variant]);
        else printf("%-44s %12.1f %14s\n", names[variant], f[variant], "-");
    }
    printf("\nsoftplus fallback / bounded fast path: forward %.2fx, forward+backward %.2fx\n\n",
           f[1] / f[0], fb[1] / fb[0]);
    free(q); free(k); free(v); free(z); free(beta); free(A_log); free(dt_bias); free(h0); free(d_o);
    free(o_rec); free(o_chunk); free(ht_rec); free(ht_chunk);
    free(g.dq); free(g.dk); free(g.dv); free(g.dz); free(g.dbeta); free(g.dA_log); free(g.ddt_bias);
    free(g.dh0);
    return worst_ok ? 0 : 1;
}

/* Greedy continuation of `prompt` until a newline: chunked prefill, then one
 * token at a time through the recurrent KDA state and the MLA latent cache. */
static lm_status complete(lm_model *m, const char *prompt, char *out, size_t n) {
    const int V = lm_model_config(m)->vocab_size, len = (int)strlen(prompt);
    lm_decoder *dec = NULL;
    int32_t *tok = mallocCheck((size_t)len * sizeof *tok);
    float *logits = mallocCheck((size_t)V * sizeof *logits);
    for (int i = 0; i < len; i++) tok[i] = (unsigned char)prompt[i];
    size_t k = 0;
    lm_status s = lm_decoder_create(m, 1, len + (int)n, &dec);
    if (!s) s = lm_decoder_prefill(dec, tok, len, logits);
    while (!s && k + 1 < n) {
        int32_t next = 0;
        for (int v = 1; v < V; v++) next = logits[v] > logits[next] ? v : next;
        if (next == '\n') break;
        out[k++] = (char)(next >= 32 && next < 127 ? next : '?');
        s = lm_decoder_step(dec, &next, logits);
    }
    out[k] = 0;
    lm_decoder_free(dec);
    free(tok);
    free(logits);
    return s;
}

int cmd_demo(int argc, char **argv) {
    const char *config = "configs/tiny.json", *out = "out/demo";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: longmoe demo [--config C] [--out DIR]\n\n"
                   "1. runs the KDA operator on random inputs: chunked = recurrent, and the cost of the\n"
                   "   bounded gate's fast path against the softplus fallback;\n"
                   "2. trains C (default configs/tiny.json) through its stages of context extension on\n"
                   "   built-in tasks into DIR (default out/demo), evaluating after each stage;\n"
                   "3. writes DIR/report.html and shows the model copying a string it never saw, decoded\n"
                   "   token by token with the recurrent KDA state and the MLA latent cache.\n");
            return 0;
        } else if (!strcmp(argv[i], "--config") && i + 1 < argc) {
            config = argv[++i];
        } else if (!strcmp(argv[i], "--out") && i + 1 < argc) {
            out = argv[++i];
        } else {
            return cli_fail("demo", "unknown option '%s' (see --help)", argv[i]) + 1;
        }
    }
    if (demo_kda()) return 1;
    lm_config cfg;
    if (lm_config_load(config, &cfg)) return cli_fail("demo", "%s", lm_last_error());
    printf("training %s on built-in tasks: copy (\"<letters>|<the same letters>\\n\", repeated) and\n"
           "vcopy (the same across a gap). The second copy is predictable only by looking back: its\n"
           "accuracy shows what the model learned. After each stage: passkey and MQAR grids, retrieval\n"
           "probes (docs/eval.md) that this preset does not train on: they stay at 0 here.\n\n", config);
    /* a fresh run never overwrites one: the previous demo's run is moved aside, not deleted */
    struct stat sb;
    char latest[1100];
    snprintf(latest, sizeof latest, "%s/latest", out);
    if (stat(latest, &sb) == 0) {
        char aside[1100];
        for (int k = 1; k < 10000; k++) {
            snprintf(aside, sizeof aside, "%s.previous-%d", out, k);
            if (stat(aside, &sb) != 0) break;
        }
        if (rename(out, aside) != 0) return cli_fail("demo", "cannot move the previous run '%s' aside", out);
        printf("kept the previous demo run as %s\n\n", aside);
    }
    lm_train_options opt = lm_train_options_default(out);
    lm_train_result r;
    if (lm_train(&cfg, &opt, &r)) return cli_fail("demo", "%s", lm_last_error());
    lm_report_options ro = lm_report_options_default(out);
    if (lm_report_write(&ro, NULL)) return cli_fail("demo", "%s", lm_last_error());
    char dir[1100], got[64];
    snprintf(dir, sizeof dir, "%s/checkpoint-%08lld", out, (long long)r.step);
    lm_model *m = NULL;
    lm_config saved;
    if (lm_checkpoint_load_model(dir, 1, 0, &saved, &m)) return cli_fail("demo", "%s", lm_last_error());
    lm_status s = complete(m, "kimi|kimi\nlongmoe|", got, sizeof got);
    lm_model_free(m);
    if (s) return cli_fail("demo", "%s", lm_last_error());
    printf("\nwhat the model learned: held-out %s accuracy %.1f%% (chance: 1/26 = 3.8%%); given\n"
           "  \"kimi|kimi\\nlongmoe|\"  it writes  \"%s\"  (a string it never saw; decoded token by token)\n",
           cfg.n_stages ? cfg.stages[cfg.n_stages - 1].data[0] : cfg.data, 100.0 * r.val_answer_acc, got);
    printf("checkpoint: %s (model.safetensors, config.json, trainer state)\n", dir);
    printf("metrics: %s/metrics.jsonl   report: %s/report.html\n", out, out);
    return 0;
}
