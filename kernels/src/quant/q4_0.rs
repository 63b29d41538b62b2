//! `q4_0`: blocks of 32 values, 18 bytes: `d: f16`, `qs: [u8; 16]`. Value j is
//! the low nibble of `qs[j]` (j < 16) or the high nibble of `qs[j - 16]`, minus 8,
//! times d. Dots against `q8_0`.

use super::{q8_0, rd_f16, wr_f16};

pub(crate) const QK: usize = 32;
pub(crate) const BYTES: usize = 18;

/// The 32 signed 4-bit levels of one block, in value order.
#[inline(always)]
pub(crate) fn levels(b: &[u8]) -> [i8; QK] {
    let mut q = [0i8; QK];
    for j in 0..16 {
        q[j] = (b[2 + j] & 0x0f) as i8 - 8;
        q[j + 16] = (b[2 + j] >> 4) as i8 - 8;
    }
    q
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, 0);
        for (yi, q) in y.iter_mut().zip(levels(b)) {
            *yi = d * q as f32;
        }
    }
}

/// ggml's reference: `d = max / -8` where `max` is the value of largest
/// magnitude, `q = min(15, trunc(x / d + 8.5))`. Bit-identical to the `gguf`
/// package's quantizer.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let max = signed_absmax(x);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_f16(b, 0, d);
        for j in 0..16 {
            let lo = ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8;
            let hi = ((x[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
            b[2 + j] = lo | (hi << 4);
        }
    }
}

/// The first value of largest magnitude, with its sign (ggml's `max`).
#[inline]
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Scalar reference against `q8_0` activations.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (bw, bx) in w.chunks_exact(BYTES).zip(x.chunks_exact(q8_0::BYTES)) {
        let mut s = 0i32;
        for (q, &y) in levels(bw).iter().zip(&bx[2..]) {
            s += *q as i32 * (y as i8 as i32);
        }
        acc += rd_f16(bw, 0) * rd_f16(bx, 0) * s as f32;
    }
    acc
}

/// The block layout for the shared SIMD driver, which reproduces [`dot`] bit for bit.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Fmt;

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
        unsafe {
            dot_i8::<D>(_mm256_setzero_si256(), level_bytes::<D>(w, ow), y)
        }
    }
}

/// The 32 levels of the block at `w[ow..]` as signed bytes.
///
/// # Safety
/// The CPU has the features of `D`; the block lies inside `w`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn level_bytes<D: crate::simd::U8I8Dot>(w: &[u8], ow: usize) -> std::arch::x86_64::__m256i {
    use crate::simd::*;
    use std::arch::x86_64::*;
    unsafe {
        _mm256_sub_epi8(nibbles_lo_hi(load128(w, ow + 2)), _mm256_set1_epi8(8))
    }
}

#[cfg(target_arch = "x86_64")]
impl super::block32::SignedLevels for Fmt {
    #[inline(always)]
    unsafe fn level_bytes(w: &[u8], ow: usize) -> std::arch::x86_64::__m256i {
        unsafe { level_bytes::<crate::simd::Avx2Dot>(w, ow) }
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
