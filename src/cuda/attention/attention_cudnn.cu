// The cuDNN kinds of the causal attention (include/longmoe/attention_cuda.h;
// docs/cuda.md, "Attention on the GPU"): cuDNN's fused flash attention through
// the header-only cudnn-frontend graph API.
//
// Layouts: our tensors are row-major [B,S,H,D] ("BSHD"); the graph speaks of
// dims (B,H,S,D), so each tensor is described with the strides
// (S*H*D, D, H*D, 1) and passed as is (no copies). lse [B,H,T] is cuDNN's
// "Stats" [B,H,T,1] (natural log of the scaled scores' sum of exponentials).
//
// Forward, three plans by what the caller wants besides o:
//   o only              generate_stats off;
//   o + lse             Stats written straight into lse;
//   o (+ lse) + max     cuDNN's Stats output cannot be asked together with its
//                       Max output (the frontend allows Stats alone or
//                       Max + Sum_exp), so the plan writes Max and Sum_exp rows
//                       and a small kernel forms lse = Max + log(Sum_exp) and
//                       the per-head maximum of Max (an exact maximum through
//                       integer atomics: order-free, deterministic).
// Backward: set_deterministic_algorithm(true) (bit-identical runs; on Hopper
// cuDNN keeps a dP buffer of about B*H*T*Tk*2 bytes in its workspace), or,
// for LM_ATTENTION_CUDNN_FAST, cuDNN's default non-deterministic algorithm.
// The causal mask is top-left aligned without an offset and bottom-right
// aligned with one (query i sees keys j <= i + Tk - T).
//
// Plans are built on the first call of a shape and kept in a small table
// (CACHE_SLOTS, least recently used out) keyed by device, shape, scale and
// plan; a shape cuDNN refuses is remembered too. Execution passes the pointers
// in the plan's sorted uid order (no allocation per call). The forward's
// Max/Sum_exp rows and cuDNN's forward workspace live in a per-(device,
// stream) scratch buffer grown to the largest shape seen.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

#include "attention_common.cuh"
#include "attention_cudnn.h"
#include "cuda/cuda_check.h"

namespace fe = cudnn_frontend;

namespace lmcudnn {
namespace {

constexpr int MAX_DEVICES = 64;
constexpr int CACHE_SLOTS = 24;
constexpr int SCRATCH_SLOTS = 16;
constexpr int MAX_UIDS = 16;

enum Uid : int64_t {
    U_Q = 1, U_K, U_V, U_O, U_STATS, U_MAX, U_SUM, U_DO, U_DQ, U_DK, U_DV
};

// plan kinds of the cache (the forward's FwdMode values first)
enum Plan { PLAN_FWD_O = 0, PLAN_FWD_STATS = 1, PLAN_FWD_MAX_SUM = 2, PLAN_BWD_DET = 3, PLAN_BWD_FAST = 4 };

struct Key {
    int device, plan;
    int B, T, Tk, H, Hkv, Dk, Dv;
    // rows of the tensors q, o, d_o (qrows) and k, v (krows) that the T
    // queries and Tk keys are a window of (the batch strides); T and Tk but
    // in the blocked backward. The statistics (lse, max, sum_exp) are always
    // packed [B,H,T]. nomask: no causal mask (a key block that every query
    // of the block sees)
    int qrows, krows, nomask;
    uint32_t scale_bits;
    bool operator==(const Key &o) const { return memcmp(this, &o, sizeof *this) == 0; }
};

struct Entry {
    bool used = false;
    Key key;
    bool ok = false;
    std::string why;                   // when !ok: cuDNN's reason
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
    int n_uids = 0;
    int64_t uids[MAX_UIDS];            // the plan's user tensors in execution order
    uint64_t last_use = 0;
};

struct Scratch {
    int device = -1;
    cudaStream_t stream = nullptr;
    void *ptr = nullptr;
    size_t bytes = 0;
};

std::mutex g_mu;
cudnnHandle_t g_handle[MAX_DEVICES];
Entry g_cache[CACHE_SLOTS];
uint64_t g_clock = 0;
Scratch g_scratch[SCRATCH_SLOTS];

size_t round256(size_t x) { return (x + 255) & ~(size_t)255; }

lm_status current_device(int *device) {
    cudaError_t e = cudaGetDevice(device);
    if (e != cudaSuccess)
        return lm_error(LM_ERR_IO, "attention (cudnn): cudaGetDevice: %s", cudaGetErrorString(e));
    if (*device < 0 || *device >= MAX_DEVICES)
        return lm_error(LM_ERR_ARG, "attention (cudnn): device %d beyond %d", *device, MAX_DEVICES);
    return LM_OK;
}

// the device's handle (g_mu held)
lm_status handle_of(int device, cudnnHandle_t *h) {
    if (!g_handle[device]) {
        cudnnStatus_t s = cudnnCreate(&g_handle[device]);
        if (s != CUDNN_STATUS_SUCCESS) {
            g_handle[device] = nullptr;
            return lm_error(LM_ERR_IO, "attention (cudnn): cudnnCreate: %s", cudnnGetErrorString(s));
        }
    }
    *h = g_handle[device];
    return LM_OK;
}

// dims (B,H,S,D) of a row-major [B,S,H,D] tensor, and its strides
std::vector<int64_t> dims4(int64_t b, int64_t h, int64_t s, int64_t d) { return {b, h, s, d}; }
std::vector<int64_t> bshd(int64_t h, int64_t s, int64_t d) { return {s * h * d, d, h * d, 1}; }
// a [B,H,T] fp32 row tensor as (B,H,T,1)
std::vector<int64_t> rows_stride(int64_t h, int64_t t) { return {h * t, t, 1, 1}; }

std::shared_ptr<fe::graph::Graph> new_graph() {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
}

// s rows of a tensor of `total` rows a sequence
std::shared_ptr<fe::graph::Tensor_attributes> input(const std::shared_ptr<fe::graph::Graph> &g, const char *name,
                                                    int64_t uid, int64_t b, int64_t h, int64_t s, int64_t d,
                                                    int64_t total) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim(dims4(b, h, s, d))
                         .set_stride(bshd(h, total, d)));
}

