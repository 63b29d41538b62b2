// Quantized GEMV (decode) and GEMMs (prefill) on q8_0 / q8_K activations,
// one kernel per weight format. Twin: pulsar_kernels::Kernels::matmul.
//
// Layout: W is `rows` rows of `cols` values of the format, rows end to end;
// X is n_tok activation rows (q8_0 for the 32-value formats, q8_K for the K
// and IQ formats), Y is [n_tok, rows] f32.
//
// Every kernel here sums each dot in the canonical order (quant_units.cuh,
// block_value): exact integer sums per block, one float per block, those
// added in block order. So the GEMV, both GEMMs and the expert kernels give
// the same bits for the same row and token, and the CPU's scalar dot too.
//
// gemv: one warp per 1..8 rows, streamed through shared memory (decode_dot.cuh).
// gemm: one warp per 4 rows x 8 tokens (rows_dot), any GPU with dp4a.
// gemm_mma: int8 tensor cores (sm_80+), tiles of 64 rows x 64 tokens staged
// through shared memory by cp.async, double-buffered; gemm_mma_grouped the
// same over a list of (expert, 32-token run) work items.

#define QV_WARPS 4
#define QM_R 4
#define QM_T 8

// gemv: up to DD_WARPS warps a block; a warp takes ng groups of rpw rows
// (decode_dot.cuh), streamed step by step through its shared-memory ring. The
// host picks fewer rows a warp for short matrices so enough warps stream the
// weights (a row's dot cannot be split across warps without changing its
// summation order). xsb > 0: the activation row is staged in the first xsb
// bytes of dynamic shared memory.
//
// Up to three matrices on the same activation row in one launch (decode's q,
// k and v projections): blocks [0, b1) take W0 -> Y0 (rows0 rows), [b1, b2)
// W1 -> Y1, [b2, grid) W2 -> Y2. A single matrix passes b1 = b2 = grid.
template <int F>
__device__ __forceinline__ void gemv_impl(const u8* __restrict__ W0, const u8* __restrict__ W1,
                                          const u8* __restrict__ W2, float* Y0, float* Y1, float* Y2, int rows0,
                                          int rows1, int rows2, int b1, int b2, const u8* __restrict__ X, int cols,
                                          int rpw, int ng, int xsb, const u64* tab) {
    __shared__ __align__(16) float vals[DD_WARPS][DD_MAX_ROWS * DD_VALS_STRIDE];
    extern __shared__ __align__(16) u8 gemv_stage[];
    int m = blockIdx.x < b1 ? 0 : blockIdx.x < b2 ? 1 : 2;
    const u8* W = m == 0 ? W0 : m == 1 ? W1 : W2;
    float* Y = m == 0 ? Y0 : m == 1 ? Y1 : Y2;
    int rows = m == 0 ? rows0 : m == 1 ? rows1 : rows2;
    int blk = blockIdx.x - (m == 0 ? 0 : m == 1 ? b1 : b2);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int first = (blk * (blockDim.x >> 5) + warp) * rpw * ng;
    DDWork wk{W, W, 1, first, min(rpw * ng, rows - first), rpw, w_row_bytes<F>(cols)};
    dd_dots<F>(gemv_stage, xsb, X, act_row_bytes<F>(cols), wk, cols / 32, vals[warp], tab, [&](int g, int n, float v) {
        if (lane < n) Y[first + g * rpw + lane] = v;
    });
}

template <int F>
__device__ __forceinline__ void gemm_impl(const u8* __restrict__ W, const u8* __restrict__ X,
                                          float* __restrict__ Y, int rows, int cols, int n_tok,
                                          const u64* tab) {
    __shared__ float vals[QV_WARPS][QM_R * QM_T * VALS_STRIDE];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row0 = (blockIdx.x * QV_WARPS + warp) * QM_R;
    if (row0 >= rows) return;
    int t0 = blockIdx.y * QM_T;
    size_t wrb = w_row_bytes<F>(cols), xrb = act_row_bytes<F>(cols);
    int nr = min(QM_R, rows - row0), nt = min(QM_T, n_tok - t0);
    float y = rows_dot<F, QM_R, QM_T>(W + (size_t)row0 * wrb, wrb, nr, X + (size_t)t0 * xrb, xrb, nt, cols / 32,
                                      tab, vals[warp]);
    int t = lane / QM_R, r = lane % QM_R;
    if (t < nt && r < nr) Y[(size_t)(t0 + t) * rows + row0 + r] = y;
}

