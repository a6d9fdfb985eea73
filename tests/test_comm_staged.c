/* The staged engine of the communication layer (include/longmoe/comm.h,
 * docs/scaleout.md "The staged engine"): a backend's buffers, messages over a
 * host handle.
 *
 * The backend here is a fenced one: its memory is host memory, but the
 * pointers it hands out are moved 2^62 bytes away (not a valid address), and
 * only its own copies move them back. So an engine that read or wrote the
 * backend's memory on the host, instead of through the backend, would crash
 * the program; and every byte it moves is counted. Its buffers are poisoned
 * where a collective must not write (gaps between regions), and the poison is
 * checked after.
 *
 * Alone (`test_comm_staged`): over a one-rank SELF handle. Under mpirun
 * (`mpirun -np N test_comm_staged --mpi N`, ctest's test_comm_staged_mpi2 and
 * _mpi4): over MPI, every collective against the serial rank-order reference
 * bit for bit, the same on every rank. */
#include <stdint.h>

#include "longmoe/backend.h"
#include "longmoe/comm.h"
#include "test.h"
#include "test_comm_data.h"

static lm_comm *host, *comm; /* the host handle; the staged one over it */
static int R = 1, me = 0;

/* ---- the fenced backend ---- */

#define FENCE ((uintptr_t)1 << 62)
static size_t fence_alloced, fence_live, fence_up, fence_down, fence_copied;

static void *real(const void *p) { return (void *)((uintptr_t)p - FENCE); }
static int fenced(const void *p) { return (uintptr_t)p >= FENCE; }

static lm_status f_alloc(lm_backend *be, size_t bytes, void **out) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) return lm_error(LM_ERR_MEMORY, "fenced: out of memory");
    fence_alloced++;
    fence_live++;
    *out = (void *)((uintptr_t)p + FENCE);
    return LM_OK;
}
static void f_release(lm_backend *be, void *p) {
    if (!p) return;
    if (!fenced(p)) {
        fprintf(stderr, "fenced backend: release of a host pointer %p\n", p);
        abort();
    }
    fence_live--;
    free(real(p));
}
static lm_status f_zero(lm_backend *be, void *p, size_t bytes) {
    if (bytes) memset(real(p), 0, bytes);
    return LM_OK;
}
/* a copy whose device side is not fenced is an engine bug: fail loudly */
static lm_status f_need(const void *p, const char *what) {
    return fenced(p) ? LM_OK : lm_error(LM_ERR_ARG, "fenced backend: %s of a host pointer", what);
}
static lm_status f_copy(lm_backend *be, void *dst, const void *src, size_t bytes) {
    if (f_need(dst, "copy to") || f_need(src, "copy from")) return LM_ERR_ARG;
    memmove(real(dst), real(src), bytes);
    fence_copied += bytes;
    return LM_OK;
}
static lm_status f_upload(lm_backend *be, void *dst, const void *h, size_t bytes) {
    if (f_need(dst, "upload to") || fenced(h)) return lm_error(LM_ERR_ARG, "fenced backend: a bad upload");
    memcpy(real(dst), h, bytes);
    fence_up += bytes;
    return LM_OK;
}
static lm_status f_download(lm_backend *be, void *h, const void *src, size_t bytes) {
    if (f_need(src, "download from") || fenced(h)) return lm_error(LM_ERR_ARG, "fenced backend: a bad download");
    memcpy(h, real(src), bytes);
    fence_down += bytes;
    return LM_OK;
}
static lm_status f_sync(lm_backend *be) { return LM_OK; }

static lm_backend fence_be = {.device = LM_DEVICE_CPU,
                              .lp_bytes = 4,
                              .alloc = f_alloc,
                              .release = f_release,
                              .zero = f_zero,
                              .copy = f_copy,
                              .upload = f_upload,
                              .download = f_download,
                              .sync = f_sync};

/* a fenced buffer holding the n bytes at h (n may be 0) */
static void *dev_from(const void *h, size_t n) {
    void *d = NULL;
    if (f_alloc(&fence_be, n, &d)) abort();
    if (n) f_upload(&fence_be, d, h, n);
    return d;
}
static void to_host(void *h, const void *d, size_t n) {
    if (n) memcpy(h, real(d), n);
}
#define OK(call) CHECK((call) == LM_OK, "%s: %s", #call, lm_last_error())

