/* `longmoe plan --config C [--context N] [--layout DP,EP,CP,PP[,TP] ...]`:
 * parameters (total and active per token), forward FLOPs per token and memory
 * per token, by component; with --layout, the memory, FLOPs, collective bytes
 * and time per GPU and step of that parallel layout (docs/scaleout.md); with
 * --memory, every buffer one training process holds for a shape, by name, from
 * the model's own memory plan (docs/model.md, "Memory"). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "longmoe/config.h"
#include "longmoe/layout_plan.h"
#include "longmoe/model.h"
#include "longmoe/optim_device.h"

static const char *const plan_usage =
    "usage: longmoe plan --config CONFIG.json [--context N] [--peak-tflops X]\n"
    "       longmoe plan --memory --config CONFIG.json [--batch B] [--seq T] [--device cpu|cuda]\n"
    "                    [--recompute MODE] [--recompute-chunk N] [--seq-segment S] [--cp N [--cp-split K]]\n"
    "                    [--ep G] [--json FILE]\n"
    "\n"
    "Prints, by component, the parameters stored and active per token, the forward\n"
    "FLOPs per token at a causal context of N tokens (default: train.seq_len), and the\n"
    "inference cache per token of context (bf16). Training costs about 3x the forward;\n"
    "at a dense bf16 peak of --peak-tflops X per GPU (default 989, an H100 or H200)\n"
    "that allows at most X / (3 x forward FLOPs) tokens/s: a ceiling, not an estimate.\n"
    "\n"
    "With --layout DP,EP,CP,PP[,TP] it sizes that layout on DP*CP*PP*TP GPUs (EP divides\n"
    "DP*CP): memory per GPU, FLOPs, the bytes one GPU sends per step in every collective\n"
    "and a time estimate (docs/scaleout.md). Options of the layout:\n"
    "  --global-tokens N     tokens per optimizer step (default: DP x context, times\n"
    "                        4 x PP micro-batches when PP > 1)\n"
    "  --gpus-per-node N     GPUs joined by NVLink (default 8)\n"
    "  --nvlink-gbytes X     NVLink bandwidth per GPU in GB/s (default 900)\n"
    "  --ib-gbits X          InfiniBand bandwidth per GPU in Gb/s (default 400)\n"
    "  --peak-tflops X       dense bf16 peak per GPU (default 989)\n"
    "  --mfu X               fraction of the peak reached (default 0.4)\n"
    "  --recompute MODE      overrides train.recompute (below) for the activations\n"
    "\n"
    "With --memory it lists every buffer a training process holds in the device's\n"
    "memory for one micro-batch of B x T tokens (default train.batch_size x\n"
    "train.seq_len): parameters, gradients, the optimizer's state (on the device for\n"
    "cuda, as train --device cuda), each activation and scratch buffer, by name, from\n"
    "the plan the model allocates with (no GPU needed). --recompute MODE overrides\n"
    "train.recompute (true or all, false or none, channel: the MoE and dense FFN,\n"
    "token: the KDA and attention; docs/model.md \"Recomputation\"; under the table the\n"
    "settings that keep less, with their totals); --recompute-chunk N\n"
    "overrides train.recompute_chunk (and turns train.recompute on when N > 0 and\n"
    "the channel mixers are not recomputed); --seq-segment S\n"
    "overrides train.seq_segment (the layers run S tokens of each row at a time,\n"
    "docs/model.md \"Sequence segments\"; 0: off); --json FILE writes the table.\n"
    "--cp N sizes one rank of `train --cp N` (cpu or cuda): its segment of\n"
    "the T tokens (--cp-split even, the default: the first T mod N segments one\n"
    "token longer; balanced: equal FLOPs a rank, the earlier segments longer), its\n"
    "token mixers' segment activations in place of their one-rank ones, for the\n"
    "rank that needs the most (the attention's activations grow with the segment's\n"
    "offset); --batch is then the rows a rank holds (its data-parallel\n"
    "group's share). --ep G sizes one rank of `train --comm mpi|nccl --ep G`: its\n"
    "weights, gradients and optimizer state of the routed experts are those of its\n"
    "n/G experts only, the blocks allocated so from the model's creation (on cuda\n"
    "the fp32 blocks and the bf16 copy alike), plus the exchange's buffers of the\n"
    "MoE layers at a balanced load (each owner receiving the rank's tokens x top_k\n"
    "rows a layer; an uneven load grows them) and, on cpu, one layer's experts that\n"
    "an evaluation gathers.\n";

static int print_memory(const char *cmd, lm_config *c, long B, long T, const char *device, long chunk, long segment,
                        long cp, lm_cp_split split, long ep, const char *json);

static int print_layout(const char *cmd, const lm_config *c, const lm_layout *layout, const lm_cluster *k,
                        long context, long long global_tokens);

static void human(char *buf, size_t n, double x, const char *unit) {
    const char *pre[] = {"", "K", "M", "G", "T", "P"};
    int i = 0;
    while (x >= 1000 && i < 5) {
        x /= 1000;
        i++;
    }
    snprintf(buf, n, "%.3g%s%s", x, pre[i], unit);
}

int cmd_plan(int argc, char **argv) {
    const char *cmd = "plan", *path = NULL, *layout_text = NULL, *device = "cpu", *json = NULL;
    long context = -1, gpn = 8, batch = -1, seq = -1, chunk = -1, segment = -1, cp = 1, ep = 1;
    int recompute = -1;
    lm_cp_split cp_split = LM_CP_SPLIT_EVEN;
    int cp_split_given = 0;
    int memory = 0;
    double global_tokens = -1, nvlink = 900, ib = 400, tflops = 989, mfu = 0.4;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(plan_usage, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--config")) {
            if (!(path = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(argv[i], "--context")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--context", v, 1, 1L << 30, &context))
                return 2;
        } else if (!strcmp(argv[i], "--memory")) {
            memory = 1;
        } else if (!strcmp(argv[i], "--batch")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--batch", v, 1, 1L << 16, &batch)) return 2;
        } else if (!strcmp(argv[i], "--seq")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--seq", v, 1, 1L << 26, &seq)) return 2;
        } else if (!strcmp(argv[i], "--recompute")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if ((recompute = lm_recompute_from_name(v)) < 0) {
                cli_fail(cmd, "--recompute must be true, all, false, none, channel or token, got '%s'", v);
                return 2;
            }
        } else if (!strcmp(argv[i], "--recompute-chunk")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--recompute-chunk", v, 0, 1L << 26, &chunk))
                return 2;
        } else if (!strcmp(argv[i], "--seq-segment")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--seq-segment", v, 0, 1L << 26, &segment))
                return 2;
        } else if (!strcmp(argv[i], "--cp")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--cp", v, 1, 4096, &cp)) return 2;
        } else if (!strcmp(argv[i], "--cp-split")) {
            if (!(v = cli_value(cmd, argc, argv, &i))) return 2;
            if (lm_cp_split_from_name(v, &cp_split)) {
                cli_fail(cmd, "--cp-split: %s", lm_last_error());
                return 2;
            }
            cp_split_given = 1;
        } else if (!strcmp(argv[i], "--ep")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--ep", v, 1, 4096, &ep)) return 2;
        } else if (!strcmp(argv[i], "--device")) {
            if (!(device = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(argv[i], "--json")) {
            if (!(json = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(argv[i], "--layout")) {
            if (!(layout_text = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(argv[i], "--gpus-per-node")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, argv[i - 1], v, 1, 1 << 20, &gpn)) return 2;
        } else if (!strcmp(argv[i], "--global-tokens") || !strcmp(argv[i], "--nvlink-gbytes") ||
                   !strcmp(argv[i], "--ib-gbits") || !strcmp(argv[i], "--peak-tflops") || !strcmp(argv[i], "--mfu")) {
            const char *flag = argv[i];
            double x;
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_double(cmd, flag, v, &x)) return 2;
            if (!(x > 0)) {
                cli_fail(cmd, "%s must be positive, got %s", flag, v);
                return 2;
            }
            double *dst = !strcmp(flag, "--global-tokens") ? &global_tokens : !strcmp(flag, "--nvlink-gbytes") ? &nvlink
                          : !strcmp(flag, "--ib-gbits") ? &ib : !strcmp(flag, "--peak-tflops") ? &tflops : &mfu;
            *dst = x;
        } else {
            cli_fail(cmd, "unknown option '%s' (see --help)", argv[i]);
            return 2;
        }
    }
    if (!path) {
        cli_fail(cmd, "--config is required (see --help)");
        return 2;
    }
    lm_config c;
    if (lm_config_load(path, &c)) return cli_fail(cmd, "%s", lm_last_error());
    if (recompute >= 0) c.recompute = recompute; /* --memory's plan and --layout's activations */
    if (context < 0) context = c.seq_len;
    if (cp_split_given && cp <= 1) return cli_fail(cmd, "--cp-split cuts the sequences of --cp N (N > 1)");
    if (memory) return print_memory(cmd, &c, batch > 0 ? batch : c.batch_size, seq > 0 ? seq : c.seq_len, device,
                                    chunk, segment, cp, cp_split, ep, json);
    if (batch > 0 || seq > 0 || chunk >= 0 || segment >= 0 || json || strcmp(device, "cpu") || cp > 1 || ep > 1)
        return cli_fail(cmd, "--batch, --seq, --device, --recompute-chunk, --seq-segment, --cp, --ep and --json go "
                             "with --memory (see --help)");
    if (layout_text) {
        lm_layout layout;
        if (lm_layout_parse(layout_text, &layout)) return cli_fail(cmd, "%s", lm_last_error());
        lm_cluster k = lm_cluster_default();
        k.gpus_per_node = (int)gpn;
        k.nvlink_bytes_per_s = nvlink * 1e9;
        k.ib_bytes_per_s = ib * 1e9 / 8;
        k.peak_flops = tflops * 1e12;
        k.mfu = mfu;
        /* default: 4 micro-batches a stage keep the pipeline bubble at (PP-1)/(4 PP) */
        long long gt = global_tokens > 0 ? (long long)global_tokens
                                         : (long long)layout.dp * context * (layout.pp > 1 ? 4 * layout.pp : 1);
        return print_layout(cmd, &c, &layout, &k, context, gt);
    }
    lm_plan p;
    lm_config_plan(&c, context, &p);
    int n_mla = 0;
    for (int l = 0; l < c.n_layers; l++) n_mla += lm_config_mixer(&c, l) == LM_MIXER_MLA;
    printf("%s: %d layers (%d KDA, %d MLA), d_model %d, %d routed experts top-%d + %d shared, "
           "context %ld\n\n", path, c.n_layers, c.n_layers - n_mla, n_mla, c.d_model,
           c.n_routed_experts, c.top_k, c.n_shared_experts, context);
    printf("%-18s %12s %12s %14s %16s\n", "component", "params", "active", "fwd FLOP/token",
           "cache bytes/token");
    char a[32], b[32], f[32], m[32];
    for (int i = 0; i < LM_PART_COUNT; i++) {
        human(a, sizeof a, p.params[i], "");
        human(b, sizeof b, p.active_params[i], "");
        human(f, sizeof f, p.flops_per_token[i], "");
        human(m, sizeof m, p.state_bytes_per_token[i], "B");
        printf("%-18s %12s %12s %14s %16s\n", lm_part_name((lm_part)i), a, b, f, m);
    }
    human(a, sizeof a, p.total_params, "");
    human(b, sizeof b, p.total_active, "");
    human(f, sizeof f, p.total_flops, "");
    double cache = 0;
    for (int i = 0; i < LM_PART_COUNT; i++) cache += p.state_bytes_per_token[i];
    human(m, sizeof m, cache, "B");
    printf("%-18s %12s %12s %14s %16s\n", "total", a, b, f, m);
    double kda_state = 0;
    for (int l = 0; l < c.n_layers; l++)
        if (lm_config_mixer(&c, l) == LM_MIXER_KDA)
            kda_state += 4.0 * c.kda_heads * c.kda_head_dim * c.kda_head_dim; /* fp32 state */
    human(m, sizeof m, kda_state, "B");
    printf("\nKDA recurrent state per sequence (fp32, independent of context): %s\n", m);
    human(m, sizeof m, p.total_params * (2 + 4 + 4 + 4), "B");
    printf("training memory for weights (bf16) + fp32 master, grads and one optimizer moment: %s\n", m);
    human(f, sizeof f, 3 * p.total_flops, "");
    printf("training FLOPs per token (about 3x forward): %s\n", f);
    printf("at %g TFLOP/s (--peak-tflops) that allows at most %.0f tokens/s a GPU (every FLOP at the peak)\n",
           tflops, tflops * 1e12 / (3 * p.total_flops));
    return 0;
}

