/* longmoe: one binary, subcommands. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "cli.h"

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command commands[] = {
    {"demo", cmd_demo, "what `make demo` runs: the KDA operator, then the tiny model learning to copy"},
    {"train", cmd_train, "train a model from a config (checkpoints, metrics, resume)"},
    {"rl", cmd_rl, "agentic RL post-training on tool-use environments (warm start, GRPO, resume)"},
    {"report", cmd_report, "one self-contained HTML report of a run directory (curves, expert load, grids)"},
    {"eval", cmd_eval, "long-context evaluation of a checkpoint: validation loss by position, passkey, MQAR"},
    {"sample", cmd_sample, "continue a prompt with a checkpoint (prefill, then recurrent decode)"},
    {"data", cmd_data, "tokenize text files into llm.c-format token shards (train and val)"},
    {"tokenizer", cmd_tokenizer, "byte-level BPE: train a tokenizer, encode and decode (Hugging Face JSON)"},
    {"experiment", cmd_experiment, "train the variants of one technique with the same budget, tabulated"},
    {"plan", cmd_plan, "parameters, FLOPs and memory of a config, by component"},
    {"op", cmd_op, "run one operator on tensors from a safetensors file"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: longmoe <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(f, "\n`longmoe <command> --help` describes each command.\n");
}

/* OpenMP threads that wait by spinning stall a run on a shared machine: with
 * one other busy process on 2 cores a step took 480x longer (docs/RELIABILITY.md,
 * "Threads on a shared machine"). libgomp reads OMP_WAIT_POLICY before main,
 * so when the user did not choose, the program starts itself again with
 * OMP_WAIT_POLICY=passive (idle threads sleep); a failed exec runs on as is. */
static void choose_wait_policy(char **argv) {
    if (getenv("OMP_WAIT_POLICY")) return;
    if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
    execv("/proc/self/exe", argv);
}

int main(int argc, char **argv) {
    choose_wait_policy(argv);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "longmoe: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
