// Mixture-of-experts: the top-k router and the expert FFN over explicit
// per-(token, slot) weight pointers.
//
// route_topk — twin: ops::softmax_in_place (or a sigmoid) + ops::top_k, then
// optional renormalisation of the k weights and a scale. An optional per-expert
// bias shifts the selection only (the weights stay the unbiased scores).
//
// moe_up_* / moe_down_* — pairs p = t * n_slot + s. gate_ptrs[p], up_ptrs[p],
// down_ptrs[p] are device addresses of that expert's [ff, cols] gate/up and
// [d_model, ff] down matrices; 0 means "not mine": the pair is skipped and its
// rows of H / OUT are left untouched. row_lo (null: all 0) gives each pair its
// first row: moe_up leaves H[p] rows below row_lo[p] untouched (the CPU lane
// computes those rows of a split expert and its weights there are absent).
// moe_up writes H[p] = act(gate x_t) * (up x_t)
// (x_t: token t's q8 activation row); the host quantizes H to q8 (quantize_*),
// then moe_down writes OUT[p] = down · Hq[p]. The host sums OUT over slots in
// slot order. Twin: Kernels::matvec + ops::glu_rows + Activations + matvec.

#define ROUTE_THREADS 256
#define MOE_WARPS 4

struct Best {
    float v;
    int i;
};
__device__ __forceinline__ Best better(Best a, Best b) {
    // Larger value wins; ties go to the lower index (the CPU's stable sort).
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
}

// logits: [n_tok, n_exp]; ids / weights: [n_tok, k]. gating 0 = softmax,
// 1 = sigmoid. Dynamic shared memory: 2 * n_exp floats.
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS)
    route_topk(const float* logits, const float* bias, int n_tok, int n_exp, int k, int gating, int renorm,
               float scale, int* ids, float* weights) {
    pdl_begin();
    extern __shared__ float smem[];
    float* p = smem;          // scores
    float* c = smem + n_exp;  // selection keys
    __shared__ float redf[ROUTE_THREADS / 32];
    __shared__ Best redb[ROUTE_THREADS / 32];
    __shared__ float chosen[64];
    int t = blockIdx.x;
    if (t >= n_tok) return;
    const float* x = logits + (size_t)t * n_exp;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (gating == 1) {
        for (int e = threadIdx.x; e < n_exp; e += ROUTE_THREADS) p[e] = sigmoid_c(x[e]);
    } else {
        float m = NEG_INF;
        for (int e = threadIdx.x; e < n_exp; e += ROUTE_THREADS) m = fmaxf(m, x[e]);
        m = warp_max(m);
        if (lane == 0) redf[warp] = m;
        __syncthreads();
        m = redf[0];
        for (int i = 1; i < ROUTE_THREADS / 32; i++) m = fmaxf(m, redf[i]);
        __syncthreads();
        for (int e = threadIdx.x; e < n_exp; e += ROUTE_THREADS) p[e] = exp_c(__fsub_rn(x[e], m));
        __syncthreads();
        // The sum in index order on one thread, like the CPU.
        if (threadIdx.x == 0) {
            float s = 0.0f;
            for (int e = 0; e < n_exp; e++) s += p[e];
            redf[0] = 1.0f / s;
        }
        __syncthreads();
        float inv = redf[0];
        for (int e = threadIdx.x; e < n_exp; e += ROUTE_THREADS) p[e] = p[e] * inv;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_exp; e += ROUTE_THREADS) c[e] = bias ? p[e] + bias[e] : p[e];
    __syncthreads();
    for (int r = 0; r < k; r++) {
        Best b = {NEG_INF, 1 << 30};
        for (int e = threadIdx.x; e < n_exp; e += ROUTE_THREADS) b = better(b, Best{c[e], e});
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            Best other = {__shfl_xor_sync(FULL_MASK, b.v, o), __shfl_xor_sync(FULL_MASK, b.i, o)};
            b = better(b, other);
        }
        if (lane == 0) redb[warp] = b;
        __syncthreads();
        if (threadIdx.x == 0) {
            Best best = redb[0];
            for (int i = 1; i < ROUTE_THREADS / 32; i++) best = better(best, redb[i]);
            int id = best.i < n_exp ? best.i : 0;
            ids[(size_t)t * k + r] = id;
            chosen[r] = p[id];
            c[id] = NEG_INF;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        // In order, and no renormalisation of an all-zero choice (the CPU's).
        float s = 0.0f;
        for (int r = 0; r < k; r++) s = __fadd_rn(s, chosen[r]);
        for (int r = 0; r < k; r++) {
            float w = renorm && s > 0.0f ? __fdiv_rn(chosen[r], s) : chosen[r];
            weights[(size_t)t * k + r] = __fmul_rn(w, scale);
        }
    }
}

