//! The formats a KV cache holds its rows in, on the CPU and CUDA alike: f32,
//! or f16 / bf16 bits (half the bytes, so half the bandwidth decode spends
//! reading the cache at long contexts). A row is rounded once when it is
//! written (round to nearest even, the conversion both backends use) and
//! widened exactly when it is read, so attention over a 16-bit cache is
//! attention over the rounded values, in the same order: CUDA equals the
//! CPU bit for bit in every format.

use std::fmt;
use std::str::FromStr;

/// A KV cache's element format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    #[default]
    F32,
    F16,
    Bf16,
}

impl KvType {
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Bf16];

    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 | KvType::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
        }
    }

    /// The 16-bit pattern `x` is stored as (f16 or bf16 only).
    pub fn bits(self, x: f32) -> u16 {
        match self {
            KvType::F16 => half::f16::from_f32(x).to_bits(),
            _ => bf16_bits(x),
        }
    }

    /// The value a 16-bit pattern holds, exactly.
    pub fn widen(self, b: u16) -> f32 {
        match self {
            KvType::F16 => half::f16::from_bits(b).to_f32(),
            _ => f32::from_bits((b as u32) << 16),
        }
    }

    /// `x` as this format stores it, widened back: what attention reads.
    pub fn round(self, x: f32) -> f32 {
        match self {
            KvType::F32 => x,
            t => t.widen(t.bits(x)),
        }
    }
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
            .ok_or_else(|| format!("unknown KV cache type {s:?} (expected f32, f16 or bf16)"))
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
}

impl<'a> KvRows<'a> {
    pub fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) | KvRows::Bf16(v) => v.len(),
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
        }
    }

    /// Values `[at, at + buf.len())` as f32: the cache's own slice for f32,
    /// else widened into `buf`.
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
            let r = KvType::Bf16.round(x);
            assert_eq!(KvType::Bf16.round(r).to_bits(), r.to_bits(), "{x}");
            assert!(r == x || (r - x).abs() <= x.abs() / 128.0, "{x} -> {r}");
        }
        assert!(KvType::Bf16.round(f32::NAN).is_nan());
        assert_eq!(bf16_bits(f32::MAX), 0x7f80, "overflow rounds to infinity");
    }

    #[test]
    fn f16_round_trips_and_names_parse() {
        assert_eq!(KvType::F16.round(1.0 + 1.0 / 4096.0), 1.0);
        assert_eq!(KvType::F16.round(65520.0), f32::INFINITY);
        for t in KvType::ALL {
            assert_eq!(t.name().parse::<KvType>(), Ok(t));
            assert_eq!(t.name().to_uppercase().parse::<KvType>(), Ok(t));
        }
        assert!("q8_0".parse::<KvType>().unwrap_err().contains("q8_0"));
    }

    #[test]
    fn rows_widen_each_format() {
        let v = [1.5f32, -2.0, 0.1];
        let h: Vec<u16> = v.iter().map(|&x| KvType::F16.bits(x)).collect();
        let b: Vec<u16> = v.iter().map(|&x| KvType::Bf16.bits(x)).collect();
        let mut buf = [0f32; 2];
        assert_eq!(KvRows::F32(&v).get(1, &mut buf), &v[1..3]);
        assert_eq!(KvRows::F16(&h).get(1, &mut buf), &[-2.0, KvType::F16.round(0.1)]);
        assert_eq!(KvRows::Bf16(&b).get(1, &mut buf), &[-2.0, KvType::Bf16.round(0.1)]);
    }
}
