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

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, bit for
/// bit, four rows at a time: each superblock's activations are loaded once
/// for the four, the integer sums stay in vector lanes until one reduction
/// per four rows, and the float expression of [`dot`] runs with the rows as
/// vector lanes (each lane the scalar's operations in its order, no FMA).
/// Levels 0..=3 are the u8 side of `vpdpbusd`.
///
/// # Safety
/// AVX2 + FMA + F16C + AVX-512 F/BW/VL/VNNI; `x` is whole superblocks and
/// `w` is `out.len()` rows of as many superblocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot_rows_avx512(w: &[u8], x: &[u8], out: &mut [f32]) {
    let rb = x.len() / q8_k::BYTES * BYTES;
    debug_assert_eq!(w.len(), out.len() * rb);
    // SAFETY: rows r.. of `w` exist for every r < out.len() (caller's lengths).
    unsafe { row_groups!(rows_avx512, w, rb, x, out) }
}

/// `R <= 4` rows starting at byte `o0` of `w`, `rb` bytes each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_avx512<const R: usize>(w: &[u8], o0: usize, rb: usize, x: &[u8], out: &mut [f32]) {
    use crate::simd::*;
    use std::arch::x86_64::*;
    let nb = rb / BYTES;
    // SAFETY: the caller has the CPU features; every load lies in superblock i
    // of rows 0..R of `w` (from o0) or of `x`, which are whole superblocks.
    unsafe {
        let zero = _mm512_setzero_si512();
        let (m2, m4) = (_mm512_set1_epi8(3), _mm512_set1_epi8(0x0f));
        // Shifted by 2s, the 64 bytes of `qs` are values [32s, 32s + 32) and
        // [128 + 32s, ...): byte b is in run j = 8 (b / 32) + 2s + b % 32 / 16.
        // The dots of s = 2h and 2h + 1 are packed to words (`vpackssdw`:
        // lane words 0-3 from the first, 4-7 from the second) and scaled by
        // `vpdpwssd`; `pick[h]` puts each word's scale j in its low byte.
        let run = |s: usize, b: usize| 8 * (b / 32) + 2 * s + b % 32 / 16;
        let pick: [__m512i; 2] = std::array::from_fn(|h| {
            let mut v = [-1i8; 64];
            for wd in 0..32 {
                // Word wd packs dword 4 (wd / 8) + wd % 4 of the dot of s.
                let s = 2 * h + wd % 8 / 4;
                v[2 * wd] = run(s, 16 * (wd / 8)) as i8;
            }
            _mm512_loadu_si512(v.as_ptr() as *const __m512i)
        });
        // d (low half of each u32) and dmin (high) -> [d0 d1 d2 d3 m0 m1 m2 m3].
        let split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        let mut acc = _mm_setzero_ps();
        for i in 0..nb {
            let ox = i * q8_k::BYTES + q8_k::QS;
            let y: [__m512i; 4] = std::array::from_fn(|s| {
                join256(load256(x, ox + 32 * s), load256(x, ox + 128 + 32 * s))
            });
            let bsums = load256(x, i * q8_k::BYTES + q8_k::BSUMS);
            if R == 4 {
                prefetch_lines::<true>(
                    w,
                    o0 + prefetch_ahead(rb) + i * 4 * BYTES,
                    (4 * BYTES).div_ceil(64) + 1,
                );
            }
            // Per row: sumi's sixteen lanes folded to eight; per pair of rows:
            // summ's m_j * bsum_j, eight lanes a row.
            let (mut s8, mut sbs) = ([_mm256_setzero_si256(); 4], [_mm_setzero_si128(); 4]);
            let mut dd = [0u32; 4];
            for r in 0..R {
                let ow = o0 + r * rb + i * BYTES;
                let q = load512(w, ow + QS);
                sbs[r] = load128(w, ow);
                let sc = _mm512_and_si512(_mm512_broadcast_i32x4(sbs[r]), m4);
                let lv = [
                    _mm512_and_si512(q, m2),
                    _mm512_and_si512(_mm512_srli_epi16::<2>(q), m2),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q), m2),
                    _mm512_and_si512(_mm512_srli_epi16::<6>(q), m2),
                ];
                // Each dpbusd lane is at most 4 * 3 * 127 in magnitude: its
                // words pack without saturating.
                let p: [__m512i; 4] =
                    std::array::from_fn(|s| _mm512_dpbusd_epi32(zero, lv[s], y[s]));
                let mut v = zero;
                for h in 0..2 {
                    let pw = _mm512_packs_epi32(p[2 * h], p[2 * h + 1]);
                    v = _mm512_dpwssd_epi32(v, pw, _mm512_shuffle_epi8(sc, pick[h]));
                }
                s8[r] =
                    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
                dd[r] = ld_u32(w, ow + D);
            }
            let bs2 = join256(bsums, bsums);
            let mins = |a: __m128i, b: __m128i| {
                let m = _mm256_and_si256(
                    _mm256_srli_epi16::<4>(_mm256_set_m128i(b, a)),
                    _mm256_set1_epi8(0x0f),
                );
                _mm512_madd_epi16(_mm512_cvtepu8_epi16(m), bs2)
            };
            let (m01, m23) = (
                mins(sbs[0], sbs[1]),
                if R > 2 { mins(sbs[2], sbs[3]) } else { zero },
            );
            let (s01, s23) = (join256(s8[0], s8[1]), join256(s8[2], s8[3]));
            // Lane L of c: [sumi r0|r1, sumi r2|r3, summ r0|r1, summ r2|r3] partials
            // (r0, r2 in lanes 0-1; r1, r3 in lanes 2-3).
            let a = _mm512_add_epi32(
                _mm512_unpacklo_epi32(s01, s23),
                _mm512_unpackhi_epi32(s01, s23),
            );
            let b = _mm512_add_epi32(
                _mm512_unpacklo_epi32(m01, m23),
                _mm512_unpackhi_epi32(m01, m23),
            );
            let c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
            let e = _mm512_add_epi32(c, _mm512_shuffle_i64x2::<0b10_11_00_01>(c, c));
            let (e02, e13) = (_mm512_castsi512_si128(e), _mm512_extracti32x4_epi32::<2>(e));
            let (sumi, summ) = (_mm_unpacklo_epi32(e02, e13), _mm_unpackhi_epi32(e02, e13));
            // d (low half of each u32) and dmin (high) of the rows, as f32.
            let h = _mm_set_epi32(dd[3] as i32, dd[2] as i32, dd[1] as i32, dd[0] as i32);
            let f = _mm256_cvtph_ps(_mm_shuffle_epi8(h, split));
            let (d, dmin) = (_mm256_castps256_ps128(f), _mm256_extractf128_ps::<1>(f));
            let dx = _mm_set1_ps(ld_f32(x, i * q8_k::BYTES));
            // The scalar `dx * d * sumi - dx * dmin * summ`, then `acc +=`.
            let a = _mm_mul_ps(_mm_mul_ps(dx, d), _mm_cvtepi32_ps(sumi));
            let b = _mm_mul_ps(_mm_mul_ps(dx, dmin), _mm_cvtepi32_ps(summ));
            acc = _mm_add_ps(acc, _mm_sub_ps(a, b));
        }
        store_lanes(acc, out);
    }
}
