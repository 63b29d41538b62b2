//! A model: its GGUF file, the family plugin that understands it, the plan
//! the plugin declared (weights by role, per-sequence state), resolved
//! against the file's tensor directory before any weight byte is read, and
//! the family's step graphs, built and checked once.

use std::collections::HashMap;
use std::path::Path;

use abi_stable::sabi_trait::TD_Opaque;
use abi_stable::std_types::{ROption, RStr, RString, RVec};
use pulsar_gguf::{Array, GgmlType, GgufFile, TensorInfo, Value};
use pulsar_kernels::ops::KvType;
use pulsar_plugin_api::{
    ChatSpec, FamilyBox, MetaValue, ModelPlan, ModelView, ModelView_TO, PluginModRef, Role, TensorDesc,
};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Gguf(#[from] pulsar_gguf::GgufError),
    #[error("{path}: {why}")]
    Open { path: String, why: String },
    #[error("plugin `{plugin}` cannot open this model: {why}")]
    Plugin { plugin: String, why: String },
    #[error("plugin `{plugin}` declared weight `{name}`, which the file does not have")]
    UnknownWeight { plugin: String, name: String },
    #[error("{0}")]
    Graph(#[from] crate::graph::PlanError),
    #[error("plugin `{plugin}` declares state {index} of kind {kind} with dims this host does not know (a newer host may be needed)")]
    UnknownState { plugin: String, index: usize, kind: u32 },
}

/// The GGUF as a plugin sees it.
pub struct GgufView<'a> {
    pub file: &'a GgufFile,
}

fn meta_value(v: &Value) -> MetaValue {
    fn ints<T: Copy + Into<i128>>(a: &[T]) -> MetaValue {
        if a.iter().all(|&x| x.into() >= 0) {
            MetaValue::U64s(a.iter().map(|&x| x.into() as u64).collect())
        } else {
            MetaValue::I64s(a.iter().map(|&x| x.into() as i64).collect())
        }
    }
    match v {
        Value::String(s) => MetaValue::Str(s.as_str().into()),
        Value::Bool(b) => MetaValue::Bool(*b),
        Value::F32(x) => MetaValue::F64(*x as f64),
        Value::F64(x) => MetaValue::F64(*x),
        Value::Array(a) => match a {
            Array::U8(a) => ints(a),
            Array::I8(a) => ints(a),
            Array::U16(a) => ints(a),
            Array::I16(a) => ints(a),
            Array::U32(a) => ints(a),
            Array::I32(a) => ints(a),
            Array::U64(a) => MetaValue::U64s(a.iter().copied().collect()),
            Array::I64(a) => MetaValue::I64s(a.iter().copied().collect()),
            Array::F32(a) => MetaValue::F64s(a.iter().map(|&x| x as f64).collect()),
            Array::F64(a) => MetaValue::F64s(a.iter().copied().collect()),
            Array::Bool(a) => MetaValue::Bools(a.iter().copied().collect()),
            Array::String(a) => MetaValue::Strs(a.iter().map(|s| RString::from(s.as_str())).collect()),
            Array::Array(a) => MetaValue::Nested(a.len() as u64),
        },
        other => match other.as_i128() {
            Some(n) if n >= 0 => MetaValue::U64(n as u64),
            Some(n) => MetaValue::I64(n as i64),
            None => MetaValue::Nested(0),
        },
    }
}

fn desc(t: &TensorInfo) -> TensorDesc {
    TensorDesc { name: t.name.as_str().into(), dims: t.dims.iter().copied().collect(), dtype: t.ty.id(), bytes: t.n_bytes }
}

impl ModelView for GgufView<'_> {
    fn meta(&self, key: RStr<'_>) -> ROption<MetaValue> {
        self.file.get(key.as_str()).map(meta_value).into()
    }
    fn meta_keys(&self) -> RVec<RString> {
        self.file.metadata().keys().map(RString::from).collect()
    }
    fn tensor(&self, name: RStr<'_>) -> ROption<TensorDesc> {
        self.file.tensor(name.as_str()).map(desc).into()
    }
    fn tensor_names(&self) -> RVec<RString> {
        self.file.tensors().iter().map(|t| RString::from(t.name.as_str())).collect()
    }
}

/// One declared weight, resolved to its tensor.
#[derive(Debug, Clone)]
pub struct Weight {
    pub name: String,
    pub role: Role,
    pub layer: Option<u32>,
    pub tensor: usize,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub bytes: u64,
}

/// Bytes by placement class, answered from the plan alone.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct MemoryPlan {
    /// Everything but routed experts: stays resident.
    pub resident_bytes: u64,
    /// Routed experts: stream through the expert store.
    pub expert_bytes: u64,
    pub expert_bytes_per_layer: Vec<u64>,
    /// KV (in the model's `kv_type`) and latent cache (f32) bytes per token of context.
    pub kv_bytes_per_token: u64,
    /// Fixed-size per-sequence state (recurrent states), f32 bytes.
    pub state_bytes_per_seq: u64,
    /// Device bytes a prefill step's activations and MoE work space take per
    /// token of the chunk (an estimate: two layers' values live at once,
    /// plus the routed experts' gate, up, product and output rows).
    pub activation_bytes_per_token: u64,
}

