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
// (f32, f16, bf16, fp8, q8_0 or q4_0 rows as the entry's name says); positions: [n_q]; part: [n_q, n_head,
// n_split, dv + 2]; out: [n_q, n_head * dv]. A query sees keys
// (pos - window, pos] (all of [0, pos] when window is 0). A position at or
// beyond n_ctx gives NaN output.

#define ATT_THREADS 128

// KV formats: 0 f32, 1 f16 bits, 2 q8_0 rows, 3 q4_0 rows, 4 bf16 bits, 5
// fp8 (e4m3) bytes (pulsar_kernels::ops::KvType). A q8_0 row of w values is w int8 quants,
// then an f16 scale per 32 values; a q4_0 row is 16 bytes of nibbles per 32
// values (byte j: value j low, value j + 16 high), then the scales; both
// padded to 16 bytes (kv_rs), so a row's bytes are its own and 16-byte
// aligned.
// The formats of 32-value blocks with a scale each.
__device__ __forceinline__ constexpr bool kv_blocked(int kv) { return kv == 2 || kv == 3; }
// Bytes a value of the unblocked formats.
__device__ __forceinline__ constexpr int kv_vbytes(int kv) { return kv == 0 ? 4 : kv == 5 ? 1 : 2; }

// f32 -> bf16 bits, round to nearest even; a NaN stays a quiet NaN of its
// sign (KvType's bf16_bits).
__device__ __forceinline__ u32 f2bf(float x) {
    const u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
// f32 -> e4m3 (E4M3FN), round to nearest even, saturated to +-448, NaN 0x7f
// with its sign: KvType's e4m3_bits, step for step.
__device__ __forceinline__ u32 f2e4m3(float x) {
    const u32 u = __float_as_uint(x), s = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return s | 0x7fu;
    if (a >= 0x43e00000u) return s | 0x7eu;
    if (a < 0x3c800000u) return s | (u32)__float2int_rn(__fmul_rn(__uint_as_float(a), 512.0f));
    return s | (((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - ((127u - 7u) << 3));
}
// The value of an e4m3 byte, exactly (KvType's e4m3_value).
__device__ __forceinline__ float e4m3f(u32 b) {
    const u32 e = (b >> 3) & 15u, m = b & 7u;
    float mag = e == 0 ? __fmul_rn((float)m, 0.001953125f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    if (e == 15 && m == 7) mag = __int_as_float(0x7fc00000);
    return (b & 0x80u) ? -mag : mag;
}

template <int KV> __device__ __forceinline__ size_t kv_rs(size_t w) {
    const size_t nb = (w + 31) / 32;
    return ((KV == 2 ? w + 2 * nb : 18 * nb) + 15) & ~(size_t)15;
}
// Byte offset of block b's scale in a row of w values.
template <int KV> __device__ __forceinline__ size_t kv_scale_at(size_t w, size_t b) {
    return (KV == 2 ? w : 16 * ((w + 31) / 32)) + 2 * b;
}

// Value `col` of row j of a cache of rows of w values.
template <int KV> __device__ __forceinline__ float ldkv(const void* p, size_t j, size_t w, size_t col) {
    if (KV == 0) return ((const float*)p)[j * w + col];
    if (KV == 1) return h2f(((const u16*)p)[j * w + col]);
    if (KV == 4) return bf2f(((const u16*)p)[j * w + col]);
    if (KV == 5) return e4m3f(((const u8*)p)[j * w + col]);
    const u8* row = (const u8*)p + j * kv_rs<KV>(w);
    const float d = h2f(*(const u16*)(row + kv_scale_at<KV>(w, col >> 5)));
    if (KV == 2) return __fmul_rn((float)(signed char)row[col], d);
    const int q = (row[16 * (col >> 5) + (col & 15)] >> (4 * ((col >> 4) & 1))) & 15;
    return __fmul_rn((float)(q - 8), d);
}

// The first byte of row j's values from `col` on (col a multiple of 32 for
// the blocked formats).
template <int KV> __device__ __forceinline__ const u8* kv_seg(const void* p, size_t j, size_t w, size_t col) {
    if (KV == 2) return (const u8*)p + j * kv_rs<KV>(w) + col;
    if (KV == 3) return (const u8*)p + j * kv_rs<KV>(w) + col / 2;
    return (const u8*)p + (j * w + col) * kv_vbytes(KV);
}
// Blocked formats: bytes from such a segment's start to its first scale (the
// same for every row); 0 for the others, which have no scales.
template <int KV> __device__ __forceinline__ int kv_sofs(size_t w, size_t col) {
    if constexpr (kv_blocked(KV))
        return (int)(kv_scale_at<KV>(w, col / 32) - (KV == 2 ? col : col / 2));
    else
        return 0;
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
        float acc = 0.0f;
        for (int d = lane; d < dk; d += 32) acc = __fadd_rn(acc, __fmul_rn(qs[d], ldkv<KV>(k, j, kw, (size_t)kvh * dk + d)));
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
            o = __fadd_rn(o, __fmul_rn(sc[i], ldkv<KV>(v, j0 + i, vw, (size_t)kvh * dv + d)));
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
ATT_ENTRY(q8_0, 2)
ATT_ENTRY(q4_0, 3)
ATT_ENTRY(bf16, 4)
ATT_ENTRY(fp8, 5)

// M = max m_s; L = sum_s exp(m_s - M) l_s and o = (sum_s exp(m_s - M) o_s) / L,
// each sum over the splits in order from +0 (splits without keys skipped).
// The weights exp(m_s - M) and products w_s l_s are formed once per split,
// CB splits at a time, in shared memory, so each thread's loop over the
// splits is loads and adds only.
#define CB 1024
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    attn_combine(const float* part, float* out, int n_q, int n_head, int dv, int n_split) {
    pdl_begin();
    __shared__ float w[CB], wl[CB], red[ATT_THREADS / 32];
    int h = blockIdx.x, t = blockIdx.y;
    const float* pp = part + ((size_t)t * n_head + h) * n_split * (dv + 2);
    float M = NEG_INF;
    for (int s = threadIdx.x; s < n_split; s += ATT_THREADS) M = fmaxf(M, pp[(size_t)s * (dv + 2)]);
    M = warp_max(M);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = M;
    __syncthreads();
    M = red[0];
#pragma unroll
    for (int i = 1; i < ATT_THREADS / 32; i++) M = fmaxf(M, red[i]);
    float L = 0.0f;
    const int nd = (dv + ATT_THREADS - 1) / ATT_THREADS;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // dims threadIdx.x + 128 i (dv <= 512)
    for (int c0 = 0; c0 < n_split; c0 += CB) {
        const int nc = min(CB, n_split - c0);
        __syncthreads();  // the last chunk's readers are done
        for (int i = threadIdx.x; i < nc; i += ATT_THREADS) {
            const float* ps = pp + (size_t)(c0 + i) * (dv + 2);
            float ms = ps[0];
            // A split without keys (m = -inf) weighs -1: skipped below.
            float e = ms != NEG_INF ? exp_c(__fsub_rn(ms, M)) : -1.0f;
            w[i] = e;
            wl[i] = e >= 0.0f ? __fmul_rn(e, ps[1]) : 0.0f;
        }
        __syncthreads();
        for (int i = 0; i < nc; i++)
            if (w[i] >= 0.0f) L = __fadd_rn(L, wl[i]);
        for (int k = 0; k < nd && k < 4; k++) {
            const int d = threadIdx.x + k * ATT_THREADS;
            if (d >= dv) break;
            float a = acc[k];
            const float* po = pp + (size_t)c0 * (dv + 2) + 2 + d;
#pragma unroll 8
            for (int i = 0; i < nc; i++)
                if (w[i] >= 0.0f) a = __fadd_rn(a, __fmul_rn(w[i], po[(size_t)i * (dv + 2)]));
            acc[k] = a;
        }
    }
    float* o = out + ((size_t)t * n_head + h) * dv;
    for (int k = 0; k < nd && k < 4; k++) {
        const int d = threadIdx.x + k * ATT_THREADS;
        if (d < dv) o[d] = __fdiv_rn(acc[k], L);
    }
}

// Store a step's k and v rows in a layer's cache at the rows their positions
// name (f32; f16 / bf16 / fp8 rounded to nearest even as the CPU's cache
// rounds them; q8_0 / q4_0 blocks quantized as KvType::put_row does). The positions are
// read here, not on the host, so a captured decode graph writes the right
// cache row at every replay. A position at or beyond n_ctx is skipped (the
// host refuses such steps before they run).
template <int KV> __device__ __forceinline__ void kv_put(void* c, size_t i, float x) {
    if (KV == 0)
        ((float*)c)[i] = x;
    else if (KV == 1)
        ((u16*)c)[i] = (u16)f2h(x);
    else if (KV == 4)
        ((u16*)c)[i] = (u16)f2bf(x);
    else
        ((u8*)c)[i] = (u8)f2e4m3(x);
}
// Block b of the q8_0 row `row` of the w values x, by one warp (lane i takes
// value i): d = amax / 127 (as f16), quants round(x * (1 / d)) (0 where d is
// 0, or for a NaN); the last block also zeroes the row's padding. A max is
// exact in any order, and each lane's max starts from 0 as the CPU's fold
// does, so a NaN is passed over as there.
__device__ __forceinline__ void kv_put_q8(const float* x, int w, int b, u8* row, int lane) {
    const int i0 = b * 32, n = min(32, w - i0), nb = (w + 31) / 32;
    const float xv = lane < n ? x[i0 + lane] : 0.0f;
    const float amax = warp_max(fmaxf(0.0f, fabsf(xv)));
    const float d = __fdiv_rn(amax, 127.0f), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    if (lane < n) {
        const float r = roundf(__fmul_rn(xv, id));
        row[i0 + lane] = (u8)(signed char)(r != r ? 0 : (int)r);
    }
    if (lane == 0) ((u16*)(row + w))[b] = (u16)f2h(d);
    const int pad0 = w + 2 * nb;
    if (b == nb - 1 && pad0 + lane < (int)kv_rs<2>(w)) row[pad0 + lane] = 0;
}
// The same for q4_0 (KvType::put_row's q4_0_row): max = the first value of
// the largest |x| (a NaN passed over; 0 where all are 0), d = max / -8,
// quants min(15, trunc(x * (1 / d) + 8.5)) (8 for a NaN and for the padding
// of a short block); lane j < 16 writes byte j (values j and j + 16).
__device__ __forceinline__ void kv_put_q4(const float* x, int w, int b, u8* row, int lane) {
    const int i0 = b * 32, n = min(32, w - i0), nb = (w + 31) / 32;
    const float xv = lane < n ? x[i0 + lane] : 0.0f;
    float a = xv != xv ? -1.0f : fabsf(xv);
    int at = lane;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float a2 = __shfl_xor_sync(FULL_MASK, a, o);
        const int at2 = __shfl_xor_sync(FULL_MASK, at, o);
        if (a2 > a || (a2 == a && at2 < at)) a = a2, at = at2;
    }
    const float mx = __shfl_sync(FULL_MASK, xv, at);
    const float max = a > 0.0f ? mx : 0.0f;
    const float d = __fdiv_rn(max, -8.0f), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const int q = xv != xv ? 8 : min(15, (int)__fadd_rn(__fmul_rn(xv, id), 8.5f));
    const int hi = __shfl_down_sync(FULL_MASK, q, 16);
    if (lane < 16) row[16 * b + lane] = (u8)(q | (hi << 4));
    if (lane == 0) ((u16*)(row + 16 * nb))[b] = (u16)f2h(d);
    const int pad0 = 18 * nb;
    if (b == nb - 1 && pad0 + lane < (int)kv_rs<3>(w)) row[pad0 + lane] = 0;
}
template <int KV>
__device__ __forceinline__ void kv_write_row(const float* k, const float* v, int r, u32 pos, void* kc, void* vc, int kw,
                                             int vw) {
    if constexpr (kv_blocked(KV)) {
        // A warp per block (the loop is warp-uniform: the reductions need all 32 lanes).
        const int nbk = (kw + 31) / 32, nbv = (vw + 31) / 32, lane = threadIdx.x & 31;
        for (int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nbk + nbv; b += (gridDim.x * blockDim.x) >> 5) {
            const bool isk = b < nbk;
            const float* x = isk ? k + (size_t)r * kw : v + (size_t)r * vw;
            const int w = isk ? kw : vw;
            u8* row = (u8*)(isk ? kc : vc) + pos * kv_rs<KV>(w);
            if (KV == 2)
                kv_put_q8(x, w, isk ? b : b - nbk, row, lane);
            else
                kv_put_q4(x, w, isk ? b : b - nbk, row, lane);
        }
        return;
    }
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < kw + vw; i += gridDim.x * blockDim.x) {
        if (i < kw)
            kv_put<KV>(kc, (size_t)pos * kw + i, k[(size_t)r * kw + i]);
        else
            kv_put<KV>(vc, (size_t)pos * vw + (i - kw), v[(size_t)r * vw + (i - kw)]);
    }
}
#define KV_WRITE_ENTRY(NAME, KV)                                                                                \
    extern "C" __global__ void kv_write##NAME(const float* k, const float* v, const u32* positions, void* kc,  \
                                              void* vc, int kw, int vw, int n_ctx) {                           \
        pdl_begin();                                                                                           \
        int r = blockIdx.y;                                                                                    \
        u32 pos = positions[r];                                                                                \
        if (pos >= (u32)n_ctx) return;                                                                         \
        kv_write_row<KV>(k, v, r, pos, kc, vc, kw, vw);                                                        \
    }
KV_WRITE_ENTRY(, 0)
KV_WRITE_ENTRY(_f16, 1)
KV_WRITE_ENTRY(_q8_0, 2)
KV_WRITE_ENTRY(_q4_0, 3)
KV_WRITE_ENTRY(_bf16, 4)
KV_WRITE_ENTRY(_fp8, 5)

// Rows of several sequences in one launch, each over its own cache (a
// batched step of the server): row t's layer cache is at kcs[t] / vcs[t].
// The arithmetic is attn_partial's and kv_write's, so a row gets the bits it
// gets alone; n_ctx only sizes the splits (the longest row's context).
#define ATT_ROWS_ENTRY(NAME, KV)                                                                               \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_partial_rows_##NAME(                        \
        const float* q, const u32* positions, const u64* kcs, const u64* vcs, float* part, int n_q, int n_head,  \
        int n_kv_head, int dk, int dv, int n_ctx, float scale, int window, float softcap, int chunk,            \
        int n_split) {                                                                                         \
        pdl_begin();                                                                                           \
        int t = blockIdx.y;                                                                                    \
        attn_partial<KV>(q, positions, (const void*)kcs[t], (const void*)vcs[t], part, n_q, n_head, n_kv_head,  \
                         dk, dv, n_ctx, scale, window, softcap, chunk, n_split);                               \
    }
ATT_ROWS_ENTRY(f32, 0)
ATT_ROWS_ENTRY(f16, 1)
ATT_ROWS_ENTRY(q8_0, 2)
ATT_ROWS_ENTRY(q4_0, 3)
ATT_ROWS_ENTRY(bf16, 4)
ATT_ROWS_ENTRY(fp8, 5)

// kv_write for rows of several sequences: row r goes to kcs[r] / vcs[r], each
// a cache of n_ctx rows.
#define KV_WRITE_ROWS_ENTRY(NAME, KV)                                                                          \
    extern "C" __global__ void kv_write_rows##NAME(const float* k, const float* v, const u32* positions,       \
                                                   const u64* kcs, const u64* vcs, int kw, int vw, int n_ctx) { \
        pdl_begin();                                                                                           \
        int r = blockIdx.y;                                                                                    \
        u32 pos = positions[r];                                                                                \
        if (pos >= (u32)n_ctx) return;                                                                         \
        kv_write_row<KV>(k, v, r, pos, (void*)kcs[r], (void*)vcs[r], kw, vw);                                  \
    }
