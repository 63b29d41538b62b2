//! matvec / matmul: each output is exactly the row's dot, whatever the thread
//! count or tiling, and matmul equals matvec token by token.

use pulsar_gguf::GgmlType;
use pulsar_kernels::quant::{can_dot, random_blocks, random_values};
use pulsar_kernels::{ActFormat, Activations, Isa, Kernels, QuantError, WeightMatrix};
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

/// Every ISA level this CPU runs, each forced (an AVX-512 machine also runs
/// its AVX2 kernels here, so the 256-bit GEMMs are checked there too).
fn available_levels() -> Vec<Kernels> {
    Isa::ALL.iter().filter_map(|&i| Kernels::with_isa(i).ok()).collect()
}

/// The repacking prefill GEMMs (the 32-value block formats, q4_K and q6_K: a
/// tile repacked once for the chunk, sixteen rows per vector with AVX-512,
/// eight with AVX2) against the scalar reference dot of every (row, token),
/// across row and token tails, at every ISA level this CPU has. At the
/// scalar level this checks the q4_0 / q5_0 tiles decoded to q8_0.
#[test]
fn repacking_gemm_is_the_scalar_dot_of_every_row_and_token() {
    let pools = [pool(1), pool(2)];
    let scalar = Kernels::scalar();
    let levels = available_levels();
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
                    for &k in &levels {
                        let mut y = vec![f32::NAN; n_tok * rows];
                        k.matmul(p, &w, &a, &mut y).unwrap();
                        assert_eq!(bits(&y), bits(&want), "{ty} {rows}x{cols} n_tok={n_tok} {}", k.isa());
                    }
                }
            }
        }
    }
}

/// The GEMMs at the extremes of every level and activation: weights at their
/// largest unsigned level (q8_0 at -128 and 127), the largest scales and
/// mins, activations whose blocks are all +127 or all -127 quants. 256-bit
/// `vpmaddubsw` saturates its i16 pair sums, and its i16 partial sums wrap,
/// at such values unless the kernel splits the sums where its format needs
/// it: any saturation or wrap shows as a difference from the scalar dot.
#[test]
fn repacking_gemm_is_exact_at_the_extreme_levels() {
    let p = pool(1);
    let scalar = Kernels::scalar();
    let (rows, cols, n_tok) = (19, 512, 6);
    // (format, [byte ranges of the quants, fill], f16 scale fields)
    type Layout = (GgmlType, &'static [(usize, usize)], &'static [usize]);
    let layouts: [Layout; 7] = [
        (GgmlType::Q8_0, &[(2, 34)], &[0]),
        (GgmlType::Q4_0, &[(2, 18)], &[0]),
        (GgmlType::Q4_1, &[(4, 20)], &[0, 2]),
        (GgmlType::Q5_0, &[(2, 22)], &[0]),
        (GgmlType::Q5_1, &[(4, 24)], &[0, 2]),
        (GgmlType::Q4_K, &[(4, 144)], &[0, 2]),
        (GgmlType::Q6_K, &[(0, 208)], &[208]),
    ];
    for (ty, quants, scales) in layouts {
        let bb = ty.block_bytes() as usize;
        let nb = rows * cols / ty.block_elems() as usize;
        let mut data = random_blocks(ty, nb, 51).unwrap();
        let per_row = nb / rows;
        for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
            let r = i / per_row;
            // Rows 0 mod 3: every bit set (the top level, the top scales;
            // q8_0 -1, q6_K scales -1); 1 mod 3: q8_0 -128 / 127, q6_K scale
            // -128 / 127; 2 mod 3: random.
            let fill = match (r % 3, ty, i % 2) {
                (0, _, _) => Some(0xff),
                (1, GgmlType::Q8_0, 0) => Some(0x80),
                (1, GgmlType::Q8_0, _) => Some(0x7f),
                (1, _, _) => Some(0xff),
                _ => None,
            };
            if let Some(f) = fill {
                for &(a, b) in quants {
                    blk[a..b].fill(f);
                }
                if ty == GgmlType::Q6_K && r % 3 == 1 {
                    blk[192..208].fill(if i % 2 == 0 { 0x80 } else { 0x7f });
                }
                for &o in scales {
                    // f16 2^-7: finite, and the same for every row.
                    blk[o..o + 2].copy_from_slice(&0x2000u16.to_le_bytes());
                }
            }
        }
        let w = WeightMatrix::new(ty, &data, rows, cols).unwrap();
        // Token t: every value +1 (t even) or -1, except token 5 whose sign
        // flips per 32 values: all quants +-127 in every block.
        let x: Vec<f32> = (0..n_tok * cols)
            .map(|e| {
                let (t, c) = (e / cols, e % cols);
                let neg = if t == 5 { (c / 32) % 2 == 1 } else { t % 2 == 1 };
                if neg { -1.0 } else { 1.0 }
            })
            .collect();
        let a = Activations::for_weight(ty, &x, cols).unwrap();
        let want: Vec<f32> = (0..n_tok)
            .flat_map(|t| (0..rows).map(move |r| (t, r)))
            .map(|(t, r)| scalar.dot(ty, w.row(r), a.row(t).unwrap()).unwrap())
            .collect();
        assert!(want.iter().all(|v| v.is_finite()), "{ty}");
        for k in available_levels() {
            let mut y = vec![f32::NAN; n_tok * rows];
            k.matmul(&p, &w, &a, &mut y).unwrap();
            assert_eq!(bits(&y), bits(&want), "{ty} {}", k.isa());
        }
    }
}
