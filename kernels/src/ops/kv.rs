//! The formats a KV cache holds its rows in, on the CPU and CUDA alike: f32,
//! or f16 / bf16 bits (half the bytes, so half the bandwidth decode spends
//! reading the cache at long contexts). A row is rounded once when it is
//! written (round to nearest even, the conversion both backends use) and
//! widened exactly when it is read, so attention over a 16-bit cache is
//! attention over the rounded values, in the same order: CUDA equals the
//! CPU bit for bit in every format.
//!
//! q8_0 is llama.cpp's block format laid out per row: a row of `w` values is
//! `w` int8 quants, then one f16 scale per block of 32 values (the last
//! block may be shorter), padded to 16 bytes ([`KvType::row_bytes`]), so a
//! row is self-contained and 16-byte aligned. A block is quantized as
//! llama.cpp's `quantize_row_q8_0` does (`d = amax / 127`, `q = round(x / d)`
//! via `x * (1 / d)`, rounding half away from zero) and read as `q * d`,
//! which is exact in f32 (8 bits times 11), so the values attention reads do
//! not depend on the order they are read in.
//!
//! q4_0 likewise: a row is one 16-byte group of nibbles per block of 32
//! values (byte j holds value j in its low nibble and value j + 16 in its
//! high one, as llama.cpp's `block_q4_0` does), then the blocks' f16 scales,
//! padded to 16 bytes. A block is quantized as `quantize_row_q4_0` does
//! (`d = max / -8` where `max` is the first value of the largest magnitude,
//! `q = min(15, trunc(x * (1 / d) + 8.5))`), a short last block as if
//! padded with zeros, and read as `(q - 8) * d`, exact in f32.
//!
//! fp8 is one e4m3 byte per value (OCP `E4M3FN`: bias 7, no infinities,
//! 0x7f / 0xff NaN, largest finite 448), no scale: a value is rounded to
//! nearest even and saturated to ±448 (as CUDA's `__NV_SATFINITE`
//! conversion does), and read back exactly. Its relative error is up to
//! 2^-4, and values below 2^-6 lose precision as subnormals (down to 2^-9).

use std::fmt;
use std::str::FromStr;

/// A KV cache's element format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    #[default]
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    /// e4m3, one byte a value.
    Fp8,
}

/// Values per q8_0 / q4_0 block.
pub const Q8_0_BLOCK: usize = 32;

impl KvType {
    pub const ALL: [KvType; 6] = [KvType::F32, KvType::F16, KvType::Bf16, KvType::Q8_0, KvType::Q4_0, KvType::Fp8];

    /// Bytes of one row of `w` values (q8_0: quants, scales, padding to 16).
    pub fn row_bytes(self, w: usize) -> usize {
        match self {
            KvType::F32 => 4 * w,
            KvType::F16 | KvType::Bf16 => 2 * w,
            KvType::Q8_0 => (w + 2 * w.div_ceil(Q8_0_BLOCK)).next_multiple_of(16),
            KvType::Q4_0 => (18 * w.div_ceil(Q8_0_BLOCK)).next_multiple_of(16),
            KvType::Fp8 => w,
        }
    }