KV_WRITE_ROWS_ENTRY(, 0)
KV_WRITE_ROWS_ENTRY(_f16, 1)
KV_WRITE_ROWS_ENTRY(_q8_0, 2)
KV_WRITE_ROWS_ENTRY(_q4_0, 3)
KV_WRITE_ROWS_ENTRY(_bf16, 4)
KV_WRITE_ROWS_ENTRY(_fp8, 5)

// ---- Prefill: the same `part` as attn_partial, bit for bit, for many queries.
// A block takes one kv head, AP_ROWS consecutive (query, head-of-the-group)
// rows (row g = t * group + h % group) and one split. It stages the keys the
// rows need KT at a time in shared memory, so every staged k/v row serves all
// the rows instead of one. The arithmetic is attn_partial's:
// - score: thread (row, key) forms lane l's partial (d = l, l+32, ..., the
//   products folded in order) for the 32 lanes in the order of the butterfly's
//   tree (bit-reversed l: lanes l and l^16 first, ...) and adds them as lane 0
//   of warp_sum does. The leading `0.0f +` of each partial is skipped: that
//   can only give -0 where attn_partial has +0 (whose partials and sums are
//   never -0), sums of such values differ only so too, and a `+ 0.0f` (the
//   subtree pairing, and before the scale) maps -0 back to +0.
// - max / sum: virtual thread v = i mod 128 of attn_partial's block, its
//   virtual warp's butterfly, then the four warp values in order.
// - o[d]: one fold over the row's keys in increasing order.
// K rows are staged lane-major (lane l's DK/32 values contiguous) so one
// vector load gives a lane's whole partial; rows are padded so the 8 rows or
// keys a warp loads at once hit distinct banks. A row's score for key j sits
// at slot (j - J0) mod 256, J0 the block's first key (a row has at most 256
// keys), whatever the row's start.

