//! An in-process fake host for plugin tests: a model view built from a list of
//! keys and tensor shapes, and an ops recorder that checks shapes symbolically
//! and records every call, so a family's graph can be tested without weights,
//! a backend or a shared library.

use std::collections::BTreeMap;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RStr, RString, RVec},
};

use crate::abi::*;

/// A model made of metadata and tensor shapes only.
#[derive(Debug, Clone, Default)]
pub struct FakeModel {
    pub meta: BTreeMap<String, MetaValue>,
    pub tensors: BTreeMap<String, TensorDesc>,
}

impl FakeModel {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn kv(mut self, key: &str, v: MetaValue) -> Self {
        self.meta.insert(key.to_string(), v);
        self
    }
    pub fn u(self, key: &str, v: u64) -> Self {
        self.kv(key, MetaValue::U64(v))
    }
    pub fn f(self, key: &str, v: f64) -> Self {
        self.kv(key, MetaValue::F64(v))
    }
    pub fn s(self, key: &str, v: &str) -> Self {
        self.kv(key, MetaValue::Str(v.into()))
    }
    /// Add an f32 tensor with ggml-order dims.
    pub fn t(mut self, name: &str, dims: &[u64]) -> Self {
        let bytes = dims.iter().product::<u64>() * 4;
        self.tensors.insert(name.to_string(), TensorDesc { name: name.into(), dims: dims.iter().copied().collect(), dtype: 0, bytes });
        self
    }
    pub fn without_tensor(mut self, name: &str) -> Self {
        self.tensors.remove(name);
        self
    }
    pub fn without_key(mut self, key: &str) -> Self {
        self.meta.remove(key);
        self
    }
    pub fn view(&self) -> ModelViewRef<'_> {
        ModelView_TO::from_ptr(self, TD_Opaque)
    }
}

impl ModelView for FakeModel {
    fn meta(&self, key: RStr<'_>) -> ROption<MetaValue> {
        self.meta.get(key.as_str()).cloned().into()
    }
    fn meta_keys(&self) -> RVec<RString> {
        self.meta.keys().map(|k| RString::from(k.as_str())).collect()
    }
    fn tensor(&self, name: RStr<'_>) -> ROption<TensorDesc> {
        self.tensors.get(name.as_str()).cloned().into()
    }
    fn tensor_names(&self) -> RVec<RString> {
        self.tensors.keys().map(|k| RString::from(k.as_str())).collect()
    }
}

/// Ops that track shapes and record calls instead of computing.
pub struct RecordingOps {
    n_tokens: u32,
    /// Weight dims by `Wt` index (from the plan and the fake model).
    weights: Vec<Vec<u64>>,
    shapes: Vec<(u64, u64)>,
    /// One line per op call, e.g. `linear(blk.0.attn_q.weight) -> [3, 64]`.
    pub calls: Vec<String>,
    names: Vec<String>,
    n_output_rows: u64,
}

impl RecordingOps {
    pub fn new(model: &FakeModel, plan: &ModelPlan, n_tokens: u32) -> Self {
        let weights = plan
            .weights
            .iter()
            .map(|w| model.tensors.get(w.name.as_str()).map(|t| t.dims.to_vec()).unwrap_or_default())
            .collect();
        let names = plan.weights.iter().map(|w| w.name.to_string()).collect();
        RecordingOps { n_tokens, weights, shapes: Vec::new(), calls: Vec::new(), names, n_output_rows: 1 }
    }

    pub fn ops(&mut self) -> OpsRef<'_> {
        Ops_TO::from_ptr(self, TD_Opaque)
    }

    pub fn shape_of(&self, v: Val) -> Option<(u64, u64)> {
        self.shapes.get(v.0 as usize).copied()
    }

    fn push(&mut self, what: String, shape: (u64, u64)) -> OpResult {
        self.calls.push(format!("{what} -> [{}, {}]", shape.0, shape.1));
        self.shapes.push(shape);
        RResult::ROk(Val(self.shapes.len() as u32 - 1))
    }

    fn get(&self, v: Val) -> Result<(u64, u64), RString> {
        self.shape_of(v).ok_or_else(|| RString::from(format!("unknown value {}", v.0)))
    }

    fn wdims(&self, w: Wt) -> Result<&[u64], RString> {
        self.weights.get(w.0 as usize).map(|d| d.as_slice()).ok_or_else(|| RString::from(format!("undeclared weight {}", w.0)))
    }

    fn wname(&self, w: Wt) -> &str {
        self.names.get(w.0 as usize).map(|s| s.as_str()).unwrap_or("?")
    }

    fn same(&mut self, op: &str, a: Val, b: Val) -> OpResult {
        let (sa, sb) = match (self.get(a), self.get(b)) {
            (Ok(x), Ok(y)) => (x, y),
            (Err(e), _) | (_, Err(e)) => return RResult::RErr(e),
        };
        if sa != sb {
            return RResult::RErr(format!("{op}: shapes differ {sa:?} vs {sb:?}").into());
        }
        self.push(op.to_string(), sa)
    }
}