std::shared_ptr<fe::graph::Tensor_attributes> rows(const std::shared_ptr<fe::graph::Graph> &g, const char *name,
                                                   int64_t uid, const Key &k) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({k.B, k.H, k.T, 1})
                         .set_stride(rows_stride(k.H, k.T))
                         .set_data_type(fe::DataType_t::FLOAT));
}

template <class Attr>
void causal(Attr &a, const Key &k) {
    if (k.nomask) return;
    a.set_diagonal_alignment(k.Tk == k.T ? fe::DiagonalAlignment_t::TOP_LEFT : fe::DiagonalAlignment_t::BOTTOM_RIGHT)
        .set_diagonal_band_right_bound(0);
}

float scale_of(const Key &k) {
    float s;
    memcpy(&s, &k.scale_bits, sizeof s);
    return s;
}

// The graph of a key (tensors, the SDPA node, the outputs), not yet built.
// sm_version > 0 names the target instead of asking the current device.
std::shared_ptr<fe::graph::Graph> describe(const Key &k, int sm_version = 0) {
    auto g = new_graph();
    if (sm_version > 0) g->set_sm_version(sm_version);
    auto Q = input(g, "q", U_Q, k.B, k.H, k.T, k.Dk, k.qrows);
    auto K = input(g, "k", U_K, k.B, k.Hkv, k.Tk, k.Dk, k.krows);
    auto V = input(g, "v", U_V, k.B, k.Hkv, k.Tk, k.Dv, k.krows);
    if (k.plan <= PLAN_FWD_MAX_SUM) {
        auto a = fe::graph::SDPA_attributes()
                     .set_name("attention")
                     .set_attn_scale(scale_of(k))
                     .set_generate_stats(k.plan == PLAN_FWD_STATS);
        causal(a, k);
        if (k.plan == PLAN_FWD_MAX_SUM) {
            a.set_logit_max(rows(g, "max", U_MAX, k));
            a.set_score_sum_exp(rows(g, "sum_exp", U_SUM, k));
        }
        auto out = g->sdpa(Q, K, V, std::move(a));
        out[0]->set_output(true).set_dim(dims4(k.B, k.H, k.T, k.Dv)).set_stride(bshd(k.H, k.T, k.Dv)).set_uid(U_O);
        if (k.plan == PLAN_FWD_STATS)
            out[1]->set_output(true)
                .set_data_type(fe::DataType_t::FLOAT)
                .set_dim({k.B, k.H, k.T, 1})
                .set_stride(rows_stride(k.H, k.T))
                .set_uid(U_STATS);
    } else {
        auto O = input(g, "o", U_O, k.B, k.H, k.T, k.Dv, k.qrows);
        auto dO = input(g, "d_o", U_DO, k.B, k.H, k.T, k.Dv, k.qrows);
        auto Stats = rows(g, "lse", U_STATS, k);
        auto a = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_attn_scale(scale_of(k))
                     .set_deterministic_algorithm(k.plan == PLAN_BWD_DET);
        causal(a, k);
        auto out = g->sdpa_backward(Q, K, V, O, dO, Stats, std::move(a));
        out[0]->set_output(true).set_dim(dims4(k.B, k.H, k.T, k.Dk)).set_stride(bshd(k.H, k.T, k.Dk)).set_uid(U_DQ);
        out[1]->set_output(true)
            .set_dim(dims4(k.B, k.Hkv, k.Tk, k.Dk))
            .set_stride(bshd(k.Hkv, k.Tk, k.Dk))
            .set_uid(U_DK);
        out[2]->set_output(true)
            .set_dim(dims4(k.B, k.Hkv, k.Tk, k.Dv))
            .set_stride(bshd(k.Hkv, k.Tk, k.Dv))
            .set_uid(U_DV);
    }
    return g;
}

