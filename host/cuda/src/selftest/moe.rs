//! Self-test rows of the routing and MoE kernels: the routers (with the
//! pointer gather and the selection bias), the pair gather, the slot combine
//! and the expert FFNs (pair by pair, grouped, float) against their CPU twins.

use super::*;

pub(super) fn route_gather_case(dev: &CudaDevice, n_exp: usize, with_bias: bool, seed: u64) -> Result<Cmp, CudaError> {
    let (n_tok, k) = (5usize, 8usize);
    let gating = if with_bias { Gating::Sigmoid } else { Gating::Softmax };
    let spec = RouterSpec { k, gating, renormalize: true, scale: if with_bias { 2.5 } else { 1.0 } };
    let logits = dev.upload(&random_values(n_tok * n_exp, seed))?;
    let bias = dev.upload(&random_values(n_exp, seed ^ 7))?;
    let bias = with_bias.then_some(&bias);
    let tables: Vec<DeviceBuf<u64>> = (0..3u64)
        .map(|m| dev.upload(&(0..n_exp as u64).map(|e| if e % 7 == 3 { 0 } else { (m + 1) << 40 | e * 4096 }).collect::<Vec<u64>>()))
        .collect::<Result<_, _>>()?;
    let tabs = [&tables[0], &tables[1], &tables[2]];
    let n = n_tok * k;
    let mut bufs: Vec<DeviceBuf<u64>> = (0..6).map(|_| poisoned::<u64>(dev, n)).collect::<Result<_, _>>()?;
    let (fused, apart) = bufs.split_at_mut(3);
    let (mut ids_a, mut w_a) = (poisoned::<i32>(dev, n)?, poisoned::<f32>(dev, n)?);
    let (mut ids_b, mut w_b) = (poisoned::<i32>(dev, n)?, poisoned::<f32>(dev, n)?);
    let [f0, f1, f2] = fused else { unreachable!() };
    dev.route_gather(dev.compute(), &spec, &logits, bias, n_tok, n_exp, &mut ids_a, &mut w_a, tabs, [f0, f1, f2])?;
    dev.route(dev.compute(), &spec, &logits, bias, n_tok, n_exp, &mut ids_b, &mut w_b)?;
    let [a0, a1, a2] = apart else { unreachable!() };
    dev.moe_gather_ptrs(dev.compute(), &ids_b, tabs, [a0, a1, a2])?;
    let mut diff = (dev.download(&ids_a)? != dev.download(&ids_b)?) as usize;
    diff += dev.download(&w_a)?.iter().zip(dev.download(&w_b)?).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    for i in 0..3 {
        diff += dev.download(&bufs[i])?.iter().zip(dev.download(&bufs[i + 3])?).filter(|(a, b)| *a != b).count();
    }
    Ok(Cmp { abs: diff as f64, rel: diff as f64 / (4 * n) as f64, tol: 0.0, pass: diff == 0 })
}

pub(super) fn gather_case(dev: &CudaDevice, seed: u64) -> Result<Cmp, CudaError> {
    let (n_pairs, n_exp) = (40usize, 16usize);
    // Ids include out-of-range values (-1, n_exp): those pairs must come out null.
    let ids: Vec<i32> = (0..n_pairs)
        .map(|p| match p {
            3 => -1,
            7 => n_exp as i32,
            _ => ((p as u64 * 7 + seed) % n_exp as u64) as i32,
        })
        .collect();
    let tables: Vec<Vec<u64>> = (0..3u64)
        .map(|k| {
            (0..n_exp as u64)
                .map(|e| if e == 5 { 0 } else { (k + 1) << 40 | (e * 4096 + seed % 64) })
                .collect()
        })
        .collect();
    let idd = dev.upload(&ids)?;
    let td: Vec<DeviceBuf<u64>> = tables.iter().map(|t| dev.upload(t)).collect::<Result<_, _>>()?;
    let (mut g, mut u, mut d) = (
        poisoned::<u64>(dev, n_pairs)?,
        poisoned::<u64>(dev, n_pairs)?,
        poisoned::<u64>(dev, n_pairs)?,
    );
    dev.moe_gather_ptrs(dev.compute(), &idd, [&td[0], &td[1], &td[2]], [&mut g, &mut u, &mut d])?;
    let mut diff = 0usize;
    for (k, got) in [dev.download(&g)?, dev.download(&u)?, dev.download(&d)?].iter().enumerate() {
        for (p, &v) in got.iter().enumerate() {
            let e = ids[p];
            let want = if (0..n_exp as i32).contains(&e) { tables[k][e as usize] } else { 0 };
            diff += (v != want) as usize;
        }
    }
    Ok(Cmp { abs: diff as f64, rel: diff as f64 / (3 * n_pairs) as f64, tol: 0.0, pass: diff == 0 })
}

