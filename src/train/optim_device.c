/* The optimizer on a backend's memory (include/longmoe/optim_device.h;
 * docs/optim.md, "On a backend"): lm_optimizer_step's loop over the
 * parameters with the backend's optimizer ops in place of the host functions. */
#include "longmoe/optim_device.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct lm_device_optimizer {
    lm_backend *be;
    lm_optim_config cfg;
    lm_param *params;      /* owned copy of the descriptors */
    int n_params;
    size_t *state_off;     /* floats, per parameter */
    size_t state_floats;
    float *state;          /* backend memory */
    void *scratch;         /* backend memory, Newton–Schulz */
    size_t scratch_bytes;
    int64_t step;
};

static int blocks_of(const lm_param *p) { return p->n_blocks > 1 ? p->n_blocks : 1; }

void lm_device_optimizer_free(lm_device_optimizer *o) {
    if (!o) return;
    if (o->state) o->be->release(o->be, o->state);
    if (o->scratch) o->be->release(o->be, o->scratch);
    free(o->params);
    free(o->state_off);
    free(o);
}

lm_status lm_optimizer_create_on(lm_backend *be, const lm_optim_config *cfg, const lm_param *params, int n_params,
                                 lm_device_optimizer **out) {
    if (!out) return lm_error(LM_ERR_ARG, "lm_optimizer_create_on: out is NULL");
    *out = NULL;
    if (!be) be = lm_backend_cpu();
    lm_status st = lm_optim_config_check(cfg);
    if (st) return st;
    if (n_params < 0 || (n_params > 0 && !params))
        return lm_error(LM_ERR_ARG, "optimizer: %d parameters with params %s", n_params, params ? "set" : "NULL");
    if (!be->ops->adamw_update || !be->ops->muon_update || !be->ops->sum_squares)
        return lm_error(LM_ERR_ARG, "the %s backend has no optimizer ops", lm_device_name(be->device));
    for (int i = 0; i < n_params; i++)
        if ((st = lm_param_check(&params[i]))) return st;
    lm_device_optimizer *o = calloc(1, sizeof *o);
    if (!o) return lm_error(LM_ERR_MEMORY, "out of memory (optimizer)");
    o->be = be;
    o->cfg = *cfg;
    o->n_params = n_params;
    o->params = calloc((size_t)(n_params ? n_params : 1), sizeof *o->params);
    o->state_off = calloc((size_t)(n_params ? n_params : 1), sizeof *o->state_off);
    if (!o->params || !o->state_off) {
        lm_device_optimizer_free(o);
        return lm_error(LM_ERR_MEMORY, "out of memory (optimizer)");
    }
    if (n_params) memcpy(o->params, params, (size_t)n_params * sizeof *params);
    size_t off = 0, scratch = 0;
    for (int i = 0; i < n_params; i++) {
        const lm_param *p = &params[i];
        o->state_off[i] = off;
        off += lm_param_state_floats(p);
        if (lm_param_optimizer(p) == LM_OPT_MUON) {
            size_t need = be->ops->muon_scratch_bytes(be, p->rows, p->cols, blocks_of(p));
            scratch = need > scratch ? need : scratch;
        }
    }
    o->state_floats = off;
    /* alloc returns zeroed memory: the state starts at zero as lm_optimizer_init's */
    if (off && (st = be->alloc(be, off * sizeof(float), (void **)&o->state))) {
        lm_device_optimizer_free(o);
        return st;
    }
    if (scratch && (st = be->alloc(be, scratch, &o->scratch))) {
        lm_device_optimizer_free(o);
        return st;
    }
    o->scratch_bytes = scratch;
    *out = o;
    return LM_OK;
}

lm_status lm_device_optimizer_step(lm_device_optimizer *o, float lr) {
    if (!o) return lm_error(LM_ERR_ARG, "optimizer is NULL");
    if (!(lr >= 0.0f) || !isfinite(lr))
        return lm_error(LM_ERR_ARG, "learning rate %g must be finite and >= 0", (double)lr);
    const lm_optim_config *c = &o->cfg;
    lm_backend *be = o->be;
    o->step++;
    for (int i = 0; i < o->n_params; i++) {
        lm_param *p = &o->params[i];
        int64_t n = lm_param_numel(p);
        float wd = p->weight_decay ? c->weight_decay : 0.0f;
        float *s = o->state + o->state_off[i];
        lm_status st;
        if (lm_param_optimizer(p) == LM_OPT_MUON)
            st = be->ops->muon_update(be, p->data, p->grad, s, p->rows, p->cols, blocks_of(p), lr, wd, c, o->scratch,
                                      o->scratch_bytes);
        else
            st = be->ops->adamw_update(be, p->data, p->grad, s, s + n, n, lr, c->adam_beta1, c->adam_beta2,
                                       c->adam_eps, wd, o->step);
        if (st) return st;
    }
    return LM_OK;
}

