/* The NCCL engine of the communication layer (include/longmoe/comm.h,
 * docs/scaleout.md) on device buffers: test_comm.c's cases, with every buffer
 * in GPU memory and every call ordered on a stream of the test's.
 *
 * Alone (`test_cuda_comm`, ctest label cuda): one GPU, a one-rank NCCL
 * communicator; the rank-order summing kernel is also run directly on 1 to 8
 * rows, so its bits are checked against the serial loop on one GPU too.
 * Under mpirun with N GPUs (`mpirun -np N test_cuda_comm --ranks N`): every
 * collective against a serial reference computed on every rank from the same
 * random data, bit for bit, with variable counts including zeros.
 * With --staged (`test_cuda_comm --staged`, `mpirun -np N test_cuda_comm
 * --staged --ranks N`; ctest's test_cuda_comm_staged and _staged_mpi2): the
 * same cases on the staged engine (lm_comm_open_staged: the device buffers
 * copied through host memory, over MPI or one rank's self handle) on the CUDA
 * backend; the processes may share one GPU, so 2 ranks run on a one-GPU
 * machine, which NCCL refuses.
 * Without a GPU, or built without NCCL (and not --staged), every case reports
 * "skip". */
#include <stdint.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "longmoe/backend.h"
#include "longmoe/comm.h"
#include "test.h"
#include "test_comm_data.h"
#include "test_cuda.h"

#include "cuda/cuda_check.h"
#include "comm/comm_internal.h"        /* the handle's scratch, for the growth case */
#include "cuda/comm/rank_order_sum.h" /* the summing kernel, run directly */

static lm_comm *comm;
static int R = 1, me = 0;
static lm_comm *staged_host;  /* --staged: the host handle under comm */
static lm_backend *staged_be; /* --staged: the CUDA backend whose copies it makes */
static cudaStream_t stream;

#define OK(call) CHECK((call) == LM_OK, "%s: %s", #call, lm_last_error())

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- device buffers ---- */

/* a new device buffer holding the n bytes at h */
static void *dev_from(const void *h, size_t n) {
    void *d = dev_alloc(n);
    if (n && lm_cuda_upload(d, h, n)) dieAt("upload of %zu bytes: %s", n, lm_last_error());
    return d;
}
/* copy n bytes at device d to h (waits for every stream of the device) */
static void to_host(void *h, const void *d, size_t n) {
    if (n && lm_cuda_download(h, d, n)) dieAt("download of %zu bytes: %s", n, lm_last_error());
}
static void to_dev(void *d, const void *h, size_t n) {
    if (n && lm_cuda_upload(d, h, n)) dieAt("upload of %zu bytes: %s", n, lm_last_error());
}

/* 1 when the `bytes` at device buf hold the same bits on every rank. */
static int same_on_every_rank(const void *buf, size_t bytes) {
    if (!bytes) return 1;
    unsigned char *all = dev_alloc(bytes * (size_t)R), *h = mallocCheck(bytes * (size_t)R);
    int ok = lm_comm_all_gather(comm, buf, all, bytes) == LM_OK;
    to_host(h, all, bytes * (size_t)R);
    for (int p = 1; p < R && ok; p++) ok = !memcmp(h, h + (size_t)p * bytes, bytes);
    lm_cuda_free(all);
    free(h);
    return ok;
}

/* ---- cheap data for the large cases (hashes, one a word) ---- */

static void fill_large_bytes(unsigned char *x, size_t n, uint64_t seed) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = lm_mix64(seed ^ (i >> 3));
        memcpy(x + i, &w, 8);
    }
    uint64_t w = lm_mix64(seed ^ (i >> 3));
    for (; i < n; i++) x[i] = (unsigned char)(w >> (8 * (i & 7)));
}
/* values in (-1, 1) times 2^-12 .. 2^12, as fill_f32's */
static void fill_large_f32(float *x, size_t n, int p) {
    const uint64_t seed = stream_seed(p, 1000, 11);
    for (size_t i = 0; i < n; i++) {
        uint64_t h = lm_mix64(seed ^ i);
        x[i] = (float)ldexp((double)(h >> 11) * 0x1p-52 - 1.0, (int)(h % 25) - 12);
    }
}

