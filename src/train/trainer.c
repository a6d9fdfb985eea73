/* The training loop (include/longmoe/train.h, docs/training.md). */
#define _POSIX_C_SOURCE 200809L
#include "longmoe/train.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check.h"
#include "checkpoint.h"
#include "files.h"
#include "json.h"
#include "longmoe/data.h"
#include "longmoe/eval.h"
#include "longmoe/optim.h"
#include "longmoe/optim_device.h"
#include "longmoe/safetensors.h"
#ifdef LONGMOE_HAVE_CUDA
#include "longmoe/cuda_context.h"
#endif

/* The most data-parallel ranks (small fixed tables of per-rank scalars). */
#define LM_DP_MAX_RANKS 4096

typedef struct {
    lm_config cfg;
    lm_train_options opt;
    lm_backend *be;     /* where the model runs: NULL on the CPU, else the CUDA backend (owned) or opt.backend */
    int be_given;       /* be is opt.backend, the caller's */
    lm_model *model;
    int B, T;
    lm_param *all, *muon_p, *adam_p;
    int n_all, n_muon, n_adam;
    lm_optimizer muon, adam;
    /* the optimizer on the device (--device cuda, unless opt.host_optimizer):
     * descriptors of the backend's parameters and gradients, the two
     * optimizers (their state lives on the device; muon_state/adam_state above
     * are its host copy for checkpoints) and the gradient norm's work area */
    int dev_opt;
    lm_param *ball, *bmuon, *badam;
    lm_device_optimizer *dmuon, *dadam;
    void *norm_work;
    float *muon_state, *adam_state, *scratch;
    size_t muon_state_n, adam_state_n, scratch_n;
    int32_t *seq, *inp, *tgt;
    uint8_t *answer;
    float *logp, *dlogp; /* train.answer_loss_weight != 1: a micro-batch's [B,T] on this rank */
    lm_balance_stats *stats;
    int n_moe;
    int64_t step, data_pos, skipped;
    double eval_seconds[LM_TIME_COUNT]; /* component time spent in evaluations */
    lm_stage stages[LM_MAX_STAGES];
    int n_stages, stage;                /* the stages, the current one */
    int64_t total_steps;
    lm_data_mix mix;                    /* the current stage's training data */
    lm_data_source *val;                /* its validation stream (lm_eval_open_validation of the first source) */
    FILE *metrics;
    /* the data the run reads, fingerprinted once at the start (trainer.json's "data") */
    int n_prints;
    char print_spec[LM_MAX_STAGES * LM_MAX_STAGE_DATA + 1][64];
    lm_data_file *print_files[LM_MAX_STAGES * LM_MAX_STAGE_DATA + 1];
    int print_n[LM_MAX_STAGES * LM_MAX_STAGE_DATA + 1];
    /* data parallelism (opt.comm): this rank of `ranks`; the model holds B / ranks
     * sequences of each micro-batch (t->B stays the whole batch). comm carries
     * host values (lm_comm_host of opt.comm); dcomm, with --comm nccl, sums
     * the gradients in the backend's memory (NULL: they are summed on the host);
     * with --device cuda --comm mpi (staged) dcomm is the staged engine over
     * comm, opened by open_device on the backend and owned here */
    lm_comm *comm, *dcomm;
    int staged;
    int rank, ranks;
    int dp_in_setup;     /* between the first agreement and the one before the loop */
    int failure_agreed, failed_rank; /* the last dp_agree that failed: every rank knows, the lowest failing */
    int64_t saved_step;  /* the step of the newest checkpoint this run wrote or resumed from (-1: none) */
    /* context parallelism (opt.context_parallel; docs/scaleout.md, "Context
     * parallelism in the trainer"): cp ranks a group (1: off), this rank's place
     * in its group and the group's place among the dp_groups = ranks / cp
     * data-parallel groups; cp_comm the group's handle (owned); the model holds
     * tokens [seg_t0, seg_t0 + seg_T) of each of its rows (0 and T without CP) */
    int cp, cp_rank, dp_rank, dp_groups;
    lm_comm *cp_comm;
    lm_comm *cp_dcomm; /* on the device path, the group's part of the device engine (the model's) */
    /* expert parallelism (opt.expert_parallel; docs/scaleout.md): ep ranks a
     * group (opt.ep_group, 0: every rank), the groups of ep consecutive ranks;
     * ep_pos this rank's place in its group (its experts' position); ep_comm
     * the group's handle (the MoE exchanges), er_comm the handle of the ranks
     * at ep_pos in every group (the replicas of its experts); both owned, NULL
     * when ep is every rank (t->comm serves); on the device path ep_dcomm the
     * group's part of the device engine (NULL: dcomm serves) and er_dcomm the
     * replicas' part (NULL when ep is every rank) */
    int ep, ep_pos;
    lm_comm *ep_comm, *er_comm, *ep_dcomm, *er_dcomm;
    int seg_t0, seg_T;
    float *dp_qk;        /* [2 qk heads] / [ranks x qk heads]: QK-Clip maxima gathered */
    double *dp_f64;      /* [2 n_moe] entropy sums and tokens of the MoE layers */
    /* ZeRO-1 (opt.zero; docs/scaleout.md, "ZeRO-1"): the tensors are cut into
     * Z = ranks consecutive ranges (Z = 1 without ZeRO: this rank holds every
     * tensor's state); range q's optimizer state lives on rank q alone.
     * muon_state / adam_state hold this rank's range, muon_state_n /
     * adam_state_n floats; the whole state (checkpoints) has muon_total_n /
     * adam_total_n floats. */
    int zero;
    int *zfirst;                 /* [Z+1] range q: tensors [zfirst[q], zfirst[q+1]) of `all` */
    int *zmuon_i, *zadam_i;      /* [Z+1] index in muon_p / adam_p of range q's first tensor of each */
    size_t *zparam;              /* [Z+1] range q's floats in the parameter block start here */
    size_t *zmuon, *zadam;       /* [Z+1] range q's state in the whole Muon / AdamW state starts here */
    size_t *ztab;                /* [3 ranks] counts and offsets of the collectives */
    size_t muon_total_n, adam_total_n;
    float *zloc;                 /* [the largest range's floats] this rank's summed gradients */
    float *zloc_dev;             /* the same in the backend's memory (ZeRO-1 on the device path) */
    double *znorm;               /* [n_all + 1] squared gradient norms per tensor, and a failure flag */
    uint64_t *zhash;             /* [n_all] hashes of each tensor's optimizer state */
    /* the state's hashes (state_hashes): phash[n_all] each tensor's weights';
     * ehash[n_ehash] the routed experts' tensors' an expert at a time (per tensor
     * n words of weights, then n a part of its state), so that they come from
     * slices of whole experts wherever those are */
    uint64_t *phash, *ehash;
    size_t n_ehash;
    /* checkpoints: rank 0's buffer of the pieces it receives from the other
     * ranks (one expert tensor, or a chunk of a ZeRO-1 range), allocated for
     * the write only; the most bytes it held (lm_train_result.ckpt_gathered_bytes) */
    float *ckbuf;
    size_t ckpt_gathered_bytes;
    /* the most bytes of parameter and gradient blocks one of this rank's
     * models held at once (lm_train_result.block_peak_bytes) */
    size_t block_peak_bytes;
    /* owner-only expert state (expert parallelism without ZeRO-1 in EP groups of
     * G = ep > 1 ranks; docs/scaleout.md, "Expert parallelism"): esplit[i]
     * marks the routed experts' tensors of `all`, each cut into G slices of
     * whole experts (position p's: elements [p numel/G, (p+1) numel/G), held
     * by the ranks at position p of every group); emuon / eadam are this rank's
     * optimizer descriptors (muon_p / adam_p with those tensors cut to its
     * slice); epiece[0] / [1] map its Muon / AdamW state onto the whole state */
    int epo;
    size_t eval_gathered_bytes; /* the most expert bytes an evaluation gathered at once (owner-only experts) */
    unsigned char *esplit;       /* [n_all] */
    int n_split;                 /* routed-expert tensors */
    lm_param *emuon, *eadam;     /* [n_all] */
    struct epo_piece {
        size_t loc, whole, len; /* local state [loc, loc+len) is whole [whole, whole+len) */
        int split;               /* a slice: rank q's lies at whole + (q - rank) len */
    } *epiece[2];
    int n_epiece[2];
    double *eparts;              /* [n_split blocks] the split tensors' block sums of squares */
    float *epack, *egath;        /* elements of the blocks that cross slices: this rank's, every rank's */
    size_t *etab;                /* [2 ranks] their counts and offsets */
    /* gradient buckets (train.grad_bucket_mb; docs/scaleout.md, "Gradient
     * buckets"): runs of consecutive whole tensors of about that size, cut from
     * the block's end (the backward's order), each summed over the ranks as soon
     * as the last micro-batch's backward has written its last element (the
     * model's grad-ready hook). bucketed: on for this run; bk_armed: the hook is
     * set for the backward running now; bk_summed: this step's sums are done or
     * enqueued. On a GPU the sums run on bk_stream, which waits for the
     * backend's stream at each bucket (bk_event); the backend's stream waits for
     * bk_stream before the clipping, the optimizer or the download. */
    int bucketed, bk_armed, bk_summed, n_bk;
    struct grad_bucket {
        size_t off, count, left; /* [off, off + count) of the block; elements not yet final */
    } *bk;
    void *bk_stream, *bk_event;
} trainer;

lm_train_options lm_train_options_default(const char *out_dir) {
    lm_train_options o;
    memset(&o, 0, sizeof o);
    o.out_dir = out_dir;
    o.val_batches = 4;
    o.progress = stdout;
    o.max_bad_steps = 10;
    o.inject_fault_step = -1;
    o.inject_nan_param_step = -1;
    o.inject_diverge_step = -1;
    o.stage_eval_batches = -1;
    o.inject_fault = LM_FAULT_LOSS;
    return o;
}

static void close_data(trainer *t);

static void trainer_free(trainer *t) {
    close_data(t);
#ifdef LONGMOE_HAVE_CUDA
    lm_cuda_stream_destroy(t->bk_stream); /* waits for its sums before the gradients are freed */
    lm_cuda_event_destroy(t->bk_event);
#endif
    free(t->bk);
    lm_device_optimizer_free(t->dmuon);
    lm_device_optimizer_free(t->dadam);
    if (t->norm_work) t->be->release(t->be, t->norm_work);
    if (t->zloc_dev) t->be->release(t->be, t->zloc_dev);
    free(t->ball);
    free(t->bmuon);
    free(t->badam);
    lm_model_free(t->model);
    lm_comm_close(t->cp_dcomm); /* after the model, which uses it */
    lm_comm_close(t->cp_comm);
    lm_comm_close(t->ep_dcomm);
    lm_comm_close(t->er_dcomm);
    lm_comm_close(t->ep_comm);
    lm_comm_close(t->er_comm);
    /* the NCCL handle outlives the trainer: it must not keep the backend's stream */
    if (t->dcomm && t->be) {
        t->be->sync(t->be);
        lm_comm_set_stream(t->dcomm, NULL);
    }
    if (t->staged) lm_comm_close(t->dcomm); /* its scratch is the backend's */
    if (!t->be_given) lm_backend_free(t->be); /* after the model, which lives on it */
    free(t->all);
    free(t->muon_p);
    free(t->adam_p);
    free(t->muon_state);
    free(t->adam_state);
    free(t->scratch);
    free(t->seq);
    free(t->inp);
    free(t->tgt);
    free(t->answer);
    free(t->logp);
    free(t->dlogp);
    free(t->stats);
    free(t->dp_qk);
    free(t->dp_f64);
    free(t->zfirst);
    free(t->zmuon_i);
    free(t->zadam_i);
    free(t->zparam);
    free(t->zmuon);
    free(t->zadam);
    free(t->ztab);
    free(t->zloc);
    free(t->znorm);
    free(t->zhash);
    free(t->phash);
    free(t->ehash);
    free(t->ckbuf);
    free(t->esplit);
    free(t->emuon);
    free(t->eadam);
    free(t->epiece[0]);
    free(t->epiece[1]);
    free(t->eparts);
    free(t->epack);
    free(t->egath);
    free(t->etab);
    for (int i = 0; i < t->n_prints; i++) free(t->print_files[i]);
    if (t->metrics) fclose(t->metrics);
}

/* Micro-batch shape of stage i. */
static void stage_shape(const trainer *t, int i, int *B, int *T) {
    *T = t->stages[i].seq_len;
    *B = (int)(t->stages[i].batch_tokens / t->stages[i].seq_len);
}

/* Point the optimizers' parameter descriptors at the current model's blocks. */
static void bind_params(trainer *t) {
    lm_model_optimizer_params(t->model, t->all, t->cfg.optimizer);
    t->n_muon = t->n_adam = 0;
    for (int i = 0; i < t->n_all; i++) {
        if (lm_param_optimizer(&t->all[i]) == LM_OPT_MUON) t->muon_p[t->n_muon++] = t->all[i];
        else t->adam_p[t->n_adam++] = t->all[i];
    }
}

static int zero_range(const trainer *t);
static lm_status epo_slice(const trainer *t, int i, float *w, float *g, size_t first, size_t count, size_t wfirst,
                           size_t wcount, lm_param *out);

/* The same split for the device optimizer: descriptors of the backend's memory. */
static lm_status bind_backend_params(trainer *t) {
    if (!t->dev_opt) return LM_OK;
    lm_model_backend_params(t->model, t->ball, t->cfg.optimizer);
    /* owner-only experts: this rank's slices in the backend's blocks (epo_slice) */
    for (int i = 0; t->epo && i < t->n_all; i++) {
        if (!t->esplit[i]) continue;
        size_t first, count, wfirst, wcount;
        float *g = lm_model_backend_grad_part(t->model, i, &first, &count);
        float *w = lm_model_backend_param_part(t->model, i, &wfirst, &wcount);
        TRY(epo_slice(t, i, w, g, first, count, wfirst, wcount, &t->ball[i]));
    }
    int nm = 0, na = 0;
    for (int i = 0; i < t->n_all; i++) {
        if (lm_param_optimizer(&t->ball[i]) == LM_OPT_MUON) t->bmuon[nm++] = t->ball[i];
        else t->badam[na++] = t->ball[i];
    }
    if (nm != t->n_muon || na != t->n_adam)
        return lm_error(LM_ERR_ARG, "the backend's parameters split %d/%d between Muon and AdamW, the host's %d/%d",
                        nm, na, t->n_muon, t->n_adam);
    if (t->dmuon) {
        /* this rank's range (all of them without ZeRO-1) */
        const int zr = zero_range(t);
        TRY(lm_device_optimizer_rebind(t->dmuon, t->bmuon + t->zmuon_i[zr], t->zmuon_i[zr + 1] - t->zmuon_i[zr]));
        TRY(lm_device_optimizer_rebind(t->dadam, t->badam + t->zadam_i[zr], t->zadam_i[zr + 1] - t->zadam_i[zr]));
    }
    return LM_OK;
}

/* The device optimizer's state to the host copy (checkpoints), or back. */
static lm_status download_optimizer_state(trainer *t) {
    if (!t->dev_opt) return LM_OK;
    TRY(lm_device_optimizer_download_state(t->dmuon, t->muon_state, t->muon_state_n, &t->muon.step));
    return lm_device_optimizer_download_state(t->dadam, t->adam_state, t->adam_state_n, &t->adam.step);
}

static lm_status upload_optimizer_state(trainer *t) {
    if (!t->dev_opt) return LM_OK;
    TRY(lm_device_optimizer_upload_state(t->dmuon, t->muon_state, t->muon_state_n, t->muon.step));
    return lm_device_optimizer_upload_state(t->dadam, t->adam_state, t->adam_state_n, t->adam.step);
}

/* The host parameters as new as the device's (before the host reads them). */
static lm_status host_params_current(trainer *t) {
    return lm_model_host_params_stale(t->model) ? lm_model_download_params(t->model) : LM_OK;
}

/* ---- data parallelism (docs/scaleout.md) ----
 * Every rank runs the same loop on its share of each micro-batch; the
 * collectives below are called by all ranks in the same order. Sums are the
 * comm layer's rank-order sums, so every rank holds the same bits. */

/* Rows of each micro-batch this rank computes (its data-parallel group's). */
static int share_B(const trainer *t) { return t->B / t->dp_groups; }

/* CP rank c's segment [*t0, *t0 + *len) of T tokens over n ranks (opt.cp_split; T >= n checked before). */
static lm_status segment_of(const trainer *t, int T, int n, int c, int *t0, int *len) {
    int64_t start[LM_DP_MAX_RANKS + 1];
    TRY(lm_config_cp_split(&t->cfg, T, n, t->opt.cp_split, start));
    *t0 = (int)start[c];
    *len = (int)(start[c + 1] - start[c]);
    return LM_OK;
}

/* Agree on a status: every rank learns whether any failed. A rank that failed
 * keeps its own message; the others report the first failing rank. */
static lm_status dp_agree(trainer *t, lm_status s) {
    if (t->ranks <= 1) return s;
    int32_t mine = s ? (int32_t)s : 0, all[LM_DP_MAX_RANKS];
    lm_status cs = lm_comm_all_gather(t->comm, &mine, all, sizeof mine);
    if (cs) return cs;
    for (int r = 0; r < t->ranks; r++)
        if (all[r]) {
            t->failure_agreed = 1;
            t->failed_rank = r;
            if (s) return s;
            return lm_error((lm_status)all[r], "data parallel: rank %d of %d failed (that rank returned the "
                            "cause)", r, t->ranks);
        }
    return LM_OK;
}

/* A stop requested on any rank stops every rank at the same step boundary. */
static int stop_requested(trainer *t) {
    int32_t mine = t->opt.stop_requested && *t->opt.stop_requested, any = mine;
    if (t->ranks > 1 && lm_comm_all_reduce_sum(t->comm, &mine, &any, 1, LM_DTYPE_I32)) any = 1;
    return any != 0;
}

/* The run takes the device path: a GPU, or a backend the caller gave. */
static int device_path(const trainer *t) { return t->opt.device != LM_DEVICE_CPU || t->opt.backend; }

/* A CUDA backend's stream (NULL for any other backend or none). */
static void *cuda_stream_of(const trainer *t) {
#ifdef LONGMOE_HAVE_CUDA
    if (t->be && t->be->device == LM_DEVICE_CUDA) return ((const lm_cuda_context *)t->be->ctx)->stream;
#endif
    (void)t;
    return NULL;
}

