//! Fused launches found by matching the step graph, once per step kind.
//!
//! A decode layer of qwen3 norms q and k per head and then rotates both: four
//! launches of a few microseconds each for a few kilobytes. Where the graph
//! has a per-head `rms_norm` whose output a `rope` reads, and a later such
//! pair with the same rope whose norm's input already exists, the first norm
//! runs all four in one `norm_rope` launch and keeps the other three outputs
//! ahead ([`AheadSet`]). The same holds for an `add` of a MoE op's output and
//! a value that exists before it (`moe_combine_add`: the residual add), and
//! for linear ops reading one input (q, k, v: one grouped GEMV in decode).
//!
//! Matching reads only the graph (ops, inputs, how each node lowers), so it
//! fires for every family whose graph has the pattern, from the first step.
//! Each output computed ahead is claimed only by an op with the same
//! parameters reading the same value, so a pattern the step cannot fuse
//! (rows or widths the kernel does not take) falls back to the plain ops.

use pulsar_cuda::DeviceBuf;
use pulsar_plugin_api::graph::{Binary, Op};
use pulsar_plugin_api::Wt;

use crate::graph::StepPlan;

/// What the fusion needs to know of an op, to claim an output made ahead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum OpKey {
    /// `rms_norm` with this weight (index), eps bits and group.
    Norm { w: Option<u32>, eps: u32, group: u32 },
    /// `rope` with these parameters (floats as bits; mode 0 neox, 1 interleaved).
    Rope { head_dim: u32, n_rot: u32, base: u32, factor: u32, mode: u8 },
    /// `add` (its two inputs, in order, are the match).
    Add,
}

/// A fused launch at one node, in graph nodes.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Fuse {
    /// At a per-head norm (q): norm node `k_norm` (reading node `k_in`, made
    /// before this one) and the ropes of both outputs, in one launch.
    NormRope { k_in: u32, k_norm: usize, q_rope: usize },
    /// At a MoE or experts node: the add node that sums its output with node
    /// `other` (made before it); `other_first` when that is the add's first input.
    CombineAdd { other: u32, other_first: bool },
    /// At a linear node: later linear nodes reading the same input, in order
    /// (one grouped GEMV in decode when their weights share a type and width).
    Linears(Vec<usize>),
}

/// How a node runs, as far as matching cares.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Runs {
    /// One op of the CUDA step's 2-D face (norms, ropes, adds, linears).
    Face,
    /// The fused MoE op or the experts op on given routing.
    Moe,
    /// Anything else (a primitive, an alias, folded, a source).
    Other,
}

/// The most linear ops one grouped GEMV runs.
const MAX_GROUP: usize = 3;

