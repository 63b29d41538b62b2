// The step graph's primitive ops on N-D row-major values (plugin_api::graph::Op).
// Twins: host/src/cpu/prim.rs (and the CPU step's mask, scan, rope). Every
// output element is computed with the CPU's operations in the CPU's order
// (explicit _rn intrinsics, so nothing is contracted into an FMA), so the
// results are the CPU's bits; the exception is the erf GELU, whose exp is
// libm's on the CPU, which the Ops harness checks with a tolerance. Values
// are 4-byte words: f32, or i32 ids.

#define PRIM_RANK 8

// An N-D index space (row-major over dims) and where each element lies in
// two operands (a, b): offset + sum of index * stride. Mirrors PrimShape in
// host/cuda/src/ops/prim.rs.
struct PrimShape {
    long long n;
    int rank;
    int pad;
    long long dims[PRIM_RANK];
    long long st_a[PRIM_RANK];
    long long st_b[PRIM_RANK];
    long long off_a;
    long long off_b;
};

__device__ __forceinline__ void prim_offsets(const PrimShape& s, long long i, long long* oa, long long* ob) {
    long long a = s.off_a, b = s.off_b;
    for (int d = s.rank - 1; d >= 0; d--) {
        long long n = s.dims[d];
        long long j = i % n;
        i /= n;
        a += j * s.st_a[d];
        b += j * s.st_b[d];
    }
    *oa = a;
    *ob = b;
}

#define PRIM_LOOP(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// dst[b(i)] = src[a(i)]: permute, slice, concat parts, contiguous copies.
extern "C" __global__ void prim_copy(const u32* src, u32* dst, PrimShape s) {
    pdl_begin();
    PRIM_LOOP(i, s.n) {
        long long a, b;
        prim_offsets(s, i, &a, &b);
        dst[b] = src[a];
    }
}

