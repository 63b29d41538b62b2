//! `f16` weights: IEEE half, 2 bytes little-endian. Dots against `f32` activations.

use half::f16;

/// Bytes to values (exact: every f16 is an f32).
pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16::from_bits(u16::from_le_bytes([s[0], s[1]])).to_f32();
    }
}

/// Values to bytes, rounding to nearest even (overflow goes to infinity).
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&f16::from_f32(*s).to_bits().to_le_bytes());
    }
}

/// Scalar reference: the canonical 32-lane order of [`super::float_dot`].
pub(crate) fn dot(w: &[u8], x: &[f32]) -> f32 {
    super::float_dot::dot_lanes(x, |i| {
        f16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f32()
    })
}

/// The canonical 32-lane order of [`super::float_dot`], bit for bit.
///
/// # Safety
/// AVX2 + F16C; `w.len() == 2 * x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.len(), 2 * x.len());
    let wp = w.as_ptr();
    unsafe {
        super::float_dot::dot_avx2(
            x,
            |o| _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * o) as *const __m128i)),
            |i| crate::simd::f16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])),
        )
    }
}
