//! `bf16` weights: the top 16 bits of an f32, 2 bytes little-endian. Dots
//! against `f32` activations.

#[inline(always)]
fn to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits as ggml and the `gguf` package do: NaN becomes a quiet NaN
/// keeping the sign and top payload bits, everything else rounds to nearest even.
#[inline]
pub(crate) fn from_f32(v: f32) -> u16 {
    let n = v.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n >> 16) | 64) as u16;
    }
    ((n as u64 + 0x7fff + ((n >> 16) & 1) as u64) >> 16) as u16
}

/// Bytes to values (exact).
pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

/// Values to bytes (see [`from_f32`]).
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (s, d) in src.iter().zip(dst.chunks_exact_mut(2)) {
        d.copy_from_slice(&from_f32(*s).to_le_bytes());
    }
}

/// Scalar reference: the canonical 32-lane order of [`super::float_dot`].
pub(crate) fn dot(w: &[u8], x: &[f32]) -> f32 {
    super::float_dot::dot_lanes(x, |i| to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])))
}

/// The canonical 32-lane order of [`super::float_dot`], bit for bit.
///
/// # Safety
/// AVX2; `w.len() == 2 * x.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert_eq!(w.len(), 2 * x.len());
    let wp = w.as_ptr();
    unsafe {
        // Eight bf16 -> eight f32: widen to 32 bits and shift into the top half.
        super::float_dot::dot_avx2(
            x,
            |o| {
                let h = _mm_loadu_si128(wp.add(2 * o) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            },
            |i| to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_ggml() {
        // 1 + 2^-8 is a tie: rounds to even (1.0); just above rounds up.
        assert_eq!(from_f32(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(from_f32(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 0x3f81);
        assert_eq!(from_f32(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(from_f32(-2.0), 0xc000);
        assert_eq!(from_f32(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(to_f32(0x3f80), 1.0);
    }
}
