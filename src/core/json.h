/* A small strict JSON parser (RFC 8259): the one reader behind safetensors
 * headers and, later, config files. The whole document is parsed into a tree
 * held in one arena; errors name the byte offset and what was expected. */
#ifndef LONGMOE_JSON_H
#define LONGMOE_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "longmoe/core.h"

typedef enum { LM_JSON_NULL, LM_JSON_BOOL, LM_JSON_NUMBER, LM_JSON_STRING, LM_JSON_ARRAY,
               LM_JSON_OBJECT } lm_json_kind;

typedef struct lm_json lm_json;
struct lm_json {
    lm_json_kind kind;
    int boolean;
    double number;
    int number_is_integer;   /* written without fraction or exponent */
    int64_t integer;         /* exact value when number_is_integer and it fits */
    char *string;            /* STRING value (NUL-terminated, escapes decoded) */
    size_t string_length;
    char *key;               /* member name when this value is inside an object */
    lm_json *child;          /* first element / member */
    lm_json *next;           /* next sibling */
    size_t count;            /* number of elements / members */
};

typedef struct lm_json_doc lm_json_doc;

/* Parse `len` bytes. On error returns LM_ERR_FORMAT with a message naming
 * `what` (e.g. the file) and the byte offset. Duplicate object keys are an
 * error. Nesting is limited to 64 levels. */
lm_status lm_json_parse(const char *text, size_t len, const char *what, lm_json_doc **out);
const lm_json *lm_json_root(const lm_json_doc *doc);
void lm_json_free(lm_json_doc *doc);

const lm_json *lm_json_get(const lm_json *object, const char *key); /* NULL if absent */

#endif
