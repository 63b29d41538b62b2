//! `q8_0`: blocks of 32 values, 34 bytes: `d: f16`, `qs: [i8; 32]`; value = d * q.
//! Also the activation format of the 32-block weight formats.

use super::{rd_f16, wr_f16};

pub(crate) const QK: usize = 32;
pub(crate) const BYTES: usize = 34;

/// Blocks to values: `q * d` in f32 (exact order of the `gguf` reference).
pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, 0);
        for (yi, &q) in y.iter_mut().zip(&b[2..]) {
            *yi = (q as i8) as f32 * d;
        }
    }
}

/// Values to blocks like ggml's reference: `d = amax / 127`, `q = round(x / d)`
/// with ties away from zero, `d` stored as f16. Every `q` is within [-127, 127].
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_f16(b, 0, d);
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = super::round_away(v * id).clamp(-127, 127) as i8 as u8;
        }
    }
}

/// Scalar reference: per block, the exact integer sum times `d_w * d_x`.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (bw, bx) in w.chunks_exact(BYTES).zip(x.chunks_exact(BYTES)) {
        let mut s = 0i32;
        for (&a, &b) in bw[2..].iter().zip(&bx[2..]) {
            s += (a as i8 as i32) * (b as i8 as i32);
        }
        acc += rd_f16(bw, 0) * rd_f16(bx, 0) * s as f32;
    }
    acc
}

/// The block layout for the shared SIMD driver, which reproduces [`dot`] bit for bit.
#[cfg(target_arch = "x86_64")]
struct Fmt;

#[cfg(target_arch = "x86_64")]
impl super::block32::Block32 for Fmt {
    const BYTES: usize = BYTES;
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn ints<D: crate::simd::U8I8Dot>(
        w: &[u8],
        ow: usize,
        y: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use crate::simd::*;
        use std::arch::x86_64::*;
        unsafe { dot_i8::<D>(_mm256_setzero_si256(), load256(w, ow + 2), y) }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_impl<D: crate::simd::U8I8Dot>(w: &[u8], x: &[u8]) -> f32 {
    unsafe { super::block32::dot::<Fmt, D>(w, x) }
}

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, four at a
/// time (`block32::dot_rows`), bit for bit.
///
/// # Safety
/// AVX2 + FMA + F16C; `x` is whole blocks and `w` is `out.len()` rows of as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows_avx2(w: &[u8], x: &[u8], out: &mut [f32]) {
    unsafe { super::block32::dot_rows::<Fmt, crate::simd::Avx2Dot>(w, x, out) }
}

/// # Safety
/// AVX2 + FMA + F16C; `w` and `x` the same whole number of blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[u8]) -> f32 {
    unsafe { dot_impl::<crate::simd::Avx2Dot>(w, x) }
}

/// # Safety
/// As [`dot_avx2`] plus AVX-512 F/BW/VL/VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot_avx512(w: &[u8], x: &[u8]) -> f32 {
    unsafe { dot_impl::<crate::simd::VnniDot>(w, x) }
}
