/* libFuzzer harness of the tokenizer file reader (lm_tokenizer_parse): any
 * byte string either gives an error or a tokenizer that writes back to the
 * same vocabulary (lm_tokenizer_to_json, lm_tokenizer_parse) and encodes any
 * bytes (here: the input's own first 2 KB) to ids that decode back to them. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "longmoe/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lm_tokenizer *tok = NULL;
    if (lm_tokenizer_parse((const char *)data, size, "fuzz input", &tok) != LM_OK) {
        if (tok) abort();
        return 0;
    }
    int V = lm_tokenizer_vocab_size(tok);
    if (V < LM_TOKENIZER_MIN_VOCAB || lm_tokenizer_eot_id(tok) != V - 1) abort();
    size_t len;
    if (lm_tokenizer_token(tok, V, &len) || lm_tokenizer_token(tok, -1, &len)) abort();
    /* written back, it reads back to the same tokens */
    char *json = NULL;
    size_t json_len = 0;
    lm_tokenizer *back = NULL;
    if (lm_tokenizer_to_json(tok, &json, &json_len) || lm_tokenizer_parse(json, json_len, "round trip", &back)) {
        fprintf(stderr, "written tokenizer does not read back: %s\n", lm_last_error());
        abort();
    }
    if (lm_tokenizer_vocab_size(back) != V) abort();
    for (int i = 0; i < V; i++) {
        size_t la, lb;
        const uint8_t *a = lm_tokenizer_token(tok, i, &la), *b = lm_tokenizer_token(back, i, &lb);
        if (!a || !b || la != lb || memcmp(a, b, la)) abort();
    }
    /* bytes encode and decode back to themselves */
    size_t n = size < 2048 ? size : 2048, n_ids = 0, out_len = 0;
    int32_t *ids = NULL;
    char *bytes = NULL;
    if (lm_tokenizer_encode(tok, data, n, &ids, &n_ids)) abort();
    for (size_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= V) abort();
    if (lm_tokenizer_decode(tok, ids, n_ids, &bytes, &out_len)) abort();
    if (out_len != n || (n && memcmp(bytes, data, n))) abort();
    free(ids);
    free(bytes);
    free(json);
    lm_tokenizer_free(back);
    lm_tokenizer_free(tok);
    return 0;
}