#define AP_THREADS 256
#define AP_ROWS 64
#define AP_CHUNK 256  // the keys of a split: the host's ATT_CHUNK
#define AP_SCS (AP_ROWS + 8)  // score slot stride: the 4 keys x 8 rows a warp stores hit distinct banks

template <int DK, int DV> struct ApGeo {
    static constexpr int NT = DK / 32;                // values of a lane partial
    static constexpr int DM = DK > DV ? DK : DV;
    static constexpr int KT = 8192 / DM;              // keys staged at a time
    static constexpr int CK = KT >= 64 ? 4 : 2;       // keys a thread scores: 8 warp tiles at least
    static constexpr int QS = DK + 4;                 // q row stride (floats)
    static constexpr int KS = DM + 4;                 // k / v row stride
    static constexpr int SMEM = (AP_ROWS * QS + KT * KS + AP_CHUNK * AP_SCS) * 4;
    static_assert(DK % 64 == 0 && DV % 64 == 0 && AP_CHUNK % KT == 0 && KT % (4 * CK) == 0, "tile shape");
    static_assert(AP_THREADS == 4 * AP_ROWS && AP_ROWS == 64, "a thread per (row, virtual warp); two 32-row halves");
};

__device__ __forceinline__ constexpr int ap_brev3(int i) { return ((i & 1) << 2) | (i & 2) | ((i >> 2) & 1); }

template <int N> __device__ __forceinline__ void ap_ld(float (&x)[N], const float* p) {
    if constexpr (N == 2) {
        float2 v = *(const float2*)p;
        x[0] = v.x, x[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            float4 v = *(const float4*)(p + i);
            x[i] = v.x, x[i + 1] = v.y, x[i + 2] = v.z, x[i + 3] = v.w;
        }
    }
}
template <int N> __device__ __forceinline__ void ap_st(float* p, const float (&x)[N]) {
    if constexpr (N == 2) {
        *(float2*)p = make_float2(x[0], x[1]);
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 4) *(float4*)(p + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
    }
}
// Element e of a 16-byte granule of f32 (KV 0), f16 (KV 1), q8_0 (KV 2),
// q4_0 (KV 3: a whole block, e's nibble), bf16 (KV 4) or fp8 (KV 5) values,
// the quants unscaled.
template <int KV> __device__ __forceinline__ float ap_el(uint4 g, int e) {
    constexpr int PW = KV == 0 ? 1 : (KV == 1 || KV == 4) ? 2 : 4;  // values (bytes for q4_0) a word
    const int byte = KV == 3 ? (e & 15) : e;
    u32 w = byte < PW ? g.x : byte < 2 * PW ? g.y : byte < 3 * PW ? g.z : g.w;
    if (KV == 0) return __uint_as_float(w);
    if (KV == 1) return h2f((u16)((e & 1) ? w >> 16 : w & 0xffffu));
    if (KV == 4) return bf2f((u16)((e & 1) ? w >> 16 : w & 0xffffu));
    if (KV == 5) return e4m3f((w >> (8 * (e & 3))) & 0xffu);
    if (KV == 2) return (float)(signed char)((w >> (8 * (e & 3))) & 0xffu);
    return (float)((int)((w >> (8 * (byte & 3) + 4 * (e >> 4))) & 15u) - 8);
}

