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

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, bit for
/// bit, four rows at a time (as `q2_k::dot_rows_avx512`). Levels 0..=7 (low
/// bits and hmask bit) are the u8 side of `vpdpbusd`; the -4 offset is
/// `4 * sum_j sc_j * bsum_j`, subtracted from the exact integer sum.
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
        let (m2, b2) = (_mm512_set1_epi8(3), _mm512_set1_epi8(4));
        // As in q2_K, byte b of `qs >> 2s` is value 128 (b / 32) + 32 s + b % 32,
        // in run j = 8 (b / 32) + 2s + b % 32 / 16; its hmask bit is bit
        // 4 (b / 32) + s of hmask[b % 32], which a dword rotate moves to bit 2.
        let rot: [__m512i; 4] = std::array::from_fn(|s| {
            let (lo, hi) = (
                (2 - s as i32).rem_euclid(32),
                (-2 - s as i32).rem_euclid(32),
            );
            join256(_mm256_set1_epi32(lo), _mm256_set1_epi32(hi))
        });
        // The dots of s = 2h and 2h + 1 are packed to words (`vpackssdw`:
        // lane words 0-3 from the first, 4-7 from the second) and scaled by
        // `vpdpwssd`; word k of `pick[p][h]` is that word's scale j, as index
        // 16p + j into the words of both rows of a pair.
        let pick: [[__m512i; 2]; 2] = std::array::from_fn(|p| {
            std::array::from_fn(|h| {
                let v: [i16; 32] = std::array::from_fn(|k| {
                    let (lane, s) = (k / 8, 2 * h + k % 8 / 4);
                    (16 * p + 8 * (lane / 2) + 2 * s + lane % 2) as i16
                });
                _mm512_loadu_si512(v.as_ptr() as *const __m512i)
            })
        });
        // Scale unpacking per lane (dwords a0 a1 t of the 12 bytes), as in
        // `dot_avx2`: out dwords [sc0-3, sc4-7, sc8-11, sc12-15], minus 32.
        let lo_shift = _mm512_set4_epi32(4, 4, 0, 0);
        let hi_rot = _mm512_set4_epi32(30, 0, 2, 4);
        let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
        let mut acc = _mm_setzero_ps();
        for i in 0..nb {
            let ox = i * q8_k::BYTES + q8_k::QS;
            let y: [__m512i; 4] = std::array::from_fn(|s| {
                join256(load256(x, ox + 32 * s), load256(x, ox + 128 + 32 * s))
            });
            let bsums = load256(x, i * q8_k::BYTES + q8_k::BSUMS);
            let bs2 = join256(bsums, bsums);
            if R == 4 {
                prefetch_lines::<true>(
                    w,
                    o0 + prefetch_ahead(rb) + i * 4 * BYTES,
                    (4 * BYTES).div_ceil(64) + 1,
                );
            }
            // Lane r: row r's 12 scale bytes (and the f16 d, unused).
            let mut s4 = zero;
            let mut dd = [0u32; 4];
            for r in 0..R {
                let ow = o0 + r * rb + i * BYTES;
                s4 = _mm512_mask_broadcast_i32x4(s4, 0xf << (4 * r), load128(w, ow + SC - 4));
                dd[r] = ld_u32(w, ow + D - 2);
            }
            // The load started 4 bytes early: dwords 1, 2, 3 are a0, a1, t.
            let a = _mm512_shuffle_epi32::<0b10_01_10_01>(s4);
            let t = _mm512_shuffle_epi32::<0b11_11_11_11>(s4);
            let sc8 = _mm512_ternarylogic_epi32::<0xEA>(
                _mm512_rolv_epi32(t, hi_rot),
                m30,
                _mm512_and_si512(_mm512_srlv_epi32(a, lo_shift), m4),
            );
            let sc8 = _mm512_sub_epi8(sc8, _mm512_set1_epi8(32));
            // Both rows of a pair as 32 words, and their sum_j sc_j * bsum_j.
            let sc16 = [
                _mm512_cvtepi8_epi16(_mm512_castsi512_si256(sc8)),
                _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(sc8)),
            ];
            let offs = sc16.map(|s| _mm512_madd_epi16(s, bs2));
            let mut s8 = [_mm256_setzero_si256(); 4];
            for r in 0..R {
                let ow = o0 + r * rb + i * BYTES;
                let q = load512(w, ow + QS);
                let hm = _mm512_broadcast_i64x4(load256(w, ow));
                let lo = [
                    _mm512_and_si512(q, m2),
                    _mm512_and_si512(_mm512_srli_epi16::<2>(q), m2),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q), m2),
                    _mm512_and_si512(_mm512_srli_epi16::<6>(q), m2),
                ];
                // Each dpbusd lane is at most 4 * 7 * 127 in magnitude: its
                // words pack without saturating.
                let p: [__m512i; 4] = std::array::from_fn(|s| {
                    let lv =
                        _mm512_ternarylogic_epi32::<0xEC>(_mm512_rolv_epi32(hm, rot[s]), lo[s], b2);
                    _mm512_dpbusd_epi32(zero, lv, y[s])
                });
                let mut v = zero;
                for h in 0..2 {
                    let sc = _mm512_permutexvar_epi16(pick[r % 2][h], sc16[r / 2]);
                    v = _mm512_dpwssd_epi32(v, _mm512_packs_epi32(p[2 * h], p[2 * h + 1]), sc);
                }
                s8[r] =
                    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
            }
            let (s01, s23) = (join256(s8[0], s8[1]), join256(s8[2], s8[3]));
            // Lane L of c: [sums r0|r1, sums r2|r3, offs r0|r1, offs r2|r3]
            // partials (r0, r2 in lanes 0-1; r1, r3 in lanes 2-3), as in q2_K.
            let a = _mm512_add_epi32(
                _mm512_unpacklo_epi32(s01, s23),
                _mm512_unpackhi_epi32(s01, s23),
            );
            let b = _mm512_add_epi32(
                _mm512_unpacklo_epi32(offs[0], offs[1]),
                _mm512_unpackhi_epi32(offs[0], offs[1]),
            );
            let c = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
            let e = _mm512_add_epi32(c, _mm512_shuffle_i64x2::<0b10_11_00_01>(c, c));
            let (e02, e13) = (_mm512_castsi512_si128(e), _mm512_extracti32x4_epi32::<2>(e));
            let (sums, offs) = (_mm_unpacklo_epi32(e02, e13), _mm_unpackhi_epi32(e02, e13));
            let sumi = _mm_sub_epi32(sums, _mm_slli_epi32::<2>(offs));
            // d: the high half of each u32.
            let h = _mm_set_epi32(dd[3] as i32, dd[2] as i32, dd[1] as i32, dd[0] as i32);
            let d = _mm_cvtph_ps(_mm_shuffle_epi8(
                h,
                _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1),
            ));
            let dx = _mm_set1_ps(ld_f32(x, i * q8_k::BYTES));
            // The scalar `dx * d * sumi`, then `acc +=`.
            acc = _mm_add_ps(acc, _mm_mul_ps(_mm_mul_ps(dx, d), _mm_cvtepi32_ps(sumi)));
        }
        store_lanes(acc, out);
    }
}
