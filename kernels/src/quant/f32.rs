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

/// Scalar reference: eight running sums (lane `i % 8`), added pairwise at the end.
pub(crate) fn dot(w: &[u8], x: &[f32]) -> f32 {
    super::f16_::dot_lanes(x, |i| {
        f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]])
    })
}

/// # Safety
/// AVX2 + FMA; `w.len() == 4 * x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.len(), 4 * x.len());
    let n = x.len();
    let (wp, xp) = (w.as_ptr() as *const f32, x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    unsafe {
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(o)), _mm256_loadu_ps(xp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(wp.add(i)),
                _mm256_loadu_ps(xp.add(i)),
                acc[0],
            );
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = crate::simd::hsum_f32(v);
        while i < n {
            s += wp.add(i).read_unaligned() * x[i];
            i += 1;
        }
        s
    }
}
