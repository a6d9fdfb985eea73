/* The communication layer (include/longmoe/comm.h, docs/scaleout.md).
 *
 * Alone (`test_comm`): the one-rank engine and the argument checks.
 * Under mpirun (`mpirun -np N test_comm --mpi N`, ctest's test_comm_mpi2 and
 * test_comm_mpi4): every collective of the MPI engine against a serial
 * reference computed on every rank from the same random data, bit for bit,
 * with variable counts including zeros. Built without MPI, `--mpi N` reports
 * every case skipped. */
#include <omp.h>
#include <stdint.h>
#include <time.h>

#include "longmoe/comm.h"
#include "test.h"
#include "test_comm_data.h"

static lm_comm *comm;

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}
static int R = 1, me = 0;

/* 1 when `bytes` at buf hold the same bits on every rank (gathered and compared). */
static int same_on_every_rank(const void *buf, size_t bytes) {
    if (!bytes) return 1;
    unsigned char *all = malloc(bytes * (size_t)R);
    int ok = lm_comm_all_gather(comm, buf, all, bytes) == LM_OK;
    for (int p = 1; p < R && ok; p++) ok = !memcmp(all, all + (size_t)p * bytes, bytes);
    free(all);
    return ok;
}

/* ---- MPI cases ---- */

static void test_mpi_job_has_the_ranks_mpirun_started(void) {
    CHECK(lm_comm_engine_of(comm) == LM_COMM_MPI, "engine %s", lm_comm_engine_name(lm_comm_engine_of(comm)));
    CHECK(me >= 0 && me < R, "rank %d of %d", me, R);
    int32_t one = 1, n = 0;
    CHECK(lm_comm_all_reduce_sum(comm, &one, &n, 1, LM_DTYPE_I32) == LM_OK, "%s", lm_last_error());
    CHECK(n == R, "sum of ones %d, size %d", n, R);
}

static void test_all_reduce_equals_the_serial_sum_in_rank_order_bit_for_bit(void) {
    int trial = 0;
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        for (int c = 0; c < 6; c++, trial++) {
            size_t n = sum_counts[c];
            unsigned char *x = malloc(n * es + 1), *y = malloc(n * es + 1), *ref = malloc(n * es + 1);
            fill(x, n, dt, me, trial);
            serial_sum(ref, n, dt, R, trial, 0);
            CHECK(lm_comm_all_reduce_sum(comm, x, y, n, dt) == LM_OK, "%s", lm_last_error());
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu: differs from the serial rank-order sum", lm_dtype_name(dt), n);
            CHECK(same_on_every_rank(y, n * es), "%s n=%zu: ranks disagree", lm_dtype_name(dt), n);
            /* in place gives the same bits */
            CHECK(lm_comm_all_reduce_sum(comm, x, x, n, dt) == LM_OK, "%s", lm_last_error());
            CHECK(!memcmp(x, ref, n * es), "%s n=%zu: in place differs", lm_dtype_name(dt), n);
            free(x);
            free(y);
            free(ref);
        }
    }
}

/* Sums large enough that each owner's share is added by several threads (comm.c
 * splits the elements of a share over the OpenMP team above 2^16 elements):
 * still the serial rank-order sum, bit for bit, with 3 threads (an uneven
 * split) as with 1. */
static void test_threaded_sums_equal_the_serial_sum(void) {
    const int threads0 = omp_get_max_threads();
    const size_t n = ((size_t)1 << 16) * (size_t)R + 12345;
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        unsigned char *x = malloc(n * es), *y = malloc(n * es), *ref = malloc(n * es);
        fill(x, n, dt, me, 900 + t);
        serial_sum(ref, n, dt, R, 900 + t, 0);
        for (int th = 1; th <= 3; th += 2) {
            omp_set_num_threads(th);
            memset(y, 0, n * es);
            CHECK(lm_comm_all_reduce_sum(comm, x, y, n, dt) == LM_OK, "%s", lm_last_error());
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu on %d threads: differs from the serial rank-order sum",
                  lm_dtype_name(dt), n, th);
        }
        free(x);
        free(y);
        free(ref);
    }
    omp_set_num_threads(threads0);
}