static int print_layout(const char *cmd, const lm_config *c, const lm_layout *layout, const lm_cluster *k,
                        long context, long long global_tokens) {
    lm_layout_plan p;
    if (lm_layout_plan_compute(c, layout, k, context, global_tokens, &p)) return cli_fail(cmd, "%s", lm_last_error());
    char a[32], b[32], f[32];
    printf("layout DP %d x EP %d x CP %d x PP %d x TP %d = %d GPUs (%d a node; NVLink %.0f GB/s, IB %.0f Gb/s)\n",
           layout->dp, layout->ep, layout->cp, layout->pp, layout->tp, p.n_gpus, k->gpus_per_node,
           k->nvlink_bytes_per_s / 1e9, k->ib_bytes_per_s * 8 / 1e9);
    human(a, sizeof a, (double)global_tokens, "");
    printf("context %ld, %s tokens a step: %d micro-batches of one sequence per DP replica, %lld tokens per GPU "
           "each\n\n", context, a, p.micro_batches, (long long)p.tokens_per_gpu);
    printf("pipeline stages (layers) and the Block AttnRes sources crossing each boundary:\n");
    for (int s = 0; s < layout->pp; s++) {
        printf("  stage %3d: layers %3d-%3d", s, p.stage_first_layer[s], p.stage_first_layer[s] + p.stage_layers[s] - 1);
        if (s < layout->pp - 1)
            printf("   -> %d sources x d_model per token cross to stage %d\n", p.boundary_sources[s], s + 1);
        else
            printf("\n");
    }
    printf("\nmemory per GPU (busiest stage, %d):\n", p.busiest_stage);
    human(a, sizeof a, p.dense_params, "");
    human(b, sizeof b, p.expert_params, "");
    printf("  parameters held: %s dense + %s of experts\n", a, b);
    const char *names[5] = {"weights (bf16)", "gradients (fp32)", "optimizer (ZeRO-1)", "activations", "total"};
    double vals[5] = {p.weight_bytes, p.grad_bytes, p.optimizer_bytes, p.activation_bytes, p.total_bytes};
    for (int i = 0; i < 5; i++) {
        printf("  %-20s %10.2f GiB\n", names[i], vals[i] / (1024.0 * 1024 * 1024));
    }
    human(f, sizeof f, p.flops_per_gpu, "FLOP");
    printf("\ncompute per GPU and step: %s, %.3f s at %.0f%% of %.0f TFLOP/s; pipeline bubble %.1f%%\n", f, p.compute_s,
           100 * k->mfu, k->peak_flops / 1e12, 100 * p.bubble_fraction);
    printf("\n%-26s %12s %6s %8s %10s\n", "collective (per GPU, step)", "bytes sent", "group", "link", "seconds");
    for (int i = 0; i < LM_COLL_COUNT; i++) {
        human(a, sizeof a, p.coll_bytes[i], "B");
        printf("%-26s %12s %6d %8s %10.4f\n", lm_collective_name((lm_collective)i), a, p.coll_group[i],
               p.coll_crosses_nodes[i] ? "IB" : "NVLink", p.coll_s[i]);
    }
    printf("\nstep estimate: %.3f s (compute with bubble; gradient and weight traffic hidden under it;\n"
           "the other collectives added) -> %.0f tokens/s on %d GPUs\n", p.step_s, (double)global_tokens / p.step_s,
           p.n_gpus);
    return 0;
}

