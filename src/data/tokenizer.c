/* Byte-level BPE tokenizer (include/longmoe/tokenizer.h, docs/data.md). */
#include "longmoe/tokenizer.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "files.h"
#include "json.h"
#include "longmoe/safetensors.h"

#define EOT_LEN (sizeof LM_TOKENIZER_EOT - 1)
#define EMPTY_KEY UINT64_MAX

/* The pre-tokenizer as the regular expression the JSON declares (Oniguruma
 * syntax, as the Hugging Face Split pre-tokenizer runs it). Alternatives in
 * order: letters (ASCII letters and every non-ASCII character), digits, other
 * symbols, each with an optional leading space; a whitespace run that is not
 * followed by a non-space; a whitespace run. Every run is at most
 * LM_PRETOKENIZE_MAX_RUN (32) characters, which bounds a chunk to 129 bytes. */
#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)
#define RUN_MAX STRINGIFY(LM_PRETOKENIZE_MAX_RUN)
static const char pretokenizer_regex[] =
    " ?[A-Za-z\\x{80}-\\x{10FFFF}]{1," RUN_MAX "}| ?[0-9]{1," RUN_MAX "}"
    "| ?[^\\x09-\\x0D A-Za-z0-9\\x{80}-\\x{10FFFF}]{1," RUN_MAX "}"
    "|[\\x09-\\x0D ]{1," RUN_MAX "}(?![^\\x09-\\x0D ])|[\\x09-\\x0D ]{1," RUN_MAX "}";

/* ------------------------------------------------------------------------ */
/* GPT-2's byte <-> character map: printable bytes stand for themselves, the
 * other 68 bytes (0x00-0x20, 0x7F-0xA0, 0xAD) for U+0100 onwards in order. */

static unsigned byte_to_codepoint(unsigned b) {
    if (b <= 0x20) return 256 + b;
    if (b >= 0x7f && b <= 0xa0) return 256 + 33 + (b - 0x7f);
    if (b == 0xad) return 256 + 33 + 34;
    return b;
}

/* ------------------------------------------------------------------------ */
/* Pre-tokenizer (the regex above, on bytes: a byte >= 0x80 is a letter, so on
 * valid UTF-8 each character falls in the class the regex gives it). */

enum { CLASS_SPACE, CLASS_LETTER, CLASS_DIGIT, CLASS_OTHER };

static int byte_class(uint8_t c) {
    if (c == ' ' || (c >= 0x09 && c <= 0x0d)) return CLASS_SPACE;
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c >= 0x80) return CLASS_LETTER;
    if (c >= '0' && c <= '9') return CLASS_DIGIT;
    return CLASS_OTHER;
}

size_t lm_pretokenize_next(const uint8_t *s, size_t n, size_t i) {
    const int max_run = LM_PRETOKENIZE_MAX_RUN;
    int c = byte_class(s[i]);
    size_t j;
    if (c != CLASS_SPACE || (s[i] == ' ' && i + 1 < n && byte_class(s[i + 1]) != CLASS_SPACE)) {
        /* " ?X{1,32}" for the class X of the first non-space; letters count
         * characters: a UTF-8 continuation byte (0x80-0xBF) extends the
         * current character unless it already has 4 bytes */
        j = c == CLASS_SPACE ? i + 1 : i;
        int k = byte_class(s[j++]), chars = 1, bytes_in_char = 1;
        while (j < n && byte_class(s[j]) == k) {
            if (k == CLASS_LETTER && (s[j] & 0xc0) == 0x80 && bytes_in_char < 4) {
                bytes_in_char++;
            } else {
                if (chars == max_run) break;
                chars++;
                bytes_in_char = 1;
            }
            j++;
        }
        return j;
    }
    /* "\s{1,32}(?!\S)": the run (at most 32), less its last character when a
     * non-space follows and it is longer than one; otherwise "\s{1,32}" */
    j = i + 1;
    while (j < n && byte_class(s[j]) == CLASS_SPACE && j - i < (size_t)max_run) j++;
    if (j < n && byte_class(s[j]) != CLASS_SPACE && j - 1 > i) j--;
    return j;
}

/* Position of the next end-of-text marker in s[i..n), or n. */
static size_t find_eot(const uint8_t *s, size_t n, size_t i) {
    while (i + EOT_LEN <= n) {
        const uint8_t *p = memchr(s + i, '<', n - i - EOT_LEN + 1);
        if (!p) break;
        size_t k = (size_t)(p - s);
        if (!memcmp(p, LM_TOKENIZER_EOT, EOT_LEN)) return k;
        i = k + 1;
    }
    return n;
}

/* ------------------------------------------------------------------------ */
/* Small containers. */


static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = lm_mix64(h ^ w) + 0x9e3779b97f4a7c15ull;
    }
    uint64_t w = 0;
    for (size_t k = 0; i < n; i++, k++) w |= (uint64_t)p[i] << (8 * k);
    return lm_mix64(h ^ w);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* Byte strings by content: each gets an index in insertion order. */
typedef struct {
    uint8_t *arena;
    size_t arena_used, arena_cap;
    size_t *off, *len;
    int64_t *value;
    size_t n, cap_items;
    int64_t *slots; /* index or -1 */
    uint64_t *slot_hash;
    size_t n_slots;
} strtab;

static void strtab_free(strtab *t) {
    free(t->arena);
    free(t->off);
    free(t->len);
    free(t->value);
    free(t->slots);
    free(t->slot_hash);
    memset(t, 0, sizeof *t);
}

static int64_t strtab_find_h(const strtab *t, const uint8_t *p, size_t n, uint64_t h) {
    if (!t->n_slots) return -1;
    for (size_t s = h & (t->n_slots - 1);; s = (s + 1) & (t->n_slots - 1)) {
        int64_t k = t->slots[s];
        if (k < 0) return -1;
        if (t->slot_hash[s] == h && t->len[k] == n && !memcmp(t->arena + t->off[k], p, n)) return k;
    }
}

static int64_t strtab_find(const strtab *t, const uint8_t *p, size_t n) {
    return strtab_find_h(t, p, n, hash_bytes(p, n));
}

static int strtab_rehash(strtab *t, size_t n_slots) {
    int64_t *slots = malloc(n_slots * sizeof *slots);
    uint64_t *hashes = malloc(n_slots * sizeof *hashes);
    if (!slots || !hashes) {
        free(slots);
        free(hashes);
        return -1;
    }
    for (size_t s = 0; s < n_slots; s++) slots[s] = -1;
    for (size_t k = 0; k < t->n; k++) {
        uint64_t h = hash_bytes(t->arena + t->off[k], t->len[k]);
        size_t s = h & (n_slots - 1);
        while (slots[s] >= 0) s = (s + 1) & (n_slots - 1);
        slots[s] = (int64_t)k;
        hashes[s] = h;
    }
    free(t->slots);
    free(t->slot_hash);
    t->slots = slots;
    t->slot_hash = hashes;
    t->n_slots = n_slots;
    return 0;
}

