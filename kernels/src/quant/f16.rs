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

/// The float dots' shared scalar reference: eight running sums (value `i` goes
/// to lane `i % 8`), then `((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7))`.
#[inline(always)]
pub(crate) fn dot_lanes(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let mut l = [0f32; 8];
    for (i, xi) in x.iter().enumerate() {
        l[i % 8] += w(i) * xi;
    }
    ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))
}

/// Scalar reference.
pub(crate) fn dot(w: &[u8], x: &[f32]) -> f32 {
    dot_lanes(x, |i| {
        f16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f32()
    })
}

/// # Safety
/// AVX2 + FMA + F16C; `w.len() == 2 * x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.len(), 2 * x.len());
    let n = x.len();
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    unsafe {
        let ld = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * o) as *const __m128i));
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                *a = _mm256_fmadd_ps(ld(o), _mm256_loadu_ps(xp.add(o)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(ld(i), _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = crate::simd::hsum_f32(v);
        while i < n {
            s += crate::simd::f16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) * x[i];
            i += 1;
        }
        s
    }
}
