//! The CUDA step's ops: linear products (GEMV/GEMM, grouped decode
//! projections), elementwise ops, attention over the KV cache, the fused
//! launches the graph allows (fuse.rs), and the [`Exec`] face the graph
//! lowering drives.

use pulsar_cuda::{attention_workspace_len, with_kv_elem, DeviceBuf};
use pulsar_kernels::ops::{AttnParams, RopeKind, RopeParams};
use pulsar_kernels::ActFormat;
use pulsar_plugin_api::graph::{Act, Experts, Op, RopeMode, Sizes};
use pulsar_plugin_api::{Val, Wt};

use super::super::fuse::{Ahead, OpKey};
use super::super::lower::{AttnSpec, Exec, NormRopeK, RopeSpec};
use super::super::profile::short_name;
use super::super::{with_kv_pair, CudaModel, DevWeight};
use super::{err, CudaStep, R};
use crate::cpu::act_of;
use crate::graph::MoeSpec;

impl<'a> CudaStep<'a> {
    /// The output of op `key` reading `inputs` if a fused launch made it ahead.
    pub(super) fn claim_ahead(&mut self, key: OpKey, inputs: &[Val]) -> R<Option<Val>> {
        let ins: Vec<u32> = inputs.iter().map(|v| v.0).collect();
        let Some(a) = self.ahead.claim(key, &ins) else { return Ok(None) };
        let v = self.push(a.buf, a.rows, a.cols)?;
        self.ahead.bind(a.feeds, v.0);
        Ok(Some(v))
    }