pub(super) fn combine_case(dev: &CudaDevice, n_tok: usize, n_slot: usize, d_model: usize, seed: u64) -> Result<Cmp, CudaError> {
    let out = random_values(n_tok * n_slot * d_model, seed);
    let w = random_values(n_tok * n_slot, seed ^ 3);
    let (od, wd) = (dev.upload(&out)?, dev.upload(&w)?);
    let mut y = poisoned::<f32>(dev, n_tok * d_model)?;
    dev.moe_combine(dev.compute(), &od, &wd, n_tok, n_slot, &mut y)?;
    let got = dev.download(&y)?;
    // The CPU backend's loop: from zero, slot by slot, multiply then add.
    let mut cpu = vec![0f32; n_tok * d_model];
    for t in 0..n_tok {
        for s in 0..n_slot {
            let p = t * n_slot + s;
            for c in 0..d_model {
                cpu[t * d_model + c] += w[p] * out[p * d_model + c];
            }
        }
    }
    // Same operations in the same order: bit for bit.
    let diff = got.iter().zip(&cpu).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    let mut c = compare(&got, &cpu, 0.0);
    c.pass = diff == 0;
    Ok(c)
}

pub(super) fn route_case(
    dev: &CudaDevice,
    spec: &RouterSpec,
    n_tok: usize,
    n_exp: usize,
    with_bias: bool,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let logits: Vec<f32> = random_values(n_tok * n_exp, seed)
        .iter()
        .map(|v| v * 2.0)
        .collect();
    let bias: Vec<f32> = random_values(n_exp, seed ^ 1)
        .iter()
        .map(|v| v * 0.1)
        .collect();
    let (mut cpu_ids, mut cpu_w) = (Vec::new(), Vec::new());
    for row in logits.chunks_exact(n_exp) {
        let mut p = row.to_vec();
        match spec.gating {
            Gating::Softmax => ops::softmax_in_place(&mut p),
            Gating::Sigmoid => p.iter_mut().for_each(|v| *v = ops::math::sigmoid(*v)),
        }
        let choice: Vec<f32> = if with_bias {
            p.iter().zip(&bias).map(|(a, b)| a + b).collect()
        } else {
            p.clone()
        };
        let ids = ops::top_k(&choice, spec.k);
        let w: Vec<f32> = ids.iter().map(|&i| p[i]).collect();
        let s: f32 = w.iter().sum();
        cpu_w.extend(
            w.iter()
                .map(|v| if spec.renormalize { v / s } else { *v } * spec.scale),
        );
        cpu_ids.extend(ids.iter().map(|&i| i as i32));
    }
    let (ld, bd) = (dev.upload(&logits)?, dev.upload(&bias)?);
    let mut ids = poisoned::<i32>(dev, n_tok * spec.k)?;
    let mut w = poisoned::<f32>(dev, n_tok * spec.k)?;
    dev.route(
        dev.compute(),
        spec,
        &ld,
        with_bias.then_some(&bd),
        n_tok,
        n_exp,
        &mut ids,
        &mut w,
    )?;
    let got_ids = dev.download(&ids)?;
    let mut c = compare(&dev.download(&w)?, &cpu_w, 0.0);
    let wrong_ids = got_ids.iter().zip(&cpu_ids).filter(|(a, b)| a != b).count();
    if wrong_ids > 0 {
        c.pass = false;
        c.abs = c.abs.max(wrong_ids as f64);
    }
    Ok(c)
}