// Exact GELU, x Phi(x), with the CPU's f64 erf (Numerical Recipes erfc fit);
// its exp is the device's, so the last bit may differ from the CPU's libm.
__device__ __forceinline__ float prim_gelu_erf(float xf) {
    double x = (double)xf;
    double z = x / 1.4142135623730951;
    double az = fabs(z);
    double t = 1.0 / (1.0 + 0.5 * az);
    double y = t * exp(-z * z - 1.26551223 +
                       t * (1.00002368 +
                            t * (0.37409196 +
                                 t * (0.09678418 +
                                      t * (-0.18628806 +
                                           t * (0.27886807 +
                                                t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))));
    double erf = z >= 0.0 ? 1.0 - y : y - 1.0;
    return (float)(0.5 * x * (1.0 + erf));
}

// op: plugin_api::graph::Unary in declaration order (0 neg .. 14 gelu_tanh),
// then 15 scale (x * p0) and 16 clamp (min(max(x, p0), p1)).
__device__ __forceinline__ float prim_unary_f(int op, float x, float p0, float p1) {
    switch (op) {
        case 0: return -x;
        case 1: return exp_c(x);
        case 2: return log_c(x);
        case 3: return __fsqrt_rn(x);
        case 4: return __fdiv_rn(1.0f, __fsqrt_rn(x));
        case 5: return __fdiv_rn(1.0f, x);
        case 6: return __fmul_rn(x, x);
        case 7: return fabsf(x);
        case 8: return sigmoid_c(x);
        case 9: return softplus_c(x);
        case 10: return tanh_c(x);
        case 11: return x > 0.0f ? x : 0.0f;
        case 12: return silu_f(x);
        case 13: return prim_gelu_erf(x);
        case 14: return gelu_tanh_f(x);
        case 15: return __fmul_rn(x, p0);
        default: return fminf(fmaxf(x, p0), p1);
    }
}

extern "C" __global__ void prim_unary(const float* x, float* y, long long n, int op, float p0, float p1) {
    pdl_begin();
    PRIM_LOOP(i, n) y[i] = prim_unary_f(op, x[i], p0, p1);
}

// y[i] = f(a[a(i)], b[b(i)]) (broadcast through zero strides); op:
// plugin_api::graph::Binary in declaration order (add sub mul div max min).
extern "C" __global__ void prim_binary(const float* a, const float* b, float* y, PrimShape s, int op) {
    pdl_begin();
    PRIM_LOOP(i, s.n) {
        long long ia, ib;
        prim_offsets(s, i, &ia, &ib);
        float u = a[ia], v = b[ib];
        float r;
        switch (op) {
            case 0: r = __fadd_rn(u, v); break;
            case 1: r = __fsub_rn(u, v); break;
            case 2: r = __fmul_rn(u, v); break;
            case 3: r = __fdiv_rn(u, v); break;
            case 4: r = fmaxf(u, v); break;
            default: r = fminf(u, v); break;
        }
        y[i] = r;
    }
}

// The lanes along one axis: `outer` x `inner` lanes of n entries, entry j of
// lane (o, i) at (o * n + j) * inner + i. One thread a lane, in index order.
#define PRIM_LANE(lane, outer, inner, base, n)          \
    long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (lane >= (outer) * (inner)) return;                \
    long long base = (lane / (inner)) * (n) * (inner) + lane % (inner);

// Softmax along the axis. Twin: ops::softmax_in_place.
extern "C" __global__ void prim_softmax(const float* x, float* y, long long outer, int n, long long inner) {
    pdl_begin();
    PRIM_LANE(lane, outer, inner, base, n)
    float m = NEG_INF;
    for (int j = 0; j < n; j++) m = fmaxf(m, x[base + j * inner]);
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        float v = exp_c(__fsub_rn(x[base + j * inner], m));
        y[base + j * inner] = v;
        sum = __fadd_rn(sum, v);
    }
    float inv = __fdiv_rn(1.0f, sum);
    for (int j = 0; j < n; j++) y[base + j * inner] = __fmul_rn(y[base + j * inner], inv);
}

// Sum (0), mean (1) or max (2) along the axis into y[lane]. `reverse` sums
// from the last entry: a deliberately wrong order, only for the Ops
// harness's negative control (its bits must differ from the CPU's).
extern "C" __global__ void prim_reduce(const float* x, float* y, long long outer, int n, long long inner, int kind,
                                       int reverse) {
    pdl_begin();
    PRIM_LANE(lane, outer, inner, base, n)
    float acc = kind == 2 ? NEG_INF : 0.0f;
    for (int jj = 0; jj < n; jj++) {
        int j = reverse ? n - 1 - jj : jj;
        float v = x[base + j * inner];
        acc = kind == 2 ? fmaxf(acc, v) : __fadd_rn(acc, v);
    }
    if (kind == 1) acc = __fdiv_rn(acc, (float)n);
    y[lane] = acc;
}

extern "C" __global__ void prim_cumsum(const float* x, float* y, long long outer, int n, long long inner) {
    pdl_begin();
    PRIM_LANE(lane, outer, inner, base, n)
    float s = 0.0f;
    for (int j = 0; j < n; j++) {
        s = __fadd_rn(s, x[base + j * inner]);
        y[base + j * inner] = s;
    }
}

// Indices of the k largest of each row of n, largest first, ties to the
// lower index (ops::top_k's stable descending order): pass j takes the
// largest entry that comes after pass j-1's in that order. One thread a row.
extern "C" __global__ void prim_topk(const float* x, int* ids, long long rows, int n, int k) {
    pdl_begin();
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* row = x + r * n;
    float pv = 0.0f;
    int pi = -1;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bv = 0.0f;
        for (int i = 0; i < n; i++) {
            float v = row[i];
            if (pi >= 0 && !(v < pv || (v == pv && i > pi))) continue;
            if (best < 0 || v > bv) {
                best = i;
                bv = v;
            }
        }
        ids[r * k + j] = best;
        pv = bv;
        pi = best;
    }
}

