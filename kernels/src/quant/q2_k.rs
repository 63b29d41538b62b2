//! `q2_K`: superblocks of 256 values, 84 bytes: `scales: [u8; 16]` (low nibble
//! scale, high nibble min, one pair per 16 values), `qs: [u8; 64]`, `d: f16`,
//! `dmin: f16`. Value `c*128 + s*32 + l` is bits 2s..2s+2 of `qs[32c + l]`;
//! value = `d*sc_j*q - dmin*m_j` for its run j of 16. Dots against `q8_K`.

use super::fit::{fit_scale_min, level as fit_level, quantize_scales};
use super::{q8_k, rd_f16, wr_f16};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 84;
const QS: usize = 16;
const D: usize = 80;

#[inline(always)]
fn level(b: &[u8], e: usize) -> u8 {
    let (c, s, l) = (e / 128, (e % 128) / 32, e % 32);
    (b[QS + 32 * c + l] >> (2 * s)) & 3
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, dmin) = (rd_f16(b, D), rd_f16(b, D + 2));
        for j in 0..16 {
            let dl = d * (b[j] & 0x0f) as f32;
            let ml = dmin * (b[j] >> 4) as f32;
            for e in 16 * j..16 * j + 16 {
                y[e] = dl * level(b, e) as f32 - ml;
            }
        }
    }
}

/// Our own quantizer: a least-squares scale/min per run of 16 onto levels
/// 0..=3, 4-bit codes for both under f16 superblock scales, then nearest levels
/// under the stored scale and min.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let (mut s, mut mn) = ([0f32; 16], [0f32; 16]);
        for j in 0..16 {
            (s[j], mn[j]) = fit_scale_min(&x[16 * j..16 * j + 16], 3);
        }
        let (mut sc, mut m) = ([0u8; 16], [0u8; 16]);
        let d = quantize_scales(&s, 15, &mut sc);
        let dmin = quantize_scales(&mn, 15, &mut m);
        wr_f16(b, D, d);
        wr_f16(b, D + 2, dmin);
        b[QS..D].fill(0);
        for j in 0..16 {
            b[j] = sc[j] | (m[j] << 4);
            let (sj, bj) = (d * sc[j] as f32, dmin * m[j] as f32);
            for e in 16 * j..16 * j + 16 {
                let q = fit_level(x[e], sj, bj, 3);
                let (c, sh, l) = (e / 128, (e % 128) / 32, e % 32);
                b[QS + 32 * c + l] |= q << (2 * sh);
            }
        }
    }
}

/// Scalar reference: exact `sumi = sum_j sc_j sum(q y)`, `summ = sum_j m_j bsum_j`,
/// then `acc += (dx * d) * sumi - (dx * dmin) * summ`.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(BYTES).enumerate() {
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..16 {
            let s: i32 = (16 * j..16 * j + 16)
                .map(|e| level(b, e) as i32 * q8_k::q(x, i, e))
                .sum();
            sumi += (b[j] & 0x0f) as i32 * s;
            summ += (b[j] >> 4) as i32 * q8_k::bsum(x, i, j);
        }
        let dx = q8_k::d(x, i);
        acc += dx * rd_f16(b, D) * sumi as f32 - dx * rd_f16(b, D + 2) * summ as f32;
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
        let m2 = _mm256_set1_epi8(3);
        let pick = pair_shuffles();
        for i in 0..nb {
            let (ow, ox) = (i * BYTES, i * q8_k::BYTES);
            let sb = load128(w, ow);
            let sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(sb, _mm_set1_epi8(0x0f)));
            let mut v = _mm256_setzero_si256();
            for c in 0..2 {
                let q = load256(w, ow + QS + 32 * c);
                let half = half_scales(sc16, c);
                let lv = [
                    _mm256_and_si256(q, m2),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(q), m2),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(q), m2),
                    _mm256_and_si256(_mm256_srli_epi16::<6>(q), m2),
                ];
                for (s, qs) in lv.iter().enumerate() {
                    let y = load256(x, ox + q8_k::QS + 128 * c + 32 * s);
                    v = _mm256_add_epi32(
                        v,
                        dot_u8i8_scaled(*qs, y, _mm256_shuffle_epi8(half, pick[s])),
                    );
                }
            }
            let sumi = hsum_i32(v);
            let mins =
                _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sb), _mm_set1_epi8(0x0f)));
            let summ = hsum_i32(_mm256_madd_epi16(load256(x, ox + q8_k::BSUMS), mins));
            let (d, dmin) = f16_pair(ld_u32(w, ow + D));
            let dx = ld_f32(x, ox);
            acc += dx * d * sumi as f32 - dx * dmin * summ as f32;
        }
    }
    acc
}
