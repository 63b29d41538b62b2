//! GPU self-test: every kernel against its CPU twin in `pulsar-kernels`, on
//! fresh random inputs, with outputs poisoned (NaN) before each launch.
//!
//! Tolerances: activation quantization and embedding of the non-IQ formats are
//! exact; the integer dots form the same integer block sums as the CPU, so only
//! the float accumulation order differs (1e-4 of the output's scale covers it,
//! a wrong unpacking is off by O(1)); float ops get 1e-5..1e-6 of their scale.


use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::{self, Activation, RopeKind, RopeParams};
use pulsar_kernels::quant::{random_blocks, random_values};
use pulsar_kernels::{dequantize, ActFormat, Activations, Isa, Kernels, WeightMatrix};

use crate::buf::{DeviceBuf, Pod};
use crate::device::CudaDevice;
use crate::error::CudaError;
use crate::kernels::{FLOAT_TYPES, QUANT_TYPES};
use crate::ops::{Gating, GemmKernel, MoePairs, RouterSpec};

mod attention;
mod bench;
mod moe;
use moe::*;
mod moe_split;
mod small_ops;

pub use bench::bench;

/// One line of the self-test table.
#[derive(Clone, Debug)]
pub struct SelfTestRow {
    pub op: String,
    pub format: String,
    pub shape: String,
    pub max_abs_err: f64,
    /// `max_abs_err` over the largest |reference| value.
    pub max_rel_err: f64,
    /// The bound `max_abs_err` must stay within.
    pub tol: f64,
    pub pass: bool,
    /// Why a row failed to run, when it did.
    pub note: String,
}

/// One line of the bandwidth table.
#[derive(Clone, Debug)]
pub struct BenchRow {
    pub op: String,
    pub format: String,
    pub shape: String,
    pub us: f64,
    pub gb_per_s: f64,
}

struct Cmp {
    abs: f64,
    rel: f64,
    tol: f64,
    pass: bool,
}

/// Compare `gpu` to `cpu`: the error bound is `rel_tol` times the largest |cpu|.
fn compare(gpu: &[f32], cpu: &[f32], rel_tol: f64) -> Cmp {
    let scale = cpu
        .iter()
        .fold(0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    let mut abs = 0f64;
    let mut finite = gpu.len() == cpu.len();
    for (g, c) in gpu.iter().zip(cpu) {
        if !g.is_finite() && c.is_finite() {
            finite = false;
        }
        let d = (*g as f64 - *c as f64).abs();
        abs = if d.is_nan() {
            f64::INFINITY
        } else {
            abs.max(d)
        };
    }
    let tol = rel_tol * scale;
    Cmp {
        abs,
        rel: abs / scale,
        tol,
        pass: finite && abs <= tol,
    }
}

/// Exact comparison of bytes: the error is the number of differing bytes.
fn compare_bytes(gpu: &[u8], cpu: &[u8]) -> Cmp {
    let diff = gpu.iter().zip(cpu).filter(|(a, b)| a != b).count() + gpu.len().abs_diff(cpu.len());
    Cmp {
        abs: diff as f64,
        rel: diff as f64 / cpu.len().max(1) as f64,
        tol: 0.0,
        pass: diff == 0,
    }
}

struct Table {
    rows: Vec<SelfTestRow>,
}

impl Table {
    fn push(&mut self, op: &str, format: &str, shape: String, r: Result<Cmp, CudaError>) {
        let row = match r {
            Ok(c) => SelfTestRow {
                op: op.into(),
                format: format.into(),
                shape,
                max_abs_err: c.abs,
                max_rel_err: c.rel,
                tol: c.tol,
                pass: c.pass,
                note: String::new(),
            },
            Err(e) => SelfTestRow {
                op: op.into(),
                format: format.into(),
                shape,
                max_abs_err: f64::NAN,
                max_rel_err: f64::NAN,
                tol: 0.0,
                pass: false,
                note: e.to_string(),
            },
        };
        self.rows.push(row);
    }
}

fn fmt_name(ty: GgmlType) -> String {
    ty.name().to_ascii_lowercase()
}

/// An output buffer filled with NaN (0xff bytes) on the compute stream.
fn poisoned<T: Pod>(dev: &CudaDevice, len: usize) -> Result<DeviceBuf<T>, CudaError> {
    let mut b = dev.alloc::<T>(len)?;
    b.fill_bytes(dev.compute(), 0xff)?;
    Ok(b)
}

fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(
            std::thread::available_parallelism()
                .map(|n| n.get().min(8))
                .unwrap_or(1),
        )
        .build()
        .expect("a CPU thread pool")
}