// y[r, j] = x[r, ids[r, j]] over rows of n (x) and k (ids); an id out of
// range gives a NaN (the CPU refuses it).
extern "C" __global__ void prim_take_along(const u32* x, const int* ids, u32* y, long long rows, int n, int k) {
    pdl_begin();
    PRIM_LOOP(i, rows * k) {
        long long r = i / k;
        int id = ids[i];
        y[i] = (id >= 0 && id < n) ? x[r * n + id] : 0x7fc00000u;
    }
}

// y[i, :] = x[ids[i], :] (rows of width words).
extern "C" __global__ void prim_gather(const u32* x, const int* ids, u32* y, long long n_ids, long long rows,
                                       long long width) {
    pdl_begin();
    PRIM_LOOP(i, n_ids * width) {
        long long r = i / width, c = i % width;
        int id = ids[r];
        y[i] = (id >= 0 && id < rows) ? x[id * width + c] : 0x7fc00000u;
    }
}

// [.., m, k] x [.., k, n]: s spans the batch (st_a / st_b in elements, zero
// where broadcast); each output sums k in order. One thread an output.
extern "C" __global__ void prim_matmul(const float* a, const float* b, float* y, PrimShape s, int m, int k, int n) {
    pdl_begin();
    long long mn = (long long)m * n;
    PRIM_LOOP(i, s.n * mn) {
        long long oa, ob;
        prim_offsets(s, i / mn, &oa, &ob);
        long long rem = i % mn;
        long long r = rem / n, c = rem % n;
        const float* ar = a + oa + r * k;
        const float* bc = b + ob + c;
        float acc = 0.0f;
        for (int t = 0; t < k; t++) acc = __fadd_rn(acc, __fmul_rn(ar[t], bc[(long long)t * n]));
        y[i] = acc;
    }
}

// [T, C]: 0 where query t (at positions[t]) sees key j, -inf elsewhere.
extern "C" __global__ void prim_mask(const u32* positions, float* y, int n_tok, int c, int window) {
    pdl_begin();
    PRIM_LOOP(i, (long long)n_tok * c) {
        int t = (int)(i / c), j = (int)(i % c);
        long long p = positions[t];
        bool see = j <= p && (window == 0 || (long long)j + window > p);
        y[i] = see ? 0.0f : NEG_INF;
    }
}

// The step's positions (or tokens) as i32 values.
extern "C" __global__ void prim_ids(const u32* src, int* y, int n) {
    pdl_begin();
    PRIM_LOOP(i, n) y[i] = (int)src[i];
}

// S_t = a_t * S_{t-1} + b_t for each of w state entries over the step's n
// rows; from zero when the step starts at position 0. Writes every S_t and
// keeps the last. One thread a state entry.
extern "C" __global__ void prim_scan(const float* a, const float* b, float* state, float* y, const u32* positions,
                                     int n, long long w) {
    pdl_begin();
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= w) return;
    float s = positions[0] == 0 ? 0.0f : state[e];
    for (int t = 0; t < n; t++) {
        long long i = (long long)t * w + e;
        s = __fadd_rn(__fmul_rn(a[i], s), b[i]);
        y[i] = s;
    }
    state[e] = s;
}

// Depthwise causal conv (Op::ShortConv) of x [n, c] with taps w [c, k]
// (oldest first) over a window [k - 1, c] of the inputs before the step
// (read as zero when the step starts at position 0), which then keeps the
// last k - 1 inputs. One thread a channel; twin: cpu::prim::short_conv_rows.
extern "C" __global__ void prim_short_conv(const float* x, const float* w, float* win, float* y, const u32* positions,
                                           int n, int c, int k) {
    pdl_begin();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    int m = k - 1;
    bool fresh = positions[0] == 0;
    for (int t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            int r = t - m + j;
            float v = r < 0 ? (fresh ? 0.0f : win[(long long)(m + r) * c + ch]) : x[(long long)r * c + ch];
            acc = __fadd_rn(acc, __fmul_rn(w[(long long)ch * k + j], v));
        }
        y[(long long)t * c + ch] = acc;
    }
    // Ascending rows read the old window ahead of where they write.
    for (int r = 0; r < m; r++) {
        int src = n - m + r;
        win[(long long)r * c + ch] = src < 0 ? (fresh ? 0.0f : win[(long long)(m + src) * c + ch]) : x[(long long)src * c + ch];
    }
}

