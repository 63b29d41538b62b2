//! One forward step on the GPU: [`CudaStep`] implements the plugin ops,
//! [`CudaRunner`] runs steps (pools, lowering, captured graphs) over caches
//! it is given; [`CudaEngine`] is one sequence's session (its cache, its
//! position, a runner).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use cudarc::driver::{sys as cusys, CudaGraph};
use pulsar_cuda::{attention_graph_ctx, DeviceBuf};
use pulsar_kernels::ActFormat;
use pulsar_plugin_api::{Val, Wt};

use super::fuse::AheadSet;
use super::lower::Lowering;
use super::pool::BufPool;
use super::profile::OpProfile;
use super::{CudaBackendError, CudaKv, CudaModel, DevWeight};
use crate::engine::EngineError;
use crate::experts::StoreExperts;
use crate::model::Model;

mod lane;
mod moe;
mod ops;
mod prims;

type R<T> = Result<T, String>;

/// Head rows of a split expert come in multiples of this (the lane's and the
/// GPU's row groups both divide it).
const HEAD_GRANULE: usize = 32;

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Where a step value's words are.
enum Store<'a> {
    /// A buffer of the step's pools.
    Own(DeviceBuf<f32>),
    /// A resident buffer of the model (a `weight` op's f32 values).
    Borrowed(&'a DeviceBuf<f32>),
    /// Released (its last use in the step's recorded plan is past).
    Gone,
}

struct DVal<'a> {
    store: Store<'a>,
    rows: usize,
    cols: usize,
}

impl<'a> DVal<'a> {
    fn buf(&self) -> Option<&DeviceBuf<f32>> {
        match &self.store {
            Store::Own(b) => Some(b),
            Store::Borrowed(b) => Some(b),
            Store::Gone => None,
        }
    }

    /// Release the value: its buffer when the step owns it.
    fn take(&mut self) -> Option<DeviceBuf<f32>> {
        match std::mem::replace(&mut self.store, Store::Gone) {
            Store::Own(b) => Some(b),
            _ => None,
        }
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
    /// The caches it was captured over ([`CudaKv::id`]): another sequence's
    /// decode captures its own.
    kv_id: u64,
    /// The step's output, owned here (out of the pools) so nothing else writes it.
    out: DeviceBuf<f32>,
    rows: usize,
    cols: usize,
}

/// What a CUDA rollback needs: the position and every recurrent state.
pub struct CudaSnapshot {
    pub n_past: usize,
    recurrent: Vec<(usize, Vec<f32>)>,
}

impl CudaKv {
    /// The recurrent states now, copied to the host, with the position they are at.
    pub fn snapshot(&self, dev: &pulsar_cuda::CudaDevice, n_past: usize) -> Result<CudaSnapshot, EngineError> {
        let stream = dev.compute();
        let mut recurrent = Vec::with_capacity(self.recurrent.len());
        for (&i, b) in &self.recurrent {
            let mut v = vec![0f32; b.len()];
            b.download(stream, &mut v).map_err(|e| EngineError::Forward(format!("snapshot of state {i}: {e}")))?;
            recurrent.push((i, v));
        }
        Ok(CudaSnapshot { n_past, recurrent })
    }

    /// Put `snap`'s recurrent states back.
    pub fn restore(&mut self, dev: &pulsar_cuda::CudaDevice, snap: &CudaSnapshot) -> Result<(), EngineError> {
        let stream = dev.compute();
        for (i, v) in &snap.recurrent {
            let b = self.recurrent.get_mut(i).ok_or_else(|| EngineError::Forward(format!("the snapshot's state {i} is not a recurrent state of this model")))?;
            b.upload(stream, v).map_err(|e| EngineError::Forward(format!("restoring state {i}: {e}")))?;
        }
        Ok(())
    }