static void test_all_reduce_does_not_depend_on_timing(void) {
    /* the same sum twice, the second time with ranks arriving in a different,
     * rank-dependent order: identical bits */
    const size_t n = 3001;
    float *x = malloc(n * sizeof *x), *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    fill_f32(x, n, me, 77);
    CHECK(lm_comm_all_reduce_sum(comm, x, a, n, LM_DTYPE_F32) == LM_OK, "%s", lm_last_error());
    sleep_ms((R - 1 - me) * 20);
    CHECK(lm_comm_all_reduce_sum(comm, x, b, n, LM_DTYPE_F32) == LM_OK, "%s", lm_last_error());
    CHECK(!memcmp(a, b, n * sizeof *a), "a repeated sum changed its bits");
    /* the order matters for these values (with 3 or more terms; two commute):
     * the reverse rank order rounds differently somewhere */
    float *rev = malloc(n * sizeof *rev), *xp = malloc(n * sizeof *xp);
    for (int p = R - 1; p >= 0; p--) {
        fill_f32(xp, n, p, 77);
        for (size_t i = 0; i < n; i++) rev[i] = p == R - 1 ? xp[i] : rev[i] + xp[i];
    }
    if (R >= 3) CHECK(memcmp(rev, a, n * sizeof *a) != 0, "the test data does not exercise summation order");
    free(x);
    free(a);
    free(b);
    free(rev);
    free(xp);
}

static void test_reduce_scatter_gives_each_rank_its_block_of_the_serial_sum(void) {
    int trial = 100;
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        for (int c = 0; c < 6; c++, trial++) {
            size_t n = sum_counts[c];
            unsigned char *x = malloc((size_t)R * n * es + 1), *y = malloc(n * es + 1), *ref = malloc(n * es + 1);
            fill(x, (size_t)R * n, dt, me, trial);
            serial_sum(ref, n, dt, R, trial, (size_t)me * n);
            CHECK(lm_comm_reduce_scatter_sum(comm, x, y, n, dt) == LM_OK, "%s", lm_last_error());
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu: block %d differs from the serial sum", lm_dtype_name(dt), n, me);
            free(x);
            free(y);
            free(ref);
        }
    }
}

/* Variable blocks (zeros among them): rank r's block is the serial rank-order
 * sum of every rank's elements at the block's place, the bits an all-reduce of
 * the whole buffer gives them. */
static void test_reduce_scatterv_gives_each_rank_its_variable_block_of_the_serial_sum(void) {
    int trial = 200;
    size_t *counts = malloc((size_t)R * sizeof *counts);
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        for (int layout = 0; layout < 3; layout++, trial++) {
            size_t total = 0, before = 0;
            for (int q = 0; q < R; q++) {
                /* uneven; layout 1 leaves rank 0 nothing, layout 2 gives everything to the last rank */
                counts[q] = layout == 0 ? (size_t)(37 * q + 5) : layout == 1 ? (size_t)(q ? 1000 + q : 0)
                          : (size_t)(q == R - 1 ? 4097 : 0);
                if (q < me) before += counts[q];
                total += counts[q];
            }
            size_t m = counts[me];
            unsigned char *x = malloc(total * es + 1), *y = malloc(m * es + 1), *ref = malloc(m * es + 1),
                          *whole = malloc(total * es + 1);
            fill(x, total, dt, me, trial);
            serial_sum(ref, m, dt, R, trial, before);
            CHECK(lm_comm_reduce_scatterv_sum(comm, x, m ? y : NULL, counts, dt) == LM_OK, "%s", lm_last_error());
            CHECK(!memcmp(y, ref, m * es), "%s layout %d: block %d differs from the serial sum", lm_dtype_name(dt),
                  layout, me);
            CHECK(lm_comm_all_reduce_sum(comm, x, whole, total, dt) == LM_OK, "%s", lm_last_error());
            CHECK(!memcmp(y, whole + before * es, m * es), "%s layout %d: differs from the all-reduce",
                  lm_dtype_name(dt), layout);
            free(x);
            free(y);
            free(ref);
            free(whole);
        }
    }
    free(counts);
}

