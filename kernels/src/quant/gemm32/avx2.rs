//! The 32-value block GEMM of [`super`] at 256 bits, for CPUs with AVX2 but
//! no AVX-512: groups of eight rows (the lanes of an f32 `__m256`), and
//! `vpmaddubsw` + `vpmaddwd` in place of `vpdpbusd`.
//!
//! Exactness is [`super`]'s: exact integer block sums, the block value
//! `(d_w * d_x) * s` (plus `(m_w * d_x) * sy`) with separate `mul`/`add`,
//! one f32 accumulator per (row, token) taking the blocks in order. What is
//! new is keeping `vpmaddubsw` exact: it adds two u8 x i8 products into a
//! saturating i16. q8_0 activations are -127..=127, so
//! - q4_0 / q4_1 (unsigned levels 0..=15): a pair is at most 2 * 15 * 127 =
//!   3810; eight of them (a whole block's vectors) sum to at most 30480,
//!   so the i16 sums of a block's eight `vpmaddubsw` are exact;
//! - q5_0 / q5_1 (0..=31): a pair is at most 7874; four sum to 31496, so
//!   the block is summed in i16 as two halves of four;
//! - q8_0 (signed -128..=127): the sign trick, `|w|` times `y` with `w`'s
//!   sign (`|w| <= 128`: a pair is at most 2 * 128 * 127 = 32512), each
//!   `vpmaddubsw` widened to i32 at once.
//!
//! Repacked layout, per group of 8 rows and per block: eight 32-byte
//! vectors, vector c lane j holding bytes `4c..4c+4` of row j's levels
//! (unsigned `q + offset`, except q8_0: its signed quants), then the 8 rows'
//! `d` as f32, then (formats with a min) the 8 rows' `m`.

use std::arch::x86_64::*;

use super::{ActSums, Fmt, Kind};
use crate::quant::q8_0;
use crate::simd::*;

/// Rows per repacked group (the lanes of a 256-bit f32 vector).
pub(crate) const GROUP: usize = 8;
/// Tokens dotted against one load of a block's weight vectors.
const TOKENS: usize = 4;

impl Fmt {
    /// Bytes of one repacked block of a group of 8.
    fn packed8(&self) -> usize {
        8 * 32 + 32 + if self.mins { 32 } else { 0 }
    }

    /// The level offset the 256-bit kernel subtracts (q8_0 stays signed).
    fn offset8(&self) -> i32 {
        if self.kind == Kind::Q8_0 {
            0
        } else {
            self.offset
        }
    }

    /// `vpmaddubsw` results summed in i16 before widening (see the module docs).
    fn i16_run(&self) -> usize {
        match self.kind {
            Kind::Q8_0 => 1,
            Kind::Q4_0 | Kind::Q4_1 => 8,
            Kind::Q5_0 | Kind::Q5_1 => 4,
        }
    }

    /// The 32 levels of the block at `w[ow..]`: unsigned `q + offset`, or
    /// q8_0's signed quants.
    ///
    /// # Safety
    /// AVX2; the block lies inside `w`.
    #[inline(always)]
    unsafe fn levels8(&self, w: &[u8], ow: usize) -> __m256i {
        unsafe {
            let five = |qs: usize, qh: usize| {
                let hi = _mm256_and_si256(bytes_from_bits(ld_u32(w, ow + qh)), _mm256_set1_epi8(0x10));
                _mm256_or_si256(nibbles_lo_hi(load128(w, ow + qs)), hi)
            };
            match self.kind {
                Kind::Q8_0 => load256(w, ow + 2),
                Kind::Q4_0 => nibbles_lo_hi(load128(w, ow + 2)),
                Kind::Q4_1 => nibbles_lo_hi(load128(w, ow + 4)),
                Kind::Q5_0 => five(6, 2),
                Kind::Q5_1 => five(8, 4),
            }
        }
    }
}

