//! Self-test cases of attention against the CPU twin (`ops::attend_rows`) at
//! tolerance 0: decode and small prefills with the kernel
//! `CudaDevice::attention` picks (per query there), prefill shapes with the
//! tiled kernel forced, decode shapes with the grouped kernel forced, the
//! other kernels' split partials compared with the per-query kernel's bit for
//! bit (the `part` workspace attn_combine merges), positions past the cache
//! too, and rows of several sequences' caches against each row alone.

use pulsar_kernels::ops::{self, AttnParams};
use pulsar_kernels::quant::random_values;

use super::{compare, compare_bytes, poisoned, Cmp, Table};
use crate::buf::DeviceBuf;
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::ops::{attention_workspace_len, AttnKernel, KvElem};

fn params(n_head: usize, n_kv_head: usize, d: usize, scale: f32, window: usize, softcap: f32) -> AttnParams {
    AttnParams { n_head, n_kv_head, head_dim_k: d, head_dim_v: d, scale, window, softcap }
}

pub(super) fn cases(dev: &CudaDevice, t: &mut Table, pool: &rayon::ThreadPool, next: &mut dyn FnMut() -> u64) {
    let attn = [
        (
            "decode",
            AttnParams {
                n_head: 8,
                n_kv_head: 2,
                head_dim_k: 128,
                head_dim_v: 128,
                scale: 0.088,
                window: 0,
                softcap: 0.0,
            },
            vec![1500u32],
            1501,
        ),
        (
            "decode window 256 softcap 50",
            AttnParams {
                n_head: 8,
                n_kv_head: 4,
                head_dim_k: 64,
                head_dim_v: 64,
                scale: 0.125,
                window: 256,
                softcap: 50.0,
            },
            vec![999],
            1000,
        ),
        (
            "prefill 96 tok",
            AttnParams {
                n_head: 4,
                n_kv_head: 1,
                head_dim_k: 64,
                head_dim_v: 64,
                scale: 0.125,
                window: 0,
                softcap: 0.0,
            },
            (200..296).collect(),
            296,
        ),
        (
            "prefill window 40",
            AttnParams {
                n_head: 4,
                n_kv_head: 2,
                head_dim_k: 256,
                head_dim_v: 256,
                scale: 0.0625,
                window: 40,
                softcap: 30.0,
            },
            (0..70).collect(),
            70,
        ),
    ];
    for (name, p, pos, n_ctx) in &attn {
        let shape = format!(
            "{}q h{}/{} d{} ctx{n_ctx}",
            pos.len(),
            p.n_head,
            p.n_kv_head,
            p.head_dim_k
        );
        t.push(
            "attention f32 kv",
            name,
            shape.clone(),
            attention_case(dev, pool, p, pos, *n_ctx, false, None, next()),
        );
        t.push(
            "attention f16 kv",
            name,
            shape,
            attention_case(dev, pool, p, pos, *n_ctx, true, None, next()),
        );
    }
    // A decode graph sizes the split count for a bucket of the context, not
    // the exact length: the extra splits are empty and must change nothing.
    let padded = attn[0].1;
    t.push(
        "attention f32 kv",
        "decode, splits sized for 4096",
        "1q h8/2 d128 pos1500 ctx4096".into(),
        attention_case(dev, pool, &padded, &[1500], 4096, false, None, next()),
    );

    // The tiled prefill kernel: the qwen3-235b chunk (64 heads over 4, d 128),
    // windows and soft-capping, a last tile cut short (n_q * group not a
    // multiple of 64 rows), a group (3) whose rows straddle queries, several
    // splits, and the other head dims.
    let tiled = [
        ("prefill 512 tok (qwen3-235b)", params(64, 4, 128, 0.088, 0, 0.0), (0..512).collect::<Vec<u32>>(), 512),
        ("prefill window 100 softcap 30, short tile", params(16, 4, 128, 0.088, 100, 30.0), (300..337).collect(), 337),
        ("prefill group 3 window 300", params(12, 4, 128, 0.088, 300, 0.0), (400..445).collect(), 445),
        ("prefill 70 tok after 1000", params(8, 1, 128, 0.088, 0, 0.0), (1000..1070).collect(), 1070),
        ("prefill 96 tok", attn[2].1, attn[2].2.clone(), attn[2].3),
        ("prefill window 40", attn[3].1, attn[3].2.clone(), attn[3].3),
    ];
    for (name, p, pos, n_ctx) in &tiled {
        let shape = format!("{}q h{}/{} d{} ctx{n_ctx}", pos.len(), p.n_head, p.n_kv_head, p.head_dim_k);
        for f16 in [false, true] {
            // d 256 needs sm_90's shared memory; elsewhere the kernel is not used.
            let avail = if f16 { dev.attention_tiled_available::<u16>(p) } else { dev.attention_tiled_available::<f32>(p) };
            if !avail.unwrap_or(false) {
                continue;
            }
            let op = if f16 { "attention tiled f16 kv" } else { "attention tiled f32 kv" };
            t.push(op, name, shape.clone(), attention_case(dev, pool, p, pos, *n_ctx, f16, Some(AttnKernel::Tiled), next()));
        }
    }
    // The grouped decode kernel: qwen3-235b's heads at 20 splits, a group
    // of 6 (a short quad), 20 heads a kv head (a 16-head and a 4-head slice),
    // windows and soft-capping, three queries, each head dim, and a group of
    // 32 at a short context (slices of 4 there).
    let grouped = [
        ("decode qwen3-235b, 20 splits", params(64, 4, 128, 0.088, 0, 0.0), vec![5000u32], 5001),
        ("decode group 6 window 700 softcap 30", params(12, 2, 64, 0.125, 700, 30.0), vec![2999], 3000),
        ("decode group 20", params(40, 2, 128, 0.088, 0, 0.0), vec![2047], 2048),
        ("3 queries, group 8 d256", params(16, 2, 256, 0.0625, 0, 0.0), vec![600, 1500, 1501], 1502),
        ("decode group 32, 2 splits", params(32, 1, 128, 0.088, 0, 0.0), vec![300], 301),
    ];
    for (name, p, pos, n_ctx) in &grouped {
        let shape = format!("{}q h{}/{} d{} ctx{n_ctx}", pos.len(), p.n_head, p.n_kv_head, p.head_dim_k);
        for f16 in [false, true] {
            let avail = if f16 { dev.attention_grouped_available::<u16>(p) } else { dev.attention_grouped_available::<f32>(p) };
            if !avail.unwrap_or(false) {
                continue;
            }
            let op = if f16 { "attention grouped f16 kv" } else { "attention grouped f32 kv" };
            t.push(op, name, shape.clone(), attention_case(dev, pool, p, pos, *n_ctx, f16, Some(AttnKernel::Grouped), next()));
        }
    }
    // Rows of three sequences, each over its own cache, against each row
    // alone (the grouped rows kernel from 2048 keys, the per-query one below).
    for (name, ctxs) in [("rows, grouped", [3000usize, 2500, 4100]), ("rows, per query", [300, 250, 410])] {
        let p = params(16, 4, 128, 0.088, 0, 0.0);
        t.push("attention rows f32 kv", name, format!("3 rows h16/4 d128 ctx{ctxs:?}"), rows_case(dev, &p, &ctxs, false, next()));
        t.push("attention rows f16 kv", name, format!("3 rows h16/4 d128 ctx{ctxs:?}"), rows_case(dev, &p, &ctxs, true, next()));
    }

    // Positions out of order, repeated, and at or past the cache (NaN rows),
    // which the CPU twin refuses: each kernel's partials against the
    // per-query kernel's, bit for bit.
    let odd: Vec<u32> = (0..45u32).map(|i| (i * 37) % 620).chain([599, 599, 0, 255, 256]).collect();
    for (name, p) in [("odd positions", params(16, 4, 128, 0.088, 0, 0.0)), ("odd positions, group 3 window 200 softcap 20", params(6, 2, 128, 0.1, 200, 20.0))] {
        let shape = format!("{}q h{}/{} d128 ctx600", odd.len(), p.n_head, p.n_kv_head);
        for f16 in [false, true] {
            let kv = if f16 { "f16 kv" } else { "f32 kv" };
            t.push("attention tiled part = per-query part (bits)", &format!("{kv}, {name}"), shape.clone(), parts_case(dev, &p, &odd, 600, f16, AttnKernel::Tiled, next()));
            t.push("attention grouped part = per-query part (bits)", &format!("{kv}, {name}"), shape.clone(), parts_case(dev, &p, &odd, 600, f16, AttnKernel::Grouped, next()));
        }
    }
}