/* The refusals of a data-parallel run, before anything is written. */
static lm_status dp_check(const trainer *t) {
    if (t->opt.zero) {
        if (t->opt.zero != 1)
            return lm_error(LM_ERR_ARG, "ZeRO stage %d: stage 1 (the optimizer state sharded over the ranks) is the "
                            "one there is", t->opt.zero);
        if (!t->comm)
            return lm_error(LM_ERR_ARG, "ZeRO-1 (--zero 1) shards the optimizer state over the ranks of --comm mpi");
        if (device_path(t) && t->opt.host_optimizer)
            return lm_error(LM_ERR_ARG, "ZeRO-1 on a device shards the device optimizer's state: it does not run with "
                            "--host-optimizer");
    }
    if (t->opt.expert_parallel) {
        if (!t->comm)
            return lm_error(LM_ERR_ARG, "expert parallelism (--ep) runs over the ranks of --comm mpi");
        if (t->cfg.answer_loss_weight != 1.0f)
            return lm_error(LM_ERR_ARG, "expert parallelism (--ep) does not run with train.answer_loss_weight (%g); "
                            "use 1", (double)t->cfg.answer_loss_weight);
        const int G = t->opt.ep_group;

        if (G < 0)
            return lm_error(LM_ERR_ARG, "expert parallelism in groups of %d ranks: give a group size of at least 1 "
                            "(0: all %d ranks)", G, t->ranks);
        if (G > 0 && t->ranks % G)
            return lm_error(LM_ERR_ARG, "expert parallelism in groups of %d ranks: the %d ranks are not a multiple "
                            "of %d (--ep G needs G to divide the number of ranks)", G, t->ranks, G);
        const int E = G > 0 ? G : t->ranks;
        if (t->cfg.n_routed_experts > 0 && t->cfg.n_routed_experts % E)
            return lm_error(LM_ERR_ARG, "expert parallelism over %d ranks: model.n_routed_experts = %d is not "
                            "divisible by %d (each rank owns an equal share of the experts)", E,
                            t->cfg.n_routed_experts, E);
    } else if (t->opt.ep_group) {
        return lm_error(LM_ERR_ARG, "an expert-parallel group size (%d) without expert parallelism (--ep)",
                        t->opt.ep_group);
    }
    if (t->dcomm && t->opt.device != LM_DEVICE_CUDA)
        return lm_error(LM_ERR_ARG, "--comm nccl sums gradients on GPUs: it needs --device cuda (data parallelism "
                        "on CPU ranks is --comm mpi)");
    const int N = t->opt.context_parallel;
    if (N < 0)
        return lm_error(LM_ERR_ARG, "context parallelism over %d ranks: give a positive group size (1: off)", N);
    if (t->opt.cp_split != LM_CP_SPLIT_EVEN && t->opt.cp_split != LM_CP_SPLIT_BALANCED)
        return lm_error(LM_ERR_ARG, "context-parallel split %d: use LM_CP_SPLIT_EVEN or LM_CP_SPLIT_BALANCED",
                        (int)t->opt.cp_split);
    if (N > 1) {
        if (!t->comm)
            return lm_error(LM_ERR_ARG, "context parallelism (--cp %d) runs over the ranks of --comm mpi", N);
        if (t->cfg.answer_loss_weight != 1.0f)
            return lm_error(LM_ERR_ARG, "context parallelism (--cp %d) does not run with train.answer_loss_weight "
                            "(%g); use 1", N, (double)t->cfg.answer_loss_weight);
        if (device_path(t) && !t->dcomm && !t->staged)
            return lm_error(LM_ERR_ARG, "context parallelism on GPUs runs over --comm nccl (or --comm mpi, staged "
                            "through the host)");
        if (t->ranks % N)
            return lm_error(LM_ERR_ARG, "context parallelism in groups of %d ranks: the %d ranks are not a multiple "
                            "of %d (mpirun -np must be a multiple of --cp)", N, t->ranks, N);
        for (int i = 0; i < t->n_stages; i++)
            if (t->stages[i].seq_len < N)
                return lm_error(LM_ERR_ARG, "context parallelism over %d ranks: %s%s%s has sequences of %d tokens, "
                                "fewer than %d (each rank of a group holds a segment of at least one token)", N,
                                t->n_stages > 1 ? "stage '" : "the run", t->n_stages > 1 ? t->stages[i].name : "",
                                t->n_stages > 1 ? "'" : "", t->stages[i].seq_len, N);
    }
    if (t->ranks <= 1) return LM_OK;
    if (device_path(t) && !t->dcomm && !t->staged)
        return lm_error(LM_ERR_ARG, "data parallel training on GPUs runs over --comm nccl (or --comm mpi, staged "
                        "through the host); %d ranks were given with --device %s and neither", t->ranks,
                        lm_device_name(t->opt.device));
    if (t->cfg.balance == LM_BALANCE_QUANTILE && t->cfg.balance_estimator == LM_QB_EXACT)
        return lm_error(LM_ERR_ARG, "data parallel: moe.balance_estimator 'exact' sorts one process's residuals "
                        "and cannot be summed over ranks; use 'histogram' or 'zoom'");
    const int D = N > 1 ? t->ranks / N : t->ranks;
    for (int i = 0; i < t->n_stages; i++) {
        int B = (int)(t->stages[i].batch_tokens / t->stages[i].seq_len);
        if (N > 1 && B % D)
            return lm_error(LM_ERR_ARG, "data parallel over %d groups of %d context-parallel ranks: %s%s%s has %d "
                            "sequences a micro-batch, not divisible by %d (each group takes an equal share: set "
                            "train.batch_size to a multiple of %d)", D, N, t->n_stages > 1 ? "stage '" : "the batch",
                            t->n_stages > 1 ? t->stages[i].name : "", t->n_stages > 1 ? "'" : "", B, D, D);
        if (N <= 1 && B % t->ranks)
            return lm_error(LM_ERR_ARG, "data parallel over %d ranks: %s%s%s has %d sequences a micro-batch, not "
                            "divisible by %d (each rank takes an equal share: set train.batch_size to a multiple "
                            "of %d)", t->ranks, t->n_stages > 1 ? "stage '" : "the batch", t->n_stages > 1 ?
                            t->stages[i].name : "", t->n_stages > 1 ? "'" : "", B, t->ranks, t->ranks);
    }
    return LM_OK;
}

/* ---- ZeRO-1 (docs/scaleout.md, "ZeRO-1") ----
 * Rank q owns a range of consecutive tensors, cut so that the ranges' optimizer
 * states are as equal as whole tensors allow. It alone keeps their state, receives
 * their summed gradients (a reduce-scatter of the gradient block), measures their
 * part of the global norm, clips and updates them with the replicated optimizer's
 * arithmetic, and gives the new values to every rank (an all-gather). So every
 * rank holds the parameters of replicated data parallelism, bit for bit. */

/* This rank's range (0 without ZeRO: the one range of everything). */
static int zero_range(const trainer *t) { return t->zero ? t->rank : 0; }

/* A routed experts' tensor (layers.L.moe.gate, .up, .down: [n, ., .], one
 * Muon block an expert), in every layout: what expert parallelism cuts, and
 * what the state's hash takes an expert at a time. */
static int routed_experts_tensor(const trainer *t, int i) {
    const lm_model_tensor *mt = lm_model_tensor_at(t->model, i);
    const char *d = strstr(mt->name, ".moe.");
    const int n = t->cfg.n_routed_experts;
    return n > 0 && d && (!strcmp(d, ".moe.gate") || !strcmp(d, ".moe.up") || !strcmp(d, ".moe.down")) &&
           mt->ndim == 3 && mt->shape[0] == n && mt->n_blocks == n;
}

/* The ranges and their offsets, from the bound parameters (after bind_params). */
static lm_status zero_setup(trainer *t) {
    const int Z = t->zero ? t->ranks : 1, n = t->n_all;
    t->zfirst = calloc((size_t)Z + 1, sizeof *t->zfirst);
    t->zmuon_i = calloc((size_t)Z + 1, sizeof *t->zmuon_i);
    t->zadam_i = calloc((size_t)Z + 1, sizeof *t->zadam_i);
    t->zparam = calloc((size_t)Z + 1, sizeof *t->zparam);
    t->zmuon = calloc((size_t)Z + 1, sizeof *t->zmuon);
    t->zadam = calloc((size_t)Z + 1, sizeof *t->zadam);
    t->ztab = calloc(3 * (size_t)t->ranks, sizeof *t->ztab);
    t->znorm = calloc((size_t)n + 1, sizeof *t->znorm);
    t->zhash = calloc((size_t)n + 1, sizeof *t->zhash);
    t->phash = calloc((size_t)n + 1, sizeof *t->phash);
    t->n_ehash = 0;
    for (int i = 0; i < n; i++)
        if (routed_experts_tensor(t, i))
            t->n_ehash += (size_t)t->cfg.n_routed_experts *
                          (1 + lm_param_state_floats(&t->all[i]) / (size_t)lm_param_numel(&t->all[i]));
    t->ehash = calloc(t->n_ehash + 1, sizeof *t->ehash);
    size_t *pre = calloc((size_t)n + 1, sizeof *pre);
    if (!t->zfirst || !t->zmuon_i || !t->zadam_i || !t->zparam || !t->zmuon || !t->zadam || !t->ztab || !t->znorm ||
        !t->zhash || !t->phash || !t->ehash || !pre) {
        free(pre);
        return lm_error(LM_ERR_MEMORY, "out of memory (optimizer ranges)");
    }
    /* the gradient and parameter blocks hold the tensors one after the other: a range is one piece of each */
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        const lm_model_tensor *mt = lm_model_tensor_at(t->model, i);
        if (mt->offset != at) {
            free(pre);
            return lm_error(LM_ERR_ARG, "ZeRO-1: tensor '%s' starts at %zu of the parameter block, not at %zu "
                            "(the tensors must lie one after the other)", mt->name, mt->offset, at);
        }
        at += mt->numel;
        pre[i + 1] = pre[i] + lm_param_state_floats(&t->all[i]);
    }
    /* cut q lies where the state before it is nearest to q/Z of the whole (the earlier tensor on a tie) */
    t->zfirst[Z] = n;
    for (int q = 1; q < Z; q++) {
        const uint64_t target = (uint64_t)pre[n] * (uint64_t)q / (uint64_t)Z;
        int i = t->zfirst[q - 1];
        while (i < n && pre[i] < target) i++;
        if (i > t->zfirst[q - 1] && target - pre[i - 1] <= pre[i] - target) i--;
        t->zfirst[q] = i;
    }
    int q = 0, nm = 0, na = 0;
    size_t sm = 0, sa = 0;
    for (int i = 0; i <= n; i++) {
        for (; q <= Z && t->zfirst[q] == i; q++) {
            t->zparam[q] = i < n ? lm_model_tensor_at(t->model, i)->offset : lm_model_num_params(t->model);
            t->zmuon_i[q] = nm;
            t->zadam_i[q] = na;
            t->zmuon[q] = sm;
            t->zadam[q] = sa;
        }
        if (i == n) break;
        if (lm_param_optimizer(&t->all[i]) == LM_OPT_MUON) {
            nm++;
            sm += lm_param_state_floats(&t->all[i]);
        } else {
            na++;
            sa += lm_param_state_floats(&t->all[i]);
        }
    }
    free(pre);
    if (t->zero && t->ranks > 1) {
        size_t most = 0;
        for (int r = 0; r < Z; r++)
            most = t->zparam[r + 1] - t->zparam[r] > most ? t->zparam[r + 1] - t->zparam[r] : most;
        if (t->dcomm) {
            /* on the device path: the buffer and the engine's scratch in the backend's memory, made once */
            TRY(t->be->alloc(t->be, (most + 1) * sizeof(float), (void **)&t->zloc_dev));
            TRY(lm_comm_reserve(t->dcomm, most + 1, LM_DTYPE_F32));
        } else {
            t->zloc = calloc(most + 1, sizeof *t->zloc);
            if (!t->zloc) return lm_error(LM_ERR_MEMORY, "out of memory (ZeRO-1 gradient buffer)");
        }
    }
    return LM_OK;
}

/* Bytes of optimizer state of range q. */
static size_t zero_state_bytes(const trainer *t, int q) {
    return (t->zmuon[q + 1] - t->zmuon[q] + t->zadam[q + 1] - t->zadam[q]) * sizeof(float);
}

/* The summed gradients of this rank's range within elements [lo, hi) of the
 * gradient block (a reduce-scatter: each element is the rank-order sum the
 * all-reduce would give, whatever [lo, hi) is), into the gradient block. The
 * ranks' ranges cut [lo, hi) into consecutive pieces in rank order, the
 * layout reduce_scatterv wants. On the device path through the device engine,
 * on the stream it was given, the copy on that stream too. */
static lm_status zero_reduce_range(trainer *t, size_t lo, size_t hi) {
    const int R = t->ranks, me = t->rank;
    if (R <= 1) return LM_OK; /* one rank's sum is its own gradient */
    size_t *count = t->ztab;
    for (int q = 0; q < R; q++) {
        const size_t a = t->zparam[q] > lo ? t->zparam[q] : lo, b = t->zparam[q + 1] < hi ? t->zparam[q + 1] : hi;
        count[q] = b > a ? b - a : 0;
    }
    const size_t mine = t->zparam[me] > lo ? t->zparam[me] : lo; /* where this rank's piece starts */
    if (t->dcomm) {
        float *gd = lm_model_backend_grads(t->model);
        TRY(lm_comm_reduce_scatterv_sum(t->dcomm, gd + lo, t->zloc_dev, count, LM_DTYPE_F32));
        return count[me] ? lm_comm_copy(t->dcomm, gd + mine, t->zloc_dev, count[me] * sizeof(float)) : LM_OK;
    }
    float *g = lm_model_grads(t->model);
    TRY(lm_comm_reduce_scatterv_sum(t->comm, g + lo, t->zloc, count, LM_DTYPE_F32));
    if (count[me]) memcpy(g + mine, t->zloc, count[me] * sizeof(float));
    return LM_OK;
}

/* The whole block's reduce-scatter after the backward (no buckets); on the
 * device path on the backend's stream. */
static lm_status zero_reduce_grads(trainer *t) {
    if (t->dcomm) lm_comm_set_stream(t->dcomm, cuda_stream_of(t));
    return zero_reduce_range(t, 0, lm_model_num_params(t->model));
}

/* The global gradient norm from the owners' per-tensor sums of squares, added in
 * tensor order on every rank (the replicated lm_grad_global_norm's order, so the
 * same bits), then this rank's range clipped. A non-finite norm, or a non-finite
 * loss on any rank, sets *bad on every rank. */
static lm_status zero_grad_clip(trainer *t, float max_norm, int loss_ok, double *norm_out, int *bad) {
    const int n = t->n_all, zr = zero_range(t), i0 = t->zfirst[zr], i1 = t->zfirst[zr + 1];
    if (t->dev_opt) {
        /* the device optimizer's sums (lm_grad_global_norm_on's op, so the replicated device run's bits) */
        double *sums = t->norm_work;
        for (int i = i0; i < i1; i++)
            TRY(t->be->ops->sum_squares(t->be, t->ball[i].grad, (size_t)lm_param_numel(&t->ball[i]), sums + i));
        for (int i = 0; i < n; i++) t->znorm[i] = 0.0;
        if (i1 > i0) TRY(t->be->download(t->be, t->znorm + i0, sums + i0, (size_t)(i1 - i0) * sizeof(double)));
    } else {
        for (int i = 0; i < n; i++)
            t->znorm[i] = i >= i0 && i < i1 ? lm_sum_squares(t->all[i].grad, lm_param_numel(&t->all[i])) : 0.0;
    }
    t->znorm[n] = loss_ok ? 0.0 : 1.0;
    /* each entry is one rank's value plus zeros: exact */
    if (t->ranks > 1) TRY(lm_comm_all_reduce_sum(t->comm, t->znorm, t->znorm, (size_t)n + 1, LM_DTYPE_F64));
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += t->znorm[i];
    const double norm = sqrt(sum);
    *norm_out = norm;
    *bad = t->znorm[n] != 0.0 || !isfinite(norm);
    if (!*bad && max_norm > 0.0f && norm > (double)max_norm) {
        const float scale = (float)(max_norm / norm);
        if (t->dev_opt) {
            for (int i = i0; i < i1; i++)
                TRY(t->be->ops->scale(t->be, t->ball[i].grad, (size_t)lm_param_numel(&t->ball[i]), scale));
        } else {
            lm_grads_scale(t->all + i0, i1 - i0, scale);
        }
    }
    return LM_OK;
}

/* Every rank's updated range to every rank, in place in the parameter block
 * (the backend's, through the device engine, on the device path). */
static lm_status zero_gather_params(trainer *t) {
    const int R = t->ranks;
    size_t *bytes = t->ztab, *offs = bytes + R;
    for (int q = 0; q < R; q++) {
        bytes[q] = (t->zparam[q + 1] - t->zparam[q]) * sizeof(float);
        offs[q] = t->zparam[q] * sizeof(float);
    }
    if (t->dcomm) {
        lm_comm_set_stream(t->dcomm, cuda_stream_of(t));
        float *pd = lm_model_backend_param_block(t->model);
        return lm_comm_all_gatherv(t->dcomm, pd + t->zparam[t->rank], bytes[t->rank], pd, bytes, offs);
    }
    float *p = lm_model_params(t->model);
    return lm_comm_all_gatherv(t->comm, p + t->zparam[t->rank], bytes[t->rank], p, bytes, offs);
}

/* ---- owner-only expert state under expert parallelism (docs/scaleout.md,
 * "Expert parallelism (CPU ranks)") ----
 * The routed experts' tensors (layers.L.moe.gate, .up, .down: [n, ., .] with n
 * Muon blocks, one an expert) are cut into G slices of n/G whole experts (G:
 * the EP group's size); the rank at position p of its group owns slice p, the
 * experts it runs. Their gradients are complete on the owner for its group's
 * tokens (the layer's backward), and the model keeps only that slice of them
 * (lm_model_create_expert_owned: the gradient block holds the replicated
 * tensors and this rank's slices), so they stay out of the world all-reduce
 * and are summed over the ranks at the same position of every group (the
 * replicas; nothing when the group is the world); the owners alone keep their
 * optimizer state and take their step (the same per-block arithmetic as the
 * replicated optimizer; the replicas identically). The weights are owner-only
 * too (the parameter block in the same layout), so the updated slices stay on
 * their owners. Both blocks are allocated in that layout when the model is
 * created (lm_model_create_expert_owned, create_model): no rank ever holds
 * the whole model's blocks. An evaluation forward
 * gathers one MoE layer's experts at a time over the group
 * (lm_model_gather_experts_by_layer); a checkpoint sends them to rank 0 one
 * tensor at a time as it writes (ckpt_model_data), and the state's hash is
 * taken an expert at a time from the slices (state_hashes).
 * Everything else is replicated. */

/* The handle of this rank's EP group (the whole world when the group is). */
static lm_comm *ep_group_comm(const trainer *t) { return t->ep_comm ? t->ep_comm : t->comm; }

/* The tensors that are cut: routed experts, one Muon block an expert. */
static int epo_is_expert(const trainer *t, int i) {
    return routed_experts_tensor(t, i) && t->cfg.n_routed_experts % t->ep == 0;
}

/* Tensor i's descriptor for this rank (t->all[i]'s; a cut tensor's slice with
 * data w and gradient g, which the model keeps at [wfirst, +wcount) and
 * [first, +count) of the tensor: checked against the optimizer's slice). */
static lm_status epo_slice(const trainer *t, int i, float *w, float *g, size_t first, size_t count, size_t wfirst,
                           size_t wcount, lm_param *out) {
    const int R = t->ep, me = t->ep_pos;
    lm_param p = t->all[i];
    const size_t numel = (size_t)lm_param_numel(&p), per = t->esplit[i] ? numel / (size_t)R : numel,
                 at = t->esplit[i] ? (size_t)me * per : 0;
    if (first != at || count != per || wfirst != at || wcount != per)
        return lm_error(LM_ERR_ARG, "expert parallelism: the model keeps the gradient of elements [%zu, %zu) of "
                        "%s and its weights [%zu, %zu), the optimizer of rank %d updates [%zu, %zu)", first,
                        first + count, p.name, wfirst, wfirst + wcount, t->rank, at, at + per);
    if (t->esplit[i]) {
        p.optimizer = lm_param_optimizer(&t->all[i]); /* the whole tensor's, whatever the slice's shape */
        p.data = w;
        p.grad = g;
        p.rows /= R;
        p.n_blocks = p.n_blocks > 1 ? p.n_blocks / R : 1;
    }
    *out = p;
    return LM_OK;
}

/* This rank's host descriptors: the whole replicated tensors, its slice of each
 * expert tensor, whose gradient is all the model keeps of that tensor
 * (lm_model_create_expert_owned; after bind_params; the same arrays every time;
 * the device optimizer's: bind_backend_params). */
static lm_status epo_bind(trainer *t) {
    if (!t->epo) return LM_OK;
    int jm = 0, ja = 0;
    for (int i = 0; i < t->n_all; i++) {
        size_t first, count, wfirst, wcount;
        float *g = lm_model_grad_part(t->model, i, &first, &count);
        float *w = lm_model_param_part(t->model, i, &wfirst, &wcount);
        lm_param p;
        TRY(epo_slice(t, i, w, g, first, count, wfirst, wcount, &p));
        if (lm_param_optimizer(&p) == LM_OPT_MUON) t->emuon[jm++] = p;
        else t->eadam[ja++] = p;
    }
    return LM_OK;
}

/* Block b of lm_sum_squares over n elements: [*lo, *hi). */
static void ss_block(int64_t n, int b, int64_t *lo, int64_t *hi) {
    const int64_t bs = (n + LM_SUM_SQUARES_BLOCKS - 1) / LM_SUM_SQUARES_BLOCKS;
    *lo = (int64_t)b * bs < n ? (int64_t)b * bs : n;
    *hi = *lo + bs < n ? *lo + bs : n;
}

/* Elements rank q holds of the blocks that cross slices, over every expert tensor. */
static size_t epo_cross_count(const trainer *t, int q) {
    const int R = t->ep;
    size_t c = 0;
    for (int i = 0; i < t->n_all; i++) {
        if (!t->esplit[i]) continue;
        const int64_t n = lm_param_numel(&t->all[i]), sl = n / R, a = (int64_t)q * sl, z = a + sl;
        for (int b = 0; b < LM_SUM_SQUARES_BLOCKS; b++) {
            int64_t lo, hi;
            ss_block(n, b, &lo, &hi);
            if (lo >= hi || lo / sl == (hi - 1) / sl) continue;
            const int64_t x = lo > a ? lo : a, y = hi < z ? hi : z;
            if (x < y) c += (size_t)(y - x);
        }
    }
    return c;
}

/* The tables: which tensors are cut, this rank's descriptors, the pieces of
 * its state in the whole state, the norm's buffers. After bind_params. */