// Check and build the plan of e.key (g_mu held).
void build(Entry &e, cudnnHandle_t h) {
    auto g = describe(e.key);
    fe::error_t st = g->build(h, {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    int64_t ws = 0;
    if (st.is_good()) st = g->get_workspace_size(ws);
    if (!st.is_good()) {
        e.ok = false;
        e.why = st.get_message();
        if (e.why.empty()) e.why = "cuDNN has no plan for this shape";
        return;
    }
    std::vector<int64_t> uids = g->get_variant_pack_uids_sorted();
    if (uids.size() > (size_t)MAX_UIDS) {
        e.ok = false;
        e.why = "the plan has more tensors than expected";
        return;
    }
    e.n_uids = (int)uids.size();
    for (size_t i = 0; i < uids.size(); i++) e.uids[i] = uids[i];
    e.graph = std::move(g);
    e.workspace = ws;
    e.ok = true;
}

// The cached entry of `key`, built on a miss (g_mu held).
Entry &lookup(const Key &key, cudnnHandle_t h) {
    for (Entry &e : g_cache)
        if (e.used && e.key == key) {
            e.last_use = ++g_clock;
            return e;
        }
    Entry *victim = nullptr;
    for (Entry &e : g_cache)
        if (!e.used) {
            victim = &e;
            break;
        }
    if (!victim) {
        victim = &g_cache[0];
        for (Entry &e : g_cache)
            if (e.last_use < victim->last_use) victim = &e;
        // the evicted plan may still run on some stream: let it finish first
        (void)cudaDeviceSynchronize();
    }
    *victim = Entry();
    victim->used = true;
    victim->key = key;
    victim->last_use = ++g_clock;
    build(*victim, h);
    return *victim;
}

Key make_key(int device, int plan, const Shape &s) {
    Key k;
    memset(&k, 0, sizeof k);  // padding too: keys compare with memcmp
    k.device = device;
    k.plan = plan;
    k.B = s.B;
    k.T = s.T;
    k.Tk = s.Tk;
    k.H = s.H;
    k.Hkv = s.Hkv;
    k.Dk = s.Dk;
    k.Dv = s.Dv;
    k.qrows = s.T;
    k.krows = s.Tk;
    k.nomask = 0;
    memcpy(&k.scale_bits, &s.scale, sizeof k.scale_bits);
    return k;
}

const char *plan_name(int plan) {
    switch (plan) {
    case PLAN_FWD_O: return "forward";
    case PLAN_FWD_STATS: return "forward with lse";
    case PLAN_FWD_MAX_SUM: return "forward with max and sum_exp";
    case PLAN_BWD_DET: return "deterministic backward";
    default: return "backward";
    }
}

// The built entry for `key`, or an error with cuDNN's reason (g_mu held).
lm_status get_plan_key(const Key &key, cudnnHandle_t *h, Entry **out) {
    lm_status st = handle_of(key.device, h);
    if (st) return st;
    Entry &e = lookup(key, *h);
    if (!e.ok)
        return lm_error(LM_ERR_ARG, "attention (cudnn): no %s plan for B=%d T=%d (keys %d) H=%d Hkv=%d Dk=%d Dv=%d%s: %s",
                        plan_name(key.plan), key.B, key.T, key.Tk, key.H, key.Hkv, key.Dk, key.Dv,
                        key.nomask ? " (no mask)" : "", e.why.c_str());
    *out = &e;
    return LM_OK;
}

// The built entry for (device, plan, s) (g_mu held).
lm_status get_plan(int device, int plan, const Shape &s, cudnnHandle_t *h, Entry **out) {
    return get_plan_key(make_key(device, plan, s), h, out);
}

lm_status run(const Entry &e, cudnnHandle_t h, cudaStream_t stream, void *const *by_uid, void *workspace) {
    void *ptrs[MAX_UIDS];
    for (int i = 0; i < e.n_uids; i++) {
        const int64_t u = e.uids[i];
        if (u < 1 || u > U_DV || !by_uid[u])
            return lm_error(LM_ERR_ARG, "attention (cudnn): the plan wants tensor uid %lld, which this call lacks",
                            (long long)u);
        ptrs[i] = by_uid[u];
    }
    cudnnStatus_t cs = cudnnSetStream(h, stream);
    if (cs != CUDNN_STATUS_SUCCESS)
        return lm_error(LM_ERR_IO, "attention (cudnn): cudnnSetStream: %s", cudnnGetErrorString(cs));
    fe::error_t st = e.graph->execute(h, ptrs, e.n_uids, workspace);
    if (!st.is_good())
        return lm_error(LM_ERR_IO, "attention (cudnn): execute: %s", st.get_message().c_str());
    return LM_OK;
}

// The forward scratch of (device, stream), at least `bytes` (g_mu held).
lm_status scratch_of(int device, cudaStream_t stream, size_t bytes, void **out) {
    Scratch *slot = nullptr;
    for (Scratch &s : g_scratch)
        if (s.device == device && s.stream == stream) slot = &s;
    if (!slot)
        for (Scratch &s : g_scratch)
            if (s.device < 0 && !slot) slot = &s;
    if (!slot)
        return lm_error(LM_ERR_MEMORY, "attention (cudnn): more than %d streams use the cuDNN forward", SCRATCH_SLOTS);
    if (slot->bytes < bytes) {
        if (slot->ptr) {
            // cudaFree waits for the device: the stream's earlier work that used it has finished
            cudaError_t e = cudaFree(slot->ptr);
            slot->ptr = nullptr;
            slot->bytes = 0;
            if (e != cudaSuccess)
                return lm_error(LM_ERR_IO, "attention (cudnn): cudaFree: %s", cudaGetErrorString(e));
        }
        cudaError_t e = cudaMalloc(&slot->ptr, bytes);
        if (e != cudaSuccess) {
            slot->ptr = nullptr;
            (void)cudaGetLastError();
            return lm_error(LM_ERR_MEMORY, "attention (cudnn): forward scratch of %zu bytes: %s", bytes,
                            cudaGetErrorString(e));
        }
        slot->bytes = bytes;
    }
    slot->device = device;
    slot->stream = stream;
    *out = slot->ptr;
    return LM_OK;
}

__global__ void fill_kernel(float *x, int n, float value) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}

// Row (b,h) = blockIdx.x, rows t of blockIdx.y: lse = max + log(sum_exp)
// (when lse is not NULL; may alias mx) and head_max[h] = max over the rows.
__global__ void max_sum_kernel(const float *mx, const float *sum, float *lse, float *head_max, int H, int T) {
    __shared__ float s_max[32];
    const int bh = blockIdx.x, h = bh % H;
    const int t = blockIdx.y * blockDim.x + threadIdx.x;
    float m = -INFINITY;
    if (t < T) {
        const size_t i = (size_t)bh * T + t;
        m = mx[i];
        if (lse) lse[i] = m + logf(sum[i]);
    }
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, w));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) s_max[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float bm = s_max[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) bm = fmaxf(bm, s_max[w]);
        if (bm > -INFINITY) lmattn::atomic_max_float(head_max + h, bm);
    }
}

}  // namespace

