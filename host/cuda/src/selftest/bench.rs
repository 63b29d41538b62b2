//! `--bench` timings of the self-test binary: decode GEMVs per format and
//! the qwen3-235b decode shapes, one token's experts, decode attention, a
//! qwen3-235b prefill chunk's attention (both partial kernels), and
//! the dp4a / tensor-core GEMMs (weights read once per call: microseconds
//! and achieved GB/s or TOPS).

use std::time::Instant;

use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::{Activation, AttnParams, KvType};
use pulsar_kernels::quant::{random_blocks, random_values};
use pulsar_kernels::{ActFormat, Activations};

use super::{fmt_name, small_ops, BenchRow};
use crate::buf::DeviceBuf;
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::ops::{attention_workspace_len, AttnKernel, GemmKernel, MoePairs};

/// Decode-shaped GEMV timings (weights read once per call): microseconds per
/// call and the achieved weight bandwidth.
pub fn bench(dev: &CudaDevice) -> Vec<BenchRow> {
    let mut out = Vec::new();
    let h32 = AttnParams { n_head: 32, n_kv_head: 8, head_dim_k: 128, head_dim_v: 128, scale: 0.088, window: 0, softcap: 0.0 };
    const KVS: [KvType; 6] = [KvType::F32, KvType::F16, KvType::Bf16, KvType::Q8_0, KvType::Q4_0, KvType::Fp8];
    for n_ctx in [4096usize, 32768] {
        for kv in KVS {
            out.push(bench_attention(dev, &h32, n_ctx, kv, None).unwrap_or_else(|e| failed_row("attention", "", e)));
        }
    }
    // qwen3-235b's heads (64 over 4): the per-query and the grouped kernel
    // at each context, to place CudaDevice::attention's switch between them.
    let h64 = AttnParams { n_head: 64, n_kv_head: 4, ..h32 };
    for n_ctx in [1024usize, 2048, 4096, 8192, 32768] {
        for kv in KVS {
            for kernel in [AttnKernel::PerQuery, AttnKernel::Grouped] {
                out.push(bench_attention(dev, &h64, n_ctx, kv, Some(kernel)).unwrap_or_else(|e| failed_row("attention", "", e)));
            }
        }
    }
    for (f16, kernel) in [(false, AttnKernel::Tiled), (false, AttnKernel::PerQuery), (true, AttnKernel::Tiled)] {
        out.push(bench_attention_prefill(dev, f16, kernel).unwrap_or_else(|e| failed_row("attention prefill", "", e)));
    }
    // qwen3-235b's decode shapes: attention q / output / k (q8_0), and one
    // token's eight experts (q2_K, q4_K).
    for (rows, cols) in [(8192usize, 4096usize), (4096, 8192), (512, 4096)] {
        out.push(bench_gemv(dev, GgmlType::Q8_0, rows, cols).unwrap_or_else(|e| failed_row("gemv", "q8_0", e)));
    }
    for ty in [GgmlType::Q2_K, GgmlType::Q4_K] {
        out.push(bench_moe(dev, ty, 4096, 1536, 8).unwrap_or_else(|e| failed_row("moe_ffn", &fmt_name(ty), e)));
    }
    small_ops::bench(dev, &mut out);
    let shapes = [(4096usize, 4096usize), (14336, 4096), (4096, 14336)];
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::IQ2_XXS,
        GgmlType::Q4_0,
    ] {
        for (rows, cols) in shapes {
            out.push(bench_gemv(dev, ty, rows, cols).unwrap_or_else(|e| failed_row("gemv", &fmt_name(ty), e)));
        }
        for kernel in [GemmKernel::Dp4a, GemmKernel::TensorCore] {
            out.push(bench_one(dev, kernel, ty, 4096, 4096, 512).unwrap_or_else(|e| failed_row(&format!("{kernel:?}"), &fmt_name(ty), e)));
        }
    }
    out
}

fn failed_row(op: &str, format: &str, e: CudaError) -> BenchRow {
    BenchRow { op: format!("{op} failed: {e}"), format: format.to_string(), shape: String::new(), us: f64::NAN, gb_per_s: f64::NAN }
}

