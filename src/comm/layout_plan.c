/* Sizing a parallel layout: memory, FLOPs, collective bytes and time per GPU
 * and step (include/longmoe/layout_plan.h; every formula is written out in
 * docs/scaleout.md, "Planning a layout"). Per-layer sizes come from the
 * model planner (lm_config_plan): every layer of a kind is the same size. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "longmoe/layout_plan.h"

const char *lm_collective_name(lm_collective c) {
    static const char *const names[LM_COLL_COUNT] = {
        "gradient reduce-scatter", "weight all-gather", "EP all-to-all", "QB histogram all-reduce",
        "CP KDA state maps", "CP MLA latents", "PP AttnRes sources", "TP all-reduce"};
    return (unsigned)c < LM_COLL_COUNT ? names[c] : "?";
}

lm_cluster lm_cluster_default(void) {
    lm_cluster k = {8, 900e9, 400e9 / 8, 989e12, 0.4};
    return k;
}

lm_status lm_layout_parse(const char *text, lm_layout *out) {
    if (!text || !out) return lm_error(LM_ERR_ARG, "layout: text or out is NULL");
    int v[5] = {0, 0, 0, 0, 1}, n = 0;
    const char *s = text;
    while (*s && n < 5) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s || x < 1 || x > (1L << 20))
            return lm_error(LM_ERR_ARG, "layout '%s': each of DP,EP,CP,PP[,TP] must be a whole number >= 1", text);
        v[n++] = (int)x;
        s = end;
        if (*s == ',') s++;
        else if (*s) return lm_error(LM_ERR_ARG, "layout '%s': expected a comma after %ld", text, x);
    }
    if (*s || n < 4) return lm_error(LM_ERR_ARG, "layout '%s': expected DP,EP,CP,PP or DP,EP,CP,PP,TP", text);
    out->dp = v[0], out->ep = v[1], out->cp = v[2], out->pp = v[3], out->tp = v[4];
    return LM_OK;
}

/* Sources that cross the boundary after `layers_done` layers (SPEC §5; docs/attnres.md). */
static int sources_after(const lm_config *c, int layers_done) {
    int done = 2 * layers_done; /* sublayers */
    if (c->residual == LM_RESIDUAL_STANDARD) return 1;
    if (c->residual == LM_RESIDUAL_FULL_ATTNRES) return 1 + done;
    int S = c->attnres_block;
    return 1 + done / S + (done % S > 0);
}

/* A group of `size` ranks `stride` apart crosses nodes when it does not fit in one. */
static int crosses(const lm_cluster *k, long stride, long size) { return size > 1 && stride * size > k->gpus_per_node; }

/* (g - 1) / g: the share of a ring reduce-scatter or all-gather one rank sends */
static double ring(int g) { return g > 1 ? (double)(g - 1) / g : 0.0; }