lm_status forward_prepare(int device, const Shape &s, FwdMode mode) {
    std::lock_guard<std::mutex> lock(g_mu);
    cudnnHandle_t h = nullptr;
    Entry *e = nullptr;
    return get_plan(device, (int)mode, s, &h, &e);
}

lm_status forward(const lm_cuda_context *ctx, const Shape &s, const uint16_t *q, const uint16_t *k,
                  const uint16_t *v, uint16_t *o, float *lse, float *head_max) {
    int device;
    lm_status st = current_device(&device);
    if (st) return st;
    const FwdMode mode = fwd_mode(lse, head_max);
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    std::lock_guard<std::mutex> lock(g_mu);
    cudnnHandle_t h = nullptr;
    Entry *e = nullptr;
    if ((st = get_plan(device, (int)mode, s, &h, &e))) return st;

    const size_t nrows = (size_t)s.B * s.H * s.T;
    const size_t row_bytes = round256(nrows * sizeof(float));
    // scratch: [sum_exp rows][max rows unless they go to lse][cuDNN workspace]
    size_t need = (size_t)e->workspace;
    if (mode == FWD_MAX_SUM) need += row_bytes * (lse ? 1 : 2);
    void *scratch = nullptr;
    if (need > 0 && (st = scratch_of(device, stream, need, &scratch))) return st;
    char *p = static_cast<char *>(scratch);
    float *sum = nullptr, *mx = nullptr;
    if (mode == FWD_MAX_SUM) {
        sum = reinterpret_cast<float *>(p);
        p += row_bytes;
        if (lse) {
            mx = lse;
        } else {
            mx = reinterpret_cast<float *>(p);
            p += row_bytes;
        }
    }
    void *workspace = e->workspace > 0 ? (void *)p : nullptr;

    void *by_uid[U_DV + 1] = {nullptr};
    by_uid[U_Q] = const_cast<uint16_t *>(q);
    by_uid[U_K] = const_cast<uint16_t *>(k);
    by_uid[U_V] = const_cast<uint16_t *>(v);
    by_uid[U_O] = o;
    by_uid[U_STATS] = lse;
    by_uid[U_MAX] = mx;
    by_uid[U_SUM] = sum;
    if ((st = run(*e, h, stream, by_uid, workspace))) return st;
    if (mode == FWD_MAX_SUM) {
        fill_kernel<<<(s.H + 255) / 256, 256, 0, stream>>>(head_max, s.H, -INFINITY);
        LM_CUDA_TRY(cudaGetLastError());
        const int threads = 256;
        dim3 grid((unsigned)(s.B * s.H), (unsigned)((s.T + threads - 1) / threads));
        max_sum_kernel<<<grid, threads, 0, stream>>>(mx, sum, lse, head_max, s.H, s.T);
        LM_CUDA_TRY(cudaGetLastError());
    }
    return LM_OK;
}

