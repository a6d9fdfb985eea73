/* The safetensors reader/writer: round trip, atomic save, and every kind of
 * malformed file rejected with a message that names the problem. */
#include <stdint.h>
#include <unistd.h>

#include "longmoe/safetensors.h"
#include "test.h"

static char tmp_dir[256];

static const char *tmp_path(const char *name) { return test_path(tmp_dir, name); }

/* Build a file image from a header string and `data_len` data bytes. */
static size_t make_image(unsigned char *out, const char *header, size_t data_len) {
    size_t n = strlen(header);
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(out + 8, header, n);
    for (size_t i = 0; i < data_len; i++) out[8 + n + i] = (unsigned char)(i * 37 + 1);
    return 8 + n + data_len;
}

static void test_round_trip_preserves_names_shapes_dtypes_and_bytes(void) {
    lm_rng r;
    lm_rng_seed(&r, 1);
    float a[2 * 3];
    uint16_t b[5];
    int32_t c[4];
    for (int i = 0; i < 6; i++) a[i] = (float)lm_rng_normal(&r);
    for (int i = 0; i < 5; i++) b[i] = lm_f32_to_bf16((float)lm_rng_normal(&r));
    for (int i = 0; i < 4; i++) c[i] = (int32_t)(lm_rng_u64(&r) % 1000) - 500;
    lm_st_writer *w = lm_st_writer_new();
    int64_t sa[2] = {2, 3}, sb[1] = {5}, sc[2] = {2, 2};
    CHECK(!lm_st_writer_add(w, "layer.a", LM_DTYPE_F32, 2, sa, a), "%s", lm_last_error());
    CHECK(!lm_st_writer_add(w, "b", LM_DTYPE_BF16, 1, sb, b), "%s", lm_last_error());
    CHECK(!lm_st_writer_add(w, "c", LM_DTYPE_I32, 2, sc, c), "%s", lm_last_error());
    CHECK(!lm_st_writer_add(w, "empty", LM_DTYPE_F32, 1, (int64_t[]){0}, a), "%s", lm_last_error());
    CHECK(lm_st_writer_add(w, "b", LM_DTYPE_F32, 1, sb, a) == LM_ERR_ARG, "duplicate accepted");
    CHECK(!lm_st_writer_set_metadata(w, "format", "pt"), "%s", lm_last_error());
    const char *path = tmp_path("rt.safetensors");
    CHECK(!lm_st_writer_save(w, path), "%s", lm_last_error());
    lm_st_writer_free(w);

    lm_safetensors *st = NULL;
    CHECK(!lm_safetensors_open(path, &st), "%s", lm_last_error());
    if (!st) return;
    CHECK(lm_safetensors_count(st) == 4, "count %d", lm_safetensors_count(st));
    const lm_st_tensor *t = lm_safetensors_find(st, "layer.a");
    CHECK(t && t->dtype == LM_DTYPE_F32 && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3,
          "layer.a header");
    CHECK(t && memcmp(t->data, a, sizeof a) == 0, "layer.a bytes");
    t = lm_safetensors_find(st, "c");
    CHECK(t && t->dtype == LM_DTYPE_I32 && memcmp(t->data, c, sizeof c) == 0, "c bytes");
    float *bf = NULL;
    int64_t shape[LM_ST_MAX_DIMS];
    CHECK(!lm_safetensors_read_f32(st, "b", 1, &bf, shape), "%s", lm_last_error());
    for (int i = 0; bf && i < 5; i++) CHECK(bf[i] == lm_bf16_to_f32(b[i]), "bf16 element %d", i);
    free(bf);
    CHECK(lm_safetensors_read_f32(st, "c", -1, &bf, NULL) == LM_ERR_FORMAT, "I32 read as float");
    CHECK(strstr(lm_last_error(), "'c'") != NULL, "message names the tensor: %s", lm_last_error());
    CHECK(lm_safetensors_read_f32(st, "nope", -1, &bf, NULL) == LM_ERR_FORMAT, "missing tensor");
    CHECK(strstr(lm_last_error(), "missing") != NULL, "message: %s", lm_last_error());
    CHECK(lm_safetensors_read_f32(st, "layer.a", 3, &bf, NULL) == LM_ERR_FORMAT, "wrong ndim");
    const char *fmt = lm_safetensors_metadata(st, "format");
    CHECK(fmt && !strcmp(fmt, "pt"), "metadata");
    lm_safetensors_close(st);
}

static void test_header_is_padded_to_eight_bytes(void) {
    lm_st_writer *w = lm_st_writer_new();
    float x = 1.5f;
    lm_st_writer_add(w, "x", LM_DTYPE_F32, 0, NULL, &x);
    const char *path = tmp_path("pad.safetensors");
    CHECK(!lm_st_writer_save(w, path), "%s", lm_last_error());
    lm_st_writer_free(w);
    FILE *f = fopen(path, "rb");
    unsigned char len8[8];
    CHECK(f && fread(len8, 1, 8, f) == 8, "read");
    if (f) fclose(f);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | len8[i];
    CHECK(n % 8 == 0, "header length %llu", (unsigned long long)n);
}