/* A split handle holds the ranks of one color in their order, and its
 * collectives reach those ranks only; a negative color gets none. */
static void test_split_makes_a_handle_of_the_ranks_of_one_color(void) {
    lm_comm *part = NULL;
    int color = me == R - 1 ? -1 : me % 2; /* the last rank stays out */
    CHECK(lm_comm_split(comm, color, &part) == LM_OK, "%s", lm_last_error());
    CHECK((color < 0) == (part == NULL), "rank %d color %d: handle %p", me, color, (void *)part);
    if (part) {
        int size = 0, rank = 0;
        for (int q = 0; q < R - 1; q++) {
            size += q % 2 == color;
            rank += q % 2 == color && q < me;
        }
        CHECK(lm_comm_size(part) == size && lm_comm_rank(part) == rank, "rank %d: %d of %d, expected %d of %d", me,
              lm_comm_rank(part), lm_comm_size(part), rank, size);
        int32_t mine = me + 1, sum = 0, want = 0;
        for (int q = 0; q < R - 1; q++) want += q % 2 == color ? q + 1 : 0;
        CHECK(lm_comm_all_reduce_sum(part, &mine, &sum, 1, LM_DTYPE_I32) == LM_OK && sum == want,
              "rank %d: sum %d over its part, expected %d", me, sum, want);
        lm_comm_close(part);
    }
    CHECK(lm_comm_barrier(comm) == LM_OK, "%s", lm_last_error());
}

static void test_all_gather_places_every_rank_in_rank_order(void) {
    const size_t bytes = 777;
    unsigned char *mine = malloc(bytes), *all = malloc(bytes * (size_t)R), *want = malloc(bytes);
    fill_bytes(mine, bytes, me, 0, 5);
    CHECK(lm_comm_all_gather(comm, mine, all, bytes) == LM_OK, "%s", lm_last_error());
    for (int p = 0; p < R; p++) {
        fill_bytes(want, bytes, p, 0, 5);
        CHECK(!memcmp(all + (size_t)p * bytes, want, bytes), "rank %d's part is wrong", p);
    }
    free(mine);
    free(all);
    free(want);
}

static void test_all_gatherv_with_variable_sizes_including_zero(void) {
    /* rank p sends (p * 37) % 101 bytes, rank 1 none; parts laid out in reverse
     * rank order with gaps, to prove offsets are honoured */
    size_t *rb = calloc((size_t)R, sizeof *rb), *ro = calloc((size_t)R, sizeof *ro);
    size_t total = 0;
    for (int p = R - 1; p >= 0; p--) {
        rb[p] = p == 1 ? 0 : (size_t)(p * 37 + 5) % 101;
        ro[p] = total + 3;
        total += rb[p] + 3;
    }
    unsigned char *mine = malloc(rb[me] + 1), *all = malloc(total), *want = malloc(128);
    memset(all, 0xAB, total);
    fill_bytes(mine, rb[me], me, 1, 6);
    CHECK(lm_comm_all_gatherv(comm, mine, rb[me], all, rb, ro) == LM_OK, "%s", lm_last_error());
    for (int p = 0; p < R; p++) {
        fill_bytes(want, rb[p], p, 1, 6);
        CHECK(!memcmp(all + ro[p], want, rb[p]), "rank %d's part is wrong", p);
        CHECK(all[ro[p] - 1] == 0xAB && all[ro[p] - 2] == 0xAB, "the gap before rank %d's part was written", p);
    }
    free(rb);
    free(ro);
    free(mine);
    free(all);
    free(want);
}

