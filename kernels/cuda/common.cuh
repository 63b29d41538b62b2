// Shared prelude of every Pulsar CUDA kernel source. Compiled by NVRTC with no
// headers at all: fixed-width types, f16 conversion (PTX cvt), byte loads,
// dp4a and warp reductions are defined here.
//
// Conventions: all buffers are little-endian byte images of the CPU layouts
// in pulsar-kernels (kernels/src/quant/*.rs); every kernel has a CPU twin there.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define WARP 32
#define FULL_MASK 0xffffffffu

// Programmatic dependent launch (sm_90+; the host launches with it there): a
// kernel may be scheduled while the previous kernel on its stream still runs.
// Every entry point calls this first: it waits until that kernel has finished
// and its writes are visible, then lets the next kernel be scheduled. Without
// the launch attribute (or before sm_90) both steps are no-ops.
__device__ __forceinline__ void pdl_begin() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// f32 -> f16 bits (round to nearest even), widened to a 32-bit integer inside
// the asm: storing the 16-bit cvt result directly with byte stores lost its low
// byte on sm_90 (seen on the H200 self-test), so integer code only ever sees a u32.
__device__ __forceinline__ u32 f2h(float f) {
    u32 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; cvt.u32.u16 %0, t; }" : "=r"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Unaligned little-endian loads, byte by byte.
__device__ __forceinline__ u32 rd16(const u8* p) { return (u32)p[0] | ((u32)p[1] << 8); }
__device__ __forceinline__ u32 rd32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
// Two aligned u16 loads (p must be 2-byte aligned).
__device__ __forceinline__ u32 rd32_a2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)q[0] | ((u32)q[1] << 16);
}
__device__ __forceinline__ float rdh(const u8* p) { return h2f((u16)rd16(p)); }