static lm_status epo_setup(trainer *t) {
    if (!t->epo) return LM_OK;
    const int R = t->ep, n = t->n_all;
    t->esplit = calloc((size_t)n, 1);
    t->emuon = calloc((size_t)n, sizeof *t->emuon);
    t->eadam = calloc((size_t)n, sizeof *t->eadam);
    t->epiece[0] = calloc(2 * (size_t)n, sizeof *t->epiece[0]);
    t->epiece[1] = calloc(2 * (size_t)n, sizeof *t->epiece[1]);
    t->etab = calloc(2 * (size_t)R, sizeof *t->etab);
    if (!t->esplit || !t->emuon || !t->eadam || !t->epiece[0] || !t->epiece[1] || !t->etab)
        return lm_error(LM_ERR_MEMORY, "out of memory (expert-parallel optimizer tables)");
    for (int i = 0; i < n; i++) t->n_split += t->esplit[i] = (unsigned char)epo_is_expert(t, i);
    TRY(epo_bind(t));
    /* the pieces, in the order of muon_p / adam_p (the whole state's order) */
    for (int part = 0; part < 2; part++) {
        const lm_param *whole = part ? t->adam_p : t->muon_p, *mine = part ? t->eadam : t->emuon;
        const int count = part ? t->n_adam : t->n_muon;
        size_t W = 0, L = 0;
        int k = 0;
        for (int j = 0; j < count; j++) {
            const size_t N = (size_t)lm_param_numel(&whole[j]), Nl = (size_t)lm_param_numel(&mine[j]);
            const size_t S = lm_param_state_floats(&whole[j]), parts = S / N;
            if (Nl == N) {
                t->epiece[part][k++] = (struct epo_piece){L, W, S, 0};
            } else {
                for (size_t c = 0; c < parts; c++)
                    t->epiece[part][k++] = (struct epo_piece){L + c * Nl, W + c * N + (size_t)t->ep_pos * Nl, Nl, 1};
            }
            W += S;
            L += lm_param_state_floats(&mine[j]);
        }
        t->n_epiece[part] = k;
    }
    size_t all = 0;
    for (int q = 0; q < R; q++) {
        t->etab[q] = epo_cross_count(t, q);
        t->etab[R + q] = all;
        all += t->etab[q];
    }
    t->eparts = calloc((size_t)t->n_split * LM_SUM_SQUARES_BLOCKS + 1, sizeof *t->eparts);
    t->epack = calloc(t->etab[t->ep_pos] + 1, sizeof *t->epack);
    t->egath = calloc(all + 1, sizeof *t->egath);
    if (!t->eparts || !t->epack || !t->egath)
        return lm_error(LM_ERR_MEMORY, "out of memory (expert-parallel gradient norm)");
    return LM_OK;
}

/* The gradients of the tensors whose table ranges lie in [lo, hi) summed over
 * the ranks, except the experts' tensors (their owner's gradient is already
 * complete; the block holds this rank's slice of each): one all-reduce a run
 * of replicated tensors (consecutive in the block too), each element the
 * rank-order sum of the whole block's all-reduce; the slices of this rank's
 * experts summed over their replicas (its position in every EP group). The
 * whole table after the backward, or a gradient bucket's tensors during it. */
static lm_status epo_reduce_range(trainer *t, size_t lo, size_t hi) {
    /* the device path: the backend's gradient block over the device engine and its replicas' part */
    const int dev = t->dcomm != NULL;
    float *g = dev ? lm_model_backend_grads(t->model) : lm_model_grads(t->model);
    lm_comm *world = dev ? t->dcomm : t->comm, *rep = dev ? t->er_dcomm : t->er_comm;
    size_t run = 0, run_n = 0; /* the pending run of replicated gradients: g[run, run + run_n) */
    for (int i = 0; i <= t->n_all; i++) {
        const lm_model_tensor *mt = i < t->n_all ? lm_model_tensor_at(t->model, i) : NULL;
        if (mt && (mt->offset < lo || mt->offset >= hi)) continue;
        size_t first = 0, count = 0;
        float *mine = !mt ? NULL
                    : dev ? lm_model_backend_grad_part(t->model, i, &first, &count)
                          : lm_model_grad_part(t->model, i, &first, &count);
        if (mt && !t->esplit[i] && run_n && g + run + run_n == mine) {
            run_n += count;
            continue;
        }
        if (run_n) TRY(lm_comm_all_reduce_sum(world, g + run, g + run, run_n, LM_DTYPE_F32));
        run_n = 0;
        if (!mt) break;
        if (!t->esplit[i]) {
            run = (size_t)(mine - g);
            run_n = count;
        } else if (rep && lm_comm_size(rep) > 1) {
            TRY(lm_comm_all_reduce_sum(rep, mine, mine, count, LM_DTYPE_F32));
        }
    }
    return LM_OK;
}

/* The device engines' stream for the gradient sums (the world's and the replicas'). */
static void epo_set_stream(trainer *t, void *stream) {
    if (t->dcomm) lm_comm_set_stream(t->dcomm, stream);
    if (t->er_dcomm) lm_comm_set_stream(t->er_dcomm, stream);
}

static lm_status epo_reduce_grads(trainer *t) {
    epo_set_stream(t, cuda_stream_of(t));
    return epo_reduce_range(t, 0, lm_model_num_params(t->model));
}

/* The global gradient norm, bit for bit the replicated lm_grad_global_norm:
 * the replicated tensors' sums of squares on every rank; each expert tensor's
 * lm_sum_squares rebuilt from its fixed blocks: a block inside one slice summed
 * by that slice's owner, a block that crosses slices summed in element order
 * by the owner of its first element from every holder's part (all-gathered),
 * the block sums summed over the ranks (one value plus zeros: exact) and added
 * in block order; the tensors added in tensor order. Then clipping. A
 * non-finite norm sets *bad on every rank. */
static lm_status epo_grad_clip_device(trainer *t, float max_norm, double *norm_out, int *bad);

static lm_status epo_grad_clip(trainer *t, float max_norm, double *norm_out, int *bad) {
    if (t->dev_opt) return epo_grad_clip_device(t, max_norm, norm_out, bad);
    const int R = t->ep, me = t->ep_pos, NB = LM_SUM_SQUARES_BLOCKS;
    lm_comm *gc = ep_group_comm(t);
    memset(t->eparts, 0, (size_t)t->n_split * NB * sizeof *t->eparts);
    size_t packed = 0;
    for (int i = 0, k = 0; i < t->n_all; i++) {
        if (!t->esplit[i]) continue;
        /* the model keeps this rank's slice [a, z) of the tensor's gradient (epo_bind): element x at g[x - a] */
        size_t first, count;
        const float *g = lm_model_grad_part(t->model, i, &first, &count);
        const int64_t n = lm_param_numel(&t->all[i]), sl = n / R, a = (int64_t)me * sl, z = a + sl;
        for (int b = 0; b < NB; b++) {
            int64_t lo, hi;
            ss_block(n, b, &lo, &hi);
            if (lo >= hi) continue;
            if (lo / sl == (hi - 1) / sl) {
                if (lo / sl == me) t->eparts[(size_t)k * NB + b] = lm_sum_squares_run(0.0, g + (lo - a), hi - lo);
                continue;
            }
            const int64_t x = lo > a ? lo : a, y = hi < z ? hi : z;
            if (x < y) {
                memcpy(t->epack + packed, g + (x - a), (size_t)(y - x) * sizeof(float));
                packed += (size_t)(y - x);
            }
        }
        k++;
    }
    size_t *bytes = t->ztab, *offs = bytes + R, cur[LM_DP_MAX_RANKS];
    for (int q = 0; q < R; q++) {
        bytes[q] = t->etab[q] * sizeof(float);
        offs[q] = t->etab[R + q] * sizeof(float);
        cur[q] = t->etab[R + q];
    }
    TRY(lm_comm_all_gatherv(gc, t->epack, bytes[me], t->egath, bytes, offs));
    for (int i = 0, k = 0; i < t->n_all; i++) {
        if (!t->esplit[i]) continue;
        const int64_t n = lm_param_numel(&t->all[i]), sl = n / R;
        for (int b = 0; b < NB; b++) {
            int64_t lo, hi;
            ss_block(n, b, &lo, &hi);
            if (lo >= hi || lo / sl == (hi - 1) / sl) continue;
            double s = 0.0;
            for (int q = (int)(lo / sl); q <= (int)((hi - 1) / sl); q++) {
                const int64_t x = lo > q * sl ? lo : q * sl, y = hi < (q + 1) * sl ? hi : (q + 1) * sl;
                s = lm_sum_squares_run(s, t->egath + cur[q], y - x);
                cur[q] += (size_t)(y - x);
            }
            if (lo / sl == me) t->eparts[(size_t)k * NB + b] = s;
        }
        k++;
    }
    /* over the group: each expert counted once (every group holds the same summed gradients) */
    TRY(lm_comm_all_reduce_sum(gc, t->eparts, t->eparts, (size_t)t->n_split * NB, LM_DTYPE_F64));
    double sum = 0.0;
    for (int i = 0, k = 0; i < t->n_all; i++) {
        if (!t->esplit[i]) {
            sum += lm_sum_squares(t->all[i].grad, lm_param_numel(&t->all[i]));
            continue;
        }
        double v = 0.0;
        for (int b = 0; b < NB; b++) v += t->eparts[(size_t)k * NB + b];
        sum += v;
        k++;
    }
    const double norm = sqrt(sum);
    *norm_out = norm;
    *bad = !isfinite(norm);
    if (!*bad && max_norm > 0.0f && norm > (double)max_norm) {
        lm_grads_scale(t->emuon, t->n_muon, (float)(max_norm / norm));
        lm_grads_scale(t->eadam, t->n_adam, (float)(max_norm / norm));
    }
    return LM_OK;
}

/* The same on the device path: each tensor's sum of squares by the backend's
 * op over what this rank holds of it (lm_grad_global_norm_on's sums: a
 * replicated tensor whole, the same on every rank; a cut tensor this rank's
 * slice), the slices' sums summed over the EP group in rank order, then the
 * tensors added in tensor order on every rank. A deterministic norm equal to
 * the replicated device run's up to double rounding (the slices group the
 * squares otherwise), not bit for bit as on the host path. Then this rank's
 * parts clipped. A non-finite norm sets *bad on every rank. */
static lm_status epo_grad_clip_device(trainer *t, float max_norm, double *norm_out, int *bad) {
    double *sums = t->norm_work;
    for (int i = 0; i < t->n_all; i++)
        TRY(t->be->ops->sum_squares(t->be, t->ball[i].grad, (size_t)lm_param_numel(&t->ball[i]), sums + i));
    TRY(t->be->download(t->be, t->znorm, sums, (size_t)t->n_all * sizeof(double)));
    int k = 0;
    for (int i = 0; i < t->n_all; i++)
        if (t->esplit[i]) t->eparts[k++] = t->znorm[i];
    /* each cut tensor's slices over the group (every group holds the same summed gradients) */
    if (k) TRY(lm_comm_all_reduce_sum(ep_group_comm(t), t->eparts, t->eparts, (size_t)k, LM_DTYPE_F64));
    double sum = 0.0;
    k = 0;
    for (int i = 0; i < t->n_all; i++) sum += t->esplit[i] ? t->eparts[k++] : t->znorm[i];
    const double norm = sqrt(sum);
    *norm_out = norm;
    *bad = !isfinite(norm);
    if (!*bad && max_norm > 0.0f && norm > (double)max_norm) {
        const float scale = (float)(max_norm / norm);
        for (int i = 0; i < t->n_all; i++)
            TRY(t->be->ops->scale(t->be, t->ball[i].grad, (size_t)lm_param_numel(&t->ball[i]), scale));
    }
    return LM_OK;
}

/* Expert parallelism on a model of this run: the MoE exchange over the EP
 * group (with owner-only state the model keeps the gradients and weights of
 * this rank's experts only since its creation, create_model). */
static lm_status model_expert_parallel(trainer *t, lm_model *m) {
    if (device_path(t)) {
        /* the exchanges move the backend's memory: its device engine (NCCL, or staged) */
        if (!t->dcomm)
            return lm_error(LM_ERR_ARG, "expert parallelism on a device runs over the device engine of --comm mpi or "
                            "--comm nccl");
        TRY(lm_model_set_expert_parallel(m, t->ep_dcomm ? t->ep_dcomm : t->dcomm));
        /* owner-only experts: evaluation forwards run the MoE layers through the exchange (no gathered weights
         * in device memory) */
        return t->epo ? lm_model_evaluate_by_exchange(m, 1) : LM_OK;
    }
    TRY(lm_model_set_expert_parallel(m, ep_group_comm(t)));
    if (!t->epo) return LM_OK;
    /* evaluation forwards gather one MoE layer's experts at a time */
    return lm_model_gather_experts_by_layer(m, 1);
}

/* The fault of lm_train_options.inject_diverge_step on this rank: the first
 * element it holds of tensor `name` moves by one ulp. */
static lm_status diverge_replica(trainer *t, const char *name) {
    for (int i = 0; name && i < t->n_all; i++) {
        if (strcmp(lm_model_tensor_at(t->model, i)->name, name)) continue;
        size_t first, count;
        float *w = lm_model_param_part(t->model, i, &first, &count);
        if (count) w[0] = nextafterf(w[0], INFINITY);
        return LM_OK;
    }
    return lm_error(LM_ERR_ARG, "inject_diverge_tensor: the model has no tensor '%s'", name ? name : "(none)");
}

/* ---- gradient buckets (docs/scaleout.md, "Gradient buckets") ----
 * The gradient block's sum over the ranks in pieces, each launched during the
 * last micro-batch's backward as soon as the model reports its range final.
 * Each element is the rank-order sum of the one all-reduce of the whole block
 * (the sums are elementwise), so the bits are the same whatever the buckets. */

/* Whether the run sums its gradients in buckets: data parallelism, replicated
 * or ZeRO-1 (each bucket reduce-scattered to the owners of its pieces), on CPU
 * ranks over MPI or on the device path (GPU ranks over NCCL or the staged
 * engine, one rank too), context parallelism's sum over the world and expert
 * parallelism's (owner-only experts: each bucket's replicated tensors over the
 * world, the owned slices over their replicas). */
static int bucket_wanted(const trainer *t) {
    return t->cfg.grad_bucket_mb > 0 &&
           (t->dcomm || (t->comm && t->ranks > 1));
}

/* Cut the buckets: whole tensors from the last one back, a bucket closing when
 * it holds at least train.grad_bucket_mb MiB (a tensor larger than that is a
 * bucket of its own); on a GPU the side stream, its event and the engine's
 * scratch for the largest bucket. */
static lm_status bucket_plan(trainer *t) {
    if (!t->bucketed || t->bk) return LM_OK;
    const int n = lm_model_num_tensors(t->model);
    const double want = (double)t->cfg.grad_bucket_mb * 1048576.0 / sizeof(float);
    const size_t limit = want < 1 ? 1 : want > (double)lm_model_num_params(t->model) ? lm_model_num_params(t->model)
                                                                                     : (size_t)want;
    t->bk = calloc((size_t)n + 1, sizeof *t->bk);
    if (!t->bk) return lm_error(LM_ERR_MEMORY, "out of memory (gradient buckets)");
    t->n_bk = 0;
    size_t next = lm_model_num_params(t->model), largest = 0; /* where the tensor after this one begins */
    for (int i = n - 1; i >= 0; i--) {
        const lm_model_tensor *mt = lm_model_tensor_at(t->model, i);
        struct grad_bucket *b = &t->bk[t->n_bk];
        if (mt->offset + mt->numel != next)
            return lm_error(LM_ERR_ARG, "internal: tensor %s does not end where the next begins", mt->name);
        next = mt->offset;
        b->off = mt->offset;
        b->count += mt->numel;
        if (b->count >= limit || i == 0) {
            largest = b->count > largest ? b->count : largest;
            t->n_bk++;
        }
    }
    if (t->bk[t->n_bk - 1].off != 0) return lm_error(LM_ERR_ARG, "internal: the gradient buckets miss the block's start");
    if (t->dcomm) TRY(lm_comm_reserve(t->dcomm, largest, LM_DTYPE_F32));
#ifdef LONGMOE_HAVE_CUDA
    if (t->dcomm && cuda_stream_of(t)) {
        TRY(lm_cuda_stream_create(&t->bk_stream));
        TRY(lm_cuda_event_create(&t->bk_event));
    }
#endif
    return LM_OK;
}

/* The hook of the last micro-batch's backward: [off, off + count) is final. */
static lm_status bucket_ready(void *user, size_t off, size_t count) {
    trainer *t = user;
    for (int i = 0; i < t->n_bk; i++) {
        struct grad_bucket *b = &t->bk[i];
        const size_t lo = off > b->off ? off : b->off;
        const size_t hi = off + count < b->off + b->count ? off + count : b->off + b->count;
        if (lo >= hi) continue;
        if (hi - lo > b->left)
            return lm_error(LM_ERR_ARG, "internal: gradient elements [%zu, %zu) reported final twice", lo, hi);
        b->left -= hi - lo;
        if (b->left) continue;
#ifdef LONGMOE_HAVE_CUDA
        if (t->dcomm && t->bk_stream) {
            /* on the side stream, after the backend's stream has written the range */
            TRY(lm_cuda_stream_wait(t->bk_stream, cuda_stream_of(t), t->bk_event));
            epo_set_stream(t, t->bk_stream);
        }
#endif
        if (t->zero) {
            /* ZeRO-1: each owner receives the sum of its piece of the bucket */
            TRY(zero_reduce_range(t, b->off, b->off + b->count));
        } else if (t->epo) {
            /* owner-only experts: the bucket's replicated tensors and this rank's expert slices */
            TRY(epo_reduce_range(t, b->off, b->off + b->count));
        } else if (t->dcomm) {
            float *g = lm_model_backend_grads(t->model) + b->off;
            TRY(lm_comm_all_reduce_sum(t->dcomm, g, g, b->count, LM_DTYPE_F32));
        } else {
            /* CPU ranks: summed here, before the backward goes on */
            float *g = lm_model_grads(t->model) + b->off;
            TRY(lm_comm_all_reduce_sum(t->comm, g, g, b->count, LM_DTYPE_F32));
        }
    }
    return LM_OK;
}

/* Before the last micro-batch's backward: every bucket waits for all its elements. */
static void bucket_arm(trainer *t) {
    for (int i = 0; i < t->n_bk; i++) t->bk[i].left = t->bk[i].count;
    t->bk_armed = 1;
    lm_model_set_grad_ready_hook(t->model, bucket_ready, t);
}

/* After it: every bucket was summed (or enqueued); on a GPU the backend's
 * stream waits for the side stream's sums before anything reads the gradients
 * (or the next step's zeroing writes them). */
static lm_status bucket_finish(trainer *t) {
    lm_model_set_grad_ready_hook(t->model, NULL, NULL);
    if (!t->bk_armed) return LM_OK;
    t->bk_armed = 0;
    for (int i = 0; i < t->n_bk; i++)
        if (t->bk[i].left)
            return lm_error(LM_ERR_ARG, "internal: the backward left %zu elements of the gradient bucket [%zu, %zu) "
                            "unreported", t->bk[i].left, t->bk[i].off, t->bk[i].off + t->bk[i].count);
#ifdef LONGMOE_HAVE_CUDA
    if (t->dcomm && t->bk_stream) {
        void *compute = cuda_stream_of(t);
        TRY(lm_cuda_stream_wait(compute, t->bk_stream, t->bk_event));
        epo_set_stream(t, compute);
    }
#endif
    t->bk_summed = 1;
    return LM_OK;
}

/* The ranks of `c` agree on a forward: `*fs` is this rank's status in and the verdict out,
 * LM_ERR_NUMERIC when any rank's forward was not finite; a failure of another kind on any rank
 * fails every rank (`where` names the ranks in the message of those it did not happen on). Used
 * before a collective backward (context parallelism) and before the last micro-batch's
 * backward, whose bucket sums every rank must join (a rank whose forward failed earlier in the
 * step joins from after its loop, with LM_ERR_NUMERIC). */
static lm_status agree_forward(lm_comm *c, lm_status *fs, const char *where) {
    int32_t f[2] = {*fs == LM_ERR_NUMERIC, *fs && *fs != LM_ERR_NUMERIC};
    TRY(lm_comm_all_reduce_sum(c, f, f, 2, LM_DTYPE_I32));
    if (f[1]) return *fs ? *fs : lm_error(LM_ERR_ARG, "the forward failed on another rank of the %s", where);
    if (f[0] && !*fs) *fs = LM_ERR_NUMERIC;
    return LM_OK;
}

/* After the micro-batches of a step: the ranks' losses averaged (each is the
 * mean over its share), a failed forward on any rank fails the step for all,
 * the data position advanced by the fewest micro-batches any rank consumed
 * (the global micro-batch that failed is consumed, as on one rank), the
 * balancing counts summed (always: the loads are state), and on a good step
 * the gradients summed (under ZeRO-1 reduce-scattered) and the QK-Clip maxima
 * taken over the ranks. */