/// One expert's matrices for the CPU reference of the MoE cases.
pub(super) struct ExpertRef<'a> {
    gate_up_ty: GgmlType,
    down_ty: GgmlType,
    gate: &'a [u8],
    up: &'a [u8],
    down: &'a [u8],
}

/// The CPU twin of one (token, expert) pair: `h = act(gate x) * (up x)`, then
/// `down h` with h in the activation format `down_ty` takes. Returns (h, out).
pub(super) fn cpu_expert(
    k: &Kernels,
    pool: &rayon::ThreadPool,
    w: &ExpertRef<'_>,
    x: &[f32],
    d_model: usize,
    ff: usize,
    act: Activation,
) -> Result<(Vec<f32>, Vec<f32>), CudaError> {
    let xt = Activations::for_weight(w.gate_up_ty, x, d_model)?;
    let (mut g, mut u) = (vec![0f32; ff], vec![0f32; ff]);
    k.matvec(pool, &WeightMatrix::new(w.gate_up_ty, w.gate, ff, d_model)?, &xt, &mut g)?;
    k.matvec(pool, &WeightMatrix::new(w.gate_up_ty, w.up, ff, d_model)?, &xt, &mut u)?;
    ops::glu_rows(&mut g, &u, act);
    let ht = Activations::for_weight(w.down_ty, &g, ff)?;
    let mut y = vec![0f32; d_model];
    k.matvec(pool, &WeightMatrix::new(w.down_ty, w.down, d_model, ff)?, &ht, &mut y)?;
    Ok((g, y))
}

/// The prefill form (expert by expert, gathered rows, the device's GEMM) must
/// give exactly the decode form's (pair by pair GEMV) bits: decode after
/// prefill equals one long prefill. `n_tok` 40 makes runs of more than one
/// 32-row tile.
pub(super) fn grouped_case(dev: &CudaDevice, gu: GgmlType, dn: GgmlType, n_tok: usize, seed: u64) -> Result<Cmp, CudaError> {
    let (d_model, ff, n_slot, n_exp) = (512usize, 512usize, 4usize, 5usize);
    let nb = |ty: GgmlType, r: usize, c: usize| r * c / ty.block_elems() as usize;
    let mut bufs = Vec::new();
    for e in 0..n_exp as u64 {
        bufs.push([
            dev.upload(&random_blocks(gu, nb(gu, ff, d_model), seed + e)?)?,
            dev.upload(&random_blocks(gu, nb(gu, ff, d_model), seed + 100 + e)?)?,
            dev.upload(&random_blocks(dn, nb(dn, d_model, ff), seed + 200 + e)?)?,
        ]);
    }
    let n_pairs = n_tok * n_slot;
    // Expert 4 is never chosen; expert 0 often.
    let expert = |p: usize| if p % 3 == 0 { 0 } else { (p * 7 / 3) % 4 };
    let gfmt = ActFormat::for_weight(gu).ok_or(CudaError::Unsupported { op: "moe", ty: gu })?;
    let dfmt = ActFormat::for_weight(dn).ok_or(CudaError::Unsupported { op: "moe", ty: dn })?;
    let x = random_values(n_tok * d_model, seed ^ 7);
    let xd = dev.upload(Activations::for_weight(gu, &x, d_model)?.as_bytes())?;
    let ptrs = |k: usize| -> Vec<u64> { (0..n_pairs).map(|p| bufs[expert(p)][k].device_ptr()).collect() };
    let (gp, up, dp) = (dev.upload(&ptrs(0))?, dev.upload(&ptrs(1))?, dev.upload(&ptrs(2))?);
    let pairs = MoePairs { gate: &gp, up: &up, down: &dp, n_tok, n_slot };
    let mut h = poisoned::<f32>(dev, n_pairs * ff)?;
    let mut hq = poisoned::<u8>(dev, crate::ops::act_bytes(dfmt, n_pairs, ff)?)?;
    let mut want = poisoned::<f32>(dev, n_pairs * d_model)?;
    dev.moe_ffn(dev.compute(), gu, dn, &pairs, &xd, d_model, ff, Activation::Silu, &mut h, &mut hq, &mut want)?;
    let mut order: Vec<usize> = (0..n_pairs).collect();
    order.sort_by_key(|&p| expert(p));
    let mut runs = Vec::new();
    let mut i = 0;
    while i < n_pairs {
        let e = expert(order[i]);
        let j = i + order[i..].iter().take_while(|&&p| expert(p) == e).count();
        let b = &bufs[e];
        runs.push(crate::ops::ExpertRun { gate: b[0].device_ptr(), up: b[1].device_ptr(), down: b[2].device_ptr(), start: i, len: j - i });
        i = j;
    }
    let tok_of = dev.upload(&order.iter().map(|&p| (p / n_slot) as i32).collect::<Vec<_>>())?;
    let pair_of = dev.upload(&order.iter().map(|&p| p as i32).collect::<Vec<_>>())?;
    let mut xs = poisoned::<u8>(dev, crate::ops::act_bytes(gfmt, n_pairs, d_model)?)?;
    let (mut hg, mut hu, mut hh) = (poisoned::<f32>(dev, n_pairs * ff)?, poisoned::<f32>(dev, n_pairs * ff)?, poisoned::<f32>(dev, n_pairs * ff)?);
    let mut hq2 = poisoned::<u8>(dev, crate::ops::act_bytes(dfmt, n_pairs, ff)?)?;
    let mut outs = poisoned::<f32>(dev, n_pairs * d_model)?;
    let mut got = poisoned::<f32>(dev, n_pairs * d_model)?;
    let mut items = dev.alloc::<u64>(crate::ops::grouped_items_len(n_pairs, runs.len()))?;
    let mut sc = crate::ops::GroupedScratch { items: &mut items, xs: &mut xs, hg: &mut hg, hu: &mut hu, h: &mut hh, hq: &mut hq2, outs: &mut outs };
    dev.moe_ffn_grouped(dev.compute(), gu, dn, &runs, &tok_of, &pair_of, &xd, n_tok, d_model, ff, Activation::Silu, &mut sc, &mut got)?;
    let (a, b) = (dev.download(&got)?, dev.download(&want)?);
    let diff = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    let mut c = compare(&a, &b, 0.0);
    c.pass = diff == 0;
    Ok(c)
}