/* Index of the string, inserting it (value 0) when absent; -1 when out of memory. */
static int64_t strtab_insert(strtab *t, const uint8_t *p, size_t n, int *inserted) {
    uint64_t h = hash_bytes(p, n);
    int64_t k = strtab_find_h(t, p, n, h);
    *inserted = 0;
    if (k >= 0) return k;
    if (2 * (t->n + 1) > t->n_slots && strtab_rehash(t, t->n_slots ? 2 * t->n_slots : 1024)) return -1;
    size_t cap = t->cap_items;
    if (grow((void **)&t->arena, &t->arena_cap, t->arena_used + n, 1) ||
        grow((void **)&t->off, &cap, t->n + 1, sizeof *t->off))
        return -1;
    cap = t->cap_items;
    if (grow((void **)&t->len, &cap, t->n + 1, sizeof *t->len)) return -1;
    cap = t->cap_items;
    if (grow((void **)&t->value, &cap, t->n + 1, sizeof *t->value)) return -1;
    t->cap_items = cap;
    memcpy(t->arena + t->arena_used, p, n);
    t->off[t->n] = t->arena_used;
    t->len[t->n] = n;
    t->value[t->n] = 0;
    t->arena_used += n;
    size_t s = h & (t->n_slots - 1);
    while (t->slots[s] >= 0) s = (s + 1) & (t->n_slots - 1);
    t->slots[s] = (int64_t)t->n;
    t->slot_hash[s] = h;
    *inserted = 1;
    return (int64_t)t->n++;
}

/* ------------------------------------------------------------------------ */
/* The tokenizer. */

struct lm_tokenizer {
    int n_merges;
    int32_t *merge_left, *merge_right; /* [n_merges]: merge k makes id 256 + k */
    uint8_t *token_bytes;              /* all tokens' bytes, id after id */
    size_t *token_off;                 /* [vocab + 1] */
    uint64_t *pair_key;                /* open addressing: (left << 32 | right) -> rank */
    int32_t *pair_rank;
    size_t pair_slots;
};

int lm_tokenizer_vocab_size(const lm_tokenizer *tok) { return 256 + tok->n_merges + 1; }
int lm_tokenizer_eot_id(const lm_tokenizer *tok) { return 256 + tok->n_merges; }

const uint8_t *lm_tokenizer_token(const lm_tokenizer *tok, int id, size_t *len) {
    if (id < 0 || id >= lm_tokenizer_vocab_size(tok)) return NULL;
    *len = tok->token_off[id + 1] - tok->token_off[id];
    return tok->token_bytes + tok->token_off[id];
}

lm_status lm_tokenizer_merge(const lm_tokenizer *tok, int k, int32_t *left, int32_t *right) {
    if (k < 0 || k >= tok->n_merges)
        return lm_error(LM_ERR_ARG, "merge %d out of range: the tokenizer has %d merges", k, tok->n_merges);
    *left = tok->merge_left[k];
    *right = tok->merge_right[k];
    return LM_OK;
}

void lm_tokenizer_free(lm_tokenizer *tok) {
    if (!tok) return;
    free(tok->merge_left);
    free(tok->merge_right);
    free(tok->token_bytes);
    free(tok->token_off);
    free(tok->pair_key);
    free(tok->pair_rank);
    free(tok);
}

static int32_t pair_rank_of(const lm_tokenizer *tok, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (size_t s = lm_mix64(key) & (tok->pair_slots - 1);; s = (s + 1) & (tok->pair_slots - 1)) {
        if (tok->pair_key[s] == key) return tok->pair_rank[s];
        if (tok->pair_key[s] == EMPTY_KEY) return -1;
    }
}

/* A tokenizer from its merges (ids of each merge's parts must be < 256 + k). */
static lm_status tokenizer_build(int n_merges, const int32_t *left, const int32_t *right, lm_tokenizer **out) {
    *out = NULL;
    lm_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return lm_error(LM_ERR_MEMORY, "out of memory building a tokenizer");
    int V = 256 + n_merges + 1;
    tok->n_merges = n_merges;
    tok->merge_left = malloc(((size_t)n_merges + 1) * sizeof(int32_t));
    tok->merge_right = malloc(((size_t)n_merges + 1) * sizeof(int32_t));
    tok->token_off = malloc(((size_t)V + 1) * sizeof(size_t));
    tok->pair_slots = 64;
    while (tok->pair_slots < 2 * (size_t)n_merges) tok->pair_slots *= 2;
    tok->pair_key = malloc(tok->pair_slots * sizeof(uint64_t));
    tok->pair_rank = malloc(tok->pair_slots * sizeof(int32_t));
    size_t total = 256 + EOT_LEN;
    if (tok->token_off) {
        for (int i = 0; i < 256; i++) tok->token_off[i + 1] = (size_t)i + 1;
        tok->token_off[0] = 0;
        for (int k = 0; k < n_merges; k++) {
            size_t a = tok->token_off[left[k] + 1] - tok->token_off[left[k]];
            size_t b = tok->token_off[right[k] + 1] - tok->token_off[right[k]];
            tok->token_off[256 + k + 1] = tok->token_off[256 + k] + a + b;
        }
        total = tok->token_off[256 + n_merges] + EOT_LEN;
        tok->token_off[V] = total;
    }
    tok->token_bytes = malloc(total);
    if (!tok->merge_left || !tok->merge_right || !tok->token_off || !tok->pair_key || !tok->pair_rank ||
        !tok->token_bytes) {
        lm_tokenizer_free(tok);
        return lm_error(LM_ERR_MEMORY, "out of memory building a tokenizer of %d merges", n_merges);
    }
    for (int i = 0; i < 256; i++) tok->token_bytes[i] = (uint8_t)i;
    for (size_t s = 0; s < tok->pair_slots; s++) tok->pair_key[s] = EMPTY_KEY;
    for (int k = 0; k < n_merges; k++) {
        tok->merge_left[k] = left[k];
        tok->merge_right[k] = right[k];
        size_t a = tok->token_off[left[k] + 1] - tok->token_off[left[k]];
        size_t b = tok->token_off[right[k] + 1] - tok->token_off[right[k]];
        uint8_t *dst = tok->token_bytes + tok->token_off[256 + k];
        memcpy(dst, tok->token_bytes + tok->token_off[left[k]], a);
        memcpy(dst + a, tok->token_bytes + tok->token_off[right[k]], b);
        uint64_t key = (uint64_t)(uint32_t)left[k] << 32 | (uint32_t)right[k];
        size_t s = lm_mix64(key) & (tok->pair_slots - 1);
        while (tok->pair_key[s] != EMPTY_KEY && tok->pair_key[s] != key) s = (s + 1) & (tok->pair_slots - 1);
        if (tok->pair_key[s] == key) {
            lm_tokenizer_free(tok);
            return lm_error(LM_ERR_FORMAT, "merge %d repeats the pair (%d, %d) of an earlier merge", k, left[k],
                            right[k]);
        }
        tok->pair_key[s] = key;
        tok->pair_rank[s] = k;
    }
    memcpy(tok->token_bytes + tok->token_off[256 + n_merges], LM_TOKENIZER_EOT, EOT_LEN);
    *out = tok;
    return LM_OK;
}

/* ------------------------------------------------------------------------ */
/* Encoding. */

typedef struct {
    int32_t *v;
    size_t n, cap;
} ivec;