/// One decode token's routed experts: `n_pairs` distinct experts of `ty`
/// (gate, up: ff x d_model; down: d_model x ff), the whole moe_ffn (up,
/// quantize, down) per call; GB/s over the experts' weight bytes.
fn bench_moe(dev: &CudaDevice, ty: GgmlType, d_model: usize, ff: usize, n_pairs: usize) -> Result<BenchRow, CudaError> {
    let nb = ff * d_model / ty.block_elems() as usize;
    let mats: Vec<Vec<u8>> = (0..3 * n_pairs).map(|i| random_blocks(ty, nb, 40 + i as u64)).collect::<Result<_, _>>()?;
    let bufs: Vec<DeviceBuf<u8>> = mats.iter().map(|m| dev.upload(m)).collect::<Result<_, _>>()?;
    let table = |k: usize| dev.upload(&(0..n_pairs).map(|p| bufs[3 * p + k].device_ptr()).collect::<Vec<u64>>());
    let (gp, up, dp) = (table(0)?, table(1)?, table(2)?);
    let pairs = MoePairs { gate: &gp, up: &up, down: &dp, n_tok: 1, n_slot: n_pairs };
    let fmt = ActFormat::for_weight(ty).ok_or(CudaError::Unsupported { op: "moe", ty })?;
    let xd = dev.upload(Activations::for_weight(ty, &random_values(d_model, 3), d_model)?.as_bytes())?;
    let mut h = dev.alloc::<f32>(n_pairs * ff)?;
    let mut hq = dev.alloc::<u8>(crate::ops::act_bytes(fmt, n_pairs, ff)?)?;
    let mut out = dev.alloc::<f32>(n_pairs * d_model)?;
    let s = dev.compute();
    let us = time_calls(dev, 50, || dev.moe_ffn(s, ty, ty, &pairs, &xd, d_model, ff, Activation::Silu, &mut h, &mut hq, &mut out))?;
    let bytes: usize = mats.iter().map(|m| m.len()).sum();
    Ok(BenchRow {
        op: "moe_ffn (decode)".into(),
        format: fmt_name(ty),
        shape: format!("{n_pairs} experts, d{d_model} ff{ff}"),
        us,
        gb_per_s: bytes as f64 / (us * 1e-6) / 1e9,
    })
}

/// Microseconds a call of `f` (three warm-up calls, then `reps` between two
/// events on the compute stream).
fn time_calls(dev: &CudaDevice, reps: usize, mut f: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    for _ in 0..3 {
        f()?;
    }
    let s = dev.compute();
    let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
    e0.record(s)?;
    for _ in 0..reps {
        f()?;
    }
    e1.record(s)?;
    e1.synchronize()?;
    Ok(e0.elapsed_ms(&e1)? as f64 * 1e3 / reps as f64)
}

fn bench_gemv(
    dev: &CudaDevice,
    ty: GgmlType,
    rows: usize,
    cols: usize,
) -> Result<BenchRow, CudaError> {
    let be = ty.block_elems() as usize;
    let w = random_blocks(ty, rows * cols / be, 1)?;
    let acts = Activations::for_weight(ty, &random_values(cols, 2), cols)?;
    let (wd, xd) = (dev.upload(&w)?, dev.upload(acts.as_bytes())?);
    let mut y = dev.alloc::<f32>(rows)?;
    let us = time_calls(dev, 50, || dev.gemv(dev.compute(), ty, &wd, rows, cols, &xd, &mut y))?;
    Ok(BenchRow {
        op: "gemv".into(),
        format: fmt_name(ty),
        shape: format!("{rows}x{cols}"),
        us,
        gb_per_s: w.len() as f64 / (us * 1e-6) / 1e9,
    })
}

/// Decode attention (one query) over `n_ctx` cached rows in format `kv`,
/// with `kernel` or the one `CudaDevice::attention` picks (None); GB/s over
/// the cache's bytes (a q8_0 row's scales and padding included).
fn bench_attention(dev: &CudaDevice, p: &AttnParams, n_ctx: usize, kv: KvType, kernel: Option<AttnKernel>) -> Result<BenchRow, CudaError> {
    let p = *p;
    let w = p.n_kv_head * p.head_dim_k;
    let vals = random_values(n_ctx * w, 4);
    let mut bytes = vec![0u8; n_ctx * kv.row_bytes(w)];
    for (row, out) in vals.chunks_exact(w).zip(bytes.chunks_exact_mut(kv.row_bytes(w))) {
        kv.put_row(row, out);
    }
    let q = dev.upload(&random_values(p.n_head * p.head_dim_k, 3))?;
    let pos = dev.upload(&[(n_ctx - 1) as u32])?;
    #[allow(clippy::too_many_arguments)]
    fn time<K: crate::ops::KvElem>(dev: &CudaDevice, kernel: Option<AttnKernel>, p: &AttnParams, q: &DeviceBuf<f32>, pos: &DeviceBuf<u32>, cache: &[K], n_ctx: usize) -> Result<f64, CudaError> {
        let (k, v) = (dev.upload(cache)?, dev.upload(cache)?);
        let mut work = dev.alloc::<f32>(attention_workspace_len(p, 1, n_ctx))?;
        let mut o = dev.alloc::<f32>(p.n_head * p.head_dim_v)?;
        let mut call = || match kernel {
            None => dev.attention(dev.compute(), p, q, pos, &k, &v, n_ctx, &mut work, &mut o),
            Some(kn) => dev.attention_with(dev.compute(), kn, p, q, pos, &k, &v, n_ctx, &mut work, &mut o),
        };
        let reps = 20;
        let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
        call()?;
        e0.record(dev.compute())?;
        for _ in 0..reps {
            call()?;
        }
        e1.record(dev.compute())?;
        e1.synchronize()?;
        Ok(e0.elapsed_ms(&e1)? as f64 * 1e3 / reps as f64)
    }
    let us = crate::with_kv_elem!(kv, K => time::<K>(dev, kernel, &p, &q, &pos, &crate::ops::kv_elems::<K>(&bytes), n_ctx))?;
    Ok(BenchRow {
        op: match kernel {
            None => "attention decode".into(),
            Some(kn) => format!("attention decode ({kn:?})"),
        },
        format: format!("{kv} kv"),
        shape: format!("h{}/{} d128 ctx{n_ctx}", p.n_head, p.n_kv_head),
        us,
        gb_per_s: (2 * bytes.len()) as f64 / (us * 1e-6) / 1e9,
    })
}

