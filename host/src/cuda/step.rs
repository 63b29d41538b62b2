//! One forward step on the GPU: [`CudaStep`] implements the plugin ops,
//! [`CudaEngine`] is the session (KV cache, position, pools).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use cudarc::driver::{sys as cusys, CudaGraph};
use pulsar_cuda::{attention_graph_ctx, attention_workspace_len, DeviceBuf, Gating as CGating, MoePairs, RouterSpec};
use pulsar_kernels::ops::{AttnParams, RopeKind, RopeParams};
use pulsar_kernels::ActFormat;
use pulsar_plugin_api::graph::{Act, RopeMode};
use pulsar_plugin_api::{Val, Wt};

use super::fuse::{norm_rope_ahead, residual_add_ahead, Ahead, AheadSet, OpKey, TraceOp};
use super::lower::{AttnSpec, Exec, Lowering, RopeSpec};
use super::pool::BufPool;
use super::profile::{short_name, OpProfile};
use super::{CudaBackendError, CudaKv, CudaModel, DevWeight};
use crate::cpu::act_of;
use crate::engine::EngineError;
use crate::experts::StoreExperts;
use crate::graph::{Gating, MoeSpec};
use crate::model::Model;

mod lane;

type R<T> = Result<T, String>;

/// Head rows of a split expert come in multiples of this (the lane's and the
/// GPU's row groups both divide it).
const HEAD_GRANULE: usize = 32;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

struct DVal {
    /// None once released (its last use in the step's recorded plan is past).
    buf: Option<DeviceBuf<f32>>,
    rows: usize,
    cols: usize,
}

/// Which values a step's ops read, so the next step of the same kind can give
/// a value's buffer back right after its last reader instead of at the end of
/// the step: a 512-token prefill of 48 layers otherwise holds every layer's
/// activations at once (gigabytes outside the VRAM budget). Values are
/// numbered in creation order, so an identical op sequence has identical
/// numbers; a step that departs from the recorded sequence stops releasing.
#[derive(Default)]
struct Liveness {
    /// Each op (by op index) of the last step of this kind: its inputs, and
    /// what fusing needs (fuse.rs).
    ops: Vec<TraceOp>,
    /// For each op index, the values whose last read it is.
    frees: Vec<Vec<u32>>,
}

impl Liveness {
    fn from_trace(ops: Vec<TraceOp>) -> Liveness {
        let mut last: HashMap<u32, usize> = HashMap::new();
        for (i, op) in ops.iter().enumerate() {
            for &v in &op.inputs {
                last.insert(v, i);
            }
        }
        let mut frees = vec![Vec::new(); ops.len()];
        for (v, i) in last {
            frees[i].push(v);
        }
        Liveness { ops, frees }
    }
}

#[derive(Default)]
struct Pools {
    f32: BufPool<f32>,
    u8: BufPool<u8>,
    u32: BufPool<u32>,
    i32: BufPool<i32>,
    u64: BufPool<u64>,
}

/// A decode step captured as one CUDA graph: replaying it launches every
/// kernel of the step with one call (a 48-layer MoE decode is ~1400 kernels,
/// whose host-side launches otherwise cost more than their GPU time).
struct DecodeGraph {
    graph: CudaGraph,
    /// The context length attention's splits were sized for.
    split_ctx: usize,
    all_rows: bool,
    /// The step's output, owned here (out of the pools) so nothing else writes it.
    out: DeviceBuf<f32>,
    rows: usize,
    cols: usize,
}

/// A model session on one GPU.
pub struct CudaEngine<'m> {
    pub model: &'m Model,
    pub cm: &'m CudaModel,
    pub kv: CudaKv,
    pub n_past: usize,
    pub ubatch: usize,
    pub history: Vec<u32>,
    /// Streamed experts come through this store's host cache (else the mapping).
    store: Option<&'m StoreExperts>,
    pools: Pools,
    /// Recorded value lifetimes of the last decode (0) and prefill (1) step.
    live: [Liveness; 2],
    /// The (weight, input value) of each linear op of the last decode step, in
    /// order: a decode linear whose next ones read the same input (q, k, v)
    /// runs them in one launch.
    linears: Vec<(u32, u32)>,
    /// Off after a step asked for a value released early (the plugin's graph
    /// changed shape between steps); every value then lives to the step's end.
    release_early: bool,
    /// The activation reserve was found too small (warned once).
    over_reserve: bool,
    /// Decode inputs at fixed device addresses (a captured graph reads them).
    dec_tok: DeviceBuf<u32>,
    dec_pos: DeviceBuf<u32>,
    /// Decode steps are captured and replayed as CUDA graphs (resident
    /// experts: a step with no host round trip); off after a capture failed.
    graphs: bool,
    graph: Option<DecodeGraph>,
    /// Some: every op's GPU time is measured (`bench --profile-ops`).
    profile: Option<OpProfile>,
    /// How the decode (0) and prefill (1) graphs run on the CUDA step.
    lowering: [Lowering; 2],
}

