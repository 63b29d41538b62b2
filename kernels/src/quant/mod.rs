//! Every quant format: block layouts, dequantize, quantize, and the dot product
//! of a weight row against activations (`f32` for float weights, `q8_0` for the
//! 32-weight block formats, `q8_K` for the K and IQ formats, as llama.cpp pairs
//! them, so results are comparable).
//!
//! One format is one module. Each module has the same crate-internal shape:
//! `dequantize(src, dst)`, optionally `quantize(src, dst)`, a scalar reference
//! `dot(w, x)`, and on x86-64 `dot_avx2` (and `dot_avx512` where VNNI helps),
//! plus `dot_rows_avx512` where a multi-row kernel exists (`rows.rs`).
//! Lengths are checked here, once, before a module is called.

use half::f16;
use pulsar_gguf::GgmlType;

use crate::error::QuantError;
use crate::isa::{Isa, Kernels};

/// The multi-row kernels' driver: `out.len()` rows of `$rb` bytes of `$w` in
/// groups of four, then the 3, 2 or 1 left, each group by `$rows::<R>(w, byte
/// offset, rb, x, its outputs)`. Expands to unsafe calls (callers hold the
/// CPU features and the lengths).
#[allow(unused_macros)]
macro_rules! row_groups {
    ($rows:ident, $w:expr, $rb:expr, $x:expr, $out:expr) => {{
        let (w, rb, x, out): (&[u8], usize, &[u8], &mut [f32]) = ($w, $rb, $x, $out);
        let mut r = 0;
        while r + 4 <= out.len() {
            $rows::<4>(w, r * rb, rb, x, &mut out[r..r + 4]);
            r += 4;
        }
        match out.len() - r {
            3 => $rows::<3>(w, r * rb, rb, x, &mut out[r..]),
            2 => $rows::<2>(w, r * rb, rb, x, &mut out[r..]),
            1 => $rows::<1>(w, r * rb, rb, x, &mut out[r..]),
            _ => {}
        }
    }};
}

mod act_simd;
mod activations;
mod block32;
mod fit;
#[cfg(target_arch = "x86_64")]
pub(crate) mod gemm32;
#[cfg(target_arch = "x86_64")]
pub(crate) mod gemm_k;
pub(crate) mod float_dot;
#[rustfmt::skip]
pub(crate) mod iq_tables;
mod random;
mod rows;

pub mod bf16;
#[path = "f16.rs"]
pub mod f16_;
#[path = "f32.rs"]
pub mod f32_;
pub mod iq2_xs;
pub mod iq2_xxs;
pub mod iq3_xxs;
pub mod q2_k;
pub mod q3_k;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;
pub mod q8_k;

pub use activations::{ActFormat, ActRow, Activations};
pub use random::{random_blocks, random_blocks_scaled, random_values};

// ---- little-endian field access shared by the format modules ----

#[inline(always)]
pub(crate) fn rd_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
#[inline(always)]
pub(crate) fn rd_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
#[inline(always)]
pub(crate) fn rd_i16(b: &[u8], off: usize) -> i16 {
    rd_u16(b, off) as i16
}
#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], off: usize) -> f32 {
    f16::from_bits(rd_u16(b, off)).to_f32()
}
/// `y.round() as i32` (ties away from zero) without the libm call that
/// baseline x86-64 makes of `f32::round`: the truncation, then one step away
/// from zero where the (exact) remainder is at least a half. Equal for every
/// input; the fallback covers |y| >= 2^22, infinities and NaN.
#[inline(always)]
pub(crate) fn round_away(y: f32) -> i32 {
    if !(y.abs() < 4_194_304.0) {
        return y.round() as i32;
    }
    let t = y as i32;
    let rem = y - t as f32;
    t + (rem >= 0.5) as i32 - (rem <= -0.5) as i32
}

/// `y.round_ties_even() as i32` without libm's `rintf`: adding and removing
/// 1.5 * 2^23 rounds to an integer under the default (ties-to-even) rounding,
/// exactly for |y| < 2^22; the fallback covers the rest.
#[inline(always)]
pub(crate) fn round_even(y: f32) -> i32 {
    if !(y.abs() < 4_194_304.0) {
        return y.round_ties_even() as i32;
    }
    ((y + 12_582_912.0) - 12_582_912.0) as i32
}