static double gib(double b) { return b / (1024.0 * 1024 * 1024); }

/* a buffer's name as a JSON string (quotes, backslashes and control characters escaped) */
static void json_string(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
        else if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", (unsigned char)*s);
        else fputc(*s, f);
    }
    fputc('"', f);
}

/* The plan of B x T tokens, as the rank whose segment starts at t0 of cp
 * ranks (cp > 1) holds it (ep > 1: the owner-only experts' plan). */
static int plan_of(const lm_config *c, long B, long T, lm_device dev, long cp, long t0, long ep, lm_model **out) {
    *out = NULL;
    const int owned = ep > 1;
    if (owned ? lm_model_plan_expert_owned(c, (int)B, (int)T, dev, (int)ep, 0, out)
              : lm_model_plan(c, (int)B, (int)T, dev, out))
        return 1;
    if (cp > 1 && lm_model_plan_context_parallel(*out, (int)cp, (int)t0)) {
        lm_model_free(*out);
        *out = NULL;
        return 1;
    }
    return 0;
}

/* Bytes of the buffers of that plan. */
static int plan_bytes(const lm_config *c, long B, long T, lm_device dev, long cp, long t0, long ep, double *bytes) {
    lm_model *m = NULL;
    if (plan_of(c, B, T, dev, cp, t0, ep, &m)) return 1;
    *bytes = (double)lm_model_plan_bytes(m);
    lm_model_free(m);
    return 0;
}

