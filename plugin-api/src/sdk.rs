//! The SDK a family is written with: implement [`FamilyPlugin`] (two required
//! methods, `open` and `forward`) and call [`export_plugin!`](crate::export_plugin).
//! Everything FFI — catching panics, converting errors to one line, building the
//! plan — happens here, so a family crate is its forward code and nothing else.

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RBox, RResult, RStr, RString, RVec},
};

use crate::abi::*;
use crate::graph::{infer, Act, Attention, Binary, Dim, Experts, Op, Reduce, Rope, Shape, ShapeCx, Unary};

/// Errors a plugin reports. Each names the key, tensor or feature at fault.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum PluginError {
    #[error("missing metadata key `{0}`")]
    MissingKey(String),
    #[error("metadata key `{key}`: expected {expected}, found {found}")]
    WrongType { key: String, expected: &'static str, found: String },
    #[error("metadata key `{key}`: {why}")]
    BadValue { key: String, why: String },
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    BadShape { name: String, expected: Vec<u64>, found: Vec<u64> },
    #[error("unsupported configuration: {0}")]
    Unsupported(String),
    /// An op failed inside the host.
    #[error("{0}")]
    Op(String),
}

/// A model family. `open` parses and validates the configuration and declares
/// the weights; `forward` builds one step from host ops.
pub trait FamilyPlugin: Sized + Send + Sync + 'static {
    /// Parse the configuration once. A missing or inconsistent key is an error
    /// naming it; unsupported configurations fail here, not in `forward`.
    fn open(cx: &mut OpenCx<'_>) -> Result<Self, PluginError>;

    /// Record the step graph for `g.kind()`; returns the logits (`[O, n_vocab]`).
    /// Called once per step kind: the graph serves every step of that kind.
    fn forward(&self, g: &mut Graph<'_>) -> Result<Val, PluginError>;

    /// Chat template fallback, stop and thinking markers.
    fn chat(&self) -> ChatSpec {
        ChatSpec::default()
    }
}

/// What a plugin sees while opening: metadata, the tensor directory, and the
/// plan it is filling in.
pub struct OpenCx<'a> {
    arch: String,
    model: ModelViewRef<'a>,
    plan: ModelPlan,
    /// ggml dims of each declared weight (what graph shape rules read).
    dims: Vec<Vec<u64>>,
}

impl<'a> OpenCx<'a> {
    pub fn new(arch: &str, model: ModelViewRef<'a>) -> Self {
        OpenCx { arch: arch.to_string(), model, plan: ModelPlan::default(), dims: Vec::new() }
    }

    /// The `general.architecture` being opened.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// `"{arch}.{suffix}"`, the usual per-family key.
    pub fn key(&self, suffix: &str) -> String {
        format!("{}.{}", self.arch, suffix)
    }

    pub fn meta(&self, key: &str) -> Option<MetaValue> {
        self.model.meta(RStr::from_str(key)).into_option()
    }

    fn require(&self, key: &str) -> Result<MetaValue, PluginError> {
        self.meta(key).ok_or_else(|| PluginError::MissingKey(key.to_string()))
    }

