/* safetensors reader and writer (format: include/longmoe/safetensors.h). */
#define _POSIX_C_SOURCE 200809L
#include "longmoe/safetensors.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "files.h"
#include "json.h"

#define LM_ST_MAX_HEADER (100u * 1024u * 1024u)

struct lm_safetensors {
    unsigned char *bytes;
    size_t size;
    lm_json_doc *doc;
    lm_st_tensor *tensors;
    int count;
    const lm_json *metadata;
};

static int cmp_by_offset(const void *a, const void *b) {
    const lm_st_tensor *x = a, *y = b;
    const unsigned char *px = x->data, *py = y->data;
    if (px != py) return px < py ? -1 : 1;
    return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

static lm_status parse_entry(const lm_json *e, const char *what, const unsigned char *data,
                             size_t data_size, lm_st_tensor *t) {
    if (e->kind != LM_JSON_OBJECT)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': entry is not an object", what, e->key);
    const lm_json *dt = lm_json_get(e, "dtype"), *sh = lm_json_get(e, "shape"),
                  *off = lm_json_get(e, "data_offsets");
    if (!dt || !sh || !off || e->count != 3)
        return lm_error(LM_ERR_FORMAT,
                        "%s: tensor '%s': needs exactly the keys dtype, shape, data_offsets",
                        what, e->key);
    if (dt->kind != LM_JSON_STRING || lm_dtype_from_name(dt->string, &t->dtype))
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': unsupported dtype %s%s%s", what, e->key,
                        dt->kind == LM_JSON_STRING ? "'" : "",
                        dt->kind == LM_JSON_STRING ? dt->string : "(not a string)",
                        dt->kind == LM_JSON_STRING ? "'" : "");
    if (sh->kind != LM_JSON_ARRAY || sh->count > LM_ST_MAX_DIMS)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': shape must be an array of at most %d "
                        "integers", what, e->key, LM_ST_MAX_DIMS);
    t->ndim = (int)sh->count;
    int64_t numel = 1;
    int i = 0;
    for (const lm_json *d = sh->child; d; d = d->next, i++) {
        if (d->kind != LM_JSON_NUMBER || !d->number_is_integer || d->integer < 0)
            return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not a non-negative "
                            "integer", what, e->key, i);
        t->shape[i] = d->integer;
        if (d->integer && numel > INT64_MAX / 16 / d->integer)
            return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': shape is too large", what, e->key);
        numel *= d->integer;
    }
    t->numel = numel;
    if (off->kind != LM_JSON_ARRAY || off->count != 2 || off->child->kind != LM_JSON_NUMBER ||
        off->child->next->kind != LM_JSON_NUMBER || !off->child->number_is_integer ||
        !off->child->next->number_is_integer)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': data_offsets must be [begin, end] "
                        "integers", what, e->key);
    int64_t b = off->child->integer, en = off->child->next->integer;
    if (b < 0 || en < b || (uint64_t)en > data_size)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': data_offsets [%lld, %lld] outside the "
                        "%zu data bytes", what, e->key, (long long)b, (long long)en, data_size);
    size_t need = (size_t)numel * lm_dtype_size(t->dtype);
    if ((size_t)(en - b) != need)
        return lm_error(LM_ERR_FORMAT, "%s: tensor '%s': shape x dtype size = %zu bytes but "
                        "data_offsets span %lld", what, e->key, need, (long long)(en - b));
    t->name = e->key;
    t->data = data + b;
    t->nbytes = need;
    return LM_OK;
}

/* FNV-1a over 64-bit little-endian words (then the tail bytes, then the
 * length): each step is a bijection of the running value, so any change of
 * one word changes the result. Streamed: the words may straddle pieces. */
typedef struct {
    uint64_t h;
    unsigned char tail[8];
    int n_tail;
    size_t n;
} checksum_state;

#define CHECKSUM_PRIME 0x100000001b3ull

static uint64_t load_le64(const unsigned char *p) {
    uint64_t w = 0;
    for (int k = 7; k >= 0; k--) w = (w << 8) | p[k];
    return w;
}

static void checksum_begin(checksum_state *c) {
    memset(c, 0, sizeof *c);
    c->h = 0xcbf29ce484222325ull;
}

