/* `longmoe experiment NAME`: one technique's variants, same seed and budget. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "longmoe/experiment.h"

static const char *const experiment_usage =
    "usage: longmoe experiment NAME [--preset tiny|small|CONFIG.json] [--steps N] [--seed S]\n"
    "                          --out DIR\n"
    "\n"
    "Trains the same model and data under each variant of one technique, with the same seed\n"
    "and budget, and writes DIR/results.md (a table) and DIR/results.jsonl; each variant's run\n"
    "(metrics.jsonl, checkpoint, report.html) is in DIR/<variant>/. docs/EXPERIMENTS.md has\n"
    "results. --seed S overrides the preset's train.seed (every variant uses it): repeat an\n"
    "experiment under several seeds to see how much of a difference is the seed's.\n"
    "\n"
    "experiments:\n"
    "  balance   none / aux loss / sign / quantile at 64 experts top-4 and 256 top-8\n"
    "  residual  standard / Block AttnRes (2 and 4 sublayers) / Full AttnRes\n"
    "  gate      bounded vs softplus KDA gate\n"
    "  hybrid    all-KDA / 3:1 / 7:1 / all-MLA (8 layers)\n"
    "  context   staged context extension (3 stages, x4 each) vs the final length throughout\n";

int cmd_experiment(int argc, char **argv) {
    const char *cmd = "experiment", *name = NULL, *preset = "tiny", *out = NULL;
    long steps = 0, seed = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(experiment_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--preset")) {
            if (!(preset = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--steps")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 1L << 30, &steps)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 0, 1L << 62, &seed)) return 2;
        } else if (a[0] == '-' || name) {
            cli_fail(cmd, "unexpected argument '%s' (see --help)", a);
            return 2;
        } else {
            name = a;
        }
    }
    if (!name || !out) {
        cli_fail(cmd, "an experiment NAME and --out DIR are required (see --help)");
        return 2;
    }
    if (!lm_experiment_known(name)) {
        cli_fail(cmd, "unknown experiment '%s' (balance, residual, gate, hybrid, context)", name);
        return 2;
    }
    char path[1024];
    if (!strcmp(preset, "tiny") || !strcmp(preset, "small"))
        snprintf(path, sizeof path, "configs/%s.json", preset);
    else
        snprintf(path, sizeof path, "%s", preset);
    lm_config cfg;
    if (lm_config_load(path, &cfg)) return cli_fail(cmd, "%s", lm_last_error());
    if (seed >= 0) cfg.seed = (uint64_t)seed;
    if (lm_experiment_run(name, &cfg, steps, out, stdout)) return cli_fail(cmd, "%s", lm_last_error());
    return 0;
}