// The gated delta rule (Op::DeltaNet) over n tokens on the state s
// [hv, dk, dv] (zeroed when the step starts at position 0): q, k [n, hk, dk],
// v [n, hv, dv], g, beta [n, hv]; o [n, hv, dv]. One block a v head j (k head
// j % hk), one thread a value column; the head's scaled q and its k sit in
// shared memory (2 dk floats). Per token, each column: decay it and sum kᵀS,
// δ = (v − kᵀS)·β, add k·δ and sum (scale·q)ᵀS, every sum over the key dim in
// order from 0 (twin: cpu::prim::delta_net_rows).
extern "C" __global__ void prim_delta_net(const float* q, const float* k, const float* v, const float* g,
                                          const float* beta, float* s, float* o, const u32* positions, int n, int hk,
                                          int hv, int dk, int dv, float scale) {
    pdl_begin();
    extern __shared__ float dn_qk[];
    float* qs = dn_qk;
    float* ks = dn_qk + dk;
    int j = blockIdx.x, kh = j % hk;
    float* sj = s + (long long)j * dk * dv;
    if (positions[0] == 0) {
        for (long long e = threadIdx.x; e < (long long)dk * dv; e += blockDim.x) sj[e] = 0.0f;
    }
    for (int t = 0; t < n; t++) {
        __syncthreads();
        long long qo = ((long long)t * hk + kh) * dk;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = __fmul_rn(q[qo + i], scale);
            ks[i] = k[qo + i];
        }
        __syncthreads();
        float decay = exp_c(g[(long long)t * hv + j]);
        float b = beta[(long long)t * hv + j];
        for (int c = threadIdx.x; c < dv; c += blockDim.x) {
            float kv = 0.0f;
            for (int i = 0; i < dk; i++) {
                float e = __fmul_rn(sj[(long long)i * dv + c], decay);
                sj[(long long)i * dv + c] = e;
                kv = __fadd_rn(kv, __fmul_rn(ks[i], e));
            }
            long long vo = ((long long)t * hv + j) * dv + c;
            float delta = __fmul_rn(__fsub_rn(v[vo], kv), b);
            float acc = 0.0f;
            for (int i = 0; i < dk; i++) {
                float e = __fadd_rn(sj[(long long)i * dv + c], __fmul_rn(ks[i], delta));
                sj[(long long)i * dv + c] = e;
                acc = __fadd_rn(acc, __fmul_rn(qs[i], e));
            }
            o[vo] = acc;
        }
    }
}