// ---- int8 tensor-core GEMM (sm_80+): mma.sync m16n8k16 s8 ----
//
// A block of MM_WARPS warps computes MM_ROWS weight rows x 8 NT tokens; warp
// w owns rows 16w .. 16w + 15 and all the tokens (NT tiles of 8). A stage
// is 8 units (256 values: one superblock, or eight 32-value blocks) of every
// row and token, copied raw into shared memory as whole 16-byte granules (the
// phase of each row is kept, so the unit loaders see the global alignment);
// the next stage's copies fly while this one computes.
//
// Per unit: A fragments from the two rows a lane owns, B from the activation
// rows; the integer products come out exact from the mma and gather in S
// (times the unit scales) and M (the mins, as a second product against the
// replicated mins); at each block's end the block value joins acc.
// Fragment layout (PTX ISA, m16n8k16 .s8): lane = 4 g + t holds A rows g and
// g + 8, k = 4t..4t+3; B column (token) g, k = 4t..4t+3; C rows g / g + 8,
// columns 2t, 2t + 1.

#define MM_WARPS 4
#define MM_ROWS 64
#define MM_WSTRIDE 304 // 19 granules: a row's stage (<= 272 bytes) at any phase
#define MM_XSTRIDE 336 // 21 granules: a token's stage (<= 292 bytes) at any phase
// One stage for NT tiles of 8 tokens; two stages are the dynamic shared
// memory (kernels.rs MMA_SMEM_BYTES for NT = 8; the grouped kernel uses NT = 4).
#define MM_STAGE_BYTES(NT) (MM_ROWS * MM_WSTRIDE + 8 * (NT) * MM_XSTRIDE)

