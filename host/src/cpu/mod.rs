//! The CPU backend: runs a family's step graph node by node on N-D f32/i32
//! tensors with the kernels crate. It is the reference every other backend
//! is checked against, and a real path on machines without a GPU.
//!
//! Determinism: every op computes each row with the same code whatever the
//! number of rows, so a prefill of N tokens and N single-token decodes give
//! bit-identical logits.

mod state;
pub mod moe;
pub mod prim;

use pulsar_kernels::ops::{self, Activation, AttnParams};
use pulsar_kernels::{ActFormat, Activations, Kernels, WeightMatrix};
use pulsar_plugin_api::graph::{Act, Attention, Dim, Op, Sizes};
use pulsar_plugin_api::Wt;
use rayon::ThreadPool;
use std::sync::Arc;

use crate::graph::StepPlan;
use crate::model::{Model, Weight};

pub use state::{SeqState, Snapshot};
pub use moe::{ExpertSource, MappedExperts, SlabBytes};
pub use prim::{TData, Tensor};

/// Compute resources of the CPU backend, created once.
pub struct CpuBackend {
    pub kernels: Kernels,
    pub pool: ThreadPool,
}

impl CpuBackend {
    pub fn new(threads: usize) -> anyhow::Result<CpuBackend> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("pulsar-cpu-{i}"))
            .build()?;
        Ok(CpuBackend { kernels: Kernels::detect(), pool })
    }
}

/// A row-major `[rows, cols]` activation.
#[derive(Clone, Debug)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// `x · Wᵀ` for rows of `cols` values (`x.len() / cols` of them), `W` being
/// `wt`'s matrix (one expert's, for a 3-D expert tensor) in `bytes`. Callable
/// from inside the pool: its tasks then join the running job.
pub(crate) fn linear(cpu: &CpuBackend, wt: &Weight, bytes: &[u8], x: &[f32], cols: usize) -> R<Mat> {
    let n_in = n_in_of(wt)?;
    if cols != n_in {
        return Err(format!("linear {}: input width {cols} but weight takes {n_in}", wt.name));
    }
    let acts = Activations::for_weight(wt.ty, x, n_in).map_err(|e| format!("{}: {e}", wt.name))?;
    linear_acts(cpu, wt, bytes, &acts)
}

/// The input width of matrix (or expert stack) `wt`.
fn n_in_of(wt: &Weight) -> R<usize> {
    match wt.dims.as_slice() {
        [i, _] | [i, _, _] => Ok(*i as usize),
        d => Err(format!("{}: not a matrix {d:?}", wt.name)),
    }
}

/// [`linear`] of activations already in the form `wt` dots against (the
/// experts of one MoE layer share them: one quantization, not one per
/// expert and projection).
pub(crate) fn linear_acts(cpu: &CpuBackend, wt: &Weight, bytes: &[u8], acts: &Activations) -> R<Mat> {
    let (n_in, n_out) = match wt.dims.as_slice() {
        [i, o] => (*i as usize, *o as usize),
        [i, o, _] => (*i as usize, *o as usize),
        d => return Err(format!("{}: not a matrix {d:?}", wt.name)),
    };
    if acts.cols() != n_in {
        return Err(format!("linear {}: input width {} but weight takes {n_in}", wt.name, acts.cols()));
    }
    let rows = acts.rows();
    let wm = WeightMatrix::new(wt.ty, bytes, n_out, n_in).map_err(|e| format!("{}: {e}", wt.name))?;
    let mut y = vec![0f32; rows * n_out];
    cpu.kernels.matmul(&cpu.pool, &wm, acts, &mut y).map_err(|e| format!("{}: {e}", wt.name))?;
    Ok(Mat { rows, cols: n_out, data: y })
}

/// Elements from which a gated unit of two same-shaped values runs on the
/// pool, in slices of this many.
const PAR_GLU: usize = 1 << 15;

