/* libFuzzer harness of the safetensors reader (lm_safetensors_parse): any
 * byte string either parses into tensors that lie inside the file and tile its
 * data, or gives an error; reading every float tensor back stays in bounds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lm_safetensors *st = NULL;
    if (lm_safetensors_parse(data, size, "fuzz input", &st) != LM_OK) {
        if (st) abort();
        return 0;
    }
    size_t total = 0;
    for (int i = 0; i < lm_safetensors_count(st); i++) {
        const lm_st_tensor *t = lm_safetensors_at(st, i);
        if (!t || !t->name || lm_safetensors_find(st, t->name) != t) abort();
        if (t->ndim < 0 || t->ndim > LM_ST_MAX_DIMS) abort();
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
        if (numel != t->numel || t->nbytes != (size_t)numel * lm_dtype_size(t->dtype)) abort();
        total += t->nbytes;
        /* touch the first and last byte: ASan reports a range outside the copy */
        if (t->nbytes) {
            volatile unsigned char a = ((const unsigned char *)t->data)[0];
            volatile unsigned char b = ((const unsigned char *)t->data)[t->nbytes - 1];
            (void)a;
            (void)b;
        }
        if (t->numel <= (1 << 16)) {
            float *x = NULL;
            int64_t shape[LM_ST_MAX_DIMS];
            lm_status s = lm_safetensors_read_f32(st, t->name, -1, &x, shape);
            int is_float = t->dtype == LM_DTYPE_F32 || t->dtype == LM_DTYPE_BF16 ||
                           t->dtype == LM_DTYPE_F16 || t->dtype == LM_DTYPE_F64;
            if ((s == LM_OK) != is_float) abort();
            free(x);
        }
    }
    if (total > size) abort();
    (void)lm_safetensors_metadata(st, "format");
    (void)lm_safetensors_at(st, -1);
    lm_safetensors_close(st);
    return 0;
}
