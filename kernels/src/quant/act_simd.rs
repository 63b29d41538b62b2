//! The activation quantizers (`q8_0`, `q8_K`) 16 values at a time with
//! AVX-512 (8 with AVX2), bit for bit the scalar references in `q8_0.rs` and `q8_k.rs`.
//! A prefill chunk's rows are quantized before every matmul; one value at a
//! time that was 16% of gemma-3-270m's pp128.
//!
//! Why the same bits: the block maximum is a max (order free, NaN lanes
//! skipped as the scalar fold skips them), the scale is the same scalar
//! division, every product is the same single IEEE multiply, and the
//! roundings are reproduced exactly: clamping to ±127 before rounding gives
//! what rounding then clamping gives (both are monotone and fix ±127), and
//! NaN products go to 0 as the scalar casts send them.

/// `q8_0::quantize`, with AVX-512 or AVX2 where the CPU has them.
pub(crate) fn q8_0(src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    match level() {
        // SAFETY: `level` checked the features.
        Level::Avx512 => return unsafe { q8_0_avx512(src, dst) },
        Level::Avx2 => return unsafe { q8_0_avx2(src, dst) },
        Level::Scalar => {}
    }
    super::q8_0::quantize(src, dst)
}

/// `q8_k::quantize`, with AVX-512 or AVX2 where the CPU has them.
pub(crate) fn q8_k(src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    match level() {
        // SAFETY: `level` checked the features.
        Level::Avx512 => return unsafe { q8_k_avx512(src, dst) },
        Level::Avx2 => return unsafe { q8_k_avx2(src, dst) },
        Level::Scalar => {}
    }
    super::q8_k::quantize(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Avx512,
    Avx2,
    Scalar,
}

#[cfg(target_arch = "x86_64")]
fn level() -> Level {
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        Level::Avx512
    } else if is_x86_feature_detected!("avx2") {
        Level::Avx2
    } else {
        Level::Scalar
    }
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Max of `|v|` into `acc` (`acc` never NaN: `max_ps` returns its second
/// operand when either is NaN, so NaN lanes leave `acc` as it was).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn abs_max(v: __m512, acc: __m512) -> __m512 {
    _mm512_max_ps(_mm512_abs_ps(v), acc)
}

/// `y` with NaN lanes set to 0, clamped to [-127, 127].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn clamp127(y: __m512) -> __m512 {
    let y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(y, y), y);
    let lim = _mm512_set1_ps(127.0);
    _mm512_max_ps(_mm512_min_ps(y, lim), _mm512_set1_ps(-127.0))
}

/// # Safety
/// AVX-512 F and BW; `src` whole blocks of 32 and `dst` as many of 34 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q8_0_avx512(src: &[f32], dst: &mut [u8]) {
    use super::q8_0::{BYTES, QK};
    let one = _mm512_set1_epi32(1);
    let half = _mm512_set1_ps(0.5);
    let mhalf = _mm512_set1_ps(-0.5);
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        // SAFETY: `x` holds 32 values, `b` 34 bytes.
        unsafe {
            let v = [_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))];
            let amax = _mm512_reduce_max_ps(abs_max(v[1], abs_max(v[0], _mm512_setzero_ps())));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            super::wr_f16(b, 0, d);
            let idv = _mm512_set1_ps(id);
            for (h, &vh) in v.iter().enumerate() {
                let y = clamp127(_mm512_mul_ps(vh, idv));
                // Ties away from zero as `round_away`: truncate, then step by the
                // exact remainder.
                let t = _mm512_cvttps_epi32(y);
                let rem = _mm512_sub_ps(y, _mm512_cvtepi32_ps(t));
                let t = _mm512_mask_add_epi32(t, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(rem, half), t, one);
                let t = _mm512_mask_sub_epi32(t, _mm512_cmp_ps_mask::<_CMP_LE_OQ>(rem, mhalf), t, one);
                _mm_storeu_si128(b.as_mut_ptr().add(2 + 16 * h) as *mut __m128i, _mm512_cvtsepi32_epi8(t));
            }
        }
    }
}