/// `act(gate) * up` elementwise over the pool (the same function per
/// element as `prim`'s `Glu`, so the same bits), for large same-shaped
/// inputs; `None` leaves the op to `prim`.
fn glu_parallel(gate: &Tensor, up: &Tensor, a: Act) -> Option<R<Tensor>> {
    use rayon::prelude::*;
    if gate.dims != up.dims || gate.dims.iter().product::<usize>() < 2 * PAR_GLU {
        return None;
    }
    let run = || -> R<Tensor> {
        let (mut h, u) = (gate.f()?.to_vec(), up.f()?);
        let act = act_of(a);
        h.par_chunks_mut(PAR_GLU).zip(u.par_chunks(PAR_GLU)).for_each(|(h, u)| ops::glu_rows(h, u, act));
        Ok(Tensor::f32(gate.dims.clone(), h))
    };
    Some(run())
}

/// A named intermediate captured for dumping (`name` op).
#[derive(Clone, Debug)]
pub struct Named {
    pub name: String,
    pub layer: i32,
    pub value: Mat,
}

/// One forward step over `tokens` at `positions`: runs a [`StepPlan`].
///
/// A step may carry rows of several sequences (a batched decode): row `i`
/// belongs to the cache `kvs[seqs[i]]` and sits at `positions[i]` of it. Only
/// attention and `output_rows` look at that; every other op is row-wise, so a
/// row's result does not depend on which other rows share its step.
pub struct CpuStep<'a> {
    pub model: &'a Model,
    pub cpu: &'a CpuBackend,
    /// One KV cache per sequence in the step.
    pub kvs: &'a mut [SeqState],
    /// Per row, its sequence's index into `kvs`; `None`: every row is `kvs[0]`'s.
    pub seqs: Option<&'a [u32]>,
    pub experts: &'a dyn ExpertSource,
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Keep every row at `output_rows` (teacher forcing), else the last only.
    pub all_rows: bool,
    /// Record named intermediates whose name matches (empty = none).
    pub capture: Option<&'a mut Vec<Named>>,
    /// The last matmul input's quantized rows, per format, keyed by its
    /// value: q, k and v (gate and up) read one input, quantized once.
    acts: Option<(u32, Vec<Arc<Activations>>)>,
}

type R<T> = Result<T, String>;

pub(crate) fn act_of(a: Act) -> Activation {
    match a {
        Act::Silu => Activation::Silu,
        Act::GeluTanh => Activation::GeluTanh,
        Act::Gelu => Activation::Gelu,
        Act::SwigluOai => Activation::SwigluOai,
    }
}

impl<'a> CpuStep<'a> {
    pub fn new(
        model: &'a Model,
        cpu: &'a CpuBackend,
        kv: &'a mut SeqState,
        experts: &'a dyn ExpertSource,
        tokens: &'a [u32],
        positions: &'a [u32],
        all_rows: bool,
    ) -> Self {
        let kvs = std::slice::from_mut(kv);
        CpuStep { model, cpu, kvs, seqs: None, experts, tokens, positions, all_rows, capture: None, acts: None }
    }

    /// A step over rows of several sequences: row `i` reads and extends the
    /// cache `kvs[seqs[i]]`. Rows of one sequence must be contiguous and in
    /// position order; without `all_rows`, `output_rows` keeps the last row of
    /// each such run.
    #[allow(clippy::too_many_arguments)]
    pub fn batched(
        model: &'a Model,
        cpu: &'a CpuBackend,
        kvs: &'a mut [SeqState],
        seqs: &'a [u32],
        experts: &'a dyn ExpertSource,
        tokens: &'a [u32],
        positions: &'a [u32],
        all_rows: bool,
    ) -> Self {
        CpuStep { model, cpu, kvs, seqs: Some(seqs), experts, tokens, positions, all_rows, capture: None, acts: None }
    }