/// Every fused launch of `plan`, by node (`runs`: how each node lowers).
pub(super) fn find(plan: &StepPlan, runs: &[Runs]) -> Vec<Option<Fuse>> {
    let n = plan.len();
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, ins) in plan.inputs.iter().enumerate() {
        for &v in ins {
            readers[v as usize].push(i);
        }
    }
    let mut fuse: Vec<Option<Fuse>> = vec![None; n];
    let face = |i: usize| runs[i] == Runs::Face;
    // A face norm read by a face rope over the norm's groups: the rope.
    let roped = |i: usize| -> Option<(usize, pulsar_plugin_api::graph::Rope)> {
        let Op::RmsNorm { .. } = plan.ops[i] else { return None };
        if !face(i) {
            return None;
        }
        readers[i].iter().find_map(|&r| match plan.ops[r] {
            Op::Rope(rope) if face(r) && rope.yarn.is_none() && plan.shapes[r].last() == plan.shapes[i].last() => Some((r, rope)),
            _ => None,
        })
    };
    let mut taken = vec![false; n];
    for i in 0..n {
        if taken[i] {
            continue;
        }
        let Some((q_rope, rope)) = roped(i) else { continue };
        // The next norm of the same head size and rope whose input exists at i.
        let partner = (i + 1..n).find(|&j| {
            !taken[j]
                && plan.inputs[j].len() == 1
                && (plan.inputs[j][0] as usize) < i
                && plan.shapes[j].last() == plan.shapes[i].last()
                && roped(j).is_some_and(|(_, r)| r == rope)
        });
        if let Some(j) = partner {
            taken[i] = true;
            taken[j] = true;
            fuse[i] = Some(Fuse::NormRope { k_in: plan.inputs[j][0], k_norm: j, q_rope });
        }
    }
    for m in 0..n {
        if runs[m] != Runs::Moe {
            continue;
        }
        let add = readers[m].iter().find_map(|&a| {
            let ins = &plan.inputs[a];
            if !(face(a) && matches!(plan.ops[a], Op::Binary(Binary::Add)) && ins.len() == 2 && plan.shapes[ins[0] as usize] == plan.shapes[ins[1] as usize]) {
                return None;
            }
            match (ins[0] as usize == m, ins[1] as usize == m) {
                (true, false) if (ins[1] as usize) < m => Some((ins[1], false)),
                (false, true) if (ins[0] as usize) < m => Some((ins[0], true)),
                _ => None,
            }
        });
        if let Some((other, other_first)) = add {
            fuse[m] = Some(Fuse::CombineAdd { other, other_first });
        }
    }
    let mut grouped = vec![false; n];
    for i in 0..n {
        if grouped[i] || !face(i) || !matches!(plan.ops[i], Op::Linear(_)) {
            continue;
        }
        let x = plan.inputs[i][0] as usize;
        let with: Vec<usize> = readers[x].iter().copied().filter(|&j| j > i && face(j) && matches!(plan.ops[j], Op::Linear(_))).take(MAX_GROUP - 1).collect();
        if !with.is_empty() {
            for &j in &with {
                grouped[j] = true;
            }
            fuse[i] = Some(Fuse::Linears(with));
        }
    }
    fuse
}

/// The weights of a [`Fuse::Linears`] group's other nodes.
pub(super) fn group_weights(plan: &StepPlan, with: &[usize]) -> Vec<Wt> {
    with.iter().filter_map(|&j| if let Op::Linear(w) = plan.ops[j] { Some(w) } else { None }).collect()
}

/// An output computed ahead: claimed by the op with `key` reading `inputs`
/// (a None until the value it stands for exists: the output of the claim of
/// the slot whose `feeds` points here).
pub(super) struct Ahead {
    pub key: OpKey,
    pub inputs: Vec<Option<u32>>,
    pub buf: DeviceBuf<f32>,
    pub rows: usize,
    pub cols: usize,
    /// (slot, input position) that reads this output's value once claimed.
    pub feeds: Option<(usize, usize)>,
}

#[derive(Default)]
pub(super) struct AheadSet {
    slots: Vec<Option<Ahead>>,
}

impl AheadSet {
    /// Add an output; returns its slot.
    pub fn add(&mut self, a: Ahead) -> usize {
        self.slots.push(Some(a));
        self.slots.len() - 1
    }

    /// The output for the op `key` reading `inputs`, if one was computed
    /// ahead; `bind` then gets the value it becomes (see [`AheadSet::bind`]).
    pub fn claim(&mut self, key: OpKey, inputs: &[u32]) -> Option<Ahead> {
        let hit = |a: &Ahead| a.key == key && a.inputs.len() == inputs.len() && a.inputs.iter().zip(inputs).all(|(x, y)| *x == Some(*y));
        let s = self.slots.iter_mut().find(|s| s.as_ref().is_some_and(hit))?;
        s.take()
    }

    /// The input that `feeds` (from a claimed output) names is value `v`.
    pub fn bind(&mut self, feeds: Option<(usize, usize)>, v: u32) {
        let Some((slot, at)) = feeds else { return };
        if let Some(Some(a)) = self.slots.get_mut(slot) {
            if let Some(x) = a.inputs.get_mut(at) {
                *x = Some(v);
            }
        }
    }

    /// Every unclaimed buffer (the step's end).
    pub fn drain(&mut self) -> impl Iterator<Item = DeviceBuf<f32>> + '_ {
        self.slots.drain(..).flatten().map(|a| a.buf)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use pulsar_plugin_api::graph::{Act, Experts, Rope, RopeMode};
    use pulsar_plugin_api::{Graph, Val, Wt};

    use super::*;

