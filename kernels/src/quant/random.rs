//! Random but valid blocks of any format, for tests, benchmarks and GPU-twin
//! checks: random bits everywhere, except that every scale field holds a
//! finite value of sane size (so dequantized values are finite) and `q8_K`
//! blocks are self-consistent (quants in [-127, 127], true `bsums`).

use pulsar_gguf::GgmlType;

use super::{can_dequantize, geometry, wr_f16};
use crate::error::QuantError;

/// SplitMix64: tiny, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly normal (sum of four uniforms, centred and scaled).
    fn normalish(&mut self) -> f32 {
        ((self.unit() + self.unit() + self.unit() + self.unit()) - 2.0) * 1.732
    }
    /// A scale: magnitude 2^-12 .. 2^0, either sign.
    fn scale(&mut self) -> f32 {
        let m = (2f32).powf(-12.0 * self.unit());
        if self.next() & 1 == 1 {
            -m
        } else {
            m
        }
    }
}

/// Offsets of the f16 scale fields in one block.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ2_XXS | IQ2_XS | IQ3_XXS => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// `n_blocks` random valid blocks of `ty` (see the module docs), reproducible from `seed`.
pub fn random_blocks(ty: GgmlType, n_blocks: usize, seed: u64) -> Result<Vec<u8>, QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::Unsupported {
            ty,
            op: "random_blocks",
        });
    }
    let (_, bb) = geometry(ty);
    let mut rng = Rng(seed ^ (ty.id() as u64) << 32);
    let mut out = vec![0u8; n_blocks * bb];
    match ty {
        GgmlType::F32 => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.normalish().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in out.chunks_exact_mut(2) {
                wr_f16(c, 0, rng.normalish());
            }
        }
        GgmlType::BF16 => {
            for c in out.chunks_exact_mut(2) {
                c.copy_from_slice(&super::bf16::from_f32(rng.normalish()).to_le_bytes());
            }
        }
        GgmlType::Q8_K => {
            let x: Vec<f32> = (0..n_blocks * 256)
                .map(|_| rng.normalish() * rng.scale().abs())
                .collect();
            super::q8_k::quantize(&x, &mut out);
        }
        _ => {
            for c in out.chunks_mut(8) {
                let v = rng.next().to_le_bytes();
                c.copy_from_slice(&v[..c.len()]);
            }
            for b in out.chunks_exact_mut(bb) {
                for &o in f16_fields(ty) {
                    wr_f16(b, o, rng.scale());
                }
            }
        }
    }
    Ok(out)
}

/// Random valid blocks whose every f16 scale field is `scale` (random quant
/// bits otherwise), for synthetic models: dequantized values are linear in
/// `scale`, so a caller can pick it for a target spread. Fast (no fitting),
/// unlike [`super::quantize`] of random values for the K and IQ formats.
pub fn random_blocks_scaled(ty: GgmlType, n_blocks: usize, seed: u64, scale: f32) -> Result<Vec<u8>, QuantError> {
    let fields = f16_fields(ty);
    if fields.is_empty() || !can_dequantize(ty) {
        return Err(QuantError::Unsupported { ty, op: "random_blocks_scaled" });
    }
    let (_, bb) = geometry(ty);
    let mut rng = Rng(seed ^ (ty.id() as u64) << 32);
    let mut out = vec![0u8; n_blocks * bb];
    for c in out.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
    for b in out.chunks_exact_mut(bb) {
        for &o in fields {
            wr_f16(b, o, scale);
        }
    }
    Ok(out)
}

/// `n` roughly normal values (mean 0, sd 1), reproducible from `seed`.
pub fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n).map(|_| rng.normalish()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_blocks_scale_linearly() {
        for ty in [GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::IQ2_XXS] {
            let (be, _) = geometry(ty);
            let rms = |s: f32| {
                let b = random_blocks_scaled(ty, 4, 3, s).unwrap();
                let mut y = vec![0f32; 4 * be];
                super::super::dequantize(ty, &b, &mut y).unwrap();
                (y.iter().map(|v| v * v).sum::<f32>() / y.len() as f32).sqrt()
            };
            let (a, b) = (rms(1.0), rms(0.25));
            assert!(a > 0.0 && ((b / a) - 0.25).abs() < 1e-3, "{ty}: {a} {b}");
        }
        assert!(random_blocks_scaled(GgmlType::F32, 1, 0, 1.0).is_err());
    }

    #[test]
    fn every_format_dequantizes_to_finite_values() {
        for &ty in GgmlType::ALL.iter().filter(|t| can_dequantize(**t)) {
            let (be, _) = geometry(ty);
            let b = random_blocks(ty, 3, 7).unwrap();
            let mut y = vec![0f32; 3 * be];
            super::super::dequantize(ty, &b, &mut y).unwrap();
            assert!(y.iter().all(|v| v.is_finite()), "{ty}");
            assert!(y.iter().any(|v| *v != 0.0), "{ty}");
            assert_eq!(random_blocks(ty, 3, 7).unwrap(), b, "{ty}: seeded");
            assert_ne!(random_blocks(ty, 3, 8).unwrap(), b, "{ty}: seed matters");
        }
        assert!(random_blocks(GgmlType::IQ1_S, 1, 0).is_err());
    }
}