impl<'m> CudaEngine<'m> {
    pub fn new(model: &'m Model, cm: &'m CudaModel, n_ctx: usize) -> Result<CudaEngine<'m>, CudaBackendError> {
        let lower = |p| Lowering::new(p).map_err(|e| CudaBackendError::Other(format!("plugin `{}`: {e}", model.plugin)));
        let lowering = [lower(&model.steps.decode)?, lower(&model.steps.prefill)?];
        Ok(CudaEngine {
            model,
            cm,
            kv: CudaKv::new(&cm.dev, model, n_ctx)?,
            n_past: 0,
            ubatch: 512,
            history: Vec::new(),
            store: None,
            pools: Pools::default(),
            live: Default::default(),
            linears: Vec::new(),
            release_early: true,
            over_reserve: false,
            dec_tok: cm.dev.alloc(1)?,
            dec_pos: cm.dev.alloc(1)?,
            graphs: cm.graphs,
            graph: None,
            profile: None,
            lowering,
        })
    }

    /// Serve streamed experts through `store` when it has a budgeted host
    /// cache (a mapped store gives the same bytes as the file mapping).
    pub fn with_store(mut self, store: Option<&'m StoreExperts>) -> Self {
        self.store = store.filter(|s| s.cached);
        self
    }

    /// Measure every op's GPU time (steps then run without graphs).
    pub fn with_profile(mut self, on: bool) -> Result<Self, CudaBackendError> {
        self.profile = if on { Some(OpProfile::new(&self.cm.dev)?) } else { None };
        Ok(self)
    }

    /// The op profile's table, when profiling.
    pub fn profile_report(&self) -> Option<String> {
        self.profile.as_ref().map(OpProfile::report)
    }

    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx
    }

    pub fn reset(&mut self) {
        self.n_past = 0;
        self.history.clear();
    }

    pub fn truncate(&mut self, n: usize) {
        self.n_past = self.n_past.min(n);
        self.history.truncate(self.n_past);
    }

    /// Device buffers allocated so far (stops growing after the first steps).
    pub fn allocations(&self) -> u64 {
        let p = &self.pools;
        p.f32.allocations + p.u8.allocations + p.u32.allocations + p.i32.allocations + p.u64.allocations
    }

    /// Device memory the step buffers hold (activations and work space).
    pub fn activation_bytes(&self) -> u64 {
        let p = &self.pools;
        p.f32.held_bytes + p.u8.held_bytes + p.u32.held_bytes + p.i32.held_bytes + p.u64.held_bytes
    }

    pub fn forward(&mut self, tokens: &[u32], all: bool) -> Result<Vec<Vec<f32>>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::Empty);
        }
        if self.n_past + tokens.len() > self.n_ctx() {
            return Err(EngineError::ContextFull { need: self.n_past + tokens.len(), n_ctx: self.n_ctx() });
        }
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(self.ubatch.clamp(1, self.cm.max_chunk)).collect();
        let last = chunks.len() - 1;
        for (ci, chunk) in chunks.into_iter().enumerate() {
            let positions: Vec<u32> = (self.n_past..self.n_past + chunk.len()).map(|p| p as u32).collect();
            let rows = self.step(chunk, &positions, all).map_err(EngineError::Forward)?;
            let held = self.activation_bytes();
            if self.cm.activation_reserve > 0 && held > self.cm.activation_reserve && !self.over_reserve {
                self.over_reserve = true;
                tracing::warn!(
                    "step buffers hold {:.0} MiB, more than the {:.0} MiB of the VRAM budget kept for them",
                    held as f64 / (1u64 << 20) as f64,
                    self.cm.activation_reserve as f64 / (1u64 << 20) as f64
                );
            }
            self.n_past += chunk.len();
            self.history.extend_from_slice(chunk);
            if all {
                out.extend(rows);
            } else if ci == last {
                out.extend(rows.into_iter().last());
            }
        }
        Ok(out)
    }

    fn step(&mut self, tokens: &[u32], positions: &[u32], all: bool) -> R<Vec<Vec<f32>>> {
        let dev = &self.cm.dev;
        let stream = dev.compute().clone();
        let decode = tokens.len() == 1;
        let kind = usize::from(!decode);
        // A decode after one that set the plan may run as a graph: replayed
        // when one was captured for this split bucket, else captured now.
        let split_ctx = (decode && self.graphs && self.profile.is_none() && self.release_early && !self.live[0].ops.is_empty())
            .then(|| attention_graph_ctx(positions[0] as usize + 1, self.kv.n_ctx));
        let (mut own_pos, mut own_tok) = (None, None);
        if decode {
            self.dec_tok.upload(&stream, tokens).map_err(err)?;
            self.dec_pos.upload(&stream, positions).map_err(err)?;
            if let (Some(sc), Some(g)) = (split_ctx, &self.graph) {
                if g.split_ctx == sc && g.all_rows == all {
                    g.graph.launch().map_err(err)?;
                    return download_rows(&stream, &g.out, g.rows, g.cols);
                }
            }
        } else {
            let mut p = self.pools.u32.take(dev, positions.len()).map_err(err)?;
            p.upload(&stream, positions).map_err(err)?;
            let mut t = self.pools.u32.take(dev, tokens.len()).map_err(err)?;
            t.upload(&stream, tokens).map_err(err)?;
            (own_pos, own_tok) = (Some(p), Some(t));
        }
        let capture = split_ctx.is_some();
        if capture {
            stream.begin_capture(cusys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(err)?;
        }
        let plan = if self.release_early { Some(&self.live[kind]) } else { None };
        if let Some(p) = self.profile.as_mut() {
            p.steps[kind] += 1;
        }
        let mut step = CudaStep {
            model: self.model,
            cm: self.cm,
            store: self.store,
            kv: &mut self.kv,
            pools: &mut self.pools,
            tokens,
            positions,
            pos_buf: own_pos.as_ref().unwrap_or(&self.dec_pos),
            tok_buf: own_tok.as_ref().unwrap_or(&self.dec_tok),
            split_ctx,
            all_rows: all,
            vals: Vec::new(),
            qcache: Vec::new(),
            plan,
            last: &self.live[kind].ops,
            ahead: AheadSet::default(),
            trace: RefCell::new(Vec::new()),
            on_plan: Cell::new(true),
            freed_to: 0,
            released_early: Cell::new(false),
            prof: RefCell::new(self.profile.as_mut()),
            kind,
            prev_linears: if decode { &self.linears } else { &[] },
            linears: Vec::new(),
            pending: Vec::new(),
            lane_pending: None,
        };
        let plan = if decode { &self.model.steps.decode } else { &self.model.steps.prefill };
        let r = self.lowering[kind].run(plan, &mut step);
        let mut captured = None;
        let result = if capture {
            // End the capture whatever happened, then run what it recorded.
            let g = stream.end_capture(cusys::CUgraphInstantiate_flags(0));
            match (r, g) {
                (Ok(v), Ok(Some(graph))) => step.take_output(v).and_then(|(out, rows, cols)| {
                    graph.launch().map_err(err)?;
                    let host = download_rows(&stream, &out, rows, cols)?;
                    captured = Some(DecodeGraph { graph, split_ctx: split_ctx.unwrap_or(0), all_rows: all, out, rows, cols });
                    Ok(host)
                }),
                (Ok(_), Ok(None)) => Err("the captured decode graph is empty".to_string()),
                (Ok(_), Err(e)) => Err(format!("capturing the decode step: {e}")),
                (Err(e), _) => Err(e),
            }
        } else {
            match r {
                Ok(v) => step.download(v),
                Err(e) => Err(e),
            }
        };
        // The last split layer's lane job: its errors fail the step.
        let result = result.and_then(|v| step.join_lane().map(|()| v));
        step.finish();
        let (trace, early) = (step.trace.take(), step.released_early.get());
        let linears = std::mem::take(&mut step.linears);
        drop(step);
        if decode && result.is_ok() {
            self.linears = linears;
        }
        if let Some(p) = own_pos {
            self.pools.u32.give(p);
        }
        if let Some(t) = own_tok {
            self.pools.u32.give(t);
        }
        if capture {
            match &result {
                Ok(_) => {
                    tracing::debug!("decode step captured as a CUDA graph (attention sized for {} positions)", split_ctx.unwrap_or(0));
                    self.graph = captured;
                }
                Err(e) => {
                    // Nothing ran (a capture only records): run the step as usual.
                    self.graphs = false;
                    self.graph = None;
                    tracing::warn!("decode steps run without CUDA graphs: {e}");
                    return self.step(tokens, positions, all);
                }
            }
        }
        if early && result.is_err() {
            // A value freed after its recorded last read was read again: the
            // graph is not the same from step to step. Keep everything from
            // now on and run the step again (it rewrites the same KV rows).
            self.release_early = false;
            self.graph = None;
            tracing::warn!("the model's op sequence varies between steps; step buffers now live to the end of each step");
            return self.step(tokens, positions, all);
        }
        if result.is_ok() {
            self.live[kind] = Liveness::from_trace(trace);
        }
        result
    }
}

/// `rows` rows of `cols` values from the device, after the stream's work.
fn download_rows(stream: &std::sync::Arc<cudarc::driver::CudaStream>, buf: &DeviceBuf<f32>, rows: usize, cols: usize) -> R<Vec<Vec<f32>>> {
    let mut host = vec![0f32; rows * cols];
    buf.download(stream, &mut host).map_err(err)?;
    Ok(host.chunks(cols.max(1)).map(|r| r.to_vec()).collect())
}

struct CudaStep<'a> {
    model: &'a Model,
    cm: &'a CudaModel,
    store: Option<&'a StoreExperts>,
    kv: &'a mut CudaKv,
    pools: &'a mut Pools,
    tokens: &'a [u32],
    positions: &'a [u32],
    pos_buf: &'a DeviceBuf<u32>,
    /// The step's token ids on the device.
    tok_buf: &'a DeviceBuf<u32>,
    /// Some while capturing a decode graph: attention's splits are sized for
    /// this context length (not the step's) so the graph serves later tokens.
    split_ctx: Option<usize>,
    all_rows: bool,
    vals: Vec<DVal>,
    /// Quantized activations made this step, by (value, format).
    qcache: Vec<(Val, ActFormat, DeviceBuf<u8>)>,
    /// The last step of this kind's value lifetimes (None: release nothing early).
    plan: Option<&'a Liveness>,
    /// The last step of this kind's ops (what fusions look ahead in).
    last: &'a [TraceOp],
    /// Outputs computed ahead of their ops by a fused launch.
    ahead: AheadSet,
    /// This step's ops, in order (shape() reads through &self).
    trace: RefCell<Vec<TraceOp>>,
    /// Whether every op so far matched the plan.
    on_plan: Cell<bool>,
    /// Plan ops whose frees are done.
    freed_to: usize,
    /// A released value was asked for (see CudaEngine::release_early).
    released_early: Cell<bool>,
    prof: RefCell<Option<&'a mut OpProfile>>,
    /// 0 decode, 1 prefill (the profile's row kind).
    kind: usize,
    /// The last decode step's linear ops (weight, input), and this step's.
    prev_linears: &'a [(u32, u32)],
    linears: Vec<(u32, u32)>,
    /// Outputs of linear ops already computed with an earlier one that read
    /// the same input, by (weight, input value): claimed when their op comes.
    pending: Vec<(u32, u32, DeviceBuf<f32>)>,
    /// The CPU lane's asynchronous job of the last split layer, until joined.
    lane_pending: Option<lane::PendingLane>,
}

