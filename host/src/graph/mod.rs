//! A family's step graphs inside the host: built once per step kind at
//! load, checked with the plugin-api's shape rules, and analysed once
//! (value lifetimes, the routing each `experts` op reads) so every backend
//! plans from the whole graph instead of learning it from past steps.

pub mod moe;

use pulsar_plugin_api::graph::{check, Checked, Dim, Op, Shape, ShapeCx};
use pulsar_plugin_api::{FamilyBox, ModelPlan, StepGraph, StepKind};

pub use moe::{Gating, MoeMatch, MoeSpec};

/// One step kind's graph, checked and analysed.
#[derive(Debug, Clone)]
pub struct StepPlan {
    pub kind: StepKind,
    pub ops: Vec<Op>,
    pub inputs: Vec<Vec<u32>>,
    pub shapes: Vec<Shape>,
    /// Per node: its dump label and layer (empty: unnamed).
    pub labels: Vec<(String, i32)>,
    pub output: u32,
    /// Per node, the last node that reads it (`usize::MAX`: the output,
    /// which lives to the step's end; a value nothing reads dies at once).
    pub last_use: Vec<usize>,
    /// Per node, how many nodes read it.
    pub readers: Vec<u32>,
    /// The routing of each `experts` op when it has a form the backends run
    /// in one fused op (router, top-k, renormalise, scale).
    pub moe: Vec<MoeMatch>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("plugin `{plugin}` failed to build its {kind:?} graph: {why}")]
    Build { plugin: String, kind: StepKind, why: String },
    #[error("plugin `{plugin}`'s {kind:?} graph is invalid: {why}")]
    Invalid { plugin: String, kind: StepKind, why: String },
}

impl StepPlan {
    /// Build `family`'s graph for `kind` and check it against the model's
    /// weights (`dims`, ggml order, by weight index).
    pub fn build(plugin: &str, family: &FamilyBox, plan: &ModelPlan, dims: &[Vec<u64>], kind: StepKind) -> Result<StepPlan, PlanError> {
        let g = family.build(kind).into_result().map_err(|e| PlanError::Build { plugin: plugin.into(), kind, why: e.into_string() })?;
        let names: Vec<String> = plan.weights.iter().map(|w| w.name.to_string()).collect();
        let cx = ShapeCx { weights: dims, weight_names: &names, states: &plan.states };
        let invalid = |why: String| PlanError::Invalid { plugin: plugin.into(), kind, why };
        let checked = check(&g, &cx).map_err(|e| invalid(e.to_string()))?;
        let out = &checked.shapes[checked.output as usize];
        let want = Shape::f32(vec![Dim::O, Dim::N(plan.n_vocab as u64)]);
        if *out != want {
            return Err(invalid(format!("the output is {out}, not the logits {want}")));
        }
        Ok(StepPlan::from_checked(kind, &g, checked))
    }

    pub(crate) fn from_checked(kind: StepKind, g: &StepGraph, c: Checked) -> StepPlan {
        let n = c.ops.len();
        let mut last_use: Vec<usize> = (0..n).collect();
        let mut readers = vec![0u32; n];
        for (i, ins) in c.inputs.iter().enumerate() {
            for &v in ins {
                last_use[v as usize] = i;
                readers[v as usize] += 1;
            }
        }
        last_use[c.output as usize] = usize::MAX;
        let labels = g.nodes.iter().map(|n| (n.label.to_string(), n.layer)).collect();
        let mut plan = StepPlan { kind, ops: c.ops, inputs: c.inputs, shapes: c.shapes, labels, output: c.output, last_use, readers, moe: Vec::new() };
        plan.moe = moe::find(&plan);
        plan
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Tests: the decode plan of the graph `body` writes on the embedded
    /// tokens (weight 0 the embedding) over weights of `dims`, named
    /// `w0`, `w1`, ...; `body`'s value is the output (not checked as logits).
    #[cfg(test)]
    pub(crate) fn for_test(dims: &[Vec<u64>], body: impl Fn(&mut pulsar_plugin_api::Graph<'_>, pulsar_plugin_api::Val) -> pulsar_plugin_api::Val) -> StepPlan {
        let names: Vec<String> = (0..dims.len()).map(|i| format!("w{i}")).collect();
        let states: Vec<pulsar_plugin_api::StateSpec> = Vec::new();
        let cx = || ShapeCx { weights: dims, weight_names: &names, states: &states };
        let mut g = pulsar_plugin_api::Graph::new(StepKind::Decode, cx());
        let ids = g.tokens().unwrap();
        let x = g.embed(pulsar_plugin_api::Wt(0), ids, 1.0).unwrap();
        let y = body(&mut g, x);
        let sg = g.finish(y);
        StepPlan::from_checked(StepKind::Decode, &sg, check(&sg, &cx()).unwrap())
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The routing match of the `experts` op at `node`, if it has one.
    pub fn moe_at(&self, node: usize) -> Option<&MoeMatch> {
        self.moe.iter().find(|m| m.experts == node)
    }

    /// The routing match of the first `experts` op of `layer`.
    pub fn moe_of_layer(&self, layer: u32) -> Option<&MoeMatch> {
        self.moe.iter().find(|m| m.spec.layer == layer)
    }
}

/// The decode and prefill plans of a model.
#[derive(Debug, Clone)]
pub struct StepPlans {
    pub decode: StepPlan,
    pub prefill: StepPlan,
}

impl StepPlans {
    pub fn build(plugin: &str, family: &FamilyBox, plan: &ModelPlan, dims: &[Vec<u64>]) -> Result<StepPlans, PlanError> {
        Ok(StepPlans {
            decode: StepPlan::build(plugin, family, plan, dims, StepKind::Decode)?,
            prefill: StepPlan::build(plugin, family, plan, dims, StepKind::Prefill)?,
        })
    }

    /// The plan for a step of `n_tokens` tokens (one: decode).
    pub fn for_tokens(&self, n_tokens: usize) -> &StepPlan {
        if n_tokens == 1 {
            &self.decode
        } else {
            &self.prefill
        }
    }
}
