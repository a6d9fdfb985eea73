/* Named parameter tensors: how a layer describes its parameters so that the
 * model can carve them out of one allocation, name them in checkpoints and
 * hand them to the optimizer. */
#ifndef LONGMOE_TENSOR_SPEC_H
#define LONGMOE_TENSOR_SPEC_H

#include <stdint.h>

typedef enum {
    LM_ROLE_MATRIX = 0,   /* a 2-D weight [rows, cols] = [out, in]: Muon */
    LM_ROLE_VECTOR = 1,   /* norms, biases, gate parameters, conv taps: AdamW, no decay */
    LM_ROLE_EMBEDDING = 2 /* embedding / LM head: AdamW */
} lm_param_role;

typedef struct {
    const char *name;  /* e.g. "W_q"; the model prefixes "layers.3.mixer." */
    int64_t rows, cols; /* cols = 1 for vectors */
    lm_param_role role;
    int heads;          /* > 1: Muon orthogonalises each head's block of rows separately */
    float init_value;   /* initial value = init_value + init_std * N(0, 1) */
    float init_std;
} lm_tensor_spec;

#endif
