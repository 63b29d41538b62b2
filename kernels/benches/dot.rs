//! Weight GB/s per format:
//! - `matvec_4096x4096_<isa>`: decode shape, the matrix streamed from memory
//!   (9-64 MB), on one thread and on all threads;
//! - `dot_cached_<isa>` / `dot_cached_scalar`: 16 rows of 8192 values that stay
//!   in L2, so the kernel's arithmetic is what is measured;
//! - `matmul_128tok_<isa>`: a 128-token prefill chunk against 4096 x 4096 (the
//!   repacking GEMMs where the format has one), GB/s of weights per pass (each
//!   weight is used 128 times); `matmul_128tok_tokens_<isa>`: the same as
//!   tokens per second.
//!
//!     CARGO_TARGET_DIR=/work/targets/kernels cargo bench -p pulsar-kernels --bench dot
//!
//! - `dot_rows_<isa>`: one thread, 4096-value rows, `Kernels::dot_rows` over
//!   all rows (`rows`) against a loop of `Kernels::dot` (`dot_loop`), for 128
//!   rows that stay in L2 (`l2/`) and for a 96 MiB matrix streamed from DRAM
//!   (`dram/`, past the 32 MiB L3 of the machines we bench on).
//!
//! `PULSAR_BENCH_FORMATS=q4_K,q8_0` limits the formats; `PULSAR_BENCH_SECS` sets
//! the measurement time per case (default 2 s).

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, Throughput};
use pulsar_gguf::GgmlType;
use pulsar_kernels::quant::{can_dot, random_blocks, random_values};
use pulsar_kernels::{Activations, Kernels, WeightMatrix};

const ROWS: usize = 4096;
const COLS: usize = 4096;

fn formats() -> Vec<GgmlType> {
    let all: Vec<GgmlType> = GgmlType::ALL
        .iter()
        .copied()
        .filter(|t| can_dot(*t))
        .collect();
    match std::env::var("PULSAR_BENCH_FORMATS") {
        Ok(list) => list
            .split(',')
            .filter_map(GgmlType::from_name)
            .filter(|t| all.contains(t))
            .collect(),
        Err(_) => all,
    }
}

fn configure(g: &mut BenchmarkGroup<'_, WallTime>) {
    let secs: f64 = std::env::var("PULSAR_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    g.measurement_time(Duration::from_secs_f64(secs))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(10);
}

fn pool(t: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(t)
        .build()
        .expect("pool")
}

fn matvec(c: &mut Criterion) {
    let k = Kernels::detect();
    let all = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let threads = if all > 1 { vec![1, all] } else { vec![1] };
    // The decode shapes: the square default, and a model's output head
    // (gemma-3-270m's 262144 x 640: short rows, 178 MB of q8_0), and a DRAM-sized
    // matrix of qwen3-30b-a3b's 2048-value rows.
    for (rows, cols) in [(ROWS, COLS), (262_144, 640), (65_536, 2048)] {
        let x = random_values(cols, 1);
        let mut g = c.benchmark_group(format!("matvec_{rows}x{cols}_{}", k.isa()));
        configure(&mut g);
        for ty in formats() {
            if rows * cols / ty.block_elems() as usize * ty.block_elems() as usize != rows * cols || cols % ty.block_elems() as usize != 0 {
                continue;
            }
            let data = random_blocks(ty, rows * cols / ty.block_elems() as usize, 7).expect("blocks");
            let w = WeightMatrix::new(ty, &data, rows, cols).expect("matrix");
            let a = Activations::for_weight(ty, &x, cols).expect("activations");
            let mut y = vec![0f32; rows];
            g.throughput(Throughput::Bytes(data.len() as u64));
            for &t in &threads {
                let p = pool(t);
                g.bench_function(format!("{}/t{t}", ty.name()), |b| {
                    b.iter(|| k.matvec(&p, &w, &a, &mut y).expect("matvec"))
                });
            }
        }
        g.finish();
    }
}

fn dot_cached(c: &mut Criterion) {
    const N: usize = 8192;
    const R: usize = 16;
    let x = random_values(N, 2);
    for k in [Kernels::detect(), Kernels::scalar()] {
        let mut g = c.benchmark_group(format!("dot_cached_{}", k.isa()));
        configure(&mut g);
        for ty in formats() {
            let data = random_blocks(ty, R * N / ty.block_elems() as usize, 8).expect("blocks");
            let rb = data.len() / R;
            let a = Activations::for_weight(ty, &x, N).expect("activations");
            let r = a.row(0).expect("row");
            g.throughput(Throughput::Bytes(data.len() as u64));
            g.bench_function(ty.name(), |b| {
                b.iter(|| {
                    (0..R)
                        .map(|i| k.dot(ty, &data[i * rb..(i + 1) * rb], r).expect("dot"))
                        .sum::<f32>()
                })
            });
        }
        g.finish();
    }
}

fn matmul(c: &mut Criterion) {
    const T: usize = 128;
    let k = Kernels::detect();
    let all = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let p = pool(all);
    let x = random_values(T * COLS, 3);
    let gemm = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::IQ2_XXS,
    ];
    for tokens in [false, true] {
        let unit = if tokens { "_tokens" } else { "" };
        let mut g = c.benchmark_group(format!("matmul_{T}tok{unit}_{}_t{all}", k.isa()));
        configure(&mut g);
        for ty in formats().into_iter().filter(|t| gemm.contains(t)) {
            let data = random_blocks(ty, ROWS * COLS / ty.block_elems() as usize, 9).expect("blocks");
            let w = WeightMatrix::new(ty, &data, ROWS, COLS).expect("matrix");
            let a = Activations::for_weight(ty, &x, COLS).expect("activations");
            let mut y = vec![0f32; T * ROWS];
            g.throughput(if tokens { Throughput::Elements(T as u64) } else { Throughput::Bytes(data.len() as u64) });
            g.bench_function(ty.name(), |b| {
                b.iter(|| k.matmul(&p, &w, &a, &mut y).expect("matmul"))
            });
        }
        g.finish();
    }
}

fn dot_rows(c: &mut Criterion) {
    let k = Kernels::detect();
    let x = random_values(COLS, 4);
    let mut g = c.benchmark_group(format!("dot_rows_{}", k.isa()));
    configure(&mut g);
    for ty in formats() {
        let a = Activations::for_weight(ty, &x, COLS).expect("activations");
        let r = a.row(0).expect("row");
        let rb = COLS / ty.block_elems() as usize * ty.block_bytes() as usize;
        for (place, rows) in [("l2", 128), ("dram", (96 << 20) / rb)] {
            let data =
                random_blocks(ty, rows * COLS / ty.block_elems() as usize, 10).expect("blocks");
            let mut y = vec![0f32; rows];
            g.throughput(Throughput::Bytes(data.len() as u64));
            g.bench_function(format!("{}/{place}/rows", ty.name()), |b| {
                b.iter(|| k.dot_rows(ty, &data, rows, r, &mut y).expect("dot_rows"))
            });
            g.bench_function(format!("{}/{place}/dot_loop", ty.name()), |b| {
                b.iter(|| {
                    for (o, w) in y.iter_mut().zip(data.chunks_exact(rb)) {
                        *o = k.dot(ty, w, r).expect("dot");
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, matvec, dot_cached, matmul, dot_rows);
criterion_main!(benches);