impl Drop for CudaStep<'_> {
    fn drop(&mut self) {
        // A job in flight borrows what this step borrows: it must end first.
        if let (Some(p), Some(l)) = (self.lane_pending.take(), self.cm.lane.as_ref()) {
            l.driver().wait(p.ticket());
        }
    }
}

impl<'a> CudaStep<'a> {
    fn finish(&mut self) {
        for v in self.vals.drain(..) {
            if let Some(b) = v.buf {
                self.pools.f32.give(b);
            }
        }
        for (_, _, q) in self.qcache.drain(..) {
            self.pools.u8.give(q);
        }
        for (_, _, b) in self.pending.drain(..) {
            self.pools.f32.give(b);
        }
        for b in self.ahead.drain() {
            self.pools.f32.give(b);
        }
    }

    fn download(&mut self, v: Val) -> R<Vec<Vec<f32>>> {
        let (rows, cols) = self.dims(v)?;
        download_rows(self.cm.dev.compute(), self.buf(v)?, rows, cols)
    }

    /// Value `v`'s buffer, taken out of the step (it is not given back to the pools).
    fn take_output(&mut self, v: Val) -> R<(DeviceBuf<f32>, usize, usize)> {
        let d = self.vals.get_mut(v.0 as usize).ok_or_else(|| format!("unknown value {}", v.0))?;
        let buf = d.buf.take().ok_or_else(|| format!("value {} was released before the end of the step", v.0))?;
        Ok((buf, d.rows, d.cols))
    }

    fn dims(&self, v: Val) -> R<(usize, usize)> {
        self.get(v).map(|d| (d.rows, d.cols))
    }

    fn get(&self, v: Val) -> R<&DVal> {
        self.vals.get(v.0 as usize).ok_or_else(|| format!("unknown value {}", v.0))
    }

    /// The device buffer of value `v` (an error, never a stale read, if it
    /// was released).
    fn buf(&self, v: Val) -> R<&DeviceBuf<f32>> {
        self.get(v)?.buf.as_ref().ok_or_else(|| {
            self.released_early.set(true);
            format!("value {} was released before this read (the op sequence changed between steps)", v.0)
        })
    }

    /// When profiling: end the timed segment and, with `label`, start one.
    fn mark(&self, label: Option<&dyn Fn() -> String>) {
        if let Some(p) = self.prof.borrow_mut().as_mut() {
            p.mark(self.cm.dev.compute(), self.kind, label.map(|l| l()));
        }
    }

    /// Record an op reading `inputs`, and whether it matches the plan.
    fn note(&self, inputs: &[Val]) {
        self.note_as(inputs, OpKey::Other);
    }

    fn note_as(&self, inputs: &[Val], key: OpKey) {
        let ins: Vec<u32> = inputs.iter().map(|v| v.0).collect();
        let mut t = self.trace.borrow_mut();
        let i = t.len();
        if self.on_plan.get() && self.plan.and_then(|p| p.ops.get(i)).map(|o| &o.inputs) != Some(&ins) {
            self.on_plan.set(false);
        }
        t.push(TraceOp { key, inputs: ins, out: u32::MAX });
    }

    /// After an op: give back the buffers of values whose last read (in the
    /// plan) is behind us, while this step still follows the plan.
    fn release(&mut self) {
        let Some(plan) = self.plan.filter(|_| self.on_plan.get()) else { return };
        let done = self.trace.borrow().len();
        while self.freed_to < done.min(plan.frees.len()) {
            for &v in &plan.frees[self.freed_to] {
                let Some(d) = self.vals.get_mut(v as usize) else { continue };
                if let Some(b) = d.buf.take() {
                    self.pools.f32.give(b);
                }
                while let Some(i) = self.qcache.iter().position(|(x, _, _)| x.0 == v) {
                    let (_, _, q) = self.qcache.swap_remove(i);
                    self.pools.u8.give(q);
                }
            }
            self.freed_to += 1;
        }
    }

    /// An op's result, after releasing what the plan says is dead.
    fn done(&mut self, r: R<Val>) -> R<Val> {
        self.mark(None);
        if let Ok(v) = &r {
            if let Some(op) = self.trace.get_mut().last_mut() {
                op.out = v.0;
            }
            self.release();
        }
        r
    }

    /// The output of op `key` reading `inputs` if a fused launch made it ahead.
    fn claim_ahead(&mut self, key: OpKey, inputs: &[Val]) -> R<Option<Val>> {
        let ins: Vec<u32> = inputs.iter().map(|v| v.0).collect();
        let Some(a) = self.ahead.claim(key, &ins) else { return Ok(None) };
        let v = self.push(a.buf, a.rows, a.cols)?;
        self.ahead.bind(a.feeds, v.0);
        Ok(Some(v))
    }

