//! `q4_1`: blocks of 32 values, 20 bytes: `d: f16`, `m: f16`, `qs: [u8; 16]`
//! (nibble order as q4_0); value = d * q + m with q in 0..=15.
//!
//! llama.cpp dots q4_1 against `q8_1` (q8_0 plus a stored f16 `d * sum(q)`);
//! here it dots against `q8_0` and sums the activation quants exactly instead,
//! so the one 32-block activation format serves every 32-block weight.

use super::{q8_0, rd_f16, wr_f16};

pub(crate) const QK: usize = 32;
pub(crate) const BYTES: usize = 20;

#[inline(always)]
fn levels(b: &[u8]) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..16 {
        q[j] = b[4 + j] & 0x0f;
        q[j + 16] = b[4 + j] >> 4;
    }
    q
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
        for (yi, q) in y.iter_mut().zip(levels(b)) {
            *yi = d * q as f32 + m;
        }
    }
}

/// ggml's reference: `d = (max - min) / 15`, `q = min(15, trunc((x - min) / d + 0.5))`.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let (min, max) = x
            .iter()
            .fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_f16(b, 0, d);
        wr_f16(b, 2, min);
        for j in 0..16 {
            let lo = (((x[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
            let hi = (((x[j + 16] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
            b[4 + j] = lo | (hi << 4);
        }
    }
}

/// Scalar reference: `d_w d_x sum(q y) + m_w d_x sum(y)` per block.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (bw, bx) in w.chunks_exact(BYTES).zip(x.chunks_exact(q8_0::BYTES)) {
        let (mut s, mut sy) = (0i32, 0i32);
        for (&q, &y) in levels(bw).iter().zip(&bx[2..]) {
            s += q as i32 * (y as i8 as i32);
            sy += y as i8 as i32;
        }
        let dx = rd_f16(bx, 0);
        acc += rd_f16(bw, 0) * dx * s as f32 + rd_f16(bw, 2) * dx * sy as f32;
    }
    acc
}

/// The block layout for the shared SIMD driver, which reproduces [`dot`] bit for bit.
#[cfg(target_arch = "x86_64")]
struct Fmt;

#[cfg(target_arch = "x86_64")]
impl super::block32::Block32 for Fmt {
    const BYTES: usize = BYTES;
    const MINS: bool = true;
    #[inline(always)]
    unsafe fn ints<D: crate::simd::U8I8Dot>(
        w: &[u8],
        ow: usize,
        y: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use crate::simd::*;
        use std::arch::x86_64::*;
        unsafe { D::dpbusd(_mm256_setzero_si256(), nibbles_lo_hi(load128(w, ow + 4)), y) }
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
