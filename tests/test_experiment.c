/* `longmoe experiment`: every variant of an experiment trains with the same
 * seed and budget, and the table, the JSON lines and each variant's report
 * are written. */
#include <sys/stat.h>
#include <unistd.h>

#include "longmoe/experiment.h"
#include "test.h"
#include "test_models.h"

static void test_gate_experiment_writes_table_lines_and_reports(void) {
    char dir[256], path[512];
    snprintf(dir, sizeof dir, "/tmp/longmoe-test-experiment-%ld", (long)getpid());
    lm_config c = test_micro_config();
    c.seq_len = 24;
    CHECK(!lm_experiment_run("gate", &c, 3, dir, NULL), "%s", lm_last_error());
    const char *files[] = {"results.md", "results.jsonl", "bounded/report.html", "softplus/report.html",
                           "softplus/checkpoint-00000003/model.safetensors"};
    struct stat sb;
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        CHECK(stat(path, &sb) == 0 && sb.st_size > 0, "%s written", files[i]);
    }
    snprintf(path, sizeof path, "%s/results.jsonl", dir);
    FILE *f = fopen(path, "r");
    char line[4096];
    int n = 0, bounded = 0;
    while (f && fgets(line, sizeof line, f)) {
        n++;
        bounded += strstr(line, "\"variant\": \"bounded\"") != NULL && strstr(line, "\"steps\": 3") != NULL;
    }
    if (f) fclose(f);
    CHECK(n == 2 && bounded == 1, "two variants of 3 steps (%d lines)", n);
    CHECK(lm_experiment_run("colour", &c, 3, dir, NULL) == LM_ERR_ARG && strstr(lm_last_error(), "unknown experiment"),
          "%s", lm_last_error());
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

/* --seed reaches every variant's run; a bad seed is refused by name. */
static void test_cli_seed_overrides_the_preset(void) {
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/longmoe-test-experiment-seed-%ld", (long)getpid());
    CHECK(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    lm_config c = test_micro_config();
    c.seq_len = 24;
    char *json = lm_config_to_json(&c);
    CHECK(json != NULL, "%s", lm_last_error());
    FILE *f = fopen(test_path(dir, "micro.json"), "w");
    CHECK(f && fputs(json, f) >= 0 && fclose(f) == 0, "write micro.json");
    free(json);
    char args[1200];
    snprintf(args, sizeof args, "experiment gate --preset %s --steps 2 --seed 77 --out %s",
             test_path(dir, "micro.json"), test_path(dir, "runs"));
    CHECK(test_run_cli(args, test_path(dir, "out.txt"), test_path(dir, "err.txt")) == 0,
          "experiment with --seed ran");
    CHECK(test_file_has(test_path(dir, "runs/bounded/config.json"), "\"seed\": 77") &&
              test_file_has(test_path(dir, "runs/softplus/config.json"), "\"seed\": 77"),
          "both variants trained with seed 77");
    snprintf(args, sizeof args, "experiment gate --preset %s --steps 2 --seed -1 --out %s",
             test_path(dir, "micro.json"), test_path(dir, "bad"));
    CHECK(test_run_cli(args, test_path(dir, "out.txt"), test_path(dir, "err.txt")) == 2 &&
              test_file_has(test_path(dir, "err.txt"), "--seed"),
          "a negative seed is refused, naming --seed");
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

int main(void) {
    RUN(test_gate_experiment_writes_table_lines_and_reports);
    RUN(test_cli_seed_overrides_the_preset);
    return test_summary();
}
