//! Dot products: every SIMD path against the scalar reference, and every dot
//! against the dequantized weights (the q8 activation error is the only gap).

use pulsar_gguf::GgmlType;
use pulsar_kernels::quant::{can_dot, random_blocks, random_values};
use pulsar_kernels::{dequantize, ActFormat, ActRow, Activations, Isa, Kernels, QuantError};

/// Every weight format with a dot.
fn dot_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .filter(|t| can_dot(*t))
        .collect()
}

/// Row widths to test: several block counts, and for the 32-block formats
/// widths that are not multiples of 256.
fn widths(ty: GgmlType) -> Vec<usize> {
    match ty.block_elems() {
        1 => vec![1, 7, 8, 31, 33, 100, 256, 1000, 4096],
        32 => vec![32, 64, 96, 160, 224, 1056, 4096],
        _ => vec![256, 512, 768, 2048, 4096],
    }
}

fn dequant(ty: GgmlType, b: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![0f32; n];
    dequantize(ty, b, &mut y).unwrap();
    y
}

/// The activation values the dot actually sees (dequantized q8, or the f32s).
fn act_values(a: &Activations, x: &[f32]) -> Vec<f32> {
    match a.format() {
        ActFormat::F32 => x.to_vec(),
        f => dequant(f.ggml_type(), a.as_bytes(), x.len()),
    }
}

#[test]
fn simd_matches_scalar_for_every_format_and_width() {
    let scalar = Kernels::scalar();
    let others: Vec<Kernels> = Isa::ALL
        .iter()
        .filter_map(|&i| Kernels::with_isa(i).ok())
        .filter(|k| k.isa() != Isa::Scalar)
        .collect();
    if others.is_empty() {
        eprintln!("no SIMD level on this CPU: nothing to compare");
    }
    for ty in dot_types() {
        for (wi, &n) in widths(ty).iter().enumerate() {
            let nb = n / ty.block_elems() as usize;
            let w = random_blocks(ty, nb, 1000 + wi as u64).unwrap();
            let x = random_values(n, 2000 + wi as u64);
            let a = Activations::for_weight(ty, &x, n).unwrap();
            let r = a.row(0).unwrap();
            let s = scalar.dot(ty, &w, r).unwrap();
            let mut per_isa = Vec::new();
            for k in &others {
                let v = k.dot(ty, &w, r).unwrap();
                // Every dot is defined by its scalar reference's order of
                // float operations (per-block integer sums scaled and added
                // block by block; the float formats in the canonical 32-lane
                // order), which the SIMD paths and the CUDA kernels reproduce.
                assert_eq!(
                    v.to_bits(),
                    s.to_bits(),
                    "{ty} n={n} {}: {v} vs scalar {s}",
                    k.isa()
                );
                per_isa.push(v);
            }
            // AVX2 and AVX-512 VNNI form the same integers and the same float
            // accumulation: identical for every format.
            for v in &per_isa {
                assert_eq!(
                    v.to_bits(),
                    per_isa[0].to_bits(),
                    "{ty} n={n}: SIMD levels differ"
                );
            }
        }
    }
}