/// [`CudaDevice::attention_rows`] over one cache per row (positions
/// `ctxs[r] - 1`) against [`CudaDevice::attention`] of each row alone, bit
/// for bit; the caches f32 or f16.
fn rows_case(dev: &CudaDevice, p: &AttnParams, ctxs: &[usize], f16: bool, seed: u64) -> Result<Cmp, CudaError> {
    let q = random_values(ctxs.len() * p.n_head * p.head_dim_k, seed);
    let pos: Vec<u32> = ctxs.iter().map(|&c| (c - 1) as u32).collect();
    let caches: Vec<(Vec<f32>, Vec<f32>)> = ctxs
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            let s = seed ^ ((r as u64 + 1) << 8);
            (random_values(c * p.n_kv_head * p.head_dim_k, s), random_values(c * p.n_kv_head * p.head_dim_v, s ^ 1))
        })
        .collect();
    if f16 {
        let bits = |v: &[f32]| v.iter().map(|x| half::f16::from_f32(*x).to_bits()).collect::<Vec<u16>>();
        let up: Vec<_> = caches.iter().map(|(k, v)| Ok((dev.upload(&bits(k))?, dev.upload(&bits(v))?))).collect::<Result<_, CudaError>>()?;
        rows_of(dev, p, &q, &pos, ctxs, &up)
    } else {
        let up: Vec<_> = caches.iter().map(|(k, v)| Ok((dev.upload(k)?, dev.upload(v)?))).collect::<Result<_, CudaError>>()?;
        rows_of(dev, p, &q, &pos, ctxs, &up)
    }
}