static void checksum_add(checksum_state *c, const unsigned char *p, size_t n) {
    c->n += n;
    while (n && c->n_tail) { /* complete a word begun by the last piece */
        c->tail[c->n_tail++] = *p++;
        n--;
        if (c->n_tail == 8) {
            c->h = (c->h ^ load_le64(c->tail)) * CHECKSUM_PRIME;
            c->n_tail = 0;
        }
    }
    for (; n >= 8; p += 8, n -= 8) c->h = (c->h ^ load_le64(p)) * CHECKSUM_PRIME;
    while (n--) c->tail[c->n_tail++] = *p++;
}

static uint64_t checksum_end(checksum_state *c) {
    uint64_t h = c->h;
    for (int i = 0; i < c->n_tail; i++) h = (h ^ c->tail[i]) * CHECKSUM_PRIME;
    return (h ^ (uint64_t)c->n) * CHECKSUM_PRIME;
}

uint64_t lm_checksum64(const void *bytes, size_t n) {
    checksum_state c;
    checksum_begin(&c);
    checksum_add(&c, bytes, n);
    return checksum_end(&c);
}

/* "<16 hex digits>" of the data section, the value of LM_ST_CHECKSUM_KEY. */
static void checksum_text(const unsigned char *data, size_t n, char out[17]) {
    snprintf(out, 17, "%016llx", (unsigned long long)lm_checksum64(data, n));
}

