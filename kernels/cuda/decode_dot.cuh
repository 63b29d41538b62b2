// Decode dots: weight rows against ONE activation row, by one warp, with the
// row bytes streamed through a three-slot shared-memory ring (included after
// quant_units.cuh by gemv_quant.cu and moe.cu).
//
// Same canonical sum as rows_dot (exact integer sums per block, one float per
// block by block_value, those added in block order), so the bits match the
// GEMMs, the CPU and the earlier kernels. What differs is the schedule:
// - the activation row is staged once per block in shared memory (every warp
//   of the block reads the same row; from global memory it cost as many
//   bytes as the weights);
// - a warp walks its rows group by group and each group chunk by chunk
//   (DD<F>::BPS blocks of each row), the next two steps' cp.async copies in
//   flight while one is summed;
// - the K and IQ formats give each superblock to four lanes (lane 4g + q
//   holds units 2q and 2q + 1 of superblock g of the chunk), so a lane keeps
//   two units, not eight rows' worth of them: few registers, many warps;
// - the rows of a group are a compile-time count (dd_dots picks 1, 2 or 4),
//   so the row loops unroll and the copies use 32-bit offsets: the issued
//   instructions, not DRAM, bounded these kernels (ncu: 0.7 issued an SM
//   sub-partition cycle at 26-41% of DRAM bandwidth).
// A group holds <= DD_MAX_ROWS rows, from up to two matrices (moe_up's gate
// and up rows side by side).

#define DD_WARPS 8 // the most warps a block (the host launches 4 for small matrices)
#define DD_MAX_ROWS 4 // rows of one group, all matrices together
#define DD_SLOTS 3    // ring slots: two steps in flight while one is summed
// A row's block values in `vals`: 16-byte aligned rows (the ordered sum reads
// four at a time) whose starts still fall in different banks.
#define DD_VALS_STRIDE 36

template <int F> struct DD {
    enum {
        LPB = Fmt<F>::UNITS == 8 ? 4 : 1, // lanes per block
        UPL = Fmt<F>::UNITS == 8 ? 2 : 1, // units per lane
        BPS = 32 / (Fmt<F>::UNITS == 8 ? 4 : 1), // blocks per chunk
        CHUNK = (32 / (Fmt<F>::UNITS == 8 ? 4 : 1)) * Fmt<F>::BYTES, // bytes of a row's chunk (a multiple of 16)
        RSTRIDE = (32 / (Fmt<F>::UNITS == 8 ? 4 : 1)) * Fmt<F>::BYTES + 16, // a staged chunk at any phase
    };
};

// Shared-memory bytes of one warp's ring for groups of `nrows` rows (host
// twin: decode_ring_bytes in host/cuda/src/ops.rs).
template <int F> __device__ __forceinline__ int dd_ring_bytes(int nrows) { return DD_SLOTS * nrows * DD<F>::RSTRIDE; }

// Block-cooperative: copy `len` bytes at `src` into `dst` (16-aligned, len +
// 32 bytes long) as whole granules, keeping the phase; returns where the
// bytes land. The caller commits, waits and syncs the block.
__device__ __forceinline__ const u8* stage_block(u8* dst, const u8* src, size_t len) {
    size_t a = (size_t)src;
    size_t first = a >> 4, ng = ((a + len - 1) >> 4) - first + 1;
    for (size_t i = threadIdx.x; i < ng; i += blockDim.x) cp_async16(dst + 16 * i, (const void*)((first + i) << 4));
    return dst + (a & 15);
}

// One warp's work: `count` consecutive rows (from row `first`) of each of
// `mats` matrices (w0, w1: moe_up's gate and up), taken in groups of
// `gr` rows a matrix. A group's rows are summed side by side (lane r ends
// with row r of the group: matrix r / gr, row r % gr; see DDRow); the steps
// (group, chunk) stream through the ring in order.
struct DDWork {
    const u8 *w0, *w1; // (two fields, not an array: a run-time index would put it in local memory)
    int mats, first, count, gr;
    size_t wrb;
    __device__ __forceinline__ int groups() const { return count <= 0 ? 0 : (count + gr - 1) / gr; }
    __device__ __forceinline__ int rows_of(int g) const { return min(gr, count - g * gr); }
};

// A position in the warp's (group, chunk) steps and its ring slot, advanced
// by counting (no division in the loop).
struct DDStep {
    int g, c, slot;
    __device__ __forceinline__ void next(int chunks) {
        if (++c == chunks) {
            c = 0;
            g++;
        }
        if (++slot == DD_SLOTS) slot = 0;
    }
};