/// Run every self-test on `dev`; one row per (op, format, shape).
pub fn run(dev: &CudaDevice) -> Vec<SelfTestRow> {
    let mut t = Table { rows: Vec::new() };
    let pool = pool();
    let k = Kernels::detect();
    // The CPU's scalar dots define the canonical sums the GPU reproduces.
    let ks = Kernels::with_isa(Isa::Scalar).expect("the scalar kernels exist everywhere");
    let mut seed = 0x5eed_u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed
    };

    for (fmt, cols) in [(ActFormat::Q8_0, 4096 + 96), (ActFormat::Q8K, 4096 + 256)] {
        let rows = 5;
        t.push(
            "quantize_act",
            &fmt.to_string(),
            format!("{rows}x{cols}"),
            quantize_case(dev, fmt, rows, cols, next()),
        );
    }
    for ty in QUANT_TYPES {
        let be = ty.block_elems() as usize;
        let cols = if be == 256 { 256 * 7 } else { 32 * 37 };
        // Every quantized product sums in the canonical order: bit-identical
        // to the CPU's scalar dot (tolerance 0) and to each other.
        t.push(
            "gemv",
            &fmt_name(ty),
            format!("257x{cols}"),
            quant_mm_with(dev, &pool, &ks, GemmKernel::Dp4a, ty, 257, cols, 1, next()),
        );
        t.push(
            "gemv",
            &fmt_name(ty),
            format!("131x{}", 3 * cols),
            quant_mm_with(dev, &pool, &ks, GemmKernel::Dp4a, ty, 131, 3 * cols, 1, next()),
        );
        // Enough rows that a warp takes several groups (of two rows for the
        // small K formats), the last group short and the last block part empty.
        t.push(
            "gemv",
            &fmt_name(ty),
            format!("16389x{cols}"),
            quant_mm_with(dev, &pool, &ks, GemmKernel::Dp4a, ty, 16389, cols, 1, next()),
        );
        // q, k and v of one row in one launch: each output is its own GEMV's.
        t.push(
            "gemv (three matrices, one launch)",
            &fmt_name(ty),
            format!("(4100+130+131)x{cols}"),
            gemv_multi_case(dev, &pool, &ks, ty, [4100, 130, 131], cols, next()),
        );
        let mut kernels = vec![("gemm dp4a", GemmKernel::Dp4a)];
        if dev.compute_capability().0 >= 8 {
            kernels.push(("gemm mma", GemmKernel::TensorCore));
        }
        for (name, kernel) in kernels {
            t.push(
                name,
                &fmt_name(ty),
                format!("129x{cols}x37tok"),
                quant_mm_with(dev, &pool, &ks, kernel, ty, 129, cols, 37, next()),
            );
            t.push(
                name,
                &fmt_name(ty),
                format!("200x{}x130tok", 3 * cols),
                quant_mm_with(dev, &pool, &ks, kernel, ty, 200, 3 * cols, 130, next()),
            );
            t.push(
                &format!("{name} = gemv bits"),
                &fmt_name(ty),
                format!("67x{cols}x70tok"),
                gemm_gemv_case(dev, kernel, ty, 67, cols, 70, next()),
            );
        }
    }
    // An activation row too large to stage in shared memory: read in place.
    for ty in [GgmlType::Q8_0, GgmlType::Q2_K] {
        t.push(
            "gemv (x unstaged)",
            &fmt_name(ty),
            "33x90112".into(),
            quant_mm_with(dev, &pool, &ks, GemmKernel::Dp4a, ty, 33, 90112, 1, next()),
        );
    }
    for ty in FLOAT_TYPES {
        t.push(
            "gemv",
            &fmt_name(ty),
            "131x1000".into(),
            float_mm_case(dev, &pool, &k, ty, 131, 1000, 1, next()),
        );
        t.push(
            "gemm",
            &fmt_name(ty),
            "67x520x19tok".into(),
            float_mm_case(dev, &pool, &k, ty, 67, 520, 19, next()),
        );
    }
    t.push(
        "rms_norm",
        "f32",
        "7x4096 weighted".into(),
        norm_case(dev, 7, 4096, true, next()),
    );
    t.push(
        "rms_norm",
        "f32",
        "(7x32)x128 grouped".into(),
        norm_case(dev, 7 * 32, 128, false, next()),
    );
    let neox = RopeParams {
        head_dim: 128,
        n_rot: 128,
        base: 1_000_000.0,
        linear_factor: 1.0,
        kind: RopeKind::Neox,
    };
    let inter = RopeParams {
        head_dim: 64,
        n_rot: 32,
        base: 10_000.0,
        linear_factor: 4.0,
        kind: RopeKind::Interleaved,
    };
    t.push(
        "rope",
        "neox",
        "9x(8x128)".into(),
        rope_case(dev, 9, 8 * 128, &neox, next()),
    );
    t.push(
        "rope",
        "interleaved partial 32/64 lf4",
        "9x(6x64)".into(),
        rope_case(dev, 9, 6 * 64, &inter, next()),
    );
    for (name, act) in [
        ("silu", Activation::Silu),
        ("gelu_tanh", Activation::GeluTanh),
    ] {
        t.push(
            "glu",
            name,
            "10000".into(),
            glu_case(dev, act, 10_000, next()),
        );
    }
    t.push(
        "add/mul/scale",
        "f32",
        "10000".into(),
        elementwise_case(dev, 10_000, next()),
    );
    for ty in FLOAT_TYPES.into_iter().chain(QUANT_TYPES) {
        t.push(
            "embed",
            &fmt_name(ty),
            "9 of 50x512".into(),
            embed_case(dev, ty, 50, 512, next()),
        );
    }
    attention::cases(dev, &mut t, &pool, &mut next);
    t.push(
        "kv_write",
        "rows at device positions",
        "3 rows k512 v256 into 16".into(),
        kv_write_case(dev, next()),
    );
    t.push("kv_write", "f16 cache, rounded as the CPU rounds", "3 rows k512 v256 into 16".into(), kv_write_f16_case(dev, next()));
    for ty in { use pulsar_kernels::ops::KvType; [KvType::Bf16, KvType::Q8_0, KvType::Q4_0, KvType::Fp8] } {
        let case = crate::with_kv_elem!(ty, K => kv_write_format_case::<K>(dev, next()));
        t.push("kv_write", &format!("{ty} cache, stored as the CPU stores it"), "3 rows k512 v80 into 16".into(), case);
    }
    let soft = RouterSpec {
        k: 8,
        gating: Gating::Softmax,
        renormalize: true,
        scale: 2.5,
    };
    let sig = RouterSpec {
        k: 6,
        gating: Gating::Sigmoid,
        renormalize: true,
        scale: 1.0,
    };
    let plain = RouterSpec {
        k: 4,
        gating: Gating::Softmax,
        renormalize: false,
        scale: 1.0,
    };
    t.push(
        "route ids+weights",
        "softmax renorm x2.5",
        "5 tok x 128 exp".into(),
        route_case(dev, &soft, 5, 128, false, next()),
    );
    t.push(
        "route ids+weights",
        "sigmoid bias renorm",
        "5 tok x 192 exp".into(),
        route_case(dev, &sig, 5, 192, true, next()),
    );
    t.push(
        "route ids+weights",
        "softmax",
        "3 tok x 512 exp".into(),
        route_case(dev, &plain, 3, 512, false, next()),
    );
    let moe = [
        (GgmlType::Q4_K, GgmlType::Q6_K),
        (GgmlType::Q8_0, GgmlType::Q8_0),
        (GgmlType::Q5_1, GgmlType::Q4_0),
        (GgmlType::Q2_K, GgmlType::Q3_K),
        (GgmlType::IQ2_XXS, GgmlType::IQ3_XXS),
        (GgmlType::IQ2_XS, GgmlType::Q5_K),
        (GgmlType::Q5_0, GgmlType::Q4_1),
    ];
    for (gu, dn) in moe {
        let f = format!("{}/{}", fmt_name(gu), fmt_name(dn));
        t.push(
            "moe_ffn (null slots skipped)",
            &f,
            "3 tok x 4 slot, d512 ff512".into(),
            moe_case(dev, &pool, &k, gu, dn, MoeShape::SMALL, next()),
        );
        for n_tok in [6usize, 40] {
            t.push(
                "moe_ffn_grouped == moe_ffn (bits)",
                &f,
                format!("{n_tok} tok x 4 slot, d512 ff512"),
                grouped_case(dev, gu, dn, n_tok, next()),
            );
        }
    }
    // Enough pairs that a warp takes two gate + up rows and four down rows.
    for (gu, dn) in [(GgmlType::Q2_K, GgmlType::Q2_K), (GgmlType::Q4_K, GgmlType::Q6_K), (GgmlType::Q8_0, GgmlType::Q8_0)] {
        t.push(
            "moe_ffn (null slots skipped)",
            &format!("{}/{}", fmt_name(gu), fmt_name(dn)),
            "4 tok x 8 slot, d1024 ff1280".into(),
            moe_case(dev, &pool, &k, gu, dn, MoeShape::WIDE, next()),
        );
    }
    for (ty, act) in [
        (GgmlType::F32, Activation::Silu),
        (GgmlType::F16, Activation::GeluTanh),
        (GgmlType::BF16, Activation::Silu),
    ] {
        t.push(
            "moe_ffn_float (null slots skipped)",
            &fmt_name(ty),
            "3 tok x 4 slot, d520 ff333".into(),
            moe_float_case(dev, &pool, &k, ty, act, next()),
        );
    }
    small_ops::cases(dev, &mut t, &pool, &k, &mut next);
    moe_split::cases(dev, &mut t, &mut next);
    t.push("stream waits for a host flag", "u32", "copy queued behind a wait, flag set 30 ms later".into(), flag_case(dev));
    t.push("lane_fill_rows == segment copies", "f32", "6 segments from mapped host memory into 8 x 300".into(), lane_fill_case(dev, next()));
    t.push(
        "moe_gather_ptrs",
        "u64",
        "40 pairs x 16 exp".into(),
        gather_case(dev, next()),
    );
    // Routing that gathers the pointers too, against route + moe_gather_ptrs
    // (one warp a token up to 256 experts, else the block router then the gather).
    for n_exp in [128usize, 300] {
        t.push("route_gather == route + gather", "softmax renorm top-8", format!("5 tok x {n_exp} exp"), route_gather_case(dev, n_exp, false, next()));
        t.push("route_gather == route + gather", "sigmoid bias renorm top-8", format!("5 tok x {n_exp} exp"), route_gather_case(dev, n_exp, true, next()));
    }
    t.push(
        "moe_combine",
        "f32",
        "5 tok x 8 slot x 2048".into(),
        combine_case(dev, 5, 8, 2048, next()),
    );
    t.rows
}

