//! `f32` weights: 4 bytes little-endian per value. Dots against `f32` activations.

/// Bytes to values (exact).
pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

/// Values to bytes (exact).
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(4)) {
        d.copy_from_slice(&s.to_le_bytes());
    }
}

/// Scalar reference: the canonical 32-lane order of [`super::float_dot`].
pub(crate) fn dot(w: &[u8], x: &[f32]) -> f32 {
    super::float_dot::dot_lanes(x, |i| {
        f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]])
    })
}

/// The canonical 32-lane order of [`super::float_dot`], bit for bit.
///
/// # Safety
/// AVX2 + F16C; `w.len() == 4 * x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.len(), 4 * x.len());
    let wp = w.as_ptr() as *const f32;
    unsafe {
        super::float_dot::dot_avx2(
            x,
            |o| _mm256_loadu_ps(wp.add(o)),
            |i| wp.add(i).read_unaligned(),
        )
    }
}