static lm_status dp_reduce_step(trainer *t, int64_t pos0, float *loss, float *aux, int *bad) {
    if (t->ranks <= 1) return LM_OK;
    const int R = t->ranks;
    struct {
        double loss, aux;
        int64_t consumed, bad;
    } mine = {*loss, *aux, t->data_pos - pos0, *bad}, all[LM_DP_MAX_RANKS];
    /* context parallel: each rank's loss is the mean over its segment; weighted by T_c / T the group's sum is
     * the mean over the group's rows (without CP the weight is 1, exactly) */
    const double w = (double)t->seg_T / (double)t->T;
    mine.loss *= w;
    mine.aux *= w;
    TRY(lm_comm_all_gather(t->comm, &mine, all, sizeof mine));
    float l = (float)all[0].loss, a = (float)all[0].aux;
    int64_t consumed = all[0].consumed, any_bad = all[0].bad;
    for (int r = 1; r < R; r++) {
        l += (float)all[r].loss;
        a += (float)all[r].aux;
        consumed = all[r].consumed < consumed ? all[r].consumed : consumed;
        any_bad |= all[r].bad;
    }
    *loss = l / (float)t->dp_groups;
    *aux = a / (float)t->dp_groups;
    *bad = any_bad != 0;
    t->data_pos = pos0 + consumed;
    /* the balancing counts: histograms and loads (int32, exact), entropy and tokens (monitoring) */
    for (int i = 0; i < t->n_moe; i++) {
        lm_balance_state *b = lm_model_balance(t->model, i);
        size_t n;
        int32_t *buf = lm_balance_reduce_buffer(b, &n);
        TRY(lm_comm_all_reduce_sum(t->comm, buf, buf, n, LM_DTYPE_I32));
        t->dp_f64[2 * i] = b->entropy_sum;
        t->dp_f64[2 * i + 1] = (double)b->tokens;
    }
    if (t->n_moe) {
        TRY(lm_comm_all_reduce_sum(t->comm, t->dp_f64, t->dp_f64, 2 * (size_t)t->n_moe, LM_DTYPE_F64));
        for (int i = 0; i < t->n_moe; i++) {
            lm_balance_state *b = lm_model_balance(t->model, i);
            b->entropy_sum = t->dp_f64[2 * i];
            b->tokens = (int64_t)t->dp_f64[2 * i + 1];
        }
    }
    if (*bad) return LM_OK;
    /* the gradients: each rank's share was scaled by 1 / (grad_accum R) (context parallel: by
     * T_c / (T grad_accum R / N)), so the sum over all ranks is the batch's mean;
     * under ZeRO-1 each rank receives the sum of its own range only */
    if (t->bk_summed) {
        /* summed bucket by bucket during the last backward (bucket_ready) */
    } else if (t->zero) {
        TRY(zero_reduce_grads(t)); /* on the host or, on the device path, in the backend's memory */
    } else if (t->epo) {
        TRY(epo_reduce_grads(t)); /* on the device path in the backend's memory, on its stream */
    } else if (t->dcomm) {
        /* in the backend's memory, on its stream: after the backward, before the optimizer or the download */
        lm_comm_set_stream(t->dcomm, cuda_stream_of(t));
        TRY(lm_comm_all_reduce_sum(t->dcomm, lm_model_backend_grads(t->model), lm_model_backend_grads(t->model),
                                   lm_model_num_params(t->model), LM_DTYPE_F32));
    } else {
        TRY(lm_comm_all_reduce_sum(t->comm, lm_model_grads(t->model), lm_model_grads(t->model),
                                   lm_model_num_params(t->model), LM_DTYPE_F32));
    }
    int nq = lm_model_qk_max_count(t->model);
    if (nq) {
        lm_model_qk_max_get(t->model, t->dp_qk);
        TRY(lm_comm_all_gather(t->comm, t->dp_qk, t->dp_qk + nq, (size_t)nq * sizeof(float)));
        for (int h = 0; h < nq; h++) {
            float m = t->dp_qk[nq + h];
            for (int r = 1; r < R; r++) {
                float x = t->dp_qk[(size_t)(r + 1) * nq + h];
                if (x > m || isnan(x)) m = x;
            }
            t->dp_qk[h] = m;
        }
        lm_model_qk_max_set(t->model, t->dp_qk);
    }
    return LM_OK;
}

/* The evaluation tallies of the ranks' shares, added in rank order. */
static lm_status dp_reduce_tally(trainer *t, lm_eval_tally *tally) {
    if (t->ranks <= 1) return LM_OK;
    lm_eval_tally *all = malloc((size_t)t->ranks * sizeof *all);
    if (!all) return lm_error(LM_ERR_MEMORY, "out of memory (evaluation tallies)");
    lm_status s = lm_comm_all_gather(t->comm, tally, all, sizeof *tally);
    if (!s) {
        *tally = all[0];
        for (int r = 1; r < t->ranks; r++) {
            for (int i = 0; i < tally->n_buckets; i++) {
                tally->loss_sum[i] += all[r].loss_sum[i];
                tally->loss_count[i] += all[r].loss_count[i];
            }
            tally->answers += all[r].answers;
            tally->answers_right += all[r].answers_right;
            tally->rows += all[r].rows;
            tally->rows_right += all[r].rows_right;
        }
    }
    free(all);
    return s;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

#define FNV_BASIS 0xcbf29ce484222325ull

/* The hashes of `count` whole experts of `per` floats each at x: h[e], each
 * from the basis (an expert's bytes alone). */
static void hash_experts(const float *x, size_t per, size_t count, uint64_t *h) {
    for (size_t e = 0; e < count; e++) h[e] = fnv(FNV_BASIS, x + e * per, per * sizeof(float));
}

/* Hashes of the run's state: the parameters, the optimizer state and the
 * counters; the balancing state of every MoE layer. The parameter hash covers
 * each tensor's hash in table order, then each tensor's optimizer state hash
 * (muon_p's, then adam_p's), then the counters. A tensor's hash is the hash
 * of its bytes, except for a routed experts' tensor: the hash of its n
 * experts' hashes in expert order (the state's: of its parts' (AdamW: m, v)
 * experts' hashes, part by part). So each value comes from whole experts, not
 * whole tensors: the owners of slices (expert parallelism with owner-only
 * state) hash their experts and the hashes are summed over the EP group (one
 * owner's words plus zeros: exact), under ZeRO-1 each tensor's state hash is
 * its owner's, summed over the ranks likewise; no layout gathers a tensor, and
 * every layout (one process, replicated, ZeRO-1, any EP group) gives the same
 * value for the same bits. Collective under ZeRO-1 and expert parallelism
 * with owner-only state. */
static lm_status state_hashes(trainer *t, uint64_t *params, uint64_t *balance) {
    const int n = t->cfg.n_routed_experts, zr = zero_range(t);
    /* this rank's optimizer descriptors and the ones it holds state of (ZeRO-1: its range) */
    const lm_param *mine_m = t->epo ? t->emuon : t->muon_p, *mine_a = t->epo ? t->eadam : t->adam_p;
    const int m_lo = t->epo ? 0 : t->zmuon_i[zr], m_hi = t->epo ? t->n_muon : t->zmuon_i[zr + 1];
    const int a_lo = t->epo ? 0 : t->zadam_i[zr], a_hi = t->epo ? t->n_adam : t->zadam_i[zr + 1];
    memset(t->zhash, 0, (size_t)t->n_all * sizeof *t->zhash);
    memset(t->ehash, 0, t->n_ehash * sizeof *t->ehash);
    /* pass 0: the hashes of what this rank holds, the experts' in their slots;
     * pass 1: the experts' slots complete, each routed tensor's hash from them */
    for (int pass = 0; pass < 2; pass++) {
        size_t k = 0, off_m = 0, off_a = 0;
        int jm = 0, ja = 0;
        for (int i = 0; i < t->n_all; i++) {
            const int muon = lm_param_optimizer(&t->all[i]) == LM_OPT_MUON, j = muon ? jm++ : ja++;
            const int held = muon ? j >= m_lo && j < m_hi : j >= a_lo && j < a_hi;
            const lm_param *p = muon ? &mine_m[j] : &mine_a[j];
            const size_t S = held ? lm_param_state_floats(p) : 0, Nl = (size_t)lm_param_numel(p);
            const float *st = held ? (muon ? t->muon_state + off_m : t->adam_state + off_a) : NULL;
            if (muon) off_m += S;
            else off_a += S;
            uint64_t *zh = &t->zhash[muon ? j : t->n_muon + j];
            size_t first, count;
            const float *w = lm_model_param_part(t->model, i, &first, &count);
            if (!routed_experts_tensor(t, i)) {
                if (pass) continue;
                t->phash[i] = fnv(FNV_BASIS, w, count * sizeof(float));
                if (held) *zh = fnv(FNV_BASIS, st, S * sizeof(float));
                continue;
            }
            const size_t N = (size_t)lm_param_numel(&t->all[i]), per = N / (size_t)n,
                         parts = lm_param_state_floats(&t->all[i]) / N, e0 = first / per;
            if (!pass) {
                /* the experts this rank holds: [e0, e0 + count / per), its state the same experts' */
                hash_experts(w, per, count / per, t->ehash + k + e0);
                for (size_t c = 0; held && c < parts; c++)
                    hash_experts(st + c * Nl, per, Nl / per, t->ehash + k + (1 + c) * (size_t)n + e0);
            } else {
                t->phash[i] = fnv(FNV_BASIS, t->ehash + k, (size_t)n * sizeof *t->ehash);
                if (held) *zh = fnv(FNV_BASIS, t->ehash + k + n, parts * (size_t)n * sizeof *t->ehash);
            }
            k += (1 + parts) * (size_t)n;
        }
        /* owner-only experts: every owner's slots over the group (one owner's words plus zeros; int32 sums wrap) */
        if (!pass && t->epo && t->n_ehash)
            TRY(lm_comm_all_reduce_sum(ep_group_comm(t), t->ehash, t->ehash, 2 * t->n_ehash, LM_DTYPE_I32));
    }
    /* ZeRO-1: each tensor's state hash from its owner (one owner's words plus zeros: exact) */
    if (t->zero && t->ranks > 1)
        TRY(lm_comm_all_reduce_sum(t->comm, t->zhash, t->zhash, 2 * (size_t)t->n_all, LM_DTYPE_I32));
    uint64_t h = fnv(FNV_BASIS, t->phash, (size_t)t->n_all * sizeof *t->phash);
    h = fnv(h, t->zhash, (size_t)t->n_all * sizeof *t->zhash);
    int64_t counters[5] = {t->step, t->data_pos, t->skipped, t->muon.step, t->adam.step};
    *params = fnv(h, counters, sizeof counters);
    h = FNV_BASIS;
    for (int i = 0; i < t->n_moe; i++) {
        lm_balance_state *b = lm_model_balance(t->model, i);
        size_t nb = (size_t)b->cfg.n_experts;
        h = fnv(h, b->bias, nb * sizeof *b->bias);
        h = fnv(h, b->halfwidth, nb * sizeof *b->halfwidth);
        h = fnv(h, b->last_load, nb * sizeof *b->last_load);
        h = fnv(h, b->interval_load, nb * sizeof *b->interval_load);
        int64_t c[2] = {b->step, b->interval_steps};
        h = fnv(h, c, sizeof c);
    }
    *balance = h;
    return LM_OK;
}

/* Every rank holds rank 0's state, bit for bit (before a checkpoint): the
 * parameters, counters and balancing state, and the optimizer state where it is
 * replicated (under ZeRO-1 every rank hashes the owners' gathered hashes).
 * Owner-only experts: a rank's hash holds its group's expert slices, so the
 * replicas of a slice in other groups are compared; a slice held once (the
 * group is the world) has nothing to be compared with. */
static lm_status dp_check_replicas(trainer *t) {
    if (t->ranks <= 1) return LM_OK;
    uint64_t mine[2], all[2 * LM_DP_MAX_RANKS];
    /* on a GPU the state is the device's: its host copies first */
    TRY(host_params_current(t));
    TRY(download_optimizer_state(t));
    TRY(state_hashes(t, &mine[0], &mine[1]));
    TRY(lm_comm_all_gather(t->comm, mine, all, sizeof mine));
    for (int r = 1; r < t->ranks; r++)
        if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
            return lm_error(LM_ERR_NUMERIC, "data parallel: at step %lld rank %d's %s differs from rank 0's (the "
                            "replicas diverged; no checkpoint written)", (long long)t->step, r,
                            all[2 * r] != all[0] ? "parameters or optimizer state" : "MoE balancing state");
    return LM_OK;
}

double lm_train_flops_per_token(const lm_config *cfg, int T) {
    lm_plan plan;
    lm_config_plan(cfg, T, &plan);
    return 3.0 * plan.total_flops;
}

/* The head dimensions the CUDA KDA operator runs (src/cuda/kda). */
static int cuda_kda_head_dim_ok(int d) { return d == 32 || d == 64 || d == 128; }

/* The device of opt.device for this config: nothing for the CPU; for CUDA a
 * config the kernels run and a usable GPU, else a clear error before anything
 * is written. */
/* A config the CUDA kernels run (before anything is written). */
static lm_status cuda_config_ok(const trainer *t) {
    const lm_config *c = &t->cfg;
    int kda = 0;
    for (int l = 0; l < c->n_layers; l++) kda |= lm_config_mixer(c, l) == LM_MIXER_KDA;
    if (kda && !cuda_kda_head_dim_ok(c->kda_head_dim))
        return lm_error(LM_ERR_ARG, "--device cuda: kda.head_dim is %d, but the CUDA KDA kernels run head dimensions "
                        "32, 64 and 128 only; train this config on the CPU (--device cpu) or use one of those",
                        c->kda_head_dim);
    return LM_OK;
}

static lm_status open_device(trainer *t) {
    if (t->opt.backend) {
        /* the caller's backend: the device path on it */
        t->be = t->opt.backend;
        t->be_given = 1;
        if (t->be->device == LM_DEVICE_CUDA) TRY(cuda_config_ok(t));
        if (t->staged) TRY(lm_comm_open_staged(t->comm, t->be, &t->dcomm));
        return LM_OK;
    }
    if (t->opt.device == LM_DEVICE_CPU) return LM_OK;
    if (t->opt.device != LM_DEVICE_CUDA) return lm_error(LM_ERR_ARG, "unknown training device %d", (int)t->opt.device);
    TRY(cuda_config_ok(t));
    /* GPU ranks over MPI: each process takes the GPU of its index on its machine
     * (several share one when there are fewer GPUs), its sums staged through the host */
    int local = 0;
    lm_status s = t->staged ? lm_comm_local_rank(t->comm, &local) : LM_OK;
    if (!s) s = t->staged ? lm_backend_cuda_create_local(local, &t->be) : lm_backend_cuda_create(&t->be);
    if (s) {
        char why[1024];
        snprintf(why, sizeof why, "%s", lm_last_error());
        return lm_error(s, "--device cuda: %s", why);
    }
    if (t->staged) TRY(lm_comm_open_staged(t->comm, t->be, &t->dcomm));
    return LM_OK;
}

/* The model of this rank for micro-batches of B x T: its group's share of the
 * rows and, under context parallelism, its segment of the tokens (*t0, *len),
 * set up over the group once every rank has its model; with owner-only
 * expert state its parameter and gradient blocks hold the replicated tensors
 * and its own experts' slices only, from the start. */
/* The model's planned bytes (lm_model_plan) of B x T tokens under cfg on `dev`; 0 when it cannot plan. */
static double planned_bytes(const lm_config *cfg, int B, int T, lm_device dev) {
    lm_model *m = NULL;
    if (lm_model_plan(cfg, B, T, dev, &m)) return 0;
    const double b = (double)lm_model_plan_bytes(m);
    lm_model_free(m);
    return b;
}

/* bytes as "12.3 GiB" or "456.7 MiB" */
static const char *size_text(double b, char *buf, size_t n) {
    const double g = 1024.0 * 1024 * 1024;
    if (b >= g) snprintf(buf, n, "%.1f GiB", b / g);
    else snprintf(buf, n, "%.1f MiB", b / (1024.0 * 1024));
    return buf;
}

/* A model that did not fit: the message adds what these settings plan and what the recompute
 * settings that keep less would (docs/model.md, "Recomputation"). */
static lm_status memory_hint(const trainer *t, int B, int T) {
    char why[1024], a[32], alt[256] = "";
    snprintf(why, sizeof why, "%s", lm_last_error());
    const lm_device dev = t->be ? t->be->device : LM_DEVICE_CPU;
    const double now = planned_bytes(&t->cfg, B, T, dev);
    if (now <= 0) return lm_error(LM_ERR_MEMORY, "%s", why);
    size_t n = 0;
    const int modes[2] = {LM_RECOMPUTE_CHANNEL, LM_RECOMPUTE_ALL};
    for (int i = 0; i < 2; i++) {
        if (t->cfg.recompute == LM_RECOMPUTE_ALL || t->cfg.recompute == modes[i]) continue;
        lm_config c = t->cfg;
        c.recompute = modes[i];
        const double b = planned_bytes(&c, B, T, dev);
        if (b > 0 && b < now)
            n += (size_t)snprintf(alt + n, sizeof alt - n, ", with train.recompute = %s %s", lm_recompute_json(modes[i]),
                                  size_text(b, a, sizeof a));
    }
    return lm_error(LM_ERR_MEMORY, "%s; the model's plan on %s at %d x %d tokens: %s with these settings%s", why,
                    lm_device_name(dev), B, T, size_text(now, a, sizeof a), alt);
}

static lm_status create_model(trainer *t, int B, int T, lm_model **out, int *t0, int *len) {
    *out = NULL;
    *t0 = 0;
    *len = T;
    if (t->cp > 1) TRY(segment_of(t, T, t->cp, t->cp_rank, t0, len));
    lm_status s = t->epo ? lm_model_create_expert_owned(&t->cfg, B / t->dp_groups, *len, t->be, t->ep, t->ep_pos, out)
                         : lm_model_create_on(&t->cfg, B / t->dp_groups, *len, t->be, out);
    if (s == LM_ERR_MEMORY && !t->epo && t->cp <= 1) s = memory_hint(t, B / t->dp_groups, *len);
    if (!s && lm_model_block_peak_bytes(*out) > t->block_peak_bytes)
        t->block_peak_bytes = lm_model_block_peak_bytes(*out);
    if (t->cp <= 1) return s;
    /* every rank, before the group's collective setup */
    if (!(s = dp_agree(t, s))) s = lm_model_set_context_parallel(*out, t->cp_dcomm ? t->cp_dcomm : t->cp_comm);
    if (s) {
        lm_model_free(*out);
        *out = NULL;
    }
    return s;
}

static lm_status trainer_setup(trainer *t, int stage) {
    const lm_config *c = &t->cfg;
    t->stage = stage;
    stage_shape(t, stage, &t->B, &t->T);
    TRY(open_device(t));
    if (t->cp > 1) {
        /* the groups of cp consecutive ranks (every rank, collectively) */
        lm_status s = lm_comm_split(t->comm, t->dp_rank, &t->cp_comm);
        if (!s && (!t->cp_comm || lm_comm_size(t->cp_comm) != t->cp || lm_comm_rank(t->cp_comm) != t->cp_rank))
            s = lm_error(LM_ERR_ARG, "context parallelism: the split gave rank %d a group of %d ranks, expected %d",
                         t->rank, t->cp_comm ? lm_comm_size(t->cp_comm) : 0, t->cp);
        /* on a device the layers' exchanges go over the group's part of the device engine, on the
         * compute stream */
        if (!s && t->dcomm && !t->cp_dcomm) {
            s = lm_comm_split(t->dcomm, t->dp_rank, &t->cp_dcomm);
            if (!s && (!t->cp_dcomm || lm_comm_size(t->cp_dcomm) != t->cp))
                s = lm_error(LM_ERR_ARG, "context parallelism: the device engine's split gave rank %d a group of %d "
                             "ranks, expected %d", t->rank, t->cp_dcomm ? lm_comm_size(t->cp_dcomm) : 0, t->cp);
            if (!s) lm_comm_set_stream(t->cp_dcomm, cuda_stream_of(t));
        }
        TRY(dp_agree(t, s));
    }
    if (t->opt.expert_parallel && t->ep < t->ranks && !t->ep_comm) {
        /* the EP groups of ep consecutive ranks, and the replicas of each position (every rank, collectively) */
        lm_status s = lm_comm_split(t->comm, t->rank / t->ep, &t->ep_comm);
        if (!s) s = lm_comm_split(t->comm, t->ep_pos, &t->er_comm);
        /* on a device the layer's exchanges go over the group's part of the device engine */
        if (!s && t->dcomm) s = lm_comm_split(t->dcomm, t->rank / t->ep, &t->ep_dcomm);
        if (!s && t->dcomm) s = lm_comm_split(t->dcomm, t->ep_pos, &t->er_dcomm);
        if (!s && t->dcomm && (!t->ep_dcomm || lm_comm_size(t->ep_dcomm) != t->ep))
            s = lm_error(LM_ERR_ARG, "expert parallelism: the device engine's split gave rank %d a group of %d ranks, "
                         "expected %d", t->rank, t->ep_dcomm ? lm_comm_size(t->ep_dcomm) : 0, t->ep);
        if (!s && (!t->ep_comm || lm_comm_size(t->ep_comm) != t->ep || lm_comm_rank(t->ep_comm) != t->ep_pos ||
                   !t->er_comm || lm_comm_size(t->er_comm) != t->ranks / t->ep))
            s = lm_error(LM_ERR_ARG, "expert parallelism: the split gave rank %d a group of %d ranks, expected %d",
                         t->rank, t->ep_comm ? lm_comm_size(t->ep_comm) : 0, t->ep);
        TRY(dp_agree(t, s));
    }
    TRY(create_model(t, t->B, t->T, &t->model, &t->seg_t0, &t->seg_T));
    if (t->opt.expert_parallel) TRY(model_expert_parallel(t, t->model));
    t->n_all = lm_model_num_tensors(t->model);
    t->all = calloc((size_t)t->n_all, sizeof *t->all);
    t->muon_p = calloc((size_t)t->n_all, sizeof *t->muon_p);
    t->adam_p = calloc((size_t)t->n_all, sizeof *t->adam_p);
    if (!t->all || !t->muon_p || !t->adam_p) return lm_error(LM_ERR_MEMORY, "out of memory (trainer)");
    bind_params(t);
    TRY(zero_setup(t));
    TRY(epo_setup(t));
    lm_optim_config oc = lm_optim_config_default();
    oc.weight_decay = c->weight_decay;
    /* this rank's range of the optimizers' tensors (all of them without ZeRO-1) */
    const int zr = zero_range(t);
    lm_param *my_muon = t->epo ? t->emuon : t->muon_p + t->zmuon_i[zr],
             *my_adam = t->epo ? t->eadam : t->adam_p + t->zadam_i[zr];
    const int my_n_muon = t->zmuon_i[zr + 1] - t->zmuon_i[zr], my_n_adam = t->zadam_i[zr + 1] - t->zadam_i[zr];
    t->muon_total_n = lm_optim_state_floats(t->muon_p, t->n_muon);
    t->adam_total_n = lm_optim_state_floats(t->adam_p, t->n_adam);
    t->muon_state_n = lm_optim_state_floats(my_muon, my_n_muon);
    t->adam_state_n = lm_optim_state_floats(my_adam, my_n_adam);
    t->scratch_n = lm_optim_scratch_floats(my_muon, my_n_muon);
    t->muon_state = calloc(t->muon_state_n + 1, sizeof(float));
    t->adam_state = calloc(t->adam_state_n + 1, sizeof(float));
    t->scratch = calloc(t->scratch_n + 1, sizeof(float));
    /* batch buffers for the largest stage: this rank's rows of a micro-batch (lm_data_mix_rows) */
    size_t most = 0;
    for (int i = 0; i < t->n_stages; i++) {
        int B, T;
        stage_shape(t, i, &B, &T);
        size_t n = (size_t)(B / t->dp_groups) * (T + 1);
        most = n > most ? n : most;
    }
    t->seq = calloc(most, sizeof(int32_t));
    t->inp = calloc(most, sizeof(int32_t));
    t->tgt = calloc(most, sizeof(int32_t));
    t->answer = calloc(most, 1);
    if (t->cfg.answer_loss_weight != 1.0f) {
        t->logp = calloc(most, sizeof(float));
        t->dlogp = calloc(most, sizeof(float));
        if (!t->logp || !t->dlogp) return lm_error(LM_ERR_MEMORY, "out of memory (weighted-loss buffers)");
    }
    t->n_moe = lm_model_num_moe_layers(t->model);
    t->stats = calloc((size_t)(t->n_moe ? t->n_moe : 1), sizeof *t->stats);
    if (t->ranks > 1) {
        t->dp_qk = calloc((size_t)(t->ranks + 1) * lm_model_qk_max_count(t->model) + 1, sizeof *t->dp_qk);
        t->dp_f64 = calloc(2 * (size_t)t->n_moe + 1, sizeof *t->dp_f64);
        if (!t->dp_qk || !t->dp_f64) return lm_error(LM_ERR_MEMORY, "out of memory (data-parallel buffers)");
    }
    if (!t->muon_state || !t->adam_state || !t->scratch || !t->seq || !t->inp || !t->tgt || !t->answer || !t->stats)
        return lm_error(LM_ERR_MEMORY, "out of memory (trainer buffers)");
    TRY(lm_optimizer_init(&t->muon, &oc, my_muon, my_n_muon, t->muon_state, t->muon_state_n, t->scratch,
                          t->scratch_n));
    TRY(lm_optimizer_init(&t->adam, &oc, my_adam, my_n_adam, t->adam_state, t->adam_state_n, t->scratch,
                          t->scratch_n));
    if (t->be && !t->opt.host_optimizer) {
        t->dev_opt = 1;
        t->ball = calloc((size_t)t->n_all, sizeof *t->ball);
        t->bmuon = calloc((size_t)t->n_all, sizeof *t->bmuon);
        t->badam = calloc((size_t)t->n_all, sizeof *t->badam);
        if (!t->ball || !t->bmuon || !t->badam) return lm_error(LM_ERR_MEMORY, "out of memory (trainer)");
        TRY(bind_backend_params(t));
        /* ZeRO-1: over this rank's range, whose state muon_state / adam_state mirror */
        TRY(lm_optimizer_create_on(t->be, &oc, t->bmuon + t->zmuon_i[zr], my_n_muon, &t->dmuon));
        TRY(lm_optimizer_create_on(t->be, &oc, t->badam + t->zadam_i[zr], my_n_adam, &t->dadam));
        TRY(t->be->alloc(t->be, lm_grad_norm_work_bytes(t->n_all), &t->norm_work));
    }
    return LM_OK;
}

static void close_data(trainer *t) {
    for (int i = 0; i < t->mix.n; i++) lm_data_close(t->mix.sources[i]);
    t->mix.n = 0;
    lm_data_close(t->val);
    t->val = NULL;
}

/* The data whose held-out stream validates stage i: its first source. */
static const char *val_spec_of(const trainer *t, int i) {
    const lm_stage *st = &t->stages[i];
    return st->n_data ? st->data[0] : t->cfg.data;
}

/* Fingerprint every data spec of every stage, each once (lm_data_fingerprint:
 * one pass over each file). */
static lm_status fingerprint_data(trainer *t) {
    for (int i = 0; i < t->n_stages; i++) {
        const lm_stage *st = &t->stages[i];
        int n = st->n_data ? st->n_data : 1;
        for (int j = 0; j < n; j++) {
            const char *spec = st->n_data ? st->data[j] : t->cfg.data;
            int seen = 0;
            for (int k = 0; k < t->n_prints && !seen; k++) seen = !strcmp(t->print_spec[k], spec);
            if (seen) continue;
            int k = t->n_prints;
            snprintf(t->print_spec[k], sizeof t->print_spec[k], "%s", spec);
            TRY(lm_data_fingerprint(spec, &t->print_files[k], &t->print_n[k]));
            t->n_prints = k + 1;
        }
    }
    return LM_OK;
}

/* Open the training mix and the validation stream of stage i. */
static lm_status open_data(trainer *t, int i) {
    close_data(t);
    const lm_stage *st = &t->stages[i];
    int n = st->n_data ? st->n_data : 1;
    t->mix.seed = t->cfg.seed ^ 0x6d69787365656421ull;
    for (int j = 0; j < n; j++) {
        const char *spec = st->n_data ? st->data[j] : t->cfg.data;
        TRY(lm_data_open(spec, t->cfg.seed, &t->mix.sources[j]));
        t->mix.weights[j] = st->n_data ? st->weights[j] : 1.0;
        if (!(isfinite(t->mix.weights[j]) && t->mix.weights[j] > 0 && t->mix.weights[j] <= 1e30))
            return lm_error(LM_ERR_ARG, "stage '%s': data '%s' has the weight %g; a weight lies in (0, 1e30]", st->name,
                            spec, t->mix.weights[j]);
        t->mix.n = j + 1;
        if (t->mix.sources[j]->vocab_size > t->cfg.vocab_size)
            return lm_error(LM_ERR_ARG, "data '%s' has tokens up to %d but model.vocab_size is %d", spec,
                            t->mix.sources[j]->vocab_size - 1, t->cfg.vocab_size);
    }
    /* validation: the same held-out data as `longmoe eval` of the stage's checkpoints */
    return lm_eval_open_validation(val_spec_of(t, i), t->cfg.seed, &t->val);
}

/* Stage of a step: the first stage whose cumulative steps exceed it (the last at the end). */
static int stage_of(const trainer *t, int64_t step) {
    int64_t end = 0;
    for (int i = 0; i < t->n_stages; i++) {
        end += t->stages[i].steps;
        if (step < end) return i;
    }
    return t->n_stages - 1;
}

static int64_t stage_end(const trainer *t, int i) {
    int64_t end = 0;
    for (int j = 0; j <= i; j++) end += t->stages[j].steps;
    return end;
}

/* Move to stage i: a model planned for its shape that carries the parameters and
 * the balancing state over; the optimizer state stays (same parameter layout). */
static lm_status switch_stage(trainer *t, int i) {
    int B, T;
    stage_shape(t, i, &B, &T);
    lm_model *next;
    /* on the GPU both stages' models are held for the copy (host parameters
     * and balancing state; the new model uploads them before its first forward) */
    TRY(host_params_current(t));
    int t0, len;
    TRY(create_model(t, B, T, &next, &t0, &len));
    /* the new stage's model runs the experts over the ranks too (the owner-only
     * expert state needs the owners' complete gradients) */
    lm_status s = t->opt.expert_parallel ? model_expert_parallel(t, next) : LM_OK;
    if (!s) s = lm_model_copy_state(next, t->model);
    if (s) {
        lm_model_free(next);
        return s;
    }
    lm_model_free(t->model);
    t->model = next;
    t->B = B;
    t->T = T;
    t->seg_t0 = t0;
    t->seg_T = len;
    t->stage = i;
    bind_params(t);
    TRY(epo_bind(t));
    TRY(bind_backend_params(t));
    return open_data(t, i);
}

/* Split B rows of a [., T+1] batch into inputs and targets [B, len] of
 * positions [t0, t0 + len): the targets are the whole sequence's, the next
 * token, so a segment's last target is the next segment's first input. */
/* train.answer_loss_weight W: the micro-batch's loss sum_i w_i nll_i / sum_i w_i with w_i = W at the
 * answer positions of t->answer (this rank's rows of the micro-batch, as lm_data_mix_rows wrote them) and 1
 * elsewhere, the sums over every rank's rows. Writes t->dlogp (the backward's weights, divided by
 * grad_accum) and *loss: this rank's share, R sum_mine w nll / W_all, whose mean over the R ranks is the
 * micro-batch's loss, as the plain path's losses are averaged. */
/* The weighted loss over the micro-batch's rows of every rank. `*fs` is this rank's forward status
 * in and the ranks' verdict out: the ranks' sums carry two failure counts with them, so a rank whose
 * forward failed still joins the sum (and contributes nothing) and every rank leaves with the same
 * verdict (LM_ERR_NUMERIC when a forward was non-finite anywhere; an error when one failed otherwise),
 * so none waits in a collective the failed rank skipped. */
static lm_status weighted_loss(trainer *t, float *loss, lm_status *fs) {
    const int Bm = share_B(t), T = t->T;
    const size_t n = (size_t)Bm * T;
    const uint8_t *ans = t->answer;
    const double W = t->cfg.answer_loss_weight;
    double sums[4] = {0, 0, *fs == LM_ERR_NUMERIC, *fs && *fs != LM_ERR_NUMERIC}; /* sum w, sum w nll, failures */
    if (!*fs) {
        TRY(lm_model_token_logprobs(t->model, t->logp));
        for (size_t i = 0; i < n; i++) {
            const double w = ans[i] ? W : 1.0;
            sums[0] += w;
            sums[1] -= w * t->logp[i];
        }
    }
    const double mine = sums[1];
    if (t->ranks > 1) TRY(lm_comm_all_reduce_sum(t->comm, sums, sums, 4, LM_DTYPE_F64));
    if (sums[3] > 0)
        return *fs && *fs != LM_ERR_NUMERIC ? *fs
                                             : lm_error(LM_ERR_ARG, "the forward failed on another rank of the job");
    if (sums[2] > 0) {
        *fs = LM_ERR_NUMERIC;
        return LM_OK;
    }
    const double scale = 1.0 / (sums[0] * t->cfg.grad_accum);
    for (size_t i = 0; i < n; i++) t->dlogp[i] = (float)(-(ans[i] ? W : 1.0) * scale);
    *loss = (float)(t->ranks * mine / sums[0]);
    return LM_OK;
}

static void split_batch(const int32_t *seq, int B, int T, int t0, int len, int32_t *inp, int32_t *tgt) {
    for (int b = 0; b < B; b++) {
        memcpy(inp + (size_t)b * len, seq + (size_t)b * (T + 1) + t0, (size_t)len * sizeof(int32_t));
        memcpy(tgt + (size_t)b * len, seq + (size_t)b * (T + 1) + t0 + 1, (size_t)len * sizeof(int32_t));
    }
}

/* ---- checkpoints ---- */

/* The bound of every optimizer moment and balancing value a checkpoint may
 * hold: far beyond any real run (moments of clipped gradients), far below
 * where an update overflows. */
#define STATE_BOUND 1e30f

/* LM_OK when x[0..n), elements [first, first + n) of tensor `name`, are
 * finite and within +-bound (bound 0: finite only). */
static lm_status check_floats_at(const char *file, const char *name, const float *x, size_t first, size_t n,
                                 float bound) {
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i]))
            return lm_error(LM_ERR_NUMERIC, "%s: tensor '%s' holds a non-finite value (element %zu)", file, name,
                            first + i);
        if (bound > 0 && fabsf(x[i]) > bound)
            return lm_error(LM_ERR_NUMERIC, "%s: tensor '%s' holds %g at element %zu, outside [-%g, %g]", file, name,
                            (double)x[i], first + i, (double)bound, (double)bound);
    }
    return LM_OK;
}
static lm_status check_floats(const char *file, const char *name, const float *x, size_t n, float bound) {
    return check_floats_at(file, name, x, 0, n, bound);
}