    /// Whether rows are blocks of 32 values with a scale each (q8_0, q4_0).
    pub fn is_blocked(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Q4_0)
    }

    /// Byte offset of block `b`'s scale in a row of `w` values (blocked formats).
    fn scale_at(self, w: usize, b: usize) -> usize {
        match self {
            KvType::Q8_0 => w + 2 * b,
            _ => 16 * w.div_ceil(Q8_0_BLOCK) + 2 * b,
        }
    }

    /// The signed quant of value `i` of a blocked row.
    fn quant(self, row: &[u8], i: usize) -> i32 {
        match self {
            KvType::Q8_0 => row[i] as i8 as i32,
            _ => ((row[16 * (i / 32) + (i & 15)] >> (4 * ((i >> 4) & 1))) & 15) as i32 - 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
            KvType::Fp8 => "fp8",
        }
    }

    /// The 16-bit pattern `x` is stored as (f16 or bf16 only).
    pub fn bits(self, x: f32) -> u16 {
        match self {
            KvType::F16 => half::f16::from_f32(x).to_bits(),
            _ => bf16_bits(x),
        }
    }

    /// Store the row `x` in this format into `out` (`row_bytes(x.len())`
    /// bytes; f32 and 16-bit values little-endian).
    pub fn put_row(self, x: &[f32], out: &mut [u8]) {
        assert_eq!(out.len(), self.row_bytes(x.len()), "a {self} row of {} values", x.len());
        match self {
            KvType::F32 => out.chunks_exact_mut(4).zip(x).for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
            KvType::F16 | KvType::Bf16 => out.chunks_exact_mut(2).zip(x).for_each(|(o, &v)| o.copy_from_slice(&self.bits(v).to_le_bytes())),
            KvType::Q8_0 => q8_0_row(x, out),
            KvType::Q4_0 => q4_0_row(x, out),
            KvType::Fp8 => out.iter_mut().zip(x).for_each(|(o, &v)| *o = e4m3_bits(v)),
        }
    }

    /// The value a 16-bit pattern holds, exactly.
    pub fn widen(self, b: u16) -> f32 {
        match self {
            KvType::F16 => half::f16::from_bits(b).to_f32(),
            _ => f32::from_bits((b as u32) << 16),
        }
    }

    /// `x` as this format stores it, widened back: what attention reads;
    /// `None` for the blocked formats, which round blocks, not values.
    pub fn round(self, x: f32) -> Option<f32> {
        match self {
            KvType::F32 => Some(x),
            KvType::Q8_0 | KvType::Q4_0 => None,
            KvType::Fp8 => Some(e4m3_value(e4m3_bits(x))),
            t => Some(t.widen(t.bits(x))),
        }
    }
}

/// One q8_0 row: for each block, `d = amax / 127` (stored as f16), the
/// quants `round(x * (1 / d))` (0 where d is 0; a NaN quant is 0). attention.cu's
/// `kv_put_q8` does the same operations.
fn q8_0_row(x: &[f32], out: &mut [u8]) {
    let w = x.len();
    let (qs, rest) = out.split_at_mut(w);
    for (b, blk) in x.chunks(Q8_0_BLOCK).enumerate() {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (o, &v) in qs[b * Q8_0_BLOCK..].iter_mut().zip(blk) {
            let r = (v * id).round();
            *o = if r.is_nan() { 0 } else { r as i8 as u8 };
        }
        rest[2 * b..2 * b + 2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    }
    rest[2 * w.div_ceil(Q8_0_BLOCK)..].fill(0);
}

/// One q4_0 row: for each block (a short one padded with zeros), `max` the
/// first value of the largest |x| (NaN passed over), `d = max / -8` (stored
/// as f16), quants `min(15, trunc(x * (1 / d) + 8.5))` (8 for a NaN).
/// attention.cu's `kv_put_q4` does the same operations.
fn q4_0_row(x: &[f32], out: &mut [u8]) {
    let nb = x.len().div_ceil(Q8_0_BLOCK);
    let (qs, rest) = out.split_at_mut(16 * nb);
    for (b, blk) in x.chunks(Q8_0_BLOCK).enumerate() {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in blk {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = |j: usize| -> u8 {
            let v = blk.get(j).copied().unwrap_or(0.0);
            if v.is_nan() {
                8
            } else {
                ((v * id + 8.5) as i32).min(15) as u8
            }
        };
        for j in 0..16 {
            qs[16 * b + j] = q(j) | (q(j + 16) << 4);
        }
        rest[2 * b..2 * b + 2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
    }
    rest[2 * nb..].fill(0);
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<KvType, String> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
            .or(matches!(s.trim().to_ascii_lowercase().as_str(), "fp8_e4m3" | "e4m3").then_some(KvType::Fp8))
            .ok_or_else(|| format!("unknown KV cache type {s:?} (expected f32, f16, bf16, q8_0, q4_0 or fp8)"))
    }
}

/// f32 to e4m3 (E4M3FN), round to nearest even, finite values beyond 448
/// (and infinities) saturated to ±448, NaN to 0x7f with its sign
/// (attention.cu's `f2e4m3`, the same integer steps).
pub fn e4m3_bits(x: f32) -> u8 {
    let u = x.to_bits();
    let s = ((u >> 24) & 0x80) as u8;
    let a = u & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return s | 0x7f;
    }
    if a >= 0x43e0_0000 {
        return s | 0x7e; // 448 and beyond
    }
    if a < 0x3c80_0000 {
        // Below 2^-6: a subnormal m * 2^-9 (m = 8 is the smallest normal).
        // Scaling by 2^9 is exact, so rounding the product rounds |x|.
        return s | (f32::from_bits(a) * 512.0).round_ties_even() as u8;
    }
    // Normal: round the 23-bit mantissa to 3 bits (a carry bumps the
    // exponent, as it should), then rebias 127 -> 7.
    let r = (a + 0x7_ffff + ((a >> 20) & 1)) >> 20;
    s | (r - ((127 - 7) << 3)) as u8
}

/// The value of an e4m3 byte, exactly.
pub fn e4m3_value(b: u8) -> f32 {
    let (e, m) = ((b >> 3) & 15, (b & 7) as u32);
    let mag = if e == 15 && m == 7 {
        f32::NAN
    } else if e == 0 {
        m as f32 / 512.0
    } else {
        f32::from_bits(((e as u32 + 120) << 23) | (m << 20))
    };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// f32 to bf16, round to nearest even (attention.cu's `f2bf`); a NaN stays a
/// quiet NaN of its sign.
pub fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) as u16) | 0x0040;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// A cache's rows in their format: what [`crate::ops::attend_rows`] reads.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
    /// Rows of `width` values in a byte format (q8_0, q4_0, fp8),
    /// [`KvType::row_bytes`] each.
    Bytes { ty: KvType, data: &'a [u8], width: usize },
}

