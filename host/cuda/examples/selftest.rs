//! `cargo run -p pulsar-cuda --release --example selftest [-- --bench] [-- --out FILE]`
//!
//! Opens CUDA device 0, compiles every kernel (or loads it from the cache),
//! runs the GPU self-test against the CPU twins and prints the table as
//! Markdown; `--bench` adds GEMV/GEMM bandwidth timings. Exit status 1 when a
//! row fails, 2 when no device could be opened.

use std::time::Instant;

use pulsar_cuda::{selftest, CudaDevice};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bench = args.iter().any(|a| a == "--bench");
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let dev = match CudaDevice::open(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("selftest: {e}");
            std::process::exit(2);
        }
    };
    let mut md = String::new();
    let (free, total) = dev.memory().unwrap_or((0, 0));
    md += &format!(
        "# pulsar-cuda self-test\n\ndevice: {} ({}, compute capability {}.{}), {:.1} of {:.1} GiB free; NVRTC {:?}\n\n",
        dev.name(),
        dev.arch(),
        dev.compute_capability().0,
        dev.compute_capability().1,
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64,
        pulsar_cuda::compile::nvrtc_version().ok()
    );
    let t0 = Instant::now();
    if let Err(e) = dev.warm_up() {
        eprintln!("selftest: compiling the kernels failed: {e}");
        std::process::exit(1);
    }
    md += &format!(
        "kernel modules ready in {:.2} s (NVRTC compile or disk cache)\n\n",
        t0.elapsed().as_secs_f64()
    );
    let t1 = Instant::now();
    let rows = selftest::run(&dev);
    let failed = rows.iter().filter(|r| !r.pass).count();
    md += &selftest::markdown(&rows);
    md += &format!(
        "\n{} rows, {} failed, {:.2} s\n",
        rows.len(),
        failed,
        t1.elapsed().as_secs_f64()
    );
    if bench {
        md += "\n## GEMV / GEMM timings\n\n";
        md += &selftest::bench_markdown(&selftest::bench(&dev));
    }
    print!("{md}");
    if let Some(p) = out {
        if let Err(e) = std::fs::write(&p, &md) {
            eprintln!("selftest: writing {p}: {e}");
        }
    }
    std::process::exit(if failed == 0 { 0 } else { 1 });
}