static void test_all_to_allv_delivers_variable_counts_including_zeros(void) {
    size_t *sb = calloc((size_t)R, sizeof *sb), *so = calloc((size_t)R, sizeof *so);
    size_t *rb = calloc((size_t)R, sizeof *rb), *ro = calloc((size_t)R, sizeof *ro);
    int64_t *sc = calloc((size_t)R, sizeof *sc), *rc = calloc((size_t)R, sizeof *rc);
    for (int trial = 0; trial < 4; trial++) {
        size_t ns = 0, nr = 0;
        /* send blocks in reverse peer order; receive blocks in order, one byte apart */
        for (int q = R - 1; q >= 0; q--) {
            sb[q] = a2a_count(me, q, trial);
            sc[q] = (int64_t)sb[q];
            so[q] = ns;
            ns += sb[q];
        }
        CHECK(lm_comm_exchange_counts(comm, sc, rc) == LM_OK, "%s", lm_last_error());
        for (int p = 0; p < R; p++) {
            CHECK(rc[p] == (int64_t)a2a_count(p, me, trial), "count from rank %d: %lld", p, (long long)rc[p]);
            rb[p] = (size_t)rc[p];
            ro[p] = nr;
            nr += rb[p] + 1;
        }
        unsigned char *send = malloc(ns + 1), *recv = malloc(nr + 1), *want = malloc(3001);
        for (int q = 0; q < R; q++) fill_bytes(send + so[q], sb[q], me, q, trial);
        memset(recv, 0xCD, nr + 1);
        CHECK(lm_comm_all_to_allv(comm, send, sb, so, recv, rb, ro) == LM_OK, "%s", lm_last_error());
        for (int p = 0; p < R; p++) {
            fill_bytes(want, rb[p], p, me, trial);
            CHECK(!memcmp(recv + ro[p], want, rb[p]), "trial %d: bytes from rank %d are wrong", trial, p);
            CHECK(recv[ro[p] + rb[p]] == 0xCD, "trial %d: written past rank %d's block", trial, p);
        }
        free(send);
        free(recv);
        free(want);
    }
    free(sb);
    free(so);
    free(rb);
    free(ro);
    free(sc);
    free(rc);
}

static void test_broadcast_copies_the_root_buffer_from_every_root(void) {
    const size_t bytes = 1234;
    unsigned char *buf = malloc(bytes), *want = malloc(bytes);
    for (int root = 0; root < R; root++) {
        fill_bytes(buf, bytes, me, 9, root); /* every rank starts with different bytes */
        fill_bytes(want, bytes, root, 9, root);
        CHECK(lm_comm_broadcast(comm, buf, bytes, root) == LM_OK, "%s", lm_last_error());
        CHECK(!memcmp(buf, want, bytes), "root %d: not the root's bytes", root);
    }
    free(buf);
    free(want);
}

static void test_barrier_returns_on_every_rank(void) {
    sleep_ms(me * 10);
    CHECK(lm_comm_barrier(comm) == LM_OK, "%s", lm_last_error());
    CHECK(lm_comm_barrier(comm) == LM_OK, "%s", lm_last_error());
}

/* ---- one rank, no MPI ---- */