lm_status lm_device_optimizer_rebind(lm_device_optimizer *o, const lm_param *params, int n_params) {
    if (!o) return lm_error(LM_ERR_ARG, "optimizer is NULL");
    if (n_params != o->n_params || (n_params && !params))
        return lm_error(LM_ERR_ARG, "optimizer rebind: %d parameters, the optimizer has %d", n_params, o->n_params);
    for (int i = 0; i < n_params; i++) {
        const lm_param *a = &o->params[i], *b = &params[i];
        lm_status st = lm_param_check(b);
        if (st) return st;
        if (a->ndim != b->ndim || a->rows != b->rows || a->cols != b->cols || blocks_of(a) != blocks_of(b) ||
            a->kind != b->kind || lm_param_optimizer(a) != lm_param_optimizer(b) || a->weight_decay != b->weight_decay)
            return lm_error(LM_ERR_ARG, "optimizer rebind: parameter %d (%s) differs from the one it was created for",
                            i, b->name ? b->name : "unnamed");
    }
    for (int i = 0; i < n_params; i++) {
        o->params[i].data = params[i].data;
        o->params[i].grad = params[i].grad;
        o->params[i].name = params[i].name;
    }
    return LM_OK;
}

int64_t lm_device_optimizer_steps(const lm_device_optimizer *o) { return o ? o->step : 0; }
size_t lm_device_optimizer_state_floats(const lm_device_optimizer *o) { return o ? o->state_floats : 0; }

lm_status lm_device_optimizer_download_state(lm_device_optimizer *o, float *host, size_t n, int64_t *step) {
    if (!o) return lm_error(LM_ERR_ARG, "optimizer is NULL");
    if (n != o->state_floats || (n && !host))
        return lm_error(LM_ERR_ARG, "optimizer state download: %zu floats asked, the state has %zu", n,
                        o->state_floats);
    if (n) {
        lm_status st = o->be->download(o->be, host, o->state, n * sizeof(float));
        if (st) return st;
    }
    if (step) *step = o->step;
    return LM_OK;
}

lm_status lm_device_optimizer_upload_state(lm_device_optimizer *o, const float *host, size_t n, int64_t step) {
    if (!o) return lm_error(LM_ERR_ARG, "optimizer is NULL");
    if (n != o->state_floats || (n && !host))
        return lm_error(LM_ERR_ARG, "optimizer state upload: %zu floats given, the state has %zu", n,
                        o->state_floats);
    if (step < 0) return lm_error(LM_ERR_ARG, "optimizer state upload: step %lld < 0", (long long)step);
    if (n) {
        lm_status st = o->be->upload(o->be, o->state, host, n * sizeof(float));
        if (st) return st;
    }
    o->step = step;
    return LM_OK;
}

/* ---- gradients ---- */

size_t lm_grad_norm_work_bytes(int n_params) { return (size_t)(n_params > 0 ? n_params : 1) * sizeof(double); }

lm_status lm_grad_global_norm_on(lm_backend *be, const lm_param *params, int n_params, void *work,
                                 double *norm_out) {
    if (!be) be = lm_backend_cpu();
    if (!norm_out) return lm_error(LM_ERR_ARG, "grad norm: norm_out is NULL");
    if (n_params < 0 || (n_params > 0 && (!params || !work)))
        return lm_error(LM_ERR_ARG, "grad norm: %d parameters with params or work NULL", n_params);
    double *sums = (double *)work;
    for (int i = 0; i < n_params; i++) {
        lm_status st = be->ops->sum_squares(be, params[i].grad, (size_t)lm_param_numel(&params[i]), sums + i);
        if (st) return st;
    }
    /* the per-tensor sums come back (one download for up to 1024 tensors; no
     * allocation inside a step) and are added in order, as lm_grad_global_norm
     * adds them */
    double host[1024], s = 0.0;
    for (int i0 = 0; i0 < n_params; i0 += 1024) {
        int n = n_params - i0 < 1024 ? n_params - i0 : 1024;
        lm_status st = be->download(be, host, sums + i0, (size_t)n * sizeof(double));
        if (st) return st;
        for (int i = 0; i < n; i++) s += host[i];
    }
    *norm_out = sqrt(s);
    return LM_OK;
}

lm_status lm_grad_clip_on(lm_backend *be, lm_param *params, int n_params, float max_norm, void *work,
                          double *norm_out) {
    if (!be) be = lm_backend_cpu();
    if (!(max_norm >= 0.0f) || !isfinite(max_norm))
        return lm_error(LM_ERR_ARG, "grad_clip: max_norm %g must be finite and >= 0 (0: off)", (double)max_norm);
    double norm = 0.0;
    lm_status st = lm_grad_global_norm_on(be, params, n_params, work, &norm);
    if (st) return st;
    if (norm_out) *norm_out = norm;
    if (!isfinite(norm))
        return lm_error(LM_ERR_NUMERIC, "gradient global norm is %g (non-finite gradients)", norm);
    if (max_norm > 0.0f && norm > (double)max_norm) {
        float s = (float)(max_norm / norm);
        for (int i = 0; i < n_params; i++)
            if ((st = be->ops->scale(be, params[i].grad, (size_t)lm_param_numel(&params[i]), s))) return st;
    }
    return LM_OK;
}