static int ivec_push(ivec *a, int32_t x) {
    if (a->n == a->cap && grow((void **)&a->v, &a->cap, a->n + 1, sizeof *a->v)) return -1;
    a->v[a->n++] = x;
    return 0;
}

/* Scratch of one encode call: the symbol list of a chunk, its merge heap and
 * a cache of short chunks already encoded. */
typedef struct {
    int32_t *id, *prev, *next;
    uint64_t *heap; /* min-heap of (rank << 32 | position) */
    size_t cap, heap_n;
    /* cache: chunk bytes (pointing into the input) -> ids in cache_ids */
    const uint8_t **c_ptr;
    uint32_t *c_len, *c_n;
    size_t *c_off;
    uint64_t *c_hash;
    size_t c_slots, c_used;
    ivec cache_ids;
} bpe_scratch;

#define CACHE_MAX_LEN 64
#define CACHE_MAX_ENTRIES (1u << 20)

static void scratch_free(bpe_scratch *w) {
    free(w->id);
    free(w->prev);
    free(w->next);
    free(w->heap);
    free(w->c_ptr);
    free(w->c_len);
    free(w->c_n);
    free(w->c_off);
    free(w->c_hash);
    free(w->cache_ids.v);
}

static void heap_push(bpe_scratch *w, uint64_t x) {
    size_t i = w->heap_n++;
    while (i > 0 && w->heap[(i - 1) / 2] > x) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = x;
}

static uint64_t heap_pop(bpe_scratch *w) {
    uint64_t top = w->heap[0], x = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && w->heap[c + 1] < w->heap[c]) c++;
        if (w->heap[c] >= x) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = x;
    return top;
}

static void push_pair(const lm_tokenizer *tok, bpe_scratch *w, int32_t pos) {
    int32_t r = pair_rank_of(tok, w->id[pos], w->id[w->next[pos]]);
    if (r >= 0) heap_push(w, (uint64_t)r << 32 | (uint32_t)pos);
}

/* BPE on one chunk: repeatedly merge the adjacent pair of lowest rank, the
 * leftmost of equal ranks (a heap of (rank, position) with stale entries
 * skipped), then append the remaining symbols to `out`. */
static lm_status bpe_chunk(const lm_tokenizer *tok, const uint8_t *s, size_t m, bpe_scratch *w, ivec *out) {
    if (m == 1) return ivec_push(out, s[0]) ? lm_error(LM_ERR_MEMORY, "out of memory encoding") : LM_OK;
    if (m > w->cap) {
        size_t c = m;
        free(w->id);
        free(w->prev);
        free(w->next);
        free(w->heap);
        w->id = malloc(c * sizeof *w->id);
        w->prev = malloc(c * sizeof *w->prev);
        w->next = malloc(c * sizeof *w->next);
        w->heap = malloc(3 * c * sizeof *w->heap);
        w->cap = c;
        if (!w->id || !w->prev || !w->next || !w->heap) {
            w->cap = 0;
            return lm_error(LM_ERR_MEMORY, "out of memory encoding a chunk of %zu bytes", m);
        }
    }
    for (size_t i = 0; i < m; i++) {
        w->id[i] = s[i];
        w->prev[i] = (int32_t)i - 1;
        w->next[i] = i + 1 < m ? (int32_t)i + 1 : -1;
    }
    w->heap_n = 0;
    for (size_t i = 0; i + 1 < m; i++) push_pair(tok, w, (int32_t)i);
    while (w->heap_n) {
        uint64_t top = heap_pop(w);
        int32_t rank = (int32_t)(top >> 32), pos = (int32_t)(uint32_t)top;
        /* stale: the symbol was merged away, or its pair changed */
        if (w->id[pos] < 0 || w->next[pos] < 0) continue;
        int32_t nx = w->next[pos];
        if (tok->merge_left[rank] != w->id[pos] || tok->merge_right[rank] != w->id[nx]) continue;
        w->id[pos] = 256 + rank;
        w->id[nx] = -1;
        w->next[pos] = w->next[nx];
        if (w->next[nx] >= 0) w->prev[w->next[nx]] = pos;
        if (w->prev[pos] >= 0) push_pair(tok, w, w->prev[pos]);
        if (w->next[pos] >= 0) push_pair(tok, w, pos);
    }
    for (int32_t i = 0; i >= 0; i = w->next[i])
        if (ivec_push(out, w->id[i])) return lm_error(LM_ERR_MEMORY, "out of memory encoding");
    return LM_OK;
}

static int cache_rehash(bpe_scratch *w, size_t n_slots) {
    const uint8_t **ptr = calloc(n_slots, sizeof *ptr);
    uint32_t *len = malloc(n_slots * sizeof *len), *nid = malloc(n_slots * sizeof *nid);
    size_t *off = malloc(n_slots * sizeof *off);
    uint64_t *hash = malloc(n_slots * sizeof *hash);
    if (!ptr || !len || !nid || !off || !hash) {
        free(ptr);
        free(len);
        free(nid);
        free(off);
        free(hash);
        return -1;
    }
    for (size_t s = 0; s < w->c_slots; s++) {
        if (!w->c_ptr[s]) continue;
        size_t t = w->c_hash[s] & (n_slots - 1);
        while (ptr[t]) t = (t + 1) & (n_slots - 1);
        ptr[t] = w->c_ptr[s];
        len[t] = w->c_len[s];
        nid[t] = w->c_n[s];
        off[t] = w->c_off[s];
        hash[t] = w->c_hash[s];
    }
    free(w->c_ptr);
    free(w->c_len);
    free(w->c_n);
    free(w->c_off);
    free(w->c_hash);
    w->c_ptr = ptr;
    w->c_len = len;
    w->c_n = nid;
    w->c_off = off;
    w->c_hash = hash;
    w->c_slots = n_slots;
    return 0;
}

/* Encode one chunk through the cache (short chunks only). */
static lm_status encode_chunk(const lm_tokenizer *tok, const uint8_t *s, size_t m, bpe_scratch *w, ivec *out) {
    if (m > CACHE_MAX_LEN || m == 1) return bpe_chunk(tok, s, m, w, out);
    uint64_t h = hash_bytes(s, m);
    size_t slot = 0;
    if (w->c_slots) {
        for (slot = h & (w->c_slots - 1); w->c_ptr[slot]; slot = (slot + 1) & (w->c_slots - 1)) {
            if (w->c_hash[slot] == h && w->c_len[slot] == m && !memcmp(w->c_ptr[slot], s, m)) {
                for (uint32_t k = 0; k < w->c_n[slot]; k++)
                    if (ivec_push(out, w->cache_ids.v[w->c_off[slot] + k]))
                        return lm_error(LM_ERR_MEMORY, "out of memory encoding");
                return LM_OK;
            }
        }
    }
    size_t start = out->n;
    lm_status st = bpe_chunk(tok, s, m, w, out);
    if (st || w->c_used >= CACHE_MAX_ENTRIES) return st;
    if (2 * (w->c_used + 1) > w->c_slots) {
        if (cache_rehash(w, w->c_slots ? 2 * w->c_slots : 4096)) return LM_OK; /* no cache: still correct */
        for (slot = h & (w->c_slots - 1); w->c_ptr[slot]; slot = (slot + 1) & (w->c_slots - 1)) {}
    }
    size_t off = w->cache_ids.n;
    for (size_t k = start; k < out->n; k++)
        if (ivec_push(&w->cache_ids, out->v[k])) return LM_OK;
    w->c_ptr[slot] = s;
    w->c_len[slot] = (uint32_t)m;
    w->c_n[slot] = (uint32_t)(out->n - start);
    w->c_off[slot] = off;
    w->c_hash[slot] = h;
    w->c_used++;
    return LM_OK;
}