pub struct Model {
    pub file: GgufFile,
    pub arch: String,
    pub plugin: String,
    pub family: FamilyBox,
    pub plan: ModelPlan,
    pub weights: Vec<Weight>,
    pub chat: ChatSpec,
    /// The family's decode and prefill graphs, checked against the weights.
    pub steps: crate::graph::StepPlans,
    /// The format the KV caches hold their rows in (`--kv-type`; f32 until
    /// the caller sets it, before any engine is made).
    pub kv_type: KvType,
}

impl Model {
    /// Open `path` with the given plugin module.
    pub fn open(path: &Path, plugin_name: &str, module: PluginModRef) -> Result<Model, ModelError> {
        let file = GgufFile::open(path)?;
        Model::from_file(file, plugin_name, module)
    }

    pub fn from_file(file: GgufFile, plugin_name: &str, module: PluginModRef) -> Result<Model, ModelError> {
        let arch = file.architecture()?.to_string();
        let family = {
            let view = GgufView { file: &file };
            let view_ref = ModelView_TO::from_ptr(&view, TD_Opaque);
            (module.open())(RStr::from_str(&arch), view_ref)
                .into_result()
                .map_err(|e| ModelError::Plugin { plugin: plugin_name.to_string(), why: e.into_string() })?
        };
        let plan = family.plan();
        let index: HashMap<&str, usize> = file.tensors().iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let mut weights = Vec::with_capacity(plan.weights.len());
        for w in plan.weights.iter() {
            let Some(&ti) = index.get(w.name.as_str()) else {
                return Err(ModelError::UnknownWeight { plugin: plugin_name.into(), name: w.name.to_string() });
            };
            let t = &file.tensors()[ti];
            weights.push(Weight {
                name: w.name.to_string(),
                role: w.role,
                layer: (w.layer >= 0).then_some(w.layer as u32),
                tensor: ti,
                ty: t.ty,
                dims: t.dims.clone(),
                bytes: t.n_bytes,
            });
        }
        let known = |s: &pulsar_plugin_api::StateSpec| match s.kind {
            pulsar_plugin_api::STATE_KV => s.as_kv().is_some(),
            pulsar_plugin_api::STATE_ROWS => s.dims.len() == 1 && s.dims[0] > 0,
            pulsar_plugin_api::STATE_RECURRENT => !s.dims.is_empty() && s.dims.iter().all(|&d| d > 0),
            _ => false,
        };
        if let Some((index, st)) = plan.states.iter().enumerate().find(|(_, s)| !known(s)) {
            return Err(ModelError::UnknownState { plugin: plugin_name.into(), index, kind: st.kind });
        }
        let dims: Vec<Vec<u64>> = weights.iter().map(|w| w.dims.clone()).collect();
        let steps = crate::graph::StepPlans::build(plugin_name, &family, &plan, &dims)?;
        let chat = family.chat();
        Ok(Model { file, arch, plugin: plugin_name.to_string(), family, plan, weights, chat, steps, kv_type: KvType::F32 })
    }

    pub fn memory_plan(&self) -> MemoryPlan {
        let mut m = MemoryPlan { expert_bytes_per_layer: vec![0; self.plan.n_layers as usize], ..Default::default() };
        for w in &self.weights {
            if w.role == Role::RoutedExpert {
                m.expert_bytes += w.bytes;
                if let Some(slot) = w.layer.and_then(|l| m.expert_bytes_per_layer.get_mut(l as usize)) {
                    *slot += w.bytes;
                }
            } else {
                m.resident_bytes += w.bytes;
            }
        }
        // KV rows in the cache's format; latent (rows) caches stay f32.
        let kv = |s: &pulsar_plugin_api::StateSpec| match s.as_kv() {
            Some((h, dk, dv, _)) => (self.kv_type.row_bytes((h * dk) as usize) + self.kv_type.row_bytes((h * dv) as usize)) as u64,
            None => s.bytes().0,
        };
        m.kv_bytes_per_token = self.plan.states.iter().map(kv).sum();
        m.state_bytes_per_seq = self.plan.states.iter().map(|s| s.bytes().1).sum();
        let d = self.plan.n_embd as u64;
        let (ff, dm) = self
            .weights
            .iter()
            .find(|w| w.role == Role::RoutedExpert && w.dims.len() == 3)
            .map(|w| (w.dims[1].min(w.dims[0]), w.dims[1].max(w.dims[0])))
            .unwrap_or((0, d));
        let k = self.file.metadata().get_u32(&format!("{}.expert_used_count", self.arch)).ok().flatten().unwrap_or(1) as u64;
        // 32 model-width rows of values a token: on the H200 the q2_K 48-layer
        // model's 512-token steps held 421 MiB (24 rows gave 392 MiB, short).
        m.activation_bytes_per_token = 4 * (k * (3 * ff + 2 * dm) + 32 * d.max(dm));
        m
    }

    pub fn tensor(&self, w: &Weight) -> &TensorInfo {
        &self.file.tensors()[w.tensor]
    }

    pub fn data(&self, w: &Weight) -> &[u8] {
        self.file.data(self.tensor(w))
    }
}