__device__ __forceinline__ void mma_s8_16816(int (&c)[4], int a0, int a1, int b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ void mma_s8_16832(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// q[i] for a run-time i in 0..3 without indexing a register array (which
// would spill the array to local memory).
__device__ __forceinline__ int pick4(const int* q, int i) {
    return i == 0 ? q[0] : i == 1 ? q[1] : i == 2 ? q[2] : q[3];
}

// The two words of unit k one MMA lane feeds: words t (values 4t..4t+3) and
// 4 + t (values 16 + 4t..), with the unit's scales, mins and floats.
struct UnitWords {
    int lo, hi;
    int s0, s1, m0, m1;
    float d, dm;
};

// Any format: the whole unit, then the lane's two words.
template <int F> __device__ __forceinline__ UnitWords unit_words(const u8* w, int k, int t, const u64* tab) {
    Unit u = load_unit<F>(w, k, tab);
    return UnitWords{pick4(u.q, t), pick4(u.q + 4, t), u.s0, u.s1, u.m0, u.m1, u.d, u.dm};
}
// The formats of the benchmarks unpack only those two words (the same bits
// load_unit gives them).
template <> __device__ __forceinline__ UnitWords unit_words<F_Q8_0>(const u8* w, int k, int t, const u64*) {
    const u8* b = w + 34 * k;
    return UnitWords{(int)rd32_a2(b + 2 + 4 * t), (int)rd32_a2(b + 18 + 4 * t), 1, 1, 0, 0, rdh(b), 0.0f};
}
template <> __device__ __forceinline__ UnitWords unit_words<F_Q2_K>(const u8* w, int k, int t, const u64*) {
    const u8* b = w + 84 * (k >> 3);
    int j = k & 7, c = j >> 2, s = j & 3;
    const u8* q = b + 16 + 32 * c + 4 * t;
    u32 sa = b[2 * j], sb = b[2 * j + 1];
    return UnitWords{(int)((rd32_a4(q) >> (2 * s)) & 0x03030303u), (int)((rd32_a4(q + 16) >> (2 * s)) & 0x03030303u),
                     (int)(sa & 0xf), (int)(sb & 0xf), (int)(sa >> 4), (int)(sb >> 4), rdh(b + 80), rdh(b + 82)};
}
template <> __device__ __forceinline__ UnitWords unit_words<F_Q4_K>(const u8* w, int k, int t, const u64*) {
    const u8* b = w + 144 * (k >> 3);
    int j = k & 7;
    const u8* q = b + 16 + 32 * (j >> 1) + 4 * t;
    int sh = 4 * (j & 1), sc, m;
    k4_scale_min(b + 4, j, sc, m);
    return UnitWords{(int)((rd32_a4(q) >> sh) & 0x0f0f0f0fu), (int)((rd32_a4(q + 16) >> sh) & 0x0f0f0f0fu), sc, sc, m, m,
                     rdh(b), rdh(b + 2)};
}

// How a unit meets the int8 MMA: one m16n8k32 accumulating the block's
// integer sum S in place (the 32-value formats: scales 1), one whose sum the
// unit's single scale then multiplies (EQ), one on levels pre-multiplied by
// their half's scale (PRESCALE, q2_K: levels 0..3 times scales 0..15 stay
// below 128, bytewise with no carry), else two m16n8k16 for the halves.
// UNROLL: the unit loop unrolls (formats whose unrolled loop fits the
// registers without spilling; q5_K spilled).
template <int F> struct MmaKind {
    enum { PRESCALE = F == F_Q2_K, UNROLL = F == F_Q8_0 || F == F_Q2_K || F == F_Q4_K || F == F_Q4_0 };
};


// Bytes of stage `it` of a weight row / an activation row, and their offsets.
template <int F> struct Stage {
    int units, wbytes, xbytes;
    size_t woff, xoff;
    __device__ __forceinline__ Stage(int it, int total_units) {
        if (Fmt<F>::UNITS == 8) {
            units = 8;
            wbytes = Fmt<F>::BYTES;
            woff = (size_t)it * Fmt<F>::BYTES;
        } else {
            units = min(8, total_units - 8 * it);
            wbytes = units * Fmt<F>::BYTES;
            woff = (size_t)it * 8 * Fmt<F>::BYTES;
        }
        xbytes = Fmt<F>::K ? 292 : units * 34;
        xoff = (size_t)it * (Fmt<F>::K ? 292 : 8 * 34);
    }
};

// One stage's copies. Each thread owns one row (or token) and a fixed run of
// its granules, so a stage costs it one row address and a few copies: the
// loop over every (row, granule) of the stride spent a division and 64-bit
// arithmetic on each, most of them idle (q2_K's 84 bytes span 7 of 19).
template <int F, int NT>
__device__ __forceinline__ void mm_issue(u8* buf, const u8* W, const u8* X, int rows, int n_tok, size_t wrb,
                                         size_t xrb, int r0, int tok0, const Stage<F>& st) {
    // Granules a stage's bytes can span at any phase.
    const int NGW = ((Fmt<F>::UNITS == 8 ? 1 : 8) * Fmt<F>::BYTES + 15) / 16 + 1;
    const int NGX = ((Fmt<F>::K ? 292 : 8 * 34) + 15) / 16 + 1;
    const int THREADS = MM_WARPS * 32, TPW = THREADS / MM_ROWS, TPX = THREADS / (8 * NT);
    const int GPW = (NGW + TPW - 1) / TPW, GPX = (NGX + TPX - 1) / TPX;
    u8* wb = buf;
    u8* xb = buf + MM_ROWS * MM_WSTRIDE;
    int r = threadIdx.x / TPW, gw = (threadIdx.x % TPW) * GPW;
    if (r0 + r < rows) {
        size_t a = (size_t)(W + (size_t)(r0 + r) * wrb + st.woff);
        int end = (int)(a & 15) + st.wbytes;
        const u8* al = (const u8*)(a & ~(size_t)15);
        u8* dst = wb + r * MM_WSTRIDE;
#pragma unroll
        for (int k = 0; k < GPW; k++) {
            int g = gw + k;
            if (g < NGW && 16 * g < end) cp_async16(dst + 16 * g, al + 16 * g);
        }
    }
    int tk = threadIdx.x / TPX, gx = (threadIdx.x % TPX) * GPX;
    if (tok0 + tk < n_tok) {
        size_t a = (size_t)(X + (size_t)(tok0 + tk) * xrb + st.xoff);
        int end = (int)(a & 15) + st.xbytes;
        const u8* al = (const u8*)(a & ~(size_t)15);
        u8* dst = xb + tk * MM_XSTRIDE;
#pragma unroll
        for (int k = 0; k < GPX; k++) {
            int g = gx + k;
            if (g < NGX && 16 * g < end) cp_async16(dst + 16 * g, al + 16 * g);
        }
    }
}

__device__ __forceinline__ int phase16(const u8* p) { return (int)((size_t)p & 15); }

// Tokens tok0 .. min(tok0 + 8 NT, n_tok) of X (rows of Y), rows blockIdx.x * MM_ROWS ...
template <int F, int NT>
__device__ __forceinline__ void gemm_mma_impl(const u8* __restrict__ W, const u8* __restrict__ X,
                                              float* __restrict__ Y, int rows, int cols, int tok0, int n_tok,
                                              const u64* tab) {
    extern __shared__ __align__(16) u8 mm_smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t = lane & 3;
    int r0 = blockIdx.x * MM_ROWS;
    int units = cols / 32;
    int stages = (units + 7) / 8;
    size_t wrb = w_row_bytes<F>(cols), xrb = act_row_bytes<F>(cols);
    int ra = warp * 16 + g, rb = ra + 8; // tile rows of this lane's A fragments
    // Global rows for the phases (rows past the end: any valid address; their results are dropped).
    const u8* wga = W + (size_t)min(r0 + ra, rows - 1) * wrb;
    const u8* wgb = W + (size_t)min(r0 + rb, rows - 1) * wrb;
    float acc[NT][4];
    int S[NT][4], M[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[n][i] = 0.0f;
            S[n][i] = 0;
            M[n][i] = 0;
        }
    mm_issue<F, NT>(mm_smem, W, X, rows, n_tok, wrb, xrb, r0, tok0, Stage<F>(0, units));
    cp_async_commit();
    for (int it = 0; it < stages; it++) {
        if (it + 1 < stages)
            mm_issue<F, NT>(mm_smem + ((it + 1) & 1) * MM_STAGE_BYTES(NT), W, X, rows, n_tok, wrb, xrb, r0, tok0,
                        Stage<F>(it + 1, units));
        cp_async_commit();
        cp_async_wait1();
        __syncthreads();
        Stage<F> st(it, units);
        const u8* wb = mm_smem + (it & 1) * MM_STAGE_BYTES(NT);
        const u8* xb = wb + MM_ROWS * MM_WSTRIDE;
        const u8* wa = wb + ra * MM_WSTRIDE + phase16(wga + st.woff);
        const u8* wbr = wb + rb * MM_WSTRIDE + phase16(wgb + st.woff);
        // This lane's B token (column g of every tile) and its two C tokens (2t, 2t + 1).
        int xb_off[NT], xc_off[NT][2];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            int tb = n * 8 + g;
            xb_off[n] = tb * MM_XSTRIDE + phase16(X + (size_t)(tok0 + tb) * xrb + st.xoff);
#pragma unroll
            for (int j = 0; j < 2; j++) {
                int tc = n * 8 + 2 * t + j;
                xc_off[n][j] = tc * MM_XSTRIDE + phase16(X + (size_t)(tok0 + tc) * xrb + st.xoff);
            }
        }
        // Unrolled (MmaKind::UNROLL): every unit's offsets become immediates,
        // and the K formats' per-superblock d and dm load only for the block's
        // end (ncu: the loop's address arithmetic and those loads were a
        // quarter of the issued instructions of an issue-bound kernel).
#pragma unroll(MmaKind<F>::UNROLL ? 8 : 1)
        for (int u = 0; u < 8; u++) {
            if (Fmt<F>::UNITS == 1 && u >= st.units) break; // a short last stage
            UnitWords ua = unit_words<F>(wa, u, t, tab);
            UnitWords ub = unit_words<F>(wbr, u, t, tab);
            int alo0 = ua.lo, alo1 = ub.lo, ahi0 = ua.hi, ahi1 = ub.hi;
            if (MmaKind<F>::PRESCALE) {
                // Levels <= 3 times scales <= 15: each byte's product stays in its byte.
                alo0 = (int)((u32)alo0 * (u32)ua.s0);
                ahi0 = (int)((u32)ahi0 * (u32)ua.s1);
                alo1 = (int)((u32)alo1 * (u32)ub.s0);
                ahi1 = (int)((u32)ahi1 * (u32)ub.s1);
            }
            int mlo0 = (int)((u32)ua.m0 * 0x01010101u), mlo1 = (int)((u32)ub.m0 * 0x01010101u);
            int mhi0 = (int)((u32)ua.m1 * 0x01010101u), mhi1 = (int)((u32)ub.m1 * 0x01010101u);
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const u8* xq = xb + xb_off[n] + (Fmt<F>::K ? 4 + 32 * u : 2 + 34 * u);
                int blo = Fmt<F>::K ? *(const int*)(xq + 4 * t) : (int)rd32_a2(xq + 4 * t);
                int bhi = Fmt<F>::K ? *(const int*)(xq + 16 + 4 * t) : (int)rd32_a2(xq + 16 + 4 * t);
                if (Fmt<F>::UNITS == 1 || MmaKind<F>::PRESCALE) {
                    // Scales 1 (or folded into the levels): the block's sum accumulates in place.
                    mma_s8_16832(S[n], alo0, alo1, ahi0, ahi1, blo, bhi);
                } else if (Fmt<F>::EQ) {
                    int c[4] = {0, 0, 0, 0};
                    mma_s8_16832(c, alo0, alo1, ahi0, ahi1, blo, bhi);
                    S[n][0] += ua.s0 * c[0];
                    S[n][1] += ua.s0 * c[1];
                    S[n][2] += ub.s0 * c[2];
                    S[n][3] += ub.s0 * c[3];
                } else {
                    int c[4] = {0, 0, 0, 0}, e[4] = {0, 0, 0, 0};
                    mma_s8_16816(c, alo0, alo1, blo);
                    mma_s8_16816(e, ahi0, ahi1, bhi);
                    S[n][0] += ua.s0 * c[0] + ua.s1 * e[0];
                    S[n][1] += ua.s0 * c[1] + ua.s1 * e[1];
                    S[n][2] += ub.s0 * c[2] + ub.s1 * e[2];
                    S[n][3] += ub.s0 * c[3] + ub.s1 * e[3];
                }
                if (Fmt<F>::MINS) mma_s8_16832(M[n], mlo0, mlo1, mhi0, mhi1, blo, bhi);
            }
            if (Fmt<F>::UNITS == 1 || u == 7) {
                // The block ends: its value joins each output's sum.
#pragma unroll
                for (int n = 0; n < NT; n++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const u8* xd = xb + xc_off[n][i & 1];
                        float dx = Fmt<F>::K ? *(const float*)xd : rdh(xd + 34 * u);
                        float d = i < 2 ? ua.d : ub.d, dm = i < 2 ? ua.dm : ub.dm;
                        acc[n][i] = __fadd_rn(acc[n][i], block_value<F>(dx, d, dm, S[n][i], M[n][i]));
                        S[n][i] = 0;
                        M[n][i] = 0;
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int n = 0; n < NT; n++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = r0 + (i < 2 ? ra : rb);
            int tok = tok0 + n * 8 + 2 * t + (i & 1);
            if (row < rows && tok < n_tok) Y[(size_t)tok * rows + row] = finish_dot<F>(acc[n][i]);
        }
    }
}

// gemm_mma_grouped: the grouped expert products of a prefill chunk in one
// launch. Work item i = blockIdx.y is items[4i + which] (the expert's matrix:
// 0 gate, 1 up, 2 down) over sorted rows start .. start + len of X / Y
// (items[4i + 3] = start | len << 32, len <= 32).
#define GEMV_ENTRY(NAME, F)                                                                     \
    extern "C" __global__ void __launch_bounds__(DD_WARPS * 32) gemv_##NAME(                   \
        const u8* W0, const u8* W1, const u8* W2, float* Y0, float* Y1, float* Y2, int rows0,   \
        int rows1, int rows2, int b1, int b2, const u8* X, int cols, int rpw, int ng, int xsb,  \
        const u64* tab) {                                                                       \
        pdl_begin();                                                                            \
        gemv_impl<F>(W0, W1, W2, Y0, Y1, Y2, rows0, rows1, rows2, b1, b2, X, cols, rpw, ng, xsb, tab); \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32) gemm_##NAME(                   \
        const u8* W, const u8* X, float* Y, int rows, int cols, int n_tok, const u64* tab) { \
        pdl_begin(); \
        gemm_impl<F>(W, X, Y, rows, cols, n_tok, tab);                                          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemm_mma_##NAME(               \
        const u8* W, const u8* X, float* Y, int rows, int cols, int n_tok, const u64* tab) { \
        pdl_begin(); \
        gemm_mma_impl<F, 8>(W, X, Y, rows, cols, blockIdx.y * 64, n_tok, tab);                  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) gemm_mma_grouped_##NAME(       \
        const u64* items, int which, const u8* X, float* Y, int rows, int cols, const u64* tab) { \
        pdl_begin(); \
        const u64* it = items + 4 * (size_t)blockIdx.y;                                         \
        int start = (int)(it[3] & 0xffffffffu), len = (int)(it[3] >> 32);                       \
        gemm_mma_impl<F, 4>((const u8*)it[which], X, Y, rows, cols, start, start + len, tab);   \
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
    pdl_begin();
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
    pdl_begin();
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
