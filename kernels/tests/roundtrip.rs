//! quantize -> dequantize round trips over random vectors (proptest), each
//! format against a stated bound.
//!
//! Float formats: f32 exact; f16 within 2^-11 relative (2^-25 absolute for
//! subnormals); bf16 within 2^-8 relative.
//!
//! Integer formats, with `step` the level spacing of each block or sub-block
//! (q8_0: amax/127, q8_K: amax/127, q4_0: amax/8, q5_0: amax/16,
//! q4_1: (max-min)/15, q5_1: (max-min)/31, q4_K: (max - min(0, min))/15 per 32,
//! q5_K: the same /31 per 32, q2_K: the same /3 per 16, q3_K: amax/4 per 16,
//! q6_K: amax/32 per 16):
//! - RMSE <= 0.35 * RMS(step) (0.40 for q3_K and q6_K, whose extreme level is
//!   clamped and whose signed scale codes round): nearest rounding alone gives
//!   step/sqrt(12) = 0.289 step; anything biased (truncation, a wrong scale) is
//!   far above;
//! - max error (the 32-block formats and q8_K): half a step, plus the f16
//!   rounding of the stored scale (times the largest level) and min, except
//!   one step at the clamped end of q4_0/q5_0.

use proptest::prelude::*;
use pulsar_gguf::GgmlType;
use pulsar_kernels::{dequantize, quantize};

const EPS16: f32 = 1.0 / 2048.0;

/// Most that rounding `v` to f16 moves it: half an ulp, 2^-11 relative, or
/// 2^-25 absolute among the subnormals.
fn f16err(v: f32) -> f32 {
    (v.abs() * EPS16).max(2f32.powi(-25))
}

/// Vectors of 1-3 superblocks: uniform values, sub-blocks of 16 with their own
/// magnitude, an overall power-of-two scale, optionally all positive, optionally
/// with outliers.
fn vectors() -> impl Strategy<Value = Vec<f32>> {
    (1usize..=3, -8i32..8, 0u8..3).prop_flat_map(|(nb, e, mode)| {
        (
            prop::collection::vec(-1f32..1.0, nb * 256),
            prop::collection::vec(0.05f32..1.0, nb * 16),
        )
            .prop_map(move |(mut x, mags)| {
                let s = (2f32).powi(e);
                for (i, v) in x.iter_mut().enumerate() {
                    *v *= mags[i / 16] * s;
                    if mode == 1 {
                        *v = v.abs();
                    }
                    if mode == 2 && i % 41 == 0 {
                        *v *= 8.0;
                    }
                }
                x
            })
    })
}

fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    let mut b = vec![0u8; x.len() / ty.block_elems() as usize * ty.block_bytes() as usize];
    quantize(ty, x, &mut b).unwrap();
    let mut y = vec![0f32; x.len()];
    dequantize(ty, &b, &mut y).unwrap();
    y
}

fn amax(c: &[f32]) -> f32 {
    c.iter().fold(0f32, |m, v| m.max(v.abs()))
}
fn range(c: &[f32], floor_at_zero: bool) -> f32 {
    let hi = c.iter().fold(f32::MIN, |m, v| m.max(*v));
    let lo = c
        .iter()
        .fold(if floor_at_zero { 0.0 } else { f32::MAX }, |m, v| m.min(*v));
    hi - lo
}