lm_status lm_tokenizer_encode(const lm_tokenizer *tok, const void *bytes, size_t len, int32_t **ids,
                              size_t *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    const uint8_t *s = bytes;
    bpe_scratch w;
    memset(&w, 0, sizeof w);
    ivec out = {0};
    lm_status st = LM_OK;
    size_t i = 0;
    while (i < len && !st) {
        /* 1. the end-of-text marker is one token */
        size_t e = find_eot(s, len, i);
        /* 2.-3. pre-tokenize the piece before it, BPE on each chunk */
        while (i < e && !st) {
            size_t j = lm_pretokenize_next(s, e, i);
            st = encode_chunk(tok, s + i, j - i, &w, &out);
            i = j;
        }
        if (!st && e < len) {
            if (ivec_push(&out, lm_tokenizer_eot_id(tok))) st = lm_error(LM_ERR_MEMORY, "out of memory encoding");
            i = e + EOT_LEN;
        }
    }
    scratch_free(&w);
    if (st) {
        free(out.v);
        return st;
    }
    *ids = out.v;
    *n_ids = out.n;
    return LM_OK;
}

lm_status lm_tokenizer_decode(const lm_tokenizer *tok, const int32_t *ids, size_t n_ids, char **bytes,
                              size_t *len) {
    *bytes = NULL;
    *len = 0;
    int V = lm_tokenizer_vocab_size(tok);
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= V)
            return lm_error(LM_ERR_ARG, "cannot decode id %d at position %zu: the vocabulary has ids 0..%d",
                            (int)ids[i], i, V - 1);
        total += tok->token_off[ids[i] + 1] - tok->token_off[ids[i]];
    }
    char *b = malloc(total + 1);
    if (!b) return lm_error(LM_ERR_MEMORY, "out of memory decoding %zu ids", n_ids);
    size_t o = 0;
    for (size_t i = 0; i < n_ids; i++) {
        size_t k = tok->token_off[ids[i] + 1] - tok->token_off[ids[i]];
        memcpy(b + o, tok->token_bytes + tok->token_off[ids[i]], k);
        o += k;
    }
    b[o] = 0;
    *bytes = b;
    *len = o;
    return LM_OK;
}

/* ------------------------------------------------------------------------ */
/* Training. */

typedef struct {
    uint64_t key;    /* left << 32 | right */
    int64_t count;   /* occurrences weighted by word frequency */
    int32_t *where;  /* words that hold (or held) the pair; may repeat, may be stale */
    int32_t n_where, cap_where;
    int32_t touched; /* the merge step that last increased the count */
    uint8_t banned;  /* its concatenation is already a token */
} pair_rec;

typedef struct {
    pair_rec *rec;
    size_t n, cap;
    int64_t *slots; /* index into rec or -1 */
    size_t n_slots;
    /* max-heap of (count, key); entries may hold outdated counts (upper bounds) */
    struct heap_entry { int64_t count; uint64_t key; } *heap;
    size_t heap_n, heap_cap;
} pair_table;

static int64_t pairs_find(const pair_table *p, uint64_t key) {
    for (size_t s = lm_mix64(key) & (p->n_slots - 1);; s = (s + 1) & (p->n_slots - 1)) {
        int64_t k = p->slots[s];
        if (k < 0 || p->rec[k].key == key) return k;
    }
}

static int64_t pairs_get(pair_table *p, uint64_t key) {
    if (2 * (p->n + 1) > p->n_slots) {
        size_t ns = p->n_slots ? 2 * p->n_slots : 4096;
        int64_t *slots = malloc(ns * sizeof *slots);
        if (!slots) return -1;
        for (size_t s = 0; s < ns; s++) slots[s] = -1;
        for (size_t k = 0; k < p->n; k++) {
            size_t s = lm_mix64(p->rec[k].key) & (ns - 1);
            while (slots[s] >= 0) s = (s + 1) & (ns - 1);
            slots[s] = (int64_t)k;
        }
        free(p->slots);
        p->slots = slots;
        p->n_slots = ns;
    }
    size_t s = lm_mix64(key) & (p->n_slots - 1);
    while (p->slots[s] >= 0) {
        if (p->rec[p->slots[s]].key == key) return p->slots[s];
        s = (s + 1) & (p->n_slots - 1);
    }
    if (grow((void **)&p->rec, &p->cap, p->n + 1, sizeof *p->rec)) return -1;
    memset(&p->rec[p->n], 0, sizeof *p->rec);
    p->rec[p->n].key = key;
    p->rec[p->n].touched = -1;
    p->slots[s] = (int64_t)p->n;
    return (int64_t)p->n++;
}

static int heap_before(const struct heap_entry *a, const struct heap_entry *b) {
    return a->count > b->count || (a->count == b->count && a->key < b->key);
}

static int pairs_heap_push(pair_table *p, int64_t count, uint64_t key) {
    if (grow((void **)&p->heap, &p->heap_cap, p->heap_n + 1, sizeof *p->heap)) return -1;
    struct heap_entry x = {count, key};
    size_t i = p->heap_n++;
    while (i > 0 && heap_before(&x, &p->heap[(i - 1) / 2])) {
        p->heap[i] = p->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    p->heap[i] = x;
    return 0;
}

static struct heap_entry pairs_heap_pop(pair_table *p) {
    struct heap_entry top = p->heap[0], x = p->heap[--p->heap_n];
    size_t i = 0, n = p->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_before(&p->heap[c + 1], &p->heap[c])) c++;
        if (!heap_before(&p->heap[c], &x)) break;
        p->heap[i] = p->heap[c];
        i = c;
    }
    if (n) p->heap[i] = x;
    return top;
}

static void pairs_free(pair_table *p) {
    for (size_t k = 0; k < p->n; k++) free(p->rec[k].where);
    free(p->rec);
    free(p->slots);
    free(p->heap);
}

/* Add `delta` to the count of (left, right); with a positive delta, note word
 * w as a holder. Returns the record index or -1 when out of memory. */
static int64_t pair_add(pair_table *p, int32_t left, int32_t right, int64_t delta, int32_t w) {
    int64_t k = pairs_get(p, (uint64_t)(uint32_t)left << 32 | (uint32_t)right);
    if (k < 0) return -1;
    pair_rec *r = &p->rec[k];
    r->count += delta;
    if (delta > 0 && (r->n_where == 0 || r->where[r->n_where - 1] != w)) {
        if (r->n_where == r->cap_where) {
            int32_t c = r->cap_where ? 2 * r->cap_where : 4;
            int32_t *q = realloc(r->where, (size_t)c * sizeof *q);
            if (!q) return -1;
            r->where = q;
            r->cap_where = c;
        }
        r->where[r->n_where++] = w;
    }
    return k;
}