#[test]
fn dot_equals_dequantized_dot_within_the_q8_bound() {
    for k in [Kernels::scalar(), Kernels::detect()] {
        for ty in dot_types() {
            for (wi, &n) in widths(ty).iter().enumerate() {
                let nb = n / ty.block_elems() as usize;
                let w = random_blocks(ty, nb, 3000 + wi as u64).unwrap();
                let x: Vec<f32> = random_values(n, 4000 + wi as u64)
                    .iter()
                    .map(|v| v * 3.0)
                    .collect();
                let a = Activations::for_weight(ty, &x, n).unwrap();
                let got = k.dot(ty, &w, a.row(0).unwrap()).unwrap() as f64;
                let wd = dequant(ty, &w, n);
                let exact: f64 = wd.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                // Per value, the most q8 can move x: half a step, plus the f16
                // rounding of the q8_0 scale (127 * 2^-11 of a step), per block amax.
                let fmt = a.format();
                let be = fmt.block_elems();
                let mut bound = 0f64;
                for (wb, xb) in wd.chunks(be).zip(x.chunks(be)) {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    let delta = match fmt {
                        ActFormat::F32 => 0.0,
                        ActFormat::Q8_0 => amax * (0.5 / 127.0 + 1.0 / 2048.0 + 1e-6),
                        ActFormat::Q8K => amax * (0.5 / 127.0 + 1e-6),
                    };
                    bound += delta * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
                }
                let mag: f64 = wd
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                bound += 2.0 * (n / be + 16) as f64 * f32::EPSILON as f64 * mag;
                assert!(
                    (got - exact).abs() <= bound,
                    "{ty} n={n} {}: dot {got}, dequantized {exact}, bound {bound}",
                    k.isa()
                );
            }
        }
    }
}

#[test]
fn q8_0_weights_with_minus_128_are_exact_in_simd() {
    // -128 is a legal q8_0 weight (files may hold it); |w| = 128 must not wrap.
    let mut w = random_blocks(GgmlType::Q8_0, 4, 5).unwrap();
    for b in w.chunks_exact_mut(34) {
        for q in &mut b[2..] {
            *q = 0x80;
        }
    }
    let x = random_values(128, 6);
    let a = Activations::for_weight(GgmlType::Q8_0, &x, 128).unwrap();
    let s = Kernels::scalar()
        .dot(GgmlType::Q8_0, &w, a.row(0).unwrap())
        .unwrap();
    let v = Kernels::detect()
        .dot(GgmlType::Q8_0, &w, a.row(0).unwrap())
        .unwrap();
    assert_eq!(s.to_bits(), v.to_bits(), "{s} vs {v}");
    let wd = dequant(GgmlType::Q8_0, &w, 128);
    let xd = act_values(&a, &x);
    let exact: f32 = wd.iter().zip(&xd).map(|(a, b)| a * b).sum();
    assert!(
        (s - exact).abs() <= 1e-4 * exact.abs().max(1.0),
        "{s} vs {exact}"
    );
}

#[test]
fn bad_inputs_are_errors() {
    let k = Kernels::detect();
    let w = random_blocks(GgmlType::Q4_K, 2, 1).unwrap();
    let x = random_values(512, 2);
    let q8k = Activations::quantize(ActFormat::Q8K, &x, 512).unwrap();
    let q80 = Activations::quantize(ActFormat::Q8_0, &x, 512).unwrap();
    assert!(k.dot(GgmlType::Q4_K, &w, q8k.row(0).unwrap()).is_ok());
    assert!(matches!(
        k.dot(GgmlType::Q4_K, &w, q80.row(0).unwrap()),
        Err(QuantError::WrongActivationFormat { .. })
    ));
    assert!(matches!(
        k.dot(GgmlType::Q4_K, &w[..144], q8k.row(0).unwrap()),
        Err(QuantError::LengthMismatch { .. })
    ));
    assert!(matches!(
        k.dot(GgmlType::F16, &[0u8; 6], ActRow::from_f32(&x[..4])),
        Err(QuantError::LengthMismatch { .. })
    ));
    assert!(matches!(
        k.dot(GgmlType::IQ1_S, &[], ActRow::from_f32(&[])),
        Err(QuantError::Unsupported { .. })
    ));
    // f32 weights take any width.
    let wf: Vec<u8> = x[..5].iter().flat_map(|v| v.to_le_bytes()).collect();
    let d = k
        .dot(GgmlType::F32, &wf, ActRow::from_f32(&x[..5]))
        .unwrap();
    let e: f32 = x[..5].iter().map(|v| v * v).sum();
    assert!((d - e).abs() <= 1e-5 * e);
}