/// The lane's heads written in place from mapped host memory: each segment's
/// values land at its offset, every other value of h keeps its poison.
fn lane_fill_case(dev: &CudaDevice, seed: u64) -> Result<Cmp, CudaError> {
    let (n_pairs, ff) = (8usize, 300usize);
    // (pair, rows): none, one, a block's worth, all, and two ordinary ones.
    let rows = [(0usize, 0usize), (1, 1), (2, 128), (4, 300), (5, 37), (7, 64)];
    let n_vals: usize = rows.iter().map(|r| r.1).sum();
    let vals = random_values(n_vals, seed);
    let mut vh = dev.alloc_pinned::<f32>(n_vals)?;
    vh.as_mut_slice().copy_from_slice(&vals);
    let mut segs = Vec::new();
    let mut at = 0;
    for &(p, r) in &rows {
        segs.push([(p * ff) as i32, at as i32, r as i32]);
        at += r;
    }
    let mut sh = dev.alloc_pinned::<i32>(3 * segs.len())?;
    sh.as_mut_slice().copy_from_slice(segs.concat().as_slice());
    let mut h = poisoned::<f32>(dev, n_pairs * ff)?;
    let mut want = dev.download(&h)?;
    for &[d, s, l] in &segs {
        want[d as usize..(d + l) as usize].copy_from_slice(&vals[s as usize..(s + l) as usize]);
    }
    // SAFETY: both page-locked buffers hold what `segs` says and outlive the sync.
    unsafe { dev.lane_fill_rows(dev.compute(), vh.device_addr()?, n_vals, sh.device_addr()?, &segs, &mut h) }?;
    dev.compute().synchronize()?;
    let got = dev.download(&h)?;
    let bad = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    Ok(Cmp { abs: bad as f64, rel: bad as f64 / got.len() as f64, tol: 0.0, pass: bad == 0 })
}