impl<'a> KvRows<'a> {
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) | KvRows::Bf16(v) => v.len(),
            KvRows::Bytes { ty, data, width } => data.len() / ty.row_bytes(*width).max(1) * width,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn kv_type(&self) -> KvType {
        match self {
            KvRows::F32(_) => KvType::F32,
            KvRows::F16(_) => KvType::F16,
            KvRows::Bf16(_) => KvType::Bf16,
            KvRows::Bytes { ty, .. } => *ty,
        }
    }

    /// Values `[at, at + buf.len())` as f32: the cache's own slice for f32,
    /// else widened into `buf` (blocked formats: within one row).
    #[inline]
    pub fn get<'b>(&'b self, at: usize, buf: &'b mut [f32]) -> &'b [f32] {
        let n = buf.len();
        match *self {
            KvRows::F32(v) => &v[at..at + n],
            KvRows::F16(v) => {
                use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
                v[at..at + n].reinterpret_cast::<half::f16>().convert_to_f32_slice(buf);
                buf
            }
            KvRows::Bf16(v) => {
                buf.iter_mut().zip(&v[at..at + n]).for_each(|(o, &b)| *o = f32::from_bits((b as u32) << 16));
                buf
            }
            KvRows::Bytes { ty: KvType::Fp8, data, .. } => {
                buf.iter_mut().zip(&data[at..at + n]).for_each(|(o, &b)| *o = e4m3_value(b));
                buf
            }
            KvRows::Bytes { ty, data, width } => {
                let (j, c) = (at / width, at % width);
                assert!(c + n <= width, "a {ty} read across rows");
                let row = &data[j * ty.row_bytes(width)..][..ty.row_bytes(width)];
                let scale = |b: usize| {
                    let s = ty.scale_at(width, b);
                    half::f16::from_bits(u16::from_le_bytes([row[s], row[s + 1]])).to_f32()
                };
                let mut blk = usize::MAX;
                let mut d = 0f32;
                for (i, o) in (c..c + n).zip(buf.iter_mut()) {
                    if i / Q8_0_BLOCK != blk {
                        blk = i / Q8_0_BLOCK;
                        d = scale(blk);
                    }
                    *o = ty.quant(row, i) as f32 * d;
                }
                buf
            }
        }
    }
}