// The gated delta rule's chunked form (Op::DeltaNet on runs of more than one
// token): the run in chunks of DN_CHUNK tokens from its first, each solved
// from the state at its start (twin: cpu::prim::delta_net_head_chunked, whose
// comment has the maths). Every value column is independent given the chunk's
// scalars (cumulative decay G, A = β e^(G_t−G_s) k_t·k_s, P = e^(G_t−G_s)
// (scale q_t)·k_s), so one block takes a v head j and DN_COLS of its value
// columns (grid hv × ⌈dv / DN_COLS⌉) and computes those scalars itself.
// Shared memory: A and P [DN_CHUNK²], G, e^G, e^(G_last−G) [DN_CHUNK], and
// the chunk's δ [DN_CHUNK, DN_COLS]. Each value is one thread's sum in index
// order, every operation rounded alone (no contraction), as on the CPU.
#define DN_CHUNK 64
#define DN_COLS 32
extern "C" __global__ void prim_delta_net_chunked(const float* q, const float* k, const float* v, const float* g,
                                                  const float* beta, float* s, float* o, const u32* positions, int n,
                                                  int hk, int hv, int dk, int dv, float scale) {
    pdl_begin();
    extern __shared__ float dn_sh[];
    float* A = dn_sh;
    float* P = A + DN_CHUNK * DN_CHUNK;
    float* G = P + DN_CHUNK * DN_CHUNK;
    float* eg = G + DN_CHUNK;
    float* el = eg + DN_CHUNK;
    float* D = el + DN_CHUNK;
    int j = blockIdx.x, kh = j % hk, c0 = blockIdx.y * DN_COLS;
    int cols = min(DN_COLS, dv - c0);
    float* sj = s + (long long)j * dk * dv;
    if (positions[0] == 0) {
        for (int e = threadIdx.x; e < dk * cols; e += blockDim.x) sj[(long long)(e / cols) * dv + c0 + e % cols] = 0.0f;
    }
    for (int t0 = 0; t0 < n; t0 += DN_CHUNK) {
        int l = min(DN_CHUNK, n - t0);
        __syncthreads();
        if (threadIdx.x == 0) {
            float acc = 0.0f;
            for (int t = 0; t < l; t++) {
                acc = __fadd_rn(acc, g[(long long)(t0 + t) * hv + j]);
                G[t] = acc;
            }
        }
        __syncthreads();
        for (int t = threadIdx.x; t < l; t += blockDim.x) {
            eg[t] = exp_c(G[t]);
            el[t] = exp_c(__fsub_rn(G[l - 1], G[t]));
        }
        for (int e = threadIdx.x; e < l * l; e += blockDim.x) {
            int t = e / l, u = e % l;
            if (u > t) continue;
            const float* kt = k + ((long long)(t0 + t) * hk + kh) * dk;
            const float* qt = q + ((long long)(t0 + t) * hk + kh) * dk;
            const float* ku = k + ((long long)(t0 + u) * hk + kh) * dk;
            float kk = 0.0f, qk = 0.0f;
            for (int i = 0; i < dk; i++) {
                kk = __fadd_rn(kk, __fmul_rn(kt[i], ku[i]));
                qk = __fadd_rn(qk, __fmul_rn(__fmul_rn(qt[i], scale), ku[i]));
            }
            float dec = exp_c(__fsub_rn(G[t], G[u]));
            A[t * DN_CHUNK + u] = u < t ? __fmul_rn(__fmul_rn(kk, dec), beta[(long long)(t0 + t) * hv + j]) : 0.0f;
            P[t * DN_CHUNK + u] = __fmul_rn(qk, dec);
        }
        __syncthreads();
        // u_t and the output the chunk's starting state gives.
        for (int e = threadIdx.x; e < l * cols; e += blockDim.x) {
            int t = e / cols, cc = e % cols, c = c0 + cc;
            const float* kt = k + ((long long)(t0 + t) * hk + kh) * dk;
            const float* qt = q + ((long long)(t0 + t) * hk + kh) * dk;
            float w = 0.0f, r = 0.0f;
            for (int i = 0; i < dk; i++) {
                float sv = sj[(long long)i * dv + c];
                w = __fadd_rn(w, __fmul_rn(kt[i], sv));
                r = __fadd_rn(r, __fmul_rn(__fmul_rn(qt[i], scale), sv));
            }
            long long vo = ((long long)(t0 + t) * hv + j) * dv + c;
            D[t * DN_COLS + cc] = __fmul_rn(__fsub_rn(v[vo], __fmul_rn(eg[t], w)), beta[(long long)(t0 + t) * hv + j]);
            o[vo] = __fmul_rn(eg[t], r);
        }
        __syncthreads();
        // Forward substitution, one thread a column.
        if (threadIdx.x < cols) {
            int cc = threadIdx.x;
            for (int t = 1; t < l; t++) {
                float acc = D[t * DN_COLS + cc];
                for (int u = 0; u < t; u++) acc = __fsub_rn(acc, __fmul_rn(A[t * DN_CHUNK + u], D[u * DN_COLS + cc]));
                D[t * DN_COLS + cc] = acc;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < l * cols; e += blockDim.x) {
            int t = e / cols, cc = e % cols;
            long long vo = ((long long)(t0 + t) * hv + j) * dv + c0 + cc;
            float acc = o[vo];
            for (int u = 0; u <= t; u++) acc = __fadd_rn(acc, __fmul_rn(P[t * DN_CHUNK + u], D[u * DN_COLS + cc]));
            o[vo] = acc;
        }
        for (int e = threadIdx.x; e < dk * cols; e += blockDim.x) {
            int i = e / cols, cc = e % cols;
            long long so = (long long)i * dv + c0 + cc;
            float acc = __fmul_rn(sj[so], eg[l - 1]);
            for (int u = 0; u < l; u++) {
                float ke = __fmul_rn(k[((long long)(t0 + u) * hk + kh) * dk + i], el[u]);
                acc = __fadd_rn(acc, __fmul_rn(ke, D[u * DN_COLS + cc]));
            }
            sj[so] = acc;
        }
    }
}

// Rows of a rows state: cache[positions[t]] = x[t] (rows of w words).
extern "C" __global__ void prim_rows_write(const u32* x, u32* cache, const u32* positions, int n, long long w,
                                           long long cap) {
    pdl_begin();
    PRIM_LOOP(i, (long long)n * w) {
        long long t = i / w, c = i % w;
        long long p = positions[t];
        if (p < cap) cache[p * w + c] = x[i];
    }
}

// Rope with the pairs' inverse frequencies given (YaRN's, computed on the
// host by the CPU's formula). Same slots and operations as `rope`.
extern "C" __global__ void prim_rope_freq(const float* x, float* y, int width, const u32* positions, int n_rows,
                                          int head_dim, int n_rot, const float* inv_freq, float linear_factor,
                                          int kind) {
    pdl_begin();
    int half = n_rot / 2;
    int per = half + head_dim - n_rot;
    int heads = width / head_dim;
    long long total = (long long)n_rows * heads * per;
    PRIM_LOOP(tid, total) {
        int i = (int)(tid % per);
        long long rh = tid / per;
        int h = (int)(rh % heads);
        long long r = rh / heads;
        long long off = r * width + (long long)h * head_dim;
        if (i >= half) {
            long long d = off + n_rot + (i - half);
            y[d] = x[d];
            continue;
        }
        float t = __fdiv_rn((float)positions[r], linear_factor);
        float c, s;
        rope_cos_sin_c(__fmul_rn(t, inv_freq[i]), &c, &s);
        long long ia = off + (kind == 0 ? i : 2 * i);
        long long ib = off + (kind == 0 ? i + half : 2 * i + 1);
        float x0 = x[ia], x1 = x[ib];
        y[ia] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        y[ib] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}

// Block-sparse attention's selection (Op::BlockSelect). Per row of c key
// scores (row r's query is r % t): each block of `block` keys scores its
// max; the query's own block and the local - 1 before it score +inf; the
// top_k blocks (ties to the lower index; a -inf block never) keep their keys
// at 0, every other key is -inf. Twin: cpu::prim::block_select (a block's
// rank is its place in that sort: the blocks that beat it). One block of
// threads a row; dynamic shared memory holds nb scores, then nb flags.
extern "C" __global__ void prim_block_select(const float* x, float* y, const u32* positions, long long rows, int c,
                                             int t, int block, int top_k, int local) {
    pdl_begin();
    extern __shared__ float bs_score[];
    long long r = blockIdx.x;
    if (r >= rows) return;
    int nb = (c + block - 1) / block;
    unsigned char* keep = (unsigned char*)(bs_score + nb);
    const float* row = x + r * c;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        float m = NEG_INF;
        int hi = min((b + 1) * block, c);
        for (int j = b * block; j < hi; j++) m = fmaxf(m, row[j]);
        bs_score[b] = m;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        long long qb = (long long)positions[r % t] / block;
        for (int l = 0; l < local; l++) {
            long long b = qb - l < 0 ? 0 : qb - l;
            if (b < nb) bs_score[b] = __int_as_float(0x7f800000);
        }
    }
    __syncthreads();
    int k = min(top_k, nb);
    for (int b = threadIdx.x; b < nb; b += blockDim.x) {
        float s = bs_score[b];
        int rank = 0;
        for (int j = 0; j < nb && rank < k; j++) {
            float v = bs_score[j];
            rank += v > s || (v == s && j < b);
        }
        keep[b] = rank < k && s != NEG_INF;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < c; j += blockDim.x) y[r * c + j] = keep[j / block] ? 0.0f : NEG_INF;
}

// i32 values (ids) as f32 (Op::ToF32), rounded to nearest as the CPU's `as f32`.
extern "C" __global__ void prim_to_f32(const int* x, float* y, long long n) {
    pdl_begin();
    PRIM_LOOP(i, n) y[i] = __int2float_rn(x[i]);
}

// Qwen4-Exp's n-gram hash (Op::NgramHash), twin of cpu::prim::ngram_hash: hist
// [c] the sequence's token ids (f32), one row of (n - 1) * heads ids a step
// position. One thread an output id: the window s_0 = tok[p], s_j = tok[p - j]
// until an EOS (or the start) resets it, then the order g's xor of
// s_j * mult[j] (i64, wrapping) mod vocab[i] (>= 0) + offset[i].
#define NGRAM_MAX_N 8
#define NGRAM_MAX_HEADS 64
struct NgramAttrs {
    long long eos;
    int n;
    int heads;
    long long mult[NGRAM_MAX_N];
    long long off[NGRAM_MAX_HEADS];
    long long voc[NGRAM_MAX_HEADS];
};
extern "C" __global__ void prim_ngram_hash(const float* hist, int* y, const u32* positions, int n_tok, NgramAttrs a) {
    pdl_begin();
    int nh = (a.n - 1) * a.heads;
    PRIM_LOOP(tid, (long long)n_tok * nh) {
        int i = (int)(tid % nh);
        long long r = tid / nh;
        long long p = positions[r];
        int g = i / a.heads + 2;
        unsigned long long m = (unsigned long long)(long long)hist[p] * (unsigned long long)a.mult[0];
        bool reset = false;
        for (int j = 1; j < g; j++) {
            reset = reset || j > p || (long long)hist[p - j] == a.eos;
            long long s = reset ? a.eos : (long long)hist[p - j];
            m ^= (unsigned long long)s * (unsigned long long)a.mult[j];
        }
        long long v = a.voc[i];
        long long q = (long long)m % v;
        if (q < 0) q += v;
        y[tid] = (int)(q + a.off[i]);
    }
}

// A depthwise dilated causal conv read from a rows cache (Op::ConvRows), twin
// of cpu::prim::conv_rows: cache [c, w], taps [w, k] (oldest first); the row
// at position p sums w[ch, j] * x[p - (k - 1 - j) * dilation][ch] in tap order,
// skipping taps before position 0. One thread an output.
extern "C" __global__ void prim_conv_rows(const float* cache, const float* taps, float* y, const u32* positions,
                                          int n_tok, int w, int k, int dilation) {
    pdl_begin();
    PRIM_LOOP(tid, (long long)n_tok * w) {
        int ch = (int)(tid % w);
        long long p = positions[tid / w];
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            long long back = (long long)(k - 1 - j) * dilation;
            if (back <= p) acc = __fadd_rn(acc, __fmul_rn(taps[(long long)ch * k + j], cache[(p - back) * w + ch]));
        }
        y[tid] = acc;
    }
}

