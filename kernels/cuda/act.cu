// Elementwise ops. Twins: pulsar_kernels::ops::glu_rows (silu / gelu_tanh / swiglu_oai),
// plain f32 add / mul / scale.

extern "C" __global__ void glu(const float* gate, const float* up, float* out, int n, int act) {
    pdl_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = unit_f(act, gate[i], up[i]);
}
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, int n) {
    pdl_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
extern "C" __global__ void mul_f32(const float* a, const float* b, float* out, int n) {
    pdl_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i];
}
extern "C" __global__ void scale_f32(const float* a, float s, float* out, int n) {
    pdl_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * s;
}

// Row gather / scatter for grouped expert products: rows of one expert made
// contiguous, and results put back in (token, slot) order. Twins: row copies.
// dst[i] = src[idx[i]] (rows of row_bytes bytes); one block per row.
extern "C" __global__ void gather_rows_u8(const unsigned char* src, const int* idx, int n, int row_bytes,
                                          unsigned char* dst) {
    pdl_begin();
    int i = blockIdx.x;
    if (i >= n) return;
    const unsigned char* s = src + (size_t)idx[i] * row_bytes;
    unsigned char* d = dst + (size_t)i * row_bytes;
    for (int b = threadIdx.x; b < row_bytes; b += blockDim.x) d[b] = s[b];
}
// dst[idx[i]] = src[i] (rows of cols floats); one block per row.
extern "C" __global__ void scatter_rows_f32(const float* src, const int* idx, int n, int cols, float* dst) {
    pdl_begin();
    int i = blockIdx.x;
    if (i >= n) return;
    const float* s = src + (size_t)i * cols;
    float* d = dst + (size_t)idx[i] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) d[c] = s[c];
}
