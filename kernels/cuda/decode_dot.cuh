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
// - a warp walks its rows chunk by chunk (DD_BPS blocks of each row), the next
//   chunk's cp.async copies in flight while this one is summed;
// - the K and IQ formats give each superblock to four lanes (lane 4g + q
//   holds units 2q and 2q + 1 of superblock g of the chunk), so a lane keeps
//   two units, not eight rows' worth of them: few registers, many warps.
// A warp takes `nrows` <= DD_MAX_ROWS rows, from up to two matrices (moe_up's
// gate and up rows: rows 0..per-1 of the first, then of the second).

#define DD_WARPS 8
#define DD_MAX_ROWS 8

template <int F> struct DD {
    enum {
        LPB = Fmt<F>::UNITS == 8 ? 4 : 1, // lanes per block
        UPL = Fmt<F>::UNITS == 8 ? 2 : 1, // units per lane
        BPS = 32 / (Fmt<F>::UNITS == 8 ? 4 : 1), // blocks per chunk
        CHUNK = (32 / (Fmt<F>::UNITS == 8 ? 4 : 1)) * Fmt<F>::BYTES, // bytes of a row's chunk (a multiple of 16)
        RSTRIDE = (32 / (Fmt<F>::UNITS == 8 ? 4 : 1)) * Fmt<F>::BYTES + 16, // a staged chunk at any phase
    };
};

// Shared-memory bytes of one warp's ring for `nrows` rows (host twin:
// decode_ring_bytes in host/cuda/src/ops.rs).
template <int F> __device__ __forceinline__ int dd_ring_bytes(int nrows) { return 2 * nrows * DD<F>::RSTRIDE; }

// Block-cooperative: copy `len` bytes at `src` into `dst` (16-aligned, len +
// 32 bytes long) as whole granules, keeping the phase; returns where the
// bytes land. The caller commits, waits and syncs the block.
__device__ __forceinline__ const u8* stage_block(u8* dst, const u8* src, size_t len) {
    size_t a = (size_t)src;
    size_t first = a >> 4, ng = ((a + len - 1) >> 4) - first + 1;
    for (size_t i = threadIdx.x; i < ng; i += blockDim.x) cp_async16(dst + 16 * i, (const void*)((first + i) << 4));
    return dst + (a & 15);
}

// Row r of the warp's rows: matrix r / per (of w0, w1), row r % per of it.
__device__ __forceinline__ const u8* dd_row(const u8* w0, const u8* w1, int per, size_t wrb, int r) {
    return (r < per ? w0 : w1) + (size_t)(r < per ? r : r - per) * wrb;
}

// Issue the copies of chunk c of every row into ring slot `slot`.
template <int F>
__device__ __forceinline__ void dd_issue(u8* slot, const u8* w0, const u8* w1, int per, int nrows, size_t wrb,
                                         int c, int blocks) {
    int lane = threadIdx.x & 31;
    int bytes = min((int)DD<F>::BPS, blocks - c * DD<F>::BPS) * Fmt<F>::BYTES;
    size_t off = (size_t)c * DD<F>::CHUNK;
    for (int r = 0; r < nrows; r++) {
        size_t g = (size_t)(dd_row(w0, w1, per, wrb, r) + off);
        size_t first = g >> 4, ng = ((g + bytes - 1) >> 4) - first + 1;
        u8* dst = slot + r * DD<F>::RSTRIDE;
        for (size_t i = lane; i < ng; i += 32) cp_async16(dst + 16 * i, (const void*)((first + i) << 4));
    }
}

// The canonical dots of the warp's rows against the staged activation row
// `x` (`units` units). `ring`: this warp's dd_ring_bytes(nrows); `vals`:
// DD_MAX_ROWS * VALS_STRIDE floats. Chunk 0 is already issued and committed
// into slot 0 (dd_begin). Returns lane r's finished dot of row r (lanes >=
// nrows: garbage to ignore).
template <int F>
__device__ __forceinline__ float dd_rows(const u8* w0, const u8* w1, int per, int nrows, size_t wrb,
                                         const u8* x, int units, u8* ring, float* vals, const u64* tab) {
    const int lane = threadIdx.x & 31;
    const int UN = Fmt<F>::UNITS, LPB = DD<F>::LPB, UPL = DD<F>::UPL, BPS = DD<F>::BPS;
    const int blocks = units / UN;
    const int chunks = (blocks + BPS - 1) / BPS;
    const int sb = lane / LPB, part = lane % LPB;
    float acc = 0.0f;
    for (int c = 0; c < chunks; c++) {
        u8* cur = ring + (c & 1) * nrows * DD<F>::RSTRIDE;
        if (c + 1 < chunks) {
            dd_issue<F>(ring + ((c + 1) & 1) * nrows * DD<F>::RSTRIDE, w0, w1, per, nrows, wrb, c + 1, blocks);
            cp_async_commit();
            cp_async_wait1();
        } else {
            cp_async_wait0();
        }
        __syncwarp();
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
            const u8* wr = cur + r * DD<F>::RSTRIDE + ((size_t)(dd_row(w0, w1, per, wrb, r) + off) & 15);
            int S = 0, M = 0;
            float d = 0.0f, dm = 0.0f;
            if (ok) {
#pragma unroll
                for (int i = 0; i < UPL; i++) {
                    Unit u = load_unit<F>(wr, sb * UN + part * UPL + i, tab);
                    int s, m;
                    unit_sums<F>(u, xv[i], s, m);
                    S += s;
                    M += m;
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
            if (ok && part == 0) vals[r * VALS_STRIDE + sb] = block_value<F>(xv[0].d, d, dm, S, M);
        }
        __syncwarp();
        if (lane < nrows) {
            int nb = min(BPS, blocks - c * BPS);
            const float* v = vals + lane * VALS_STRIDE;
            for (int j = 0; j < nb; j++) acc = __fadd_rn(acc, v[j]);
        }
        // The ring slot and vals are rewritten next chunk.
        __syncwarp();
    }
    return finish_dot<F>(acc);
}

// Dynamic shared memory layout of the decode kernels: the staged activation
// row (xsb bytes, 0 when x is read from global memory), then DD_WARPS rings.
// Stages x (when xsb > 0) and chunk 0 of this warp's rows, then syncs the
// block so every warp may read x. Every warp of the block must call it.
template <int F>
__device__ __forceinline__ const u8* dd_begin(u8* smem, int xsb, const u8* x, size_t xlen, const u8* w0,
                                              const u8* w1, int per, int nrows, size_t wrb, int units,
                                              int rows_per_warp, u8*& ring) {
    int warp = threadIdx.x >> 5;
    ring = smem + xsb + warp * dd_ring_bytes<F>(rows_per_warp);
    const u8* xs = x;
    if (xsb > 0) {
        xs = stage_block(smem, x, xlen);
        cp_async_commit();
    }
    if (nrows > 0) dd_issue<F>(ring, w0, w1, per, nrows, wrb, 0, units / Fmt<F>::UNITS);
    cp_async_commit();
    if (xsb > 0) {
        // x was copied by every thread: wait for its group (chunk 0 may still
        // fly), then for the block.
        cp_async_wait1();
        __syncthreads();
    }
    return xs;
}