/// The moe test cases' routing: pair (t, s) uses expert (t + 2 s) % n_exp.
pub(super) fn pair_expert(n_slot: usize, n_exp: usize) -> impl Fn(usize) -> usize {
    move |p| ((p / n_slot) + 2 * (p % n_slot)) % n_exp
}

/// Pairs 5 and 10 are "not mine": null pointers the kernels must skip.
pub(super) fn pair_skipped(p: usize) -> bool {
    p == 5 || p == 10
}

/// Upload each expert's gate, up and down bytes, and per-pair pointer tables
/// over them (null where [`pair_skipped`]). The buffers are returned so they
/// outlive the tables.
#[allow(clippy::type_complexity)]
pub(super) fn pair_tables(
    dev: &CudaDevice,
    mats: [&[Vec<u8>]; 3],
    n_pairs: usize,
    expert: &dyn Fn(usize) -> usize,
) -> Result<([Vec<DeviceBuf<u8>>; 3], [DeviceBuf<u64>; 3]), CudaError> {
    let up = |m: &[Vec<u8>]| -> Result<Vec<DeviceBuf<u8>>, CudaError> { m.iter().map(|b| dev.upload(b)).collect() };
    let bufs = [up(mats[0])?, up(mats[1])?, up(mats[2])?];
    let table = |b: &[DeviceBuf<u8>]| -> Result<DeviceBuf<u64>, CudaError> {
        let p: Vec<u64> = (0..n_pairs).map(|p| if pair_skipped(p) { 0 } else { b[expert(p)].device_ptr() }).collect();
        dev.upload(&p)
    };
    let tables = [table(&bufs[0])?, table(&bufs[1])?, table(&bufs[2])?];
    Ok((bufs, tables))
}

/// The geometry of a [`moe_case`].
#[derive(Clone, Copy)]
pub(super) struct MoeShape {
    pub(super) d_model: usize,
    pub(super) ff: usize,
    pub(super) n_tok: usize,
    pub(super) n_slot: usize,
    pub(super) n_exp: usize,
}

