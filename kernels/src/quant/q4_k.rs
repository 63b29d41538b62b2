//! `q4_K`: superblocks of 256 values, 144 bytes: `d: f16`, `dmin: f16`,
//! `scales: [u8; 12]` (eight 6-bit scales and eight 6-bit mins, packed),
//! `qs: [u8; 128]`. Sub-block j (32 values) is `d*sc_j*q - dmin*m_j`; sub-blocks
//! 2c and 2c+1 are the low and high nibbles of `qs[32c..32c+32]`. Dots against `q8_K`.

use super::fit::{fit_scale_min, level, quantize_scales};
use super::{q8_k, rd_f16, wr_f16};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 144;

/// Unpack the eight 6-bit scales and mins (shared with q5_K):
/// bytes 0-3 hold sc0-3 in bits 0-5, bytes 4-7 m0-3; bytes 8-11 hold the low
/// nibbles of sc4-7 and m4-7, whose top two bits sit in bits 6-7 of bytes 0-7.
#[inline(always)]
pub(crate) fn scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, m)
}

/// Inverse of [`scales_mins`]; every input must be below 64.
pub(crate) fn pack_scales_mins(sc: &[u8; 8], m: &[u8; 8], s: &mut [u8]) {
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
        let (sc, m) = scales_mins(&b[4..16]);
        for c in 0..4 {
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * m[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * m[2 * c + 1] as f32);
            for l in 0..32 {
                let q = b[16 + 32 * c + l];
                y[64 * c + l] = d1 * (q & 0x0f) as f32 - m1;
                y[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

/// Our own quantizer (not ggml's): a least-squares scale/min per sub-block
/// ([`fit_scale_min`]), 6-bit codes for both under f16 superblock scales, then
/// each value's nearest level under the stored (quantized) scale and min.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let (mut s, mut mn) = ([0f32; 8], [0f32; 8]);
        for j in 0..8 {
            (s[j], mn[j]) = fit_scale_min(&x[32 * j..32 * j + 32], 15);
        }
        let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
        let d = quantize_scales(&s, 63, &mut sc);
        let dmin = quantize_scales(&mn, 63, &mut m);
        wr_f16(b, 0, d);
        wr_f16(b, 2, dmin);
        pack_scales_mins(&sc, &m, &mut b[4..16]);
        for c in 0..4 {
            let (s1, b1) = (d * sc[2 * c] as f32, dmin * m[2 * c] as f32);
            let (s2, b2) = (d * sc[2 * c + 1] as f32, dmin * m[2 * c + 1] as f32);
            for l in 0..32 {
                let lo = level(x[64 * c + l], s1, b1, 15);
                let hi = level(x[64 * c + 32 + l], s2, b2, 15);
                b[16 + 32 * c + l] = lo | (hi << 4);
            }
        }
    }
}

/// Scalar reference: per superblock the exact integer sums
/// `sumi = sum_j sc_j * sum(q y)` and `summ = sum_j m_j * bsum_j`, then
/// `acc += (dx * d) * sumi - (dx * dmin) * summ`. The SIMD path forms the same
/// integers and the same float expression, so the two agree exactly.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(BYTES).enumerate() {
        let (sc, m) = scales_mins(&b[4..16]);
        let mut sumi = 0i32;
        for c in 0..4 {
            let (mut s1, mut s2) = (0i32, 0i32);
            for l in 0..32 {
                let q = b[16 + 32 * c + l];
                s1 += (q & 0x0f) as i32 * q8_k::q(x, i, 64 * c + l);
                s2 += (q >> 4) as i32 * q8_k::q(x, i, 64 * c + 32 + l);
            }
            sumi += sc[2 * c] as i32 * s1 + sc[2 * c + 1] as i32 * s2;
        }
        let summ: i32 = (0..8)
            .map(|j| m[j] as i32 * (q8_k::bsum(x, i, 2 * j) + q8_k::bsum(x, i, 2 * j + 1)))
            .sum();
        let dx = q8_k::d(x, i);
        acc += dx * rd_f16(b, 0) * sumi as f32 - dx * rd_f16(b, 2) * summ as f32;
    }
    acc
}

/// # Safety
/// AVX2 + FMA + F16C; `w` and `x` the same whole number of superblocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[u8]) -> f32 {
    use crate::simd::*;
    use std::arch::x86_64::*;
    let nb = w.len() / BYTES;
    debug_assert_eq!(x.len(), nb * q8_k::BYTES);
    let mut acc = 0f32;
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        for i in 0..nb {
            let (ow, ox) = (i * BYTES, i * q8_k::BYTES);
            let (d, dmin) = f16_pair(ld_u32(w, ow));
            let s: [u8; 12] = w.as_ptr().add(ow + 4).cast::<[u8; 12]>().read_unaligned();
            let (sc, m) = scales_mins(&s);
            let mut v = _mm256_setzero_si256();
            for c in 0..4 {
                let q = load256(w, ow + 16 + 32 * c);
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                let y = ox + q8_k::QS + 64 * c;
                let p1 = dot_u8i8_scaled(lo, load256(x, y), _mm256_set1_epi16(sc[2 * c] as i16));
                let p2 = dot_u8i8_scaled(
                    hi,
                    load256(x, y + 32),
                    _mm256_set1_epi16(sc[2 * c + 1] as i16),
                );
                v = _mm256_add_epi32(v, _mm256_add_epi32(p1, p2));
            }
            let sumi = hsum_i32(v);
            // Mins: pair the 16 bsums into 8 sub-block sums, times m_j.
            let bs = _mm256_madd_epi16(load256(x, ox + q8_k::BSUMS), _mm256_set1_epi16(1));
            let mv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(m.as_ptr() as *const __m128i));
            let summ = hsum_i32(_mm256_mullo_epi32(bs, mv));
            let dx = ld_f32(x, ox);
            acc += dx * d * sumi as f32 - dx * dmin * summ as f32;
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_packing_round_trips() {
        let sc = [0, 1, 17, 63, 32, 45, 7, 62];
        let m = [63, 0, 5, 33, 16, 1, 60, 31];
        let mut s = [0u8; 12];
        pack_scales_mins(&sc, &m, &mut s);
        assert_eq!(scales_mins(&s), (sc, m));
    }
}
