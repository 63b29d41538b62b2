//! `q6_K`: superblocks of 256 values, 210 bytes: `ql: [u8; 128]` (low 4 bits),
//! `qh: [u8; 64]` (high 2 bits), `scales: [i8; 16]`, `d: f16`. In half c
//! (128 values), for l in 0..32, values `c*128 + {l, 32+l, 64+l, 96+l}` take the low nibble of `ql[64c+l]`,
//! the low nibble of `ql[64c+32+l]`, the high nibble of `ql[64c+l]`, the high
//! nibble of `ql[64c+32+l]`, and bits 0-1, 2-3, 4-5, 6-7 of `qh[32c+l]`;
//! value = `d * scale[v/16] * (q - 32)`. Dots against `q8_K`.

use super::{q8_k, rd_f16, wr_f16};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 210;
const QH: usize = 128;
pub(crate) const SC: usize = 192;
pub(crate) const D: usize = 208;

/// Unsigned 6-bit level (0..=63) of value `e`.
#[inline(always)]
pub(crate) fn level(b: &[u8], e: usize) -> u8 {
    let (c, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = b[64 * c + 32 * (k % 2) + l] >> (4 * (k / 2)) & 0x0f;
    let qh = (b[QH + 32 * c + l] >> (2 * k)) & 3;
    ql | (qh << 4)
}

pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, D);
        for (e, ye) in y.iter_mut().enumerate() {
            let dl = d * (b[SC + e / 16] as i8) as f32;
            *ye = dl * (level(b, e) as i8 - 32) as f32;
        }
    }
}

/// Our own quantizer: per run of 16 the signed extreme maps to -32
/// (`s = max / -32`), the 16 scales get 8-bit codes under `d = max|s| / 127`,
/// and each value takes its nearest level under the stored scale.
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let mut s = [0f32; 16];
        for (j, sj) in s.iter_mut().enumerate() {
            *sj = super::q4_0::signed_absmax(&x[16 * j..16 * j + 16]) / -32.0;
        }
        let smax = s.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = half::f16::from_f32(smax / 127.0).to_f32();
        wr_f16(b, D, d);
        b[..SC].fill(0);
        for j in 0..16 {
            let code = if d > 0.0 {
                (s[j] / d).round().clamp(-127.0, 127.0) as i8
            } else {
                0
            };
            b[SC + j] = code as u8;
            let dl = d * code as f32;
            for e in 16 * j..16 * j + 16 {
                let q = if dl != 0.0 {
                    ((x[e] / dl).round().clamp(-32.0, 31.0) as i32 + 32) as u8
                } else {
                    32
                };
                let (c, k, l) = (e / 128, (e % 128) / 32, e % 32);
                b[64 * c + 32 * (k % 2) + l] |= (q & 0x0f) << (4 * (k / 2));
                b[QH + 32 * c + l] |= (q >> 4) << (2 * k);
            }
        }
    }
}