impl MoeShape {
    pub(super) const SMALL: MoeShape = MoeShape { d_model: 512, ff: 512, n_tok: 3, n_slot: 4, n_exp: 5 };
    /// 32 pairs: 40960 gate/up rows and 32768 down rows, so the decode
    /// kernels' warps take more than one row.
    pub(super) const WIDE: MoeShape = MoeShape { d_model: 1024, ff: 1280, n_tok: 4, n_slot: 8, n_exp: 10 };
}

pub(super) fn moe_case(
    dev: &CudaDevice,
    pool: &rayon::ThreadPool,
    k: &Kernels,
    gu: GgmlType,
    dn: GgmlType,
    shape: MoeShape,
    seed: u64,
) -> Result<Cmp, CudaError> {
    let MoeShape { d_model, ff, n_tok, n_slot, n_exp } = shape;
    let nb = |ty: GgmlType, r: usize, c: usize| r * c / ty.block_elems() as usize;
    let gates: Vec<Vec<u8>> = (0..n_exp)
        .map(|e| random_blocks(gu, nb(gu, ff, d_model), seed + e as u64))
        .collect::<Result<_, _>>()?;
    let ups: Vec<Vec<u8>> = (0..n_exp)
        .map(|e| random_blocks(gu, nb(gu, ff, d_model), seed + 100 + e as u64))
        .collect::<Result<_, _>>()?;
    let downs: Vec<Vec<u8>> = (0..n_exp)
        .map(|e| random_blocks(dn, nb(dn, d_model, ff), seed + 200 + e as u64))
        .collect::<Result<_, _>>()?;
    let x = random_values(n_tok * d_model, seed ^ 7);
    let xa = Activations::for_weight(gu, &x, d_model)?;
    let (expert, skipped) = (pair_expert(n_slot, n_exp), pair_skipped);
    let n_pairs = n_tok * n_slot;
    let (_experts, [gp, up, dp]) = pair_tables(dev, [&gates, &ups, &downs], n_pairs, &expert)?;
    let pairs = MoePairs {
        gate: &gp,
        up: &up,
        down: &dp,
        n_tok,
        n_slot,
    };
    let xd = dev.upload(xa.as_bytes())?;
    let mut h = poisoned::<f32>(dev, n_pairs * ff)?;
    let dfmt = ActFormat::for_weight(dn).ok_or(CudaError::Unsupported { op: "moe", ty: dn })?;
    let mut hq = poisoned::<u8>(dev, crate::ops::act_bytes(dfmt, n_pairs, ff)?)?;
    let mut out = poisoned::<f32>(dev, n_pairs * d_model)?;
    dev.moe_ffn(
        dev.compute(),
        gu,
        dn,
        &pairs,
        &xd,
        d_model,
        ff,
        Activation::Silu,
        &mut h,
        &mut hq,
        &mut out,
    )?;
    let got = dev.download(&out)?;
    let (h_gpu, hq_gpu) = (dev.download(&h)?, dev.download(&hq)?);

    let (mut cpu, mut gpu) = (Vec::new(), Vec::new());
    let (mut h_cpu_all, mut h_gpu_all, mut hq_off) = (Vec::new(), Vec::new(), 0usize);
    let mut untouched = true;
    for p in 0..n_pairs {
        let row = &got[p * d_model..(p + 1) * d_model];
        if skipped(p) {
            untouched &= row.iter().all(|v| v.to_bits() == u32::MAX);
            continue;
        }
        let (t, e) = (p / n_slot, expert(p));
        let w = ExpertRef { gate_up_ty: gu, down_ty: dn, gate: &gates[e], up: &ups[e], down: &downs[e] };
        let (g, y) = cpu_expert(k, pool, &w, &x[t * d_model..(t + 1) * d_model], d_model, ff, Activation::Silu)?;
        // Diagnostics: the GPU's h against the CPU's, and the GPU's quantization of its own h.
        let hg = &h_gpu[p * ff..(p + 1) * ff];
        h_cpu_all.extend_from_slice(&g);
        h_gpu_all.extend_from_slice(hg);
        let hq_of_gpu_h = Activations::for_weight(dn, hg, ff)?;
        let rb = hq_of_gpu_h.as_bytes().len();
        hq_off += compare_bytes(&hq_gpu[p * rb..(p + 1) * rb], hq_of_gpu_h.as_bytes()).abs as usize;
        cpu.extend(y);
        gpu.extend_from_slice(row);
    }
    // The canonical dots and the shared activation give the CPU's h, hence
    // its quantization and the same down product: bit for bit.
    let mut c = compare(&gpu, &cpu, 0.0);
    c.pass &= untouched;
    if !c.pass {
        let hc = compare(&h_gpu_all, &h_cpu_all, 1e-4);
        return Err(CudaError::Shape {
            op: "moe_ffn",
            what: format!(
                "out max rel err {:.3e}; h max rel err {:.3e}; {hq_off} bytes of hq differ from the CPU quantization of the GPU's h; skipped rows untouched: {untouched}",
                c.rel, hc.rel
            ),
        });
    }
    Ok(c)
}

