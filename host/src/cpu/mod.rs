//! The CPU backend: executes a plugin's ops eagerly on f32 activations with
//! the kernels crate. It is the reference every other backend is checked
//! against, and a real path on machines without a GPU.
//!
//! Determinism: every op computes each row with the same code whatever the
//! number of rows, so a prefill of N tokens and N single-token decodes give
//! bit-identical logits.

mod kv;
pub mod moe;

use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
use pulsar_kernels::ops::{self, Activation, AttnParams, RopeKind, RopeParams};
use pulsar_kernels::{Activations, Kernels, WeightMatrix};
use pulsar_plugin_api::{Act, AttnSpec, MoeSpec, OpResult, Ops, RopeMode, RopeSpec, Val, Wt};
use rayon::ThreadPool;

use crate::model::{Model, Weight};

pub use kv::KvCache;
pub use moe::{ExpertSource, MappedExperts, SlabBytes};

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

/// A named intermediate captured for dumping (`name` op).
#[derive(Clone, Debug)]
pub struct Named {
    pub name: String,
    pub layer: i32,
    pub value: Mat,
}

/// One forward step over `tokens` at `positions`.
///
/// A step may carry rows of several sequences (a batched decode): row `i`
/// belongs to the cache `kvs[seqs[i]]` and sits at `positions[i]` of it. Only
/// attention and `output_rows` look at that; every other op is row-wise, so a
/// row's result does not depend on which other rows share its step.
pub struct CpuStep<'a> {
    pub model: &'a Model,
    pub cpu: &'a CpuBackend,
    /// One KV cache per sequence in the step.
    pub kvs: &'a mut [KvCache],
    /// Per row, its sequence's index into `kvs`; `None`: every row is `kvs[0]`'s.
    pub seqs: Option<&'a [u32]>,
    pub experts: &'a dyn ExpertSource,
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Keep every row at `output_rows` (teacher forcing), else the last only.
    pub all_rows: bool,
    /// Record named intermediates whose name matches (empty = none).
    pub capture: Option<&'a mut Vec<Named>>,
    vals: Vec<Mat>,
}

type R<T> = Result<T, String>;

fn res(r: R<Val>) -> OpResult {
    match r {
        Ok(v) => RResult::ROk(v),
        Err(e) => RResult::RErr(RString::from(e)),
    }
}

pub(crate) fn act_of(a: Act) -> Activation {
    match a {
        Act::Silu => Activation::Silu,
        Act::GeluTanh => Activation::GeluTanh,
        Act::Gelu => Activation::Gelu,
    }
}

impl<'a> CpuStep<'a> {
    pub fn new(
        model: &'a Model,
        cpu: &'a CpuBackend,
        kv: &'a mut KvCache,
        experts: &'a dyn ExpertSource,
        tokens: &'a [u32],
        positions: &'a [u32],
        all_rows: bool,
    ) -> Self {
        let kvs = std::slice::from_mut(kv);
        CpuStep { model, cpu, kvs, seqs: None, experts, tokens, positions, all_rows, capture: None, vals: Vec::new() }
    }