#[inline(always)]
pub(crate) fn rd_f32(b: &[u8], off: usize) -> f32 {
    f32::from_bits(rd_u32(b, off))
}
#[inline(always)]
pub(crate) fn wr_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Block geometry as `usize`, for slicing.
#[inline]
pub(crate) fn geometry(ty: GgmlType) -> (usize, usize) {
    (ty.block_elems() as usize, ty.block_bytes() as usize)
}

/// Bytes of `n` values of `ty`, or an error when `n` is not a whole number of blocks.
pub fn row_bytes(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let (be, bb) = geometry(ty);
    if n % be != 0 {
        return Err(QuantError::NotWholeBlocks {
            ty,
            len: n,
            block: be,
            unit: "values",
        });
    }
    Ok(n / be * bb)
}

/// Whether [`dequantize`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | Q8_K
            | IQ2_XXS
            | IQ2_XS
            | IQ3_XXS
    )
}

/// Whether [`quantize`] handles `ty`.
pub fn can_quantize(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q8_K
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
    )
}

/// Whether [`Kernels::dot`] (and so the matvec) handles weights of `ty`.
pub fn can_dot(ty: GgmlType) -> bool {
    ActFormat::for_weight(ty).is_some()
}

/// Number of whole blocks in `src` bytes, checked against `dst_len` values.
fn check_pair(ty: GgmlType, bytes: usize, values: usize) -> Result<(), QuantError> {
    let (be, bb) = geometry(ty);
    if bytes % bb != 0 {
        return Err(QuantError::NotWholeBlocks {
            ty,
            len: bytes,
            block: bb,
            unit: "bytes",
        });
    }
    let n = bytes / bb * be;
    if n != values {
        return Err(QuantError::LengthMismatch {
            what: "values for these bytes",
            expected: n,
            got: values,
        });
    }
    Ok(())
}

/// Dequantize any whole number of blocks of `ty` in `src` into `dst`, which must
/// hold exactly the values those blocks encode.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::Unsupported {
            ty,
            op: "dequantize",
        });
    }
    check_pair(ty, src.len(), dst.len())?;
    use GgmlType::*;
    match ty {
        F32 => f32_::dequantize(src, dst),
        F16 => f16_::dequantize(src, dst),
        BF16 => bf16::dequantize(src, dst),
        Q4_0 => q4_0::dequantize(src, dst),
        Q4_1 => q4_1::dequantize(src, dst),
        Q5_0 => q5_0::dequantize(src, dst),
        Q5_1 => q5_1::dequantize(src, dst),
        Q8_0 => q8_0::dequantize(src, dst),
        Q2_K => q2_k::dequantize(src, dst),
        Q3_K => q3_k::dequantize(src, dst),
        Q4_K => q4_k::dequantize(src, dst),
        Q5_K => q5_k::dequantize(src, dst),
        Q6_K => q6_k::dequantize(src, dst),
        Q8_K => q8_k::dequantize(src, dst),
        IQ2_XXS => iq2_xxs::dequantize(src, dst),
        IQ2_XS => iq2_xs::dequantize(src, dst),
        IQ3_XXS => iq3_xxs::dequantize(src, dst),
        _ => unreachable!("can_dequantize lists exactly the types above"),
    }
    Ok(())
}

/// Quantize `src` (a whole number of blocks of `ty`) into `dst`, which must be
/// exactly the bytes of those blocks. Values should be finite: the scale of a
/// block holding an infinity or NaN is not meaningful.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::Unsupported { ty, op: "quantize" });
    }
    let need = row_bytes(ty, src.len())?;
    if dst.len() != need {
        return Err(QuantError::LengthMismatch {
            what: "quantized bytes",
            expected: need,
            got: dst.len(),
        });
    }
    use GgmlType::*;
    match ty {
        F32 => f32_::quantize(src, dst),
        F16 => f16_::quantize(src, dst),
        BF16 => bf16::quantize(src, dst),
        Q4_0 => q4_0::quantize(src, dst),
        Q4_1 => q4_1::quantize(src, dst),
        Q5_0 => q5_0::quantize(src, dst),
        Q5_1 => q5_1::quantize(src, dst),
        Q8_0 => act_simd::q8_0(src, dst),
        Q8_K => act_simd::q8_k(src, dst),
        Q2_K => q2_k::quantize(src, dst),
        Q3_K => q3_k::quantize(src, dst),
        Q4_K => q4_k::quantize(src, dst),
        Q5_K => q5_k::quantize(src, dst),
        Q6_K => q6_k::quantize(src, dst),
        _ => unreachable!("can_quantize lists exactly the types above"),
    }
    Ok(())
}