lm_status backward_prepare(int device, const Shape &s, bool deterministic, size_t *workspace_bytes) {
    std::lock_guard<std::mutex> lock(g_mu);
    cudnnHandle_t h = nullptr;
    Entry *e = nullptr;
    lm_status st = get_plan(device, deterministic ? PLAN_BWD_DET : PLAN_BWD_FAST, s, &h, &e);
    if (st) return st;
    *workspace_bytes = round256((size_t)e->workspace);
    return LM_OK;
}

lm_status backward(const lm_cuda_context *ctx, const Shape &s, bool deterministic, const uint16_t *q,
                   const uint16_t *k, const uint16_t *v, const uint16_t *o, const uint16_t *d_o,
                   const float *lse, uint16_t *dq, uint16_t *dk, uint16_t *dv, void *workspace,
                   size_t workspace_bytes) {
    int device;
    lm_status st = current_device(&device);
    if (st) return st;
    std::lock_guard<std::mutex> lock(g_mu);
    cudnnHandle_t h = nullptr;
    Entry *e = nullptr;
    if ((st = get_plan(device, deterministic ? PLAN_BWD_DET : PLAN_BWD_FAST, s, &h, &e))) return st;
    if (workspace_bytes < (size_t)e->workspace || (e->workspace > 0 && !workspace))
        return lm_error(LM_ERR_ARG, "attention backward (cudnn): workspace of %zu bytes, need %lld",
                        workspace_bytes, (long long)e->workspace);
    void *by_uid[U_DV + 1] = {nullptr};
    by_uid[U_Q] = const_cast<uint16_t *>(q);
    by_uid[U_K] = const_cast<uint16_t *>(k);
    by_uid[U_V] = const_cast<uint16_t *>(v);
    by_uid[U_O] = const_cast<uint16_t *>(o);
    by_uid[U_DO] = const_cast<uint16_t *>(d_o);
    by_uid[U_STATS] = const_cast<float *>(lse);
    by_uid[U_DQ] = dq;
    by_uid[U_DK] = dk;
    by_uid[U_DV] = dv;
    return run(*e, h, (cudaStream_t)ctx->stream, by_uid, e->workspace > 0 ? workspace : nullptr);
}

