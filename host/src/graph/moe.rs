//! The routing in front of each `experts` op, recognised in the graph.
//!
//! Routing is plugin code built from primitives. Where it has the common
//! form `linear(router, x)` → softmax or sigmoid (→ plus a selection-only
//! bias, `weight(b)`, for choosing) → `top_k` → `take_along` of the unbiased
//! scores (→ divided by their sum) (→ scaled) feeding `experts(x, ids, weights)`,
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
    /// `[n_expert]` added to the scores for choosing only (the weights are
    /// the unbiased scores of the chosen).
    pub bias: Option<Wt>,
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
/// the same bits). `bias` is the spec's selection bias, as values.
pub fn route(logits: &[f32], spec: &MoeSpec, bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
    let k = spec.top_k as usize;
    let mut p = logits.to_vec();
    match spec.gating {
        Gating::Softmax => ops::softmax_in_place(&mut p),
        Gating::Sigmoid => p.iter_mut().for_each(|v| *v = ops::math::sigmoid(*v)),
    }
    let sel = match bias {
        Some(b) => ops::top_k(&p.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<f32>>(), k),
        None => ops::top_k(&p, k),
    };
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
    if sel != ids || !only(sel, 2) {
        return None;
    }
    routing.extend([take, sel]);
    // Chosen on the scores themselves, or on the scores plus a bias weight.
    let choice = plan.inputs[sel][0] as usize;
    let mut bias = None;
    if choice == p {
        if !only(p, 2) {
            return None;
        }
    } else {
        let Op::Binary(Binary::Add) = plan.ops[choice] else { return None };
        let ins = &plan.inputs[choice];
        let other = match (ins[0] as usize == p, ins[1] as usize == p) {
            (true, false) => ins[1] as usize,
            (false, true) => ins[0] as usize,
            _ => return None,
        };
        let Op::Weight(b) = plan.ops[other] else { return None };
        if !only(choice, 1) || !only(other, 1) || !only(p, 2) || plan.shapes[other].dims != plan.shapes[p].dims[1..] {
            return None;
        }
        bias = Some(b);
        routing.extend([choice, other]);
    }
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
        bias,
        norm_topk,
        weights_scale,
        act: e.act,
    };
    Some(MoeMatch { experts: i, spec, routing })
}

#[cfg(test)]
mod tests {
    use pulsar_plugin_api::graph::{Act, Experts};
    use pulsar_plugin_api::{Graph, Val, Wt};

    use super::super::StepPlan;
    use super::*;

    /// Weights: 0 embedding [8, 16], 1 router [8, 4], 2 bias [4], 3-5 experts.
    fn weights() -> Vec<Vec<u64>> {
        vec![vec![8, 16], vec![8, 4], vec![4], vec![8, 6, 4], vec![8, 6, 4], vec![6, 8, 4]]
    }

    /// Build a one-MoE-layer graph whose routing `route` writes, and find its matches.
    fn matches(route: impl Fn(&mut Graph<'_>, Val) -> (Val, Val)) -> Vec<MoeMatch> {
        StepPlan::for_test(&weights(), |g, x| {
            let (sel, w) = route(g, x);
            let spec = Experts { layer: 0, gate: Wt(3), up: Wt(4), down: Wt(5), act: Act::Silu };
            g.experts(x, sel, w, spec).unwrap()
        })
        .moe
    }

    #[test]
    fn sigmoid_routing_with_a_selection_bias_is_fused() {
        let m = matches(|g, x| {
            let l = g.linear(Wt(1), x).unwrap();
            let p = g.sigmoid(l).unwrap();
            let b = g.weight(Wt(2)).unwrap();
            let c = g.add(p, b).unwrap();
            let sel = g.top_k(c, 2).unwrap();
            let w = g.take_along(p, sel).unwrap();
            let s = g.sum(w, -1).unwrap();
            let w = g.div(w, s).unwrap();
            (sel, g.scale(w, 2.5).unwrap())
        });
        assert_eq!(m.len(), 1);
        let s = m[0].spec;
        assert_eq!((s.gating, s.bias, s.norm_topk, s.weights_scale, s.top_k, s.n_expert), (Gating::Sigmoid, Some(Wt(2)), true, 2.5, 2, 4));
        assert_eq!(m[0].routing.len(), 9);
    }

    #[test]
    fn routing_the_fused_op_cannot_express_runs_as_primitives() {
        // Weights taken from the biased scores: not the fused op's rule.
        let m = matches(|g, x| {
            let l = g.linear(Wt(1), x).unwrap();
            let p = g.sigmoid(l).unwrap();
            let b = g.weight(Wt(2)).unwrap();
            let c = g.add(p, b).unwrap();
            let sel = g.top_k(c, 2).unwrap();
            (sel, g.take_along(c, sel).unwrap())
        });
        assert!(m.is_empty());
        // A routing value read elsewhere too (the scores feed a second op).
        let m = matches(|g, x| {
            let l = g.linear(Wt(1), x).unwrap();
            let p = g.softmax(l, -1).unwrap();
            let sel = g.top_k(p, 2).unwrap();
            let w = g.take_along(p, sel).unwrap();
            let _extra = g.exp(p).unwrap();
            (sel, w)
        });
        assert!(m.is_empty());
    }
}