    /// Copy the first `n` positions of every KV and rows cache of `from`
    /// into these (on the compute stream, in order with the steps): what a
    /// prefix of the same tokens would write. Refused for recurrent states.
    pub fn copy_prefix(&mut self, dev: &pulsar_cuda::CudaDevice, from: &CudaKv, n: usize) -> Result<(), EngineError> {
        let fail = |m: String| EngineError::Forward(format!("copying a cached prefix: {m}"));
        if !self.recurrent.is_empty() || n > self.n_ctx.min(from.n_ctx) {
            return Err(fail(format!("{n} positions of caches of {} and {} (or a recurrent state)", self.n_ctx, from.n_ctx)));
        }
        let mut copies = Vec::new();
        for (i, (kw, vw, k, v)) in &self.layers {
            let (skw, svw, sk, sv) = from.layers.get(i).ok_or_else(|| fail(format!("no state {i} to copy from")))?;
            if (kw, vw) != (skw, svw) || k.kv_type() != sk.kv_type() {
                return Err(fail(format!("state {i}: widths or formats differ")));
            }
            let t = k.kv_type();
            copies.push((k.device_ptr(), sk.device_ptr(), n * t.row_bytes(*kw)));
            copies.push((v.device_ptr(), sv.device_ptr(), n * t.row_bytes(*vw)));
        }
        for (i, (w, b)) in &self.rows {
            let (sw, sb) = from.rows.get(i).ok_or_else(|| fail(format!("no state {i} to copy from")))?;
            if w != sw {
                return Err(fail(format!("state {i}: widths differ")));
            }
            copies.push((b.device_ptr(), sb.device_ptr(), n * w * 4));
        }
        dev.context().bind_to_thread().map_err(|e| fail(e.to_string()))?;
        for (dst, src, bytes) in copies.into_iter().filter(|c| c.2 > 0) {
            // SAFETY: both ranges are the first `n` rows of live caches of
            // at least `n` rows (checked above).
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, dev.compute().cu_stream()) }.map_err(|e| fail(e.to_string()))?;
        }
        Ok(())
    }

    /// An identity for the caches (the lowest address among their buffers,
    /// which no other live allocation shares).
    pub fn id(&self) -> u64 {
        let kv = self.layers.values().flat_map(|(_, _, k, v)| [k.device_ptr(), v.device_ptr()]);
        let rest = self.rows.values().map(|(_, b)| b.device_ptr()).chain(self.recurrent.values().map(|b| b.device_ptr()));
        kv.chain(rest).min().unwrap_or(0)
    }

    /// Bytes of the device buffers.
    pub fn bytes(&self) -> usize {
        let kv: usize = self.layers.values().map(|(_, _, k, v)| k.bytes() + v.bytes()).sum();
        kv + self.rows.values().map(|(_, b)| b.bytes()).sum::<usize>() + self.recurrent.values().map(|b| b.bytes()).sum::<usize>()
    }
}

/// What runs steps on one GPU for one or several sequences: the lowering of
/// the model's graphs, the step buffers' pools, the recorded value
/// lifetimes and the captured decode graph. The caches are the caller's
/// ([`CudaEngine`] owns one, `CudaSeqs` one per sequence slot).
pub struct CudaRunner<'m> {
    pub model: &'m Model,
    pub cm: &'m CudaModel,
    /// Streamed experts come through this store's host cache (else the mapping).
    store: Option<&'m StoreExperts>,
    pools: Pools,
    /// A decode step has run (the next may be captured: its buffers are in the pools).
    decoded: bool,
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

/// A model session on one GPU: one sequence's caches, its position, and the runner.
pub struct CudaEngine<'m> {
    pub kv: CudaKv,
    pub n_past: usize,
    pub ubatch: usize,
    pub history: Vec<u32>,
    run: CudaRunner<'m>,
}