    /// A per-head norm whose next three ops in the last step were the other
    /// norm and both ropes (fuse.rs): all four in one launch, the three later
    /// outputs kept ahead. None: no such pattern (the caller runs the norm).
    fn norm_rope_fused(&mut self, x: Val, w: Option<Wt>, eps: f32, group: usize) -> R<Option<Val>> {
        let at = self.trace.borrow().len() - 1;
        let Some((k, k_key, rope_key)) = norm_rope_ahead(self.last, at) else { return Ok(None) };
        let (OpKey::Norm { w: kw, eps: k_eps, group: k_group }, OpKey::Rope { head_dim, n_rot, base, factor, mode }) = (k_key, rope_key) else {
            return Ok(None);
        };
        let n = self.positions.len();
        let (rows, cols) = self.dims(x)?;
        let k_live = self.vals.get(k as usize).filter(|d| d.buf.is_some()).map(|d| (d.rows, d.cols));
        let Some((k_rows, k_cols)) = k_live else { return Ok(None) };
        let hd = head_dim as usize;
        if group != hd || k_group as usize != hd || rows != n || k_rows != n || cols % hd != 0 || k_cols % hd != 0 {
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
        let (wq, wk) = (weight(w)?, weight(kw.map(Wt))?);
        let kind = if mode == 0 { RopeKind::Neox } else { RopeKind::Interleaved };
        let p = RopeParams { head_dim: hd, n_rot: n_rot as usize, base: f32::from_bits(base), linear_factor: f32::from_bits(factor), kind };
        let (mut qn, mut qr) = (self.new_val(rows, cols)?, self.new_val(rows, cols)?);
        let (mut kn, mut kr) = (self.new_val(k_rows, k_cols)?, self.new_val(k_rows, k_cols)?);
        {
            let stream = self.cm.dev.compute().clone();
            let kx = self.vals[k as usize].buf.as_ref().expect("checked live");
            let mut parts = [
                pulsar_cuda::NormRopePart { x: self.buf(x)?, weight: wq, eps, width: cols, normed: &mut qn, roped: &mut qr },
                pulsar_cuda::NormRopePart { x: kx, weight: wk, eps: f32::from_bits(k_eps), width: k_cols, normed: &mut kn, roped: &mut kr },
            ];
            self.cm.dev.norm_rope(&stream, &mut parts, self.pos_buf, &p).map_err(err)?;
        }
        let q = self.push(qn, rows, cols)?;
        let kr_slot = self.ahead.add(Ahead { key: rope_key, inputs: vec![None], buf: kr, rows: k_rows, cols: k_cols, feeds: None });
        self.ahead.add(Ahead { key: k_key, inputs: vec![Some(k)], buf: kn, rows: k_rows, cols: k_cols, feeds: Some((kr_slot, 0)) });
        self.ahead.add(Ahead { key: rope_key, inputs: vec![Some(q.0)], buf: qr, rows, cols, feeds: None });
        Ok(Some(q))
    }

    /// The MoE op's slot combine into `y`; when the last step added this op's
    /// output to another live value next, that sum too (one launch), kept
    /// ahead for the add.
    fn combine(&mut self, out: &DeviceBuf<f32>, wts: &DeviceBuf<f32>, rows: usize, k: usize, d_model: usize) -> R<Val> {
        let stream = self.cm.dev.compute().clone();
        let mut y = self.new_val(rows, d_model)?;
        let at = self.trace.borrow().len() - 1;
        let other = residual_add_ahead(self.last, at)
            .filter(|&(r, _)| self.vals.get(r as usize).is_some_and(|d| d.buf.is_some() && (d.rows, d.cols) == (rows, d_model)));
        let Some((r, r_first)) = other else {
            self.cm.dev.moe_combine(&stream, out, wts, rows, k, &mut y).map_err(err)?;
            return self.push(y, rows, d_model);
        };
        let mut sum = self.new_val(rows, d_model)?;
        let rb = self.vals[r as usize].buf.as_ref().expect("checked live");
        self.cm.dev.moe_combine_add(&stream, out, wts, rows, k, rb, r_first, &mut y, &mut sum).map_err(err)?;
        let v = self.push(y, rows, d_model)?;
        let inputs = if r_first { vec![Some(r), Some(v.0)] } else { vec![Some(v.0), Some(r)] };
        self.ahead.add(Ahead { key: OpKey::Add, inputs, buf: sum, rows, cols: d_model, feeds: None });
        Ok(v)
    }

    fn new_val(&mut self, rows: usize, cols: usize) -> R<DeviceBuf<f32>> {
        self.pools.f32.take(&self.cm.dev, rows * cols).map_err(err)
    }

    fn push(&mut self, buf: DeviceBuf<f32>, rows: usize, cols: usize) -> R<Val> {
        self.vals.push(DVal { buf: Some(buf), rows, cols });
        Ok(Val(self.vals.len() as u32 - 1))
    }

    fn weight_index(&self, w: Wt) -> R<usize> {
        self.weight(w).map(|_| w.0 as usize)
    }

    fn weight(&self, w: Wt) -> R<(&'a DevWeight, &'a crate::model::Weight)> {
        let i = w.0 as usize;
        match (self.cm.weights.get(i), self.model.weights.get(i)) {
            (Some(d), Some(m)) => Ok((d, m)),
            _ => Err(format!("undeclared weight {i}")),
        }
    }

    /// `y = x · Wᵀ` for weight bytes at `w` (`rows` = n_out, `cols` = n_in).
    /// Decode uses the GEMV and prefill the device's GEMM (tensor cores on
    /// sm_80+): all sum each dot in one canonical order, so a decoded token's
    /// logits equal a fresh prefill's bit for bit.
    fn matmul_raw(&mut self, ty: pulsar_gguf::GgmlType, w: &DeviceBuf<u8>, n_out: usize, n_in: usize, x: Val) -> R<(DeviceBuf<f32>, usize)> {
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
    fn quantized(&mut self, x: Val, fmt: ActFormat) -> R<usize> {
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

    fn linear_w(&mut self, w: Wt, x: Val) -> R<Val> {
        let (dw, mw) = self.weight(w)?;
        let raw = dw.raw.as_ref().ok_or_else(|| format!("{} is not resident", mw.name))?;
        let (n_in, n_out) = (dw.dims[0] as usize, dw.dims[1] as usize);
        let at = self.linears.len();
        self.linears.push((w.0, x.0));
        if let Some(i) = self.pending.iter().position(|p| (p.0, p.1) == (w.0, x.0)) {
            let (_, _, y) = self.pending.swap_remove(i);
            return self.push(y, 1, n_out);
        }
        if let Some(v) = self.linear_group(w, x, at)? {
            return Ok(v);
        }
        let (y, rows) = self.matmul_raw(dw.ty, raw, n_out, n_in, x)?;
        self.push(y, rows, n_out)
    }

    /// Decode: when the last decode step's next one or two linear ops read
    /// this op's input with weights of the same type and width (q, k, v), run
    /// them all in one GEMV launch now and keep their outputs for their ops.
    /// The match is by weight and input value, so a step that departs from
    /// the last one only wastes the launch; it never takes a wrong output.
    fn linear_group(&mut self, w: Wt, x: Val, at: usize) -> R<Option<Val>> {
        let (rows, _) = self.dims(x)?;
        if rows != 1 || self.prev_linears.get(at) != Some(&(w.0, x.0)) {
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
        for &(wn, xn) in self.prev_linears.iter().skip(at + 1).take(2) {
            let Some(d) = cm.weights.get(wn as usize) else { break };
            if xn != x.0 || d.ty != ty || d.dims[0] as usize != n_in || d.raw.is_none() || group.iter().any(|g| g.0 == wn) {
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

    fn binary(&mut self, a: Val, b: Val, op: u8) -> R<Val> {
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

    fn copy_rows(&self, dst: u64, src: u64, bytes: usize) -> R<()> {
        self.cm.dev.context().bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: both ranges lie inside live device allocations (checked by callers).
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.cm.dev.compute().cu_stream()) }.map_err(err)
    }

    fn do_attention(&mut self, q: Val, k: Val, v: Val, s: AttnSpec) -> R<Val> {
        let (nh, nkv, dk, dv) = (s.n_head as usize, s.n_kv_head as usize, s.head_dim_k as usize, s.head_dim_v as usize);
        let n = self.positions.len();
        {
            let (mq, mk, mv) = (self.get(q)?, self.get(k)?, self.get(v)?);
            if mq.cols != nh * dk || mk.cols != nkv * dk || mv.cols != nkv * dv || mq.rows != n || mk.rows != n || mv.rows != n {
                return Err(format!("attention layer {}: q/k/v shapes do not match the spec", s.layer));
            }
        }
        let p0 = self.positions[0] as usize;
        let n_ctx = p0 + n;
        let (kw, vw) = (nkv * dk, nkv * dv);
        {
            let (lkw, lvw, _, _) = self.kv.layers.get(&(s.layer as usize)).ok_or_else(|| format!("layer {} declared no KV cache", s.layer))?;
            if (*lkw, *lvw) != (kw, vw) {
                return Err(format!("layer {}: k/v widths {kw}/{vw} differ from the plan's {lkw}/{lvw}", s.layer));
            }
            if n_ctx > self.kv.n_ctx {
                return Err(format!("context is full: position {} beyond {}", n_ctx - 1, self.kv.n_ctx));
            }
        }
        {
            let stream = self.cm.dev.compute().clone();
            let val = |x: Val| self.vals.get(x.0 as usize).and_then(|d| d.buf.as_ref());
            let (kb, vb) = (val(k), val(v));
            let (Some(kb), Some(vb)) = (kb, vb) else {
                self.released_early.set(true);
                return Err(format!("attention layer {}: k or v was released before this read", s.layer));
            };
            let (_, _, kc, vc) = self.kv.layers.get_mut(&(s.layer as usize)).ok_or_else(|| format!("layer {} declared no KV cache", s.layer))?;
            self.cm.dev.kv_write(&stream, kb, vb, self.pos_buf, kw, vw, kc, vc).map_err(err)?;
        }
        // A graph being captured sizes the splits for its bucket of contexts.
        let n_ctx = self.split_ctx.unwrap_or(n_ctx).max(n_ctx);
        let params = AttnParams { n_head: nh, n_kv_head: nkv, head_dim_k: dk, head_dim_v: dv, scale: s.scale, window: s.window as usize, softcap: s.softcap };
        let mut work = self.pools.f32.take(&self.cm.dev, attention_workspace_len(&params, n, n_ctx)).map_err(err)?;
        let mut out = self.new_val(n, nh * dv)?;
        let stream = self.cm.dev.compute().clone();
        let (_, _, kc, vc) = &self.kv.layers[&(s.layer as usize)];
        self.cm.dev.attention(&stream, &params, self.buf(q)?, self.pos_buf, kc, vc, n_ctx, &mut work, &mut out).map_err(err)?;
        self.pools.f32.give(work);
        self.push(out, n, nh * dv)
    }

    fn do_moe(&mut self, x: Val, spec: &MoeSpec) -> R<Val> {
        let cm: &'a CudaModel = self.cm;
        let dev = &cm.dev;
        let stream = dev.compute().clone();
        let (rows, d_model) = self.dims(x)?;
        let (ne, k) = (spec.n_expert as usize, spec.top_k as usize);
        // Router scores on the device, top-k there too.
        let logits = self.linear_w(spec.router, x)?;
        let mut ids = self.pools.i32.take(dev, rows * k).map_err(err)?;
        let mut wts = self.pools.f32.take(dev, rows * k).map_err(err)?;
        let rs = RouterSpec {
            k,
            gating: match spec.gating {
                Gating::Softmax => CGating::Softmax,
                Gating::Sigmoid => CGating::Sigmoid,
            },
            renormalize: spec.norm_topk,
            scale: spec.weights_scale,
        };
        let n_pairs = rows * k;
        let ws = [spec.gate_exps, spec.up_exps, spec.down_exps];
        let widx = [self.weight_index(ws[0])?, self.weight_index(ws[1])?, self.weight_index(ws[2])?];
        let (gdw, _) = self.weight(spec.gate_exps)?;
        let (ddw, _) = self.weight(spec.down_exps)?;
        let (gate_ty, down_ty) = (gdw.ty, ddw.ty);
        let ff = gdw.dims[1] as usize;
        let fmt_of = |t: pulsar_gguf::GgmlType| ActFormat::for_weight(t).ok_or_else(|| format!("no CUDA expert kernel for {t}"));
        let (gfmt, dfmt) = (fmt_of(gate_ty)?, fmt_of(down_ty)?);
        // Float experts: f32 activations, one format for all three matrices.
        let float = gfmt == ActFormat::F32;
        if float != (dfmt == ActFormat::F32) || (float && gate_ty != down_ty) {
            return Err(format!("moe layer {}: CUDA expert kernels need one float format or two quantized ones, not {gate_ty}/{down_ty}", spec.layer));
        }
        // Prefill chunks of quantized experts go expert by expert (each weight
        // read once per tile of its tokens); decode goes pair by pair.
        let grouped = rows > 1 && !float;
        let resident: Option<[&DeviceBuf<u64>; 3]> = match widx.map(|i| cm.expert_tables.get(&i)) {
            [Some(g), Some(u), Some(d)] => Some([g, u, d]),
            _ => None,
        };
        let mut pbufs = Vec::with_capacity(3);
        for _ in 0..3 {
            pbufs.push(self.pools.u64.take(dev, n_pairs).map_err(err)?);
        }
        {
            let [pg, pu, pd] = &mut pbufs[..] else { unreachable!("three pointer buffers") };
            match resident {
                // Decode on resident experts: the router kernel gathers the
                // pairs' pointers too (no host round trip, one kernel).
                Some(tables) if !grouped => dev.route_gather(&stream, &rs, self.buf(logits)?, rows, ne, &mut ids, &mut wts, tables, [pg, pu, pd]),
                _ => dev.route(&stream, &rs, self.buf(logits)?, None, rows, ne, &mut ids, &mut wts),
            }
            .map_err(err)?;
        }
        self.mark(Some(&|| "moe: expert placement".to_string()));
        // Host copies, when the host takes part: routing ids, and each
        // selected expert's (gate, up, down) device addresses.
        let mut h_ids: Vec<i32> = Vec::new();
        let mut host_ptrs: Vec<[u64; 3]> = Vec::new();
        // Prefill with prefetch: the next layer's predicted experts, their
        // weights and slab kinds, for the copies that wait for this layer's kernels.
        let mut prefetch_rest: Option<(Vec<u32>, Vec<usize>, [pulsar_store::SlabKind; 3])> = None;
        // The store's step (streamed experts through the host cache): alive
        // until the uploads and the CPU lane have read its bytes.
        let mut guard: Option<pulsar_store::StepGuard<'a>> = None;
        // Cold experts the CPU lane computes this step, and the slab kinds.
        let mut lane_experts: Vec<u32> = Vec::new();
        let mut lane_x: Vec<f32> = Vec::new();
        // (expert, rows): gate/up heads the CPU lane computes this step.
        let mut lane_heads: Vec<(u32, usize)> = Vec::new();
        let mut layer_kinds = [pulsar_store::SlabKind::Gate; 3];
        let [pg, pu, pd] = &mut pbufs[..] else { unreachable!("three pointer buffers") };
        match resident {
            Some(_) => {
                if grouped {
                    h_ids = vec![0i32; n_pairs];
                    ids.download(&stream, &mut h_ids).map_err(err)?;
                    host_ptrs = (0..ne)
                        .map(|e| -> R<[u64; 3]> {
                            let mut p = [0u64; 3];
                            for (ki, &i) in widx.iter().enumerate() {
                                let (dw, mw) = (&cm.weights[i], &self.model.weights[i]);
                                let slab = (mw.bytes / dw.dims.get(2).copied().unwrap_or(1).max(1)) as usize;
                                p[ki] = dw.raw.as_ref().ok_or("resident expert without bytes")?.device_ptr_at(e * slab).map_err(err)?;
                            }
                            Ok(p)
                        })
                        .collect::<R<_>>()?;
                }
                // Else: everything is on the device, gathered by the router above.
            }
            None => {
                let pool = cm.experts.as_ref().ok_or("experts are neither resident nor pooled")?;
                // Decode: predict the next layer's experts with its router on
                // this layer's input, so their cold slabs can be copied while
                // this layer computes (the store path's guard cannot outlive
                // the layer, so only the page-locked mapping prefetches).
                let pays = pool.lock().unwrap_or_else(|e| e.into_inner()).prefetch_pays();
                // Prefill predicts too (its whole next-layer set is copied
                // while this layer computes); repetitive text routes a chunk to
                // few experts, so "every expert" would waste the link.
                let next_router = match (self.store, cm.prefetch && (rows > 1 || pays)) {
                    (None, true) => self.model.weights.iter().position(|w| w.role == pulsar_plugin_api::Role::Router && w.layer == Some(spec.layer + 1)),
                    _ => None,
                };
                let mut next = None;
                if let Some(ri) = next_router {
                    let nl = self.linear_w(Wt(ri as u32), x)?;
                    let mut idn = self.pools.i32.take(dev, rows * k).map_err(err)?;
                    let mut wn = self.pools.f32.take(dev, rows * k).map_err(err)?;
                    dev.route(&stream, &rs, self.buf(nl)?, None, rows, ne, &mut idn, &mut wn).map_err(err)?;
                    next = Some((idn, wn));
                }
                h_ids = vec![0i32; n_pairs];
                // Decode with a lane: its input comes back with the routing ids.
                let lane_may = rows == 1 && cm.lane.is_some() && !grouped;
                if lane_may {
                    pool.lock().unwrap_or_else(|e| e.into_inner()).stage_lane_input(dev, self.buf(x)?).map_err(err)?;
                }
                // Synchronises the stream: earlier layers' expert kernels are
                // done, so their scratch and evicted slots may be reused.
                let t_route = std::time::Instant::now();
                ids.download(&stream, &mut h_ids).map_err(err)?;
                let route_wait = t_route.elapsed().as_secs_f64();
                let mut predicted: Vec<u32> = Vec::new();
                if let Some((idn, wn)) = next {
                    let mut h = vec![0i32; rows * k];
                    let r = idn.download(&stream, &mut h);
                    self.pools.i32.give(idn);
                    self.pools.f32.give(wn);
                    r.map_err(err)?;
                    predicted = h.into_iter().filter(|&e| e >= 0 && (e as usize) < ne).map(|e| e as u32).collect();
                    predicted.sort_unstable();
                    predicted.dedup();
                }
                if let Some(&e) = h_ids.iter().find(|&&e| e < 0 || e as usize >= ne) {
                    return Err(format!("moe layer {}: router chose expert {e} of {ne}", spec.layer));
                }
                // The layer before's lane job is done (the stream waited for
                // it before this sync): account it before this layer's plan.
                self.join_lane()?;
                let touched: Vec<u32> = h_ids.iter().map(|&e| e as u32).collect();
                let mut experts = touched.clone();
                experts.sort_unstable();
                experts.dedup();
                let mut kinds = [pulsar_store::SlabKind::Gate; 3];
                for (ki, &i) in widx.iter().enumerate() {
                    let w = &self.model.weights[i];
                    kinds[ki] = crate::cpu::moe::slab_kind(&w.name).ok_or_else(|| format!("{}: not an expert tensor", w.name))?;
                }
                let model = self.model;
                let req0 = super::LayerRequest { layer: spec.layer, kinds, experts: &experts, touched: &touched, zero_copy: &[], cpu: &[], heads: &[], decode: rows == 1 };
                let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
                if self.store.is_none() && cm.prefetch {
                    pool.enable_prefetch(k);
                }
                let plan = pool.plan_layer(&req0).map_err(err)?;
                pool.stats.route_wait_seconds += route_wait;
                // Who waited for whom in the layer before: steer the lane's share.
                let (busy, chain) = pool.take_layer_outcome();
                let copies = pool.take_copy_span().filter(|_| rows == 1);
                if busy.is_some() || chain.is_some() || copies.is_some() {
                    let mut cost = cm.cost.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some((bytes, secs)) = copies {
                        cost.observe_link(bytes, secs);
                    }
                    if let Some(link_busy) = busy {
                        cost.balance(link_busy);
                    }
                    if let Some(c) = chain {
                        cost.observe_chain(c);
                    }
                }
                use crate::cold::{ColdPath, ColdPolicy};
                let policy = if cm.lane.is_none() && cm.cold == ColdPolicy::Force(ColdPath::Cpu) { ColdPolicy::Force(ColdPath::Upload) } else { cm.cold };
                let lane_on = cm.lane.is_some() && matches!(policy, ColdPolicy::Auto | ColdPolicy::Force(ColdPath::Cpu));
                let expert_bytes = |ws: &[usize]| -> u64 { ws.iter().map(|&i| self.model.weights[i].bytes / ne as u64).sum() };
                // Bytes of `r` rows of this layer's gate (= up) slab.
                let gate_row = pulsar_kernels::quant::row_bytes(gate_ty, d_model).unwrap_or(0);
                let head_bytes = |r: usize| r * gate_row;
                // A layer's head geometry (gate + up bytes of a row, ff, one
                // slab's row bytes), if gate and up share one type.
                let next_head = |ws: &[usize]| -> Option<(u64, usize, usize)> {
                    // Gate and up fused in one slab: a head would need rows of both halves.
                    if ws[0] == ws[1] {
                        return None;
                    }
                    let (g, u) = (&self.model.weights[ws[0]], &self.model.weights[ws[1]]);
                    let row = pulsar_kernels::quant::row_bytes(g.ty, *g.dims.first()? as usize).ok()?;
                    (g.ty == u.ty && g.dims == u.dims).then_some((2 * row as u64, *g.dims.get(1)? as usize, row))
                };
                let as_cold = |experts: &[u32], bytes: u64| -> Vec<crate::cold::ColdExpert> {
                    experts.iter().map(|&expert| crate::cold::ColdExpert { expert, bytes, ty: gate_ty, in_host_memory: true }).collect()
                };
                // Decode: split the cold experts between the link (upload or
                // zero-copy) and the CPU lane by measured cost. Experts the
                // last layer's prefetch left to the lane go there; the rest
                // are split around them. Prefill uploads: its grouped
                // products want the weights in VRAM.
                // Experts whose gate/up heads the last layer's prefetch left
                // to the lane (their other rows and down are on the device).
                let heads: Vec<(u32, usize)> = if !grouped && !float && lane_on && policy == ColdPolicy::Auto && widx[0] != widx[1] { pool.heads_ready(spec.layer, kinds, &experts) } else { Vec::new() };
                let head_experts: Vec<u32> = heads.iter().map(|h| h.0).collect();
                let (mut zero_copy, mut cpu) = (Vec::new(), Vec::new());
                if !grouped && !plan.cold.is_empty() {
                    let reserved = pool.lane_reserved(spec.layer);
                    let (kept, rest): (Vec<u32>, Vec<u32>) = plan.cold.iter().partition(|e| lane_on && reserved.binary_search(e).is_ok());
                    let cost = cm.cost.lock().unwrap_or_else(|e| e.into_inner());
                    let bytes = expert_bytes(&widx);
                    let kept_cold = as_cold(&kept, bytes);
                    let head_bytes: u64 = heads.iter().map(|&(_, r)| head_bytes(r) as u64 * 2).sum();
                    let mut busy = crate::cold::Busy { link: 0.0, cpu: crate::cold::lane_seconds(&kept_cold, &vec![ColdPath::Cpu; kept.len()], &cost).1 };
                    if head_bytes > 0 {
                        busy.cpu += cost.cpu_fixed() + cost.seconds(ColdPath::Cpu, head_bytes, gate_ty);
                    }
                    let rest_cold = as_cold(&rest, bytes);
                    let paths = crate::cold::split_busy(&rest_cold, &cost, policy, busy);
                    cpu = kept;
                    for (c, p) in rest_cold.iter().zip(paths) {
                        match p {
                            ColdPath::ZeroCopy => zero_copy.push(c.expert),
                            ColdPath::Cpu if lane_on => cpu.push(c.expert),
                            _ => {}
                        }
                    }
                    zero_copy.sort_unstable();
                    cpu.sort_unstable();
                }
                if !grouped && lane_on && cpu.is_empty() && heads.is_empty() {
                    cm.cost.lock().unwrap_or_else(|e| e.into_inner()).relax();
                }
                // The lane reads this layer's input on the host; the stream
                // is idle here (the routing ids just came back), so this
                // copy costs no wait, and the lane can run beside the GPU.
                let mut x_host = Vec::new();
                if !cpu.is_empty() || !heads.is_empty() {
                    x_host = pool.lane_input().to_vec();
                    if !lane_may || x_host.len() != rows * d_model {
                        x_host = vec![0f32; rows * d_model];
                        self.buf(x)?.download(&stream, &mut x_host).map_err(err)?;
                    }
                }
                // Heads start now, on the lane's driver, while the host copies and queues.
                let heads_async = !heads.is_empty() && pool.async_lane();
                if heads_async {
                    // A copy: whole cold experts of this layer run on the lane after it (16 KB).
                    self.submit_heads(&mut pool, spec, x_host.clone(), &h_ids, &heads, widx, ff)?;
                }
                let req = super::LayerRequest { zero_copy: &zero_copy, cpu: &cpu, heads: &head_experts, ..req0 };
                let need = &plan.need;
                match self.store.filter(|_| !need.is_empty()) {
                    // Tier 3/4: what VRAM lacks comes through the host cache
                    // (page-locked) over the disk; the guard keeps those bytes
                    // alive until the copies and the CPU lane are done with them.
                    Some(st) => {
                        let sel: Vec<pulsar_store::Selection> =
                            h_ids.iter().enumerate().map(|(p, &e)| pulsar_store::Selection { token: (p / k) as u32, slot: (p % k) as u32, expert: e as u32 }).collect();
                        // Places first, then each slab's copy starts the moment
                        // the store has its bytes (a host-cache hit at once, a
                        // disk read as it completes), overlapping the rest.
                        let plan = pool.assign_layer(dev, &req, None).map_err(err)?;
                        let r = st.store.resolve_streaming(spec.layer, &sel, &|e| need.binary_search(&e).is_ok(), &mut |id, b| {
                            pool.copy_slab(dev, &plan, id, b).map_err(|e| e.to_string())
                        });
                        if r.is_err() {
                            // Nothing may still read host bytes the failed step released.
                            let _ = pool.wait_copies();
                        }
                        let g = r.map_err(err)?;
                        let g = guard.insert(g);
                        if let Some(&(id, ..)) = plan.copies.iter().find(|c| g.slab(c.0).is_none()) {
                            return Err(format!("{id}: not resolved by the store"));
                        }
                        pool.finish_fill(dev, plan).map_err(err)?;
                    }
                    None => {
                        pool.fill_layer(dev, &req, &|ki, e| {
                            let t = model.tensor(&model.weights[widx[ki]]);
                            let range = model.file.expert_slab(t, e as u64).map_err(err)?;
                            model.file.bytes(&range).map_err(err)
                        })
                        .map_err(err)?;
                        let nw: Option<Vec<usize>> = kinds.iter().map(|&kd| cm.slab_index.get(&(spec.layer + 1, kd)).copied()).collect();
                        if let (false, Some(nw)) = (predicted.is_empty(), nw) {
                            // Decode: the predicted cold experts the lane would
                            // finish before the link are left to it (they then
                            // never cross the link); the link copies the rest.
                            let mut lane_next = Vec::new();
                            if rows == 1 && lane_on && pool.prefetch_enabled() {
                                let next_cold = as_cold(&pool.cold_of(spec.layer + 1, kinds, &predicted), expert_bytes(&nw));
                                let cost = cm.cost.lock().unwrap_or_else(|e| e.into_inner());
                                lane_next = match policy {
                                    // Forced: the lane takes them whole.
                                    ColdPolicy::Force(_) => next_cold.iter().map(|c| (c.expert, super::pool::LaneShare::Whole)).collect(),
                                    // Auto: the same head of each, sized so the
                                    // lane and the link finish together.
                                    ColdPolicy::Auto => match next_head(&nw) {
                                        Some((gu_row, ff_next, row)) if !float => {
                                            // Beside the host, the lane adds to no host work.
                                            let serial = if pool.async_lane() { 0.0 } else { cost.chain_s };
                                            let r = crate::cold::head_rows(&next_cold, gu_row, ff_next, HEAD_GRANULE, serial, &cost);
                                            if r == 0 { Vec::new() } else { next_cold.iter().map(|c| (c.expert, super::pool::LaneShare::Head { rows: r, bytes: r * row })).collect() }
                                        }
                                        _ => Vec::new(),
                                    },
                                };
                            }
                            pool.prefetch_layer(dev, spec.layer + 1, rows == 1, kinds, &predicted, &lane_next, &|ki, e| {
                                let t = model.tensor(&model.weights[nw[ki]]);
                                let range = model.file.expert_slab(t, e as u64).map_err(err)?;
                                model.file.bytes(&range).map_err(err)
                            })
                            .map_err(err)?;
                            if grouped {
                                prefetch_rest = Some((std::mem::take(&mut predicted), nw, kinds));
                            }
                        }
                    }
                }
                lane_experts = cpu;
                lane_heads = heads;
                lane_x = x_host;
                layer_kinds = kinds;
                if grouped {
                    let t = pool.host_tables();
                    host_ptrs = (0..ne).map(|e| [t[0][e], t[1][e], t[2][e]]).collect();
                } else {
                    let table = pool.tables();
                    dev.moe_gather_ptrs(&stream, &ids, [&table[0], &table[1], &table[2]], [pg, pu, pd]).map_err(err)?;
                }
            }
        }
        self.mark(Some(&|| format!("moe: experts {}", if grouped { "grouped" } else { "per pair" })));
        let mut out = self.pools.f32.take(dev, n_pairs * d_model).map_err(err)?;
        if float {
            let mut h = self.pools.f32.take(dev, n_pairs * ff).map_err(err)?;
            let pairs = MoePairs { gate: &pbufs[0], up: &pbufs[1], down: &pbufs[2], n_tok: rows, n_slot: k };
            let r = dev.moe_ffn_float(&stream, gate_ty, &pairs, self.buf(x)?, d_model, ff, act_of(spec.act), &mut h, &mut out);
            self.pools.f32.give(h);
            r.map_err(err)?;
            if !lane_experts.is_empty() {
                self.run_lane(spec, &lane_x, &h_ids, &lane_experts, layer_kinds, widx, guard.as_ref(), &mut out)?;
            }
        } else if grouped {
            let xqi = self.quantized(x, gfmt)?;
            // Pairs sorted by expert (stable: pair order within an expert).
            let mut order: Vec<usize> = (0..n_pairs).collect();
            order.sort_by_key(|&p| h_ids[p]);
            let tok_of: Vec<i32> = order.iter().map(|&p| (p / k) as i32).collect();
            let pair_of: Vec<i32> = order.iter().map(|&p| p as i32).collect();
            let mut runs = Vec::new();
            let mut i = 0;
            while i < n_pairs {
                let e = h_ids[order[i]] as usize;
                let mut j = i;
                while j < n_pairs && h_ids[order[j]] as usize == e {
                    j += 1;
                }
                let p = host_ptrs.get(e).copied().ok_or_else(|| format!("moe layer {}: router chose expert {e} of {ne}", spec.layer))?;
                if p.iter().all(|&a| a != 0) {
                    runs.push(pulsar_cuda::ExpertRun { gate: p[0], up: p[1], down: p[2], start: i, len: j - i });
                }
                i = j;
            }
            let mut tb = self.pools.i32.take(dev, n_pairs).map_err(err)?;
            let mut pb = self.pools.i32.take(dev, n_pairs).map_err(err)?;
            tb.upload(&stream, &tok_of).map_err(err)?;
            pb.upload(&stream, &pair_of).map_err(err)?;
            let mut xs = self.pools.u8.take(dev, pulsar_cuda::act_bytes(gfmt, n_pairs, d_model).map_err(err)?).map_err(err)?;
            let mut hg = self.pools.f32.take(dev, n_pairs * ff).map_err(err)?;
            let mut hu = self.pools.f32.take(dev, n_pairs * ff).map_err(err)?;
            let mut h = self.pools.f32.take(dev, n_pairs * ff).map_err(err)?;
            let mut hq = self.pools.u8.take(dev, pulsar_cuda::act_bytes(dfmt, n_pairs, ff).map_err(err)?).map_err(err)?;
            let mut outs = self.pools.f32.take(dev, n_pairs * d_model).map_err(err)?;
            // Sized for the most runs a chunk can have (one per expert), so the pool
            // hands back one buffer instead of allocating one per distinct run count.
            let mut items = self.pools.u64.take(dev, pulsar_cuda::grouped_items_len(n_pairs, ne.min(n_pairs))).map_err(err)?;
            let mut scratch = pulsar_cuda::GroupedScratch { items: &mut items, xs: &mut xs, hg: &mut hg, hu: &mut hu, h: &mut h, hq: &mut hq, outs: &mut outs };
            let r = dev.moe_ffn_grouped(&stream, gate_ty, down_ty, &runs, &tb, &pb, &self.qcache[xqi].2, rows, d_model, ff, act_of(spec.act), &mut scratch, &mut out);
            self.pools.i32.give(tb);
            self.pools.i32.give(pb);
            self.pools.u64.give(items);
            self.pools.u8.give(xs);
            self.pools.u8.give(hq);
            for b in [hg, hu, h, outs] {
                self.pools.f32.give(b);
            }
            r.map_err(err)?;
            if let (Some((predicted, nw, kinds)), Some(pool)) = (prefetch_rest.take(), &cm.experts) {
                let model = self.model;
                pool.lock().unwrap_or_else(|e| e.into_inner())
                    .prefetch_rest(dev, spec.layer + 1, kinds, &predicted, &|ki, e| {
                        let t = model.tensor(&model.weights[nw[ki]]);
                        let range = model.file.expert_slab(t, e as u64).map_err(err)?;
                        model.file.bytes(&range).map_err(err)
                    })
                    .map_err(err)?;
            }
        } else {
            let xqi = self.quantized(x, gfmt)?;
            let mut h = self.pools.f32.take(dev, n_pairs * ff).map_err(err)?;
            let mut hq = self.pools.u8.take(dev, pulsar_cuda::act_bytes(dfmt, n_pairs, ff).map_err(err)?).map_err(err)?;
            let pairs = MoePairs { gate: &pbufs[0], up: &pbufs[1], down: &pbufs[2], n_tok: rows, n_slot: k };
            // Split experts: each pair's first device row of h; the lane
            // fills the rows below while the GPU computes the rest.
            let row_lo = if lane_heads.is_empty() {
                None
            } else {
                let lo: Vec<i32> = h_ids.iter().map(|&e| lane_heads.iter().find(|h| h.0 as i32 == e).map_or(0, |h| h.1 as i32)).collect();
                let mut b = self.pools.i32.take(dev, n_pairs).map_err(err)?;
                let pool = cm.experts.as_ref().ok_or("heads without an expert pool")?;
                pool.lock().unwrap_or_else(|e| e.into_inner()).stage_row_lo(dev, &lo, &mut b).map_err(err)?;
                Some(b)
            };
            let mut lane_err = None;
            let r = {
                let (me, heads, xh, ids) = (&*self, &lane_heads, &lane_x, &h_ids);
                let mut fill = |h: &mut DeviceBuf<f32>| -> Result<(), pulsar_cuda::CudaError> {
                    if heads.is_empty() {
                        return Ok(());
                    }
                    // A pending job here is this layer's (the layer before's
                    // was joined at the routing sync): its copies go behind a
                    // wait for its flag, and the host does not wait.
                    if let (Some(p), Some(pool)) = (me.lane_pending.as_ref(), cm.experts.as_ref()) {
                        return pool.lock().unwrap_or_else(|e| e.into_inner()).queue_lane_output(dev, p.seq, &p.segs, h).map_err(|e| {
                            lane_err = Some(e.to_string());
                            pulsar_cuda::CudaError::Shape { op: "moe_ffn", what: "the cpu lane's heads could not be queued".into() }
                        });
                    }
                    me.lane_heads(spec, xh, ids, heads, widx, ff, h).map_err(|e| {
                        lane_err = Some(e);
                        pulsar_cuda::CudaError::Shape { op: "moe_ffn", what: "the cpu lane's heads failed".into() }
                    })
                };
                dev.moe_ffn_split(&stream, gate_ty, down_ty, &pairs, row_lo.as_ref(), &self.qcache[xqi].2, d_model, ff, act_of(spec.act), &mut h, &mut hq, &mut out, &mut fill)
            };
            if let Some(b) = row_lo {
                self.pools.i32.give(b);
            }
            self.pools.u8.give(hq);
            self.pools.f32.give(h);
            if let Some(e) = lane_err {
                return Err(e);
            }
            r.map_err(err)?;
            if !lane_experts.is_empty() {
                // The GPU works on its experts meanwhile; the lane's rows land
                // in `out` before the combine, which sums in slot order as ever.
                self.run_lane(spec, &lane_x, &h_ids, &lane_experts, layer_kinds, widx, guard.as_ref(), &mut out)?;
            }
        }
        if let Some(g) = guard.take() {
            if let Some(p) = &cm.experts {
                p.lock().unwrap_or_else(|e| e.into_inner()).wait_copies().map_err(err)?;
            }
            drop(g);
        }
        // Weighted sum over slots, in slot order, as the CPU backend does.
        self.mark(Some(&|| "moe: combine".to_string()));
        let y = self.combine(&out, &wts, rows, k, d_model);
        for b in pbufs {
            self.pools.u64.give(b);
        }
        self.pools.i32.give(ids);
        self.pools.f32.give(wts);
        self.pools.f32.give(out);
        y
    }
}

impl Exec for CudaStep<'_> {
    fn embed(&mut self, table: Wt, scale: f32) -> R<Val> {
        self.note(&[]);
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
    fn linear(&mut self, w: Wt, x: Val) -> R<Val> {
        self.note(&[x]);
        self.mark(Some(&|| format!("linear {}", self.model.weights.get(w.0 as usize).map_or("?", |m| short_name(&m.name)))));
        let r = self.linear_w(w, x);
        self.done(r)
    }
    fn rms_norm(&mut self, x: Val, w: Option<Wt>, eps: f32, group: u32) -> R<Val> {
        let key = OpKey::Norm { w: w.map(|w| w.0), eps: eps.to_bits(), group };
        self.note_as(&[x], key);
        self.mark(Some(&|| "rms_norm".to_string()));
        let r = (|| {
            if let Some(v) = self.claim_ahead(key, &[x])? {
                return Ok(v);
            }
            let g = group as usize;
            if let Some(v) = self.norm_rope_fused(x, w, eps, g)? {
                return Ok(v);
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
        self.note_as(&[a, b], OpKey::Add);
        self.mark(Some(&|| "add".to_string()));
        let r = match self.claim_ahead(OpKey::Add, &[a, b]) {
            Ok(Some(v)) => Ok(v),
            Ok(None) => self.binary(a, b, 0),
            Err(e) => Err(e),
        };
        self.done(r)
    }
    fn mul(&mut self, a: Val, b: Val) -> R<Val> {
        self.note(&[a, b]);
        self.mark(Some(&|| "mul".to_string()));
        let r = self.binary(a, b, 1);
        self.done(r)
    }
    fn scale(&mut self, x: Val, s: f32) -> R<Val> {
        self.note(&[x]);
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
    fn act(&mut self, x: Val, act: Act) -> R<Val> {
        // act(x) = glu(x, 1): the GLU kernel with a ones vector.
        self.note(&[x]);
        self.mark(Some(&|| "act".to_string()));
        let r = (|| {
            let (rows, cols) = self.dims(x)?;
            let stream = self.cm.dev.compute().clone();
            let mut ones = self.new_val(rows, cols)?;
            ones.fill_words(&stream, 1f32.to_bits()).map_err(err)?;
            let mut y = self.new_val(rows, cols)?;
            self.cm.dev.glu(&stream, self.buf(x)?, &ones, &mut y, act_of(act)).map_err(err)?;
            self.pools.f32.give(ones);
            self.push(y, rows, cols)
        })();
        self.done(r)
    }
    fn glu(&mut self, gate: Val, up: Val, act: Act) -> R<Val> {
        self.note(&[gate, up]);
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
        let mode = match spec.mode {
            RopeMode::Neox => 0,
            RopeMode::Interleaved => 1,
        };
        let key = OpKey::Rope { head_dim: spec.head_dim, n_rot: spec.n_rot, base: spec.base.to_bits(), factor: spec.linear_factor.to_bits(), mode };
        self.note_as(&[x], key);
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
            let kind = match spec.mode {
                RopeMode::Neox => RopeKind::Neox,
                RopeMode::Interleaved => RopeKind::Interleaved,
            };
            let p = RopeParams { head_dim: spec.head_dim as usize, n_rot: spec.n_rot as usize, base: spec.base, linear_factor: spec.linear_factor, kind };
            let stream = self.cm.dev.compute().clone();
            // Out of place: one kernel reads x and writes every value of y.
            self.cm.dev.rope(&stream, self.buf(x)?, &mut y, cols, self.pos_buf, &p).map_err(err)?;
            self.push(y, rows, cols)
        })();
        self.done(r)
    }
    fn attention(&mut self, q: Val, k: Val, v: Val, spec: AttnSpec) -> R<Val> {
        self.note(&[q, k, v]);
        self.mark(Some(&|| "attention".to_string()));
        let r = self.do_attention(q, k, v, spec);
        self.done(r)
    }
    fn moe(&mut self, x: Val, spec: MoeSpec) -> R<Val> {
        self.note(&[x]);
        self.mark(Some(&|| "moe: router, top-k".to_string()));
        let r = self.do_moe(x, &spec);
        self.done(r)
    }
    fn output_rows(&mut self, x: Val) -> R<Val> {
        self.note(&[x]);
        self.mark(Some(&|| "output_rows".to_string()));
        let r = (|| {
            let (rows, cols) = self.dims(x)?;
            let keep = if self.all_rows { rows } else { 1 };
            let mut y = self.new_val(keep, cols)?;
            let src = self.buf(x)?.device_ptr() + ((rows - keep) * cols * 4) as u64;
            self.copy_rows(y.device_ptr(), src, keep * cols * 4)?;
            let _ = &mut y;
            self.push(y, keep, cols)
        })();
        self.done(r)
    }
}

#[cfg(test)]
mod tests {
    use super::{Liveness, OpKey, TraceOp};

    #[test]
    fn a_value_is_released_after_its_last_reader() {
        // op 0 makes v0; op 1 reads v0 (makes v1); op 2 reads v0 and v1; op 3 reads v2.
        let ops = [vec![], vec![0], vec![0, 1], vec![2]].into_iter().enumerate();
        let l = Liveness::from_trace(ops.map(|(i, inputs)| TraceOp { key: OpKey::Other, inputs, out: i as u32 }).collect());
        let mut f: Vec<Vec<u32>> = l.frees.clone();
        f.iter_mut().for_each(|v| v.sort_unstable());
        assert_eq!(f, vec![vec![], vec![], vec![0, 1], vec![2]]);
        assert_eq!(l.ops.len(), 4);
    }
}
