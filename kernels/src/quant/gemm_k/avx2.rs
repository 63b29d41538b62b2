//! The q4_K / q6_K GEMM of [`super`] at 256 bits, for CPUs with AVX2 but no
//! AVX-512: groups of eight rows, `vpmaddubsw` + `vpmaddwd` in place of
//! `vpdpbusd`.
//!
//! Exactness is [`super`]'s (the reference's integers, exact in any order;
//! its float expression per superblock lane-wise; superblocks in order per
//! (row, token)). `vpmaddubsw` adds two u8 x i8 products into a saturating
//! i16; q8_K quants are -127..=127, so
//! - q4_K (levels 0..=15): a pair is at most 2 * 15 * 127 = 3810, and the
//!   eight `vpmaddubsw` of a 32-value sub-block sum to at most 30480 in i16;
//! - q6_K (levels 0..=63): a pair is at most 16002, so two sum to 32004 and
//!   a 16-value sub-block (four vectors) is summed as two i16 halves.
//!
//! Each i16 sum is then multiplied by its sub-block scale with `vpmaddwd`
//! (row j's scale in both i16 halves of lane j). The reference's other
//! integers come from `vpmaddwd` of per-row i16 pairs with a dword of the
//! token's `bsums` (`(bs_2k, bs_2k+1)`): q4_K's `summ = sum_k m_k (bs_2k +
//! bs_2k+1)` with pairs `(m_k, m_k)`, and q6_K's `32 * sum_j sc_j bs_j`
//! (its level offset) with pairs `(sc_2k, sc_2k+1)`.
//!
//! Repacked layout per group of 8 rows and superblock: 64 vectors of levels
//! (vector c lane j: bytes `4c..4c+4` of row j's 256 unsigned levels), the
//! sub-block scale vectors, the 8 pair vectors, then `d` (and q4_K's
//! `dmin`) as f32 vectors.

use std::arch::x86_64::*;

use super::Fmt;
use crate::quant::gemm32::avx2::{store8, transpose8};
use crate::quant::q8_k;
use crate::simd::*;

/// Rows per repacked group (as gemm32's 256-bit one: matmul sizes tasks by it).
pub(crate) const GROUP: usize = 8;
const _: () = assert!(GROUP == crate::quant::gemm32::avx2::GROUP);
/// Tokens dotted against one load of a sub-block's weight vectors.
const TOKENS: usize = 4;

impl Fmt {
    fn sc8_at(self) -> usize {
        64 * 32
    }
    fn pairs8_at(self) -> usize {
        self.sc8_at() + 32 * self.subs()
    }
    fn d8_at(self) -> usize {
        self.pairs8_at() + 32 * 8
    }
    fn packed8(self) -> usize {
        self.d8_at() + if self.mins() { 64 } else { 32 }
    }
}

/// Two i16 as one little-endian dword `(lo, hi)`.
fn pair(lo: i32, hi: i32) -> [u8; 4] {
    ((lo as u16 as u32) | ((hi as u16 as u32) << 16)).to_le_bytes()
}

/// Repack `n_rows` rows (`rb` bytes, `nb` superblocks each) into `out`, in
/// groups of 8 (missing rows are zero, their lanes unused).
///
/// # Safety
/// AVX2 + FMA + F16C; `w` holds `n_rows` rows of `rb` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn repack(fmt: Fmt, w: &[u8], n_rows: usize, rb: usize, out: &mut Vec<u8>) {
    let nb = rb / fmt.block_bytes();
    let pb = fmt.packed8();
    let groups = n_rows.div_ceil(GROUP);
    out.clear();
    out.resize(groups * nb * pb, 0);
    let mut lv = [[0u8; 256]; GROUP];
    let (mut sc, mut mn) = ([0i32; 16], [0i32; 8]);
    let put = |dst: &mut [u8], at: usize, v: [u8; 4]| dst[at..at + 4].copy_from_slice(&v);
    for g in 0..groups {
        let rows = (n_rows - g * GROUP).min(GROUP);
        for i in 0..nb {
            let dst = &mut out[(g * nb + i) * pb..][..pb];
            for (j, l) in lv.iter_mut().enumerate() {
                if j >= rows {
                    *l = [0; 256];
                    continue;
                }
                let b = &w[(g * GROUP + j) * rb + i * fmt.block_bytes()..][..fmt.block_bytes()];
                let (d, dmin) = fmt.decode(b, l, &mut sc, &mut mn);
                for s in 0..fmt.subs() {
                    put(dst, fmt.sc8_at() + 32 * s + 4 * j, pair(sc[s], sc[s]));
                }
                for k in 0..8 {
                    let p = if fmt.mins() { pair(mn[k], mn[k]) } else { pair(sc[2 * k], sc[2 * k + 1]) };
                    put(dst, fmt.pairs8_at() + 32 * k + 4 * j, p);
                }
                if fmt.mins() {
                    put(dst, fmt.d8_at() + 32 + 4 * j, dmin.to_le_bytes());
                }
                put(dst, fmt.d8_at() + 4 * j, d.to_le_bytes());
            }
            // Eight 8 x 8 dword transposes: vector c gathers dword c of each row.
            // SAFETY: every load lies in `lv`, every store in the 64 level
            // vectors at the start of `dst`.
            unsafe {
                for q in 0..8 {
                    let r: [__m256i; 8] =
                        std::array::from_fn(|j| _mm256_loadu_si256(lv[j].as_ptr().add(32 * q) as *const __m256i));
                    for (c, v) in transpose8(&r).iter().enumerate() {
                        _mm256_storeu_si256(dst.as_mut_ptr().add(32 * (8 * q + c)) as *mut __m256i, *v);
                    }
                }
            }
        }
    }
}

