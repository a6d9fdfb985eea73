/* `longmoe op moe` (the MoE layer, forward and backward) and `longmoe op route`
 * (router selection and one balancing update) on tensors from a safetensors
 * file (docs/ops.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "files.h"
#include "longmoe/balance.h"
#include "longmoe/moe.h"
#include "longmoe/safetensors.h"

static const char *const moe_usage =
    "usage: longmoe op moe --in IN.safetensors --out OUT.safetensors [--backward] [options]\n"
    "\n"
    "Runs the MoE layer on the tensors in IN and writes its outputs to OUT.\n"
    "Inputs (F32, BF16, F16 or F64); d_e = d_lat with LatentMoE, else d:\n"
    "  x [m,d]   router [n,d]   gate, up [n,f,d_e]   down [n,d_e,f]\n"
    "  optional: b [n] (balancing bias, selection only)\n"
    "            lat_down [d_lat,d], lat_norm [d_lat], lat_up [d,d_lat] (LatentMoE, all three)\n"
    "            shared_gate, shared_up [n_shared,f_s,d], shared_down [n_shared,d,f_s]\n"
    "            dy [m,d] (needed by --backward)\n"
    "Outputs (F32 unless noted): y [m,d], s [m,n] router scores, topk [m,k] I32,\n"
    "weights [m,k], load [n] I32; with --backward the gradients of sum(y*dy):\n"
    "dx and d<name> for every parameter present (drouter, dgate, ...).\n"
    "\n"
    "options (each may also come from the file's __metadata__: top_k, act, route_scale, eps):\n"
    "  --k K              experts per token, 1..16 (required here or as metadata top_k)\n"
    "  --act swiglu|situ  expert activation (default swiglu)\n"
    "  --route-scale X    scale of the renormalised weights (default 1)\n"
    "  --eps X            epsilon of the LatentMoE RMSNorm (default 1e-6)\n"
    "  --backward         also run the backward with dy\n";

static const char *const route_usage =
    "usage: longmoe op route --in SCORES.safetensors --k K [--out OUT.safetensors] [options]\n"
    "\n"
    "Routes router scores s [m,n] (in [0,1]) with an optional bias b [n]:\n"
    "topk = argtop_k(s + b), weights = s renormalised over the chosen set, and\n"
    "optionally one balancing update of b on this batch (as at a step's end).\n"
    "Outputs: topk [m,k] I32, weights [m,k] F32, load [n] I32 (tokens per expert,\n"
    "routed with the input b), b [n] F32 (updated, or the input b without\n"
    "--bias-update); metadata maxvio_batch. A summary line goes to stdout; without\n"
    "--out nothing is written.\n"
    "\n"
    "options:\n"
    "  --k K                         experts per token, 1..16\n"
    "  --bias-update quantile|sign   update b (default: none)\n"
    "  --bins N                      quantile histogram bins (default 1000)\n"
    "  --exact                       quantile by sorting instead of the histogram\n"
    "  --zoom                        quantile by the zoom estimator (docs/moe.md)\n"
    "  --rate U                      step of the sign rule (default 1e-3)\n"
    "  --route-scale X               scale of the weights (default 1)\n";

/* Read `name` as F32 with exactly `ndim` dims equal to want (want[d] < 0: any). */

static int dims_fit_int(const char *cmd, const char *name, const int64_t *shape, int ndim) {
    for (int d = 0; d < ndim; d++)
        if (shape[d] < 1 || shape[d] > (1 << 24))
            return cli_fail(cmd, "tensor '%s' dimension %d = %lld is outside [1, 2^24]", name, d,
                            (long long)shape[d]);
    return 0;
}

