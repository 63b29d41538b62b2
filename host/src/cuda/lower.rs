//! Lowering a step graph onto the CUDA step's ops.
//!
//! The CUDA step executes the common ops as 2-D `[rows, cols]` values with
//! fused kernels (router + top-k + experts in one op, norms, ropes,
//! attention over its cache). The graph's N-D values map onto them: a
//! reshape that keeps the first axis is the same buffer; per-head norms and
//! ropes take the head size from the value's last dim; the routing in front
//! of an `experts` op runs inside the fused MoE op ([`crate::graph::moe`]).
//! Every other op runs as a primitive ([`super::prim`]) on its N-D dims,
//! resolved for the step; an `experts` op whose routing has another form
//! runs the same expert path on the ids and weights the graph computed. Ops
//! this backend has no kernel for are refused when the engine is created,
//! naming the op, before any step runs.

use pulsar_plugin_api::graph::{Act, Binary, Dim, Experts, Op, RopeMode, Sizes};
use pulsar_plugin_api::{Val, Wt};

use super::fuse::{Fuse, Runs};
use crate::graph::{MoeSpec, StepPlan};

pub(super) type R<T> = Result<T, String>;

/// Rotary embedding on `[n_tok, n_head * head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeSpec {
    pub head_dim: u32,
    pub n_rot: u32,
    pub base: f32,
    pub linear_factor: f32,
    pub mode: RopeMode,
}

/// Attention over a KV state (`layer` is the state's index). q is
/// `[n_tok, n_head*head_dim_k]`, k `[n_tok, n_kv_head*head_dim_k]`, v
/// `[n_tok, n_kv_head*head_dim_v]`; k and v are appended first. Causal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnSpec {
    pub layer: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim_k: u32,
    pub head_dim_v: u32,
    pub scale: f32,
    pub window: u32,
    pub softcap: f32,
}

/// The second half of a norm + rope fusion ([`Fuse::NormRope`]): k's norm
/// (input, weight, eps) and the rope both ropes apply.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormRopeK {
    pub x: Val,
    pub w: Option<Wt>,
    pub eps: f32,
    pub rope: RopeSpec,
}

/// The ops of the CUDA step, on its 2-D values. The fused launches the
/// graph allows ([`super::fuse`]) come as hints: an op may compute later
/// ops' outputs with its own, which those ops then claim.
pub(super) trait Exec {
    fn embed(&mut self, table: Wt, scale: f32) -> R<Val>;
    /// `with`: later linear ops on the same input (one grouped launch may run them).
    fn linear(&mut self, w: Wt, x: Val, with: &[Wt]) -> R<Val>;
    /// RMS norm over groups of `group` columns, times the weight if given;
    /// `k`: also k's norm and both ropes.
    fn rms_norm(&mut self, x: Val, w: Option<Wt>, eps: f32, group: u32, k: Option<NormRopeK>) -> R<Val>;
    fn add(&mut self, a: Val, b: Val) -> R<Val>;
    fn mul(&mut self, a: Val, b: Val) -> R<Val>;
    fn scale(&mut self, x: Val, s: f32) -> R<Val>;
    fn glu(&mut self, gate: Val, up: Val, act: Act) -> R<Val>;
    /// Any other op, on N-D values (`ins` with dims `in_dims`, giving `want`).
    fn prim(&mut self, op: &Op, ins: &[Val], in_dims: &[Vec<usize>], want: &[usize]) -> R<Val>;
    /// The selected experts for ids and weights the graph computed. `add`:
    /// a value a later add sums with the output (and whether it comes first).
    fn experts(&mut self, x: Val, ids: Val, weights: Val, e: &Experts, top_k: u32, add: Option<(Val, bool)>) -> R<Val>;
    /// What the shape symbols stand for in this step.
    fn sizes(&self) -> Sizes;
    fn rope(&mut self, x: Val, spec: RopeSpec) -> R<Val>;
    fn attention(&mut self, q: Val, k: Val, v: Val, spec: AttnSpec) -> R<Val>;
    fn moe(&mut self, x: Val, spec: MoeSpec, add: Option<(Val, bool)>) -> R<Val>;
    fn output_rows(&mut self, x: Val) -> R<Val>;
    /// Nothing reads `v` after this: its buffer may go back to the pools.
    fn release(&mut self, v: Val);
}