// QSA's pooled keys (Op::PooledSelect, first half), twin of the pooling in
// cpu::prim::pooled_select: block b of `block` raw keys [d] summed in order
// and divided by `block`, RMS-normed with w (the sum of squares in f64 in the
// order of norm_rope.cu's rms_norm: thread-strided partials over 256 threads,
// the warp butterfly, warp sums in order), then rotated (no YaRN) at position
// b * block. One block of 256 threads a pooled key.
#define POOL_THREADS 256
extern "C" __global__ void __launch_bounds__(POOL_THREADS)
    prim_pool_keys(const float* keys, const float* w, float* pooled, int d, int block, float eps, int n_rot,
                   int kind, float base, float linear_factor) {
    pdl_begin();
    __shared__ double part[POOL_THREADS / 32];
    int b = blockIdx.x, t = threadIdx.x;
    float* row = pooled + (long long)b * d;
    double ss = 0.0;
    for (int i = t; i < d; i += POOL_THREADS) {
        float acc = 0.0f;
        for (int r = 0; r < block; r++) acc = __fadd_rn(acc, keys[((long long)b * block + r) * d + i]);
        acc = __fdiv_rn(acc, (float)block);
        row[i] = acc;
        ss = __dadd_rn(ss, __dmul_rn((double)acc, (double)acc));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss = __dadd_rn(ss, __shfl_xor_sync(FULL_MASK, ss, o));
    if ((t & 31) == 0) part[t >> 5] = ss;
    __syncthreads();
    double tot = 0.0;
#pragma unroll
    for (int i = 0; i < POOL_THREADS / 32; i++) tot = __dadd_rn(tot, part[i]);
    float scale = __double2float_rn(__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(__ddiv_rn(tot, (double)d), (double)eps))));
    for (int i = t; i < d; i += POOL_THREADS) row[i] = __fmul_rn(__fmul_rn(row[i], scale), w[i]);
    __syncthreads();
    int half = n_rot / 2;
    float tp = __fdiv_rn((float)((long long)b * block), linear_factor);
    for (int i = t; i < half; i += POOL_THREADS) {
        float c, s;
        rope_cos_sin_c(__fmul_rn(tp, rope_inv_freq_c(base, i, n_rot)), &c, &s);
        int ia = kind == 0 ? i : 2 * i, ib = kind == 0 ? i + half : 2 * i + 1;
        float x0 = row[ia], x1 = row[ib];
        row[ia] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        row[ib] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}

