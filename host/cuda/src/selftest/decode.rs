//! Self-test cases and timings of the decode paths that quantize their own
//! activation rows (gemv_f32_act, moe_ffn_f32_act), and the qwen3-235b
//! decode shapes as `--bench` rows.

use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::Activation;
use pulsar_kernels::quant::{random_blocks, random_values};
use pulsar_kernels::{Activations, Kernels, WeightMatrix};

use super::{bench_gemv, compare, fmt_name, moe_case, poisoned, BenchRow, Cmp, MoeShape, Table};
use crate::buf::DeviceBuf;
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::kernels::QUANT_TYPES;
use crate::ops::MoePairs;

pub(super) fn cases(dev: &CudaDevice, t: &mut Table, pool: &rayon::ThreadPool, k: &Kernels, next: &mut dyn FnMut() -> u64) {
    for ty in QUANT_TYPES {
        let cols = if ty.block_elems() == 256 { 256 * 7 } else { 32 * 37 };
        // The block's own quantization of x gives the quantize kernel's bytes,
        // so the CPU's dot bit for bit (two-row groups and one-row groups).
        for rows in [257usize, 16389] {
            t.push("gemv (f32 x, quantized in the kernel)", &fmt_name(ty), format!("{rows}x{cols}"), gemv_f32_case(dev, pool, k, ty, rows, cols, next()));
        }
    }
    for (gu, dn) in [(GgmlType::Q2_K, GgmlType::Q2_K), (GgmlType::Q4_K, GgmlType::Q6_K), (GgmlType::Q8_0, GgmlType::Q8_0), (GgmlType::IQ2_XXS, GgmlType::Q5_0)] {
        let f = format!("{}/{}", fmt_name(gu), fmt_name(dn));
        for (shape, what) in [(MoeShape::SMALL, "3 tok x 4 slot, d512 ff512"), (MoeShape::WIDE, "4 tok x 8 slot, d1024 ff1280")] {
            t.push("moe_ffn (f32 x and h, quantized in the kernels)", &f, what.into(), moe_case(dev, pool, k, gu, dn, shape, true, next()));
        }
    }
}

fn gemv_f32_case(dev: &CudaDevice, pool: &rayon::ThreadPool, k: &Kernels, ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Result<Cmp, CudaError> {
    let w = random_blocks(ty, rows * cols / ty.block_elems() as usize, seed)?;
    let x = random_values(cols, seed ^ 1);
    let mut cpu = vec![0f32; rows];
    k.matmul(pool, &WeightMatrix::new(ty, &w, rows, cols)?, &Activations::for_weight(ty, &x, cols)?, &mut cpu)?;
    let (wd, xd) = (dev.upload(&w)?, dev.upload(&x)?);
    let mut y = poisoned::<f32>(dev, rows)?;
    dev.gemv_f32_act(dev.compute(), ty, &wd, rows, cols, &xd, &mut y)?;
    Ok(compare(&dev.download(&y)?, &cpu, 0.0))
}

pub(super) fn bench(dev: &CudaDevice, out: &mut Vec<BenchRow>) {
    // qwen3-235b's decode shapes: attention q / output / k (q8_0), and one
    // token's eight experts (q2_K, q4_K).
    for (rows, cols) in [(8192usize, 4096usize), (4096, 8192), (512, 4096)] {
        out.push(bench_gemv(dev, GgmlType::Q8_0, rows, cols).unwrap_or_else(|e| failed_row("gemv", e)));
    }
    for ty in [GgmlType::Q2_K, GgmlType::Q4_K] {
        out.push(bench_moe(dev, ty, 4096, 1536, 8).unwrap_or_else(|e| failed_row("moe_ffn", e)));
    }
}

fn failed_row(op: &str, e: CudaError) -> BenchRow {
    BenchRow { op: format!("{op} failed: {e}"), format: String::new(), shape: String::new(), us: f64::NAN, gb_per_s: f64::NAN }
}

/// One decode token's routed experts: `n_pairs` distinct experts of `ty`
/// (gate, up: ff x d_model; down: d_model x ff), the whole moe_ffn (up,
/// down, each quantizing its activations) per call; GB/s over the experts'
/// weight bytes.
fn bench_moe(dev: &CudaDevice, ty: GgmlType, d_model: usize, ff: usize, n_pairs: usize) -> Result<BenchRow, CudaError> {
    let nb = ff * d_model / ty.block_elems() as usize;
    let mats: Vec<Vec<u8>> = (0..3 * n_pairs).map(|i| random_blocks(ty, nb, 40 + i as u64)).collect::<Result<_, _>>()?;
    let bufs: Vec<DeviceBuf<u8>> = mats.iter().map(|m| dev.upload(m)).collect::<Result<_, _>>()?;
    let table = |k: usize| dev.upload(&(0..n_pairs).map(|p| bufs[3 * p + k].device_ptr()).collect::<Vec<u64>>());
    let (gp, up, dp) = (table(0)?, table(1)?, table(2)?);
    let pairs = MoePairs { gate: &gp, up: &up, down: &dp, n_tok: 1, n_slot: n_pairs };
    // The f32 path, as decode runs it (the kernels quantize x and h).
    let xd = dev.upload(&random_values(d_model, 3))?;
    let mut h = dev.alloc::<f32>(n_pairs * ff)?;
    let mut out = dev.alloc::<f32>(n_pairs * d_model)?;
    let s = dev.compute();
    let mut run = || dev.moe_ffn_f32_act(s, ty, ty, &pairs, &xd, d_model, ff, Activation::Silu, &mut h, &mut out);
    for _ in 0..3 {
        run()?;
    }
    let reps = 50;
    let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
    e0.record(s)?;
    for _ in 0..reps {
        run()?;
    }
    e1.record(s)?;
    e1.synchronize()?;
    let us = e0.elapsed_ms(&e1)? as f64 * 1e3 / reps as f64;
    let bytes: usize = mats.iter().map(|m| m.len()).sum();
    Ok(BenchRow {
        op: "moe_ffn (decode)".into(),
        format: fmt_name(ty),
        shape: format!("{n_pairs} experts, d{d_model} ff{ff}"),
        us,
        gb_per_s: bytes as f64 / (us * 1e-6) / 1e9,
    })
}

