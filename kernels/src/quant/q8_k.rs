//! `q8_K`: the activation format of the K and IQ dots. Blocks of 256 values,
//! 292 bytes: `d: f32`, `qs: [i8; 256]`, `bsums: [i16; 16]` (sum of each run of
//! 16 quants, which the K dots use to apply mins and offsets cheaply).

use super::{rd_f32, rd_i16};

pub(crate) const QK: usize = 256;
pub(crate) const BYTES: usize = 292;
/// Offset of `qs` and of `bsums` in a block.
pub(crate) const QS: usize = 4;
pub(crate) const BSUMS: usize = 260;

/// Blocks to values: `d * q`.
pub(crate) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(BYTES).zip(dst.chunks_exact_mut(QK)) {
        let d = rd_f32(b, 0);
        for (yi, &q) in y.iter_mut().zip(&b[QS..QS + QK]) {
            *yi = d * (q as i8) as f32;
        }
    }
}

/// ggml's reference: the value of largest magnitude maps to -127
/// (`iscale = -127 / max`), `q = round_ties_even(iscale * x)`, `d = 1 / iscale`.
/// Every `q` is within [-127, 127] (the IQ dots negate quants, so -128 must
/// not occur).
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(BYTES)) {
        let max = super::q4_0::signed_absmax(x);
        if max == 0.0 {
            b.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b[QS..QS + QK].iter_mut().zip(x) {
            *q = super::round_even(iscale * v).clamp(-127, 127) as i8 as u8;
        }
        for j in 0..16 {
            let s: i32 = b[QS + 16 * j..QS + 16 * j + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            b[BSUMS + 2 * j..BSUMS + 2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }
}

/// `d` of block `i` of a q8_K row.
#[inline(always)]
pub(crate) fn d(x: &[u8], i: usize) -> f32 {
    rd_f32(x, i * BYTES)
}

/// Quant `j` of block `i`.
#[inline(always)]
pub(crate) fn q(x: &[u8], i: usize, j: usize) -> i32 {
    x[i * BYTES + QS + j] as i8 as i32
}

/// 16-value sum `j` of block `i`.
#[inline(always)]
pub(crate) fn bsum(x: &[u8], i: usize, j: usize) -> i32 {
    rd_i16(x, i * BYTES + BSUMS + 2 * j) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extreme_value_maps_to_minus_127_and_sums_are_kept() {
        let mut x = vec![0f32; 256];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 * 0.37).sin();
        }
        x[17] = 3.0;
        let mut b = vec![0u8; BYTES];
        quantize(&x, &mut b);
        assert_eq!(q(&b, 0, 17), -127);
        assert!((d(&b, 0) + 3.0 / 127.0).abs() < 1e-7);
        for j in 0..16 {
            let s: i32 = (0..16).map(|k| q(&b, 0, 16 * j + k)).sum();
            assert_eq!(bsum(&b, 0, j), s);
        }
        let mut y = vec![0f32; 256];
        dequantize(&b, &mut y);
        for (a, e) in x.iter().zip(&y) {
            assert!((a - e).abs() <= 3.0 / 254.0 * 1.0001, "{a} {e}");
        }
    }
}
