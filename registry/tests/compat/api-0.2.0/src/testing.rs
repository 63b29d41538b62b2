//! An in-process fake host for plugin tests: a model view built from a list
//! of keys and tensor shapes, and helpers that open a family on it and build
//! and check its step graphs, with no weights, backend or shared library.

use std::collections::BTreeMap;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RStr, RString, RVec},
};

use crate::abi::*;
use crate::graph::{check, Checked, GraphError, Op, ShapeCx};

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

    /// Build `family`'s graph for `kind` and check it as the host does.
    pub fn check_graph(&self, family: &FamilyBox, kind: StepKind) -> Result<Checked, String> {
        let plan = family.plan();
        let g = family.build(kind).into_result().map_err(|e| e.into_string())?;
        self.check(&plan, &g).map_err(|e| e.to_string())
    }

    /// Check a graph against `plan` and this model's tensor shapes.
    pub fn check(&self, plan: &ModelPlan, g: &StepGraph) -> Result<Checked, GraphError> {
        let dims: Vec<Vec<u64>> =
            plan.weights.iter().map(|w| self.tensors.get(w.name.as_str()).map(|t| t.dims.to_vec()).unwrap_or_default()).collect();
        let names: Vec<String> = plan.weights.iter().map(|w| w.name.to_string()).collect();
        check(g, &ShapeCx { weights: &dims, weight_names: &names, states: &plan.states })
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

/// How many nodes of a checked graph run `op` (by name: "experts", "attention", ...).
pub fn count_ops(g: &Checked, op: &str) -> usize {
    g.ops.iter().filter(|o: &&Op| o.name() == op).count()
}
