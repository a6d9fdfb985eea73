/* `longmoe train`: train a model from a config on built-in data. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "longmoe/backend.h"
#include "longmoe/comm.h"
#include "longmoe/train.h"

static const char *const train_usage =
    "usage: longmoe train --config CONFIG.json --out DIR [--data TASK] [--resume [--accept-data-change]]\n"
    "                     [--steps N] [--seed S] [--device cpu|cuda] [--host-optimizer]\n"
    "       mpirun -np N longmoe train --comm mpi [--ep [G]] [--cp C [--cp-split even|balanced]] [--zero 1]\n"
    "                     --config CONFIG.json --out DIR ...\n"
    "       mpirun -np N longmoe train --device cuda --comm nccl|mpi --config CONFIG.json --out DIR ...\n"
    "\n"
    "Trains the model of CONFIG (docs/config.md) and writes to DIR: metrics.jsonl (one JSON\n"
    "object per step and evaluation), checkpoint-<step>/ (model.safetensors, config.json,\n"
    "trainer state) and `latest`. A progress line every train.log_every steps shows step, loss,\n"
    "learning rate, gradient norm, tokens/s (and MFU on the GPU), ETA and the worst MoE\n"
    "MaxVio of the step.\n"
    "\n"
    "options:\n"
    "  --data SPEC   data of stages that name none (overrides train.data): a built-in\n"
    "                task (copy, mqar, passkey, vcopy, mix; docs/eval.md) or shards:DIR\n"
    "                (token shards from `longmoe data prepare`; docs/data.md)\n"
    "  --resume      continue from DIR/latest, bit-identically to an uninterrupted run, with\n"
    "                the checkpoint's config (--config, --data and --seed are refused); the\n"
    "                data's files must be the ones the checkpoint recorded (names, sizes,\n"
    "                checksums)\n"
    "  --accept-data-change  with --resume: continue although the data's files changed\n"
    "                (the batches then differ from the uninterrupted run's)\n"
    "  --steps N     total steps (overrides train.steps)\n"
    "  --stop-after N  stop with a checkpoint once N steps are done (the schedule still\n"
    "                spans all steps; --resume continues)\n"
    "  --seed S      seed of initialisation and data (overrides train.seed)\n"
    "  --device D    where the model's forward and backward run: cpu (default) or cuda\n"
    "                (one GPU, bf16 products; the optimizer runs there too: gradient norm,\n"
    "                clipping, Muon, AdamW, QK-Clip). Checkpoints are the same files on\n"
    "                either device, so --resume may change the device; a resume is\n"
    "                bit-identical on the device the run had. cuda needs a CUDA build, a GPU\n"
    "                and kda.head_dim 32, 64 or 128 (docs/training.md, \"Devices\")\n"
    "  --host-optimizer  with --device cuda: the optimizer on the host instead (gradients\n"
    "                down and parameters up every step; slower, for comparison)\n"
    "  --comm C      self (default: one process), mpi (CPU ranks) or nccl (--device cuda,\n"
    "                one GPU a process): data parallel over the processes mpirun started.\n"
    "                --device cuda --comm mpi: GPU ranks whose gradient sums go through\n"
    "                host memory over MPI (slow; processes may share a GPU, which NCCL\n"
    "                refuses: the multi-rank GPU path on a one-GPU machine).\n"
    "                Rank r computes sequences [r B/N, (r+1) B/N) of every micro-batch of\n"
    "                B = train.batch_size sequences (B divisible by N); gradients, losses\n"
    "                and MoE balancing counts are summed in rank order and every rank takes\n"
    "                the same optimizer step: the run equals one process's to float\n"
    "                rounding (more loosely with the zoom estimator). Rank 0 prints and\n"
    "                writes DIR; every rank must see DIR (one machine or a shared file\n"
    "                system). A checkpoint resumes on one process or any number of ranks\n"
    "                that divides B (docs/scaleout.md, \"Data parallelism\")\n"
    "  --ep [G]      with --comm mpi (or nccl): expert parallelism too, in groups of G\n"
    "                consecutive ranks (G divides N; default G = N): rank r computes the\n"
    "                routed experts [p n/G, (p+1) n/G), p = r mod G, of every MoE layer for\n"
    "                the tokens of its group, which reach it by all-to-all\n"
    "                (model.n_routed_experts divisible by G); the N/G replicas of an\n"
    "                expert (one a group) sum their gradients.\n"
    "                Rank r keeps only its experts' weights, gradients and optimizer state\n"
    "                (their gradients skip the world all-reduce; the clipping norm is the\n"
    "                replicated run's; an evaluation gathers one MoE layer's experts, a\n"
    "                checkpoint sends rank 0 one expert tensor at a time): the run is the\n"
    "                replicated one bit for bit, and checkpoints are data parallelism's and\n"
    "                resume with or without --ep on any layout and G. With --zero 1\n"
    "                ZeRO-1's ranges hold all the state. With --device cuda (--comm mpi or\n"
    "                nccl) the rows are exchanged by the device engine (a group's part of\n"
    "                it), the slices stay on their owners in device memory, an evaluation\n"
    "                runs the experts through the exchange, and the clipping norm equals\n"
    "                the replicated run's to double rounding (not bit for bit)\n"
    "                (docs/scaleout.md, \"Expert parallelism\")\n"
    "  --ep-replicated-state  with --ep: every rank keeps every expert's weights,\n"
    "                gradients and optimizer state whole (the layout without owner-only\n"
    "                state)\n"
    "  --zero S      with --comm mpi or nccl: 0 (default) keeps the optimizer state on every rank;\n"
    "                1 (ZeRO-1) shards it: the tensors are cut into N ranges of consecutive\n"
    "                tensors balanced by state size, rank r keeps range r's Muon and AdamW\n"
    "                state, sums its gradients (reduce-scatter, in the gradient buckets of\n"
    "                train.grad_bucket_mb during the backward), clips and updates it and\n"
    "                all-gathers the new weights. The same run bit for bit with about 1/N\n"
    "                of the optimizer memory a rank (the start message says how much);\n"
    "                checkpoints are the same files and resume on any number of ranks, with\n"
    "                or without --zero. On GPUs the device optimizer's state is sharded\n"
    "                (not with --host-optimizer) (docs/scaleout.md, \"ZeRO-1\")\n"
    "  --cp C        with --comm mpi or nccl: context parallelism in groups of C consecutive ranks\n"
    "                (N a multiple of C; 1: off): the N/C groups split the batch as data\n"
    "                parallelism does (B divisible by N/C) and the C ranks of a group hold\n"
    "                contiguous segments of every sequence of their rows (as equal as\n"
    "                possible; train.seq_len >= C), the KDA and attention layers exchanging\n"
    "                states. Gradients scaled by segment/T are summed over all N ranks, so\n"
    "                the step is the whole batch's, to float rounding; checkpoints are the\n"
    "                ordinary ones and resume on any layout. With --zero 1 the state is\n"
    "                sharded over all N ranks. With --ep [G] too, each EP group of G\n"
    "                consecutive ranks sends its segments' tokens to their experts' owners\n"
    "                as above (the two groupings need not match). On GPUs (--device cuda\n"
    "                --comm nccl, or --comm mpi staged) the layers' exchanges go over the\n"
    "                device engine (docs/scaleout.md, \"Context parallelism in the trainer\")\n"
    "  --cp-split K  how --cp cuts a sequence: even (default; segments as equal as possible) or\n"
    "                balanced (equal FLOPs a rank: the later ranks' attention sees longer\n"
    "                prefixes, so the earlier segments are longer; the same run to float\n"
    "                rounding; `longmoe plan --memory --cp C --cp-split balanced` sizes it)\n"
    "  --quiet       no progress lines\n"
    "\n"
    "A fresh run needs an --out without a run in it (else: --resume). One trainer per DIR\n"
    "(DIR/lock). SIGINT, SIGTERM or SIGHUP stop the run at the next step boundary with a\n"
    "checkpoint (exit code 128 + the signal); --resume continues it.\n";

/* The processes of the job a launcher started this one in (Open MPI's and
 * MPICH's mpirun say so in the environment); 0 when none says. */