    /// A per-head norm of q with k's norm and both ropes after it in the
    /// graph (fuse.rs): all four in one launch, the three later outputs kept
    /// ahead. None: the step's shapes do not fit the kernel (the caller runs
    /// the norm alone).
    pub(super) fn norm_rope_fused(&mut self, x: Val, w: Option<Wt>, eps: f32, group: usize, kh: NormRopeK) -> R<Option<Val>> {
        let NormRopeK { x: k, w: kw, eps: k_eps, rope } = kh;
        let head_dim = rope.head_dim;
        let k_key = OpKey::Norm { w: kw.map(|w| w.0), eps: k_eps.to_bits(), group: head_dim };
        let rope_key = rope_key(&rope);
        let k = k.0;
        let n = self.positions.len();
        let (rows, cols) = self.dims(x)?;
        let k_live = self.vals.get(k as usize).filter(|d| d.buf().is_some()).map(|d| (d.rows, d.cols));
        let Some((k_rows, k_cols)) = k_live else { return Ok(None) };
        let hd = head_dim as usize;
        if group != hd || rows != n || k_rows != n || cols % hd != 0 || k_cols % hd != 0 {
            return Ok(None);
        }
        let weight = |w: Option<Wt>| -> R<Option<&'a DeviceBuf<f32>>> {
            let Some(w) = w else { return Ok(None) };
            let (dw, mw) = self.weight(w)?;
            let f = dw.f32.as_ref().ok_or_else(|| format!("{} is not a vector", mw.name))?;
            if f.len() != hd {
                return Err(format!("rms_norm: weight {} has {} values for group {hd}", mw.name, f.len()));
            }
            Ok(Some(f))
        };
        let (wq, wk) = (weight(w)?, weight(kw)?);
        let p = rope_params(&rope);
        let (mut qn, mut qr) = (self.new_val(rows, cols)?, self.new_val(rows, cols)?);
        let (mut kn, mut kr) = (self.new_val(k_rows, k_cols)?, self.new_val(k_rows, k_cols)?);
        {
            let stream = self.cm.dev.compute().clone();
            let kx = self.vals[k as usize].buf().expect("checked live");
            let mut parts = [
                pulsar_cuda::NormRopePart { x: self.buf(x)?, weight: wq, eps, width: cols, normed: &mut qn, roped: &mut qr },
                pulsar_cuda::NormRopePart { x: kx, weight: wk, eps: k_eps, width: k_cols, normed: &mut kn, roped: &mut kr },
            ];
            self.cm.dev.norm_rope(&stream, &mut parts, self.pos_buf, &p).map_err(err)?;
        }
        let q = self.push(qn, rows, cols)?;
        let kr_slot = self.ahead.add(Ahead { key: rope_key, inputs: vec![None], buf: kr, rows: k_rows, cols: k_cols, feeds: None });
        self.ahead.add(Ahead { key: k_key, inputs: vec![Some(k)], buf: kn, rows: k_rows, cols: k_cols, feeds: Some((kr_slot, 0)) });
        self.ahead.add(Ahead { key: rope_key, inputs: vec![Some(q.0)], buf: qr, rows, cols, feeds: None });
        Ok(Some(q))
    }

    /// The MoE op's slot combine into `y`; when the graph adds this op's
    /// output to a live value ([`CudaStep::add_after`]), that sum too (one
    /// launch), kept ahead for the add.
    pub(super) fn combine(&mut self, out: &DeviceBuf<f32>, wts: &DeviceBuf<f32>, rows: usize, k: usize, d_model: usize) -> R<Val> {
        let stream = self.cm.dev.compute().clone();
        let mut y = self.new_val(rows, d_model)?;
        let other = self
            .add_after
            .take()
            .map(|(r, first)| (r.0, first))
            .filter(|&(r, _)| self.vals.get(r as usize).is_some_and(|d| d.buf().is_some() && (d.rows, d.cols) == (rows, d_model)));
        let Some((r, r_first)) = other else {
            self.cm.dev.moe_combine(&stream, out, wts, rows, k, &mut y).map_err(err)?;
            return self.push(y, rows, d_model);
        };
        let mut sum = self.new_val(rows, d_model)?;
        let rb = self.vals[r as usize].buf().expect("checked live");
        self.cm.dev.moe_combine_add(&stream, out, wts, rows, k, rb, r_first, &mut y, &mut sum).map_err(err)?;
        let v = self.push(y, rows, d_model)?;
        let inputs = if r_first { vec![Some(r), Some(v.0)] } else { vec![Some(v.0), Some(r)] };
        self.ahead.add(Ahead { key: OpKey::Add, inputs, buf: sum, rows, cols: d_model, feeds: None });
        Ok(v)
    }

    /// `y = x · Wᵀ` for weight bytes at `w` (`rows` = n_out, `cols` = n_in).
    /// Decode uses the GEMV and prefill the device's GEMM (tensor cores on
    /// sm_80+): all sum each dot in one canonical order, so a decoded token's
    /// logits equal a fresh prefill's bit for bit.
    pub(super) fn matmul_raw(&mut self, ty: pulsar_gguf::GgmlType, w: &DeviceBuf<u8>, n_out: usize, n_in: usize, x: Val) -> R<(DeviceBuf<f32>, usize)> {
        let (rows, cols) = self.dims(x)?;
        if cols != n_in {
            return Err(format!("linear: input width {cols}, weight takes {n_in}"));
        }
        let mut y = self.new_val(rows, n_out)?;
        let stream = self.cm.dev.compute().clone();
        match ActFormat::for_weight(ty) {
            Some(ActFormat::F32) => {
                let xb = self.buf(x)?;
                self.cm.dev.gemm_float(&stream, ty, w, n_out, n_in, xb, rows, &mut y).map_err(err)?;
            }
            Some(fmt) => {
                let qi = self.quantized(x, fmt)?;
                let q = &self.qcache[qi].2;
                if rows == 1 {
                    self.cm.dev.gemv(&stream, ty, w, n_out, n_in, q, &mut y).map_err(err)?;
                } else {
                    self.cm.dev.gemm(&stream, ty, w, n_out, n_in, q, rows, &mut y).map_err(err)?;
                }
            }
            None => return Err(format!("no CUDA product for weight type {ty}")),
        }
        Ok((y, rows))
    }

    /// `x` quantized for `fmt`, once per step: values never change after they
    /// are made, so q, k and v projections (and the experts) share one.
    pub(super) fn quantized(&mut self, x: Val, fmt: ActFormat) -> R<usize> {
        if let Some(i) = self.qcache.iter().position(|(v, f, _)| *v == x && *f == fmt) {
            return Ok(i);
        }
        let (rows, cols) = self.dims(x)?;
        let qlen = pulsar_cuda::act_bytes(fmt, rows, cols).map_err(err)?;
        let mut q = self.pools.u8.take(&self.cm.dev, qlen).map_err(err)?;
        let stream = self.cm.dev.compute().clone();
        self.cm.dev.quantize_act(&stream, fmt, self.buf(x)?, rows, cols, &mut q).map_err(err)?;
        self.qcache.push((x, fmt, q));
        Ok(self.qcache.len() - 1)
    }

    pub(super) fn linear_w(&mut self, w: Wt, x: Val, with: &[Wt]) -> R<Val> {
        let (dw, mw) = self.weight(w)?;
        let raw = dw.raw.as_ref().ok_or_else(|| format!("{} is not resident", mw.name))?;
        let (n_in, n_out) = (dw.dims[0] as usize, dw.dims[1] as usize);
        if let Some(i) = self.pending.iter().position(|p| (p.0, p.1) == (w.0, x.0)) {
            let (_, _, y) = self.pending.swap_remove(i);
            return self.push(y, 1, n_out);
        }
        if let Some(v) = self.linear_group(w, x, with)? {
            return Ok(v);
        }
        let (y, rows) = self.matmul_raw(dw.ty, raw, n_out, n_in, x)?;
        self.push(y, rows, n_out)
    }

    /// Decode: when later linear ops of the graph (`with`) read this op's
    /// input with weights of the same type and width (q, k, v), run them all
    /// in one GEMV launch now and keep their outputs for their ops (claimed
    /// by weight and input value).
    pub(super) fn linear_group(&mut self, w: Wt, x: Val, with: &[Wt]) -> R<Option<Val>> {
        let (rows, _) = self.dims(x)?;
        if rows != 1 || with.is_empty() {
            return Ok(None);
        }
        let cm: &'a CudaModel = self.cm;
        let (dw, _) = self.weight(w)?;
        let (ty, n_in) = (dw.ty, dw.dims[0] as usize);
        let fmt = match ActFormat::for_weight(ty) {
            Some(f) if f != ActFormat::F32 => f,
            _ => return Ok(None),
        };
        let mut group: Vec<(u32, &'a DevWeight)> = vec![(w.0, dw)];
        for &Wt(wn) in with {
            let Some(d) = cm.weights.get(wn as usize) else { break };
            if d.ty != ty || d.dims[0] as usize != n_in || d.raw.is_none() || group.iter().any(|g| g.0 == wn) {
                break;
            }
            group.push((wn, d));
        }
        if group.len() < 2 {
            return Ok(None);
        }
        let qi = self.quantized(x, fmt)?;
        let mut outs = Vec::with_capacity(group.len());
        for (_, d) in &group {
            outs.push(self.new_val(1, d.dims[1] as usize)?);
        }
        {
            let mut parts: Vec<pulsar_cuda::GemvPart<'_>> = group
                .iter()
                .zip(outs.iter_mut())
                .map(|((_, d), y)| pulsar_cuda::GemvPart { w: d.raw.as_ref().expect("checked resident"), rows: d.dims[1] as usize, y })
                .collect();
            let stream = cm.dev.compute().clone();
            cm.dev.gemv_multi(&stream, ty, &mut parts, n_in, &self.qcache[qi].2).map_err(err)?;
        }
        let mut outs = outs.into_iter();
        let first = outs.next().expect("two or more outputs");
        for ((wn, _), y) in group.iter().skip(1).zip(outs) {
            self.pending.push((*wn, x.0, y));
        }
        let n_out = dw.dims[1] as usize;
        self.push(first, 1, n_out).map(Some)
    }

    pub(super) fn binary(&mut self, a: Val, b: Val, op: u8) -> R<Val> {
        let (ra, ca, rb, cb) = {
            let (x, y) = (self.get(a)?, self.get(b)?);
            (x.rows, x.cols, y.rows, y.cols)
        };
        if (ra, ca) != (rb, cb) {
            return Err(format!("elementwise: shapes [{ra}, {ca}] and [{rb}, {cb}] differ"));
        }
        let mut out = self.new_val(ra, ca)?;
        let s = self.cm.dev.compute().clone();
        let (x, y) = (self.buf(a)?, self.buf(b)?);
        match op {
            0 => self.cm.dev.add(&s, x, y, &mut out),
            _ => self.cm.dev.mul(&s, x, y, &mut out),
        }
        .map_err(err)?;
        self.push(out, ra, ca)
    }

    pub(super) fn copy_rows(&self, dst: u64, src: u64, bytes: usize) -> R<()> {
        self.cm.dev.context().bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: both ranges lie inside live device allocations (checked by callers).
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.cm.dev.compute().cu_stream()) }.map_err(err)
    }

    pub(super) fn do_attention(&mut self, q: Val, k: Val, v: Val, s: AttnSpec) -> R<Val> {
        let (nh, nkv, dk, dv) = (s.n_head as usize, s.n_kv_head as usize, s.head_dim_k as usize, s.head_dim_v as usize);
        let n = self.positions.len();
        {
            let (mq, mk, mv) = (self.get(q)?, self.get(k)?, self.get(v)?);
            if mq.cols != nh * dk || mk.cols != nkv * dk || mv.cols != nkv * dv || mq.rows != n || mk.rows != n || mv.rows != n {
                return Err(format!("attention layer {}: q/k/v shapes do not match the spec", s.layer));
            }
        }
        let state = s.layer as usize;
        let (kw, vw) = (nkv * dk, nkv * dv);
        // Each sequence's context after this step, checked against its cache.
        let mut n_ctx = 0;
        for &(start, end, seq) in &self.runs {
            let kv = &self.kvs[seq];
            let (lkw, lvw, _, _) = kv.layers.get(&state).ok_or_else(|| format!("layer {} declared no KV cache", s.layer))?;
            if (*lkw, *lvw) != (kw, vw) {
                return Err(format!("layer {}: k/v widths {kw}/{vw} differ from the plan's {lkw}/{lvw}", s.layer));
            }
            let ctx = self.positions[start..end].iter().max().map_or(0, |&p| p as usize + 1);
            if ctx > kv.n_ctx {
                return Err(format!("context is full: position {} beyond {}", ctx - 1, kv.n_ctx));
            }
            n_ctx = n_ctx.max(ctx);
        }
        let stream = self.cm.dev.compute().clone();
        let val = |x: Val| self.vals.get(x.0 as usize).and_then(|d| d.buf());
        let (Some(kb), Some(vb)) = (val(k), val(v)) else {
            self.released_early.set(true);
            return Err(format!("attention layer {}: k or v was released before this read", s.layer));
        };
        let cap = self.runs.iter().map(|r| self.kvs[r.2].n_ctx).min().unwrap_or(0);
        let tables = match self.tables {
            Some((t, at)) => Some((t, *at.get(&state).ok_or_else(|| format!("no cache table for state {state}"))?)),
            None => None,
        };
        // Every sequence's caches hold the model's one format.
        let ty = match self.kvs[self.runs[0].2].layers.get(&state) {
            Some((_, _, k, _)) => k.kv_type(),
            None => return Err(format!("layer {} declared no KV cache", s.layer)),
        };
        let dev = &self.cm.dev;
        match tables {
            // SAFETY: the table holds, per row, the addresses of its
            // sequence's caches for this state (CudaRunner::step), each of
            // `cap` or more rows of these widths in this format (checked above).
            Some((t, at)) => with_kv_elem!(ty, K => unsafe { dev.kv_write_rows::<K>(&stream, kb, vb, self.pos_buf, t, (at, at + n), (kw, vw), cap) }).map_err(err)?,
            None => {
                let one = self.runs[0].2;
                let Some((_, _, k, v)) = self.kvs[one].layers.get_mut(&state) else { return Err(format!("layer {} declared no KV cache", s.layer)) };
                with_kv_pair!((k, v), |kc, vc| dev.kv_write(&stream, kb, vb, self.pos_buf, kw, vw, kc, vc), return Err(format!("layer {}: its key and value caches differ in format", s.layer))).map_err(err)?;
            }
        }
        // A graph being captured sizes the splits for its bucket of contexts.
        let n_ctx = self.split_ctx.unwrap_or(n_ctx).max(n_ctx);
        let params = AttnParams { n_head: nh, n_kv_head: nkv, head_dim_k: dk, head_dim_v: dv, scale: s.scale, window: s.window as usize, softcap: s.softcap };
        let mut work = self.pools.f32.take(&self.cm.dev, attention_workspace_len(&params, n, n_ctx)).map_err(err)?;
        let mut out = self.new_val(n, nh * dv)?;
        let (dev, qb) = (&self.cm.dev, self.buf(q)?);
        match tables {
            // SAFETY: as for kv_write_rows; every row's position is below its cache's rows.
            Some((t, at)) => with_kv_elem!(ty, K => unsafe { dev.attention_rows::<K>(&stream, &params, qb, self.pos_buf, t, (at, at + n), n_ctx, &mut work, &mut out) }),
            None => {
                let (_, _, k, v) = &self.kvs[self.runs[0].2].layers[&state];
                with_kv_pair!((k, v), |kc, vc| dev.attention(&stream, &params, qb, self.pos_buf, kc, vc, n_ctx, &mut work, &mut out), return Err(format!("layer {}: its key and value caches differ in format", s.layer)))
            }
        }
        .map_err(err)?;
        self.pools.f32.give(work);
        self.push(out, n, nh * dv)
    }
}

