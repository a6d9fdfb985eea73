/* Training: the loop, progress and metrics, validation, checkpoints and
 * bit-exact resume (docs/training.md).
 *
 * A run directory holds:
 *   metrics.jsonl            one JSON object per line: {"type":"train",...} every
 *                            step, {"type":"eval",...}, {"type":"skip",...}, {"type":"checkpoint",...}
 * Training runs through the stages of train.stages (staged context extension:
 * each stage its sequence length, batch tokens, data mix and learning-rate
 * scale); a stage change is logged ({"type": "stage"}), evaluated and
 * checkpointed, and resume works in the middle of a stage.
 *   checkpoint-<step>/       model.safetensors (parameters, F32, names in docs/model.md),
 *                            config.json, trainer.safetensors (optimizer moments,
 *                            balancing biases and counters) and trainer.json (step,
 *                            data position, seeds)
 *   latest                   the name of the newest complete checkpoint
 * A checkpoint directory is written under a temporary name, every file fsynced,
 * then renamed; `latest` is replaced atomically after it; the oldest beyond
 * train.keep_checkpoints are removed (real checkpoint directories older than
 * the one written only; links are never followed).
 *   lock                     held by the one trainer of the directory
 * A fresh run (resume = 0) is refused in a directory that holds a run; on
 * resume everything loaded is validated (shapes, finiteness, bounds, counters
 * against the directory's step) and every safetensors checksum verified. */
#ifndef LONGMOE_TRAIN_H
#define LONGMOE_TRAIN_H

#include <stdint.h>
#include <stdio.h>