/// `q4_0` / `q5_0` rows rewritten as `q8_0` rows of the same values: each
/// block's f16 `d` copied and its levels stored as signed bytes. The q8_0
/// dot of the copy is the source's dot bit for bit (the same integer sum
/// `s = sum(q y)` and the same `d_w * d_x * s`), so a prefill tile can be
/// decoded once and dotted by every token of the chunk with the faster
/// q8_0 kernel. Returns false (and writes nothing) for any other type.
pub(crate) fn levels_as_q8_0(k: &Kernels, ty: GgmlType, src: &[u8], dst: &mut Vec<u8>) -> bool {
    type Levels = fn(&[u8]) -> [i8; 32];
    let (bytes, levels): (usize, Levels) = match ty {
        GgmlType::Q4_0 => (q4_0::BYTES, q4_0::levels),
        GgmlType::Q5_0 => (q5_0::BYTES, q5_0::levels),
        _ => return false,
    };
    let nb = src.len() / bytes;
    dst.clear();
    dst.resize(nb * q8_0::BYTES, 0);
    #[cfg(target_arch = "x86_64")]
    if k.isa() >= Isa::Avx2 {
        // SAFETY: a Kernels at Avx2 or above exists only on a CPU with AVX2,
        // FMA and F16C; `dst` holds nb q8_0 blocks.
        unsafe {
            match ty {
                GgmlType::Q4_0 => block32::to_q8_0::<q4_0::Fmt>(src, dst),
                _ => block32::to_q8_0::<q5_0::Fmt>(src, dst),
            }
        }
        return true;
    }
    let _ = k;
    for (b, d) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(q8_0::BYTES)) {
        d[..2].copy_from_slice(&b[..2]);
        for (o, q) in d[2..].iter_mut().zip(levels(b)) {
            *o = q as u8;
        }
    }
    true
}

impl Kernels {
    /// The dot product of one weight row of type `ty` with one activation row.
    /// `x` must be in the format [`ActFormat::for_weight`] gives for `ty`, and
    /// `w` must hold exactly `x.cols()` weights.
    pub fn dot(&self, ty: GgmlType, w: &[u8], x: ActRow<'_>) -> Result<f32, QuantError> {
        check_dot(ty, w.len(), x)?;
        Ok(self.dot_checked(ty, w, x))
    }

