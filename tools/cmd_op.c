/* `longmoe op <operator>`: run one operator on tensors from a file. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} op_command;

static const op_command ops[] = {
    {"kda", cmd_op_kda, "Kimi Delta Attention, chunked or recurrent, forward and backward"},
    {"attention", cmd_op_attention, "causal softmax attention (tiled, GQA), forward and backward"},
    {"moe", cmd_op_moe, "MoE layer: router, grouped GLU experts, LatentMoE, shared; forward and backward"},
    {"route", cmd_op_route, "router top-k with bias, loads, and one quantile or sign update of b"},
};

int cmd_op(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        FILE *f = argc < 2 ? stderr : stdout;
        fprintf(f, "usage: longmoe op <operator> --in IN.safetensors --out OUT.safetensors [options]\n\n"
                   "operators:\n");
        for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
            fprintf(f, "  %-10s %s\n", ops[i].name, ops[i].summary);
        fprintf(f, "\nTensor names and options: docs/ops.md, or `longmoe op <operator> --help`.\n");
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
        if (!strcmp(argv[1], ops[i].name)) return ops[i].run(argc - 1, argv + 1);
    fprintf(stderr, "longmoe op: unknown operator '%s' (see `longmoe op --help`)\n", argv[1]);
    return 2;
}