/// A copy queued behind a flag wait must read what the host wrote just
/// before it raised the flag, 30 ms after the copy was queued (without the
/// wait the copy would read the value of the queueing time).
fn flag_case(dev: &CudaDevice) -> Result<Cmp, CudaError> {
    let flag = dev.new_flag()?;
    let mut src = dev.alloc_pinned::<u32>(1)?;
    src.as_mut_slice()[0] = 1;
    let sp = src.as_mut_slice().as_mut_ptr();
    let dst = dev.alloc::<u32>(1)?;
    let s = dev.compute();
    flag.wait_on(s, 7)?;
    // SAFETY: `dst` holds one u32; `src` is page-locked and outlives the sync below.
    let bytes = unsafe { std::slice::from_raw_parts(sp as *const u8, 4) };
    unsafe { crate::copy_to_device_async(s, dst.device_ptr(), bytes) }?;
    std::thread::sleep(std::time::Duration::from_millis(30));
    // The host's write through the same page-locked memory the copy reads.
    // SAFETY: the copy reads `src` only after the flag is raised below.
    unsafe { std::ptr::write_volatile(sp, 42) };
    flag.set(7);
    s.synchronize()?;
    let got = dev.download(&dst)?[0];
    let bad = (got != 42) as usize;
    Ok(Cmp { abs: bad as f64, rel: bad as f64, tol: 0.0, pass: bad == 0 })
}

fn quantize_case(
    dev: &CudaDevice,
    fmt: ActFormat,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let mut x = random_values(rows * cols, seed);
    x[17] = 0.0;
    x[cols..cols + 256].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
    x[2 * cols + 5] = -9.5; // a signed extreme
    let cpu = Activations::quantize(fmt, &x, cols)?;
    let xd = dev.upload(&x)?;
    let mut out = poisoned::<u8>(dev, cpu.as_bytes().len())?;
    dev.quantize_act(dev.compute(), fmt, &xd, rows, cols, &mut out)?;
    let got = dev.download(&out)?;
    let c = compare_bytes(&got, cpu.as_bytes());
    if !c.pass {
        return Err(CudaError::Shape {
            op: "quantize_act",
            what: byte_diff_note(fmt, &got, cpu.as_bytes(), &x),
        });
    }
    Ok(c)
}