// route_topk_warp — route_topk's results, bit for bit, for n_exp <= 256: one
// warp a token (ROUTE_WARPS tokens a block), V <= 8 scores a lane in
// registers, no block barriers. Lane l holds experts l, l + 32, ... Every
// value is formed by the same operations in the same order: the max (fmaxf
// over the same values: its result does not depend on the order; a max of
// either zero gives the same exp_c(x - max)), exp_c, the sum in index order
// (every lane runs thread 0's chain from shared memory), 1 / sum, the product,
// the bias add. Each round's pick is the maximum of the same total order
// (larger value, then lower index; NaN keys never win, removed keys become
// -inf and can be picked again, nothing left picks 0), which no reduction
// order changes; the renormalising sum adds the k weights in pick order.
#define ROUTE_WARPS 4
#define ROUTE_WARP_MAX 256

// Pointer tables to gather through (moe_gather_ptrs's work, done here when
// pg is non-null): pair p's slabs are tg / tu / td [ids[p]].
struct RouteGather {
    const u64 *tg, *tu, *td;
    u64 *pg, *pu, *pd;
};

template <int V>
__device__ __forceinline__ void route_warp(const float* logits, const float* bias, int n_tok, int n_exp, int k,
                                           int gating, int renorm, float scale, int* ids, float* weights,
                                           float* sp, RouteGather gt) {
    int lane = threadIdx.x & 31;
    int t = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= n_tok) return;
    const float* x = logits + (size_t)t * n_exp;
    float p[V], c[V];
#pragma unroll
    for (int j = 0; j < V; j++) p[j] = j * 32 + lane < n_exp ? x[j * 32 + lane] : 0.0f;
    if (gating == 1) {
#pragma unroll
        for (int j = 0; j < V; j++) p[j] = sigmoid_c(p[j]);
    } else {
        float m = NEG_INF;
#pragma unroll
        for (int j = 0; j < V; j++)
            if (j * 32 + lane < n_exp) m = fmaxf(m, p[j]);
        m = warp_max(m);
#pragma unroll
        for (int j = 0; j < V; j++) {
            p[j] = exp_c(__fsub_rn(p[j], m));
            if (j * 32 + lane < n_exp) sp[j * 32 + lane] = p[j];
        }
        __syncwarp();
        float s = 0.0f;
        int e = 0;
        for (; e + 4 <= n_exp; e += 4) {
            float4 q = *(const float4*)(sp + e);
            s = __fadd_rn(__fadd_rn(__fadd_rn(__fadd_rn(s, q.x), q.y), q.z), q.w);
        }
        for (; e < n_exp; e++) s = __fadd_rn(s, sp[e]);
        float inv = __fdiv_rn(1.0f, s);
#pragma unroll
        for (int j = 0; j < V; j++) p[j] = __fmul_rn(p[j], inv);
        // Every lane's sum has read sp before the weights overwrite it.
        __syncwarp();
    }
#pragma unroll
    for (int j = 0; j < V; j++) {
        int e = j * 32 + lane;
        if (e < n_exp) sp[e] = p[j];
        c[j] = e < n_exp && bias ? __fadd_rn(p[j], bias[e]) : p[j];
    }
    __syncwarp();
    float s = 0.0f, w_lo = 0.0f, w_hi = 0.0f;
    int id_lo = 0, id_hi = 0;
    for (int r = 0; r < k; r++) {
        Best b = {NEG_INF, 1 << 30};
#pragma unroll
        for (int j = 0; j < V; j++)
            if (j * 32 + lane < n_exp) b = better(b, Best{c[j], j * 32 + lane});
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            Best other = {__shfl_xor_sync(FULL_MASK, b.v, o), __shfl_xor_sync(FULL_MASK, b.i, o)};
            b = better(b, other);
        }
        int id = b.i < n_exp ? b.i : 0;