/// Per node, the values whose last read it is ([`Lowering::frees`]). An
/// alias is its input's buffer, so a value lives to the last read of any
/// alias of it; the routing folded into a fused MoE op reads its inputs at
/// that op; the output lives to the step's end.
fn frees(plan: &StepPlan, nodes: &[Lowered]) -> Vec<Vec<u32>> {
    let n = plan.len();
    let mut root: Vec<usize> = (0..n).collect();
    for i in 0..n {
        if nodes[i] == Lowered::Alias {
            root[i] = root[plan.inputs[i][0] as usize];
        }
    }
    let mut at: Vec<usize> = (0..n).collect();
    for m in &plan.moe {
        for &r in &m.routing {
            at[r] = m.experts;
        }
    }
    let mut last: Vec<Option<usize>> = vec![None; n];
    for i in 0..n {
        if nodes[i] == Lowered::Alias {
            continue;
        }
        for &v in &plan.inputs[i] {
            let r = root[v as usize];
            last[r] = Some(last[r].map_or(at[i], |l| l.max(at[i])));
        }
    }
    let mut frees = vec![Vec::new(); n];
    let keep = root[plan.output as usize];
    for r in 0..n {
        if root[r] != r || r == keep || matches!(nodes[r], Lowered::Folded | Lowered::Tokens) {
            continue;
        }
        // A value nothing reads goes back once made.
        frees[last[r].unwrap_or(r)].push(r as u32);
    }
    frees
}

/// How one node runs on the CUDA step.
#[derive(Clone, Debug, PartialEq)]
enum Lowered {
    /// A source the fused ops read directly (the step's tokens).
    Tokens,
    /// The same buffer as its input.
    Alias,
    /// Folded into the fused MoE op at a later node.
    Folded,
    /// One CUDA op of the 2-D face.
    Run,
    /// A primitive on N-D values.
    Prim,
    /// The fused MoE op with this routing.
    Moe(MoeSpec),
    /// The experts on routing the graph computed.
    Experts,
}

/// What each node of a plan lowers to, or the first node the CUDA step
/// cannot run.
pub(super) struct Lowering {
    nodes: Vec<Lowered>,
    /// The fused launch at each node, if any.
    fuse: Vec<Option<Fuse>>,
    /// Per node: the values (by the node that made them) whose last reader
    /// it is, given back to the step's pools right after it.
    frees: Vec<Vec<u32>>,
    /// No value's size depends on the cache length, so a decode step may be
    /// captured once and replayed as a CUDA graph.
    pub capturable: bool,
}