/// Where GPU and CPU activation blocks differ: scale bytes vs quant bytes, and the first few.
fn byte_diff_note(fmt: ActFormat, gpu: &[u8], cpu: &[u8], x: &[f32]) -> String {
    let (bb, be, qs) = match fmt {
        ActFormat::Q8K => (292usize, 256usize, 4usize),
        _ => (34, 32, 2),
    };
    let (mut scale, mut quants, mut first) = (0, 0, Vec::new());
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        if g == c {
            continue;
        }
        let (blk, off) = (i / bb, i % bb);
        if off < qs {
            scale += 1
        } else {
            quants += 1
        }
        if first.len() < 4 {
            let xv = if off >= qs && off - qs < be {
                x.get(blk * be + off - qs).copied().unwrap_or(f32::NAN)
            } else {
                f32::NAN
            };
            first.push(format!(
                "blk {blk} byte {off}: gpu {g:#04x} cpu {c:#04x} x {xv}"
            ));
        }
    }
    format!(
        "{scale} scale bytes and {quants} quant bytes differ; {}",
        first.join("; ")
    )
}

/// A quantized GEMV (one token) or GEMM against the CPU reference `k`, bit for bit.
#[allow(clippy::too_many_arguments)]
fn quant_mm_with(
    dev: &CudaDevice,
    pool: &rayon::ThreadPool,
    k: &Kernels,
    kernel: GemmKernel,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n_tok: usize,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let be = ty.block_elems() as usize;
    let w = random_blocks(ty, rows * cols / be, seed)?;
    let x = random_values(n_tok * cols, seed ^ 1);
    let acts = Activations::for_weight(ty, &x, cols)?;
    let mut cpu = vec![0f32; rows * n_tok];
    k.matmul(
        pool,
        &WeightMatrix::new(ty, &w, rows, cols)?,
        &acts,
        &mut cpu,
    )?;
    let (wd, xd) = (dev.upload(&w)?, dev.upload(acts.as_bytes())?);
    let mut y = poisoned::<f32>(dev, rows * n_tok)?;
    if n_tok == 1 {
        dev.gemv(dev.compute(), ty, &wd, rows, cols, &xd, &mut y)?;
    } else {
        dev.gemm_with(dev.compute(), kernel, ty, &wd, rows, cols, &xd, n_tok, &mut y)?;
    }
    Ok(compare(&dev.download(&y)?, &cpu, 0.0))
}

/// [`CudaDevice::gemv_multi`] of three matrices against the CPU's product of each.
#[allow(clippy::too_many_arguments)]
fn gemv_multi_case(
    dev: &CudaDevice,
    pool: &rayon::ThreadPool,
    k: &Kernels,
    ty: GgmlType,
    rows: [usize; 3],
    cols: usize,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let be = ty.block_elems() as usize;
    let x = random_values(cols, seed ^ 1);
    let acts = Activations::for_weight(ty, &x, cols)?;
    let (mut ws, mut cpu) = (Vec::new(), Vec::new());
    for (i, &r) in rows.iter().enumerate() {
        let w = random_blocks(ty, r * cols / be, seed + i as u64)?;
        let mut c = vec![0f32; r];
        k.matmul(pool, &WeightMatrix::new(ty, &w, r, cols)?, &acts, &mut c)?;
        cpu.extend(c);
        ws.push(dev.upload(&w)?);
    }
    let xd = dev.upload(acts.as_bytes())?;
    let mut ys = rows.iter().map(|&r| poisoned::<f32>(dev, r)).collect::<Result<Vec<_>, _>>()?;
    {
        let mut parts: Vec<crate::ops::GemvPart<'_>> =
            ws.iter().zip(rows).zip(ys.iter_mut()).map(|((w, rows), y)| crate::ops::GemvPart { w, rows, y }).collect();
        dev.gemv_multi(dev.compute(), ty, &mut parts, cols, &xd)?;
    }
    let mut got = Vec::new();
    for y in &ys {
        got.extend(dev.download(y)?);
    }
    Ok(compare(&got, &cpu, 0.0))
}

/// A GEMM's outputs against the GEMV of each token alone, bit for bit: what
/// makes a decoded token's logits equal a fresh prefill's.
#[allow(clippy::too_many_arguments)]
fn gemm_gemv_case(
    dev: &CudaDevice,
    kernel: GemmKernel,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n_tok: usize,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let be = ty.block_elems() as usize;
    let w = random_blocks(ty, rows * cols / be, seed)?;
    let acts = Activations::for_weight(ty, &random_values(n_tok * cols, seed ^ 1), cols)?;
    let row_bytes = acts.as_bytes().len() / n_tok;
    let wd = dev.upload(&w)?;
    let mut y = poisoned::<f32>(dev, rows * n_tok)?;
    dev.gemm_with(dev.compute(), kernel, ty, &wd, rows, cols, &dev.upload(acts.as_bytes())?, n_tok, &mut y)?;
    let mut one = Vec::with_capacity(rows * n_tok);
    let mut yt = poisoned::<f32>(dev, rows)?;
    for t in 0..n_tok {
        let xt = dev.upload(&acts.as_bytes()[t * row_bytes..(t + 1) * row_bytes])?;
        dev.gemv(dev.compute(), ty, &wd, rows, cols, &xt, &mut yt)?;
        one.extend(dev.download(&yt)?);
    }
    Ok(compare(&dev.download(&y)?, &one, 0.0))
}

