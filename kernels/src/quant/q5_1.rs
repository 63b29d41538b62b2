//! `q5_1`: blocks of 32 values, 24 bytes: `d: f16`, `m: f16`, `qh: u32`,
//! `qs: [u8; 16]`; value = d * q + m with q in 0..=31 (bits as q5_0).
//!
//! Like q4_1, dots against `q8_0` with an exact activation sum instead of
//! llama.cpp's `q8_1`.

use super::{q8_0, rd_f16, rd_u32, wr_f16};

pub(crate) const QK: usize = 32;
pub(crate) const BYTES: usize = 24;

#[inline(always)]
fn levels(b: &[u8]) -> [u8; QK] {
    let qh = rd_u32(b, 4);
    let mut q = [0u8; QK];
    for j in 0..16 {
        q[j] = (b[8 + j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (b[8 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
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

/// ggml's reference: `d = (max - min) / 31`, `q = min(31, trunc((x - min) / d + 0.5))`.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let (min, max) = x
            .iter()
            .fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_f16(b, 0, d);
        wr_f16(b, 2, min);
        let mut qh = 0u32;
        for j in 0..16 {
            let lo = (((x[j] - min) * id + 0.5) as i32).clamp(0, 31) as u32;
            let hi = (((x[j + 16] - min) * id + 0.5) as i32).clamp(0, 31) as u32;
            b[8 + j] = ((lo & 0x0f) | ((hi & 0x0f) << 4)) as u8;
            qh |= ((lo >> 4) << j) | ((hi >> 4) << (j + 16));
        }
        b[4..8].copy_from_slice(&qh.to_le_bytes());
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
        unsafe {
            let hi = _mm256_and_si256(D::bit_bytes(ld_u32(w, ow + 4)), _mm256_set1_epi8(0x10));
            let q = _mm256_or_si256(nibbles_lo_hi(load128(w, ow + 8)), hi);
            D::dpbusd(_mm256_setzero_si256(), q, y)
        }
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
