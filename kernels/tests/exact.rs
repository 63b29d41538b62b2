//! Every SIMD dot equals the scalar reference bit for bit (proptest).
//!
//! The scalar `dot` of each format in `kernels/src/quant/*.rs` is the
//! definition the CUDA kernels reproduce too, so any SIMD level that differs
//! in the last bit would make the CPU and the GPU disagree. Checked for every
//! format with a dot, random row lengths (1..=40 blocks of 32 values, 1..=6
//! superblocks of 256, any width for the float formats), weights either random
//! valid bits or the real quantizer's output, and activations quantized by the
//! real activation quantizers from vectors with varied per-block magnitudes
//! (zero blocks and outliers included).

use proptest::prelude::*;
use pulsar_gguf::GgmlType;
use pulsar_kernels::quant::{can_dot, can_quantize, random_blocks};
use pulsar_kernels::{quantize, Activations, Isa, Kernels};

fn dot_types() -> Vec<GgmlType> {
    GgmlType::ALL.iter().copied().filter(|t| can_dot(*t)).collect()
}

/// Every SIMD level this CPU runs (the scalar path is the reference).
fn simd_levels() -> Vec<Kernels> {
    Isa::ALL
        .iter()
        .filter(|&&i| i != Isa::Scalar)
        .filter_map(|&i| Kernels::with_isa(i).ok())
        .collect()
}

/// Values with a magnitude per run of 16 (some runs all zero), an overall
/// power-of-two scale and occasional outliers.
fn values(n: usize, seed: u64, scale_exp: i32) -> Vec<f32> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut mag = 0f32;
    (0..n)
        .map(|i| {
            if i % 16 == 0 {
                let r = next();
                mag = if r % 11 == 0 { 0.0 } else { (r >> 40) as f32 / (1u64 << 24) as f32 + 0.01 };
            }
            let r = next();
            let u = (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let out = if r % 97 == 0 { 16.0 } else { 1.0 };
            u * mag * out * 2f32.powi(scale_exp)
        })
        .collect()
}

fn check(ty: GgmlType, blocks: usize, seed: u64, scale_exp: i32, quantized_w: bool) -> Result<(), TestCaseError> {
    let be = ty.block_elems() as usize;
    let n = blocks * be;
    let w = if quantized_w && can_quantize(ty) {
        let mut b = vec![0u8; blocks * ty.block_bytes() as usize];
        quantize(ty, &values(n, seed ^ 0x5555, 0), &mut b).unwrap();
        b
    } else {
        random_blocks(ty, blocks, seed).unwrap()
    };
    let x = values(n, seed.rotate_left(17) ^ 0xabcd, scale_exp);
    let a = Activations::for_weight(ty, &x, n).unwrap();
    let r = a.row(0).unwrap();
    let s = Kernels::scalar().dot(ty, &w, r).unwrap();
    for k in simd_levels() {
        let v = k.dot(ty, &w, r).unwrap();
        prop_assert_eq!(v.to_bits(), s.to_bits(), "{} n={} {}: {} vs scalar {}", ty, n, k.isa(), v, s);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn simd_dots_equal_the_scalar_reference(
        seed in any::<u64>(),
        blocks32 in 1usize..=40,
        blocks256 in 1usize..=6,
        width in 1usize..=300,
        scale_exp in -6i32..6,
        quantized_w in any::<bool>(),
    ) {
        for ty in dot_types() {
            let blocks = match ty.block_elems() {
                1 => width,
                32 => blocks32,
                _ => blocks256,
            };
            check(ty, blocks, seed, scale_exp, quantized_w)?;
        }
    }
}

#[test]
fn long_rows_are_exact_too() {
    // Rows as long as real models have (and the gemma-3 widths 640 / 2048).
    for ty in dot_types() {
        let be = ty.block_elems() as usize;
        for n in [640usize, 2048, 4096, 16384] {
            if n % be == 0 {
                check(ty, n / be, n as u64 * 31 + be as u64, 0, false).unwrap();
                check(ty, n / be, n as u64 * 37 + be as u64, 2, true).unwrap();
            }
        }
    }
}