#[allow(clippy::too_many_arguments)]
fn float_mm_case(
    dev: &CudaDevice,
    pool: &rayon::ThreadPool,
    k: &Kernels,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n_tok: usize,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let w = random_blocks(ty, rows * cols, seed)?;
    let x = random_values(n_tok * cols, seed ^ 1);
    let acts = Activations::for_weight(ty, &x, cols)?;
    let mut cpu = vec![0f32; rows * n_tok];
    k.matmul(
        pool,
        &WeightMatrix::new(ty, &w, rows, cols)?,
        &acts,
        &mut cpu,
    )?;
    let (wd, xd) = (dev.upload(&w)?, dev.upload(&x)?);
    let mut y = poisoned::<f32>(dev, rows * n_tok)?;
    dev.gemm_float(dev.compute(), ty, &wd, rows, cols, &xd, n_tok, &mut y)?;
    Ok(compare(&dev.download(&y)?, &cpu, 0.0))
}

fn norm_case(
    dev: &CudaDevice,
    groups: usize,
    group: usize,
    weighted: bool,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let x: Vec<f32> = random_values(groups * group, seed)
        .iter()
        .map(|v| v * 3.0)
        .collect();
    let w = random_values(group, seed ^ 1);
    let mut cpu = x.clone();
    ops::rms_norm_rows(&mut cpu, group, weighted.then_some(&w[..]), 1e-6);
    let (xd, wd) = (dev.upload(&x)?, dev.upload(&w)?);
    let mut y = poisoned::<f32>(dev, x.len())?;
    dev.rms_norm(
        dev.compute(),
        &xd,
        &mut y,
        weighted.then_some(&wd),
        group,
        1e-6,
    )?;
    let r1 = compare(&dev.download(&y)?, &cpu, 0.0);
    // In place must agree with out of place.
    let mut xi = dev.upload(&x)?;
    dev.rms_norm_in_place(dev.compute(), &mut xi, weighted.then_some(&wd), group, 1e-6)?;
    let r2 = compare(&dev.download(&xi)?, &cpu, 0.0);
    Ok(if r2.abs > r1.abs || !r2.pass { r2 } else { r1 })
}

fn rope_case(
    dev: &CudaDevice,
    n: usize,
    width: usize,
    p: &RopeParams,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let x = random_values(n * width, seed);
    let pos: Vec<u32> = (0..n as u32)
        .map(|i| [0, 1, 7, 100, 513, 2047, 4095, 32767, 131_000][i as usize % 9])
        .collect();
    let mut cpu = x.clone();
    ops::rope_rows(&mut cpu, width, &pos, *p);
    let (mut xd, pd) = (dev.upload(&x)?, dev.upload(&pos)?);
    // Out of place into a poisoned buffer (the unrotated tail is copied), then in place.
    let mut y = poisoned::<f32>(dev, x.len())?;
    dev.rope(dev.compute(), &xd, &mut y, width, &pd, p)?;
    let r1 = compare(&dev.download(&y)?, &cpu, 0.0);
    dev.rope_in_place(dev.compute(), &mut xd, width, &pd, p)?;
    let r2 = compare(&dev.download(&xd)?, &cpu, 0.0);
    Ok(if r2.abs > r1.abs || !r2.pass { r2 } else { r1 })
}

fn glu_case(dev: &CudaDevice, act: Activation, n: usize, seed: u64) -> Result<Cmp, CudaError> {
    let g: Vec<f32> = random_values(n, seed).iter().map(|v| v * 4.0).collect();
    let u = random_values(n, seed ^ 1);
    let mut cpu = g.clone();
    ops::glu_rows(&mut cpu, &u, act);
    let (gd, ud) = (dev.upload(&g)?, dev.upload(&u)?);
    let mut o = poisoned::<f32>(dev, n)?;
    dev.glu(dev.compute(), &gd, &ud, &mut o, act)?;
    Ok(compare(&dev.download(&o)?, &cpu, 0.0))
}

fn elementwise_case(dev: &CudaDevice, n: usize, seed: u64) -> Result<Cmp, CudaError> {
    let a = random_values(n, seed);
    let b = random_values(n, seed ^ 1);
    let mut cpu: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    cpu.extend(a.iter().zip(&b).map(|(x, y)| x * y));
    cpu.extend(a.iter().map(|x| x * 0.37));
    let (ad, bd) = (dev.upload(&a)?, dev.upload(&b)?);
    let mut o = poisoned::<f32>(dev, n)?;
    let mut got = Vec::with_capacity(3 * n);
    dev.add(dev.compute(), &ad, &bd, &mut o)?;
    got.extend(dev.download(&o)?);
    o.fill_bytes(dev.compute(), 0xff)?;
    dev.mul(dev.compute(), &ad, &bd, &mut o)?;
    got.extend(dev.download(&o)?);
    o.fill_bytes(dev.compute(), 0xff)?;
    dev.scale(dev.compute(), &ad, 0.37, &mut o)?;
    got.extend(dev.download(&o)?);
    Ok(compare(&got, &cpu, 0.0))
}