// QSA's selection (Op::PooledSelect, second half), twin of
// cpu::prim::pooled_select: the query row r at position p scores each of its
// (p + 1) / block complete blocks scale * sum_h relu(q_h . k_b) (dots and the
// head sum in order from 0); the top_k (ties to the lower block) and the open
// tail after the last complete block get 0, every other key -inf. One block of
// threads a row; dynamic shared memory holds the scores, then the flags.
extern "C" __global__ void prim_pooled_select(const float* q, const float* pooled, float* y, const u32* positions,
                                              int c, int nh, int d, int block, int top_k, float scale) {
    pdl_begin();
    extern __shared__ float ps_score[];
    long long r = blockIdx.x;
    long long p = positions[r];
    int full = (int)((p + 1) / block);
    unsigned char* keep = (unsigned char*)(ps_score + (c / block));
    for (int b = threadIdx.x; b < full; b += blockDim.x) {
        const float* k = pooled + (long long)b * d;
        float sc = 0.0f;
        for (int h = 0; h < nh; h++) {
            const float* qh = q + (r * nh + h) * d;
            float dot = 0.0f;
            for (int i = 0; i < d; i++) dot = __fadd_rn(dot, __fmul_rn(qh[i], k[i]));
            sc = __fadd_rn(sc, fmaxf(dot, 0.0f));
        }
        ps_score[b] = __fmul_rn(sc, scale);
    }
    __syncthreads();
    int kk = min(top_k, full);
    for (int b = threadIdx.x; b < full; b += blockDim.x) {
        float s = ps_score[b];
        int rank = 0;
        for (int j = 0; j < full && rank < kk; j++) {
            float v = ps_score[j];
            rank += v > s || (v == s && j < b);
        }
        keep[b] = rank < kk;
    }
    __syncthreads();
    long long tail = (long long)full * block;
    for (long long j = threadIdx.x; j < c; j += blockDim.x)
        y[r * c + j] = (j < tail ? keep[j / block] : j <= p) ? 0.0f : NEG_INF;
}