fn rows_of<K: KvElem>(dev: &CudaDevice, p: &AttnParams, q: &[f32], pos: &[u32], ctxs: &[usize], caches: &[(DeviceBuf<K>, DeviceBuf<K>)]) -> Result<Cmp, CudaError> {
    let n = ctxs.len();
    let longest = ctxs.iter().copied().max().unwrap_or(1);
    let mut alone = Vec::new();
    for (r, &c) in ctxs.iter().enumerate() {
        let qd = dev.upload(&q[r * p.n_head * p.head_dim_k..][..p.n_head * p.head_dim_k])?;
        let pd = dev.upload(&pos[r..r + 1])?;
        let mut work = poisoned::<f32>(dev, attention_workspace_len(p, 1, c))?;
        let mut o = poisoned::<f32>(dev, p.n_head * p.head_dim_v)?;
        dev.attention(dev.compute(), p, &qd, &pd, &caches[r].0, &caches[r].1, c, &mut work, &mut o)?;
        alone.extend(dev.download(&o)?);
    }
    let table: Vec<u64> = caches.iter().map(|c| c.0.device_ptr()).chain(caches.iter().map(|c| c.1.device_ptr())).collect();
    let (qd, pd, td) = (dev.upload(q)?, dev.upload(pos)?, dev.upload(&table)?);
    let mut work = poisoned::<f32>(dev, attention_workspace_len(p, n, longest))?;
    let mut o = poisoned::<f32>(dev, n * p.n_head * p.head_dim_v)?;
    // SAFETY: the table names live caches of ctxs[r] rows for row r, whose
    // position is ctxs[r] - 1.
    unsafe { dev.attention_rows::<K>(dev.compute(), p, &qd, &pd, &td, (0, n), longest, &mut work, &mut o)? };
    let bits = |v: &[f32]| v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect::<Vec<u8>>();
    Ok(compare_bytes(&bits(&dev.download(&o)?), &bits(&alone)))
}

/// The `part` workspaces of the per-query and the tiled kernel on the same
/// inputs, compared bit for bit.
fn parts_case(dev: &CudaDevice, p: &AttnParams, pos: &[u32], n_ctx: usize, f16_kv: bool, other: AttnKernel, seed: u64) -> Result<Cmp, CudaError> {
    let q = dev.upload(&random_values(pos.len() * p.n_head * p.head_dim_k, seed))?;
    let pd = dev.upload(pos)?;
    let (kc, vc) = (random_values(n_ctx * p.n_kv_head * p.head_dim_k, seed ^ 1), random_values(n_ctx * p.n_kv_head * p.head_dim_v, seed ^ 2));
    if f16_kv {
        let bits = |v: &[f32]| v.iter().map(|x| half::f16::from_f32(*x).to_bits()).collect::<Vec<u16>>();
        parts_of(dev, p, &q, &pd, &dev.upload(&bits(&kc))?, &dev.upload(&bits(&vc))?, n_ctx, other)
    } else {
        parts_of(dev, p, &q, &pd, &dev.upload(&kc)?, &dev.upload(&vc)?, n_ctx, other)
    }
}

