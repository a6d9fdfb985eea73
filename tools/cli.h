/* Shared helpers of the longmoe CLI: subcommand table and flag parsing.
 * Each subcommand is `int cmd_<name>(int argc, char **argv)` (argv[0] is the
 * subcommand's own name) returning the process exit code. Errors are printed
 * as "longmoe <cmd>: error: ..." and give exit code 1; bad usage gives 2. */
#ifndef LONGMOE_CLI_H
#define LONGMOE_CLI_H

#include <stdint.h>

int cmd_demo(int argc, char **argv);
int cmd_op(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_experiment(int argc, char **argv);
int cmd_report(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_rl(int argc, char **argv);
int cmd_tokenizer(int argc, char **argv);
int cmd_data(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_op_kda(int argc, char **argv);
int cmd_op_attention(int argc, char **argv);
int cmd_op_moe(int argc, char **argv);
int cmd_op_route(int argc, char **argv);

/* Print "longmoe <cmd>: error: <msg>" to stderr; returns 1. */
int cli_fail(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Parse a whole-string number for `flag`; on error prints and returns non-zero. */
int cli_parse_double(const char *cmd, const char *flag, const char *text, double *out);
int cli_parse_int(const char *cmd, const char *flag, const char *text, long lo, long hi, long *out);
/* Read tensor `name` of `st` as float32 with `ndim` dimensions; where want[d]
 * >= 0 (want may be NULL) dimension d must equal it. `dims` names the layout
 * in messages ("[B,T,H,K]"; may be NULL). shape (may be NULL, may alias want)
 * receives the dimensions. Prints the error and returns 1 on failure. */
struct lm_safetensors;
int cli_read_tensor(const char *cmd, const struct lm_safetensors *st, const char *name, int ndim, const char *dims,
                    const int64_t *want, float **out, int64_t *shape);

/* A command with subcommands (`longmoe data prepare ...`): with no subcommand
 * prints `usage` to stderr and returns 2; with --help/-h anywhere prints it to
 * stdout and returns 0; otherwise returns -1 (run the subcommand). */
int cli_group_help(int argc, char **argv, const char *usage);

/* The value following flag argv[*i]; NULL (with a message) if absent. */
const char *cli_value(const char *cmd, int argc, char **argv, int *i);

#endif