    /// An unsigned integer that fits in u32.
    pub fn u32(&self, key: &str) -> Result<u32, PluginError> {
        let v = self.require(key)?;
        let n = as_u64(&v).ok_or_else(|| wrong(key, "an unsigned integer", &v))?;
        u32::try_from(n).map_err(|_| PluginError::BadValue { key: key.into(), why: format!("{n} does not fit in 32 bits") })
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, PluginError> {
        match self.meta(key) {
            None => Ok(None),
            Some(_) => self.u32(key).map(Some),
        }
    }

    pub fn f32(&self, key: &str) -> Result<f32, PluginError> {
        let v = self.require(key)?;
        match v {
            MetaValue::F64(x) => Ok(x as f32),
            MetaValue::U64(x) => Ok(x as f32),
            MetaValue::I64(x) => Ok(x as f32),
            other => Err(wrong(key, "a number", &other)),
        }
    }

    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, PluginError> {
        match self.meta(key) {
            None => Ok(None),
            Some(_) => self.f32(key).map(Some),
        }
    }

    pub fn bool(&self, key: &str) -> Result<bool, PluginError> {
        match self.require(key)? {
            MetaValue::Bool(b) => Ok(b),
            other => Err(wrong(key, "a bool", &other)),
        }
    }

    pub fn string(&self, key: &str) -> Result<String, PluginError> {
        match self.require(key)? {
            MetaValue::Str(s) => Ok(s.into_string()),
            other => Err(wrong(key, "a string", &other)),
        }
    }

    /// A per-layer u32 that may be stored as one scalar or as an array of
    /// `n_layers` values (llama.cpp writes both forms, e.g. `head_count_kv`).
    pub fn u32_per_layer(&self, key: &str, n_layers: u32) -> Result<Vec<u32>, PluginError> {
        let v = self.require(key)?;
        let vals: Vec<u64> = match &v {
            MetaValue::U64s(a) => a.to_vec(),
            MetaValue::I64s(a) if a.iter().all(|&x| x >= 0) => a.iter().map(|&x| x as u64).collect(),
            other => match as_u64(other) {
                Some(n) => vec![n; n_layers as usize],
                None => return Err(wrong(key, "an unsigned integer or array of them", other)),
            },
        };
        if vals.len() != n_layers as usize {
            return Err(PluginError::BadValue { key: key.into(), why: format!("has {} entries for {} layers", vals.len(), n_layers) });
        }
        vals.into_iter()
            .map(|n| u32::try_from(n).map_err(|_| PluginError::BadValue { key: key.into(), why: format!("{n} does not fit in 32 bits") }))
            .collect()
    }

    /// `{arch}.attention.head_count` and `.head_count_kv`, checked for grouped
    /// attention (the KV heads divide the query heads).
    pub fn gqa_heads(&self) -> Result<(u32, u32), PluginError> {
        let n_head = self.u32(&self.key("attention.head_count"))?;
        let n_kv = self.u32(&self.key("attention.head_count_kv"))?;
        if n_kv == 0 || n_head % n_kv != 0 {
            return Err(PluginError::BadValue {
                key: self.key("attention.head_count_kv"),
                why: format!("{n_kv} does not divide head_count {n_head}"),
            });
        }
        Ok((n_head, n_kv))
    }

    /// The vocabulary size: the second dimension of the embedding table.
    pub fn n_vocab(&self, embedding: &str) -> Result<u32, PluginError> {
        let t = self.tensor(embedding).ok_or_else(|| PluginError::MissingTensor(embedding.to_string()))?;
        match t.dims.as_slice() {
            [_, v] => u32::try_from(*v).map_err(|_| PluginError::BadShape { name: embedding.into(), expected: vec![], found: t.dims.to_vec() }),
            d => Err(PluginError::BadShape { name: embedding.into(), expected: vec![0, 0], found: d.to_vec() }),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<TensorDesc> {
        self.model.tensor(RStr::from_str(name)).into_option()
    }

    /// Declare a weight the family needs; missing is an error naming it.
    pub fn weight(&mut self, name: &str, role: Role, layer: Option<u32>) -> Result<Wt, PluginError> {
        self.opt_weight(name, role, layer)?.ok_or_else(|| PluginError::MissingTensor(name.to_string()))
    }

    /// Declare a weight that may be absent (e.g. a bias, a tied output head).
    pub fn opt_weight(&mut self, name: &str, role: Role, layer: Option<u32>) -> Result<Option<Wt>, PluginError> {
        if self.tensor(name).is_none() {
            return Ok(None);
        }
        if let Some(i) = self.plan.weights.iter().position(|w| w.name.as_str() == name) {
            return Ok(Some(Wt(i as u32)));
        }
        let id = Wt(self.plan.weights.len() as u32);
        self.plan.weights.push(WeightReq { name: name.into(), role, layer: layer.map_or(-1, |l| l as i32) });
        self.dims.push(self.tensor(name).map(|t| t.dims.to_vec()).unwrap_or_default());
        Ok(Some(id))
    }

    /// Declare a weight and check its shape (ggml order).
    pub fn weight_shaped(&mut self, name: &str, role: Role, layer: Option<u32>, dims: &[u64]) -> Result<Wt, PluginError> {
        let w = self.weight(name, role, layer)?;
        let found = self.tensor(name).map(|t| t.dims.to_vec()).unwrap_or_default();
        if found != dims {
            return Err(PluginError::BadShape { name: name.into(), expected: dims.to_vec(), found });
        }
        Ok(w)
    }

    pub fn set_dims(&mut self, n_layers: u32, n_embd: u32, n_vocab: u32, n_ctx_train: u32) {
        self.plan.n_layers = n_layers;
        self.plan.n_embd = n_embd;
        self.plan.n_vocab = n_vocab;
        self.plan.n_ctx_train = n_ctx_train;
    }

    /// Declare a per-sequence state; returns its index (what ops name it by).
    pub fn state(&mut self, spec: StateSpec) -> u32 {
        self.plan.states.push(spec);
        self.plan.states.len() as u32 - 1
    }

    /// Declare a cache of one `width`-wide row per position; returns its index.
    pub fn rows_state(&mut self, layer: u32, width: u32) -> u32 {
        self.state(StateSpec::rows(layer, width))
    }

    /// Declare a recurrent state of shape `dims`; returns its index.
    pub fn recurrent_state(&mut self, layer: u32, dims: &[u64]) -> u32 {
        self.state(StateSpec::recurrent(layer, dims))
    }

    /// Declare the KV cache of one attention layer; returns its state index.
    pub fn kv_cache(&mut self, layer: u32, n_kv_head: u32, head_dim_k: u32, head_dim_v: u32, window: u32) -> u32 {
        self.state(StateSpec::kv(layer, n_kv_head, head_dim_k, head_dim_v, window))
    }

    pub fn into_plan(self) -> ModelPlan {
        self.plan
    }

    /// The plan and each declared weight's ggml dims.
    pub fn into_parts(self) -> (ModelPlan, Vec<Vec<u64>>) {
        (self.plan, self.dims)
    }
}

fn as_u64(v: &MetaValue) -> Option<u64> {
    match *v {
        MetaValue::U64(n) => Some(n),
        MetaValue::I64(n) if n >= 0 => Some(n as u64),
        _ => None,
    }
}

fn wrong(key: &str, expected: &'static str, found: &MetaValue) -> PluginError {
    let found = match found {
        MetaValue::U64(n) => format!("unsigned {n}"),
        MetaValue::I64(n) => format!("signed {n}"),
        MetaValue::F64(x) => format!("float {x}"),
        MetaValue::Bool(b) => format!("bool {b}"),
        MetaValue::Str(s) => format!("string {:?}", s.as_str()),
        MetaValue::U64s(a) => format!("array of {} unsigned", a.len()),
        MetaValue::I64s(a) => format!("array of {} signed", a.len()),
        MetaValue::F64s(a) => format!("array of {} floats", a.len()),
        MetaValue::Bools(a) => format!("array of {} bools", a.len()),
        MetaValue::Strs(a) => format!("array of {} strings", a.len()),
        MetaValue::Nested(n) => format!("array of {n} arrays"),
    };
    PluginError::WrongType { key: key.into(), expected, found }
}

/// The step graph a family records in [`FamilyPlugin::forward`]: one typed
/// method per op, each checked (inputs, shapes) as it is recorded, so a
/// mistake fails at build time with the node that made it.
pub struct Graph<'a> {
    kind: StepKind,
    cx: ShapeCx<'a>,
    nodes: Vec<Node>,
    shapes: Vec<Shape>,
}

impl<'a> Graph<'a> {
    pub fn new(kind: StepKind, cx: ShapeCx<'a>) -> Self {
        Graph { kind, cx, nodes: Vec::new(), shapes: Vec::new() }
    }

    /// The step kind this graph is built for (decode: one token per sequence).
    pub fn kind(&self) -> StepKind {
        self.kind
    }

    /// A value's shape.
    pub fn shape(&self, x: Val) -> Result<&Shape, PluginError> {
        self.shapes.get(x.0 as usize).ok_or_else(|| PluginError::Op(format!("unknown value {}", x.0)))
    }

    /// Record `op` reading `inputs`: its shape rule runs now.
    pub fn op(&mut self, op: Op, inputs: &[Val]) -> Result<Val, PluginError> {
        let i = self.nodes.len();
        let ins: Vec<&Shape> = inputs.iter().map(|v| self.shape(*v)).collect::<Result<_, _>>()?;
        let shape = infer(&op, &ins, &self.cx).map_err(|why| PluginError::Op(format!("node {i} ({}): {why}", op.name())))?;
        let e = op.encode();
        self.nodes.push(Node {
            op: e.code,
            inputs: inputs.iter().map(|v| v.0).collect(),
            ints: e.ints.into(),
            floats: e.floats.into(),
            label: RString::new(),
            layer: -1,
        });
        self.shapes.push(shape);
        Ok(Val(i as u32))
    }

    /// Name a value (`attn_out`, layer 3) so the host can dump it and diff it
    /// against a reference; returns it for chaining.
    pub fn name(&mut self, x: Val, label: &str, layer: Option<u32>) -> Val {
        if let Some(n) = self.nodes.get_mut(x.0 as usize) {
            n.label = label.into();
            n.layer = layer.map_or(-1, |l| l as i32);
        }
        x
    }

    /// The graph, with `output` (the logits, `[O, n_vocab]`).
    pub fn finish(self, output: Val) -> StepGraph {
        StepGraph { nodes: self.nodes.into(), output: output.0 }
    }

    /// i32 values as f32 (see [`Op::ToF32`]).
    pub fn to_f32(&mut self, x: Val) -> Result<Val, PluginError> {
        self.op(Op::ToF32, &[x])
    }

    /// Hashed n-gram ids from the sequence's token history `f32[C, 1]` (see
    /// [`Op::NgramHash`]).
    pub fn ngram_hash(&mut self, hist: Val, n: u32, heads: u32, eos: i64, mult: &[i64], offsets: &[i64], vocab: &[i64]) -> Result<Val, PluginError> {
        let op = Op::NgramHash { n, heads, eos, mult: mult.to_vec(), offsets: offsets.to_vec(), vocab: vocab.to_vec() };
        self.op(op, &[hist])
    }

    /// A depthwise dilated causal conv over a rows cache `[C, W]` at the
    /// step's positions (see [`Op::ConvRows`]).
    pub fn conv_rows(&mut self, weight: Wt, dilation: u32, cache: Val) -> Result<Val, PluginError> {
        self.op(Op::ConvRows { weight, dilation }, &[cache])
    }

    /// Pooled block selection over a cache of raw index keys: the additive
    /// mask `[T, C]` (see [`Op::PooledSelect`]).
    #[allow(clippy::too_many_arguments)]
    pub fn pooled_select(&mut self, q: Val, keys: Val, block: u32, top_k: u32, key_norm: Wt, eps: f32, scale: f32, rope: Rope) -> Result<Val, PluginError> {
        self.op(Op::PooledSelect { block, top_k, key_norm, eps, scale, rope }, &[q, keys])
    }


    /// The step's token ids, i32 `[T]`.
    pub fn tokens(&mut self) -> Result<Val, PluginError> {
        self.op(Op::Tokens, &[])
    }
    /// The step's positions, i32 `[T]`.
    pub fn positions(&mut self) -> Result<Val, PluginError> {
        self.op(Op::Positions, &[])
    }
    /// A resident weight as a value (row-major, ggml dims reversed).
    pub fn weight(&mut self, w: Wt) -> Result<Val, PluginError> {
        self.op(Op::Weight(w), &[])
    }
    /// Rows of `table` for i32 `ids`, times `scale`.
    pub fn embed(&mut self, table: Wt, ids: Val, scale: f32) -> Result<Val, PluginError> {
        self.op(Op::Embed { table, scale }, &[ids])
    }
    /// `x · wᵀ` over the last axis.
    pub fn linear(&mut self, w: Wt, x: Val) -> Result<Val, PluginError> {
        self.op(Op::Linear(w), &[x])
    }
    /// Keep the rows whose logits the host wants; call before the final norm
    /// so the output head runs once per wanted row.
    pub fn output_rows(&mut self, x: Val) -> Result<Val, PluginError> {
        self.op(Op::OutputRows, &[x])
    }
    pub fn reshape(&mut self, x: Val, dims: &[Dim]) -> Result<Val, PluginError> {
        self.op(Op::Reshape(dims.to_vec()), &[x])
    }
    /// `[T, heads * head_dim]` as `[T, heads, head_dim]`.
    pub fn split_heads(&mut self, x: Val, heads: u32, head_dim: u32) -> Result<Val, PluginError> {
        self.reshape(x, &[Dim::T, Dim::N(heads as u64), Dim::N(head_dim as u64)])
    }
    /// `[T, a, b, ..]` as `[T, a * b * ..]`.
    pub fn merge_heads(&mut self, x: Val) -> Result<Val, PluginError> {
        let s = self.shape(x)?;
        let (n, sym) = s.split();
        if sym != [Dim::T] || s.dims.first() != Some(&Dim::T) {
            return Err(PluginError::Op(format!("merge_heads: {s} is not [T, ..]")));
        }
        self.reshape(x, &[Dim::T, Dim::N(n)])
    }
    pub fn permute(&mut self, x: Val, perm: &[u32]) -> Result<Val, PluginError> {
        self.op(Op::Permute(perm.to_vec()), &[x])
    }
    pub fn concat(&mut self, xs: &[Val], axis: i64) -> Result<Val, PluginError> {
        self.op(Op::Concat { axis }, xs)
    }
    pub fn slice(&mut self, x: Val, axis: i64, start: u64, len: u64) -> Result<Val, PluginError> {
        self.op(Op::Slice { axis, start, len }, &[x])
    }
    pub fn unary(&mut self, x: Val, f: Unary) -> Result<Val, PluginError> {
        self.op(Op::Unary(f), &[x])
    }
    pub fn exp(&mut self, x: Val) -> Result<Val, PluginError> {
        self.unary(x, Unary::Exp)
    }
    pub fn sigmoid(&mut self, x: Val) -> Result<Val, PluginError> {
        self.unary(x, Unary::Sigmoid)
    }
    pub fn softplus(&mut self, x: Val) -> Result<Val, PluginError> {
        self.unary(x, Unary::Softplus)
    }
    pub fn silu(&mut self, x: Val) -> Result<Val, PluginError> {
        self.unary(x, Unary::Silu)
    }
    pub fn tanh(&mut self, x: Val) -> Result<Val, PluginError> {
        self.unary(x, Unary::Tanh)
    }
    pub fn scale(&mut self, x: Val, s: f32) -> Result<Val, PluginError> {
        self.op(Op::Scale(s), &[x])
    }
    pub fn clamp(&mut self, x: Val, lo: f32, hi: f32) -> Result<Val, PluginError> {
        self.op(Op::Clamp { lo, hi }, &[x])
    }
    pub fn binary(&mut self, a: Val, b: Val, f: Binary) -> Result<Val, PluginError> {
        self.op(Op::Binary(f), &[a, b])
    }
    pub fn add(&mut self, a: Val, b: Val) -> Result<Val, PluginError> {
        self.binary(a, b, Binary::Add)
    }
    pub fn sub(&mut self, a: Val, b: Val) -> Result<Val, PluginError> {
        self.binary(a, b, Binary::Sub)
    }
    pub fn mul(&mut self, a: Val, b: Val) -> Result<Val, PluginError> {
        self.binary(a, b, Binary::Mul)
    }
    pub fn div(&mut self, a: Val, b: Val) -> Result<Val, PluginError> {
        self.binary(a, b, Binary::Div)
    }
    pub fn softmax(&mut self, x: Val, axis: i64) -> Result<Val, PluginError> {
        self.op(Op::Softmax { axis }, &[x])
    }
    pub fn sum(&mut self, x: Val, axis: i64) -> Result<Val, PluginError> {
        self.op(Op::Reduce { kind: Reduce::Sum, axis }, &[x])
    }
    pub fn mean(&mut self, x: Val, axis: i64) -> Result<Val, PluginError> {
        self.op(Op::Reduce { kind: Reduce::Mean, axis }, &[x])
    }
    pub fn max(&mut self, x: Val, axis: i64) -> Result<Val, PluginError> {
        self.op(Op::Reduce { kind: Reduce::Max, axis }, &[x])
    }
    /// Indices of the `k` largest entries along the last axis, largest first.
    pub fn top_k(&mut self, x: Val, k: u32) -> Result<Val, PluginError> {
        self.op(Op::TopK { k }, &[x])
    }
    /// `x[..., ids[..., j]]` along the last axis.
    pub fn take_along(&mut self, x: Val, ids: Val) -> Result<Val, PluginError> {
        self.op(Op::TakeAlong, &[x, ids])
    }
    /// Rows of `x` (first axis) by i32 `ids`.
    pub fn gather(&mut self, x: Val, ids: Val) -> Result<Val, PluginError> {
        self.op(Op::Gather, &[x, ids])
    }
    pub fn cumsum(&mut self, x: Val, axis: i64) -> Result<Val, PluginError> {
        self.op(Op::Cumsum { axis }, &[x])
    }
    /// `[.., m, k] · [.., k, n]`.
    pub fn matmul(&mut self, a: Val, b: Val) -> Result<Val, PluginError> {
        self.op(Op::Matmul, &[a, b])
    }
    /// RMS norm over the last axis (reshape to `[T, heads, head_dim]` first
    /// for per-head norms).
    pub fn rms_norm(&mut self, x: Val, w: Option<Wt>, eps: f32) -> Result<Val, PluginError> {
        self.op(Op::RmsNorm { weight: w, eps }, &[x])
    }
    pub fn rope(&mut self, x: Val, spec: Rope) -> Result<Val, PluginError> {
        self.op(Op::Rope(spec), &[x])
    }
    /// `act(gate) * up`.
    pub fn glu(&mut self, gate: Val, up: Val, act: Act) -> Result<Val, PluginError> {
        self.op(Op::Glu(act), &[gate, up])
    }
    pub fn attention(&mut self, q: Val, k: Val, v: Val, spec: Attention) -> Result<Val, PluginError> {
        self.op(Op::Attention(spec), &[q, k, v])
    }
    /// The selected experts' FFNs through the expert store.
    pub fn experts(&mut self, x: Val, ids: Val, weights: Val, spec: Experts) -> Result<Val, PluginError> {
        self.op(Op::Experts(spec), &[x, ids, weights])
    }
    /// Append `x` `[T, W]` to a rows state and read the cache back, `[C, W]`.
    pub fn state_rows(&mut self, state: u32, x: Val) -> Result<Val, PluginError> {
        self.op(Op::StateRows { state }, &[x])
    }
    /// The causal (and, with `window`, sliding) mask `[T, C]`: 0 or -inf.
    pub fn mask(&mut self, window: u32) -> Result<Val, PluginError> {
        self.op(Op::Mask { window }, &[])
    }
    /// Block-sparse key selection from per-key scores `[.., T, C]`: the
    /// additive mask of the chosen blocks' keys (see [`Op::BlockSelect`]).
    pub fn block_select(&mut self, scores: Val, block: u32, top_k: u32, local: u32) -> Result<Val, PluginError> {
        self.op(Op::BlockSelect { block, top_k, local }, &[scores])
    }
    /// `S_t = a_t * S_{t-1} + b_t` on a recurrent state; every `S_t`.
    pub fn scan(&mut self, state: u32, a: Val, b: Val) -> Result<Val, PluginError> {
        self.op(Op::Scan { state }, &[a, b])
    }
    /// The depthwise causal conv of `x` `[T, C]` with `weight` (`[K, C]`) on
    /// a recurrent state `[K - 1, C]` (see [`Op::ShortConv`]).
    pub fn short_conv(&mut self, state: u32, weight: Wt, x: Val) -> Result<Val, PluginError> {
        self.op(Op::ShortConv { state, weight }, &[x])
    }
    /// The gated delta rule on a recurrent state `[Hv, Dk, Dv]` (see
    /// [`Op::DeltaNet`]): o `[T, Hv, Dv]`.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_net(&mut self, state: u32, scale: f32, q: Val, k: Val, v: Val, g: Val, beta: Val) -> Result<Val, PluginError> {
        self.op(Op::DeltaNet { state, scale }, &[q, k, v, g, beta])
    }
    /// `x / sqrt(Σx² + eps)` over the last axis (of `width` values), composed
    /// as an RMS norm with `eps / width` scaled by `1 / sqrt(width)` (the
    /// delta nets' q/k L2 norm).
    pub fn l2_norm(&mut self, x: Val, width: u32, eps: f32) -> Result<Val, PluginError> {
        let n = self.rms_norm(x, None, eps / width as f32)?;
        self.scale(n, 1.0 / (width as f32).sqrt())
    }
}

/// Run `f`, turning a panic into an error line that names the plugin.
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, PluginError>) -> RResult<T, RString> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => RResult::ROk(v),
        Ok(Err(e)) => RResult::RErr(RString::from(format!("{what}: {e}"))),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            RResult::RErr(RString::from(format!("{what} panicked: {msg}")))
        }
    }
}