#[allow(clippy::too_many_arguments)]
fn parts_of<K: KvElem>(dev: &CudaDevice, p: &AttnParams, q: &DeviceBuf<f32>, pos: &DeviceBuf<u32>, k: &DeviceBuf<K>, v: &DeviceBuf<K>, n_ctx: usize, other: AttnKernel) -> Result<Cmp, CudaError> {
    let mut parts = Vec::new();
    for kernel in [AttnKernel::PerQuery, other] {
        let mut work = poisoned::<f32>(dev, attention_workspace_len(p, pos.len(), n_ctx))?;
        let mut o = poisoned::<f32>(dev, pos.len() * p.n_head * p.head_dim_v)?;
        run(dev, Some(kernel), p, q, pos, k, v, n_ctx, &mut work, &mut o)?;
        parts.push(dev.download(&work)?.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect::<Vec<u8>>());
    }
    Ok(compare_bytes(&parts[1], &parts[0]))
}

/// Attention with `kernel`, or the one `CudaDevice::attention` picks (None).
#[allow(clippy::too_many_arguments)]
fn run<K: KvElem>(
    dev: &CudaDevice,
    kernel: Option<AttnKernel>,
    p: &AttnParams,
    q: &DeviceBuf<f32>,
    pos: &DeviceBuf<u32>,
    k: &DeviceBuf<K>,
    v: &DeviceBuf<K>,
    n_ctx: usize,
    work: &mut DeviceBuf<f32>,
    out: &mut DeviceBuf<f32>,
) -> Result<(), CudaError> {
    match kernel {
        None => dev.attention(dev.compute(), p, q, pos, k, v, n_ctx, work, out),
        Some(kn) => dev.attention_with(dev.compute(), kn, p, q, pos, k, v, n_ctx, work, out),
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_case(
    dev: &CudaDevice,
    pool: &rayon::ThreadPool,
    p: &AttnParams,
    pos: &[u32],
    n_ctx: usize,
    f16_kv: bool,
    kernel: Option<AttnKernel>,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let n_q = pos.len();
    let q = random_values(n_q * p.n_head * p.head_dim_k, seed);
    let mut kc = random_values(n_ctx * p.n_kv_head * p.head_dim_k, seed ^ 1);
    let mut vc = random_values(n_ctx * p.n_kv_head * p.head_dim_v, seed ^ 2);
    let to_f16 = |v: &mut Vec<f32>| -> Vec<u16> {
        let bits: Vec<u16> = v
            .iter()
            .map(|x| half::f16::from_f32(*x).to_bits())
            .collect();
        v.iter_mut()
            .zip(&bits)
            .for_each(|(x, b)| *x = half::f16::from_bits(*b).to_f32());
        bits
    };
    let (kh, vh) = if f16_kv {
        (to_f16(&mut kc), to_f16(&mut vc))
    } else {
        (Vec::new(), Vec::new())
    };
    let mut cpu = vec![0f32; n_q * p.n_head * p.head_dim_v];
    ops::attend_rows(pool, p, &q, pos, &kc, &vc, &mut cpu);
    let (qd, pd) = (dev.upload(&q)?, dev.upload(pos)?);
    let mut work = dev.alloc::<f32>(attention_workspace_len(p, n_q, n_ctx))?;
    let mut o = poisoned::<f32>(dev, cpu.len())?;
    if f16_kv {
        let (kd, vd) = (dev.upload(&kh)?, dev.upload(&vh)?);
        run(dev, kernel, p, &qd, &pd, &kd, &vd, n_ctx, &mut work, &mut o)?;
    } else {
        let (kd, vd) = (dev.upload(&kc)?, dev.upload(&vc)?);
        run(dev, kernel, p, &qd, &pd, &kd, &vd, n_ctx, &mut work, &mut o)?;
    }
    Ok(compare(&dev.download(&o)?, &cpu, 0.0))
}

