// Decode dots: weight rows against ONE activation row, by one warp, with the
// row bytes streamed through a two-slot shared-memory ring (included after
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
//   two units, not eight rows' worth of them: few registers, many warps.
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
// with row r of the group: matrix r / n, row r % n, n its rows a matrix);
// the steps (group, chunk) stream through the ring in order.
struct DDWork {
    const u8 *w0, *w1; // (two fields, not an array: a run-time index would put it in local memory)
    int mats, first, count, gr;
    size_t wrb;
    __device__ __forceinline__ int groups() const { return count <= 0 ? 0 : (count + gr - 1) / gr; }
    __device__ __forceinline__ int rows_of(int g) const { return min(gr, count - g * gr); }
    // Row r of group g (n = rows_of(g)).
    __device__ __forceinline__ const u8* row(int g, int n, int r) const {
        return (r < n ? w0 : w1) + (size_t)(first + g * gr + (r < n ? r : r - n)) * wrb;
    }
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

// Issue the copies of step `at` into its ring slot; nothing past the last
// group. The caller commits.
template <int F>
__device__ __forceinline__ void dd_issue(u8* ring, const DDWork& wk, DDStep at, int groups, int blocks) {
    if (at.g >= groups) return;
    int lane = threadIdx.x & 31;
    int n = wk.rows_of(at.g);
    u8* slot = ring + at.slot * (wk.mats * wk.gr) * DD<F>::RSTRIDE;
    int bytes = min((int)DD<F>::BPS, blocks - at.c * DD<F>::BPS) * Fmt<F>::BYTES;
    size_t off = (size_t)at.c * DD<F>::CHUNK;
    for (int r = 0; r < wk.mats * n; r++) {
        size_t a = (size_t)(wk.row(at.g, n, r) + off);
        size_t gi = a >> 4, ng = ((a + bytes - 1) >> 4) - gi + 1;
        u8* dst = slot + r * DD<F>::RSTRIDE;
        for (size_t i = lane; i < ng; i += 32) cp_async16(dst + 16 * i, (const void*)((gi + i) << 4));
    }
}

// Dynamic shared memory of the decode kernels: the staged activation row (xsb
// bytes, 0 when x is read from global memory), then one ring a warp of
// dd_ring_bytes(mats * gr). Stages x and the first DD_SLOTS - 1 steps of this
// warp's work, then syncs the block so every warp may read x. Every thread of
// the block must call it (before any thread returns).
template <int F>
__device__ __forceinline__ const u8* dd_begin(u8* smem, int xsb, const u8* x, size_t xlen, const DDWork& wk,
                                              int units, u8*& ring) {
    int warp = threadIdx.x >> 5;
    ring = smem + xsb + warp * dd_ring_bytes<F>(wk.mats * wk.gr);
    const u8* xs = x;
    if (xsb > 0) {
        xs = stage_block(smem, x, xlen);
        cp_async_commit();
    }
    int blocks = units / Fmt<F>::UNITS, chunks = (blocks + DD<F>::BPS - 1) / DD<F>::BPS;
    DDStep at{0, 0, 0};
#pragma unroll
    for (int s = 0; s < DD_SLOTS - 1; s++) {
        dd_issue<F>(ring, wk, at, wk.groups(), blocks);
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

// The canonical dots of the warp's work against the (staged) activation row
// `x` of `units` units; `ring` from dd_begin, `vals` DD_MAX_ROWS *
// DD_VALS_STRIDE floats of this warp (16-byte aligned). After each group, every lane calls
// store(g, n, v): lane r < mats * n holds the finished dot of the group's row r.
template <int F, class Store>
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
        dd_issue<F>(ring, wk, at, groups, blocks);
        cp_async_commit();
        cp_async_wait<DD_SLOTS - 1>();
        __syncwarp();
        int g = now.g, c = now.c, n = wk.rows_of(g), nrows = wk.mats * n;
        const u8* cur = ring + now.slot * (wk.mats * wk.gr) * DD<F>::RSTRIDE;
        int b = c * BPS + sb;
        bool ok = b < blocks;
        XUnit xv[UPL];
        if (ok) {
#pragma unroll
            for (int i = 0; i < UPL; i++) xv[i] = load_x<Fmt<F>::K, Fmt<F>::MINS>(x, b * UN + part * UPL + i);
        }
        size_t off = (size_t)c * DD<F>::CHUNK;
        for (int r = 0; r < nrows; r++) {
            // The chunk keeps its global phase within its 16-byte granules.
            const u8* wr = cur + r * DD<F>::RSTRIDE + ((size_t)(wk.row(g, n, r) + off) & 15);
            int S = 0, M = 0;
            float d = 0.0f, dm = 0.0f;
            if (ok) {
#pragma unroll
                for (int i = 0; i < UPL; i++) {
                    Unit u = load_unit<F>(wr, sb * UN + part * UPL + i, tab);
                    int su, mu;
                    unit_sums<F>(u, xv[i], su, mu);
                    S += su;
                    M += mu;
                    d = u.d;
                    dm = u.dm;
                }
            }
            if (LPB == 4) {
                // A superblock's four lanes: exact integer sums, any order.
                S += __shfl_xor_sync(FULL_MASK, S, 1);
                S += __shfl_xor_sync(FULL_MASK, S, 2);
                if (Fmt<F>::MINS) {
                    M += __shfl_xor_sync(FULL_MASK, M, 1);
                    M += __shfl_xor_sync(FULL_MASK, M, 2);
                }
            }
            if (ok && part == 0) vals[r * DD_VALS_STRIDE + sb] = block_value<F>(xv[0].d, d, dm, S, M);
        }
        __syncwarp();
        if (lane < nrows) {
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
