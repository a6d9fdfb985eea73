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

int main(void) {
    RUN(test_gate_experiment_writes_table_lines_and_reports);
    return test_summary();
}