/// `outs[t][r] = dot(row r, token t)` for the rows in `packed` (the first
/// `outs[t].len()`) and the q8_K token rows `xs` of `nb` superblocks.
///
/// # Safety
/// AVX2 + FMA + F16C; `packed` is [`repack`]'s output for at least
/// `outs[t].len()` rows of `nb` superblocks; every `xs[t]` holds `nb`
/// superblocks of quants in -127..=127 (as every q8_K activation row).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemm(fmt: Fmt, packed: &[u8], nb: usize, xs: &[&[u8]], outs: &mut [&mut [f32]]) {
    let n_rows = outs.first().map_or(0, |o| o.len());
    // SAFETY: as the caller promises; each call stays in its tokens and groups.
    unsafe {
        for g in 0..n_rows.div_ceil(GROUP) {
            let mut t0 = 0;
            while t0 < xs.len() {
                let n = (xs.len() - t0).min(TOKENS);
                let o = &mut outs[t0..t0 + n];
                let x = &xs[t0..t0 + n];
                match (fmt, n) {
                    (Fmt::Q4K, 4) => group::<4, false>(fmt, packed, nb, g, x, o),
                    (Fmt::Q4K, 3) => group::<3, false>(fmt, packed, nb, g, x, o),
                    (Fmt::Q4K, 2) => group::<2, false>(fmt, packed, nb, g, x, o),
                    (Fmt::Q4K, _) => group::<1, false>(fmt, packed, nb, g, x, o),
                    (Fmt::Q6K, 4) => group::<4, true>(fmt, packed, nb, g, x, o),
                    (Fmt::Q6K, 3) => group::<3, true>(fmt, packed, nb, g, x, o),
                    (Fmt::Q6K, 2) => group::<2, true>(fmt, packed, nb, g, x, o),
                    (Fmt::Q6K, _) => group::<1, true>(fmt, packed, nb, g, x, o),
                }
                t0 += n;
            }
        }
    }
}

/// Group `g` of 8 rows against `T` tokens; `Q6` picks q6_K over q4_K.
#[inline(always)]
unsafe fn group<const T: usize, const Q6: bool>(
    fmt: Fmt,
    packed: &[u8],
    nb: usize,
    g: usize,
    xs: &[&[u8]],
    outs: &mut [&mut [f32]],
) {
    let pb = fmt.packed8();
    let sub = if Q6 { 16 } else { 32 };
    let words = sub / 4;
    // i16 sums per widening: a q4_K sub-block whole, a q6_K one in halves.
    let run = if Q6 { 2 } else { 8 };
    // SAFETY: every load lies in group g's repacked superblocks or in
    // superblock i of a token's q8_K row.
    unsafe {
        let zero = _mm256_setzero_si256();
        let mut acc = [_mm256_setzero_ps(); T];
        for i in 0..nb {
            let o = (g * nb + i) * pb;
            let ox = i * q8_k::BYTES;
            let mut sumi = [zero; T];
            for s in 0..fmt.subs() {
                let sc = load256(packed, o + fmt.sc8_at() + 32 * s);
                let mut h = [zero; T];
                for c in 0..words {
                    let w = load256(packed, o + 32 * (s * words + c));
                    for t in 0..T {
                        let y = _mm256_set1_epi32(ld_u32(xs[t], ox + q8_k::QS + s * sub + 4 * c) as i32);
                        let p = _mm256_maddubs_epi16(w, y);
                        h[t] = if c % run == 0 { p } else { _mm256_add_epi16(h[t], p) };
                        if c % run == run - 1 {
                            sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(h[t], sc));
                        }
                    }
                }
            }
            let d = _mm256_loadu_ps(packed.as_ptr().add(o + fmt.d8_at()) as *const f32);
            for t in 0..T {
                let x = xs[t];
                let mut pr = zero;
                for k in 0..8 {
                    let bs = _mm256_set1_epi32(ld_u32(x, ox + q8_k::BSUMS + 4 * k) as i32);
                    pr = _mm256_add_epi32(pr, _mm256_madd_epi16(load256(packed, o + fmt.pairs8_at() + 32 * k), bs));
                }
                let dx = _mm256_set1_ps(ld_f32(x, ox));
                if Q6 {
                    // sum_j sc_j * (S_j - 32 bs_j), exact in i32.
                    let si = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32::<5>(pr));
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(dx, d), _mm256_cvtepi32_ps(si)));
                } else {
                    let dmin = _mm256_loadu_ps(packed.as_ptr().add(o + fmt.d8_at() + 32) as *const f32);
                    let v = _mm256_mul_ps(_mm256_mul_ps(dx, d), _mm256_cvtepi32_ps(sumi[t]));
                    let v = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_mul_ps(dx, dmin), _mm256_cvtepi32_ps(pr)));
                    acc[t] = _mm256_add_ps(acc[t], v);
                }
            }
        }
        let r0 = g * GROUP;
        for (t, out) in outs.iter_mut().enumerate() {
            let n = (out.len() - r0).min(GROUP);
            store8(acc[t], &mut out[r0..r0 + n]);
        }
    }
}