/// One layer's attention of a 512-token prefill chunk at positions 0..511
/// (qwen3-235b: 64 heads over 4 KV heads, d 128): the partials of `kernel`
/// and the combine. Compute-bound: the op names the achieved TFLOPS (a
/// multiply and an add per q.k and e.v term; the causal half only); GB/s is
/// over the KV bytes.
fn bench_attention_prefill(dev: &CudaDevice, f16: bool, kernel: AttnKernel) -> Result<BenchRow, CudaError> {
    let p = AttnParams { n_head: 64, n_kv_head: 4, head_dim_k: 128, head_dim_v: 128, scale: 0.088, window: 0, softcap: 0.0 };
    let (n_q, n_ctx) = (512usize, 512usize);
    let kv = n_ctx * p.n_kv_head * p.head_dim_k;
    let q = dev.upload(&random_values(n_q * p.n_head * p.head_dim_k, 3))?;
    let pos = dev.upload(&(0..n_q as u32).collect::<Vec<u32>>())?;
    let mut work = dev.alloc::<f32>(attention_workspace_len(&p, n_q, n_ctx))?;
    let mut o = dev.alloc::<f32>(n_q * p.n_head * p.head_dim_v)?;
    let s = dev.compute();
    let vals = random_values(kv, 4);
    let us = if f16 {
        let bits: Vec<u16> = vals.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
        let (k, v) = (dev.upload(&bits)?, dev.upload(&bits)?);
        time_calls(dev, 20, || dev.attention_with(s, kernel, &p, &q, &pos, &k, &v, n_ctx, &mut work, &mut o))?
    } else {
        let (k, v) = (dev.upload(&vals)?, dev.upload(&vals)?);
        time_calls(dev, 20, || dev.attention_with(s, kernel, &p, &q, &pos, &k, &v, n_ctx, &mut work, &mut o))?
    };
    let terms = (n_q * (n_q + 1) / 2 * p.n_head * p.head_dim_k) as f64;
    let tflops = 4.0 * terms / (us * 1e-6) / 1e12;
    Ok(BenchRow {
        op: format!("attention prefill {} ({tflops:.1} TFLOPS)", if kernel == AttnKernel::Tiled { "tiled" } else { "per-query" }),
        format: if f16 { "f16 kv".into() } else { "f32 kv".into() },
        shape: format!("{n_q}q h64/4 d128 ctx{n_ctx}"),
        us,
        gb_per_s: (2 * kv * if f16 { 2 } else { 4 }) as f64 / (us * 1e-6) / 1e9,
    })
}

fn bench_one(
    dev: &CudaDevice,
    kernel: GemmKernel,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n_tok: usize,
) -> Result<BenchRow, CudaError> {
    let be = ty.block_elems() as usize;
    let w = random_blocks(ty, rows * cols / be, 1)?;
    let x = random_values(n_tok * cols, 2);
    let acts = Activations::for_weight(ty, &x, cols)?;
    let (wd, xd) = (dev.upload(&w)?, dev.upload(acts.as_bytes())?);
    let mut y = dev.alloc::<f32>(rows * n_tok)?;
    let s = dev.compute();
    let call = |y: &mut DeviceBuf<f32>| {
        if n_tok == 1 {
            dev.gemv(s, ty, &wd, rows, cols, &xd, y)
        } else {
            dev.gemm_with(s, kernel, ty, &wd, rows, cols, &xd, n_tok, y)
        }
    };
    for _ in 0..3 {
        call(&mut y)?;
    }
    dev.sync()?;
    let reps = if n_tok == 1 { 50 } else { 5 };
    let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
    let wall = Instant::now();
    e0.record(s)?;
    for _ in 0..reps {
        call(&mut y)?;
    }
    e1.record(s)?;
    e1.synchronize()?;
    let ms = e0
        .elapsed_ms(&e1)
        .map(|v| v as f64)
        .unwrap_or(wall.elapsed().as_secs_f64() * 1e3);
    let us = ms * 1e3 / reps as f64;
    let tops = 2.0 * (rows * cols * n_tok) as f64 / (us * 1e-6) / 1e12;
    Ok(BenchRow {
        op: match (n_tok, kernel) {
            (1, _) => "gemv".into(),
            (_, GemmKernel::Dp4a) => format!("gemm dp4a ({tops:.1} TOPS)"),
            (_, GemmKernel::TensorCore) => format!("gemm mma ({tops:.1} TOPS)"),
        },
        format: fmt_name(ty),
        shape: format!("{rows}x{cols}x{n_tok}tok"),
        us,
        gb_per_s: w.len() as f64 / (us * 1e-6) / 1e9,
    })
}