/* 1 when the `bytes` at fenced buf hold the same bits on every rank. */
static int same_on_every_rank(const void *buf, size_t bytes) {
    if (!bytes) return 1;
    unsigned char *h = malloc(bytes), *all = malloc(bytes * (size_t)R);
    to_host(h, buf, bytes);
    int ok = lm_comm_all_gather(host, h, all, bytes) == LM_OK;
    for (int p = 1; p < R && ok; p++) ok = !memcmp(all, all + (size_t)p * bytes, bytes);
    free(h);
    free(all);
    return ok;
}

/* The end of a case: its two fenced buffers and three host buffers. */
static void drop_case(void *dx, void *dy, void *x, void *y, void *ref) {
    f_release(&fence_be, dx);
    f_release(&fence_be, dy);
    free(x);
    free(y);
    free(ref);
}

/* ---- cases ---- */

static void test_the_handle_is_staged_over_its_host(void) {
    CHECK(lm_comm_engine_of(comm) == LM_COMM_STAGED && !strcmp(lm_comm_engine_name(LM_COMM_STAGED), "staged"),
          "engine %s", lm_comm_engine_name(lm_comm_engine_of(comm)));
    CHECK(lm_comm_host(comm) == host, "lm_comm_host is not the host handle");
    CHECK(lm_comm_rank(comm) == me && lm_comm_size(comm) == R, "rank %d of %d", lm_comm_rank(comm),
          lm_comm_size(comm));
    CHECK(lm_comm_engine_available(LM_COMM_STAGED), "the staged engine is always built");
    int local = -1;
    OK(lm_comm_local_rank(host, &local));
    CHECK(local == me, "local rank %d on one machine, rank %d", local, me); /* every rank runs here */
    CHECK(lm_comm_local_rank(comm, &local) == LM_ERR_ARG && strstr(lm_last_error(), "lm_comm_host"),
          "local rank over the staged handle: %s", lm_last_error());
}

static void test_all_reduce_equals_the_serial_sum_through_the_backend_only(void) {
    static const size_t counts[] = {1, 2, 7, 1000, 4097};
    int trial = 0;
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        for (int c = 0; c < 5; c++, trial++) {
            size_t n = counts[c];
            unsigned char *x = malloc(n * es), *y = calloc(n, es), *ref = malloc(n * es);
            fill(x, n, dt, me, trial);
            serial_sum(ref, n, dt, R, trial, 0);
            void *dx = dev_from(x, n * es), *dy = dev_from(x, n * es);
            size_t down0 = fence_down;
            OK(lm_comm_all_reduce_sum(comm, dx, dy, n, dt));
            to_host(y, dy, n * es);
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu: differs from the serial rank-order sum", lm_dtype_name(dt), n);
            CHECK(same_on_every_rank(dy, n * es), "%s n=%zu: ranks disagree", lm_dtype_name(dt), n);
            if (R > 1) CHECK(fence_down > down0, "%s n=%zu: nothing was downloaded", lm_dtype_name(dt), n);
            OK(lm_comm_all_reduce_sum(comm, dx, dx, n, dt)); /* in place */
            to_host(y, dx, n * es);
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu: in place differs", lm_dtype_name(dt), n);
            drop_case(dx, dy, x, y, ref);
        }
    }
}

static void test_reduce_scatters_give_each_rank_its_block(void) {
    int trial = 100;
    size_t *counts = malloc((size_t)R * sizeof *counts);
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        /* equal blocks */
        size_t n = 333;
        unsigned char *x = malloc((size_t)R * n * es), *y = calloc(n, es), *ref = malloc(n * es);
        fill(x, (size_t)R * n, dt, me, trial);
        serial_sum(ref, n, dt, R, trial, (size_t)me * n);
        void *dx = dev_from(x, (size_t)R * n * es), *dy = dev_from(y, n * es);
        OK(lm_comm_reduce_scatter_sum(comm, dx, dy, n, dt));
        to_host(y, dy, n * es);
        CHECK(!memcmp(y, ref, n * es), "%s: block %d differs from the serial sum", lm_dtype_name(dt), me);
        drop_case(dx, dy, x, y, ref);
        trial++;
        /* variable blocks, a zero among them (rank 1's when there is one) */
        size_t total = 0, at = 0;
        for (int q = 0; q < R; q++) {
            counts[q] = q == 1 ? 0 : 50 + 37 * (size_t)q;
            total += counts[q];
        }
        for (int q = 0; q < me; q++) at += counts[q];
        const size_t m = counts[me];
        x = malloc(total * es + 1);
        y = calloc(m + 1, es);
        ref = malloc(m * es + 1);
        fill(x, total, dt, me, trial);
        if (m) serial_sum(ref, m, dt, R, trial, at);
        dx = dev_from(x, total * es);
        dy = m ? dev_from(y, m * es) : NULL;
        OK(lm_comm_reduce_scatterv_sum(comm, dx, dy, counts, dt));
        if (m) {
            to_host(y, dy, m * es);
            CHECK(!memcmp(y, ref, m * es), "%s: variable block %d differs from the serial sum", lm_dtype_name(dt),
                  me);
        }
        drop_case(dx, dy, x, y, ref);
        trial++;
    }
    free(counts);
}

