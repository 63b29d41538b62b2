//! Prefill GEMM for the 32-value block formats (q8_0, q4_0, q4_1, q5_0, q5_1
//! against q8_0 activations): a tile of weight rows is decoded and repacked
//! once, then every token of the chunk is dotted against it.
//!
//! Exactness: each output equals the format's scalar `dot` bit for bit. Per
//! block the integer sum `s = sum(q y)` is exact in any order; the block
//! value `(d_w * d_x) * s` (plus `(m_w * d_x) * sy`) is formed with separate
//! vector `mul`/`add` (the reference has no FMA); and each (row, token) has
//! its own f32 accumulator that takes the block values in block order. The
//! lanes of a vector are sixteen rows, so there is no serial chain per row
//! and no horizontal reduction at all.
//!
//! Repacked layout, per group of 16 rows and per block: eight 64-byte
//! vectors, vector c lane j holding bytes `4c..4c+4` of row j's levels as
//! unsigned bytes `q + offset` (`vpdpbusd` multiplies unsigned by signed
//! bytes: `sum((q + o) y) - o * sum(y)` is the signed sum), then the 16
//! rows' `d` as f32, then (formats with a min) the 16 rows' `m`.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use pulsar_gguf::GgmlType;

use super::q8_0;
use crate::simd::*;

pub(crate) mod avx2;

/// Rows per repacked group (the lanes of a 512-bit f32 vector).
pub(crate) const GROUP: usize = 16;
/// Tokens dotted against one load of a block's weight vectors.
const TOKENS: usize = 4;

/// A 32-value block format as the repacker needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fmt {
    bytes: usize,
    /// Added to each level to make it an unsigned byte.
    offset: i32,
    /// The block has an f16 min at byte 2 (value = d * q + m).
    mins: bool,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
}

impl Fmt {
    pub(crate) fn of(ty: GgmlType) -> Option<Fmt> {
        let f = |bytes, offset, mins, kind| Some(Fmt { bytes, offset, mins, kind });
        match ty {
            GgmlType::Q8_0 => f(34, 128, false, Kind::Q8_0),
            GgmlType::Q4_0 => f(18, 8, false, Kind::Q4_0),
            GgmlType::Q4_1 => f(20, 0, true, Kind::Q4_1),
            GgmlType::Q5_0 => f(22, 16, false, Kind::Q5_0),
            GgmlType::Q5_1 => f(24, 0, true, Kind::Q5_1),
            _ => None,
        }
    }

    /// Bytes of one weight block.
    pub(crate) fn block_bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes of one repacked block of a group.
    fn packed(&self) -> usize {
        8 * 64 + 64 + if self.mins { 64 } else { 0 }
    }

    /// The 32 levels of the block at `w[ow..]` as unsigned bytes `q + offset`.
    ///
    /// # Safety
    /// AVX-512 BW/VL; the block lies inside `w`.
    #[inline(always)]
    unsafe fn levels(&self, w: &[u8], ow: usize) -> __m256i {
        unsafe {
            let five = |qs: usize, qh: usize| {
                let hi = _mm256_and_si256(_mm256_movm_epi8(ld_u32(w, ow + qh)), _mm256_set1_epi8(0x10));
                _mm256_or_si256(nibbles_lo_hi(load128(w, ow + qs)), hi)
            };
            match self.kind {
                Kind::Q8_0 => _mm256_xor_si256(load256(w, ow + 2), _mm256_set1_epi8(-128)),
                Kind::Q4_0 => nibbles_lo_hi(load128(w, ow + 2)),
                Kind::Q4_1 => nibbles_lo_hi(load128(w, ow + 4)),
                Kind::Q5_0 => five(6, 2),
                Kind::Q5_1 => five(8, 4),
            }
        }
    }
}

/// Per token and block of the activations: `d_x` and the exact `sum(y)`.
pub(crate) struct ActSums {
    pub(crate) dx: Vec<f32>,
    pub(crate) sy: Vec<i32>,
}

