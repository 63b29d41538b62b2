//! `iq3_xxs`: superblocks of 256 values, 98 bytes: `d: f16`, `qs: [u8; 64]`
//! (grid indices, four values each), then per run of 32 a u32 `s`: four 7-bit
//! sign indices (each covering 8 values = two grid entries) and a 4-bit scale
//! `ls` in bits 28-31. Value = `d * (0.5 + ls) * 0.5 * grid * sign`. Dots
//! against `q8_K`.

use super::iq_tables::{IQ3XXS_GRID, KSIGNS_IQ2XS};
use super::{q8_k, rd_f16, rd_u32};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 98;
const SS: usize = 66;

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, 0);
        for ib in 0..8 {
            let s = rd_u32(b, SS + 4 * ib);
            let db = d * (0.5 + (s >> 28) as f32) * 0.5;
            for g in 0..4 {
                let signs = KSIGNS_IQ2XS[((s >> (7 * g)) & 127) as usize];
                for k in 0..8 {
                    let grid = IQ3XXS_GRID[b[2 + 8 * ib + 2 * g + k / 4] as usize].to_le_bytes();
                    let sign = if (signs >> k) & 1 == 1 { -1.0 } else { 1.0 };
                    y[32 * ib + 8 * g + k] = db * grid[k % 4] as f32 * sign;
                }
            }
        }
    }
}

/// Scalar reference: `sumi = sum_runs (2 ls + 1) * sum(grid * sign * y)`
/// (the scale `(0.5 + ls) / 2` is `(2 ls + 1) / 4`), `acc += (dx * d) * sumi`,
/// `acc / 4` at the end.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(BYTES).enumerate() {
        let mut sumi = 0i32;
        for ib in 0..8 {
            let s = rd_u32(b, SS + 4 * ib);
            let mut run = 0i32;
            for g in 0..4 {
                let signs = KSIGNS_IQ2XS[((s >> (7 * g)) & 127) as usize];
                for k in 0..8 {
                    let grid = IQ3XXS_GRID[b[2 + 8 * ib + 2 * g + k / 4] as usize].to_le_bytes();
                    let v = grid[k % 4] as i32 * q8_k::q(x, i, 32 * ib + 8 * g + k);
                    run += if (signs >> k) & 1 == 1 { -v } else { v };
                }
            }
            sumi += (2 * (s >> 28) as i32 + 1) * run;
        }
        acc += q8_k::d(x, i) * rd_f16(b, 0) * sumi as f32;
    }
    0.25 * acc
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
        for i in 0..nb {
            let (ow, ox) = (i * BYTES, i * q8_k::BYTES);
            let mut v = _mm256_setzero_si256();
            for ib in 0..8 {
                let s = ld_u32(w, ow + SS + 4 * ib);
                let g = |k: usize| IQ3XXS_GRID[ld_u8(w, ow + 2 + 8 * ib + k) as usize] as i32;
                let grid = _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0));
                let sg = |k: u32| SIGNS64[((s >> (7 * k)) & 127) as usize] as i64;
                let signs = _mm256_set_epi64x(sg(3), sg(2), sg(1), sg(0));
                let y = _mm256_sign_epi8(load256(x, ox + q8_k::QS + 32 * ib), signs);
                let ls = (2 * (s >> 28) + 1) as i16;
                v = _mm256_add_epi32(v, dot_u8i8_scaled(grid, y, _mm256_set1_epi16(ls)));
            }
            let (d, _) = f16_pair(ld_u32(w, ow));
            acc += ld_f32(x, ox) * d * hsum_i32(v) as f32;
        }
    }
    0.25 * acc
}