static void test_self_engine_collectives_are_copies(void) {
    lm_comm *c = NULL;
    CHECK(lm_comm_open(LM_COMM_SELF, &c) == LM_OK && c, "%s", lm_last_error());
    if (!c) return;
    CHECK(lm_comm_rank(c) == 0 && lm_comm_size(c) == 1, "rank %d size %d", lm_comm_rank(c), lm_comm_size(c));
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t n = 513, es = lm_dtype_size(dt);
        unsigned char *x = malloc(n * es), *y = malloc(n * es);
        fill(x, n, dt, 0, 40 + t);
        CHECK(lm_comm_all_reduce_sum(c, x, y, n, dt) == LM_OK && !memcmp(x, y, n * es), "all_reduce %s", lm_dtype_name(dt));
        memset(y, 0, n * es);
        CHECK(lm_comm_reduce_scatter_sum(c, x, y, n, dt) == LM_OK && !memcmp(x, y, n * es), "reduce_scatter %s",
              lm_dtype_name(dt));
        free(x);
        free(y);
    }
    unsigned char a[100], b[120];
    fill_bytes(a, sizeof a, 0, 0, 41);
    memset(b, 0, sizeof b);
    CHECK(lm_comm_all_gather(c, a, b, sizeof a) == LM_OK && !memcmp(a, b, sizeof a), "all_gather");
    size_t cnt = 60, off = 10, zero = 0;
    memset(b, 0, sizeof b);
    CHECK(lm_comm_all_gatherv(c, a, cnt, b, &cnt, &off) == LM_OK && !memcmp(b + 10, a, cnt) && b[9] == 0 && b[70] == 0,
          "all_gatherv");
    size_t so = 7, ro = 20;
    memset(b, 0, sizeof b);
    CHECK(lm_comm_all_to_allv(c, a, &cnt, &so, b, &cnt, &ro) == LM_OK && !memcmp(b + 20, a + 7, cnt), "all_to_allv");
    CHECK(lm_comm_all_to_allv(c, a, &zero, &so, b, &zero, &ro) == LM_OK, "all_to_allv of nothing");
    int64_t sc = 12345, rc = 0;
    CHECK(lm_comm_exchange_counts(c, &sc, &rc) == LM_OK && rc == 12345, "exchange_counts");
    CHECK(lm_comm_broadcast(c, a, sizeof a, 0) == LM_OK, "broadcast");
    CHECK(lm_comm_barrier(c) == LM_OK, "barrier");
    CHECK(lm_comm_reserve(c, 1000, LM_DTYPE_F32) == LM_OK, "reserve");
    float v[5] = {1, 2, 3, 4, 5}, w[5] = {0};
    size_t five = 5;
    CHECK(lm_comm_reduce_scatterv_sum(c, v, w, &five, LM_DTYPE_F32) == LM_OK && !memcmp(v, w, sizeof v),
          "reduce_scatterv");
    float u[5] = {0};
    CHECK(lm_comm_copy(c, u, v, sizeof v) == LM_OK && !memcmp(u, v, sizeof v), "copy");
    lm_comm *part = NULL;
    CHECK(lm_comm_split(c, 3, &part) == LM_OK && part && lm_comm_size(part) == 1 && lm_comm_rank(part) == 0,
          "split: %s", lm_last_error());
    lm_comm_close(part);
    CHECK(lm_comm_split(c, -1, &part) == LM_OK && !part, "split with a negative color gave a handle");
    lm_comm_close(c);
}