// N rows of D values (f32, or f16 / q8_0 widened) staged into shared memory
// as f32 rows of STRIDE floats, through registers: load() early, store()
// after the last tile's readers are done, so the loads overlap that tile's
// arithmetic. Lane-major (LANE): a unit (row, a) loads 16-byte granules
// a + A c (c < D/32) of EPG values, whose values e are lane EPG a + e's; else
// a unit is a granule stored in place. A q8_0 granule is 16 quants of one
// block, a q4_0 one a whole block; its scale is at the row segment's start +
// sofs (kv_sofs) + 2 x the block: c (lane-major), else a EPG / 32.
template <int KV, int N, int D, bool LANE, int STRIDE, int THREADS = AP_THREADS> struct ApStage {
    static constexpr int EPG = KV == 0 ? 4 : (KV == 1 || KV == 4) ? 8 : (KV == 2 || KV == 5) ? 16 : 32, A = 32 / EPG, NT = D / 32;
    static constexpr int G = LANE ? NT : 1;                    // granules a unit
    static constexpr int UR = LANE ? A : D / EPG;              // units a row
    static constexpr int NU = N * UR, UPT = (NU + THREADS - 1) / THREADS;
    static constexpr int SG = kv_blocked(KV) ? G : 1, SU = kv_blocked(KV) ? UPT : 1;
    uint4 g[UPT][G];
    float sc[SU][SG];  // q8_0 scales
    int sofs = 0;

    // rowp(r) is row r's first element; rows r >= n are zero.
    template <class RowP> __device__ __forceinline__ void load(RowP rowp, int n) {
#pragma unroll
        for (int k = 0; k < UPT; k++) {
            int u = threadIdx.x + k * THREADS, r = u / UR, a = u % UR;
            bool ok = (NU % THREADS == 0 || u < NU) && r < n;
            const u8* b = ok ? rowp(r) : nullptr;
            const uint4* p = (const uint4*)b;
#pragma unroll
            for (int c = 0; c < G; c++) g[k][c] = ok ? p[LANE ? a + A * c : a] : make_uint4(0, 0, 0, 0);
            if constexpr (kv_blocked(KV)) {
#pragma unroll
                for (int c = 0; c < G; c++) sc[k][c] = ok ? h2f(((const u16*)(b + sofs))[LANE ? c : a * EPG / 32]) : 0.0f;
            }
        }
    }
    __device__ __forceinline__ float el(int k, int c, int e) const {
        if constexpr (kv_blocked(KV)) return __fmul_rn(ap_el<KV>(g[k][c], e), sc[k][c]);
        return ap_el<KV>(g[k][c], e);
    }
    __device__ __forceinline__ void store(float* dst) const {
#pragma unroll
        for (int k = 0; k < UPT; k++) {
            int u = threadIdx.x + k * THREADS, r = u / UR, a = u % UR;
            if (NU % THREADS != 0 && u >= NU) continue;
            if (LANE) {
#pragma unroll
                for (int e = 0; e < EPG; e++) {
                    float x[NT];
#pragma unroll
                    for (int c = 0; c < NT; c++) x[c] = el(k, c, e);
                    ap_st(dst + r * STRIDE + NT * (EPG * a + e), x);
                }
            } else {
                float x[EPG];
#pragma unroll
                for (int e = 0; e < EPG; e++) x[e] = el(k, 0, e);
                ap_st(dst + r * STRIDE + EPG * a, x);
            }
        }
    }
};

// Eight leaves of the score tree for a thread's 4 rows x 4 keys: lanes
// 4 brev3(i) + lb, i < 8 (qp, kp already offset by lb's values), combined as
// the butterfly combines them.
template <int NT, int CK, int QS, int KS>
__device__ __forceinline__ void ap_leaves(const float* qp, const float* kp, float (&t)[4][CK]) {
    float s0[4][CK], s1[4][CK], s2[4][CK];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int off = NT * 4 * ap_brev3(i);
        float q[4][NT], k[CK][NT];
#pragma unroll
        for (int a = 0; a < 4; a++) ap_ld(q[a], qp + a * 8 * QS + off);
#pragma unroll
        for (int c = 0; c < CK; c++) ap_ld(k[c], kp + c * 4 * KS + off);
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int c = 0; c < CK; c++) {
                float x = __fmul_rn(q[a][0], k[c][0]);
#pragma unroll
                for (int n = 1; n < NT; n++) x = __fadd_rn(x, __fmul_rn(q[a][n], k[c][n]));
                if (i & 1) {
                    x = __fadd_rn(s0[a][c], x);
                    if (i & 2) {
                        x = __fadd_rn(s1[a][c], x);
                        if (i & 4)
                            t[a][c] = __fadd_rn(s2[a][c], x);
                        else
                            s2[a][c] = x;
                    } else {
                        s1[a][c] = x;
                    }
                } else {
                    s0[a][c] = x;
                }
            }
    }
}

// A warp's butterfly over leaf(v0 + l), l < 32, as lane 0 of warp_sum /
// warp_max sees it (op(lower lanes, upper lanes) at every node): four 8-leaf
// subtrees (lanes = lb mod 4) in a loop, to keep the code small. Starting
// each pairing from `id` is exact: id is op's identity on the values here
// (sums of e >= 0 are never -0; maxima that start from -inf never NaN).
template <class Leaf, class Op>
__device__ __forceinline__ float ap_tree32(int v0, Leaf leaf, Op op, float id) {
    float acc = id;
#pragma unroll 1
    for (int mm = 0; mm < 2; mm++) {
        float x = id;
#pragma unroll 1
        for (int h = 0; h < 2; h++) {
            const int lb = h << 1 | mm;
            float s0, s1, s2, t;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float y = leaf(v0 + 4 * ap_brev3(i) + lb);
                if (i & 1) {
                    y = op(s0, y);
                    if (i & 2) {
                        y = op(s1, y);
                        if (i & 4) t = op(s2, y); else s2 = y;
                    } else {
                        s1 = y;
                    }
                } else {
                    s0 = y;
                }
            }
            x = op(x, t);
        }
        acc = op(acc, x);
    }
    return acc;
}

