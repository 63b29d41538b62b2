//! `q8_0`: blocks of 32 values, 34 bytes: `d: f16`, `qs: [i8; 32]`; value = d * q.
//! Also the activation format of the 32-block weight formats.

use super::{rd_f16, wr_f16};

pub(crate) const QK: usize = 32;
pub(crate) const BYTES: usize = 34;

/// Blocks to values: `q * d` in f32 (exact order of the `gguf` reference).
pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f16(b, 0);
        for (yi, &q) in y.iter_mut().zip(&b[2..]) {
            *yi = (q as i8) as f32 * d;
        }
    }
}

/// Values to blocks like ggml's reference: `d = amax / 127`, `q = round(x / d)`
/// with ties away from zero, `d` stored as f16. Every `q` is within [-127, 127].
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        wr_f16(b, 0, d);
        for (q, &v) in b[2..].iter_mut().zip(x) {
            *q = super::round_away(v * id).clamp(-127, 127) as i8 as u8;
        }
    }
}

/// Scalar reference: per block, the exact integer sum times `d_w * d_x`.
pub(crate) fn dot(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0f32;
    for (bw, bx) in w.chunks_exact(BYTES).zip(x.chunks_exact(BYTES)) {
        let mut s = 0i32;
        for (&a, &b) in bw[2..].iter().zip(&bx[2..]) {
            s += (a as i8 as i32) * (b as i8 as i32);
        }
        acc += rd_f16(bw, 0) * rd_f16(bx, 0) * s as f32;
    }
    acc
}

/// The block layout for the shared SIMD driver, which reproduces [`dot`] bit for bit.
#[cfg(target_arch = "x86_64")]
struct Fmt;

#[cfg(target_arch = "x86_64")]
impl super::block32::Block32 for Fmt {
    const BYTES: usize = BYTES;
    const MINS: bool = false;
    #[inline(always)]
    unsafe fn ints<D: crate::simd::U8I8Dot>(
        w: &[u8],
        ow: usize,
        y: std::arch::x86_64::__m256i,
    ) -> std::arch::x86_64::__m256i {
        use crate::simd::*;
        use std::arch::x86_64::*;
        unsafe { dot_i8::<D>(_mm256_setzero_si256(), load256(w, ow + 2), y) }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dot_impl<D: crate::simd::U8I8Dot>(w: &[u8], x: &[u8]) -> f32 {
    unsafe { super::block32::dot::<Fmt, D>(w, x) }
}

/// # Safety
/// AVX2 + FMA + F16C; `w` and `x` the same whole number of blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2(w: &[u8], x: &[u8]) -> f32 {
    unsafe { dot_impl::<crate::simd::Avx2Dot>(w, x) }
}

/// # Safety
/// As [`dot_avx2`] plus AVX-512 F/BW/VL/VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot_avx512(w: &[u8], x: &[u8]) -> f32 {
    unsafe { dot_impl::<crate::simd::VnniDot>(w, x) }
}

/// [`dot`] of each of the `out.len()` rows laid end to end in `w`, bit for
/// bit, four rows by four blocks at a time: activations loaded once for the
/// four rows, one `vpdpbusd` per row and two blocks, one reduction for the
/// sixteen block sums, the block values formed lane-wise and added to each
/// row's accumulator in block order.
///
/// `vpdpbusd` wants one unsigned side: the weights go in as `w + 128`
/// (`w ^ 0x80`, exact for -128 too), and each sum starts at `-128 * sum(y)`,
/// which all rows share.
///
/// # Safety
/// AVX2 + FMA + F16C + AVX-512 F/BW/VL/VNNI; `x` is whole blocks and `w` is
/// `out.len()` rows of as many blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dot_rows_avx512(w: &[u8], x: &[u8], out: &mut [f32]) {
    let rb = x.len();
    debug_assert_eq!(w.len(), out.len() * rb);
    // SAFETY: rows r.. of `w` exist for every r < out.len() (caller's lengths).
    unsafe { row_groups!(rows_avx512, w, rb, x, out) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn rows_avx512<const R: usize>(w: &[u8], o0: usize, rb: usize, x: &[u8], out: &mut [f32]) {
    let nb = rb / BYTES;
    let mut k = 0;
    // SAFETY: groups cover blocks 0..nb of each row, each at most 4 blocks.
    unsafe {
        let mut acc = std::arch::x86_64::_mm_setzero_ps();
        while k + 4 <= nb {
            acc = group_avx512::<R, 4>(w, o0, rb, x, k, acc);
            k += 4;
        }
        acc = match nb - k {
            3 => group_avx512::<R, 3>(w, o0, rb, x, k, acc),
            2 => group_avx512::<R, 2>(w, o0, rb, x, k, acc),
            1 => group_avx512::<R, 1>(w, o0, rb, x, k, acc),
            _ => acc,
        };
        crate::simd::store_lanes(acc, out);
    }
}

/// Blocks `k0..k0 + N` (`N <= 4`) of `R <= 4` rows added to `acc` (lane r: row r).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn group_avx512<const R: usize, const N: usize>(
    w: &[u8],
    o0: usize,
    rb: usize,
    x: &[u8],
    k0: usize,
    acc: std::arch::x86_64::__m128,
) -> std::arch::x86_64::__m128 {
    use crate::simd::*;
    use std::arch::x86_64::*;
    // SAFETY: the caller has the CPU features; every load lies in blocks
    // k0..k0 + N of rows 0..R of `w` (from o0) or of `x`.
    unsafe {
        let (zero, z256) = (_mm512_setzero_si512(), _mm256_setzero_si256());
        let flip = _mm512_set1_epi8(-128);
        // Blocks past N are zero on both sides, so their lanes stay zero.
        let blk = |p: &[u8], o: usize, k: usize| {
            if k < N {
                load256(p, o + k * BYTES + 2)
            } else {
                z256
            }
        };
        let ox = k0 * BYTES;
        let y = [
            join256(blk(x, ox, 0), blk(x, ox, 1)),
            join256(blk(x, ox, 2), blk(x, ox, 3)),
        ];
        let c = y.map(|y| _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, y)));
        if R == 4 {
            prefetch_lines::<false>(
                w,
                o0 + 4 * rb + k0 * 4 * BYTES,
                (16 * BYTES).div_ceil(64) + 1,
            );
        }
        let (mut a, mut b) = ([zero; 4], [zero; 4]);
        let mut dw = [0u16; 16];
        for r in 0..R {
            let ow = o0 + r * rb + ox;
            let w01 = _mm512_xor_si512(join256(blk(w, ow, 0), blk(w, ow, 1)), flip);
            a[r] = _mm512_dpbusd_epi32(c[0], w01, y[0]);
            if N > 2 {
                let w23 = _mm512_xor_si512(join256(blk(w, ow, 2), blk(w, ow, 3)), flip);
                b[r] = _mm512_dpbusd_epi32(c[1], w23, y[1]);
            }
            for k in 0..N {
                dw[4 * k + r] = ld_u16(w, ow + k * BYTES);
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
        for k in 0..N {
            dxh[k] = ld_u16(x, ox + k * BYTES);
        }
        let dx4 = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadu_si128(
            dxh.as_ptr() as *const __m128i
        )));
        let dx = _mm512_permutexvar_ps(
            _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
            dx4,
        );
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
