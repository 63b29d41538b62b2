//! Self-test cases and timings of the small decode kernels (rms_norm, rope,
//! the router, the float GEMV) on the shapes of their faster paths: one
//! 4096-wide norm group, a 128-expert top-8 router, a 128 x 4096 f32 router
//! GEMV, a partial rope written out of place.

use cudarc::driver::sys as cusys;
use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::{RopeKind, RopeParams};
use pulsar_kernels::quant::{random_blocks, random_values};
use pulsar_kernels::{Activations, Kernels, WeightMatrix};

use super::{compare, compare_bytes, fmt_name, norm_case, poisoned, rope_case, route_case, BenchRow, Cmp, Table};
use crate::device::CudaDevice;
use crate::error::{shape, CudaError};
use crate::kernels::FLOAT_TYPES;
use crate::ops::{Gating, NormRopePart, RouterSpec, FLOAT_STAGED_MAX_ROWS};

pub(super) fn cases(dev: &CudaDevice, t: &mut Table, pool: &rayon::ThreadPool, k: &Kernels, next: &mut dyn FnMut() -> u64) {
    // One group per register tier of rms_norm (1, 4, 8, 16, 32 values a
    // thread) and the loop past 8192; the decode norm is one 4096 group.
    for (groups, group, weighted) in [(1, 4096, true), (5, 1000, true), (4, 2048, false), (3, 8192, true), (2, 8200, true)] {
        let w = if weighted { " weighted" } else { "" };
        t.push("rms_norm", "f32", format!("{groups}x{group}{w}"), norm_case(dev, groups, group, weighted, next()));
    }
    let partial = RopeParams { head_dim: 128, n_rot: 64, base: 10_000.0, linear_factor: 1.0, kind: RopeKind::Neox };
    t.push("rope", "neox partial 64/128", "9x(4x128)".into(), rope_case(dev, 9, 4 * 128, &partial, next()));

    // Decode's per-head q_norm / k_norm then rope, fused (qwen3: 64 and 4
    // heads of 128), against the two kernels apart.
    let full = RopeParams { head_dim: 128, n_rot: 128, base: 1_000_000.0, linear_factor: 1.0, kind: RopeKind::Neox };
    let inter = RopeParams { head_dim: 64, n_rot: 32, base: 10_000.0, linear_factor: 2.0, kind: RopeKind::Interleaved };
    for (name, rows, heads, p) in [("neox 128/128", 1, (64, 4), &full), ("neox partial 64/128", 3, (5, 2), &partial), ("interleaved 32/64", 2, (3, 0), &inter)] {
        let shape = format!("{rows}x({}+{})x{}", heads.0, heads.1, p.head_dim);
        t.push("norm_rope == rms_norm, rope (bits)", name, shape, norm_rope_case(dev, rows, heads, p, next()));
    }

    for r_first in [true, false] {
        let name = if r_first { "r + y" } else { "y + r" };
        t.push("moe_combine_add == moe_combine, add (bits)", name, "3 tok x 8 slot x 4096".into(), combine_add_case(dev, 3, 8, 4096, r_first, next()));
    }

    let spec = |k, gating, renormalize, scale| RouterSpec { k, gating, renormalize, scale };
    let routes = [
        ("softmax renorm (decode)", spec(8, Gating::Softmax, true, 1.0), 1, 128, false),
        ("sigmoid bias renorm", spec(6, Gating::Sigmoid, true, 2.0), 39, 64, true),
        ("softmax, k = n_exp", spec(20, Gating::Softmax, false, 1.0), 6, 20, false),
        ("softmax renorm top-64", spec(64, Gating::Softmax, true, 1.0), 2, 256, false),
    ];
    for (name, s, n_tok, n_exp, bias) in routes {
        let shape = format!("{n_tok} tok x {n_exp} exp top-{}", s.k);
        t.push("route ids+weights", name, shape, route_case(dev, &s, n_tok, n_exp, bias, next()));
    }
    for (gating, n_exp) in [(Gating::Softmax, 128), (Gating::Sigmoid, 200)] {
        t.push(
            "route warp == block (bits)",
            &format!("{gating:?}, ties/-inf/NaN/inf"),
            format!("{} tok x {n_exp} exp top-8", EDGE_ROWS),
            route_edge_case(dev, gating, n_exp, next()),
        );
    }

    let shapes = [(128, 4096), (131, 1000), (3, 5000), (1, 4096), (FLOAT_STAGED_MAX_ROWS + 76, 300)];
    for ty in FLOAT_TYPES {
        for (rows, cols) in shapes {
            let r = float_gemv_case(dev, pool, k, ty, rows, cols, next());
            t.push("gemv staged & 4-row", &fmt_name(ty), format!("{rows}x{cols}"), r);
        }
    }
}