template <int KV, int DK, int DV>
__device__ __forceinline__ void attn_prefill(const float* q, const u32* positions, const void* k, const void* v,
                                             float* part, int n_q, int n_head, int n_kv_head, int n_ctx,
                                             float scale, int window, float softcap, int n_split) {
    typedef ApGeo<DK, DV> Geo;
    constexpr int NT = Geo::NT, KT = Geo::KT, QS = Geo::QS, KS = Geo::KS, DPT = DV / 16;
    constexpr int CK = Geo::CK, WK = 4 * CK;  // keys a thread / a warp tile scores
    extern __shared__ float4 ap_smem4[];
    float* Qs = (float*)ap_smem4;       // [AP_ROWS][QS], lane-major
    float* KVs = Qs + AP_ROWS * QS;     // [KT][KS]: k lane-major, then v as is
    float* sc = KVs + KT * KS;          // [AP_CHUNK][AP_SCS]: scores, then e
    __shared__ int ra[AP_ROWS], rb[AP_ROWS], rt[AP_ROWS], rh[AP_ROWS], rs[AP_ROWS];
    __shared__ float red[2][4][AP_ROWS];
    __shared__ int span[6];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kvh = blockIdx.y, s = blockIdx.z, group = n_head / n_kv_head;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * AP_ROWS;  // the longest rows first
    const size_t kw = (size_t)n_kv_head * DK, vw = (size_t)n_kv_head * DV;
    // Row r: keys [ra, rb) of this split; rs 0 = computed, 1 = NaN (position
    // beyond the cache), 2 = no keys, 3 = past the last row.
    if (tid < AP_ROWS) {
        int g = r0 + tid, st = 3, a = 0x7fffffff, b = 0, t = 0, h = 0;
        if (g < n_q * group) {
            t = g / group, h = kvh * group + g % group;
            u32 pos = positions[t];
            st = 1;
            if (pos < (u32)n_ctx) {
                int start = window > 0 ? max(0, (int)pos + 1 - window) : 0;
                int j0 = start + s * AP_CHUNK, j1 = min((int)pos + 1, j0 + AP_CHUNK);
                st = j0 < j1 ? 0 : 2;
                if (st == 0) a = j0, b = j1;
            }
        }
        ra[tid] = a, rb[tid] = b, rt[tid] = t, rh[tid] = h, rs[tid] = st;
    }
    __syncthreads();
    auto out_row = [&](int r) { return part + (((size_t)rt[r] * n_head + rh[r]) * n_split + s) * (DV + 2); };
    for (int r = warp; r < AP_ROWS; r += AP_THREADS / 32) {
        if (rs[r] == 1 || rs[r] == 2) {
            float* pp = out_row(r);
            for (int d = lane; d < DV + 2; d += 32)
                pp[d] = rs[r] == 1 ? __int_as_float(0x7fc00000) : d == 0 ? NEG_INF : 0.0f;
        }
    }
    // The keys of each 32-row half and of the block.
    if (tid == 0) {
        int a0 = 0x7fffffff, b0 = 0, a1 = 0x7fffffff, b1 = 0;
#pragma unroll 8
        for (int r = 0; r < 32; r++) {
            a0 = min(a0, ra[r]), b0 = max(b0, rb[r]);
            a1 = min(a1, ra[r + 32]), b1 = max(b1, rb[r + 32]);
        }
        span[0] = a0, span[1] = b0, span[2] = a1, span[3] = b1, span[4] = min(a0, a1), span[5] = max(b0, b1);
    }
    __syncthreads();
    const int J0 = span[4], J1 = span[5];
    if (J0 >= J1) return;
    auto krow = [&](int j) { return kv_seg<KV>(k, j, kw, (size_t)kvh * DK); };
    auto vrow = [&](int j) { return kv_seg<KV>(v, j, vw, (size_t)kvh * DV); };
    {
        ApStage<0, AP_ROWS, DK, true, QS> qst;
        qst.load([&](int r) { return (const u8*)(q + ((size_t)rt[r] * n_head + rh[r]) * DK); }, AP_ROWS);
        qst.store(Qs);
    }
    ApStage<KV, KT, DK, true, KS> kst;
    ApStage<KV, KT, DV, false, KS> vst;
    kst.sofs = kv_sofs<KV>(kw, (size_t)kvh * DK), vst.sofs = kv_sofs<KV>(vw, (size_t)kvh * DV);
    kst.load([&](int r) { return krow(J0 + r); }, J1 - J0);

    // Scores. Warp tile: 32 rows (half rh) x WK keys (group kq); lane (rg, kg)
    // takes rows rg + 8 a and keys kg + 4 c.
    const int rg = lane >> 2, kg = lane & 3;
    for (int jt = J0; jt < J1; jt += KT) {
        __syncthreads();  // the last tile's readers are done
        kst.store(KVs);
        __syncthreads();
        if (jt + KT < J1) kst.load([&](int r) { return krow(jt + KT + r); }, J1 - jt - KT);
        for (int tl = warp; tl < 2 * (KT / WK); tl += AP_THREADS / 32) {
            const int half = tl & 1, kq = tl >> 1, kb = jt + kq * WK;
            if (kb >= span[2 * half + 1] || kb + WK <= span[2 * half]) continue;
            const int rr = half * 32 + rg;
            const float* qp = Qs + rr * QS;
            const float* kp = KVs + (kq * WK + kg) * KS;
            // The four 8-leaf subtrees (lanes = lb mod 4), paired as the
            // butterfly pairs them. Adding to +0 first is harmless (above).
            float sco[4][CK];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int c = 0; c < CK; c++) sco[a][c] = 0.0f;
#pragma unroll 1
            for (int mm = 0; mm < 2; mm++) {
                float x[4][CK];
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int c = 0; c < CK; c++) x[a][c] = 0.0f;
#pragma unroll 1
                for (int h = 0; h < 2; h++) {
                    const int lb = h << 1 | mm;
                    float t[4][CK];
                    ap_leaves<NT, CK, QS, KS>(qp + NT * lb, kp + NT * lb, t);
#pragma unroll
                    for (int a = 0; a < 4; a++)
#pragma unroll
                        for (int c = 0; c < CK; c++) x[a][c] = __fadd_rn(x[a][c], t[a][c]);
                }
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int c = 0; c < CK; c++) sco[a][c] = __fadd_rn(sco[a][c], x[a][c]);
            }
            // The butterfly's sums; the softmax scales (and caps) them.
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const int r = rr + 8 * a, lo = ra[r], hi = rb[r];
#pragma unroll
                for (int c = 0; c < CK; c++) {
                    const int j = kb + kg + 4 * c;
                    if (j >= lo && j < hi) sc[((j - J0) & (AP_CHUNK - 1)) * AP_SCS + r] = sco[a][c];
                }
            }
        }
    }
    vst.load([&](int r) { return vrow(J0 + r); }, J1 - J0);  // arrives during the softmax
    __syncthreads();

    // Softmax: thread (row r, virtual warp w) reduces virtual threads 32 w + l.
    {
        const int r = tid % AP_ROWS, w = tid / AP_ROWS;
        const bool live = rs[r] == 0;
        const int a = ra[r], n = rb[r] - a;
        float* scr = sc + r;
        auto at = [&](int i) -> float& { return scr[((a + i - J0) & (AP_CHUNK - 1)) * AP_SCS]; };
        // Virtual thread vt's max over its keys vt, vt + 128, scoring them as
        // attn_partial does (the + 0.0f: above).
        auto vmax = [&](int vt) {
            float x = NEG_INF;
#pragma unroll
            for (int i = vt; i < vt + 256; i += 128)
                if (i < n) {
                    float y = __fmul_rn(__fadd_rn(at(i), 0.0f), scale);
                    if (softcap > 0.0f) y = __fmul_rn(softcap, tanh_c(__fdiv_rn(y, softcap)));
                    at(i) = y;
                    x = fmaxf(x, y);
                }
            return x;
        };
        auto fmax_ = [](float p, float q) { return fmaxf(p, q); };
        float m = live ? ap_tree32(32 * w, vmax, fmax_, NEG_INF) : NEG_INF;
        red[0][w][r] = m;
        __syncthreads();
        m = red[0][0][r];
#pragma unroll
        for (int i = 1; i < 4; i++) m = fmaxf(m, red[0][i][r]);
        auto vsum = [&](int vt) {
            float x = 0.0f;
#pragma unroll
            for (int i = vt; i < vt + 256; i += 128)
                if (i < n) {
                    float e = exp_c(__fsub_rn(at(i), m));
                    at(i) = e;
                    x = __fadd_rn(x, e);
                }
            return x;
        };
        auto fadd_ = [](float p, float q) { return __fadd_rn(p, q); };
        float l = live ? ap_tree32(32 * w, vsum, fadd_, 0.0f) : 0.0f;
        red[1][w][r] = l;
        __syncthreads();
        if (live && w == 0) {
            l = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++) l = __fadd_rn(l, red[1][i][r]);
            float* pp = out_row(r);
            pp[0] = m;
            pp[1] = l;
        }
    }

    // o = sum e v. Thread: rows pr .. pr + 3, dims 4 g + 64 h (h < DV / 64).
    const int pr = warp * 8 + (lane >> 4) * 4, g = lane & 15;
    int la[4], lb4[4], lo = 0, hi = 0x7fffffff, ulo = 0x7fffffff, uhi = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        la[i] = ra[pr + i], lb4[i] = rb[pr + i];
        lo = max(lo, la[i]), hi = min(hi, lb4[i]), ulo = min(ulo, la[i]), uhi = max(uhi, lb4[i]);
    }
    float acc[4][DPT];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int d = 0; d < DPT; d++) acc[i][d] = 0.0f;
    for (int jt = J0; jt < J1; jt += KT) {
        __syncthreads();  // scores (softmax) or the last tile's readers are done
        vst.store(KVs);
        __syncthreads();
        if (jt + KT < J1) vst.load([&](int r) { return vrow(jt + KT + r); }, J1 - jt - KT);
        // Keys every row of the thread has run unmasked; the others per row.
        const int j0 = max(jt, ulo), j1 = min(jt + KT, uhi);
        const int f0 = min(max(j0, lo), j1), f1 = max(min(j1, hi), f0);
        const float* eb = sc + ((jt - J0) & (AP_CHUNK - 1)) * AP_SCS + pr;  // KT divides 256: no wrap in a tile
        auto masked = [&](int j) {
            float vv[DPT / 4][4];
#pragma unroll
            for (int h = 0; h < DPT / 4; h++) ap_ld(vv[h], KVs + (j - jt) * KS + 4 * g + 64 * h);
            const float* er = eb + (j - jt) * AP_SCS;
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (j >= la[i] && j < lb4[i]) {
                    float e = er[i];
#pragma unroll
                    for (int d = 0; d < DPT; d++) acc[i][d] = __fadd_rn(acc[i][d], __fmul_rn(e, vv[d >> 2][d & 3]));
                }
        };
        for (int j = j0; j < f0; j++) masked(j);
#pragma unroll 4
        for (int j = f0; j < f1; j++) {
            float vv[DPT / 4][4], e[4];
#pragma unroll
            for (int h = 0; h < DPT / 4; h++) ap_ld(vv[h], KVs + (j - jt) * KS + 4 * g + 64 * h);
            ap_ld(e, eb + (j - jt) * AP_SCS);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int d = 0; d < DPT; d++) acc[i][d] = __fadd_rn(acc[i][d], __fmul_rn(e[i], vv[d >> 2][d & 3]));
        }
        for (int j = f1; j < j1; j++) masked(j);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (rs[pr + i] != 0) continue;
        float* pp = out_row(pr + i) + 2;
