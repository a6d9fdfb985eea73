/* `longmoe op attention`: run the causal softmax attention core on tensors from
 * a safetensors file and write its outputs (and gradients) to another (docs/ops.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "files.h"
#include "longmoe/attention.h"
#include "longmoe/safetensors.h"

static const char *const attention_usage =
    "usage: longmoe op attention --in IN.safetensors --out OUT.safetensors [options]\n"
    "\n"
    "Runs causal softmax attention (no position encoding, tiled with an online\n"
    "softmax) on the tensors in IN and writes o and lse (and, with the backward,\n"
    "dq dk dv) to OUT. Inputs (F32, BF16, F16 or F64):\n"
    "  q [B,T,H,Dk]   k [B,T,Hkv,Dk]   v [B,T,Hkv,Dv]   (H a multiple of Hkv: GQA)\n"
    "  optional: do [B,T,H,Dv] (when present the backward runs)\n"
    "Outputs (F32): o [B,T,H,Dv], lse [B,H,T]; with the backward dq [B,T,H,Dk],\n"
    "dk [B,T,Hkv,Dk], dv [B,T,Hkv,Dv] (gradients of sum(o*do)).\n"
    "\n"
    "options:\n"
    "  --backward   run the backward; without `do` in IN it uses do = 1 (the\n"
    "               gradient of sum(o))\n"
    "  --scale X    score scale, > 0 (default Dk^-1/2)\n"
    "  --naive      use the O(T^2)-memory reference instead of the tiled core\n";

/* "[a,b,c]" of the first n dims; a negative (free) dim prints as '*'. */