lm_status lm_layout_plan_compute(const lm_config *c, const lm_layout *L, const lm_cluster *k, int64_t seq_len,
                                 int64_t global_tokens, lm_layout_plan *out) {
    const char *what = "plan layout";
    if (!c || !L || !k || !out) return lm_error(LM_ERR_ARG, "%s: an argument is NULL", what);
    memset(out, 0, sizeof *out);
    const int dp = L->dp, ep = L->ep, cp = L->cp, pp = L->pp, tp = L->tp;
    if (dp < 1 || ep < 1 || cp < 1 || pp < 1 || tp < 1)
        return lm_error(LM_ERR_ARG, "%s: DP %d, EP %d, CP %d, PP %d, TP %d must all be >= 1", what, dp, ep, cp, pp, tp);
    if (((long)dp * cp) % ep)
        return lm_error(LM_ERR_ARG, "%s: EP = %d must divide DP x CP = %ld (experts are split among data-parallel ranks)",
                        what, ep, (long)dp * cp);
    if (c->n_routed_experts % ep)
        return lm_error(LM_ERR_ARG, "%s: EP = %d must divide the %d routed experts", what, ep, c->n_routed_experts);
    if (pp > c->n_layers || pp > LM_LAYOUT_MAX_STAGES)
        return lm_error(LM_ERR_ARG, "%s: PP = %d exceeds the %d layers (or %d stages)", what, pp, c->n_layers,
                        LM_LAYOUT_MAX_STAGES);
    if (c->kda_heads % tp || c->attn_heads % tp)
        return lm_error(LM_ERR_ARG, "%s: TP = %d must divide the KDA heads (%d) and attention heads (%d)", what, tp,
                        c->kda_heads, c->attn_heads);
    if (seq_len < 1 || seq_len % ((int64_t)cp * tp))
        return lm_error(LM_ERR_ARG, "%s: seq_len %lld must be a positive multiple of CP x TP = %d", what,
                        (long long)seq_len, cp * tp);
    if (global_tokens < 1 || global_tokens % (seq_len * dp))
        return lm_error(LM_ERR_ARG, "%s: global batch of %lld tokens must be a multiple of DP x seq_len = %lld", what,
                        (long long)global_tokens, (long long)seq_len * dp);
    if (!(k->gpus_per_node >= 1 && k->nvlink_bytes_per_s > 0 && k->ib_bytes_per_s > 0 && k->peak_flops > 0 &&
          k->mfu > 0 && k->mfu <= 1))
        return lm_error(LM_ERR_ARG, "%s: cluster figures must be positive (and MFU in (0, 1])", what);

    lm_plan p;
    lm_config_plan(c, seq_len, &p);
    int n_kda = 0, n_mla = 0, n_moe = 0;
    for (int l = 0; l < c->n_layers; l++) {
        n_kda += lm_config_mixer(c, l) == LM_MIXER_KDA;
        n_mla += lm_config_mixer(c, l) == LM_MIXER_MLA;
        n_moe += lm_config_is_moe(c, l);
    }
    const int n_dense = c->n_layers - n_moe;
    const double d = c->d_model, din = c->latent_dim ? c->latent_dim : c->d_model;
    /* per layer of each kind: parameters and forward FLOPs per token */
    const double kda_par = n_kda ? p.params[LM_PART_KDA] / n_kda : 0, kda_fl = n_kda ? p.flops_per_token[LM_PART_KDA] / n_kda : 0;
    const double mla_par = n_mla ? p.params[LM_PART_MLA] / n_mla : 0, mla_fl = n_mla ? p.flops_per_token[LM_PART_MLA] / n_mla : 0;
    const double expert_par = (double)c->n_routed_experts * 3 * din * c->expert_ffn; /* split by EP */
    const double moe_par = n_moe ? (p.params[LM_PART_ROUTER] + p.params[LM_PART_ROUTED_EXPERTS] +
                                    p.params[LM_PART_SHARED_EXPERTS]) / n_moe : 0;
    const double moe_fl = n_moe ? (p.flops_per_token[LM_PART_ROUTER] + p.flops_per_token[LM_PART_ROUTED_EXPERTS] +
                                   p.flops_per_token[LM_PART_SHARED_EXPERTS]) / n_moe : 0;
    const double ffn_par = n_dense ? p.params[LM_PART_DENSE_FFN] / n_dense : 0;
    const double ffn_fl = n_dense ? p.flops_per_token[LM_PART_DENSE_FFN] / n_dense : 0;
    const double norm_par = p.params[LM_PART_ATTNRES_NORMS] / c->n_layers;

    out->layout = *L;
    out->n_gpus = dp * cp * pp * tp;
    out->seq_len = seq_len;
    out->global_tokens = global_tokens;
    out->micro_batches = (int)(global_tokens / (seq_len * dp));
    out->tokens_per_gpu = seq_len / ((int64_t)cp * tp);
    const int m = out->micro_batches, g_dense = dp * cp, g_expert = dp * cp / ep;
    const double ntok = (double)out->tokens_per_gpu;
    const int moments = c->optimizer == LM_TRAIN_MUON ? 1 : 2;
    const int n_blocks_all = c->residual == LM_RESIDUAL_BLOCK_ATTNRES ? (2 * c->n_layers + c->attnres_block - 1) / c->attnres_block
                             : c->residual == LM_RESIDUAL_FULL_ATTNRES ? 2 * c->n_layers : 0;
    /* live activations of one layer, bf16 per token (docs/scaleout.md) */
    const double tok_work = 2 * (10.0 * d), ch_work = 2 * (c->top_k * (din + 3.0 * c->expert_ffn));
    const double layer_work = tok_work + ch_work;
    /* with train.recompute a layer keeps its inputs and what is not recomputed; the recomputed part of one
     * layer is live in the backward */
    const int rc_tok = lm_recompute_sublayer(c->recompute, 0), rc_ch = lm_recompute_sublayer(c->recompute, 1);
    const double kept = (rc_tok ? 0 : tok_work) + (rc_ch ? 0 : ch_work), redo = layer_work - kept;

    double best_total = -1;
    for (int s = 0; s < pp; s++) {
        const int l0 = (int)((int64_t)c->n_layers * s / pp), l1 = (int)((int64_t)c->n_layers * (s + 1) / pp);
        out->stage_first_layer[s] = l0;
        out->stage_layers[s] = l1 - l0;
        if (s < pp - 1) out->boundary_sources[s] = sources_after(c, l1);
        double dense = 0, expert = 0, fl = 0;
        int s_kda = 0, s_mla = 0, s_moe = 0;
        for (int l = l0; l < l1; l++) {
            int is_kda = lm_config_mixer(c, l) == LM_MIXER_KDA, is_moe = lm_config_is_moe(c, l);
            s_kda += is_kda, s_mla += !is_kda, s_moe += is_moe;
            dense += (is_kda ? kda_par : mla_par) + norm_par + (is_moe ? moe_par - expert_par : ffn_par);
            expert += is_moe ? expert_par : 0;
            fl += (is_kda ? kda_fl : mla_fl) + (is_moe ? moe_fl : ffn_fl);
        }
        if (s == 0) dense += p.params[LM_PART_EMBEDDING];
        if (s == pp - 1) {
            dense += p.params[LM_PART_LM_HEAD];
            fl += p.flops_per_token[LM_PART_LM_HEAD];
        }
        /* memory per GPU of this stage */
        const double dense_g = dense / tp, expert_g = expert / ((double)ep * tp);
        const double wb = 2 * (dense_g + expert_g), gb = 4 * (dense_g + expert_g);
        const double ob = (4.0 + 4.0 * moments) * (dense_g / g_dense + expert_g / g_expert);
        const int in_flight = m < pp - s ? m : pp - s; /* 1F1B: stage s holds up to pp - s micro-batches */
        const double stored = c->recompute ? (l1 - l0) * (2 * (2 * d) + kept) : (l1 - l0) * layer_work;
        const double history = (1 + n_blocks_all) * d * 2;
        const double ab = ntok * (in_flight * (stored + history) + redo);
        const double total = wb + gb + ob + ab;
        if (total > best_total) {
            best_total = total;
            out->busiest_stage = s;
            out->dense_params = dense_g, out->expert_params = expert_g;
            out->weight_bytes = wb, out->grad_bytes = gb, out->optimizer_bytes = ob, out->activation_bytes = ab;
            out->total_bytes = total;
        }
        /* compute: training = 3 x forward, the stage's tokens split over DP x CP x TP */
        double flops = 3 * fl * (double)global_tokens / ((double)dp * cp * tp);
        if (flops > out->flops_per_gpu) out->flops_per_gpu = flops;
        /* collectives of this stage, per GPU and step; the largest stage counts */
        double cb[LM_COLL_COUNT] = {0};
        cb[LM_COLL_GRAD_REDUCE_SCATTER] = 4 * (ring(g_dense) * dense_g + ring(g_expert) * expert_g);
        cb[LM_COLL_PARAM_ALL_GATHER] = 2 * (ring(g_dense) * dense_g + ring(g_expert) * expert_g);
        cb[LM_COLL_EP_ALL_TO_ALL] = (double)m * s_moe * 4 * ntok * c->top_k * din * 2 * ring(ep);
        cb[LM_COLL_QB_HISTOGRAM] = c->balance == LM_BALANCE_QUANTILE
                                       ? s_moe * 2 * ring(dp * cp * tp) * (double)c->n_routed_experts * c->balance_bins * 4
                                       : 0;
        cb[LM_COLL_CP_KDA_STATE] = (double)m * s_kda * 2 * (cp - 1) * ((double)c->kda_heads / tp) *
                                   ((double)c->kda_head_dim * c->kda_head_dim * 2) * 4;
        cb[LM_COLL_CP_MLA_LATENT] = (double)m * s_mla * 2 * (cp - 1) * ((double)seq_len / cp) * c->kv_lora_rank * 2;
        if (s < pp - 1) cb[LM_COLL_PP_ATTNRES] = (double)m * 2 * out->boundary_sources[s] * ntok * d * 2;
        cb[LM_COLL_TP_ALL_REDUCE] = (double)m * (l1 - l0) * 4 * 2 * ring(tp) * ((double)seq_len / cp) * d * 2;
        for (int i = 0; i < LM_COLL_COUNT; i++)
            if (cb[i] > out->coll_bytes[i]) out->coll_bytes[i] = cb[i];
    }
    /* groups and their links (ranks: TP fastest, then CP, DP, PP) */
    out->coll_group[LM_COLL_GRAD_REDUCE_SCATTER] = out->coll_group[LM_COLL_PARAM_ALL_GATHER] = g_dense;
    out->coll_crosses_nodes[LM_COLL_GRAD_REDUCE_SCATTER] = out->coll_crosses_nodes[LM_COLL_PARAM_ALL_GATHER] =
        crosses(k, tp, g_dense);
    out->coll_group[LM_COLL_EP_ALL_TO_ALL] = ep;
    out->coll_crosses_nodes[LM_COLL_EP_ALL_TO_ALL] = crosses(k, tp, ep);
    out->coll_group[LM_COLL_QB_HISTOGRAM] = dp * cp * tp;
    out->coll_crosses_nodes[LM_COLL_QB_HISTOGRAM] = crosses(k, 1, (long)dp * cp * tp);
    out->coll_group[LM_COLL_CP_KDA_STATE] = out->coll_group[LM_COLL_CP_MLA_LATENT] = cp;
    out->coll_crosses_nodes[LM_COLL_CP_KDA_STATE] = out->coll_crosses_nodes[LM_COLL_CP_MLA_LATENT] = crosses(k, tp, cp);
    out->coll_group[LM_COLL_PP_ATTNRES] = pp;
    out->coll_crosses_nodes[LM_COLL_PP_ATTNRES] = crosses(k, (long)tp * cp * dp, pp);
    out->coll_group[LM_COLL_TP_ALL_REDUCE] = tp;
    out->coll_crosses_nodes[LM_COLL_TP_ALL_REDUCE] = crosses(k, 1, tp);
    double hidden = 0, exposed = 0;
    for (int i = 0; i < LM_COLL_COUNT; i++) {
        out->coll_s[i] = out->coll_bytes[i] / (out->coll_crosses_nodes[i] ? k->ib_bytes_per_s : k->nvlink_bytes_per_s);
        if (i == LM_COLL_GRAD_REDUCE_SCATTER || i == LM_COLL_PARAM_ALL_GATHER) hidden += out->coll_s[i];
        else exposed += out->coll_s[i];
    }
    out->compute_s = out->flops_per_gpu / (k->peak_flops * k->mfu);
    out->bubble_fraction = (double)(pp - 1) / m;
    const double busy = out->compute_s * (1 + out->bubble_fraction);
    out->step_s = (busy > hidden ? busy : hidden) + exposed;
    return LM_OK;
}
