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

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, bit for
/// bit, four rows at a time (as `q2_k::dot_rows_avx512`): activations loaded
/// once per superblock for the four rows, the 6-bit scales and mins of the
/// four unpacked together, integer sums reduced for the four at once, and
/// the scalar's float expression with rows as vector lanes.
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
        let m4 = _mm512_set1_epi8(0x0f);
        // Nibble vectors k = lo(qs[0..64]), hi(..), lo(qs[64..128]), hi(..)
        // hold sub-blocks j and j + 2 (j = 0, 1, 4, 5) in their low / high 256
        // bits. The dots of k = 2h and 2h + 1 are packed to words (`vpackssdw`:
        // lane words 0-3 from the first, 4-7 from the second) and scaled by
        // `vpdpwssd`; `pick[h]` puts each word's scale byte (bytes 0-7 of a
        // lane hold sc0-7) in the word's low byte.
        let pick: [__m512i; 2] = std::array::from_fn(|h| {
            let mut v = [-1i8; 64];
            for wd in 0..32 {
                let (lane, k) = (wd / 8, 2 * h + wd % 8 / 4);
                v[2 * wd] = ([0, 1, 4, 5][k] + 2 * (lane / 2)) as i8;
            }
            _mm512_loadu_si512(v.as_ptr() as *const __m512i)
        });
        // Mins (bytes 8-15 of a lane) to words.
        let min_words = _mm512_broadcast_i32x4(_mm_setr_epi8(
            8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1,
        ));
        // Scale unpacking per lane (dwords u0 u1 u2 of the 12 bytes), see
        // `scales_mins`: out dwords [sc0-3, sc4-7, m0-3, m4-7].
        let lo_shift = _mm512_set_epi32(4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0);
        let lo_mask = _mm512_set4_epi32(0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f);
        let hi_mask = _mm512_set4_epi32(0x3030_3030, 0, 0x3030_3030, 0);
        let split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm_setzero_ps();
        for i in 0..nb {
            let ox = i * q8_k::BYTES + q8_k::QS;
            // Activations in the nibble vectors' order.
            let y: [__m512i; 4] = std::array::from_fn(|k| {
                let o = ox + 128 * (k / 2) + 32 * (k % 2);
                join256(load256(x, o), load256(x, o + 64))
            });
            // Sums of the sixteen-value pairs (one per sub-block) as words in every lane.
            let bs = _mm256_madd_epi16(load256(x, i * q8_k::BYTES + q8_k::BSUMS), ones);
            let pair_sums = _mm512_broadcast_i32x4(_mm256_cvtepi32_epi16(bs));
            if R == 4 {
                // To L2: prefetched to L1, two threads streamed a 65536 x 2048
                // matrix from DRAM at 18 GiB/s; to L2, at 28.
                prefetch_lines::<false>(
                    w,
                    o0 + prefetch_ahead(rb) + i * 4 * BYTES,
                    (4 * BYTES).div_ceil(64) + 1,
                );
            }
            // Lane r: row r's 12 scale bytes (and 4 bytes of qs, unused).
            let mut s4 = zero;
            let mut dd = [0u32; 4];
            for r in 0..R {
                let ow = o0 + r * rb + i * BYTES;
                s4 = _mm512_mask_broadcast_i32x4(s4, 0xf << (4 * r), load128(w, ow + 4));
                dd[r] = ld_u32(w, ow);
            }
            let a = _mm512_shuffle_epi32::<0b10_01_10_00>(s4);
            let b = _mm512_shuffle_epi32::<0b01_01_00_00>(s4);
            let sm = _mm512_ternarylogic_epi32::<0xEA>(
                _mm512_srli_epi32::<2>(b),
                hi_mask,
                _mm512_and_si512(_mm512_srlv_epi32(a, lo_shift), lo_mask),
            );
            // Lane r: row r's m_j * pair_sum_j, four dwords.
            let mins = _mm512_madd_epi16(_mm512_shuffle_epi8(sm, min_words), pair_sums);
            let mut v = [zero; 4];
            for r in 0..R {
                let ow = o0 + r * rb + i * BYTES;
                let q = [load512(w, ow + 16), load512(w, ow + 80)];
                let sc = match r {
                    0 => _mm512_shuffle_i32x4::<0b00_00_00_00>(sm, sm),
                    1 => _mm512_shuffle_i32x4::<0b01_01_01_01>(sm, sm),
                    2 => _mm512_shuffle_i32x4::<0b10_10_10_10>(sm, sm),
                    _ => _mm512_shuffle_i32x4::<0b11_11_11_11>(sm, sm),
                };
                let nib = [
                    _mm512_and_si512(q[0], m4),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q[0]), m4),
                    _mm512_and_si512(q[1], m4),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(q[1]), m4),
                ];
                // Each dpbusd lane is at most 4 * 15 * 127: its words pack
                // without saturating.
                let p: [__m512i; 4] =
                    std::array::from_fn(|k| _mm512_dpbusd_epi32(zero, nib[k], y[k]));
                for h in 0..2 {
                    let pw = _mm512_packs_epi32(p[2 * h], p[2 * h + 1]);
                    v[r] = _mm512_dpwssd_epi32(v[r], pw, _mm512_shuffle_epi8(sc, pick[h]));
                }
            }
            // sumi: rows as the lanes of each 128-bit lane, then the four summed.
            let c = reduce4_lanes(&v);
            let c = _mm512_add_epi32(c, _mm512_shuffle_i64x2::<0b01_00_11_10>(c, c));
            let sumi = _mm_add_epi32(_mm512_castsi512_si128(c), _mm512_extracti32x4_epi32::<1>(c));
            // summ: each lane's four dwords summed, lane r to dword r.
            let t = _mm512_add_epi32(mins, _mm512_shuffle_epi32::<0b01_00_11_10>(mins));
            let t = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0b10_11_00_01>(t));
            let summ = _mm512_castsi512_si128(_mm512_permutexvar_epi32(
                _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0),
                t,
            ));
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

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, bit for
/// bit, four rows at a time with AVX2 (the machines without AVX-512): each
/// superblock's activations and pair sums are read once for the four rows,
/// the scales and mins unpacked with vector shifts instead of per-byte
/// scalar code, the integer sums of the four rows reduced together, and the
/// scalar's float expression formed with rows as vector lanes.
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
        // Dwords [u0, u2, u1, u2] and [u0, u0, u1, u1] of the 12 scale bytes
        // give [sc0-3, sc4-7, m0-3, m4-7] (see `scales_mins`).
        let lo_shift = _mm_setr_epi32(0, 0, 0, 4);
        let lo_mask = _mm_setr_epi32(0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f);
        let hi_mask = _mm_setr_epi32(0, 0x3030_3030, 0, 0x3030_3030);
        // Word j of every 128-bit lane to all eight words of the lane.
        let bcast: [__m256i; 8] = std::array::from_fn(|j| {
            let b = (2 * j) as i8;
            _mm256_set1_epi16(i16::from_le_bytes([b as u8, b as u8 + 1]))
        });
        let split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        let mut acc = _mm_setzero_ps();
        for i in 0..nb {
            let ox = i * q8_k::BYTES;
            // The sixteen-value pair sums (one per sub-block) as eight words:
            // each is at most 32 * 127 in magnitude, so the words are exact.
            let bs = load256(x, ox + q8_k::BSUMS);
            let pair_sums = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
            if R == 4 {
                // To L2, as `rows_avx512` (the DRAM stream of a decode matmul).
                prefetch_lines::<false>(w, o0 + prefetch_ahead(rb) + i * 4 * BYTES, (4 * BYTES).div_ceil(64) + 1);
            }
            let mut v = [_mm256_setzero_si256(); 4];
            let mut mins = [_mm_setzero_si128(); 4];
            let mut dd = [0u32; 4];
            for r in 0..R {
                let ow = o0 + r * rb + i * BYTES;
                dd[r] = ld_u32(w, ow);
                let s = load128(w, ow + 4);
                let a = _mm_shuffle_epi32::<0b10_01_10_00>(s);
                let b = _mm_shuffle_epi32::<0b01_01_00_00>(s);
                let sm = _mm_or_si128(
                    _mm_and_si128(_mm_srlv_epi32(a, lo_shift), lo_mask),
                    _mm_and_si128(_mm_srli_epi32::<2>(b), hi_mask),
                );
                // m_j * pair_sum_j, four dwords whose sum is the scalar `summ`.
                mins[r] = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128::<8>(sm)), pair_sums);
                let sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
                for c in 0..4 {
                    let q = load256(w, ow + 16 + 32 * c);
                    let lo = _mm256_and_si256(q, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                    let y = ox + q8_k::QS + 64 * c;
                    // Each word is at most 2 * 15 * 127: no saturation.
                    let p1 = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(lo, load256(x, y)),
                        _mm256_shuffle_epi8(sc, bcast[2 * c]),
                    );
                    let p2 = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(hi, load256(x, y + 32)),
                        _mm256_shuffle_epi8(sc, bcast[2 * c + 1]),
                    );
                    v[r] = _mm256_add_epi32(v[r], _mm256_add_epi32(p1, p2));
                }
            }
            // sumi and summ of the rows, row r in lane r (exact integer sums).
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let sumi = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            let summ = _mm_hadd_epi32(_mm_hadd_epi32(mins[0], mins[1]), _mm_hadd_epi32(mins[2], mins[3]));
            // d (low half of each u32) and dmin (high) of the rows, as f32.
            let hd = _mm_set_epi32(dd[3] as i32, dd[2] as i32, dd[1] as i32, dd[0] as i32);
            let f = _mm256_cvtph_ps(_mm_shuffle_epi8(hd, split));
            let (d, dmin) = (_mm256_castps256_ps128(f), _mm256_extractf128_ps::<1>(f));
            let dx = _mm_set1_ps(ld_f32(x, ox));
            // The scalar `dx * d * sumi - dx * dmin * summ`, then `acc +=`.
            let a = _mm_mul_ps(_mm_mul_ps(dx, d), _mm_cvtepi32_ps(sumi));
            let b = _mm_mul_ps(_mm_mul_ps(dx, dmin), _mm_cvtepi32_ps(summ));
            acc = _mm_add_ps(acc, _mm_sub_ps(a, b));
        }
        store_lanes(acc, out);
    }
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