// Signed 8-bit dot of four byte lanes, accumulated into c.
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// Per byte: v_b - off (v_b < 128, off <= 128), as a signed byte.
__device__ __forceinline__ u32 sub_bytes(u32 v, u32 off) {
    return ((v | 0x80808080u) - off * 0x01010101u) ^ 0x80808080u;
}
// Bits 0..3 of `b` to bit 0 of bytes 0..3.
__device__ __forceinline__ u32 spread4(u32 b) {
    return (b & 1u) | ((b & 2u) << 7) | ((b & 4u) << 14) | ((b & 8u) << 21);
}
// Negate the bytes of `x` (each 1..127) whose bit in `signs4` (bits 0..3) is set.
__device__ __forceinline__ u32 apply_signs(u32 x, u32 signs4) {
    u32 m = spread4(signs4) * 0xffu;
    return (x ^ m) + (m & 0x01010101u);
}
// The iq2 sign byte of a 7-bit index: the eighth bit makes the parity even.
__device__ __forceinline__ u32 ksigns(u32 i) { return i | ((__popc(i) & 1u) << 7); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// ---- cp.async (sm_80+): copies into shared memory that need no registers,
// many in flight per thread. .cg bypasses L1 (weights, read once); .ca keeps
// the line in L1 (activations that other blocks on the SM read too).
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16_ca(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Wait until at most N of this thread's committed groups are in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait1() { cp_async_wait<1>(); }
__device__ __forceinline__ void cp_async_wait0() { cp_async_wait<0>(); }

// Start copying the `bytes` (> 0) bytes at `src` into `dst` (16-aligned,
// bytes + 32 long) as the whole 16-byte granules that hold them, this warp's
// lanes taking every 32nd; returns where src[0] lands (dst + (src & 15)).
// Granules reach at most 15 bytes past either end, inside the aligned span.
// l1: keep the lines in L1 (cp_async16_ca). The caller commits and waits.
__device__ __forceinline__ const u8* stage_span(u8* dst, const void* src, size_t bytes, bool l1) {
    size_t a = (size_t)src, first = a >> 4, ng = ((a + bytes - 1) >> 4) - first + 1;
    for (size_t i = threadIdx.x & 31; i < ng; i += 32) {
        const void* g = (const void*)((first + i) << 4);
        if (l1)
            cp_async16_ca(dst + 16 * i, g);
        else
            cp_async16(dst + 16 * i, g);
    }
    return dst + (a & 15);
}

// ---- The shared transcendentals. Twins, bit for bit: pulsar_kernels::ops::math
// (kernels/src/ops/math.rs), whose test checks that every PC_* constant below
// holds the bits of the Rust one. Every operation is a round-to-nearest
// intrinsic so NVRTC (--fmad=true) can neither contract nor reorder; no libm
// (expf/tanhf/sinf differ from the CPU's in the last bit, and the q8
// re-quantisation of activations amplifies that into different tokens).

#define PC_LOG2E 0x3fb8aa3bu
#define PC_C1 0x3f318000u
#define PC_C2 0xb95e8083u
#define PC_MAXLOG 0x42b17218u
#define PC_MINLOG 0xc2cff1b4u
#define PC_MAGIC 0x4b400000u
#define PC_GELU_S 0x3f4c422au
#define PC_GELU_C 0x3d372713u
#define PC_P0 0x39506967u
#define PC_P1 0x3ab743ceu
#define PC_P2 0x3c088908u
#define PC_P3 0x3d2aa9c1u
#define PC_P4 0x3e2aaaaau
#define PC_P5 0x3f000000u
#define PC_T0 0xbbbaf0eau
#define PC_T1 0x3ca9134eu
#define PC_T2 0xbd5c1e2du
#define PC_T3 0x3e088393u
#define PC_T4 0xbeaaaa99u
#define PC_L0 0x3d9021bbu
#define PC_L1 0xbdebd1b8u
#define PC_L2 0x3def251au
#define PC_L3 0xbdfe5d4fu
#define PC_L4 0x3e11e9bfu
#define PC_L5 0xbe2aae50u
#define PC_L6 0x3e4cceacu
#define PC_L7 0xbe7ffffcu
#define PC_L8 0x3eaaaaaau
#define PC_SQRTHF 0x3f3504f3u
#define PC_MAGIC52 0x4338000000000000ULL
#define PC_LN2_HI 0x3fe62e42fee00000ULL
#define PC_LN2_LO 0x3dea39ef35793c76ULL
#define PC_LOG2E_D 0x3ff71547652b82feULL
#define PC_PIO2_1 0x3ff921fb54400000ULL
#define PC_PIO2_2 0x3dd0b4611a600000ULL
#define PC_PIO2_3 0x3ba3198a2e037073ULL
#define PC_TWO_OVER_PI 0x3fe45f306dc9c883ULL
#define PC_SQRT2 0x3ff6a09e667f3bcdULL
#define PC_EXP_C0 0x3de6124613a86d09ULL
#define PC_EXP_C1 0x3e21eed8eff8d898ULL
#define PC_EXP_C2 0x3e5ae64567f544e4ULL
#define PC_EXP_C3 0x3e927e4fb7789f5cULL
#define PC_EXP_C4 0x3ec71de3a556c734ULL
#define PC_EXP_C5 0x3efa01a01a01a01aULL
#define PC_EXP_C6 0x3f2a01a01a01a01aULL
#define PC_EXP_C7 0x3f56c16c16c16c17ULL
#define PC_EXP_C8 0x3f81111111111111ULL
#define PC_EXP_C9 0x3fa5555555555555ULL
#define PC_EXP_C10 0x3fc5555555555555ULL
#define PC_EXP_C11 0x3fe0000000000000ULL
#define PC_LN_C0 0x3fa47ae147ae147bULL
#define PC_LN_C1 0x3fa642c8590b2164ULL
#define PC_LN_C2 0x3fa8618618618618ULL
#define PC_LN_C3 0x3faaf286bca1af28ULL
#define PC_LN_C4 0x3fae1e1e1e1e1e1eULL
#define PC_LN_C5 0x3fb1111111111111ULL
#define PC_LN_C6 0x3fb3b13b13b13b14ULL
#define PC_LN_C7 0x3fb745d1745d1746ULL
#define PC_LN_C8 0x3fbc71c71c71c71cULL
#define PC_LN_C9 0x3fc2492492492492ULL
#define PC_LN_C10 0x3fc999999999999aULL
#define PC_LN_C11 0x3fd5555555555555ULL
#define PC_LN_C12 0x3ff0000000000000ULL
#define PC_SIN_C0 0xbc62f49b46814157ULL
#define PC_SIN_C1 0x3ce952c77030ad4aULL
#define PC_SIN_C2 0xbd6ae7f3e733b81fULL
#define PC_SIN_C3 0x3de6124613a86d09ULL
#define PC_SIN_C4 0xbe5ae64567f544e4ULL
#define PC_SIN_C5 0x3ec71de3a556c734ULL
#define PC_SIN_C6 0xbf2a01a01a01a01aULL
#define PC_SIN_C7 0x3f81111111111111ULL
#define PC_SIN_C8 0xbfc5555555555555ULL
#define PC_COS_C0 0xbca6827863b97d97ULL
#define PC_COS_C1 0x3d2ae7f3e733b81fULL
#define PC_COS_C2 0xbda93974a8c07c9dULL
#define PC_COS_C3 0x3e21eed8eff8d898ULL
#define PC_COS_C4 0xbe927e4fb7789f5cULL
#define PC_COS_C5 0x3efa01a01a01a01aULL
#define PC_COS_C6 0xbf56c16c16c16c17ULL
#define PC_COS_C7 0x3fa5555555555555ULL
#define PC_COS_C8 0xbfe0000000000000ULL

__device__ __forceinline__ float pcf(u32 b) { return __uint_as_float(b); }
__device__ __forceinline__ double pcd(u64 b) { return __longlong_as_double((long long)b); }
// p * r + c, two roundings.
__device__ __forceinline__ float hornf(float p, float r, u32 c) { return __fadd_rn(__fmul_rn(p, r), pcf(c)); }
__device__ __forceinline__ double hornd(double p, double r, u64 c) { return __dadd_rn(__dmul_rn(p, r), pcd(c)); }

// 2^k for k in [-126, 127]; y * 2^n for n in [-150, 128] with one rounding.
__device__ __forceinline__ float pow2_c(int k) { return __uint_as_float((u32)(k + 127) << 23); }
__device__ __forceinline__ float ldexp_c(float y, int n) {
    if (n > 127) return __fmul_rn(__fmul_rn(y, pow2_c(127)), pow2_c(n - 127));
    if (n < -126) return __fmul_rn(__fmul_rn(y, pow2_c(n + 100)), pow2_c(-100));
    return __fmul_rn(y, pow2_c(n));
}

// e^x (Cephes expf). Twin: ops::math::exp.
__device__ __forceinline__ float exp_c(float x) {
    if (x != x) return x;
    if (x > pcf(PC_MAXLOG)) return __int_as_float(0x7f800000);
    if (x < pcf(PC_MINLOG)) return 0.0f;
    float t = __fadd_rn(__fmul_rn(x, pcf(PC_LOG2E)), pcf(PC_MAGIC));
    float n = __fsub_rn(t, pcf(PC_MAGIC));
    int ni = (int)(__float_as_uint(t) - PC_MAGIC);
    float r = __fsub_rn(x, __fmul_rn(n, pcf(PC_C1)));
    r = __fsub_rn(r, __fmul_rn(n, pcf(PC_C2)));
    float z = __fmul_rn(r, r);
    float p = pcf(PC_P0);
    p = hornf(p, r, PC_P1);
    p = hornf(p, r, PC_P2);
    p = hornf(p, r, PC_P3);
    p = hornf(p, r, PC_P4);
    p = hornf(p, r, PC_P5);
    float y = __fadd_rn(__fadd_rn(__fmul_rn(p, z), r), 1.0f);
    return ldexp_c(y, min(max(ni, -150), 128));
}

// ln x (Cephes logf). Twin: ops::math::ln.
__device__ __forceinline__ float log_c(float x) {
    if (x != x || x < 0.0f) return __int_as_float(0x7fc00000);
    if (x == 0.0f) return __int_as_float(0xff800000);
    if (x == __int_as_float(0x7f800000)) return x;
    u32 bits = __float_as_uint(x);
    int e = 0;
    if (bits < 0x00800000u) {
        bits = __float_as_uint(__fmul_rn(x, pow2_c(23)));
        e = -23;
    }
    e += (int)((bits >> 23) & 0xffu) - 126;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f000000u);
    if (m < pcf(PC_SQRTHF)) {
        e -= 1;
        m = __fsub_rn(__fadd_rn(m, m), 1.0f);
    } else {
        m = __fsub_rn(m, 1.0f);
    }
    float z = __fmul_rn(m, m);
    float y = pcf(PC_L0);
    y = hornf(y, m, PC_L1);
    y = hornf(y, m, PC_L2);
    y = hornf(y, m, PC_L3);
    y = hornf(y, m, PC_L4);
    y = hornf(y, m, PC_L5);
    y = hornf(y, m, PC_L6);
    y = hornf(y, m, PC_L7);
    y = hornf(y, m, PC_L8);
    y = __fmul_rn(__fmul_rn(y, m), z);
    float fe = (float)e;
    if (e != 0) y = __fadd_rn(y, __fmul_rn(fe, pcf(PC_C2)));
    y = __fsub_rn(y, __fmul_rn(0.5f, z));
    float r = __fadd_rn(m, y);
    return e != 0 ? __fadd_rn(r, __fmul_rn(fe, pcf(PC_C1))) : r;
}
// ln(1 + e^x), x above 20. Twin: ops::math::softplus.
__device__ __forceinline__ float softplus_c(float x) { return x > 20.0f ? x : log_c(__fadd_rn(1.0f, exp_c(x))); }

// tanh (Cephes tanhf). Twin: ops::math::tanh.
__device__ __forceinline__ float tanh_c(float x) {
    float a = fabsf(x);
    if (a >= 0.625f) {
        float s = exp_c(__fadd_rn(a, a));
        float t = __fsub_rn(1.0f, __fdiv_rn(2.0f, __fadd_rn(s, 1.0f)));
        return x < 0.0f ? -t : t;
    }
    if (x == 0.0f) return x;
    float z = __fmul_rn(x, x);
    float p = pcf(PC_T0);
    p = hornf(p, z, PC_T1);
    p = hornf(p, z, PC_T2);
    p = hornf(p, z, PC_T3);
    p = hornf(p, z, PC_T4);
    return __fadd_rn(__fmul_rn(__fmul_rn(p, z), x), x);
}

// 1 / (1 + e^-x). Twin: ops::math::sigmoid.
__device__ __forceinline__ float sigmoid_c(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_c(-x))); }
// x / (1 + e^-x). Twin: ops::math::silu.
__device__ __forceinline__ float silu_f(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, exp_c(-x))); }
// (0.5 x) (1 + tanh(s (x + ((c x) x) x))). Twin: ops::math::gelu_tanh.
__device__ __forceinline__ float gelu_tanh_f(float x) {
    float cube = __fmul_rn(__fmul_rn(__fmul_rn(pcf(PC_GELU_C), x), x), x);
    float t = tanh_c(__fmul_rn(pcf(PC_GELU_S), __fadd_rn(x, cube)));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, t));
}
// act: 0 = silu, 1 = gelu_tanh (the CPU's ops::Activation::{Silu, GeluTanh}).
__device__ __forceinline__ float act_f(int act, float x) {
    return act == 1 ? gelu_tanh_f(x) : silu_f(x);
}
// The gated unit of gate g and up u: act(g) * u, or for act 3 (swiglu_oai,
// GPT-OSS / MiniMax M3) (clamp(u, -7, 7) + 1) * (g' * sigmoid(1.702 g')) with
// g' = min(g, 7). Twin: ops::Activation::unit, NaNs included (min gives 7 for
// a NaN gate as Rust's f32::min does; a NaN up stays NaN as f32::clamp keeps it).
#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.0f
__device__ __forceinline__ float unit_f(int act, float g, float u) {
    if (act == 3) {
        float gc = g < SWIGLU_OAI_LIMIT ? g : SWIGLU_OAI_LIMIT;
        float uc = u < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : (u > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : u);
        float glu = __fmul_rn(gc, sigmoid_c(__fmul_rn(gc, SWIGLU_OAI_ALPHA)));
        return __fmul_rn(__fadd_rn(uc, 1.0f), glu);
    }
    return __fmul_rn(act_f(act, g), u);
}