// Row pointers of a group of R rows (R = mats * gr, both launch-uniform):
// row r is matrix r / gr (w1 when mats == 2 and r >= gr), row r % gr of the
// group; it exists when r % gr < n (the last group may be short).
template <int R> struct DDRow {
    __device__ __forceinline__ static bool second(const DDWork& wk, int r) { return R > 1 && wk.mats == 2 && r >= R / 2; }
    __device__ __forceinline__ static int index(const DDWork& wk, int r) { return second(wk, r) ? r - R / 2 : r; }
    __device__ __forceinline__ static const u8* base(const DDWork& wk, int r) { return second(wk, r) ? wk.w1 : wk.w0; }
};

// Issue the copies of step `at` into its ring slot; nothing past the last
// group. 32-bit offsets and a fixed trip count: the copy loop was as many
// instructions as the dots. The caller commits.
template <int F, int R>
__device__ __forceinline__ void dd_issue(u8* ring, const DDWork& wk, DDStep at, int groups, int blocks) {
    if (at.g >= groups) return;
    const int lane = threadIdx.x & 31;
    // Granules of a chunk at any phase, and each lane's share of them.
    const int NG = DD<F>::CHUNK / 16 + 1, PER = (NG + 31) / 32;
    int n = wk.rows_of(at.g);
    u8* slot = ring + at.slot * R * DD<F>::RSTRIDE;
    int bytes = min((int)DD<F>::BPS, blocks - at.c * DD<F>::BPS) * Fmt<F>::BYTES;
    size_t off = (size_t)at.c * DD<F>::CHUNK;
#pragma unroll
    for (int r = 0; r < R; r++) {
        int rr = DDRow<R>::index(wk, r);
        if (rr >= n) continue;
        const u8* src = DDRow<R>::base(wk, r) + (size_t)(wk.first + at.g * wk.gr + rr) * wk.wrb + off;
        int ph = (int)((size_t)src & 15);
        const u8* g0 = src - ph;
        int ng = (ph + bytes + 15) >> 4;
        u8* dst = slot + r * DD<F>::RSTRIDE;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            int i = lane + 32 * k;
            if (i < ng) cp_async16(dst + 16 * i, g0 + 16 * i);
        }
    }
}

// Dynamic shared memory of the decode kernels: the staged activation row (xsb
// bytes, 0 when x is read from global memory), then one ring a warp of
// dd_ring_bytes(R). Stages x and the first DD_SLOTS - 1 steps of this warp's
// work, then syncs the block so every warp may read x. Every thread of the
// block must call it (before any thread returns).
template <int F, int R>
__device__ __forceinline__ const u8* dd_begin(u8* smem, int xsb, const u8* x, size_t xlen, const DDWork& wk,
                                              int units, u8*& ring) {
    int warp = threadIdx.x >> 5;
    ring = smem + xsb + warp * dd_ring_bytes<F>(R);
    const u8* xs = x;
    if (xsb > 0) {
        xs = stage_block(smem, x, xlen);
        cp_async_commit();
    }
    int blocks = units / Fmt<F>::UNITS, chunks = (blocks + DD<F>::BPS - 1) / DD<F>::BPS;
    DDStep at{0, 0, 0};
#pragma unroll
    for (int s = 0; s < DD_SLOTS - 1; s++) {
        dd_issue<F, R>(ring, wk, at, wk.groups(), blocks);
        cp_async_commit();
        at.next(chunks);
    }
    if (xsb > 0) {
        // x was copied by every thread: wait for its group (the steps may
        // still fly), then for the block.
        cp_async_wait<DD_SLOTS - 1>();
        __syncthreads();
    }
    return xs;
}

// The exact integer sums (S, M) of a lane's UPL consecutive units starting at
// unit k of the staged row `w`, with the block's d and dm. The general form
// loads unit by unit; q2_K and q8_0 (the benchmark's formats) have their own.
template <int F> struct DDSums {
    __device__ __forceinline__ static void run(const u8* w, int k, const XUnit* xv, const u64* tab, int& S, int& M,
                                               float& d, float& dm) {
        S = M = 0;
#pragma unroll
        for (int i = 0; i < DD<F>::UPL; i++) {
            Unit u = load_unit<F>(w, k + i, tab);
            int su, mu;
            unit_sums<F>(u, xv[i], su, mu);
            S += su;
            M += mu;
            d = u.d;
            dm = u.dm;
        }
    }
};

