//! `Kernels::dot_rows` is `Kernels::dot` of every row, bit for bit, at every
//! ISA level this CPU runs: random and quantized rows, row counts around the
//! kernels' four-row groups, one and many blocks a row.

use pulsar_gguf::GgmlType;
use pulsar_kernels::quant::{can_dot, can_quantize, random_blocks, random_values};
use pulsar_kernels::{quantize, ActFormat, ActRow, Activations, Isa, Kernels, QuantError};

fn levels() -> Vec<Kernels> {
    Isa::ALL
        .iter()
        .filter_map(|&i| Kernels::with_isa(i).ok())
        .collect()
}

fn dot_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .filter(|t| can_dot(*t))
        .collect()
}

/// Weights for `rows` rows of `n` values: random valid blocks, or (`quantized`)
/// the real quantizer's output of values with varied per-row magnitude.
fn weights(ty: GgmlType, rows: usize, n: usize, seed: u64, quantized: bool) -> Vec<u8> {
    let nb = rows * n / ty.block_elems() as usize;
    if quantized && can_quantize(ty) {
        let v: Vec<f32> = random_values(rows * n, seed)
            .iter()
            .enumerate()
            .map(|(i, v)| v * (1 + (i / n) % 5) as f32 * 0.1)
            .collect();
        let mut b = vec![0u8; nb * ty.block_bytes() as usize];
        quantize(ty, &v, &mut b).unwrap();
        b
    } else {
        random_blocks(ty, nb, seed).unwrap()
    }
}

fn check(k: Kernels, ty: GgmlType, rows: usize, n: usize, seed: u64, quantized: bool) {
    let w = weights(ty, rows, n, seed, quantized);
    let x: Vec<f32> = random_values(n, seed ^ 0x9e37)
        .iter()
        .enumerate()
        // Some all-zero 16-value runs and an outlier, as real activations have,
        // and (some seeds) a whole zero 256-value block.
        .map(|(i, v)| {
            if (i / 16) % 7 == 3 || (seed % 3 == 1 && i / 256 == 1) {
                0.0
            } else if i % 97 == 5 {
                v * 20.0
            } else {
                *v
            }
        })
        .collect();
    let a = Activations::for_weight(ty, &x, n).unwrap();
    let r = a.row(0).unwrap();
    let rb = w.len() / rows;
    let mut got = vec![f32::NAN; rows];
    k.dot_rows(ty, &w, rows, r, &mut got).unwrap();
    for (i, g) in got.iter().enumerate() {
        let want = k.dot(ty, &w[i * rb..(i + 1) * rb], r).unwrap();
        let scalar = Kernels::scalar()
            .dot(ty, &w[i * rb..(i + 1) * rb], r)
            .unwrap();
        assert_eq!(
            g.to_bits(),
            want.to_bits(),
            "{ty} {} rows={rows} n={n} row {i}: {g} vs dot {want}",
            k.isa()
        );
        assert_eq!(
            g.to_bits(),
            scalar.to_bits(),
            "{ty} {} rows={rows} n={n} row {i}: {g} vs scalar {scalar}",
            k.isa()
        );
    }
}

#[test]
fn dot_rows_equals_dot_for_every_format_and_level() {
    for k in levels() {
        for ty in dot_types() {
            let be = ty.block_elems() as usize;
            let widths: Vec<usize> = match be {
                1 => vec![1, 33, 256],
                32 => vec![32, 64, 96, 128, 160, 224, 288, 4096],
                _ => vec![256, 512, 1280, 4096],
            };
            for (wi, &n) in widths.iter().enumerate() {
                for rows in [1usize, 2, 3, 4, 5, 7, 8, 9, 13] {
                    let seed = (wi * 100 + rows) as u64 * 7919 + be as u64;
                    check(k, ty, rows, n, seed, rows % 2 == 0);
                }
            }
        }
    }
}

#[test]
fn dot_rows_seeded_sweep_for_the_multi_row_kernels() {
    // The formats with multi-row kernels, many seeds and shapes.
    for k in levels() {
        for ty in [
            GgmlType::Q2_K,
            GgmlType::Q8_0,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q4_0,
            GgmlType::Q5_0,
            GgmlType::Q4_1,
            GgmlType::Q5_1,
            GgmlType::Q6_K,
        ] {
            let be = ty.block_elems() as usize;
            for seed in 0..40u64 {
                let rows = 1 + (seed as usize * 7) % 11;
                let blocks = 1 + (seed as usize * 13) % if be == 32 { 37 } else { 9 };
                check(k, ty, rows, blocks * be, seed * 104729 + 17, seed % 3 == 0);
            }
        }
    }
}

#[test]
fn q8_0_minus_128_weights_in_dot_rows() {
    let ty = GgmlType::Q8_0;
    let mut w = random_blocks(ty, 5 * 7, 3).unwrap();
    for (i, b) in w.chunks_exact_mut(34).enumerate() {
        for q in &mut b[2 + i % 3..] {
            *q = 0x80;
        }
    }
    let x = random_values(7 * 32, 4);
    let a = Activations::for_weight(ty, &x, 7 * 32).unwrap();
    for k in levels() {
        let mut got = vec![0f32; 5];
        k.dot_rows(ty, &w, 5, a.row(0).unwrap(), &mut got).unwrap();
        for (i, g) in got.iter().enumerate() {
            let want = Kernels::scalar()
                .dot(ty, &w[i * 238..(i + 1) * 238], a.row(0).unwrap())
                .unwrap();
            assert_eq!(g.to_bits(), want.to_bits(), "{} row {i}", k.isa());
        }
    }
}

#[test]
fn dot_rows_bad_inputs_are_errors() {
    let k = Kernels::detect();
    let w = random_blocks(GgmlType::Q2_K, 6, 1).unwrap();
    let x = random_values(512, 2);
    let q8k = Activations::quantize(ActFormat::Q8K, &x, 512).unwrap();
    let q80 = Activations::quantize(ActFormat::Q8_0, &x, 512).unwrap();
    let mut out = [0f32; 3];
    assert!(k
        .dot_rows(GgmlType::Q2_K, &w, 3, q8k.row(0).unwrap(), &mut out)
        .is_ok());
    assert!(matches!(
        k.dot_rows(GgmlType::Q2_K, &w, 3, q80.row(0).unwrap(), &mut out),
        Err(QuantError::WrongActivationFormat { .. })
    ));
    assert!(matches!(
        k.dot_rows(GgmlType::Q2_K, &w, 2, q8k.row(0).unwrap(), &mut out),
        Err(QuantError::LengthMismatch { .. })
    ));
    assert!(matches!(
        k.dot_rows(
            GgmlType::Q2_K,
            &w[..84 * 5],
            3,
            q8k.row(0).unwrap(),
            &mut out[..3]
        ),
        Err(QuantError::LengthMismatch { .. })
    ));
    assert!(k
        .dot_rows(GgmlType::Q2_K, &[], 0, q8k.row(0).unwrap(), &mut [])
        .is_ok());
    assert!(matches!(
        k.dot_rows(GgmlType::IQ1_S, &[], 0, ActRow::from_f32(&[]), &mut []),
        Err(QuantError::Unsupported { .. })
    ));
    let mut one = [f32::NAN; 2];
    assert!(k
        .dot_rows(GgmlType::F32, &[], 2, ActRow::from_f32(&[]), &mut one)
        .is_ok());
    assert_eq!(one, [0.0, 0.0]);
}