/// # Safety
/// AVX-512 F and BW; `src` whole blocks of 256 and `dst` as many of 292 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q8_k_avx512(src: &[f32], dst: &mut [u8]) {
    use super::q8_k::{BSUMS, BYTES, QK, QS};
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        // SAFETY: `x` holds 256 values, `b` 292 bytes.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|j| _mm512_loadu_ps(x.as_ptr().add(16 * j)));
            let amax = _mm512_reduce_max_ps(v.iter().fold(_mm512_setzero_ps(), |acc, &vj| abs_max(vj, acc)));
            if amax == 0.0 {
                b.fill(0);
                continue;
            }
            // The scalar keeps the first value of the largest magnitude.
            let at = _mm512_set1_ps(amax);
            let (j, lanes) = v
                .iter()
                .enumerate()
                .map(|(j, &vj)| (j, _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(vj), at)))
                .find(|&(_, m)| m != 0)
                .expect("amax is some lane's magnitude");
            let max = x[16 * j + lanes.trailing_zeros() as usize];
            let iscale = -127.0 / max;
            let sv = _mm512_set1_ps(iscale);
            for (j, &vj) in v.iter().enumerate() {
                let y = clamp127(_mm512_mul_ps(sv, vj));
                let q = _mm512_cvtps_epi32(_mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y));
                _mm_storeu_si128(b.as_mut_ptr().add(QS + 16 * j) as *mut __m128i, _mm512_cvtsepi32_epi8(q));
                let s = _mm512_reduce_add_epi32(q) as i16;
                b[BSUMS + 2 * j..BSUMS + 2 * j + 2].copy_from_slice(&s.to_le_bytes());
            }
            b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        }
    }
}

/// Max of `|v|` into `acc`, NaN lanes skipped (as [`abs_max`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn abs_max8(v: __m256, acc: __m256) -> __m256 {
    unsafe { _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0), v), acc) }
}

/// The largest lane of `v` (no NaN lanes).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hmax8(v: __m256) -> f32 {
    unsafe {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
    }
}

/// `y` with NaN lanes set to 0, clamped to [-127, 127] (as [`clamp127`]).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn clamp127_8(y: __m256) -> __m256 {
    unsafe {
        let y = _mm256_and_ps(y, _mm256_cmp_ps::<_CMP_ORD_Q>(y, y));
        _mm256_max_ps(_mm256_min_ps(y, _mm256_set1_ps(127.0)), _mm256_set1_ps(-127.0))
    }
}

/// Four vectors of eight i32 in [-127, 127] to their 32 bytes, in order.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pack32(q: [__m256i; 4], out: *mut u8) {
    unsafe {
        let b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out as *mut __m256i, b);
    }
}

/// # Safety
/// AVX2; `src` whole blocks of 32 and `dst` as many of 34 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q8_0_avx2(src: &[f32], dst: &mut [u8]) {
    use super::q8_0::{BYTES, QK};
    let one = _mm256_set1_epi32(1);
    let (half, mhalf) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        // SAFETY: `x` holds 32 values, `b` 34 bytes.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|h| _mm256_loadu_ps(x.as_ptr().add(8 * h)));
            let amax = hmax8(v.iter().fold(_mm256_setzero_ps(), |acc, &vh| abs_max8(vh, acc)));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            super::wr_f16(b, 0, d);
            let idv = _mm256_set1_ps(id);
            let q: [__m256i; 4] = std::array::from_fn(|h| {
                let y = clamp127_8(_mm256_mul_ps(v[h], idv));
                let t = _mm256_cvttps_epi32(y);
                let rem = _mm256_sub_ps(y, _mm256_cvtepi32_ps(t));
                let up = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(rem, half)), one);
                let down = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(rem, mhalf)), one);
                _mm256_sub_epi32(_mm256_add_epi32(t, up), down)
            });
            pack32(q, b.as_mut_ptr().add(2));
        }
    }
}