static int print_memory(const char *cmd, lm_config *c, long B, long T, const char *device, long chunk, long segment,
                        long cp, lm_cp_split split, long ep, const char *json) {
    lm_device dev;
    if (lm_device_from_name(device, &dev)) return cli_fail(cmd, "--device must be cpu or cuda, got '%s'", device);
    if (chunk >= 0) {
        c->recompute_chunk = (int)chunk;
        if (chunk > 0 && !lm_recompute_sublayer(c->recompute, 1)) c->recompute = LM_RECOMPUTE_ALL;
    }
    if (segment >= 0) c->seq_segment = (int)segment;
    if (cp > 1 && c->seq_segment > 0)
        return cli_fail(cmd, "--cp with sequence segments (seq_segment %d): the model runs one or the other",
                        c->seq_segment);
    if (B * T > (1L << 26)) return cli_fail(cmd, "--batch x --seq = %ld tokens exceeds 2^26", B * T);
    /* context parallel: the rank that needs the most, the last of the longer segments or the last rank */
    const long T_whole = T;
    long rank = 0, t0 = 0;
    if (ep > 1 && c->n_routed_experts % ep)
        return cli_fail(cmd, "--ep %ld: %d routed experts cannot be split over %ld ranks (model.n_routed_experts must "
                        "be divisible by the group size)", ep, c->n_routed_experts, ep);
    if (cp > 1) {
        if (T < cp)
            return cli_fail(cmd, "--cp %ld: sequences of %ld tokens cannot give each of %ld ranks a segment of at "
                            "least one token", cp, T, cp);
        int64_t *start = malloc((size_t)(cp + 1) * sizeof *start);
        if (!start) return cli_fail(cmd, "out of memory");
        if (lm_config_cp_split(c, T, (int)cp, split, start)) {
            free(start);
            return cli_fail(cmd, "%s", lm_last_error());
        }
        /* the even split's candidates: the last of the longer segments and the last rank; the balanced split's:
         * every rank (the first holds the most tokens, the last the longest prefix) */
        const long r = T % cp;
        double best = -1;
        long len_best = T;
        for (long q = 0; q < cp; q++) {
            if (split == LM_CP_SPLIT_EVEN && q != (r > 0 ? r - 1 : cp - 1) && q != cp - 1) continue;
            double bytes;
            if (plan_bytes(c, B, (long)(start[q + 1] - start[q]), dev, cp, (long)start[q], ep, &bytes)) {
                free(start);
                return cli_fail(cmd, "%s", lm_last_error());
            }
            if (bytes > best) best = bytes, rank = q, t0 = (long)start[q], len_best = (long)(start[q + 1] - start[q]);
        }
        free(start);
        T = len_best;
    }
    lm_model *m = NULL;
    /* expert parallel: a rank allocates its experts' gradients and weights only (every position the same size),
     * on the CPU and on a device */
    const int owned = ep > 1;
    if (plan_of(c, B, T, dev, cp, t0, ep, &m)) return cli_fail(cmd, "%s%s", owned ? "--ep: " : "", lm_last_error());
    /* the optimizer's state and scratch: the device optimizer's for cuda, the host optimizer's for cpu */
    int nt = lm_model_num_tensors(m);
    lm_param *ps = calloc((size_t)nt, sizeof *ps);
    if (!ps) {
        lm_model_free(m);
        return cli_fail(cmd, "out of memory");
    }
    lm_model_optimizer_params(m, ps, c->optimizer);
    /* a tensor's state in proportion to the part of it whose gradient a rank keeps (expert parallel: its experts) */
    size_t state = 0, scratch = 0, norm = 0;
    for (int i = 0; i < nt; i++) {
        size_t first, count, numel = (size_t)lm_param_numel(&ps[i]);
        lm_model_grad_part(m, i, &first, &count);
        state += lm_param_state_floats(&ps[i]) / numel * count * sizeof(float);
    }
    if (dev == LM_DEVICE_CUDA) {
        const lm_ops *ops = lm_backend_cuda_ops();
        for (int i = 0; i < nt; i++)
            if (lm_param_optimizer(&ps[i]) == LM_OPT_MUON) {
                size_t b = ops->muon_scratch_bytes(NULL, ps[i].rows, ps[i].cols, ps[i].n_blocks > 1 ? ps[i].n_blocks : 1);
                scratch = b > scratch ? b : scratch;
            }
        norm = lm_grad_norm_work_bytes(nt);
    } else {
        scratch = lm_optim_scratch_floats(ps, nt) * sizeof(float);
    }
    free(ps);
    enum { N_EXTRA = 5 };
    const char *extra_names[N_EXTRA] = {
        "optimizer state (Muon momentum, AdamW moments)", "optimizer scratch (Newton-Schulz)", "gradient norm work",
        "expert parallel: one MoE layer's routed experts, gathered by an evaluation forward",
        "expert parallel: the exchange's rows of the MoE layers at a balanced load"};
    /* an evaluation on a device runs the experts through the exchange (nothing gathered) */
    size_t extra[N_EXTRA] = {state, scratch, norm, dev == LM_DEVICE_CPU ? lm_model_expert_layer_bytes(m) : 0,
                             ep > 1 ? lm_model_ep_exchange_bytes(m, (int)ep) : 0};
    int nb = lm_model_num_buffers(m);
    double total = (double)lm_model_plan_bytes(m);
    for (int i = 0; i < N_EXTRA; i++) total += (double)extra[i];
    printf("%s on %s, B=%ld x T=%ld (%ld tokens), recompute %s, recompute_chunk %d, seq_segment %d: %zu parameters\n",
           cmd, device, B, T, B * T, c->recompute == LM_RECOMPUTE_ALL ? "on" : c->recompute ? lm_recompute_name(c->recompute) : "off",
           c->recompute_chunk, c->seq_segment,
           lm_model_num_params(m));
    if (cp > 1)
        printf("context parallel over %ld ranks (%s split): rank %ld of a group (the one that needs the most) holds "
               "tokens [%ld, %ld) of %ld\n", cp, lm_cp_split_name(split), rank, t0, t0 + T, T_whole);
    if (owned)
        printf("expert parallel in groups of %ld ranks: a rank keeps the weights, gradients and optimizer state of "
               "%d of the %d routed experts of a layer (%s; a checkpoint sends rank 0 one expert tensor at a time, "
               "not counted here; with --ep-replicated-state or --zero 1 they stay whole)\n", ep,
               c->n_routed_experts / (int)ep, c->n_routed_experts,
               dev == LM_DEVICE_CPU ? "an evaluation gathers one layer's experts at a time, counted below"
                                    : "an evaluation runs them through the exchange");
    printf("\n");
    printf("%-82s %12s %7s\n", "buffer", "GiB", "share");
    for (int i = 0; i < nb; i++) {
        const lm_model_buffer *b = lm_model_buffer_at(m, i);
        printf("%-82s %12.3f %6.1f%%\n", b->name, gib((double)b->bytes), 100.0 * (double)b->bytes / total);
    }
    for (int i = 0; i < N_EXTRA; i++)
        if (extra[i]) printf("%-82s %12.3f %6.1f%%\n", extra_names[i], gib((double)extra[i]), 100.0 * extra[i] / total);
    printf("%-82s %12.3f\n", "total", gib(total));
    printf("(%.1f KiB a token; the CUDA backend adds small scratch of its own and the allocator's rounding)\n",
           total / 1024.0 / (double)(B * T));
    {
        /* the recompute settings that keep less, at this shape (the optimizer's part does not change) */
        const double model_now = (double)lm_model_plan_bytes(m);
        const int modes[2] = {LM_RECOMPUTE_CHANNEL, LM_RECOMPUTE_ALL};
        int shown = 0;
        for (int i = 0; i < 2; i++) {
            if (c->recompute == LM_RECOMPUTE_ALL || c->recompute == modes[i]) continue;
            lm_config a = *c;
            a.recompute = modes[i];
            double b = 0;
            if (plan_bytes(&a, B, T, dev, cp, t0, ep, &b) || b >= model_now) continue;
            printf("%s train.recompute = %s: %.3f GiB", shown ? "," : "with", lm_recompute_json(modes[i]),
                   gib(total - model_now + b));
            shown = 1;
        }
        if (shown) printf(" (--recompute MODE; docs/model.md \"Recomputation\")\n");
    }
    int rc = 0;
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            rc = cli_fail(cmd, "cannot write %s", json);
        } else {
            fprintf(f, "{\"device\": \"%s\", \"batch\": %ld, \"seq\": %ld, \"recompute\": %s, \"recompute_chunk\": %d, "
                       "\"seq_segment\": %d, ",
                    device, B, T, lm_recompute_json(c->recompute),
                    c->recompute_chunk, c->seq_segment);
            if (cp > 1)
                fprintf(f, "\"context_parallel\": %ld, \"cp_split\": \"%s\", \"cp_rank\": %ld, \"segment_start\": %ld, "
                        "\"seq_whole\": %ld, ", cp, lm_cp_split_name(split), rank, t0, T_whole);
            if (ep > 1) fprintf(f, "\"expert_parallel\": %ld, ", ep);
            fprintf(f, "\"total_bytes\": %.0f, \"buffers\": [", total);
            int first = 1;
            for (int i = 0; i < nb; i++) {
                const lm_model_buffer *b = lm_model_buffer_at(m, i);
                fprintf(f, "%s\n  {\"name\": ", first ? "" : ",");
                json_string(f, b->name);
                fprintf(f, ", \"bytes\": %zu}", b->bytes);
                first = 0;
            }
            for (int i = 0; i < N_EXTRA; i++)
                if (extra[i]) {
                    fprintf(f, ",\n  {\"name\": ");
                    json_string(f, extra_names[i]);
                    fprintf(f, ", \"bytes\": %zu}", extra[i]);
                }
            fprintf(f, "]}\n");
            if (fclose(f)) rc = cli_fail(cmd, "cannot write %s", json);
        }
    }
    lm_model_free(m);
    return rc;
}