    /// `dot` after `check_dot` passed.
    #[inline]
    pub(crate) fn dot_checked(&self, ty: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
        match self.isa() {
            Isa::Scalar => dot_scalar(ty, w, x),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: a Kernels at Avx2 or above exists only when the CPU has those features.
            Isa::Avx2 => unsafe { dot_avx2(ty, w, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, for the AVX-512 VNNI level.
            Isa::Avx512Vnni => unsafe { dot_avx512(ty, w, x) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => dot_scalar(ty, w, x),
        }
    }
}

/// The checks `Kernels::dot` makes: format pairing and lengths.
pub(crate) fn check_dot(ty: GgmlType, w_len: usize, x: ActRow<'_>) -> Result<(), QuantError> {
    let need = dot_row_bytes(ty, x)?;
    if w_len != need {
        return Err(QuantError::LengthMismatch {
            what: "weight row bytes",
            expected: need,
            got: w_len,
        });
    }
    Ok(())
}

/// Bytes of the `ty` weight row that dots with `x`, once the formats pair.
pub(crate) fn dot_row_bytes(ty: GgmlType, x: ActRow<'_>) -> Result<usize, QuantError> {
    let expected = ActFormat::for_weight(ty).ok_or(QuantError::Unsupported { ty, op: "dot" })?;
    if x.format() != expected {
        return Err(QuantError::WrongActivationFormat {
            ty,
            expected,
            got: x.format(),
        });
    }
    row_bytes(ty, x.cols())
}

fn dot_scalar(ty: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
    use GgmlType::*;
    match ty {
        F32 => f32_::dot(w, x.f32s()),
        F16 => f16_::dot(w, x.f32s()),
        BF16 => bf16::dot(w, x.f32s()),
        Q4_0 => q4_0::dot(w, x.bytes()),
        Q4_1 => q4_1::dot(w, x.bytes()),
        Q5_0 => q5_0::dot(w, x.bytes()),
        Q5_1 => q5_1::dot(w, x.bytes()),
        Q8_0 => q8_0::dot(w, x.bytes()),
        Q2_K => q2_k::dot(w, x.bytes()),
        Q3_K => q3_k::dot(w, x.bytes()),
        Q4_K => q4_k::dot(w, x.bytes()),
        Q5_K => q5_k::dot(w, x.bytes()),
        Q6_K => q6_k::dot(w, x.bytes()),
        IQ2_XXS => iq2_xxs::dot(w, x.bytes()),
        IQ2_XS => iq2_xs::dot(w, x.bytes()),
        IQ3_XXS => iq3_xxs::dot(w, x.bytes()),
        _ => unreachable!("check_dot admits only types with an activation format"),
    }
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; lengths must have passed `check_dot`.
#[cfg(target_arch = "x86_64")]
unsafe fn dot_avx2(ty: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
    use GgmlType::*;
    unsafe {
        match ty {
            F32 => f32_::dot_avx2(w, x.f32s()),
            F16 => f16_::dot_avx2(w, x.f32s()),
            BF16 => bf16::dot_avx2(w, x.f32s()),
            Q4_0 => q4_0::dot_avx2(w, x.bytes()),
            Q4_1 => q4_1::dot_avx2(w, x.bytes()),
            Q5_0 => q5_0::dot_avx2(w, x.bytes()),
            Q5_1 => q5_1::dot_avx2(w, x.bytes()),
            Q8_0 => q8_0::dot_avx2(w, x.bytes()),
            Q2_K => q2_k::dot_avx2(w, x.bytes()),
            Q3_K => q3_k::dot_avx2(w, x.bytes()),
            Q4_K => q4_k::dot_avx2(w, x.bytes()),
            Q5_K => q5_k::dot_avx2(w, x.bytes()),
            Q6_K => q6_k::dot_avx2(w, x.bytes()),
            IQ2_XXS => iq2_xxs::dot_avx2(w, x.bytes()),
            IQ2_XS => iq2_xs::dot_avx2(w, x.bytes()),
            IQ3_XXS => iq3_xxs::dot_avx2(w, x.bytes()),
            _ => unreachable!("check_dot admits only types with an activation format"),
        }
    }
}

/// # Safety
/// The CPU must have the `Isa::Avx512Vnni` features; lengths must have passed `check_dot`.
#[cfg(target_arch = "x86_64")]
unsafe fn dot_avx512(ty: GgmlType, w: &[u8], x: ActRow<'_>) -> f32 {
    use GgmlType::*;
    unsafe {
        match ty {
            Q4_0 => q4_0::dot_avx512(w, x.bytes()),
            Q4_1 => q4_1::dot_avx512(w, x.bytes()),
            Q5_0 => q5_0::dot_avx512(w, x.bytes()),
            Q5_1 => q5_1::dot_avx512(w, x.bytes()),
            Q8_0 => q8_0::dot_avx512(w, x.bytes()),
            // One row at a time, the K and IQ formats gain nothing from VNNI:
            // their per-16 or per-32 scale multiply is the `vpmaddwd` that
            // widens anyway. Their AVX-512 speed-up is in `dot_rows` (several
            // rows per activation load, see rows.rs).
            _ => dot_avx2(ty, w, x),
        }
    }
}

#[cfg(test)]
mod round_tests {
    use super::{round_away, round_even};

    fn check(y: f32) {
        assert_eq!(round_away(y), y.round() as i32, "round_away({y:e})");
        assert_eq!(round_even(y), y.round_ties_even() as i32, "round_even({y:e})");
    }

    #[test]
    fn the_fast_roundings_equal_libm_on_ties_neighbours_and_a_bit_sweep() {
        for k in -3000..3000 {
            let tie = k as f32 + 0.5;
            for y in [tie, tie.next_up(), tie.next_down(), k as f32, (k as f32).next_up(), (k as f32).next_down()] {
                check(y);
                check(-y);
            }
        }
        // Every 61st bit pattern of the positive floats up to 2^24, both signs.
        let mut bits = 0u32;
        while bits < 0x4b80_0000 {
            let y = f32::from_bits(bits);
            check(y);
            check(-y);
            bits += 61;
        }
        for y in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 4_194_304.0, -4_194_303.5, 1e30, -1e30, f32::MIN_POSITIVE, 0.0, -0.0] {
            check(y);
        }
    }
}