// Unsigned bytes of a times signed bytes of b, accumulated into c.
__device__ __forceinline__ int dp4a_us(u32 a, int b, int c) {
    int r;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// q2_K, units k and k + 1 (k even): the same eight quant words at shifts 2s
// and 2s + 2. The levels are masked in place, not shifted down: a sum of
// level * 4^s products is 4^s times the sum, so one exact shift recovers it.
// The four scale bytes and d, dm load as two words (superblocks are whole
// words and the ring keeps the global phase).
template <> struct DDSums<F_Q2_K> {
    __device__ __forceinline__ static void run(const u8* w, int k, const XUnit* xv, const u64*, int& S, int& M,
                                               float& d, float& dm) {
        const u8* b = w + 84 * (k >> 3);
        int j = k & 7, s = 2 * (j & 3);
        const u32* q = (const u32*)(b + 16 + 32 * (j >> 2));
        u32 m0 = 0x03030303u << s, m1 = m0 << 2;
        int a0 = 0, b0 = 0, a1 = 0, b1 = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo = q[i], hi = q[i + 4];
            a0 = dp4a_us(lo & m0, xv[0].q[i], a0);
            b0 = dp4a_us(hi & m0, xv[0].q[i + 4], b0);
            a1 = dp4a_us(lo & m1, xv[1].q[i], a1);
            b1 = dp4a_us(hi & m1, xv[1].q[i + 4], b1);
        }
        a0 >>= s;
        b0 >>= s;
        a1 >>= s + 2;
        b1 >>= s + 2;
        u32 sc = *(const u32*)(b + 2 * j);
        S = (int)(sc & 0xfu) * a0 + (int)((sc >> 8) & 0xfu) * b0 + (int)((sc >> 16) & 0xfu) * a1 +
            (int)((sc >> 24) & 0xfu) * b1;
        M = (int)((sc >> 4) & 0xfu) * xv[0].y0 + (int)((sc >> 12) & 0xfu) * xv[0].y1 +
            (int)((sc >> 20) & 0xfu) * xv[1].y0 + (int)(sc >> 28) * xv[1].y1;
        u32 dd = *(const u32*)(b + 80);
        d = h2f((u16)(dd & 0xffffu));
        dm = h2f((u16)(dd >> 16));
    }
};

// Eight words at the 2-aligned p as nine aligned loads and byte permutes.
__device__ __forceinline__ void rd8_words_a2(const u8* p, int* out) {
    u32 a = (u32)(size_t)p & 2u;
    const u32* q = (const u32*)(p - a);
    u32 sel = a ? 0x5432u : 0x3210u;
    u32 w[9];
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = q[i];
    // The ninth word only matters at phase 2; at phase 0 re-read the eighth
    // (never a byte past the block's).
    w[8] = q[a ? 8 : 7];
#pragma unroll
    for (int i = 0; i < 8; i++) out[i] = (int)__byte_perm(w[i], w[i + 1], sel);
}

template <> struct DDSums<F_Q8_0> {
    __device__ __forceinline__ static void run(const u8* w, int k, const XUnit* xv, const u64*, int& S, int& M,
                                               float& d, float& dm) {
        const u8* b = w + 34 * k;
        int q[8];
        rd8_words_a2(b + 2, q);
        int a = 0, c = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            a = dp4a(q[i], xv[0].q[i], a);
            c = dp4a(q[i + 4], xv[0].q[i + 4], c);
        }
        S = a + c;
        M = 0;
        d = h2f(*(const u16*)b);
        dm = 0.0f;
    }
};

// Activation unit k: q8_0 rows are 2-aligned blocks (aligned loads and
// permutes, as the weights); q8_K as load_x.
template <int F> __device__ __forceinline__ XUnit dd_load_x(const u8* x, int k) {
    if (Fmt<F>::K) return load_x<true, Fmt<F>::MINS>(x, k);
    XUnit v;
    const u8* b = x + 34 * k;
    rd8_words_a2(b + 2, v.q);
    v.d = h2f(*(const u16*)b);
    if (Fmt<F>::MINS) {
        v.y0 = dp4a(0x01010101, v.q[0], dp4a(0x01010101, v.q[1], dp4a(0x01010101, v.q[2], dp4a(0x01010101, v.q[3], 0))));
        v.y1 = dp4a(0x01010101, v.q[4], dp4a(0x01010101, v.q[5], dp4a(0x01010101, v.q[6], dp4a(0x01010101, v.q[7], 0))));
    }
    return v;
}

