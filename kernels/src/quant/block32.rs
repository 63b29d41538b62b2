//! The SIMD driver shared by the 32-value block dots (q8_0, q4_0, q4_1, q5_0,
//! q5_1 against q8_0 activations).
//!
//! The result must equal the scalar reference `dot` of each format bit for
//! bit, because that reference is also what the CUDA kernels reproduce: per
//! block, the exact integer sums (`s = sum(q y)`, and `sy = sum(y)` for the
//! formats with a min), the block value `(d_w * d_x) * s` (plus
//! `(m_w * d_x) * sy`), each `*` and `+` rounded on its own, and one f32
//! accumulator that takes the block values in block order.
//!
//! Fast and still exact: eight blocks at a time, the `vpdpbusd` lanes of each
//! block are reduced in integer arithmetic (exact in any order) into one
//! vector of eight block sums; the block values are formed lane-wise with
//! vector `mul`/`add` (which round exactly like the scalar operations; no FMA,
//! the reference has none); only the final adds into the accumulator run one
//! lane at a time, in block order.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use super::q8_0;
use crate::simd::*;

/// One 32-value block format's layout, as the driver needs it.
pub(crate) trait Block32 {
    /// Bytes of one weight block; its f16 `d` sits at byte 0.
    const BYTES: usize;
    /// Whether a block has an f16 min `m` at byte 2 (value = d * q + m).
    const MINS: bool;
    /// The products of the block at `w[ow..]` with the 32 activation quants
    /// `y`, as eight i32 lanes whose sum is the reference's `s = sum(q y)`.
    ///
    /// # Safety
    /// The CPU has the features of `D`; the block lies inside `w`.
    unsafe fn ints<D: U8I8Dot>(w: &[u8], ow: usize, y: __m256i) -> __m256i;
}

/// A format without a min whose block is `d` and 32 signed levels: it
/// converts to q8_0 exactly.
pub(crate) trait SignedLevels: Block32 {
    /// The 32 levels of the block at `w[ow..]` as signed bytes.
    ///
    /// # Safety
    /// AVX2; the block lies inside `w`.
    unsafe fn level_bytes(w: &[u8], ow: usize) -> __m256i;
}

/// The blocks of `src` as q8_0 blocks in `dst` (the same `d`, the levels
/// as signed bytes), as `quant::levels_as_q8_0`.
///
/// # Safety
/// AVX2 + FMA + F16C; `dst` holds `src.len() / F::BYTES` q8_0 blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn to_q8_0<F: SignedLevels>(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / F::BYTES;
    assert_eq!(dst.len(), nb * q8_0::BYTES);
    for i in 0..nb {
        let (o, od) = (i * F::BYTES, i * q8_0::BYTES);
        dst[od..od + 2].copy_from_slice(&src[o..o + 2]);
        // SAFETY: block i lies in `src` and its q8_0 copy in `dst` (lengths above).
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr().add(od + 2).cast(), F::level_bytes(src, o)) }
    }
}

/// The reference dot of `F` weights against q8_0 activations, bit for bit.
///
/// # Safety
/// The CPU has the features of `D` (and AVX2 + F16C); `w` and `x` hold the same
/// whole number of blocks.
#[inline(always)]
pub(crate) unsafe fn dot<F: Block32, D: U8I8Dot>(w: &[u8], x: &[u8]) -> f32 {
    let nb = w.len() / F::BYTES;
    debug_assert_eq!(x.len(), nb * q8_0::BYTES);
    let mut acc = 0f32;
    let mut i = 0;
    unsafe {
        while i + 8 <= nb {
            acc = group::<F, D>(w, x, i, 8, acc);
            i += 8;
        }
        if i < nb {
            acc = group::<F, D>(w, x, i, nb - i, acc);
        }
    }
    acc
}

/// Blocks `i0..i0 + n` (`1 <= n <= 8`) added to `acc` in order.
#[inline(always)]
unsafe fn group<F: Block32, D: U8I8Dot>(w: &[u8], x: &[u8], i0: usize, n: usize, acc: f32) -> f32 {
    unsafe {
        let zero = _mm256_setzero_si256();
        let ones = _mm256_set1_epi8(1);
        let (mut s, mut sy) = ([zero; 8], [zero; 8]);
        for k in 0..n {
            let (ow, ox) = ((i0 + k) * F::BYTES, (i0 + k) * q8_0::BYTES);
            let y = load256(x, ox + 2);
            s[k] = F::ints::<D>(w, ow, y);
            if F::MINS {
                sy[k] = D::dpbusd(zero, ones, y);
            }
        }
        let (ow, ox) = (i0 * F::BYTES, i0 * q8_0::BYTES);
        let dx = f16x8_strided(x, ox, q8_0::BYTES, n);
        let d = _mm256_mul_ps(f16x8_strided(w, ow, F::BYTES, n), dx);
        let mut v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(hsum8_i32(&s)));
        if F::MINS {
            let m = _mm256_mul_ps(f16x8_strided(w, ow + 2, F::BYTES, n), dx);
            v = _mm256_add_ps(v, _mm256_mul_ps(m, _mm256_cvtepi32_ps(hsum8_i32(&sy))));
        }
        add_lanes(acc, v, n)
    }
}

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, four rows
/// at a time, bit for bit: the activation scales (and, with mins, the
/// activation sums) are formed once for the four rows, and the block values
/// of the four rows are transposed so the per-row accumulators take them in
/// block order as the lanes of one vector, instead of one row's serial chain
/// of scalar adds after another.
///
/// # Safety
/// As [`dot`], with `w` holding `out.len()` rows of `x.len() / q8_0::BYTES` blocks.
#[inline(always)]
pub(crate) unsafe fn dot_rows<F: Block32, D: U8I8Dot>(w: &[u8], x: &[u8], out: &mut [f32]) {
    let rb = x.len() / q8_0::BYTES * F::BYTES;
    debug_assert_eq!(w.len(), out.len() * rb);
    let mut r = 0;
    // SAFETY: rows r.. of `w` exist for every r < out.len() (caller's lengths).
    unsafe {
        while r + 4 <= out.len() {
            rows::<F, D, 4>(w, r * rb, rb, x, &mut out[r..r + 4]);
            r += 4;
        }
        match out.len() - r {
            3 => rows::<F, D, 3>(w, r * rb, rb, x, &mut out[r..]),
            2 => rows::<F, D, 2>(w, r * rb, rb, x, &mut out[r..]),
            1 => rows::<F, D, 1>(w, r * rb, rb, x, &mut out[r..]),
            _ => {}
        }
    }
}

