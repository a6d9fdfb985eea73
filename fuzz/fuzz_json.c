/* libFuzzer harness of the JSON reader (src/core/json.c): any byte string
 * either parses into a tree whose invariants hold or gives an error; never a
 * crash, a leak or undefined behaviour. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

/* Walk a parsed value, checking what readers rely on: counts match the child
 * lists, strings are NUL-terminated at their length, object keys are present,
 * free of NUL and unique (lm_json_get finds each member itself). */
static void check_value(const lm_json *v, int depth) {
    if (depth > 64) abort();
    if (v->kind == LM_JSON_STRING && (!v->string || v->string[v->string_length] != 0)) abort();
    if (v->kind == LM_JSON_NUMBER && v->number_is_integer && fabs(v->number) > 9.2e18) abort();
    size_t n = 0;
    for (const lm_json *c = v->child; c; c = c->next, n++) {
        if (v->kind == LM_JSON_OBJECT) {
            if (!c->key) abort();
            if (lm_json_get(v, c->key) != c) abort();
        }
        check_value(c, depth + 1);
    }
    if (n != v->count) abort();
    if (v->kind != LM_JSON_OBJECT && v->kind != LM_JSON_ARRAY && v->child) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    lm_json_doc *doc = NULL;
    if (lm_json_parse((const char *)data, size, "fuzz input", &doc) == LM_OK) {
        check_value(lm_json_root(doc), 0);
        lm_json_free(doc);
    } else if (doc) {
        abort(); /* an error leaves *out NULL */
    }
    return 0;
}
