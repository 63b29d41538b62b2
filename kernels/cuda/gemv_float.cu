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
        gemv_##NAME(const u8* W, const float* x, float* y, int rows, int cols) {                 \
        fgemv<T>(W, x, y, rows, cols);                                                            \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FG_WARPS * 32)                                  \
        gemm_##NAME(const u8* W, const float* X, float* Y, int rows, int cols, int n_tok) {      \
        fgemm<T>(W, X, Y, rows, cols, n_tok);                                                     \
    }

FGEMV_ENTRY(f32, 0)
FGEMV_ENTRY(f16, 1)
FGEMV_ENTRY(bf16, 2)