#include "longmoe/backend.h"
#include "longmoe/comm.h"
#include "longmoe/config.h"
#include "longmoe/data.h"
#include "longmoe/core.h"
#include "longmoe/model.h"
#include "longmoe/tasks.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const char *out_dir;  /* run directory (created if absent) */
    int resume;           /* continue from out_dir/latest */
    /* on resume: the data's files differ from the fingerprint the checkpoint
     * recorded (lm_data_fingerprint); 0 refuses the run naming the first
     * changed file, 1 says so on progress (stderr when NULL), continues and
     * records the new fingerprint */
    int accept_data_change;
    int64_t steps;        /* total steps of the run (0: config's train.steps); the schedule spans them */
    int64_t stop_after;   /* stop (with a checkpoint) once this many steps are done (0: at the end) */
    int val_batches;      /* batches of held-out data per evaluation */
    int stage_eval_batches; /* batches (of 2 rows) per cell of the passkey and MQAR grids
                               evaluated after each stage and at the end (0: none; -1, the
                               default: train.grid_rows / 2, rounded up) */
    FILE *progress;       /* progress lines (NULL: none) */
    int max_bad_steps;    /* consecutive skipped steps that stop the run */
    /* fault injection for tests: at step inject_fault_step (-1: off) inject
     * inject_fault (include/longmoe/model.h: NaN in the batch, a router score,
     * a gradient, or the loss) */
    int64_t inject_fault_step;
    lm_fault inject_fault;
    /* for tests: after the update of step inject_nan_param_step (-1: off) the
     * first parameter becomes NaN (as a broken optimizer state would make it) */
    int64_t inject_nan_param_step;
    /* for tests: after the update of step inject_diverge_step (-1: off), on
     * rank inject_diverge_rank only, the first element that rank holds of
     * tensor inject_diverge_tensor (a name; under owner-only expert
     * parallelism a routed experts' tensor's first element of its slice) moves
     * by one ulp: a replica that diverged, which the hash check before the
     * next checkpoint refuses */
    int64_t inject_diverge_step;
    int inject_diverge_rank;
    const char *inject_diverge_tensor;
    /* when not NULL and non-zero at a step boundary (a signal handler sets it):
     * the run stops there with a checkpoint and result->interrupted set */
    volatile int *stop_requested;
    /* where the model's forward and backward run (docs/training.md, "Devices"):
     * LM_DEVICE_CPU (default) or LM_DEVICE_CUDA (one GPU; the checkpoints are
     * the same files on either device, read and written through the host) */
    lm_device device;
    /* on a device: 0 (default) runs the optimizer there too (optim_device.h:
     * gradient norm, clipping, Muon, AdamW and QK-Clip on the device's memory,
     * nothing but the norm crossing to the host in a step); 1 runs it on the
     * host as on the CPU (gradients down, parameters up every step) */
    int host_optimizer;
    /* the backend to train on, the caller's (it must outlive the run); NULL
     * (default): the one `device` names, opened and closed by the trainer.
     * Given, the run takes the device path on it whatever `device` says: the
     * model in its memory, the optimizer through its ops (unless
     * host_optimizer), and with an MPI comm the gradient block summed by the
     * staged engine over it. lm_backend_cpu() so runs the device path on the
     * CPU, where tests compare it with the host path. */
    lm_backend *backend;
    /* data parallelism (docs/scaleout.md, docs/training.md): the handle of the
     * job's ranks (NULL or one rank: a single-process run). Every rank calls
     * lm_train with the same config and options; rank r computes the gradients
     * of sequences [r B/R, (r+1) B/R) of every micro-batch of B = the stage's
     * batch (B divisible by R), the gradients, losses and balancing counts are
     * summed in rank order, and every rank takes the same optimizer step.
     * Rank 0 alone writes the run directory (metrics, checkpoints, progress);
     * every rank reads the checkpoint it resumes from, so the directory must
     * be visible to all. An MPI handle runs CPU ranks (device LM_DEVICE_CPU),
     * or GPU ranks (LM_DEVICE_CUDA: the gradient block summed by the staged
     * engine through host memory; a process takes the GPU of its index on its
     * machine, several may share one); an NCCL handle GPU ranks
     * (LM_DEVICE_CUDA, opened before the trainer opens the device: it selects
     * this process's GPU), the gradients summed on the device. The small
     * per-step values go over lm_comm_host. */
    lm_comm *comm;
    /* expert parallelism over the same ranks (docs/scaleout.md; needs comm):
     * rank r computes the routed experts [p n / G, (p+1) n / G), p = r mod G,
     * of every MoE layer for the tokens of its EP group (dispatch and combine
     * by all-to-all; G: the group's size, every rank unless ep_group says
     * otherwise). n_routed_experts must be divisible by G. The owner alone
     * keeps its experts' weights, gradients and optimizer state and takes
     * their step (their gradients, complete on the owner, stay out of the
     * world all-reduce and are summed over the replicas of the position; the
     * model keeps only its slice from its creation). On the host path the
     * clipping norm takes the owners' block sums, the replicated norm's bits;
     * on the device path (a GPU, or lm_train_options.backend) each owner's
     * slice sums, summed over the group: the replicated norm to double
     * rounding. An evaluation gathers one MoE layer's experts at a time on the
     * host path and runs the exchange on the device path; checkpoints are
     * those of data parallelism (the experts gathered to rank 0 a tensor at a
     * time, sliced on load). With zero = 1 ZeRO-1's ranges hold every
     * tensor's state instead and the weights stay whole. */
    int expert_parallel;
    /* with expert_parallel and zero = 0: 1 keeps the routed experts' gradients
     * whole and in the all-reduce and their optimizer state on every rank (the
     * layout before owner-only state, the same bits; for comparisons) */
    int ep_replicated_state;
    /* with expert_parallel: the EP group size G (0, the default: every rank).
     * The R ranks form R / G groups of G consecutive ranks; inside a group the
     * MoE layers exchange tokens and rank r owns experts of position r % G
     * ([p n / G, (p+1) n / G)); the R / G replicas of an expert sum their
     * gradients, and the owner-only state is each position's. G must divide R
     * and n_routed_experts; G = 1 is data parallelism with the experts run
     * locally (every rank owns every expert; the state replicated). */
    int ep_group;
    /* ZeRO stage (docs/scaleout.md, "ZeRO-1"; needs comm; on a device with the
     * device optimizer, not host_optimizer): 0 (default)
     * replicates the optimizer state on every rank; 1 shards it: the tensors
     * are cut into one range of consecutive tensors a rank, balanced by state
     * size, and rank r alone keeps range r's optimizer state, sums its
     * gradients (reduce-scatter), clips and updates it, then all-gathers the new
     * parameters. The result equals zero = 0 bit for bit; checkpoints are the
     * same files (rank 0 gathers the state) and resume on any layout. */
    int zero;
    /* context parallelism (docs/scaleout.md, "Context parallelism in the
     * trainer"; needs comm, CPU only): 0 or 1 (default) off; N > 1 cuts the R
     * ranks into R / N data-parallel groups of N consecutive ranks (world rank
     * w: group w / N, CP rank w % N). A group takes the rows of one
     * data-parallel replica (B divisible by R / N) and CP rank c holds the
     * contiguous segment c of every sequence (T split by cp_split: as equally as
     * possible by default, the first T mod N segments one token longer; T >= N); the model runs
     * lm_model_set_context_parallel over the group. Each rank's gradients are
     * scaled by T_c / (T grad_accum R / N) and summed over all R ranks, so
     * the step is the whole batch's; losses, balancing counts, QK-Clip maxima
     * and evaluation tallies are whole-batch values on every rank, and
     * checkpoints are the ordinary ones (they resume on any layout). R must
     * be divisible by N; with expert_parallel too (EP groups cut apart). With zero = 1 the
     * optimizer state is sharded over all R ranks. */
    int context_parallel;
    /* how the T tokens are cut over the N ranks of a group (lm_config_cp_split):
     * LM_CP_SPLIT_EVEN (default) or LM_CP_SPLIT_BALANCED (equal FLOPs: earlier
     * segments longer, as the later ranks' attention sees longer prefixes) */
    lm_cp_split cp_split;
} lm_train_options;

lm_train_options lm_train_options_default(const char *out_dir);