/// The 8 x 8 transpose of i32 lanes: lane j of result c is lane c of `r[j]`.
#[inline(always)]
pub(crate) unsafe fn transpose8(r: &[__m256i; 8]) -> [__m256i; 8] {
    unsafe {
        let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
        let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
        let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
        let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
        let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
        let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
        let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
        let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
        // u0: lane 0 of rows 0-3 | lane 4 of rows 0-3; u1: 1 | 5; u2: 2 | 6; u3: 3 | 7.
        let u0 = _mm256_unpacklo_epi64(t0, t2);
        let u1 = _mm256_unpackhi_epi64(t0, t2);
        let u2 = _mm256_unpacklo_epi64(t1, t3);
        let u3 = _mm256_unpackhi_epi64(t1, t3);
        let u4 = _mm256_unpacklo_epi64(t4, t6);
        let u5 = _mm256_unpackhi_epi64(t4, t6);
        let u6 = _mm256_unpacklo_epi64(t5, t7);
        let u7 = _mm256_unpackhi_epi64(t5, t7);
        [
            _mm256_permute2x128_si256::<0x20>(u0, u4),
            _mm256_permute2x128_si256::<0x20>(u1, u5),
            _mm256_permute2x128_si256::<0x20>(u2, u6),
            _mm256_permute2x128_si256::<0x20>(u3, u7),
            _mm256_permute2x128_si256::<0x31>(u0, u4),
            _mm256_permute2x128_si256::<0x31>(u1, u5),
            _mm256_permute2x128_si256::<0x31>(u2, u6),
            _mm256_permute2x128_si256::<0x31>(u3, u7),
        ]
    }
}

/// The first `out.len() <= 8` lanes of `v` stored to `out`.
#[inline(always)]
pub(crate) unsafe fn store8(v: __m256, out: &mut [f32]) {
    unsafe {
        if out.len() == 8 {
            _mm256_storeu_ps(out.as_mut_ptr(), v);
        } else {
            let mut a = [0f32; 8];
            _mm256_storeu_ps(a.as_mut_ptr(), v);
            out.copy_from_slice(&a[..out.len()]);
        }
    }
}

/// Repack `n_rows` rows of `fmt` (`rb` bytes each) into `out`, in groups of
/// 8 (rows past the end are zero and their lanes unused).
///
/// # Safety
/// AVX2 + FMA + F16C; `w` holds `n_rows` rows of `rb` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn repack(fmt: Fmt, w: &[u8], n_rows: usize, rb: usize, out: &mut Vec<u8>) {
    let nb = rb / fmt.bytes;
    let groups = n_rows.div_ceil(GROUP);
    let pb = fmt.packed8();
    out.clear();
    out.resize(groups * nb * pb, 0);
    for g in 0..groups {
        let rows = (n_rows - g * GROUP).min(GROUP);
        for b in 0..nb {
            let o = (g * nb + b) * pb;
            let dst = &mut out[o..o + pb];
            let mut lv = [_mm256_setzero_si256(); GROUP];
            for (j, l) in lv.iter_mut().enumerate().take(rows) {
                let ow = (g * GROUP + j) * rb + b * fmt.bytes;
                // SAFETY: the block lies inside row g*8+j of `w`.
                *l = unsafe { fmt.levels8(w, ow) };
                let d = super::super::rd_f16(&w[ow..], 0);
                dst[256 + 4 * j..260 + 4 * j].copy_from_slice(&d.to_le_bytes());
                if fmt.mins {
                    let m = super::super::rd_f16(&w[ow..], 2);
                    dst[288 + 4 * j..292 + 4 * j].copy_from_slice(&m.to_le_bytes());
                }
            }
            // SAFETY: the eight stores lie in the first 256 bytes of `dst`.
            unsafe {
                for (c, v) in transpose8(&lv).iter().enumerate() {
                    _mm256_storeu_si256(dst.as_mut_ptr().add(32 * c) as *mut __m256i, *v);
                }
            }
        }
    }
}