#pragma unroll
        for (int j = 0; j < V; j++)
            if (j * 32 + lane == id) c[j] = NEG_INF;
        float w = sp[id];
        s = __fadd_rn(s, w);
        if (lane == (r & 31)) {
            if (r < 32) {
                id_lo = id;
                w_lo = w;
            } else {
                id_hi = id;
                w_hi = w;
            }
        }
    }
    for (int r = lane; r < k; r += 32) {
        float w = r < 32 ? w_lo : w_hi;
        w = renorm && s > 0.0f ? __fdiv_rn(w, s) : w;
        int id = r < 32 ? id_lo : id_hi;
        size_t p = (size_t)t * k + r;
        ids[p] = id;
        weights[p] = __fmul_rn(w, scale);
        if (gt.pg) {
            gt.pg[p] = gt.tg[id];
            gt.pu[p] = gt.tu[id];
            gt.pd[p] = gt.td[id];
        }
    }
}

// Parameters as route_topk (n_exp <= ROUTE_WARP_MAX), then the pointer
// tables and outputs of RouteGather (null pg: no gather); no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
    route_topk_warp(const float* logits, const float* bias, int n_tok, int n_exp, int k, int gating, int renorm,
                    float scale, int* ids, float* weights, const u64* tg, const u64* tu, const u64* td, u64* pg,
                    u64* pu, u64* pd) {
    pdl_begin();
    __shared__ __align__(16) float sp[ROUTE_WARPS][ROUTE_WARP_MAX];
    float* s = sp[threadIdx.x >> 5];
    RouteGather gt{tg, tu, td, pg, pu, pd};
    if (n_exp <= 32)
        route_warp<1>(logits, bias, n_tok, n_exp, k, gating, renorm, scale, ids, weights, s, gt);
    else if (n_exp <= 64)
        route_warp<2>(logits, bias, n_tok, n_exp, k, gating, renorm, scale, ids, weights, s, gt);
    else if (n_exp <= 128)
        route_warp<4>(logits, bias, n_tok, n_exp, k, gating, renorm, scale, ids, weights, s, gt);
    else
        route_warp<8>(logits, bias, n_tok, n_exp, k, gating, renorm, scale, ids, weights, s, gt);
}

// Up to DD_WARPS warps a block; a warp takes ng groups of rpw rows (moe_up: rpw
// gate rows and the same rpw up rows side by side, 2 rpw <= DD_MAX_ROWS),
// streamed step by step (decode_dot.cuh). xsb > 0: the pair's activation row
// is staged in the first xsb bytes of dynamic shared memory.
template <int F>
__device__ __forceinline__ void moe_up(const u64* gate_ptrs, const u64* up_ptrs, const int* row_lo, const u8* X,
                                       float* H, int ff, int cols, int n_slot, int act, int rpw, int ng, int xsb,
                                       const u64* tab) {
    __shared__ __align__(16) float vals[DD_WARPS][DD_MAX_ROWS * DD_VALS_STRIDE];
    extern __shared__ __align__(16) u8 moe_stage[];
    int p = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u64 gp = gate_ptrs[p], upp = up_ptrs[p];
    int lo = row_lo ? row_lo[p] : 0;
    // The whole block skips a null pair, or one whose rows all lie below its
    // first row (before any barrier).
    if (gp == 0 || upp == 0 || (int)((blockIdx.x + 1) * blockDim.x / 32) * rpw * ng <= lo) return;
    int t = p / n_slot, first = (blockIdx.x * (blockDim.x >> 5) + warp) * rpw * ng;
    DDWork wk{(const u8*)gp, (const u8*)upp, 2, first, min(rpw * ng, ff - first), rpw, w_row_bytes<F>(cols)};
    size_t xrb = act_row_bytes<F>(cols);
    float* h = H + (size_t)p * ff + first;
    dd_dots<F>(moe_stage, xsb, X + (size_t)t * xrb, xrb, wk, cols / 32, vals[warp], tab, [&](int g, int n, float v) {
        // Lane r holds gate row r of the group, lane rpw + r its up row.
        float u = __shfl_down_sync(FULL_MASK, v, rpw);
        if (lane < n && first + g * rpw + lane >= lo) h[g * rpw + lane] = unit_f(act, v, u);
    });
}

template <int F>
__device__ __forceinline__ void moe_down(const u64* down_ptrs, const u8* HQ, float* OUT, int d_model, int ff,
                                         int rpw, int ng, int xsb, const u64* tab) {
    __shared__ __align__(16) float vals[DD_WARPS][DD_MAX_ROWS * DD_VALS_STRIDE];
    extern __shared__ __align__(16) u8 moe_stage[];
    int p = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u64 dp = down_ptrs[p];
    if (dp == 0) return;
    int first = (blockIdx.x * (blockDim.x >> 5) + warp) * rpw * ng;
    DDWork wk{(const u8*)dp, (const u8*)dp, 1, first, min(rpw * ng, d_model - first), rpw, w_row_bytes<F>(ff)};
    size_t hrb = act_row_bytes<F>(ff);
    float* out = OUT + (size_t)p * d_model + first;
    dd_dots<F>(moe_stage, xsb, HQ + (size_t)p * hrb, hrb, wk, ff / 32, vals[warp], tab, [&](int g, int n, float v) {
        if (lane < n) out[g * rpw + lane] = v;
    });
}

