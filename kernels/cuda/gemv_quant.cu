// Quantized GEMV (decode) and tiled GEMM (prefill) on q8_0 / q8_K activations,
// one kernel per weight format. Twin: pulsar_kernels::Kernels::matmul.
//
// Layout: W is `rows` rows of `cols` values of the format, rows end to end;
// X is n_tok activation rows (q8_0 for the 32-value formats, q8_K for the K
// and IQ formats), Y is [n_tok, rows] f32.
//
// GEMV: one warp per weight row, lanes stride over the row's 32-value units.
// GEMM: one warp per weight row and tile of GEMM_TT tokens: each unit of the
// weight row is unpacked once and dotted against the tile's tokens.

#define GEMV_WARPS 4
#define GEMM_TT 8

template <int F>
__device__ __forceinline__ void gemv_impl(const u8* __restrict__ W, const u8* __restrict__ X,
                                          float* __restrict__ Y, int rows, int cols, const u64* tab) {
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    int units = cols / 32;
    const u8* w = W + (size_t)row * w_row_bytes<F>(cols);
    float acc = warp_sum(row_dot_partial<F>(w, X, units, tab));
    if ((threadIdx.x & 31) == 0) Y[row] = acc;
}

template <int F>
__device__ __forceinline__ void gemm_impl(const u8* __restrict__ W, const u8* __restrict__ X,
                                          float* __restrict__ Y, int rows, int cols, int n_tok,
                                          const u64* tab) {
    int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    int t0 = blockIdx.y * GEMM_TT;
    int nt = min(GEMM_TT, n_tok - t0);
    int units = cols / 32;
    size_t xrb = act_row_bytes<F>(cols);
    const u8* w = W + (size_t)row * w_row_bytes<F>(cols);
    const u8* x0 = X + (size_t)t0 * xrb;
    float acc[GEMM_TT];
#pragma unroll
    for (int t = 0; t < GEMM_TT; t++) acc[t] = 0.0f;
    for (int k = threadIdx.x & 31; k < units; k += 32) {
        Unit u = load_unit<F>(w, k, tab);
#pragma unroll
        for (int t = 0; t < GEMM_TT; t++) {
            if (t < nt) {
                XUnit xv = load_x<Fmt<F>::K, Fmt<F>::MINS>(x0 + t * xrb, k);
                acc[t] += unit_dot<F>(u, xv);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < GEMM_TT; t++) {
        float v = warp_sum(acc[t]);
        if (t < nt && (threadIdx.x & 31) == 0) Y[(size_t)(t0 + t) * rows + row] = v;
    }
}

// ---- GEMV with the weight row staged through shared memory ----
//
// The same arithmetic as gemv_impl, but each warp first copies a chunk of its
// weight row (STAGE_UNITS units, whole blocks) into shared memory with
// coalesced 16-byte loads, then unpacks units from there: far fewer global
// load instructions than unpacking straight from global memory byte by byte.
// The last 16-byte load of a chunk may read up to 15 bytes past the row (never
// past the 16-byte-aligned granule holding its last byte).

#define STAGE_UNITS 32
#define STAGE_V4 70 // 16-byte words per warp: 32 q8_0 blocks (1088 bytes) + alignment slack

struct alignas(16) v4u {
    u32 x, y, z, w;
};

template <int F>
__device__ __forceinline__ void gemv_staged_impl(const u8* __restrict__ W, const u8* __restrict__ X,
                                                 float* __restrict__ Y, int rows, int cols, const u64* tab) {
    __shared__ v4u stage[GEMV_WARPS][STAGE_V4];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * GEMV_WARPS + warp;
    if (row >= rows) return;
    int units = cols / 32;
    const u8* w = W + (size_t)row * w_row_bytes<F>(cols);
    v4u* sm = stage[warp];
    float acc = 0.0f;
    for (int k0 = 0; k0 < units; k0 += STAGE_UNITS) {
        int nu = min(STAGE_UNITS, units - k0);
        const u8* src = w + (size_t)(k0 / Fmt<F>::UNITS) * Fmt<F>::BYTES;
        int nbytes = nu / Fmt<F>::UNITS * Fmt<F>::BYTES;
        size_t addr = (size_t)src;
        int head = (int)(addr & 15);
        const v4u* s16 = (const v4u*)(addr - head);
        int n16 = (head + nbytes + 15) >> 4;
        __syncwarp();
        for (int i = lane; i < n16; i += 32) sm[i] = s16[i];
        __syncwarp();
        if (lane < nu) {
            Unit u = load_unit<F>((const u8*)sm + head, lane, tab);
            XUnit xv = load_x<Fmt<F>::K, Fmt<F>::MINS>(X, k0 + lane);
            acc += unit_dot<F>(u, xv);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) Y[row] = acc;
}

// ---- int8 tensor-core GEMM (sm_80+): mma.sync m16n8k16 s8 ----
//
// One warp computes a tile of 16 weight rows x (8 * MMA_NT) tokens. For every
// 32-value unit it issues one m16n8k16 per half (values 0..15 and 16..31), so
// both halves' integer sums come out exact and are scaled like unit_dot:
// dx * d * (s0 * c_lo + s1 * c_hi) - dx * dm * (m0 * y_lo + m1 * y_hi).
// Fragment layout (PTX ISA, m16n8k16 .s8): lane = 4 g + t holds A rows g and
// g + 8, k = 4t..4t+3; B column (token) g, k = 4t..4t+3; C rows g / g + 8,
// columns 2t, 2t + 1.

#define MMA_WARPS 4
#define MMA_NT 4

__device__ __forceinline__ void mma_s8_16816(int (&c)[4], int a0, int a1, int b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// q[i] for a run-time i in 0..3 without indexing a register array (which
// would spill the array to local memory).
__device__ __forceinline__ int pick4(const int* q, int i) {
    return i == 0 ? q[0] : i == 1 ? q[1] : i == 2 ? q[2] : q[3];
}

template <int F>
__device__ __forceinline__ void gemm_mma_impl(const u8* __restrict__ W, const u8* __restrict__ X,
                                              float* __restrict__ Y, int rows, int cols, int n_tok,
                                              const u64* tab) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t = lane & 3;
    int r0 = (blockIdx.x * MMA_WARPS + warp) * 16;
    if (r0 >= rows) return;
    int tok0 = blockIdx.y * (8 * MMA_NT);
    int units = cols / 32;
    size_t wrb = w_row_bytes<F>(cols), xrb = act_row_bytes<F>(cols);
    int ra = r0 + g, rb = r0 + g + 8;
    // Rows and tokens past the end load row / token 0 (valid memory); their results are dropped.
    const u8* wa = W + (size_t)(ra < rows ? ra : 0) * wrb;
    const u8* wb = W + (size_t)(rb < rows ? rb : 0) * wrb;
    float acc[MMA_NT][4];
#pragma unroll
    for (int n = 0; n < MMA_NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    for (int k = 0; k < units; k++) {
        Unit ua = load_unit<F>(wa, k, tab);
        Unit ub = load_unit<F>(wb, k, tab);
        int a_lo0 = pick4(ua.q, t), a_hi0 = pick4(ua.q + 4, t);
        int a_lo1 = pick4(ub.q, t), a_hi1 = pick4(ub.q + 4, t);
#pragma unroll
        for (int n = 0; n < MMA_NT; n++) {
            int tk = tok0 + 8 * n + g;
            XUnit xv = load_x<Fmt<F>::K, Fmt<F>::MINS>(X + (size_t)(tk < n_tok ? tk : 0) * xrb, k);
            int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
            mma_s8_16816(lo, a_lo0, a_lo1, pick4(xv.q, t));
            mma_s8_16816(hi, a_hi0, a_hi1, pick4(xv.q + 4, t));
            // Columns 2t and 2t + 1 are tokens whose scales sit in lanes 8t and 8t + 4.
            float dx0 = __shfl_sync(FULL_MASK, xv.d, 8 * t);
            float dx1 = __shfl_sync(FULL_MASK, xv.d, 8 * t + 4);
            acc[n][0] += dx0 * ua.d * (float)(ua.s0 * lo[0] + ua.s1 * hi[0]);
            acc[n][1] += dx1 * ua.d * (float)(ua.s0 * lo[1] + ua.s1 * hi[1]);
            acc[n][2] += dx0 * ub.d * (float)(ub.s0 * lo[2] + ub.s1 * hi[2]);
            acc[n][3] += dx1 * ub.d * (float)(ub.s0 * lo[3] + ub.s1 * hi[3]);
            if (Fmt<F>::MINS) {
                int y00 = __shfl_sync(FULL_MASK, xv.y0, 8 * t), y10 = __shfl_sync(FULL_MASK, xv.y1, 8 * t);
                int y01 = __shfl_sync(FULL_MASK, xv.y0, 8 * t + 4), y11 = __shfl_sync(FULL_MASK, xv.y1, 8 * t + 4);
                acc[n][0] -= dx0 * ua.dm * (float)(ua.m0 * y00 + ua.m1 * y10);
                acc[n][1] -= dx1 * ua.dm * (float)(ua.m0 * y01 + ua.m1 * y11);
                acc[n][2] -= dx0 * ub.dm * (float)(ub.m0 * y00 + ub.m1 * y10);
                acc[n][3] -= dx1 * ub.dm * (float)(ub.m0 * y01 + ub.m1 * y11);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < MMA_NT; n++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = i < 2 ? ra : rb;
            int tok = tok0 + 8 * n + 2 * t + (i & 1);
            if (row < rows && tok < n_tok) Y[(size_t)tok * rows + row] = acc[n][i];
        }
    }
}

#define GEMV_ENTRY(NAME, F)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_##NAME(const u8* W, const u8* X, float* Y, int rows, int cols, const u64* tab) {  \
        gemv_impl<F>(W, X, Y, rows, cols, tab);                                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemm_##NAME(                 \
        const u8* W, const u8* X, float* Y, int rows, int cols, int n_tok, const u64* tab) {    \
        gemm_impl<F>(W, X, Y, rows, cols, n_tok, tab);                                          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) gemm_mma_##NAME(              \
        const u8* W, const u8* X, float* Y, int rows, int cols, int n_tok, const u64* tab) {    \
        gemm_mma_impl<F>(W, X, Y, rows, cols, n_tok, tab);                                      \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                              \
        gemv_staged_##NAME(const u8* W, const u8* X, float* Y, int rows, int cols, const u64* tab) { \
        gemv_staged_impl<F>(W, X, Y, rows, cols, tab);                                          \
    }

GEMV_ENTRY(q8_0, F_Q8_0)
GEMV_ENTRY(q4_0, F_Q4_0)
GEMV_ENTRY(q4_1, F_Q4_1)
GEMV_ENTRY(q5_0, F_Q5_0)
GEMV_ENTRY(q5_1, F_Q5_1)
GEMV_ENTRY(q2_k, F_Q2_K)
GEMV_ENTRY(q3_k, F_Q3_K)
GEMV_ENTRY(q4_k, F_Q4_K)
GEMV_ENTRY(q5_k, F_Q5_K)
GEMV_ENTRY(q6_k, F_Q6_K)
GEMV_ENTRY(iq2_xxs, F_IQ2_XXS)
GEMV_ENTRY(iq2_xs, F_IQ2_XS)
GEMV_ENTRY(iq3_xxs, F_IQ3_XXS)

// ---- activation quantization, bit-identical to the CPU's Activations ----

// q8_0: one warp per block of 32 (lane = value). d = amax / 127, q = round(x / d)
// (ties away from zero), d stored as f16 (kernels/src/quant/q8_0.rs).
extern "C" __global__ void quantize_q8_0(const float* __restrict__ x, u8* __restrict__ out, int n_blocks) {
    int blk = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= n_blocks) return;
    int lane = threadIdx.x & 31;
    float v = x[(size_t)blk * 32 + lane];
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    u8* b = out + (size_t)blk * 34;
    float r = roundf(v * id);
    int q = r != r ? 0 : (int)fminf(fmaxf(r, -127.0f), 127.0f);
    b[2 + lane] = (u8)(i8)q;
    if (lane == 0) {
        u32 h = f2h(d);
        b[0] = (u8)(h & 0xffu);
        b[1] = (u8)((h >> 8) & 0xffu);
    }
}

// q8_K: one warp per superblock of 256 (lane = 8 consecutive values). The first
// value of largest magnitude maps to -127: iscale = -127 / max,
// q = round_ties_even(iscale x), d = 1 / iscale; 16-value sums kept
// (kernels/src/quant/q8_k.rs).
extern "C" __global__ void quantize_q8_k(const float* __restrict__ x, u8* __restrict__ out, int n_blocks) {
    int blk = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (blk >= n_blocks) return;
    int lane = threadIdx.x & 31;
    const float* xb = x + (size_t)blk * 256 + lane * 8;
    float v[8];
    float amax = 0.0f;
    int first = 8;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        v[i] = xb[i];
        amax = fmaxf(amax, fabsf(v[i]));
    }
    float m = warp_max(amax);
#pragma unroll
    for (int i = 7; i >= 0; i--)
        if (fabsf(v[i]) == m) first = i;
    // The lowest index holding the maximum magnitude, across lanes.
    int idx = first < 8 ? lane * 8 + first : 1 << 30;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) idx = min(idx, __shfl_xor_sync(FULL_MASK, idx, o));
    float vmax = __shfl_sync(FULL_MASK, first < 8 ? v[first & 7] : 0.0f, (idx >> 3) & 31);
    u8* b = out + (size_t)blk * 292;
    if (m == 0.0f || idx == (1 << 30)) {
        for (int i = lane; i < 292; i += 32) b[i] = 0;
        return;
    }
    float iscale = -127.0f / vmax;
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float r = rintf(iscale * v[i]);
        int q = (int)fminf(fmaxf(r, -127.0f), 127.0f);
        sum += q;
        b[4 + lane * 8 + i] = (u8)(i8)q;
    }
    // Lanes 2j and 2j+1 hold the 16 values of sum j.
    int pair = sum + __shfl_xor_sync(FULL_MASK, sum, 1);
    if ((lane & 1) == 0) {
        i16 s = (i16)pair;
        b[260 + lane] = (u8)(s & 0xff);
        b[261 + lane] = (u8)((u16)s >> 8);
    }
    if (lane == 0) {
        float d = 1.0f / iscale;
        u32 bits = __float_as_uint(d);
        b[0] = bits & 0xff;
        b[1] = (bits >> 8) & 0xff;
        b[2] = (bits >> 16) & 0xff;
        b[3] = bits >> 24;
    }
}