/// `outs[t][r] = dot(row r, token t)` for the rows repacked by [`repack`] in
/// `packed` (the first `outs[t].len()`) and the q8_0 token rows `xs` of `nb`
/// blocks with their [`ActSums`] (token t's at index t).
///
/// # Safety
/// AVX2 + FMA + F16C; `packed` is [`repack`]'s output for at least
/// `outs[t].len()` rows of `nb` blocks; every `xs[t]` holds `nb` blocks of
/// quants in -127..=127 (as every q8_0 activation row).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn gemm(fmt: Fmt, packed: &[u8], nb: usize, xs: &[&[u8]], sums: &ActSums, outs: &mut [&mut [f32]]) {
    let n_rows = outs.first().map_or(0, |o| o.len());
    // SAFETY: as the caller promises; each call stays in its tokens and groups.
    unsafe {
        for g in 0..n_rows.div_ceil(GROUP) {
            let mut t0 = 0;
            while t0 < xs.len() {
                let n = (xs.len() - t0).min(TOKENS);
                let o = &mut outs[t0..t0 + n];
                let x = &xs[t0..t0 + n];
                match (fmt.i16_run(), n) {
                    (1, 4) => group::<4, 1>(fmt, packed, nb, g, x, t0, sums, o),
                    (1, 3) => group::<3, 1>(fmt, packed, nb, g, x, t0, sums, o),
                    (1, 2) => group::<2, 1>(fmt, packed, nb, g, x, t0, sums, o),
                    (1, _) => group::<1, 1>(fmt, packed, nb, g, x, t0, sums, o),
                    (4, 4) => group::<4, 4>(fmt, packed, nb, g, x, t0, sums, o),
                    (4, 3) => group::<3, 4>(fmt, packed, nb, g, x, t0, sums, o),
                    (4, 2) => group::<2, 4>(fmt, packed, nb, g, x, t0, sums, o),
                    (4, _) => group::<1, 4>(fmt, packed, nb, g, x, t0, sums, o),
                    (_, 4) => group::<4, 8>(fmt, packed, nb, g, x, t0, sums, o),
                    (_, 3) => group::<3, 8>(fmt, packed, nb, g, x, t0, sums, o),
                    (_, 2) => group::<2, 8>(fmt, packed, nb, g, x, t0, sums, o),
                    (_, _) => group::<1, 8>(fmt, packed, nb, g, x, t0, sums, o),
                }
                t0 += n;
            }
        }
    }
}

/// Group `g` of 8 rows against the `T` tokens `xs` (token indices `t0..`);
/// `K` `vpmaddubsw` results are summed in i16 before widening (1: q8_0's
/// sign trick).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn group<const T: usize, const K: usize>(
    fmt: Fmt,
    packed: &[u8],
    nb: usize,
    g: usize,
    xs: &[&[u8]],
    t0: usize,
    sums: &ActSums,
    outs: &mut [&mut [f32]],
) {
    let pb = fmt.packed8();
    let offset = fmt.offset8();
    // SAFETY: every load lies in group g's repacked blocks or in block b of a
    // token's row (its quants at bytes 2..34).
    unsafe {
        let zero = _mm256_setzero_si256();
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..nb {
            let o = (g * nb + b) * pb;
            let ox = b * q8_0::BYTES + 2;
            let (mut s, mut h) = ([zero; T], [zero; T]);
            for c in 0..8 {
                let w = load256(packed, o + 32 * c);
                // q8_0: |w| against y with w's sign (exact, see the module docs).
                let aw = if K == 1 { _mm256_sign_epi8(w, w) } else { w };
                for t in 0..T {
                    let mut y = _mm256_set1_epi32(ld_u32(xs[t], ox + 4 * c) as i32);
                    if K == 1 {
                        y = _mm256_sign_epi8(y, w);
                    }
                    let p = _mm256_maddubs_epi16(aw, y);
                    h[t] = if c % K == 0 { p } else { _mm256_add_epi16(h[t], p) };
                    if c % K == K - 1 {
                        s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(h[t], ones));
                    }
                }
            }
            let dw = _mm256_loadu_ps(packed.as_ptr().add(o + 256) as *const f32);
            for t in 0..T {
                let k = (t0 + t) * nb + b;
                let sy = sums.sy[k];
                let mut st = s[t];
                if offset != 0 {
                    st = _mm256_sub_epi32(st, _mm256_set1_epi32(offset * sy));
                }
                let dx = _mm256_set1_ps(sums.dx[k]);
                let mut v = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(st));
                if fmt.mins {
                    let mw = _mm256_loadu_ps(packed.as_ptr().add(o + 288) as *const f32);
                    v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_set1_ps(sy as f32)));
                }
                acc[t] = _mm256_add_ps(acc[t], v);
            }
        }
        let r0 = g * GROUP;
        for (t, out) in outs.iter_mut().enumerate() {
            let n = (out.len() - r0).min(GROUP);
            store8(acc[t], &mut out[r0..r0 + n]);
        }
    }
}