// The canonical dots of the warp's work (groups of R rows) against the
// (staged) activation row `x` of `units` units; `ring` from dd_begin, `vals`
// DD_MAX_ROWS * DD_VALS_STRIDE floats of this warp (16-byte aligned). After
// each group, every lane calls store(g, n, v): lane r < R holds the finished
// dot of the group's row r (DDRow), meaningful when r % gr < n.
template <int F, int R, class Store>
__device__ __forceinline__ void dd_run(const DDWork& wk, const u8* x, int units, u8* ring, float* vals,
                                       const u64* tab, Store store) {
    const int lane = threadIdx.x & 31;
    const int UN = Fmt<F>::UNITS, LPB = DD<F>::LPB, UPL = DD<F>::UPL, BPS = DD<F>::BPS;
    const int blocks = units / UN;
    const int chunks = (blocks + BPS - 1) / BPS;
    const int sb = lane / LPB, part = lane % LPB;
    const int groups = wk.groups();
    // `at` steps DD_SLOTS - 1 ahead of `now` (dd_begin issued the ones between).
    DDStep now{0, 0, 0}, at{0, 0, 0};
#pragma unroll
    for (int s = 0; s < DD_SLOTS - 1; s++) at.next(chunks);
    float acc = 0.0f;
    for (; now.g < groups; now.next(chunks), at.next(chunks)) {
        // Keep DD_SLOTS - 1 steps in flight; this step's copies are then done.
        dd_issue<F, R>(ring, wk, at, groups, blocks);
        cp_async_commit();
        cp_async_wait<DD_SLOTS - 1>();
        __syncwarp();
        int g = now.g, c = now.c, n = wk.rows_of(g);
        const u8* cur = ring + now.slot * R * DD<F>::RSTRIDE;
        int b = c * BPS + sb;
        bool ok = b < blocks;
        XUnit xv[UPL];
        if (ok) {
#pragma unroll
            for (int i = 0; i < UPL; i++) xv[i] = dd_load_x<F>(x, b * UN + part * UPL + i);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            int rr = DDRow<R>::index(wk, r);
            // The chunk keeps its row's global phase within its 16-byte
            // granules (chunks are whole granules, so the phase is the row's).
            u32 ph = ((u32)(size_t)DDRow<R>::base(wk, r) + (u32)(wk.first + g * wk.gr + rr) * (u32)wk.wrb) & 15u;
            const u8* wr = cur + r * DD<F>::RSTRIDE + ph;
            bool live = ok && rr < n;
            int S = 0, M = 0;
            float d = 0.0f, dm = 0.0f;
            if (live) DDSums<F>::run(wr, sb * UN + part * UPL, xv, tab, S, M, d, dm);
            if (LPB == 4) {
                // A superblock's four lanes: exact integer sums, any order.
                S += __shfl_xor_sync(FULL_MASK, S, 1);
                S += __shfl_xor_sync(FULL_MASK, S, 2);
                if (Fmt<F>::MINS) {
                    M += __shfl_xor_sync(FULL_MASK, M, 1);
                    M += __shfl_xor_sync(FULL_MASK, M, 2);
                }
            }
            if (live && part == 0) vals[r * DD_VALS_STRIDE + sb] = block_value<F>(xv[0].d, d, dm, S, M);
        }
        __syncwarp();
        if (lane < R) {
            // In block order, one after another; read four at a time.
            int nb = min(BPS, blocks - c * BPS), j = 0;
            const float* v = vals + lane * DD_VALS_STRIDE;
            for (; j + 4 <= nb; j += 4) {
                float4 q = *(const float4*)(v + j);
                acc = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(acc, q.x), q.y), q.z), q.w);
            }
            for (; j < nb; j++) acc = __fadd_rn(acc, v[j]);
        }
        if (c == chunks - 1) {
            store(g, n, finish_dot<F>(acc));
            acc = 0.0f;
        }
        // The ring slot and vals are rewritten by later steps.
        __syncwarp();
    }
    cp_async_wait<0>();
}

// One warp's decode dots, begin to end, for R = mats * gr in {1, 2, 4} (the
// host's plans; a launch-uniform branch, so the block's barrier in dd_begin
// is met by every warp).
template <int F, class Store>
__device__ __forceinline__ void dd_dots(u8* smem, int xsb, const u8* x, size_t xlen, const DDWork& wk, int units,
                                        float* vals, const u64* tab, Store store) {
    u8* ring;
    switch (wk.mats * wk.gr) {
    case 1: {
        const u8* xs = dd_begin<F, 1>(smem, xsb, x, xlen, wk, units, ring);
        dd_run<F, 1>(wk, xs, units, ring, vals, tab, store);
        break;
    }
    case 2: {
        const u8* xs = dd_begin<F, 2>(smem, xsb, x, xlen, wk, units, ring);
        dd_run<F, 2>(wk, xs, units, ring, vals, tab, store);
        break;
    }
    default: {
        const u8* xs = dd_begin<F, 4>(smem, xsb, x, xlen, wk, units, ring);
        dd_run<F, 4>(wk, xs, units, ring, vals, tab, store);
        break;
    }
    }
}