impl ActSums {
    /// For `rows` of q8_0 activations of `nb` blocks each.
    pub(crate) fn new<'a>(rows: impl Iterator<Item = &'a [u8]>, nb: usize) -> ActSums {
        let (mut dx, mut sy) = (Vec::new(), Vec::new());
        for x in rows {
            for b in 0..nb {
                let blk = &x[b * q8_0::BYTES..(b + 1) * q8_0::BYTES];
                dx.push(super::rd_f16(blk, 0));
                sy.push(blk[2..].iter().map(|&y| y as i8 as i32).sum());
            }
        }
        ActSums { dx, sy }
    }
}

/// Repack `n_rows` rows of `fmt` (`rb` bytes each, `nb` blocks) into `out`,
/// in groups of 16 (rows past the end are zero and their lanes unused).
///
/// # Safety
/// AVX-512 F/BW/VL; `w` holds `n_rows` rows of `rb` bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn repack(fmt: Fmt, w: &[u8], n_rows: usize, rb: usize, out: &mut Vec<u8>) {
    let nb = rb / fmt.bytes;
    let groups = n_rows.div_ceil(GROUP);
    let pb = fmt.packed();
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
                // SAFETY: the block lies inside row g*16+j of `w`.
                *l = unsafe { fmt.levels(w, ow) };
                let d = super::rd_f16(&w[ow..], 0);
                dst[512 + 4 * j..516 + 4 * j].copy_from_slice(&d.to_le_bytes());
                if fmt.mins {
                    let m = super::rd_f16(&w[ow..], 2);
                    dst[576 + 4 * j..580 + 4 * j].copy_from_slice(&m.to_le_bytes());
                }
            }
            // The 16 x 8 dword transpose in registers: vector c holds dword c
            // of each row (gathering them from memory cost more than the GEMM
            // of a few tokens).
            // SAFETY: the 8 stores of 64 bytes lie in `dst` (pb >= 512).
            unsafe {
                let r: [__m512i; 8] = std::array::from_fn(|p| join256(lv[p], lv[p + 8]));
                for (c, v) in transpose_16x8(r).into_iter().enumerate() {
                    _mm512_storeu_si512(dst.as_mut_ptr().add(64 * c) as *mut __m512i, v);
                }
            }
        }
    }
}

/// `outs[t][r] = dot(row r, token t)` for the rows repacked in `packed` (the
/// first `outs[t].len()` of them) and the tokens `xs` (q8_0 rows of `nb`
/// blocks) with their [`ActSums`] (token t's at index t).
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI; `packed` is [`repack`]'s output for at least
/// `outs[t].len()` rows of `nb` blocks; every `xs[t]` holds `nb` blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn gemm(
    fmt: Fmt,
    packed: &[u8],
    nb: usize,
    xs: &[&[u8]],
    sums: &ActSums,
    outs: &mut [&mut [f32]],
) {
    let n_rows = outs.first().map_or(0, |o| o.len());
    // One group of rows at a time against every token, so that group's
    // repacked blocks stay in L1/L2 while the tokens pass.
    // SAFETY: as the caller promises; each call stays in its tokens and groups.
    unsafe {
        for g in 0..n_rows.div_ceil(GROUP) {
            let mut t0 = 0;
            while t0 < xs.len() {
                let n = (xs.len() - t0).min(TOKENS);
                let at = |k: usize| (xs[t0 + k], t0 + k);
                match n {
                    4 => group::<4>(fmt, packed, nb, g, [at(0), at(1), at(2), at(3)], sums, &mut outs[t0..t0 + 4]),
                    3 => group::<3>(fmt, packed, nb, g, [at(0), at(1), at(2)], sums, &mut outs[t0..t0 + 3]),
                    2 => group::<2>(fmt, packed, nb, g, [at(0), at(1)], sums, &mut outs[t0..t0 + 2]),
                    _ => group::<1>(fmt, packed, nb, g, [at(0)], sums, &mut outs[t0..t0 + 1]),
                }
                t0 += n;
            }
        }
    }
}