    /// A step over rows of several sequences: row `i` reads and extends the
    /// cache `kvs[seqs[i]]`. Rows of one sequence must be contiguous and in
    /// position order; without `all_rows`, `output_rows` keeps the last row of
    /// each such run.
    #[allow(clippy::too_many_arguments)]
    pub fn batched(
        model: &'a Model,
        cpu: &'a CpuBackend,
        kvs: &'a mut [KvCache],
        seqs: &'a [u32],
        experts: &'a dyn ExpertSource,
        tokens: &'a [u32],
        positions: &'a [u32],
        all_rows: bool,
    ) -> Self {
        CpuStep { model, cpu, kvs, seqs: Some(seqs), experts, tokens, positions, all_rows, capture: None, vals: Vec::new() }
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

    /// The value a handle names, moved out (the step is over).
    pub fn take(&mut self, v: Val) -> R<Mat> {
        let m = self.vals.get_mut(v.0 as usize).ok_or_else(|| format!("unknown value {}", v.0))?;
        Ok(std::mem::replace(m, Mat { rows: 0, cols: 0, data: Vec::new() }))
    }

    fn get(&self, v: Val) -> R<&Mat> {
        self.vals.get(v.0 as usize).ok_or_else(|| format!("unknown value {}", v.0))
    }

    fn push(&mut self, m: Mat) -> R<Val> {
        self.vals.push(m);
        Ok(Val(self.vals.len() as u32 - 1))
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

    fn matmul(&self, wt: &Weight, bytes: &[u8], x: &Mat) -> R<Mat> {
        let (n_in, n_out) = match wt.dims.as_slice() {
            [i, o] => (*i as usize, *o as usize),
            [i, o, _] => (*i as usize, *o as usize),
            d => return Err(format!("{}: not a matrix {d:?}", wt.name)),
        };
        if x.cols != n_in {
            return Err(format!("linear {}: input width {} but weight takes {n_in}", wt.name, x.cols));
        }
        let wm = WeightMatrix::new(wt.ty, bytes, n_out, n_in).map_err(|e| format!("{}: {e}", wt.name))?;
        let acts = Activations::for_weight(wt.ty, &x.data, n_in).map_err(|e| format!("{}: {e}", wt.name))?;
        let mut y = vec![0f32; x.rows * n_out];
        self.cpu.kernels.matmul(&self.cpu.pool, &wm, &acts, &mut y).map_err(|e| format!("{}: {e}", wt.name))?;
        Ok(Mat { rows: x.rows, cols: n_out, data: y })
    }

    fn binary(&mut self, a: Val, b: Val, what: &str, f: impl Fn(f32, f32) -> f32) -> R<Val> {
        let (ma, mb) = (self.get(a)?, self.get(b)?);
        if (ma.rows, ma.cols) != (mb.rows, mb.cols) {
            return Err(format!("{what}: shapes [{}, {}] and [{}, {}] differ", ma.rows, ma.cols, mb.rows, mb.cols));
        }
        let data = ma.data.iter().zip(&mb.data).map(|(&x, &y)| f(x, y)).collect();
        let m = Mat { rows: ma.rows, cols: ma.cols, data };
        self.push(m)
    }

    fn do_embed(&mut self, table: Wt, scale: f32) -> R<Val> {
        let wt = self.weight(table)?;
        let (n_embd, n_vocab) = match wt.dims.as_slice() {
            [e, v] => (*e as usize, *v as usize),
            d => return Err(format!("{}: not a matrix {d:?}", wt.name)),
        };
        let bytes = self.model.data(wt);
        let row_bytes = bytes.len() / n_vocab;
        let mut data = vec![0f32; self.tokens.len() * n_embd];
        for (i, &t) in self.tokens.iter().enumerate() {
            if t as usize >= n_vocab {
                return Err(format!("token id {t} is outside the vocabulary of {n_vocab}"));
            }
            let row = &bytes[t as usize * row_bytes..(t as usize + 1) * row_bytes];
            let out = &mut data[i * n_embd..(i + 1) * n_embd];
            pulsar_kernels::dequantize(wt.ty, row, out).map_err(|e| format!("{}: {e}", wt.name))?;
            if scale != 1.0 {
                out.iter_mut().for_each(|v| *v *= scale);
            }
        }
        self.push(Mat { rows: self.tokens.len(), cols: n_embd, data })
    }

    fn do_attention(&mut self, q: Val, k: Val, v: Val, s: AttnSpec) -> R<Val> {
        let (mq, mk, mv) = (self.get(q)?, self.get(k)?, self.get(v)?);
        let (nh, nkv, dk, dv) = (s.n_head as usize, s.n_kv_head as usize, s.head_dim_k as usize, s.head_dim_v as usize);
        if mq.cols != nh * dk || mk.cols != nkv * dk || mv.cols != nkv * dv || mq.rows != mk.rows || mk.rows != mv.rows {
            return Err(format!("attention layer {}: q/k/v shapes do not match the spec", s.layer));
        }
        if mq.rows != self.positions.len() {
            return Err(format!("attention layer {}: {} rows for {} positions", s.layer, mq.rows, self.positions.len()));
        }
        if let Some(seqs) = self.seqs {
            if let Some(&bad) = seqs.iter().find(|&&q| q as usize >= self.kvs.len()) {
                return Err(format!("attention layer {}: sequence {bad} has no cache ({} in the step)", s.layer, self.kvs.len()));
            }
        }
        let (kw, vw) = (nkv * dk, nkv * dv);
        let (k_rows, v_rows) = (mk.data.clone(), mv.data.clone());
        let runs = self.seq_runs(mq.rows).map_err(|e| format!("attention layer {}: {e}", s.layer))?;
        // Every row's key and value go to its own sequence's cache first, so a
        // row attends to the rows before it in the same step.
        for &(start, end, seq) in &runs {
            let layer = self.kvs[seq].layer_mut(s.layer as usize, kw, vw)?;
            for i in start..end {
                layer.write(self.positions[i] as usize, &k_rows[i * kw..(i + 1) * kw], &v_rows[i * vw..(i + 1) * vw])?;
            }
        }
        let params = AttnParams {
            n_head: nh,
            n_kv_head: nkv,
            head_dim_k: dk,
            head_dim_v: dv,
            scale: s.scale,
            window: s.window as usize,
            softcap: s.softcap,
        };
        let mq = self.get(q)?;
        let mut out = vec![0f32; mq.rows * nh * dv];
        for &(start, end, seq) in &runs {
            let positions = &self.positions[start..end];
            let n_ctx = positions.iter().max().map_or(0, |&p| p as usize + 1);
            let layer = self.kvs[seq].layer(s.layer as usize)?;
            ops::attend_rows(
                &self.cpu.pool,
                &params,
                &mq.data[start * nh * dk..end * nh * dk],
                positions,
                layer.keys(n_ctx),
                layer.values(n_ctx),
                &mut out[start * nh * dv..end * nh * dv],
            );
        }
        let rows = mq.rows;
        self.push(Mat { rows, cols: nh * dv, data: out })
    }
}

impl Ops for CpuStep<'_> {
    fn n_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }
    fn shape(&self, x: Val) -> RResult<RVec<u64>, RString> {
        match self.get(x) {
            Ok(m) => RResult::ROk(RVec::from(vec![m.rows as u64, m.cols as u64])),
            Err(e) => RResult::RErr(e.into()),
        }
    }
    fn embed(&mut self, table: Wt, scale: f32) -> OpResult {
        res(self.do_embed(table, scale))
    }
    fn linear(&mut self, w: Wt, x: Val) -> OpResult {
        res((|| {
            let wt = self.weight(w)?;
            let y = self.matmul(wt, self.model.data(wt), self.get(x)?)?;
            self.push(y)
        })())
    }
    fn rms_norm(&mut self, x: Val, w: ROption<Wt>, eps: f32, group: u32) -> OpResult {
        res((|| {
            let weight = match w {
                ROption::RSome(w) => Some(self.weight_f32(w)?),
                ROption::RNone => None,
            };
            let mut m = self.get(x)?.clone();
            let g = group as usize;
            if g == 0 || m.cols % g != 0 || weight.as_ref().is_some_and(|w| w.len() != g) {
                return Err(format!("rms_norm: group {g} does not fit width {}", m.cols));
            }
            ops::rms_norm_rows(&mut m.data, g, weight.as_deref(), eps);
            self.push(m)
        })())
    }
    fn add(&mut self, a: Val, b: Val) -> OpResult {
        res(self.binary(a, b, "add", |x, y| x + y))
    }
    fn mul(&mut self, a: Val, b: Val) -> OpResult {
        res(self.binary(a, b, "mul", |x, y| x * y))
    }
    fn scale(&mut self, x: Val, s: f32) -> OpResult {
        res((|| {
            let mut m = self.get(x)?.clone();
            m.data.iter_mut().for_each(|v| *v *= s);
            self.push(m)
        })())
    }
    fn act(&mut self, x: Val, act: Act) -> OpResult {
        res((|| {
            let mut m = self.get(x)?.clone();
            let a = act_of(act);
            m.data.iter_mut().for_each(|v| *v = a.apply(*v));
            self.push(m)
        })())
    }
    fn glu(&mut self, gate: Val, up: Val, act: Act) -> OpResult {
        let a = act_of(act);
        res(self.binary(gate, up, "glu", move |g, u| a.apply(g) * u))
    }
    fn rope(&mut self, x: Val, spec: RopeSpec) -> OpResult {
        res((|| {
            let mut m = self.get(x)?.clone();
            let (hd, nr) = (spec.head_dim as usize, spec.n_rot as usize);
            if hd == 0 || m.cols % hd != 0 || nr > hd || nr % 2 != 0 || m.rows != self.positions.len() {
                return Err(format!("rope: spec {spec:?} does not fit [{}, {}]", m.rows, m.cols));
            }
            let kind = match spec.mode {
                RopeMode::Neox => RopeKind::Neox,
                RopeMode::Interleaved => RopeKind::Interleaved,
            };
            let p = RopeParams { head_dim: hd, n_rot: nr, base: spec.base, linear_factor: spec.linear_factor, kind };
            ops::rope_rows(&mut m.data, m.cols, self.positions, p);
            self.push(m)
        })())
    }
    fn attention(&mut self, q: Val, k: Val, v: Val, spec: AttnSpec) -> OpResult {
        res(self.do_attention(q, k, v, spec))
    }
    fn moe(&mut self, x: Val, spec: MoeSpec) -> OpResult {
        res((|| {
            let y = moe::run(self, x, &spec)?;
            self.push(y)
        })())
    }
    fn output_rows(&mut self, x: Val) -> OpResult {
        res((|| {
            let m = self.get(x)?;
            if self.all_rows || m.rows <= 1 {
                let m = m.clone();
                return self.push(m);
            }
            // The last row of each sequence's run (of the only one, unbatched).
            let (rows, cols) = (m.rows, m.cols);
            let mut data = Vec::new();
            let runs = self.seq_runs(rows).map_err(|e| format!("output_rows: {e}"))?;
            let m = self.get(x)?;
            for &(_, end, _) in &runs {
                data.extend_from_slice(&m.data[(end - 1) * cols..end * cols]);
            }
            self.push(Mat { rows: runs.len(), cols, data })
        })())
    }
    fn name(&mut self, x: Val, name: RStr<'_>, layer: i32) {
        if self.capture.is_some() {
            if let Ok(m) = self.get(x).cloned() {
                if let Some(c) = self.capture.as_deref_mut() {
                    c.push(Named { name: name.to_string(), layer, value: m });
                }
            }
        }
    }
}
