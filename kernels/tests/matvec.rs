//! matvec / matmul: each output is exactly the row's dot, whatever the thread
//! count or tiling, and matmul equals matvec token by token.

use pulsar_gguf::GgmlType;
use pulsar_kernels::quant::{can_dot, random_blocks, random_values};
use pulsar_kernels::{ActFormat, Activations, Kernels, QuantError, WeightMatrix};
use rayon::{ThreadPool, ThreadPoolBuilder};

fn pool(n: usize) -> ThreadPool {
    ThreadPoolBuilder::new().num_threads(n).build().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn matvec_is_the_row_dots_on_any_thread_count() {
    let pools = [pool(1), pool(2), pool(3)];
    for ty in GgmlType::ALL.iter().copied().filter(|t| can_dot(*t)) {
        let cols = match ty.block_elems() {
            1 => 200,
            32 => 96 * 3, // not a multiple of 256
            _ => 512,
        };
        // Enough rows that the threaded path (not the serial shortcut) runs.
        let rows = (300 * 1024 / (cols * ty.block_bytes() as usize / ty.block_elems() as usize))
            .max(64)
            + 3;
        let nb = rows * cols / ty.block_elems() as usize;
        let data = random_blocks(ty, nb, 11).unwrap();
        let w = WeightMatrix::new(ty, &data, rows, cols).unwrap();
        let x = random_values(cols, 12);
        for k in [Kernels::scalar(), Kernels::detect()] {
            let a = Activations::for_weight(ty, &x, cols).unwrap();
            let want: Vec<f32> = (0..rows)
                .map(|r| k.dot(ty, w.row(r), a.row(0).unwrap()).unwrap())
                .collect();
            for p in &pools {
                let mut y = vec![f32::NAN; rows];
                k.matvec(p, &w, &a, &mut y).unwrap();
                assert_eq!(
                    bits(&y),
                    bits(&want),
                    "{ty} {} threads={}",
                    k.isa(),
                    p.current_num_threads()
                );
            }
            let mut y = vec![0f32; rows];
            k.matvec_f32(&pools[1], &w, &x, &mut y).unwrap();
            assert_eq!(bits(&y), bits(&want), "{ty} matvec_f32");
        }
    }
}

#[test]
fn matmul_equals_matvec_per_token() {
    let p = pool(2);
    let k = Kernels::detect();
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q8_0,
        GgmlType::IQ2_XS,
        GgmlType::F16,
    ] {
        let (rows, cols) = (37, 512);
        let data = random_blocks(ty, rows * cols / ty.block_elems() as usize, 21).unwrap();
        let w = WeightMatrix::new(ty, &data, rows, cols).unwrap();
        for n_tok in [1, 5, 16, 17, 40] {
            let x = random_values(n_tok * cols, 22 + n_tok as u64);
            let a = Activations::for_weight(ty, &x, cols).unwrap();
            let mut y = vec![f32::NAN; n_tok * rows];
            k.matmul(&p, &w, &a, &mut y).unwrap();
            let fmt = ActFormat::for_weight(ty).unwrap();
            for t in 0..n_tok {
                let one = Activations::quantize(fmt, &x[t * cols..(t + 1) * cols], cols).unwrap();
                let mut yt = vec![0f32; rows];
                k.matvec(&p, &w, &one, &mut yt).unwrap();
                assert_eq!(
                    bits(&y[t * rows..(t + 1) * rows]),
                    bits(&yt),
                    "{ty} n_tok={n_tok} t={t}"
                );
            }
        }
    }
}

#[test]
fn matmul_threads_do_not_change_results_on_a_big_prefill() {
    let ty = GgmlType::Q6_K;
    let (rows, cols, n_tok) = (256, 1024, 33);
    let data = random_blocks(ty, rows * cols / 256, 31).unwrap();
    let w = WeightMatrix::new(ty, &data, rows, cols).unwrap();
    let a = Activations::for_weight(ty, &random_values(n_tok * cols, 32), cols).unwrap();
    let k = Kernels::detect();
    let mut y1 = vec![0f32; n_tok * rows];
    let mut y3 = vec![0f32; n_tok * rows];
    k.matmul(&pool(1), &w, &a, &mut y1).unwrap();
    k.matmul(&pool(3), &w, &a, &mut y3).unwrap();
    assert_eq!(bits(&y1), bits(&y3));
}

