/* Strict recursive-descent JSON parser into an arena-allocated tree. */
#include "json.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct lm_json_doc {
    lm_json *root;
    char *arena;     /* all nodes and strings live here */
    size_t used, capacity;
};

typedef struct {
    const char *s;
    size_t len, pos;
    const char *what;
    lm_json_doc *doc;
    int depth;
} parser;

static void *arena_alloc(lm_json_doc *d, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (d->used + n > d->capacity) return NULL;
    void *p = d->arena + d->used;
    d->used += n;
    return p;
}

static lm_status fail(parser *p, const char *msg) {
    return lm_error(LM_ERR_FORMAT, "%s: invalid JSON at byte %zu: %s", p->what, p->pos, msg);
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') p->pos++;
        else break;
    }
}

static lm_status parse_value(parser *p, lm_json **out);

static int hex4(const char *s, unsigned *v) {
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        unsigned d;
        if (c >= '0' && c <= '9') d = (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') d = (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') d = (unsigned)(c - 'A' + 10);
        else return -1;
        *v = *v * 16 + d;
    }
    return 0;
}

static size_t put_utf8(char *o, unsigned cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xc0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f)); return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); o[3] = (char)(0x80 | (cp & 0x3f)); return 4;
}

/* Validate one UTF-8 sequence starting at s[i]; return its length or 0. */
static size_t utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) return 1;
    if ((c & 0xe0) == 0xc0) { len = 2; min = 0x80; c &= 0x1f; }
    else if ((c & 0xf0) == 0xe0) { len = 3; min = 0x800; c &= 0x0f; }
    else if ((c & 0xf8) == 0xf0) { len = 4; min = 0x10000; c &= 0x07; }
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        c = (c << 6) | (s[i] & 0x3f);
    }
    if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return 0;
    return len;
}

static lm_status parse_string(parser *p, char **out, size_t *out_len) {
    if (p->pos >= p->len || p->s[p->pos] != '"') return fail(p, "expected a string");
    p->pos++;
    /* decoded length <= raw length */
    size_t start = p->pos, end = start;
    while (end < p->len && p->s[end] != '"') end += (p->s[end] == '\\') ? 2 : 1;
    if (end >= p->len) return fail(p, "unterminated string");
    char *o = arena_alloc(p->doc, end - start + 1);
    if (!o) return fail(p, "document too large");
    size_t n = 0;
    while (p->s[p->pos] != '"') {
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c < 0x20) return fail(p, "control character in string");
        if (c == '\\') {
            char e = p->s[p->pos + 1];
            p->pos += 2;
            switch (e) {
            case '"': o[n++] = '"'; break;
            case '\\': o[n++] = '\\'; break;
            case '/': o[n++] = '/'; break;
            case 'b': o[n++] = '\b'; break;
            case 'f': o[n++] = '\f'; break;
            case 'n': o[n++] = '\n'; break;
            case 'r': o[n++] = '\r'; break;
            case 't': o[n++] = '\t'; break;
            case 'u': {
                unsigned cp;
                if (p->pos + 4 > p->len || hex4(p->s + p->pos, &cp)) return fail(p, "bad \\u escape");
                p->pos += 4;
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    unsigned lo;
                    if (p->pos + 6 > p->len || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u' ||
                        hex4(p->s + p->pos + 2, &lo) || lo < 0xdc00 || lo > 0xdfff)
                        return fail(p, "unpaired surrogate in \\u escape");
                    p->pos += 6;
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                } else if (cp >= 0xdc00 && cp <= 0xdfff) {
                    return fail(p, "unpaired surrogate in \\u escape");
                }
                n += put_utf8(o + n, cp);
                break;
            }
            default: return fail(p, "unknown escape in string");
            }
        } else {
            size_t l = utf8_len((const unsigned char *)p->s + p->pos, end - p->pos);
            if (!l) return fail(p, "invalid UTF-8 in string");
            memcpy(o + n, p->s + p->pos, l);
            n += l;
            p->pos += l;
        }
    }
    p->pos++;
    o[n] = 0;
    *out = o;
    *out_len = n;
    return LM_OK;
}

static lm_status parse_number(parser *p, lm_json *v) {
    size_t st = p->pos;
    const char *s = p->s;
    int integer = 1;
    if (p->pos < p->len && s[p->pos] == '-') p->pos++;
    if (p->pos >= p->len) return fail(p, "truncated number");
    if (s[p->pos] == '0') p->pos++;
    else if (s[p->pos] >= '1' && s[p->pos] <= '9')
        while (p->pos < p->len && s[p->pos] >= '0' && s[p->pos] <= '9') p->pos++;
    else return fail(p, "expected a value");
    if (p->pos < p->len && s[p->pos] == '.') {
        integer = 0;
        p->pos++;
        if (p->pos >= p->len || s[p->pos] < '0' || s[p->pos] > '9') return fail(p, "digit expected after '.'");
        while (p->pos < p->len && s[p->pos] >= '0' && s[p->pos] <= '9') p->pos++;
    }
    if (p->pos < p->len && (s[p->pos] == 'e' || s[p->pos] == 'E')) {
        integer = 0;
        p->pos++;
        if (p->pos < p->len && (s[p->pos] == '+' || s[p->pos] == '-')) p->pos++;
        if (p->pos >= p->len || s[p->pos] < '0' || s[p->pos] > '9') return fail(p, "digit expected in exponent");
        while (p->pos < p->len && s[p->pos] >= '0' && s[p->pos] <= '9') p->pos++;
    }
    char buf[64];
    size_t n = p->pos - st;
    if (n >= sizeof buf) {
        if (integer) return fail(p, "integer too long");
        n = sizeof buf - 1; /* long fractions: strtod on the prefix is accurate enough */
    }
    memcpy(buf, s + st, n);
    buf[n] = 0;
    v->kind = LM_JSON_NUMBER;
    v->number = strtod(buf, NULL);
    v->number_is_integer = integer;
    if (integer) {
        char *endp;
        long long x = strtoll(buf, &endp, 10);
        if (fabs(v->number) > 9.2e18) return fail(p, "integer out of range");
        v->integer = (int64_t)x;
    }
    return LM_OK;
}