// ---- the blocked deterministic backward ----
//
// cuDNN's deterministic backward keeps a dP buffer of B*H*T*Tk*2 bytes: 16 GiB
// at one row of 32K, far more for the query segments of a long row. The
// backward is a sum over key blocks (each key block's dk, dv need only its
// rows; dq is the sum of every block's part: the softmax statistics lse and
// D_i = rowsum(dO * O) are the whole row's), so it runs as cuDNN calls on
// blocks of at most L queries and L keys, each with a dP buffer of B*H*L*L*2
// bytes:
//   keys before the queries (q_offset > 0): blocks of L, seen whole by every
//     query block (no mask);
//   keys at the queries' positions: block n is query block n's own keys,
//     causal top-left, and seen whole by every later query block.
// Key block by key block (in order), its dk, dv add up in fp32 over the query
// blocks (in order) and are then written in bf16; dq adds up in fp32 over
// the key blocks and is written at the end: every sum has a fixed order, so
// the result is bit-identical from run to run. Each piece's rows of lse are
// copied into a packed [B,H,tq] buffer first (cuDNN before 9.26 refuses a
// strided statistics tensor). The extra rounding: each
// block's dq, dk, dv part passes through bf16 (cuDNN's output) before the
// fp32 sums.

namespace {

__global__ void add_rows_kernel(float *acc, size_t acc_bstride, const uint16_t *x, size_t x_bstride, size_t n) {
    const size_t b = blockIdx.y;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc[b * acc_bstride + i] += __uint_as_float((uint32_t)x[b * x_bstride + i] << 16);
}

__global__ void store_rows_kernel(uint16_t *out, size_t out_bstride, const float *acc, size_t acc_bstride, size_t n) {
    const size_t b = blockIdx.y;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float f = acc[b * acc_bstride + i];
        uint32_t u = __float_as_uint(f);
        // round to nearest even (a NaN stays a NaN)
        uint16_t r = (f != f) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        out[b * out_bstride + i] = r;
    }
}

unsigned blocks_for(size_t n) {
    size_t g = (n + 255) / 256;
    return (unsigned)(g > 4096 ? 4096 : g < 1 ? 1 : g);
}

// One cuDNN call of the blocked backward: queries [i0, i0+tq) (of the T), keys
// [j0, j0+tk) (of the Tk), causal top-left (tq == tk) or no mask.
struct Piece {
    int i0, tq, j0, tk, nomask;
};

// Every piece, key block by key block, each key block's query blocks in order.
template <class F>
lm_status for_each_piece(const Shape &s, int L, F fn) {
    const int qoff = s.Tk - s.T;
    lm_status st;
    for (int j0 = 0; j0 < qoff; j0 += L) {  // keys before the queries
        const int tk = qoff - j0 < L ? qoff - j0 : L;
        for (int i0 = 0; i0 < s.T; i0 += L)
            if ((st = fn(Piece{i0, s.T - i0 < L ? s.T - i0 : L, j0, tk, 1}, i0 + L >= s.T))) return st;
    }
    for (int n0 = 0; n0 < s.T; n0 += L) {  // keys at the queries' positions
        const int tk = s.T - n0 < L ? s.T - n0 : L;
        for (int i0 = n0; i0 < s.T; i0 += L)
            if ((st = fn(Piece{i0, s.T - i0 < L ? s.T - i0 : L, qoff + n0, tk, i0 != n0}, i0 + L >= s.T))) return st;
    }
    return LM_OK;
}

Key piece_key(int device, const Shape &s, const Piece &p) {
    Shape w = s;
    w.T = p.tq;
    w.Tk = p.tk;
    Key k = make_key(device, PLAN_BWD_DET, w);
    k.qrows = s.T; /* the statistics are copied packed per piece (backward_blocked): their head stride is p.tq */
    /* the key rows only set k's and v's batch stride: with one row the pieces of every prefix
     * length share their plans (sequence segments: the prefix grows from segment to segment) */
    k.krows = s.B > 1 ? s.Tk : p.tk;
    k.nomask = p.nomask;
    return k;
}

struct BlockedLayout {
    size_t acc_dq, acc_dk, acc_dv, p_dq, p_dk, p_dv, stats, cudnn, total;
};