typedef struct {
    int n_words;
    int32_t *sym;      /* all words' symbols */
    size_t *start;     /* [n_words] */
    int32_t *len;      /* [n_words] current symbol count */
    int64_t *freq;     /* [n_words] */
    int32_t *seen;     /* [n_words] last merge step that visited the word */
} word_set;

/* Count the pre-tokenizer's chunks of every text (end-of-text markers cut
 * the text and are not counted). */
static lm_status count_words(const void *const *texts, const size_t *lengths, int n_texts, strtab *words) {
    for (int t = 0; t < n_texts; t++) {
        const uint8_t *s = texts[t];
        size_t n = lengths[t], i = 0;
        while (i < n) {
            size_t e = find_eot(s, n, i);
            while (i < e) {
                size_t j = lm_pretokenize_next(s, e, i);
                int ins;
                int64_t k = strtab_insert(words, s + i, j - i, &ins);
                if (k < 0) return lm_error(LM_ERR_MEMORY, "out of memory counting words for tokenizer training");
                words->value[k]++;
                i = j;
            }
            if (e < n) i = e + EOT_LEN;
        }
    }
    return LM_OK;
}

/* Replace (a, b) by t in word w, updating pair counts locally: the pairs
 * (prev, a), (a, b), (b, next) lose the word's frequency, (prev, t) and
 * (t, next) gain it (docs/data.md, training). */
static lm_status merge_word(word_set *ws, pair_table *p, int32_t w, int32_t a, int32_t b, int32_t t, int32_t step,
                            ivec *touched) {
    int32_t *s = ws->sym + ws->start[w];
    int32_t L = ws->len[w], o = 0;
    int64_t f = ws->freq[w];
    for (int32_t i = 0; i < L;) {
        if (i + 1 < L && s[i] == a && s[i + 1] == b) {
            if (pair_add(p, a, b, -f, w) < 0) goto oom;
            if (o > 0) {
                if (pair_add(p, s[o - 1], a, -f, w) < 0) goto oom;
                int64_t k = pair_add(p, s[o - 1], t, f, w);
                if (k < 0) goto oom;
                if (p->rec[k].touched != step) {
                    p->rec[k].touched = step;
                    if (ivec_push(touched, (int32_t)k)) goto oom;
                }
            }
            if (i + 2 < L) {
                if (pair_add(p, b, s[i + 2], -f, w) < 0) goto oom;
                int64_t k = pair_add(p, t, s[i + 2], f, w);
                if (k < 0) goto oom;
                if (p->rec[k].touched != step) {
                    p->rec[k].touched = step;
                    if (ivec_push(touched, (int32_t)k)) goto oom;
                }
            }
            s[o++] = t;
            i += 2;
        } else {
            s[o++] = s[i++];
        }
    }
    ws->len[w] = o;
    return LM_OK;
oom:
    return lm_error(LM_ERR_MEMORY, "out of memory in tokenizer training");
}

lm_status lm_tokenizer_train(const void *const *texts, const size_t *lengths, int n_texts, int vocab_size,
                             int64_t min_frequency, lm_tokenizer **out) {
    *out = NULL;
    if (vocab_size < LM_TOKENIZER_MIN_VOCAB || vocab_size > LM_TOKENIZER_MAX_VOCAB)
        return lm_error(LM_ERR_ARG, "vocab size %d out of range [%d, %d] (256 bytes + merges + end-of-text)",
                        vocab_size, LM_TOKENIZER_MIN_VOCAB, LM_TOKENIZER_MAX_VOCAB);
    if (min_frequency < 1) return lm_error(LM_ERR_ARG, "min_frequency must be >= 1, got %lld", (long long)min_frequency);
    if (n_texts < 0) return lm_error(LM_ERR_ARG, "negative number of texts %d", n_texts);

    strtab words = {0}, tokens = {0};
    pair_table pairs = {0};
    word_set ws = {0};
    ivec touched = {0}, ml = {0}, mr = {0};
    uint8_t *concat = NULL;
    size_t concat_cap = 0;
    lm_status st = count_words(texts, lengths, n_texts, &words);
    if (st) goto done;

    /* every word as a sequence of byte symbols */
    ws.n_words = (int)words.n;
    ws.sym = malloc((words.arena_used + 1) * sizeof *ws.sym);
    ws.start = malloc((words.n + 1) * sizeof *ws.start);
    ws.len = malloc((words.n + 1) * sizeof *ws.len);
    ws.freq = malloc((words.n + 1) * sizeof *ws.freq);
    ws.seen = malloc((words.n + 1) * sizeof *ws.seen);
    if (!ws.sym || !ws.start || !ws.len || !ws.freq || !ws.seen) {
        st = lm_error(LM_ERR_MEMORY, "out of memory for %zu training words", words.n);
        goto done;
    }
    for (size_t w = 0; w < words.n; w++) {
        ws.start[w] = words.off[w];
        ws.len[w] = (int32_t)words.len[w];
        ws.freq[w] = words.value[w];
        ws.seen[w] = -1;
        for (size_t i = 0; i < words.len[w]; i++) ws.sym[words.off[w] + i] = words.arena[words.off[w] + i];
    }
    /* the token strings (to refuse merges that would duplicate one) */
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        int ins;
        if (strtab_insert(&tokens, &c, 1, &ins) < 0) goto oom;
    }
    /* initial pair counts */
    for (int32_t w = 0; w < ws.n_words; w++) {
        const int32_t *s = ws.sym + ws.start[w];
        for (int32_t i = 0; i + 1 < ws.len[w]; i++)
            if (pair_add(&pairs, s[i], s[i + 1], ws.freq[w], w) < 0) goto oom;
    }
    for (size_t k = 0; k < pairs.n; k++)
        if (pairs_heap_push(&pairs, pairs.rec[k].count, pairs.rec[k].key)) goto oom;

    int target = vocab_size - 257;
    for (int32_t step = 0; step < target;) {
        /* the most frequent pair: re-queue entries whose count went down */
        int64_t best = -1;
        while (pairs.heap_n) {
            struct heap_entry e = pairs_heap_pop(&pairs);
            int64_t k = pairs_find(&pairs, e.key);
            pair_rec *r = &pairs.rec[k];
            if (r->banned || r->count <= 0) continue;
            if (r->count != e.count) {
                if (pairs_heap_push(&pairs, r->count, r->key)) goto oom;
                continue;
            }
            best = k;
            break;
        }
        if (best < 0 || pairs.rec[best].count < min_frequency) break;
        int32_t a = (int32_t)(pairs.rec[best].key >> 32), b = (int32_t)(uint32_t)pairs.rec[best].key;
        /* the new token's bytes; a pair that spells an existing token is banned */
        size_t la = tokens.len[a], lb = tokens.len[b];
        if (grow((void **)&concat, &concat_cap, la + lb, 1)) goto oom;
        memcpy(concat, tokens.arena + tokens.off[a], la);
        memcpy(concat + la, tokens.arena + tokens.off[b], lb);
        int ins;
        if (strtab_find(&tokens, concat, la + lb) >= 0) {
            pairs.rec[best].banned = 1;
            continue;
        }
        if (strtab_insert(&tokens, concat, la + lb, &ins) < 0) goto oom;
        int32_t t = 256 + step;
        if (ivec_push(&ml, a) || ivec_push(&mr, b)) goto oom;
        /* apply the merge in every word that holds the pair */
        int32_t *where = pairs.rec[best].where, n_where = pairs.rec[best].n_where;
        touched.n = 0;
        for (int32_t q = 0; q < n_where && !st; q++) {
            int32_t w = where[q];
            if (ws.seen[w] == step) continue;
            ws.seen[w] = step;
            st = merge_word(&ws, &pairs, w, a, b, t, step, &touched);
        }
        if (st) break;
        best = pairs_find(&pairs, (uint64_t)(uint32_t)a << 32 | (uint32_t)b);
        free(pairs.rec[best].where);
        pairs.rec[best].where = NULL;
        pairs.rec[best].n_where = pairs.rec[best].cap_where = 0;
        for (size_t q = 0; q < touched.n; q++)
            if (pairs_heap_push(&pairs, pairs.rec[touched.v[q]].count, pairs.rec[touched.v[q]].key)) goto oom;
        step++;
    }
    if (!st) st = tokenizer_build((int)ml.n, ml.v, mr.v, out);
    goto done;