/* ---- cases ---- */

static void test_nccl_job_has_the_ranks_mpirun_started(void) {
    const lm_comm_engine want = staged_host ? LM_COMM_STAGED : LM_COMM_NCCL;
    CHECK(lm_comm_engine_of(comm) == want, "engine %s", lm_comm_engine_name(lm_comm_engine_of(comm)));
    CHECK(me >= 0 && me < R, "rank %d of %d", me, R);
    int32_t one = 1, n = 0;
    int32_t *d = dev_from(&one, sizeof one);
    OK(lm_comm_all_reduce_sum(comm, d, d, 1, LM_DTYPE_I32));
    to_host(&n, d, sizeof n);
    CHECK(n == R, "sum of ones %d, size %d", n, R);
    int dev = -1, ndev = 0;
    cudaGetDevice(&dev);
    cudaGetDeviceCount(&ndev);
    CHECK(dev >= 0 && dev < ndev, "device %d of %d", dev, ndev);
    lm_cuda_free(d);
}

static void test_all_reduce_equals_the_serial_sum_in_rank_order_bit_for_bit(void) {
    int trial = 0;
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        for (int c = 0; c < 6; c++, trial++) {
            size_t n = sum_counts[c];
            unsigned char *x = mallocCheck(n * es + 1), *y = mallocCheck(n * es + 1), *ref = mallocCheck(n * es + 1);
            fill(x, n, dt, me, trial);
            serial_sum(ref, n, dt, R, trial, 0);
            void *dx = dev_from(x, n * es), *dy = dev_alloc(n * es);
            OK(lm_comm_all_reduce_sum(comm, dx, dy, n, dt));
            to_host(y, dy, n * es);
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu: differs from the serial rank-order sum", lm_dtype_name(dt), n);
            CHECK(same_on_every_rank(dy, n * es), "%s n=%zu: ranks disagree", lm_dtype_name(dt), n);
            /* in place gives the same bits */
            OK(lm_comm_all_reduce_sum(comm, dx, dx, n, dt));
            to_host(y, dx, n * es);
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu: in place differs", lm_dtype_name(dt), n);
            lm_cuda_free(dx);
            lm_cuda_free(dy);
            free(x);
            free(y);
            free(ref);
        }
    }
}

static void test_all_reduce_does_not_depend_on_timing(void) {
    const size_t n = 3001;
    float *x = mallocCheck(n * sizeof *x), *a = mallocCheck(n * sizeof *a), *b = mallocCheck(n * sizeof *b);
    fill_f32(x, n, me, 77);
    float *dx = dev_from(x, n * sizeof *x), *da = dev_alloc(n * sizeof *x), *db = dev_alloc(n * sizeof *x);
    OK(lm_comm_all_reduce_sum(comm, dx, da, n, LM_DTYPE_F32));
    to_host(a, da, n * sizeof *a);
    sleep_ms((R - 1 - me) * 20);
    OK(lm_comm_all_reduce_sum(comm, dx, db, n, LM_DTYPE_F32));
    to_host(b, db, n * sizeof *b);
    CHECK(!memcmp(a, b, n * sizeof *a), "a repeated sum changed its bits");
    /* with 3 or more ranks the reverse rank order rounds differently somewhere */
    float *rev = mallocCheck(n * sizeof *rev), *xp = mallocCheck(n * sizeof *xp);
    for (int p = R - 1; p >= 0; p--) {
        fill_f32(xp, n, p, 77);
        for (size_t i = 0; i < n; i++) rev[i] = p == R - 1 ? xp[i] : rev[i] + xp[i];
    }
    if (R >= 3) CHECK(memcmp(rev, a, n * sizeof *a) != 0, "the test data does not exercise summation order");
    lm_cuda_free(dx);
    lm_cuda_free(da);
    lm_cuda_free(db);
    free(x);
    free(a);
    free(b);
    free(rev);
    free(xp);
}

