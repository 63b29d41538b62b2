// Embedding row gather + dequantize. Twin: pulsar_kernels::dequantize of the
// selected rows. out is [n, cols] f32; an id >= n_vocab gives a row of NaN.

#define EMBED_THREADS 256

template <int F>
__device__ __forceinline__ void embed_q(const u8* table, const u32* ids, float* out, int n, int cols,
                                        int n_vocab, const u64* tab) {
    int t = blockIdx.y;
    int e = blockIdx.x * EMBED_THREADS + threadIdx.x;
    if (t >= n || e >= cols) return;
    u32 id = ids[t];
    float* o = out + (size_t)t * cols;
    if (id >= (u32)n_vocab) {
        o[e] = __int_as_float(0x7fc00000);
        return;
    }
    const u8* row = table + (size_t)id * w_row_bytes<F>(cols);
    Unit u = load_unit<F>(row, e >> 5, tab);
    o[e] = unit_value<F>(u, e & 31);
}

template <int T>
__device__ __forceinline__ void embed_f(const u8* table, const u32* ids, float* out, int n, int cols, int n_vocab) {
    int t = blockIdx.y;
    int e = blockIdx.x * EMBED_THREADS + threadIdx.x;
    if (t >= n || e >= cols) return;
    u32 id = ids[t];
    float* o = out + (size_t)t * cols;
    if (id >= (u32)n_vocab) {
        o[e] = __int_as_float(0x7fc00000);
        return;
    }
    size_t i = (size_t)id * cols + e;
    if (T == 0) o[e] = ((const float*)table)[i];
    else if (T == 1) o[e] = h2f(((const u16*)table)[i]);
    else o[e] = bf2f(((const u16*)table)[i]);
}

#define EMBED_Q(NAME, F)                                                                        \
    extern "C" __global__ void __launch_bounds__(EMBED_THREADS) embed_##NAME(                  \
        const u8* table, const u32* ids, float* out, int n, int cols, int n_vocab, const u64* tab) { \
        pdl_begin(); \
        embed_q<F>(table, ids, out, n, cols, n_vocab, tab);                                     \
    }
#define EMBED_F(NAME, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(EMBED_THREADS) embed_##NAME(                  \
        const u8* table, const u32* ids, float* out, int n, int cols, int n_vocab, const u64*) { \
        pdl_begin(); \
        embed_f<T>(table, ids, out, n, cols, n_vocab);                                          \
    }

EMBED_F(f32, 0)
EMBED_F(f16, 1)
EMBED_F(bf16, 2)
EMBED_Q(q8_0, F_Q8_0)
EMBED_Q(q4_0, F_Q4_0)
EMBED_Q(q4_1, F_Q4_1)
EMBED_Q(q5_0, F_Q5_0)
EMBED_Q(q5_1, F_Q5_1)
EMBED_Q(q2_k, F_Q2_K)
EMBED_Q(q3_k, F_Q3_K)
EMBED_Q(q4_k, F_Q4_K)
EMBED_Q(q5_k, F_Q5_K)
EMBED_Q(q6_k, F_Q6_K)
EMBED_Q(iq2_xxs, F_IQ2_XXS)
EMBED_Q(iq2_xs, F_IQ2_XS)
EMBED_Q(iq3_xxs, F_IQ3_XXS)
