/* Tokens per second of training steps of the CPU presets, with the split of
 * the time by component. Usage: bench_train [steps] [preset ...] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "longmoe/train.h"

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 6;
    const char *defaults[] = {"configs/tiny.json", "configs/small.json"};
    const char **presets = argc > 2 ? (const char **)argv + 2 : defaults;
    int n = argc > 2 ? argc - 2 : 2;
    printf("build: %s\n\n", lm_build_cpu_target());
    printf("| preset | tokens/step | tokens/s | step ms | kda | attention | moe | dense ffn | attnres | "
           "norms+embed | lm head | optimizer |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++) {
        lm_config c;
        if (lm_config_load(presets[i], &c)) {
            fprintf(stderr, "%s\n", lm_last_error());
            return 1;
        }
        c.eval_every = 0;
        c.ckpt_every = 0;
        c.n_stages = 0; /* the preset's base shape: train.batch_size x train.seq_len */
        c.steps = steps + 1;
        char dir[256];
        snprintf(dir, sizeof dir, "/tmp/longmoe-bench-train-%ld-%d", (long)getpid(), i);
        lm_train_options o = lm_train_options_default(dir);
        o.progress = NULL;
        o.val_batches = 1;
        o.stage_eval_batches = 0;
        lm_train_result r;
        if (lm_train(&c, &o, &r)) {
            fprintf(stderr, "%s\n", lm_last_error());
            return 1;
        }
        char cmd[400];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        if (system(cmd) != 0) return 1;
        double total = r.step_seconds, pct = 100.0 / total;
        printf("| %s | %lld | %.0f | %.1f |", presets[i], (long long)(r.tokens / r.step), r.tokens / total,
               1e3 * total / (double)r.step);
        for (int p = 0; p < LM_TIME_COUNT; p++) printf(" %.1f%% |", pct * r.component_seconds[p]);
        printf(" %.1f%% |\n", pct * r.optimizer_seconds);
    }
    return 0;
}
