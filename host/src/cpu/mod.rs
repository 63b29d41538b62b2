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
pub struct CpuStep<'a> {
    pub model: &'a Model,
    pub cpu: &'a CpuBackend,
    pub kv: &'a mut KvCache,
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
        CpuStep { model, cpu, kv, experts, tokens, positions, all_rows, capture: None, vals: Vec::new() }
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
        let (k_rows, v_rows) = (mk.data.clone(), mv.data.clone());
        let layer = self.kv.layer_mut(s.layer as usize, nkv * dk, nkv * dv)?;
        for (i, &p) in self.positions.iter().enumerate() {
            layer.write(p as usize, &k_rows[i * nkv * dk..(i + 1) * nkv * dk], &v_rows[i * nkv * dv..(i + 1) * nkv * dv])?;
        }
        let n_ctx = self.positions.iter().max().map_or(0, |&p| p as usize + 1);
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
        let layer = self.kv.layer(s.layer as usize)?;
        ops::attend_rows(&self.cpu.pool, &params, &mq.data, self.positions, layer.keys(n_ctx), layer.values(n_ctx), &mut out);
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
            let last = m.data[(m.rows - 1) * m.cols..].to_vec();
            let cols = m.cols;
            self.push(Mat { rows: 1, cols, data: last })
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
