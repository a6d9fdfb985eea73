/* `longmoe op kda`: run the KDA operator on tensors from a safetensors file
 * and write its outputs (and gradients) to another (docs/ops.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "files.h"
#include "longmoe/kda.h"
#include "longmoe/safetensors.h"
#ifdef LONGMOE_HAVE_CUDA
#include "longmoe/kda_cuda.h"
#endif

static const char *const kda_usage =
    "usage: longmoe op kda --in IN.safetensors --out OUT.safetensors [options]\n"
    "\n"
    "Runs Kimi Delta Attention on the tensors in IN and writes o and ht (and, when\n"
    "IN holds `do`, the gradients) to OUT. Inputs (F32, BF16, F16 or F64):\n"
    "  q, k [B,T,H,K]   v [B,T,H,V]   z (raw gate input) [B,T,H,K]   beta [B,T,H]\n"
    "  A_log [H]   dt_bias [H*K]   optional: h0 [B,H,K,V], do [B,T,H,V], dht [B,H,K,V]\n"
    "Outputs (F32): o [B,T,H,V], ht [B,H,K,V]; with do: dq dk dv dz dbeta dA_log\n"
    "ddt_bias dh0 (gradients of sum(o*do) + sum(ht*dht)).\n"
    "\n"
    "options:\n"
    "  --mode chunk|recurrent   form of the forward (default chunk); the backward\n"
    "                           is always the chunked backward\n"
    "  --gate bounded|softplus  decay gate (default bounded)\n"
    "  --g-min X                lower bound of the bounded gate, in [-5, 0) (default -5)\n"
    "  --chunk N                chunk size 16, 32 or 64 (default 64)\n"
    "  --scale X                output scale (default K^-1/2)\n"
    "  --device cpu|cuda        where to run (default cpu); cuda runs the Hopper kernels\n"
    "                           (bf16 tensors, fp32 state; chunk form, chunk 64, K = V = 32, 64 or 128)\n";

typedef struct {
    float *q, *k, *v, *z, *beta, *A_log, *dt_bias, *h0, *d_o, *dht;
} kda_tensors;

static void kda_tensors_free(kda_tensors *t) {
    float **all[] = {&t->q, &t->k, &t->v, &t->z, &t->beta, &t->A_log, &t->dt_bias, &t->h0, &t->d_o, &t->dht};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        free(*all[i]);
        *all[i] = NULL;
    }
}

int cmd_op_kda(int argc, char **argv) {
    const char *cmd = "op kda";
    const char *in_path = NULL, *out_path = NULL;
    int recurrent = 0;
    lm_kda_gate gate = LM_KDA_GATE_BOUNDED;
    double g_min = LM_KDA_G_MIN_DEFAULT, scale = 0;
    long chunk = 64;
    int cuda = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(kda_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--in")) {
            if (!(in_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--mode")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if (!strcmp(v, "chunk")) recurrent = 0;
            else if (!strcmp(v, "recurrent")) recurrent = 1;
            else return cli_fail(cmd, "--mode must be chunk or recurrent, got '%s'", v) + 1;
        } else if (!strcmp(a, "--gate")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if (!strcmp(v, "bounded")) gate = LM_KDA_GATE_BOUNDED;
            else if (!strcmp(v, "softplus")) gate = LM_KDA_GATE_SOFTPLUS;
            else return cli_fail(cmd, "--gate must be bounded or softplus, got '%s'", v) + 1;
        } else if (!strcmp(a, "--g-min")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &g_min)) return 2;
        } else if (!strcmp(a, "--chunk")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 16, 64, &chunk)) return 2;
        } else if (!strcmp(a, "--device")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if (!strcmp(v, "cpu")) cuda = 0;
            else if (!strcmp(v, "cuda")) cuda = 1;
            else return cli_fail(cmd, "--device must be cpu or cuda, got '%s'", v) + 1;
        } else if (!strcmp(a, "--scale")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &scale)) return 2;
        } else {
            cli_fail(cmd, "unknown option '%s' (see --help)", a);
            return 2;
        }
    }
    if (!in_path || !out_path) {
        cli_fail(cmd, "--in and --out are required (see --help)");
        return 2;
    }
#ifndef LONGMOE_HAVE_CUDA
    if (cuda) return cli_fail(cmd, "--device cuda: this build has no CUDA kernels (nvcc was not found when it "
                                   "was configured)");
#endif
    if (cuda && recurrent) return cli_fail(cmd, "--device cuda runs the chunked form: drop --mode recurrent");

    lm_safetensors *st = NULL;
    if (out_path && lm_same_file(in_path, out_path))
        return cli_fail(cmd, "--out '%s' is the --in file: writing it would destroy the input (choose another --out)",
                        out_path) + 1;
    if (lm_safetensors_open(in_path, &st)) return cli_fail(cmd, "%s", lm_last_error());
    int rc = 1;
    kda_tensors t = {0};
    float *o = NULL, *ht = NULL;
    lm_kda_grads g = {0};

    /* dimensions come from q [B,T,H,K] and v [B,T,H,V] */
    const lm_st_tensor *tq = lm_safetensors_find(st, "q"), *tv = lm_safetensors_find(st, "v");
    if (!tq || tq->ndim != 4 || !tv || tv->ndim != 4) {
        cli_fail(cmd, "%s: needs tensors q [B,T,H,K] and v [B,T,H,V] (4 dimensions each)", in_path);
        goto done;
    }
    int64_t B = tq->shape[0], T = tq->shape[1], H = tq->shape[2], K = tq->shape[3], V = tv->shape[3];
    if (B < 1 || T < 1 || H < 1 || K < 1 || V < 1 || B * T * H * (K > V ? K : V) > ((int64_t)1 << 31)) {
        cli_fail(cmd, "q [B,T,H,K] = [%lld,%lld,%lld,%lld]: every dimension must be positive and "
                 "the tensor below 2^31 elements", (long long)B, (long long)T, (long long)H, (long long)K);
        goto done;
    }
    int64_t s_btHK[4] = {B, T, H, K}, s_btHV[4] = {B, T, H, V}, s_bth[3] = {B, T, H}, s_h[1] = {H},
            s_hk[1] = {H * K}, s_state[4] = {B, H, K, V};
    if (cli_read_tensor(cmd, st, "q", 4, "[B,T,H,K]", s_btHK, &t.q, NULL) ||
        cli_read_tensor(cmd, st, "k", 4, "[B,T,H,K]", s_btHK, &t.k, NULL) ||
        cli_read_tensor(cmd, st, "v", 4, "[B,T,H,V]", s_btHV, &t.v, NULL) ||
        cli_read_tensor(cmd, st, "z", 4, "[B,T,H,K]", s_btHK, &t.z, NULL) ||
        cli_read_tensor(cmd, st, "beta", 3, "[B,T,H]", s_bth, &t.beta, NULL) ||
        cli_read_tensor(cmd, st, "A_log", 1, "[H]", s_h, &t.A_log, NULL) ||
        cli_read_tensor(cmd, st, "dt_bias", 1, "[H*K]", s_hk, &t.dt_bias, NULL))
        goto done;
    if (lm_safetensors_find(st, "h0") && cli_read_tensor(cmd, st, "h0", 4, "[B,H,K,V]", s_state, &t.h0, NULL))
        goto done;
    if (lm_safetensors_find(st, "do") && cli_read_tensor(cmd, st, "do", 4, "[B,T,H,V]", s_btHV, &t.d_o, NULL))
        goto done;
    if (lm_safetensors_find(st, "dht")) {
        if (!t.d_o) {
            cli_fail(cmd, "%s: dht is given but do is not; the backward needs do", in_path);
            goto done;
        }
        if (cli_read_tensor(cmd, st, "dht", 4, "[B,H,K,V]", s_state, &t.dht, NULL)) goto done;
    }

    lm_kda_config cfg = lm_kda_config_default((int)B, (int)T, (int)H, (int)K, (int)V);
    cfg.gate = gate;
    cfg.g_min = (float)g_min;
    cfg.scale = (float)scale;
    cfg.chunk = (int)chunk;
    lm_kda_inputs in = {t.q, t.k, t.v, t.z, t.beta, t.A_log, t.dt_bias, t.h0};
    size_t n_o = (size_t)(B * T * H * V), n_s = (size_t)(B * H * K * V), n_k = (size_t)(B * T * H * K);
    o = malloc(n_o * sizeof *o);
    ht = malloc(n_s * sizeof *ht);
    if (!o || !ht) {
        cli_fail(cmd, "out of memory for the outputs (%zu floats)", n_o + n_s);
        goto done;
    }
    lm_status s;