/* A JSON string literal of s. */
static void put_json_string(lm_text *t, const char *s) {
    lm_text_puts(t, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') lm_text_printf(t, "\\%c", c);
        else if (c < 0x20) lm_text_printf(t, "\\u%04x", c);
        else lm_text_put(t, s, 1);
    }
    lm_text_puts(t, "\"");
}

/* trainer.json of a checkpoint into directory `tmp`: counters and the data's fingerprint. */
static lm_status write_trainer_json(trainer *t, const char *tmp) {
    char path[4200];
    lm_text text = {0};
    lm_text_printf(&text,
                   "{\"step\": %lld, \"data_position\": %lld, \"skipped\": %lld, \"muon_step\": %lld, "
                   "\"adam_step\": %lld, \"balance\": [",
                   (long long)t->step, (long long)t->data_pos, (long long)t->skipped, (long long)t->muon.step,
                   (long long)t->adam.step);
    for (int i = 0; i < t->n_moe; i++) {
        lm_balance_state *b = lm_model_balance(t->model, i);
        lm_text_printf(&text, "%s{\"step\": %lld, \"interval_steps\": %d}", i ? ", " : "", (long long)b->step,
                       b->interval_steps);
    }
    lm_text_puts(&text, "],\n \"data\": [");
    for (int i = 0; i < t->n_prints; i++) {
        lm_text_printf(&text, "%s{\"spec\": ", i ? ",\n  " : "");
        put_json_string(&text, t->print_spec[i]);
        lm_text_puts(&text, ", \"files\": [");
        for (int j = 0; j < t->print_n[i]; j++) {
            const lm_data_file *f = &t->print_files[i][j];
            lm_text_printf(&text, "%s{\"name\": ", j ? ",\n   " : "\n   ");
            put_json_string(&text, f->name);
            lm_text_printf(&text, ", \"bytes\": %lld, \"checksum\": \"%016llx\"}", (long long)f->bytes,
                           (unsigned long long)f->checksum);
        }
        lm_text_puts(&text, "]}");
    }
    lm_text_puts(&text, "]}\n");
    if (text.failed) {
        lm_text_free(&text);
        return lm_error(LM_ERR_MEMORY, "out of memory writing trainer.json");
    }
    snprintf(path, sizeof path, "%s/trainer.json", tmp);
    lm_status s = lm_write_text_atomic(path, text.s);
    lm_text_free(&text);
    return s;
}

/* ZeRO-1's ranges cross to rank 0 in chunks of at most this many floats (16 MiB). */
#define CKPT_CHUNK_FLOATS ((size_t)1 << 22)

/* A checkpoint's data on its way to rank 0's files: rank 0 checks each piece
 * (every value finite, the optimizer state's within STATE_BOUND) and appends
 * it to the open file. Its first failure (a non-finite value, a file error)
 * is kept in `bad` / `msg` and the later pieces are only exchanged, never
 * written, so a failure on rank 0 leaves no other rank waiting. */
typedef struct {
    trainer *t;
    lm_st_stream *st; /* rank 0: the file being written */
    lm_status bad;
    char what[64], msg[1024];
} ckpt_out;

static void ckpt_fail(ckpt_out *o, lm_status s) {
    if (o->bad || !s) return;
    o->bad = s;
    snprintf(o->msg, sizeof o->msg, "%s", lm_last_error());
}

/* Rank 0: elements [first, first + n) of tensor `name` into the file. */
static void ckpt_put(ckpt_out *o, const char *name, size_t first, const float *x, size_t n, float bound) {
    if (o->bad) return;
    lm_status s = check_floats_at(o->what, name, x, first, n, bound);
    if (!s) s = lm_st_stream_write(o->st, x, n * sizeof(float));
    ckpt_fail(o, s);
}

/* rank q of comm sends `count` floats at `send` to rank 0 of comm, which
 * receives them at `recv` (an all-to-all with nothing sent elsewhere). */
static lm_status send_to_first(trainer *t, lm_comm *c, int q, const float *send, size_t count, float *recv) {
    const int R = lm_comm_size(c), me = lm_comm_rank(c);
    size_t *sb = t->ztab, *rb = sb + R, zero_off[LM_DP_MAX_RANKS] = {0};
    for (int r = 0; r < R; r++) {
        sb[r] = r == 0 && me == q ? count * sizeof(float) : 0;
        rb[r] = r == q && me == 0 ? count * sizeof(float) : 0;
    }
    return lm_comm_all_to_allv(c, send, sb, zero_off, recv, rb, zero_off);
}

/* Every rank of comm sends `count` floats to rank 0, which receives them one
 * after the other in rank order at `recv`. */
static lm_status gather_to_first(trainer *t, lm_comm *c, const float *send, size_t count, float *recv) {
    const int R = lm_comm_size(c), me = lm_comm_rank(c);
    size_t *sb = t->ztab, *rb = sb + R, *ro = rb + R, zero_off[LM_DP_MAX_RANKS] = {0};
    for (int q = 0; q < R; q++) {
        sb[q] = q == 0 ? count * sizeof(float) : 0;
        rb[q] = me == 0 ? count * sizeof(float) : 0;
        ro[q] = me == 0 ? (size_t)q * count * sizeof(float) : 0;
    }
    return lm_comm_all_to_allv(c, send, sb, zero_off, recv, rb, ro);
}

/* The floats of rank 0's receive buffer for a checkpoint (0 on other ranks,
 * and where nothing crosses): owner-only experts, the largest routed experts'
 * tensor (a tensor gathered whole, or one part of its state); ZeRO-1, the
 * largest other range, at most a chunk. */
static size_t ckpt_buffer_floats(const trainer *t) {
    size_t most = 0;
    if (t->rank != 0) return 0;
    if (t->epo) {
        for (int i = 0; i < t->n_all; i++)
            if (t->esplit[i] && (size_t)lm_param_numel(&t->all[i]) > most) most = (size_t)lm_param_numel(&t->all[i]);
    } else if (t->zero && t->ranks > 1) {
        for (int q = 1; q < t->ranks; q++) {
            const size_t m = t->zmuon[q + 1] - t->zmuon[q], a = t->zadam[q + 1] - t->zadam[q];
            most = m > most ? m : most;
            most = a > most ? a : most;
        }
        most = most < CKPT_CHUNK_FLOATS ? most : CKPT_CHUNK_FLOATS;
    }
    return most;
}

/* model.safetensors' data in table order: the replicated tensors from rank 0's
 * block; under owner-only experts each expert tensor gathered from the owners
 * of rank 0's group (the other groups hold replicas of it) into the buffer,
 * one tensor at a time. */
static lm_status ckpt_model_data(trainer *t, ckpt_out *o) {
    for (int i = 0; i < t->n_all; i++) {
        const lm_model_tensor *mt = lm_model_tensor_at(t->model, i);
        if (t->epo && t->esplit[i]) {
            if (t->rank >= t->ep) continue;
            size_t first, count;
            const float *mine = lm_model_param_part(t->model, i, &first, &count);
            TRY(gather_to_first(t, ep_group_comm(t), mine, count, t->ckbuf));
            if (t->rank == 0) ckpt_put(o, mt->name, 0, t->ckbuf, mt->numel, 0);
        } else if (t->rank == 0) {
            const float *w = lm_model_tensor_data(t->model, i);
            if (w) ckpt_put(o, mt->name, 0, w, mt->numel, 0);
            else ckpt_fail(o, lm_error(LM_ERR_ARG, "%s: %s is cut to this rank's experts, and the checkpoint does "
                                       "not gather it", o->what, mt->name));
        }
    }
    return LM_OK;
}

/* optim.muon_state (part 0) or optim.adam_state (1), the whole state in its
 * order: rank 0's own; under owner-only experts its replicated pieces and
 * each expert tensor's state part gathered from the owners of rank 0's group
 * (one tensor's part at a time); under ZeRO-1 each owner's range in turn, in
 * chunks. */