/// RMSE of the round trip over RMS of the per-run step.
fn rmse_over_step(x: &[f32], y: &[f32], run: usize, step: impl Fn(&[f32]) -> f32) -> f64 {
    let mse: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        / x.len() as f64;
    let s2: f64 =
        x.chunks(run).map(|c| (step(c) as f64).powi(2)).sum::<f64>() / (x.len() / run) as f64;
    if s2 == 0.0 {
        return if mse == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (mse / s2).sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn floats(x in vectors()) {
        let y = round_trip(GgmlType::F32, &x);
        prop_assert!(x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()));
        for (a, b) in x.iter().zip(round_trip(GgmlType::F16, &x)) {
            prop_assert!((a - b).abs() <= (a.abs() * EPS16).max(2f32.powi(-25)), "f16 {a} {b}");
        }
        for (a, b) in x.iter().zip(round_trip(GgmlType::BF16, &x)) {
            prop_assert!((a - b).abs() <= a.abs() / 256.0, "bf16 {a} {b}");
        }
    }

    #[test]
    fn q8_formats(x in vectors()) {
        let y = round_trip(GgmlType::Q8_0, &x);
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let a = amax(xb);
            for (u, v) in xb.iter().zip(yb) {
                let d = a / 127.0;
                prop_assert!((u - v).abs() <= (0.5 * d + 127.0 * f16err(d)) * 1.0001, "q8_0 {u} {v}");
            }
        }
        prop_assert!(rmse_over_step(&x, &y, 32, |c| amax(c) / 127.0) <= 0.35);
        let y = round_trip(GgmlType::Q8_K, &x);
        for (xb, yb) in x.chunks(256).zip(y.chunks(256)) {
            let a = amax(xb);
            for (u, v) in xb.iter().zip(yb) {
                prop_assert!((u - v).abs() <= a * (0.5 / 127.0) * 1.0001, "q8_K {u} {v}");
            }
        }
    }

    #[test]
    fn q4_0_and_q5_0(x in vectors()) {
        for (ty, half_levels) in [(GgmlType::Q4_0, 8.0f32), (GgmlType::Q5_0, 16.0)] {
            let y = round_trip(ty, &x);
            for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
                let step = amax(xb) / half_levels;
                // The extreme value maps to -half_levels; its opposite clamps one step short.
                let f16 = half_levels * f16err(step);
                for (u, v) in xb.iter().zip(yb) {
                    prop_assert!((u - v).abs() <= (step + f16) * 1.0001, "{ty} {u} {v}");
                }
            }
            prop_assert!(rmse_over_step(&x, &y, 32, |c| amax(c) / half_levels) <= 0.35, "{ty}");
        }
    }

    #[test]
    fn q4_1_and_q5_1(x in vectors()) {
        for (ty, levels) in [(GgmlType::Q4_1, 15.0f32), (GgmlType::Q5_1, 31.0)] {
            let y = round_trip(ty, &x);
            for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
                let step = range(xb, false) / levels;
                let min = xb.iter().fold(f32::MAX, |m, v| m.min(*v));
                let f16 = levels * f16err(step) + f16err(min);
                for (u, v) in xb.iter().zip(yb) {
                    prop_assert!((u - v).abs() <= (0.5 * step + f16) * 1.0001, "{ty} {u} {v}");
                }
            }
            prop_assert!(rmse_over_step(&x, &y, 32, |c| range(c, false) / levels) <= 0.35, "{ty}");
        }
    }

    #[test]
    fn k_quants(x in vectors()) {
        let y = round_trip(GgmlType::Q4_K, &x);
        prop_assert!(rmse_over_step(&x, &y, 32, |c| range(c, true) / 15.0) <= 0.35, "q4_K");
        let y = round_trip(GgmlType::Q2_K, &x);
        prop_assert!(rmse_over_step(&x, &y, 16, |c| range(c, true) / 3.0) <= 0.35, "q2_K");
        let y = round_trip(GgmlType::Q6_K, &x);
        prop_assert!(rmse_over_step(&x, &y, 16, |c| amax(c) / 32.0) <= 0.40, "q6_K");
        let y = round_trip(GgmlType::Q5_K, &x);
        prop_assert!(rmse_over_step(&x, &y, 32, |c| range(c, true) / 31.0) <= 0.35, "q5_K");
        let y = round_trip(GgmlType::Q3_K, &x);
        prop_assert!(rmse_over_step(&x, &y, 16, |c| amax(c) / 4.0) <= 0.40, "q3_K");
    }
}

#[test]
fn zeros_and_constants_round_trip_exactly() {
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_K,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let z = vec![0f32; 512];
        assert_eq!(round_trip(ty, &z), z, "{ty}");
    }
    // A constant run is one level of the min/max formats (the min itself).
    for ty in [GgmlType::Q4_1, GgmlType::Q5_1] {
        let c = vec![-0.75f32; 64];
        assert_eq!(round_trip(ty, &c), c, "{ty}");
    }
}

#[test]
fn quantize_checks_lengths_and_support() {
    let x = vec![0.5f32; 256];
    let mut b = vec![0u8; 144];
    assert!(quantize(GgmlType::Q4_K, &x, &mut b).is_ok());
    assert!(quantize(GgmlType::Q4_K, &x, &mut b[..143]).is_err());
    assert!(quantize(GgmlType::Q4_K, &x[..255], &mut b).is_err());
    assert!(quantize(GgmlType::IQ2_XXS, &x, &mut b[..66]).is_err());
    let mut y = vec![0f32; 256];
    assert!(dequantize(GgmlType::Q4_K, &b[..143], &mut y).is_err());
    assert!(dequantize(GgmlType::Q4_K, &b, &mut y[..255]).is_err());
    assert!(dequantize(GgmlType::IQ1_S, &b[..50], &mut y).is_err());
}