oom:
    st = lm_error(LM_ERR_MEMORY, "out of memory in tokenizer training");
done:
    free(concat);
    strtab_free(&words);
    strtab_free(&tokens);
    pairs_free(&pairs);
    free(ws.sym);
    free(ws.start);
    free(ws.len);
    free(ws.freq);
    free(ws.seen);
    free(touched.v);
    free(ml.v);
    free(mr.v);
    return st;
}

/* ------------------------------------------------------------------------ */
/* The writer. */

typedef lm_text sbuf; /* src/core/files.h */

static size_t put_utf8(char *o, unsigned cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    o[0] = (char)(0xc0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2; /* the byte-level alphabet stays below U+0800 */
}

/* A token as a JSON string of byte-level characters. */
static void sb_token(sbuf *b, const uint8_t *p, size_t n) {
    lm_text_put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        char u[4];
        unsigned cp = byte_to_codepoint(p[i]);
        if (cp == '"' || cp == '\\') lm_text_put(b, "\\", 1);
        lm_text_put(b, u, put_utf8(u, cp));
    }
    lm_text_put(b, "\"", 1);
}

lm_status lm_tokenizer_to_json(const lm_tokenizer *tok, char **json, size_t *len) {
    *json = NULL;
    *len = 0;
    sbuf b = {0};
    int V = lm_tokenizer_vocab_size(tok), eot = lm_tokenizer_eot_id(tok);
    lm_text_printf(&b, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n");
    lm_text_printf(&b, "  \"added_tokens\": [\n    {\"id\": %d, \"content\": \"%s\", \"single_word\": false, "
                  "\"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}\n  ],\n",
              eot, LM_TOKENIZER_EOT);
    lm_text_printf(&b, "  \"normalizer\": null,\n");
    lm_text_printf(&b, "  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [\n");
    lm_text_printf(&b, "    {\"type\": \"Split\", \"pattern\": {\"Regex\": \"");
    for (const char *p = pretokenizer_regex; *p; p++) {
        if (*p == '\\' || *p == '"') lm_text_put(&b, "\\", 1);
        lm_text_put(&b, p, 1);
    }
    lm_text_printf(&b, "\"}, \"behavior\": \"Isolated\", \"invert\": false},\n");
    lm_text_printf(&b, "    {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                  "\"use_regex\": false}\n  ]},\n");
    lm_text_printf(&b, "  \"post_processor\": null,\n");
    lm_text_printf(&b, "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
                  "\"use_regex\": false},\n");
    lm_text_printf(&b, "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n"
                  "    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n"
                  "    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n");
    lm_text_printf(&b, "    \"vocab\": {\n");
    for (int id = 0; id < V; id++) {
        size_t n = 0;
        const uint8_t *p = lm_tokenizer_token(tok, id, &n);
        lm_text_put(&b, "      ", 6);
        if (id == eot) lm_text_printf(&b, "\"%s\"", LM_TOKENIZER_EOT);
        else sb_token(&b, p, n);
        lm_text_printf(&b, ": %d%s\n", id, id + 1 < V ? "," : "");
    }
    lm_text_printf(&b, "    },\n    \"merges\": [\n");
    for (int k = 0; k < tok->n_merges; k++) {
        size_t na = 0, nb = 0;
        const uint8_t *pa = lm_tokenizer_token(tok, tok->merge_left[k], &na);
        const uint8_t *pb = lm_tokenizer_token(tok, tok->merge_right[k], &nb);
        /* "A B": the byte-level alphabet has no space, so one space separates */
        sbuf both = {0};
        sb_token(&both, pa, na);
        lm_text_put(&b, "      ", 6);
        if (!both.failed) lm_text_put(&b, both.s, both.n - 1);
        lm_text_put(&b, " ", 1);
        free(both.s);
        memset(&both, 0, sizeof both);
        sb_token(&both, pb, nb);
        if (!both.failed) lm_text_put(&b, both.s + 1, both.n - 1);
        b.failed |= both.failed;
        free(both.s);
        lm_text_printf(&b, "%s\n", k + 1 < tok->n_merges ? "," : "");
    }
    lm_text_printf(&b, "    ]\n  }\n}\n");
    if (b.failed) {
        free(b.s);
        return lm_error(LM_ERR_MEMORY, "out of memory writing the tokenizer JSON");
    }
    *json = b.s;
    *len = b.n;
    return LM_OK;
}

lm_status lm_tokenizer_save(const lm_tokenizer *tok, const char *path) {
    char *json;
    size_t len;
    lm_status st = lm_tokenizer_to_json(tok, &json, &len);
    if (st) return st;
    const void *parts[1] = {json};
    size_t sizes[1] = {len};
    st = lm_write_file_atomic(path, parts, sizes, 1);
    free(json);
    return st;
}

/* ------------------------------------------------------------------------ */
/* The reader. */

#define BAD(...) lm_error(LM_ERR_FORMAT, __VA_ARGS__)

/* Object `o` may hold only the listed keys (NULL-terminated). */
static lm_status only_keys(const char *what, const char *where, const lm_json *o, const char *const *keys) {
    for (const lm_json *m = o->child; m; m = m->next) {
        int ok = 0;
        for (const char *const *k = keys; *k; k++) ok |= !strcmp(m->key, *k);
        if (!ok) return BAD("%s: unexpected key \"%s\" in %s (this reader knows only the format longmoe writes)", what,
                            m->key, where);
    }
    return LM_OK;
}

static lm_status want_string(const char *what, const char *where, const lm_json *o, const char *key,
                             const char *value) {
    const lm_json *v = lm_json_get(o, key);
    if (!v || v->kind != LM_JSON_STRING || strcmp(v->string, value))
        return BAD("%s: %s.%s must be \"%s\"", what, where, key, value);
    return LM_OK;
}

/* key must be absent, null, or (when `or_empty`) the empty string */
static lm_status want_null(const char *what, const char *where, const lm_json *o, const char *key, int or_empty) {
    const lm_json *v = lm_json_get(o, key);
    if (!v || v->kind == LM_JSON_NULL || (or_empty && v->kind == LM_JSON_STRING && !v->string[0])) return LM_OK;
    return BAD("%s: %s.%s must be null (longmoe's tokenizer does not use it)", what, where, key);
}

/* key must be a boolean; `value` >= 0 requires that value; absent is allowed when `optional` */
static lm_status want_bool(const char *what, const char *where, const lm_json *o, const char *key, int value,
                           int optional) {
    const lm_json *v = lm_json_get(o, key);
    if (!v && optional) return LM_OK;
    if (!v || v->kind != LM_JSON_BOOL) return BAD("%s: %s.%s must be true or false", what, where, key);
    if (value >= 0 && v->boolean != value)
        return BAD("%s: %s.%s must be %s", what, where, key, value ? "true" : "false");
    return LM_OK;
}

static lm_status check_pre_tokenizer(const char *what, const lm_json *p) {
    static const char *const seq_keys[] = {"type", "pretokenizers", NULL};
    static const char *const split_keys[] = {"type", "pattern", "behavior", "invert", NULL};
    static const char *const bl_keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex", NULL};
    lm_status st;
    if (!p || p->kind != LM_JSON_OBJECT) return BAD("%s: pre_tokenizer must be an object", what);
    if ((st = only_keys(what, "pre_tokenizer", p, seq_keys)) ||
        (st = want_string(what, "pre_tokenizer", p, "type", "Sequence")))
        return st;
    const lm_json *list = lm_json_get(p, "pretokenizers");
    if (!list || list->kind != LM_JSON_ARRAY || list->count != 2)
        return BAD("%s: pre_tokenizer.pretokenizers must list two steps (Split, ByteLevel)", what);
    const lm_json *split = list->child, *bl = list->child->next;
    if (split->kind != LM_JSON_OBJECT || bl->kind != LM_JSON_OBJECT)
        return BAD("%s: pre_tokenizer.pretokenizers must hold objects", what);
    if ((st = only_keys(what, "the Split pre-tokenizer", split, split_keys)) ||
        (st = want_string(what, "pretokenizers[0]", split, "type", "Split")) ||
        (st = want_string(what, "pretokenizers[0]", split, "behavior", "Isolated")) ||
        (st = want_bool(what, "pretokenizers[0]", split, "invert", 0, 0)))
        return st;
    const lm_json *pat = lm_json_get(split, "pattern");
    const lm_json *re = pat && pat->kind == LM_JSON_OBJECT && pat->count == 1 ? lm_json_get(pat, "Regex") : NULL;
    if (!re || re->kind != LM_JSON_STRING || strcmp(re->string, pretokenizer_regex))
        return BAD("%s: the Split pattern must be {\"Regex\": \"%s\"} (the pre-tokenizer longmoe implements)", what,
                   pretokenizer_regex);
    if ((st = only_keys(what, "the ByteLevel pre-tokenizer", bl, bl_keys)) ||
        (st = want_string(what, "pretokenizers[1]", bl, "type", "ByteLevel")) ||
        (st = want_bool(what, "pretokenizers[1]", bl, "add_prefix_space", 0, 0)) ||
        (st = want_bool(what, "pretokenizers[1]", bl, "use_regex", 0, 0)) ||
        (st = want_bool(what, "pretokenizers[1]", bl, "trim_offsets", -1, 1)))
        return st;
    return LM_OK;
}

static lm_status check_added_tokens(const char *what, const lm_json *a, int eot) {
    static const char *const keys[] = {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special",
                                       NULL};
    lm_status st;
    if (!a || a->kind != LM_JSON_ARRAY || a->count != 1 || a->child->kind != LM_JSON_OBJECT)
        return BAD("%s: added_tokens must hold exactly one entry, the end-of-text token " LM_TOKENIZER_EOT, what);
    const lm_json *t = a->child, *id = lm_json_get(t, "id");
    if ((st = only_keys(what, "added_tokens[0]", t, keys)) ||
        (st = want_string(what, "added_tokens[0]", t, "content", LM_TOKENIZER_EOT)) ||
        (st = want_bool(what, "added_tokens[0]", t, "special", 1, 0)) ||
        (st = want_bool(what, "added_tokens[0]", t, "single_word", 0, 1)) ||
        (st = want_bool(what, "added_tokens[0]", t, "lstrip", 0, 1)) ||
        (st = want_bool(what, "added_tokens[0]", t, "rstrip", 0, 1)) ||
        (st = want_bool(what, "added_tokens[0]", t, "normalized", 0, 1)))
        return st;
    if (!id || id->kind != LM_JSON_NUMBER || !id->number_is_integer || id->integer != eot)
        return BAD("%s: added_tokens[0].id must be %d (the last id of the vocabulary)", what, eot);
    return LM_OK;
}

/* One merge entry: "A B" or ["A", "B"]; the parts' keys are written into a/b. */
static lm_status merge_parts(const char *what, int k, const lm_json *m, char **a, char **b, char *buf, size_t cap) {
    if (m->kind == LM_JSON_ARRAY && m->count == 2 && m->child->kind == LM_JSON_STRING &&
        m->child->next->kind == LM_JSON_STRING) {
        *a = m->child->string;
        *b = m->child->next->string;
        return LM_OK;
    }
    if (m->kind != LM_JSON_STRING || m->string_length + 1 > cap)
        return BAD("%s: merges[%d] must be a string \"A B\" or a pair [\"A\", \"B\"]", what, k);
    memcpy(buf, m->string, m->string_length + 1);
    char *sp = strchr(buf, ' ');
    if (!sp || sp == buf || !sp[1] || strchr(sp + 1, ' '))
        return BAD("%s: merges[%d] \"%s\" must be two tokens separated by one space", what, k, m->string);
    *sp = 0;
    *a = buf;
    *b = sp + 1;
    return LM_OK;
}

static lm_status parse_doc(const lm_json *root, const char *what, lm_tokenizer **out) {
    static const char *const top_keys[] = {"version", "truncation", "padding", "added_tokens", "normalizer",
                                           "pre_tokenizer", "post_processor", "decoder", "model", NULL};
    static const char *const model_keys[] = {"type", "dropout", "unk_token", "continuing_subword_prefix",
                                             "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges",
                                             "vocab", "merges", NULL};
    lm_status st;
    if (root->kind != LM_JSON_OBJECT) return BAD("%s: the tokenizer file must be a JSON object", what);
    if ((st = only_keys(what, "the top level", root, top_keys))) return st;
    const lm_json *v = lm_json_get(root, "version");
    if (v && (v->kind != LM_JSON_STRING || strcmp(v->string, "1.0")))
        return BAD("%s: version must be \"1.0\"", what);
    if ((st = want_null(what, "the top level", root, "truncation", 0)) ||
        (st = want_null(what, "the top level", root, "padding", 0)) ||
        (st = want_null(what, "the top level", root, "normalizer", 0)) ||
        (st = want_null(what, "the top level", root, "post_processor", 0)) ||
        (st = check_pre_tokenizer(what, lm_json_get(root, "pre_tokenizer"))))
        return st;
    const lm_json *dec = lm_json_get(root, "decoder");
    if (!dec || dec->kind != LM_JSON_OBJECT) return BAD("%s: decoder must be an object {\"type\": \"ByteLevel\"}", what);
    static const char *const dec_keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex", NULL};
    if ((st = only_keys(what, "decoder", dec, dec_keys)) || (st = want_string(what, "decoder", dec, "type", "ByteLevel")))
        return st;

    const lm_json *model = lm_json_get(root, "model");
    if (!model || model->kind != LM_JSON_OBJECT) return BAD("%s: model must be an object", what);
    if ((st = only_keys(what, "model", model, model_keys)) || (st = want_string(what, "model", model, "type", "BPE")) ||
        (st = want_null(what, "model", model, "dropout", 0)) || (st = want_null(what, "model", model, "unk_token", 0)) ||
        (st = want_null(what, "model", model, "continuing_subword_prefix", 1)) ||
        (st = want_null(what, "model", model, "end_of_word_suffix", 1)) ||
        (st = want_bool(what, "model", model, "fuse_unk", -1, 1)) ||
        (st = want_bool(what, "model", model, "byte_fallback", 0, 1)) ||
        (st = want_bool(what, "model", model, "ignore_merges", 0, 1)))
        return st;
    const lm_json *vocab = lm_json_get(model, "vocab"), *merges = lm_json_get(model, "merges");
    if (!vocab || vocab->kind != LM_JSON_OBJECT) return BAD("%s: model.vocab must be an object", what);
    if (!merges || merges->kind != LM_JSON_ARRAY) return BAD("%s: model.merges must be an array", what);
    if (vocab->count < LM_TOKENIZER_MIN_VOCAB || vocab->count > LM_TOKENIZER_MAX_VOCAB)
        return BAD("%s: model.vocab has %zu entries; it needs %d to %d (256 bytes, merges, end-of-text)", what,
                   vocab->count, LM_TOKENIZER_MIN_VOCAB, LM_TOKENIZER_MAX_VOCAB);
    int V = (int)vocab->count, n_merges = V - 257;
    if (merges->count != (size_t)n_merges)
        return BAD("%s: model.merges has %zu entries but the vocabulary of %d needs %d (vocab - 257)", what,
                   merges->count, V, n_merges);
    if ((st = check_added_tokens(what, lm_json_get(root, "added_tokens"), V - 1))) return st;

    /* id -> key, and key -> id */
    const char **key_of = calloc((size_t)V, sizeof *key_of);
    int32_t *ml = malloc(((size_t)n_merges + 1) * sizeof *ml), *mr = malloc(((size_t)n_merges + 1) * sizeof *mr);
    char *buf = NULL;
    size_t buf_cap = 0;
    strtab ids = {0};
    if (!key_of || !ml || !mr) {
        st = lm_error(LM_ERR_MEMORY, "%s: out of memory reading a vocabulary of %d", what, V);
        goto done;
    }
    for (const lm_json *e = vocab->child; e; e = e->next) {
        if (e->kind != LM_JSON_NUMBER || !e->number_is_integer || e->integer < 0 || e->integer >= V) {
            st = BAD("%s: model.vocab[\"%s\"] must be an integer id in [0, %d)", what, e->key, V);
            goto done;
        }
        if (key_of[e->integer]) {
            st = BAD("%s: id %lld is given to both \"%s\" and \"%s\"", what, (long long)e->integer,
                     key_of[e->integer], e->key);
            goto done;
        }
        key_of[e->integer] = e->key;
        int ins;
        int64_t k = strtab_insert(&ids, (const uint8_t *)e->key, strlen(e->key), &ins);
        if (k < 0) {
            st = lm_error(LM_ERR_MEMORY, "%s: out of memory reading the vocabulary", what);
            goto done;
        }
        ids.value[k] = e->integer;
    }
    /* ids 0..255: the bytes, in order */
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t n = put_utf8(u, byte_to_codepoint((unsigned)b));
        u[n] = 0;
        if (strcmp(key_of[b], u)) {
            st = BAD("%s: id %d must be the byte-level character of byte 0x%02x (U+%04X), found \"%s\"", what, b, b,
                     byte_to_codepoint((unsigned)b), key_of[b]);
            goto done;
        }
    }
    if (strcmp(key_of[V - 1], LM_TOKENIZER_EOT)) {
        st = BAD("%s: the last id %d must be " LM_TOKENIZER_EOT ", found \"%s\"", what, V - 1, key_of[V - 1]);
        goto done;
    }
    int k = 0;
    for (const lm_json *m = merges->child; m; m = m->next, k++) {
        char *a = NULL, *b = NULL;
        size_t need = m->kind == LM_JSON_STRING ? m->string_length + 1 : 1;
        if (grow((void **)&buf, &buf_cap, need, 1)) {
            st = lm_error(LM_ERR_MEMORY, "%s: out of memory reading merges", what);
            goto done;
        }
        if ((st = merge_parts(what, k, m, &a, &b, buf, buf_cap))) goto done;
        int64_t ia = strtab_find(&ids, (const uint8_t *)a, strlen(a));
        int64_t ib = strtab_find(&ids, (const uint8_t *)b, strlen(b));
        if (ia < 0 || ib < 0) {
            st = BAD("%s: merges[%d] uses \"%s\", which is not in the vocabulary", what, k, ia < 0 ? a : b);
            goto done;
        }
        ml[k] = (int32_t)ids.value[ia];
        mr[k] = (int32_t)ids.value[ib];
        if (ml[k] >= 256 + k || mr[k] >= 256 + k) {
            st = BAD("%s: merges[%d] uses \"%s\" (id %d), which only a later merge creates", what, k,
                     ml[k] >= 256 + k ? a : b, ml[k] >= 256 + k ? ml[k] : mr[k]);
            goto done;
        }
        size_t la = strlen(a), lb = strlen(b);
        const char *want = key_of[256 + k];
        if (strlen(want) != la + lb || memcmp(want, a, la) || memcmp(want + la, b, lb)) {
            st = BAD("%s: merges[%d] (\"%s\" + \"%s\") must produce id %d, which is \"%s\"", what, k, a, b, 256 + k,
                     want);
            goto done;
        }
    }
    st = tokenizer_build(n_merges, ml, mr, out);
    if (st) {
        char msg[1024]; /* lm_error writes the buffer lm_last_error reads: copy first */
        snprintf(msg, sizeof msg, "%s", lm_last_error());
        st = BAD("%s: %s", what, msg);
    }
done:
    free(key_of);
    free(ml);
    free(mr);
    free(buf);
    strtab_free(&ids);
    return st;
}

lm_status lm_tokenizer_parse(const char *json, size_t len, const char *what, lm_tokenizer **out) {
    *out = NULL;
    lm_json_doc *doc;
    lm_status st = lm_json_parse(json, len, what, &doc);
    if (st) return st;
    st = parse_doc(lm_json_root(doc), what, out);
    lm_json_free(doc);
    return st;
}

lm_status lm_tokenizer_load(const char *path, lm_tokenizer **out) {
    *out = NULL;
    char *text;
    size_t len;
    lm_status st = lm_read_file(path, 0, &text, &len);
    if (st) return st;
    st = lm_tokenizer_parse(text, len, path, out);
    free(text);
    return st;
}