impl Exec for CudaStep<'_> {
    fn prim(&mut self, op: &Op, ins: &[Val], in_dims: &[Vec<usize>], want: &[usize]) -> R<Val> {
        self.mark(Some(&|| op.name().to_string()));
        let r = self.run_prim(op, ins, in_dims, want);
        self.done(r)
    }
    fn experts(&mut self, x: Val, ids: Val, weights: Val, e: &Experts, top_k: u32, add: Option<(Val, bool)>) -> R<Val> {
        self.add_after = add;
        self.mark(Some(&|| "experts".to_string()));
        let r = self.given_experts(x, ids, weights, e, top_k);
        self.done(r)
    }
    fn sizes(&self) -> Sizes {
        let t = self.positions.len();
        Sizes { t, o: if self.all_rows { t } else { self.runs.len() }, c: self.positions.first().map_or(0, |&p| p as usize) + t }
    }
    fn embed(&mut self, table: Wt, scale: f32) -> R<Val> {
        self.mark(Some(&|| "embed".to_string()));
        let r = (|| {
            let (dw, mw) = self.weight(table)?;
            let raw = dw.raw.as_ref().ok_or_else(|| format!("{} is not resident", mw.name))?;
            let (cols, n_vocab) = (dw.dims[0] as usize, dw.dims[1] as usize);
            if let Some(&t) = self.tokens.iter().find(|&&t| t as usize >= n_vocab) {
                return Err(format!("token id {t} is outside the vocabulary of {n_vocab}"));
            }
            let n = self.tokens.len();
            let stream = self.cm.dev.compute().clone();
            let mut out = self.new_val(n, cols)?;
            self.cm.dev.embed(&stream, dw.ty, raw, n_vocab, cols, self.tok_buf, &mut out).map_err(err)?;
            if scale != 1.0 {
                let mut scaled = self.new_val(n, cols)?;
                self.cm.dev.scale(&stream, &out, scale, &mut scaled).map_err(err)?;
                self.pools.f32.give(out);
                out = scaled;
            }
            self.push(out, n, cols)
        })();
        self.done(r)
    }
    fn linear(&mut self, w: Wt, x: Val, with: &[Wt]) -> R<Val> {
        self.mark(Some(&|| format!("linear {}", self.model.weights.get(w.0 as usize).map_or("?", |m| short_name(&m.name)))));
        let r = self.linear_w(w, x, with);
        self.done(r)
    }
    fn rms_norm(&mut self, x: Val, w: Option<Wt>, eps: f32, group: u32, k: Option<NormRopeK>) -> R<Val> {
        let key = OpKey::Norm { w: w.map(|w| w.0), eps: eps.to_bits(), group };
        self.mark(Some(&|| "rms_norm".to_string()));
        let r = (|| {
            if let Some(v) = self.claim_ahead(key, &[x])? {
                return Ok(v);
            }
            let g = group as usize;
            if let Some(k) = k {
                if let Some(v) = self.norm_rope_fused(x, w, eps, g, k)? {
                    return Ok(v);
                }
            }
            let (rows, cols) = self.dims(x)?;
            let weight = match w {
                Some(w) => {
                    let (dw, mw) = self.weight(w)?;
                    let f = dw.f32.as_ref().ok_or_else(|| format!("{} is not a vector", mw.name))?;
                    if f.len() != g {
                        return Err(format!("rms_norm: weight {} has {} values for group {g}", mw.name, f.len()));
                    }
                    Some(f)
                }
                None => None,
            };
            let mut y = self.new_val(rows, cols)?;
            let stream = self.cm.dev.compute().clone();
            self.cm.dev.rms_norm(&stream, self.buf(x)?, &mut y, weight, g, eps).map_err(err)?;
            self.push(y, rows, cols)
        })();
        self.done(r)
    }
    fn add(&mut self, a: Val, b: Val) -> R<Val> {
        self.mark(Some(&|| "add".to_string()));
        let r = match self.claim_ahead(OpKey::Add, &[a, b]) {
            Ok(Some(v)) => Ok(v),
            Ok(None) => self.binary(a, b, 0),
            Err(e) => Err(e),
        };
        self.done(r)
    }
    fn mul(&mut self, a: Val, b: Val) -> R<Val> {
        self.mark(Some(&|| "mul".to_string()));
        let r = self.binary(a, b, 1);
        self.done(r)
    }
    fn scale(&mut self, x: Val, s: f32) -> R<Val> {
        self.mark(Some(&|| "scale".to_string()));
        let r = (|| {
            let (rows, cols) = self.dims(x)?;
            let mut y = self.new_val(rows, cols)?;
            let stream = self.cm.dev.compute().clone();
            self.cm.dev.scale(&stream, self.buf(x)?, s, &mut y).map_err(err)?;
            self.push(y, rows, cols)
        })();
        self.done(r)
    }
    fn glu(&mut self, gate: Val, up: Val, act: Act) -> R<Val> {
        self.mark(Some(&|| "glu".to_string()));
        let r = (|| {
            let (rows, cols) = {
                let (g, u) = (self.get(gate)?, self.get(up)?);
                if (g.rows, g.cols) != (u.rows, u.cols) {
                    return Err("glu: gate and up shapes differ".to_string());
                }
                (g.rows, g.cols)
            };
            let mut y = self.new_val(rows, cols)?;
            let stream = self.cm.dev.compute().clone();
            self.cm.dev.glu(&stream, self.buf(gate)?, self.buf(up)?, &mut y, act_of(act)).map_err(err)?;
            self.push(y, rows, cols)
        })();
        self.done(r)
    }
    fn rope(&mut self, x: Val, spec: RopeSpec) -> R<Val> {
        let key = rope_key(&spec);
        self.mark(Some(&|| "rope".to_string()));
        let r = (|| {
            if let Some(v) = self.claim_ahead(key, &[x])? {
                return Ok(v);
            }
            let (rows, cols) = self.dims(x)?;
            if rows != self.positions.len() {
                return Err(format!("rope: {rows} rows for {} positions", self.positions.len()));
            }
            let mut y = self.new_val(rows, cols)?;
            let p = rope_params(&spec);
            let stream = self.cm.dev.compute().clone();
            // Out of place: one kernel reads x and writes every value of y.
            self.cm.dev.rope(&stream, self.buf(x)?, &mut y, cols, self.pos_buf, &p).map_err(err)?;
            self.push(y, rows, cols)
        })();
        self.done(r)
    }
    fn attention(&mut self, q: Val, k: Val, v: Val, spec: AttnSpec) -> R<Val> {
        self.mark(Some(&|| "attention".to_string()));
        let r = self.do_attention(q, k, v, spec);
        self.done(r)
    }
    fn moe(&mut self, x: Val, spec: MoeSpec, add: Option<(Val, bool)>) -> R<Val> {
        self.add_after = add;
        self.mark(Some(&|| "moe: router, top-k".to_string()));
        let r = self.do_moe(x, &spec, None);
        self.done(r)
    }
    fn release(&mut self, v: Val) {
        self.free(v);
    }
    fn output_rows(&mut self, x: Val) -> R<Val> {
        self.mark(Some(&|| "output_rows".to_string()));
        let r = (|| {
            let (rows, cols) = self.dims(x)?;
            if self.all_rows || self.runs.len() == 1 {
                let keep = if self.all_rows { rows } else { 1 };
                let y = self.new_val(keep, cols)?;
                let src = self.buf(x)?.device_ptr() + ((rows - keep) * cols * 4) as u64;
                self.copy_rows(y.device_ptr(), src, keep * cols * 4)?;
                return self.push(y, keep, cols);
            }
            // The last row of each sequence's run.
            let y = self.new_val(self.runs.len(), cols)?;
            let base = self.buf(x)?.device_ptr();
            for (i, &(_, end, _)) in self.runs.iter().enumerate() {
                if end > rows {
                    return Err(format!("output_rows: {rows} rows, a sequence ends at row {end}"));
                }
                self.copy_rows(y.device_ptr() + (i * cols * 4) as u64, base + ((end - 1) * cols * 4) as u64, cols * 4)?;
            }
            self.push(y, self.runs.len(), cols)
        })();
        self.done(r)
    }
}

/// The key a rope's output made ahead is claimed by.
fn rope_key(spec: &RopeSpec) -> OpKey {
    let mode = match spec.mode {
        RopeMode::Neox => 0,
        RopeMode::Interleaved => 1,
    };
    OpKey::Rope { head_dim: spec.head_dim, n_rot: spec.n_rot, base: spec.base.to_bits(), factor: spec.linear_factor.to_bits(), mode }
}

fn rope_params(spec: &RopeSpec) -> RopeParams {
    let kind = match spec.mode {
        RopeMode::Neox => RopeKind::Neox,
        RopeMode::Interleaved => RopeKind::Interleaved,
    };
    RopeParams { head_dim: spec.head_dim as usize, n_rot: spec.n_rot as usize, base: spec.base, linear_factor: spec.linear_factor, kind }
}