int cmd_op_moe(int argc, char **argv) {
    const char *cmd = "op moe";
    const char *in_path = NULL, *out_path = NULL, *act_name = NULL;
    long k = 0;
    double route_scale = -1, eps = -1;
    int backward = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(moe_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--in")) {
            if (!(in_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--k")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, LM_MOE_MAX_TOPK, &k)) return 2;
        } else if (!strcmp(a, "--act")) {
            if (!(act_name = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--route-scale")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &route_scale)) return 2;
        } else if (!strcmp(a, "--eps")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &eps)) return 2;
        } else if (!strcmp(a, "--backward")) {
            backward = 1;
        } else {
            fprintf(stderr, "longmoe %s: unknown option '%s'\n%s", cmd, a, moe_usage);
            return 2;
        }
    }
    if (!in_path || !out_path) {
        fprintf(stderr, "longmoe %s: --in and --out are required\n%s", cmd, moe_usage);
        return 2;
    }
    lm_safetensors *st = NULL;
    if (out_path && lm_same_file(in_path, out_path))
        return cli_fail(cmd, "--out '%s' is the --in file: writing it would destroy the input (choose another --out)",
                        out_path) + 1;
    if (lm_safetensors_open(in_path, &st)) return cli_fail(cmd, "%s", lm_last_error());
    /* flags override the file's metadata */
    const char *meta;
    if (!k && (meta = lm_safetensors_metadata(st, "top_k")) && cli_parse_int(cmd, "top_k", meta, 1, 16, &k)) {
        lm_safetensors_close(st);
        return 1;
    }
    if (!act_name) act_name = lm_safetensors_metadata(st, "act");
    if (route_scale < 0 && (meta = lm_safetensors_metadata(st, "route_scale")) &&
        cli_parse_double(cmd, "route_scale", meta, &route_scale)) {
        lm_safetensors_close(st);
        return 1;
    }
    if (eps < 0 && (meta = lm_safetensors_metadata(st, "eps")) && cli_parse_double(cmd, "eps", meta, &eps)) {
        lm_safetensors_close(st);
        return 1;
    }
    int rc = 1;
    float *x = NULL, *b = NULL, *dy = NULL, *y = NULL, *dx = NULL, *pmem = NULL, *gmem = NULL;
    int32_t *load = NULL;
    lm_moe_acts acts;
    memset(&acts, 0, sizeof acts);
    lm_st_writer *w = NULL;
    if (!k) {
        cli_fail(cmd, "the number of experts per token is missing: pass --k K or metadata top_k");
        goto done;
    }
    lm_moe_config c = lm_moe_config_default(1, LM_MOE_MIN_EXPERTS, 1, 1);
    c.top_k = (int)k;
    if (route_scale >= 0) c.route_scale = (float)route_scale;
    if (eps >= 0) c.norm_eps = (float)eps;
    if (act_name) {
        if (!strcmp(act_name, "swiglu")) c.act = LM_EXPERT_SWIGLU;
        else if (!strcmp(act_name, "situ")) c.act = LM_EXPERT_SITU_GLU;
        else {
            cli_fail(cmd, "act must be swiglu or situ, got '%s'", act_name);
            goto done;
        }
    }
    /* shapes: x fixes m, d; router fixes n; gate fixes f and d_e */
    int64_t xs[2] = {-1, -1};
    if (cli_read_tensor(cmd, st, "x", 2, NULL, xs, &x, xs) || dims_fit_int(cmd, "x", xs, 2)) goto done;
    const lm_st_tensor *tr = lm_safetensors_find(st, "router"), *tg = lm_safetensors_find(st, "gate");
    if (!tr || tr->ndim != 2 || !tg || tg->ndim != 3) {
        cli_fail(cmd, "need tensors 'router' [n,d] and 'gate' [n,f,d_e] in %s", in_path);
        goto done;
    }
    if (dims_fit_int(cmd, "router", tr->shape, 2) || dims_fit_int(cmd, "gate", tg->shape, 3)) goto done;
    int64_t m = xs[0];
    c.d = (int)xs[1];
    c.n_experts = (int)tr->shape[0];
    c.d_ff = (int)tg->shape[1];
    int de = (int)tg->shape[2];
    const lm_st_tensor *tl = lm_safetensors_find(st, "lat_down"), *ts = lm_safetensors_find(st, "shared_gate");
    if (tl) {
        if (tl->ndim != 2 || dims_fit_int(cmd, "lat_down", tl->shape, 2)) {
            cli_fail(cmd, "'lat_down' must be [d_lat,d] with positive dims");
            goto done;
        }
        c.d_latent = (int)tl->shape[0];
    }
    if (de != (c.d_latent ? c.d_latent : c.d)) {
        cli_fail(cmd, "'gate' last dimension %d must equal %s = %d", de, c.d_latent ? "d_lat" : "d",
                 c.d_latent ? c.d_latent : c.d);
        goto done;
    }
    if (ts) {
        if (ts->ndim != 3 || dims_fit_int(cmd, "shared_gate", ts->shape, 3)) {
            cli_fail(cmd, "'shared_gate' must be [n_shared,f_s,d] with positive dims");
            goto done;
        }
        c.n_shared = (int)ts->shape[0];
        c.d_ff_shared = (int)ts->shape[1];
    }
    if (lm_moe_check(&c)) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    size_t count = lm_moe_param_count(&c);
    pmem = malloc(count * sizeof *pmem);
    gmem = calloc(count, sizeof *gmem);
    if (!pmem || !gmem) {
        cli_fail(cmd, "out of memory for %zu parameters", count);
        goto done;
    }
    lm_moe_params p, g;
    lm_moe_params_carve(&c, pmem, &p);
    lm_moe_params_carve(&c, gmem, &g);
    int n = c.n_experts, d = c.d, f = c.d_ff, dl = c.d_latent, ns = c.n_shared, fs = c.d_ff_shared;
    /* every parameter: name, where it goes, its shape */
    struct { const char *name, *grad; float *dst, *gdst; int ndim; int64_t shape[3]; } prm[] = {
        {"router", "drouter", p.router, g.router, 2, {n, d}},
        {"gate", "dgate", p.gate, g.gate, 3, {n, f, de}},
        {"up", "dup", p.up, g.up, 3, {n, f, de}},
        {"down", "ddown", p.down, g.down, 3, {n, de, f}},
        {"lat_down", "dlat_down", p.lat_down, g.lat_down, 2, {dl, d}},
        {"lat_norm", "dlat_norm", p.lat_norm, g.lat_norm, 1, {dl}},
        {"lat_up", "dlat_up", p.lat_up, g.lat_up, 2, {d, dl}},
        {"shared_gate", "dshared_gate", p.shared_gate, g.shared_gate, 3, {ns, fs, d}},
        {"shared_up", "dshared_up", p.shared_up, g.shared_up, 3, {ns, fs, d}},
        {"shared_down", "dshared_down", p.shared_down, g.shared_down, 3, {ns, d, fs}},
    };
    size_t nprm = sizeof prm / sizeof prm[0];
    for (size_t i = 0; i < nprm; i++) {
        if (!prm[i].dst) {
            if (lm_safetensors_find(st, prm[i].name)) {
                cli_fail(cmd, "tensor '%s' is present but its part (%s) is not: give all of %s", prm[i].name,
                         i < 7 ? "LatentMoE" : "shared experts",
                         i < 7 ? "lat_down, lat_norm, lat_up" : "shared_gate, shared_up, shared_down");
                goto done;
            }
            continue;
        }
        float *tmp;
        int64_t want[3] = {prm[i].shape[0], prm[i].shape[1], prm[i].shape[2]};
        if (cli_read_tensor(cmd, st, prm[i].name, prm[i].ndim, NULL, want, &tmp, want)) goto done;
        size_t len = 1;
        for (int e = 0; e < prm[i].ndim; e++) len *= (size_t)prm[i].shape[e];
        memcpy(prm[i].dst, tmp, len * sizeof *tmp);
        free(tmp);
    }
    if (lm_safetensors_find(st, "b")) {
        int64_t bs[1] = {n};
        if (cli_read_tensor(cmd, st, "b", 1, NULL, bs, &b, bs)) goto done;
    }
    if (backward) {
        int64_t ds[2] = {m, d};
        if (!lm_safetensors_find(st, "dy")) {
            cli_fail(cmd, "--backward needs the tensor 'dy' [m,d] = [%lld,%d] in %s", (long long)m, d, in_path);
            goto done;
        }
        if (cli_read_tensor(cmd, st, "dy", 2, NULL, ds, &dy, ds)) goto done;
    }
    y = malloc((size_t)(m * d) * sizeof *y);
    dx = calloc((size_t)(m * d), sizeof *dx);
    load = calloc((size_t)n, sizeof *load);
    if (!y || !dx || !load) {
        cli_fail(cmd, "out of memory for %lld tokens", (long long)m);
        goto done;
    }
    if (lm_moe_acts_alloc(&acts, &c, m) || lm_moe_forward(y, x, b, &c, &p, &acts, m) ||
        (backward && lm_moe_backward(dx, &g, dy, x, NULL, &c, &p, &acts))) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    for (int j = 0; j < n; j++) load[j] = (int32_t)(acts.offsets[j + 1] - acts.offsets[j]);
    w = lm_st_writer_new();
    int64_t sy[2] = {m, d}, ss[2] = {m, n}, sk[2] = {m, c.top_k}, sn[1] = {n};
    lm_status s = lm_st_writer_add(w, "y", LM_DTYPE_F32, 2, sy, y);
    if (!s) s = lm_st_writer_add(w, "s", LM_DTYPE_F32, 2, ss, acts.s);
    if (!s) s = lm_st_writer_add(w, "topk", LM_DTYPE_I32, 2, sk, acts.topk);
    if (!s) s = lm_st_writer_add(w, "weights", LM_DTYPE_F32, 2, sk, acts.weights);
    if (!s) s = lm_st_writer_add(w, "load", LM_DTYPE_I32, 1, sn, load);
    if (backward) {
        if (!s) s = lm_st_writer_add(w, "dx", LM_DTYPE_F32, 2, sy, dx);
        for (size_t i = 0; i < nprm && !s; i++)
            if (prm[i].gdst) s = lm_st_writer_add(w, prm[i].grad, LM_DTYPE_F32, prm[i].ndim, prm[i].shape, prm[i].gdst);
    }
    if (!s) s = lm_st_writer_save(w, out_path);
    if (s) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    rc = 0;
done:
    lm_st_writer_free(w);
    lm_moe_acts_free(&acts);
    free(x);
    free(b);
    free(dy);
    free(y);
    free(dx);
    free(load);
    free(pmem);
    free(gmem);
    lm_safetensors_close(st);
    return rc;
}

int cmd_op_route(int argc, char **argv) {
    const char *cmd = "op route";
    const char *in_path = NULL, *out_path = NULL, *update = NULL;
    long k = 0, bins = LM_QB_BINS_DEFAULT;
    int exact = 0, zoom = 0;
    double rate = LM_SIGN_RATE_DEFAULT, route_scale = 1.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(route_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--in")) {
            if (!(in_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out_path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--k")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, LM_MOE_MAX_TOPK, &k)) return 2;
        } else if (!strcmp(a, "--bias-update")) {
            if (!(update = cli_value(cmd, argc, argv, &i))) return 2;
            if (strcmp(update, "quantile") && strcmp(update, "sign"))
                return cli_fail(cmd, "--bias-update must be quantile or sign, got '%s'", update) + 1;
        } else if (!strcmp(a, "--bins")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 4, 1 << 20, &bins)) return 2;
        } else if (!strcmp(a, "--exact")) {
            exact = 1;
        } else if (!strcmp(a, "--zoom")) {
            zoom = 1;
        } else if (!strcmp(a, "--rate")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &rate)) return 2;
        } else if (!strcmp(a, "--route-scale")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &route_scale)) return 2;
        } else {
            fprintf(stderr, "longmoe %s: unknown option '%s'\n%s", cmd, a, route_usage);
            return 2;
        }
    }
    if (!in_path || !k) {
        fprintf(stderr, "longmoe %s: --in and --k are required\n%s", cmd, route_usage);
        return 2;
    }
    if (exact && zoom) return cli_fail(cmd, "--exact and --zoom are two estimators: pick one") + 1;
    if ((exact || zoom) && (!update || strcmp(update, "quantile")))
        return cli_fail(cmd, "--exact and --zoom need --bias-update quantile") + 1;
    lm_safetensors *st = NULL;
    if (out_path && lm_same_file(in_path, out_path))
        return cli_fail(cmd, "--out '%s' is the --in file: writing it would destroy the input (choose another --out)",
                        out_path) + 1;
    if (lm_safetensors_open(in_path, &st)) return cli_fail(cmd, "%s", lm_last_error());
    int rc = 1;
    float *s = NULL, *b = NULL, *weights = NULL;
    int32_t *topk = NULL;
    lm_balance_state bal;
    memset(&bal, 0, sizeof bal);
    lm_st_writer *w = NULL;
    int64_t ss[2] = {-1, -1};
    if (cli_read_tensor(cmd, st, "s", 2, NULL, ss, &s, ss) || dims_fit_int(cmd, "s", ss, 2)) goto done;
    int64_t m = ss[0];
    int n = (int)ss[1];
    if (lm_safetensors_find(st, "b")) {
        int64_t bs[1] = {n};
        if (cli_read_tensor(cmd, st, "b", 1, NULL, bs, &b, bs)) goto done;
    }
    lm_balance_mode mode = !update ? LM_BALANCE_NONE : !strcmp(update, "sign") ? LM_BALANCE_SIGN : LM_BALANCE_QUANTILE;
    lm_balance_config bc = lm_balance_config_default(mode, n, (int)k, m);
    bc.bins = (int)bins;
    bc.sign_rate = (float)rate;
    bc.estimator = exact ? LM_QB_EXACT : zoom ? LM_QB_ZOOM : LM_QB_HISTOGRAM;
    if (lm_balance_init(&bal, &bc)) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    if (b) memcpy(bal.bias, b, (size_t)n * sizeof *b);
    topk = malloc((size_t)(m * k) * sizeof *topk);
    weights = malloc((size_t)(m * k) * sizeof *weights);
    if (!topk || !weights) {
        cli_fail(cmd, "out of memory for %lld tokens", (long long)m);
        goto done;
    }
    lm_balance_stats stats;
    if (lm_router_select(topk, weights, s, bal.bias, m, n, (int)k, (float)route_scale) ||
        lm_balance_observe(&bal, s, m, 1) || lm_balance_step_end(&bal, 1, &stats)) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    char mv[64];
    snprintf(mv, sizeof mv, "%.9g", stats.maxvio_batch);
    printf("route: m %lld n %d k %ld  maxvio_batch %.4f  cv %.4f  min %d max %d dead %d  b update %s\n",
           (long long)m, n, k, stats.maxvio_batch, stats.cv, stats.min_load, stats.max_load, stats.dead,
           update ? update : "none");
    w = lm_st_writer_new();
    int64_t sk[2] = {m, k}, sn[1] = {n};
    lm_status e = lm_st_writer_add(w, "topk", LM_DTYPE_I32, 2, sk, topk);
    if (!e) e = lm_st_writer_add(w, "weights", LM_DTYPE_F32, 2, sk, weights);
    if (!e) e = lm_st_writer_add(w, "load", LM_DTYPE_I32, 1, sn, stats.load);
    if (!e) e = lm_st_writer_add(w, "b", LM_DTYPE_F32, 1, sn, bal.bias);
    if (!e) e = lm_st_writer_set_metadata(w, "maxvio_batch", mv);
    if (!e && out_path) e = lm_st_writer_save(w, out_path);
    if (e) {
        cli_fail(cmd, "%s", lm_last_error());
        goto done;
    }
    rc = 0;
done:
    lm_st_writer_free(w);
    lm_balance_free(&bal);
    free(s);
    free(b);
    free(topk);
    free(weights);
    lm_safetensors_close(st);
    return rc;
}