/// `moe_case` for float experts: no quantization of x or h, so both are
/// compared at the float GEMV's tolerance.
pub(super) fn moe_float_case(
    dev: &CudaDevice,
    pool: &rayon::ThreadPool,
    k: &Kernels,
    ty: GgmlType,
    act: Activation,
    seed: u64,
) -> Result<Cmp, CudaError> {
    // Neither width a multiple of 32 (lane tails) nor ff of 4 (block tails).
    let (d_model, ff, n_tok, n_slot, n_exp) = (520usize, 333usize, 3usize, 4usize, 5usize);
    let mats = |rows: usize, cols: usize, off: u64| -> Result<Vec<Vec<u8>>, CudaError> {
        (0..n_exp)
            .map(|e| Ok(random_blocks(ty, rows * cols, seed + off + e as u64)?))
            .collect()
    };
    let (gates, ups, downs) = (
        mats(ff, d_model, 0)?,
        mats(ff, d_model, 100)?,
        mats(d_model, ff, 200)?,
    );
    let x = random_values(n_tok * d_model, seed ^ 7);
    let (expert, skipped) = (pair_expert(n_slot, n_exp), pair_skipped);
    let n_pairs = n_tok * n_slot;
    let (_experts, [gp, up, dp]) = pair_tables(dev, [&gates, &ups, &downs], n_pairs, &expert)?;
    let pairs = MoePairs {
        gate: &gp,
        up: &up,
        down: &dp,
        n_tok,
        n_slot,
    };
    let xd = dev.upload(&x)?;
    let mut h = poisoned::<f32>(dev, n_pairs * ff)?;
    let mut out = poisoned::<f32>(dev, n_pairs * d_model)?;
    dev.moe_ffn_float(
        dev.compute(),
        ty,
        &pairs,
        &xd,
        d_model,
        ff,
        act,
        &mut h,
        &mut out,
    )?;
    let (got, h_gpu) = (dev.download(&out)?, dev.download(&h)?);

    let (mut cpu, mut gpu, mut h_cpu_all, mut h_gpu_all) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut untouched = true;
    for p in 0..n_pairs {
        let row = &got[p * d_model..(p + 1) * d_model];
        let hg = &h_gpu[p * ff..(p + 1) * ff];
        if skipped(p) {
            untouched &= row.iter().chain(hg).all(|v| v.to_bits() == u32::MAX);
            continue;
        }
        let (t, e) = (p / n_slot, expert(p));
        let w = ExpertRef { gate_up_ty: ty, down_ty: ty, gate: &gates[e], up: &ups[e], down: &downs[e] };
        let (g, y) = cpu_expert(k, pool, &w, &x[t * d_model..(t + 1) * d_model], d_model, ff, act)?;
        h_cpu_all.extend_from_slice(&g);
        h_gpu_all.extend_from_slice(hg);
        cpu.extend(y);
        gpu.extend_from_slice(row);
    }
    let hc = compare(&h_gpu_all, &h_cpu_all, 0.0);
    let mut c = compare(&gpu, &cpu, 0.0);
    c.pass &= hc.pass && untouched;
    if !c.pass {
        return Err(CudaError::Shape {
            op: "moe_ffn_float",
            what: format!(
                "out max rel err {:.3e}; h max rel err {:.3e}; skipped rows untouched: {untouched}",
                c.rel, hc.rel
            ),
        });
    }
    Ok(c)
}