static lm_status ckpt_state_data(trainer *t, ckpt_out *o, int part) {
    const char *name = part ? "optim.adam_state" : "optim.muon_state";
    const float *local = part ? t->adam_state : t->muon_state;
    if (t->epo) {
        if (t->rank >= t->ep) return LM_OK;
        for (int k = 0; k < t->n_epiece[part]; k++) {
            const struct epo_piece *pc = &t->epiece[part][k];
            if (!pc->split) {
                if (t->rank == 0) ckpt_put(o, name, pc->whole, local + pc->loc, pc->len, STATE_BOUND);
                continue;
            }
            /* the slices of the owners 0 .. G-1 lie one after the other in the whole state from rank 0's */
            TRY(gather_to_first(t, ep_group_comm(t), local + pc->loc, pc->len, t->ckbuf));
            if (t->rank == 0) ckpt_put(o, name, pc->whole, t->ckbuf, (size_t)t->ep * pc->len, STATE_BOUND);
        }
    } else if (t->zero && t->ranks > 1) {
        const size_t *start = part ? t->zadam : t->zmuon;
        if (t->rank == 0) ckpt_put(o, name, 0, local, start[1] - start[0], STATE_BOUND);
        for (int q = 1; q < t->ranks; q++) {
            const size_t n = start[q + 1] - start[q];
            for (size_t at = 0; at < n; at += CKPT_CHUNK_FLOATS) {
                const size_t c = n - at < CKPT_CHUNK_FLOATS ? n - at : CKPT_CHUNK_FLOATS;
                TRY(send_to_first(t, t->comm, q, t->rank == q ? local + at : NULL, c, t->ckbuf));
                if (t->rank == 0) ckpt_put(o, name, start[q] + at, t->ckbuf, c, STATE_BOUND);
            }
        }
    } else if (t->rank == 0) {
        ckpt_put(o, name, 0, local, part ? t->adam_total_n : t->muon_total_n, STATE_BOUND);
    }
    return LM_OK;
}

/* The files of a checkpoint into directory `tmp` (rank 0's; NULL elsewhere):
 * model.safetensors and config.json, trainer.safetensors (optimizer moments
 * and balancing state), trainer.json. Collective: the tensors cross to rank 0
 * one at a time (ckpt_model_data, ckpt_state_data); a failure on rank 0 goes
 * to o, the ranks' exchanges go on to the end. */
static lm_status write_checkpoint_files(trainer *t, const char *tmp, ckpt_out *o) {
    if (t->rank == 0 && !o->bad) ckpt_fail(o, lm_checkpoint_model_begin(t->model, tmp, &o->st));
    TRY(ckpt_model_data(t, o));
    if (t->rank == 0 && !o->bad) {
        lm_st_stream *st = o->st;
        o->st = NULL;
        ckpt_fail(o, lm_st_stream_commit(st));
        if (!o->bad) ckpt_fail(o, lm_checkpoint_write_config(&t->cfg, tmp));
        if (!o->bad)
            ckpt_fail(o, lm_checkpoint_trainer_begin(t->model, t->muon_total_n, t->adam_total_n, tmp, &o->st));
    }
    TRY(ckpt_state_data(t, o, 0));
    TRY(ckpt_state_data(t, o, 1));
    if (t->rank == 0 && !o->bad) {
        lm_st_stream *st = o->st;
        o->st = NULL;
        ckpt_fail(o, lm_checkpoint_trainer_finish(st, t->model));
        if (!o->bad) ckpt_fail(o, write_trainer_json(t, tmp));
    }
    return LM_OK;
}

/* A checkpoint, written by rank 0 (collective: the other ranks send what only
 * they hold): files under a temporary name, then committed; a failure leaves
 * no partial directory behind (and the previous checkpoint untouched). A
 * checkpoint with a non-finite parameter or optimizer moment is never
 * written: it would replace (and prune) the good ones. */
static lm_status write_checkpoint(trainer *t) {
    TRY(host_params_current(t));
    TRY(download_optimizer_state(t));
    ckpt_out o = {.t = t};
    snprintf(o.what, sizeof o.what, "step %lld", (long long)t->step);
    /* rank 0's receive buffer, for the write only */
    const size_t nbuf = ckpt_buffer_floats(t);
    lm_status s = LM_OK;
    if (nbuf && !(t->ckbuf = malloc(nbuf * sizeof(float))))
        s = lm_error(LM_ERR_MEMORY, "out of memory receiving the checkpoint's tensors (%zu bytes)",
                     nbuf * sizeof(float));
    if ((s = dp_agree(t, s))) {
        free(t->ckbuf);
        t->ckbuf = NULL;
        return s;
    }
    if (nbuf * sizeof(float) > t->ckpt_gathered_bytes) t->ckpt_gathered_bytes = nbuf * sizeof(float);
    char tmp[4096] = {0};
    if (t->rank == 0) ckpt_fail(&o, lm_checkpoint_begin(t->opt.out_dir, t->step, tmp, sizeof tmp));
    s = write_checkpoint_files(t, tmp, &o);
    free(t->ckbuf);
    t->ckbuf = NULL;
    lm_st_stream_abort(o.st);
    if (t->rank != 0) return s;
    if (!s && o.bad) {
        s = o.bad == LM_ERR_NUMERIC
                ? lm_error(o.bad, "%s; the checkpoint is not written and the earlier ones are kept", o.msg)
                : lm_error(o.bad, "%s", o.msg);
    }
    if (s) {
        if (tmp[0]) lm_checkpoint_abort(tmp);
        return s;
    }
    if (t->metrics) fflush(t->metrics);
    TRY(lm_checkpoint_commit(t->opt.out_dir, t->step, tmp, t->cfg.keep_checkpoints));
    if (t->metrics) fprintf(t->metrics, "{\"type\": \"checkpoint\", \"step\": %lld}\n", (long long)t->step);
    return LM_OK;
}

/* The checkpoint of this step: written by rank 0, after every rank's state
 * was checked to be rank 0's by hash (from slices: nothing is gathered for
 * it); the tensors only other ranks hold (owner-only experts, ZeRO-1's
 * optimizer ranges) reach rank 0 one at a time as it writes, so no rank holds
 * more than one expert tensor (or a chunk) beyond its own state: the same
 * files whatever the layout. The ranks learn whether it was written. */
static lm_status save_checkpoint(trainer *t) {
    lm_status s = dp_check_replicas(t);
    if (!s) s = write_checkpoint(t);
    if ((s = dp_agree(t, s))) return s;
    t->saved_step = t->step;
    return LM_OK;
}

/* Copy tensor `name` of `st` into dst (numel floats or ints), checking its
 * dtype and shape: [numel] when ndim is 0, else exactly shape[0..ndim). */
static lm_status load_exact_part(const lm_safetensors *st, const char *file, const char *name, lm_dtype dtype,
                                 void *dst, size_t numel, int ndim, const int64_t *shape, size_t first,
                                 size_t count);
static lm_status load_exact(const lm_safetensors *st, const char *file, const char *name, lm_dtype dtype,
                            void *dst, size_t numel, int ndim, const int64_t *shape) {
    return load_exact_part(st, file, name, dtype, dst, numel, ndim, shape, 0, numel);
}

/* The same, copying only elements [first, first + count) of the tensor to dst. */
static lm_status load_exact_part(const lm_safetensors *st, const char *file, const char *name, lm_dtype dtype,
                                 void *dst, size_t numel, int ndim, const int64_t *shape, size_t first,
                                 size_t count) {
    const lm_st_tensor *t = lm_safetensors_find(st, name);
    if (!t) return lm_error(LM_ERR_FORMAT, "%s: tensor '%s' is missing", file, name);
    if (t->dtype != dtype || (size_t)t->numel != numel)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s' is %s with %lld elements, expected %s with %zu", file, name,
                        lm_dtype_name(t->dtype), (long long)t->numel, lm_dtype_name(dtype), numel);
    int64_t flat[1] = {(int64_t)numel};
    if (!ndim) ndim = 1, shape = flat;
    int same = t->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
    if (!same) {
        char got[160], want[160];
        int g = 0, w = 0;
        for (int d = 0; d < t->ndim && g < 140; d++)
            g += snprintf(got + g, sizeof got - (size_t)g, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        for (int d = 0; d < ndim && w < 140; d++)
            w += snprintf(want + w, sizeof want - (size_t)w, "%s%lld", d ? "," : "", (long long)shape[d]);
        got[g] = want[w] = 0;
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s' has shape [%s], expected [%s] (same element count, "
                        "another layout: refused)", file, name, got, want);
    }
    const size_t el = numel ? t->nbytes / numel : 0;
    if (count) memcpy(dst, (const char *)t->data + first * el, count * el);
    return LM_OK;
}

static lm_status load_params(lm_model *m, const char *dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    lm_safetensors *st;
    TRY(lm_safetensors_open(path, &st));
    lm_status s = LM_OK;
    for (int i = 0; i < lm_model_num_tensors(m) && !s; i++) {
        /* each tensor's part this model keeps (with owner-only expert weights, this rank's experts) */
        const lm_model_tensor *mt = lm_model_tensor_at(m, i);
        size_t first, count;
        float *w = lm_model_param_part(m, i, &first, &count);
        s = load_exact_part(st, path, mt->name, LM_DTYPE_F32, w, mt->numel, mt->ndim, mt->shape, first, count);
        if (!s) s = check_floats(path, mt->name, w, count, 0);
    }
    if (!s && lm_safetensors_count(st) != lm_model_num_tensors(m))
        s = lm_error(LM_ERR_FORMAT, "%s: holds %d tensors, the model has %d", path, lm_safetensors_count(st),
                     lm_model_num_tensors(m));
    lm_safetensors_close(st);
    return s;
}

/* The balancing state of every MoE layer from an open trainer.safetensors. */
static lm_status load_balance(lm_model *m, const lm_safetensors *st, const char *path) {
    lm_status s = LM_OK;
    for (int i = 0; i < lm_model_num_moe_layers(m) && !s; i++) {
        lm_balance_state *b = lm_model_balance(m, i);
        int l = lm_model_moe_layer_index(m, i);
        size_t n = (size_t)b->cfg.n_experts;
        char name[96];
        snprintf(name, sizeof name, "layers.%d.moe.bias", l);
        s = load_exact(st, path, name, LM_DTYPE_F32, b->bias, n, 0, NULL);
        if (!s) s = check_floats(path, name, b->bias, n, STATE_BOUND);
        snprintf(name, sizeof name, "layers.%d.moe.halfwidth", l);
        if (!s) s = load_exact(st, path, name, LM_DTYPE_F32, b->halfwidth, n, 0, NULL);
        if (!s) s = check_floats(path, name, b->halfwidth, n, STATE_BOUND);
        for (size_t j = 0; j < n && !s; j++)
            if (b->halfwidth[j] < 0)
                s = lm_error(LM_ERR_NUMERIC, "%s: tensor '%s' holds %g at element %zu; a half-width is >= 0", path,
                             name, (double)b->halfwidth[j], j);
        snprintf(name, sizeof name, "layers.%d.moe.last_load", l);
        if (!s) s = load_exact(st, path, name, LM_DTYPE_I32, b->last_load, n, 0, NULL);
        for (size_t j = 0; j < n && !s; j++)
            if (b->last_load[j] < 0)
                s = lm_error(LM_ERR_FORMAT, "%s: tensor '%s' holds the negative load %d", path, name, b->last_load[j]);
        snprintf(name, sizeof name, "layers.%d.moe.interval_load", l);
        if (!s) s = load_exact(st, path, name, LM_DTYPE_I64, b->interval_load, n, 0, NULL);
        for (size_t j = 0; j < n && !s; j++)
            if (b->interval_load[j] < 0)
                s = lm_error(LM_ERR_FORMAT, "%s: tensor '%s' holds the negative load %lld", path, name,
                             (long long)b->interval_load[j]);
    }
    return s;
}

lm_status lm_checkpoint_load_model(const char *dir, int B, int T, lm_config *cfg, lm_model **out) {
    return lm_checkpoint_load_model_on(dir, B, T, NULL, cfg, out);
}

lm_status lm_checkpoint_load_model_on(const char *dir, int B, int T, lm_backend *backend, lm_config *cfg,
                                      lm_model **out) {
    char path[4200];
    *out = NULL;
    snprintf(path, sizeof path, "%s/config.json", dir);
    TRY(lm_config_load(path, cfg));
    if (B > 0) cfg->batch_size = B;
    if (T > 0) cfg->seq_len = T;
    TRY(lm_model_create_on(cfg, cfg->batch_size, cfg->seq_len, backend, out));
    lm_status s = load_params(*out, dir);
    /* the loaded host parameters to the backend (a no-op on the CPU) */
    if (!s) s = lm_model_upload_params(*out);
    if (!s && lm_model_num_moe_layers(*out)) {
        /* the trained balancing biases route at evaluation and inference (frozen) */
        snprintf(path, sizeof path, "%s/trainer.safetensors", dir);
        lm_safetensors *st;
        s = lm_safetensors_open(path, &st);
        if (!s) {
            s = load_balance(*out, st, path);
            lm_safetensors_close(st);
        }
    }
    if (s) {
        lm_model_free(*out);
        *out = NULL;
    }
    return s;
}

static int64_t json_int(const lm_json *o, const char *key, int *ok) {
    const lm_json *v = lm_json_get(o, key);
    if (!v || v->kind != LM_JSON_NUMBER || !v->number_is_integer) {
        *ok = 0;
        return 0;
    }
    return v->integer;
}

/* The data's fingerprint recorded in trainer.json (`data`, NULL in checkpoints
 * of earlier versions: accepted unverified) against the one taken at this
 * start. A difference is refused naming the spec and the file, unless
 * opt.accept_data_change (then reported and the new fingerprint recorded). */
static lm_status check_data(trainer *t, const lm_json *data, const char *path) {
    if (!data) return LM_OK;
    if (data->kind != LM_JSON_ARRAY) return lm_error(LM_ERR_FORMAT, "%s: 'data' is not an array", path);
    char why[1024] = "";
    const char *spec = NULL;
    for (int i = 0; i < t->n_prints && !why[0]; i++) {
        spec = t->print_spec[i];
        const lm_json *rec = NULL;
        for (const lm_json *e = data->child; e && !rec; e = e->next) {
            const lm_json *sp = lm_json_get(e, "spec");
            if (sp && sp->kind == LM_JSON_STRING && !strcmp(sp->string, spec)) rec = e;
        }
        const lm_json *files = rec ? lm_json_get(rec, "files") : NULL;
        if (!files || files->kind != LM_JSON_ARRAY) {
            snprintf(why, sizeof why, "the checkpoint records no files for it");
            break;
        }
        const lm_json *e = files->child;
        for (int j = 0; j < t->print_n[i] && !why[0]; j++, e = e ? e->next : NULL) {
            const lm_data_file *f = &t->print_files[i][j];
            const lm_json *nm = e ? lm_json_get(e, "name") : NULL, *by = e ? lm_json_get(e, "bytes") : NULL,
                          *ck = e ? lm_json_get(e, "checksum") : NULL;
            if (!e) {
                snprintf(why, sizeof why, "file '%s' (%lld bytes) was added", f->name, (long long)f->bytes);
            } else if (!nm || nm->kind != LM_JSON_STRING || !by || by->kind != LM_JSON_NUMBER ||
                       !by->number_is_integer || !ck || ck->kind != LM_JSON_STRING) {
                return lm_error(LM_ERR_FORMAT, "%s: data[\"%s\"].files[%d] lacks name, bytes or checksum", path, spec,
                                j);
            } else if (strcmp(nm->string, f->name)) {
                snprintf(why, sizeof why, "file '%s' is now '%s'", nm->string, f->name);
            } else {
                char now[17];
                snprintf(now, sizeof now, "%016llx", (unsigned long long)f->checksum);
                if (by->integer != f->bytes || strcmp(ck->string, now))
                    snprintf(why, sizeof why, "shard '%s' changed: it has %lld bytes and checksum %s, the checkpoint "
                             "recorded %lld bytes and checksum %.16s", f->name, (long long)f->bytes, now,
                             (long long)by->integer, ck->string);
            }
        }
        if (!why[0] && e) {
            const lm_json *nm = lm_json_get(e, "name");
            snprintf(why, sizeof why, "file '%s' is gone", nm && nm->kind == LM_JSON_STRING ? nm->string : "?");
        }
    }
    if (!why[0]) return LM_OK;
    if (!t->opt.accept_data_change)
        return lm_error(LM_ERR_ARG, "data '%s' differs from what the run trained on (%s): %s; restore it, or "
                        "continue on the new data with --accept-data-change (the batches then differ from an "
                        "uninterrupted run's)", spec, path, why);
    fprintf(t->opt.progress ? t->opt.progress : stderr, "warning: data '%s' changed since the checkpoint: %s; "
            "continuing on it (--accept-data-change)\n", spec, why);
    return LM_OK;
}

/* Under ZeRO-1: this rank's piece [off, off + n) of the whole optimizer state
 * `name` (F32 [total], as any layout writes it). */
static lm_status load_state_range(const lm_safetensors *st, const char *file, const char *name, float *dst,
                                  size_t total, size_t off, size_t n) {
    const lm_st_tensor *t = lm_safetensors_find(st, name);
    if (!t) return lm_error(LM_ERR_FORMAT, "%s: tensor '%s' is missing", file, name);
    if (t->dtype != LM_DTYPE_F32 || (size_t)t->numel != total || t->ndim != 1)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s' is %s with %lld elements in %d dimensions, expected F32 "
                        "with %zu in one", file, name, lm_dtype_name(t->dtype), (long long)t->numel, t->ndim, total);
    if (n) memcpy(dst, (const float *)t->data + off, n * sizeof(float));
    return check_floats(file, name, dst, n, STATE_BOUND);
}

static lm_status load_checkpoint(trainer *t, const char *dir) {
    char path[4200];
    TRY(load_params(t->model, dir));
    snprintf(path, sizeof path, "%s/trainer.safetensors", dir);
    lm_safetensors *st;
    TRY(lm_safetensors_open(path, &st));
    lm_status s = LM_OK;
    if (t->epo) {
        /* whatever layout wrote it: each rank takes the replicated tensors' state and its experts' slices */
        for (int part = 0; part < 2 && !s; part++)
            for (int k = 0; k < t->n_epiece[part] && !s; k++) {
                const struct epo_piece *pc = &t->epiece[part][k];
                s = load_state_range(st, path, part ? "optim.adam_state" : "optim.muon_state",
                                     (part ? t->adam_state : t->muon_state) + pc->loc,
                                     part ? t->adam_total_n : t->muon_total_n, pc->whole, pc->len);
            }
    } else if (t->zero) {
        /* whatever layout wrote it: each rank takes its range */
        const int zr = zero_range(t);
        s = load_state_range(st, path, "optim.muon_state", t->muon_state, t->muon_total_n, t->zmuon[zr],
                             t->muon_state_n);
        if (!s) s = load_state_range(st, path, "optim.adam_state", t->adam_state, t->adam_total_n, t->zadam[zr],
                                     t->adam_state_n);
    } else {
        s = load_exact(st, path, "optim.muon_state", LM_DTYPE_F32, t->muon_state, t->muon_state_n, 0, NULL);
        if (!s) s = check_floats(path, "optim.muon_state", t->muon_state, t->muon_state_n, STATE_BOUND);
        if (!s) s = load_exact(st, path, "optim.adam_state", LM_DTYPE_F32, t->adam_state, t->adam_state_n, 0, NULL);
        if (!s) s = check_floats(path, "optim.adam_state", t->adam_state, t->adam_state_n, STATE_BOUND);
    }
    if (!s) s = load_balance(t->model, st, path);
    lm_safetensors_close(st);
    if (s) return s;
    snprintf(path, sizeof path, "%s/trainer.json", dir);
    char *text;
    size_t len;
    TRY(lm_read_file(path, LM_TEXT_FILE_MAX, &text, &len));
    lm_json_doc *doc;
    s = lm_json_parse(text, len, path, &doc);
    free(text);
    if (s) return s;
    const lm_json *r = lm_json_root(doc);
    int ok = 1;
    t->step = json_int(r, "step", &ok);
    t->data_pos = json_int(r, "data_position", &ok);
    t->skipped = json_int(r, "skipped", &ok);
    t->muon.step = json_int(r, "muon_step", &ok);
    t->adam.step = json_int(r, "adam_step", &ok);
    const lm_json *bal = lm_json_get(r, "balance");
    if (!bal || bal->kind != LM_JSON_ARRAY || (int)bal->count != t->n_moe) ok = 0;
    int i = 0;
    for (const lm_json *e = bal ? bal->child : NULL; e && ok; e = e->next, i++) {
        lm_balance_state *b = lm_model_balance(t->model, i);
        b->step = json_int(e, "step", &ok);
        b->interval_steps = (int)json_int(e, "interval_steps", &ok);
    }
    lm_status ds = ok ? check_data(t, lm_json_get(r, "data"), path) : LM_OK;
    lm_json_free(doc);
    if (ds) return ds;
    if (!ok || t->step < 0 || t->data_pos < 0)
        return lm_error(LM_ERR_FORMAT, "%s: missing or bad counters (step, data_position, skipped, "
                        "muon_step, adam_step, balance)", path);
    /* the counters agree with each other and with the directory's name */
    const char *base = strrchr(dir, '/');
    base = base ? base + 1 : dir;
    long long named = -1;
    int end = 0;
    if (sscanf(base, "checkpoint-%lld%n", &named, &end) != 1 || base[end] || named != t->step)
        return lm_error(LM_ERR_FORMAT, "%s: step %lld disagrees with its checkpoint's name '%s'", path,
                        (long long)t->step, base);
    int64_t most_batches = t->step * (int64_t)t->cfg.grad_accum;
    if (t->data_pos < t->step || t->data_pos > most_batches || t->skipped < 0 || t->skipped > t->step ||
        t->muon.step < 0 || t->muon.step > t->step || t->adam.step < 0 || t->adam.step > t->step)
        return lm_error(LM_ERR_FORMAT, "%s: counters disagree with step %lld (data_position %lld must lie in [step, "
                        "step x grad_accum], skipped, muon_step and adam_step in [0, step])", path,
                        (long long)t->step, (long long)t->data_pos);
    for (int j = 0; j < t->n_moe; j++)
        if (lm_model_balance(t->model, j)->step < 0 || lm_model_balance(t->model, j)->step > t->step)
            return lm_error(LM_ERR_FORMAT, "%s: balance[%d].step %lld lies outside [0, %lld]", path, j,
                            (long long)lm_model_balance(t->model, j)->step, (long long)t->step);
    return LM_OK;
}