/// Both float GEMV kernels against the CPU's product (the worse of the two).
#[allow(clippy::too_many_arguments)]
fn float_gemv_case(
    dev: &CudaDevice,
    pool: &rayon::ThreadPool,
    k: &Kernels,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let w = random_blocks(ty, rows * cols, seed)?;
    let x = random_values(cols, seed ^ 1);
    let mut cpu = vec![0f32; rows];
    k.matmul(pool, &WeightMatrix::new(ty, &w, rows, cols)?, &Activations::for_weight(ty, &x, cols)?, &mut cpu)?;
    let (wd, xd) = (dev.upload(&w)?, dev.upload(&x)?);
    let mut worst: Option<Cmp> = None;
    for staged in [true, false] {
        let mut y = poisoned::<f32>(dev, rows)?;
        dev.gemv_float_with(dev.compute(), staged, ty, &wd, rows, cols, &xd, &mut y)?;
        let c = compare(&dev.download(&y)?, &cpu, 0.0);
        if worst.as_ref().is_none_or(|m| !c.pass || c.abs > m.abs) {
            worst = Some(c);
        }
    }
    worst.ok_or_else(|| shape("gemv", "no kernel ran"))
}

/// The fused per-head norm and rope of one or two tensors (heads.1 == 0: one)
/// against rms_norm then rope: every output byte equal.
fn norm_rope_case(dev: &CudaDevice, rows: usize, heads: (usize, usize), p: &RopeParams, seed: u64) -> Result<Cmp, CudaError> {
    let hd = p.head_dim;
    let positions: Vec<u32> = (0..rows as u32).map(|r| 7 + 131 * r).collect();
    let pos = dev.upload(&positions)?;
    let mut want_bytes = Vec::new();
    let mut got_bytes = Vec::new();
    let widths: Vec<usize> = [heads.0, heads.1].into_iter().filter(|&h| h > 0).map(|h| h * hd).collect();
    let mut xs = Vec::new();
    let mut ws = Vec::new();
    for (i, &width) in widths.iter().enumerate() {
        let x = random_values(rows * width, seed ^ (11 * i as u64 + 1));
        let w = random_values(hd, seed ^ (13 * i as u64 + 2));
        xs.push(dev.upload(&x)?);
        ws.push(dev.upload(&w)?);
    }
    let eps = [1e-6f32, 1e-5];
    for (i, &width) in widths.iter().enumerate() {
        let mut n = poisoned::<f32>(dev, rows * width)?;
        let mut r = poisoned::<f32>(dev, rows * width)?;
        dev.rms_norm(dev.compute(), &xs[i], &mut n, Some(&ws[i]), hd, eps[i])?;
        dev.rope(dev.compute(), &n, &mut r, width, &pos, p)?;
        want_bytes.extend(dev.download(&n)?.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        want_bytes.extend(dev.download(&r)?.iter().flat_map(|v| v.to_bits().to_le_bytes()));
    }
    let mut outs = Vec::new();
    for &width in &widths {
        outs.push((poisoned::<f32>(dev, rows * width)?, poisoned::<f32>(dev, rows * width)?));
    }
    {
        let mut parts: Vec<NormRopePart<'_>> = outs
            .iter_mut()
            .enumerate()
            .map(|(i, (n, r))| NormRopePart { x: &xs[i], weight: Some(&ws[i]), eps: eps[i], width: widths[i], normed: n, roped: r })
            .collect();
        dev.norm_rope(dev.compute(), &mut parts, &pos, p)?;
    }
    for (n, r) in &outs {
        got_bytes.extend(dev.download(n)?.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        got_bytes.extend(dev.download(r)?.iter().flat_map(|v| v.to_bits().to_le_bytes()));
    }
    Ok(compare_bytes(&got_bytes, &want_bytes))
}

/// The slot combine with the residual add fused, against the two kernels apart.
fn combine_add_case(dev: &CudaDevice, n_tok: usize, n_slot: usize, d_model: usize, r_first: bool, seed: u64) -> Result<Cmp, CudaError> {
    let out = dev.upload(&random_values(n_tok * n_slot * d_model, seed))?;
    let w = dev.upload(&random_values(n_tok * n_slot, seed ^ 3))?;
    let r = dev.upload(&random_values(n_tok * d_model, seed ^ 5))?;
    let n = n_tok * d_model;
    let (mut y0, mut s0) = (poisoned::<f32>(dev, n)?, poisoned::<f32>(dev, n)?);
    dev.moe_combine(dev.compute(), &out, &w, n_tok, n_slot, &mut y0)?;
    if r_first {
        dev.add(dev.compute(), &r, &y0, &mut s0)?;
    } else {
        dev.add(dev.compute(), &y0, &r, &mut s0)?;
    }
    let (mut y1, mut s1) = (poisoned::<f32>(dev, n)?, poisoned::<f32>(dev, n)?);
    dev.moe_combine_add(dev.compute(), &out, &w, n_tok, n_slot, &r, r_first, &mut y1, &mut s1)?;
    let bytes = |a: Vec<f32>, b: Vec<f32>| -> Vec<u8> { a.iter().chain(&b).flat_map(|v| v.to_bits().to_le_bytes()).collect() };
    Ok(compare_bytes(&bytes(dev.download(&y1)?, dev.download(&s1)?), &bytes(dev.download(&y0)?, dev.download(&s0)?)))
}

const EDGE_ROWS: usize = 7;

/// The two router kernels on rows the CPU twin does not define the same way
/// (ties, -inf and NaN scores, an infinite logit, NaN everywhere): ids and
/// weight bits must match each other exactly.
fn route_edge_case(dev: &CudaDevice, gating: Gating, n_exp: usize, seed: u64) -> Result<Cmp, CudaError> {
    let rnd = random_values(EDGE_ROWS * n_exp, seed);
    let mut logits = Vec::with_capacity(EDGE_ROWS * n_exp);
    for r in 0..EDGE_ROWS {
        for e in 0..n_exp {
            let v = rnd[r * n_exp + e];
            logits.push(match r {
                0 => 0.5,                                       // all tied
                1 => (v * 4.0).round() / 4.0,                   // many ties
                2 if e % 3 == 0 => f32::NEG_INFINITY,           // -inf logits
                3 if e % 17 == 5 => f32::NAN,                   // some NaN
                4 if e == n_exp / 2 => f32::INFINITY,           // one +inf
                5 => f32::NEG_INFINITY,                         // all -inf
                _ => v,
            });
        }
    }
    // Bias: -inf keys (removed experts are -inf too), +inf and NaN keys.
    let bias: Vec<f32> = (0..n_exp)
        .map(|e| match e % 11 {
            0 => f32::NEG_INFINITY,
            4 => f32::INFINITY,
            7 => f32::NAN,
            _ => 0.0,
        })
        .collect();
    let (ld, bd) = (dev.upload(&logits)?, dev.upload(&bias)?);
    let spec = RouterSpec { k: 8, gating, renormalize: true, scale: 1.5 };
    let mut worst = compare_bytes(&[], &[]);
    for with_bias in [false, true] {
        let mut got = Vec::new();
        for warp in [true, false] {
            let mut ids = poisoned::<i32>(dev, EDGE_ROWS * spec.k)?;
            let mut w = poisoned::<f32>(dev, EDGE_ROWS * spec.k)?;
            let b = with_bias.then_some(&bd);
            dev.route_with(dev.compute(), warp, &spec, &ld, b, EDGE_ROWS, n_exp, &mut ids, &mut w, None)?;
            let mut bytes: Vec<u8> = dev.download(&ids)?.iter().flat_map(|v| v.to_le_bytes()).collect();
            bytes.extend(dev.download(&w)?.iter().flat_map(|v| v.to_bits().to_le_bytes()));
            got.push(bytes);
        }
        let c = compare_bytes(&got[0], &got[1]);
        if !c.pass || c.abs > worst.abs {
            worst = c;
        }
    }
    Ok(worst)
}

/// GPU time per call of `f`, from one CUDA graph of `reps` calls (as a
/// decode step runs them: host launch costs would hide a 2 us kernel).
fn graph_us(dev: &CudaDevice, reps: usize, mut f: impl FnMut() -> Result<(), CudaError>) -> Result<f64, CudaError> {
    let s = dev.compute();
    f()?;
    dev.sync()?;
    s.begin_capture(cusys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let queued = (0..reps).try_for_each(|_| f());
    let graph = s.end_capture(cusys::CUgraphInstantiate_flags(0));
    queued?;
    let graph = graph?.ok_or_else(|| shape("bench", "empty graph"))?;
    graph.launch()?;
    let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
    e0.record(s)?;
    graph.launch()?;
    e1.record(s)?;
    e1.synchronize()?;
    Ok(e0.elapsed_ms(&e1)? as f64 * 1e3 / reps as f64)
}

/// Rows for `selftest::bench`: the decode-sized norm, router and router GEMV
/// (both GEMV kernels, and both on a bf16 4096 x 4096 matrix for the row
/// threshold between them).
pub(super) fn bench(dev: &CudaDevice, out: &mut Vec<BenchRow>) {
    let mut push = |op: &str, format: &str, shape: &str, bytes: usize, r: Result<f64, CudaError>| {
        let (op, us) = match r {
            Ok(us) => (op.to_string(), us),
            Err(e) => (format!("{op} failed: {e}"), f64::NAN),
        };
        let (format, shape) = (format.to_string(), shape.to_string());
        out.push(BenchRow { op, format, shape, us, gb_per_s: bytes as f64 / (us * 1e-6) / 1e9 });
    };
    let reps = 200;
    push("rms_norm (graph)", "f32 weighted", "1x4096", 3 * 4096 * 4, bench_norm(dev, reps));
    push("route (graph)", "softmax renorm top-8", "1 tok x 128 exp", 128 * 4, bench_route(dev, reps));
    for (ty, rows, cols) in [(GgmlType::F32, 128, 4096), (GgmlType::BF16, 4096, 4096)] {
        let bytes = rows * cols * if ty == GgmlType::F32 { 4 } else { 2 };
        for (name, staged) in [("gemv staged (graph)", true), ("gemv 4-row (graph)", false)] {
            let r = bench_float_gemv(dev, ty, rows, cols, staged, reps);
            push(name, &fmt_name(ty), &format!("{rows}x{cols}"), bytes, r);
        }
    }
}

fn bench_norm(dev: &CudaDevice, reps: usize) -> Result<f64, CudaError> {
    let (x, w) = (dev.upload(&random_values(4096, 5))?, dev.upload(&random_values(4096, 6))?);
    let mut y = dev.alloc::<f32>(4096)?;
    graph_us(dev, reps, || dev.rms_norm(dev.compute(), &x, &mut y, Some(&w), 4096, 1e-6))
}

fn bench_route(dev: &CudaDevice, reps: usize) -> Result<f64, CudaError> {
    let spec = RouterSpec { k: 8, gating: Gating::Softmax, renormalize: true, scale: 1.0 };
    let logits = dev.upload(&random_values(128, 7))?;
    let (mut ids, mut w) = (dev.alloc::<i32>(8)?, dev.alloc::<f32>(8)?);
    graph_us(dev, reps, || dev.route(dev.compute(), &spec, &logits, None, 1, 128, &mut ids, &mut w))
}

fn bench_float_gemv(dev: &CudaDevice, ty: GgmlType, rows: usize, cols: usize, staged: bool, reps: usize) -> Result<f64, CudaError> {
    // Copies enough to outgrow the L2, used in turn: each call reads its
    // weights from DRAM, as a decode step's router does.
    let host = random_blocks(ty, rows * cols, 8)?;
    let copies = (256usize << 20).div_ceil(host.len()).clamp(1, 64);
    let ws = (0..copies).map(|_| dev.upload(&host)).collect::<Result<Vec<_>, _>>()?;
    let x = dev.upload(&random_values(cols, 9))?;
    let mut y = dev.alloc::<f32>(rows)?;
    let mut i = 0;
    graph_us(dev, reps, || {
        i += 1;
        dev.gemv_float_with(dev.compute(), staged, ty, &ws[i % copies], rows, cols, &x, &mut y)
    })
}