#[test]
fn shapes_and_formats_are_checked() {
    let p = pool(1);
    let k = Kernels::scalar();
    let data = random_blocks(GgmlType::Q4_0, 8, 1).unwrap();
    assert!(WeightMatrix::new(GgmlType::Q4_0, &data, 4, 64).is_ok());
    assert!(matches!(
        WeightMatrix::new(GgmlType::Q4_0, &data, 3, 64),
        Err(QuantError::LengthMismatch { .. })
    ));
    assert!(matches!(
        WeightMatrix::new(GgmlType::Q4_0, &data, 4, 60),
        Err(QuantError::NotWholeBlocks { .. })
    ));
    assert!(matches!(
        WeightMatrix::new(GgmlType::IQ1_S, &data, 1, 256),
        Err(QuantError::Unsupported { .. })
    ));
    let w = WeightMatrix::new(GgmlType::Q4_0, &data, 4, 64).unwrap();
    let x = random_values(128, 2);
    let a = Activations::quantize(ActFormat::Q8_0, &x, 64).unwrap();
    let mut y = vec![0f32; 4];
    // Two rows of activations are not a matvec, but are a matmul.
    assert!(matches!(
        k.matvec(&p, &w, &a, &mut y),
        Err(QuantError::LengthMismatch { .. })
    ));
    let mut y2 = vec![0f32; 8];
    assert!(k.matmul(&p, &w, &a, &mut y2).is_ok());
    assert!(matches!(
        k.matmul(&p, &w, &a, &mut y),
        Err(QuantError::LengthMismatch { .. })
    ));
    let wrong = Activations::quantize(ActFormat::Q8K, &random_values(256, 3), 256).unwrap();
    assert!(k.matvec(&p, &w, &wrong, &mut y).is_err());
    let a_f32 = Activations::quantize(ActFormat::F32, &x[..64], 64).unwrap();
    assert!(matches!(
        k.matvec(&p, &w, &a_f32, &mut y),
        Err(QuantError::WrongActivationFormat { .. })
    ));
}

/// The repacking prefill GEMMs (the 32-value block formats, q4_K and q6_K: a
/// tile repacked once for the chunk, sixteen rows per vector) against the
/// scalar reference dot of every (row, token), across row and token tails.
/// On AVX2 (no GEMM) this checks the q4_0 / q5_0 tiles decoded to q8_0 and
/// the four-row dots instead.
#[test]
fn repacking_gemm_is_the_scalar_dot_of_every_row_and_token() {
    let pools = [pool(1), pool(2)];
    let fast = Kernels::detect();
    let scalar = Kernels::scalar();
    let k_shapes = [(1, 256), (15, 512), (16, 256), (37, 768), (300, 1024)];
    let b32_shapes = [(1, 32), (15, 96), (16, 640), (37, 320), (300, 640)];
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4_K, GgmlType::Q6_K] {
        let shapes = if ty.block_elems() == 256 { k_shapes } else { b32_shapes };
        for (rows, cols) in shapes {
            let data = random_blocks(ty, rows * cols / ty.block_elems() as usize, 41 + rows as u64).unwrap();
            let w = WeightMatrix::new(ty, &data, rows, cols).unwrap();
            for n_tok in [4, 5, 7, 33] {
                let x = random_values(n_tok * cols, 43 + n_tok as u64);
                let a = Activations::for_weight(ty, &x, cols).unwrap();
                let want: Vec<f32> = (0..n_tok)
                    .flat_map(|t| (0..rows).map(move |r| (t, r)))
                    .map(|(t, r)| scalar.dot(ty, w.row(r), a.row(t).unwrap()).unwrap())
                    .collect();
                for p in &pools {
                    for k in [fast, scalar] {
                        let mut y = vec![f32::NAN; n_tok * rows];
                        k.matmul(p, &w, &a, &mut y).unwrap();
                        assert_eq!(bits(&y), bits(&want), "{ty} {rows}x{cols} n_tok={n_tok} {}", k.isa());
                    }
                }
            }
        }
    }
}
