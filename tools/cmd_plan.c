/* `longmoe plan --config C [--context N]`: parameters (total and active per
 * token), forward FLOPs per token and memory per token, by component. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "longmoe/config.h"

static const char *const plan_usage =
    "usage: longmoe plan --config CONFIG.json [--context N]\n"
    "\n"
    "Prints, by component, the parameters stored and active per token, the forward\n"
    "FLOPs per token at a causal context of N tokens (default: train.seq_len), and the\n"
    "inference cache per token of context (bf16). Training costs about 3x the forward.\n";

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
    const char *cmd = "plan", *path = NULL;
    long context = -1;
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
    if (context < 0) context = c.seq_len;
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
    return 0;
}