#pragma unroll
        for (int h = 0; h < DPT / 4; h++)
#pragma unroll
            for (int e = 0; e < 4; e++) pp[4 * g + 64 * h + e] = acc[i][4 * h + e];
    }
}

#define AP_ENTRY(NAME, KV, D)                                                                               \
    extern "C" __global__ void __launch_bounds__(AP_THREADS, 1) attn_prefill_##NAME(                        \
        const float* q, const u32* positions, const void* k, const void* v, float* part, int n_q,          \
        int n_head, int n_kv_head, int n_ctx, float scale, int window, float softcap, int n_split) {       \
        pdl_begin();                                                                                        \
        attn_prefill<KV, D, D>(q, positions, k, v, part, n_q, n_head, n_kv_head, n_ctx, scale, window,      \
                               softcap, n_split);                                                           \
    }

AP_ENTRY(f32_d64, 0, 64)
AP_ENTRY(f16_d64, 1, 64)
AP_ENTRY(q8_0_d64, 2, 64)
AP_ENTRY(q4_0_d64, 3, 64)
AP_ENTRY(bf16_d64, 4, 64)
AP_ENTRY(fp8_d64, 5, 64)
AP_ENTRY(f32_d128, 0, 128)
AP_ENTRY(f16_d128, 1, 128)
AP_ENTRY(q8_0_d128, 2, 128)
AP_ENTRY(q4_0_d128, 3, 128)
AP_ENTRY(bf16_d128, 4, 128)
AP_ENTRY(fp8_d128, 5, 128)
AP_ENTRY(f32_d256, 0, 256)
AP_ENTRY(f16_d256, 1, 256)
AP_ENTRY(q8_0_d256, 2, 256)
AP_ENTRY(q4_0_d256, 3, 256)
AP_ENTRY(bf16_d256, 4, 256)
AP_ENTRY(fp8_d256, 5, 256)

// ---- Decode with a GQA group's heads together: attn_partial's `part`, bit
// for bit, each k / v row read once per block instead of once per head (the
// per-query kernel reads the cache group times over: at long contexts that
// traffic, not the arithmetic, bounds decode). A block takes one query, one kv
// head, a slice of up to AD_HEADS of its group's heads (gb of them, slice
// blockIdx.x % slices) and one split. The arithmetic is attn_partial's:
// - score: thread (head quad, key) forms four heads' scores of one key, each
//   the 32 lane partials (d = l, l+32, ..., folded in order from +0) added as
//   lane 0 of warp_sum adds them: leaves in bit-reversed lane order, pairs
//   merged on a stack (the butterfly pairs lanes 16 apart first). No shuffles.
//   Keys are staged AD_KT at a time, lane-major (ApStage), through registers
//   so the next tile's loads overlap this tile's arithmetic.
// - max / sum: per head, attn_partial's own reductions over its 128 threads.
// - o[d]: thread (quad, 4 dims) folds the keys in increasing order; v is
//   staged as k is, the next tile's loads in flight during this tile's sums.
// d_v = d_k.
#define AD_THREADS 128
#define AD_HEADS 16
#define AD_CHUNK 256  // the keys of a split: the host's ATT_CHUNK