/// Group `g` of 16 rows against `T` tokens.
#[inline(always)]
unsafe fn group<const T: usize>(
    fmt: Fmt,
    packed: &[u8],
    nb: usize,
    g: usize,
    xs: [(&[u8], usize); T],
    sums: &ActSums,
    outs: &mut [&mut [f32]],
) {
    let pb = fmt.packed();
    // SAFETY: every load lies in group g's repacked blocks or in block b of a
    // token's row (its quants at bytes 2..34).
    unsafe {
        let mut acc = [_mm512_setzero_ps(); T];
        for b in 0..nb {
            let o = (g * nb + b) * pb;
            let wv: [__m512i; 8] = std::array::from_fn(|c| load512(packed, o + 64 * c));
            let dw = _mm512_loadu_ps(packed.as_ptr().add(o + 512) as *const f32);
            for (t, &(x, si)) in xs.iter().enumerate() {
                let ox = b * q8_0::BYTES + 2;
                let mut s = _mm512_setzero_si512();
                for (c, w) in wv.iter().enumerate() {
                    s = _mm512_dpbusd_epi32(s, *w, _mm512_set1_epi32(ld_u32(x, ox + 4 * c) as i32));
                }
                let k = si * nb + b;
                let sy = sums.sy[k];
                if fmt.offset != 0 {
                    s = _mm512_sub_epi32(s, _mm512_set1_epi32(fmt.offset * sy));
                }
                let dx = _mm512_set1_ps(sums.dx[k]);
                let mut v = _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(s));
                if fmt.mins {
                    let mw = _mm512_loadu_ps(packed.as_ptr().add(o + 576) as *const f32);
                    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_mul_ps(mw, dx), _mm512_set1_ps(sy as f32)));
                }
                acc[t] = _mm512_add_ps(acc[t], v);
            }
        }
        let r0 = g * GROUP;
        for (t, out) in outs.iter_mut().enumerate() {
            let n = (out.len() - r0).min(GROUP);
            let mask: __mmask16 = if n == GROUP { 0xffff } else { (1u16 << n) - 1 };
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(r0), mask, acc[t]);
        }
    }
}

/// Decode's multi-row dots of the formats without a min (q8_0, q4_0, q5_0):
/// `out[r] = dot(row r, x)` for the rows laid end to end in `w`, four rows
/// at a time, bit for bit the scalar `dot`. Per group of four blocks the
/// activations are loaded once for the four rows, each row's levels come
/// from [`Fmt::levels`] (unsigned, `q + offset`), `c = -offset * sum(y)` per
/// block (shared by the rows) turns `vpdpbusd` into the signed sum, and the
/// integer sums of the four rows are reduced together; the block values
/// `(d_w * d_x) * s` are added in block order with rows as vector lanes.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI; `fmt` has no min; `x` is whole q8_0 blocks and `w`
/// is `out.len()` rows of as many blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot_rows_avx512(fmt: Fmt, w: &[u8], x: &[u8], out: &mut [f32]) {
    debug_assert!(!fmt.mins);
    let rb = x.len() / q8_0::BYTES * fmt.bytes;
    debug_assert_eq!(w.len(), out.len() * rb);
    let mut r = 0;
    // SAFETY: rows r.. of `w` exist for every r < out.len() (caller's lengths).
    unsafe {
        while r + 4 <= out.len() {
            rows::<4>(fmt, w, r * rb, rb, x, &mut out[r..r + 4]);
            r += 4;
        }
        match out.len() - r {
            3 => rows::<3>(fmt, w, r * rb, rb, x, &mut out[r..]),
            2 => rows::<2>(fmt, w, r * rb, rb, x, &mut out[r..]),
            1 => rows::<1>(fmt, w, r * rb, rb, x, &mut out[r..]),
            _ => {}
        }
    }
}

/// `R <= 4` rows from byte `o0` of `w`, `rb` bytes each.
#[inline(always)]
unsafe fn rows<const R: usize>(fmt: Fmt, w: &[u8], o0: usize, rb: usize, x: &[u8], out: &mut [f32]) {
    let nb = rb / fmt.bytes;
    let mut k = 0;
    // SAFETY: groups cover blocks 0..nb of each row, each at most 4 blocks.
    unsafe {
        let mut acc = _mm_setzero_ps();
        while k + 4 <= nb {
            acc = rows_group::<R, 4>(fmt, w, o0, rb, x, k, acc);
            k += 4;
        }
        acc = match nb - k {
            3 => rows_group::<R, 3>(fmt, w, o0, rb, x, k, acc),
            2 => rows_group::<R, 2>(fmt, w, o0, rb, x, k, acc),
            1 => rows_group::<R, 1>(fmt, w, o0, rb, x, k, acc),
            _ => acc,
        };
        store_lanes(acc, out);
    }
}