static lm_status parse_owned(lm_safetensors *st, const char *what) {
    lm_status s;
    if (st->size < 8)
        return lm_error(LM_ERR_FORMAT, "%s: %zu bytes is too short for a safetensors file "
                        "(needs an 8-byte header length)", what, st->size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | st->bytes[i];
    if (n > LM_ST_MAX_HEADER || n > st->size - 8)
        return lm_error(LM_ERR_FORMAT, "%s: header length %llu does not fit the file of %zu "
                        "bytes", what, (unsigned long long)n, st->size);
    if (n < 2 || st->bytes[8] != '{')
        return lm_error(LM_ERR_FORMAT, "%s: header must be a JSON object starting with '{'", what);
    if ((s = lm_json_parse((const char *)st->bytes + 8, (size_t)n, what, &st->doc))) return s;
    const lm_json *root = lm_json_root(st->doc);
    if (root->kind != LM_JSON_OBJECT)
        return lm_error(LM_ERR_FORMAT, "%s: header is not a JSON object", what);
    const unsigned char *data = st->bytes + 8 + n;
    size_t data_size = st->size - 8 - (size_t)n;
    st->tensors = calloc(root->count ? root->count : 1, sizeof *st->tensors);
    if (!st->tensors) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    for (const lm_json *e = root->child; e; e = e->next) {
        if (strcmp(e->key, "__metadata__") == 0) {
            if (e->kind != LM_JSON_OBJECT)
                return lm_error(LM_ERR_FORMAT, "%s: __metadata__ is not an object", what);
            for (const lm_json *m = e->child; m; m = m->next)
                if (m->kind != LM_JSON_STRING)
                    return lm_error(LM_ERR_FORMAT, "%s: __metadata__ value '%s' is not a string",
                                    what, m->key);
            st->metadata = e;
            continue;
        }
        if (e->key[0] == 0) return lm_error(LM_ERR_FORMAT, "%s: empty tensor name", what);
        if ((s = parse_entry(e, what, data, data_size, &st->tensors[st->count]))) return s;
        st->count++;
    }
    /* ranges must tile the data exactly: sort by offset, check contiguity */
    lm_st_tensor *sorted = malloc((size_t)(st->count ? st->count : 1) * sizeof *sorted);
    if (!sorted) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    memcpy(sorted, st->tensors, (size_t)st->count * sizeof *sorted);
    qsort(sorted, (size_t)st->count, sizeof *sorted, cmp_by_offset);
    const unsigned char *cursor = data;
    for (int i = 0; i < st->count; i++) {
        const unsigned char *b = sorted[i].data;
        if (b < cursor) {
            s = lm_error(LM_ERR_FORMAT, "%s: tensor '%s' overlaps tensor '%s'", what,
                         sorted[i].name, sorted[i - 1].name);
            free(sorted);
            return s;
        }
        if (b > cursor) {
            s = lm_error(LM_ERR_FORMAT, "%s: %zu unreferenced data bytes before tensor '%s'",
                         what, (size_t)(b - cursor), sorted[i].name);
            free(sorted);
            return s;
        }
        cursor = b + sorted[i].nbytes;
    }
    free(sorted);
    if (cursor != data + data_size)
        return lm_error(LM_ERR_FORMAT, "%s: %zu trailing data bytes that no tensor references",
                        what, (size_t)(data + data_size - cursor));
    /* a recorded checksum must match the data section (a file without one,
     * from another writer, is accepted as it is) */
    const lm_json *sum = lm_json_get(st->metadata, LM_ST_CHECKSUM_KEY);
    if (sum) {
        char got[17];
        checksum_text(data, data_size, got);
        if (strcmp(got, sum->string))
            return lm_error(LM_ERR_FORMAT, "%s: checksum mismatch: the data section (%zu bytes) hashes to %s but the "
                            "header records %s (a flipped bit or a damaged copy)", what, data_size, got,
                            sum->string);
    }
    return LM_OK;
}

lm_status lm_safetensors_parse(const void *bytes, size_t size, const char *what,
                               lm_safetensors **out) {
    *out = NULL;
    lm_safetensors *st = calloc(1, sizeof *st);
    if (!st) return lm_error(LM_ERR_MEMORY, "%s: out of memory", what);
    st->bytes = malloc(size ? size : 1);
    if (!st->bytes) {
        free(st);
        return lm_error(LM_ERR_MEMORY, "%s: out of memory for %zu bytes", what, size);
    }
    if (size) memcpy(st->bytes, bytes, size);
    st->size = size;
    lm_status s = parse_owned(st, what);
    if (s) {
        lm_safetensors_close(st);
        return s;
    }
    *out = st;
    return LM_OK;
}

lm_status lm_safetensors_open(const char *path, lm_safetensors **out) {
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0) return lm_error(LM_ERR_IO, "cannot open '%s': %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return lm_error(LM_ERR_IO, "'%s' is not a regular file", path);
    char *bytes;
    size_t size;
    TRY(lm_read_file(path, 0, &bytes, &size));
    lm_safetensors *st = calloc(1, sizeof *st);
    if (!st) {
        free(bytes);
        return lm_error(LM_ERR_MEMORY, "out of memory reading '%s'", path);
    }
    st->bytes = (unsigned char *)bytes;
    st->size = size;
    lm_status s = parse_owned(st, path);
    if (s) {
        lm_safetensors_close(st);
        return s;
    }
    *out = st;
    return LM_OK;
}

void lm_safetensors_close(lm_safetensors *st) {
    if (!st) return;
    lm_json_free(st->doc);
    free(st->tensors);
    free(st->bytes);
    free(st);
}

int lm_safetensors_count(const lm_safetensors *st) { return st->count; }
const lm_st_tensor *lm_safetensors_at(const lm_safetensors *st, int i) {
    return (i >= 0 && i < st->count) ? &st->tensors[i] : NULL;
}

const lm_st_tensor *lm_safetensors_find(const lm_safetensors *st, const char *name) {
    for (int i = 0; i < st->count; i++)
        if (strcmp(st->tensors[i].name, name) == 0) return &st->tensors[i];
    return NULL;
}

const char *lm_safetensors_metadata(const lm_safetensors *st, const char *key) {
    const lm_json *v = lm_json_get(st->metadata, key);
    return v ? v->string : NULL;
}

lm_status lm_safetensors_read_f32(const lm_safetensors *st, const char *name, int expect_ndim,
                                  float **out, int64_t shape[LM_ST_MAX_DIMS]) {
    *out = NULL;
    const lm_st_tensor *t = lm_safetensors_find(st, name);
    if (!t) return lm_error(LM_ERR_FORMAT, "tensor '%s' is missing", name);
    if (expect_ndim >= 0 && t->ndim != expect_ndim)
        return lm_error(LM_ERR_FORMAT, "tensor '%s' has %d dimensions, expected %d", name,
                        t->ndim, expect_ndim);
    if (t->dtype != LM_DTYPE_F32 && t->dtype != LM_DTYPE_BF16 && t->dtype != LM_DTYPE_F16 &&
        t->dtype != LM_DTYPE_F64)
        return lm_error(LM_ERR_FORMAT, "tensor '%s' has dtype %s; expected F32, BF16, F16 or F64",
                        name, lm_dtype_name(t->dtype));
    float *o = malloc((size_t)(t->numel ? t->numel : 1) * sizeof(float));
    if (!o) return lm_error(LM_ERR_MEMORY, "out of memory reading tensor '%s'", name);
    const unsigned char *p = t->data;
    for (int64_t i = 0; i < t->numel; i++) {
        switch (t->dtype) {
        case LM_DTYPE_F32: memcpy(&o[i], p + 4 * i, 4); break;
        case LM_DTYPE_F64: { double d; memcpy(&d, p + 8 * i, 8); o[i] = (float)d; break; }
        case LM_DTYPE_BF16: { uint16_t h; memcpy(&h, p + 2 * i, 2); o[i] = lm_bf16_to_f32(h); break; }
        default: { uint16_t h; memcpy(&h, p + 2 * i, 2); o[i] = lm_f16_to_f32(h); break; }
        }
    }
    if (shape)
        for (int d = 0; d < t->ndim; d++) shape[d] = t->shape[d];
    *out = o;
    return LM_OK;
}

/* ---- writer ---- */

typedef struct {
    char *name;
    lm_dtype dtype;
    int ndim;
    int64_t shape[LM_ST_MAX_DIMS];
    size_t nbytes;
    const void *data;
} writer_entry;

struct lm_st_writer {
    writer_entry *entries;
    int count, capacity;
    char **meta_keys, **meta_values;
    int meta_count;
};

lm_st_writer *lm_st_writer_new(void) { return calloc(1, sizeof(lm_st_writer)); }

void lm_st_writer_free(lm_st_writer *w) {
    if (!w) return;
    for (int i = 0; i < w->count; i++) free(w->entries[i].name);
    for (int i = 0; i < w->meta_count; i++) {
        free(w->meta_keys[i]);
        free(w->meta_values[i]);
    }
    free(w->meta_keys);
    free(w->meta_values);
    free(w->entries);
    free(w);
}

static int json_safe(const char *s) {
    for (; *s; s++)
        if (*s == '"' || *s == '\\' || (unsigned char)*s < 0x20) return 0;
    return 1;
}

lm_status lm_st_writer_add(lm_st_writer *w, const char *name, lm_dtype dtype, int ndim,
                           const int64_t *shape, const void *data) {
    if (!name[0] || !json_safe(name) || strcmp(name, "__metadata__") == 0)
        return lm_error(LM_ERR_ARG, "tensor name '%s' is empty, reserved or has characters "
                        "that need escaping", name);
    if (ndim < 0 || ndim > LM_ST_MAX_DIMS || (unsigned)dtype >= LM_DTYPE_COUNT)
        return lm_error(LM_ERR_ARG, "tensor '%s': bad ndim %d or dtype", name, ndim);
    for (int i = 0; i < w->count; i++)
        if (strcmp(w->entries[i].name, name) == 0)
            return lm_error(LM_ERR_ARG, "tensor '%s' added twice", name);
    if (w->count == w->capacity) {
        int cap = w->capacity ? 2 * w->capacity : 16;
        writer_entry *e = realloc(w->entries, (size_t)cap * sizeof *e);
        if (!e) return lm_error(LM_ERR_MEMORY, "out of memory");
        w->entries = e;
        w->capacity = cap;
    }
    writer_entry *e = &w->entries[w->count];
    memset(e, 0, sizeof *e);
    size_t numel = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return lm_error(LM_ERR_ARG, "tensor '%s': negative dimension", name);
        e->shape[i] = shape[i];
        numel *= (size_t)shape[i];
    }
    e->name = strdup(name);
    if (!e->name) return lm_error(LM_ERR_MEMORY, "out of memory");
    e->dtype = dtype;
    e->ndim = ndim;
    e->nbytes = numel * lm_dtype_size(dtype);
    e->data = data;
    w->count++;
    return LM_OK;
}