// rpw, ng: rows a group and groups a warp, chosen by the host from the pairs' total rows.
#define MOE_ENTRY(NAME, F)                                                                          \
    extern "C" __global__ void __launch_bounds__(DD_WARPS * 32)                                    \
        moe_up_##NAME(const u64* gate_ptrs, const u64* up_ptrs, const int* row_lo, const u8* X, float* H, \
                      int ff, int cols, int n_slot, int act, int rpw, int ng, int xsb, const u64* tab) { \
        pdl_begin(); \
        moe_up<F>(gate_ptrs, up_ptrs, row_lo, X, H, ff, cols, n_slot, act, rpw, ng, xsb, tab);      \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(DD_WARPS * 32) moe_down_##NAME(                   \
        const u64* down_ptrs, const u8* HQ, float* OUT, int d_model, int ff, int rpw, int ng,      \
        int xsb, const u64* tab) { \
        pdl_begin(); \
        moe_down<F>(down_ptrs, HQ, OUT, d_model, ff, rpw, ng, xsb, tab);                            \
    }

MOE_ENTRY(q8_0, F_Q8_0)
MOE_ENTRY(q4_0, F_Q4_0)
MOE_ENTRY(q4_1, F_Q4_1)
MOE_ENTRY(q5_0, F_Q5_0)
MOE_ENTRY(q5_1, F_Q5_1)
MOE_ENTRY(q2_k, F_Q2_K)
MOE_ENTRY(q3_k, F_Q3_K)
MOE_ENTRY(q4_k, F_Q4_K)
MOE_ENTRY(q5_k, F_Q5_K)
MOE_ENTRY(q6_k, F_Q6_K)
MOE_ENTRY(iq2_xxs, F_IQ2_XXS)
MOE_ENTRY(iq2_xs, F_IQ2_XS)
MOE_ENTRY(iq3_xxs, F_IQ3_XXS)

// moe_gather_ptrs — per-(token, slot) slab pointers from per-expert tables:
// PG[p] = TG[ids[p]] (likewise up, down). A table entry of 0 ("not mine":
// served by another lane) yields a null pair the expert kernels skip. Lets a
// resident or hot-set layer route and run with no host round trip.
// Twin: the host's table lookup.
extern "C" __global__ void moe_gather_ptrs(const int* ids, int n_pairs, int n_exp, const u64* tg, const u64* tu,
                                           const u64* td, u64* pg, u64* pu, u64* pd) {
    pdl_begin();
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n_pairs) return;
    int e = ids[p];
    bool ok = e >= 0 && e < n_exp;
    pg[p] = ok ? tg[e] : 0;
    pu[p] = ok ? tu[e] : 0;
    pd[p] = ok ? td[e] : 0;
}

// moe_combine — y[t] = sum over slots s, in slot order, of w[t, s] * out[t, s]
// from 0, with separate multiply and add roundings as the CPU backend's loop.
// Twin: the CPU MoE op's slot sum.
extern "C" __global__ void moe_combine(const float* out, const float* w, int n_tok, int n_slot, int d_model,
                                       float* y) {
    pdl_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (c >= d_model || t >= n_tok) return;
    float acc = 0.0f;
    for (int s = 0; s < n_slot; s++) {
        size_t p = (size_t)t * n_slot + s;
        acc = __fadd_rn(acc, __fmul_rn(w[p], out[p * d_model + c]));
    }
    y[(size_t)t * d_model + c] = acc;
}

// moe_combine_add — moe_combine's y, and s = y + r (r_first: r + y), the
// residual add that follows the MoE op in a decoder layer, in one launch (the
// add's operands in the op's order, so s has add_f32's bits).
extern "C" __global__ void moe_combine_add(const float* out, const float* w, int n_tok, int n_slot, int d_model,
                                           const float* r, int r_first, float* y, float* s) {
    pdl_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (c >= d_model || t >= n_tok) return;
    float acc = 0.0f;
    for (int k = 0; k < n_slot; k++) {
        size_t p = (size_t)t * n_slot + k;
        acc = __fadd_rn(acc, __fmul_rn(w[p], out[p * d_model + c]));
    }
    size_t i = (size_t)t * d_model + c;
    y[i] = acc;
    s[i] = r_first ? r[i] + acc : acc + r[i];
}