impl Lowering {
    pub fn new(plan: &StepPlan) -> R<Lowering> {
        let mut nodes = vec![Lowered::Run; plan.len()];
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); plan.len()];
        for (i, ins) in plan.inputs.iter().enumerate() {
            for &v in ins {
                readers[v as usize].push(i);
            }
        }
        for m in &plan.moe {
            for &r in &m.routing {
                nodes[r] = Lowered::Folded;
            }
            nodes[m.experts] = Lowered::Moe(m.spec);
        }
        for i in 0..plan.len() {
            if nodes[i] != Lowered::Run {
                continue;
            }
            let ins = &plan.inputs[i];
            let shape_in = |k: usize| &plan.shapes[ins[k] as usize];
            let refuse = |why: &str| {
                let (label, layer) = &plan.labels[i];
                let at = if *layer >= 0 { format!(" at layer {layer}") } else { String::new() };
                let label = if label.is_empty() { String::new() } else { format!(" {label:?}") };
                Err(format!("node {i} ({}{at}{label}): {why} on the CUDA backend yet (run with --device cpu)", plan.ops[i].name()))
            };
            nodes[i] = match &plan.ops[i] {
                // The embedding reads the step's tokens itself; another reader gets them as a value.
                Op::Tokens if readers[i].iter().all(|&r| matches!(plan.ops[r], Op::Embed { .. })) => Lowered::Tokens,
                Op::Embed { .. } if matches!(plan.ops[ins[0] as usize], Op::Tokens) => Lowered::Run,
                Op::Embed { .. } => return refuse("embedding rows by computed ids has no kernel"),
                Op::Reshape(_) if plan.shapes[i].dims.first() == shape_in(0).dims.first() => Lowered::Alias,
                Op::Linear(_) | Op::OutputRows | Op::Glu(_) | Op::Scale(_) | Op::RmsNorm { .. } | Op::Attention(_) => Lowered::Run,
                Op::Rope(r) if r.yarn.is_none() => Lowered::Run,
                Op::Binary(Binary::Add | Binary::Mul) if shape_in(0) == shape_in(1) => Lowered::Run,
                Op::Experts(_) => Lowered::Experts,
                Op::Weight(_) | Op::StateRows { .. } | Op::Scan { .. } | Op::ShortConv { .. } | Op::DeltaNet { .. } => Lowered::Prim,
                op if super::prim::runs(op) => Lowered::Prim,
                _ => return refuse("this op has no kernel"),
            };
        }
        // A folded or tokens value read by a node that runs is a fused op's
        // input that nothing produced.
        for i in 0..plan.len() {
            if matches!(nodes[i], Lowered::Run | Lowered::Alias | Lowered::Prim | Lowered::Experts) {
                for &v in &plan.inputs[i] {
                    if matches!(nodes[v as usize], Lowered::Folded) || (nodes[v as usize] == Lowered::Tokens && !matches!(plan.ops[i], Op::Embed { .. })) {
                        return Err(format!("node {i} ({}): reads node {v}, which only a fused op can read, on the CUDA backend", plan.ops[i].name()));
                    }
                }
            }
        }
        let capturable = plan.shapes.iter().all(|s| !s.dims.contains(&Dim::C));
        let runs: Vec<Runs> = nodes
            .iter()
            .map(|n| match n {
                Lowered::Run => Runs::Face,
                Lowered::Moe(_) | Lowered::Experts => Runs::Moe,
                _ => Runs::Other,
            })
            .collect();
        let fuse = super::fuse::find(plan, &runs);
        let frees = frees(plan, &nodes);
        Ok(Lowering { nodes, fuse, frees, capturable })
    }

    /// How many of each fused launch the graph allows: (norm + rope,
    /// combine + add, linear groups).
    pub fn fusions(&self) -> (usize, usize, usize) {
        let count = |f: fn(&Fuse) -> bool| self.fuse.iter().flatten().filter(|x| f(x)).count();
        (count(|f| matches!(f, Fuse::NormRope { .. })), count(|f| matches!(f, Fuse::CombineAdd { .. })), count(|f| matches!(f, Fuse::Linears(_))))
    }

    /// Run `plan` on `exec`; returns the output's CUDA value.
    pub fn run(&self, plan: &StepPlan, exec: &mut dyn Exec) -> R<Val> {
        let mut vals: Vec<Option<Val>> = vec![None; plan.len()];
        let sizes = exec.sizes();
        for i in 0..plan.len() {
            let ins = &plan.inputs[i];
            let get = |k: usize| -> R<Val> { vals[ins[k] as usize].ok_or_else(|| format!("node {i}: input {k} has no CUDA value")) };
            let shape = &plan.shapes[i];
            let last = |s: &pulsar_plugin_api::graph::Shape| s.last().unwrap_or(0) as u32;
            let rope_spec = |r: &pulsar_plugin_api::graph::Rope, shape: &pulsar_plugin_api::graph::Shape| RopeSpec {
                head_dim: last(shape),
                n_rot: r.n_rot,
                base: r.base,
                linear_factor: r.linear_factor,
                mode: r.mode,
            };
            // A fused launch's other operand, when it has a value here.
            let add = match &self.fuse[i] {
                Some(Fuse::CombineAdd { other, other_first }) => vals[*other as usize].map(|v| (v, *other_first)),
                _ => None,
            };
            let v = match (&self.nodes[i], &plan.ops[i]) {
                (Lowered::Tokens | Lowered::Folded, _) => None,
                (Lowered::Alias, _) => Some(get(0)?),
                (Lowered::Moe(spec), _) => Some(exec.moe(get(0)?, *spec, add)?),
                (Lowered::Experts, Op::Experts(e)) => {
                    let k = plan.shapes[ins[1] as usize].last().unwrap_or(0) as u32;
                    Some(exec.experts(get(0)?, get(1)?, get(2)?, e, k, add)?)
                }
                (Lowered::Experts, _) => unreachable!("only experts ops lower to the experts path"),
                (Lowered::Prim, op) => {
                    let vs = (0..ins.len()).map(get).collect::<R<Vec<Val>>>()?;
                    let dims: Vec<Vec<usize>> = ins.iter().map(|&v| plan.shapes[v as usize].at(&sizes)).collect();
                    Some(exec.prim(op, &vs, &dims, &shape.at(&sizes))?)
                }
                (Lowered::Run, op) => Some(match op {
                    Op::Embed { table, scale } => exec.embed(*table, *scale)?,
                    Op::Linear(w) => match &self.fuse[i] {
                        Some(Fuse::Linears(with)) => exec.linear(*w, get(0)?, &super::fuse::group_weights(plan, with))?,
                        _ => exec.linear(*w, get(0)?, &[])?,
                    },
                    Op::OutputRows => exec.output_rows(get(0)?)?,
                    Op::Glu(a) => exec.glu(get(0)?, get(1)?, *a)?,
                    Op::Scale(s) => exec.scale(get(0)?, *s)?,
                    Op::RmsNorm { weight, eps } => {
                        let k = match &self.fuse[i] {
                            Some(Fuse::NormRope { k_in, k_norm, q_rope }) => match (vals[*k_in as usize], &plan.ops[*k_norm], &plan.ops[*q_rope]) {
                                (Some(x), Op::RmsNorm { weight, eps }, Op::Rope(r)) => Some(NormRopeK { x, w: *weight, eps: *eps, rope: rope_spec(r, &plan.shapes[*q_rope]) }),
                                _ => None,
                            },
                            _ => None,
                        };
                        exec.rms_norm(get(0)?, *weight, *eps, last(shape), k)?
                    }
                    Op::Rope(r) => exec.rope(get(0)?, rope_spec(r, shape))?,
                    Op::Attention(a) => {
                        let (q, k, v) = (&plan.shapes[ins[0] as usize], &plan.shapes[ins[1] as usize], &plan.shapes[ins[2] as usize]);
                        let d = |s: &pulsar_plugin_api::graph::Shape, i: usize| s.dims[i].fixed().unwrap_or(0) as u32;
                        let spec = AttnSpec {
                            layer: a.state,
                            n_head: d(q, 1),
                            n_kv_head: d(k, 1),
                            head_dim_k: d(q, 2),
                            head_dim_v: d(v, 2),
                            scale: a.scale,
                            window: a.window,
                            softcap: a.softcap,
                        };
                        exec.attention(get(0)?, get(1)?, get(2)?, spec)?
                    }
                    Op::Binary(Binary::Add) => exec.add(get(0)?, get(1)?)?,
                    Op::Binary(Binary::Mul) => exec.mul(get(0)?, get(1)?)?,
                    other => return Err(format!("node {i} ({}) has no CUDA lowering", other.name())),
                }),
            };
            vals[i] = v;
            for &r in &self.frees[i] {
                if let Some(v) = vals[r as usize] {
                    exec.release(v);
                }
            }
        }
        vals[plan.output as usize].ok_or_else(|| "the output has no CUDA value".to_string())
    }
}