/// Blocks `k0..k0 + N` (`N <= 4`) of `R <= 4` rows added to `acc` (lane r: row r).
#[inline(always)]
unsafe fn rows_group<const R: usize, const N: usize>(
    fmt: Fmt,
    w: &[u8],
    o0: usize,
    rb: usize,
    x: &[u8],
    k0: usize,
    acc: __m128,
) -> __m128 {
    // SAFETY: the caller has the CPU features; every load lies in blocks
    // k0..k0 + N of rows 0..R of `w` (from o0) or of `x`.
    unsafe {
        let (zero, z256) = (_mm512_setzero_si512(), _mm256_setzero_si256());
        let off = _mm512_set1_epi8(fmt.offset as u8 as i8);
        // Blocks past N are zero on both sides, so their lanes stay zero.
        let act = |k: usize| if k < N { load256(x, (k0 + k) * q8_0::BYTES + 2) } else { z256 };
        let lev = |ow: usize, k: usize| if k < N { fmt.levels(w, ow + k * fmt.bytes) } else { z256 };
        let y = [join256(act(0), act(1)), join256(act(2), act(3))];
        let c = y.map(|y| _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, off, y)));
        if R == 4 {
            prefetch_lines::<false>(w, o0 + prefetch_ahead(rb) + k0 * 4 * fmt.bytes, (16 * fmt.bytes).div_ceil(64) + 1);
        }
        let (mut a, mut b) = ([zero; 4], [zero; 4]);
        let mut dw = [0u16; 16];
        for r in 0..R {
            let ow = o0 + r * rb + k0 * fmt.bytes;
            a[r] = _mm512_dpbusd_epi32(c[0], join256(lev(ow, 0), lev(ow, 1)), y[0]);
            if N > 2 {
                b[r] = _mm512_dpbusd_epi32(c[1], join256(lev(ow, 2), lev(ow, 3)), y[1]);
            }
            for k in 0..N {
                dw[4 * k + r] = ld_u16(w, ow + k * fmt.bytes);
            }
        }
        // 128-bit lane L of `ra`: rows' sums over lane L of a (blocks 0, 1 in
        // lanes 0-1, 2-3); then lane k of `s` = block k, lane r within it = row r.
        let (ra, rb_) = (reduce4_lanes(&a), reduce4_lanes(&b));
        let s = _mm512_add_epi32(
            _mm512_shuffle_i64x2::<0b10_00_10_00>(ra, rb_),
            _mm512_shuffle_i64x2::<0b11_01_11_01>(ra, rb_),
        );
        let mut dxh = [0u16; 8];
        for (k, h) in dxh.iter_mut().enumerate().take(N) {
            *h = ld_u16(x, (k0 + k) * q8_0::BYTES);
        }
        let dx4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadu_si128(dxh.as_ptr() as *const __m128i)));
        let dx = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), dx4);
        let dwf = _mm512_cvtph_ps(_mm256_loadu_si256(dw.as_ptr() as *const __m256i));
        // The scalar `d_w * d_x * s` lane-wise, then the block values in order.
        let v = _mm512_mul_ps(_mm512_mul_ps(dwf, dx), _mm512_cvtepi32_ps(s));
        let mut acc = _mm_add_ps(acc, _mm512_castps512_ps128(v));
        if N > 1 {
            acc = _mm_add_ps(acc, _mm512_extractf32x4_ps::<1>(v));
        }
        if N > 2 {
            acc = _mm_add_ps(acc, _mm512_extractf32x4_ps::<2>(v));
        }
        if N > 3 {
            acc = _mm_add_ps(acc, _mm512_extractf32x4_ps::<3>(v));
        }
        acc
    }
}