template <int DK> struct AdGeo {
    static constexpr int NT = DK / 32;
    static constexpr int KT = DK >= 256 ? 32 : 64;  // keys staged at a time
    static constexpr int QS = DK + 4, KS = DK + 4;  // q / k row strides (floats)
    static constexpr int SMEM = (AD_HEADS * QS + KT * KS + AD_CHUNK * AD_HEADS) * 4;
    static_assert(DK % 64 == 0 && AD_CHUNK % KT == 0 && KT % 32 == 0, "tile shape");
};

__device__ __forceinline__ constexpr int ad_brev5(int i) {
    return ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);
}

// Four heads' q . k for one key (rows lane-major: lane l's NT values at NT l),
// as lane 0 of attn_partial's warp_sum has it. Heads a >= live are not formed.
template <int NT, int QS>
__device__ __forceinline__ void ad_dot4(const float* qp, const float* kp, int live, float (&out)[4]) {
    float st[4][5];
#pragma unroll
    for (int i = 0; i < 32; i++) {
        const int l = ad_brev5(i);
        float kv[NT];
        ap_ld(kv, kp + NT * l);
#pragma unroll
        for (int a = 0; a < 4; a++) {
            if (a >= live) continue;
            float qv[NT];
            ap_ld(qv, qp + a * QS + NT * l);
            float x = 0.0f;
#pragma unroll
            for (int c = 0; c < NT; c++) x = __fadd_rn(x, __fmul_rn(qv[c], kv[c]));
            // Merge with the subtrees this leaf completes (i's trailing ones).
            int b = 0;
#pragma unroll
            for (int bb = 0; bb < 5; bb++) {
                if (((i >> bb) & 1) == 0) break;
                x = __fadd_rn(st[a][bb], x);
                b = bb + 1;
            }
            if (i == 31)
                out[a] = x;
            else
                st[a][b] = x;
        }
    }
}

template <int KV, int DK>
__device__ __forceinline__ void attn_decode(const float* q, const u32* positions, const void* k, const void* v,
                                            float* part, int n_head, int n_kv_head, int dv, int n_ctx, float scale,
                                            int window, float softcap, int n_split, int gb) {
    typedef AdGeo<DK> Geo;
    constexpr int NT = Geo::NT, KT = Geo::KT, QS = Geo::QS, KS = Geo::KS;
    extern __shared__ float4 ad_smem4[];
    float* Qs = (float*)ad_smem4;      // [AD_HEADS][QS], lane-major
    float* Ks = Qs + AD_HEADS * QS;    // [KT][KS], lane-major
    float* Sc = Ks + KT * KS;          // [AD_CHUNK][AD_HEADS]: scores, then e
    __shared__ float red[2][AD_HEADS][AD_THREADS / 32];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int group = n_head / n_kv_head, slices = (group + gb - 1) / gb;
    const int kvh = blockIdx.x / slices, h0 = kvh * group + (blockIdx.x % slices) * gb;
    const int t = blockIdx.y, s = blockIdx.z;
    gb = min(gb, kvh * group + group - h0);  // the last slice may be short
    const int quads = (gb + 3) / 4;
    auto out_row = [&](int g) { return part + (((size_t)t * n_head + h0 + g) * n_split + s) * (dv + 2); };
    u32 pos = positions[t];
    int start = window > 0 ? max(0, (int)pos + 1 - window) : 0;
    int j0 = start + s * AD_CHUNK;
    int j1 = min((int)pos + 1, j0 + AD_CHUNK);
    if (pos >= (u32)n_ctx || j0 >= j1) {
        const bool nan = pos >= (u32)n_ctx;
        for (int i = tid; i < gb * (dv + 2); i += AD_THREADS) {
            int g = i / (dv + 2), d = i % (dv + 2);
            out_row(g)[d] = nan ? __int_as_float(0x7fc00000) : d == 0 ? NEG_INF : 0.0f;
        }
        return;
    }
    const int n = j1 - j0;
    const size_t kw = (size_t)n_kv_head * DK, vw = (size_t)n_kv_head * dv;
    auto krow = [&](int j) { return kv_seg<KV>(k, j, kw, (size_t)kvh * DK); };
    ApStage<KV, KT, DK, true, KS, AD_THREADS> kst;
    kst.sofs = kv_sofs<KV>(kw, (size_t)kvh * DK);
    kst.load([&](int r) { return krow(j0 + r); }, n);
    for (int i = tid; i < gb * DK; i += AD_THREADS) {
        int g = i / DK, d = i % DK;
        Qs[g * QS + NT * (d & 31) + (d >> 5)] = q[((size_t)t * n_head + h0 + g) * DK + d];
    }
    for (int jt = 0; jt < n; jt += KT) {
        __syncthreads();  // the last tile's readers are done
        kst.store(Ks);
        __syncthreads();
        if (jt + KT < n) kst.load([&](int r) { return krow(j0 + jt + KT + r); }, n - jt - KT);
        for (int task = warp; task < quads * (KT / 32); task += AD_THREADS / 32) {
            const int qd = task % quads, sub = task / quads, key = jt + sub * 32 + lane;
            if (jt + sub * 32 >= n) continue;
            float sco[4];
            ad_dot4<NT, QS>(Qs + 4 * qd * QS, Ks + (sub * 32 + lane) * KS, gb - 4 * qd, sco);
            if (key >= n) continue;
#pragma unroll
            for (int a = 0; a < 4; a++) {
                if (4 * qd + a >= gb) continue;
                float y = __fmul_rn(sco[a], scale);
                if (softcap > 0.0f) y = __fmul_rn(softcap, tanh_c(__fdiv_rn(y, softcap)));
                Sc[key * AD_HEADS + 4 * qd + a] = y;
            }
        }
    }
    auto vrow = [&](int j) { return kv_seg<KV>(v, j, vw, (size_t)kvh * DK); };
    ApStage<KV, KT, DK, false, KS, AD_THREADS> vst;
    vst.sofs = kv_sofs<KV>(vw, (size_t)kvh * DK);
    vst.load([&](int r) { return vrow(j0 + r); }, n);  // arrives during the softmax
    __syncthreads();
    // Softmax, per head as attn_partial reduces it.
    for (int g = 0; g < gb; g++) {
        float m = NEG_INF;
        for (int i = tid; i < n; i += AD_THREADS) m = fmaxf(m, Sc[i * AD_HEADS + g]);
        m = warp_max(m);
        if (lane == 0) red[0][g][warp] = m;
    }
    __syncthreads();
    for (int g = 0; g < gb; g++) {
        float m = red[0][g][0];
#pragma unroll
        for (int w = 1; w < AD_THREADS / 32; w++) m = fmaxf(m, red[0][g][w]);
        float l = 0.0f;
        for (int i = tid; i < n; i += AD_THREADS) {
            float e = exp_c(__fsub_rn(Sc[i * AD_HEADS + g], m));
            Sc[i * AD_HEADS + g] = e;
            l = __fadd_rn(l, e);
        }
        l = warp_sum(l);
        if (lane == 0) red[1][g][warp] = l;
    }
    __syncthreads();
    if (tid < gb) {
        float m = red[0][tid][0], l = 0.0f;
#pragma unroll
        for (int w = 1; w < AD_THREADS / 32; w++) m = fmaxf(m, red[0][tid][w]);
#pragma unroll
        for (int w = 0; w < AD_THREADS / 32; w++) l = __fadd_rn(l, red[1][tid][w]);
        float* pp = out_row(tid);
        pp[0] = m;
        pp[1] = l;
    }
    // o = sum e v: thread (quad, dims d0 .. d0 + 3) folds the keys in order,
    // v staged KT rows at a time in the k tile's place.
    constexpr int DQ = DK / 4, TPT = (AD_HEADS / 4 * DQ + AD_THREADS - 1) / AD_THREADS;
    float acc[TPT][4][4];
#pragma unroll
    for (int u = 0; u < TPT; u++)
#pragma unroll
        for (int a = 0; a < 4; a++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[u][a][c] = 0.0f;
    for (int jt = 0; jt < n; jt += KT) {
        __syncthreads();  // the softmax, or the last tile's readers, are done
        vst.store(Ks);
        __syncthreads();
        if (jt + KT < n) vst.load([&](int r) { return vrow(j0 + jt + KT + r); }, n - jt - KT);
        const int nk = min(KT, n - jt);
#pragma unroll
        for (int u = 0; u < TPT; u++) {
            const int task = tid + u * AD_THREADS, qd = task / DQ, d0 = 4 * (task % DQ);
            if (qd >= quads) continue;
#pragma unroll 8
            for (int i = 0; i < nk; i++) {
                float4 x = *(const float4*)(Ks + i * KS + d0);
                float4 e = *(const float4*)(Sc + (jt + i) * AD_HEADS + 4 * qd);
                const float xv[4] = {x.x, x.y, x.z, x.w}, ev[4] = {e.x, e.y, e.z, e.w};
#pragma unroll
                for (int a = 0; a < 4; a++)
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[u][a][c] = __fadd_rn(acc[u][a][c], __fmul_rn(ev[a], xv[c]));
            }
        }
    }
#pragma unroll
    for (int u = 0; u < TPT; u++) {
        const int task = tid + u * AD_THREADS, qd = task / DQ, d0 = 4 * (task % DQ);
        if (qd >= quads) continue;
#pragma unroll
        for (int a = 0; a < 4; a++) {
            if (4 * qd + a >= gb) continue;
            float* pp = out_row(4 * qd + a) + 2 + d0;
#pragma unroll
            for (int c = 0; c < 4; c++) pp[c] = acc[u][a][c];
        }
    }
}

#define AD_ENTRY(NAME, KV, D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(AD_THREADS, 3) attn_decode_##NAME(                             \
        const float* q, const u32* positions, const void* k, const void* v, float* part, int n_head,            \
        int n_kv_head, int dv, int n_ctx, float scale, int window, float softcap, int n_split, int gb) {       \
        pdl_begin();                                                                                           \
        attn_decode<KV, D>(q, positions, k, v, part, n_head, n_kv_head, dv, n_ctx, scale, window, softcap,     \
                           n_split, gb);                                                                       \
    }