// 2^k for k in [-1022, 1023].
__device__ __forceinline__ double pow2_dc(long long k) { return __longlong_as_double((k + 1023) << 52); }
// e^y for |y| < 700 (Taylor to r^13). Twin: ops::math::exp_d.
__device__ __forceinline__ double exp_dc(double y) {
    double t = __dadd_rn(__dmul_rn(y, pcd(PC_LOG2E_D)), pcd(PC_MAGIC52));
    double n = __dsub_rn(t, pcd(PC_MAGIC52));
    double r = __dsub_rn(__dsub_rn(y, __dmul_rn(n, pcd(PC_LN2_HI))), __dmul_rn(n, pcd(PC_LN2_LO)));
    const u64 c[11] = {PC_EXP_C1, PC_EXP_C2, PC_EXP_C3, PC_EXP_C4, PC_EXP_C5, PC_EXP_C6,
                       PC_EXP_C7, PC_EXP_C8, PC_EXP_C9, PC_EXP_C10, PC_EXP_C11};
    double p = pcd(PC_EXP_C0);
#pragma unroll
    for (int i = 0; i < 11; i++) p = hornd(p, r, c[i]);
    double e = __dadd_rn(__dadd_rn(__dmul_rn(__dmul_rn(p, r), r), r), 1.0);
    return __dmul_rn(e, pow2_dc((long long)n));
}
// ln b for a positive normal b (atanh series). Twin: ops::math::ln_d.
__device__ __forceinline__ double ln_dc(double b) {
    u64 bits = (u64)__double_as_longlong(b);
    long long k = (long long)((bits >> 52) & 0x7ff) - 1023;
    double m = __longlong_as_double((long long)((bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL));
    if (m > pcd(PC_SQRT2)) {
        m = __dmul_rn(m, 0.5);
        k += 1;
    }
    double s = __ddiv_rn(__dsub_rn(m, 1.0), __dadd_rn(m, 1.0));
    double z = __dmul_rn(s, s);
    const u64 c[12] = {PC_LN_C1, PC_LN_C2, PC_LN_C3, PC_LN_C4, PC_LN_C5, PC_LN_C6,
                       PC_LN_C7, PC_LN_C8, PC_LN_C9, PC_LN_C10, PC_LN_C11, PC_LN_C12};
    double p = pcd(PC_LN_C0);
#pragma unroll
    for (int i = 0; i < 12; i++) p = hornd(p, z, c[i]);
    double lnm = __dmul_rn(__dmul_rn(2.0, s), p);
    double kd = (double)k;
    return __dadd_rn(__dmul_rn(kd, pcd(PC_LN2_HI)), __dadd_rn(__dmul_rn(kd, pcd(PC_LN2_LO)), lnm));
}
// 1 / base^(2i / n_rot), the power in f64 rounded once. Twin: ops::math::rope_inv_freq.
__device__ __forceinline__ float rope_inv_freq_c(float base, int i, int n_rot) {
    double e = __ddiv_rn((double)(2 * i), (double)n_rot);
    double p = i == 0 ? 1.0 : exp_dc(__dmul_rn(ln_dc((double)base), e));
    return __fdiv_rn(1.0f, __double2float_rn(p));
}
// cos and sin of an f32 angle in f64, each rounded once. Twin: ops::math::rope_cos_sin.
__device__ __forceinline__ void rope_cos_sin_c(float a, float* cos_out, float* sin_out) {
    double x = (double)a;
    double t = __dadd_rn(__dmul_rn(x, pcd(PC_TWO_OVER_PI)), pcd(PC_MAGIC52));
    double k = __dsub_rn(t, pcd(PC_MAGIC52));
    double r = __dsub_rn(__dsub_rn(__dsub_rn(x, __dmul_rn(k, pcd(PC_PIO2_1))), __dmul_rn(k, pcd(PC_PIO2_2))),
                         __dmul_rn(k, pcd(PC_PIO2_3)));
    double z = __dmul_rn(r, r);
    const u64 sc[8] = {PC_SIN_C1, PC_SIN_C2, PC_SIN_C3, PC_SIN_C4, PC_SIN_C5, PC_SIN_C6, PC_SIN_C7, PC_SIN_C8};
    const u64 cc[8] = {PC_COS_C1, PC_COS_C2, PC_COS_C3, PC_COS_C4, PC_COS_C5, PC_COS_C6, PC_COS_C7, PC_COS_C8};
    double ps = pcd(PC_SIN_C0), pc = pcd(PC_COS_C0);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        ps = hornd(ps, z, sc[i]);
        pc = hornd(pc, z, cc[i]);
    }
    double s = __dadd_rn(__dmul_rn(__dmul_rn(ps, z), r), r);
    double c = __dadd_rn(__dmul_rn(pc, z), 1.0);
    int q = (int)((long long)k & 3);
    double co = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
    double si = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
    *cos_out = __double2float_rn(co);
    *sin_out = __double2float_rn(si);
}

#define NEG_INF __int_as_float(0xff800000)
#define QNAN __int_as_float(0x7fc00000)
