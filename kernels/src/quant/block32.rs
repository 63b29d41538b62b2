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