// Rows of several sequences (a batched step of the server), row t over the
// caches at kcs[t] / vcs[t], as attn_partial_rows_*.
#define AD_ROWS_ENTRY(NAME, KV, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(AD_THREADS, 3) attn_decode_rows_##NAME(                        \
        const float* q, const u32* positions, const u64* kcs, const u64* vcs, float* part, int n_head,          \
        int n_kv_head, int dv, int n_ctx, float scale, int window, float softcap, int n_split, int gb) {       \
        pdl_begin();                                                                                           \
        int t = blockIdx.y;                                                                                    \
        attn_decode<KV, D>(q, positions, (const void*)kcs[t], (const void*)vcs[t], part, n_head, n_kv_head, dv, \
                          n_ctx, scale, window, softcap, n_split, gb);                                         \
    }

AD_ENTRY(f32_d64, 0, 64)
AD_ENTRY(f16_d64, 1, 64)
AD_ENTRY(q8_0_d64, 2, 64)
AD_ENTRY(q4_0_d64, 3, 64)
AD_ENTRY(bf16_d64, 4, 64)
AD_ENTRY(fp8_d64, 5, 64)
AD_ENTRY(f32_d128, 0, 128)
AD_ENTRY(f16_d128, 1, 128)
AD_ENTRY(q8_0_d128, 2, 128)
AD_ENTRY(q4_0_d128, 3, 128)
AD_ENTRY(bf16_d128, 4, 128)
AD_ENTRY(fp8_d128, 5, 128)
AD_ENTRY(f32_d256, 0, 256)
AD_ENTRY(f16_d256, 1, 256)
AD_ENTRY(q8_0_d256, 2, 256)
AD_ENTRY(q4_0_d256, 3, 256)
AD_ENTRY(bf16_d256, 4, 256)
AD_ENTRY(fp8_d256, 5, 256)
AD_ROWS_ENTRY(f32_d64, 0, 64)
AD_ROWS_ENTRY(f16_d64, 1, 64)
AD_ROWS_ENTRY(q8_0_d64, 2, 64)
AD_ROWS_ENTRY(q4_0_d64, 3, 64)
AD_ROWS_ENTRY(bf16_d64, 4, 64)
AD_ROWS_ENTRY(fp8_d64, 5, 64)
AD_ROWS_ENTRY(f32_d128, 0, 128)
AD_ROWS_ENTRY(f16_d128, 1, 128)
AD_ROWS_ENTRY(q8_0_d128, 2, 128)
AD_ROWS_ENTRY(q4_0_d128, 3, 128)
AD_ROWS_ENTRY(bf16_d128, 4, 128)
AD_ROWS_ENTRY(fp8_d128, 5, 128)
AD_ROWS_ENTRY(f32_d256, 0, 256)
AD_ROWS_ENTRY(f16_d256, 1, 256)
AD_ROWS_ENTRY(q8_0_d256, 2, 256)
AD_ROWS_ENTRY(q4_0_d256, 3, 256)
AD_ROWS_ENTRY(bf16_d256, 4, 256)
AD_ROWS_ENTRY(fp8_d256, 5, 256)