fn embed_case(
    dev: &CudaDevice,
    ty: GgmlType,
    n_vocab: usize,
    cols: usize,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let be = ty.block_elems() as usize;
    let table = random_blocks(ty, n_vocab * cols / be, seed)?;
    let ids: Vec<u32> = vec![3, 0, 49, 17, 17, 8, 21, 48, 1];
    let rb = table.len() / n_vocab;
    let mut cpu = vec![0f32; ids.len() * cols];
    for (i, &id) in ids.iter().enumerate() {
        let r = id as usize;
        dequantize(
            ty,
            &table[r * rb..(r + 1) * rb],
            &mut cpu[i * cols..(i + 1) * cols],
        )?;
    }
    let (td, idd) = (dev.upload(&table)?, dev.upload(&ids)?);
    let mut o = poisoned::<f32>(dev, ids.len() * cols)?;
    dev.embed(dev.compute(), ty, &td, n_vocab, cols, &idd, &mut o)?;
    // The IQ formats scale by a power of two in another place than the CPU:
    // exact (0 on the H200) unless a value is subnormal, so this stays strict.
    Ok(compare(&dev.download(&o)?, &cpu, 0.0))
}

/// `kv_write` puts each row at the cache row its position names (here out of
/// order) and leaves the other rows alone.
fn kv_write_case(dev: &CudaDevice, seed: u64) -> Result<Cmp, CudaError> {
    let (kw, vw, n_ctx, pos) = (512usize, 256usize, 16usize, [5u32, 2, 9]);
    let (k, v) = (random_values(pos.len() * kw, seed), random_values(pos.len() * vw, seed ^ 1));
    let (kc0, vc0) = (random_values(n_ctx * kw, seed ^ 2), random_values(n_ctx * vw, seed ^ 3));
    let (mut kc, mut vc) = (dev.upload(&kc0)?, dev.upload(&vc0)?);
    dev.kv_write(dev.compute(), &dev.upload(&k)?, &dev.upload(&v)?, &dev.upload(&pos)?, kw, vw, &mut kc, &mut vc)?;
    let (mut want_k, mut want_v) = (kc0, vc0);
    for (r, &p) in pos.iter().enumerate() {
        let p = p as usize;
        want_k[p * kw..(p + 1) * kw].copy_from_slice(&k[r * kw..(r + 1) * kw]);
        want_v[p * vw..(p + 1) * vw].copy_from_slice(&v[r * vw..(r + 1) * vw]);
    }
    let mut got = dev.download(&kc)?;
    got.extend(dev.download(&vc)?);
    want_k.extend(want_v);
    Ok(compare(&got, &want_k, 0.0))
}

/// `kv_write` into an f16 cache: each value rounded to nearest even, the
/// bits the CPU cache (`KvType::F16`) stores; the other rows alone.
fn kv_write_f16_case(dev: &CudaDevice, seed: u64) -> Result<Cmp, CudaError> {
    use pulsar_kernels::ops::KvType;
    let (kw, vw, n_ctx, pos) = (512usize, 256usize, 16usize, [5u32, 2, 9]);
    // Large, tiny and halfway values as well as random ones.
    let mut k = random_values(pos.len() * kw, seed);
    k[..6].copy_from_slice(&[7e4, -7e4, 1e-8, 1.0 + 1.0 / 2048.0, 1.0 + 3.0 / 2048.0, -0.0]);
    let v = random_values(pos.len() * vw, seed ^ 1);
    let bits = |x: &[f32]| x.iter().map(|&x| KvType::F16.bits(x)).collect::<Vec<u16>>();
    let (kc0, vc0) = (bits(&random_values(n_ctx * kw, seed ^ 2)), bits(&random_values(n_ctx * vw, seed ^ 3)));
    let (mut kc, mut vc) = (dev.upload(&kc0)?, dev.upload(&vc0)?);
    dev.kv_write(dev.compute(), &dev.upload(&k)?, &dev.upload(&v)?, &dev.upload(&pos)?, kw, vw, &mut kc, &mut vc)?;
    let (mut want_k, mut want_v) = (kc0, vc0);
    for (r, &p) in pos.iter().enumerate() {
        let p = p as usize;
        want_k[p * kw..(p + 1) * kw].copy_from_slice(&bits(&k[r * kw..(r + 1) * kw]));
        want_v[p * vw..(p + 1) * vw].copy_from_slice(&bits(&v[r * vw..(r + 1) * vw]));
    }
    let mut got = dev.download(&kc)?;
    got.extend(dev.download(&vc)?);
    want_k.extend(want_v);
    let le = |x: &[u16]| x.iter().flat_map(|b| b.to_le_bytes()).collect::<Vec<u8>>();
    Ok(compare_bytes(&le(&got), &le(&want_k)))
}