    /// Row ranges `[start, end)` that belong to one sequence, with its cache index.
    fn seq_runs(&self, rows: usize) -> R<Vec<(usize, usize, usize)>> {
        let Some(seqs) = self.seqs else {
            return Ok(vec![(0, rows, 0)]);
        };
        if seqs.len() != rows {
            return Err(format!("{rows} rows for {} sequence ids", seqs.len()));
        }
        let mut runs = Vec::new();
        let mut start = 0;
        while start < rows {
            let s = seqs[start];
            let end = (start..rows).find(|&i| seqs[i] != s).unwrap_or(rows);
            runs.push((start, end, s as usize));
            start = end;
        }
        Ok(runs)
    }

    /// Rows `output_rows` keeps.
    fn n_output_rows(&self) -> R<usize> {
        let n = self.tokens.len();
        if self.all_rows || n <= 1 {
            return Ok(n);
        }
        Ok(self.seq_runs(n)?.len())
    }

    /// Run `plan` over this step's tokens; returns the logits `[rows, n_vocab]`.
    /// Each value is dropped after its last reader.
    ///
    /// The whole step runs on one of the pool's threads: the ops between
    /// two matmuls then run on a thread that takes part in the matmuls too,
    /// instead of on a caller that sleeps through each matmul and wakes the
    /// pool for the next (at two threads, a decode step wakes it hundreds
    /// of times).
    pub fn run(&mut self, plan: &StepPlan) -> R<Mat> {
        let pool = &self.cpu.pool;
        pool.install(|| self.run_on_pool(plan))
    }

    fn run_on_pool(&mut self, plan: &StepPlan) -> R<Mat> {
        let t = self.tokens.len();
        // C is defined for a step of one sequence (else 0: ops reading it refuse).
        let c = match self.seq_runs(t)?.as_slice() {
            [_] => self.positions.iter().max().map_or(0, |&p| p as usize + 1),
            _ => 0,
        };
        let sizes = Sizes { t, o: self.n_output_rows()?, c };
        let mut vals: Vec<Option<Tensor>> = vec![None; plan.len()];
        for i in 0..plan.len() {
            let op = &plan.ops[i];
            let at = |e: String| {
                let (label, layer) = &plan.labels[i];
                let place = if *layer >= 0 { format!(" at layer {layer}") } else { String::new() };
                let label = if label.is_empty() { String::new() } else { format!(" {label:?}") };
                format!("node {i} ({}{place}{label}): {e}", op.name())
            };
            let ins: Vec<&Tensor> = plan.inputs[i]
                .iter()
                .map(|&v| vals[v as usize].as_ref().ok_or_else(|| at(format!("value {v} was dropped before this read"))))
                .collect::<R<_>>()?;
            if sizes.c == 0 && plan.shapes[i].dims.contains(&Dim::C) {
                return Err(at("reads a sequence's whole cache in a step of several sequences".into()));
            }
            let want = plan.shapes[i].at(&sizes);
            let y = self.eval(plan, i, op, &ins, &want).map_err(at)?;
            if y.dims != want {
                return Err(at(format!("made {:?}, the graph says {want:?}", y.dims)));
            }
            if let Some(c) = self.capture.as_deref_mut() {
                let (label, layer) = &plan.labels[i];
                if !label.is_empty() {
                    if let Ok(d) = y.f() {
                        let (rows, cols) = y.rows_cols();
                        c.push(Named { name: label.clone(), layer: *layer, value: Mat { rows, cols, data: d.to_vec() } });
                    }
                }
            }
            vals[i] = Some(y);
            for &v in &plan.inputs[i] {
                if plan.last_use[v as usize] == i {
                    vals[v as usize] = None;
                }
            }
            if plan.last_use[i] == i {
                vals[i] = None;
            }
        }
        let out = vals[plan.output as usize].take().ok_or("the output was dropped")?;
        let (rows, cols) = out.rows_cols();
        Ok(Mat { rows, cols, data: out.into_f32()? })
    }