/// A [`FamilyPlugin`] behind the FFI-safe [`Family`] trait.
pub struct Exported<F> {
    family: F,
    plan: ModelPlan,
    dims: Vec<Vec<u64>>,
    names: Vec<String>,
    label: String,
}

impl<F: FamilyPlugin> Exported<F> {
    /// Record `family`'s graph for `kind` against its declared weights.
    pub fn graph(&self, kind: StepKind) -> Result<StepGraph, PluginError> {
        let cx = ShapeCx { weights: &self.dims, weight_names: &self.names, states: &self.plan.states };
        let mut g = Graph::new(kind, cx);
        let out = self.family.forward(&mut g)?;
        Ok(g.finish(out))
    }
}

impl<F: FamilyPlugin> Family for Exported<F> {
    fn plan(&self) -> ModelPlan {
        self.plan.clone()
    }
    fn build(&self, kind: StepKind) -> RResult<StepGraph, RString> {
        guard(&self.label, || self.graph(kind))
    }
    fn chat(&self) -> ChatSpec {
        // A chat spec is plain data: a panic here is still caught.
        match catch_unwind(AssertUnwindSafe(|| self.family.chat())) {
            Ok(c) => c,
            Err(_) => ChatSpec::default(),
        }
    }
}

/// Open `F` for `arch` (used by the macro; also usable in-process by tests).
pub fn open_family<F: FamilyPlugin>(plugin: &str, arch: RStr<'_>, model: ModelViewRef<'_>) -> RResult<FamilyBox, RString> {
    let label = format!("plugin {plugin} ({})", arch.as_str());
    guard(&label.clone(), || {
        let mut cx = OpenCx::new(arch.as_str(), model);
        let family = F::open(&mut cx)?;
        let (plan, dims) = cx.into_parts();
        let names = plan.weights.iter().map(|w| w.name.to_string()).collect();
        let exported = Exported { family, plan, dims, names, label };
        Ok(Family_TO::from_ptr(RBox::new(exported), TD_Opaque))
    })
}