int cmd_op_attention(int argc, char **argv) {
    const char *cmd = "op attention";
    const char *in_path = NULL, *out_path = NULL;
    int backward = 0, naive = 0;
    double scale = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(attention_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--in")) {
            if (!(in_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--backward")) {
            backward = 1;
        } else if (!strcmp(a, "--naive")) {
            naive = 1;
        } else if (!strcmp(a, "--scale")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &scale)) return 2;
            if (scale <= 0) return cli_fail(cmd, "--scale must be > 0, got %g", scale) + 1;
        } else {
            cli_fail(cmd, "unknown option '%s' (see --help)", a);
            return 2;
        }
    }
    if (!in_path || !out_path) {
        cli_fail(cmd, "--in and --out are required (see --help)");
        return 2;
    }

    lm_safetensors *st = NULL;
    if (out_path && lm_same_file(in_path, out_path))
        return cli_fail(cmd, "--out '%s' is the --in file: writing it would destroy the input (choose another --out)",
                        out_path) + 1;
    if (lm_safetensors_open(in_path, &st)) return cli_fail(cmd, "%s", lm_last_error());
    int rc = 1;
    float *q = NULL, *k = NULL, *v = NULL, *d_o = NULL, *o = NULL, *lse = NULL;
    float *dq = NULL, *dk = NULL, *dv = NULL;
    int64_t sq[LM_ST_MAX_DIMS], sk[LM_ST_MAX_DIMS], sv[LM_ST_MAX_DIMS], sdo[LM_ST_MAX_DIMS];

    /* dims come from q [B,T,H,Dk], k's Hkv and v's Dv; everything else must agree */
    const int64_t free4[4] = {-1, -1, -1, -1};
    if (cli_read_tensor(cmd, st, "q", 4, "[B,T,H,Dk]", free4, &q, sq)) goto done;
    const int64_t B = sq[0], T = sq[1], H = sq[2], Dk = sq[3];
    const int64_t want_k[4] = {B, T, -1, Dk};
    if (cli_read_tensor(cmd, st, "k", 4, "[B,T,Hkv,Dk]", want_k, &k, sk)) goto done;
    const int64_t Hkv = sk[2];
    const int64_t want_v[4] = {B, T, Hkv, -1};
    if (cli_read_tensor(cmd, st, "v", 4, "[B,T,Hkv,Dv]", want_v, &v, sv)) goto done;
    const int64_t Dv = sv[3];
    const int64_t lim = (int64_t)1 << 31;
    if (B < 1 || T < 1 || H < 1 || Hkv < 1 || Dk < 1 || Dv < 1 || B * T * H * (Dk > Dv ? Dk : Dv) >= lim) {
        cli_fail(cmd, "q [B,T,H,Dk] = [%lld,%lld,%lld,%lld], v's Dv = %lld: every dimension must be "
                 "positive and each tensor below 2^31 elements",
                 (long long)B, (long long)T, (long long)H, (long long)Dk, (long long)Dv);
        goto done;
    }
    if (H % Hkv) {
        cli_fail(cmd, "q has H=%lld heads, k has Hkv=%lld: H must be a multiple of Hkv",
                 (long long)H, (long long)Hkv);
        goto done;
    }
    const int64_t s_o[4] = {B, T, H, Dv}, s_lse[3] = {B, H, T};
    if (lm_safetensors_find(st, "do")) {
        if (cli_read_tensor(cmd, st, "do", 4, "[B,T,H,Dv]", s_o, &d_o, sdo)) goto done;
        backward = 1;
    }
    lm_attention_config cfg =
        lm_attention_config_default((int)B, (int)T, (int)H, (int)Hkv, (int)Dk, (int)Dv);
    cfg.scale = (float)scale;
    const size_t n_q = (size_t)(B * T * H * Dk), n_k = (size_t)(B * T * Hkv * Dk);
    const size_t n_v = (size_t)(B * T * Hkv * Dv), n_o = (size_t)(B * T * H * Dv);
    o = malloc(n_o * sizeof *o);
    lse = malloc((size_t)(B * H * T) * sizeof *lse);
    if (!o || !lse) {
        cli_fail(cmd, "out of memory for the outputs (%zu floats)", n_o + (size_t)(B * H * T));
        goto done;
    }
    lm_status s = naive ? lm_attention_naive_forward(&cfg, q, k, v, o, lse)
                        : lm_attention_forward(&cfg, q, k, v, o, lse);
    if (s) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    if (backward) {
        if (!d_o) {
            if (!(d_o = malloc(n_o * sizeof *d_o))) {
                cli_fail(cmd, "out of memory for do");
                goto done;
            }
            for (size_t i = 0; i < n_o; i++) d_o[i] = 1.0f;
        }
        dq = calloc(n_q, sizeof *dq), dk = calloc(n_k, sizeof *dk), dv = calloc(n_v, sizeof *dv);
        if (!dq || !dk || !dv) {
            cli_fail(cmd, "out of memory for the gradients");
            goto done;
        }
        s = naive ? lm_attention_naive_backward(&cfg, q, k, v, o, lse, d_o, dq, dk, dv)
                  : lm_attention_backward(&cfg, q, k, v, o, lse, d_o, dq, dk, dv);
        if (s) {
            cli_fail(cmd, "%s", lm_last_error());
            goto done;
        }
    }
    lm_st_writer *w = lm_st_writer_new();
    lm_st_writer_add(w, "o", LM_DTYPE_F32, 4, s_o, o);
    lm_st_writer_add(w, "lse", LM_DTYPE_F32, 3, s_lse, lse);
    if (backward) {
        lm_st_writer_add(w, "dq", LM_DTYPE_F32, 4, sq, dq);
        lm_st_writer_add(w, "dk", LM_DTYPE_F32, 4, sk, dk);
        lm_st_writer_add(w, "dv", LM_DTYPE_F32, 4, sv, dv);
    }
    char scale_text[32];
    snprintf(scale_text, sizeof scale_text, "%.9g", (double)lm_attention_scale(&cfg));
    lm_st_writer_set_metadata(w, "producer", "longmoe op attention");
    lm_st_writer_set_metadata(w, "path", naive ? "naive" : "tiled");
    lm_st_writer_set_metadata(w, "scale", scale_text);
    s = lm_st_writer_save(w, out_path);
    lm_st_writer_free(w);
    if (s) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    rc = 0;
done:
    free(q), free(k), free(v), free(d_o), free(o), free(lse), free(dq), free(dk), free(dv);
    lm_safetensors_close(st);
    return rc;
}
