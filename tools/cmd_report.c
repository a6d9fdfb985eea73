/* `longmoe report DIR [--out FILE.html] [--log-loss]`: the training report of a
 * run directory as one self-contained HTML file (docs/report.md). */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "longmoe/report.h"

static const char *const report_usage =
    "usage: longmoe report DIR [--out FILE.html] [--log-loss] [--max-points N] [--max-columns N]\n"
    "\n"
    "Draws DIR/metrics.jsonl (and DIR/config.json when present) as one self-contained\n"
    "HTML file with inline SVG (no scripts, nothing loaded from elsewhere): a summary\n"
    "table, loss, learning rate, gradient norm and max attention logit over steps with\n"
    "the context-extension stages, the expert load of every MoE layer as a heatmap with\n"
    "its MaxVio, and the passkey and MQAR accuracy grids. Malformed lines are skipped\n"
    "and counted. Default output: DIR/report.html.\n"
    "\n"
    "  --out FILE       where to write the report\n"
    "  --log-loss       logarithmic y axis for the loss\n"
    "  --max-points N   buckets per curve (default 600; longer runs are averaged)\n"
    "  --max-columns N  step columns per expert heatmap (default 300)\n";

int cmd_report(int argc, char **argv) {
    const char *cmd = "report", *dir = NULL, *out = NULL;
    long max_points = 600, max_columns = 300;
    int log_loss = 0;
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(report_usage, stdout);
            return 0;
        } else if (!strcmp(argv[i], "--out")) {
            if (!(out = cli_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(argv[i], "--log-loss")) {
            log_loss = 1;
        } else if (!strcmp(argv[i], "--max-points")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) || cli_parse_int(cmd, "--max-points", v, 2, 100000, &max_points))
                return 2;
        } else if (!strcmp(argv[i], "--max-columns")) {
            if (!(v = cli_value(cmd, argc, argv, &i)) ||
                cli_parse_int(cmd, "--max-columns", v, 2, 100000, &max_columns))
                return 2;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            cli_fail(cmd, "unknown option '%s' (see --help)", argv[i]);
            return 2;
        } else if (!dir) {
            dir = argv[i];
        } else {
            cli_fail(cmd, "one run directory expected, got '%s' and '%s' (see --help)", dir, argv[i]);
            return 2;
        }
    }
    if (!dir) {
        cli_fail(cmd, "the run directory is required: longmoe report DIR (see --help)");
        return 2;
    }
    lm_report_options opt = lm_report_options_default(dir);
    opt.out_path = out;
    opt.log_loss = log_loss;
    opt.max_points = (int)max_points;
    opt.max_columns = (int)max_columns;
    lm_report_summary sum;
    if (lm_report_write(&opt, &sum)) return cli_fail(cmd, "%s", lm_last_error());
    printf("report: %s%s (%.1f KB) from %lld records", out ? out : dir, out ? "" : "/report.html",
           sum.html_bytes / 1024.0, (long long)sum.records);
    if (sum.moe_layers) printf(", %d MoE layers x %d experts in %d columns", sum.moe_layers, sum.experts,
                               sum.heatmap_columns);
    if (sum.malformed)
        printf("; %lld malformed line%s skipped", (long long)sum.malformed, sum.malformed == 1 ? "" : "s");
    printf("\n");
    return 0;
}
