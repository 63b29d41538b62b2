//! `q3_K`: superblocks of 256 values, 110 bytes: `hmask: [u8; 32]`,
//! `qs: [u8; 64]` (low 2 bits, laid out as q2_K), `scales: [u8; 12]` (sixteen
//! 6-bit scales, offset by 32), `d: f16`. Value `e = c*128 + s*32 + l` has low
//! bits from `qs[32c + l] >> 2s` and high bit `hmask[l] >> (4c + s)`;
//! q = low - (high ? 0 : 4); value = `d * (sc_j - 32) * q`. Dots against `q8_K`.

use super::{q8_k, rd_f16, wr_f16};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 110;
const QS: usize = 32;
const SC: usize = 96;
const D: usize = 108;

/// The sixteen signed scales: low nibbles in bytes 0-7 (runs 0-7 low, 8-15
/// high), top two bits in bytes 8-11 (run j: byte 8 + j%4, bits 2*(j/4)).
#[inline(always)]
fn scales(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|j| {
        let lo = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        (lo | (hi << 4)) as i8 - 32
    })
}

/// Unsigned level 0..=7 (the signed value plus 4).
#[inline(always)]
fn level(b: &[u8], e: usize) -> u8 {
    let (c, s, l) = (e / 128, (e % 128) / 32, e % 32);
    let lo = (b[QS + 32 * c + l] >> (2 * s)) & 3;
    let hi = (b[l] >> (4 * c + s)) & 1;
    lo | (hi << 2)
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, D);
        let sc = scales(&b[SC..SC + 12]);
        for (e, ye) in y.iter_mut().enumerate() {
            let dl = d * sc[e / 16] as f32;
            *ye = dl * (level(b, e) as i8 - 4) as f32;
        }
    }
}

/// Our own quantizer: per run of 16 the signed extreme maps to level -4
/// (`s = max / -4`), the sixteen scales get signed 6-bit codes under
/// `d = max|s| / 31`, and each value takes its nearest level in -4..=3 under
/// the stored scale.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let mut s = [0f32; 16];
        for (j, sj) in s.iter_mut().enumerate() {
            *sj = super::q4_0::signed_absmax(&x[16 * j..16 * j + 16]) / -4.0;
        }
        let smax = s.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = half::f16::from_f32(smax / 31.0).to_f32();
        wr_f16(b, D, d);
        b[..D].fill(0);
        for j in 0..16 {
            let code = if d > 0.0 {
                (s[j] / d).round().clamp(-32.0, 31.0) as i32
            } else {
                0
            };
            let v = (code + 32) as u8;
            if j < 8 {
                b[SC + j] |= v & 0x0f;
            } else {
                b[SC + j - 8] |= (v & 0x0f) << 4;
            }
            b[SC + 8 + j % 4] |= (v >> 4) << (2 * (j / 4));
            let dl = d * code as f32;
            for e in 16 * j..16 * j + 16 {
                let q = if dl != 0.0 {
                    (x[e] / dl).round().clamp(-4.0, 3.0) as i32 + 4
                } else {
                    4
                } as u8;
                let (c, sh, l) = (e / 128, (e % 128) / 32, e % 32);
                b[QS + 32 * c + l] |= (q & 3) << (2 * sh);
                b[l] |= (q >> 2) << (4 * c + sh);
            }
        }
    }
}

/// Scalar reference: exact `sumi = sum_j sc_j * sum(q y)`, then `acc += (dx * d) * sumi`.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(BYTES).enumerate() {
        let sc = scales(&b[SC..SC + 12]);
        let mut sumi = 0i32;
        for j in 0..16 {
            let s: i32 = (16 * j..16 * j + 16)
                .map(|e| (level(b, e) as i32 - 4) * q8_k::q(x, i, e))
                .sum();
            sumi += sc[j] as i32 * s;
        }
        acc += q8_k::d(x, i) * rd_f16(b, D) * sumi as f32;
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
        let b2 = _mm256_set1_epi8(4);
        let pick = pair_shuffles();
        for i in 0..nb {
            let (ow, ox) = (i * BYTES, i * q8_k::BYTES);
            // Scales word-parallel: low nibbles from bytes 0-7, top bits from 8-11.
            let (a0, a1, t) = (
                ld_u32(w, ow + SC),
                ld_u32(w, ow + SC + 4),
                ld_u32(w, ow + SC + 8),
            );
            let (m4, m3) = (0x0f0f_0f0f_u32, 0x0303_0303_u32);
            let s = _mm_set_epi32(
                (((a1 >> 4) & m4) | (((t >> 6) & m3) << 4)) as i32,
                (((a0 >> 4) & m4) | (((t >> 4) & m3) << 4)) as i32,
                ((a1 & m4) | (((t >> 2) & m3) << 4)) as i32,
                ((a0 & m4) | ((t & m3) << 4)) as i32,
            );
            let sc16 = _mm256_cvtepi8_epi16(_mm_sub_epi8(s, _mm_set1_epi8(32)));
            let hm = load256(w, ow);
            let mut v = _mm256_setzero_si256();
            for c in 0..2 {
                let q = load256(w, ow + QS + 32 * c);
                let half = half_scales(sc16, c);
                for s in 0..4 {
                    let lo =
                        _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * s as i32)), m2);
                    // hmask bit (4c + s) to bit 2 of each byte.
                    let k = (4 * c + s) as i32;
                    let hb = if k >= 2 {
                        _mm256_srl_epi16(hm, _mm_cvtsi32_si128(k - 2))
                    } else {
                        _mm256_sll_epi16(hm, _mm_cvtsi32_si128(2 - k))
                    };
                    let ql = _mm256_or_si256(lo, _mm256_and_si256(hb, b2));
                    let y = load256(x, ox + q8_k::QS + 128 * c + 32 * s);
                    v = _mm256_add_epi32(
                        v,
                        dot_u8i8_scaled(ql, y, _mm256_shuffle_epi8(half, pick[s])),
                    );
                }
            }
            // The -4 offset: sum_j sc_j * 4 * bsum_j.
            let offs = hsum_i32(_mm256_madd_epi16(load256(x, ox + q8_k::BSUMS), sc16));
            let sumi = hsum_i32(v) - 4 * offs;
            let (_, d) = f16_pair(ld_u32(w, ow + D - 2));
            acc += ld_f32(x, ox) * d * sumi as f32;
        }
    }
    acc
}
