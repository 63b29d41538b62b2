// RMS norm (grouped) and rotary embeddings.
// Twins: pulsar_kernels::ops::rms_norm_rows, ops::rope_rows.

#define NORM_THREADS 256

// y = x * rsqrt(mean(x^2) + eps) [* w], per group of `group` values; one block
// per group; the sum of squares in f64. x may alias y. The CPU twin adds the
// squares in this kernel's order (thread-strided partials, warp butterfly,
// warp sums in order), so both give the same bits.
//
// V > 0 (group <= V * NORM_THREADS): a thread's values of x and w are loaded
// into registers up front, every load in flight before the first add, and the
// output pass reuses them. Re-reading x after the sum made each output load
// wait for the store before it (x may alias y), one round trip per value.
// V == 0: any group, straight from memory. Same operations, same order.
template <int V>
__device__ __forceinline__ void rms_norm_group(const float* xg, float* yg, const float* w, int group, float eps,
                                               double* part) {
    int t = threadIdx.x;
    float xv[V > 0 ? V : 1], wv[V > 0 ? V : 1];
    double ss = 0.0;
    if (V > 0) {
#pragma unroll
        for (int j = 0; j < V; j++) {
            int i = t + j * NORM_THREADS;
            xv[j] = i < group ? xg[i] : 0.0f;
            wv[j] = w && i < group ? w[i] : 1.0f;
        }
#pragma unroll
        for (int j = 0; j < V; j++)
            if (t + j * NORM_THREADS < group) ss = __dadd_rn(ss, __dmul_rn((double)xv[j], (double)xv[j]));
    } else {
        for (int i = t; i < group; i += NORM_THREADS) ss = __dadd_rn(ss, __dmul_rn((double)xg[i], (double)xg[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss = __dadd_rn(ss, __shfl_xor_sync(FULL_MASK, ss, o));
    if ((t & 31) == 0) part[t >> 5] = ss;
    __syncthreads();
    double tot = 0.0;
#pragma unroll
    for (int i = 0; i < NORM_THREADS / 32; i++) tot = __dadd_rn(tot, part[i]);
    float scale = __double2float_rn(__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(__ddiv_rn(tot, (double)group), (double)eps))));
    if (V > 0) {
#pragma unroll
        for (int j = 0; j < V; j++) {
            int i = t + j * NORM_THREADS;
            if (i < group) {
                float v = __fmul_rn(xv[j], scale);
                yg[i] = w ? __fmul_rn(v, wv[j]) : v;
            }
        }
    } else {
        for (int i = t; i < group; i += NORM_THREADS) {
            float v = __fmul_rn(xg[i], scale);
            yg[i] = w ? __fmul_rn(v, w[i]) : v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm(const float* x, float* y, const float* w, int group, int n_groups, float eps) {
    pdl_begin();
    __shared__ double part[NORM_THREADS / 32];
    int g = blockIdx.x;
    if (g >= n_groups) return;
    const float* xg = x + (size_t)g * group;
    float* yg = y + (size_t)g * group;
    // Up to 32 values a thread (8192 a group) in registers; beyond, the loop.
    if (group <= NORM_THREADS)
        rms_norm_group<1>(xg, yg, w, group, eps, part);
    else if (group <= 4 * NORM_THREADS)
        rms_norm_group<4>(xg, yg, w, group, eps, part);
    else if (group <= 8 * NORM_THREADS)
        rms_norm_group<8>(xg, yg, w, group, eps, part);
    else if (group <= 16 * NORM_THREADS)
        rms_norm_group<16>(xg, yg, w, group, eps, part);
    else if (group <= 32 * NORM_THREADS)
        rms_norm_group<32>(xg, yg, w, group, eps, part);
    else
        rms_norm_group<0>(xg, yg, w, group, eps, part);
}

// Rows of `width` values (heads of head_dim), row r at positions[r], from x
// into y; y == x rotates in place. kind 0 = neox (i, i + n_rot/2), 1 =
// interleaved (2i, 2i+1). One thread per (row, head, slot): slots below
// n_rot/2 rotate a pair; out of place, the head_dim - n_rot slots after them
// copy the unrotated tail, so no copy of the row has to come first.
extern "C" __global__ void rope(const float* x, float* y, int width, const u32* positions, int n_rows,
                                int head_dim, int n_rot, float base, float linear_factor, int kind) {
    pdl_begin();
    int half = n_rot / 2;
    int per = half + (x == y ? 0 : head_dim - n_rot);
    int heads = width / head_dim;
    size_t total = (size_t)n_rows * heads * per;
    size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (tid >= total) return;
    int i = (int)(tid % per);
    size_t rh = tid / per;
    int h = (int)(rh % heads);
    int r = (int)(rh / heads);
    size_t off = (size_t)r * width + (size_t)h * head_dim;
    if (i >= half) {
        size_t d = off + n_rot + (i - half);
        y[d] = x[d];
        return;
    }
    // The shared f64 formulas of ops::math (rope_inv_freq, rope_cos_sin), not
    // pow/cosf/sinf, whose last bits differ from the CPU's.
    float inv_freq = rope_inv_freq_c(base, i, n_rot);
    float t = __fdiv_rn((float)positions[r], linear_factor);
    float c, s;
    rope_cos_sin_c(__fmul_rn(t, inv_freq), &c, &s);
    size_t ia = off + (kind == 0 ? i : 2 * i);
    size_t ib = off + (kind == 0 ? i + half : 2 * i + 1);
    float x0 = x[ia], x1 = x[ib];
    y[ia] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    y[ib] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// One head's RMS norm then its rotation, for up to two tensors (decode's q
// and k, per-head q_norm / k_norm then rope) in one launch: blocks [0, g0)
// take part 0, the rest part 1; a block is one head (group == head_dim) of
// one row. It writes the normed head (n*) and the rotated one (r*) with the
// operations of rms_norm and rope, so both outputs have their bits.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    norm_rope(const float* x0, const float* w0, float* n0, float* r0, int width0, int g0, float eps0,
              const float* x1, const float* w1, float* n1, float* r1, int width1, float eps1, int n_groups,
              const u32* positions, int head_dim, int n_rot, float base, float linear_factor, int kind) {
    pdl_begin();
    __shared__ double part[NORM_THREADS / 32];
    int b = blockIdx.x;
    if (b >= n_groups) return;
    bool second = b >= g0;
    if (second) b -= g0;
    const float* x = second ? x1 : x0;
    const float* w = second ? w1 : w0;
    float* yn = second ? n1 : n0;
    float* yr = second ? r1 : r0;
    int width = second ? width1 : width0;
    float eps = second ? eps1 : eps0;
    size_t off = (size_t)b * head_dim;
    if (head_dim <= NORM_THREADS)
        rms_norm_group<1>(x + off, yn + off, w, head_dim, eps, part);
    else
        rms_norm_group<0>(x + off, yn + off, w, head_dim, eps, part);
    // The block's normed values, written above, are visible after the barrier.
    __syncthreads();
    int r = b / (width / head_dim);
    int half = n_rot / 2;
    const float* xn = yn + off;
    float* y = yr + off;
    for (int i = threadIdx.x; i < half + head_dim - n_rot; i += NORM_THREADS) {
        if (i >= half) {
            int d = n_rot + (i - half);
            y[d] = xn[d];
            continue;
        }
        float inv_freq = rope_inv_freq_c(base, i, n_rot);
        float t = __fdiv_rn((float)positions[r], linear_factor);
        float c, s;
        rope_cos_sin_c(__fmul_rn(t, inv_freq), &c, &s);
        int ia = kind == 0 ? i : 2 * i, ib = kind == 0 ? i + half : 2 * i + 1;
        float v0 = xn[ia], v1 = xn[ib];
        y[ia] = __fsub_rn(__fmul_rn(v0, c), __fmul_rn(v1, s));
        y[ib] = __fadd_rn(__fmul_rn(v0, s), __fmul_rn(v1, c));
    }
}