/* all-gather-v into a buffer with gaps (poisoned, and left alone), a zero
 * part, and in place */
static void test_all_gathers_place_every_rank_and_leave_the_gaps(void) {
    size_t *rb = malloc((size_t)R * sizeof *rb), *ro = malloc((size_t)R * sizeof *ro), at = 3;
    for (int q = 0; q < R; q++) {
        rb[q] = q == R - 1 && R > 1 ? 0 : 11 + 5 * (size_t)q;
        ro[q] = at;
        at += rb[q] + 2; /* two poisoned bytes after each part */
    }
    unsigned char *mine = malloc(rb[me] + 1), *want = malloc(at), *got = malloc(at);
    memset(want, 0xA5, at);
    for (int q = 0; q < R; q++) fill_bytes(want + ro[q], rb[q], q, 0, 7);
    memcpy(mine, want + ro[me], rb[me]);
    for (int in_place = 0; in_place < 2; in_place++) {
        unsigned char *start = malloc(at);
        memset(start, 0xA5, at);
        if (in_place) memcpy(start + ro[me], mine, rb[me]);
        void *drecv = dev_from(start, at), *dsend = in_place ? (char *)drecv + ro[me] : dev_from(mine, rb[me]);
        OK(lm_comm_all_gatherv(comm, dsend, rb[me], drecv, rb, ro));
        to_host(got, drecv, at);
        CHECK(!memcmp(got, want, at), "all_gatherv%s: parts or gaps differ", in_place ? " in place" : "");
        if (!in_place) f_release(&fence_be, dsend);
        f_release(&fence_be, drecv);
        free(start);
    }
    /* equal parts */
    const size_t b = 29;
    unsigned char *all = calloc(b, (size_t)R), *ref = malloc(b * (size_t)R);
    for (int q = 0; q < R; q++) fill_bytes(ref + (size_t)q * b, b, q, 1, 8);
    void *ds = dev_from(ref + (size_t)me * b, b), *dr = dev_from(all, b * (size_t)R);
    OK(lm_comm_all_gather(comm, ds, dr, b));
    to_host(all, dr, b * (size_t)R);
    CHECK(!memcmp(all, ref, b * (size_t)R), "all_gather: rank order or bytes differ");
    f_release(&fence_be, ds);
    f_release(&fence_be, dr);
    free(all);
    free(ref);
    free(rb);
    free(ro);
    free(mine);
    free(want);
    free(got);
}

