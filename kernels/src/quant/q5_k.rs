//! `q5_K`: superblocks of 256 values, 176 bytes: `d: f16`, `dmin: f16`,
//! `scales: [u8; 12]` (packed as q4_K), `qh: [u8; 32]`, `qs: [u8; 128]`.
//! Sub-block j (32 values, j = 2c or 2c+1 from the low/high nibbles of
//! `qs[32c..]`) takes its fifth bit from bit j of `qh[l]`; value =
//! `d*sc_j*q - dmin*m_j`. Dots against `q8_K`.

use super::fit::{fit_scale_min, level as fit_level, quantize_scales};
use super::q4_k::{pack_scales_mins, scales_mins};
use super::{q8_k, rd_f16, wr_f16};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 176;
const QH: usize = 16;
const QS: usize = 48;

#[inline(always)]
fn level(b: &[u8], j: usize, l: usize) -> u8 {
    let nib = (b[QS + 32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
    nib | (((b[QH + l] >> j) & 1) << 4)
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let (d, dmin) = (rd_f16(b, 0), rd_f16(b, 2));
        let (sc, m) = scales_mins(&b[4..16]);
        for j in 0..8 {
            let (dl, ml) = (d * sc[j] as f32, dmin * m[j] as f32);
            for l in 0..32 {
                y[32 * j + l] = dl * level(b, j, l) as f32 - ml;
            }
        }
    }
}

/// Our own quantizer, as q4_K's with 32 levels: least-squares scale/min per
/// run of 32, 6-bit codes under f16 superblock scales, nearest levels under the
/// stored scale and min.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let (mut s, mut mn) = ([0f32; 8], [0f32; 8]);
        for j in 0..8 {
            (s[j], mn[j]) = fit_scale_min(&x[32 * j..32 * j + 32], 31);
        }
        let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
        let d = quantize_scales(&s, 63, &mut sc);
        let dmin = quantize_scales(&mn, 63, &mut m);
        wr_f16(b, 0, d);
        wr_f16(b, 2, dmin);
        pack_scales_mins(&sc, &m, &mut b[4..16]);
        b[QH..].fill(0);
        for j in 0..8 {
            let (sj, bj) = (d * sc[j] as f32, dmin * m[j] as f32);
            for l in 0..32 {
                let q = fit_level(x[32 * j + l], sj, bj, 31);
                b[QS + 32 * (j / 2) + l] |= (q & 0x0f) << (4 * (j % 2));
                b[QH + l] |= (q >> 4) << j;
            }
        }
    }
}

/// Scalar reference; the same integer sums and float expression as q4_K.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(BYTES).enumerate() {
        let (sc, m) = scales_mins(&b[4..16]);
        let mut sumi = 0i32;
        for j in 0..8 {
            let s: i32 = (0..32)
                .map(|l| level(b, j, l) as i32 * q8_k::q(x, i, 32 * j + l))
                .sum();
            sumi += sc[j] as i32 * s;
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
        let b4 = _mm256_set1_epi8(0x10);
        for i in 0..nb {
            let (ow, ox) = (i * BYTES, i * q8_k::BYTES);
            let (d, dmin) = f16_pair(ld_u32(w, ow));
            let s: [u8; 12] = w.as_ptr().add(ow + 4).cast::<[u8; 12]>().read_unaligned();
            let (sc, m) = scales_mins(&s);
            let qh = load256(w, ow + QH);
            let mut v = _mm256_setzero_si256();
            for c in 0..4 {
                let q = load256(w, ow + QS + 32 * c);
                // Bit j of qh moved to bit 4 of each byte, for j = 2c and 2c + 1.
                let h1 = _mm256_and_si256(shift_to_bit4(qh, 2 * c), b4);
                let h2 = _mm256_and_si256(shift_to_bit4(qh, 2 * c + 1), b4);
                let lo = _mm256_or_si256(_mm256_and_si256(q, m4), h1);
                let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), h2);
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
            let bs = _mm256_madd_epi16(load256(x, ox + q8_k::BSUMS), _mm256_set1_epi16(1));
            let mv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(m.as_ptr() as *const __m128i));
            let summ = hsum_i32(_mm256_mullo_epi32(bs, mv));
            let dx = ld_f32(x, ox);
            acc += dx * d * sumi as f32 - dx * dmin * summ as f32;
        }
    }
    acc
}

/// Move bit `j` of every byte of `v` to bit 4 (other bits are garbage; mask after).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn shift_to_bit4(v: std::arch::x86_64::__m256i, j: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    unsafe {
        if j <= 4 {
            _mm256_sll_epi16(v, _mm_cvtsi32_si128((4 - j) as i32))
        } else {
            _mm256_srl_epi16(v, _mm_cvtsi32_si128((j - 4) as i32))
        }
    }
}