/* Keep the metrics lines of steps <= `step` (a resumed run rewrites what came
 * after). redo_end: the resumed run trains no step and repeats the end of the
 * run (evaluation, checkpoint, grids), so the lines of `step` other than its
 * train, skip and stage lines are dropped too: each record once. */
static lm_status truncate_metrics(const char *path, int64_t step, int redo_end) {
    char *text;
    size_t len;
    if (lm_read_file(path, LM_TEXT_FILE_MAX, &text, &len)) return LM_OK; /* no metrics yet */
    char *out = malloc(len + 1);
    if (!out) {
        free(text);
        return lm_error(LM_ERR_MEMORY, "out of memory rewriting '%s'", path);
    }
    size_t n = 0;
    for (char *line = text; *line;) {
        char *nl = strchr(line, '\n');
        if (!nl) break; /* a torn last line */
        const char *sp = strstr(line, "\"step\": ");
        long long s = sp && sp < nl ? atoll(sp + 8) : 0;
        static const char *const kept[3] = {"{\"type\": \"train\"", "{\"type\": \"skip\"", "{\"type\": \"stage\""};
        int kept_type = 0;
        for (int k = 0; k < 3; k++) kept_type |= !strncmp(line, kept[k], strlen(kept[k]));
        if (s < step || (s == step && (!redo_end || kept_type))) {
            memcpy(out + n, line, (size_t)(nl - line + 1));
            n += (size_t)(nl - line + 1);
        }
        line = nl + 1;
    }
    out[n] = 0;
    lm_status st = lm_write_text_atomic(path, out);
    free(out);
    free(text);
    return st;
}
/* ---- the loop ---- */

static void format_eta(char *buf, size_t n, double seconds) {
    if (!isfinite(seconds) || seconds < 0) seconds = 0;
    long s = (long)(seconds + 0.5);
    if (s >= 3600) snprintf(buf, n, "%ldh%02ldm", s / 3600, (s / 60) % 60);
    else snprintf(buf, n, "%ldm%02lds", s / 60, s % 60);
}

/* Validation loss and answer accuracy on val_batches held-out batches at the
 * model's shape (the eval module's scoring), without charging the time to the
 * training components; the {"type": "eval"} line goes to the metrics log. */
static lm_status evaluate(trainer *t, float *loss, float *acc) {
    double before[LM_TIME_COUNT], after[LM_TIME_COUNT];
    /* owner-only experts: the evaluation forward runs every expert, each MoE
     * layer's gathered over the group for that layer only
     * (lm_model_gather_experts_by_layer; every rank runs as many forwards) */
    /* the device's parameters as they are: the scoring runs there (lm_model_score) */
    lm_model_timings(t->model, before);
    (void)lm_model_gathered_peak_bytes(t->model, 1);
    lm_eval_tally tally;
    /* each rank scores its share of every validation batch; the tallies are summed */
    const int nb = lm_eval_options_default().n_buckets;
    lm_status s = t->cp > 1 ? lm_eval_loss_segment(t->model, t->val, t->opt.val_batches, nb, t->B,
                                                   t->dp_rank * share_B(t), t->T, t->seg_t0, t->cp_comm, &tally)
                            : lm_eval_loss_rows(t->model, t->val, t->opt.val_batches, nb, t->B,
                                                t->dp_rank * share_B(t), &tally);
    lm_model_timings(t->model, after);
    const size_t held = lm_model_gathered_peak_bytes(t->model, 0);
    t->eval_gathered_bytes = held > t->eval_gathered_bytes ? held : t->eval_gathered_bytes;
    for (int i = 0; i < LM_TIME_COUNT; i++) t->eval_seconds[i] += after[i] - before[i];
    if ((s = dp_agree(t, s)) || (s = dp_reduce_tally(t, &tally))) return s;
    lm_eval_result *r = calloc(1, sizeof *r);
    if (!r) return lm_error(LM_ERR_MEMORY, "out of memory (evaluation result)");
    r->step = t->step;
    snprintf(r->val_data, sizeof r->val_data, "%s", val_spec_of(t, t->stage));
    r->val_length = t->T;
    lm_eval_result_set_validation(r, &tally);
    *loss = (float)r->val_loss;
    *acc = (float)r->answer_accuracy;
    if (t->metrics) lm_eval_write_validation(r, t->metrics);
    free(r);
    return LM_OK;
}

static void log_eval(trainer *t, float loss, float acc) {
    if (t->opt.progress && isfinite(acc))
        fprintf(t->opt.progress, "eval  step %lld | val loss %.4f | %s answer accuracy %.1f%%\n", (long long)t->step,
                loss, t->val->name, 100.0 * acc);
    else if (t->opt.progress) /* plain text has no answer positions */
        fprintf(t->opt.progress, "eval  step %lld | val loss %.4f | %s\n", (long long)t->step, loss, t->val->name);
}

/* Long-context evaluation of the checkpoint just written at a stage end:
 * passkey (length x depth) and MQAR at the lengths of the stages so far, into
 * the metrics log (docs/eval.md). Their rows are bytes: byte-vocabulary
 * models only. */
static lm_status stage_evaluation(trainer *t) {
    const int batches = t->opt.stage_eval_batches >= 0 ? t->opt.stage_eval_batches : (t->cfg.grid_rows + 1) / 2;
    if (t->cfg.vocab_size != 256 || batches <= 0) return LM_OK;
    if (t->rank > 0) return dp_agree(t, LM_OK); /* rank 0 evaluates the checkpoint it wrote */
    lm_eval_options eo = lm_eval_options_default();
    eo.tasks = LM_EVAL_PASSKEY | LM_EVAL_MQAR;
    eo.n_lengths = 0;
    for (int i = 0; i <= t->stage && eo.n_lengths < LM_EVAL_MAX_GRID; i++) {
        int seen = 0;
        for (int j = 0; j < eo.n_lengths; j++) seen |= eo.lengths[j] == t->stages[i].seq_len;
        if (!seen) eo.lengths[eo.n_lengths++] = t->stages[i].seq_len;
    }
    eo.batches = batches;
    eo.batch_size = 2;
    eo.backend = t->be; /* on the training device (NULL: the CPU) */
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/checkpoint-%08lld", t->opt.out_dir, (long long)t->step);
    fflush(t->metrics);
    lm_status s = lm_eval_checkpoint(dir, &eo, t->metrics, t->opt.progress);
    fflush(t->metrics);
    return dp_agree(t, s);
}

/* Fold the model's component timings (less evaluations) into the run's totals. */
static void bank_timings(trainer *t, double *acc) {
    double now[LM_TIME_COUNT];
    lm_model_timings(t->model, now);
    for (int i = 0; i < LM_TIME_COUNT; i++) acc[i] += now[i] - t->eval_seconds[i];
    memset(t->eval_seconds, 0, sizeof t->eval_seconds);
    lm_model_reset_timings(t->model);
}

static void log_stage(trainer *t) {
    const lm_stage *st = &t->stages[t->stage];
    if (t->metrics) fprintf(t->metrics, "{\"type\": \"stage\", \"step\": %lld, \"stage\": %d, \"name\": \"%s\", \"seq_len\": %d, "
            "\"batch_size\": %d, \"steps\": %lld, \"lr_scale\": %.6g}\n", (long long)t->step, t->stage, st->name,
            st->seq_len, t->B, (long long)st->steps, st->lr_scale);
    if (t->opt.progress)
        fprintf(t->opt.progress, "stage %d/%d '%s': %lld steps of %d x %d tokens, data %s%s\n", t->stage + 1,
                t->n_stages, st->name, (long long)st->steps, t->B, t->T, st->n_data ? st->data[0] : t->cfg.data,
                st->n_data > 1 ? " (+ mix)" : "");
}

/* The config as every checkpoint saves it (config.json) must read back to
 * itself before a step is trained: a value that parses but does not survive
 * the round trip (a float overflowing to inf, say) would make every
 * checkpoint of the run unloadable. */
static lm_status check_config_round_trip(const lm_config *c) {
    char *saved = lm_config_to_json(c), *again = NULL;
    if (!saved) return lm_error(LM_ERR_MEMORY, "out of memory writing the config");
    lm_config back;
    lm_config_defaults(&back);
    lm_status s = lm_config_parse(saved, strlen(saved), "config.json as saved", &back);
    if (s) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        s = lm_error(LM_ERR_ARG, "the config does not survive saving, so no checkpoint of this run could be loaded: "
                     "%s; nothing was written", msg);
    } else if (!(again = lm_config_to_json(&back))) {
        s = lm_error(LM_ERR_MEMORY, "out of memory writing the config");
    } else if (strcmp(saved, again)) {
        /* name the first line that changed */
        const char *a = saved, *b = again;
        while (*a && *a == *b) a++, b++;
        while (a > saved && a[-1] != '\n') a--, b--;
        int la = (int)strcspn(a, "\n"), lb = (int)strcspn(b, "\n");
        s = lm_error(LM_ERR_ARG, "the config changes when saved and read back ('%.*s' becomes '%.*s'): a value "
                     "outside what the checkpoint can hold; nothing was written", la, a, lb, b);
    }
    free(saved);
    free(again);
    return s;
}