typedef struct {
    int64_t step;          /* steps completed */
    float last_loss;       /* training loss of the last step */
    float val_loss;        /* last evaluation (NaN if none) */
    float val_answer_acc;  /* accuracy at the task's answer positions */
    int64_t skipped;       /* steps skipped for non-finite values */
    /* timing of the steps of this call (evaluation and checkpoints excluded) */
    double step_seconds, optimizer_seconds;
    double component_seconds[LM_TIME_COUNT]; /* forward + backward by component */
    int64_t tokens;
    int interrupted;       /* 1: stopped early by opt->stop_requested (checkpointed) */
    double mfu;            /* model FLOPs utilisation of these steps against 989 TFLOP/s
                              (lm_train_flops_per_token); reported on the GPU */
    /* 64-bit hashes of the state at the end: the parameters, the optimizer
     * state and the counters (from a hash of each tensor's weights and of its
     * state, a routed experts' tensor's from its experts' hashes: under ZeRO-1
     * each tensor's state hash is its owner's, under expert parallelism each
     * expert's hashes its owner's, so a layout does not change the value), and
     * the MoE balancing state (biases, windows, loads); data-parallel ranks hold
     * the same (checked at every checkpoint). Under ZeRO-1 lm_train computes
     * them on every rank (collectively), as under expert parallelism */
    uint64_t params_hash, balance_hash;
    /* a 64-bit hash of the bits of the global gradient norm of every step this
     * call took (skipped steps left out): equal for layouts that compute the
     * same norms bit for bit */
    uint64_t grad_norm_hash;
    /* bytes of optimizer state (Muon momenta, AdamW moments) this rank holds:
     * the whole state, under ZeRO-1 its range's, under expert parallelism the
     * replicated tensors' and its experts' */
    size_t optimizer_state_bytes;
    /* bytes of the gradient block this rank holds (lm_model_num_grads): the
     * whole parameter block's size, under expert parallelism with owner-only
     * state the replicated tensors' and its own experts' only */
    size_t gradient_bytes;
    /* bytes of the parameter block this rank holds (lm_model_num_kept_params):
     * the whole model's, under expert parallelism with owner-only state the
     * replicated tensors' and its own experts' only */
    size_t parameter_bytes;
    /* the most bytes of parameter and gradient blocks (host, and a device's
     * copies) one of this rank's models held at once from its creation on
     * (lm_model_block_peak_bytes; the largest over the stages' models): with
     * owner-only expert state parameter_bytes + gradient_bytes, the model
     * being created in that layout (lm_model_create_expert_owned), never the
     * whole model's blocks */
    size_t block_peak_bytes;
    /* the most bytes of gathered expert weights this rank held at once during
     * the run's evaluations besides its parameter block (owner-only experts:
     * one MoE layer's routed experts, lm_model_expert_layer_bytes; else 0) */
    size_t eval_gathered_bytes;
    /* the most bytes this rank held at once during the run's checkpoint
     * writes besides its own state: rank 0's buffer of the tensors it receives
     * from the other ranks as it writes (owner-only experts: the largest routed
     * experts' tensor, at most one MoE layer's experts; ZeRO-1: the largest
     * other range, at most 16 MiB a piece); 0 on the other ranks and where
     * rank 0 holds everything */
    size_t ckpt_gathered_bytes;
    /* data parallel, when lm_train failed: 1 when every rank returned at the
     * same point with a failure (then all may close the handle; rank
     * failed_rank, the lowest that failed, has the first cause), 0 when the
     * other ranks may wait in a collective (then lm_comm_abort) */
    int failure_agreed, failed_rank;
} lm_train_result;

lm_status lm_train(const lm_config *cfg, const lm_train_options *opt, lm_train_result *result);

/* Training FLOPs per token of a micro-batch of sequences of T tokens: 3x the
 * forward FLOPs of lm_config_plan = 6 N_active plus the attention and KDA
 * operators' forward and backward. MFU = tokens/s x this / LM_TRAIN_PEAK_FLOPS. */
double lm_train_flops_per_token(const lm_config *cfg, int T);
#define LM_TRAIN_PEAK_FLOPS 989e12 /* dense bf16, one H100/H200 */

/* Load the parameters of checkpoint directory `dir`, and the balancing biases
 * of its MoE layers (trainer.safetensors; they route, frozen, at evaluation and
 * inference), into a model created with the config in `dir`/config.json for B
 * sequences of T tokens (<= 0: the config's). *out and *cfg receive them. */
lm_status lm_checkpoint_load_model(const char *dir, int B, int T, lm_config *cfg, lm_model **out);
/* The same on a backend (backend.h; NULL: the CPU): the model is created
 * there and the loaded parameters go up before its first forward. */
lm_status lm_checkpoint_load_model_on(const char *dir, int B, int T, struct lm_backend *backend, lm_config *cfg,
                                      lm_model **out);

#ifdef __cplusplus
}
#endif
#endif