// lane_fill_rows — values computed elsewhere (the CPU lane's heads of split
// experts) into their rows of h: segment s copies seg[3s + 2] values from
// vals + seg[3s + 1] to h + seg[3s]. vals and seg may be mapped host memory
// (a few KB read over the bus): one launch instead of a copy per pair.
// Twin: the segment copies it replaces.
extern "C" __global__ void lane_fill_rows(const float* vals, const int* seg, int n_seg, float* h) {
    pdl_begin();
    int s = blockIdx.x;
    if (s >= n_seg) return;
    int dst = seg[3 * s], src = seg[3 * s + 1], len = seg[3 * s + 2];
    for (int i = threadIdx.x; i < len; i += blockDim.x) h[dst + i] = vals[src + i];
}

// moe_up_<f32|f16|bf16> / moe_down_<...> — the same pairs and null-pointer
// skipping as the quantized entries above, for float expert weights on f32
// activations: moe_up writes H[p] = act(gate x_t) * (up x_t) with x_t token t's
// f32 row; moe_down writes OUT[p] = down · H[p] straight from the f32 H (no
// quantization step). Each lane's strided sum, then warp_sum, is the loop of
// gemv_float.cu's fgemv, so an expert gives the values of the dense float GEMV.
// Twin: Kernels::matvec (ActFormat::F32) + ops::glu_rows + matvec.

// T: 0 = f32, 1 = f16, 2 = bf16 (as gemv_float.cu).
template <int T> __device__ __forceinline__ float moe_ldw(const u8* w, size_t i) {
    if (T == 0) return ((const float*)w)[i];
    if (T == 1) return h2f(((const u16*)w)[i]);
    return bf2f(((const u16*)w)[i]);
}

// This lane's share of w · x over `cols` values (fgemv's order).
template <int T> __device__ __forceinline__ float moe_frow_partial(const u8* w, const float* x, int cols) {
    float acc = 0.0f;
    for (int i = threadIdx.x & 31; i < cols; i += 32) acc = __fadd_rn(acc, __fmul_rn(moe_ldw<T>(w, i), x[i]));
    return acc;
}

template <int T>
__device__ __forceinline__ void moe_up_float(const u64* gate_ptrs, const u64* up_ptrs, const float* X, float* H,
                                             int ff, int cols, int n_slot, int act) {
    int p = blockIdx.y;
    int row = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    u64 gp = gate_ptrs[p], upp = up_ptrs[p];
    if (gp == 0 || upp == 0 || row >= ff) return;
    const float* x = X + (size_t)(p / n_slot) * cols;
    size_t off = (size_t)row * cols * (T == 0 ? 4 : 2);
    float g = warp_sum(moe_frow_partial<T>((const u8*)gp + off, x, cols));
    float u = warp_sum(moe_frow_partial<T>((const u8*)upp + off, x, cols));
    if ((threadIdx.x & 31) == 0) H[(size_t)p * ff + row] = unit_f(act, g, u);
}

template <int T>
__device__ __forceinline__ void moe_down_float(const u64* down_ptrs, const float* H, float* OUT, int d_model, int ff) {
    int p = blockIdx.y;
    int row = blockIdx.x * MOE_WARPS + (threadIdx.x >> 5);
    u64 dp = down_ptrs[p];
    if (dp == 0 || row >= d_model) return;
    size_t off = (size_t)row * ff * (T == 0 ? 4 : 2);
    float y = warp_sum(moe_frow_partial<T>((const u8*)dp + off, H + (size_t)p * ff, ff));
    if ((threadIdx.x & 31) == 0) OUT[(size_t)p * d_model + row] = y;
}

#define MOE_FENTRY(NAME, T)                                                                               \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32) moe_up_##NAME(                           \
        const u64* gate_ptrs, const u64* up_ptrs, const float* X, float* H, int ff, int cols, int n_slot, \
        int act) { \
        pdl_begin(); \
        moe_up_float<T>(gate_ptrs, up_ptrs, X, H, ff, cols, n_slot, act);                                 \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(MOE_WARPS * 32)                                          \
        moe_down_##NAME(const u64* down_ptrs, const float* H, float* OUT, int d_model, int ff) { \
        pdl_begin(); \
        moe_down_float<T>(down_ptrs, H, OUT, d_model, ff);                                                \
    }

MOE_FENTRY(f32, 0)
MOE_FENTRY(f16, 1)
MOE_FENTRY(bf16, 2)