lm_status lm_train(const lm_config *cfg_in, const lm_train_options *opt_in, lm_train_result *result) {
    trainer t;
    memset(&t, 0, sizeof t);
    lm_status s = LM_OK;
    char path[4200], ckpt[4096] = "";
    double comp[LM_TIME_COUNT] = {0};
    int lock = -1;
    /* data parallel: rank 0 alone prints progress and writes the run directory */
    lm_train_options opt_here = *opt_in;
    const lm_train_options *opt = &opt_here;
    t.comm = opt_in->comm ? lm_comm_host(opt_in->comm) : NULL;
    t.dcomm = opt_in->comm && lm_comm_engine_of(opt_in->comm) == LM_COMM_NCCL ? opt_in->comm : NULL;
    t.staged = opt_in->comm && lm_comm_engine_of(opt_in->comm) == LM_COMM_MPI &&
               (opt_in->device == LM_DEVICE_CUDA || opt_in->backend);
    t.rank = t.comm ? lm_comm_rank(t.comm) : 0;
    t.ranks = t.comm ? lm_comm_size(t.comm) : 1;
    t.saved_step = -1;
    t.zero = opt_in->zero == 1 && t.comm;
    /* expert parallelism without ZeRO-1: the experts' optimizer state on their owners only
     * (under ZeRO-1 the ranges already hold every tensor's state once) */
    t.ep = opt_in->expert_parallel ? (opt_in->ep_group > 0 ? opt_in->ep_group : t.ranks) : 0;
    t.ep_pos = t.ep > 0 ? t.rank % t.ep : 0;
    t.epo = opt_in->expert_parallel && !opt_in->ep_replicated_state && !t.zero && t.comm && t.ep > 1;
    if (t.rank > 0) opt_here.progress = NULL;
    if (t.ranks > LM_DP_MAX_RANKS) { /* every rank, before any collective */
        s = lm_error(LM_ERR_ARG, "data parallel: %d ranks, at most %d", t.ranks, LM_DP_MAX_RANKS);
        goto done;
    }
    t.cfg = *cfg_in;
    t.opt = *opt;
    /* one trainer per run directory; a fresh run only into an empty one */
    if (t.rank == 0) {
        s = lm_ensure_dir(opt->out_dir);
        if (!s) s = lm_run_lock(opt->out_dir, &lock);
        if (!s && !opt->resume) s = lm_run_check_fresh(opt->out_dir);
        if (!s && opt->resume) s = lm_checkpoint_latest(opt->out_dir, ckpt, sizeof ckpt);
    }
    if ((s = dp_agree(&t, s))) goto done;
    /* every rank resumes from the checkpoint rank 0 found; a failure on one
     * rank until the loop starts is agreed on before it (dp_in_setup) */
    if (t.ranks > 1 && opt->resume && (s = lm_comm_broadcast(t.comm, ckpt, sizeof ckpt, 0))) goto done;
    t.dp_in_setup = t.ranks > 1;
    if (opt->resume) {
        snprintf(path, sizeof path, "%s/config.json", ckpt);
        lm_config saved;
        if ((s = lm_config_load(path, &saved))) goto done;
        t.cfg = saved;
    }
    if (opt->steps > 0) {
        if (t.cfg.n_stages) {
            s = lm_error(LM_ERR_ARG, "--steps cannot change a staged run: edit the steps of train.stages");
            goto done;
        }
        t.cfg.steps = opt->steps;
    }
    if ((s = check_config_round_trip(&t.cfg))) goto done;
    t.n_stages = lm_config_stages(&t.cfg, t.stages);
    t.total_steps = lm_config_total_steps(&t.cfg);
    if ((s = dp_check(&t))) goto done;
    /* the groups: cp consecutive ranks each (one rank each without context parallelism) */
    t.cp = opt->context_parallel > 1 ? opt->context_parallel : 1;
    t.cp_rank = t.rank % t.cp;
    t.dp_rank = t.rank / t.cp;
    t.dp_groups = t.ranks / t.cp;
    if ((s = trainer_setup(&t, 0))) goto done;
    /* the data's fingerprint goes into checkpoints (rank 0's) and is checked on resume there */
    if (t.rank == 0 && (s = fingerprint_data(&t))) goto done;
    lm_model_init(t.model, t.cfg.seed);
    snprintf(path, sizeof path, "%s/metrics.jsonl", opt->out_dir);
    if (opt->resume) {
        if ((s = load_checkpoint(&t, ckpt))) goto done;
        t.saved_step = t.step;
        /* the loaded host parameters to the device (a no-op on the CPU) */
        if ((s = lm_model_upload_params(t.model))) goto done;
        if ((s = upload_optimizer_state(&t))) goto done;
        int64_t stop_at = opt->stop_after > 0 && opt->stop_after < t.total_steps ? opt->stop_after : t.total_steps;
        if (t.rank == 0 && (s = truncate_metrics(path, t.step, t.step >= stop_at))) goto done;
        if (opt->progress) fprintf(opt->progress, "resumed from %s at step %lld\n", ckpt, (long long)t.step);
    } else if (t.rank == 0) {
        /* a fresh run starts a fresh log and writes its config */
        char *json = lm_config_to_json(&t.cfg);
        char cpath[4200];
        snprintf(cpath, sizeof cpath, "%s/config.json", opt->out_dir);
        s = json ? lm_write_text_atomic(cpath, json) : lm_error(LM_ERR_MEMORY, "out of memory");
        free(json);
        if (s) goto done;
        if ((s = lm_write_text_atomic(path, ""))) goto done;
    }
    t.metrics = t.rank == 0 ? fopen(path, "ab") : NULL;
    if (t.rank == 0 && !t.metrics) {
        s = lm_error(LM_ERR_IO, "cannot open '%s' for appending", path);
        goto done;
    }
    /* the stage of the (resumed) step, and its data */
    int first = stage_of(&t, t.step);
    if ((s = first ? switch_stage(&t, first) : open_data(&t, 0))) goto done;
    /* gradient buckets: one plan for every stage (the tensors stay) */
    t.bucketed = bucket_wanted(&t);
    if ((s = bucket_plan(&t))) goto done;
    t.dp_in_setup = 0;
    if ((s = dp_agree(&t, LM_OK))) goto done;
    const lm_config *c = &t.cfg;
    lm_lr_schedule sched = lm_lr_schedule_default(1.0f);
    sched.kind = c->schedule == LM_SCHEDULE_WSD ? LM_LR_WSD : LM_LR_COSINE;
    sched.warmup_frac = c->warmup_frac;
    sched.min_lr_ratio = c->min_lr_ratio;
    sched.decay_frac = c->decay_frac;
    if ((s = lm_lr_schedule_check(&sched))) goto done;
    const float muon_lr = c->lr, adam_lr = c->adam_lr;
    double ema_step = 0, t_start = lm_time_seconds();
    int bad_in_row = 0;
    uint64_t gnorm_hash = 0xcbf29ce484222325ull; /* the global norms of this call's steps, bit for bit */
    double opt_seconds = 0, step_seconds = 0;
    int64_t tokens_done = 0;
    lm_model_reset_timings(t.model);
    float last_loss = NAN, val_loss = NAN, val_acc = NAN;
    const int on_gpu = opt->device == LM_DEVICE_CUDA;
    if (opt->progress && !opt->resume && !on_gpu)
        fprintf(opt->progress, "training %zu parameters (%d tensors), %lld steps in %d stage%s; %d threads "
                "(OMP_WAIT_POLICY=%s)\n", lm_model_num_params(t.model), t.n_all, (long long)t.total_steps, t.n_stages,
                t.n_stages > 1 ? "s" : "", omp_get_max_threads(),
                getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "unset: the runtime's default");
    if (opt->progress && on_gpu)
        fprintf(opt->progress, "training %zu parameters (%d tensors), %lld steps in %d stage%s on the GPU (forward "
                "and backward; optimizer on the %s)\n", lm_model_num_params(t.model), t.n_all,
                (long long)t.total_steps, t.n_stages, t.n_stages > 1 ? "s" : "", t.dev_opt ? "GPU" : "host");
    if (opt->progress && !opt->resume) {
        /* what the activations keep, and the model's memory plan at the first stage's shape */
        char sz[32];
        int mB = 0, mT = 0;
        lm_model_shape(t.model, &mB, &mT);
        fprintf(opt->progress, "memory: train.recompute = %s, recompute_chunk %d, seq_segment %d; the model's plan %s "
                "at %d x %d tokens (longmoe plan --memory lists every buffer)\n", lm_recompute_json(c->recompute),
                c->recompute_chunk, c->seq_segment, size_text((double)lm_model_plan_bytes(t.model), sz, sizeof sz), mB,
                mT);
    }
    if (opt->progress && t.ranks > 1 && t.cp == 1)
        fprintf(opt->progress, "data parallel over %d ranks: each takes %d of the %d sequences of a micro-batch\n",
                t.ranks, share_B(&t), t.B);
    if (opt->progress && t.bucketed)
        fprintf(opt->progress, "gradients summed over the ranks in %d bucket%s of about %g MiB as the last backward of "
                "a step finishes them%s\n", t.n_bk, t.n_bk > 1 ? "s" : "", (double)c->grad_bucket_mb,
                t.staged ? ", staged through the host" : t.dcomm ? ", on a stream of their own" : "");
    if (opt->progress && t.cp > 1) {
        int64_t start[LM_DP_MAX_RANKS + 1];
        if (!lm_config_cp_split(&t.cfg, t.T, t.cp, opt->cp_split, start)) {
            int64_t lo = t.T, hi = 0;
            for (int r = 0; r < t.cp; r++) {
                const int64_t n = start[r + 1] - start[r];
                lo = n < lo ? n : lo;
                hi = n > hi ? n : hi;
            }
            fprintf(opt->progress, "context parallel: %d group%s of %d ranks; a group takes %d of the %d sequences "
                    "of a micro-batch, each of its ranks a segment of %lld to %lld of the %d tokens (%s split",
                    t.dp_groups, t.dp_groups > 1 ? "s" : "", t.cp, share_B(&t), t.B, (long long)lo, (long long)hi,
                    t.T, lm_cp_split_name(opt->cp_split));
            if (opt->cp_split == LM_CP_SPLIT_BALANCED)
                for (int r = 0; r < t.cp; r++)
                    fprintf(opt->progress, "%s%lld", r ? ", " : ": ", (long long)(start[r + 1] - start[r]));
            fprintf(opt->progress, ")\n");
        }
    }
    if (opt->progress && t.zero) {
        /* the optimizer state a rank holds: every range's (rank 0 knows the cut) */
        size_t lo = zero_state_bytes(&t, 0), hi = lo, whole = (t.muon_total_n + t.adam_total_n) * sizeof(float);
        for (int q = 1; q < t.ranks; q++) {
            size_t b = zero_state_bytes(&t, q);
            lo = b < lo ? b : lo;
            hi = b > hi ? b : hi;
        }
        fprintf(opt->progress, "ZeRO-1: optimizer state %.3f to %.3f MiB a rank over %d ranks (rank 0: %.3f MiB) "
                "instead of %.3f MiB on every rank\n", lo / 1048576.0, hi / 1048576.0, t.ranks,
                zero_state_bytes(&t, 0) / 1048576.0, whole / 1048576.0);
    }
    if (opt->progress && t.ep && t.ep < t.ranks)
        fprintf(opt->progress, "expert parallel in %d groups of %d ranks: each rank owns %d of the %d routed experts "
                "of a layer, each expert on %d ranks\n", t.ranks / t.ep, t.ep, t.cfg.n_routed_experts / t.ep,
                t.cfg.n_routed_experts, t.ranks / t.ep);
    if (opt->progress && t.ep > 1 && device_path(&t))
        fprintf(opt->progress, "expert parallel on the device: each rank runs %d of the %d routed experts of a layer "
                "on every rank's tokens; %s\n", t.cfg.n_routed_experts / t.ep, t.cfg.n_routed_experts,
                t.epo ? "their weights, gradients and optimizer state on their owners only (evaluations go through "
                        "the exchange too)"
                : t.zero ? "their weights and gradients whole on every rank, the optimizer state in ZeRO-1's ranges"
                         : "their weights, gradients and optimizer state whole on every rank (--ep-replicated-state)");
    if (opt->progress && t.epo) {
        size_t mine = (t.muon_state_n + t.adam_state_n) * sizeof(float),
               whole = (t.muon_total_n + t.adam_total_n) * sizeof(float);
        fprintf(opt->progress, "expert parallel: optimizer state %.3f MiB a rank (the routed experts' on their owners "
                "only) instead of %.3f MiB on every rank\n", mine / 1048576.0, whole / 1048576.0);
        fprintf(opt->progress, "expert parallel: gradients %.3f MiB a rank (the routed experts' of the owned experts "
                "only) instead of %.3f MiB\n", lm_model_num_grads(t.model) * sizeof(float) / 1048576.0,
                lm_model_num_params(t.model) * sizeof(float) / 1048576.0);
        fprintf(opt->progress, "expert parallel: weights %.3f MiB a rank (the routed experts' of the owned experts "
                "only; %s, a checkpoint sends rank 0 one expert tensor at a time) instead of %.3f MiB\n",
                lm_model_num_kept_params(t.model) * sizeof(float) / 1048576.0,
                device_path(&t) ? "an evaluation runs the experts through the exchange"
                                : "an evaluation gathers one MoE layer's at a time",
                lm_model_num_params(t.model) * sizeof(float) / 1048576.0);
    }
    double flops_done = 0;
    if (!opt->resume) log_stage(&t);
    int64_t stop = opt->stop_after > 0 && opt->stop_after < t.total_steps ? opt->stop_after : t.total_steps;
    int interrupted = 0;
    while (t.step < stop) {
        /* a step boundary: a requested stop (SIGINT, SIGTERM, SIGHUP in the CLI) ends here, checkpointed */
        if (stop_requested(&t)) {
            interrupted = 1;
            break;
        }
        int64_t tokens_per_step = (int64_t)t.B * t.T * c->grad_accum;
        double t0 = lm_time_seconds();
        lm_model_zero_grads(t.model);
        float loss = 0, aux = 0;
        int bad = 0;
        if (t.step == opt->inject_fault_step && opt->inject_fault != LM_FAULT_LOSS)
            lm_model_inject_fault(t.model, opt->inject_fault);
        const int64_t pos0 = t.data_pos;
        /* where the step's time goes (metrics.jsonl "phases"): each phase ends where the host waits for
         * its result (the loss of a forward, the gradient norm, the optimizer's QK-Clip maxima), so on a
         * GPU a phase also holds the device work queued before it */
        double ph_data = 0, ph_fwd = 0, ph_bwd = 0, ph_reduce = 0, ph_clip = 0, ph_opt = 0, ph_end = 0, tp;
        /* gradient buckets: the ranks agree on the forwards before the last backward, which sums them */
        const int bk_agree = t.bucketed && t.ranks > 1;
        int agreed = 0;
        t.bk_summed = 0;
        for (int micro = 0; micro < c->grad_accum && !bad; micro++) {
            tp = lm_time_seconds();
            /* of the micro-batch's B rows this rank reads rows [g B/D, (g+1) B/D) of its group g of D (without
             * context parallelism the rank's own) alone, and takes tokens [seg_t0, seg_t0 + seg_T) of them
             * (all without) */
            const int weighted = c->answer_loss_weight != 1.0f;
            if ((s = lm_data_mix_rows(&t.mix, t.data_pos++, t.B, t.T, t.dp_rank * share_B(&t), share_B(&t), t.seq,
                                      weighted ? t.answer : NULL)))
                goto done;
            split_batch(t.seq, share_B(&t), t.T, t.seg_t0, t.seg_T, t.inp, t.tgt);
            ph_data += lm_time_seconds() - tp;
            tp = lm_time_seconds();
            /* the batch's mean: 1 / (grad_accum R) a rank; context parallel T_c / (T grad_accum R / N). The
             * scale enters at the loss (each token's logit gradient scale / (its rank's tokens), 1 / (B T
             * grad_accum) on every rank), so under expert parallelism the expert-output gradients an owner
             * receives from other ranks' tokens carry those ranks' scales */
            const float scale = t.cp > 1 ? (float)((double)t.seg_T / ((double)t.T * c->grad_accum * t.dp_groups))
                                         : 1.0f / (float)((int64_t)c->grad_accum * t.ranks);
            /* known before the forward: the LM head's backward runs inside it (each chunk's logits once) */
            if ((s = lm_model_set_head_backward(t.model, weighted ? 0.0f : scale))) goto done;
            float l;
            lm_status fs = lm_model_forward(t.model, t.inp, t.tgt, 1, &l);
            if (t.cp > 1) {
                /* the group's backward is collective: its ranks agree on the forward (the model agrees inside
                 * it; this adds the loss, computed on each rank's own tokens). With expert parallelism the
                 * backward's exchanges also join other groups' ranks: then every rank agrees (a step failing
                 * on one rank is skipped on all in any case) */
                const int world = t.opt.expert_parallel;
                if ((s = agree_forward(world ? t.comm : t.cp_comm, &fs, world ? "job" : "context-parallel group")))
                    goto done;
            }
            /* train.answer_loss_weight: sum_i w_i nll_i / sum_i w_i over the micro-batch (every rank's rows);
             * its sum over the ranks also agrees on the forward, so every rank joins it */
            if (weighted && (s = weighted_loss(&t, &l, &fs))) goto done;
            const int last = micro == c->grad_accum - 1;
            if (bk_agree && last) {
                agreed = 1;
                if ((s = agree_forward(t.comm, &fs, "job"))) goto done;
            }
            if (fs == LM_ERR_NUMERIC) {
                bad = 1;
                break;
            }
            if (fs) {
                s = fs;
                goto done;
            }
            ph_fwd += lm_time_seconds() - tp;
            tp = lm_time_seconds();
            /* the last micro-batch's backward finishes the gradients: its hook launches the buckets' sums */
            if (t.bucketed && last) bucket_arm(&t);
            if ((s = weighted ? lm_model_backward_weighted(t.model, t.dlogp) : lm_model_backward(t.model, scale)))
                goto done;
            if ((s = bucket_finish(&t))) goto done;
            ph_bwd += lm_time_seconds() - tp;
            loss += l / (float)c->grad_accum;
            aux += lm_model_aux_loss(t.model) / (float)c->grad_accum;
        }
        /* a rank whose forward failed before the last micro-batch joins the others' agreement */
        if (bk_agree && !agreed) {
            lm_status failed = LM_ERR_NUMERIC;
            if ((s = agree_forward(t.comm, &failed, "job"))) goto done;
        }
        tp = lm_time_seconds();
        /* the balancing counts the backend kept for the step (a GPU's: one download for every layer, after
         * the queued backward); a score outside [0, 1] found there skips the step as a non-finite forward does */
        if (!bad) {
            lm_status bs = lm_model_balance_sync(t.model);
            if (bs == LM_ERR_NUMERIC) bad = 1;
            else if (bs) {
                s = bs;
                goto done;
            }
        }
        /* data parallel: losses, balancing counts, gradients and QK-Clip maxima over the ranks */
        if ((s = dp_reduce_step(&t, pos0, &loss, &aux, &bad))) goto done;
        /* the micro-batches' summed gradients to the host's optimizer (a no-op on the CPU) */
        if (!bad && !t.dev_opt && (s = lm_model_download_grads(t.model))) goto done;
        ph_reduce = lm_time_seconds() - tp;
        tp = lm_time_seconds();
        if (t.step == opt->inject_fault_step && opt->inject_fault == LM_FAULT_LOSS) loss = NAN;
        double gnorm = NAN;
        if (t.zero) {
            /* ZeRO-1: the owners' partial norms; a loss non-finite on any rank skips on every rank */
            if (!bad && (s = zero_grad_clip(&t, c->grad_clip, isfinite(loss), &gnorm, &bad))) goto done;
        } else if (t.epo) {
            /* owner-only experts: their owners' block sums (the loss is every rank's, so all take this branch) */
            if (!bad && isfinite(loss)) {
                if ((s = epo_grad_clip(&t, c->grad_clip, &gnorm, &bad))) goto done;
            } else bad = 1;
        } else if (!bad && isfinite(loss))
            bad = (t.dev_opt ? lm_grad_clip_on(t.be, t.ball, t.n_all, c->grad_clip, t.norm_work, &gnorm)
                             : lm_grad_clip(t.all, t.n_all, c->grad_clip, &gnorm)) != LM_OK;
        else bad = 1;
        ph_clip = lm_time_seconds() - tp;
        if (bad) {
            /* skip: no update, b kept, logit maxima dropped, the batch is consumed */
            lm_model_balance_step_end(t.model, 0, NULL);
            lm_model_qk_clip(t.model, 0, NULL, NULL);
            t.skipped++;
            if (t.metrics) fprintf(t.metrics, "{\"type\": \"skip\", \"step\": %lld, \"reason\": \"non-finite loss or gradient\"}\n",
                    (long long)t.step);
            if (t.metrics) fflush(t.metrics);
            if (opt->progress)
                fprintf(opt->progress, "step %lld skipped: non-finite loss or gradient\n", (long long)t.step);
            if (++bad_in_row >= opt->max_bad_steps) {
                s = lm_error(LM_ERR_NUMERIC, "%d consecutive steps had non-finite loss or gradients (last at step "
                             "%lld); stopping. Hint: lower train.lr or check the data", bad_in_row, (long long)t.step);
                goto done;
            }
            t.step++;
        } else {
        bad_in_row = 0;
        gnorm_hash = fnv(gnorm_hash, &gnorm, sizeof gnorm);
        float f = lm_lr_at(&sched, t.step, t.total_steps) * t.stages[t.stage].lr_scale;
        double t_opt = lm_time_seconds();
        float max_logit;
        int n_clipped;
        if (t.dev_opt) {
            /* the update on the device; its product-format copy follows and the host copy is
             * marked stale (read back for checkpoints and evaluation); QK-Clip clips there */
            if ((s = lm_device_optimizer_step(t.dmuon, muon_lr * f)) ||
                (s = lm_device_optimizer_step(t.dadam, adam_lr * f)) ||
                /* ZeRO-1: each owner updated its range; every rank receives the others' */
                (t.zero && t.ranks > 1 && (s = zero_gather_params(&t))) ||
                (s = lm_model_params_changed_on_backend(t.model)))
                goto done;
            if (t.step == opt->inject_nan_param_step) {
                if ((s = lm_model_download_params(t.model))) goto done;
                lm_model_params(t.model)[0] = NAN; /* embed[0]: whole on every rank */
                if ((s = lm_model_upload_params(t.model))) goto done;
            }
            if ((s = lm_model_qk_clip(t.model, c->qk_clip_tau, &max_logit, &n_clipped))) goto done;
        } else {
            if ((s = lm_optimizer_step(&t.muon, muon_lr * f)) || (s = lm_optimizer_step(&t.adam, adam_lr * f)))
                goto done;
            /* ZeRO-1: each owner updated its range; every rank receives the others' */
            if (t.zero && t.ranks > 1 && (s = zero_gather_params(&t))) goto done;
            /* owner-only experts: each owner updated its slices, which stay there (the replicas
             * at its position in the other groups took the same step) */
            if (t.step == opt->inject_nan_param_step) {
                size_t first, count; /* embed[0]: whole on every rank */
                lm_model_param_part(t.model, 0, &first, &count)[0] = NAN;
            }
            if (t.step == opt->inject_diverge_step && t.rank == opt->inject_diverge_rank &&
                (s = diverge_replica(&t, opt->inject_diverge_tensor)))
                goto done;
            if ((s = lm_model_qk_clip(t.model, c->qk_clip_tau, &max_logit, &n_clipped))) goto done;
            /* the host parameters changed (the update, QK-Clip): the device copy
             * follows before the next forward or evaluation (a no-op on the CPU);
             * the balancing biases go with each forward */
            if ((s = lm_model_upload_params(t.model))) goto done;
        }
        ph_opt = lm_time_seconds() - t_opt;
        opt_seconds += ph_opt;
        tp = lm_time_seconds();
        if ((s = lm_model_balance_step_end(t.model, 1, t.stats))) goto done;
        ph_end = lm_time_seconds() - tp;
        t.step++;
        last_loss = loss;
        double dt = lm_time_seconds() - t0;
        step_seconds += dt;
        tokens_done += tokens_per_step;
        double step_flops = (double)tokens_per_step * lm_train_flops_per_token(c, t.T);
        flops_done += step_flops;
        ema_step = ema_step > 0 ? 0.9 * ema_step + 0.1 * dt : dt;
        double worst = 0;
        for (int i = 0; i < t.n_moe; i++) worst = t.stats[i].maxvio_batch > worst ? t.stats[i].maxvio_batch : worst;
        /* metrics: every number of the step (rank 0 writes the run's log) */
        if (t.metrics) {
            fprintf(t.metrics,
                    "{\"type\": \"train\", \"step\": %lld, \"loss\": %.9g, \"aux_loss\": %.9g, \"lr\": %.9g, "
                    "\"grad_norm\": %.9g, \"tokens_per_s\": %.6g, \"step_seconds\": %.6g, ",
                    (long long)t.step, loss, aux, muon_lr * f, gnorm, tokens_per_step / dt, dt);
            if (on_gpu) fprintf(t.metrics, "\"mfu\": %.6g, ", step_flops / dt / LM_TRAIN_PEAK_FLOPS);
            fprintf(t.metrics,
                    "\"phases\": {\"data\": %.6g, \"forward\": %.6g, \"backward\": %.6g, \"reduce\": %.6g, "
                    "\"clip\": %.6g, \"optimizer\": %.6g, \"balance\": %.6g, \"other\": %.6g}, ",
                    ph_data, ph_fwd, ph_bwd, ph_reduce, ph_clip, ph_opt, ph_end,
                    dt - (ph_data + ph_fwd + ph_bwd + ph_reduce + ph_clip + ph_opt + ph_end));
            fprintf(t.metrics, "\"max_logit\": %.6g, \"qk_clipped_heads\": %d, \"moe\": [",
                    isfinite(max_logit) ? max_logit : 0.0, n_clipped);
            for (int i = 0; i < t.n_moe; i++) {
                const lm_balance_stats *b = &t.stats[i];
                fprintf(t.metrics,
                        "%s{\"layer\": %d, \"maxvio_batch\": %.6g, \"maxvio_global\": %.6g, \"cv\": %.6g, \"min\": %d, "
                        "\"max\": %d, \"dead\": %d, \"entropy\": %.6g, \"bias_min\": %.6g, \"bias_max\": %.6g, \"load\": [",
                        i ? ", " : "", lm_model_moe_layer_index(t.model, i), b->maxvio_batch, b->maxvio_global, b->cv,
                        b->min_load, b->max_load, b->dead, b->router_entropy, b->bias_min, b->bias_max);
                for (int j = 0; j < c->n_routed_experts; j++) fprintf(t.metrics, "%s%d", j ? ", " : "", b->load[j]);
                fprintf(t.metrics, "]}");
            }
            fprintf(t.metrics, "]}\n");
            fflush(t.metrics); /* each step's record reaches the file before its progress line */
        }
        if (opt->progress && (t.step % c->log_every == 0 || t.step == 1 || t.step == t.total_steps)) {
            char eta[32];
            format_eta(eta, sizeof eta, ema_step * (double)(t.total_steps - t.step));
            /* the device's memory in use (every process on it: GPU ranks sharing one count together) */
            size_t mem_used = 0, mem_total = 0;
            char mem[48] = "";
            if (on_gpu && t.be && t.be->memory && !t.be->memory(t.be, &mem_used, &mem_total))
                snprintf(mem, sizeof mem, " | GPU mem %.1f GiB", (double)mem_used / 1073741824.0);
            if (on_gpu)
                fprintf(opt->progress, "step %5lld/%lld | loss %.4f | lr %.2e | grad %.3f | %.0f tok/s | MFU %.1f%% | "
                        "ETA %s | maxvio %.3f%s\n", (long long)t.step, (long long)t.total_steps, loss, muon_lr * f,
                        gnorm, tokens_per_step / dt, 100.0 * step_flops / dt / LM_TRAIN_PEAK_FLOPS, eta, worst, mem);
            else
                fprintf(opt->progress, "step %5lld/%lld | loss %.4f | lr %.2e | grad %.3f | %.0f tok/s | ETA %s | "
                        "maxvio %.3f\n", (long long)t.step, (long long)t.total_steps, loss, muon_lr * f, gnorm,
                        tokens_per_step / dt, eta, worst);
            fflush(opt->progress);
        }
        }
        /* the end of a stage: evaluate, checkpoint, move to the next stage's shape and data */
        int stage_done = t.step == stage_end(&t, t.stage) && t.step < t.total_steps;
        if ((c->eval_every > 0 && t.step % c->eval_every == 0 && t.step < stop) || (stage_done && t.step < stop)) {
            if ((s = evaluate(&t, &val_loss, &val_acc))) goto done;
            log_eval(&t, val_loss, val_acc);
        }
        if (((c->ckpt_every > 0 && t.step % c->ckpt_every == 0) || stage_done) && t.step < stop)
            if ((s = save_checkpoint(&t))) goto done;
        if (stage_done) {
            if (t.step < stop && (s = stage_evaluation(&t))) goto done;
            bank_timings(&t, comp);
            if ((s = switch_stage(&t, t.stage + 1))) goto done;
            log_stage(&t);
        }
    }
    if (interrupted) {
        /* the last step's checkpoint, unless it was just written (or resumed from) */
        if (t.step > 0 && t.saved_step != t.step && (s = save_checkpoint(&t))) goto done;
        if (t.rank == 0)
            fprintf(opt->progress ? opt->progress : stderr,
                    "interrupted at step %lld of %lld: %s; continue with: longmoe train --out %s --resume\n",
                    (long long)t.step, (long long)t.total_steps,
                    t.step > 0 ? "checkpoint written" : "no step done, nothing to resume", opt->out_dir);
    } else {
        if ((s = evaluate(&t, &val_loss, &val_acc))) goto done;
        log_eval(&t, val_loss, val_acc);
        if ((s = save_checkpoint(&t))) goto done;
        if (t.step == t.total_steps && (s = stage_evaluation(&t))) goto done;
        if (opt->progress)
            fprintf(opt->progress, "done: %lld steps in %.1f s, checkpoint in %s\n", (long long)t.step,
                    lm_time_seconds() - t_start, opt->out_dir);
    }
    /* collective under ZeRO-1 and owner-only experts: every rank computes them */
    uint64_t params_hash = 0, balance_hash = 0;
    if ((result || t.zero || t.epo) && (s = state_hashes(&t, &params_hash, &balance_hash))) goto done;
    if (result) {
        result->step = t.step;
        result->last_loss = last_loss;
        result->val_loss = val_loss;
        result->val_answer_acc = val_acc;
        result->skipped = t.skipped;
        result->step_seconds = step_seconds;
        result->optimizer_seconds = opt_seconds;
        result->tokens = tokens_done;
        result->mfu = step_seconds > 0 ? flops_done / step_seconds / LM_TRAIN_PEAK_FLOPS : 0;
        result->interrupted = interrupted;
        result->params_hash = params_hash;
        result->grad_norm_hash = gnorm_hash;
        result->optimizer_state_bytes = (t.muon_state_n + t.adam_state_n) * sizeof(float);
        result->gradient_bytes = lm_model_num_grads(t.model) * sizeof(float);
        result->parameter_bytes = lm_model_num_kept_params(t.model) * sizeof(float);
        result->block_peak_bytes = t.block_peak_bytes;
        result->eval_gathered_bytes = t.eval_gathered_bytes;
        result->ckpt_gathered_bytes = t.ckpt_gathered_bytes;
        result->balance_hash = balance_hash;
        bank_timings(&t, comp);
        memcpy(result->component_seconds, comp, sizeof comp);
    }
done:
    /* a rank that failed before the loop meets the others' agreement there */
    if (t.dp_in_setup) (void)dp_agree(&t, s);
    if (s && result) {
        result->failure_agreed = t.ranks <= 1 || t.failure_agreed;
        result->failed_rank = t.ranks <= 1 ? 0 : t.failed_rank;
    }
    trainer_free(&t);
    lm_run_unlock(lock);
    return s;
}