static void test_rank_order_kernel_equals_the_serial_loop_for_1_to_8_rows(void) {
    /* the owner's step alone, on this GPU, for row counts a one-rank job never
     * reaches; F32 rows also get subnormal values (a flush to zero would change them) */
    const int row_counts[5] = {1, 2, 3, 5, 8};
    const size_t lengths[3] = {1, 1000, 70001};
    int trial = 300, order_matters = 0, subnormal_results = 0;
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        const size_t es = lm_dtype_size(dt);
        for (int ri = 0; ri < 5; ri++) {
            for (int li = 0; li < 3; li++, trial++) {
                const int rows_n = row_counts[ri];
                const size_t m = lengths[li];
                unsigned char *rows = mallocCheck((size_t)rows_n * m * es), *ref = mallocCheck(m * es),
                              *got = mallocCheck(m * es);
                for (int p = 0; p < rows_n; p++) {
                    void *row = rows + (size_t)p * m * es;
                    fill(row, m, dt, p, trial);
                    if (dt == LM_DTYPE_F32) /* every 7th element of every row tiny: subnormal sums */
                        for (size_t i = 0; i < m; i += 7) ((float *)row)[i] *= 0x1p-130f;
                }
                /* the reference: the serial loop over the rows as they are */
                memcpy(ref, rows, m * es);
                for (int p = 1; p < rows_n; p++)
                    for (size_t i = 0; i < m; i++) {
                        const unsigned char *row = rows + (size_t)p * m * es;
                        if (dt == LM_DTYPE_F32) ((float *)ref)[i] += ((const float *)row)[i];
                        else if (dt == LM_DTYPE_F64) ((double *)ref)[i] += ((const double *)row)[i];
                        else ((uint32_t *)ref)[i] += ((const uint32_t *)row)[i];
                    }
                void *drows = dev_from(rows, (size_t)rows_n * m * es), *dacc = dev_alloc(m * es);
                OK(lm_cuda_rank_order_sum(dacc, drows, m, rows_n, dt, stream));
                to_host(got, dacc, m * es);
                CHECK(!memcmp(got, ref, m * es), "%s, %d rows of %zu: differs from the serial loop", lm_dtype_name(dt),
                      rows_n, m);
                if (dt == LM_DTYPE_F32 && rows_n >= 2) {
                    for (size_t i = 0; i < m; i++) {
                        float v = ((float *)ref)[i];
                        subnormal_results += v != 0 && fabsf(v) < 0x1p-126f;
                    }
                }
                if (dt == LM_DTYPE_F32 && rows_n >= 3) {
                    /* the reverse order would have rounded differently */
                    float *rev = mallocCheck(m * sizeof *rev);
                    memcpy(rev, rows + (size_t)(rows_n - 1) * m * es, m * es);
                    for (int p = rows_n - 2; p >= 0; p--)
                        for (size_t i = 0; i < m; i++) rev[i] += ((const float *)(rows + (size_t)p * m * es))[i];
                    order_matters += memcmp(rev, ref, m * es) != 0;
                    free(rev);
                }
                lm_cuda_free(drows);
                lm_cuda_free(dacc);
                free(rows);
                free(ref);
                free(got);
            }
        }
    }
    CHECK(order_matters > 0, "the data does not exercise the summation order");
    CHECK(subnormal_results > 0, "no subnormal sums: the flush-to-zero check is empty");
    CHECK(lm_cuda_rank_order_sum(NULL, NULL, 4, 2, LM_DTYPE_F32, stream) == LM_ERR_ARG, "a NULL buffer is refused");
    void *d = dev_alloc(64);
    CHECK(lm_cuda_rank_order_sum(d, (char *)d + 32, 4, 2, LM_DTYPE_BF16, stream) == LM_ERR_ARG &&
              strstr(lm_last_error(), "dtype"),
          "bf16: %s", lm_last_error());
    lm_cuda_free(d);
}