/// # Safety
/// AVX2; `src` whole blocks of 256 and `dst` as many of 292 bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn q8_k_avx2(src: &[f32], dst: &mut [u8]) {
    use super::q8_k::{BSUMS, BYTES, QK, QS};
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        // SAFETY: `x` holds 256 values, `b` 292 bytes.
        unsafe {
            let v: [__m256; 32] = std::array::from_fn(|j| _mm256_loadu_ps(x.as_ptr().add(8 * j)));
            let amax = hmax8(v.iter().fold(_mm256_setzero_ps(), |acc, &vj| abs_max8(vj, acc)));
            if amax == 0.0 {
                b.fill(0);
                continue;
            }
            let at = _mm256_set1_ps(amax);
            let (j, lanes) = v
                .iter()
                .enumerate()
                .map(|(j, &vj)| (j, _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(_mm256_set1_ps(-0.0), vj), at))))
                .find(|&(_, m)| m != 0)
                .expect("amax is some lane's magnitude");
            let max = x[8 * j + lanes.trailing_zeros() as usize];
            let iscale = -127.0 / max;
            let sv = _mm256_set1_ps(iscale);
            let q: [__m256i; 32] = std::array::from_fn(|j| {
                let y = clamp127_8(_mm256_mul_ps(sv, v[j]));
                _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(y))
            });
            for c in 0..8 {
                pack32([q[4 * c], q[4 * c + 1], q[4 * c + 2], q[4 * c + 3]], b.as_mut_ptr().add(QS + 32 * c));
            }
            for j in 0..16 {
                let s = _mm256_add_epi32(q[2 * j], q[2 * j + 1]);
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                let s = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s))) as i16;
                b[BSUMS + 2 * j..BSUMS + 2 * j + 2].copy_from_slice(&s.to_le_bytes());
            }
            b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows that hit every branch: ties at ±0.5 steps, NaN, infinities,
    /// subnormal and zero blocks, repeated maxima of both signs.
    fn rows(n: usize) -> Vec<f32> {
        let mut s = 0x2545_f491_u64;
        let mut rnd = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut x: Vec<f32> = (0..n)
            .map(|i| {
                let r = rnd();
                let v = ((r >> 11) as f64 / (1u64 << 53) as f64 * 8.0 - 4.0) as f32;
                match (i / 256) % 6 {
                    0 => v,
                    1 => (v * 4.0).round() / 4.0 * 127.0 / 3.5,
                    2 => v * 1e-39,
                    3 => 0.0,
                    4 => v * 3e38,
                    _ => ((r % 9) as f32 - 4.0) * 0.5,
                }
            })
            .collect();
        for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 4.0, -4.0].into_iter().enumerate() {
            x[256 * 6 + 37 * i] = v;
        }
        x[256 * 7 + 3] = -4.0;
        x[256 * 7 + 200] = 4.0;
        x
    }

    /// Every SIMD level this CPU has against the scalar references.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_quantizers_equal_the_scalar_references_bit_for_bit() {
        type Q = unsafe fn(&[f32], &mut [u8]);
        let x = rows(256 * 60);
        let mut levels: Vec<(&str, Q, Q)> = Vec::new();
        if level() == Level::Avx512 {
            levels.push(("avx512", q8_0_avx512, q8_k_avx512));
        }
        if is_x86_feature_detected!("avx2") {
            levels.push(("avx2", q8_0_avx2, q8_k_avx2));
        }
        for (name, f0, fk) in levels {
            let (mut a, mut b) = (vec![0u8; x.len() / 32 * 34], vec![0u8; x.len() / 32 * 34]);
            // SAFETY: the level's features were checked above.
            unsafe { f0(&x, &mut a) };
            super::super::q8_0::quantize(&x, &mut b);
            assert!(a == b, "{name} q8_0 differs at block {}", a.chunks(34).zip(b.chunks(34)).position(|(p, q)| p != q).unwrap());
            let (mut a, mut b) = (vec![0u8; x.len() / 256 * 292], vec![0u8; x.len() / 256 * 292]);
            // SAFETY: as above.
            unsafe { fk(&x, &mut a) };
            super::super::q8_k::quantize(&x, &mut b);
            assert!(a == b, "{name} q8_K differs at block {}", a.chunks(292).zip(b.chunks(292)).position(|(p, q)| p != q).unwrap());
        }
    }
}