impl<'a> From<&'a [f32]> for KvRows<'a> {
    fn from(v: &'a [f32]) -> Self {
        KvRows::F32(v)
    }
}
impl<'a> From<&'a Vec<f32>> for KvRows<'a> {
    fn from(v: &'a Vec<f32>) -> Self {
        KvRows::F32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_widens_exactly() {
        // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: even (1) wins.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: even wins.
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(1.0 + 3.0 / 512.0), 0x3f81);
        for x in [0.0f32, -0.0, 1.5, -3.25e-3, 6.5e4, f32::INFINITY, f32::MIN_POSITIVE] {
            let r = KvType::Bf16.round(x).unwrap();
            assert_eq!(KvType::Bf16.round(r).unwrap().to_bits(), r.to_bits(), "{x}");
            assert!(r == x || (r - x).abs() <= x.abs() / 128.0, "{x} -> {r}");
        }
        assert!(KvType::Bf16.round(f32::NAN).unwrap().is_nan());
        assert_eq!(bf16_bits(f32::MAX), 0x7f80, "overflow rounds to infinity");
    }

    #[test]
    fn f16_round_trips_and_names_parse() {
        assert_eq!(KvType::F16.round(1.0 + 1.0 / 4096.0), Some(1.0));
        assert_eq!(KvType::F16.round(65520.0), Some(f32::INFINITY));
        assert_eq!(KvType::Q8_0.round(1.0), None, "blocks, not values");
        for t in KvType::ALL {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
            assert_eq!(t.name().to_uppercase().parse::<KvType>(), Ok(t));
        }
        assert_eq!("FP8_E4M3".parse::<KvType>(), Ok(KvType::Fp8));
        assert!("fp16".parse::<KvType>().unwrap_err().contains("fp16"));
    }

    #[test]
    fn rows_widen_each_format() {
        let v = [1.5f32, -2.0, 0.1];
        let h: Vec<u16> = v.iter().map(|&x| KvType::F16.bits(x)).collect();
        let b: Vec<u16> = v.iter().map(|&x| KvType::Bf16.bits(x)).collect();
        let mut buf = [0f32; 2];
        assert_eq!(KvRows::F32(&v).get(1, &mut buf), &v[1..3]);
        assert_eq!(KvRows::F16(&h).get(1, &mut buf), &[-2.0, KvType::F16.round(0.1).unwrap()]);
        assert_eq!(KvRows::Bf16(&b).get(1, &mut buf), &[-2.0, KvType::Bf16.round(0.1).unwrap()]);
        let mut f = [0u8; 3];
        KvType::Fp8.put_row(&v, &mut f);
        assert_eq!(KvRows::Bytes { ty: KvType::Fp8, data: &f, width: 3 }.get(1, &mut buf), &[-2.0, KvType::Fp8.round(0.1).unwrap()]);
    }

    /// Every e4m3 byte, and the f32 values nearest each, against the
    /// definition: the nearest representable value (ties to even
    /// mantissas), saturated at 448.
    #[test]
    fn fp8_rounds_to_nearest_even_saturates_and_reads_back_exactly() {
        let finite: Vec<(u8, f32)> = (0u8..=0x7e).map(|b| (b, e4m3_value(b))).collect();
        assert_eq!(e4m3_value(0x7e), 448.0);
        assert_eq!(e4m3_value(0x08), 1.0 / 64.0, "the smallest normal");
        assert_eq!(e4m3_value(0x01), 1.0 / 512.0, "the smallest subnormal");
        assert_eq!(e4m3_value(0x38), 1.0);
        assert!(e4m3_value(0x7f).is_nan() && e4m3_value(0xff).is_nan());
        assert_eq!(e4m3_value(0xb8), -1.0);
        for w in finite.windows(2) {
            assert!(w[0].1 < w[1].1, "monotonic at {:#x}", w[0].0);
        }
        // Each value and its sign flip round to themselves.
        for &(b, v) in &finite {
            assert_eq!(e4m3_bits(v), b, "{v}");
            assert_eq!(e4m3_bits(-v), b | 0x80, "{v}");
        }
        // Midpoints go to the even mantissa; just off them, to the nearer.
        for w in finite.windows(2) {
            let ((b0, v0), (b1, v1)) = (w[0], w[1]);
            let mid = (v0 + v1) / 2.0; // exact: few mantissa bits
            assert_eq!(e4m3_bits(mid), if b0 & 1 == 0 { b0 } else { b1 }, "{v0}..{v1}");
            assert_eq!(e4m3_bits(f32::from_bits(mid.to_bits() - 1)), b0);
            assert_eq!(e4m3_bits(f32::from_bits(mid.to_bits() + 1)), b1);
        }
        for x in [448.5f32, 464.0, 1e9, f32::MAX, f32::INFINITY] {
            assert_eq!(e4m3_bits(x), 0x7e, "{x} saturates");
            assert_eq!(e4m3_bits(-x), 0xfe);
        }
        assert_eq!(e4m3_bits(f32::NAN) & 0x7f, 0x7f);
        assert_eq!(e4m3_bits(1.0 / 1024.0), 0, "half the smallest subnormal: ties to 0");
        assert_eq!(e4m3_bits(f32::from_bits(1)), 0);
        assert_eq!(e4m3_bits(-0.0), 0x80);
    }

    #[test]
    fn q8_0_rows_quantize_as_llama_cpp_and_read_back_exactly() {
        // 40 values: a block of 32 and a short one of 8.
        let x: Vec<f32> = (0..40).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        let rb = KvType::Q8_0.row_bytes(40);
        assert_eq!(rb, 48, "40 quants + 2 scales, padded to 16");
        assert_eq!(KvType::Q8_0.row_bytes(512), 544);
        let mut row = vec![0xaau8; 2 * rb];
        KvType::Q8_0.put_row(&x, &mut row[rb..]);
        KvType::Q8_0.put_row(&x[..40].iter().map(|v| -v).collect::<Vec<_>>(), &mut row[..rb]);
        let rows = KvRows::Bytes { ty: KvType::Q8_0, data: &row, width: 40 };
        assert_eq!(rows.len(), 80);
        let mut buf = vec![0f32; 40];
        let got = rows.get(40, &mut buf).to_vec();
        for (b, blk) in x.chunks(32).enumerate() {
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = half::f16::from_f32(amax / 127.0).to_f32();
            for (i, &v) in blk.iter().enumerate() {
                let q = (v * (1.0 / (amax / 127.0))).round();
                let want = q * d;
                assert!((got[32 * b + i] - want).abs() <= d * 1e-3, "{b} {i}: {} vs {want}", got[32 * b + i]);
                assert!((got[32 * b + i] - v).abs() <= d * 0.5 + amax * 1e-3);
            }
        }
        // The first row holds the negated values; a read inside one row.
        let mut two = [0f32; 2];
        assert_eq!(rows.get(33, &mut two), &[-got[33], -got[34]]);
        // An all-zero block has scale 0 and quants 0; NaN quantizes to 0.
        let mut z = vec![0u8; KvType::Q8_0.row_bytes(32)];
        KvType::Q8_0.put_row(&[0.0; 32], &mut z);
        assert!(z.iter().all(|&b| b == 0));
        let mut nan = [1.0f32; 32];
        nan[3] = f32::NAN;
        KvType::Q8_0.put_row(&nan, &mut z);
        assert_eq!(z[3], 0);
        assert_eq!(z[0] as i8, 127);
    }

    #[test]
    fn q4_0_rows_quantize_as_llama_cpp_and_read_back_exactly() {
        // 40 values: a block of 32 and a short one of 8 (padded with zeros).
        let mut x: Vec<f32> = (0..40).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        x[5] = -3.0; // the block's largest magnitude, negative: d > 0
        x[9] = 3.0; // as large, later: the first one wins
        let t = KvType::Q4_0;
        assert_eq!(t.row_bytes(40), 48, "2 x 16 nibble bytes + 2 scales, padded to 16");
        assert_eq!(t.row_bytes(512), 288);
        let mut row = vec![0xaau8; 48];
        t.put_row(&x, &mut row);
        let mut got = vec![0f32; 40];
        KvRows::Bytes { ty: t, data: &row, width: 40 }.get(0, &mut got);
        for (b, blk) in x.chunks(32).enumerate() {
            let max = blk.iter().copied().fold(0f32, |m, v| if m.abs() < v.abs() { v } else { m });
            let d = max / -8.0;
            let dh = half::f16::from_f32(d).to_f32();
            for (i, &v) in blk.iter().enumerate() {
                let q = ((v * (1.0 / d) + 8.5) as i32).min(15);
                assert_eq!(got[32 * b + i], (q - 8) as f32 * dh, "{b} {i}");
                // Half a step, but a whole one on the side opposite the max (quant 16 clips to 15).
                assert!((got[32 * b + i] - v).abs() <= dh.abs() + max.abs() * 1e-3, "{b} {i}");
            }
        }
        assert_eq!(got[5], -3.0f32 / -8.0 * -8.0, "the max maps to quant 0: -8 d");
        // Read from the middle of the row (across the two blocks).
        let mut mid = [0f32; 4];
        assert_eq!(KvRows::Bytes { ty: t, data: &row, width: 40 }.get(30, &mut mid), &got[30..34]);
        // Padding is zeroed; a NaN quantizes to 8 (the value 0).
        assert!(row[36..].iter().all(|&b| b == 0));
        let mut nan = [1.0f32; 32];
        nan[3] = f32::NAN;
        let mut z = vec![0u8; t.row_bytes(32)];
        t.put_row(&nan, &mut z);
        assert_eq!(z[3] & 15, 8);
        assert_eq!(z[0] & 15, 0, "1.0 is the max: quant 0");
    }
}