static void test_reduce_scatter_gives_each_rank_its_block_of_the_serial_sum(void) {
    int trial = 100;
    for (int t = 0; t < 3; t++) {
        lm_dtype dt = sum_types[t];
        size_t es = lm_dtype_size(dt);
        for (int c = 0; c < 6; c++, trial++) {
            size_t n = sum_counts[c];
            unsigned char *x = mallocCheck((size_t)R * n * es + 1), *y = mallocCheck(n * es + 1),
                          *ref = mallocCheck(n * es + 1);
            fill(x, (size_t)R * n, dt, me, trial);
            serial_sum(ref, n, dt, R, trial, (size_t)me * n);
            void *dx = dev_from(x, (size_t)R * n * es), *dy = dev_alloc(n * es);
            OK(lm_comm_reduce_scatter_sum(comm, dx, dy, n, dt));
            to_host(y, dy, n * es);
            CHECK(!memcmp(y, ref, n * es), "%s n=%zu: block %d differs from the serial sum", lm_dtype_name(dt), n, me);
            lm_cuda_free(dx);
            lm_cuda_free(dy);
            free(x);
            free(y);
            free(ref);
        }
    }
}

static void test_all_gather_places_every_rank_in_rank_order(void) {
    const size_t bytes = 777;
    unsigned char *mine = mallocCheck(bytes), *all = mallocCheck(bytes * (size_t)R), *want = mallocCheck(bytes);
    fill_bytes(mine, bytes, me, 0, 5);
    void *dmine = dev_from(mine, bytes), *dall = dev_alloc(bytes * (size_t)R);
    OK(lm_comm_all_gather(comm, dmine, dall, bytes));
    to_host(all, dall, bytes * (size_t)R);
    for (int p = 0; p < R; p++) {
        fill_bytes(want, bytes, p, 0, 5);
        CHECK(!memcmp(all + (size_t)p * bytes, want, bytes), "rank %d's part is wrong", p);
    }
    /* in place: this rank's part already at its place */
    memset(all, 0, bytes * (size_t)R);
    memcpy(all + (size_t)me * bytes, mine, bytes);
    to_dev(dall, all, bytes * (size_t)R);
    OK(lm_comm_all_gather(comm, (unsigned char *)dall + (size_t)me * bytes, dall, bytes));
    to_host(all, dall, bytes * (size_t)R);
    for (int p = 0; p < R; p++) {
        fill_bytes(want, bytes, p, 0, 5);
        CHECK(!memcmp(all + (size_t)p * bytes, want, bytes), "in place: rank %d's part is wrong", p);
    }
    lm_cuda_free(dmine);
    lm_cuda_free(dall);
    free(mine);
    free(all);
    free(want);
}

