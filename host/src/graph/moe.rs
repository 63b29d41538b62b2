//! The routing in front of each `experts` op, recognised in the graph.
//!
//! Routing is plugin code built from primitives. Where it has the common
//! form `linear(router, x)` → softmax or sigmoid → `top_k` → `take_along`
//! (→ divided by its sum) (→ scaled) feeding `experts(x, ids, weights)`,
//! the backends run router, top-k and experts as one fused op (the CUDA
//! kernels, the next layer's prefetch) and skip the primitives. Anything
//! else runs as the primitives it is.

use pulsar_kernels::ops;
use pulsar_plugin_api::graph::{Act, Binary, Op, Reduce, Unary};
use pulsar_plugin_api::Wt;

use super::StepPlan;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// A routed-expert block as one fused op: router, top-k, the selected
/// experts' gated FFNs through the expert store, weighted sum.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSpec {
    pub layer: u32,
    /// `[n_embd] -> [n_expert]` router weight.
    pub router: Wt,
    /// `*_exps` tensors `[n_embd, n_ff, n_expert]` / `[n_ff, n_embd, n_expert]`.
    pub gate_exps: Wt,
    pub up_exps: Wt,
    pub down_exps: Wt,
    pub n_expert: u32,
    pub top_k: u32,
    pub gating: Gating,
    /// Renormalise the selected weights to sum to 1.
    pub norm_topk: bool,
    /// Multiplier on the selected weights after normalisation.
    pub weights_scale: f32,
    pub act: Act,
}

/// One `experts` op whose routing has the fused form.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeMatch {
    /// The `experts` node.
    pub experts: usize,
    pub spec: MoeSpec,
    /// The routing nodes the fused op stands for (read by nothing else).
    pub routing: Vec<usize>,
}

/// Routing of one row: selected experts and their weights, in selection
/// order (the CPU twin of the fused op's router; the graph's primitives give
/// the same bits).
pub fn route(logits: &[f32], spec: &MoeSpec) -> (Vec<u32>, Vec<f32>) {
    let k = spec.top_k as usize;
    let mut p = logits.to_vec();
    match spec.gating {
        Gating::Softmax => ops::softmax_in_place(&mut p),
        Gating::Sigmoid => p.iter_mut().for_each(|v| *v = ops::math::sigmoid(*v)),
    }
    let sel = ops::top_k(&p, k);
    let mut w: Vec<f32> = sel.iter().map(|&e| p[e]).collect();
    // No renormalisation of an all-zero choice (the fused kernels' rule; the
    // primitives' division differs only there, where it gives NaN).
    if spec.norm_topk {
        let s: f32 = w.iter().sum();
        if s > 0.0 {
            w.iter_mut().for_each(|v| *v /= s);
        }
    }
    w.iter_mut().for_each(|v| *v *= spec.weights_scale);
    (sel.into_iter().map(|e| e as u32).collect(), w)
}

/// Every `experts` op of `plan` whose routing has the fused form.
pub fn find(plan: &StepPlan) -> Vec<MoeMatch> {
    (0..plan.len()).filter_map(|i| match_at(plan, i)).collect()
}

fn match_at(plan: &StepPlan, i: usize) -> Option<MoeMatch> {
    let Op::Experts(e) = &plan.ops[i] else { return None };
    let (x, ids, mut w) = match plan.inputs[i].as_slice() {
        [x, ids, w] => (*x as usize, *ids as usize, *w as usize),
        _ => return None,
    };
    let mut routing = Vec::new();
    // Read only by the nodes we fold in (counted as we go).
    let only = |v: usize, n: u32| plan.readers[v] == n;
    let mut weights_scale = 1.0;
    if let Op::Scale(s) = plan.ops[w] {
        if !only(w, 1) {
            return None;
        }
        weights_scale = s;
        routing.push(w);
        w = plan.inputs[w][0] as usize;
    }
    let mut norm_topk = false;
    let take = match &plan.ops[w] {
        Op::TakeAlong => w,
        Op::Binary(Binary::Div) => {
            let [num, den] = plan.inputs[w][..] else { return None };
            let (num, den) = (num as usize, den as usize);
            let is_sum = matches!(plan.ops[den], Op::Reduce { kind: Reduce::Sum, axis: -1 | 1 }) && plan.inputs[den] == [num as u32];
            if !is_sum || !only(w, 1) || !only(den, 1) || !only(num, 2) || plan.ops[num] != Op::TakeAlong {
                return None;
            }
            norm_topk = true;
            routing.extend([w, den]);
            num
        }
        _ => return None,
    };
    if !norm_topk && !only(take, 1) {
        return None;
    }
    let [p, sel] = plan.inputs[take][..] else { return None };
    let (p, sel) = (p as usize, sel as usize);
    let Op::TopK { k } = plan.ops[sel] else { return None };
    if sel != ids || plan.inputs[sel] != [p as u32] || !only(sel, 2) || !only(p, 2) {
        return None;
    }
    routing.extend([take, sel]);
    let gating = match plan.ops[p] {
        Op::Softmax { axis: -1 | 1 } => Gating::Softmax,
        Op::Unary(Unary::Sigmoid) => Gating::Sigmoid,
        _ => return None,
    };
    let logits = plan.inputs[p][0] as usize;
    let Op::Linear(router) = plan.ops[logits] else { return None };
    if plan.inputs[logits] != [x as u32] || !only(logits, 1) {
        return None;
    }
    routing.extend([p, logits]);
    // Softmax over the last axis of [T, n_expert] (axis 1 is the last).
    let n_expert = plan.shapes[logits].last()? as u32;
    if plan.shapes[logits].rank() != 2 {
        return None;
    }
    routing.sort_unstable();
    let spec = MoeSpec {
        layer: e.layer,
        router,
        gate_exps: e.gate,
        up_exps: e.up,
        down_exps: e.down,
        n_expert,
        top_k: k,
        gating,
        norm_topk,
        weights_scale,
        act: e.act,
    };
    Some(MoeMatch { experts: i, spec, routing })
}