/// Build the [`PluginInfo`] the macro's `describe` returns.
pub fn plugin_info(name: &str, version: &str, archs: &[&str]) -> PluginInfo {
    PluginInfo {
        name: name.into(),
        version: version.into(),
        archs: archs.iter().map(|a| RString::from(*a)).collect::<RVec<_>>(),
        api_version: crate::API_VERSION.into(),
    }
}

/// Export a plugin library. Each `"arch" => Type` pair registers one family.
///
/// ```ignore
/// pulsar_plugin_api::export_plugin! {
///     name: "gemma3",
///     families: { "gemma3" => Gemma3 },
/// }
/// ```
/// This defines the abi_stable root module (for the `cdylib`) and a
/// `plugin_module()` function returning the same module in-process (for tests
/// through the `rlib`).
#[macro_export]
macro_rules! export_plugin {
    (name: $name:expr, families: { $($arch:literal => $ty:ty),+ $(,)? } $(,)?) => {
        extern "C" fn __pulsar_describe() -> $crate::reexports::RResult<$crate::abi::PluginInfo, $crate::reexports::RString> {
            $crate::sdk::guard($name, || Ok($crate::sdk::plugin_info($name, env!("CARGO_PKG_VERSION"), &[$($arch),+])))
        }
        extern "C" fn __pulsar_open(
            arch: $crate::reexports::RStr<'_>,
            model: $crate::abi::ModelViewRef<'_>,
        ) -> $crate::reexports::RResult<$crate::abi::FamilyBox, $crate::reexports::RString> {
            match arch.as_str() {
                $($arch => $crate::sdk::open_family::<$ty>($name, arch, model),)+
                other => $crate::reexports::RResult::RErr(format!("plugin {} does not serve architecture `{}`", $name, other).into()),
            }
        }
        /// This plugin's root module, for in-process use.
        pub fn plugin_module() -> $crate::abi::PluginModRef {
            use $crate::reexports::PrefixTypeTrait;
            $crate::abi::PluginMod { describe: __pulsar_describe, open: __pulsar_open }.leak_into_prefix()
        }
        #[$crate::reexports::export_root_module]
        pub fn pulsar_plugin_root() -> $crate::abi::PluginModRef {
            plugin_module()
        }
    };
}