    fn eval(&mut self, plan: &StepPlan, node: usize, op: &Op, ins: &[&Tensor], want: &[usize]) -> R<Tensor> {
        let weight = |w: Wt| self.weight_f32(w);
        let cx = prim::PrimCx { tokens: self.tokens, positions: self.positions, weight: &weight };
        if let Op::Glu(a) = op {
            if let Some(t) = glu_parallel(ins[0], ins[1], *a) {
                return t;
            }
        }
        if let Some(r) = prim::eval(op, ins, want, &cx) {
            return r;
        }
        Ok(match op {
            Op::Embed { table, scale } => self.embed(*table, *scale, ins[0], want)?,
            Op::Linear(w) => {
                let wt = self.weight(*w)?;
                let acts = self.acts_of(plan.inputs[node][0], wt, ins[0])?;
                let y = linear_acts(self.cpu, wt, self.model.data(wt), &acts)?;
                Tensor::f32(want.to_vec(), y.data)
            }
            Op::OutputRows => self.output_rows(ins[0], want)?,
            Op::Attention(a) => {
                let d = self.attention(ins[0], ins[1], ins[2], a, &plan.shapes[plan.inputs[node][0] as usize])?;
                Tensor::f32(want.to_vec(), d)
            }
            Op::Experts(e) => {
                let y = moe::run_experts(self, plan, ins[0], ins[1], ins[2], e)?;
                Tensor::f32(want.to_vec(), y.data)
            }
            Op::StateRows { state } => Tensor::f32(want.to_vec(), self.state_rows(*state as usize, ins[0], want[0])?),
            Op::Scan { state } => Tensor::f32(want.to_vec(), self.scan(*state as usize, ins[0], ins[1])?),
            Op::ShortConv { state, weight } => Tensor::f32(want.to_vec(), self.short_conv(*state as usize, *weight, ins[0])?),
            Op::DeltaNet { state, scale } => Tensor::f32(want.to_vec(), self.delta_net(*state as usize, *scale, ins)?),
            other => return Err(format!("{} has no CPU implementation", other.name())),
        })
    }

    /// Append the step's rows to a rows state; the first `c` rows after.
    fn state_rows(&mut self, state: usize, x: &Tensor, c: usize) -> R<Vec<f32>> {
        let (n, w) = x.rows_cols();
        let d = x.f()?;
        let seq = self.seq_runs(n)?.first().map_or(0, |r| r.2);
        let rows = self.kvs[seq].rows_mut(state)?;
        for i in 0..n {
            rows.write(self.positions[i] as usize, &d[i * w..(i + 1) * w])?;
        }
        Ok(rows.rows(c).to_vec())
    }

    /// Run `f` over each sequence run `[start, end)` of the step's `n` rows
    /// with that sequence's recurrent state `state` (zero at position 0; at
    /// any other start it must hold exactly the tokens before the run); the
    /// state then counts the run's tokens.
    fn each_recurrent_run(&mut self, state: usize, n: usize, mut f: impl FnMut(&mut [f32], usize, usize)) -> R<()> {
        for (start, end, seq) in self.seq_runs(n)? {
            let first = self.positions[start] as usize;
            let r = self.kvs[seq].recurrent_mut(state)?;
            if first == 0 {
                r.value.iter_mut().for_each(|v| *v = 0.0);
            } else if r.pos != first {
                return Err(format!("recurrent state {state} holds {} tokens but the step starts at position {first} (restore a snapshot)", r.pos));
            }
            f(&mut r.value, start, end);
            r.pos = self.positions[end - 1] as usize + 1;
        }
        Ok(())
    }

    /// `S_t = a_t * S_{t-1} + b_t` per sequence run, from the sequence's
    /// state, which keeps the run's last `S_t`.
    fn scan(&mut self, state: usize, a: &Tensor, b: &Tensor) -> R<Vec<f32>> {
        let (n, w) = a.rows_cols();
        let (da, db) = (a.f()?, b.f()?);
        let mut out = vec![0f32; n * w];
        self.each_recurrent_run(state, n, |s, start, end| {
            let rows = start * w..end * w;
            out[rows.clone()].copy_from_slice(&prim::scan_rows(s, &da[rows.clone()], &db[rows]));
        })?;
        Ok(out)
    }