static void test_all_gatherv_with_variable_sizes_including_zero(void) {
    /* rank p sends (p * 37 + 5) % 101 bytes, rank 1 none (on one rank: rank 0's
     * 5); parts in reverse rank order with gaps, to prove offsets are honoured */
    size_t *rb = calloc((size_t)R, sizeof *rb), *ro = calloc((size_t)R, sizeof *ro);
    size_t total = 0;
    for (int p = R - 1; p >= 0; p--) {
        rb[p] = p == 1 ? 0 : (size_t)(p * 37 + 5) % 101;
        ro[p] = total + 3;
        total += rb[p] + 3;
    }
    unsigned char *mine = mallocCheck(rb[me] + 1), *all = mallocCheck(total), *want = mallocCheck(128);
    memset(all, 0xAB, total);
    fill_bytes(mine, rb[me], me, 1, 6);
    void *dmine = dev_from(mine, rb[me]), *dall = dev_from(all, total);
    OK(lm_comm_all_gatherv(comm, dmine, rb[me], dall, rb, ro));
    to_host(all, dall, total);
    for (int p = 0; p < R; p++) {
        fill_bytes(want, rb[p], p, 1, 6);
        CHECK(!memcmp(all + ro[p], want, rb[p]), "rank %d's part is wrong", p);
        CHECK(all[ro[p] - 1] == 0xAB && all[ro[p] - 2] == 0xAB, "the gap before rank %d's part was written", p);
    }
    lm_cuda_free(dmine);
    lm_cuda_free(dall);
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
    int zero_seen = 0;
    for (int trial = 0; trial < 6; trial++) {
        size_t ns = 0, nr = 0;
        /* send blocks in reverse peer order; receive blocks in order, one byte apart */
        for (int q = R - 1; q >= 0; q--) {
            sb[q] = a2a_count(me, q, trial);
            sc[q] = (int64_t)sb[q];
            so[q] = ns;
            ns += sb[q];
        }
        /* the counts are host arrays: they size the host tables of the exchange */
        OK(lm_comm_exchange_counts(comm, sc, rc));
        for (int p = 0; p < R; p++) {
            CHECK(rc[p] == (int64_t)a2a_count(p, me, trial), "count from rank %d: %lld", p, (long long)rc[p]);
            rb[p] = (size_t)rc[p];
            ro[p] = nr;
            nr += rb[p] + 1;
            for (int q = 0; q < R; q++) zero_seen += a2a_count(p, q, trial) == 0; /* any pair of the job */
        }
        unsigned char *send = mallocCheck(ns + 1), *recv = mallocCheck(nr + 1), *want = mallocCheck(3001);
        for (int q = 0; q < R; q++) fill_bytes(send + so[q], sb[q], me, q, trial);
        memset(recv, 0xCD, nr + 1);
        void *dsend = dev_from(send, ns + 1), *drecv = dev_from(recv, nr + 1);
        OK(lm_comm_all_to_allv(comm, dsend, sb, so, drecv, rb, ro));
        to_host(recv, drecv, nr + 1);
        for (int p = 0; p < R; p++) {
            fill_bytes(want, rb[p], p, me, trial);
            CHECK(!memcmp(recv + ro[p], want, rb[p]), "trial %d: bytes from rank %d are wrong", trial, p);
            CHECK(recv[ro[p] + rb[p]] == 0xCD, "trial %d: written past rank %d's block", trial, p);
        }
        lm_cuda_free(dsend);
        lm_cuda_free(drecv);
        free(send);
        free(recv);
        free(want);
    }
    CHECK(zero_seen > 0, "no zero count in the trials: the case lost its coverage");
    free(sb);
    free(so);
    free(rb);
    free(ro);
    free(sc);
    free(rc);
}

static void test_broadcast_copies_the_root_buffer_from_every_root(void) {
    const size_t bytes = 1234;
    unsigned char *buf = mallocCheck(bytes), *want = mallocCheck(bytes);
    void *d = dev_alloc(bytes);
    for (int root = 0; root < R; root++) {
        fill_bytes(buf, bytes, me, 9, root); /* every rank starts with different bytes */
        fill_bytes(want, bytes, root, 9, root);
        to_dev(d, buf, bytes);
        OK(lm_comm_broadcast(comm, d, bytes, root));
        to_host(buf, d, bytes);
        CHECK(!memcmp(buf, want, bytes), "root %d: not the root's bytes", root);
    }
    lm_cuda_free(d);
    free(buf);
    free(want);
}

static void test_barrier_returns_on_every_rank(void) {
    sleep_ms(me * 10);
    OK(lm_comm_barrier(comm));
    OK(lm_comm_barrier(comm));
}

/* A split of the device handle (NCCL: ncclCommSplit beside the host handle's
 * split; staged: the host handle's split) holds the ranks of one color in
 * their order, its host handle the same ranks, and its sum is the rank-order
 * sum over those ranks only; a negative color gets no handle. */
