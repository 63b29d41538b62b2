//! `iq2_xs`: superblocks of 256 values, 74 bytes: `d: f16`, `qs: [u16; 32]`
//! (9-bit grid index, 7-bit sign index), `scales: [u8; 8]` (two 4-bit scales
//! per run of 32: low nibble for its first 16 values, high for the last 16).
//! Group g (8 values) is `IQ2XS_GRID[qs[g] & 511]` with signs
//! `KSIGNS_IQ2XS[qs[g] >> 9]`; value = `d * (0.5 + ls) * 0.25 * grid * sign`.
//! Dots against `q8_K`.

use super::iq_tables::{IQ2XS_GRID, KSIGNS_IQ2XS};
use super::{q8_k, rd_f16, rd_u16};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 74;
const SC: usize = 66;

/// The 4-bit scale of group g (8 values).
#[inline(always)]
fn ls(b: &[u8], g: usize) -> u32 {
    ((b[SC + g / 4] >> (4 * ((g / 2) % 2))) & 0x0f) as u32
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, 0);
        for g in 0..32 {
            let q = rd_u16(b, 2 + 2 * g);
            let db = d * (0.5 + ls(b, g) as f32) * 0.25;
            let grid = IQ2XS_GRID[(q & 511) as usize].to_le_bytes();
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            for k in 0..8 {
                let sign = if (signs >> k) & 1 == 1 { -1.0 } else { 1.0 };
                y[8 * g + k] = db * grid[k] as f32 * sign;
            }
        }
    }
}

/// Scalar reference: `sumi = sum_groups (2 ls + 1) * sum(grid * sign * y)`,
/// `acc += (dx * d) * sumi`, `acc / 8` at the end.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(BYTES).enumerate() {
        let mut sumi = 0i32;
        for g in 0..32 {
            let q = rd_u16(b, 2 + 2 * g);
            let grid = IQ2XS_GRID[(q & 511) as usize].to_le_bytes();
            let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
            let mut s = 0i32;
            for k in 0..8 {
                let v = grid[k] as i32 * q8_k::q(x, i, 8 * g + k);
                s += if (signs >> k) & 1 == 1 { -v } else { v };
            }
            sumi += (2 * ls(b, g) as i32 + 1) * s;
        }
        acc += q8_k::d(x, i) * rd_f16(b, 0) * sumi as f32;
    }
    0.125 * acc
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
                let q = |k: usize| ld_u16(w, ow + 2 + 2 * (4 * ib + k));
                let g = |k: usize| IQ2XS_GRID[(q(k) & 511) as usize] as i64;
                let sg = |k: usize| SIGNS64[(q(k) >> 9) as usize] as i64;
                let grid = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
                let signs = _mm256_set_epi64x(sg(3), sg(2), sg(1), sg(0));
                let y = _mm256_sign_epi8(load256(x, ox + q8_k::QS + 32 * ib), signs);
                let sc = ld_u8(w, ow + SC + ib);
                let scl = scales_lo_hi(2 * (sc & 0x0f) as i32 + 1, 2 * (sc >> 4) as i32 + 1);
                v = _mm256_add_epi32(v, dot_u8i8_scaled(grid, y, scl));
            }
            let (d, _) = f16_pair(ld_u32(w, ow));
            acc += ld_f32(x, ox) * d * hsum_i32(v) as f32;
        }
    }
    0.125 * acc
}