    /// The short conv of each sequence run over its conv window.
    fn short_conv(&mut self, state: usize, weight: Wt, x: &Tensor) -> R<Vec<f32>> {
        let (n, c) = x.rows_cols();
        let w = self.weight_f32(weight)?;
        let k = w.len() / c.max(1);
        let dx = x.f()?;
        let mut out = vec![0f32; n * c];
        self.each_recurrent_run(state, n, |win, start, end| {
            let y = prim::short_conv_rows(win, &w, &dx[start * c..end * c], k, c);
            out[start * c..end * c].copy_from_slice(&y);
        })?;
        Ok(out)
    }

    /// The gated delta rule of each sequence run on its state.
    fn delta_net(&mut self, state: usize, scale: f32, ins: &[&Tensor]) -> R<Vec<f32>> {
        let (q, k, v, g, b) = (ins[0].f()?, ins[1].f()?, ins[2].f()?, ins[3].f()?, ins[4].f()?);
        let d = prim::DeltaDims { hk: ins[0].dims[1], hv: ins[2].dims[1], dk: ins[0].dims[2], dv: ins[2].dims[2] };
        let n = ins[0].dims[0];
        let (qk, vw) = (d.hk * d.dk, d.hv * d.dv);
        let mut out = vec![0f32; n * vw];
        let pool = &self.cpu.pool;
        self.each_recurrent_run(state, n, |s, a, e| {
            let o = prim::delta_net_rows(s, d, scale, &q[a * qk..e * qk], &k[a * qk..e * qk], &v[a * vw..e * vw], &g[a * d.hv..e * d.hv], &b[a * d.hv..e * d.hv], Some(pool));
            out[a * vw..e * vw].copy_from_slice(&o);
        })?;
        Ok(out)
    }