static void test_split_sums_over_the_ranks_of_one_color(void) {
    const int color = R > 1 ? me % 2 : 0;
    lm_comm *part = NULL;
    OK(lm_comm_split(comm, color, &part));
    if (!part) return;
    const int Rp = R > 1 ? (R - color + 1) / 2 : 1;
    CHECK(lm_comm_size(part) == Rp && lm_comm_rank(part) == (R > 1 ? me / 2 : 0), "rank %d of %d in the part",
          lm_comm_rank(part), lm_comm_size(part));
    CHECK(lm_comm_size(lm_comm_host(part)) == Rp && lm_comm_rank(lm_comm_host(part)) == lm_comm_rank(part),
          "the part's host handle has rank %d of %d", lm_comm_rank(lm_comm_host(part)),
          lm_comm_size(lm_comm_host(part)));
    lm_comm_set_stream(part, stream);
    const size_t n = 1000;
    float *h = mallocCheck(n * 4), *want = mallocCheck(n * 4);
    for (size_t i = 0; i < n; i++) h[i] = (float)(me + 1) * 0.37f + (float)i * 1e-3f;
    for (size_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (int q = color, k = 0; q < R; q += R > 1 ? 2 : 1, k++) {
            const float v = (float)(q + 1) * 0.37f + (float)i * 1e-3f;
            acc = k ? acc + v : v;
        }
        want[i] = acc;
    }
    float *d = dev_from(h, n * 4);
    OK(lm_comm_all_reduce_sum(part, d, d, n, LM_DTYPE_F32));
    OK(lm_comm_barrier(part));
    to_host(h, d, n * 4);
    CHECK(!memcmp(h, want, n * 4), "the part's sum is not the rank-order sum over its ranks");
    lm_cuda_free(d);
    free(h);
    free(want);
    lm_comm_close(part);
    lm_comm *none = NULL;
    OK(lm_comm_split(comm, -1, &none));
    CHECK(!none, "a negative color gave a handle");
}

static void test_scratch_grows_on_need_and_is_reused_after(void) {
    /* lm_comm_reserve sizes the device scratch once; sums no larger reuse it
     * (no allocation in a step); a larger sum grows it and still sums right.
     * One rank needs none: a sum is a copy. */
    const size_t n = 5000;
    OK(lm_comm_reserve(comm, n, LM_DTYPE_F64));
    const unsigned char *scratch = comm->scratch;
    const size_t bytes = comm->scratch_bytes;
    if (R == 1) CHECK(scratch == NULL && bytes == 0, "one rank allocated %zu bytes of scratch", bytes);
    else CHECK(scratch != NULL && bytes >= (size_t)(n / R + 1) * (R + 1) * 8, "reserved %zu bytes", bytes);
    size_t sizes[3] = {n, 4000, 1};
    lm_dtype types[3] = {LM_DTYPE_F64, LM_DTYPE_F32, LM_DTYPE_I32};
    for (int k = 0; k < 3; k++) {
        size_t es = lm_dtype_size(types[k]);
        unsigned char *x = mallocCheck(sizes[k] * es), *ref = mallocCheck(sizes[k] * es), *y = mallocCheck(sizes[k] * es);
        fill(x, sizes[k], types[k], me, 500 + k);
        serial_sum(ref, sizes[k], types[k], R, 500 + k, 0);
        void *d = dev_from(x, sizes[k] * es);
        OK(lm_comm_all_reduce_sum(comm, d, d, sizes[k], types[k]));
        to_host(y, d, sizes[k] * es);
        CHECK(!memcmp(y, ref, sizes[k] * es), "%s n=%zu differs", lm_dtype_name(types[k]), sizes[k]);
        CHECK(comm->scratch == scratch && comm->scratch_bytes == bytes, "a reserved size reallocated the scratch");
        lm_cuda_free(d);
        free(x);
        free(ref);
        free(y);
    }
    /* larger than reserved: grows (several ranks), and the sum is still the serial one */
    const size_t big = 4 * n * (size_t)R;
    double *x = mallocCheck(big * sizeof *x), *ref = mallocCheck(big * sizeof *ref), *y = mallocCheck(big * sizeof *y);
    fill_f64(x, big, me, 510);
    serial_sum(ref, big, LM_DTYPE_F64, R, 510, 0);
    double *d = dev_from(x, big * sizeof *x);
    OK(lm_comm_all_reduce_sum(comm, d, d, big, LM_DTYPE_F64));
    to_host(y, d, big * sizeof *y);
    CHECK(!memcmp(y, ref, big * sizeof *y), "the sum after growing differs");
    if (R > 1) CHECK(comm->scratch_bytes > bytes, "scratch %zu bytes did not grow past %zu", comm->scratch_bytes, bytes);
    lm_cuda_free(d);
    free(x);
    free(ref);
    free(y);
}