    /// Weights (ggml order): 0 embedding (16 wide, 32 tokens), 1 wq (2 heads
    /// of 8), 2 wk and 3 wv (1 head), 4/5 q/k norms, 6 router, 7-9 experts.
    fn weights() -> Vec<Vec<u64>> {
        vec![vec![16, 32], vec![16, 16], vec![16, 8], vec![16, 8], vec![8], vec![8], vec![16, 4], vec![16, 6, 4], vec![16, 6, 4], vec![6, 16, 4]]
    }

    const ROPE: Rope = Rope { n_rot: 8, base: 10000.0, linear_factor: 1.0, mode: RopeMode::Neox, yarn: None };

    /// The plan of the graph `body` writes on top of the embedded tokens
    /// (its result is the output).
    pub(in crate::cuda) fn plan_of(body: impl Fn(&mut Graph<'_>, Val) -> Val) -> StepPlan {
        StepPlan::for_test(&weights(), body)
    }

    /// The fusions of [`plan_of`]'s graph, with the CUDA step's 2-D ops as the face.
    fn fusions(body: impl Fn(&mut Graph<'_>, Val) -> Val) -> (StepPlan, Vec<Option<Fuse>>) {
        let plan = plan_of(body);
        let runs: Vec<Runs> = plan
            .ops
            .iter()
            .map(|o| match o {
                Op::Linear(_) | Op::RmsNorm { .. } | Op::Rope(_) | Op::Binary(Binary::Add) => Runs::Face,
                Op::Experts(_) => Runs::Moe,
                _ => Runs::Other,
            })
            .collect();
        let f = find(&plan, &runs);
        (plan, f)
    }

    /// q, k, v of one input, split into heads.
    fn qkv(g: &mut Graph<'_>, x: Val) -> (Val, Val, Val) {
        let q = g.linear(Wt(1), x).unwrap();
        let k = g.linear(Wt(2), x).unwrap();
        let v = g.linear(Wt(3), x).unwrap();
        (g.split_heads(q, 2, 8).unwrap(), g.split_heads(k, 1, 8).unwrap(), v)
    }

    fn node_of(plan: &StepPlan, f: impl Fn(&Op) -> bool) -> Vec<usize> {
        (0..plan.len()).filter(|&i| f(&plan.ops[i])).collect()
    }

    #[test]
    fn finds_the_qwen3_attention_pattern() {
        let (plan, f) = fusions(|g, x| {
            let (q, k, _) = qkv(g, x);
            let qn = g.rms_norm(q, Some(Wt(4)), 1e-6).unwrap();
            let kn = g.rms_norm(k, Some(Wt(5)), 1e-6).unwrap();
            let qr = g.rope(qn, ROPE).unwrap();
            let kr = g.rope(kn, ROPE).unwrap();
            let a = g.reshape(qr, &[pulsar_plugin_api::Dim::T, pulsar_plugin_api::Dim::N(16)]).unwrap();
            let b = g.reshape(kr, &[pulsar_plugin_api::Dim::T, pulsar_plugin_api::Dim::N(8)]).unwrap();
            let c = g.linear(Wt(3), a).unwrap();
            g.add(c, b).unwrap()
        });
        let norms = node_of(&plan, |o| matches!(o, Op::RmsNorm { .. }));
        let ropes = node_of(&plan, |o| matches!(o, Op::Rope(_)));
        let k_in = plan.inputs[norms[1]][0];
        assert_eq!(f[norms[0]], Some(Fuse::NormRope { k_in, k_norm: norms[1], q_rope: ropes[0] }));
        assert_eq!(f[norms[1]], None);
        let lin = node_of(&plan, |o| matches!(o, Op::Linear(_)));
        assert_eq!(f[lin[0]], Some(Fuse::Linears(vec![lin[1], lin[2]])));
        assert_eq!(group_weights(&plan, &[lin[1], lin[2]]), vec![Wt(2), Wt(3)]);
        // The later linear on another input groups with nothing.
        assert_eq!(f[lin[3]], None);
    }

    #[test]
    fn refuses_near_misses_of_norm_and_rope() {
        // k's projection made after q's norm: its input does not exist yet.
        let (plan, f) = fusions(|g, x| {
            let q = g.linear(Wt(1), x).unwrap();
            let q = g.split_heads(q, 2, 8).unwrap();
            let qn = g.rms_norm(q, Some(Wt(4)), 1e-6).unwrap();
            let k = g.linear(Wt(2), x).unwrap();
            let k = g.split_heads(k, 1, 8).unwrap();
            let kn = g.rms_norm(k, Some(Wt(5)), 1e-6).unwrap();
            let qr = g.rope(qn, ROPE).unwrap();
            let kr = g.rope(kn, ROPE).unwrap();
            let qr = g.reshape(qr, &[pulsar_plugin_api::Dim::T, pulsar_plugin_api::Dim::N(16)]).unwrap();
            let kr = g.reshape(kr, &[pulsar_plugin_api::Dim::T, pulsar_plugin_api::Dim::N(8)]).unwrap();
            let y = g.linear(Wt(3), qr).unwrap();
            g.add(y, kr).unwrap()
        });
        assert!(f.iter().flatten().all(|x| !matches!(x, Fuse::NormRope { .. })), "{f:?}");
        // Two linears on x, not adjacent: still one group.
        let lin = node_of(&plan, |o| matches!(o, Op::Linear(_)));
        assert_eq!(f[lin[0]], Some(Fuse::Linears(vec![lin[1]])));
        // Different ropes, or a norm with no rope after it: nothing.
        for case in 0..2 {
            let (_, f) = fusions(|g, x| {
                let (q, k, _) = qkv(g, x);
                let qn = g.rms_norm(q, Some(Wt(4)), 1e-6).unwrap();
                let kn = g.rms_norm(k, Some(Wt(5)), 1e-6).unwrap();
                let qr = g.rope(qn, ROPE).unwrap();
                let kr = if case == 0 { g.rope(kn, Rope { n_rot: 4, ..ROPE }).unwrap() } else { kn };
                let qr = g.reshape(qr, &[pulsar_plugin_api::Dim::T, pulsar_plugin_api::Dim::N(16)]).unwrap();
                let kr = g.reshape(kr, &[pulsar_plugin_api::Dim::T, pulsar_plugin_api::Dim::N(8)]).unwrap();
                let y = g.linear(Wt(3), qr).unwrap();
                g.add(y, kr).unwrap()
            });
            assert!(f.iter().flatten().all(|x| !matches!(x, Fuse::NormRope { .. })), "case {case}: {f:?}");
        }
    }

    pub(in crate::cuda) fn moe(g: &mut Graph<'_>, x: Val) -> Val {
        let l = g.linear(Wt(6), x).unwrap();
        let p = g.softmax(l, -1).unwrap();
        let sel = g.top_k(p, 2).unwrap();
        let w = g.take_along(p, sel).unwrap();
        g.experts(x, sel, w, Experts { layer: 0, gate: Wt(7), up: Wt(8), down: Wt(9), act: Act::Silu }).unwrap()
    }

    #[test]
    fn finds_the_residual_add_after_a_moe_op() {
        for first in [true, false] {
            let (plan, f) = fusions(|g, x| {
                let h = g.rms_norm(x, None, 1e-6).unwrap();
                let y = moe(g, h);
                if first {
                    g.add(x, y).unwrap()
                } else {
                    g.add(y, x).unwrap()
                }
            });
            let m = node_of(&plan, |o| matches!(o, Op::Experts(_)))[0];
            let x = node_of(&plan, |o| matches!(o, Op::Embed { .. }))[0] as u32;
            assert_eq!(f[m], Some(Fuse::CombineAdd { other: x, other_first: first }));
        }
        // Added to a value made after it (a shared expert), or to itself: no fusion.
        for case in 0..2 {
            let (plan, f) = fusions(|g, x| {
                let y = moe(g, x);
                let s = if case == 0 { g.linear(Wt(1), x).unwrap() } else { y };
                let s = if case == 0 { g.reshape(s, &[pulsar_plugin_api::Dim::T, pulsar_plugin_api::Dim::N(16)]).unwrap() } else { s };
                g.add(y, s).unwrap()
            });
            let m = node_of(&plan, |o| matches!(o, Op::Experts(_)))[0];
            assert_eq!(f[m], None, "case {case}");
        }
    }
}
