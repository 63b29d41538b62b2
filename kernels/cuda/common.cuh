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

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_tanh_f(float x) {
    const float S = 0.7978846f;
    return 0.5f * x * (1.0f + tanhf(S * (x + 0.044715f * x * x * x)));
}
// act: 0 = silu, 1 = gelu_tanh (the CPU's ops::Activation::{Silu, GeluTanh}).
__device__ __forceinline__ float act_f(int act, float x) {
    return act == 1 ? gelu_tanh_f(x) : silu_f(x);
}

#define NEG_INF __int_as_float(0xff800000)
#define QNAN __int_as_float(0x7fc00000)