lm_status lm_st_writer_set_metadata(lm_st_writer *w, const char *key, const char *value) {
    if (!json_safe(key) || !json_safe(value))
        return lm_error(LM_ERR_ARG, "metadata '%s' has characters that need escaping", key);
    char **k = realloc(w->meta_keys, (size_t)(w->meta_count + 1) * sizeof *k);
    if (!k) return lm_error(LM_ERR_MEMORY, "out of memory");
    w->meta_keys = k;
    char **v = realloc(w->meta_values, (size_t)(w->meta_count + 1) * sizeof *v);
    if (!v) return lm_error(LM_ERR_MEMORY, "out of memory");
    w->meta_values = v;
    k[w->meta_count] = strdup(key);
    v[w->meta_count] = strdup(value);
    if (!k[w->meta_count] || !v[w->meta_count]) {
        free(k[w->meta_count]);
        free(v[w->meta_count]);
        return lm_error(LM_ERR_MEMORY, "out of memory");
    }
    w->meta_count++;
    return LM_OK;
}

/* The header of w's tensors (their data not read), padded to 8 bytes, with
 * the checksum's 16 digits left as zeros at h->s + *sum_at. */
static lm_status writer_header(const lm_st_writer *w, const char *path, lm_text *h, size_t *sum_at) {
    lm_text_printf(h, "{\"__metadata__\":{");
    for (int i = 0; i < w->meta_count; i++)
        if (strcmp(w->meta_keys[i], LM_ST_CHECKSUM_KEY))
            lm_text_printf(h, "\"%s\":\"%s\",", w->meta_keys[i], w->meta_values[i]);
    lm_text_printf(h, "\"%s\":\"", LM_ST_CHECKSUM_KEY);
    *sum_at = h->n;
    lm_text_printf(h, "0000000000000000\"}%s", w->count ? "," : "");
    size_t offset = 0;
    for (int i = 0; i < w->count; i++) {
        const writer_entry *e = &w->entries[i];
        lm_text_printf(h, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "", e->name,
                       lm_dtype_name(e->dtype));
        for (int d = 0; d < e->ndim; d++) lm_text_printf(h, "%s%lld", d ? "," : "", (long long)e->shape[d]);
        lm_text_printf(h, "],\"data_offsets\":[%zu,%zu]}", offset, offset + e->nbytes);
        offset += e->nbytes;
    }
    lm_text_printf(h, "}");
    while (!h->failed && h->n % 8) lm_text_printf(h, " ");
    if (h->failed) return lm_error(LM_ERR_MEMORY, "out of memory writing '%s'", path);
    return LM_OK;
}