/* counts exchanged first (host arrays), then bytes moved with zeros and gaps */
static void test_all_to_allv_delivers_counts_and_leaves_the_gaps(void) {
    int64_t *sc = malloc((size_t)R * sizeof *sc), *rc = malloc((size_t)R * sizeof *rc);
    size_t *sb = malloc((size_t)R * sizeof *sb), *so = malloc((size_t)R * sizeof *so);
    size_t *rb = malloc((size_t)R * sizeof *rb), *ro = malloc((size_t)R * sizeof *ro);
    size_t sat = 1, rat = 4;
    for (int q = 0; q < R; q++) {
        sc[q] = (me + 2 * q) % 3 == 0 ? 0 : 7 + me * 3 + q; /* some zeros */
        sb[q] = (size_t)sc[q];
        so[q] = sat;
        sat += sb[q] + 1;
    }
    OK(lm_comm_exchange_counts(comm, sc, rc));
    for (int p = 0; p < R; p++) {
        int64_t want = (p + 2 * me) % 3 == 0 ? 0 : 7 + p * 3 + me;
        CHECK(rc[p] == want, "count from %d: %lld, want %lld", p, (long long)rc[p], (long long)want);
        rb[p] = (size_t)rc[p];
        ro[p] = rat;
        rat += rb[p] + 3;
    }
    unsigned char *send = malloc(sat), *want = malloc(rat), *got = malloc(rat);
    memset(send, 0x3C, sat);
    memset(want, 0x5A, rat);
    for (int q = 0; q < R; q++) fill_bytes(send + so[q], sb[q], me, q, 9);
    for (int p = 0; p < R; p++) fill_bytes(want + ro[p], rb[p], p, me, 9);
    unsigned char *start = malloc(rat);
    memset(start, 0x5A, rat);
    void *ds = dev_from(send, sat), *dr = dev_from(start, rat);
    OK(lm_comm_all_to_allv(comm, ds, sb, so, dr, rb, ro));
    to_host(got, dr, rat);
    CHECK(!memcmp(got, want, rat), "all_to_allv: delivered bytes or gaps differ");
    f_release(&fence_be, ds);
    f_release(&fence_be, dr);
    free(sc);
    free(rc);
    free(sb);
    free(so);
    free(rb);
    free(ro);
    free(send);
    free(want);
    free(got);
    free(start);
}

static void test_broadcast_from_every_root_and_the_barrier(void) {
    const size_t n = 1001;
    unsigned char *h = malloc(n), *ref = malloc(n);
    for (int root = 0; root < R; root++) {
        fill_bytes(ref, n, root, root, 10);
        fill_bytes(h, n, me, root, 11); /* every rank starts with its own bytes */
        if (me == root) memcpy(h, ref, n);
        void *d = dev_from(h, n);
        OK(lm_comm_broadcast(comm, d, n, root));
        to_host(h, d, n);
        CHECK(!memcmp(h, ref, n), "broadcast from %d differs", root);
        f_release(&fence_be, d);
    }
    OK(lm_comm_barrier(comm));
    free(h);
    free(ref);
}

/* the ranks of one parity: a staged part over the host's part, its sums the
 * serial sums over the part's ranks in their order */
static void test_split_parts_sum_over_their_ranks(void) {
    lm_comm *part = NULL;
    OK(lm_comm_split(comm, me % 2, &part));
    if (!part) return;
    CHECK(lm_comm_engine_of(part) == LM_COMM_STAGED && lm_comm_host(part) != host,
          "a part is staged over a host part of its own");
    const int PR = lm_comm_size(part);
    CHECK(PR == (R - me % 2 + 1) / 2 && lm_comm_rank(part) == me / 2, "part rank %d of %d", lm_comm_rank(part), PR);
    const size_t n = 777;
    float *x = malloc(n * sizeof *x), *ref = malloc(n * sizeof *ref), *xp = malloc(n * sizeof *xp), *y = malloc(n * sizeof *y);
    fill_f32(x, n, me, 55);
    for (int p = me % 2, k = 0; p < R; p += 2, k++) {
        fill_f32(xp, n, p, 55);
        for (size_t i = 0; i < n; i++) ref[i] = k == 0 ? xp[i] : ref[i] + xp[i];
    }
    void *d = dev_from(x, n * sizeof *x);
    OK(lm_comm_all_reduce_sum(part, d, d, n, LM_DTYPE_F32));
    to_host(y, d, n * sizeof *y);
    CHECK(!memcmp(y, ref, n * sizeof *y), "the part's sum differs from its ranks' serial sum");
    f_release(&fence_be, d);
    lm_comm_close(part);
    free(x);
    free(ref);
    free(xp);
    free(y);
}

/* lm_comm_reserve takes the backend's memory once; smaller sums reuse it and
 * closing returns it */
