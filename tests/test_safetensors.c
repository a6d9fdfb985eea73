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

/* A file streamed in pieces of any size holds exactly the bytes the format
 * defines (built here by hand: the header with the data section's checksum,
 * padded to 8 bytes, then the data) and those lm_st_writer_save writes; too
 * many or too few bytes are refused, leaving no file behind. */
static void test_streamed_file_is_the_saved_file_byte_for_byte(void) {
    float a[3] = {1.0f, -2.5f, 3.25f};
    int32_t c[5] = {7, -1, 0, 42, 9};
    int64_t sa[1] = {3}, sc[1] = {5};
    lm_st_writer *w = lm_st_writer_new();
    CHECK(!lm_st_writer_add(w, "a", LM_DTYPE_F32, 1, sa, NULL), "%s", lm_last_error());
    CHECK(!lm_st_writer_add(w, "c", LM_DTYPE_I32, 1, sc, c), "%s", lm_last_error());
    CHECK(!lm_st_writer_set_metadata(w, "format", "longmoe"), "%s", lm_last_error());
    /* a tensor added without data cannot be saved whole */
    CHECK(lm_st_writer_save(w, tmp_path("nodata.safetensors")) == LM_ERR_ARG, "saved a tensor without data");
    CHECK(strstr(lm_last_error(), "'a'") != NULL, "message names the tensor: %s", lm_last_error());
    CHECK(access(tmp_path("nodata.safetensors"), F_OK) != 0, "a file was left");
    lm_st_stream *s = NULL;
    const char *path = tmp_path("streamed.safetensors");
    CHECK(!lm_st_writer_begin(w, path, &s), "%s", lm_last_error());
    if (!s) return;
    /* the data in pieces that cut the tensors and their words */
    unsigned char data[32];
    memcpy(data, a, 12);
    memcpy(data + 12, c, 20);
    const size_t cuts[] = {0, 5, 12, 13, 27, 32};
    for (int i = 0; i + 1 < 6; i++)
        CHECK(!lm_st_stream_write(s, data + cuts[i], cuts[i + 1] - cuts[i]), "%s", lm_last_error());
    CHECK(!lm_st_stream_commit(s), "%s", lm_last_error());
    char header[256];
    int n = snprintf(header, sizeof header,
                     "{\"__metadata__\":{\"format\":\"longmoe\",\"longmoe.checksum\":\"%016llx\"},"
                     "\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
                     "\"c\":{\"dtype\":\"I32\",\"shape\":[5],\"data_offsets\":[12,32]}}",
                     (unsigned long long)lm_checksum64(data, sizeof data));
    while (n % 8) header[n++] = ' ';
    header[n] = 0;
    unsigned char want[300];
    for (int i = 0; i < 8; i++) want[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(want + 8, header, (size_t)n);
    memcpy(want + 8 + n, data, sizeof data);
    size_t got_n = 0;
    char *got = test_slurp(path, &got_n);
    CHECK(got && got_n == 8 + (size_t)n + sizeof data && !memcmp(got, want, got_n),
          "the streamed file is not the format's bytes (%zu bytes)", got_n);
    free(got);
    /* lm_st_writer_save of the same tensors writes the same bytes */
    lm_st_writer *w2 = lm_st_writer_new();
    lm_st_writer_add(w2, "a", LM_DTYPE_F32, 1, sa, a);
    lm_st_writer_add(w2, "c", LM_DTYPE_I32, 1, sc, c);
    lm_st_writer_set_metadata(w2, "format", "longmoe");
    CHECK(!lm_st_writer_save(w2, tmp_path("saved.safetensors")), "%s", lm_last_error());
    lm_st_writer_free(w2);
    CHECK(test_same_file(path, tmp_path("saved.safetensors")), "streamed and saved files differ");
    lm_safetensors *st = NULL;
    CHECK(!lm_safetensors_open(path, &st), "the streamed file does not read back: %s", lm_last_error());
    lm_safetensors_close(st);
    /* more bytes than the header names: refused; too few: refused at commit, no file left */
    CHECK(!lm_st_writer_begin(w, tmp_path("long.safetensors"), &s), "%s", lm_last_error());
    CHECK(lm_st_stream_write(s, data, 30) == LM_OK, "%s", lm_last_error());
    CHECK(lm_st_stream_write(s, data, 3) == LM_ERR_ARG, "a write past the data section was accepted");
    CHECK(strstr(lm_last_error(), "more bytes") != NULL, "message: %s", lm_last_error());
    lm_st_stream_abort(s);
    CHECK(access(tmp_path("long.safetensors"), F_OK) != 0, "an aborted stream left a file");
    CHECK(!lm_st_writer_begin(w, tmp_path("short.safetensors"), &s), "%s", lm_last_error());
    CHECK(lm_st_stream_write(s, data, 31) == LM_OK, "%s", lm_last_error());
    CHECK(lm_st_stream_commit(s) == LM_ERR_ARG, "a short data section was committed");
    CHECK(strstr(lm_last_error(), "31 bytes") != NULL, "message: %s", lm_last_error());
    CHECK(access(tmp_path("short.safetensors"), F_OK) != 0, "a refused stream left a file");
    lm_st_writer_free(w);
}

int main(void) {
    if (test_make_tmpdir(tmp_dir, sizeof tmp_dir, "st")) return 1;
    RUN(test_round_trip_preserves_names_shapes_dtypes_and_bytes);
    RUN(test_header_is_padded_to_eight_bytes);
    RUN(test_malformed_files_are_rejected_with_clear_messages);
    RUN(test_valid_image_parses);
    RUN(test_missing_file_is_an_io_error);
    RUN(test_failed_save_keeps_the_previous_file);
    RUN(test_streamed_file_is_the_saved_file_byte_for_byte);
    test_remove_tree(tmp_dir);
    return test_summary();
}
