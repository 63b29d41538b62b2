//! The real gemma-3-270m Q4_K_M weights (q4_K, q6_K, q5_0 at width 640, q8_0,
//! f32): every tensor dequantizes to finite values, and the matvec of one
//! tensor of each quant type agrees between the scalar and SIMD paths and with
//! the dequantized weights (within the q8 activation bound).

use std::path::PathBuf;

use pulsar_gguf::{GgmlType, GgufFile, TensorInfo};
use pulsar_kernels::quant::random_values;
use pulsar_kernels::{dequantize, ActFormat, Activations, Kernels, WeightMatrix};

fn gemma() -> GgufFile {
    let p = std::env::var_os("PULSAR_GEMMA_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root/.cache/pulsar/models/gemma-3-270m-Q4_K_M.gguf"));
    assert!(
        p.is_file(),
        "gemma-3-270m GGUF not found at {}: run scripts/fetch-gemma.sh (or set PULSAR_GEMMA_GGUF)",
        p.display()
    );
    GgufFile::open(&p).unwrap()
}

fn cols_rows(t: &TensorInfo) -> (usize, usize) {
    let cols = t.dims[0] as usize;
    (cols, (t.n_elements() as usize) / cols)
}

#[test]
fn every_tensor_dequantizes_to_finite_values() {
    let f = gemma();
    let mut types = std::collections::BTreeSet::new();
    for t in f.tensors() {
        let (cols, rows) = cols_rows(t);
        let data = f.data(t);
        // At most 64 rows per tensor (all of the small ones), so the test stays quick.
        let n = rows.min(64);
        let rb = data.len() / rows;
        let mut y = vec![0f32; n * cols];
        dequantize(t.ty, &data[..n * rb], &mut y).unwrap();
        assert!(y.iter().all(|v| v.is_finite()), "{}", t.name);
        assert!(y.iter().any(|v| *v != 0.0), "{}", t.name);
        types.insert(t.ty);
    }
    let want: std::collections::BTreeSet<_> = [
        GgmlType::F32,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ]
    .into_iter()
    .collect();
    assert_eq!(types, want);
}

#[test]
fn real_matvecs_agree_across_paths_and_with_dequantized_weights() {
    let f = gemma();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
    ] {
        // The first 2-D tensor of the type (for q8_0 not the 262k-row embedding).
        let t = f
            .tensors()
            .iter()
            .find(|t| t.ty == ty && t.dims.len() == 2 && t.dims[1] <= 4096)
            .expect("tensor");
        let (cols, rows) = cols_rows(t);
        let data = f.data(t);
        let w = WeightMatrix::new(ty, data, rows, cols).unwrap();
        let x = random_values(cols, 5);
        let a = Activations::for_weight(ty, &x, cols).unwrap();
        let (mut ys, mut yv) = (vec![0f32; rows], vec![0f32; rows]);
        Kernels::scalar().matvec(&pool, &w, &a, &mut ys).unwrap();
        Kernels::detect().matvec(&pool, &w, &a, &mut yv).unwrap();
        let mut wd = vec![0f32; rows * cols];
        dequantize(ty, data, &mut wd).unwrap();
        let xq = {
            let mut v = vec![0f32; cols];
            dequantize(a.format().ggml_type(), a.as_bytes(), &mut v).unwrap();
            v
        };
        let be = a.format().block_elems();
        for r in 0..rows {
            let wr = &wd[r * cols..(r + 1) * cols];
            let mag: f64 = wr
                .iter()
                .zip(&xq)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            // Paths: exact for q8_K dots, float reordering otherwise.
            let tol = if a.format() == ActFormat::Q8K {
                0.0
            } else {
                (cols / 32 + 16) as f64 * f32::EPSILON as f64 * mag
            };
            assert!(
                ((ys[r] - yv[r]) as f64).abs() <= tol,
                "{} row {r}: scalar {} simd {}",
                t.name,
                ys[r],
                yv[r]
            );
            // Against f32 weights times f32 activations: the q8 step bound.
            let exact: f64 = wr.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mut bound = 2.0 * (cols / be + 16) as f64 * f32::EPSILON as f64 * mag;
            for (wb, xb) in wr.chunks(be).zip(x.chunks(be)) {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                let delta = amax * (0.5 / 127.0 + if be == 32 { 1.0 / 2048.0 } else { 0.0 } + 1e-6);
                bound += delta * wb.iter().map(|v| v.abs() as f64).sum::<f64>();
            }
            assert!(
                (ys[r] as f64 - exact).abs() <= bound,
                "{} row {r}: {} vs {exact} (bound {bound})",
                t.name,
                ys[r]
            );
        }
    }
}
