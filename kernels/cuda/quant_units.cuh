// Weight formats as "units" of 32 values for the integer dots (included after
// common.cuh by gemv_quant.cu, moe.cu and embed.cu).
//
// A unit is 32 signed 8-bit levels packed in q[8] (four per int, value order),
// two integer scales (s0 for values 0..15, s1 for 16..31), two integer mins
// (m0, m1, multiplied by the activation sums of the same halves) and two floats:
//   value_e = post * d * s_half * q_e - dm * m_half
// (post: the IQ grids' 1/8 or 1/4, applied once to a finished dot).
// The 32-value formats have one unit per block; the K and IQ formats eight per
// 256-value superblock (unit u is values 32u .. 32u + 32 of its superblock).
//
// Dots sum exact integers per block (unit_sums, added over a superblock's
// units), turn each block into one float (block_value, the CPU scalar dot's
// expression) and add those in block order: see block_value.

#define F_Q8_0 0
#define F_Q4_0 1
#define F_Q4_1 2
#define F_Q5_0 3
#define F_Q5_1 4
#define F_Q2_K 5
#define F_Q3_K 6
#define F_Q4_K 7
#define F_Q5_K 8
#define F_Q6_K 9
#define F_IQ2_XXS 10
#define F_IQ2_XS 11
#define F_IQ3_XXS 12

struct Unit {
    int q[8];
    int s0, s1, m0, m1;
    float d, dm;
};

// Bytes of one block, units per block, activation kind (K: q8_K, else q8_0),
// whether units have mins, and whether s0 == s1 in every unit (EQ), per format.
template <int F> struct Fmt;
template <> struct Fmt<F_Q8_0> { enum { BYTES = 34, UNITS = 1, K = 0, MINS = 0, EQ = 1 }; };
template <> struct Fmt<F_Q4_0> { enum { BYTES = 18, UNITS = 1, K = 0, MINS = 0, EQ = 1 }; };
template <> struct Fmt<F_Q4_1> { enum { BYTES = 20, UNITS = 1, K = 0, MINS = 1, EQ = 1 }; };
template <> struct Fmt<F_Q5_0> { enum { BYTES = 22, UNITS = 1, K = 0, MINS = 0, EQ = 1 }; };
template <> struct Fmt<F_Q5_1> { enum { BYTES = 24, UNITS = 1, K = 0, MINS = 1, EQ = 1 }; };
template <> struct Fmt<F_Q2_K> { enum { BYTES = 84, UNITS = 8, K = 1, MINS = 1, EQ = 0 }; };
template <> struct Fmt<F_Q3_K> { enum { BYTES = 110, UNITS = 8, K = 1, MINS = 0, EQ = 0 }; };
template <> struct Fmt<F_Q4_K> { enum { BYTES = 144, UNITS = 8, K = 1, MINS = 1, EQ = 1 }; };
template <> struct Fmt<F_Q5_K> { enum { BYTES = 176, UNITS = 8, K = 1, MINS = 1, EQ = 1 }; };
template <> struct Fmt<F_Q6_K> { enum { BYTES = 210, UNITS = 8, K = 1, MINS = 0, EQ = 0 }; };
template <> struct Fmt<F_IQ2_XXS> { enum { BYTES = 66, UNITS = 8, K = 1, MINS = 0, EQ = 1 }; };
template <> struct Fmt<F_IQ2_XS> { enum { BYTES = 74, UNITS = 8, K = 1, MINS = 0, EQ = 0 }; };
template <> struct Fmt<F_IQ3_XXS> { enum { BYTES = 98, UNITS = 8, K = 1, MINS = 0, EQ = 1 }; };

// The IQ grids live in one device table (uploaded by the host, extracted from
// the CPU tables): iq2_xxs at u64 [0, 256), iq2_xs at u64 [256, 768), iq3_xxs
// as u32 from u64 index 768 on.
#define TAB_IQ2XS 256
#define TAB_IQ3XXS 768

__device__ __forceinline__ void unit_plain(Unit& u, float d) {
    u.s0 = u.s1 = 1;
    u.m0 = u.m1 = 0;
    u.d = d;
    u.dm = 0.0f;
}

// An aligned u32 load (p must be 4-byte aligned).
__device__ __forceinline__ u32 rd32_a4(const u8* p) { return *(const u32*)p; }

