// f32 / f16 / bf16 GEMV and small GEMM on f32 activations.
// Twin: pulsar_kernels::Kernels::matmul with ActFormat::F32, bit for bit: the
// CPU's float dots use this order (kernels/src/quant/float_dot.rs): lane l of a
// warp sums values l, l + 32, ... as acc + w * x (rounded separately, no FMA),
// then warp_sum's xor-butterfly.

#define FG_WARPS 4
#define FG_TT 8

// T: 0 = f32, 1 = f16, 2 = bf16.
template <int T> __device__ __forceinline__ float ldw(const u8* w, size_t i) {
    if (T == 0) return ((const float*)w)[i];
    if (T == 1) return h2f(((const u16*)w)[i]);
    return bf2f(((const u16*)w)[i]);
}
template <int T> __device__ __forceinline__ size_t wbytes() { return T == 0 ? 4 : 2; }

template <int T>
__device__ __forceinline__ void fgemv(const u8* W, const float* x, float* y, int rows, int cols) {
    int row = blockIdx.x * FG_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const u8* w = W + (size_t)row * cols * wbytes<T>();
    float acc = 0.0f;
    for (int i = threadIdx.x & 31; i < cols; i += 32) acc = __fadd_rn(acc, __fmul_rn(ldw<T>(w, i), x[i]));
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0) y[row] = acc;
}

// Shared-memory bytes of one chunk buffer of fgemv_staged: `ch` weights and
// `ch` activations, each with room for stage_span's granules. Host twin:
// float_stage_bytes in host/cuda/src/ops.rs.
__device__ __forceinline__ size_t fgs_buf_bytes(int ch, size_t wb) { return (size_t)ch * wb + 32 + (size_t)ch * 4 + 32; }

// The chunk `c` of the row and of x into its buffer (chunk c in buffer c & 1),
// as cp.async granules, then commits them as one group. Returns nothing: the
// dot recomputes where the chunk landed (stage_span's dst + (src & 15)).
template <int T>
__device__ __forceinline__ void fgs_stage(u8* smem, size_t buf, int ch, const u8* w, const float* x, int cols, int c) {
    int c0 = c * ch, n = min(ch, cols - c0);
    u8* b = smem + (c & 1) * buf;
    stage_span(b, w + (size_t)c0 * wbytes<T>(), (size_t)n * wbytes<T>(), false);
    stage_span(b + (size_t)ch * wbytes<T>() + 32, x + c0, (size_t)n * 4, true);
}

// One row a one-warp block, for matrices of few rows, where fgemv's warps each
// waiting on their own loads leave most of the GPU's memory parallelism idle:
// the row and x are copied to shared memory in chunks of `ch` values (a
// multiple of 32), two chunks in flight ahead of the dot, so a row of up to
// 2 * ch values is read in one round trip. A chunk starts at a multiple of 32,
// so lane l still sums values l, l + 32, ... in order as acc + w * x: fgemv's
// bits. Dynamic shared memory: min(2, chunks) * fgs_buf_bytes(ch).
template <int T>
__device__ __forceinline__ void fgemv_staged(const u8* W, const float* x, float* y, int rows, int cols, int ch) {
    extern __shared__ __align__(16) u8 fgs_smem[];
    int row = blockIdx.x, lane = threadIdx.x & 31;
    if (row >= rows || cols <= 0) return;
    const u8* w = W + (size_t)row * cols * wbytes<T>();
    size_t buf = fgs_buf_bytes(ch, wbytes<T>());
    int n_chunks = (cols + ch - 1) / ch;
    fgs_stage<T>(fgs_smem, buf, ch, w, x, cols, 0);
    cp_async_commit();
    if (n_chunks > 1) fgs_stage<T>(fgs_smem, buf, ch, w, x, cols, 1);
    cp_async_commit();
    float acc = 0.0f;
    for (int c = 0; c < n_chunks; c++) {
        // Every group but the newest done: chunk c has landed.
        cp_async_wait1();
        __syncwarp();
        int c0 = c * ch, n = min(ch, cols - c0);
        u8* b = fgs_smem + (c & 1) * buf;
        const u8* ws = b + (((size_t)w + (size_t)c0 * wbytes<T>()) & 15);
        const float* xs = (const float*)(b + (size_t)ch * wbytes<T>() + 32 + ((size_t)(x + c0) & 15));
#pragma unroll 8
        for (int i = lane; i < n; i += 32) acc = __fadd_rn(acc, __fmul_rn(ldw<T>(ws, i), xs[i]));
        // All lanes are done with buffer c & 1 before chunk c + 2 overwrites it.
        __syncwarp();
        if (c + 2 < n_chunks) fgs_stage<T>(fgs_smem, buf, ch, w, x, cols, c + 2);
        cp_async_commit();
    }
    acc = warp_sum(acc);
    if (lane == 0) y[row] = acc;
}

template <int T>
__device__ __forceinline__ void fgemm(const u8* W, const float* X, float* Y, int rows, int cols, int n_tok) {
    int row = blockIdx.x * FG_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    int t0 = blockIdx.y * FG_TT;
    int nt = min(FG_TT, n_tok - t0);
    const u8* w = W + (size_t)row * cols * wbytes<T>();
    float acc[FG_TT];
#pragma unroll
    for (int t = 0; t < FG_TT; t++) acc[t] = 0.0f;
    for (int i = threadIdx.x & 31; i < cols; i += 32) {
        float wv = ldw<T>(w, i);
#pragma unroll
        for (int t = 0; t < FG_TT; t++)
            if (t < nt) acc[t] = __fadd_rn(acc[t], __fmul_rn(wv, X[(size_t)(t0 + t) * cols + i]));
    }
#pragma unroll
    for (int t = 0; t < FG_TT; t++) {
        float v = warp_sum(acc[t]);
        if (t < nt && (threadIdx.x & 31) == 0) Y[(size_t)(t0 + t) * rows + row] = v;
    }
}

#define FGEMV_ENTRY(NAME, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(FG_WARPS * 32)                                  \
        gemv_##NAME(const u8* W, const float* x, float* y, int rows, int cols) { \
        pdl_begin(); \
        fgemv<T>(W, x, y, rows, cols);                                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FG_WARPS * 32)                                  \
        gemm_##NAME(const u8* W, const float* X, float* Y, int rows, int cols, int n_tok) { \
        pdl_begin(); \
        fgemm<T>(W, X, Y, rows, cols, n_tok);                                                     \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(32)                                             \
        gemv_staged_##NAME(const u8* W, const float* x, float* y, int rows, int cols, int ch) { \
        pdl_begin(); \
        fgemv_staged<T>(W, x, y, rows, cols, ch);                                                 \
    }

FGEMV_ENTRY(f32, 0)
FGEMV_ENTRY(f16, 1)
FGEMV_ENTRY(bf16, 2)