#ifdef LONGMOE_HAVE_CUDA
    if (cuda) s = lm_kda_cuda_forward_host(&cfg, &in, o, ht);
    else
#endif
        s = recurrent ? lm_kda_recurrent_forward(&cfg, &in, o, ht) : lm_kda_chunk_forward(&cfg, &in, o, ht);
    if (s) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    lm_st_writer *w = lm_st_writer_new();
    lm_st_writer_add(w, "o", LM_DTYPE_F32, 4, s_btHV, o);
    lm_st_writer_add(w, "ht", LM_DTYPE_F32, 4, s_state, ht);
    if (t.d_o) {
        g.dq = calloc(n_k, sizeof(float));
        g.dk = calloc(n_k, sizeof(float));
        g.dv = calloc(n_o, sizeof(float));
        g.dz = calloc(n_k, sizeof(float));
        g.dbeta = calloc((size_t)(B * T * H), sizeof(float));
        g.dA_log = calloc((size_t)H, sizeof(float));
        g.ddt_bias = calloc((size_t)(H * K), sizeof(float));
        g.dh0 = calloc(n_s, sizeof(float));
        if (!g.dq || !g.dk || !g.dv || !g.dz || !g.dbeta || !g.dA_log || !g.ddt_bias || !g.dh0) {
            lm_st_writer_free(w);
            cli_fail(cmd, "out of memory for the gradients");
            goto done;
        }
        lm_status bs;
#ifdef LONGMOE_HAVE_CUDA
        if (cuda) bs = lm_kda_cuda_backward_host(&cfg, &in, t.d_o, t.dht, &g);
        else
#endif
            bs = lm_kda_chunk_backward(&cfg, &in, t.d_o, t.dht, &g);
        if (bs) {
            lm_st_writer_free(w);
            cli_fail(cmd, "%s", lm_last_error());
            goto done;
        }
        lm_st_writer_add(w, "dq", LM_DTYPE_F32, 4, s_btHK, g.dq);
        lm_st_writer_add(w, "dk", LM_DTYPE_F32, 4, s_btHK, g.dk);
        lm_st_writer_add(w, "dv", LM_DTYPE_F32, 4, s_btHV, g.dv);
        lm_st_writer_add(w, "dz", LM_DTYPE_F32, 4, s_btHK, g.dz);
        lm_st_writer_add(w, "dbeta", LM_DTYPE_F32, 3, s_bth, g.dbeta);
        lm_st_writer_add(w, "dA_log", LM_DTYPE_F32, 1, s_h, g.dA_log);
        lm_st_writer_add(w, "ddt_bias", LM_DTYPE_F32, 1, s_hk, g.ddt_bias);
        lm_st_writer_add(w, "dh0", LM_DTYPE_F32, 4, s_state, g.dh0);
    }
    lm_st_writer_set_metadata(w, "producer", "longmoe op kda");
    lm_st_writer_set_metadata(w, "device", cuda ? "cuda" : "cpu");
    lm_st_writer_set_metadata(w, "diag_path",
                              lm_kda_diag_path(&cfg) == LM_KDA_DIAG_FACTORED ? "factored" : "pairwise");
    s = lm_st_writer_save(w, out_path);
    lm_st_writer_free(w);
    if (s) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    rc = 0;
done:
    free(o);
    free(ht);
    free(g.dq); free(g.dk); free(g.dv); free(g.dz);
    free(g.dbeta); free(g.dA_log); free(g.ddt_bias); free(g.dh0);
    kda_tensors_free(&t);
    lm_safetensors_close(st);
    return rc;
}