static lm_status parse_literal(parser *p, const char *word) {
    size_t n = strlen(word);
    if (p->pos + n > p->len || memcmp(p->s + p->pos, word, n) != 0) return fail(p, "expected a value");
    p->pos += n;
    return LM_OK;
}

static lm_status parse_value(parser *p, lm_json **out) {
    lm_status st;
    if (++p->depth > 64) return fail(p, "nesting deeper than 64 levels");
    lm_json *v = arena_alloc(p->doc, sizeof *v);
    if (!v) return fail(p, "document too large");
    memset(v, 0, sizeof *v);
    skip_ws(p);
    if (p->pos >= p->len) return fail(p, "unexpected end of input");
    char c = p->s[p->pos];
    if (c == '{' || c == '[') {
        int is_obj = c == '{';
        v->kind = is_obj ? LM_JSON_OBJECT : LM_JSON_ARRAY;
        p->pos++;
        skip_ws(p);
        lm_json **tail = &v->child;
        if (p->pos < p->len && p->s[p->pos] == (is_obj ? '}' : ']')) {
            p->pos++;
        } else {
            for (;;) {
                char *key = NULL;
                size_t key_len = 0;
                if (is_obj) {
                    skip_ws(p);
                    if ((st = parse_string(p, &key, &key_len))) return st;
                    if (strlen(key) != key_len) return fail(p, "NUL byte in object key");
                    for (lm_json *m = v->child; m; m = m->next)
                        if (strcmp(m->key, key) == 0) return fail(p, "duplicate object key");
                    skip_ws(p);
                    if (p->pos >= p->len || p->s[p->pos] != ':') return fail(p, "expected ':'");
                    p->pos++;
                }
                lm_json *item;
                if ((st = parse_value(p, &item))) return st;
                item->key = key;
                *tail = item;
                tail = &item->next;
                v->count++;
                skip_ws(p);
                if (p->pos >= p->len) return fail(p, "unexpected end of input");
                if (p->s[p->pos] == ',') { p->pos++; continue; }
                if (p->s[p->pos] == (is_obj ? '}' : ']')) { p->pos++; break; }
                return fail(p, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
            }
        }
    } else if (c == '"') {
        v->kind = LM_JSON_STRING;
        if ((st = parse_string(p, &v->string, &v->string_length))) return st;
    } else if (c == 't') {
        v->kind = LM_JSON_BOOL; v->boolean = 1;
        if ((st = parse_literal(p, "true"))) return st;
    } else if (c == 'f') {
        v->kind = LM_JSON_BOOL;
        if ((st = parse_literal(p, "false"))) return st;
    } else if (c == 'n') {
        v->kind = LM_JSON_NULL;
        if ((st = parse_literal(p, "null"))) return st;
    } else {
        if ((st = parse_number(p, v))) return st;
    }
    p->depth--;
    *out = v;
    return LM_OK;
}

lm_status lm_json_parse(const char *text, size_t len, const char *what, lm_json_doc **out) {
    *out = NULL;
    lm_json_doc *d = calloc(1, sizeof *d);
    if (!d) return lm_error(LM_ERR_MEMORY, "out of memory parsing %s", what);
    /* a value takes at least two input bytes (one for the last); each costs one
     * node plus at most 16 bytes of rounding, and one string of at most its raw
     * length + 16 bytes of rounding */
    d->capacity = 2 * len + (len / 2 + 2) * (sizeof(lm_json) + 48) + 64;
    d->arena = malloc(d->capacity);
    if (!d->arena) {
        free(d);
        return lm_error(LM_ERR_MEMORY, "out of memory parsing %s", what);
    }
    parser p = {text, len, 0, what, d, 0};
    lm_status st = parse_value(&p, &d->root);
    if (!st) {
        skip_ws(&p);
        if (p.pos != len) st = fail(&p, "trailing characters after the document");
    }
    if (st) {
        lm_json_free(d);
        return st;
    }
    *out = d;
    return LM_OK;
}

const lm_json *lm_json_root(const lm_json_doc *doc) { return doc->root; }

void lm_json_free(lm_json_doc *doc) {
    if (!doc) return;
    free(doc->arena);
    free(doc);
}

const lm_json *lm_json_get(const lm_json *object, const char *key) {
    if (!object || object->kind != LM_JSON_OBJECT) return NULL;
    for (const lm_json *m = object->child; m; m = m->next)
        if (strcmp(m->key, key) == 0) return m;
    return NULL;
}