BlockedLayout blocked_layout(const Shape &s, int L, size_t cudnn_ws) {
    BlockedLayout l;
    const size_t B = (size_t)s.B, Lr = (size_t)(L < s.Tk ? L : s.Tk);
    l.acc_dq = round256(B * s.T * s.H * s.Dk * 4);
    l.acc_dk = round256(B * Lr * s.Hkv * s.Dk * 4);
    l.acc_dv = round256(B * Lr * s.Hkv * s.Dv * 4);
    l.p_dq = round256(B * Lr * s.H * s.Dk * 2);
    l.p_dk = round256(B * Lr * s.Hkv * s.Dk * 2);
    l.p_dv = round256(B * Lr * s.Hkv * s.Dv * 2);
    l.stats = round256(B * s.H * Lr * 4);
    l.cudnn = round256(cudnn_ws);
    l.total = l.acc_dq + l.acc_dk + l.acc_dv + l.p_dq + l.p_dk + l.p_dv + l.stats + l.cudnn;
    return l;
}

}  // namespace

lm_status backward_blocked_prepare(int device, const Shape &s, int L, size_t *workspace_bytes) {
    if (L < 64) return lm_error(LM_ERR_ARG, "attention backward (cudnn-blocked): blocks of %d rows (at least 64)", L);
    std::lock_guard<std::mutex> lock(g_mu);
    cudnnHandle_t h = nullptr;
    size_t ws = 0;
    lm_status st = for_each_piece(s, L, [&](const Piece &p, bool) {
        Entry *e = nullptr;
        lm_status r = get_plan_key(piece_key(device, s, p), &h, &e);
        if (!r && (size_t)e->workspace > ws) ws = (size_t)e->workspace;
        return r;
    });
    if (st) return st;
    *workspace_bytes = blocked_layout(s, L, ws).total;
    return LM_OK;
}