impl<'m> CudaRunner<'m> {
    pub fn new(model: &'m Model, cm: &'m CudaModel) -> Result<CudaRunner<'m>, CudaBackendError> {
        let lower = |p| Lowering::new(p).map_err(|e| CudaBackendError::Other(format!("plugin `{}`: {e}", model.plugin)));
        let lowering = [lower(&model.steps.decode)?, lower(&model.steps.prefill)?];
        Ok(CudaRunner {
            model,
            cm,
            store: None,
            pools: Pools::default(),
            decoded: false,
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

    /// Warn once when the step buffers outgrow what the VRAM budget kept for them.
    fn check_reserve(&mut self) {
        let held = self.activation_bytes();
        if self.cm.activation_reserve > 0 && held > self.cm.activation_reserve && !self.over_reserve {
            self.over_reserve = true;
            tracing::warn!(
                "step buffers hold {:.0} MiB, more than the {:.0} MiB of the VRAM budget kept for them",
                held as f64 / (1u64 << 20) as f64,
                self.cm.activation_reserve as f64 / (1u64 << 20) as f64
            );
        }
    }

    /// Whether a step may carry rows of several sequences: every state the
    /// model declares is a KV cache, and no graph reads a whole cache as a
    /// value (those run one sequence a step).
    pub fn batches(&self) -> bool {
        let reads_cache = |p: &crate::graph::StepPlan| p.shapes.iter().any(|s| s.dims.contains(&pulsar_plugin_api::Dim::C));
        self.model.plan.states.iter().all(|s| s.as_kv().is_some()) && !reads_cache(&self.model.steps.decode) && !reads_cache(&self.model.steps.prefill)
    }

    /// One step over `tokens` at `positions`. `seqs` None: every row is
    /// `kvs[0]`'s; else row `i` belongs to `kvs[seqs[i]]` (a sequence's rows
    /// contiguous and in order, [`CudaRunner::batches`] true). Returns every
    /// row's logits (`all`) or each sequence's last row's.
    pub fn step(&mut self, kvs: &mut [CudaKv], seqs: Option<&[u32]>, tokens: &[u32], positions: &[u32], all: bool) -> R<Vec<Vec<f32>>> {
        let runs = seq_runs(seqs, tokens.len(), kvs.len())?;
        if runs.len() > 1 && !self.batches() {
            return Err(format!("plugin `{}`: its states cannot be batched over sequences on the GPU", self.model.plugin));
        }
        let single = runs.len() == 1;
        let p = &mut self.pools;
        // `|` not `||`: every flag is read and cleared.
        if p.f32.take_trimmed() | p.u8.take_trimmed() | p.u32.take_trimmed() | p.i32.take_trimmed() | p.u64.take_trimmed() {
            self.graph = None;
        }
        let dev = &self.cm.dev;
        let stream = dev.compute().clone();
        let decode = tokens.len() == 1;
        let kind = usize::from(!decode);
        let n_ctx0 = kvs[runs[0].2].n_ctx;
        // A decode after one that set the plan may run as a graph: replayed
        // when one was captured for this split bucket, else captured now.
        let split_ctx = (decode && self.graphs && self.lowering[0].capturable && self.profile.is_none() && self.release_early && self.decoded)
            .then(|| attention_graph_ctx(positions[0] as usize + 1, n_ctx0));
        let (mut own_pos, mut own_tok) = (None, None);
        if decode {
            self.dec_tok.upload(&stream, tokens).map_err(err)?;
            self.dec_pos.upload(&stream, positions).map_err(err)?;
            if let (Some(sc), Some(g)) = (split_ctx, &self.graph) {
                if g.split_ctx == sc && g.all_rows == all && g.kv_id == kvs[runs[0].2].id() {
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
        // Rows of several sequences: each KV layer's per-row cache addresses.
        let (mut tables, mut table_at) = (None, HashMap::new());
        if !single {
            let mut host: Vec<u64> = Vec::new();
            for &state in kvs[0].layers.keys() {
                table_at.insert(state, host.len());
                for side in 0..2 {
                    for &(start, end, s) in &runs {
                        let (_, _, k, v) = kvs[s].layers.get(&state).ok_or_else(|| format!("sequence {s} has no cache for state {state}"))?;
                        host.extend(std::iter::repeat_n(if side == 0 { k.device_ptr() } else { v.device_ptr() }, end - start));
                    }
                }
            }
            let mut t = self.pools.u64.take(dev, host.len().max(1)).map_err(err)?;
            t.upload_prefix(&stream, &host).map_err(err)?;
            tables = Some(t);
        }
        let capture = split_ctx.is_some();
        let kv_id = kvs[runs[0].2].id();
        if capture {
            stream.begin_capture(cusys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).map_err(err)?;
        }
        if let Some(p) = self.profile.as_mut() {
            p.steps[kind] += 1;
        }
        let graph = if decode { &self.model.steps.decode } else { &self.model.steps.prefill };
        let mut step = CudaStep {
            model: self.model,
            graph,
            cm: self.cm,
            store: self.store,
            kvs: &mut *kvs,
            runs: runs.clone(),
            tables: tables.as_ref().map(|t| (t, &table_at)),
            pools: &mut self.pools,
            tokens,
            positions,
            pos_buf: own_pos.as_ref().unwrap_or(&self.dec_pos),
            tok_buf: own_tok.as_ref().unwrap_or(&self.dec_tok),
            split_ctx,
            all_rows: all,
            vals: Vec::new(),
            qcache: Vec::new(),
            free_early: self.release_early,
            ahead: AheadSet::default(),
            add_after: None,
            released_early: Cell::new(false),
            prof: RefCell::new(self.profile.as_mut()),
            kind,
            pending: Vec::new(),
            lane_pending: None,
        };
        let r = self.lowering[kind].run(graph, &mut step);
        let mut captured = None;
        let result = if capture {
            // End the capture whatever happened, then run what it recorded.
            let g = stream.end_capture(cusys::CUgraphInstantiate_flags(0));
            match (r, g) {
                (Ok(v), Ok(Some(graph))) => step.take_output(v).and_then(|(out, rows, cols)| {
                    graph.launch().map_err(err)?;
                    let host = download_rows(&stream, &out, rows, cols)?;
                    captured = Some(DecodeGraph { graph, split_ctx: split_ctx.unwrap_or(0), all_rows: all, kv_id, out, rows, cols });
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
        let early = step.released_early.get();
        drop(step);
        if let Some(p) = own_pos {
            self.pools.u32.give(p);
        }
        if let Some(t) = own_tok {
            self.pools.u32.give(t);
        }
        if let Some(t) = tables {
            self.pools.u64.give(t);
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
                    return self.step(kvs, seqs, tokens, positions, all);
                }
            }
        }
        if early && result.is_err() {
            // A value was read after the graph's last reader of it (an op
            // reads more than its inputs: a bug, but not a wrong result).
            // Keep everything from now on and run the step again (it
            // rewrites the same KV rows).
            self.release_early = false;
            self.graph = None;
            tracing::warn!("a step read a value after its last reader in the graph; step buffers now live to the end of each step");
            return self.step(kvs, seqs, tokens, positions, all);
        }
        self.decoded |= decode && result.is_ok();
        self.check_reserve();
        result
    }
}

/// Row ranges `[start, end)` of one sequence each, with its cache index.
fn seq_runs(seqs: Option<&[u32]>, rows: usize, n_kv: usize) -> R<Vec<(usize, usize, usize)>> {
    let Some(seqs) = seqs else {
        return if n_kv == 0 { Err("a step without a cache".into()) } else { Ok(vec![(0, rows, 0)]) };
    };
    if seqs.len() != rows {
        return Err(format!("{rows} rows for {} sequence ids", seqs.len()));
    }
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    let mut start = 0;
    while start < rows {
        let s = seqs[start] as usize;
        if s >= n_kv {
            return Err(format!("sequence {s} has no cache ({n_kv} in the step)"));
        }
        if runs.iter().any(|r| r.2 == s) {
            return Err(format!("the rows of sequence {s} are not contiguous"));
        }
        let end = (start..rows).find(|&i| seqs[i] as usize != s).unwrap_or(rows);
        runs.push((start, end, s));
        start = end;
    }
    if runs.is_empty() {
        return Err("an empty step".into());
    }
    Ok(runs)
}

impl<'m> CudaEngine<'m> {
    pub fn new(model: &'m Model, cm: &'m CudaModel, n_ctx: usize) -> Result<CudaEngine<'m>, CudaBackendError> {
        Ok(CudaEngine { kv: CudaKv::new(&cm.dev, model, n_ctx)?, n_past: 0, ubatch: 512, history: Vec::new(), run: CudaRunner::new(model, cm)? })
    }

    pub fn model(&self) -> &'m Model {
        self.run.model
    }

    pub fn cm(&self) -> &'m CudaModel {
        self.run.cm
    }

    /// Serve streamed experts through `store` when it has a budgeted host
    /// cache (a mapped store gives the same bytes as the file mapping).
    pub fn with_store(mut self, store: Option<&'m StoreExperts>) -> Self {
        self.run = self.run.with_store(store);
        self
    }

    /// Measure every op's GPU time (steps then run without graphs).
    pub fn with_profile(mut self, on: bool) -> Result<Self, CudaBackendError> {
        self.run.profile = if on { Some(OpProfile::new(&self.run.cm.dev)?) } else { None };
        Ok(self)
    }

    /// The op profile's table, when profiling.
    pub fn profile_report(&self) -> Option<String> {
        self.run.profile.as_ref().map(OpProfile::report)
    }

    pub fn n_ctx(&self) -> usize {
        self.kv.n_ctx
    }

    pub fn reset(&mut self) {
        self.n_past = 0;
        self.history.clear();
    }

    /// Keep the first `n` positions; a recurrent state cannot go back, so a
    /// family with one restarts at 0 (as the CPU engine does).
    pub fn truncate(&mut self, n: usize) {
        let back = n < self.n_past;
        self.n_past = if back && !self.kv.recurrent.is_empty() { 0 } else { self.n_past.min(n) };
        self.history.truncate(self.n_past);
    }

    /// The sequence's recurrent states and position now, copied to the host,
    /// for [`CudaEngine::restore`] (a recurrent state cannot go back without one).
    pub fn snapshot(&self) -> Result<CudaSnapshot, EngineError> {
        self.kv.snapshot(&self.run.cm.dev, self.n_past)
    }

    /// Go back to `snap` (taken from this engine at or before now).
    pub fn restore(&mut self, snap: &CudaSnapshot) -> Result<(), EngineError> {
        if snap.n_past > self.n_past {
            return Err(EngineError::Forward(format!("a snapshot at position {} is ahead of the sequence ({})", snap.n_past, self.n_past)));
        }
        self.kv.restore(&self.run.cm.dev, snap)?;
        self.n_past = snap.n_past;
        self.history.truncate(snap.n_past);
        Ok(())
    }

    /// Device buffers allocated so far (stops growing after the first steps).
    pub fn allocations(&self) -> u64 {
        self.run.allocations()
    }

    /// Device memory the step buffers hold (activations and work space).
    pub fn activation_bytes(&self) -> u64 {
        self.run.activation_bytes()
    }

    pub fn forward(&mut self, tokens: &[u32], all: bool) -> Result<Vec<Vec<f32>>, EngineError> {
        crate::engine::check_room(tokens.len(), self.n_past, self.n_ctx())?;
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(self.ubatch.clamp(1, self.run.cm.max_chunk)).collect();
        let last = chunks.len() - 1;
        for (ci, chunk) in chunks.into_iter().enumerate() {
            let positions: Vec<u32> = (self.n_past..self.n_past + chunk.len()).map(|p| p as u32).collect();
            let rows = self.run.step(std::slice::from_mut(&mut self.kv), None, chunk, &positions, all).map_err(EngineError::Forward)?;
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
}

/// `rows` rows of `cols` values from the device, after the stream's work.
fn download_rows(stream: &std::sync::Arc<cudarc::driver::CudaStream>, buf: &DeviceBuf<f32>, rows: usize, cols: usize) -> R<Vec<Vec<f32>>> {
    let mut host = vec![0f32; rows * cols];
    buf.download(stream, &mut host).map_err(err)?;
    Ok(host.chunks(cols.max(1)).map(|r| r.to_vec()).collect())
}

struct CudaStep<'a> {
    model: &'a Model,
    /// The graph this step runs (the fused MoE op reads the next layer's routing in it).
    graph: &'a crate::graph::StepPlan,
    cm: &'a CudaModel,
    store: Option<&'a StoreExperts>,
    /// The caches of the step's sequences (one, unless batched).
    kvs: &'a mut [CudaKv],
    /// Row ranges `[start, end)` of one sequence each, with its index into `kvs`.
    runs: Vec<(usize, usize, usize)>,
    /// Rows of several sequences: each KV layer's per-row cache addresses
    /// (keys, then values), at their offset by state.
    tables: Option<(&'a DeviceBuf<u64>, &'a HashMap<usize, usize>)>,
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
    vals: Vec<DVal<'a>>,
    /// Quantized activations made this step, by (value, format).
    qcache: Vec<(Val, ActFormat, DeviceBuf<u8>)>,
    /// Values go back to the pools after their last reader in the graph
    /// (else at the step's end).
    free_early: bool,
    /// Outputs computed ahead of their ops by a fused launch.
    ahead: AheadSet,
    /// The value the running MoE op's output is added to next, and whether
    /// it comes first: its combine writes that sum too (fuse.rs).
    add_after: Option<(Val, bool)>,
    /// A released value was asked for (see CudaEngine::release_early).
    released_early: Cell<bool>,
    prof: RefCell<Option<&'a mut OpProfile>>,
    /// 0 decode, 1 prefill (the profile's row kind).
    kind: usize,
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
        for mut v in self.vals.drain(..) {
            if let Some(b) = v.take() {
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
        let buf = d.take().ok_or_else(|| format!("value {} was released before the end of the step (or is a weight)", v.0))?;
        Ok((buf, d.rows, d.cols))
    }

    fn dims(&self, v: Val) -> R<(usize, usize)> {
        self.get(v).map(|d| (d.rows, d.cols))
    }

    fn get(&self, v: Val) -> R<&DVal<'a>> {
        self.vals.get(v.0 as usize).ok_or_else(|| format!("unknown value {}", v.0))
    }

    /// The device buffer of value `v` (an error, never a stale read, if it
    /// was released).
    fn buf(&self, v: Val) -> R<&DeviceBuf<f32>> {
        self.get(v)?.buf().ok_or_else(|| {
            self.released_early.set(true);
            format!("value {} was released before this read (after its last reader in the graph)", v.0)
        })
    }

    /// When profiling: end the timed segment and, with `label`, start one.
    fn mark(&self, label: Option<&dyn Fn() -> String>) {
        if let Some(p) = self.prof.borrow_mut().as_mut() {
            p.mark(self.cm.dev.compute(), self.kind, label.map(|l| l()));
        }
    }

    /// Give back value `v`'s buffer and its quantized copies: nothing
    /// reads it after this (the lowering's liveness).
    fn free(&mut self, v: Val) {
        if !self.free_early {
            return;
        }
        let Some(d) = self.vals.get_mut(v.0 as usize) else { return };
        if let Some(b) = d.take() {
            self.pools.f32.give(b);
        }
        while let Some(i) = self.qcache.iter().position(|(x, _, _)| *x == v) {
            let (_, _, q) = self.qcache.swap_remove(i);
            self.pools.u8.give(q);
        }
    }

    /// An op's result (the end of its profiled segment).
    fn done(&mut self, r: R<Val>) -> R<Val> {
        self.mark(None);
        r
    }

    fn new_val(&mut self, rows: usize, cols: usize) -> R<DeviceBuf<f32>> {
        self.pools.f32.take(&self.cm.dev, rows * cols).map_err(err)
    }

    fn push(&mut self, buf: DeviceBuf<f32>, rows: usize, cols: usize) -> R<Val> {
        self.vals.push(DVal { store: Store::Own(buf), rows, cols });
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
}

#[cfg(test)]
mod tests {
    use super::seq_runs;

    #[test]
    fn rows_split_into_one_run_per_sequence_and_misuse_is_an_error() {
        assert_eq!(seq_runs(None, 5, 1).unwrap(), vec![(0, 5, 0)]);
        assert_eq!(seq_runs(Some(&[2, 2, 0, 1, 1, 1]), 6, 3).unwrap(), vec![(0, 2, 2), (2, 3, 0), (3, 6, 1)]);
        // A sequence's rows split by another's, a missing cache, a count mismatch.
        assert!(seq_runs(Some(&[0, 1, 0]), 3, 2).unwrap_err().contains("not contiguous"));
        assert!(seq_runs(Some(&[0, 3]), 2, 2).unwrap_err().contains("no cache"));
        assert!(seq_runs(Some(&[0]), 2, 2).is_err());
        assert!(seq_runs(None, 1, 0).is_err());
    }
}