/// `R <= 4` rows from byte `o0` of `w`, `rb` bytes each.
#[inline(always)]
unsafe fn rows<F: Block32, D: U8I8Dot, const R: usize>(w: &[u8], o0: usize, rb: usize, x: &[u8], out: &mut [f32]) {
    let nb = rb / F::BYTES;
    let mut i = 0;
    // SAFETY: groups cover blocks 0..nb of each row, each at most 8 blocks.
    unsafe {
        let mut acc = _mm_setzero_ps();
        while i + 8 <= nb {
            acc = rows_group::<F, D, R>(w, o0, rb, x, i, 8, acc);
            i += 8;
        }
        if i < nb {
            acc = rows_group::<F, D, R>(w, o0, rb, x, i, nb - i, acc);
        }
        store_lanes(acc, out);
    }
}

/// Blocks `i0..i0 + n` (`1 <= n <= 8`) of `R <= 4` rows added to `acc`
/// (lane r: row r) in block order.
#[inline(always)]
unsafe fn rows_group<F: Block32, D: U8I8Dot, const R: usize>(
    w: &[u8],
    o0: usize,
    rb: usize,
    x: &[u8],
    i0: usize,
    n: usize,
    acc: __m128,
) -> __m128 {
    unsafe {
        let zero = _mm256_setzero_si256();
        let ox = i0 * q8_0::BYTES;
        let dx = f16x8_strided(x, ox, q8_0::BYTES, n);
        let mut syf = _mm256_setzero_ps();
        if F::MINS {
            let ones = _mm256_set1_epi8(1);
            let mut sy = [zero; 8];
            for (k, s) in sy.iter_mut().enumerate().take(n) {
                *s = D::dpbusd(zero, ones, load256(x, ox + k * q8_0::BYTES + 2));
            }
            syf = _mm256_cvtepi32_ps(hsum8_i32(&sy));
        }
        if R == 4 {
            // The four rows' next blocks, to L2 (as the AVX-512 row kernels).
            prefetch_lines::<false>(w, o0 + prefetch_ahead(rb) + i0 * 4 * F::BYTES, (32 * F::BYTES).div_ceil(64) + 1);
        }
        let mut v = [_mm256_setzero_ps(); 4];
        for (r, vr) in v.iter_mut().enumerate().take(R) {
            let ow = o0 + r * rb + i0 * F::BYTES;
            let mut s = [zero; 8];
            for (k, sk) in s.iter_mut().enumerate().take(n) {
                *sk = F::ints::<D>(w, ow + k * F::BYTES, load256(x, ox + k * q8_0::BYTES + 2));
            }
            // The block values exactly as `group` forms them.
            let d = _mm256_mul_ps(f16x8_strided(w, ow, F::BYTES, n), dx);
            *vr = _mm256_mul_ps(d, _mm256_cvtepi32_ps(hsum8_i32(&s)));
            if F::MINS {
                let m = _mm256_mul_ps(f16x8_strided(w, ow + 2, F::BYTES, n), dx);
                *vr = _mm256_add_ps(*vr, _mm256_mul_ps(m, syf));
            }
        }
        // Transpose: `b[k]` holds block k (low half) and block k + 4 (high
        // half) of rows 0-3 as lanes 0-3.
        let t0 = _mm256_unpacklo_ps(v[0], v[1]);
        let t1 = _mm256_unpackhi_ps(v[0], v[1]);
        let t2 = _mm256_unpacklo_ps(v[2], v[3]);
        let t3 = _mm256_unpackhi_ps(v[2], v[3]);
        let b = [
            _mm256_shuffle_ps::<0x44>(t0, t2),
            _mm256_shuffle_ps::<0xEE>(t0, t2),
            _mm256_shuffle_ps::<0x44>(t1, t3),
            _mm256_shuffle_ps::<0xEE>(t1, t3),
        ];
        let mut acc = acc;
        for k in 0..n.min(4) {
            acc = _mm_add_ps(acc, _mm256_castps256_ps128(b[k]));
        }
        for k in 4..n {
            acc = _mm_add_ps(acc, _mm256_extractf128_ps::<1>(b[k - 4]));
        }
        acc
    }
}