/// `kv_write` into a cache of format `K::KV_TYPE`: each row stored as the
/// bytes the CPU cache (`KvType::put_row`) stores, padding included (v rows
/// of 80 values: a short last block of the blocked formats); the other rows
/// alone.
fn kv_write_format_case<K: crate::ops::KvElem>(dev: &CudaDevice, seed: u64) -> Result<Cmp, CudaError> {
    use crate::ops::{kv_bytes, kv_elems};
    let (kw, vw, n_ctx, pos) = (512usize, 80usize, 16usize, [5u32, 2, 9]);
    let ty = K::KV_TYPE;
    // A zero block, a NaN, a block of halfway values (q8_0 quants), a block
    // whose largest magnitude comes twice with both signs (q4_0 takes the
    // first), values fp8 saturates or holds as subnormals, and random ones.
    let mut k = random_values(pos.len() * kw, seed);
    k[32..64].fill(0.0);
    k[70] = f32::NAN;
    for (i, x) in k[96..128].iter_mut().enumerate() {
        *x = (i as f32 - 15.5) * 0.5;
    }
    k[127] = 127.0 * 0.5;
    k[130] = 5.0;
    k[140] = -5.0;
    k[150] = 1000.0;
    k[151] = -1e-3;
    k[152] = 3e-3;
    k[153] = f32::INFINITY;
    let v = random_values(pos.len() * vw, seed ^ 1);
    let rows = |x: &[f32], w: usize| {
        let rb = ty.row_bytes(w);
        let mut out = vec![0u8; x.len() / w * rb];
        x.chunks_exact(w).zip(out.chunks_exact_mut(rb)).for_each(|(r, o)| ty.put_row(r, o));
        out
    };
    let (kc0, vc0) = (rows(&random_values(n_ctx * kw, seed ^ 2), kw), rows(&random_values(n_ctx * vw, seed ^ 3), vw));
    let (mut kc, mut vc) = (dev.upload(&kv_elems::<K>(&kc0))?, dev.upload(&kv_elems::<K>(&vc0))?);
    dev.kv_write(dev.compute(), &dev.upload(&k)?, &dev.upload(&v)?, &dev.upload(&pos)?, kw, vw, &mut kc, &mut vc)?;
    let (mut want_k, mut want_v) = (kc0, vc0);
    let (kb, vb) = (ty.row_bytes(kw), ty.row_bytes(vw));
    for (r, &p) in pos.iter().enumerate() {
        let p = p as usize;
        want_k[p * kb..(p + 1) * kb].copy_from_slice(&rows(&k[r * kw..(r + 1) * kw], kw));
        want_v[p * vb..(p + 1) * vb].copy_from_slice(&rows(&v[r * vw..(r + 1) * vw], vw));
    }
    let mut got = kv_bytes(&dev.download(&kc)?);
    got.extend(kv_bytes(&dev.download(&vc)?));
    want_k.extend(want_v);
    Ok(compare_bytes(&got, &want_k))
}

/// The table as GitHub Markdown.
pub fn markdown(rows: &[SelfTestRow]) -> String {
    let mut s = String::from("| op | format | shape | max abs err | max rel err | tol | pass |\n|---|---|---|---|---|---|---|\n");
    for r in rows {
        let note = if r.note.is_empty() {
            String::new()
        } else {
            format!(" ({})", r.note.replace('\n', " ").replace('|', "/"))
        };
        s += &format!(
            "| {} | {} | {} | {:.3e} | {:.3e} | {:.3e} | {}{} |\n",
            r.op,
            r.format,
            r.shape,
            r.max_abs_err,
            r.max_rel_err,
            r.tol,
            if r.pass { "ok" } else { "FAIL" },
            note
        );
    }
    s
}

/// The bandwidth table as GitHub Markdown.
pub fn bench_markdown(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "| op | format | shape | us/call | GB/s (weights or KV read) |\n|---|---|---|---|---|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {} | {} | {:.1} | {:.0} |\n",
            r.op, r.format, r.shape, r.us, r.gb_per_s
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_catches_nan_and_errors() {
        assert!(compare(&[1.0, 2.0], &[1.0, 2.0], 0.0).pass);
        assert!(!compare(&[1.0, f32::NAN], &[1.0, 2.0], 1.0).pass);
        assert!(!compare(&[1.0, 2.1], &[1.0, 2.0], 1e-3).pass);
        assert!(compare(&[1.0, 2.0001], &[1.0, 2.0], 1e-3).pass);
        assert!(!compare_bytes(&[1, 2], &[1, 3]).pass);
        assert!(!compare(&[1.0], &[1.0, 2.0], 1.0).pass);
    }
}