static void test_bad_arguments_are_rejected_with_a_message(void) {
    lm_comm *c = NULL;
    CHECK(lm_comm_open(LM_COMM_SELF, &c) == LM_OK, "%s", lm_last_error());
    if (!c) return;
    float x[4] = {1, 2, 3, 4}, y[4];
    CHECK(lm_comm_all_reduce_sum(c, x, y, 4, LM_DTYPE_BF16) == LM_ERR_ARG && strstr(lm_last_error(), "dtype"),
          "bf16 sum: %s", lm_last_error());
    CHECK(lm_comm_all_reduce_sum(c, NULL, y, 4, LM_DTYPE_F32) == LM_ERR_ARG && strstr(lm_last_error(), "send"),
          "NULL send: %s", lm_last_error());
    CHECK(lm_comm_reduce_scatter_sum(c, x, x + 1, 2, LM_DTYPE_F32) == LM_ERR_ARG && strstr(lm_last_error(), "overlap"),
          "overlap: %s", lm_last_error());
    CHECK(lm_comm_broadcast(c, x, 4, 1) == LM_ERR_ARG && strstr(lm_last_error(), "root"), "root: %s", lm_last_error());
    CHECK(lm_comm_copy(c, x + 1, x, 3 * sizeof(float)) == LM_ERR_ARG && strstr(lm_last_error(), "overlap"),
          "copy overlap: %s", lm_last_error());
    CHECK(lm_comm_copy(c, NULL, x, 4) == LM_ERR_ARG && strstr(lm_last_error(), "dst"), "copy to NULL: %s",
          lm_last_error());
    size_t n3 = 3, n4 = 4, o = 0;
    CHECK(lm_comm_all_gatherv(c, x, 4, y, &n3, &o) == LM_ERR_ARG, "gatherv size mismatch");
    CHECK(lm_comm_all_to_allv(c, x, &n3, &o, y, &n4, &o) == LM_ERR_ARG, "all_to_allv count mismatch");
    CHECK(lm_comm_all_reduce_sum(NULL, x, y, 4, LM_DTYPE_F32) == LM_ERR_ARG, "NULL comm");
    lm_comm_close(c);
    lm_comm *n = NULL;
    if (!lm_comm_engine_available(LM_COMM_NCCL)) {
        CHECK(lm_comm_open(LM_COMM_NCCL, &n) == LM_ERR_ARG && !n && strstr(lm_last_error(), "nccl") &&
                  strstr(lm_last_error(), "NCCL"),
              "nccl: %s", lm_last_error());
    } else if (lm_comm_open(LM_COMM_NCCL, &n) == LM_OK) {
        lm_comm_close(n); /* a GPU is here: tests/test_cuda_comm.c tests the engine */
    } else {
        CHECK(!n && strstr(lm_last_error(), "nccl"), "nccl without a GPU: %s", lm_last_error());
    }
    if (!lm_comm_engine_available(LM_COMM_MPI))
        CHECK(lm_comm_open(LM_COMM_MPI, &n) == LM_ERR_ARG && strstr(lm_last_error(), "MPI"), "mpi: %s",
              lm_last_error());
}

int main(int argc, char **argv) {
    int want_ranks = 0;
    if (argc == 3 && !strcmp(argv[1], "--mpi")) want_ranks = atoi(argv[2]);
    if (!want_ranks) {
        RUN(test_self_engine_collectives_are_copies);
        RUN(test_bad_arguments_are_rejected_with_a_message);
        return test_summary();
    }
    if (!lm_comm_engine_available(LM_COMM_MPI)) test_skip_all("built without MPI (the MPI engine is not compiled)");
    else if (lm_comm_open(LM_COMM_MPI, &comm)) {
        fprintf(stderr, "cannot open MPI: %s\n", lm_last_error());
        return 1;
    } else {
        R = lm_comm_size(comm);
        me = lm_comm_rank(comm);
        if (me) freopen("/dev/null", "w", stdout); /* one rank prints the cases; every rank prints failures */
        if (R != want_ranks) {
            fprintf(stderr, "started on %d ranks, expected %d\n", R, want_ranks);
            lm_comm_close(comm);
            return 1;
        }
    }
    RUN(test_mpi_job_has_the_ranks_mpirun_started);
    RUN(test_all_reduce_equals_the_serial_sum_in_rank_order_bit_for_bit);
    RUN(test_all_reduce_does_not_depend_on_timing);
    RUN(test_threaded_sums_equal_the_serial_sum);
    RUN(test_reduce_scatter_gives_each_rank_its_block_of_the_serial_sum);
    RUN(test_reduce_scatterv_gives_each_rank_its_variable_block_of_the_serial_sum);
    RUN(test_split_makes_a_handle_of_the_ranks_of_one_color);
    RUN(test_all_gather_places_every_rank_in_rank_order);
    RUN(test_all_gatherv_with_variable_sizes_including_zero);
    RUN(test_all_to_allv_delivers_variable_counts_including_zeros);
    RUN(test_broadcast_copies_the_root_buffer_from_every_root);
    RUN(test_barrier_returns_on_every_rank);
    if (comm) {
        /* a failure on any rank fails the job's summary */
        int32_t failed = test_failed_count, total = 0;
        if (lm_comm_all_reduce_sum(comm, &failed, &total, 1, LM_DTYPE_I32) == LM_OK) test_failed_count = total;
        lm_comm_close(comm);
    }
    return test_summary();
}