#[cfg(test)]
mod tests {
    use pulsar_plugin_api::{Dim, Wt};

    use super::super::fuse::tests::{moe, plan_of};
    use super::*;

    #[test]
    fn values_go_back_after_their_last_reader() {
        // embed x; h = norm(x); y = moe(h) (routing folded); q = linear(x);
        // r = reshape(q) (an alias); s = add(y, x); out = add(s, r).
        let plan = plan_of(|g, x| {
            let h = g.rms_norm(x, None, 1e-6).unwrap();
            let y = moe(g, h);
            let q = g.linear(Wt(1), x).unwrap();
            let r = g.reshape(q, &[Dim::T, Dim::N(16)]).unwrap();
            let s = g.add(y, x).unwrap();
            g.add(s, r).unwrap()
        });
        let l = Lowering::new(&plan).unwrap();
        let node = |f: &dyn Fn(&Op) -> bool| (0..plan.len()).filter(|&i| f(&plan.ops[i])).collect::<Vec<_>>();
        let x = node(&|o| matches!(o, Op::Embed { .. }))[0];
        let h = node(&|o| matches!(o, Op::RmsNorm { .. }))[0];
        let m = node(&|o| matches!(o, Op::Experts(_)))[0];
        let lin = node(&|o| matches!(o, Op::Linear(_)));
        let adds = node(&|o| matches!(o, Op::Binary(Binary::Add)));
        assert_eq!(plan.moe.len(), 1, "the routing is the fused form");
        let freed_at = |v: usize| (0..plan.len()).filter(|&i| l.frees[i].contains(&(v as u32))).collect::<Vec<_>>();
        // The routing's reads of h happen in the MoE op, not at the router node.
        assert_eq!(freed_at(h), vec![m]);
        assert_eq!(freed_at(x), vec![adds[0]]);
        // q lives through its alias to the last add; the output never goes back.
        let q = *lin.last().unwrap();
        assert_eq!(freed_at(q), vec![adds[1]]);
        assert!(freed_at(adds[1]).is_empty());
        assert_eq!(freed_at(m), vec![adds[0]]);
        // Every value is given back once at most, and never an alias or folded node.
        let all: Vec<u32> = l.frees.iter().flatten().copied().collect();
        let mut dedup = all.clone();
        dedup.sort_unstable();
        dedup.dedup();
        assert_eq!(all.len(), dedup.len());
        assert!(all.iter().all(|&v| matches!(l.nodes[v as usize], Lowered::Run | Lowered::Prim | Lowered::Moe(_) | Lowered::Experts)));
    }
}