lm_status backward_blocked(const lm_cuda_context *ctx, const Shape &s, int L, const uint16_t *q, const uint16_t *k,
                           const uint16_t *v, const uint16_t *o, const uint16_t *d_o, const float *lse, uint16_t *dq,
                           uint16_t *dk, uint16_t *dv, void *workspace, size_t workspace_bytes) {
    int device;
    lm_status st = current_device(&device);
    if (st) return st;
    size_t need = 0;
    if ((st = backward_blocked_prepare(device, s, L, &need))) return st;
    if (!workspace || workspace_bytes < need)
        return lm_error(LM_ERR_ARG, "attention backward (cudnn-blocked): workspace of %zu bytes, need %zu",
                        workspace_bytes, need);
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    const BlockedLayout lay = blocked_layout(s, L, 0);
    char *w = static_cast<char *>(workspace);
    float *acc_dq = reinterpret_cast<float *>(w);
    float *acc_dk = reinterpret_cast<float *>(w + lay.acc_dq);
    float *acc_dv = reinterpret_cast<float *>(w + lay.acc_dq + lay.acc_dk);
    uint16_t *p_dq = reinterpret_cast<uint16_t *>(w + lay.acc_dq + lay.acc_dk + lay.acc_dv);
    uint16_t *p_dk = reinterpret_cast<uint16_t *>(w + lay.acc_dq + lay.acc_dk + lay.acc_dv + lay.p_dq);
    uint16_t *p_dv = reinterpret_cast<uint16_t *>(w + lay.acc_dq + lay.acc_dk + lay.acc_dv + lay.p_dq + lay.p_dk);
    float *p_stats = reinterpret_cast<float *>(w + lay.acc_dq + lay.acc_dk + lay.acc_dv + lay.p_dq + lay.p_dk + lay.p_dv);
    void *cudnn_ws = w + (lay.total - lay.cudnn);  // lay.cudnn is 0: the rest of the workspace
    const size_t qw = (size_t)s.H * s.Dk, vw = (size_t)s.H * s.Dv, kw = (size_t)s.Hkv * s.Dk, kvw = (size_t)s.Hkv * s.Dv;
    const size_t Lr = (size_t)(L < s.Tk ? L : s.Tk);
    LM_CUDA_TRY(cudaMemsetAsync(acc_dq, 0, (size_t)s.B * s.T * qw * 4, stream));
    int block_j0 = -1;  // the key block whose dk, dv are being summed
    std::lock_guard<std::mutex> lock(g_mu);
    cudnnHandle_t h = nullptr;
    return for_each_piece(s, L, [&](const Piece &p, bool last_of_block) -> lm_status {
        lm_status r;
        if (p.j0 != block_j0) {
            block_j0 = p.j0;
            LM_CUDA_TRY(cudaMemsetAsync(acc_dk, 0, (size_t)s.B * Lr * kw * 4, stream));
            LM_CUDA_TRY(cudaMemsetAsync(acc_dv, 0, (size_t)s.B * Lr * kvw * 4, stream));
        }
        Entry *e = nullptr;
        if ((r = get_plan_key(piece_key(device, s, p), &h, &e))) return r;
        if (round256((size_t)e->workspace) > workspace_bytes - (lay.total - lay.cudnn))
            return lm_error(LM_ERR_ARG, "attention backward (cudnn-blocked): workspace too small for a block");
        void *by_uid[U_DV + 1] = {nullptr};
        by_uid[U_Q] = const_cast<uint16_t *>(q + (size_t)p.i0 * qw);
        by_uid[U_K] = const_cast<uint16_t *>(k + (size_t)p.j0 * kw);
        by_uid[U_V] = const_cast<uint16_t *>(v + (size_t)p.j0 * kvw);
        by_uid[U_O] = const_cast<uint16_t *>(o + (size_t)p.i0 * vw);
        by_uid[U_DO] = const_cast<uint16_t *>(d_o + (size_t)p.i0 * vw);
        /* the piece's rows of the statistics, packed [B,H,tq] (cuDNN before 9.26 takes only a packed
         * statistics tensor): rows i0 .. i0+tq of each (b, h) row of T */
        LM_CUDA_TRY(cudaMemcpy2DAsync(p_stats, (size_t)p.tq * 4, lse + p.i0, (size_t)s.T * 4, (size_t)p.tq * 4,
                                      (size_t)s.B * s.H, cudaMemcpyDeviceToDevice, stream));
        by_uid[U_STATS] = p_stats;
        by_uid[U_DQ] = p_dq;
        by_uid[U_DK] = p_dk;
        by_uid[U_DV] = p_dv;
        if ((r = run(*e, h, stream, by_uid, e->workspace > 0 ? cudnn_ws : nullptr))) return r;
        const dim3 grid_q(blocks_for((size_t)p.tq * qw), (unsigned)s.B);
        add_rows_kernel<<<grid_q, 256, 0, stream>>>(acc_dq + (size_t)p.i0 * qw, (size_t)s.T * qw, p_dq,
                                                    (size_t)p.tq * qw, (size_t)p.tq * qw);
        const dim3 grid_k(blocks_for((size_t)p.tk * kw), (unsigned)s.B);
        add_rows_kernel<<<grid_k, 256, 0, stream>>>(acc_dk, Lr * kw, p_dk, (size_t)p.tk * kw, (size_t)p.tk * kw);
        const dim3 grid_v(blocks_for((size_t)p.tk * kvw), (unsigned)s.B);
        add_rows_kernel<<<grid_v, 256, 0, stream>>>(acc_dv, Lr * kvw, p_dv, (size_t)p.tk * kvw, (size_t)p.tk * kvw);
        LM_CUDA_TRY(cudaGetLastError());
        if (last_of_block) {  // the key block is complete: its rows of dk, dv
            store_rows_kernel<<<grid_k, 256, 0, stream>>>(dk + (size_t)p.j0 * kw, (size_t)s.Tk * kw, acc_dk, Lr * kw,
                                                          (size_t)p.tk * kw);
            store_rows_kernel<<<grid_v, 256, 0, stream>>>(dv + (size_t)p.j0 * kvw, (size_t)s.Tk * kvw, acc_dv,
                                                          Lr * kvw, (size_t)p.tk * kvw);
            LM_CUDA_TRY(cudaGetLastError());
        }
        if (last_of_block && p.j0 + p.tk == s.Tk) {  // the last key block: dq is complete
            const dim3 grid_dq(blocks_for((size_t)s.T * qw), (unsigned)s.B);
            store_rows_kernel<<<grid_dq, 256, 0, stream>>>(dq, (size_t)s.T * qw, acc_dq, (size_t)s.T * qw,
                                                           (size_t)s.T * qw);
            LM_CUDA_TRY(cudaGetLastError());
        }
        return LM_OK;
    });
}

size_t scratch_bytes(int device) {
    std::lock_guard<std::mutex> lock(g_mu);
    size_t total = 0;
    for (const Scratch &s : g_scratch)
        if (s.device == device) total += s.bytes;
    return total;
}

}  // namespace lmcudnn
