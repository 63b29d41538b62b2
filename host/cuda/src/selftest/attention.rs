//! Self-test cases of attention against the CPU twin (`ops::attend_rows`) at
//! tolerance 0: decode and small prefills with the kernel
//! `CudaDevice::attention` picks (per query there), prefill shapes with the
//! tiled kernel forced, decode shapes with the grouped kernel forced, the
//! other kernels' split partials compared with the per-query kernel's bit for
//! bit (the `part` workspace attn_combine merges), positions past the cache
//! too, and rows of several sequences' caches against each row alone; each
//! in every cache format CUDA holds (f32, f16, bf16, q8_0, q4_0, fp8).

use pulsar_kernels::ops::{self, AttnParams, KvRows, KvType};
use pulsar_kernels::quant::random_values;

use super::{compare, compare_bytes, poisoned, Cmp, Table};
use crate::buf::DeviceBuf;
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::ops::{attention_workspace_len, kv_elems, AttnKernel, KvElem};
use crate::with_kv_elem;

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
        for kv in KV_TYPES {
            t.push(&format!("attention {kv} kv"), name, shape.clone(), attention_case(dev, pool, p, pos, *n_ctx, kv, None, next()));
        }
    }
    // A decode graph sizes the split count for a bucket of the context, not
    // the exact length: the extra splits are empty and must change nothing.
    let padded = attn[0].1;
    t.push(
        "attention f32 kv",
        "decode, splits sized for 4096",
        "1q h8/2 d128 pos1500 ctx4096".into(),
        attention_case(dev, pool, &padded, &[1500], 4096, KvType::F32, None, next()),
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
        for kv in KV_TYPES {
            // d 256 needs sm_90's shared memory; elsewhere the kernel is not used.
            if !available(dev, kv, AttnKernel::Tiled, p) {
                continue;
            }
            t.push(&format!("attention tiled {kv} kv"), name, shape.clone(), attention_case(dev, pool, p, pos, *n_ctx, kv, Some(AttnKernel::Tiled), next()));
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
        for kv in KV_TYPES {
            if !available(dev, kv, AttnKernel::Grouped, p) {
                continue;
            }
            t.push(&format!("attention grouped {kv} kv"), name, shape.clone(), attention_case(dev, pool, p, pos, *n_ctx, kv, Some(AttnKernel::Grouped), next()));
        }
    }
    // Rows of three sequences, each over its own cache, against each row
    // alone (the grouped rows kernel from 2048 keys, the per-query one below).
    for (name, ctxs) in [("rows, grouped", [3000usize, 2500, 4100]), ("rows, per query", [300, 250, 410])] {
        let p = params(16, 4, 128, 0.088, 0, 0.0);
        for kv in KV_TYPES {
            t.push(&format!("attention rows {kv} kv"), name, format!("3 rows h16/4 d128 ctx{ctxs:?}"), rows_case(dev, &p, &ctxs, kv, next()));
        }
    }

    // Positions out of order, repeated, and at or past the cache (NaN rows),
    // which the CPU twin refuses: each kernel's partials against the
    // per-query kernel's, bit for bit.
    let odd: Vec<u32> = (0..45u32).map(|i| (i * 37) % 620).chain([599, 599, 0, 255, 256]).collect();
    for (name, p) in [("odd positions", params(16, 4, 128, 0.088, 0, 0.0)), ("odd positions, group 3 window 200 softcap 20", params(6, 2, 128, 0.1, 200, 20.0))] {
        let shape = format!("{}q h{}/{} d128 ctx600", odd.len(), p.n_head, p.n_kv_head);
        for kv in KV_TYPES {
            t.push("attention tiled part = per-query part (bits)", &format!("{kv} kv, {name}"), shape.clone(), parts_case(dev, &p, &odd, 600, kv, AttnKernel::Tiled, next()));
            t.push("attention grouped part = per-query part (bits)", &format!("{kv} kv, {name}"), shape.clone(), parts_case(dev, &p, &odd, 600, kv, AttnKernel::Grouped, next()));
        }
    }
}

/// The cache formats the CUDA kernels read.
const KV_TYPES: [KvType; 6] = [KvType::F32, KvType::F16, KvType::Bf16, KvType::Q8_0, KvType::Q4_0, KvType::Fp8];

