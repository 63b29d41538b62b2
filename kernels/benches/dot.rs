//! Weight GB/s of `matvec` per format on a 4096 x 4096 matrix (decode shape),
//! at the best SIMD level this CPU has, on one thread and on all threads.
//!
//!     CARGO_TARGET_DIR=/work/targets/kernels cargo bench -p pulsar-kernels --bench dot
//!
//! `PULSAR_BENCH_FORMATS=q4_K,q8_0` limits the formats; `PULSAR_BENCH_SECS` sets
//! the measurement time per case (default 2 s).

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pulsar_gguf::GgmlType;
use pulsar_kernels::quant::{can_dot, random_blocks, random_values};
use pulsar_kernels::{Activations, Kernels, WeightMatrix};

const ROWS: usize = 4096;
const COLS: usize = 4096;

fn formats() -> Vec<GgmlType> {
    let all: Vec<GgmlType> = GgmlType::ALL.iter().copied().filter(|t| can_dot(*t)).collect();
    match std::env::var("PULSAR_BENCH_FORMATS") {
        Ok(list) => list.split(',').filter_map(GgmlType::from_name).filter(|t| all.contains(t)).collect(),
        Err(_) => all,
    }
}

fn bench(c: &mut Criterion) {
    let secs: f64 = std::env::var("PULSAR_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(2.0);
    let k = Kernels::detect();
    let all = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut threads = vec![1];
    if all > 1 {
        threads.push(all);
    }
    let x = random_values(COLS, 1);
    let mut g = c.benchmark_group(format!("matvec_{ROWS}x{COLS}_{}", k.isa()));
    g.measurement_time(Duration::from_secs_f64(secs)).warm_up_time(Duration::from_millis(500)).sample_size(10);
    for ty in formats() {
        let nb = ROWS * COLS / ty.block_elems() as usize;
        let data = random_blocks(ty, nb, 7).expect("random blocks");
        let w = WeightMatrix::new(ty, &data, ROWS, COLS).expect("matrix");
        let a = Activations::for_weight(ty, &x, COLS).expect("activations");
        let mut y = vec![0f32; ROWS];
        g.throughput(Throughput::Bytes(data.len() as u64));
        for &t in &threads {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool");
            g.bench_function(format!("{}/t{t}", ty.name()), |b| {
                b.iter(|| k.matvec(&pool, &w, &a, &mut y).expect("matvec"))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
