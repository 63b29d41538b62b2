// Causal attention of a step's queries over a layer's KV cache, with GQA,
// sliding window and soft-capping; split-K over the keys (flash-decode style):
// attn_partial_* writes per split (max, sum, unnormalised output), attn_combine
// merges the splits. The same two kernels serve decode (n_q = 1) and prefill.
// Twin: pulsar_kernels::ops::attend_rows, which reproduces this arithmetic
// operation for operation (the chunking, the butterflies, the block sums and
// the combine), so both give the same bits: every float operation here is a
// round-to-nearest intrinsic (no contraction) and exp/tanh are the shared
// exp_c/tanh_c of common.cuh.
//
// q: [n_q, n_head * dk]; k: [n_ctx, n_kv_head * dk]; v: [n_ctx, n_kv_head * dv]
// (f32, or f16 for the *_f16 entry); positions: [n_q]; part: [n_q, n_head,
// n_split, dv + 2]; out: [n_q, n_head * dv]. A query sees keys
// (pos - window, pos] (all of [0, pos] when window is 0). A position at or
// beyond n_ctx gives NaN output.

#define ATT_THREADS 128

template <int KV> __device__ __forceinline__ float ldkv(const void* p, size_t i) {
    if (KV == 0) return ((const float*)p)[i];
    return h2f(((const u16*)p)[i]);
}

template <int KV>
__device__ __forceinline__ void attn_partial(const float* q, const u32* positions, const void* k, const void* v,
                                             float* part, int n_q, int n_head, int n_kv_head, int dk, int dv,
                                             int n_ctx, float scale, int window, float softcap, int chunk,
                                             int n_split) {
    extern __shared__ float smem[];
    float* qs = smem;             // dk
    float* sc = smem + dk;        // chunk
    __shared__ float red[ATT_THREADS / 32];
    int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z;
    float* pp = part + (((size_t)t * n_head + h) * n_split + s) * (dv + 2);
    u32 pos = positions[t];
    if (pos >= (u32)n_ctx) {
        for (int d = threadIdx.x; d < dv + 2; d += ATT_THREADS) pp[d] = __int_as_float(0x7fc00000);
        return;
    }
    int start = window > 0 ? max(0, (int)pos + 1 - window) : 0;
    int j0 = start + s * chunk;
    int j1 = min((int)pos + 1, j0 + chunk);
    if (j0 >= j1) {
        for (int d = threadIdx.x; d < dv + 2; d += ATT_THREADS) pp[d] = d == 0 ? NEG_INF : 0.0f;
        return;
    }
    int group = n_head / n_kv_head;
    int kvh = h / group;
    size_t kw = (size_t)n_kv_head * dk, vw = (size_t)n_kv_head * dv;
    const float* qh = q + ((size_t)t * n_head + h) * dk;
    for (int d = threadIdx.x; d < dk; d += ATT_THREADS) qs[d] = qh[d];
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int j = j0 + warp; j < j1; j += ATT_THREADS / 32) {
        size_t base = (size_t)j * kw + (size_t)kvh * dk;
        float acc = 0.0f;
        for (int d = lane; d < dk; d += 32) acc = __fadd_rn(acc, __fmul_rn(qs[d], ldkv<KV>(k, base + d)));
        acc = __fmul_rn(warp_sum(acc), scale);
        if (softcap > 0.0f) acc = __fmul_rn(softcap, tanh_c(__fdiv_rn(acc, softcap)));
        if (lane == 0) sc[j - j0] = acc;
    }
    __syncthreads();
    int n = j1 - j0;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += ATT_THREADS) m = fmaxf(m, sc[i]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
#pragma unroll
    for (int i = 1; i < ATT_THREADS / 32; i++) m = fmaxf(m, red[i]);
    __syncthreads();
    float l = 0.0f;
    for (int i = threadIdx.x; i < n; i += ATT_THREADS) {
        float e = exp_c(__fsub_rn(sc[i], m));
        sc[i] = e;
        l = __fadd_rn(l, e);
    }
    l = warp_sum(l);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    l = 0.0f;
#pragma unroll
    for (int i = 0; i < ATT_THREADS / 32; i++) l = __fadd_rn(l, red[i]);
    for (int d = threadIdx.x; d < dv; d += ATT_THREADS) {
        float o = 0.0f;
        for (int i = 0; i < n; i++)
            o = __fadd_rn(o, __fmul_rn(sc[i], ldkv<KV>(v, (size_t)(j0 + i) * vw + (size_t)kvh * dv + d)));
        pp[2 + d] = o;
    }
    if (threadIdx.x == 0) {
        pp[0] = m;
        pp[1] = l;
    }
}

#define ATT_ENTRY(NAME, KV)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_partial_##NAME(                \
        const float* q, const u32* positions, const void* k, const void* v, float* part, int n_q,  \
        int n_head, int n_kv_head, int dk, int dv, int n_ctx, float scale, int window,            \
        float softcap, int chunk, int n_split) { \
        pdl_begin(); \
        attn_partial<KV>(q, positions, k, v, part, n_q, n_head, n_kv_head, dk, dv, n_ctx, scale,  \
                         window, softcap, chunk, n_split);                                        \
    }

ATT_ENTRY(f32, 0)
ATT_ENTRY(f16, 1)

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attn_combine(const float* part, float* out, int n_q, int n_head, int dv, int n_split) {
    pdl_begin();
    int h = blockIdx.x, t = blockIdx.y;
    const float* pp = part + ((size_t)t * n_head + h) * n_split * (dv + 2);
    float M = NEG_INF;
    for (int s = 0; s < n_split; s++) M = fmaxf(M, pp[(size_t)s * (dv + 2)]);
    float L = 0.0f;
    for (int s = 0; s < n_split; s++) {
        float ms = pp[(size_t)s * (dv + 2)];
        if (ms != NEG_INF) L = __fadd_rn(L, __fmul_rn(exp_c(__fsub_rn(ms, M)), pp[(size_t)s * (dv + 2) + 1]));
    }
    float* o = out + ((size_t)t * n_head + h) * dv;
    for (int d = threadIdx.x; d < dv; d += ATT_THREADS) {
        float acc = 0.0f;
        for (int s = 0; s < n_split; s++) {
            float ms = pp[(size_t)s * (dv + 2)];
            if (ms != NEG_INF) acc = __fadd_rn(acc, __fmul_rn(exp_c(__fsub_rn(ms, M)), pp[(size_t)s * (dv + 2) + 2 + d]));
        }
        o[d] = __fdiv_rn(acc, L);
    }
}

// Store a step's k and v rows in a layer's cache at the rows their positions
// name. The positions are read here, not on the host, so a captured decode
// graph writes the right cache row at every replay. A position at or beyond
// n_ctx is skipped (the host refuses such steps before they run).
extern "C" __global__ void kv_write(const float* k, const float* v, const u32* positions, float* kc, float* vc,
                                    int kw, int vw, int n_ctx) {
    pdl_begin();
    int r = blockIdx.y;
    u32 pos = positions[r];
    if (pos >= (u32)n_ctx) return;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kw + vw; i += gridDim.x * blockDim.x) {
        if (i < kw)
            kc[(size_t)pos * kw + i] = k[(size_t)r * kw + i];
        else
            vc[(size_t)pos * vw + (i - kw)] = v[(size_t)r * vw + (i - kw)];
    }
}