/// Rows `x` of `w` values in format `kv`: their bytes (`put_row`'s, what
/// the device cache holds) and the values the format holds (what the CPU
/// twin reads). One path for every format.
fn encode(kv: KvType, x: &[f32], w: usize) -> (Vec<u8>, Vec<f32>) {
    let rb = kv.row_bytes(w);
    let mut bytes = vec![0u8; x.len() / w * rb];
    for (row, out) in x.chunks_exact(w).zip(bytes.chunks_exact_mut(rb)) {
        kv.put_row(row, out);
    }
    let mut vals = vec![0f32; x.len()];
    match kv {
        KvType::F32 => vals.copy_from_slice(x),
        KvType::F16 | KvType::Bf16 => {
            let bits: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let rows = if kv == KvType::F16 { KvRows::F16(&bits) } else { KvRows::Bf16(&bits) };
            rows.get(0, &mut vals);
        }
        _ => {
            for (j, out) in vals.chunks_exact_mut(w).enumerate() {
                KvRows::Bytes { ty: kv, data: &bytes, width: w }.get(j * w, out);
            }
        }
    }
    (bytes, vals)
}

/// Whether `kernel` (tiled or grouped) takes these heads in format `kv` here.
fn available(dev: &CudaDevice, kv: KvType, kernel: AttnKernel, p: &AttnParams) -> bool {
    with_kv_elem!(kv, K => {
        let r = if kernel == AttnKernel::Tiled { dev.attention_tiled_available::<K>(p) } else { dev.attention_grouped_available::<K>(p) };
        r.unwrap_or(false)
    })
}

/// [`CudaDevice::attention_rows`] over one cache per row (positions
/// `ctxs[r] - 1`) against [`CudaDevice::attention`] of each row alone, bit
/// for bit; the caches in format `kv`.
fn rows_case(dev: &CudaDevice, p: &AttnParams, ctxs: &[usize], kv: KvType, seed: u64) -> Result<Cmp, CudaError> {
    let q = random_values(ctxs.len() * p.n_head * p.head_dim_k, seed);
    let pos: Vec<u32> = ctxs.iter().map(|&c| (c - 1) as u32).collect();
    let (kw, vw) = (p.n_kv_head * p.head_dim_k, p.n_kv_head * p.head_dim_v);
    let caches: Vec<(Vec<u8>, Vec<u8>)> = ctxs
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            let s = seed ^ ((r as u64 + 1) << 8);
            (encode(kv, &random_values(c * kw, s), kw).0, encode(kv, &random_values(c * vw, s ^ 1), vw).0)
        })
        .collect();
    with_kv_elem!(kv, K => {
        let up = caches.iter().map(|(k, v)| Ok((dev.upload(&kv_elems::<K>(k))?, dev.upload(&kv_elems::<K>(v))?))).collect::<Result<Vec<_>, CudaError>>()?;
        rows_of(dev, p, &q, &pos, ctxs, &up)
    })
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
fn parts_case(dev: &CudaDevice, p: &AttnParams, pos: &[u32], n_ctx: usize, kv: KvType, other: AttnKernel, seed: u64) -> Result<Cmp, CudaError> {
    let q = dev.upload(&random_values(pos.len() * p.n_head * p.head_dim_k, seed))?;
    let pd = dev.upload(pos)?;
    let (kw, vw) = (p.n_kv_head * p.head_dim_k, p.n_kv_head * p.head_dim_v);
    let (ek, _) = encode(kv, &random_values(n_ctx * kw, seed ^ 1), kw);
    let (ev, _) = encode(kv, &random_values(n_ctx * vw, seed ^ 2), vw);
    with_kv_elem!(kv, K => parts_of(dev, p, &q, &pd, &dev.upload(&kv_elems::<K>(&ek))?, &dev.upload(&kv_elems::<K>(&ev))?, n_ctx, other))
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
    kv: KvType,
    kernel: Option<AttnKernel>,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let n_q = pos.len();
    let q = random_values(n_q * p.n_head * p.head_dim_k, seed);
    let (kw, vw) = (p.n_kv_head * p.head_dim_k, p.n_kv_head * p.head_dim_v);
    let (ek, kc) = encode(kv, &random_values(n_ctx * kw, seed ^ 1), kw);
    let (ev, vc) = encode(kv, &random_values(n_ctx * vw, seed ^ 2), vw);
    // The twin over the values the format holds: f32 rows of them.
    let mut cpu = vec![0f32; n_q * p.n_head * p.head_dim_v];
    ops::attend_rows(pool, p, &q, pos, &kc, &vc, &mut cpu);
    let (qd, pd) = (dev.upload(&q)?, dev.upload(pos)?);
    let mut work = dev.alloc::<f32>(attention_workspace_len(p, n_q, n_ctx))?;
    let mut o = poisoned::<f32>(dev, cpu.len())?;
    with_kv_elem!(kv, K => run(dev, kernel, p, &qd, &pd, &dev.upload(&kv_elems::<K>(&ek))?, &dev.upload(&kv_elems::<K>(&ev))?, n_ctx, &mut work, &mut o))?;
    Ok(compare(&dev.download(&o)?, &cpu, 0.0))
}
