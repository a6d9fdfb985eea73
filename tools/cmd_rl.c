/* `longmoe rl`: agentic RL post-training on the tool-use environments
 * (docs/rl.md): a supervised warm start on the solvers' demonstrations, then
 * group-relative policy optimisation. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "longmoe/rl_run.h"

static const char *const rl_usage =
    "usage: longmoe rl --config CONFIG.json --out DIR [--init CHECKPOINT] [--resume] [--warm-steps N]\n"
    "                  [--steps N] [--stop-after N] [--credit outcome|turn] [--seed S]\n"
    "                  [--eval-split heldout|select] [--quiet]\n"
    "\n"
    "Post-trains a model on the environments of the config's `rl` section (docs/rl.md,\n"
    "docs/config.md): rl.warm_steps supervised steps on the solvers' demonstrations (the loss\n"
    "only on the bytes the model writes), then rl.steps RL steps: rl.group rollouts for each of\n"
    "rl.tasks tasks, group-relative advantages, the clipped policy ratio (optionally a KL to the\n"
    "frozen warm-start model). Held-out greedy success is evaluated after the warm start, every\n"
    "rl.eval_every RL steps and at the end. DIR receives metrics.jsonl (types rl_warm, rl,\n"
    "rl_eval), checkpoint-<step>/ and `latest`; `longmoe report DIR` draws the curves.\n"
    "\n"
    "options:\n"
    "  --init DIR     start from this checkpoint (its model config; the config's model\n"
    "                 sections are then ignored)\n"
    "  --resume       continue from DIR/latest, bit-identically to an uninterrupted run\n"
    "  --warm-steps N supervised steps (overrides rl.warm_steps)\n"
    "  --steps N      RL steps (overrides rl.steps)\n"
    "  --stop-after N stop with a checkpoint once N steps (warm start included) are done\n"
    "  --credit C     outcome or turn (overrides rl.credit)\n"
    "  --seed S       overrides rl.seed (tasks and sampling; held-out seeds stay the same)\n"
    "  --eval-split S heldout (default) or select: the seeds every evaluation of this call uses.\n"
    "                 select is for choosing checkpoints, so that held-out stays a test set;\n"
    "                 with --init CKPT --warm-steps 0 --steps 0 it evaluates CKPT alone\n"
    "  --quiet        no progress lines\n";

int cmd_rl(int argc, char **argv) {
    const char *cmd = "rl", *config = NULL, *out = NULL, *init = NULL, *credit = NULL, *split = NULL, *v;
    int resume = 0, quiet = 0;
    long warm = -1, steps = -1, stop_after = 0, seed = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(rl_usage, stdout);
            return 0;
        } else if (!strcmp(a, "--config")) {
            if (!(config = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--out")) {
            if (!(out = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--init")) {
            if (!(init = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--credit")) {
            if (!(credit = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--eval-split")) {
            if (!(split = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--resume")) {
            resume = 1;
        } else if (!strcmp(a, "--quiet")) {
            quiet = 1;
        } else if (!strcmp(a, "--warm-steps")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 0, 1L << 30, &warm)) return 2;
        } else if (!strcmp(a, "--steps")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 0, 1L << 40, &steps)) return 2;
        } else if (!strcmp(a, "--stop-after")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 1, 1L << 40, &stop_after)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, a, v, 0, 0x7fffffffL, &seed)) return 2;
        } else {
            cli_fail(cmd, "unknown option '%s' (see --help)", a);
            return 2;
        }
    }
    if (!out || (!config && !resume)) {
        cli_fail(cmd, "--out and --config are required (--config may be left out with --resume)");
        return 2;
    }
    if (resume && (config || init || credit || warm >= 0 || steps >= 0 || seed >= 0)) {
        cli_fail(cmd, "--resume continues the run as its checkpoint describes it: leave out --config, --init, "
                 "--credit, --warm-steps, --steps and --seed");
        return 2;
    }
    lm_config mc;
    lm_rl_config rc;
    lm_config_defaults(&mc);
    lm_rl_config_defaults(&rc);
    if (config && lm_rl_config_load(config, &mc, &rc)) return cli_fail(cmd, "%s", lm_last_error());
    if (warm >= 0) rc.warm_steps = (int)warm;
    if (steps >= 0) rc.steps = steps;
    if (seed >= 0) rc.seed = (uint64_t)seed;
    if (credit) {
        if (!strcmp(credit, "outcome")) rc.credit = LM_CREDIT_OUTCOME;
        else if (!strcmp(credit, "turn")) rc.credit = LM_CREDIT_TURN;
        else return cli_fail(cmd, "--credit must be outcome or turn, got '%s'", credit) + 1;
    }
    lm_rl_split eval_split = LM_RL_SPLIT_HELDOUT;
    if (split) {
        if (!strcmp(split, "heldout")) eval_split = LM_RL_SPLIT_HELDOUT;
        else if (!strcmp(split, "select")) eval_split = LM_RL_SPLIT_SELECT;
        else return cli_fail(cmd, "--eval-split must be heldout or select, got '%s'", split) + 1;
    }
    lm_rl_options opt = {out, init, resume, stop_after, quiet ? NULL : stdout, eval_split};
    lm_rl_result res;
    if (lm_rl_run(&mc, &rc, &opt, &res)) return cli_fail(cmd, "%s", lm_last_error());
    if (!quiet && !isnan(res.warm_success[0]) && !isnan(res.final_success[0])) {
        printf("%s greedy success, warm start -> after RL:",
               eval_split == LM_RL_SPLIT_SELECT ? "selection" : "held-out");
        for (int e = 0; e < res.n_envs; e++)
            printf(" %s %.1f%% -> %.1f%%", lm_env_kind_name(res.envs[e]), 100 * res.warm_success[e],
                   100 * res.final_success[e]);
        printf("\n");
    }
    return 0;
}