typedef struct {
    const char *header;
    size_t data_len;
    size_t truncate; /* if nonzero, the image is cut to this many bytes */
    const char *expect; /* a phrase the message must contain */
} bad_case;

static void test_malformed_files_are_rejected_with_clear_messages(void) {
    static const bad_case cases[] = {
        {"{}", 0, 5, "too short"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 12, "does not fit"},
        {"[1,2]", 0, 0, "starting with '{'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}", 4, 0, "invalid JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x", 4, 0, "trailing characters"},
        {"{\"a\":{\"dtype\":\"Q7\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, 0, "unsupported dtype"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, 0, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, 0, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4, 0, "shape x dtype size"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}", 4, 0, "outside"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, 0, "outside"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}", 8, 0, "overlaps"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, 0, "unreferenced"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 9, 0, "trailing data"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, 0, "duplicate"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, 0, "exactly the keys"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4, 0, "exactly the keys"},
        {"{\"a\":5}", 0, 0, "not an object"},
        {"{\"__metadata__\":{\"k\":1}}", 0, 0, "not a string"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, 0, "at most"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,4]}}", 4, 0, "too large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}\x01", 4, 0, "invalid JSON"},
    };
    unsigned char img[1024];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n = make_image(img, cases[i].header, cases[i].data_len);
        if (cases[i].truncate) n = cases[i].truncate;
        lm_safetensors *st = NULL;
        lm_clear_error();
        lm_status s = lm_safetensors_parse(img, n, "bad.safetensors", &st);
        CHECK(s == LM_ERR_FORMAT && st == NULL, "case %zu (%s) accepted (status %d)", i,
              cases[i].expect, (int)s);
        CHECK(strstr(lm_last_error(), cases[i].expect) != NULL,
              "case %zu: message '%s' lacks '%s'", i, lm_last_error(), cases[i].expect);
        CHECK(strstr(lm_last_error(), "bad.safetensors") != NULL, "case %zu names the file", i);
        lm_safetensors_close(st);
    }
}

static void test_valid_image_parses(void) {
    /* the same builder with a valid header: the negative cases fail for their reason only */
    unsigned char img[256];
    size_t n = make_image(img, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}  ", 4);
    lm_safetensors *st = NULL;
    CHECK(!lm_safetensors_parse(img, n, "good", &st), "%s", lm_last_error());
    CHECK(st && lm_safetensors_count(st) == 1, "one tensor");
    lm_safetensors_close(st);
}

static void test_missing_file_is_an_io_error(void) {
    lm_safetensors *st = NULL;
    CHECK(lm_safetensors_open(tmp_path("does-not-exist.safetensors"), &st) == LM_ERR_IO, "status");
    CHECK(strstr(lm_last_error(), "does-not-exist") != NULL, "names the path: %s", lm_last_error());
}

static void test_failed_save_keeps_the_previous_file(void) {
    const char *path = tmp_path("keep.safetensors");
    float x = 2.0f, y = 3.0f;
    lm_st_writer *w = lm_st_writer_new();
    lm_st_writer_add(w, "x", LM_DTYPE_F32, 0, NULL, &x);
    CHECK(!lm_st_writer_save(w, path), "%s", lm_last_error());
    lm_st_writer_free(w);
    /* saving into a directory that does not exist fails and leaves no temporary file */
    char bad[600];
    snprintf(bad, sizeof bad, "%s/no-such-dir/keep.safetensors", tmp_dir);
    w = lm_st_writer_new();
    lm_st_writer_add(w, "x", LM_DTYPE_F32, 0, NULL, &y);
    CHECK(lm_st_writer_save(w, bad) == LM_ERR_IO, "save into a missing directory succeeded");
    CHECK(strstr(lm_last_error(), "no-such-dir") != NULL, "message: %s", lm_last_error());
    lm_st_writer_free(w);
    lm_safetensors *st = NULL;
    CHECK(!lm_safetensors_open(path, &st), "%s", lm_last_error());
    const lm_st_tensor *t = st ? lm_safetensors_find(st, "x") : NULL;
    CHECK(t && memcmp(t->data, &x, 4) == 0, "previous content intact");
    lm_safetensors_close(st);
}

int main(void) {
    if (test_make_tmpdir(tmp_dir, sizeof tmp_dir, "st")) return 1;
    RUN(test_round_trip_preserves_names_shapes_dtypes_and_bytes);
    RUN(test_header_is_padded_to_eight_bytes);
    RUN(test_malformed_files_are_rejected_with_clear_messages);
    RUN(test_valid_image_parses);
    RUN(test_missing_file_is_an_io_error);
    RUN(test_failed_save_keeps_the_previous_file);
    test_remove_tree(tmp_dir);
    return test_summary();
}