macro_rules! tryr {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return RResult::RErr(e),
        }
    };
}

impl Ops for RecordingOps {
    fn n_tokens(&self) -> u32 {
        self.n_tokens
    }
    fn shape(&self, x: Val) -> RResult<RVec<u64>, RString> {
        let (r, c) = tryr!(self.get(x));
        RResult::ROk(RVec::from(vec![r, c]))
    }
    fn embed(&mut self, table: Wt, _scale: f32) -> OpResult {
        let d = tryr!(self.wdims(table)).to_vec();
        let name = format!("embed({})", self.wname(table));
        self.push(name, (self.n_tokens as u64, d[0]))
    }
    fn linear(&mut self, w: Wt, x: Val) -> OpResult {
        let (r, c) = tryr!(self.get(x));
        let d = tryr!(self.wdims(w)).to_vec();
        if d.len() != 2 || d[0] != c {
            return RResult::RErr(format!("linear({}): weight {:?} does not take width {c}", self.wname(w), d).into());
        }
        let name = format!("linear({})", self.wname(w));
        self.push(name, (r, d[1]))
    }
    fn rms_norm(&mut self, x: Val, w: ROption<Wt>, _eps: f32, group: u32) -> OpResult {
        let (r, c) = tryr!(self.get(x));
        if group == 0 || c % group as u64 != 0 {
            return RResult::RErr(format!("rms_norm: group {group} does not divide width {c}").into());
        }
        if let ROption::RSome(w) = w {
            let d = tryr!(self.wdims(w)).to_vec();
            if d != [group as u64] {
                return RResult::RErr(format!("rms_norm({}): weight {:?} but group {group}", self.wname(w), d).into());
            }
        }
        self.push("rms_norm".into(), (r, c))
    }
    fn add(&mut self, a: Val, b: Val) -> OpResult {
        self.same("add", a, b)
    }
    fn mul(&mut self, a: Val, b: Val) -> OpResult {
        self.same("mul", a, b)
    }
    fn scale(&mut self, x: Val, _s: f32) -> OpResult {
        let s = tryr!(self.get(x));
        self.push("scale".into(), s)
    }
    fn act(&mut self, x: Val, act: Act) -> OpResult {
        let s = tryr!(self.get(x));
        self.push(format!("act({act:?})"), s)
    }
    fn glu(&mut self, gate: Val, up: Val, _act: Act) -> OpResult {
        self.same("glu", gate, up)
    }
    fn rope(&mut self, x: Val, spec: RopeSpec) -> OpResult {
        let (r, c) = tryr!(self.get(x));
        if spec.head_dim == 0 || c % spec.head_dim as u64 != 0 || spec.n_rot > spec.head_dim || spec.n_rot % 2 != 0 {
            return RResult::RErr(format!("rope: bad spec {spec:?} for width {c}").into());
        }
        self.push("rope".into(), (r, c))
    }
    fn attention(&mut self, q: Val, k: Val, v: Val, s: AttnSpec) -> OpResult {
        let (sq, sk, sv) = (tryr!(self.get(q)), tryr!(self.get(k)), tryr!(self.get(v)));
        let ok = sq.1 == (s.n_head * s.head_dim_k) as u64
            && sk.1 == (s.n_kv_head * s.head_dim_k) as u64
            && sv.1 == (s.n_kv_head * s.head_dim_v) as u64
            && s.n_kv_head > 0
            && s.n_head % s.n_kv_head == 0
            && sq.0 == sk.0
            && sk.0 == sv.0;
        if !ok {
            return RResult::RErr(format!("attention: shapes q{sq:?} k{sk:?} v{sv:?} do not fit {s:?}").into());
        }
        self.push(format!("attention(layer {})", s.layer), (sq.0, (s.n_head * s.head_dim_v) as u64))
    }
    fn moe(&mut self, x: Val, s: MoeSpec) -> OpResult {
        let (r, c) = tryr!(self.get(x));
        let router = tryr!(self.wdims(s.router)).to_vec();
        let gate = tryr!(self.wdims(s.gate_exps)).to_vec();
        let down = tryr!(self.wdims(s.down_exps)).to_vec();
        let ok = router == [c, s.n_expert as u64]
            && gate.len() == 3
            && gate[0] == c
            && gate[2] == s.n_expert as u64
            && down == [gate[1], c, s.n_expert as u64]
            && s.top_k >= 1
            && s.top_k <= s.n_expert;
        if !ok {
            return RResult::RErr(format!("moe(layer {}): router {router:?} gate {gate:?} down {down:?} do not fit width {c}", s.layer).into());
        }
        self.push(format!("moe(layer {})", s.layer), (r, c))
    }
    fn output_rows(&mut self, x: Val) -> OpResult {
        let (_, c) = tryr!(self.get(x));
        let n = self.n_output_rows;
        self.push("output_rows".into(), (n, c))
    }
    fn name(&mut self, x: Val, name: RStr<'_>, layer: i32) {
        self.calls.push(format!("name({}, {name}, {layer})", x.0));
    }
}