/// Scalar reference: `sumi = sum_j scale_j * sum((q - 32) y)` exactly, then
/// `acc += (dx * d) * sumi`.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(BYTES).enumerate() {
        let mut sumi = 0i32;
        for j in 0..16 {
            let s: i32 = (16 * j..16 * j + 16)
                .map(|e| (level(b, e) as i32 - 32) * q8_k::q(x, i, e))
                .sum();
            sumi += (b[SC + j] as i8) as i32 * s;
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
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let pick = pair_shuffles();
        for i in 0..nb {
            let (ow, ox) = (i * BYTES, i * q8_k::BYTES);
            let sc16 = _mm256_cvtepi8_epi16(load128(w, ow + SC));
            let mut v = _mm256_setzero_si256();
            for c in 0..2 {
                let ql0 = load256(w, ow + 64 * c);
                let ql1 = load256(w, ow + 64 * c + 32);
                let qh = load256(w, ow + QH + 32 * c);
                // The four runs of 32 levels of this half, unsigned 0..=63.
                let q = [
                    _mm256_or_si256(
                        _mm256_and_si256(ql0, m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(ql1, m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2)),
                    ),
                ];
                let half = half_scales(sc16, c);
                for (k, qk) in q.iter().enumerate() {
                    let y = load256(x, ox + q8_k::QS + 128 * c + 32 * k);
                    v = _mm256_add_epi32(
                        v,
                        dot_u8i8_scaled(*qk, y, _mm256_shuffle_epi8(half, pick[k])),
                    );
                }
            }
            // The -32 offset: sum_j scale_j * 32 * bsum_j.
            let offs = hsum_i32(_mm256_madd_epi16(load256(x, ox + q8_k::BSUMS), sc16));
            let sumi = hsum_i32(v) - 32 * offs;
            let (_, d) = f16_pair(ld_u32(w, ow + D - 2));
            acc += ld_f32(x, ox) * d * sumi as f32;
        }
    }
    acc
}

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, bit for
/// bit, four rows at a time with AVX2: the rows' integer sums (the -32
/// offset folded in lane-wise, exact in wrapping arithmetic) reduced
/// together, and `acc += (dx * d) * sumi` with rows as vector lanes.
///
/// # Safety
/// AVX2 + FMA + F16C; `x` is whole superblocks and `w` is `out.len()` rows of
/// as many superblocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows_avx2(w: &[u8], x: &[u8], out: &mut [f32]) {
    let rb = x.len() / q8_k::BYTES * BYTES;
    debug_assert_eq!(w.len(), out.len() * rb);
    // SAFETY: rows r.. of `w` exist for every r < out.len() (caller's lengths).
    unsafe { row_groups!(rows_avx2, w, rb, x, out) }
}

/// `R <= 4` rows starting at byte `o0` of `w`, `rb` bytes each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_avx2<const R: usize>(w: &[u8], o0: usize, rb: usize, x: &[u8], out: &mut [f32]) {
    use crate::simd::*;
    use std::arch::x86_64::*;
    let nb = rb / BYTES;
    // SAFETY: the caller has the CPU features; every load lies in superblock i
    // of rows 0..R of `w` (from o0) or of `x`, which are whole superblocks.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let m2 = _mm256_set1_epi8(0x03);
        let pick = pair_shuffles();
        let mut acc = _mm_setzero_ps();
        for i in 0..nb {
            let ox = i * q8_k::BYTES;
            if R == 4 {
                prefetch_lines::<false>(w, o0 + prefetch_ahead(rb) + i * 4 * BYTES, (4 * BYTES).div_ceil(64) + 1);
            }
            let bs = load256(x, ox + q8_k::BSUMS);
            let mut v = [_mm256_setzero_si256(); 4];
            let mut d = [0f32; 4];
            for r in 0..R {
                let ow = o0 + r * rb + i * BYTES;
                let sc16 = _mm256_cvtepi8_epi16(load128(w, ow + SC));
                // The -32 offset, lane-wise: sum_j scale_j * 32 * bsum_j.
                let mut vr = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, sc16)));
                for c in 0..2 {
                    let ql0 = load256(w, ow + 64 * c);
                    let ql1 = load256(w, ow + 64 * c + 32);
                    let qh = load256(w, ow + QH + 32 * c);
                    // As `dot_avx2`: the four runs of 32 levels, unsigned 0..=63.
                    let q = [
                        _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2))),
                        _mm256_or_si256(
                            _mm256_and_si256(ql1, m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2)),
                        ),
                    ];
                    let half = half_scales(sc16, c);
                    for (k, qk) in q.iter().enumerate() {
                        let y = load256(x, ox + q8_k::QS + 128 * c + 32 * k);
                        vr = _mm256_add_epi32(vr, dot_u8i8_scaled(*qk, y, _mm256_shuffle_epi8(half, pick[k])));
                    }
                }
                v[r] = vr;
                d[r] = f16_pair(ld_u32(w, ow + D - 2)).1;
            }
            // sumi of the rows, row r in lane r.
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let sumi = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let dx = _mm_set1_ps(ld_f32(x, ox));
            // The scalar `dx * d * sumi`, then `acc +=`.
            let dv = _mm_loadu_ps(d.as_ptr());
            acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(dx, dv), _mm_cvtepi32_ps(sumi)));
        }
        store_lanes(acc, out);
    }
}