static long launched_ranks(void) {
    const char *names[2] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
    for (int i = 0; i < 2; i++) {
        const char *v = getenv(names[i]);
        if (v && atol(v) > 0) return atol(v);
    }
    return 0;
}

/* SIGINT, SIGTERM, SIGHUP: stop at the next step boundary with a checkpoint.
 * The handler is reset after the first signal, so a second one ends the
 * process at once. */
static volatile int stop_signal;
static void on_stop_signal(int sig) { stop_signal = sig; }

static void catch_stop_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

int cmd_train(int argc, char **argv) {
    const char *cmd = "train", *config = NULL, *out = NULL, *data = NULL;
    int resume = 0, quiet = 0, have_seed = 0, accept_data_change = 0;
    long steps = 0, stop_after = 0;
    double seed = 0;
    lm_device device = LM_DEVICE_CPU;
    int host_optimizer = 0, use_mpi = 0, use_nccl = 0, expert_parallel = 0, ep_replicated = 0;
    long zero = 0, cp = 1, ep_group = 0;
    lm_cp_split cp_split = LM_CP_SPLIT_EVEN;
    int cp_split_given = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(train_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--config")) {
            if (!(config = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--data")) {
            if (!(data = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--resume")) {
            resume = 1;
        } else if (!strcmp(a, "--accept-data-change")) {
            accept_data_change = 1;
        } else if (!strcmp(a, "--device")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if (lm_device_from_name(v, &device)) {
                cli_fail(cmd, "--device must be cpu or cuda, got '%s'", v);
                return 2;
            }
        } else if (!strcmp(a, "--comm")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            use_mpi = !strcmp(v, "mpi");
            use_nccl = !strcmp(v, "nccl");
            if (!use_mpi && !use_nccl && strcmp(v, "self")) {
                cli_fail(cmd, "--comm must be mpi, nccl (or self: one process), got '%s'", v);
                return 2;
            }
        } else if (!strcmp(a, "--ep")) {
            expert_parallel = 1;
            /* an optional group size: --ep G */
            const char *n = i + 1 < argc ? argv[i + 1] : NULL;
            if (n && (isdigit((unsigned char)n[0]) || (n[0] == '-' && isdigit((unsigned char)n[1])))) {
                i++;
                if (cli_parse_int(cmd, "--ep", n, 1, 4096, &ep_group)) return 2;
            }
        } else if (!strcmp(a, "--ep-replicated-state")) {
            ep_replicated = 1;
        } else if (!strcmp(a, "--zero")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 0, 1, &zero)) return 2;
        } else if (!strcmp(a, "--cp")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 4096, &cp)) return 2;
        } else if (!strcmp(a, "--cp-split")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if (lm_cp_split_from_name(v, &cp_split)) {
                cli_fail(cmd, "--cp-split: %s", lm_last_error());
                return 2;
            }
            cp_split_given = 1;
        } else if (!strcmp(a, "--host-optimizer")) {
            host_optimizer = 1;
        } else if (!strcmp(a, "--quiet")) {
            quiet = 1;
        } else if (!strcmp(a, "--steps")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 1L << 40, &steps)) return 2;
        } else if (!strcmp(a, "--stop-after")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 1L << 40, &stop_after)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, a, v, &seed)) return 2;
            if (seed < 0 || seed != (double)(long long)seed) return cli_fail(cmd, "--seed must be a non-negative integer") + 1;
            have_seed = 1;
        } else {
            cli_fail(cmd, "unknown option '%s' (see --help)", a);
            return 2;
        }
    }
    if (!out || (!config && !resume)) {
        cli_fail(cmd, "--out and --config are required (--config is left out with --resume)");
        return 2;
    }
    /* a resumed run is the run its checkpoint's config.json describes: what
     * would change it is refused, not ignored (--steps may extend an unstaged run) */
    if (accept_data_change && !resume) {
        cli_fail(cmd, "--accept-data-change is only for --resume");
        return 2;
    }
    if (resume && (config || data || have_seed)) {
        cli_fail(cmd, "%s cannot be given with --resume: a resumed run uses its checkpoint's config.json (start a "
                 "new run with another --out to change it)", config ? "--config" : data ? "--data" : "--seed");
        return 2;
    }
    lm_train_options opt = lm_train_options_default(out);
    opt.resume = resume;
    opt.accept_data_change = accept_data_change;
    opt.steps = steps;
    opt.stop_after = stop_after;
    opt.progress = quiet ? NULL : stdout;
    if (host_optimizer && device != LM_DEVICE_CUDA)
        return cli_fail(cmd, "--host-optimizer chooses where a device run's optimizer runs: give it with --device cuda") + 1;
    opt.device = device;
    opt.host_optimizer = host_optimizer;
    lm_config cfg;
    lm_config_defaults(&cfg);
    if (config && lm_config_load(config, &cfg)) return cli_fail(cmd, "%s", lm_last_error());
    if (have_seed) cfg.seed = (uint64_t)seed;
    if (data) {
        lm_data_source *probe;
        if (lm_data_open(data, 0, &probe)) return cli_fail(cmd, "--data: %s", lm_last_error()) + 1;
        lm_data_close(probe);
        if (strlen(data) >= sizeof cfg.data) return cli_fail(cmd, "--data: name too long") + 1;
        strcpy(cfg.data, data);
    }
    /* data parallel: the processes of mpirun's job (docs/scaleout.md) */
    if (!use_mpi && !use_nccl && launched_ranks() > 1)
        return cli_fail(cmd, "started by mpirun as one of %ld processes without --comm mpi or nccl: each would train "
                        "the whole run alone into the same --out; give --comm mpi (CPU) or --comm nccl (GPU) for "
                        "data parallelism", launched_ranks()) + 1;
    if (expert_parallel && !use_mpi && !use_nccl)
        return cli_fail(cmd, "--ep (expert parallelism) runs over the processes of --comm mpi or nccl") + 1;
    if (ep_replicated && !expert_parallel) {
        cli_fail(cmd, "--ep-replicated-state keeps the experts' state of --ep whole on every rank: give --ep too");
        return 2;
    }
    if (zero && !use_mpi && !use_nccl)
        return cli_fail(cmd, "--zero 1 shards the optimizer state over the processes of --comm mpi or nccl") + 1;
    if (cp > 1 && !use_mpi && !use_nccl)
        return cli_fail(cmd, "--cp %ld (context parallelism) runs over the processes of --comm mpi or nccl", cp) + 1;
    if (cp_split_given && cp <= 1) {
        cli_fail(cmd, "--cp-split cuts the sequences of --cp C (C > 1)");
        return 2;
    }
    opt.zero = (int)zero;
    opt.context_parallel = (int)cp;
    opt.cp_split = cp_split;
    lm_comm *comm = NULL;
    opt.expert_parallel = expert_parallel;
    opt.ep_group = (int)ep_group;
    opt.ep_replicated_state = ep_replicated;
    if (use_mpi) {
        if (!lm_comm_engine_available(LM_COMM_MPI))
            return cli_fail(cmd, "--comm mpi: this build has no MPI engine (CMake found no MPI library; install one, "
                            "e.g. Debian's libopenmpi-dev, and configure again with -DLONGMOE_MPI=ON)") + 1;
        if (lm_comm_open(LM_COMM_MPI, &comm)) return cli_fail(cmd, "--comm mpi: %s", lm_last_error());
        opt.comm = comm;
    }
    if (use_nccl) {
        if (device != LM_DEVICE_CUDA)
            return cli_fail(cmd, "--comm nccl: data parallelism on GPUs needs --device cuda (CPU ranks: --comm mpi)") + 1;
        if (!lm_comm_engine_available(LM_COMM_NCCL)) {
            lm_comm *none = NULL;
            lm_comm_open(LM_COMM_NCCL, &none); /* its message names the missing library */
            return cli_fail(cmd, "--comm nccl: %s", lm_last_error()) + 1;
        }
        /* before the model's device is opened: the engine selects this process's GPU */
        if (lm_comm_open(LM_COMM_NCCL, &comm)) return cli_fail(cmd, "--comm nccl: %s", lm_last_error());
        opt.comm = comm;
    }
    lm_train_result r;
    memset(&r, 0, sizeof r);
    catch_stop_signals();
    opt.stop_requested = &stop_signal;
    if (lm_train(&cfg, &opt, &r)) {
        int rank = comm ? lm_comm_rank(comm) : 0;
        /* a failure every rank returned with: rank 0 and the first failing rank say why */
        if (!r.failure_agreed || rank == 0 || rank == r.failed_rank) cli_fail(cmd, "%s", lm_last_error());
        /* else the other ranks may wait in a collective for this one: end the job */
        if (comm && lm_comm_size(comm) > 1 && !r.failure_agreed) {
            fflush(NULL);
            lm_comm_abort(comm, 1);
        }
        lm_comm_close(comm);
        return 1;
    }
    lm_comm_close(comm);
    if (r.interrupted && !stop_signal) stop_signal = SIGTERM; /* another rank received it */
    return r.interrupted ? 128 + stop_signal : 0; /* the shell's code for death by that signal */
}