static void test_large_counts_sum_and_move_bit_for_bit(void) {
    /* a 512 MiB sum, and blocks past 2^31 bytes (size_t counts and offsets) */
    const size_t n = ((size_t)1 << 27) + 5;
    float *x = mallocCheck(n * sizeof *x), *ref = mallocCheck(n * sizeof *ref);
    for (int p = 0; p < R; p++) {
        fill_large_f32(x, n, p);
        if (!p) memcpy(ref, x, n * sizeof *x);
        else
            for (size_t i = 0; i < n; i++) ref[i] += x[i];
    }
    fill_large_f32(x, n, me);
    float *d = dev_from(x, n * sizeof *x);
    OK(lm_comm_all_reduce_sum(comm, d, d, n, LM_DTYPE_F32));
    to_host(x, d, n * sizeof *x);
    CHECK(!memcmp(x, ref, n * sizeof *x), "the 512 MiB sum differs from the serial loop");
    lm_cuda_free(d);
    free(x);
    free(ref);

    /* rank r sends L > 2^31 bytes to rank r+1 (itself on one rank), at an offset past 2^31 */
    const size_t L = ((size_t)1 << 31) + 11, off = ((size_t)1 << 31) + 3;
    const int to = (me + 1) % R, from = (me + R - 1) % R;
    unsigned char *h = mallocCheck(L), *want = mallocCheck(L);
    fill_large_bytes(h, L, stream_seed(me, 2000, 12));
    fill_large_bytes(want, L, stream_seed(from, 2000, 12));
    unsigned char *dsend = dev_alloc(off + L), *drecv = dev_alloc(off + L);
    to_dev(dsend + off, h, L);
    size_t *sb = calloc((size_t)R, sizeof *sb), *so = calloc((size_t)R, sizeof *so);
    size_t *rb = calloc((size_t)R, sizeof *rb), *ro = calloc((size_t)R, sizeof *ro);
    sb[to] = L;
    so[to] = off;
    rb[from] = L;
    ro[from] = off;
    OK(lm_comm_all_to_allv(comm, dsend, sb, so, drecv, rb, ro));
    to_host(h, drecv + off, L);
    CHECK(!memcmp(h, want, L), "the %zu-byte block from rank %d differs", L, from);
    /* the same size broadcast from the last rank */
    fill_large_bytes(want, L, stream_seed(R - 1, 2001, 12));
    if (me == R - 1) to_dev(drecv, want, L);
    OK(lm_comm_broadcast(comm, drecv, L, R - 1));
    to_host(h, drecv, L);
    CHECK(!memcmp(h, want, L), "the %zu-byte broadcast differs", L);
    lm_cuda_free(dsend);
    lm_cuda_free(drecv);
    free(h);
    free(want);
    free(sb);
    free(so);
    free(rb);
    free(ro);
}

static void test_bad_arguments_are_rejected_with_a_message(void) {
    float *d = dev_alloc(4 * sizeof(float));
    CHECK(lm_comm_all_reduce_sum(comm, d, d, 4, LM_DTYPE_BF16) == LM_ERR_ARG && strstr(lm_last_error(), "dtype"),
          "bf16 sum: %s", lm_last_error());
    CHECK(lm_comm_reduce_scatter_sum(comm, d, d + 1, 2, LM_DTYPE_F32) == LM_ERR_ARG &&
              strstr(lm_last_error(), "overlap"),
          "overlap: %s", lm_last_error());
    CHECK(lm_comm_broadcast(comm, d, 4, R) == LM_ERR_ARG && strstr(lm_last_error(), "root"), "root: %s",
          lm_last_error());
    CHECK(lm_comm_exchange_counts(comm, (int64_t *)d, (int64_t *)d) == LM_ERR_ARG, "one array for both counts");
    lm_cuda_free(d);
}