static void test_scratch_is_the_backends_and_reused(void) {
    lm_comm *c = NULL;
    OK(lm_comm_open_staged(host, &fence_be, &c));
    if (!c) return;
    const size_t live0 = fence_live, alloc0 = fence_alloced;
    OK(lm_comm_reserve(c, 5000, LM_DTYPE_F64));
    CHECK(fence_alloced == alloc0 + (R > 1), "reserve allocated %zu buffers", fence_alloced - alloc0);
    const size_t n = 3000;
    double *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y), *ref = malloc(n * sizeof *ref);
    fill_f64(x, n, me, 66);
    serial_sum(ref, n, LM_DTYPE_F64, R, 66, 0);
    void *d = dev_from(x, n * sizeof *x);
    const size_t after = fence_alloced;
    OK(lm_comm_all_reduce_sum(c, d, d, n, LM_DTYPE_F64));
    CHECK(fence_alloced == after, "a smaller sum allocated %zu buffers", fence_alloced - after);
    to_host(y, d, n * sizeof *y);
    CHECK(!memcmp(y, ref, n * sizeof *y), "the sum over the reserved scratch differs");
    /* a copy within the backend's memory: through the backend's copy (fenced pointers) */
    void *e = dev_from(x, n * sizeof *x);
    OK(lm_comm_copy(c, e, d, n * sizeof *x));
    to_host(y, e, n * sizeof *y);
    CHECK(!memcmp(y, ref, n * sizeof *y), "lm_comm_copy of the sum differs");
    f_release(&fence_be, e);
    f_release(&fence_be, d);
    lm_comm_close(c);
    CHECK(fence_live == live0, "closing left %zu of the backend's buffers", fence_live - live0);
    free(x);
    free(y);
    free(ref);
}

static void test_bad_arguments_are_rejected_with_a_message(void) {
    lm_comm *c = (lm_comm *)1;
    CHECK(lm_comm_open(LM_COMM_STAGED, &c) == LM_ERR_ARG && !c && strstr(lm_last_error(), "lm_comm_open_staged"),
          "open(STAGED): %s", lm_last_error());
    c = (lm_comm *)1;
    CHECK(lm_comm_open_staged(NULL, &fence_be, &c) == LM_ERR_ARG && !c, "no host: %s", lm_last_error());
    CHECK(lm_comm_open_staged(host, NULL, &c) == LM_ERR_ARG && !c, "no backend: %s", lm_last_error());
    CHECK(lm_comm_open_staged(comm, &fence_be, &c) == LM_ERR_ARG && !c && strstr(lm_last_error(), "staged"),
          "a staged host: %s", lm_last_error());
    lm_backend partial = fence_be;
    partial.download = NULL;
    CHECK(lm_comm_open_staged(host, &partial, &c) == LM_ERR_ARG && !c && strstr(lm_last_error(), "memory function"),
          "a backend without download: %s", lm_last_error());
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (want_ranks) {
        if (!lm_comm_engine_available(LM_COMM_MPI)) {
            test_skip_all("built without MPI (the MPI engine is not compiled)");
        } else if (lm_comm_open(LM_COMM_MPI, &host)) {
            fprintf(stderr, "cannot open MPI: %s\n", lm_last_error());
            return 1;
        }
    } else if (lm_comm_open(LM_COMM_SELF, &host)) {
        fprintf(stderr, "cannot open the self engine: %s\n", lm_last_error());
        return 1;
    }
    if (host) {
        R = lm_comm_size(host);
        me = lm_comm_rank(host);
        if (me) freopen("/dev/null", "w", stdout); /* one rank prints the cases; every rank prints failures */
        if (want_ranks && R != want_ranks) {
            fprintf(stderr, "started on %d ranks, expected %d\n", R, want_ranks);
            lm_comm_close(host);
            return 1;
        }
        if (lm_comm_open_staged(host, &fence_be, &comm)) {
            fprintf(stderr, "cannot open the staged engine: %s\n", lm_last_error());
            return 1;
        }
    }
    RUN(test_the_handle_is_staged_over_its_host);
    RUN(test_all_reduce_equals_the_serial_sum_through_the_backend_only);
    RUN(test_reduce_scatters_give_each_rank_its_block);
    RUN(test_all_gathers_place_every_rank_and_leave_the_gaps);
    RUN(test_all_to_allv_delivers_counts_and_leaves_the_gaps);
    RUN(test_broadcast_from_every_root_and_the_barrier);
    RUN(test_split_parts_sum_over_their_ranks);
    RUN(test_scratch_is_the_backends_and_reused);
    RUN(test_bad_arguments_are_rejected_with_a_message);
    if (comm) {
        lm_comm_close(comm);
        if (fence_live) {
            fprintf(stderr, "  FAIL: %zu of the fenced backend's buffers were not released\n", fence_live);
            test_failed_count++;
        }
        /* a failure on any rank fails the job's summary */
        int32_t failed = test_failed_count, total = 0;
        if (lm_comm_all_reduce_sum(host, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
        lm_comm_close(host);
    }
    return test_summary();
}