    fn weight(&self, w: Wt) -> R<&'a Weight> {
        self.model.weights.get(w.0 as usize).ok_or_else(|| format!("undeclared weight {}", w.0))
    }

    /// A weight as f32 values (norm weights, small vectors).
    fn weight_f32(&self, w: Wt) -> R<Vec<f32>> {
        let wt = self.weight(w)?;
        let n = wt.dims.iter().product::<u64>() as usize;
        let mut out = vec![0f32; n];
        pulsar_kernels::dequantize(wt.ty, self.model.data(wt), &mut out).map_err(|e| format!("{}: {e}", wt.name))?;
        Ok(out)
    }

    /// `x · Wᵀ` for rows of `cols` values (`x.len() / cols` of them).
    fn matmul(&self, wt: &Weight, bytes: &[u8], x: &[f32], cols: usize) -> R<Mat> {
        linear(self.cpu, wt, bytes, x, cols)
    }

    /// Value `v` (`x`) as the activations `wt` dots against, quantized once
    /// per format for the matmuls that read it one after another.
    fn acts_of(&mut self, v: u32, wt: &Weight, x: &Tensor) -> R<Arc<Activations>> {
        let fmt = ActFormat::for_weight(wt.ty).ok_or_else(|| format!("{}: no dot for {}", wt.name, wt.ty.name()))?;
        if let Some((at, sets)) = &self.acts {
            if let Some(a) = sets.iter().find(|a| *at == v && a.format() == fmt) {
                return Ok(a.clone());
            }
        }
        let cols = *x.dims.last().unwrap_or(&0);
        let n_in = n_in_of(wt)?;
        if cols != n_in {
            return Err(format!("linear {}: input width {cols} but weight takes {n_in}", wt.name));
        }
        let a = Arc::new(Activations::quantize(fmt, x.f()?, cols).map_err(|e| format!("{}: {e}", wt.name))?);
        match &mut self.acts {
            Some((at, sets)) if *at == v => sets.push(a.clone()),
            slot => *slot = Some((v, vec![a.clone()])),
        }
        Ok(a)
    }

    fn embed(&self, table: Wt, scale: f32, ids: &Tensor, want: &[usize]) -> R<Tensor> {
        let wt = self.weight(table)?;
        let (n_embd, n_vocab) = match wt.dims.as_slice() {
            [e, v] => (*e as usize, *v as usize),
            d => return Err(format!("{}: not a matrix {d:?}", wt.name)),
        };
        let bytes = self.model.data(wt);
        let row_bytes = bytes.len() / n_vocab;
        let ids = ids.ids()?;
        let mut data = vec![0f32; ids.len() * n_embd];
        for (i, &t) in ids.iter().enumerate() {
            let t = usize::try_from(t).ok().filter(|&t| t < n_vocab).ok_or_else(|| format!("token id {t} is outside the vocabulary of {n_vocab}"))?;
            let row = &bytes[t * row_bytes..(t + 1) * row_bytes];
            let out = &mut data[i * n_embd..(i + 1) * n_embd];
            pulsar_kernels::dequantize(wt.ty, row, out).map_err(|e| format!("{}: {e}", wt.name))?;
            if scale != 1.0 {
                out.iter_mut().for_each(|v| *v *= scale);
            }
        }
        Ok(Tensor::f32(want.to_vec(), data))
    }

    fn output_rows(&self, x: &Tensor, want: &[usize]) -> R<Tensor> {
        let (rows, cols) = x.rows_cols();
        if want[0] == rows {
            return Ok(x.clone());
        }
        // The last row of each sequence's run (of the only one, unbatched).
        let d = x.f()?;
        let mut data = Vec::with_capacity(want[0] * cols);
        for &(_, end, _) in &self.seq_runs(rows)? {
            data.extend_from_slice(&d[(end - 1) * cols..end * cols]);
        }
        Ok(Tensor::f32(want.to_vec(), data))
    }

    /// Attention over the KV state `a.state` (q `[T, H, Dk]`); k and v are
    /// appended at the step's positions first.
    fn attention(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, a: &Attention, q_shape: &pulsar_plugin_api::graph::Shape) -> R<Vec<f32>> {
        let dim = |i: usize| q_shape.dims[i].fixed().unwrap_or(0) as usize;
        let (nh, dk) = (dim(1), dim(2));
        let (nkv, dv) = (k.dims[1], v.dims[2]);
        let (mq, mk, mv) = (q.f()?, k.f()?, v.f()?);
        let n = q.dims[0];
        if n != self.positions.len() {
            return Err(format!("{n} rows for {} positions", self.positions.len()));
        }
        if let Some(seqs) = self.seqs {
            if let Some(&bad) = seqs.iter().find(|&&q| q as usize >= self.kvs.len()) {
                return Err(format!("sequence {bad} has no cache ({} in the step)", self.kvs.len()));
            }
        }
        let st = a.state as usize;
        let (kw, vw) = (nkv * dk, nkv * dv);
        let runs = self.seq_runs(n)?;
        // Every row's key and value go to its own sequence's cache first, so a
        // row attends to the rows before it in the same step.
        for &(start, end, seq) in &runs {
            let layer = self.kvs[seq].layer_mut(st, kw, vw)?;
            for i in start..end {
                layer.write(self.positions[i] as usize, &mk[i * kw..(i + 1) * kw], &mv[i * vw..(i + 1) * vw])?;
            }
        }
        let params = AttnParams { n_head: nh, n_kv_head: nkv, head_dim_k: dk, head_dim_v: dv, scale: a.scale, window: a.window as usize, softcap: a.softcap };
        let mut out = vec![0f32; n * nh * dv];
        for &(start, end, seq) in &runs {
            let positions = &self.positions[start..end];
            let n_ctx = positions.iter().max().map_or(0, |&p| p as usize + 1);
            let layer = self.kvs[seq].layer(st)?;
            ops::attend_rows(
                &self.cpu.pool,
                &params,
                &mq[start * nh * dk..end * nh * dk],
                positions,
                layer.keys(n_ctx),
                layer.values(n_ctx),
                &mut out[start * nh * dv..end * nh * dv],
            );
        }
        Ok(out)
    }
}