struct lm_st_stream {
    int fd;
    char *path, *tmp;
    off_t sum_at;            /* the file offset of the checksum's 16 digits */
    size_t expected, written; /* bytes of the data section */
    checksum_state sum;
};

/* All n bytes at p to fd (tmp names it in errors). */
static lm_status write_all(int fd, const void *bytes, size_t n, const char *tmp) {
    const unsigned char *p = bytes;
    while (n) {
        ssize_t k = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return lm_error(LM_ERR_IO, "writing '%s' failed: %s", tmp, k < 0 ? strerror(errno) : "no progress (disk full?)");
        p += k;
        n -= (size_t)k;
    }
    return LM_OK;
}

void lm_st_stream_abort(lm_st_stream *s) {
    if (!s) return;
    if (s->fd >= 0) close(s->fd);
    if (s->tmp) unlink(s->tmp);
    free(s->tmp);
    free(s->path);
    free(s);
}

lm_status lm_st_writer_begin(const lm_st_writer *w, const char *path, lm_st_stream **out) {
    *out = NULL;
    lm_st_stream *s = calloc(1, sizeof *s);
    const size_t plen = strlen(path);
    if (s) {
        s->fd = -1;
        s->path = strdup(path);
        s->tmp = malloc(plen + 32);
    }
    if (!s || !s->path || !s->tmp) {
        lm_st_stream_abort(s);
        return lm_error(LM_ERR_MEMORY, "out of memory writing '%s'", path);
    }
    snprintf(s->tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    lm_text h = {0};
    size_t sum_at = 0;
    lm_status st = writer_header(w, path, &h, &sum_at);
    if (!st) {
        s->fd = open(s->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (s->fd < 0) {
            st = lm_error(LM_ERR_IO, "cannot create '%s': %s (is the directory writable?)", s->tmp, strerror(errno));
            free(s->tmp); /* nothing to remove */
            s->tmp = NULL;
        }
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
    if (!st) st = write_all(s->fd, len8, 8, s->tmp);
    if (!st) st = write_all(s->fd, h.s, h.n, s->tmp);
    free(h.s);
    if (st) {
        lm_st_stream_abort(s);
        return st;
    }
    s->sum_at = (off_t)(8 + sum_at);
    for (int i = 0; i < w->count; i++) s->expected += w->entries[i].nbytes;
    checksum_begin(&s->sum);
    *out = s;
    return LM_OK;
}

lm_status lm_st_stream_write(lm_st_stream *s, const void *bytes, size_t n) {
    if (n > s->expected - s->written)
        return lm_error(LM_ERR_ARG, "'%s': %zu more bytes of tensor data than the header's %zu", s->path,
                        s->written + n - s->expected, s->expected);
    TRY(write_all(s->fd, bytes, n, s->tmp));
    checksum_add(&s->sum, bytes, n);
    s->written += n;
    return LM_OK;
}

lm_status lm_st_stream_commit(lm_st_stream *s) {
    lm_status st = LM_OK;
    if (s->written != s->expected)
        st = lm_error(LM_ERR_ARG, "'%s': %zu bytes of tensor data written, the header names %zu", s->path, s->written,
                      s->expected);
    /* the checksum of the data section into the header's placeholder (its width is fixed) */
    char sum[17];
    snprintf(sum, sizeof sum, "%016llx", (unsigned long long)checksum_end(&s->sum));
    if (!st && pwrite(s->fd, sum, 16, s->sum_at) != 16)
        st = lm_error(LM_ERR_IO, "writing the checksum of '%s' failed: %s", s->tmp, strerror(errno));
    if (!st && fsync(s->fd) != 0) st = lm_error(LM_ERR_IO, "fsync of '%s' failed: %s", s->tmp, strerror(errno));
    const int fd = s->fd;
    s->fd = -1;
    if (close(fd) != 0 && !st) st = lm_error(LM_ERR_IO, "closing '%s' failed: %s", s->tmp, strerror(errno));
    if (!st && rename(s->tmp, s->path) != 0)
        st = lm_error(LM_ERR_IO, "renaming '%s' to '%s' failed: %s", s->tmp, s->path, strerror(errno));
    if (st) {
        lm_st_stream_abort(s);
        return st;
    }
    /* make the rename itself durable */
    char *dir = s->tmp; /* reused: at least as long as the path */
    memcpy(dir, s->path, strlen(s->path) + 1);
    int dfd = open(dirname(dir), O_RDONLY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    free(s->tmp);
    s->tmp = NULL;
    lm_st_stream_abort(s);
    return LM_OK;
}

lm_status lm_st_writer_save(const lm_st_writer *w, const char *path) {
    for (int i = 0; i < w->count; i++)
        if (!w->entries[i].data && w->entries[i].nbytes)
            return lm_error(LM_ERR_ARG, "'%s': tensor '%s' was added without data (stream it: lm_st_writer_begin)",
                            path, w->entries[i].name);
    lm_st_stream *s;
    TRY(lm_st_writer_begin(w, path, &s));
    for (int i = 0; i < w->count; i++) {
        lm_status st = lm_st_stream_write(s, w->entries[i].data, w->entries[i].nbytes);
        if (st) {
            lm_st_stream_abort(s);
            return st;
        }
    }
    return lm_st_stream_commit(s);
}

lm_status lm_write_file_atomic(const char *path, const void *const *parts, const size_t *sizes,
                               int nparts) {
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 32);
    char *dir = malloc(plen + 1);
    if (!tmp || !dir) {
        free(tmp);
        free(dir);
        return lm_error(LM_ERR_MEMORY, "out of memory writing '%s'", path);
    }
    snprintf(tmp, plen + 32, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    lm_status s = LM_OK;
    if (fd < 0) {
        s = lm_error(LM_ERR_IO, "cannot create '%s': %s (is the directory writable?)", tmp,
                     strerror(errno));
        goto done;
    }
    for (int i = 0; i < nparts && !s; i++) {
        const unsigned char *p = parts[i];
        size_t left = sizes[i];
        while (left) {
            ssize_t k = write(fd, p, left > (1u << 30) ? (1u << 30) : left);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) {
                s = lm_error(LM_ERR_IO, "writing '%s' failed: %s", tmp,
                             k < 0 ? strerror(errno) : "no progress (disk full?)");
                break;
            }
            p += k;
            left -= (size_t)k;
        }
    }
    if (!s && fsync(fd) != 0)
        s = lm_error(LM_ERR_IO, "fsync of '%s' failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && !s)
        s = lm_error(LM_ERR_IO, "closing '%s' failed: %s", tmp, strerror(errno));
    if (!s && rename(tmp, path) != 0)
        s = lm_error(LM_ERR_IO, "renaming '%s' to '%s' failed: %s", tmp, path, strerror(errno));
    if (s) {
        unlink(tmp);
        goto done;
    }
    /* make the rename itself durable */
    memcpy(dir, path, plen + 1);
    int dfd = open(dirname(dir), O_RDONLY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
done:
    free(tmp);
    free(dir);
    return s;
}