/* --staged: the host handle (MPI under --ranks N, else one rank's self), the
 * CUDA backend on this process's GPU, the staged handle over both */
static int open_staged(int want_ranks) {
    if (want_ranks && !lm_comm_engine_available(LM_COMM_MPI)) {
        fprintf(stderr, "--staged --ranks %d needs the MPI engine, which this build lacks\n", want_ranks);
        return 1;
    }
    int local = 0;
    if (lm_comm_open(want_ranks ? LM_COMM_MPI : LM_COMM_SELF, &staged_host) ||
        lm_comm_local_rank(staged_host, &local) || lm_backend_cuda_create_local(local, &staged_be) ||
        lm_comm_open_staged(staged_host, staged_be, &comm)) {
        fprintf(stderr, "cannot open the staged engine: %s\n", lm_last_error());
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    int want_ranks = 0, staged = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--ranks") && i + 1 < argc) want_ranks = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--staged")) staged = 1;
        else {
            fprintf(stderr, "usage: test_cuda_comm [--staged] [--ranks N]\n");
            return 2;
        }
    }
    test_skip_without_cuda();
    if (!test_skip_all_reason && !staged && !lm_comm_engine_available(LM_COMM_NCCL))
        test_skip_all("built without NCCL (the NCCL engine is not compiled)");
    if (!test_skip_all_reason) {
        if (staged) {
            if (open_staged(want_ranks)) return 1;
        } else if (lm_comm_open(LM_COMM_NCCL, &comm)) {
            fprintf(stderr, "cannot open NCCL: %s\n", lm_last_error());
            return 1;
        }
        R = lm_comm_size(comm);
        me = lm_comm_rank(comm);
        if (me) freopen("/dev/null", "w", stdout); /* one rank prints the cases; every rank prints failures */
        if (want_ranks && R != want_ranks) {
            fprintf(stderr, "started on %d ranks, expected %d\n", R, want_ranks);
            lm_comm_close(comm);
            return 1;
        }
        cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        lm_comm_set_stream(comm, stream);
    } else {
        fprintf(stderr, "test_cuda_comm: %s: every case skips\n", test_skip_all_reason);
    }
    RUN(test_nccl_job_has_the_ranks_mpirun_started);
    RUN(test_all_reduce_equals_the_serial_sum_in_rank_order_bit_for_bit);
    RUN(test_all_reduce_does_not_depend_on_timing);
    RUN(test_rank_order_kernel_equals_the_serial_loop_for_1_to_8_rows);
    RUN(test_reduce_scatter_gives_each_rank_its_block_of_the_serial_sum);
    RUN(test_all_gather_places_every_rank_in_rank_order);
    RUN(test_all_gatherv_with_variable_sizes_including_zero);
    RUN(test_all_to_allv_delivers_variable_counts_including_zeros);
    RUN(test_broadcast_copies_the_root_buffer_from_every_root);
    RUN(test_barrier_returns_on_every_rank);
    RUN(test_split_sums_over_the_ranks_of_one_color);
    RUN(test_scratch_grows_on_need_and_is_reused_after);
    RUN(test_large_counts_sum_and_move_bit_for_bit);
    RUN(test_bad_arguments_are_rejected_with_a_message);
    if (comm) {
        /* a failure on any rank fails the job's summary */
        int32_t failed = test_failed_count;
        int32_t *d = dev_from(&failed, sizeof failed);
        if (lm_comm_all_reduce_sum(comm, d, d, 1, LM_DTYPE_I32) == LM_OK) to_host(&failed, d, sizeof failed);
        test_failed_count = failed;
        lm_cuda_free(d);
        lm_comm_close(comm);
        lm_backend_free(staged_be);
        lm_comm_close(staged_host);
        cudaStreamDestroy(stream);
    }
    return test_summary();
}