// Unit `k` of the row starting at `w`. q2_K, q4_K and q5_K superblocks are
// whole 4-byte words (84, 144, 176 bytes) and tensors start 4-aligned (GGUF
// aligns tensor data to 32, device allocations more), so their quants load as
// words; the other formats' blocks are only 2-aligned.
template <int F> __device__ __forceinline__ Unit load_unit(const u8* w, int k, const u64* tab);

template <> __device__ __forceinline__ Unit load_unit<F_Q8_0>(const u8* w, int k, const u64*) {
    const u8* b = w + 34 * k;
    Unit u;
#pragma unroll
    for (int i = 0; i < 8; i++) u.q[i] = (int)rd32_a2(b + 2 + 4 * i);
    unit_plain(u, rdh(b));
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q4_0>(const u8* w, int k, const u64*) {
    const u8* b = w + 18 * k;
    Unit u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = rd32_a2(b + 2 + 4 * i);
        u.q[i] = (int)sub_bytes(v & 0x0f0f0f0fu, 8);
        u.q[i + 4] = (int)sub_bytes((v >> 4) & 0x0f0f0f0fu, 8);
    }
    unit_plain(u, rdh(b));
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q4_1>(const u8* w, int k, const u64*) {
    const u8* b = w + 20 * k;
    Unit u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = rd32_a2(b + 4 + 4 * i);
        u.q[i] = (int)(v & 0x0f0f0f0fu);
        u.q[i + 4] = (int)((v >> 4) & 0x0f0f0f0fu);
    }
    // value = d q + m: the min enters as -dm * 1 * sum(y) with dm = -m.
    u.s0 = u.s1 = 1;
    u.m0 = u.m1 = 1;
    u.d = rdh(b);
    u.dm = -rdh(b + 2);
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q5_0>(const u8* w, int k, const u64*) {
    const u8* b = w + 22 * k;
    u32 qh = rd32_a2(b + 2);
    Unit u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = rd32_a2(b + 6 + 4 * i);
        u32 h0 = spread4((qh >> (4 * i)) & 0xfu) << 4;
        u32 h1 = spread4((qh >> (16 + 4 * i)) & 0xfu) << 4;
        u.q[i] = (int)sub_bytes((v & 0x0f0f0f0fu) | h0, 16);
        u.q[i + 4] = (int)sub_bytes(((v >> 4) & 0x0f0f0f0fu) | h1, 16);
    }
    unit_plain(u, rdh(b));
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q5_1>(const u8* w, int k, const u64*) {
    const u8* b = w + 24 * k;
    u32 qh = rd32_a2(b + 4);
    Unit u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = rd32_a2(b + 8 + 4 * i);
        u32 h0 = spread4((qh >> (4 * i)) & 0xfu) << 4;
        u32 h1 = spread4((qh >> (16 + 4 * i)) & 0xfu) << 4;
        u.q[i] = (int)((v & 0x0f0f0f0fu) | h0);
        u.q[i + 4] = (int)(((v >> 4) & 0x0f0f0f0fu) | h1);
    }
    u.s0 = u.s1 = 1;
    u.m0 = u.m1 = 1;
    u.d = rdh(b);
    u.dm = -rdh(b + 2);
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q2_K>(const u8* w, int k, const u64*) {
    const u8* b = w + 84 * (k >> 3);
    int j = k & 7, c = j >> 2, s = j & 3;
    Unit u;
#pragma unroll
    for (int i = 0; i < 8; i++) u.q[i] = (int)((rd32_a4(b + 16 + 32 * c + 4 * i) >> (2 * s)) & 0x03030303u);
    u32 sa = b[2 * j], sb = b[2 * j + 1];
    u.s0 = sa & 0xf;
    u.s1 = sb & 0xf;
    u.m0 = sa >> 4;
    u.m1 = sb >> 4;
    u.d = rdh(b + 80);
    u.dm = rdh(b + 82);
    return u;
}

__device__ __forceinline__ int q3k_scale(const u8* s, int j) {
    u32 lo = j < 8 ? (s[j] & 0xfu) : (s[j - 8] >> 4);
    u32 hi = (s[8 + (j & 3)] >> (2 * (j >> 2))) & 3u;
    return (int)(lo | (hi << 4)) - 32;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q3_K>(const u8* w, int k, const u64*) {
    const u8* b = w + 110 * (k >> 3);
    int j = k & 7, c = j >> 2, s = j & 3;
    Unit u;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 lo = (rd32(b + 32 + 32 * c + 4 * i) >> (2 * s)) & 0x03030303u;
        u32 hi = (rd32(b + 4 * i) >> (4 * c + s)) & 0x01010101u;
        u.q[i] = (int)sub_bytes(lo | (hi << 2), 4);
    }
    u.s0 = q3k_scale(b + 96, 2 * j);
    u.s1 = q3k_scale(b + 96, 2 * j + 1);
    u.m0 = u.m1 = 0;
    u.d = rdh(b + 108);
    u.dm = 0.0f;
    return u;
}

// The 6-bit scale and min of sub-block j of a q4_K/q5_K superblock.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 2) & 0x30);
        m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

template <> __device__ __forceinline__ Unit load_unit<F_Q4_K>(const u8* w, int k, const u64*) {
    const u8* b = w + 144 * (k >> 3);
    int j = k & 7;
    Unit u;
#pragma unroll
    for (int i = 0; i < 8; i++)
        u.q[i] = (int)((rd32_a4(b + 16 + 32 * (j >> 1) + 4 * i) >> (4 * (j & 1))) & 0x0f0f0f0fu);
    int sc, m;
    k4_scale_min(b + 4, j, sc, m);
    u.s0 = u.s1 = sc;
    u.m0 = u.m1 = m;
    u.d = rdh(b);
    u.dm = rdh(b + 2);
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q5_K>(const u8* w, int k, const u64*) {
    const u8* b = w + 176 * (k >> 3);
    int j = k & 7;
    Unit u;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 lo = (rd32_a4(b + 48 + 32 * (j >> 1) + 4 * i) >> (4 * (j & 1))) & 0x0f0f0f0fu;
        u32 hi = (rd32_a4(b + 16 + 4 * i) >> j) & 0x01010101u;
        u.q[i] = (int)(lo | (hi << 4));
    }
    int sc, m;
    k4_scale_min(b + 4, j, sc, m);
    u.s0 = u.s1 = sc;
    u.m0 = u.m1 = m;
    u.d = rdh(b);
    u.dm = rdh(b + 2);
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_Q6_K>(const u8* w, int k, const u64*) {
    const u8* b = w + 210 * (k >> 3);
    int j = k & 7, c = j >> 2, s = j & 3;
    Unit u;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 lo = (rd32_a2(b + 64 * c + 32 * (s & 1) + 4 * i) >> (4 * (s >> 1))) & 0x0f0f0f0fu;
        u32 hi = (rd32_a2(b + 128 + 32 * c + 4 * i) >> (2 * s)) & 0x03030303u;
        u.q[i] = (int)sub_bytes(lo | (hi << 4), 32);
    }
    u.s0 = (int)(i8)b[192 + 2 * j];
    u.s1 = (int)(i8)b[192 + 2 * j + 1];
    u.m0 = u.m1 = 0;
    u.d = rdh(b + 208);
    u.dm = 0.0f;
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_IQ2_XXS>(const u8* w, int k, const u64* tab) {
    const u8* b = w + 66 * (k >> 3);
    int j = k & 7;
    u32 a = rd32_a2(b + 2 + 8 * j), s = rd32_a2(b + 6 + 8 * j);
    Unit u;
#pragma unroll
    for (int g = 0; g < 4; g++) {
        u64 grid = tab[(a >> (8 * g)) & 0xffu];
        u32 sg = ksigns((s >> (7 * g)) & 127u);
        u.q[2 * g] = (int)apply_signs((u32)grid, sg & 0xfu);
        u.q[2 * g + 1] = (int)apply_signs((u32)(grid >> 32), sg >> 4);
    }
    u.s0 = u.s1 = 2 * (int)(s >> 28) + 1;
    u.m0 = u.m1 = 0;
    u.d = rdh(b);
    u.dm = 0.0f;
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_IQ2_XS>(const u8* w, int k, const u64* tab) {
    const u8* b = w + 74 * (k >> 3);
    int j = k & 7;
    Unit u;
#pragma unroll
    for (int g = 0; g < 4; g++) {
        u32 q = rd16(b + 2 + 2 * (4 * j + g));
        u64 grid = tab[TAB_IQ2XS + (q & 511u)];
        u32 sg = ksigns(q >> 9);
        u.q[2 * g] = (int)apply_signs((u32)grid, sg & 0xfu);
        u.q[2 * g + 1] = (int)apply_signs((u32)(grid >> 32), sg >> 4);
    }
    u32 sc = b[66 + j];
    u.s0 = 2 * (int)(sc & 0xf) + 1;
    u.s1 = 2 * (int)(sc >> 4) + 1;
    u.m0 = u.m1 = 0;
    u.d = rdh(b);
    u.dm = 0.0f;
    return u;
}

template <> __device__ __forceinline__ Unit load_unit<F_IQ3_XXS>(const u8* w, int k, const u64* tab) {
    const u8* b = w + 98 * (k >> 3);
    int j = k & 7;
    const u32* grid = (const u32*)(tab + TAB_IQ3XXS);
    u32 s = rd32_a2(b + 66 + 4 * j);
    Unit u;
#pragma unroll
    for (int g = 0; g < 4; g++) {
        u32 sg = ksigns((s >> (7 * g)) & 127u);
        u.q[2 * g] = (int)apply_signs(grid[b[2 + 8 * j + 2 * g]], sg & 0xfu);
        u.q[2 * g + 1] = (int)apply_signs(grid[b[2 + 8 * j + 2 * g + 1]], sg >> 4);
    }
    u.s0 = u.s1 = 2 * (int)(s >> 28) + 1;
    u.m0 = u.m1 = 0;
    u.d = rdh(b);
    u.dm = 0.0f;
    return u;
}

// ---- activation units: the same 32 values of a q8_0 or q8_K row ----

struct XUnit {
    int q[8];
    float d;
    int y0, y1; // sums of quants 0..15 and 16..31 (only filled when needed)
};

// q8_0 row: unit k is block k (34 bytes). q8_K row: block k/8 (292 bytes).
template <bool K, bool SUMS> __device__ __forceinline__ XUnit load_x(const u8* x, int k) {
    XUnit v;
    if (K) {
        const u8* b = x + 292 * (k >> 3);
        int j = k & 7;
        const int* qs = (const int*)(b + 4 + 32 * j);
#pragma unroll
        for (int i = 0; i < 8; i++) v.q[i] = qs[i];
        v.d = *(const float*)b;
        if (SUMS) {
            const i16* bs = (const i16*)(b + 260);
            v.y0 = bs[2 * j];
            v.y1 = bs[2 * j + 1];
        }
    } else {
        const u8* b = x + 34 * k;
#pragma unroll
        for (int i = 0; i < 8; i++) v.q[i] = (int)rd32_a2(b + 2 + 4 * i);
        v.d = rdh(b);
        if (SUMS) {
            v.y0 = dp4a(0x01010101, v.q[0], dp4a(0x01010101, v.q[1], dp4a(0x01010101, v.q[2], dp4a(0x01010101, v.q[3], 0))));
            v.y1 = dp4a(0x01010101, v.q[4], dp4a(0x01010101, v.q[5], dp4a(0x01010101, v.q[6], dp4a(0x01010101, v.q[7], 0))));
        }
    }
    return v;
}

// Exact integer sums of one unit against activation unit x: S = s0 * sum(q y)_lo
// + s1 * sum(q y)_hi and, for formats with mins, M = m0 * sum(y)_lo + m1 * sum(y)_hi.
template <int F> __device__ __forceinline__ void unit_sums(const Unit& u, const XUnit& x, int& S, int& M) {
    int a = 0, b = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) a = dp4a(u.q[i], x.q[i], a);
#pragma unroll
    for (int i = 4; i < 8; i++) b = dp4a(u.q[i], x.q[i], b);
    S = u.s0 * a + u.s1 * b;
    M = Fmt<F>::MINS ? u.m0 * x.y0 + u.m1 * x.y1 : 0;
}

// The float value of one block (a 32-value block, or a whole superblock of the
// K and IQ formats) from its exact integer sums: the CPU scalar dot's
// expression, (dx * d) * S - (dx * dm) * M, every operation rounded on its own.
// The canonical dot is these values added one by one, in block order, to an
// accumulator starting at 0, then times post_scale. Every quantized GEMV, GEMM
// and expert kernel follows it, so decode, prefill and the CPU agree bit for bit.
template <int F> __device__ __forceinline__ float block_value(float dx, float d, float dm, int S, int M) {
    float r = __fmul_rn(__fmul_rn(dx, d), (float)S);
    if (Fmt<F>::MINS) r = __fsub_rn(r, __fmul_rn(__fmul_rn(dx, dm), (float)M));
    return r;
}

// The factor the CPU applies to the finished sum (the IQ grids' 1/8 and 1/4).
template <int F> __device__ __forceinline__ float post_scale() {
    return F == F_IQ2_XXS || F == F_IQ2_XS ? 0.125f : F == F_IQ3_XXS ? 0.25f : 1.0f;
}
template <int F> __device__ __forceinline__ float finish_dot(float acc) {
    return F == F_IQ2_XXS || F == F_IQ2_XS || F == F_IQ3_XXS ? __fmul_rn(post_scale<F>(), acc) : acc;
}

// Activation bytes of one row of `cols` values, for the format F dots against.
template <int F> __device__ __forceinline__ size_t act_row_bytes(int cols) {
    return Fmt<F>::K ? (size_t)(cols / 256) * 292 : (size_t)(cols / 32) * 34;
}
template <int F> __device__ __forceinline__ size_t w_row_bytes(int cols) {
    return (size_t)(cols / (32 * Fmt<F>::UNITS)) * Fmt<F>::BYTES;
}

// Canonical dots of R weight rows (`w`, `wrb` bytes apart; the first `nrows`
// exist) against T activation rows (`x`, `xrb` apart; the first `nt` exist),
// by one warp. Step c: lane l takes unit 32c + l of every row and token; a
// block's integer sums meet in its first lane (a superblock's 8 lanes reduce
// exactly), which writes the block value to `vals` (R * T * VALS_STRIDE
// floats of this warp's shared memory); then lane p = t * R + r adds its
// pair's values in block order. Returns lane p's finished dot (R * T <= 32;
// lanes past that, and missing rows or tokens, return garbage to ignore).
#define VALS_STRIDE 33

template <int F, int R, int T>
__device__ __forceinline__ float rows_dot(const u8* w, size_t wrb, int nrows, const u8* x, size_t xrb, int nt,
                                          int units, const u64* tab, float* vals) {
    const int lane = threadIdx.x & 31;
    const int UN = Fmt<F>::UNITS, BPS = 32 / UN;
    int blocks = units / UN;
    float acc = 0.0f;
    for (int c = 0; c * 32 < units; c++) {
        int k = c * 32 + lane;
        bool ok = k < units;
        Unit u[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r >= nrows) break; // the same for the whole warp
            if (ok) u[r] = load_unit<F>(w + (size_t)r * wrb, k, tab);
        }
#pragma unroll
        for (int t = 0; t < T; t++) {
            bool okt = ok && t < nt;
            XUnit xv;
            if (okt) xv = load_x<Fmt<F>::K, Fmt<F>::MINS>(x + (size_t)t * xrb, k);
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= nrows) break; // warp-uniform: the shuffles below stay converged
                bool okr = okt;
                int S = 0, M = 0;
                if (okr) unit_sums<F>(u[r], xv, S, M);
                if (UN == 8) {
#pragma unroll
                    for (int o = 1; o < 8; o <<= 1) {
                        S += __shfl_xor_sync(FULL_MASK, S, o);
                        if (Fmt<F>::MINS) M += __shfl_xor_sync(FULL_MASK, M, o);
                    }
                }
                if (okr && lane % UN == 0)
                    vals[(t * R + r) * VALS_STRIDE + lane / UN] = block_value<F>(xv.d, u[r].d, u[r].dm, S, M);
            }
        }
        __syncwarp();
        if (lane < R * T) {
            int nb = min(BPS, blocks - c * BPS);
            const float* v = vals + lane * VALS_STRIDE;
            for (int b = 0; b < nb; b++) acc = __fadd_rn(acc, v[b]);
        }
        __syncwarp();
    }
    return finish_dot<F>(acc);
}

// The value of element e (0..31) of a unit.
template <int F> __device__ __forceinline__ float unit_value(const Unit& u, int e) {
    int q = (int)(i8)((u.q[e >> 2] >> (8 * (e & 3))) & 0xff);
    int s = e < 16 ? u.s0 : u.s1;
    int m = e < 16 ? u.m0 : u.m1;
    float d = post_scale<F>() != 1.0f ? __fmul_rn(post_scale<F>(), u.d) : u.d;
    // No contraction into an fma: the CPU rounds each product.
    return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)s), (float)q), __fmul_rn(u.dm, (float)m));
}
